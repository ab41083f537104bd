// waferline's CPU operators: the headers, compile-time switches and small vector helpers every part uses.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <torch/custom_class.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // the few-row bf16 and int4 products' vector kernels
#endif
#if !(defined(__AVX512BF16__) && defined(__AVX512F__)) && defined(__AVX2__) && defined(__FMA__)
#define WAFERLINE_BF16_AVX2 1  // few-row bf16 products: widen the weight to fp32 in registers, fp32 FMAs
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>  // madvise: the tile copies in huge pages
#endif

namespace {

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

// the sum of s[0..L) as 16 partial sums (s[l] into partial l % 16) added pairwise at the end: the same number whatever
// zeros follow s[L - 1]. A softmax's denominator over a batch's keys, padded to its longest row (a shorter row's keys
// past its own end masked: probability 0), so equals that row's alone; a vectorised reduction grouped them by L.
inline float sum_by16(const float* s, int64_t L) {
  float p[16] = {};
  int64_t l = 0;
  for (; l + 16 <= L; l += 16)
    for (int i = 0; i < 16; ++i) p[i] += s[l + i];
  for (int i = 0; l + i < L; ++i) p[i] += s[l + i];
  for (int w = 8; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) p[i] += p[i + w];
  return p[0];
}

inline float dotf(const float* a, const float* b, int64_t n) {  // sum of a[i] b[i], vectorised (fp32 throughout)
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// a . b_t for the 4 rows b_t = b + t ld (t < 4): four independent sums, where one dotf after another waits on its
// single chain's FMA latency (attention's scores and output projections over short rows)
inline void dot4(const float* a, const float* b, int64_t ld, int64_t n, float* out) {
  const float *b0 = b, *b1 = b + ld, *b2 = b + 2 * ld, *b3 = b + 3 * ld;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < n; ++i) {
    s0 += a[i] * b0[i];
    s1 += a[i] * b1[i];
    s2 += a[i] * b2[i];
    s3 += a[i] * b3[i];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

// exp(x) in fp32 for loops the compiler vectorises (std::exp is a libm call per element, ~4 ns here: with it silu_mul
// ran 5x slower than ATen's silu on a 256-row prefill): x = n ln2 + r with n = round(x / ln2) and r in two parts
// (Cody-Waite), e^r by its degree-7 Taylor polynomial (|r| <= ln2 / 2: truncation < 1e-8 relative), 2^n through the
// exponent bits (n clamped to [-127, 128]: 0 below x ~ -87.3, inf above ~ 88.4, where std::exp is still denormal or
// finite; silu and sigmoid do not see the difference). Within ~1.2 ulp of exp elsewhere (checked over [-87, 88]).
inline float vexp(float x) {
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t k = static_cast<int32_t>(n);
  k = k < -127 ? -127 : (k > 128 ? 128 : k);  // (integer clamps: float ones made the compiler split the loop)
  const int32_t bits = (k + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// bf16 <-> fp32 for loops the compiler vectorises (c10::BFloat16's conversions element by element keep a loop
// scalar): the same round-to-nearest-even, NaN -> 0x7FC0, as c10. Other dtypes convert element by element.
inline float bf16_bits_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint16_t f32_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return f != f ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
template <typename T>
inline float round_to(float x) { return f32(static_cast<T>(x)); }  // x rounded to T and back
template <>
inline float round_to<float>(float x) { return x; }
template <>
inline float round_to<c10::BFloat16>(float x) { return bf16_bits_f32(f32_bf16_bits(x)); }
template <typename T>
inline void load_f32(const T* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = f32(s[i]);
}
template <>
inline void load_f32<c10::BFloat16>(const c10::BFloat16* s, float* d, int64_t n) {
  const uint16_t* b = reinterpret_cast<const uint16_t*>(s);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = bf16_bits_f32(b[i]);
}
template <typename T>
inline void store_f32(const float* s, T* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<T>(s[i]);
}
template <>
inline void store_f32<c10::BFloat16>(const float* s, c10::BFloat16* d, int64_t n) {
  uint16_t* b = reinterpret_cast<uint16_t*>(d);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) b[i] = f32_bf16_bits(s[i]);
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

std::atomic<int64_t> g_team_halves{0};  // layer halves run on a thread team (tests check which path ran)
int64_t team_halves() { return g_team_halves.load(); }
std::atomic<bool> g_portable{false};  // tests run the portable loop on CPUs that have the AVX512-BF16 or AVX2 kernel

bool use_portable(bool on) { return g_portable.exchange(on); }

// the int4 and int8 products' 16-bit-integer activation kernels (int4_rows_i16, int8_rows_i16), on by default; off:
// the fp32 kernels (exact products of the dequantized weight and x), for tests and same-process comparisons
std::atomic<bool> g_int_act{true};

bool use_int_activations(bool on) { return g_int_act.exchange(on); }

// 16-bit fixed point of activations (the integer kernels: int4.h, int8.h): over a span of x, sx = max|x| / 32767 and
// xi = round(x / sx), so x ~ sx * xi with |xi| <= 32767; an all-zero span has sx = 0 and xi = 0. A span holding a NaN
// or an infinity has sx = NaN and xi = 0: every product it enters is NaN (the float product's is NaN or infinite),
// where the maximum (it skips NaN) and the clamp alone made it finite numbers. A span whose max|x| is below 32767
// times the smallest normal float (2^-126; max|x| < ~3.9e-34) has sx = 2^-126 instead (|xi| < 32767 still): there
// max|x| / 32767 is a denormal and 32767 / max|x| may pass the largest float, an infinity that turned every xi into
// -32767 (x * inf: the float -> int conversion's out-of-range value, or NaN for x = 0).
inline float fixed16_scale(float mx, float* sx) {  // -> 1 / sx for a span of finite max|x| mx (0: all zero); sets sx
  constexpr float tiny = std::numeric_limits<float>::min();  // 2^-126 (1 / tiny = 2^126: both exact)
  if (!(mx > 0.f)) {
    *sx = 0.f;
    return 0.f;
  }
  if (mx < 32767.f * tiny) {
    *sx = tiny;
    return 1.f / tiny;
  }
  *sx = mx / 32767.f;
  return 32767.f / mx;
}
inline float fixed16_inv(const float* x, int64_t n, float* sx) {  // -> 1 / sx (0 for an all-zero span); sets sx
  float mx = 0.f;
  bool finite = true;
  for (int64_t k = 0; k < n; ++k) {
    const float a = std::fabs(x[k]);
    mx = std::max(mx, a);
    finite = finite && a <= std::numeric_limits<float>::max();
  }
  if (!finite) {
    *sx = std::numeric_limits<float>::quiet_NaN();
    return 0.f;
  }
  return fixed16_scale(mx, sx);
}
inline int16_t fixed16(float v, float inv) {
  const float r = std::nearbyint(v * inv);  // (NaN: a non-finite span's value, inv 0)
  return r != r ? 0 : static_cast<int16_t>(std::clamp(static_cast<int>(r), -32767, 32767));
}

// v at least n long: a buffer kept from call to call grows and never shrinks, so a call after a larger one does not
// zero-fill what it then overwrites (a decode step's MoE jobs change size from step to step)
template <typename V>
inline void at_least(V& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

}  // namespace
