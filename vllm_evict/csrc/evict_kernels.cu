// CUDA kernels of vllm-evict: in-place paged compaction and the observation-window attention mass.
// No torch header here on purpose: this file compiles with plain nvcc (see tests/kernels).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "evict_kernels.h"

namespace vllm_evict {
namespace {

constexpr int kCompactThreads = 256;
constexpr int kCompactPerThread = 8;
constexpr int kCompactTile = kCompactThreads * kCompactPerThread;  // elements per tile
constexpr int kWindowThreads = 256;
constexpr int kWarps = kWindowThreads / 32;
constexpr int kKeysPerLane = kWindowTile / 32;
constexpr int kLseThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

// One branch on a flag that is the same for every thread: cheaper than a conversion kernel per call.
__device__ __forceinline__ int64_t load_index(const Index& ix, int64_t offset) {
  return ix.wide ? static_cast<const int64_t*>(ix.data)[offset] : static_cast<const int32_t*>(ix.data)[offset];
}

// Element offset of logical slot `slot` of the row whose block-table row starts at `bt_row`.
__device__ __forceinline__ int64_t slot_offset(const Index& bt, int64_t bt_row, int64_t bt_s_p, int64_t slot,
                                               int64_t page_size, int64_t s_blk, int64_t s_tok) {
  return load_index(bt, bt_row + (slot / page_size) * bt_s_p) * s_blk + (slot % page_size) * s_tok;
}

// ---- compaction -----------------------------------------------------------------------------------
// One CTA per (row, head, column chunk). Tiles of slots are processed in ascending order; each tile is
// loaded completely into registers, then __syncthreads(), then stored. keep is ascending, so
// keep[j] >= j: a tile [t0, t1) reads only slots >= t0, never a slot an earlier tile wrote (< t0), and
// every earlier tile finished its loads before the barrier that precedes this tile's stores.
// Raw element copies (T is an unsigned integer of the element's size): bit-exact for any dtype.
template <typename T>
__global__ void compact_kernel(CompactArgs a, int64_t col_chunk) {
  const int64_t r = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int64_t c0 = static_cast<int64_t>(blockIdx.z) * col_chunk;
  const int64_t cols = a.d - c0 < col_chunk ? a.d - c0 : col_chunk;
  const int64_t count = load_index(a.counts, r * a.counts_s);
  const int64_t b = count < a.b_max ? count : a.b_max;  // columns past b_max do not exist
  const int64_t rows_per_tile = kCompactTile / cols > 0 ? kCompactTile / cols : 1;
  const int64_t bt_row = r * a.bt_s_r;
  const int64_t keep_row = r * a.keep_s_r + h * a.keep_s_h;
  T* base = static_cast<T*>(a.cache) + h * a.s_head;
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
        const int64_t src = load_index(a.keep, keep_row + j * a.keep_s_b);
        if (src != j) {
          const int64_t col = (c0 + e % cols) * a.s_dim;
          reg[k] = base[slot_offset(a.block_table, bt_row, a.bt_s_p, src, a.page_size, a.s_blk, a.s_tok) + col];
          dst[k] = slot_offset(a.block_table, bt_row, a.bt_s_p, j, a.page_size, a.s_blk, a.s_tok) + col;
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
cudaError_t compact_typed(const CompactArgs& a, cudaStream_t stream) {
  const int64_t col_chunk = a.d < kCompactTile ? a.d : kCompactTile;
  dim3 grid(static_cast<unsigned>(a.rows), static_cast<unsigned>(a.heads),
            static_cast<unsigned>((a.d + col_chunk - 1) / col_chunk));
  compact_kernel<T><<<grid, kCompactThreads, 0, stream>>>(a, col_chunk);
  return cudaGetLastError();
}

// ---- observation-window attention mass ---------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e5m2 x) { return static_cast<float>(x); }

// fp8 keys are stored divided by the layer's scale: only they are multiplied back (a.k_scale).
template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, __nv_fp8_e4m3> || std::is_same_v<T, __nv_fp8_e5m2>;

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ int64_t row_length(const WindowArgs& a, int64_t r) {
  const int64_t n = load_index(a.lengths, r * a.len_s);
  return n < a.width ? n : a.width;  // never address a slot outside [0, width)
}

__device__ __forceinline__ int64_t query_position(const WindowArgs& a, int64_t r, int64_t e) {
  return load_index(a.query_pos, r * a.qp_s_r + e * a.qp_s_w);
}

// Loads the tile's keys (fp32, padded rows: conflict-free column reads; fp8 keys times the scale) and
// their positions. Shared layout: keys [kWindowTile][d + 1], then the query rows [kWarps][d].
template <typename KT>
__device__ void load_key_tile(const WindowArgs& a, int64_t r, int64_t h, int64_t n0, int64_t length, float* ks,
                              int64_t* kpos) {
  const KT* k = static_cast<const KT*>(a.k);
  float k_scale = 1.f;
  if constexpr (kIsFp8<KT>) {
    if (a.k_scale != nullptr) k_scale = *a.k_scale;  // read on the device: no host sync
  }
  const int64_t bt_row = r * a.bt_s_r;
  const int64_t ld = a.d + 1;
  for (int64_t idx = threadIdx.x; idx < kWindowTile * a.d; idx += blockDim.x) {
    const int64_t key = idx / a.d;
    const int64_t dd = idx % a.d;
    const int64_t slot = n0 + key;
    float x = 0.f;
    if (slot < length) {
      x = to_float(k[slot_offset(a.block_table, bt_row, a.bt_s_p, slot, a.page_size, a.s_blk, a.s_tok) +
                     h * a.s_head + dd * a.s_dim]);
      if constexpr (kIsFp8<KT>) x *= k_scale;
    }
    ks[key * ld + dd] = x;
  }
  for (int64_t key = threadIdx.x; key < kWindowTile; key += blockDim.x) {
    const int64_t slot = n0 + key;
    int64_t p = INT64_MAX;  // padding: never visible
    if (slot < length) {
      p = a.pos[slot_offset(a.block_table, bt_row, a.bt_s_p, slot, a.page_size, a.p_blk, a.p_tok) + h * a.p_head];
    }
    kpos[key] = p;
  }
}

// The base-2 logits of window entry e of query head hq of row r against this lane's keys; -inf where
// not visible. The whole warp calls it for one entry.
template <typename QT>
__device__ void row_logits(const WindowArgs& a, int64_t r, int64_t e, int64_t hq, int64_t qpos, const float* ks,
                           const int64_t* kpos, float* qrow, float (&s)[kKeysPerLane]) {
  const QT* q = static_cast<const QT*>(a.q) + r * a.q_s_r + e * a.q_s_w + hq * a.q_s_h;
  const int lane = threadIdx.x & 31;
  for (int64_t dd = lane; dd < a.d; dd += 32) qrow[dd] = to_float(q[dd * a.q_s_d]);
  __syncwarp();
  const float coef = a.scale * kLog2e * (a.gain != nullptr ? a.gain[r * a.g_s_r + e * a.g_s_w] : 1.f);
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

// Scratch layout: part_m and part_l [R, W, H_q, n_tiles], then lse [R, W, H_q].
__host__ __device__ __forceinline__ int64_t n_tiles_of(const WindowArgs& a) {
  return (a.width + kWindowTile - 1) / kWindowTile;
}

template <typename KT, typename QT>
__global__ void window_partials_kernel(WindowArgs a, float* __restrict__ part_m, float* __restrict__ part_l) {
  extern __shared__ float smem[];
  __shared__ int64_t kpos[kWindowTile];
  const int64_t r = blockIdx.x, h = blockIdx.y, tile = blockIdx.z;
  const int64_t length = row_length(a, r);
  const int64_t n0 = tile * kWindowTile;
  if (n0 >= length) return;  // uniform over the CTA; the LSE kernel reads only the row's tiles
  float* ks = smem;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* qrow = smem + kWindowTile * (a.d + 1) + warp * a.d;
  load_key_tile<KT>(a, r, h, n0, length, ks, kpos);
  __syncthreads();
  const int64_t h_q = a.h_kv * a.group;
  const int64_t n_tiles = n_tiles_of(a);
  for (int64_t ri = warp; ri < a.group * a.w; ri += kWarps) {
    const int64_t hq = h * a.group + ri / a.w;
    const int64_t e = ri % a.w;
    const int64_t qpos = query_position(a, r, e);
    float m = -INFINITY, l = 0.f;
    if (qpos >= 0) {  // an empty entry sees nothing: skip its logits (uniform over the warp)
      float s[kKeysPerLane];
      row_logits<QT>(a, r, e, hq, qpos, ks, kpos, qrow, s);
#pragma unroll
      for (int j = 0; j < kKeysPerLane; ++j) m = fmaxf(m, s[j]);
      m = warp_max(m);
      if (m != -INFINITY) {
#pragma unroll
        for (int j = 0; j < kKeysPerLane; ++j) l += exp2f(s[j] - m);
      }
      l = warp_sum(l);
    }
    if (lane == 0) {
      const int64_t at = ((r * a.w + e) * h_q + hq) * n_tiles + tile;
      part_m[at] = m;
      part_l[at] = l;
    }
  }
}

// One thread per (row, window entry, query head): combines the row's tiles into a base-2 LSE.
__global__ void window_lse_kernel(WindowArgs a, const float* __restrict__ part_m, const float* __restrict__ part_l,
                                  float* __restrict__ lse) {
  const int64_t h_q = a.h_kv * a.group;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.rows * a.w * h_q) return;
  const int64_t r = idx / (a.w * h_q);
  const int64_t n_tiles = n_tiles_of(a);
  const int64_t tiles = (row_length(a, r) + kWindowTile - 1) / kWindowTile;  // the tiles pass 1 wrote
  const float* pm = part_m + idx * n_tiles;
  const float* pl = part_l + idx * n_tiles;
  float m = -INFINITY;
  for (int64_t t = 0; t < tiles; ++t) m = fmaxf(m, pm[t]);
  if (m == -INFINITY) {
    lse[idx] = -INFINITY;  // sees no key: contributes nothing
    return;
  }
  float l = 0.f;
  for (int64_t t = 0; t < tiles; ++t) l += pl[t] * exp2f(pm[t] - m);
  lse[idx] = m + log2f(l);
}

// Where pass 3 puts its sums: a dense out [R, H_kv, width] (every element written, 0 on padding), or,
// when `state` is set, added into a paged fp32 state [num_pages, H_kv, page_size] at the row's slots
// below its length (each slot has one writer: no atomics; padding is not touched).
struct WindowOut {
  float* out;
  int64_t out_s_r, out_s_h;
  float* state;
  int64_t st_blk, st_head, st_tok;
};

template <typename KT, typename QT>
__global__ void window_colsums_kernel(WindowArgs a, const float* __restrict__ lse, WindowOut o) {
  extern __shared__ float smem[];
  __shared__ int64_t kpos[kWindowTile];
  __shared__ float red[kWarps][kWindowTile];
  const int64_t r = blockIdx.x, h = blockIdx.y, tile = blockIdx.z;
  const int64_t length = row_length(a, r);
  const int64_t n0 = tile * kWindowTile;
  float* out_row = o.state != nullptr ? nullptr : o.out + r * o.out_s_r + h * o.out_s_h;
  if (n0 >= length) {  // a tile of padding: the zeros the result was not filled with
    if (out_row == nullptr) return;
    for (int64_t key = threadIdx.x; key < kWindowTile; key += blockDim.x) {
      if (n0 + key < a.width) out_row[n0 + key] = 0.f;
    }
    return;
  }
  float* ks = smem;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* qrow = smem + kWindowTile * (a.d + 1) + warp * a.d;
  load_key_tile<KT>(a, r, h, n0, length, ks, kpos);
  __syncthreads();
  const int64_t h_q = a.h_kv * a.group;
  float acc[kKeysPerLane];
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) acc[j] = 0.f;
  for (int64_t ri = warp; ri < a.group * a.w; ri += kWarps) {
    const int64_t hq = h * a.group + ri / a.w;
    const int64_t e = ri % a.w;
    const float row_lse = lse[(r * a.w + e) * h_q + hq];
    if (row_lse == -INFINITY) continue;  // empty entry or no visible key (uniform over the warp)
    float s[kKeysPerLane];
    row_logits<QT>(a, r, e, hq, query_position(a, r, e), ks, kpos, qrow, s);
#pragma unroll
    for (int j = 0; j < kKeysPerLane; ++j) acc[j] += s[j] == -INFINITY ? 0.f : exp2f(s[j] - row_lse);
  }
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) red[warp][lane + 32 * j] = acc[j];
  __syncthreads();
  for (int key = threadIdx.x; key < kWindowTile; key += blockDim.x) {
    float total = 0.f;
    for (int wi = 0; wi < kWarps; ++wi) total += red[wi][key];
    if (out_row != nullptr) {
      if (n0 + key < a.width) out_row[n0 + key] = total;  // 0 on padding slots (kpos: never visible)
    } else if (n0 + key < length) {
      o.state[slot_offset(a.block_table, r * a.bt_s_r, a.bt_s_p, n0 + key, a.page_size, o.st_blk, o.st_tok) +
              h * o.st_head] += total;
    }
  }
}

size_t window_smem(const WindowArgs& a) {
  return sizeof(float) * (kWindowTile * (a.d + 1) + kWarps * a.d);
}

template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t smem) {
  if (smem > 48 * 1024) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  }
  return cudaSuccess;
}

