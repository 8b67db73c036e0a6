// SIMD helpers of the C++ CPU kernels: vectors of the machine's widest unit written with
// GCC/Clang vector extensions (16 floats with AVX-512, 8 otherwise: AVX2 and narrower), and a
// call-free exp, so the loops around it vectorize.
//
// The width follows the machine because a vector wider than its registers is not free: GCC
// lowers each 64-byte vector on an AVX2 CPU to a pair of registers, runs out of its 16 for
// the rows a kernel keeps in them, and builds every broadcast of a scalar through the stack;
// decode attention ran at half the speed it does with 8-float vectors there
// (docs/notes/cpu-gemm-findings.md, "A skinny GEMM for decode").
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pdc {

#if defined(__AVX512F__)
constexpr int W = 16;  // floats per vector
#else
constexpr int W = 8;
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));  // W bfloat16 bit patterns

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// bfloat16 is the top half of a float32: widening is a shift; narrowing rounds to nearest,
// ties to even (as torch's casts do; the kernels' outputs are finite), in one instruction
// where the CPU has AVX-512 BF16: the bit arithmetic otherwise takes six, which made the
// bfloat16 layer ops bound by their instructions rather than their bytes. That instruction
// flushes values below bfloat16's smallest normal (~1.2e-38) to zero, where torch's cast
// keeps them subnormal.
inline vf load(const c10::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu bits = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline void store(c10::BFloat16* p, vf v) {
#if defined(__AVX512BF16__)
  if constexpr (W == 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v))));
    return;
  }
#endif
  vu bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const vh h = __builtin_convertvector(bits, vh);
  std::memcpy(p, &h, sizeof h);
}

inline vf splat(float x) { return vf{} + x; }

// How far ahead a kernel streaming K/V token by token asks for the rows it will read. The
// hardware prefetchers lose the stream at every block boundary (the next block is anywhere in
// the cache) and keep too few lines in flight per thread; rows requested a few blocks ahead,
// through the block table, keep the memory system busy (docs/notes/cpu-attention-findings.md: the
// distances tried).
constexpr int64_t PREFETCH_TOKENS = 48;

// v as the kernels' element type T holds it: itself for float, rounded for bfloat16 (what
// torch's bfloat16 ops do to each intermediate result).
template <typename T>
inline vf round_to(vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
#if defined(__AVX512BF16__)
    if constexpr (W == 16) {
      const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v)));
      return reinterpret_cast<vf>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
#endif
    T tmp[W];
    store(tmp, v);
    return load(tmp);
  }
}

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// Rotate-half RoPE of one vector of a head's halves: (x1, x2) -> (x1 cos - x2 sin,
// x2 cos + x1 sin), with cos/sin rounded to T first and every product rounded to T, as the
// reference computes in T; a store to T rounds the sums.
template <typename T>
inline void rotate_half(vf& x1, vf& x2, vf cos, vf sin) {
  const vf a = x1, b = x2, c = round_to<T>(cos), s = round_to<T>(sin);
  x1 = round_to<T>(a * c) - round_to<T>(b * s);
  x2 = round_to<T>(b * c) + round_to<T>(a * s);
}

// Ask for the cache lines of the `n` elements from p on.
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * int64_t(sizeof(T)); b += 64) __builtin_prefetch(bytes + b);
}

