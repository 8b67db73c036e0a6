// The C++ CPU kernels' entry points (defined in cpu_paged_decode.cpp, cpu_paged_prefill.cpp,
// cpu_amx_prefill.cpp, cpu_fused_ops.cpp, cpu_skinny_gemm.cpp, cpu_amx_gemm.cpp and cpu_threads.cpp), for the
// bindings and for cpu_decode_stack.cpp, which calls them directly.
#pragma once

#include "cpu_tensor.h"

#include <tuple>
#include <vector>

bool supports_head_dim(int64_t head_dim);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache,
                                  at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale);
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache,
                                   at::Tensor v_cache, at::Tensor block_tables,
                                   at::Tensor cu_seqlens_q, at::Tensor seq_lens,
                                   double scale);
at::Tensor amx_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                 at::Tensor block_tables, at::Tensor cu_seqlens_q,
                                 at::Tensor seq_lens, double scale);

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(at::Tensor x, at::Tensor weight,
                                                      double eps,
                                                      c10::optional<at::Tensor> residual);
at::Tensor silu_and_mul(at::Tensor x);
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k,
                      at::Tensor cos_sin_cache);
// RoPE's positions as int64 [tokens], checked against cos_sin_cache (float32
// [max_position, head_dim]): one per token, each inside the cache.
at::Tensor rope_positions(const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                          int64_t tokens, int64_t head_dim);
void store_kv_cache(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                    at::Tensor slot_mapping);

// Elements from one block of a paged cache [num_blocks, block_size, kv_heads, head_dim] to the
// next. A block's tokens and heads are contiguous; the blocks need not be: a layer's K or V of a
// cross-layer cache (engine.kv_cache) is a view whose blocks sit num_layers * 2 blocks apart.
// v_cache has k_cache's shape and strides (or both are contiguous). TORCH_CHECKs that layout.
inline int64_t paged_block_stride(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "caches: [num_blocks, block_size, kv_heads, head_dim], K and V alike");
  const int64_t head_dim = k_cache.size(3), row = k_cache.size(2) * head_dim;
  if (k_cache.is_contiguous() && v_cache.is_contiguous()) return k_cache.size(1) * row;
  TORCH_CHECK(v_cache.strides() == k_cache.strides() && k_cache.stride(3) == 1
                  && k_cache.stride(2) == head_dim && k_cache.stride(1) == row
                  && k_cache.stride(0) >= k_cache.size(1) * row,
              "caches: each block's tokens and heads contiguous, blocks apart, got strides ",
              k_cache.strides());
  return k_cache.stride(0);
}

int64_t skinny_gemm_tile();
at::Tensor skinny_gemm_pack(at::Tensor weight);
at::Tensor skinny_gemm(at::Tensor x, at::Tensor packed, int64_t out_features,
                       c10::optional<at::Tensor> bias);

bool amx_gemm_supported();
at::Tensor amx_gemm_pack(at::Tensor weight);
at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, int64_t out_features,
                    c10::optional<at::Tensor> bias);
// silu_and_mul(amx_gemm(...)) in one pass, for a gate | up weight whose halves are whole
// column blocks (amx_gemm_fuses_silu): [M, out_features / 2], the same values.
bool amx_gemm_fuses_silu(int64_t out_features);
at::Tensor amx_gemm_silu_and_mul(at::Tensor x, at::Tensor packed, int64_t out_features,
                                 c10::optional<at::Tensor> bias);
// amx_gemm(...) with rotate-half RoPE applied to its first `rotated` features, heads of
// head_dim at `positions` [M] (cos_sin_cache float32 [max_position, head_dim] = cos | sin), as
// rotary_embedding applies it to the output: the same values in one pass. For heads that are
// whole column blocks (amx_gemm_fuses_rope).
bool amx_gemm_fuses_rope(int64_t out_features, int64_t rotated, int64_t head_dim);
at::Tensor amx_gemm_rope(at::Tensor x, at::Tensor packed, int64_t out_features,
                         c10::optional<at::Tensor> bias, at::Tensor positions,
                         at::Tensor cos_sin_cache, int64_t rotated, int64_t head_dim);

std::vector<int64_t> bind_omp_threads(const std::vector<int64_t>& cpus);
