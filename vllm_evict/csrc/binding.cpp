// Torch binding of the CUDA eviction kernels (the kernels themselves are in evict_kernels.cu).
// Built JIT by vllm_evict.csrc.load_extension() with torch.utils.cpp_extension.load.
//
// Arguments are validated and passed as pointers and strides: no argument is converted or copied, so
// compact_ runs one kernel and no aten op, and window_mass three kernels plus two allocations from
// the caching allocator (its result and one scratch buffer), with no host-device synchronisation.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include "evict_kernels.h"

namespace {

void check_cuda(int err, const char* what) {
  TORCH_CHECK(err == 0, what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// An int32/int64 tensor on `device`, read in place by the kernels.
vllm_evict::Index index_of(const torch::Tensor& t, const char* name, const torch::Device& device) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, " like the cache, got ", t.device());
  TORCH_CHECK(t.scalar_type() == torch::kInt32 || t.scalar_type() == torch::kInt64, name,
              " must be int32 or int64, got ", t.scalar_type());
  return {t.data_ptr(), t.scalar_type() == torch::kInt64};
}

void check_table(const torch::Tensor& block_table, int64_t rows) {
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == rows, "block_table must be [R, pages] with R = ",
              rows, ", got ", block_table.sizes());
}

void compact_(torch::Tensor cache, torch::Tensor block_table, torch::Tensor keep, torch::Tensor counts) {
  TORCH_CHECK(cache.is_cuda(), "cache must be a CUDA tensor");
  TORCH_CHECK(cache.dim() == 3 || cache.dim() == 4, "cache must be [num_pages, H, page_size, d] or "
              "[num_pages, H, page_size], got ", cache.sizes());
  TORCH_CHECK(keep.dim() == 3 && keep.size(1) == cache.size(1), "keep must be [R, H, b] with H = ", cache.size(1),
              ", got ", keep.sizes());
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == keep.size(0), "counts must be [R] with R = ", keep.size(0),
              ", got ", counts.sizes());
  check_table(block_table, keep.size(0));
  const c10::cuda::CUDAGuard guard(cache.device());
  const auto dev = cache.device();
  vllm_evict::CompactArgs a{};
  a.cache = cache.data_ptr();
  a.elem_size = static_cast<int>(cache.element_size());
  a.s_blk = cache.stride(0); a.s_head = cache.stride(1); a.s_tok = cache.stride(2);
  a.s_dim = cache.dim() == 4 ? cache.stride(3) : 0;
  a.d = cache.dim() == 4 ? cache.size(3) : 1;
  a.page_size = cache.size(2);
  a.block_table = index_of(block_table, "block_table", dev);
  a.bt_s_r = block_table.stride(0); a.bt_s_p = block_table.stride(1);
  a.keep = index_of(keep, "keep", dev);
  a.keep_s_r = keep.stride(0); a.keep_s_h = keep.stride(1); a.keep_s_b = keep.stride(2); a.b_max = keep.size(2);
  a.counts = index_of(counts, "counts", dev);
  a.counts_s = counts.stride(0);
  a.rows = keep.size(0); a.heads = keep.size(1);
  check_cuda(vllm_evict::launch_compact(a, c10::cuda::getCurrentCUDAStream().stream()), "compact");
}

int scalar_kind(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return vllm_evict::kFloat32;
    case torch::kFloat16: return vllm_evict::kFloat16;
    case torch::kBFloat16: return vllm_evict::kBFloat16;
    case at::ScalarType::Float8_e4m3fn: return vllm_evict::kFloat8E4M3;
    case at::ScalarType::Float8_e5m2: return vllm_evict::kFloat8E5M2;
    default: TORCH_CHECK(false, "window mass supports fp32/fp16/bf16 and fp8 (e4m3fn, e5m2) caches, got ",
                         t.scalar_type());
  }
  return -1;
}

