// Launchers of the CUDA eviction kernels (evict_kernels.cu). Plain C++ types only: this header is
// shared by the kernel file, which includes no torch header, and by the torch binding (binding.cpp).
#pragma once

#include <cstdint>

namespace vllm_evict {

enum ScalarKind : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// In-place per-head compaction of one paged view [num_blocks, H, block_size, d] (a state buffer is
// a view with d = 1 and s_dim = 0). keep [R, H, >= counts[r]] int64, strictly ascending per head.
// Returns a cudaError_t value (0 on success).
int launch_compact(void* cache, int elem_size, const int64_t* block_table, int64_t bt_stride,
                   const int64_t* keep, int64_t keep_s_r, int64_t keep_s_h, const int64_t* counts,
                   int64_t num_requests, int64_t num_heads, int64_t block_size, int64_t s_blk,
                   int64_t s_head, int64_t s_tok, int64_t s_dim, int64_t d, void* stream);

struct WindowArgs {
  const void* k;            // paged key view, element type `kind`
  int kind;                 // ScalarKind of keys and queries (they must match)
  int64_t s_blk, s_head, s_tok, s_dim, d, block_size;
  const int64_t* block_table;
  int64_t bt_stride;
  const int64_t* lengths;   // [R] physical lengths
  const void* q;            // [T, H_q, d] packed window queries
  int64_t q_s_t, q_s_h, q_s_d;
  const int64_t* query_start_loc;  // [R + 1]
  const int64_t* query_pos;        // [T]
  const float* gain;               // [T] or nullptr
  const int32_t* pos;              // paged per-slot logical positions [nb, H_kv, bs] or nullptr (slot index)
  int64_t p_blk, p_head, p_tok;
  float scale;
  int64_t num_requests, h_kv, group, max_len;
};

// Keys per work tile of the window kernels (one CTA per (request, KV head, tile)).
constexpr int kWindowTile = 64;

// Pass 1: per (packed query row, query head, key tile) the base-2 max and sum of exp2 of the logits.
// part_m / part_l: [T, H_q, n_tiles] fp32 with n_tiles = ceil(max_len / kWindowTile).
int launch_window_partials(const WindowArgs& a, float* part_m, float* part_l, int64_t n_tiles, void* stream);

// Pass 2: column sums of exp2(logit - lse) over the window rows and the G query heads.
// lse: [T, H_q] base-2 log-sum-exp (-inf for rows that see no key); out: [R, H_kv, max_len] fp32.
int launch_window_colsums(const WindowArgs& a, const float* lse, float* out, int64_t out_s_r,
                          int64_t out_s_h, void* stream);

}  // namespace vllm_evict
