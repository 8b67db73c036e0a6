// The elementwise ops of a decoder layer on CPU, each one pass over its data: RMSNorm fused
// with the residual add, SiLU-and-mul, rotate-half RoPE in place, and the store of new K/V
// rows into the paged cache. Contracts: kernels.reference, in float32 or bfloat16
// (kernels.cpu_fused_ops.supports); math in float32, with bfloat16 intermediates rounded where
// the reference's ops round them. Eager torch runs each of these as several ops with a
// temporary between each; here each element is read and written once. Rows are split over
// OpenMP threads (torch's thread count) once a batch has enough of them to pay for waking the
// threads.
#include "cpu_tensor.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "cpu_kernels.h"
#include "cpu_vec.h"

namespace {

using namespace pdc;

constexpr int64_t PARALLEL_ROWS = 16;  // fewer rows run on the calling thread alone

inline int threads_for(int64_t rows) { return rows >= PARALLEL_ROWS ? at::get_num_threads() : 1; }

bool supported(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(supported(t) && t.dim() == 2 && t.stride(1) == 1,
              name, ": float32 or bfloat16 [rows, n] with contiguous rows");
}

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(supported(t) && t.dim() == 3 && t.stride(2) == 1,
              name, ": float32 or bfloat16 [tokens, heads, head_dim] with contiguous head rows");
}

// Each intermediate is rounded to T where kernels.reference's torch ops round it (the sum with
// the residual, the normalized value), so bfloat16 results match the reference's to its last
// rounding.
template <typename T>
void rms_norm_rows(const at::Tensor& x, const T* w, float eps, const at::Tensor* residual,
                   at::Tensor& sum, at::Tensor& out) {
  const int64_t rows = x.size(0), hidden = x.size(1), full = hidden / W * W;
#pragma omp parallel for num_threads(threads_for(rows))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x.data_ptr<T>() + r * x.stride(0);
    const T* rr = residual ? residual->data_ptr<T>() + r * residual->stride(0) : nullptr;
    T* hr = sum.data_ptr<T>() + r * sum.stride(0);
    T* orow = out.data_ptr<T>() + r * hidden;
    const T* h = rr ? hr : xr;
    vf ss = vf{};
    float tail = 0.f;
    for (int64_t i = 0; i < full; i += W) {
      if (rr) store(hr + i, load(xr + i) + load(rr + i));
      const vf v = load(h + i);
      ss += v * v;
    }
    for (int64_t i = full; i < hidden; ++i) {
      if (rr) hr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
      const float v = static_cast<float>(h[i]);
      tail += v * v;
    }
    const float inv = 1.f / std::sqrt((hsum(ss) + tail) / hidden + eps);
    for (int64_t i = 0; i < full; i += W)
      store(orow + i, load(w + i) * round_to<T>(load(h + i) * inv));
    for (int64_t i = full; i < hidden; ++i)
      orow[i] = static_cast<T>(static_cast<float>(w[i]) * round_to<T>(static_cast<float>(h[i]) * inv));
  }
}

template <typename T>
void silu_and_mul_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), d = x.size(1) / 2, full = d / W * W;
#pragma omp parallel for num_threads(threads_for(rows))
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = x.data_ptr<T>() + r * x.stride(0);
    const T* u = g + d;
    T* o = out.data_ptr<T>() + r * d;
    for (int64_t i = 0; i < full; i += W) store(o + i, round_to<T>(silu(load(g + i))) * load(u + i));
    for (int64_t i = full; i < d; ++i)
      o[i] = static_cast<T>(round_to<T>(silu(static_cast<float>(g[i]))) * static_cast<float>(u[i]));
  }
}

// Rotate-half RoPE of one token's heads in place: x = x1 | x2 -> x1 cos - x2 sin | x2 cos + x1 sin,
// cos/sin rounded to T first and every product and sum rounded to T, as the reference does.
template <typename T>
void rotate_heads(T* x, int64_t heads, int64_t head_stride, int64_t half, const float* cos,
                  const float* sin) {
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = x + h * head_stride;
    T* x2 = x1 + half;
    int64_t i = 0;
    for (; i + W <= half; i += W) {
      vf a = load(x1 + i), b = load(x2 + i);
      rotate_half<T>(a, b, load(cos + i), load(sin + i));
      store(x1 + i, a);
      store(x2 + i, b);
    }
    for (; i < half; ++i) {
      const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
      const float c = round_to<T>(cos[i]), s = round_to<T>(sin[i]);
      x1[i] = static_cast<T>(round_to<T>(a * c) - round_to<T>(b * s));
      x2[i] = static_cast<T>(round_to<T>(b * c) + round_to<T>(a * s));
    }
  }
}

