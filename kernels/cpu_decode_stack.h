// An all-decode step's decoder layers (Llama family) as one C++ call over the CPU kernels of
// cpu_kernels.h (defined in cpu_decode_stack.cpp).
#pragma once

#include "cpu_tensor.h"

#include <vector>

// One decoder layer's weights as the stack reads them: the two RMSNorm weights [hidden], and
// the four projections (q|k|v stacked, gate|up stacked) packed by skinny_gemm_pack, or for
// bfloat16 on AMX by amx_gemm_pack (kernels/cpu_gemm.py: a flat tensor), each with its
// optional bias [out] in the activations' dtype and, optionally, the same weight in oneDNN's
// packed layout (an opaque mkldnn tensor) for batches of more rows than that copy takes.
struct DecodeLayer {
  at::Tensor input_norm, qkv, o, post_norm, gate_up, down;
  c10::optional<at::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
  c10::optional<at::Tensor> qkv_packed, o_packed, gate_up_packed, down_packed;
};

class DecodeStack {
 public:
  // skinny_max_rows: the most rows a projection runs on its first copy (the skinny GEMM, or
  // the tile GEMM for a flat copy); larger batches run
  // oneDNN's matmul over the packed weights, which every layer must then have.
  DecodeStack(at::Tensor embedding, std::vector<DecodeLayer> layers, at::Tensor final_norm,
              double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              int64_t intermediate_size, double scale, int64_t skinny_max_rows);

  // input_ids, positions int64 [n] (one new token per sequence) -> the final-normed hidden
  // states [n, hidden]; writes each layer's new K/V into k_caches[l] / v_caches[l] at
  // slot_mapping (int64 [n]) and attends over block_tables (int32 [n, max_blocks]) up to
  // seq_lens (int32 [n]). The same kernels, in the same order, as the model's eager forward.
  // Raises c10::Error for more than skinny_max_rows rows where a layer has no packed weights.
  at::Tensor forward(at::Tensor input_ids, at::Tensor positions,
                     at::Tensor cos_sin_cache, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor seq_lens) const;

 private:
  // x [n, in] @ W^T (+ bias) -> [n, out]: the skinny GEMM (or the tile GEMM, for a flat copy)
  // up to skinny_max_rows_ rows, oneDNN above, as kernels.cpu_gemm.linear chooses.
  at::Tensor linear(const at::Tensor& x, const at::Tensor& skinny,
                    const c10::optional<at::Tensor>& packed, int64_t out,
                    const c10::optional<at::Tensor>& bias) const;
  // silu_and_mul(linear(x, gate_up)) -> [n, intermediate]: one pass on the tile GEMM where
  // it takes the batch, as kernels.linear_silu_and_mul chooses.
  at::Tensor linear_silu_and_mul(const at::Tensor& x, const DecodeLayer& layer) const;

  at::Tensor embedding_;
  std::vector<DecodeLayer> layers_;
  at::Tensor final_norm_;
  double eps_, scale_;
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_size_, intermediate_size_;
  int64_t skinny_max_rows_;
};
