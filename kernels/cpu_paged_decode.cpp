// Paged decode attention on CPU: one query token per sequence over its paged K/V, reading
// each cached K and V element once, straight from the cache blocks (no gathered copy).
// Contract: kernels.torch_attention.paged_decode_attention (float32 or bfloat16
// caches; a head_dim that cpu_vec.h's by_head_dim lists: kernels.cpu_paged_attention.supports).
//
// Per work item (a sequence and a run of its KV heads), for each KV head, its query heads are
// taken a few rows at a time: pass 1 computes their scores over the sequence, pass 2 the
// softmax, pass 3 the weighted sum of V, all in float32. The rows' query and accumulator
// vectors stay in registers while one pass streams K (or V) token by token, which is what
// makes the kernel bound by reading the cache rather than by loads and stores of partial sums.
// SIMD: cpu_vec.h. Items run on ATen's intra-op thread pool, so the engine's torch thread
// count applies.
#include "cpu_tensor.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_vec.h"

namespace {

using namespace pdc;

template <typename T>
struct Seq {
  const T* k;            // the cache's K, offset to this KV head
  const T* v;            // the cache's V, offset to this KV head
  const int32_t* table;  // this sequence's block table
  int64_t len, block_size, row;  // tokens, tokens per block, elements between tokens
  int64_t block_stride;           // elements between blocks
  int shift;  // log2(block_size) for a power of two, else -1
  // A 64-bit division per token and pass would cost more than the token's multiply-adds:
  // block sizes are powers of two in practice, and take a shift and a mask. Forced inline,
  // as are the passes' per-token lambdas: the compiler left them as calls, and every vector
  // register is caller-saved, so each call spilled and reloaded the rows' accumulators.
  __attribute__((always_inline)) const T* token(const T* base, int64_t t) const {
    if (shift >= 0)
      return base + int64_t(table[t >> shift]) * block_stride + (t & (block_size - 1)) * row;
    return base + int64_t(table[t / block_size]) * block_stride + t % block_size * row;
  }
};

inline int log2_or_minus_one(int64_t n) {
  return n > 0 && (n & (n - 1)) == 0 ? __builtin_ctzll(static_cast<unsigned long long>(n)) : -1;
}

// Halves of two vectors of partial sums added so that each result lane pair-sums lanes of one
// input: with H = W / (2 * (number of tokens each input already covers)), every group of 2H
// lanes of the result holds H lanes of x's matching group, then H of y's, each the sum of the
// first and second half of that group. Applied log2(W) times to the dot vectors of W tokens it
// leaves one total per lane, the tokens in bit-reversed lane order (`unreverse` restores it):
// W dot products finished with about 3 shuffles and adds a token instead of a horizontal sum
// each.
template <int H>
inline vf fold(vf x, vf y) {
#if defined(__AVX512F__)  // W == 16
  {
    if constexpr (H == 8) {
      return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    } else if constexpr (H == 4) {
      return __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
             + __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    } else if constexpr (H == 2) {
      return __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
             + __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    } else {
      return __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
             + __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
  }
#else  // W == 8
  {
    if constexpr (H == 4) {
      return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
    } else if constexpr (H == 2) {
      return __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13)
             + __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
    } else {
      return __builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14)
             + __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
    }
  }
#endif
}