template <typename T>
void rotate_tokens(const int64_t* pos, at::Tensor& q, at::Tensor& k, const float* cache) {
  const int64_t tokens = q.size(0), head_dim = q.size(2), half = head_dim / 2;
#pragma omp parallel for num_threads(threads_for(tokens))
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cos = cache + pos[t] * head_dim;
    rotate_heads(q.data_ptr<T>() + t * q.stride(0), q.size(1), q.stride(1), half, cos, cos + half);
    rotate_heads(k.data_ptr<T>() + t * k.stride(0), k.size(1), k.stride(1), half, cos, cos + half);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(at::Tensor x, at::Tensor weight,
                                                      double eps,
                                                      c10::optional<at::Tensor> residual) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous()
              && weight.numel() == x.size(1), "weight: [hidden] in x's dtype");
  if (residual) check_rows(*residual, "residual");
  TORCH_CHECK(!residual || (residual->sizes() == x.sizes()
                            && residual->scalar_type() == x.scalar_type()),
              "residual: x's shape and dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  auto sum = residual ? at::empty({x.size(0), x.size(1)}, x.options()) : x;
  const at::Tensor* res = residual ? &*residual : nullptr;
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows<c10::BFloat16>(x, weight.data_ptr<c10::BFloat16>(), float(eps), res, sum, out);
  else
    rms_norm_rows<float>(x, weight.data_ptr<float>(), float(eps), res, sum, out);
  return {out, sum};
}

at::Tensor silu_and_mul(at::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x: gate | up, an even width");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    silu_and_mul_rows<c10::BFloat16>(x, out);
  else
    silu_and_mul_rows<float>(x, out);
  return out;
}

at::Tensor rope_positions(const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                          int64_t tokens, int64_t head_dim) {
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2
              && cos_sin_cache.is_contiguous() && cos_sin_cache.size(1) == head_dim,
              "cos_sin_cache: float32 [max_position, head_dim]");
  auto pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == tokens, "positions: one per token");
  const int64_t max_position = cos_sin_cache.size(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_position, "position ", pp[t], " outside the cache");
  return pos;
}

void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k,
                      at::Tensor cos_sin_cache) {
  check_heads(q, "q");
  check_heads(k, "k");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "q and k: one dtype");
  TORCH_CHECK(k.size(2) == q.size(2) && k.size(0) == q.size(0), "q and k: one row per token, one head_dim");
  const auto pos = rope_positions(positions, cos_sin_cache, q.size(0), q.size(2));
  const int64_t* pp = pos.data_ptr<int64_t>();
  if (q.scalar_type() == at::kBFloat16)
    rotate_tokens<c10::BFloat16>(pp, q, k, cos_sin_cache.data_ptr<float>());
  else
    rotate_tokens<float>(pp, q, k, cos_sin_cache.data_ptr<float>());
}

void store_kv_cache(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                    at::Tensor slot_mapping) {
  check_heads(k, "k");
  check_heads(v, "v");
  TORCH_CHECK(k_cache.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k.scalar_type()
              && v.scalar_type() == k.scalar_type(), "caches: in k's dtype");
  const int64_t block_stride = paged_block_stride(k_cache, v_cache);
  const int64_t tokens = k.size(0), heads = k.size(1), head_dim = k.size(2);
  TORCH_CHECK(k_cache.size(2) == heads && k_cache.size(3) == head_dim && v.sizes() == k.sizes(),
              "k/v rows do not match the cache's heads");
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == tokens, "slot_mapping: one slot per token");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  const int64_t row = heads * head_dim;
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= -1 && sp[t] < num_slots, "slot ", sp[t], " outside the cache");
  const int64_t size = k.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
#pragma omp parallel for num_threads(threads_for(tokens))
  for (int64_t t = 0; t < tokens; ++t) {
    if (sp[t] < 0) continue;  // padding
    const int64_t at = sp[t] / block_size * block_stride + sp[t] % block_size * row;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kc + (at + h * head_dim) * size,
                  kp + (t * k.stride(0) + h * k.stride(1)) * size, head_dim * size);
      std::memcpy(vc + (at + h * head_dim) * size,
                  vp + (t * v.stride(0) + h * v.stride(1)) * size, head_dim * size);
    }
  }
}
