// Paged prefill attention on CPU: the new tokens of each sequence (a whole prompt, or a chunk
// after a cached prefix) attend causally over the sequence's paged K/V.
// Contract: kernels.torch_attention.paged_prefill_attention (float32 or bfloat16
// caches; a head_dim that cpu_vec.h's by_head_dim lists: kernels.cpu_paged_attention.supports).
//
// Many query rows share each key here, unlike decode, so the scores are a small GEMM per work
// item: the rows of up to QT new tokens times the query heads of one KV head, against key
// tiles of 16 tokens. Each (sequence, KV head) first copies its K transposed ([head_dim][len])
// so one vector load gives one dimension of 16 keys, which every row's accumulator takes by
// a broadcast FMA; the transpose costs one read of K and serves all of the sequence's rows
// (sequences are taken in groups whose copies fit KT_BUDGET).
// Then, per row, a softmax over its visible keys (bottom-right causal: new token i of L, in a
// sequence of S, sees keys 0..S-L+i), and the weighted sum of V streamed token by token from
// the cache blocks, a few rows' accumulators in registers at a time. Two passes over the
// scores instead of an online softmax: a tile's scores (48 rows of a 32k-token context are
// 6 MiB) stay in the last-level cache between the passes. All math in float32. Items are claimed dynamically by the threads (OpenMP, at torch's
// thread count), largest first, since later tiles of a sequence see more keys.
#include "cpu_tensor.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_vec.h"