// A tree of halving steps of `op` (+ or max) over the lanes, where a lane-by-lane loop
// compiles to ~2 scalar instructions a lane: decode attention finishes one dot product per
// token and query row, the attention kernels take one maximum per row and key chunk.
template <typename Op>
inline float reduce_lanes(vf v, Op op) {
  typedef float v4 __attribute__((vector_size(16)));
  v4 b;
  if constexpr (W == 16) {
    typedef float v8 __attribute__((vector_size(32)));
    const v8 a = op(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
    b = op(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
  } else {
    b = op(__builtin_shufflevector(v, v, 0, 1, 2, 3), __builtin_shufflevector(v, v, 4, 5, 6, 7));
  }
  return op(op(b[0], b[2]), op(b[1], b[3]));
}

inline float hsum(vf v) {
  return reduce_lanes(v, [](auto x, auto y) { return x + y; });
}

inline float hmax(vf v) {
  return reduce_lanes(v, [](auto x, auto y) { return x > y ? x : y; });
}

// fn(std::integral_constant<int, NV>{}) for a head_dim = NV * W the kernels are specialized
// for (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256: multiples of 16, so of W), R{} for
// any other: the one list of head dims both attention kernels instantiate.
template <typename R, typename Fn>
R by_head_dim(int64_t head_dim, Fn fn) {
  switch (head_dim) {
    case 16: return fn(std::integral_constant<int, 16 / W>{});
    case 32: return fn(std::integral_constant<int, 32 / W>{});
    case 48: return fn(std::integral_constant<int, 48 / W>{});
    case 64: return fn(std::integral_constant<int, 64 / W>{});
    case 80: return fn(std::integral_constant<int, 80 / W>{});
    case 96: return fn(std::integral_constant<int, 96 / W>{});
    case 112: return fn(std::integral_constant<int, 112 / W>{});
    case 128: return fn(std::integral_constant<int, 128 / W>{});
    case 160: return fn(std::integral_constant<int, 160 / W>{});
    case 192: return fn(std::integral_constant<int, 192 / W>{});
    case 256: return fn(std::integral_constant<int, 256 / W>{});
    default: return R{};
  }
}

// Coefficients of 2^f on f in [-0.5, 0.5] (degree 6), highest first.
constexpr float EXP2_POLY[] = {1.535336188319500e-4f, 1.339887440266574e-3f,
                               9.618437357674640e-3f, 5.550332471162809e-2f,
                               2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

// exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) split into 2^n * 2^f,
// f in [-0.5, 0.5], 2^f by the polynomial, 2^n by adding n to the exponent bits. Relative
// error (against float64 exp, checked over [-87, 0]) below 2e-7 on [-1, 0], growing to 4e-6
// at -87 from rounding x log2(e) to float32: at that size a softmax weight is negligible
// beside the max's 1.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float y = x * 1.44269504088896341f;
  const float n = std::floor(y + 0.5f);
  const float f = y - n;
  const float p6 = EXP2_POLY[0] * f + EXP2_POLY[1];  // Horner, spelled out so the loop
  const float p5 = p6 * f + EXP2_POLY[2];            // calling this vectorizes
  const float p4 = p5 * f + EXP2_POLY[3];
  const float p3 = p4 * f + EXP2_POLY[4];
  const float p2 = p3 * f + EXP2_POLY[5];
  float p = p2 * f + EXP2_POLY[6];
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

// 2^f on W lanes for f in [-0.5, 0.5], by the polynomial.
inline vf exp2_poly(vf f) {
  vf p = splat(EXP2_POLY[0]);
  for (int i = 1; i < 7; ++i) p = p * f + EXP2_POLY[i];
  return p;
}

// 2^y on W lanes for y in [-126, 0]: 2^n * 2^f, f in [-0.5, 0.5] by the polynomial, 2^n by
// adding n to the exponent bits; n = -floor(0.5 - y) (truncation of a non-negative value),
// which rounds ties down instead of up: f stays in [-0.5, 0.5] either way.
inline vf exp2_in_range(vf y) {
  const vi n = -__builtin_convertvector(0.5f - y, vi);
  const vf f = y - __builtin_convertvector(n, vf);
  vf p = exp2_poly(f);
  vi bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += n << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

// The scalar version's exp on W lanes.
inline vf exp_nonpositive(vf x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  return exp2_in_range(x * 1.44269504088896341f);
}

// 2^y for y <= 0 on W lanes (a softmax weight with its scale folded into y). With AVX-512, n
// is one rounding instruction and 2^n one `vscalefps`, which takes any n (2^-200 is 0), so y
// needs no clamp and four instructions a vector go; elsewhere y is clamped to where the
// exponent bits hold 2^n.
inline vf exp2_nonpositive(vf y) {
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    const __m512 yy = reinterpret_cast<__m512>(y);
    const __m512 n = _mm512_roundscale_ps(yy, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf f = reinterpret_cast<vf>(_mm512_sub_ps(yy, n));
    return reinterpret_cast<vf>(_mm512_scalef_ps(reinterpret_cast<__m512>(exp2_poly(f)), n));
  }
#endif
  return exp2_in_range(y < -125.0f ? splat(-125.0f) : y);
}

// 1 / d for d in [1, 2]: with AVX-512 the 14-bit estimate and one Newton step (within an ulp
// or two of float32 division, at a fraction of its cost: a vector divide made silu_and_mul
// bound by that one instruction), else the division.
inline vf reciprocal(vf d) {
#if defined(__AVX512F__)
  if constexpr (W == 16) {
    const vf r = reinterpret_cast<vf>(_mm512_rcp14_ps(reinterpret_cast<__m512>(d)));
    return r * (2.f - d * r);
  }
#endif
  return 1.f / d;
}

// x * sigmoid(x), with exp only of non-positive arguments (no overflow).
inline vf silu(vf x) {
  const vf e = exp_nonpositive(x < 0.f ? x : -x);  // exp(-|x|)
  const vf r = reciprocal(1.f + e);
  const vf sig = x < 0.f ? e * r : r;
  return x * sig;
}

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

}  // namespace pdc
