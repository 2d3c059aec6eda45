// CUDA kernels of vllm-evict: in-place paged compaction and the observation-window attention mass.
// No torch header here on purpose: this file compiles with plain nvcc (see tests/kernels).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "evict_kernels.h"

namespace vllm_evict {
namespace {

constexpr int kCompactThreads = 256;
constexpr int kCompactPerThread = 8;
constexpr int kCompactTile = kCompactThreads * kCompactPerThread;  // elements per tile
constexpr int kWindowThreads = 256;
constexpr int kWarps = kWindowThreads / 32;
constexpr int kKeysPerLane = kWindowTile / 32;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ int64_t slot_offset(const int64_t* bt_row, int64_t slot, int64_t block_size,
                                               int64_t s_blk, int64_t s_tok) {
  return bt_row[slot / block_size] * s_blk + (slot % block_size) * s_tok;
}

// ---- compaction -----------------------------------------------------------------------------------
// One CTA per (request, head, column chunk). Tiles of rows are processed in ascending order; each
// tile is loaded completely into registers, then __syncthreads(), then stored. keep is ascending, so
// keep[j] >= j: a tile [t0, t1) reads only slots >= t0, never a slot an earlier tile wrote (< t0),
// and every earlier tile finished its loads before the barrier that precedes this tile's stores.
// Raw element copies (T is an unsigned integer of the element's size): bit-exact for any dtype.
template <typename T>
__global__ void compact_kernel(T* __restrict__ cache, const int64_t* __restrict__ block_table, int64_t bt_stride,
                               const int64_t* __restrict__ keep, int64_t keep_s_r, int64_t keep_s_h,
                               const int64_t* __restrict__ counts, int64_t block_size, int64_t s_blk,
                               int64_t s_head, int64_t s_tok, int64_t s_dim, int64_t d, int64_t col_chunk) {
  const int64_t r = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int64_t c0 = static_cast<int64_t>(blockIdx.z) * col_chunk;
  const int64_t cols = d - c0 < col_chunk ? d - c0 : col_chunk;
  const int64_t b = counts[r];
  const int64_t rows_per_tile = kCompactTile / cols > 0 ? kCompactTile / cols : 1;
  const int64_t* bt_row = block_table + r * bt_stride;
  const int64_t* keep_row = keep + r * keep_s_r + h * keep_s_h;
  T* base = cache + h * s_head;
  T reg[kCompactPerThread];
  int64_t dst[kCompactPerThread];
  for (int64_t t0 = 0; t0 < b; t0 += rows_per_tile) {
#pragma unroll
    for (int k = 0; k < kCompactPerThread; ++k) {
      const int64_t e = threadIdx.x + static_cast<int64_t>(k) * kCompactThreads;
      const int64_t row = e / cols;
      const int64_t j = t0 + row;
      dst[k] = -1;
      if (row < rows_per_tile && j < b) {
        const int64_t src = keep_row[j];
        if (src != j) {
          const int64_t col = (c0 + e % cols) * s_dim;
          reg[k] = base[slot_offset(bt_row, src, block_size, s_blk, s_tok) + col];
          dst[k] = slot_offset(bt_row, j, block_size, s_blk, s_tok) + col;
        }
      }
    }
    __syncthreads();  // the whole tile is read before any of it is written
#pragma unroll
    for (int k = 0; k < kCompactPerThread; ++k) {
      if (dst[k] >= 0) base[dst[k]] = reg[k];
    }
  }
}

template <typename T>
cudaError_t compact_typed(void* cache, const int64_t* bt, int64_t bt_stride, const int64_t* keep, int64_t keep_s_r,
                          int64_t keep_s_h, const int64_t* counts, int64_t n_req, int64_t n_heads, int64_t block_size,
                          int64_t s_blk, int64_t s_head, int64_t s_tok, int64_t s_dim, int64_t d, cudaStream_t stream) {
  const int64_t col_chunk = d < kCompactTile ? d : kCompactTile;
  dim3 grid(static_cast<unsigned>(n_req), static_cast<unsigned>(n_heads),
            static_cast<unsigned>((d + col_chunk - 1) / col_chunk));
  compact_kernel<T><<<grid, kCompactThreads, 0, stream>>>(static_cast<T*>(cache), bt, bt_stride, keep, keep_s_r,
                                                          keep_s_h, counts, block_size, s_blk, s_head, s_tok,
                                                          s_dim, d, col_chunk);
  return cudaGetLastError();
}

// ---- observation-window attention mass ---------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Loads the tile's keys (fp32, padded rows: conflict-free column reads) and their positions.
// Shared layout: keys [kWindowTile][d + 1], then the query rows [kWarps][d].
template <typename T>
__device__ void load_key_tile(const WindowArgs& a, int64_t r, int64_t h, int64_t n0, int64_t length, float* ks,
                              int64_t* kpos) {
  const T* k = static_cast<const T*>(a.k);
  const int64_t* bt_row = a.block_table + r * a.bt_stride;
  const int64_t ld = a.d + 1;
  for (int64_t idx = threadIdx.x; idx < kWindowTile * a.d; idx += blockDim.x) {
    const int64_t key = idx / a.d;
    const int64_t dd = idx % a.d;
    const int64_t slot = n0 + key;
    float x = 0.f;
    if (slot < length) {
      x = to_float(k[slot_offset(bt_row, slot, a.block_size, a.s_blk, a.s_tok) + h * a.s_head + dd * a.s_dim]);
    }
    ks[key * ld + dd] = x;
  }
  for (int64_t key = threadIdx.x; key < kWindowTile; key += blockDim.x) {
    const int64_t slot = n0 + key;
    int64_t p = slot;
    if (a.pos != nullptr && slot < length) {
      p = a.pos[slot_offset(bt_row, slot, a.block_size, a.p_blk, a.p_tok) + h * a.p_head];
    }
    kpos[key] = slot < length ? p : INT64_MAX;  // never visible
  }
}

// The base-2 logits of one window row against this lane's keys; -inf where not visible.
template <typename T>
__device__ void row_logits(const WindowArgs& a, int64_t tok, int64_t hq, const float* ks, const int64_t* kpos,
                           float* qrow, float (&s)[kKeysPerLane]) {
  const T* q = static_cast<const T*>(a.q);
  const int lane = threadIdx.x & 31;
  for (int64_t dd = lane; dd < a.d; dd += 32) qrow[dd] = to_float(q[tok * a.q_s_t + hq * a.q_s_h + dd * a.q_s_d]);
  __syncwarp();
  const float coef = a.scale * kLog2e * (a.gain != nullptr ? a.gain[tok] : 1.f);
  const int64_t qpos = a.query_pos[tok];
  const int64_t ld = a.d + 1;
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) {
    const int key = lane + 32 * j;
    float acc = 0.f;
    for (int64_t dd = 0; dd < a.d; ++dd) acc = fmaf(qrow[dd], ks[key * ld + dd], acc);
    s[j] = kpos[key] <= qpos ? acc * coef : -INFINITY;
  }
  __syncwarp();
}

template <typename T>
__global__ void window_partials_kernel(WindowArgs a, float* __restrict__ part_m, float* __restrict__ part_l,
                                       int64_t n_tiles) {
  extern __shared__ float smem[];
  __shared__ int64_t kpos[kWindowTile];
  const int64_t r = blockIdx.x, h = blockIdx.y, tile = blockIdx.z;
  const int64_t length = a.lengths[r];
  const int64_t n0 = tile * kWindowTile;
  if (n0 >= length) return;  // uniform over the CTA; the combine step ignores untouched tiles
  float* ks = smem;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* qrow = smem + kWindowTile * (a.d + 1) + warp * a.d;
  load_key_tile<T>(a, r, h, n0, length, ks, kpos);
  __syncthreads();
  const int64_t q0 = a.query_start_loc[r];
  const int64_t w = a.query_start_loc[r + 1] - q0;
  for (int64_t ri = warp; ri < a.group * w; ri += kWarps) {
    const int64_t hq = h * a.group + ri / w;
    const int64_t tok = q0 + ri % w;
    float s[kKeysPerLane];
    row_logits<T>(a, tok, hq, ks, kpos, qrow, s);
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kKeysPerLane; ++j) m = fmaxf(m, s[j]);
    m = warp_max(m);
    float l = 0.f;
    if (m != -INFINITY) {
#pragma unroll
      for (int j = 0; j < kKeysPerLane; ++j) l += exp2f(s[j] - m);
    }
    l = warp_sum(l);
    if (lane == 0) {
      const int64_t at = (tok * a.h_kv * a.group + hq) * n_tiles + tile;
      part_m[at] = m;
      part_l[at] = l;
    }
  }
}

