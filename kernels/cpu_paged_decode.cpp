// Paged decode attention on CPU: one query token per sequence over its paged K/V, reading
// each cached K and V element once, straight from the cache blocks (no gathered copy).
// Contract: kernels.torch_attention.paged_decode_attention (float32 caches).
//
// Per work item, pass 1 computes the query heads' scores over the sequence, pass 2 the softmax,
// pass 3 the weighted sum of V, all in float32. Items run on ATen's intra-op thread pool, so
// the engine's torch thread count applies.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q: float32 [S, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32,
              "caches: float32");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables, seq_lens: int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_dim, "head shapes");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t row = num_kv_heads * head_dim;  // floats between consecutive tokens of a block
  const float fscale = static_cast<float>(scale);

  // Work item = (sequence, run of KV heads). Within a token, the KV heads are adjacent in the
  // cache, so an item that takes all of them reads whole rows front to back: few items (one
  // per sequence) when the batch alone keeps the threads busy, heads split otherwise.
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::min(num_kv_heads, std::max<int64_t>(1, (2 * threads + num_seqs - 1) / num_seqs));
  const int64_t heads_per_item = (num_kv_heads + splits - 1) / splits;
  at::parallel_for(0, num_seqs * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / splits;
      const int64_t h0 = (item % splits) * heads_per_item;
      const int64_t h1 = std::min(num_kv_heads, h0 + heads_per_item);
      const int64_t rows = (h1 - h0) * group;  // query heads of this item
      const int64_t len = lens[seq];
      TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "seq_len outside its block table");
      const int32_t* table = tables + seq * max_blocks;
      const float* qh = qp + (seq * num_heads + h0 * group) * head_dim;
      scores.assign(rows * len, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const float* k = kp + (int64_t(table[t / block_size]) * block_size + t % block_size) * row
                         + h0 * head_dim;
        for (int64_t r = 0; r < rows; ++r) {
          const float* qr = qh + r * head_dim;
          const float* kr = k + (r / group) * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * kr[d];
          scores[r * len + t] = dot * fscale;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * len;
        const float m = *std::max_element(s, s + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) sum += (s[t] = std::exp(s[t] - m));
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      acc.assign(rows * head_dim, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const float* v = vp + (int64_t(table[t / block_size]) * block_size + t % block_size) * row
                         + h0 * head_dim;
        for (int64_t r = 0; r < rows; ++r) {
          const float p = scores[r * len + t];
          const float* vr = v + (r / group) * head_dim;
          float* a = acc.data() + r * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vr[d];
        }
      }
      std::copy(acc.begin(), acc.end(), op + (seq * num_heads + h0 * group) * head_dim);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
}
