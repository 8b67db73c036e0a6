// An all-decode step's decoder layers (Llama family) as one C++ call over the CPU kernels of
// cpu_kernels.h (defined in cpu_decode_stack.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

// One decoder layer's weights as the stack reads them: the two RMSNorm weights [hidden], and
// the four projections packed by skinny_gemm_pack (q|k|v stacked, gate|up stacked), each
// with its optional bias [out] in the activations' dtype.
struct DecodeLayer {
  torch::Tensor input_norm, qkv, o, post_norm, gate_up, down;
  c10::optional<torch::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
};

class DecodeStack {
 public:
  DecodeStack(torch::Tensor embedding, std::vector<DecodeLayer> layers, torch::Tensor final_norm,
              double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              int64_t intermediate_size, double scale);

  // input_ids, positions int64 [n] (one new token per sequence) -> the final-normed hidden
  // states [n, hidden]; writes each layer's new K/V into k_caches[l] / v_caches[l] at
  // slot_mapping (int64 [n]) and attends over block_tables (int32 [n, max_blocks]) up to
  // seq_lens (int32 [n]). The same kernels, in the same order, as the model's eager forward.
  torch::Tensor forward(torch::Tensor input_ids, torch::Tensor positions,
                        torch::Tensor cos_sin_cache, const std::vector<torch::Tensor>& k_caches,
                        const std::vector<torch::Tensor>& v_caches, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor seq_lens) const;

 private:
  torch::Tensor embedding_;
  std::vector<DecodeLayer> layers_;
  torch::Tensor final_norm_;
  double eps_, scale_;
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_size_, intermediate_size_;
};