// The kernels' view of paged.window_mass's arguments (checked; nothing converted or copied). `g` keeps a
// gain converted to fp32 alive until the launches are queued. Keys and queries share a dtype, or the keys
// are fp8 (vLLM's fp8 KV cache, optionally with the layer's scale `k_scale`) and the queries fp16/bf16.
vllm_evict::WindowArgs window_args(const torch::Tensor& k_cache, const torch::Tensor& block_table,
                                   const torch::Tensor& lengths, const torch::Tensor& queries,
                                   const torch::Tensor& query_positions, double scale, const torch::Tensor& positions,
                                   int64_t width, const c10::optional<torch::Tensor>& gain,
                                   const c10::optional<torch::Tensor>& k_scale, torch::Tensor& g) {
  TORCH_CHECK(k_cache.is_cuda() && k_cache.dim() == 4, "k_cache must be a CUDA [num_pages, H_kv, page_size, d] view");
  TORCH_CHECK(k_cache.size(3) <= 256, "window mass supports head sizes up to 256, got ", k_cache.size(3));
  const int kind = scalar_kind(k_cache);
  const bool fp8 = kind == vllm_evict::kFloat8E4M3 || kind == vllm_evict::kFloat8E5M2;
  if (fp8) {
    TORCH_CHECK(queries.scalar_type() == torch::kFloat16 || queries.scalar_type() == torch::kBFloat16,
                "with fp8 keys the queries must be fp16 or bf16, got ", queries.scalar_type());
  } else {
    TORCH_CHECK(queries.scalar_type() == k_cache.scalar_type(), "queries (", queries.scalar_type(),
                ") and keys (", k_cache.scalar_type(), ") must share a dtype");
    TORCH_CHECK(!k_scale.has_value(), "k_scale is for fp8 keys; the keys are ", k_cache.scalar_type());
  }
  TORCH_CHECK(lengths.dim() == 1, "lengths must be [R], got ", lengths.sizes());
  const int64_t rows = lengths.size(0), h_kv = k_cache.size(1);
  TORCH_CHECK(queries.dim() == 4 && queries.size(0) == rows && queries.size(3) == k_cache.size(3),
              "queries must be [R, W, H_q, d] with R = ", rows, " and d = ", k_cache.size(3), ", got ", queries.sizes());
  const int64_t w = queries.size(1), h_q = queries.size(2);
  TORCH_CHECK(h_q % h_kv == 0, h_q, " query heads do not form groups over ", h_kv, " KV heads");
  TORCH_CHECK(query_positions.dim() == 2 && query_positions.size(0) == rows && query_positions.size(1) == w,
              "query_positions must be [R, W] = [", rows, ", ", w, "], got ", query_positions.sizes());
  TORCH_CHECK(positions.scalar_type() == torch::kInt32, "positions must be int32, got ", positions.scalar_type());
  TORCH_CHECK(positions.dim() == 3 && positions.size(0) == k_cache.size(0) && positions.size(1) == h_kv &&
              positions.size(2) == k_cache.size(2), "positions must be [num_pages, H_kv, page_size], got ",
              positions.sizes());
  TORCH_CHECK(width >= 0, "width must be >= 0, got ", width);
  check_table(block_table, rows);
  const auto dev = k_cache.device();
  TORCH_CHECK(queries.device() == dev && positions.device() == dev, "queries and positions must be on ", dev);
  vllm_evict::WindowArgs a{};
  a.k = k_cache.data_ptr();
  a.kind = kind;
  a.q_kind = scalar_kind(queries);
  if (k_scale.has_value()) {  // a device pointer: the kernels read the scale, the host never does
    TORCH_CHECK(k_scale->scalar_type() == torch::kFloat32 && k_scale->numel() == 1 && k_scale->device() == dev,
                "k_scale must be a one-element fp32 tensor on ", dev, ", got ", k_scale->scalar_type(), " ",
                k_scale->sizes(), " on ", k_scale->device());
    a.k_scale = k_scale->data_ptr<float>();
  }
  a.s_blk = k_cache.stride(0); a.s_head = k_cache.stride(1); a.s_tok = k_cache.stride(2); a.s_dim = k_cache.stride(3);
  a.d = k_cache.size(3); a.page_size = k_cache.size(2);
  a.block_table = index_of(block_table, "block_table", dev);
  a.bt_s_r = block_table.stride(0); a.bt_s_p = block_table.stride(1);
  a.lengths = index_of(lengths, "lengths", dev);
  a.len_s = lengths.stride(0);
  a.q = queries.data_ptr();
  a.q_s_r = queries.stride(0); a.q_s_w = queries.stride(1); a.q_s_h = queries.stride(2); a.q_s_d = queries.stride(3);
  a.query_pos = index_of(query_positions, "query_positions", dev);
  a.qp_s_r = query_positions.stride(0); a.qp_s_w = query_positions.stride(1);
  if (gain.has_value()) {
    TORCH_CHECK(gain->dim() == 2 && gain->size(0) == rows && gain->size(1) == w, "gain must be None or [R, W] = [",
                rows, ", ", w, "], got ", gain->sizes());
    g = gain->to(dev, torch::kFloat32);  // the same tensor (no copy) when already fp32 on the device
    a.gain = g.data_ptr<float>();
    a.g_s_r = g.stride(0); a.g_s_w = g.stride(1);
  }
  a.pos = positions.data_ptr<int32_t>();
  a.p_blk = positions.stride(0); a.p_head = positions.stride(1); a.p_tok = positions.stride(2);
  a.scale = static_cast<float>(scale);
  a.rows = rows; a.h_kv = h_kv; a.group = h_q / h_kv; a.w = w; a.width = width;
  return a;
}

