// Launchers of the CUDA eviction kernels (evict_kernels.cu). Plain C++ types only: this header is
// shared by the kernel file, which includes no torch header, and by the torch binding (binding.cpp).
//
// Every tensor is passed as a pointer plus its strides, and index tensors (block tables, lengths,
// counts, keep lists, query positions) as they are stored, int32 or int64: the binding never
// converts or copies an argument, so a call costs its kernels and its output allocations.
#pragma once

#include <cstdint>

namespace vllm_evict {

// Element types of the window kernels' keys and queries (fp8: keys only, vLLM's fp8 KV cache).
enum ScalarKind : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat8E4M3 = 3, kFloat8E5M2 = 4 };

// An integer tensor read in place: int64 elements when `wide`, else int32.
struct Index {
  const void* data;
  bool wide;
};

// In-place per-head compaction of one paged view [num_pages, H, page_size, d] (a per-token buffer is
// a view with d = 1 and s_dim = 0): slot keep[r, h, j] moves to slot j for j < min(counts[r], b_max),
// keep strictly ascending over those columns; later columns are never read.
struct CompactArgs {
  void* cache;
  int elem_size;  // bytes per element: 1, 2, 4 or 8 (elements are copied as raw bits)
  int64_t s_blk, s_head, s_tok, s_dim, d, page_size;
  Index block_table;  // [R, pages]
  int64_t bt_s_r, bt_s_p;
  Index keep;  // [R, H, b_max]
  int64_t keep_s_r, keep_s_h, keep_s_b, b_max;
  Index counts;  // [R]
  int64_t counts_s;
  int64_t rows, heads;
};

// Returns a cudaError_t value (0 on success).
int launch_compact(const CompactArgs& a, void* stream);

// Observation-window attention mass of every row, summed over the GQA group: out [R, H_kv, width] fp32.
struct WindowArgs {
  const void* k;  // paged key view [num_pages, H_kv, page_size, d], element type `kind`
  int kind;       // ScalarKind of the keys
  int q_kind;     // ScalarKind of the queries: `kind`, or fp16/bf16 when the keys are fp8
  const float* k_scale;  // fp8 keys: device pointer to the layer's key scale (value = k * scale); nullptr: 1
  int64_t s_blk, s_head, s_tok, s_dim, d, page_size;
  Index block_table;  // [R, pages]
  int64_t bt_s_r, bt_s_p;
  Index lengths;  // [R] slots in use per row (clamped to width)
  int64_t len_s;
  const void* q;  // [R, W, H_q, d] padded window queries
  int64_t q_s_r, q_s_w, q_s_h, q_s_d;
  Index query_pos;  // [R, W] logical positions, -1: empty entry (sees no key)
  int64_t qp_s_r, qp_s_w;
  const float* gain;  // [R, W] logit gain, or nullptr
  int64_t g_s_r, g_s_w;
  const int32_t* pos;  // [num_pages, H_kv, page_size] logical position of every slot
  int64_t p_blk, p_head, p_tok;
  float scale;
  int64_t rows, h_kv, group, w, width;
};

// Keys per work tile of the window kernels (one CTA per (row, KV head, tile)).
constexpr int kWindowTile = 64;

// Scratch floats the three window kernels share: per-tile (max, sum) pairs and the log-sum-exp of
// every (row, window entry, query head).
int64_t window_scratch_floats(const WindowArgs& a);

// Pass 1: per (row, KV head, key tile) the base-2 max and sum of exp2 of every window row's logits;
// pass 2: each (row, entry, query head)'s log-sum-exp from its tiles; pass 3: per key tile the column
// sums of exp2(logit - lse) over the window entries and the G query heads, zeros on padding slots.
// Needs rows, w and width > 0. `scratch` holds window_scratch_floats(a) floats; `out` [R, H_kv, width] fp32 with the given strides
// (every element written). Returns a cudaError_t value (0 on success).
int launch_window_mass(const WindowArgs& a, float* scratch, float* out, int64_t out_s_r, int64_t out_s_h,
                       void* stream);

// The same three passes with pass 3 adding its sums into a paged fp32 state [num_pages, H_kv, page_size]
// (strides st_blk, st_head, st_tok) at each row's slots below its length, nothing else written: the
// engine's accumulated window mass, updated in place.
int launch_window_mass_into(const WindowArgs& a, float* scratch, float* state, int64_t st_blk, int64_t st_head,
                            int64_t st_tok, void* stream);

}  // namespace vllm_evict
