// Python bindings of the C++ CPU kernels (cpu_kernels.h), of the decode step's layer stack
// (cpu_decode_stack.h) and of the thread pinning (cpu_threads.cpp), built together as one
// extension by kernels/cpu_extension.py. The one file that includes torch's whole extension
// API (pybind11 and the type casters of at::Tensor and c10::optional).
#include <torch/extension.h>

#include "cpu_kernels.h"
#include "cpu_decode_stack.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supports_head_dim", &supports_head_dim);
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("paged_prefill_attention", &paged_prefill_attention);
  m.def("amx_prefill_attention", &amx_prefill_attention);
  m.def("fused_add_rms_norm", &fused_add_rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotary_embedding", &rotary_embedding);
  m.def("store_kv_cache", &store_kv_cache);
  m.def("skinny_gemm_tile", &skinny_gemm_tile);
  m.def("skinny_gemm_pack", &skinny_gemm_pack);
  m.def("skinny_gemm", &skinny_gemm);
  m.def("amx_gemm_supported", &amx_gemm_supported);
  m.def("amx_gemm_pack", &amx_gemm_pack);
  // prefill GEMMs run while the engine's other Python threads go on
  m.def("amx_gemm", &amx_gemm, py::call_guard<py::gil_scoped_release>());
  m.def("amx_gemm_fuses_silu", &amx_gemm_fuses_silu);
  m.def("amx_gemm_silu_and_mul", &amx_gemm_silu_and_mul, py::call_guard<py::gil_scoped_release>());
  m.def("amx_gemm_fuses_rope", &amx_gemm_fuses_rope);
  m.def("amx_gemm_rope", &amx_gemm_rope, py::call_guard<py::gil_scoped_release>());
  m.def("bind_omp_threads", &bind_omp_threads);
  py::class_<DecodeLayer>(m, "DecodeLayer")
      .def(py::init([](torch::Tensor input_norm, torch::Tensor qkv, torch::Tensor o,
                       torch::Tensor post_norm, torch::Tensor gate_up, torch::Tensor down,
                       c10::optional<torch::Tensor> qkv_bias, c10::optional<torch::Tensor> o_bias,
                       c10::optional<torch::Tensor> gate_up_bias,
                       c10::optional<torch::Tensor> down_bias,
                       c10::optional<torch::Tensor> qkv_packed,
                       c10::optional<torch::Tensor> o_packed,
                       c10::optional<torch::Tensor> gate_up_packed,
                       c10::optional<torch::Tensor> down_packed) {
             return DecodeLayer{input_norm, qkv, o, post_norm, gate_up, down,
                                qkv_bias, o_bias, gate_up_bias, down_bias,
                                qkv_packed, o_packed, gate_up_packed, down_packed};
           }),
           py::arg("input_norm"), py::arg("qkv"), py::arg("o"), py::arg("post_norm"),
           py::arg("gate_up"), py::arg("down"), py::arg("qkv_bias") = py::none(),
           py::arg("o_bias") = py::none(), py::arg("gate_up_bias") = py::none(),
           py::arg("down_bias") = py::none(), py::arg("qkv_packed") = py::none(),
           py::arg("o_packed") = py::none(), py::arg("gate_up_packed") = py::none(),
           py::arg("down_packed") = py::none());
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<torch::Tensor, std::vector<DecodeLayer>, torch::Tensor, double, int64_t,
                    int64_t, int64_t, int64_t, double, int64_t>(),
           py::arg("embedding"), py::arg("layers"), py::arg("final_norm"), py::arg("eps"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("intermediate_size"), py::arg("scale"), py::arg("skinny_max_rows"))
      // the other Python threads of an engine process (its RPC servers, the token stream)
      // run while the step computes
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>());
}
