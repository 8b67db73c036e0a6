// Paged prefill attention in bfloat16 on AMX tiles: the new tokens of each sequence (a whole
// prompt, or a chunk after a cached prefix) attend causally over the sequence's paged K/V.
// Contract: kernels.torch_attention.paged_prefill_attention, bfloat16 only, on a CPU where
// torch's brgemm runs on the tile unit (kernels.cpu_paged_attention chooses it).
//
// A flash-attention loop on torch's brgemm (oneDNN's JIT micro-kernel), in two phases:
// - Each (sequence, KV head) copies its keys and values out of the cache blocks once, into
//   the tile unit's pair-interleaved (VNNI) layouts: K transposed, [head_dim / 2][keys][2],
//   the B operand of the scores; V as [keys / 2][head_dim][2], the B operand of the output.
//   Keys are padded with zeros to a whole chunk.
// - A work item is QB new tokens of one sequence times the query heads of one KV head (GQA
//   stacks them as rows, so each key chunk is read once for the group). For each chunk of KC
//   keys up to the item's last visible key: scores = Q K^T on the tiles (float32), then an
//   online softmax in float32 (bottom-right causal: new token i of L, in a sequence of S,
//   sees keys 0..S-L+i), and O += P V on the tiles after O is rescaled by the new row maxima.
//   As in torch's bfloat16 flash attention, P is rounded to bfloat16 for the product and the
//   row sums add the float32 weights. The scale is folded into the exponent (one multiply-add
//   a score), so the row maximum is taken of the unscaled scores.
// - Chunks wholly after a row's last key are never computed, so causal prefill does half a
//   square's work; the item's last chunk stops at its last key rounded up to 32 (one tile's
//   keys), so the diagonal costs at most a tile of keys past it.
// torch's own CPU flash attention (the SDPA this replaces) works the same way but takes one
// sequence per call, after its keys are gathered out of the blocks into new tensors
// (docs/notes/cpu-attention-findings.md, "Prefill attention", compares the two).
#include "cpu_tensor.h"

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_vec.h"

namespace {

using namespace pdc;
using bf16 = c10::BFloat16;

constexpr int64_t QB = 32;   // new tokens per work item
constexpr int64_t KC = 256;  // keys per chunk

// 0, 1, ..., W - 1: a lane's index, to mask the keys past a row's last
const vf lane = [] {
  vf v;
  for (int i = 0; i < W; ++i) v[i] = float(i);
  return v;
}();
const vf minus_inf = splat(-std::numeric_limits<float>::infinity());
constexpr float LOG2E = 1.44269504088896341f;

struct Sequence {
  int64_t q_begin, new_tokens, len, padded;  // padded: len rounded up to KC
  int64_t pack_offset;                        // of its (KV head 0) packs, in elements
};

struct Item {
  int64_t seq, kv_head, first;  // first: index of its first new token within the sequence
};

// Copy one (sequence, KV head)'s keys and values from the blocks into the VNNI layouts.
void pack_kv(const bf16* k_cache, const bf16* v_cache, const int32_t* table, int64_t block_size,
             int64_t block_stride, int64_t token_stride, int64_t len, int64_t padded, int64_t D,
             bf16* kt, bf16* vp) {
  std::fill(kt, kt + padded * D, bf16(0.f));
  std::fill(vp, vp + padded * D, bf16(0.f));
  for (int64_t s = 0; s < len; ++s) {
    const int64_t at = int64_t(table[s / block_size]) * block_stride + s % block_size * token_stride;
    const bf16* k = k_cache + at;
    const bf16* v = v_cache + at;
    for (int64_t d = 0; d < D; ++d) kt[((d / 2) * padded + s) * 2 + (d % 2)] = k[d];
    bf16* vrow = vp + ((s / 2) * D) * 2 + (s % 2);
    for (int64_t d = 0; d < D; ++d) vrow[d * 2] = v[d];
  }
}

}  // namespace

