// Torch binding of the CUDA eviction kernels (the kernels themselves are in evict_kernels.cu).
// Built JIT by vllm_evict.csrc.load_extension() with torch.utils.cpp_extension.load.
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cmath>

#include "evict_kernels.h"

namespace {

void check_cuda(int err, const char* what) {
  TORCH_CHECK(err == 0, what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

torch::Tensor as_int64(const torch::Tensor& t, const torch::Device& device) {
  return t.to(device, torch::kInt64).contiguous();
}

void compact_(torch::Tensor cache, torch::Tensor block_table, torch::Tensor keep, torch::Tensor counts) {
  TORCH_CHECK(cache.is_cuda(), "cache must be a CUDA tensor");
  TORCH_CHECK(cache.dim() == 3 || cache.dim() == 4, "cache must be [nb, H, bs, d] or [nb, H, bs]");
  TORCH_CHECK(keep.dim() == 3, "keep must be [R, H, b]");
  const c10::cuda::CUDAGuard guard(cache.device());
  auto bt = as_int64(block_table.dim() == 1 ? block_table.unsqueeze(0) : block_table, cache.device());
  auto kp = as_int64(keep, cache.device());
  auto cnt = as_int64(counts, cache.device());
  const bool has_d = cache.dim() == 4;
  const int64_t d = has_d ? cache.size(3) : 1;
  const int64_t s_dim = has_d ? cache.stride(3) : 0;
  check_cuda(vllm_evict::launch_compact(cache.data_ptr(), static_cast<int>(cache.element_size()), bt.data_ptr<int64_t>(),
                                        bt.stride(0), kp.data_ptr<int64_t>(), kp.stride(0), kp.stride(1),
                                        cnt.data_ptr<int64_t>(), kp.size(0), kp.size(1), cache.size(2),
                                        cache.stride(0), cache.stride(1), cache.stride(2), s_dim, d,
                                        c10::cuda::getCurrentCUDAStream().stream()),
             "compact");
}

int scalar_kind(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return vllm_evict::kFloat32;
    case torch::kFloat16: return vllm_evict::kFloat16;
    case torch::kBFloat16: return vllm_evict::kBFloat16;
    default: TORCH_CHECK(false, "window mass supports fp32/fp16/bf16 caches, got ", t.scalar_type());
  }
  return -1;
}

torch::Tensor window_mass(torch::Tensor k_cache, torch::Tensor block_table, torch::Tensor lengths,
                          torch::Tensor queries, torch::Tensor query_start_loc, torch::Tensor query_positions,
                          double scale, c10::optional<torch::Tensor> positions, c10::optional<torch::Tensor> gain,
                          int64_t max_len) {
  TORCH_CHECK(k_cache.is_cuda() && k_cache.dim() == 4, "k_cache must be a CUDA [nb, H_kv, bs, d] view");
  TORCH_CHECK(queries.scalar_type() == k_cache.scalar_type(), "queries and keys must share a dtype");
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const auto dev = k_cache.device();
  auto bt = as_int64(block_table.dim() == 1 ? block_table.unsqueeze(0) : block_table, dev);
  auto len = as_int64(lengths, dev);
  auto qsl = as_int64(query_start_loc, dev);
  auto qpos = as_int64(query_positions, dev);
  const int64_t n_req = len.size(0), h_kv = k_cache.size(1), t = queries.size(0), h_q = queries.size(1);
  TORCH_CHECK(h_q % h_kv == 0, "query heads must be a multiple of KV heads");
  auto f32 = torch::TensorOptions().device(dev).dtype(torch::kFloat32);
  auto out = torch::zeros({n_req, h_kv, max_len}, f32);
  if (max_len == 0 || t == 0 || n_req == 0) return out;
  torch::Tensor pos, g;
  vllm_evict::WindowArgs a{};
  a.k = k_cache.data_ptr();
  a.kind = scalar_kind(k_cache);
  a.s_blk = k_cache.stride(0); a.s_head = k_cache.stride(1); a.s_tok = k_cache.stride(2); a.s_dim = k_cache.stride(3);
  a.d = k_cache.size(3); a.block_size = k_cache.size(2);
  a.block_table = bt.data_ptr<int64_t>(); a.bt_stride = bt.stride(0);
  a.lengths = len.data_ptr<int64_t>();
  a.q = queries.data_ptr(); a.q_s_t = queries.stride(0); a.q_s_h = queries.stride(1); a.q_s_d = queries.stride(2);
  a.query_start_loc = qsl.data_ptr<int64_t>(); a.query_pos = qpos.data_ptr<int64_t>();
  if (gain.has_value()) {
    g = gain->to(dev, torch::kFloat32).contiguous();
    a.gain = g.data_ptr<float>();
  }
  if (positions.has_value()) {
    TORCH_CHECK(positions->scalar_type() == torch::kInt32, "positions must be int32");
    pos = *positions;
    a.pos = pos.data_ptr<int32_t>(); a.p_blk = pos.stride(0); a.p_head = pos.stride(1); a.p_tok = pos.stride(2);
  }
  a.scale = static_cast<float>(scale);
  a.num_requests = n_req; a.h_kv = h_kv; a.group = h_q / h_kv; a.max_len = max_len;
  const int64_t n_tiles = (max_len + vllm_evict::kWindowTile - 1) / vllm_evict::kWindowTile;
  auto part_m = torch::full({t, h_q, n_tiles}, -INFINITY, f32);
  auto part_l = torch::zeros({t, h_q, n_tiles}, f32);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_cuda(vllm_evict::launch_window_partials(a, part_m.data_ptr<float>(), part_l.data_ptr<float>(), n_tiles, stream),
             "window partials");
  // Combine the per-tile (max, sum) pairs into each row's base-2 log-sum-exp; -inf for empty rows.
  auto m = std::get<0>(part_m.max(-1, true));
  auto m_safe = torch::where(torch::isinf(m), torch::zeros_like(m), m);
  auto l = (part_l * torch::exp2(part_m - m_safe)).sum(-1, true);
  auto lse = torch::where(l > 0, m_safe + torch::log2(l), torch::full_like(l, -INFINITY)).squeeze(-1).contiguous();
  check_cuda(vllm_evict::launch_window_colsums(a, lse.data_ptr<float>(), out.data_ptr<float>(), out.stride(0),
                                               out.stride(1), stream),
             "window column sums");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vllm-evict CUDA kernels: in-place paged compaction and observation-window attention mass";
  m.def("compact_", &compact_, "in-place per-head compaction of one paged view",
        py::arg("cache"), py::arg("block_table"), py::arg("keep"), py::arg("counts"));
  m.def("window_mass", &window_mass, "observation-window attention mass (summed over the GQA group)",
        py::arg("k_cache"), py::arg("block_table"), py::arg("lengths"), py::arg("queries"),
        py::arg("query_start_loc"), py::arg("query_positions"), py::arg("scale"), py::arg("positions"),
        py::arg("gain"), py::arg("max_len"));
}