// KT: the keys' element type; QT: the queries' (the same unless the keys are fp8).
template <typename KT, typename QT>
cudaError_t window_mass_typed(const WindowArgs& a, float* scratch, const WindowOut& o, cudaStream_t stream) {
  const size_t smem = window_smem(a);
  cudaError_t err = allow_smem(window_partials_kernel<KT, QT>, smem);
  if (err == cudaSuccess) err = allow_smem(window_colsums_kernel<KT, QT>, smem);
  if (err != cudaSuccess) return err;
  const int64_t n_tiles = n_tiles_of(a);
  const int64_t entries = a.rows * a.w * a.h_kv * a.group;
  float* part_m = scratch;
  float* part_l = scratch + entries * n_tiles;
  float* lse = scratch + 2 * entries * n_tiles;
  const dim3 grid(static_cast<unsigned>(a.rows), static_cast<unsigned>(a.h_kv), static_cast<unsigned>(n_tiles));
  window_partials_kernel<KT, QT><<<grid, kWindowThreads, smem, stream>>>(a, part_m, part_l);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const unsigned lse_blocks = static_cast<unsigned>((entries + kLseThreads - 1) / kLseThreads);
  window_lse_kernel<<<lse_blocks, kLseThreads, 0, stream>>>(a, part_m, part_l, lse);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  window_colsums_kernel<KT, QT><<<grid, kWindowThreads, smem, stream>>>(a, lse, o);
  return cudaGetLastError();
}

}  // namespace