at::Tensor amx_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                 at::Tensor block_tables, at::Tensor cu_seqlens_q,
                                 at::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1,
              "q: bfloat16 [tokens, heads, head_dim] with contiguous head rows");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == at::kBFloat16,
              "caches: bfloat16 [num_blocks, block_size, kv_heads, head_dim]");
  const int64_t block_stride = paged_block_stride(k_cache, v_cache);
  const int64_t H = q.size(1), D = q.size(2), block_size = k_cache.size(1),
                KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % W == 0, "the caches' head_dim must be q's, a multiple of ",
              W);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t G = H / KVH, B = seq_lens.size(0);
  const auto tables = block_tables.to(at::kInt).contiguous();
  const auto starts = cu_seqlens_q.to(at::kLong).contiguous();
  const auto lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(starts.numel() == B + 1 && tables.size(0) == B,
              "cu_seqlens_q has batch + 1 entries and block_tables one row per sequence");
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t max_blocks = tables.size(1);
  std::vector<Sequence> seqs(B);
  std::vector<Item> items;
  int64_t pack_elems = 0;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t new_tokens = st[i + 1] - st[i], len = ln[i];
    TORCH_CHECK(new_tokens >= 0 && st[i + 1] <= q.size(0), "cu_seqlens_q out of order or range");
    TORCH_CHECK(len >= new_tokens, "sequence ", i, ": seq_len ", len,
                " is shorter than its new tokens (", new_tokens, ")");
    TORCH_CHECK((len + block_size - 1) / block_size <= max_blocks, "sequence ", i, ": seq_len ",
                len, " is beyond its block table (", max_blocks, " blocks)");
    const int64_t padded = (len + KC - 1) / KC * KC;
    seqs[i] = {st[i], new_tokens, len, padded, pack_elems};
    if (new_tokens > 0) {
      pack_elems += 2 * KVH * padded * D;
      for (int64_t g = 0; g < KVH; ++g)
        for (int64_t first = 0; first < new_tokens; first += QB) items.push_back({i, g, first});
    }
  }
  auto out = at::empty_like(q);
  const int64_t total = st[B];
  if (total < q.size(0)) out.narrow(0, total, q.size(0) - total).zero_();  // padding rows
  if (items.empty()) return out;
  // later tokens see more keys: the largest items first, for the dynamic schedule
  std::sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    const int64_t ka = seqs[a.seq].len - seqs[a.seq].new_tokens + a.first;
    const int64_t kb = seqs[b.seq].len - seqs[b.seq].new_tokens + b.first;
    return ka > kb;
  });
  // uninitialized: pack_kv writes every element, the padding zeros included
  const auto packs_t = at::empty({pack_elems}, q.options());
  bf16* packs = packs_t.data_ptr<bf16>();
  const bf16* kc = k_cache.data_ptr<bf16>();
  const bf16* vc = v_cache.data_ptr<bf16>();
  const int32_t* tb = tables.data_ptr<int32_t>();
  const int64_t token_stride = KVH * D;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const Sequence& s = seqs[w / KVH];
      const int64_t g = w % KVH;
      if (s.new_tokens == 0) continue;
      bf16* kt = packs + s.pack_offset + 2 * g * s.padded * D;
      pack_kv(kc + g * D, vc + g * D, tb + (w / KVH) * max_blocks, block_size, block_stride,
              token_stride, s.len, s.padded, D, kt, kt + s.padded * D);
    }
  });
  const bf16* qp = q.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t q_tok = q.stride(0), q_head = q.stride(1);
  const float fscale = static_cast<float>(scale);
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(std::min<int64_t>(at::get_num_threads(), n_items))
  {
    const int64_t R = G * QB;  // rows of a work item: row r is head r / QB, token r % QB
    std::vector<bf16> qs(R * D), pb(R * KC);
    std::vector<float> sc(R * KC), o(R * D), row_max(R), row_sum(R);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& item = items[it];
      const Sequence& s = seqs[item.seq];
      const int64_t rows_t = std::min(QB, s.new_tokens - item.first);
      const int64_t prefix = s.len - s.new_tokens;
      const bf16* kt = packs + s.pack_offset + 2 * item.kv_head * s.padded * D;
      const bf16* vp = kt + s.padded * D;
      // the group's query rows, stacked; rows past the item's tokens are zero
      std::fill(qs.begin(), qs.end(), bf16(0.f));
      for (int64_t h = 0; h < G; ++h)
        for (int64_t t = 0; t < rows_t; ++t)
          std::copy_n(qp + (s.q_begin + item.first + t) * q_tok + (item.kv_head * G + h) * q_head,
                      D, qs.data() + (h * QB + t) * D);
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      const int64_t last_key = prefix + item.first + rows_t;  // keys [0, last_key) seen by some row
      for (int64_t c0 = 0; c0 < last_key; c0 += KC) {
        // the last chunk ends at the item's last key, rounded up to a tile's 32 keys
        const int64_t kw = std::min(KC, (last_key - c0 + 31) / 32 * 32);
        at::native::cpublas::brgemm(R, kw, D, D, s.padded, KC, /*add_C=*/false, qs.data(),
                                    kt + c0 * 2, sc.data());
        for (int64_t r = 0; r < R; ++r) {
          const int64_t t = r % QB;
          const float* srow = sc.data() + r * KC;
          bf16* prow = pb.data() + r * KC;
          // keys this row sees in the chunk: up to its own position (bottom-right causal)
          const int64_t visible = t < rows_t ? std::min(kw, prefix + item.first + t + 1 - c0) : 0;
          if (visible <= 0) {
            std::fill(prow, prow + kw, bf16(0.f));
            continue;
          }
          // the maximum of the unscaled scores: the scale is positive
          vf mx = minus_inf;
          for (int64_t j = 0; j < kw; j += W) {
            vf v = load(srow + j);
            if (j + W > visible) v = lane + float(j) < float(visible) ? v : minus_inf;
            mx = mx > v ? mx : v;
          }
          const float m_old = row_max[r], m_new = std::max(m_old, hmax(mx) * fscale);
          // exp(m_old - m_new), skipped when the maximum held (most chunks after the first)
          const float alpha = m_new == m_old ? 1.f : std::isinf(m_old) ? 0.f : std::exp(m_old - m_new);
          // exp(score * scale - m_new) = 2^(score * c - m_new log2 e): one multiply-add
          const float c = fscale * LOG2E, offset = -m_new * LOG2E;
          vf sum = vf{};
          for (int64_t j = 0; j < kw; j += W) {
            vf p = exp2_nonpositive(load(srow + j) * c + offset);
            if (j + W > visible) p = lane + float(j) < float(visible) ? p : vf{};
            sum += p;
            store(prow + j, p);
          }
          row_max[r] = m_new;
          row_sum[r] = row_sum[r] * alpha + hsum(sum);
          if (alpha != 1.f) {
            float* orow = o.data() + r * D;
            for (int64_t d = 0; d < D; d += W) store(orow + d, load(orow + d) * alpha);
          }
        }
        at::native::cpublas::brgemm(R, D, kw, KC, D, D, /*add_C=*/true, pb.data(),
                                    vp + c0 * D, o.data());
      }
      for (int64_t h = 0; h < G; ++h)
        for (int64_t t = 0; t < rows_t; ++t) {
          const int64_t r = h * QB + t;
          const float inv = 1.f / row_sum[r];
          bf16* dst = op + (s.q_begin + item.first + t) * out.stride(0) +
                      (item.kv_head * G + h) * out.stride(1);
          const float* orow = o.data() + r * D;
          for (int64_t d = 0; d < D; d += W) store(dst + d, load(orow + d) * inv);
        }
    }
    at::native::cpublas::brgemm_release();
  }
  return out;
}
