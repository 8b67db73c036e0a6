// Python bindings of the C++ CPU attention kernels (cpu_paged_decode.cpp,
// cpu_paged_prefill.cpp), built together as one extension by kernels/cpu_paged_attention.py.
#include <torch/extension.h>

bool supports_head_dim(int64_t head_dim);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale);
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor block_tables,
                                      torch::Tensor cu_seqlens_q, torch::Tensor seq_lens,
                                      double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supports_head_dim", &supports_head_dim);
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("paged_prefill_attention", &paged_prefill_attention);
}
