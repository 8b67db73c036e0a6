// The linear layer's GEMM in bfloat16 on AMX tiles: out [M, N] = x [M, K] @ W^T (+ bias),
// with W [N, K] packed once into blocks of BN columns in the tile unit's pair-interleaved
// (VNNI) layout: block b is [K / 2][width][2], width BN but for the last, N - b * BN, in a
// flat tensor of W's N * K elements.
//
// Why not oneDNN's matmul, which already runs on the tiles: with up to about a thousand rows
// and two threads, its work split leaves one thread waiting (two threads ran 1.3-1.6x one,
// against 2x from about 1100 rows on: docs/notes/cpu-gemm-findings.md, "Prefill GEMMs on AMX
// tiles").
// Here the output is cut into blocks of at most BM_MAX rows by BN columns, which the threads
// claim one at a time, in order: the column blocks of one row block, whose rows stay in the
// L2. Each block runs on torch's brgemm (oneDNN's JIT micro-kernel, the one torch's CPU flash
// attention uses); a block of many rows takes K in chunks of KC, so that the chunk of its
// weight columns the micro-kernel reads again for every 32 rows stays in the L1 (over the
// whole K it is read from the L2, which then sets the pace). Accumulation is float32; the
// output is rounded once, to nearest even, after the bias, as oneDNN does.
#include "cpu_tensor.h"

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_vec.h"

namespace {

using bf16 = c10::BFloat16;
using pdc::load;
using pdc::rotate_half;
using pdc::round_to;
using pdc::silu;
using pdc::store;
using pdc::vf;
using pdc::W;

constexpr int64_t BN = 64;      // output columns per block: 8 tiles of 16 floats
constexpr int64_t BM_MAX = 512;  // output rows per block, at most
constexpr int64_t KC = 256;      // K per brgemm call in a block of many rows
// Fewer rows than this read each weight chunk once or twice: one call over the whole K then
// saves the calls and the accumulator's round trips.
constexpr int64_t KC_MIN_ROWS = 64;

// Rows per block: M cut into equal blocks of at most BM_MAX rows, so no thread is left with
// a short last block.
int64_t rows_per_block(int64_t M) {
  const int64_t blocks = (M + BM_MAX - 1) / BM_MAX;
  return (M + blocks - 1) / blocks;
}

// acc [rows][ldc] float32 = A [rows, K] (row stride lda) @ the packed block B ([K / 2][width][2])
// over the whole K, in chunks of KC for a block of many rows.
void gemm_block(int64_t rows, int64_t width, int64_t K, int64_t lda, const bf16* A,
                const bf16* B, float* acc, int64_t ldc) {
  const int64_t kc = rows < KC_MIN_ROWS ? K : KC;
  for (int64_t k0 = 0; k0 < K; k0 += kc)
    at::native::cpublas::brgemm(rows, width, std::min(kc, K - k0), lda, width, ldc,
                                /*add_C=*/k0 > 0, A + k0, B + k0 * width, acc);
}

// acc [rows][ldacc] float32 (+ bias) -> out rows, columns [n0, n0 + nn), rounded to bfloat16.
void store_block(const float* acc, int64_t ldacc, int64_t rows, const float* bias, bf16* out,
                 int64_t ldo, int64_t nn) {
  const int64_t full = nn / W * W;
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = acc + r * ldacc;
    bf16* o = out + r * ldo;
    if (bias != nullptr) {
      for (int64_t n = 0; n < full; n += W) store(o + n, load(a + n) + load(bias + n));
      for (int64_t n = full; n < nn; ++n) o[n] = static_cast<bf16>(a[n] + bias[n]);
    } else {
      for (int64_t n = 0; n < full; n += W) store(o + n, load(a + n));
      for (int64_t n = full; n < nn; ++n) o[n] = static_cast<bf16>(a[n]);
    }
  }
}

}  // namespace

