// A decode step's decoder layers in one call: between the kernels there is no Python, whose
// dispatch of a few dozen small ops per layer costs a sizeable share of a decode step on a
// slow core. The layer is the model's (engine/model.py), kernel for kernel; prefill chunks,
// tensor parallel and the KV connector's per-layer hooks stay on that forward.
#include "cpu_decode_stack.h"

#include "cpu_kernels.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/embedding.h>

#include <optional>
#include <tuple>
#include <utility>

namespace {

// oneDNN's matmul over a weight packed by mkldnn::_reorder_linear_weight: the op
// kernels.cpu_gemm.linear calls, reached through the dispatcher since it has no C++ API.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(),
                 c10::string_view(""));
}

}  // namespace

DecodeStack::DecodeStack(at::Tensor embedding, std::vector<DecodeLayer> layers,
                         at::Tensor final_norm, double eps, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size,
                         double scale, int64_t skinny_max_rows)
    : embedding_(std::move(embedding)), layers_(std::move(layers)),
      final_norm_(std::move(final_norm)), eps_(eps), scale_(scale), num_heads_(num_heads),
      num_kv_heads_(num_kv_heads), head_dim_(head_dim), hidden_size_(embedding_.size(1)),
      intermediate_size_(intermediate_size), skinny_max_rows_(skinny_max_rows) {
  TORCH_CHECK(embedding_.dim() == 2, "embedding: [vocab, hidden]");
  TORCH_CHECK(!layers_.empty(), "at least one layer");
  TORCH_CHECK(num_kv_heads_ > 0 && num_heads_ % num_kv_heads_ == 0,
              "num_heads must be a multiple of num_kv_heads");
}

at::Tensor DecodeStack::linear(const at::Tensor& x, const at::Tensor& skinny,
                               const c10::optional<at::Tensor>& packed, int64_t out,
                               const c10::optional<at::Tensor>& bias) const {
  if (x.size(0) <= skinny_max_rows_) {
    return skinny.dim() == 1 ? amx_gemm(x, skinny, out, bias) : skinny_gemm(x, skinny, out, bias);
  }
  TORCH_CHECK(packed.has_value(), "a batch of ", x.size(0), " rows needs the oneDNN-packed "
              "weights: the skinny GEMM takes at most ", skinny_max_rows_);
  return onednn_linear(x, *packed, bias);
}

at::Tensor DecodeStack::linear_silu_and_mul(const at::Tensor& x,
                                            const DecodeLayer& layer) const {
  const int64_t out = 2 * intermediate_size_;
  if (x.size(0) <= skinny_max_rows_ && layer.gate_up.dim() == 1 && amx_gemm_fuses_silu(out)) {
    return amx_gemm_silu_and_mul(x, layer.gate_up, out, layer.gate_up_bias);
  }
  return silu_and_mul(linear(x, layer.gate_up, layer.gate_up_packed, out, layer.gate_up_bias));
}

at::Tensor DecodeStack::forward(at::Tensor input_ids, at::Tensor positions,
                                at::Tensor cos_sin_cache,
                                const std::vector<at::Tensor>& k_caches,
                                const std::vector<at::Tensor>& v_caches,
                                at::Tensor slot_mapping, at::Tensor block_tables,
                                at::Tensor seq_lens) const {
  const size_t num_layers = layers_.size();
  TORCH_CHECK(k_caches.size() == num_layers && v_caches.size() == num_layers,
              "one K and one V cache per layer");
  TORCH_CHECK(input_ids.dim() == 1 && positions.sizes() == input_ids.sizes()
                  && slot_mapping.sizes() == input_ids.sizes()
                  && seq_lens.size(0) == input_ids.size(0) && block_tables.size(0) == input_ids.size(0),
              "one new token per sequence: input_ids, positions, slot_mapping, seq_lens and "
              "block_tables' rows agree");
  const int64_t n = input_ids.size(0);
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  at::Tensor hidden = at::embedding(embedding_, input_ids);
  c10::optional<at::Tensor> residual;
  at::Tensor normed;
  for (size_t l = 0; l < num_layers; ++l) {
    const DecodeLayer& layer = layers_[l];
    std::tie(normed, hidden) = fused_add_rms_norm(hidden, layer.input_norm, eps_, residual);
    residual = hidden;
    at::Tensor qkv = linear(normed, layer.qkv, layer.qkv_packed, q_size + 2 * kv_size,
                            layer.qkv_bias);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads_, head_dim_});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads_, head_dim_});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads_, head_dim_});
    rotary_embedding(positions, q, k, cos_sin_cache);
    store_kv_cache(k, v, k_caches[l], v_caches[l], slot_mapping);
    at::Tensor attn = paged_decode_attention(q, k_caches[l], v_caches[l], block_tables,
                                             seq_lens, scale_);
    hidden = linear(attn.reshape({n, q_size}), layer.o, layer.o_packed, hidden_size_,
                    layer.o_bias);
    std::tie(normed, hidden) = fused_add_rms_norm(hidden, layer.post_norm, eps_, residual);
    residual = hidden;
    hidden = linear(linear_silu_and_mul(normed, layer), layer.down, layer.down_packed,
                    hidden_size_, layer.down_bias);
  }
  return std::get<0>(fused_add_rms_norm(hidden, final_norm_, eps_, residual));
}