inline vf unreverse(vf v) {
#if defined(__AVX512F__)
  return __builtin_shufflevector(v, v, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
#else
  return __builtin_shufflevector(v, v, 0, 4, 2, 6, 1, 5, 3, 7);
#endif
}

// The dot vectors `leaf(t, d)` gives for N consecutive tokens from t (d[r]: row r's W partial
// sums for token t), folded: out[r] is the vector `fold` makes of them (N = W: each lane one
// token's score, bit-reversed).
template <int N, int R, typename Leaf>
__attribute__((always_inline)) inline void fold_tokens(int64_t t, const Leaf& leaf, vf (&out)[R]) {
  if constexpr (N == 1) {
    leaf(t, out);
  } else {
    vf a[R], b[R];
    fold_tokens<N / 2, R>(t, leaf, a);
    fold_tokens<N / 2, R>(t + N / 2, leaf, b);
    for (int r = 0; r < R; ++r) out[r] = fold<W / N>(a[r], b[r]);
  }
}

// Softmax of sc[0, len) in place without the division: returns 1 / the sum of the exps.
inline float softmax_unnormalized(float* sc, int64_t len) {
  const int64_t main = len / W * W;
  vf mv = splat(sc[0]);
  for (int64_t t = 0; t < main; t += W) {
    const vf x = load(sc + t);
    mv = x > mv ? x : mv;
  }
  float m = hmax(mv);
  for (int64_t t = main; t < len; ++t) m = std::max(m, sc[t]);
  vf sv{};
  for (int64_t t = 0; t < main; t += W) {
    const vf e = exp_nonpositive(load(sc + t) - m);
    store(sc + t, e);
    sv += e;
  }
  float sum = hsum(sv);
  for (int64_t t = main; t < len; ++t) sum += (sc[t] = exp_nonpositive(sc[t] - m));
  return 1.f / sum;
}

// Pass 1 of `attend_rows`: R rows' scaled scores over the sequence into scores (row r at
// r * len), W tokens at a time.
template <int NV, int R, typename T>
void score_rows(const Seq<T>& s, const T* q, float scale, float* scores) {
  const auto pass = [&](const auto& leaf) {
    const int64_t main = s.len / W * W;
    for (int64_t t = 0; t < main; t += W) {
      vf dots[R];
      fold_tokens<W, R>(t, leaf, dots);
      for (int r = 0; r < R; ++r) store(scores + r * s.len + t, unreverse(dots[r]) * scale);
    }
    for (int64_t t = main; t < s.len; ++t) {
      vf dots[R];
      leaf(t, dots);
      for (int r = 0; r < R; ++r) scores[r * s.len + t] = hsum(dots[r]) * scale;
    }
  };
#if defined(__AVX512BF16__)
  // bfloat16 K times bfloat16 q, pairs of products summed into float32 lanes by one
  // instruction (vdpbf16ps): no widening of K, half the multiply-adds.
  if constexpr (std::is_same_v<T, c10::BFloat16> && NV % 2 == 0) {
    constexpr int NB = NV / 2;  // 32-element bfloat16 vectors per row
    __m512bh qb[R][NB];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NB; ++c)
        qb[r][c] = (__m512bh)_mm512_loadu_si512(q + r * NV * W + c * 2 * W);
    pass([&](int64_t t, vf (&d)[R]) __attribute__((always_inline)) {
      const T* k = s.token(s.k, t);
      if (t + PREFETCH_TOKENS < s.len) prefetch_row(s.token(s.k, t + PREFETCH_TOKENS), NV * W);
      __m512bh kb[NB];
      for (int c = 0; c < NB; ++c) kb[c] = (__m512bh)_mm512_loadu_si512(k + c * 2 * W);
      for (int r = 0; r < R; ++r) {
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[r][0], kb[0]);
        for (int c = 1; c < NB; ++c) dot = _mm512_dpbf16_ps(dot, qb[r][c], kb[c]);
        d[r] = dot;
      }
    });
    return;
  }
#endif
  vf qv[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) qv[r][c] = load(q + r * NV * W + c * W);
  pass([&](int64_t t, vf (&d)[R]) __attribute__((always_inline)) {
    const T* k = s.token(s.k, t);
    if (t + PREFETCH_TOKENS < s.len) prefetch_row(s.token(s.k, t + PREFETCH_TOKENS), NV * W);
    vf kv[NV];
    for (int c = 0; c < NV; ++c) kv[c] = load(k + c * W);
    for (int r = 0; r < R; ++r) {
      vf dot = qv[r][0] * kv[0];
      for (int c = 1; c < NV; ++c) dot += qv[r][c] * kv[c];
      d[r] = dot;
    }
  });
}