bool amx_gemm_supported() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor amx_gemm_pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.device().is_cpu(),
              "amx_gemm_pack: a 2-D bfloat16 CPU weight [out, in]");
  TORCH_CHECK(weight.size(1) % 2 == 0, "amx_gemm_pack: in_features must be even, got ",
              weight.size(1));
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + BN - 1) / BN;
  auto packed = at::empty({N * K}, w.options());
  const bf16* src = w.data_ptr<bf16>();
  bf16* dst = packed.data_ptr<bf16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t width = std::min(BN, N - b * BN);
      bf16* block = dst + b * BN * K;
      for (int64_t n = 0; n < width; ++n) {
        const bf16* row = src + (b * BN + n) * K;
        for (int64_t k = 0; k < K; ++k) block[(k / 2) * width * 2 + n * 2 + (k % 2)] = row[k];
      }
    }
  });
  return packed;
}

namespace {

// One call's operands, checked: x [M, K] bfloat16 with unit column stride, a packed weight of
// N * K elements, the bias widened to float32 (bias == nullptr without one), and the output
// [M, out_columns] allocated.
struct Operands {
  int64_t M, K, lda;
  const bf16* A;
  const bf16* B;
  at::Tensor bias_f;
  const float* bias = nullptr;
  at::Tensor out;
  bf16* C;

  Operands(const at::Tensor& x, const at::Tensor& packed, int64_t N,
           const c10::optional<at::Tensor>& bias_opt, int64_t out_columns) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
                "amx_gemm: x must be bfloat16 [M, K] with unit column stride");
    TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kBFloat16 &&
                    packed.is_contiguous(),
                "amx_gemm: packed must come from amx_gemm_pack");
    M = x.size(0), K = x.size(1), lda = x.stride(0);
    TORCH_CHECK(K % 2 == 0 && N > 0 && packed.numel() == N * K, "amx_gemm: x has ", K,
                " columns; the packed weight's ", packed.numel(), " elements are not ", N,
                " out_features times that");
    if (bias_opt.has_value()) {
      TORCH_CHECK(bias_opt->numel() == N, "amx_gemm: bias must have out_features elements");
      bias_f = bias_opt->to(at::kFloat).contiguous();
      bias = bias_f.data_ptr<float>();
    }
    A = x.data_ptr<bf16>();
    B = packed.data_ptr<bf16>();
    out = at::empty({M, out_columns}, x.options());
    C = out.data_ptr<bf16>();
  }
};

// Runs body(m0, rows, nb, acc) for every block of M rows (cut by rows_per_block) by
// `blocks_n` column blocks, on the threads, which claim blocks one at a time in order: the
// column blocks of one row block, whose rows stay in the L2. acc: this thread's float32
// scratch of 2 * BM_MAX * BN (two accumulators, for a fused epilogue).
template <typename Body>
void for_each_block(int64_t M, int64_t blocks_n, const Body& body) {
  if (M == 0) return;
  const int64_t BM = rows_per_block(M), blocks_m = (M + BM - 1) / BM;
  const int64_t blocks = blocks_m * blocks_n;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), blocks));
#pragma omp parallel num_threads(threads)
  {
    thread_local std::vector<float> acc;
    acc.resize(2 * BM_MAX * BN);
    // a thread the OS takes off its core for a while leaves its share to the others instead
    // of stalling them at the end
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t mb = i / blocks_n, m0 = mb * BM;
      body(m0, std::min(BM, M - m0), i % blocks_n, acc.data());
    }
    at::native::cpublas::brgemm_release();
  }
}

}  // namespace

at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, int64_t out_features,
                    c10::optional<at::Tensor> bias) {
  const Operands op(x, packed, out_features, bias, out_features);
  const int64_t N = out_features;
  for_each_block(op.M, (N + BN - 1) / BN, [&](int64_t m0, int64_t rows, int64_t nb, float* acc) {
    const int64_t n0 = nb * BN, width = std::min(BN, N - n0);
    gemm_block(rows, width, op.K, op.lda, op.A + m0 * op.lda, op.B + n0 * op.K, acc, BN);
    store_block(acc, BN, rows, op.bias == nullptr ? nullptr : op.bias + n0, op.C + m0 * N + n0,
                N, width);
  });
  return op.out;
}

bool amx_gemm_fuses_silu(int64_t out_features) {
  return out_features > 0 && out_features % (2 * BN) == 0;
}