namespace {

using namespace pdc;

constexpr int QT = 16;  // new tokens per work item
constexpr int RC = 12;  // rows per pass of the score GEMM (accumulators in registers)
constexpr int64_t KT_BUDGET = int64_t(1) << 24;  // floats of transposed K held at once (64 MiB)

template <typename T>
struct Tile {
  const float* kt;       // K of this sequence and KV head, transposed: [head_dim][spad]
  int64_t spad;          // keys per row of kt: seq_len rounded up to a vector
  const T* v;            // the cache's V, offset to this KV head
  const int32_t* table;  // this sequence's block table
  int64_t block_size, row;  // tokens per block, elements between tokens of a block
  int64_t block_stride;     // elements between blocks
  int64_t first_pos;     // position of the tile's first new token
  int64_t num_pos;       // new tokens in the tile
  int64_t offset(int64_t key) const {  // of a key's row in the cache, in elements
    return int64_t(table[key / block_size]) * block_stride + key % block_size * row;
  }
};

template <typename T>
struct Scratch {
  std::vector<float> scores;
  std::vector<const T*> q;
  std::vector<T*> out;
};

// scores[r][Wj..Wj+W) = scale * q_r . K[Wj..Wj+W) for key tiles j < ntiles.
template <int NV, typename T>
void score_tiles(const Tile<T>& t, const T* const* q, int rows, int64_t ntiles, float scale,
                 float* scores) {
  for (int64_t j = 0; j < ntiles; ++j) {
    const float* kt = t.kt + j * W;
    for (int r0 = 0; r0 < rows; r0 += RC) {
      const int rn = std::min(RC, rows - r0);
      vf acc[RC];
      for (int r = 0; r < RC; ++r) acc[r] = vf{};
      if (rn == RC) {  // the common case, unrolled at compile time
        for (int d = 0; d < NV * W; ++d) {
          const vf k = load(kt + d * t.spad);
          for (int r = 0; r < RC; ++r) acc[r] += static_cast<float>(q[r0 + r][d]) * k;
        }
      } else {
        for (int d = 0; d < NV * W; ++d) {
          const vf k = load(kt + d * t.spad);
          for (int r = 0; r < rn; ++r) acc[r] += static_cast<float>(q[r0 + r][d]) * k;
        }
      }
      for (int r = 0; r < rn; ++r) store(scores + (r0 + r) * t.spad + j * W, acc[r] * scale);
    }
  }
}

// One row's scores over keys [0, visible) -> softmax weights, zero from `visible` up to
// `width` (the keys later rows of the tile see), in place.
void softmax_row(float* s, int64_t visible, int64_t width) {
  const int64_t tiles = (visible + W - 1) / W;
  for (int64_t k = visible; k < tiles * W; ++k) s[k] = -INFINITY;
  vf m = splat(-INFINITY);
  for (int64_t j = 0; j < tiles; ++j) {
    const vf x = load(s + j * W);
    m = x > m ? x : m;
  }
  const float mx = hmax(m);
  vf sum = vf{};
  for (int64_t j = 0; j < tiles; ++j) {
    const vf e = exp_nonpositive(load(s + j * W) - mx);
    store(s + j * W, e);
    sum += e;
  }
  const float inv = 1.f / hsum(sum);
  for (int64_t j = 0; j < tiles; ++j) store(s + j * W, load(s + j * W) * inv);
  std::fill(s + tiles * W, s + width, 0.f);
}

// out_r = sum over keys [0, nkeys) of weight_r[k] * V[k], RV rows at a time.
template <int NV, typename T>
void weighted_values(const Tile<T>& t, const float* weights, int rows, int64_t nkeys,
                     T* const* out) {
  constexpr int HD = NV * W;
  constexpr int RV = HD <= 32 ? 8 : (HD <= 64 ? 6 : (HD <= 128 ? 3 : 1));
  for (int r0 = 0; r0 < rows; r0 += RV) {
    const int rn = std::min(RV, rows - r0);
    vf acc[RV][NV];
    for (int r = 0; r < RV; ++r)
      for (int c = 0; c < NV; ++c) acc[r][c] = vf{};
    for (int64_t k = 0; k < nkeys; ++k) {
      const T* v = t.v + t.offset(k);
      if (k + PREFETCH_TOKENS < nkeys) prefetch_row(t.v + t.offset(k + PREFETCH_TOKENS), NV * W);
      vf vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = load(v + c * W);
      for (int r = 0; r < rn; ++r) {
        const float p = weights[(r0 + r) * t.spad + k];
        for (int c = 0; c < NV; ++c) acc[r][c] += p * vv[c];
      }
    }
    for (int r = 0; r < rn; ++r)
      for (int c = 0; c < NV; ++c) store(out[r0 + r] + c * W, acc[r][c]);
  }
}

// The tile's rows: row i * group + g is new token i's query head g of this KV head (q and
// out rows in `scratch`).
template <int NV, typename T>
void attend_tile(const Tile<T>& t, int64_t group, float scale, Scratch<T>& scratch) {
  const int rows = static_cast<int>(t.num_pos * group);
  const int64_t nkeys = t.first_pos + t.num_pos;  // keys the tile's last token sees
  const int64_t ntiles = (nkeys + W - 1) / W;
  scratch.scores.resize(static_cast<size_t>(rows) * t.spad);
  float* scores = scratch.scores.data();
  score_tiles<NV, T>(t, scratch.q.data(), rows, ntiles, scale, scores);
  for (int64_t i = 0; i < t.num_pos; ++i)
    for (int64_t g = 0; g < group; ++g)
      softmax_row(scores + (i * group + g) * t.spad, t.first_pos + i + 1, ntiles * W);
  weighted_values<NV, T>(t, scores, rows, nkeys, scratch.out.data());
}

template <typename T>
using TileFn = void (*)(const Tile<T>&, int64_t, float, Scratch<T>&);

template <typename T>
TileFn<T> tile_fn(int64_t head_dim) {
  return by_head_dim<TileFn<T>>(head_dim, [](auto nv) -> TileFn<T> {
    return attend_tile<decltype(nv)::value, T>;
  });
}

struct Item {
  int64_t seq, head, tile;
};

template <typename T>
at::Tensor prefill(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                   at::Tensor block_tables, at::Tensor cu_seqlens_q,
                   at::Tensor seq_lens, double scale) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt, "block_tables: int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  const auto cu = cu_seqlens_q.to(at::kLong).contiguous();
  const auto lens = seq_lens.to(at::kLong).contiguous();
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t num_seqs = lens.size(0);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_dim, "head shapes");
  TORCH_CHECK(cu.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "cu_seqlens_q / block_tables do not match seq_lens");
  const TileFn<T> attend = tile_fn<T>(head_dim);
  TORCH_CHECK(attend != nullptr, "head_dim ", head_dim, " unsupported");
  const int64_t* cup = cu.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  TORCH_CHECK(cup[0] == 0 && cup[num_seqs] <= q.size(0), "cu_seqlens_q outside q");

  std::vector<int64_t> spad(num_seqs);  // keys per row of a transposed K
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t num_new = cup[s + 1] - cup[s];
    TORCH_CHECK(num_new >= 0 && lp[s] >= num_new, "seq_len shorter than its new tokens");
    TORCH_CHECK(lp[s] <= max_blocks * block_size, "seq_len outside its block table");
    spad[s] = num_new > 0 ? (lp[s] + W - 1) / W * W : 0;  // no K copy without new tokens
  }
  auto out = at::zeros_like(q);  // padding rows past cu_seqlens_q[-1] stay zero
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t row = num_kv_heads * head_dim;
  const int64_t block_stride = paged_block_stride(k_cache, v_cache);
  const float fscale = static_cast<float>(scale);
  const int64_t kt_per_key = num_kv_heads * head_dim;

  // Sequences go in groups whose transposed K fits KT_BUDGET floats (a longer one alone), so
  // a batch of long cached prefixes never holds a second copy of all their K at once.
  std::vector<float> kt;
  std::vector<int64_t> kt_offset;
  std::vector<Item> items;
  for (int64_t first_seq = 0; first_seq < num_seqs;) {
    int64_t end_seq = first_seq, floats = 0;
    kt_offset.assign(1, 0);
    items.clear();
    while (end_seq < num_seqs
           && (end_seq == first_seq || floats + kt_per_key * spad[end_seq] <= KT_BUDGET)) {
      floats += kt_per_key * spad[end_seq];
      kt_offset.push_back(floats);
      const int64_t num_new = cup[end_seq + 1] - cup[end_seq];
      for (int64_t h = 0; h < num_kv_heads; ++h)
        for (int64_t tile = 0; tile < (num_new + QT - 1) / QT; ++tile)
          items.push_back({end_seq, h, tile});
      ++end_seq;
    }
    kt.resize(floats);
    const int64_t pairs = (end_seq - first_seq) * num_kv_heads;
    const int64_t num_items = static_cast<int64_t>(items.size());

#pragma omp parallel num_threads(at::get_num_threads())
    {
#pragma omp for schedule(dynamic, 1)
      for (int64_t pair = 0; pair < pairs; ++pair) {
        const int64_t s = first_seq + pair / num_kv_heads, h = pair % num_kv_heads;
        if (spad[s] == 0) continue;
        float* dst = kt.data() + kt_offset[s - first_seq] + h * head_dim * spad[s];
        const int32_t* table = tables + s * max_blocks;
        const auto src_row = [&](int64_t k) {
          return kp + int64_t(table[k / block_size]) * block_stride + k % block_size * row
                 + h * head_dim;
        };
        for (int64_t k = 0; k < lp[s]; ++k) {
          const T* src = src_row(k);
          if (k + PREFETCH_TOKENS < lp[s]) prefetch_row(src_row(k + PREFETCH_TOKENS), head_dim);
          for (int64_t d = 0; d < head_dim; ++d) dst[d * spad[s] + k] = static_cast<float>(src[d]);
        }
        for (int64_t d = 0; d < head_dim; ++d)
          std::fill(dst + d * spad[s] + lp[s], dst + (d + 1) * spad[s], 0.f);
      }
      Scratch<T> scratch;
#pragma omp for schedule(dynamic, 1)
      for (int64_t n = num_items - 1; n >= 0; --n) {
        const Item& it = items[n];
        const int64_t num_new = cup[it.seq + 1] - cup[it.seq];
        const int64_t first = it.tile * QT, num_pos = std::min<int64_t>(QT, num_new - first);
        const Tile<T> tile{kt.data() + kt_offset[it.seq - first_seq] + it.head * head_dim * spad[it.seq],
                        spad[it.seq], vp + it.head * head_dim, tables + it.seq * max_blocks,
                        block_size, row, block_stride, lp[it.seq] - num_new + first, num_pos};
        scratch.q.resize(num_pos * group);
        scratch.out.resize(num_pos * group);
        for (int64_t i = 0; i < num_pos; ++i)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t offset = ((cup[it.seq] + first + i) * num_heads + it.head * group + g)
                                   * head_dim;
            scratch.q[i * group + g] = qp + offset;
            scratch.out[i * group + g] = op + offset;
          }
        attend(tile, group, fscale, scratch);
      }
    }
    first_seq = end_seq;
  }
  return out;
}

}  // namespace

at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache,
                                   at::Tensor v_cache, at::Tensor block_tables,
                                   at::Tensor cu_seqlens_q, at::Tensor seq_lens,
                                   double scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(q.dim() == 3 && (dtype == at::kFloat || dtype == at::kBFloat16),
              "q: float32 or bfloat16 [T, H, D]");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "caches: q's dtype");
  if (dtype == at::kBFloat16)
    return prefill<c10::BFloat16>(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                  scale);
  return prefill<float>(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale);
}