template <typename T>
__global__ void window_colsums_kernel(WindowArgs a, const float* __restrict__ lse, float* __restrict__ out,
                                      int64_t out_s_r, int64_t out_s_h) {
  extern __shared__ float smem[];
  __shared__ int64_t kpos[kWindowTile];
  __shared__ float red[kWarps][kWindowTile];
  const int64_t r = blockIdx.x, h = blockIdx.y, tile = blockIdx.z;
  const int64_t length = a.lengths[r];
  const int64_t n0 = tile * kWindowTile;
  if (n0 >= length) return;
  float* ks = smem;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* qrow = smem + kWindowTile * (a.d + 1) + warp * a.d;
  load_key_tile<T>(a, r, h, n0, length, ks, kpos);
  __syncthreads();
  const int64_t q0 = a.query_start_loc[r];
  const int64_t w = a.query_start_loc[r + 1] - q0;
  const int64_t h_q = a.h_kv * a.group;
  float acc[kKeysPerLane];
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) acc[j] = 0.f;
  for (int64_t ri = warp; ri < a.group * w; ri += kWarps) {
    const int64_t hq = h * a.group + ri / w;
    const int64_t tok = q0 + ri % w;
    const float row_lse = lse[tok * h_q + hq];
    float s[kKeysPerLane];
    row_logits<T>(a, tok, hq, ks, kpos, qrow, s);
    if (row_lse != -INFINITY) {
#pragma unroll
      for (int j = 0; j < kKeysPerLane; ++j) acc[j] += s[j] == -INFINITY ? 0.f : exp2f(s[j] - row_lse);
    }
  }
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) red[warp][lane + 32 * j] = acc[j];
  __syncthreads();
  for (int key = threadIdx.x; key < kWindowTile; key += blockDim.x) {
    float total = 0.f;
    for (int wi = 0; wi < kWarps; ++wi) total += red[wi][key];
    if (n0 + key < length) out[r * out_s_r + h * out_s_h + n0 + key] = total;
  }
}

