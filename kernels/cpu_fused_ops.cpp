// The elementwise ops of a decoder layer on CPU, each one pass over its data: RMSNorm fused
// with the residual add, SiLU-and-mul, rotate-half RoPE in place, and the store of new K/V
// rows into the paged cache. Contracts: kernels.reference (float32 only:
// kernels.cpu_fused_ops.supports). Eager torch runs each of these as several ops with a
// temporary between each; here each element is read and written once. Rows are split over
// OpenMP threads (torch's thread count) once a batch has enough of them to pay for waking the
// threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "cpu_vec.h"

namespace {

using namespace pdc;

constexpr int64_t PARALLEL_ROWS = 16;  // fewer rows run on the calling thread alone

inline int threads_for(int64_t rows) { return rows >= PARALLEL_ROWS ? at::get_num_threads() : 1; }

// x * sigmoid(x), with exp only of non-positive arguments (no overflow).
inline vf silu(vf x) {
  const vf e = exp_nonpositive(x < 0.f ? x : -x);  // exp(-|x|)
  const vf sig = x < 0.f ? e / (1.f + e) : 1.f / (1.f + e);
  return x * sig;
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.stride(1) == 1,
              name, ": float32 [rows, n] with contiguous rows");
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> fused_add_rms_norm(torch::Tensor x, torch::Tensor weight,
                                                            double eps,
                                                            c10::optional<torch::Tensor> residual) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous()
              && weight.numel() == x.size(1), "weight: float32 [hidden]");
  if (residual) check_rows(*residual, "residual");
  TORCH_CHECK(!residual || residual->sizes() == x.sizes(), "residual: x's shape");
  const int64_t rows = x.size(0), hidden = x.size(1);
  auto out = torch::empty({rows, hidden}, x.options());
  auto sum = residual ? torch::empty({rows, hidden}, x.options()) : x;
  const float* w = weight.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  const int64_t full = hidden / W * W;
#pragma omp parallel for num_threads(threads_for(rows))
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data_ptr<float>() + r * x.stride(0);
    const float* rr = residual ? residual->data_ptr<float>() + r * residual->stride(0) : nullptr;
    float* hr = sum.data_ptr<float>() + r * sum.stride(0);
    float* orow = out.data_ptr<float>() + r * hidden;
    vf ss = vf{};
    float tail = 0.f;
    for (int64_t i = 0; i < full; i += W) {
      vf h = load(xr + i);
      if (rr) {
        h += load(rr + i);
        store(hr + i, h);
      }
      ss += h * h;
    }
    for (int64_t i = full; i < hidden; ++i) {
      const float h = rr ? xr[i] + rr[i] : xr[i];
      if (rr) hr[i] = h;
      tail += h * h;
    }
    const float inv = 1.f / std::sqrt((hsum(ss) + tail) / hidden + feps);
    const float* hsrc = rr ? hr : xr;
    for (int64_t i = 0; i < full; i += W) store(orow + i, load(w + i) * (load(hsrc + i) * inv));
    for (int64_t i = full; i < hidden; ++i) orow[i] = w[i] * (hsrc[i] * inv);
  }
  return {out, sum};
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0, "x: gate | up, an even width");
  auto out = torch::empty({rows, d}, x.options());
  const int64_t full = d / W * W;
#pragma omp parallel for num_threads(threads_for(rows))
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = x.data_ptr<float>() + r * x.stride(0);
    const float* u = g + d;
    float* o = out.data_ptr<float>() + r * d;
    for (int64_t i = 0; i < full; i += W) store(o + i, silu(load(g + i)) * load(u + i));
    for (int64_t i = full; i < d; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
  return out;
}

namespace {

// Rotate-half RoPE of one token's heads in place: x = x1 | x2 -> x1 cos - x2 sin | x2 cos + x1 sin.
void rotate_heads(float* x, int64_t heads, int64_t head_stride, int64_t half, const float* cos,
                  const float* sin) {
  for (int64_t h = 0; h < heads; ++h) {
    float* x1 = x + h * head_stride;
    float* x2 = x1 + half;
    int64_t i = 0;
    for (; i + W <= half; i += W) {
      const vf a = load(x1 + i), b = load(x2 + i), c = load(cos + i), s = load(sin + i);
      store(x1 + i, a * c - b * s);
      store(x2 + i, b * c + a * s);
    }
    for (; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cos[i] - b * sin[i];
      x2[i] = b * cos[i] + a * sin[i];
    }
  }
}

void check_heads(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.dim() == 3 && t.stride(2) == 1,
              name, ": float32 [tokens, heads, head_dim] with contiguous head rows");
}

}  // namespace

void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k,
                      torch::Tensor cos_sin_cache) {
  check_heads(q, "q");
  check_heads(k, "k");
  TORCH_CHECK(cos_sin_cache.scalar_type() == torch::kFloat32 && cos_sin_cache.is_contiguous()
              && cos_sin_cache.size(1) == q.size(2) && k.size(2) == q.size(2),
              "cos_sin_cache: float32 [max_position, head_dim]");
  const auto pos = positions.to(torch::kInt64).contiguous();
  const int64_t tokens = q.size(0), head_dim = q.size(2), half = head_dim / 2;
  TORCH_CHECK(k.size(0) == tokens && pos.numel() == tokens, "q, k and positions: one row per token");
  const int64_t max_position = cos_sin_cache.size(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_position, "position ", pp[t], " outside the cache");
  const float* cache = cos_sin_cache.data_ptr<float>();
#pragma omp parallel for num_threads(threads_for(tokens))
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cos = cache + pp[t] * head_dim;
    rotate_heads(q.data_ptr<float>() + t * q.stride(0), q.size(1), q.stride(1), half, cos, cos + half);
    rotate_heads(k.data_ptr<float>() + t * k.stride(0), k.size(1), k.stride(1), half, cos, cos + half);
  }
}

void store_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping) {
  check_heads(k, "k");
  check_heads(v, "v");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32
              && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches: contiguous float32");
  const int64_t tokens = k.size(0), heads = k.size(1), head_dim = k.size(2);
  TORCH_CHECK(k_cache.size(2) == heads && k_cache.size(3) == head_dim && v.sizes() == k.sizes(),
              "k/v rows do not match the cache's heads");
  const auto slots = slot_mapping.to(torch::kInt64).contiguous();
  TORCH_CHECK(slots.numel() == tokens, "slot_mapping: one slot per token");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), row = heads * head_dim;
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= -1 && sp[t] < num_slots, "slot ", sp[t], " outside the cache");
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
#pragma omp parallel for num_threads(threads_for(tokens))
  for (int64_t t = 0; t < tokens; ++t) {
    if (sp[t] < 0) continue;  // padding
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kc + sp[t] * row + h * head_dim,
                  k.data_ptr<float>() + t * k.stride(0) + h * k.stride(1), head_dim * sizeof(float));
      std::memcpy(vc + sp[t] * row + h * head_dim,
                  v.data_ptr<float>() + t * v.stride(0) + h * v.stride(1), head_dim * sizeof(float));
    }
  }
}
