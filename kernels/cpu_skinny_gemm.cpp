// The linear layer's GEMM for a few rows (decode batches): out [M, N] = x [M, K] @ W^T, with W
// [N, K] packed once into column tiles, [ceil(N / TILE)][K][TILE], zero-padded past N.
//
// With few rows a GEMM is a read of the weight: every weight element is used M times, once per
// row, so the step time is the weight's bytes over the read bandwidth. A thread here owns a
// contiguous run of tiles and reads it front to back, one sequential stream, asking for the
// lines a few tile rows ahead; each weight vector loaded is multiplied into MR rows at once
// from registers. oneDNN's matmul reads its blocked layout well below the bandwidth at these
// sizes on some CPUs (docs/notes/cpu-gemm-findings.md, "A skinny GEMM for decode").
//
// Vectors are cpu_vec.h's, the machine's widest (AVX-512: 16 floats, 4 per tile row;
// otherwise 8, 2 per tile row), so the accumulators stay in registers: MR x NT of them, plus
// NT weight vectors and one broadcast x value. Math in float32; bfloat16 weights and inputs are widened exactly, and
// a bfloat16 output is rounded once, to nearest even, as oneDNN's bf16 matmul does.
#include "cpu_tensor.h"

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_vec.h"

namespace {

using namespace pdc;

constexpr int NT = W == 16 ? 4 : 2;    // vectors per tile row
constexpr int TILE = W * NT;           // output columns per tile
constexpr int MR = 6;                  // rows multiplied per pass over a tile
constexpr int64_t PREFETCH_ROWS = 8;   // tile rows ahead of the one being read

// rows: MR_ rows of x (row stride ldx) times one tile [K][TILE] -> out columns [n0, n0 + nn),
// with U independent accumulator sets over k so that a pass with few rows still has enough
// FMAs in flight to cover their latency.
template <typename T, int MR_, int U>
void tile_pass(const T* x, int64_t ldx, const T* tile, int64_t K, const T* bias, T* out,
               int64_t ldo, int64_t nn) {
  vf acc[U][MR_][NT];
#pragma GCC unroll 64
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 64
    for (int m = 0; m < MR_; ++m)
#pragma GCC unroll 8
      for (int j = 0; j < NT; ++j) acc[u][m][j] = vf{};
  const int64_t K_main = K / U * U;
  for (int64_t k = 0; k < K_main; k += U) {
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const T* w = tile + (k + u) * TILE;
      const char* ahead = reinterpret_cast<const char*>(w + PREFETCH_ROWS * TILE);
#pragma GCC unroll 8
      for (int c = 0; c < int(TILE * sizeof(T)); c += 64) __builtin_prefetch(ahead + c);
      vf wv[NT];
#pragma GCC unroll 8
      for (int j = 0; j < NT; ++j) wv[j] = load(w + j * W);
#pragma GCC unroll 64
      for (int m = 0; m < MR_; ++m) {
        const vf xs = splat(static_cast<float>(x[m * ldx + k + u]));
#pragma GCC unroll 8
        for (int j = 0; j < NT; ++j) acc[u][m][j] += xs * wv[j];
      }
    }
  }
  for (int64_t k = K_main; k < K; ++k) {
    const T* w = tile + k * TILE;
    for (int m = 0; m < MR_; ++m) {
      const vf xs = splat(static_cast<float>(x[m * ldx + k]));
      for (int j = 0; j < NT; ++j) acc[0][m][j] += xs * load(w + j * W);
    }
  }
  for (int m = 0; m < MR_; ++m) {
    float sum[TILE];
    for (int j = 0; j < NT; ++j) {
      vf s = acc[0][m][j];
      for (int u = 1; u < U; ++u) s += acc[u][m][j];
      store(sum + j * W, s);
    }
    T* o = out + m * ldo;
    for (int64_t i = 0; i < nn; ++i)
      o[i] = static_cast<T>(bias ? sum[i] + static_cast<float>(bias[i]) : sum[i]);
  }
}

template <typename T>
void skinny_rows(const at::Tensor& x, const at::Tensor& packed, const T* bias,
                 at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), tiles = packed.size(0);
  const int64_t ldx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = packed.data_ptr<T>();
  T* op = out.data_ptr<T>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * TILE, nn = std::min<int64_t>(TILE, N - n0);
    const T* tile = wp + t * K * TILE;
    const T* b = bias ? bias + n0 : nullptr;
    int64_t m = 0;
    for (; m + MR <= M; m += MR)
      tile_pass<T, MR, 1>(xp + m * ldx, ldx, tile, K, b, op + m * N + n0, N, nn);
    const T* xm = xp + m * ldx;
    T* om = op + m * N + n0;
    switch (M - m) {
      case 5: tile_pass<T, 5, 1>(xm, ldx, tile, K, b, om, N, nn); break;
      case 4: tile_pass<T, 4, 1>(xm, ldx, tile, K, b, om, N, nn); break;
      case 3: tile_pass<T, 3, 1>(xm, ldx, tile, K, b, om, N, nn); break;
      case 2: tile_pass<T, 2, 2>(xm, ldx, tile, K, b, om, N, nn); break;
      case 1: tile_pass<T, 1, 4>(xm, ldx, tile, K, b, om, N, nn); break;
      default: break;
    }
  }
}

bool supported_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

}  // namespace

int64_t skinny_gemm_tile() { return TILE; }

at::Tensor skinny_gemm_pack(at::Tensor weight) {
  TORCH_CHECK(supported_dtype(weight) && weight.dim() == 2 && weight.device().is_cpu(),
              "weight: float32 or bfloat16 [out, in] on CPU");
  const int64_t N = weight.size(0), K = weight.size(1), tiles = (N + TILE - 1) / TILE;
  // one transposing copy over the full tiles (ATen runs it on every thread); only a partial
  // last tile needs its padding columns zeroed
  at::Tensor packed = at::empty({tiles, K, TILE}, weight.options());
  const int64_t full = N / TILE;
  if (full > 0)
    packed.narrow(0, 0, full).copy_(
        weight.narrow(0, 0, full * TILE).reshape({full, TILE, K}).transpose(1, 2));
  if (full < tiles) {
    at::Tensor last = packed[full];
    last.zero_();
    last.narrow(1, 0, N - full * TILE).copy_(weight.narrow(0, full * TILE, N - full * TILE).t());
  }
  return packed;
}

at::Tensor skinny_gemm(at::Tensor x, at::Tensor packed, int64_t out_features,
                       c10::optional<at::Tensor> bias) {
  TORCH_CHECK(supported_dtype(x) && x.dim() == 2 && x.stride(1) == 1,
              "x: float32 or bfloat16 [rows, in] with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.dim() == 3
                  && packed.size(1) == x.size(1) && packed.size(2) == TILE
                  && packed.is_contiguous() && packed.size(0) * TILE >= out_features
                  && packed.size(0) * TILE < out_features + TILE,
              "packed: from skinny_gemm_pack, in x's dtype and with x's in_features");
  TORCH_CHECK(!bias || (bias->scalar_type() == x.scalar_type() && bias->dim() == 1
                        && bias->size(0) == out_features && bias->is_contiguous()),
              "bias: [out_features] contiguous, in x's dtype");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    skinny_rows<c10::BFloat16>(x, packed, bias ? bias->data_ptr<c10::BFloat16>() : nullptr, out);
  else
    skinny_rows<float>(x, packed, bias ? bias->data_ptr<float>() : nullptr, out);
  return out;
}