size_t window_smem(const WindowArgs& a) {
  return sizeof(float) * (kWindowTile * (a.d + 1) + kWarps * a.d);
}

template <typename T, typename Kernel>
cudaError_t prepare(Kernel kernel, size_t smem) {
  if (smem > 48 * 1024) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  }
  return cudaSuccess;
}

template <typename T>
cudaError_t partials_typed(const WindowArgs& a, float* part_m, float* part_l, int64_t n_tiles, cudaStream_t stream) {
  const size_t smem = window_smem(a);
  cudaError_t err = prepare<T>(window_partials_kernel<T>, smem);
  if (err != cudaSuccess) return err;
  dim3 grid(static_cast<unsigned>(a.num_requests), static_cast<unsigned>(a.h_kv), static_cast<unsigned>(n_tiles));
  window_partials_kernel<T><<<grid, kWindowThreads, smem, stream>>>(a, part_m, part_l, n_tiles);
  return cudaGetLastError();
}

template <typename T>
cudaError_t colsums_typed(const WindowArgs& a, const float* lse, float* out, int64_t out_s_r, int64_t out_s_h,
                          cudaStream_t stream) {
  const size_t smem = window_smem(a);
  cudaError_t err = prepare<T>(window_colsums_kernel<T>, smem);
  if (err != cudaSuccess) return err;
  const int64_t n_tiles = (a.max_len + kWindowTile - 1) / kWindowTile;
  dim3 grid(static_cast<unsigned>(a.num_requests), static_cast<unsigned>(a.h_kv), static_cast<unsigned>(n_tiles));
  window_colsums_kernel<T><<<grid, kWindowThreads, smem, stream>>>(a, lse, out, out_s_r, out_s_h);
  return cudaGetLastError();
}

}  // namespace

int launch_compact(void* cache, int elem_size, const int64_t* block_table, int64_t bt_stride, const int64_t* keep,
                   int64_t keep_s_r, int64_t keep_s_h, const int64_t* counts, int64_t num_requests,
                   int64_t num_heads, int64_t block_size, int64_t s_blk, int64_t s_head, int64_t s_tok,
                   int64_t s_dim, int64_t d, void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  switch (elem_size) {
    case 1:
      return compact_typed<uint8_t>(cache, block_table, bt_stride, keep, keep_s_r, keep_s_h, counts, num_requests,
                                    num_heads, block_size, s_blk, s_head, s_tok, s_dim, d, st);
    case 2:
      return compact_typed<uint16_t>(cache, block_table, bt_stride, keep, keep_s_r, keep_s_h, counts, num_requests,
                                     num_heads, block_size, s_blk, s_head, s_tok, s_dim, d, st);
    case 4:
      return compact_typed<uint32_t>(cache, block_table, bt_stride, keep, keep_s_r, keep_s_h, counts, num_requests,
                                     num_heads, block_size, s_blk, s_head, s_tok, s_dim, d, st);
    case 8:
      return compact_typed<uint64_t>(cache, block_table, bt_stride, keep, keep_s_r, keep_s_h, counts, num_requests,
                                     num_heads, block_size, s_blk, s_head, s_tok, s_dim, d, st);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

int launch_window_partials(const WindowArgs& a, float* part_m, float* part_l, int64_t n_tiles, void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  switch (a.kind) {
    case kFloat32: return partials_typed<float>(a, part_m, part_l, n_tiles, st);
    case kFloat16: return partials_typed<__half>(a, part_m, part_l, n_tiles, st);
    case kBFloat16: return partials_typed<__nv_bfloat16>(a, part_m, part_l, n_tiles, st);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

int launch_window_colsums(const WindowArgs& a, const float* lse, float* out, int64_t out_s_r, int64_t out_s_h,
                          void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  switch (a.kind) {
    case kFloat32: return colsums_typed<float>(a, lse, out, out_s_r, out_s_h, st);
    case kFloat16: return colsums_typed<__half>(a, lse, out, out_s_r, out_s_h, st);
    case kBFloat16: return colsums_typed<__nv_bfloat16>(a, lse, out, out_s_r, out_s_h, st);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace vllm_evict