int launch_compact(const CompactArgs& a, void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  if (a.rows == 0 || a.heads == 0 || a.b_max == 0 || a.d == 0) return static_cast<int>(cudaSuccess);
  switch (a.elem_size) {
    case 1: return compact_typed<uint8_t>(a, st);
    case 2: return compact_typed<uint16_t>(a, st);
    case 4: return compact_typed<uint32_t>(a, st);
    case 8: return compact_typed<uint64_t>(a, st);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

int64_t window_scratch_floats(const WindowArgs& a) {
  return a.rows * a.w * a.h_kv * a.group * (2 * n_tiles_of(a) + 1);
}

namespace {
// fp8 keys with fp16/bf16 queries.
template <typename KT>
int window_mass_fp8(const WindowArgs& a, float* scratch, const WindowOut& o, cudaStream_t st) {
  switch (a.q_kind) {
    case kFloat16: return window_mass_typed<KT, __half>(a, scratch, o, st);
    case kBFloat16: return window_mass_typed<KT, __nv_bfloat16>(a, scratch, o, st);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

int window_mass_any(const WindowArgs& a, float* scratch, const WindowOut& o, void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  const bool same = a.q_kind == a.kind;
  switch (a.kind) {
    case kFloat32: return same ? window_mass_typed<float, float>(a, scratch, o, st) : cudaErrorInvalidValue;
    case kFloat16: return same ? window_mass_typed<__half, __half>(a, scratch, o, st) : cudaErrorInvalidValue;
    case kBFloat16:
      return same ? window_mass_typed<__nv_bfloat16, __nv_bfloat16>(a, scratch, o, st) : cudaErrorInvalidValue;
    case kFloat8E4M3: return window_mass_fp8<__nv_fp8_e4m3>(a, scratch, o, st);
    case kFloat8E5M2: return window_mass_fp8<__nv_fp8_e5m2>(a, scratch, o, st);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}
}  // namespace

int launch_window_mass(const WindowArgs& a, float* scratch, float* out, int64_t out_s_r, int64_t out_s_h,
                       void* stream) {
  return window_mass_any(a, scratch, WindowOut{out, out_s_r, out_s_h, nullptr, 0, 0, 0}, stream);
}

int launch_window_mass_into(const WindowArgs& a, float* scratch, float* state, int64_t st_blk, int64_t st_head,
                            int64_t st_tok, void* stream) {
  return window_mass_any(a, scratch, WindowOut{nullptr, 0, 0, state, st_blk, st_head, st_tok}, stream);
}

}  // namespace vllm_evict
