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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace pdc;

template <typename T>
struct Seq {
  const T* k;            // the cache's K, offset to this KV head
  const T* v;            // the cache's V, offset to this KV head
  const int32_t* table;  // this sequence's block table
  int64_t len, block_size, row;  // tokens, tokens per block, elements between tokens
  const T* token(const T* base, int64_t t) const {
    return base + (int64_t(table[t / block_size]) * block_size + t % block_size) * row;
  }
};

// R query rows of one KV head with head_dim = NV * W: q rows at q (head_dim apart), out rows
// likewise; scores: scratch of R * len floats.
template <int NV, int R, typename T>
void attend_rows(const Seq<T>& s, const T* q, T* out, float scale, float* scores) {
  vf qv[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) qv[r][c] = load(q + r * NV * W + c * W);
  for (int64_t t = 0; t < s.len; ++t) {
    const T* k = s.token(s.k, t);
    if (t + PREFETCH_TOKENS < s.len) prefetch_row(s.token(s.k, t + PREFETCH_TOKENS), NV * W);
    vf kv[NV];
    for (int c = 0; c < NV; ++c) kv[c] = load(k + c * W);
    for (int r = 0; r < R; ++r) {
      vf dot = qv[r][0] * kv[0];
      for (int c = 1; c < NV; ++c) dot += qv[r][c] * kv[c];
      scores[r * s.len + t] = hsum(dot) * scale;
    }
  }
  for (int r = 0; r < R; ++r) {
    float* sc = scores + r * s.len;
    const float m = *std::max_element(sc, sc + s.len);
    float sum = 0.f;
    for (int64_t t = 0; t < s.len; ++t) sum += (sc[t] = exp_nonpositive(sc[t] - m));
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < s.len; ++t) sc[t] *= inv;
  }
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
    for (int c = 0; c < NV; ++c) store(out + r * NV * W + c * W, acc[r][c]);
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
torch::Tensor decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
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
  auto out = torch::empty_like(q);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t row = num_kv_heads * head_dim;  // elements between consecutive tokens of a block
  const float fscale = static_cast<float>(scale);

  // Work item = (sequence, run of KV heads): few items (one per sequence) when the batch alone
  // keeps the threads busy, heads split otherwise.
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::min(num_kv_heads, std::max<int64_t>(1, (2 * threads + num_seqs - 1) / num_seqs));
  const int64_t heads_per_item = (num_kv_heads + splits - 1) / splits;
  at::parallel_for(0, num_seqs * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / splits;
      const int64_t h0 = (item % splits) * heads_per_item;
      const int64_t h1 = std::min(num_kv_heads, h0 + heads_per_item);
      const int64_t len = lens[seq];
      TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "seq_len outside its block table");
      scores.resize(4 * len);
      for (int64_t h = h0; h < h1; ++h) {
        const Seq<T> s{kp + h * head_dim, vp + h * head_dim, tables + seq * max_blocks, len,
                    block_size, row};
        const int64_t offset = (seq * num_heads + h * group) * head_dim;
        attend(s, qp + offset, op + offset, group, fscale, scores.data());
      }
    }
  });
  return out;
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(q.dim() == 3 && (dtype == torch::kFloat32 || dtype == torch::kBFloat16),
              "q: float32 or bfloat16 [S, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "caches: q's dtype");
  if (dtype == torch::kBFloat16)
    return decode<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale);
  return decode<float>(q, k_cache, v_cache, block_tables, seq_lens, scale);
}
