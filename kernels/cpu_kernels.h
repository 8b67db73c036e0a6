// The C++ CPU kernels' entry points (defined in cpu_paged_decode.cpp, cpu_paged_prefill.cpp,
// cpu_amx_prefill.cpp, cpu_fused_ops.cpp, cpu_skinny_gemm.cpp, cpu_amx_gemm.cpp and cpu_threads.cpp), for the
// bindings and for cpu_decode_stack.cpp, which calls them directly.
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <vector>

bool supports_head_dim(int64_t head_dim);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale);
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor block_tables,
                                      torch::Tensor cu_seqlens_q, torch::Tensor seq_lens,
                                      double scale);
torch::Tensor amx_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                    torch::Tensor block_tables, torch::Tensor cu_seqlens_q,
                                    torch::Tensor seq_lens, double scale);

std::tuple<torch::Tensor, torch::Tensor> fused_add_rms_norm(torch::Tensor x, torch::Tensor weight,
                                                            double eps,
                                                            c10::optional<torch::Tensor> residual);
torch::Tensor silu_and_mul(torch::Tensor x);
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k,
                      torch::Tensor cos_sin_cache);
// RoPE's positions as int64 [tokens], checked against cos_sin_cache (float32
// [max_position, head_dim]): one per token, each inside the cache.
torch::Tensor rope_positions(const torch::Tensor& positions, const torch::Tensor& cos_sin_cache,
                            int64_t tokens, int64_t head_dim);
void store_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping);

int64_t skinny_gemm_tile();
torch::Tensor skinny_gemm_pack(torch::Tensor weight);
torch::Tensor skinny_gemm(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                          c10::optional<torch::Tensor> bias);

bool amx_gemm_supported();
torch::Tensor amx_gemm_pack(torch::Tensor weight);
torch::Tensor amx_gemm(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                       c10::optional<torch::Tensor> bias);
// silu_and_mul(amx_gemm(...)) in one pass, for a gate | up weight whose halves are whole
// column blocks (amx_gemm_fuses_silu): [M, out_features / 2], the same values.
bool amx_gemm_fuses_silu(int64_t out_features);
torch::Tensor amx_gemm_silu_and_mul(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                                    c10::optional<torch::Tensor> bias);
// amx_gemm(...) with rotate-half RoPE applied to its first `rotated` features, heads of
// head_dim at `positions` [M] (cos_sin_cache float32 [max_position, head_dim] = cos | sin), as
// rotary_embedding applies it to the output: the same values in one pass. For heads that are
// whole column blocks (amx_gemm_fuses_rope).
bool amx_gemm_fuses_rope(int64_t out_features, int64_t rotated, int64_t head_dim);
torch::Tensor amx_gemm_rope(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                            c10::optional<torch::Tensor> bias, torch::Tensor positions,
                            torch::Tensor cos_sin_cache, int64_t rotated, int64_t head_dim);

std::vector<int64_t> bind_omp_threads(const std::vector<int64_t>& cpus);