at::Tensor amx_gemm_silu_and_mul(at::Tensor x, at::Tensor packed, int64_t out_features,
                                 c10::optional<at::Tensor> bias) {
  const int64_t d = out_features / 2;
  TORCH_CHECK(amx_gemm_fuses_silu(out_features), "amx_gemm_silu_and_mul: gate | up of ",
              out_features, " features: each half must be a multiple of ", BN);
  const Operands op(x, packed, out_features, bias, d);
  for_each_block(op.M, d / BN, [&](int64_t m0, int64_t rows, int64_t nb, float* acc) {
    const int64_t n0 = nb * BN;
    float* acc_up = acc + BM_MAX * BN;
    gemm_block(rows, BN, op.K, op.lda, op.A + m0 * op.lda, op.B + n0 * op.K, acc, BN);
    gemm_block(rows, BN, op.K, op.lda, op.A + m0 * op.lda, op.B + (d + n0) * op.K, acc_up, BN);
    const float* bias_g = op.bias == nullptr ? nullptr : op.bias + n0;
    const float* bias_u = op.bias == nullptr ? nullptr : op.bias + d + n0;
    for (int64_t r = 0; r < rows; ++r) {
      bf16* o = op.C + (m0 + r) * d + n0;
      for (int64_t n = 0; n < BN; n += W) {
        vf g = load(acc + r * BN + n), u = load(acc_up + r * BN + n);
        if (op.bias != nullptr) {
          g += load(bias_g + n);
          u += load(bias_u + n);
        }
        // each half rounded as the GEMM's output, silu's result rounded, as the unfused
        // silu_and_mul computes them
        g = round_to<bf16>(g);
        store(o + n, round_to<bf16>(silu(g)) * round_to<bf16>(u));
      }
    }
  });
  return op.out;
}

bool amx_gemm_fuses_rope(int64_t out_features, int64_t rotated, int64_t head_dim) {
  return head_dim > 0 && head_dim % BN == 0 && head_dim <= 2 * BN && rotated >= 0 &&
         rotated % head_dim == 0 && rotated <= out_features && out_features % head_dim == 0;
}

at::Tensor amx_gemm_rope(at::Tensor x, at::Tensor packed, int64_t out_features,
                         c10::optional<at::Tensor> bias, at::Tensor positions,
                         at::Tensor cos_sin_cache, int64_t rotated, int64_t head_dim) {
  TORCH_CHECK(amx_gemm_fuses_rope(out_features, rotated, head_dim), "amx_gemm_rope: ",
              out_features, " features with the first ", rotated, " in heads of ", head_dim,
              ": the heads must be whole column blocks of ", BN, ", at most two");
  const Operands op(x, packed, out_features, bias, out_features);
  const auto pos = rope_positions(positions, cos_sin_cache, op.M, head_dim);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  const int64_t N = out_features, half = head_dim / 2;
  // a block is one head: its halves are in the same accumulator, [rows][head_dim]
  for_each_block(op.M, N / head_dim, [&](int64_t m0, int64_t rows, int64_t nb, float* acc) {
    const int64_t n0 = nb * head_dim;
    for (int64_t j = 0; j < head_dim; j += BN)
      gemm_block(rows, BN, op.K, op.lda, op.A + m0 * op.lda, op.B + (n0 + j) * op.K, acc + j,
                 head_dim);
    const float* bias_h = op.bias == nullptr ? nullptr : op.bias + n0;
    if (n0 >= rotated) {
      store_block(acc, head_dim, rows, bias_h, op.C + m0 * N + n0, N, head_dim);
      return;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* a = acc + r * head_dim;
      const float* cos = cache + pp[m0 + r] * head_dim;
      bf16* o = op.C + (m0 + r) * N + n0;
      for (int64_t i = 0; i < half; i += W) {
        vf x1 = load(a + i), x2 = load(a + half + i);
        if (bias_h != nullptr) {
          x1 += load(bias_h + i);
          x2 += load(bias_h + half + i);
        }
        // the projection rounded as the GEMM's output, then rotated as the unfused op does
        x1 = round_to<bf16>(x1);
        x2 = round_to<bf16>(x2);
        rotate_half<bf16>(x1, x2, load(cos + i), load(cos + half + i));
        store(o + i, x1);
        store(o + half + i, x2);
      }
    }
  });
  return op.out;
}