// R query rows of one KV head with head_dim = NV * W, q rows at q (head_dim apart), out rows
// likewise; scores: scratch of R * len floats. Pass 1 takes the scores (`score_rows`), pass 2
// exponentiates them, pass 3 sums V weighted by them and scales each row once by 1 / its sum.
template <int NV, int R, typename T>
void attend_rows(const Seq<T>& s, const T* q, T* out, float scale, float* scores) {
  score_rows<NV, R, T>(s, q, scale, scores);
  float inv[R];
  for (int r = 0; r < R; ++r) inv[r] = softmax_unnormalized(scores + r * s.len, s.len);
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = vf{};
  for (int64_t t = 0; t < s.len; ++t) {
    const T* v = s.token(s.v, t);
    if (t + PREFETCH_TOKENS < s.len) prefetch_row(s.token(s.v, t + PREFETCH_TOKENS), NV * W);
    vf vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load(v + c * W);
    for (int r = 0; r < R; ++r) {
      const float p = scores[r * s.len + t];
      for (int c = 0; c < NV; ++c) acc[r][c] += p * vv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) store(out + r * NV * W + c * W, acc[r][c] * inv[r]);
}

// All `group` query rows of one KV head, up to RMAX at a time (so rows x head_dim of
// accumulators fit in the vector registers): each pass over K and V serves that many rows.
template <int NV, typename T>
void attend_head(const Seq<T>& s, const T* q, T* out, int64_t group, float scale,
                 float* scores) {
  constexpr int HD = NV * W;
  constexpr int RMAX = HD <= 64 ? 4 : (HD <= 128 ? 2 : 1);
  for (int64_t r = 0; r < group;) {
    const int64_t rows = std::min<int64_t>(RMAX, group - r);
    const T* qr = q + r * NV * W;
    T* o = out + r * NV * W;
    switch (rows) {
      case 4: attend_rows<NV, (RMAX >= 4 ? 4 : 1), T>(s, qr, o, scale, scores); break;
      case 3: attend_rows<NV, (RMAX >= 3 ? 3 : 1), T>(s, qr, o, scale, scores); break;
      case 2: attend_rows<NV, (RMAX >= 2 ? 2 : 1), T>(s, qr, o, scale, scores); break;
      default: attend_rows<NV, 1, T>(s, qr, o, scale, scores); break;
    }
    r += rows;
  }
}

template <typename T>
using HeadFn = void (*)(const Seq<T>&, const T*, T*, int64_t, float, float*);

template <typename T>
HeadFn<T> head_fn(int64_t head_dim) {
  return by_head_dim<HeadFn<T>>(head_dim, [](auto nv) -> HeadFn<T> {
    return attend_head<decltype(nv)::value, T>;
  });
}

}  // namespace

bool supports_head_dim(int64_t head_dim) { return head_fn<float>(head_dim) != nullptr; }

namespace {

template <typename T>
at::Tensor decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables, seq_lens: int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_dim, "head shapes");
  const HeadFn<T> attend = head_fn<T>(head_dim);
  TORCH_CHECK(attend != nullptr, "head_dim ", head_dim, " unsupported");
  auto out = at::empty_like(q);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t row = num_kv_heads * head_dim;  // elements between consecutive tokens of a block
  const int64_t block_stride = paged_block_stride(k_cache, v_cache);
  const float fscale = static_cast<float>(scale);
  const int shift = log2_or_minus_one(block_size);

  // Work item = (sequence, run of KV heads): few items (one per sequence) when the batch alone
  // keeps the threads busy, heads split otherwise.
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::min(num_kv_heads, std::max<int64_t>(1, (2 * threads + num_seqs - 1) / num_seqs));
  const int64_t heads_per_item = (num_kv_heads + splits - 1) / splits;
  for (int64_t seq = 0; seq < num_seqs; ++seq)
    TORCH_CHECK(lens[seq] >= 1 && lens[seq] <= max_blocks * block_size,
                "seq_len outside its block table");
  // Items are claimed one at a time: a thread the OS takes off its core for a while (a busy
  // small machine runs the gateway and the client beside the engine) leaves its share to the
  // other threads instead of stalling them at the end of the step.
  const int64_t items = num_seqs * splits;
#pragma omp parallel num_threads(std::min(threads, items))
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t seq = item / splits;
      const int64_t h0 = (item % splits) * heads_per_item;
      const int64_t h1 = std::min(num_kv_heads, h0 + heads_per_item);
      const int64_t len = lens[seq];
      scores.resize(4 * len);
      for (int64_t h = h0; h < h1; ++h) {
        const Seq<T> s{kp + h * head_dim, vp + h * head_dim, tables + seq * max_blocks, len,
                    block_size, row, block_stride, shift};
        const int64_t offset = (seq * num_heads + h * group) * head_dim;
        attend(s, qp + offset, op + offset, group, fscale, scores.data());
      }
    }
  }
  return out;
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache,
                                  at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(q.dim() == 3 && (dtype == at::kFloat || dtype == at::kBFloat16),
              "q: float32 or bfloat16 [S, H, D]");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "caches: q's dtype");
  if (dtype == at::kBFloat16)
    return decode<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale);
  return decode<float>(q, k_cache, v_cache, block_tables, seq_lens, scale);
}