// fp32 [R, H_kv, width]: the window mass of every row summed over the GQA group. The arguments are
// those of paged.window_mass, in its order (per_query_head aside: not supported here).
torch::Tensor window_mass(torch::Tensor k_cache, torch::Tensor block_table, torch::Tensor lengths,
                          torch::Tensor queries, torch::Tensor query_positions, double scale, torch::Tensor positions,
                          int64_t width, c10::optional<torch::Tensor> gain, c10::optional<torch::Tensor> k_scale) {
  torch::Tensor g;
  const auto a = window_args(k_cache, block_table, lengths, queries, query_positions, scale, positions, width, gain,
                             k_scale, g);
  const c10::cuda::CUDAGuard guard(k_cache.device());
  auto f32 = torch::TensorOptions().device(k_cache.device()).dtype(torch::kFloat32);
  if (a.rows == 0 || a.w == 0 || width == 0) return torch::zeros({a.rows, a.h_kv, width}, f32);  // no key or no query
  auto out = torch::empty({a.rows, a.h_kv, width}, f32);  // every element is written by the kernels
  auto scratch = torch::empty({vllm_evict::window_scratch_floats(a)}, f32);
  check_cuda(vllm_evict::launch_window_mass(a, scratch.data_ptr<float>(), out.data_ptr<float>(), out.stride(0),
                                            out.stride(1), c10::cuda::getCurrentCUDAStream().stream()),
             "window mass");
  return out;
}

// paged.accumulate_window_mass for a group-summed state: the window mass added into `state`
// (fp32 [num_pages, H_kv, page_size], any strides) at every row's slots, in place.
void accumulate_window_mass_(torch::Tensor state, torch::Tensor k_cache, torch::Tensor block_table,
                             torch::Tensor lengths, torch::Tensor queries, torch::Tensor query_positions, double scale,
                             torch::Tensor positions, int64_t width, c10::optional<torch::Tensor> gain,
                             c10::optional<torch::Tensor> k_scale) {
  torch::Tensor g;
  const auto a = window_args(k_cache, block_table, lengths, queries, query_positions, scale, positions, width, gain,
                             k_scale, g);
  TORCH_CHECK(state.scalar_type() == torch::kFloat32 && state.dim() == 3 && state.size(0) == k_cache.size(0) &&
              state.size(1) == k_cache.size(1) && state.size(2) == k_cache.size(2) &&
              state.device() == k_cache.device(), "state must be fp32 [num_pages, H_kv, page_size] on ",
              k_cache.device(), ", got ", state.scalar_type(), " ", state.sizes());
  if (a.rows == 0 || a.w == 0 || width == 0) return;
  const c10::cuda::CUDAGuard guard(k_cache.device());
  auto scratch = torch::empty({vllm_evict::window_scratch_floats(a)},
                              torch::TensorOptions().device(k_cache.device()).dtype(torch::kFloat32));
  check_cuda(vllm_evict::launch_window_mass_into(a, scratch.data_ptr<float>(), state.data_ptr<float>(), state.stride(0),
                                                 state.stride(1), state.stride(2),
                                                 c10::cuda::getCurrentCUDAStream().stream()),
             "window mass (accumulated)");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vllm-evict CUDA kernels: in-place paged compaction and observation-window attention mass";
  m.def("compact_", &compact_, "in-place per-head compaction of one paged view (paged.compact_tokens)",
        py::arg("cache"), py::arg("block_table"), py::arg("keep"), py::arg("counts"));
  m.def("window_mass", &window_mass, "observation-window attention mass summed over the GQA group "
        "(paged.window_mass)", py::arg("k_cache"), py::arg("block_table"), py::arg("lengths"), py::arg("queries"),
        py::arg("query_positions"), py::arg("scale"), py::arg("positions"), py::arg("width"), py::arg("gain"),
        py::arg("k_scale") = py::none());
  m.def("accumulate_window_mass_", &accumulate_window_mass_, "observation-window attention mass summed over the "
        "GQA group, added into a paged state in place (paged.accumulate_window_mass)", py::arg("state"),
        py::arg("k_cache"), py::arg("block_table"), py::arg("lengths"), py::arg("queries"),
        py::arg("query_positions"), py::arg("scale"), py::arg("positions"), py::arg("width"), py::arg("gain"),
        py::arg("k_scale") = py::none());
}
