// waferline's fused CPU operators for the decode step (torch.ops.waferline.*).
//
// Why: a batch-1 decode step of a small MoE is ~1,100 eager aten ops of 2-4 us each; the weights' GEMVs are already
// near one core's memory bandwidth, so the ops around them are what is left to cut. Each operator here replaces a
// chain of eager ops with one call and computes what that chain computes (same dtypes, fp32 where it is fp32, the
// same rounding points to 16 bits); tests/test_kernels.py checks each against the eager path.
//
// Plain C++ loops the compiler vectorises (-O3, `omp simd` reductions), so any CPU with a C++ compiler builds it; the
// exceptions, the few-row bf16 product (AVX512-BF16 intrinsics where the CPU has them, AVX2 + FMA ones where it has
// those) and the int4 and int8 products (AVX2 + FMA; tile copies with AVX512-VNNI), have a portable loop beside them
// for other CPUs. Built with OpenMP, so
// at::parallel_for splits work across torch's threads (torch.set_num_threads).
// Sums of products run in a different order than ATen's, so results agree to float rounding, not bitwise.

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

// ---------------------------------------------------------------- RMSNorm
// out = weight * to(dtype)(x_f32 * rsqrt(mean(x_f32^2) + eps)), the multiply by weight in fp32, rounded once.
template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> tmp(D);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * D;
      T* yr = y + r * D;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < D; ++i) {
        float v = f32(xr[i]);
        tmp[i] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
      for (int64_t i = 0; i < D; ++i) {
        T n = static_cast<T>(tmp[i] * inv);  // the normalised value in the input dtype (a no-op for fp32)
        yr[i] = static_cast<T>(f32(w[i]) * f32(n));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "waferline::rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "waferline::rms_norm: x and weight must share a dtype");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D, "waferline::rms_norm: weight must have ", D, " elements");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto y = at::empty_like(xc);
  const int64_t rows = D ? xc.numel() / D : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "waferline_rms_norm", [&] {
    rms_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, D,
                       static_cast<float>(eps));
  });
  return y;
}

// ---------------------------------------------------------------- SwiGLU: silu(gate) * up
// exp(x) in fp32 for loops the compiler vectorises (std::exp is a libm call per element, ~4 ns here, which made this
// file's silu 5x slower than ATen's on a 256-row prefill): x = n ln2 + r with n = round(x / ln2) and r in two parts
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

// h [..., 2F] = [gate | up] -> [..., F]; silu is rounded to the dtype before the multiply, as the eager chain does.
inline float silu1(float x) { return x / (1.f + vexp(-x)); }

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

// rows of h [rows, >= 2F] (row stride ldh) -> y [rows, F], in fp32 chunks of a row
template <typename T>
void silu_mul_rows(const T* h, T* y, int64_t rows, int64_t F, int64_t ldh) {
  constexpr int64_t CH = 256;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(F, 1)), [&](int64_t r0, int64_t r1) {
    float gb[CH], ub[CH];
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = h + r * ldh;
      const T* u = g + F;
      T* o = y + r * F;
      for (int64_t i0 = 0; i0 < F; i0 += CH) {
        const int64_t n = std::min(CH, F - i0);
        load_f32(g + i0, gb, n);
        load_f32(u + i0, ub, n);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) gb[i] = round_to<T>(silu1(gb[i])) * ub[i];
        store_f32(gb, o + i0, n);
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& h) {
  TORCH_CHECK(h.device().is_cpu(), "waferline::silu_mul: CPU tensors only");
  const int64_t F2 = h.size(-1);
  TORCH_CHECK(F2 % 2 == 0, "waferline::silu_mul: the last dimension must be even");
  auto hc = h.contiguous();
  auto sizes = hc.sizes().vec();
  sizes.back() = F2 / 2;
  auto y = at::empty(sizes, hc.options());
  const int64_t rows = F2 ? hc.numel() / F2 : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hc.scalar_type(), "waferline_silu_mul", [&] {
    silu_mul_rows<scalar_t>(hc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, F2 / 2, F2);
  });
  return y;
}

// ---------------------------------------------------------------- rotary embedding
// x [B, T, H, W] (any dtype), cos2 / sin2 [B, T, d] fp32 as Rotary.cos_sin lays them out (cos twice; -sin then sin).
// The first d channels of each row are rotated in fp32 -- de-interleaved first when ``interleaved`` (x0,x1),(x2,x3)..
// -> [x0,x2,.. | x1,x3,..] -- as rot * cos2 + swap_halves(rot) * sin2, rounded once to x's dtype; the other W - d
// channels pass through. One pass instead of the eager chain's slices, casts, concatenations and products.
template <typename T>
void rope_rows(const T* x, const float* cs, const float* sn, T* y, int64_t BT, int64_t H, int64_t W, int64_t d,
               bool interleaved) {
  const int64_t half = d / 2;
  at::parallel_for(0, BT * H, std::max<int64_t>(1, 16384 / std::max<int64_t>(W, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> rot(d);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * W;
      T* yr = y + r * W;
      const float* c = cs + (r / H) * d;
      const float* s = sn + (r / H) * d;
      if (interleaved) {
        for (int64_t j = 0; j < half; ++j) {
          rot[j] = f32(xr[2 * j]);
          rot[half + j] = f32(xr[2 * j + 1]);
        }
      } else {
        for (int64_t j = 0; j < d; ++j) rot[j] = f32(xr[j]);
      }
      for (int64_t j = 0; j < half; ++j) {
        const float a = rot[j] * c[j];
        yr[j] = static_cast<T>(a + rot[half + j] * s[j]);
      }
      for (int64_t j = half; j < d; ++j) {
        const float a = rot[j] * c[j];
        yr[j] = static_cast<T>(a + rot[j - half] * s[j]);
      }
      for (int64_t j = d; j < W; ++j) yr[j] = xr[j];
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos2, const at::Tensor& sin2, int64_t d, bool interleaved) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 4, "waferline::rope: x must be a CPU tensor [B, T, H, W]");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), W = x.size(3);
  TORCH_CHECK(d > 0 && d % 2 == 0 && d <= W, "waferline::rope: the rotated width must be even and at most W");
  TORCH_CHECK(cos2.scalar_type() == at::kFloat && sin2.scalar_type() == at::kFloat && cos2.numel() == B * T * d &&
                  sin2.numel() == B * T * d,
              "waferline::rope: cos / sin must be fp32 [B, T, d]");
  auto xc = x.contiguous();
  auto c = cos2.contiguous();
  auto s = sin2.contiguous();
  auto y = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "waferline_rope", [&] {
    rope_rows<scalar_t>(xc.data_ptr<scalar_t>(), c.data_ptr<float>(), s.data_ptr<float>(), y.data_ptr<scalar_t>(),
                        B * T, H, W, d, interleaved);
  });
  return y;
}

// ---------------------------------------------------------------- MoE router
// x [N, D] (any dtype; read as fp32), gate_w [E, D] fp32, gate_b [E] fp32 or empty, corr [E] fp32 or empty
// (DeepSeek-V3's e_score_correction_bias). Per token, in fp32: logits = x W^T + b; then either
//   softmax_after_topk: the top-k logits, softmax over them (GPT-OSS); or
//   scores = softmax(logits) | sigmoid(logits); choice = scores + corr; with n_group > 1 and topk_group < n_group only
//   the topk_group groups with the best group score (the sum of its top 2 choices when group_top2, else its max)
//   stay eligible; the top-k choices, weighted by their scores, renormalised (norm) and times ``scaling``.
// -> (weights fp32 [N, k], indices int64 [N, k]), in descending order of the choice, as topk returns them. The
// eager chain is ~12 ops per token batch; the logits' sums run in another order than the BLAS GEMV (float rounding).
inline void top_desc(const float* v, int64_t n, int64_t k, int64_t* out) {  // indices of the k largest, descending
  std::vector<int64_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = i;
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                    [&](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  for (int64_t i = 0; i < k; ++i) out[i] = ids[i];
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& gate_w, const at::Tensor& gate_b,
                                             const at::Tensor& corr, int64_t k, bool softmax_scores,
                                             bool softmax_after_topk, int64_t n_group, int64_t topk_group,
                                             bool group_top2, bool norm, double scaling) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && gate_w.dim() == 2 && gate_w.scalar_type() == at::kFloat,
              "waferline::moe_route: x [N, D] and an fp32 gate [E, D] on CPU");
  const int64_t N = x.size(0), D = x.size(1), E = gate_w.size(0);
  TORCH_CHECK(gate_w.size(1) == D && k >= 1 && k <= E, "waferline::moe_route: gate [E, D] with 1 <= k <= E");
  TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1, "waferline::moe_route: experts must split into groups");
  for (const at::Tensor* t : {&gate_b, &corr}) {
    TORCH_CHECK(t->numel() == 0 || (t->scalar_type() == at::kFloat && t->numel() == E),
                "waferline::moe_route: biases must be fp32 [E] (or empty)");
  }
  auto xf = x.to(at::kFloat).contiguous();
  auto w = gate_w.contiguous();
  auto gb = gate_b.numel() ? gate_b.contiguous() : gate_b;
  auto cb = corr.numel() ? corr.contiguous() : corr;
  const float* xp = xf.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = gb.numel() ? gb.data_ptr<float>() : nullptr;
  const float* cp = cb.numel() ? cb.data_ptr<float>() : nullptr;
  auto weights = at::empty({N, k}, xf.options());
  auto idx = at::empty({N, k}, xf.options().dtype(at::kLong));
  float* op = weights.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t G = n_group, per = E / G;
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(E * D, 1)), [&](int64_t n0, int64_t n1) {
    std::vector<float> lg(E), sc(E), ch(E), gs(G);
    std::vector<int64_t> top(E);
    for (int64_t t = n0; t < n1; ++t) {
      const float* xr = xp + t * D;
      for (int64_t e = 0; e < E; ++e) {
        const float acc = dotf(xr, wp + e * D, D);
        lg[e] = bp ? acc + bp[e] : acc;
      }
      float* wo = op + t * k;
      int64_t* io = ip + t * k;
      if (softmax_after_topk) {
        top_desc(lg.data(), E, k, io);
        float den = 0.f;
        for (int64_t i = 0; i < k; ++i) den += (wo[i] = std::exp(lg[io[i]] - lg[io[0]]));
        for (int64_t i = 0; i < k; ++i) wo[i] /= den;
        continue;
      }
      if (softmax_scores) {
        float mx = ninf, den = 0.f;
        for (int64_t e = 0; e < E; ++e) mx = std::max(mx, lg[e]);
        for (int64_t e = 0; e < E; ++e) den += (sc[e] = std::exp(lg[e] - mx));
        for (int64_t e = 0; e < E; ++e) sc[e] /= den;
      } else {
        for (int64_t e = 0; e < E; ++e) sc[e] = 1.f / (1.f + std::exp(-lg[e]));
      }
      for (int64_t e = 0; e < E; ++e) ch[e] = cp ? sc[e] + cp[e] : sc[e];
      if (G > 1 && topk_group < G) {  // group-limited routing: only the best topk_group groups stay eligible
        for (int64_t g = 0; g < G; ++g) {
          const float* c = ch.data() + g * per;
          if (group_top2 && per >= 2) {
            top_desc(c, per, 2, top.data());
            gs[g] = c[top[0]] + c[top[1]];
          } else {
            gs[g] = *std::max_element(c, c + per);
          }
        }
        top_desc(gs.data(), G, topk_group, top.data());
        std::vector<char> keep(G, 0);
        for (int64_t i = 0; i < topk_group; ++i) keep[top[i]] = 1;
        for (int64_t e = 0; e < E; ++e)
          if (!keep[e / per]) ch[e] = ninf;
      }
      top_desc(ch.data(), E, k, io);
      float sum = 0.f;
      for (int64_t i = 0; i < k; ++i) sum += (wo[i] = sc[io[i]]);
      for (int64_t i = 0; i < k; ++i) {
        if (norm) wo[i] /= sum + 1e-20f;
        if (scaling != 1.0) wo[i] *= static_cast<float>(scaling);
      }
    }
  });
  return {weights, idx};
}

// ---------------------------------------------------------------- few-row linear: y = x W^T for up to 8 rows
// x [M, K] and W [N, K] of one dtype (fp32 / bf16 / fp16), y [M, N] of that dtype, fp32 sums rounded once. The
// decode step's products have 1-8 rows: every weight row is read once from memory and multiplied into all M rows
// while it sits in L1 (ATen's one-row GEMV reads it once too; 2-8 rows otherwise go to oneDNN, slower on the small
// weights of a decode step). With AVX512-BF16 the bf16 products run as pairwise bf16 dot products (vdpbf16ps: exact products,
// fp32 sums); with AVX2 + FMA (no bf16 arithmetic: AMD Zen 2/3, Intel before Cooper Lake) each weight vector is widened
// to fp32 in registers (a bf16 is the top half of an fp32) into fp32 FMAs; elsewhere a portable loop. Rows of W are
// split across threads.
constexpr int64_t FEW_ROWS = 8;

// Whether this CPU multiplies 16-bit matrices natively (what oneDNN's bf16 GEMM needs: AVX512 BW/VL/DQ or
// AVX-NE-CONVERT). Without it ATen's bf16 mm runs a generic loop, ~6-8x slower here (AVX2, 256 x 2048 x 2048: 205 ms)
// than widening both operands to fp32 and running the fp32 GEMM (33 ms): the same products (bf16 x bf16 is exact in
// fp32), fp32 sums, one rounding at the end, as oneDNN's bf16 kernel computes.
#if (defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)) || defined(__AVXNECONVERT__)
constexpr bool kNative16 = true;
#else
constexpr bool kNative16 = false;
#endif

// a 16-bit tensor widened to a new fp32 one, in loops of our own (no dispatched copy ops: a profile of a widened
// product shows one operator, with the conversion in its own time)
at::Tensor widen(const at::Tensor& t) {
  auto c = t.contiguous();
  auto f = at::empty(c.sizes(), c.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, c.scalar_type(), "waferline_widen", [&] {
    const scalar_t* s = c.data_ptr<scalar_t>();
    float* d = f.data_ptr<float>();
    at::parallel_for(0, c.numel(), 1 << 16, [&](int64_t i0, int64_t i1) { load_f32<scalar_t>(s + i0, d + i0, i1 - i0); });
  });
  return f;
}

at::Tensor narrow_to(const at::Tensor& f, at::ScalarType dt) {  // fp32 -> dt, rounded as c10 rounds
  if (dt == at::kFloat) return f;
  auto c = f.contiguous();
  auto y = at::empty(c.sizes(), c.options().dtype(dt));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dt, "waferline_narrow", [&] {
    store_f32<scalar_t>(c.data_ptr<float>(), y.data_ptr<scalar_t>(), c.numel());
  });
  return y;
}

// x [..., K] W^T (+ b) for 16-bit x and W on a CPU without 16-bit GEMMs: both widened to fp32 (exact), ATen's fp32
// product (fp32 sums), rounded once to x's dtype, as a native bf16 GEMM computes it. One operator (the engine's
// linear() calls it for products of more rows than linear_rows takes), so the twin's op count and the profiler see
// one product with a 16-bit weight, priced by the bf16 linear table calibrate measured through the same path.
at::Tensor linear_wide(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && w.dim() == 2 && x.scalar_type() == w.scalar_type(),
              "waferline::linear_wide: CPU x [..., K] and W [N, K] of one dtype");
  if (x.scalar_type() == at::kFloat) return at::linear(x, w, bias);
  std::optional<at::Tensor> bf;
  if (bias.has_value() && bias->defined()) bf = widen(*bias);
  return narrow_to(at::linear(widen(x), widen(w), bf), x.scalar_type());
}

// X [R, K] W^T for X and W of many rows: ATen's mm, widened (linear_wide) where the CPU has no 16-bit GEMM.
at::Tensor mm_rows(const at::Tensor& X, const at::Tensor& W) {
  if (!kNative16 && X.scalar_type() != at::kFloat) return linear_wide(X, W, std::nullopt);
  return at::mm(X, W.t());
}

template <typename T>
void few_rows_generic(const T* x, int64_t M, const T* w, int64_t N, int64_t K, T* y, int64_t ldy) {
  std::vector<float> xf(M * K);
  load_f32<T>(x, xf.data(), M * K);
  at::parallel_for(0, N, std::max<int64_t>(16, 16384 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    std::vector<float> wr(K);
    for (int64_t n = n0; n < n1; ++n) {
      load_f32<T>(w + n * K, wr.data(), K);
      for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = static_cast<T>(dotf(xf.data() + m * K, wr.data(), K));
    }
  });
}

// a huge-page aligned uint8 buffer of ``need`` bytes for a tile copy (advised MADV_HUGEPAGE; under one huge page:
// cache-line aligned only), uninitialised
[[maybe_unused]] at::Tensor tile_buffer(size_t need) {
  constexpr size_t HUGE_PAGE = size_t(2) << 20;
  const size_t align = need >= HUGE_PAGE ? HUGE_PAGE : 64;
  const size_t bytes = std::max<size_t>(1, (need + align - 1) / align) * align;
  void* mem = std::aligned_alloc(align, bytes);
  TORCH_CHECK(mem != nullptr, "waferline: no memory for a ", bytes, "-byte tile copy");
#ifdef MADV_HUGEPAGE
  if (align == HUGE_PAGE) madvise(mem, bytes, MADV_HUGEPAGE);
#endif
  return at::from_blob(mem, {static_cast<int64_t>(need)}, [](void* q) { std::free(q); },
                       at::TensorOptions().dtype(at::kByte));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 fp32 lanes rounded to T and stored to y[i] where bit i of keep is set: bf16 as c10 rounds (nearest even, NaN ->
// 0x7FC0), 16 at a time; other types one by one (static_cast)
template <typename T>
inline void store16_rounded(T* y, __m512 v, __mmask16 keep) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(y, keep, _mm512_cvtepi32_epi16(r));
  } else {
    alignas(64) float f[16];
    _mm512_store_ps(f, v);
    for (int i = 0; i < 16; ++i)
      if (keep >> i & 1) y[i] = static_cast<T>(f[i]);
  }
}

template <typename S>
inline __m512 load16_f32(const S* p) {  // 16 values of S, widened to fp32 (exactly)
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  } else if constexpr (std::is_same_v<S, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return _mm512_loadu_ps(p);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// One weight row at a time, read straight through (the hardware prefetcher's best case: measured 1.4-1.9x the GB/s
// of blocking several rows together), into 4 independent accumulators per row of x (chains over K that hide the dot
// product's latency), MM (1 or 2) rows of x at a time: each further pair of rows reads the weight row again from L1.
// Every row of x sums in the same order whatever the number of rows, so a row's result does not depend on the rows
// beside it (a speculative verify's T tokens compute what T one-token steps compute, bitwise).
constexpr int BF16_CHAINS = 4;

template <int MM>
inline void bf16_row_pair(const uint16_t* x, const uint16_t* wr, int64_t K, int64_t Kv, c10::BFloat16* y, int64_t ldy) {
  __m512 acc[BF16_CHAINS][MM];
  for (int u = 0; u < BF16_CHAINS; ++u)
    for (int m = 0; m < MM; ++m) acc[u][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kv; k += 32 * BF16_CHAINS) {
    for (int u = 0; u < BF16_CHAINS; ++u) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k + 32 * u);
      for (int m = 0; m < MM; ++m)
        acc[u][m] = _mm512_dpbf16_ps(acc[u][m], wv, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * u));
    }
  }
  for (int m = 0; m < MM; ++m) {
    __m512 a = acc[0][m];
    for (int u = 1; u < BF16_CHAINS; ++u) a = _mm512_add_ps(a, acc[u][m]);
    float v = _mm512_reduce_add_ps(a);
    for (int64_t k = Kv; k < K; ++k)
      v += f32(c10::BFloat16(x[m * K + k], c10::BFloat16::from_bits())) *
           f32(c10::BFloat16(wr[k], c10::BFloat16::from_bits()));
    y[m * ldy] = c10::BFloat16(v);
  }
}

// weight rows n0..n1 of w [N, K] for the M rows of x [M, K] -> y[m * ldy + n]
void bf16_span(const uint16_t* x, int64_t M, const uint16_t* w, int64_t K, c10::BFloat16* y, int64_t ldy, int64_t n0,
               int64_t n1) {
  const int64_t Kv = K / (32 * BF16_CHAINS) * (32 * BF16_CHAINS);
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) bf16_row_pair<2>(x + m * K, w + n * K, K, Kv, y + m * ldy + n, ldy);
    if (m < M) bf16_row_pair<1>(x + m * K, w + n * K, K, Kv, y + m * ldy + n, ldy);
  }
}

void bf16_rows(const uint16_t* x, int64_t M, const uint16_t* w, int64_t N, int64_t K, c10::BFloat16* y, int64_t ldy) {
  at::parallel_for(0, N, std::max<int64_t>(16, 16384 / std::max<int64_t>(K, 1)),
                   [&](int64_t n0, int64_t n1) { bf16_span(x, M, w, K, y, ldy, n0, n1); });
}

bool few_rows_bf16(const c10::BFloat16* xp, int64_t M, const c10::BFloat16* wp, int64_t N, int64_t K,
                   c10::BFloat16* y, int64_t ldy) {
  if (M < 1 || M > 8) return false;
  bf16_rows(reinterpret_cast<const uint16_t*>(xp), M, reinterpret_cast<const uint16_t*>(wp), N, K, y, ldy);
  return true;
}

// ---------------------------------------------------------------- bf16 weights in tiles of 16 outputs
// The row kernel above ends every weight row with a horizontal sum, and each row of x reloads the weight vector
// beside its own x vector (two loads per product): at 8 rows it is held by those loads, and at one row it streamed
// 0.75-0.97x what a plain read of the weight does (ad hoc). A copy of the weight laid out in tiles of 16
// outputs -- per tile, K/2 pairs of inputs, each pair as 16 outputs x 2 inputs (64 bytes; tiles in groups, below),
// rows past N zero -- lets one vdpbf16ps take 16 outputs' products of an input pair against that
// pair of x broadcast: no horizontal sums, one weight load per 16 outputs shared by up to 8 rows of x, the copy read
// straight through. Each output's sum runs through its pairs in order in one fp32 lane, whatever the number of rows
// or tiles taken together: a row's result does not depend on the rows beside it (a verify's tokens equal one-token
// steps bitwise), and another order than the row kernel's (float rounding apart). Measured (2-core AVX-512 VM, 2
// threads, huge pages, same process): 8 rows 2.0-3.0x the row kernel in cache, 1.6-2.0x streamed; 1 row 0.87-1.2x
// by shape (slowest at K = 512); in the decode step 1.07-1.28x at batch 1 and 1.19-1.56x at batch 8 (README, "What
// the decode-step work bought", session 26).
constexpr int64_t BF16_TILE = 16;

// Tiles go in groups of BF16_GROUP, interleaved pair by pair (per group: [K/2][BF16_GROUP][16][2]), so the tiles a
// kernel call takes together are read as one stream (several tiles' separate streams ran slower from memory).
constexpr int64_t BF16_GROUP = 2;
constexpr int64_t BF16_GROUP_OUT = BF16_GROUP * BF16_TILE;  // outputs per group

// the tile copy of w [N, K] or [E, N, K] (contiguous bf16, K even): [E][ceil(N / 32)][K/2][2][16][2], rows past N
// zero; huge-page aligned (advised MADV_HUGEPAGE)
at::Tensor pack_bf16_tiles(const at::Tensor& w) {
  const int64_t E = w.dim() == 3 ? w.size(0) : 1, N = w.size(-2), K = w.size(-1), K2 = K / 2;
  const int64_t T = (N + BF16_GROUP_OUT - 1) / BF16_GROUP_OUT, per = T * BF16_GROUP_OUT * K;  // elements per expert
  auto out = tile_buffer(E * per * sizeof(uint16_t)).view(at::kBFloat16).view({E, T, K2, BF16_GROUP_OUT, 2});
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, E * T, 1, [&](int64_t a, int64_t b) {
    for (int64_t et = a; et < b; ++et) {  // a group at a time, written straight through (pairs as 32-bit words)
      const int64_t e = et / T, t = et % T, rows = std::min<int64_t>(BF16_GROUP_OUT, N - t * BF16_GROUP_OUT);
      uint32_t* d = reinterpret_cast<uint32_t*>(dst + e * per + t * BF16_GROUP_OUT * K);
      const uint16_t* s = src + (e * N + t * BF16_GROUP_OUT) * K;
      for (int64_t j = 0; j < K2; ++j) {
        for (int64_t r = 0; r < rows; ++r) std::memcpy(d + j * BF16_GROUP_OUT + r, s + r * K + 2 * j, sizeof(uint32_t));
        for (int64_t r = rows; r < BF16_GROUP_OUT; ++r) d[j * BF16_GROUP_OUT + r] = 0;
      }
    }
  });
  return out;
}

// MR rows of x (row stride K) against S tiles of one group, the first at p (the next BF16_TILE pairs on), K2 pairs
// each -> y[m * ldy + n] for the tiles' outputs n0 + i < n1 (n0: the first tile's first output)
template <int MR, int S>
inline void bf16_tile_block(const uint16_t* x, int64_t K, const uint16_t* p, int64_t K2, c10::BFloat16* y, int64_t ldy,
                            int64_t n0, int64_t n1) {
  __m512 acc[MR][S];
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < S; ++s) acc[m][s] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K2; ++j) {
    __m512bh wv[S];
    for (int s = 0; s < S; ++s)
      wv[s] = (__m512bh)_mm512_loadu_si512(p + (j * BF16_GROUP + s) * 2 * BF16_TILE);
    for (int m = 0; m < MR; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + m * K + 2 * j, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int s = 0; s < S; ++s) acc[m][s] = _mm512_dpbf16_ps(acc[m][s], wv[s], xb);
    }
  }
  for (int s = 0; s < S; ++s) {  // rounded to bf16 as c10 rounds (nearest even, NaN -> 0x7FC0), 16 at a time
    const int64_t a = n0 + s * BF16_TILE, left = n1 - a;
    if (left <= 0) break;
    const __mmask16 keep = left >= BF16_TILE ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    for (int m = 0; m < MR; ++m) store16_rounded(y + m * ldy + a, acc[m][s], keep);
  }
}

template <int S>
inline void bf16_tile_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* p, int64_t K2, c10::BFloat16* y,
                           int64_t ldy, int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) bf16_tile_block<8, S>(x + m * K, K, p, K2, y + m * ldy, ldy, n0, n1);
  for (; m + 4 <= M; m += 4) bf16_tile_block<4, S>(x + m * K, K, p, K2, y + m * ldy, ldy, n0, n1);
  for (; m + 2 <= M; m += 2) bf16_tile_block<2, S>(x + m * K, K, p, K2, y + m * ldy, ldy, n0, n1);
  for (; m < M; ++m) bf16_tile_block<1, S>(x + m * K, K, p, K2, y + m * ldy, ldy, n0, n1);
}

// outputs n0..n1 (n0 a multiple of BF16_TILE) of the tile copy ``tiles`` (one expert's) for the M rows of x [M, K]:
// group by group, the span's tiles of each group together (a span may start or end inside a group)
void bf16_tile_span(const uint16_t* x, int64_t M, const uint16_t* tiles, int64_t K, c10::BFloat16* y, int64_t ldy,
                    int64_t n0, int64_t n1) {
  const int64_t K2 = K / 2, t1 = (n1 + BF16_TILE - 1) / BF16_TILE;
  for (int64_t t = n0 / BF16_TILE; t < t1;) {
    const int64_t g = t / BF16_GROUP, in = t % BF16_GROUP, take = std::min(BF16_GROUP - in, t1 - t);
    const uint16_t* p = tiles + g * BF16_GROUP_OUT * K + in * 2 * BF16_TILE;
    if (take == 2) bf16_tile_rows<2>(x, M, K, p, K2, y, ldy, t * BF16_TILE, n1);
    else bf16_tile_rows<1>(x, M, K, p, K2, y, ldy, t * BF16_TILE, n1);
    t += take;
  }
}
#endif


#if defined(__AVX2__) && defined(__FMA__)
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// One token of the Mamba-2 recurrence on one (head, head-dim) row of the state: h = h a + x B, returns C . h. Shared
// by ssm_update (a rewind's replay) and mamba2_mix (decode and verify), so both reach bitwise the same states. In
// 8-lane vectors where the CPU has them (the compiler kept the loop scalar inside mamba2_rows' parallel lambda: ~5 us
// a token of sol-mini's 512 state rows).
inline float ssm_token(float* h, float a, float x, const float* B, const float* C, int64_t N) {
#if defined(__AVX2__) && defined(__FMA__)
  if (N % 8 == 0) {
    const __m256 va = _mm256_set1_ps(a), vx = _mm256_set1_ps(x);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < N; k += 8) {
      const __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(h + k), va, _mm256_mul_ps(vx, _mm256_loadu_ps(B + k)));
      _mm256_storeu_ps(h + k, v);
      acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(C + k), acc);
    }
    return hsum8(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t k = 0; k < N; ++k) {
    const float v = h[k] * a + x * B[k];
    h[k] = v;
    acc += v * C[k];
  }
  return acc;
}

#if defined(WAFERLINE_BF16_AVX2)

// One weight row at a time, straight through, into 8 accumulators per row of x (x already in fp32), one row of x at
// a time (each further row reads the weight row again from L1): every row sums in the same order whatever the number
// of rows, so its result does not depend on the rows beside it (a verify's tokens compute what one-token steps do).
// A bf16 is the top half of an fp32, so 16 weights loaded as 8 32-bit lanes give the odd-indexed ones as fp32 by
// masking the low half off and the even-indexed ones by shifting left 16: two integer ops per 16 weights (widening 8
// at a time with vpmovzxwd + shift ran at ~14 GB/s, compute-bound); x is laid out to match (per 16: its 8 even
// entries, then its 8 odd ones). The same exact products and fp32 sums as the portable loop, in another order.
constexpr int BF16_AVX2_U = 4;  // 4 x (even, odd) chains: FMA latency x throughput, within AVX2's 16 registers

inline void bf16_row_avx2(const float* xm, const uint16_t* wr, int64_t K, int64_t Kv, c10::BFloat16* y) {
  const int64_t K16 = K / 16 * 16;  // x is laid out in blocks of 16 up to here, as it is beyond
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[BF16_AVX2_U][2];
  for (int u = 0; u < BF16_AVX2_U; ++u) acc[u][0] = acc[u][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < Kv; k += 16 * BF16_AVX2_U) {
    for (int u = 0; u < BF16_AVX2_U; ++u) {
      const __m256i wi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k + 16 * u));
      acc[u][0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wi, 16)), _mm256_loadu_ps(xm + k + 16 * u),
                                  acc[u][0]);
      acc[u][1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(wi, hi)), _mm256_loadu_ps(xm + k + 16 * u + 8),
                                  acc[u][1]);
    }
  }
  for (int64_t k = Kv; k < K16; k += 16) {  // whole blocks of 16 left after the unrolled ones
    const __m256i wi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k));
    acc[0][0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wi, 16)), _mm256_loadu_ps(xm + k), acc[0][0]);
    acc[0][1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(wi, hi)), _mm256_loadu_ps(xm + k + 8), acc[0][1]);
  }
  __m256 a = acc[0][0];
  for (int u = 0; u < BF16_AVX2_U; ++u)
    for (int t = 0; t < 2; ++t)
      if (u || t) a = _mm256_add_ps(a, acc[u][t]);
  float v = hsum8(a);
  for (int64_t k = K16; k < K; ++k) v += xm[k] * bf16_bits_f32(wr[k]);
  *y = c10::BFloat16(v);
}

bool few_rows_bf16_avx2(const c10::BFloat16* xp, int64_t M, const c10::BFloat16* wp, int64_t N, int64_t K,
                        c10::BFloat16* y, int64_t ldy) {
  // x in fp32, each whole block of 16 as its 8 even entries then its 8 odd ones (the tail as it is)
  std::vector<float> xf(M * K);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(xp);
  const int64_t K16 = K / 16 * 16;
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* s = xb + m * K;
    float* d = xf.data() + m * K;
    for (int64_t k = 0; k < K16; k += 16)
      for (int j = 0; j < 8; ++j) {
        d[k + j] = bf16_bits_f32(s[k + 2 * j]);
        d[k + 8 + j] = bf16_bits_f32(s[k + 2 * j + 1]);
      }
    for (int64_t k = K16; k < K; ++k) d[k] = bf16_bits_f32(s[k]);
  }
  auto w = reinterpret_cast<const uint16_t*>(wp);
  if (M < 1 || M > 8) return false;
  const int64_t Kv = K / (16 * BF16_AVX2_U) * (16 * BF16_AVX2_U);
  at::parallel_for(0, N, std::max<int64_t>(16, 16384 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) bf16_row_avx2(xf.data() + m * K, w + n * K, K, Kv, y + m * ldy + n);
  });
  return true;
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

// The tile copies (bf16_tiles), kept per weight -- its storage, offset and shape -- while the weight lives and is not
// modified in place: an entry holds a weak reference to the weight's storage (it goes when the storage is freed) and
// the weight's version counter at packing (a write through the tensor or its views bumps it, and the copy is redone;
// a write through ``.data``, which has its own counter, is not seen -- the rule of the oneDNN copy that
// model/layers.packed_linear keeps for prefill).
// Costs a second copy of each bf16 weight a few-row product multiplies. WAFERLINE_BF16_TILES=0 (or use_bf16_tiles
// False) keeps the row kernel.
std::atomic<bool> g_bf16_tiles{[] {
  const char* v = std::getenv("WAFERLINE_BF16_TILES");
  return v == nullptr || std::string(v) != "0";
}()};

bool use_bf16_tiles(bool on) { return g_bf16_tiles.exchange(on); }

// the integer kernels' tile copies (int4_tiles, int8_tiles; CPUs with AVX512-VNNI), on by default;
// WAFERLINE_INT_TILES=0 (or use_int_tiles False) keeps their row kernels (int4_i16_span, int8_block_i16)
std::atomic<bool> g_int_tiles{[] {
  const char* v = std::getenv("WAFERLINE_INT_TILES");
  return v == nullptr || std::string(v) != "0";
}()};

bool use_int_tiles(bool on) { return g_int_tiles.exchange(on); }

// the kinds of tile copy (bf16_tiles; int4_tiles and int8_tiles, further down)
enum TileKind : int64_t { TILE_BF16 = 0, TILE_INT4 = 1, TILE_INT8 = 2 };

struct TileEntry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage, storage2;  // the weight's; its scales' (int4, int8), or again w's
  int64_t version, version2;
  at::Tensor tiles;
};
std::mutex g_tiles_mu;
// (kind, the weight's storage, offset, dims, sizes, the scales' storage and offset (int4, int8; else 0))
std::map<std::array<int64_t, 9>, TileEntry> g_tiles;

std::atomic<int64_t> g_tile_packs[3] = {0, 0, 0};  // copies made so far, per kind (a weight packed at every call shows)

// (live entries, copies made so far) of one kind: tests check that a freed weight's copy goes at the next packing
// and that a decode loop packs each weight once
std::tuple<int64_t, int64_t> tile_copies(int64_t kind) {
  std::lock_guard<std::mutex> lock(g_tiles_mu);
  int64_t live = 0;
  for (const auto& kv : g_tiles) live += kv.first[0] == kind;
  return {live, g_tile_packs[kind].load()};
}
std::tuple<int64_t, int64_t> bf16_tile_copies() { return tile_copies(TILE_BF16); }
std::tuple<int64_t, int64_t> int4_tile_copies() { return tile_copies(TILE_INT4); }
std::tuple<int64_t, int64_t> int8_tile_copies() { return tile_copies(TILE_INT8); }

// the copy of weight w (with its scales sz for an integer weight; else undefined) that make() builds, made at the first
// call and kept while w (and sz) live unmodified. w and sz must not be inference tensors (no version counter to check
// the copy by) and must have storage.
template <typename F>
at::Tensor cached_tiles(TileKind kind, const at::Tensor& w, const at::Tensor& sz, F&& make) {
  const auto& st = w.storage();
  const auto& st2 = sz.defined() ? sz.storage() : st;
  std::array<int64_t, 9> key{kind, reinterpret_cast<int64_t>(st.unsafeGetStorageImpl()), w.storage_offset(), w.dim(),
                             w.size(0), w.size(1), w.dim() == 3 ? w.size(2) : 0,
                             sz.defined() ? reinterpret_cast<int64_t>(st2.unsafeGetStorageImpl()) : 0,
                             sz.defined() ? sz.storage_offset() : 0};
  const int64_t version = w._version(), version2 = sz.defined() ? sz._version() : version;
  {
    std::lock_guard<std::mutex> lock(g_tiles_mu);
    auto it = g_tiles.find(key);
    if (it != g_tiles.end() && it->second.version == version && it->second.version2 == version2 &&
        !it->second.storage.expired() && !it->second.storage2.expired())
      return it->second.tiles;
  }
  at::Tensor tiles = make();
  g_tile_packs[kind].fetch_add(1);
  std::lock_guard<std::mutex> lock(g_tiles_mu);
  for (auto it = g_tiles.begin(); it != g_tiles.end();)
    it = it->second.storage.expired() || it->second.storage2.expired() ? g_tiles.erase(it) : ++it;
  g_tiles.insert_or_assign(std::move(key),
                           TileEntry{st.getWeakStorageImpl(), st2.getWeakStorageImpl(), version, version2, tiles});
  return tiles;
}

// The tile copy of a bf16 weight w [N, K] or [E, N, K] for the few-row kernel, made at its first use; an undefined
// tensor where the row kernel runs instead (no AVX512-BF16, tiles off, odd K, not contiguous, an inference tensor: no
// version counter to check the copy by).
at::Tensor bf16_tiles(const at::Tensor& w) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (!g_bf16_tiles.load(std::memory_order_relaxed) || g_portable.load(std::memory_order_relaxed) ||
      w.scalar_type() != at::kBFloat16 || (w.dim() != 2 && w.dim() != 3) || w.size(-1) % 2 != 0 ||
      w.size(-1) == 0 || !w.is_contiguous() || w.is_inference() || !w.has_storage())
    return at::Tensor();
  return cached_tiles(TILE_BF16, w, at::Tensor(), [&] { return pack_bf16_tiles(w); });
#else
  (void)w;
  return at::Tensor();
#endif
}

// where expert e (e < 0: W is one [N, K] weight) of W's tile copy starts; null where W has none
const uint16_t* tiles_of(const at::Tensor& tiles, int64_t e) {
  if (!tiles.defined()) return nullptr;
  return reinterpret_cast<const uint16_t*>(tiles.data_ptr()) + std::max<int64_t>(e, 0) * (tiles.numel() / tiles.size(0));
}

// y = x W^T (W [N', K], or expert e of W [E, N', K]; its first N rows) for the M <= FEW_ROWS rows of bf16 x through
// W's tile copy, split across threads by tiles; false where W has none (the caller runs few_rows)
template <typename T>
bool few_rows_tiled(const at::Tensor& W, int64_t e, const T* x, int64_t M, int64_t N, int64_t K, T* y, int64_t ldy) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (M < 1 || M > 8) return false;
    auto tiles = bf16_tiles(W);
    if (!tiles.defined()) return false;
    const uint16_t* tp = tiles_of(tiles, e);
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x);
    const int64_t nt = (N + BF16_TILE - 1) / BF16_TILE;
    at::parallel_for(0, nt, std::max<int64_t>(1, 16384 / (BF16_TILE * K)), [&](int64_t t0, int64_t t1) {
      bf16_tile_span(xp, M, tp, K, y, ldy, t0 * BF16_TILE, std::min(N, t1 * BF16_TILE));
    });
    return true;
  }
#endif
  (void)W, (void)e, (void)x, (void)M, (void)N, (void)K, (void)y, (void)ldy;
  return false;
}

// y[m * ldy + n] for m < M <= FEW_ROWS, n < N
template <typename T>
void few_rows(const T* x, int64_t M, const T* w, int64_t N, int64_t K, T* y, int64_t ldy) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (!g_portable.load(std::memory_order_relaxed) && few_rows_bf16(x, M, w, N, K, y, ldy)) return;
  }
#elif defined(WAFERLINE_BF16_AVX2)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (!g_portable.load(std::memory_order_relaxed) && few_rows_bf16_avx2(x, M, w, N, K, y, ldy)) return;
  }
#endif
  few_rows_generic<T>(x, M, w, N, K, y, ldy);
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && w.dim() == 2 && x.scalar_type() == w.scalar_type(),
              "waferline::linear_rows: CPU x [..., K] and W [N, K] of one dtype");
  const int64_t K = w.size(1), N = w.size(0);
  TORCH_CHECK(x.size(-1) == K, "waferline::linear_rows: x has ", x.size(-1), " inputs, W ", K);
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = K ? xc.numel() / K : 0;
  TORCH_CHECK(M <= FEW_ROWS, "waferline::linear_rows: at most ", FEW_ROWS, " rows");
  auto sizes = xc.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, xc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "waferline_linear_rows", [&] {
    if (!few_rows_tiled<scalar_t>(wc, -1, xc.data_ptr<scalar_t>(), M, N, K, y.data_ptr<scalar_t>(), N))
      few_rows<scalar_t>(xc.data_ptr<scalar_t>(), M, wc.data_ptr<scalar_t>(), N, K, y.data_ptr<scalar_t>(), N);
  });
  return y;
}

// 16-bit fixed point of activations (the integer kernels below): over a span of x, sx = max|x| / 32767 and
// xi = round(x / sx), so x ~ sx * xi with |xi| <= 32767; an all-zero span has sx = 0 and xi = 0
inline float fixed16_inv(const float* x, int64_t n, float* sx) {  // -> 1 / sx (0 for an all-zero span); sets sx
  float mx = 0.f;
  for (int64_t k = 0; k < n; ++k) mx = std::max(mx, std::fabs(x[k]));
  *sx = mx > 0.f ? mx / 32767.f : 0.f;
  return mx > 0.f ? 32767.f / mx : 0.f;
}
inline int16_t fixed16(float v, float inv) {
  return static_cast<int16_t>(std::clamp(static_cast<int>(std::nearbyint(v * inv)), -32767, 32767));
}

// ---------------------------------------------------------------- int4 weights (W4A16) in waferline's own layout
// packed uint8 [N, K/2] in blocks of 64 inputs (32 bytes): byte b holds the code of input k0 + lo_k(b) in its low nibble
// and of k0 + 32 + lo_k(b) in its high one (codes 0..15; lo_k, below, is the order the AVX2 kernel's widening produces,
// so the kernel reads x in its natural order); where K % 64 == 32 the last 32 inputs are 16 bytes, byte j holding
// input k0 + j low and k0 + 16 + j high; sz [N, K/G, Z] per row and group: the scale (Z = 1, symmetric) or the
// scale and the zero (Z = 2), 16-bit or fp32. The weight is w = (code - 8) * scale + zero, in fp32 with one fused
// multiply-add (one rounding; exact when zero = 0). x [..., K] of any float dtype is widened to fp32, sums are fp32, y
// is rounded once to x's dtype. Why our own layout: ATen's int4pack kernel ran a decode step's small products (1 row,
// 512-2048 square) at ~2 GB/s of packed weight on a 2-core AVX2 CPU, slower than our bf16 product reading 4x the
// bytes. Here (AVX2) a table lookup (vpshufb) turns 32 codes at once into the bf16 bits of code - 8, which widen to
// fp32 by a shift or a mask (a bf16 is the top half of an fp32), one FMA applies scale and zero, and each weight
// vector is multiplied into every row while it is in registers. Up to INT4_KERNEL_ROWS rows go through that kernel (8
// at a time); more rows (a prefill) go through the integer tile kernel where the weight has a tile copy (int4_tiles),
// else dequantise the weight to fp32 once and run ATen's fp32 GEMM.
constexpr int64_t INT4_BLOCK = 64;

// the input (0..31) whose code sits in the low nibble of byte b (0..31) of a block (the high nibble: that + 32). The
// kernel's widening: bytes -> 16-bit lanes by unpacklo / unpackhi_epi8 (per 128-bit lane), then even / odd 16-bit
// lanes -> fp32 vectors; vector t (0..3) lane i holds input 8 t + i.
constexpr int int4_lo_k(int b) {
  // byte b lands in 16-bit lane p of unpack half u: u = 0 takes bytes 0-7 and 16-23, u = 1 bytes 8-15 and 24-31
  const int u = (b / 8) % 2, p = (b % 8) + 8 * (b / 16), t = 2 * u + p % 2, i = p / 2;
  return 8 * t + i;
}

template <typename S>
inline void int4_dequant_row_generic(const uint8_t* q, const S* sz, int64_t Z, int64_t K, int64_t G, float* w) {
  const int64_t K64 = K / INT4_BLOCK * INT4_BLOCK;
  if (K64 < K) {  // the 32-input tail
    const int64_t g = K64 / G;
    const float st = f32(sz[g * Z]), zt = Z > 1 ? f32(sz[g * Z + 1]) : 0.f;
    const uint8_t* qb = q + K64 / 2;
    for (int j = 0; j < 16; ++j) {
      w[K64 + j] = std::fma(static_cast<float>(static_cast<int>(qb[j] & 15) - 8), st, zt);
      w[K64 + 16 + j] = std::fma(static_cast<float>(static_cast<int>(qb[j] >> 4) - 8), st, zt);
    }
  }
  for (int64_t k0 = 0; k0 < K64; k0 += INT4_BLOCK) {
    const int64_t gl = k0 / G, gh = (k0 + 32) / G;
    const float sl = f32(sz[gl * Z]), zl = Z > 1 ? f32(sz[gl * Z + 1]) : 0.f;
    const float sh = f32(sz[gh * Z]), zh = Z > 1 ? f32(sz[gh * Z + 1]) : 0.f;
    const uint8_t* qb = q + k0 / 2;
    for (int b = 0; b < 32; ++b) {
      const int k = int4_lo_k(b);
      w[k0 + k] = std::fma(static_cast<float>(static_cast<int>(qb[b] & 15) - 8), sl, zl);
      w[k0 + 32 + k] = std::fma(static_cast<float>(static_cast<int>(qb[b] >> 4) - 8), sh, zh);
    }
  }
}

template <typename T, typename S>
void int4_rows_generic(const float* xf, int64_t M, const uint8_t* q, const S* sz, int64_t Z, int64_t N, int64_t K,
                       int64_t G, T* y, int64_t ldy) {
  at::parallel_for(0, N, std::max<int64_t>(16, 16384 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    std::vector<float> w(K);
    for (int64_t n = n0; n < n1; ++n) {
      int4_dequant_row_generic<S>(q + n * (K / 2), sz + n * (K / G) * Z, Z, K, G, w.data());
      for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = static_cast<T>(dotf(xf + m * K, w.data(), K));
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
// 64 codes (32 bytes) -> 8 fp32 vectors of w = (code - 8) * scale + zero, vector t holding inputs 8 t .. 8 t + 7 of
// the block (the first 4 from the low nibbles, with the low half's scale and zero; the last 4 from the high ones)
struct Int4Widen {
  __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i hi16 = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  // bf16 bits of code - 8 (-8 .. 7, exact in bf16): the low bytes, then the high bytes, per 128-bit lane
  __m256i tab_lo = _mm256_setr_epi8(0, static_cast<char>(0xE0), static_cast<char>(0xC0), static_cast<char>(0xA0),
                                    static_cast<char>(0x80), 0x40, 0, static_cast<char>(0x80), 0, static_cast<char>(0x80),
                                    0, 0x40, static_cast<char>(0x80), static_cast<char>(0xA0), static_cast<char>(0xC0),
                                    static_cast<char>(0xE0), 0, static_cast<char>(0xE0), static_cast<char>(0xC0),
                                    static_cast<char>(0xA0), static_cast<char>(0x80), 0x40, 0, static_cast<char>(0x80),
                                    0, static_cast<char>(0x80), 0, 0x40, static_cast<char>(0x80),
                                    static_cast<char>(0xA0), static_cast<char>(0xC0), static_cast<char>(0xE0));
  __m256i tab_hi = _mm256_setr_epi8(static_cast<char>(0xC1), static_cast<char>(0xC0), static_cast<char>(0xC0),
                                    static_cast<char>(0xC0), static_cast<char>(0xC0), static_cast<char>(0xC0),
                                    static_cast<char>(0xC0), static_cast<char>(0xBF), 0, 0x3F, 0x40, 0x40, 0x40, 0x40,
                                    0x40, 0x40, static_cast<char>(0xC1), static_cast<char>(0xC0),
                                    static_cast<char>(0xC0), static_cast<char>(0xC0), static_cast<char>(0xC0),
                                    static_cast<char>(0xC0), static_cast<char>(0xC0), static_cast<char>(0xBF), 0, 0x3F,
                                    0x40, 0x40, 0x40, 0x40, 0x40, 0x40);

  // the 4 vectors of one nibble half as code - 8 (exact), without scale or zero
  inline void half_raw(__m256i idx, __m256* w) const {
    const __m256i bl = _mm256_shuffle_epi8(tab_lo, idx), bh = _mm256_shuffle_epi8(tab_hi, idx);
    const __m256i u0 = _mm256_unpacklo_epi8(bl, bh), u1 = _mm256_unpackhi_epi8(bl, bh);
    w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(u0, 16));
    w[1] = _mm256_castsi256_ps(_mm256_and_si256(u0, hi16));
    w[2] = _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16));
    w[3] = _mm256_castsi256_ps(_mm256_and_si256(u1, hi16));
  }
  inline void block_raw(const uint8_t* qb, __m256* w) const {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb));
    half_raw(_mm256_and_si256(v, low4), w);
    half_raw(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), w + 4);
  }
  inline void half(__m256i idx, __m256 s, __m256 z, __m256* w) const {
    const __m256i bl = _mm256_shuffle_epi8(tab_lo, idx), bh = _mm256_shuffle_epi8(tab_hi, idx);
    const __m256i u0 = _mm256_unpacklo_epi8(bl, bh), u1 = _mm256_unpackhi_epi8(bl, bh);
    w[0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(u0, 16)), s, z);
    w[1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(u0, hi16)), s, z);
    w[2] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(u1, 16)), s, z);
    w[3] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(u1, hi16)), s, z);
  }
  inline void block(const uint8_t* qb, __m256 sl, __m256 zl, __m256 sh, __m256 zh, __m256* w) const {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb));
    half(_mm256_and_si256(v, low4), sl, zl, w);
    half(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), sh, zh, w + 4);
  }
  // the 32-input tail (16 bytes, natural order): 4 vectors, by sign extension and conversion
  inline void tail(const uint8_t* qb, __m256 s, __m256 z, __m256* w) const {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb));
    const __m128i m4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, m4), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m4), eight);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), s, z);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo))), s, z);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), s, z);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi))), s, z);
  }
};

template <typename S>
inline void int4_scale(const S* sz, int64_t Z, int64_t g, __m256& s, __m256& z) {
  s = _mm256_set1_ps(f32(sz[g * Z]));
  z = _mm256_set1_ps(Z > 1 ? f32(sz[g * Z + 1]) : 0.f);
}

// One weight row at a time, straight through, into M x U accumulators (U chains per row: FMA latency when M is small)
template <int M, int U, typename T, typename S>
void int4_block_avx2(const float* xf, const uint8_t* q, const S* sz, int64_t Z, int64_t K, int64_t G, T* y,
                     int64_t ldy, int64_t n0, int64_t n1) {
  const Int4Widen wd;
  const int64_t ng = K / G, K64 = K / INT4_BLOCK * INT4_BLOCK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = q + n * (K / 2);
    const S* sr = sz + n * ng * Z;
    __m256 acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
    __m256 sl, zl, sh, zh;
    for (int64_t k0 = 0; k0 < K64; k0 += INT4_BLOCK) {
      if (k0 % G == 0) int4_scale(sr, Z, k0 / G, sl, zl);
      if ((k0 + 32) % G == 0) int4_scale(sr, Z, (k0 + 32) / G, sh, zh);
      else if (k0 % G == 0) sh = sl, zh = zl;
      // one nibble half at a time (4 weight vectors live, not 8: with 8 rows' accumulators that spilled)
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + k0 / 2));
      for (int h = 0; h < 2; ++h) {
        __m256 w[4];
        wd.half(_mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, wd.low4), h ? sh : sl, h ? zh : zl, w);
        for (int t = 0; t < 4; ++t)
          for (int m = 0; m < M; ++m)
            acc[m][t % U] = _mm256_fmadd_ps(w[t], _mm256_loadu_ps(xf + m * K + k0 + 32 * h + 8 * t), acc[m][t % U]);
      }
    }
    if (K64 < K) {
      int4_scale(sr, Z, K64 / G, sl, zl);
      __m256 w[4];
      wd.tail(qr + K64 / 2, sl, zl, w);
      for (int t = 0; t < 4; ++t)
        for (int m = 0; m < M; ++m)
          acc[m][t % U] = _mm256_fmadd_ps(w[t], _mm256_loadu_ps(xf + m * K + K64 + 8 * t), acc[m][t % U]);
    }
    for (int m = 0; m < M; ++m) {
      __m256 a = acc[m][0];
      for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[m][u]);
      y[m * ldy + n] = static_cast<T>(hsum8(a));
    }
  }
}

// 1-2 rows, groups of whole blocks (G % 64 == 0): sum (code - 8) x over each group unscaled, then one FMA by the
// group's scale (and the zero times the group's sum of x): half the FMAs per weight of int4_block_avx2, where one row
// leaves the widening's FMA unshared. The same exact products (code - 8) x_k; the scale multiplies their sum instead.
template <int M, int U, typename T, typename S>
void int4_block_fold_avx2(const float* xf, const float* xsum, const uint8_t* q, const S* sz, int64_t Z, int64_t K,
                          int64_t G, T* y, int64_t ldy, int64_t n0, int64_t n1) {
  const Int4Widen wd;
  const int64_t ng = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = q + n * (K / 2);
    const S* sr = sz + n * ng * Z;
    __m256 tot[M];
    float zs[M];
    for (int m = 0; m < M; ++m) tot[m] = _mm256_setzero_ps(), zs[m] = 0.f;
    for (int64_t g = 0; g < ng; ++g) {
      __m256 acc[M][U];
      for (int m = 0; m < M; ++m)
        for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
      for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += INT4_BLOCK) {
        __m256 w[8];
        wd.block_raw(qr + k0 / 2, w);
        for (int t = 0; t < 8; ++t)
          for (int m = 0; m < M; ++m)
            acc[m][t % U] = _mm256_fmadd_ps(w[t], _mm256_loadu_ps(xf + m * K + k0 + 8 * t), acc[m][t % U]);
      }
      const __m256 s = _mm256_set1_ps(f32(sr[g * Z]));
      for (int m = 0; m < M; ++m) {
        __m256 a = acc[m][0];
        for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[m][u]);
        tot[m] = _mm256_fmadd_ps(a, s, tot[m]);
        if (Z > 1) zs[m] += f32(sr[g * Z + 1]) * xsum[m * ng + g];
      }
    }
    for (int m = 0; m < M; ++m) y[m * ldy + n] = static_cast<T>(hsum8(tot[m]) + zs[m]);
  }
}

template <int M, typename T, typename S>
void int4_rows_avx2(const float* xf, const uint8_t* q, const S* sz, int64_t Z, int64_t N, int64_t K, int64_t G, T* y,
                    int64_t ldy) {
  constexpr int U = M == 1 ? 4 : (M <= 4 ? 2 : 1);  // ~4-8 independent chains, within AVX2's 16 registers
  if constexpr (M <= 2) {
    if (G % INT4_BLOCK == 0) {
      const int64_t ng = K / G;
      std::vector<float> xsum(M * ng, 0.f);  // per row and group: the sum of x (what the zero multiplies)
      if (Z > 1)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t g = 0; g < ng; ++g)
            for (int64_t k = g * G; k < (g + 1) * G; ++k) xsum[m * ng + g] += xf[m * K + k];
      at::parallel_for(0, N, std::max<int64_t>(16, 16384 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
        int4_block_fold_avx2<M, U, T, S>(xf, xsum.data(), q, sz, Z, K, G, y, ldy, n0, n1);
      });
      return;
    }
  }
  at::parallel_for(0, N, std::max<int64_t>(16, 16384 / std::max<int64_t>(K, 1)),
                   [&](int64_t n0, int64_t n1) { int4_block_avx2<M, U, T, S>(xf, q, sz, Z, K, G, y, ldy, n0, n1); });
}

// ---- 16-bit activations (bf16 / fp16 x) as integers: the decode step's int4 product without fp32 widening of the
// weight. Per row and weight group, x is held as 16-bit fixed point, x_k ~ sx_g * xi_k with |xi_k| <= 32767 and
// sx_g = max_g |x| / 32767 (so every x within 2^7 of its group's largest keeps all 8 bits of a bf16 mantissa; smaller
// ones are rounded to sx_g / 2). The codes are widened to 16-bit lanes (two unpacks per 32), vpmaddwd multiplies them
// into xi pairwise and sums in int32, exactly: sum_k code_k xi_k per group (|sum| < 2^31 for groups of up to 4096).
// Then per group, in fp32: scale * sx * that + (zero - 8 scale) * sx * sum xi. About half the vector instructions per
// weight of the fp32 kernel above (which widens every code to fp32): that one ran ~10 G weights/s on one Zen 3 core,
// compute-bound, below the core's memory bandwidth. fp32 x keeps the fp32 kernel (exact products).
constexpr int64_t I16_MAX_GROUP = 4096;
constexpr int64_t I16_TILE = 16;  // weight rows per tile: each goes through all rows of x (4 at a time) from L1

// where input j (0..63) of a 64-input block sits in the 16-bit lanes the kernel builds: vector v = j / 16 (0, 1: the
// low nibbles unpacked low / high with zero; 2, 3: the high nibbles), lane i = j % 16 -> the byte (0..31) it came from
constexpr int i16_lane_input(int j) {
  const int v = j / 16, i = j % 16;
  const int b = (i < 8 ? i : i + 8) + (v % 2 ? 8 : 0);  // unpacklo: bytes 0-7, 16-23; unpackhi: 8-15, 24-31
  return (v >= 2 ? 32 : 0) + int4_lo_k(b);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// i16_lane_input as two-source permute indices: lane j of a block's output takes input i16_lane_input(j) of the two
// vectors holding the block's 64 inputs in order (0..31 the first, 32..63 the second)
struct I16LaneOrder {
  alignas(64) int16_t idx[64];
  constexpr I16LaneOrder() : idx() {
    for (int j = 0; j < 64; ++j) idx[j] = static_cast<int16_t>(i16_lane_input(j));
  }
};
inline constexpr I16LaneOrder kI16LaneOrder{};

// i16_quantize's numbers, 64 inputs at a time: each group's largest |x| by vmaxps with the running maximum second
// (what std::max(mx, |x|) gives: max is exact, and a NaN is skipped the same way), x * inv rounded to nearest even
// (the default mode, nearbyint's) and clamped to +-32767, narrowed, and put in lane order by one permute per 32. The
// scalar loop took ~2% of a 1-thread llama int4 batch-8 step (its max does not vectorise: fp max is not reassociated)
inline void i16_quantize_avx512(const float* xf, int64_t M, int64_t K, int64_t G, int16_t* xq, float* sx, float* xs) {
  const int64_t ng = K / G;
  const __m512i lo_idx = _mm512_load_si512(kI16LaneOrder.idx), hi_idx = _mm512_load_si512(kI16LaneOrder.idx + 32);
  const __m512i top = _mm512_set1_epi32(32767), bottom = _mm512_set1_epi32(-32767);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      const float* x = xf + m * K + g * G;
      __m512 mv = _mm512_setzero_ps();
      for (int64_t k = 0; k < G; k += 16) mv = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + k)), mv);
      const float mx = _mm512_reduce_max_ps(mv);
      const float s = mx > 0.f ? mx / 32767.f : 0.f;  // (fixed16_inv's)
      const __m512 inv = _mm512_set1_ps(mx > 0.f ? 32767.f / mx : 0.f);
      __m512i sum = _mm512_setzero_si512();
      int16_t* out = xq + m * K + g * G;
      for (int64_t k0 = 0; k0 < G; k0 += INT4_BLOCK) {
        __m256i n[4];
        for (int i = 0; i < 4; ++i) {
          __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k0 + 16 * i), inv));
          v = _mm512_min_epi32(_mm512_max_epi32(v, bottom), top);
          sum = _mm512_add_epi32(sum, v);
          n[i] = _mm512_cvtepi32_epi16(v);
        }
        const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(n[0]), n[1], 1);
        const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(n[2]), n[3], 1);
        _mm512_storeu_si512(out + k0, _mm512_permutex2var_epi16(a, lo_idx, b));
        _mm512_storeu_si512(out + k0 + 32, _mm512_permutex2var_epi16(a, hi_idx, b));
      }
      sx[m * ng + g] = s;  // (|sum| <= 32767 G < 2^31 for G <= I16_MAX_GROUP)
      xs[m * ng + g] = s * static_cast<float>(static_cast<int64_t>(_mm512_reduce_add_epi32(sum)));
    }
}
#endif

// rows xf [M, K] (fp32) -> xq [M, K] int16 in lane order per 64-input block, sx [M, ng] and sx * sum xi [M, ng]
inline void i16_quantize(const float* xf, int64_t M, int64_t K, int64_t G, int16_t* xq, float* sx, float* xs) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (!g_portable.load(std::memory_order_relaxed)) return i16_quantize_avx512(xf, M, K, G, xq, sx, xs);
#endif
  const int64_t ng = K / G;
  for (int64_t m = 0; m < M; ++m) {
    const float* x = xf + m * K;
    for (int64_t g = 0; g < ng; ++g) {
      float s;
      const float inv = fixed16_inv(x + g * G, G, &s);
      int64_t sum = 0;
      for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += INT4_BLOCK)
        for (int j = 0; j < INT4_BLOCK; ++j) {
          xq[m * K + k0 + j] = fixed16(x[k0 + i16_lane_input(j)], inv);
          sum += xq[m * K + k0 + j];
        }
      sx[m * ng + g] = s;
      xs[m * ng + g] = s * static_cast<float>(sum);
    }
  }
}

// weight rows n0..n1 for M (<= 4) rows of xq; y rounded to T
// one 64-input block of codes times 16-bit x: the exact integer sums, 8 lanes
inline __m256i int4_dot_i16(const uint8_t* qb, const __m256i* xv) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb));
  const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  __m256i p = _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), xv[0]);
  p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), xv[1]));
  p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), xv[2]));
  return _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), xv[3]));
}

// one row of x (a batch-1 decode step's) through weight rows n0..n1, two rows at a time: each block of x is loaded
// once for both, and the two sums are independent chains. Per row the same integer sums and the same float steps, in
// the same order, as int4_block_i16<1> (the same numbers; ~25% fewer instructions per weight row). Each block also
// prefetches the codes four rows ahead: reading two rows side by side, the hardware prefetcher alone left a one-row
// product of a 768 x 2048 weight from memory at ~4 GB/s on one core of a Zen 4 EPYC (1.5-1.8x faster with it, and
// 0-10% on 768-input rows; session 23). (A prefetch past the weight's end is harmless: it never faults.)
template <typename T, typename S>
int64_t int4_pairs_i16(const int16_t* xq, const float* sx, const float* xs, const uint8_t* q, const S* sz, int64_t Z,
                       int64_t K, int64_t G, T* y, int64_t n0, int64_t n1) {
  const int64_t ng = K / G, pf = 2 * K;  // (bytes: four rows of K / 2)
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    const uint8_t* qa = q + n * (K / 2);
    const uint8_t* qb = qa + K / 2;
    const S* sa = sz + n * ng * Z;
    const S* sb = sa + ng * Z;
    __m256 ta = _mm256_setzero_ps(), tb = _mm256_setzero_ps();
    float oa = 0.f, ob = 0.f;
    const int16_t* xp = xq;
    for (int64_t g = 0; g < ng; ++g) {
      __m256i aa = _mm256_setzero_si256(), ab = _mm256_setzero_si256();
      for (int64_t k = 0; k < G; k += INT4_BLOCK, qa += INT4_BLOCK / 2, qb += INT4_BLOCK / 2, xp += INT4_BLOCK) {
        const __m256i* xm = reinterpret_cast<const __m256i*>(xp);
        const __m256i xv[4] = {_mm256_loadu_si256(xm), _mm256_loadu_si256(xm + 1), _mm256_loadu_si256(xm + 2),
                               _mm256_loadu_si256(xm + 3)};
        _mm_prefetch(reinterpret_cast<const char*>(qa + pf), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(qb + pf), _MM_HINT_T0);
        aa = _mm256_add_epi32(aa, int4_dot_i16(qa, xv));
        ab = _mm256_add_epi32(ab, int4_dot_i16(qb, xv));
      }
      const float s_a = f32(sa[g * Z]), z_a = (Z > 1 ? f32(sa[g * Z + 1]) : 0.f) - 8.f * s_a;
      const float s_b = f32(sb[g * Z]), z_b = (Z > 1 ? f32(sb[g * Z + 1]) : 0.f) - 8.f * s_b;
      ta = _mm256_fmadd_ps(_mm256_cvtepi32_ps(aa), _mm256_set1_ps(s_a * sx[g]), ta);
      tb = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ab), _mm256_set1_ps(s_b * sx[g]), tb);
      oa += z_a * xs[g];
      ob += z_b * xs[g];
    }
    y[n] = static_cast<T>(hsum8(ta) + oa);
    y[n + 1] = static_cast<T>(hsum8(tb) + ob);
  }
  return n;  // (the first row left: an odd last one)
}

template <int M, typename T, typename S>
void int4_block_i16(const int16_t* xq, const float* sx, const float* xs, const uint8_t* q, const S* sz, int64_t Z,
                    int64_t K, int64_t G, T* y, int64_t ldy, int64_t n0, int64_t n1) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
  const int64_t ng = K / G, pf = K;  // prefetch distance in bytes: two weight rows ahead (see int4_pairs_i16)
  if constexpr (M == 1) n0 = int4_pairs_i16<T, S>(xq, sx, xs, q, sz, Z, K, G, y, n0, n1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = q + n * (K / 2);
    const S* sr = sz + n * ng * Z;
    __m256 tot[M];
    float off[M];
    for (int m = 0; m < M; ++m) tot[m] = _mm256_setzero_ps(), off[m] = 0.f;
    for (int64_t g = 0; g < ng; ++g) {
      __m256i acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
      for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += INT4_BLOCK) {
        _mm_prefetch(reinterpret_cast<const char*>(qr + k0 / 2 + pf), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + k0 / 2));
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        const __m256i w[4] = {_mm256_unpacklo_epi8(lo, zero), _mm256_unpackhi_epi8(lo, zero),
                              _mm256_unpacklo_epi8(hi, zero), _mm256_unpackhi_epi8(hi, zero)};
        for (int m = 0; m < M; ++m) {
          const __m256i* xm = reinterpret_cast<const __m256i*>(xq + m * K + k0);
          __m256i p = _mm256_madd_epi16(w[0], _mm256_loadu_si256(xm));
          p = _mm256_add_epi32(p, _mm256_madd_epi16(w[1], _mm256_loadu_si256(xm + 1)));
          p = _mm256_add_epi32(p, _mm256_madd_epi16(w[2], _mm256_loadu_si256(xm + 2)));
          p = _mm256_add_epi32(p, _mm256_madd_epi16(w[3], _mm256_loadu_si256(xm + 3)));
          acc[m] = _mm256_add_epi32(acc[m], p);
        }
      }
      const float s = f32(sr[g * Z]), zt = (Z > 1 ? f32(sr[g * Z + 1]) : 0.f) - 8.f * s;
      for (int m = 0; m < M; ++m) {
        tot[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_set1_ps(s * sx[m * ng + g]), tot[m]);
        off[m] += zt * xs[m * ng + g];
      }
    }
    for (int m = 0; m < M; ++m) y[m * ldy + n] = static_cast<T>(hsum8(tot[m]) + off[m]);
  }
}

// weight rows n0..n1 for M rows of quantized x (i16_quantize's xq, sx, xs): tiles of I16_TILE weight rows, each
// through all rows of x 4 at a time (the tile stays in L1)
template <typename T, typename S>
void int4_i16_span(const int16_t* xq, const float* sx, const float* xs, int64_t M, const uint8_t* q, const S* sz,
                   int64_t Z, int64_t K, int64_t G, T* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t ng = K / G;
  for (int64_t t0 = n0; t0 < n1; t0 += I16_TILE) {
    const int64_t t1 = std::min(n1, t0 + I16_TILE);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int16_t* xm = xq + m0 * K;
      const float *sm = sx + m0 * ng, *zm = xs + m0 * ng;
      T* ym = y + m0 * ldy;
      switch (std::min<int64_t>(4, M - m0)) {
        case 1: int4_block_i16<1, T, S>(xm, sm, zm, q, sz, Z, K, G, ym, ldy, t0, t1); break;
        case 2: int4_block_i16<2, T, S>(xm, sm, zm, q, sz, Z, K, G, ym, ldy, t0, t1); break;
        case 3: int4_block_i16<3, T, S>(xm, sm, zm, q, sz, Z, K, G, ym, ldy, t0, t1); break;
        default: int4_block_i16<4, T, S>(xm, sm, zm, q, sz, Z, K, G, ym, ldy, t0, t1); break;
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define WAFERLINE_INT4_TILES 1
// ---------------------------------------------------------------- int4 weights in tiles of 16 outputs (AVX512-VNNI)
// The integer kernel above sums each weight row across its 8 lanes at the end (a horizontal sum per output and row of
// x), widens every code twice per 64 inputs and multiplies with vpmaddwd + vpaddd (two instructions per 16 products):
// at 8 rows of x it ran at 40-64 G MAC/s on 2 Zen 4 cores, the int4 batch-8 step's ceiling (decode_speed, session 26).
// A copy of the weight in tiles of 16 outputs lets one vpdpwssd take 16 outputs' products of an input pair against
// that pair of x broadcast (its int32 lanes are the outputs): no horizontal sums, one widening per 64 weights shared by
// up to 8 rows of x, one instruction per 32 products. Per tile and weight group: G / 4 steps of 32 bytes, byte 2 j + u
// holding output j's codes at x positions 4 s + u (low nibble) and 4 s + 2 + u (high) -- positions in the integer
// kernels' x order (i16_quantize: a lane order per 64 inputs), so both kernels take the same quantized rows -- then
// the group's scales (and zeros) of the 16 outputs as S. Widened to 16-bit lanes, the low nibbles are the pairs of
// positions (4 s, 4 s + 1) of the 16 outputs and the high ones (4 s + 2, 4 s + 3). Per output and group the integer
// sum is the row kernel's (exact); the float steps are the row kernel's in one lane (scale * sx times the sum, summed
// over groups; (zero - 8 scale) * sum sx xi over groups beside it), so a row's result does not depend on the rows or
// tiles beside it (a verify's tokens equal one-token steps bitwise); against the row kernel it differs by float
// rounding (its 8 partial sums per row).
constexpr int64_t I4_TILE = 16;

template <typename S>
constexpr int64_t i4_tile_group_bytes(int64_t G, int64_t Z) {  // codes, then Z x 16 scales (zeros) of S
  return 8 * G + Z * I4_TILE * static_cast<int64_t>(sizeof(S));
}

// the code at x position j (0..63) of a 64-input block of one weight row in waferline's layout (32 bytes): position
// j holds the input of the integer kernels' lane j (i16_lane_input), whose code sits in byte b's low or high nibble
inline int i4_code_at(const uint8_t* qb, int j) {
  const int v = j / 16, i = j % 16;
  const int b = (i < 8 ? i : i + 8) + (v % 2 ? 8 : 0);
  return v >= 2 ? qb[b] >> 4 : qb[b] & 15;
}

// the tile copy of an int4 weight (packed [(E,) N, K/2], scales sz [(E,) N, K/G, Z] of S; G a multiple of 64):
// [E][ceil(N / 16)][K / G][i4_tile_group_bytes], outputs past N code 8 with scale and zero 0
template <typename S>
at::Tensor pack_int4_tiles(const at::Tensor& packed, const at::Tensor& sz, int64_t G) {
  const int64_t E = packed.dim() == 3 ? packed.size(0) : 1, N = packed.size(-2), K = packed.size(-1) * 2;
  const int64_t ng = K / G, Z = sz.size(-1), T = (N + I4_TILE - 1) / I4_TILE, gb = i4_tile_group_bytes<S>(G, Z);
  auto out = tile_buffer(E * T * ng * gb);
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const S* sp = reinterpret_cast<const S*>(sz.data_ptr());
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, E * T, 1, [&](int64_t a, int64_t b) {
    for (int64_t et = a; et < b; ++et) {
      const int64_t e = et / T, t = et % T;
      for (int64_t g = 0; g < ng; ++g) {
        uint8_t* d = dst + (et * ng + g) * gb;
        for (int64_t st = 0; st < G / 4; ++st)
          for (int bb = 0; bb < 32; ++bb) {
            const int64_t n = t * I4_TILE + bb / 2, pos = g * G + 4 * st + bb % 2;  // (pos + 2: the high nibble's)
            if (n >= N) {
              d[st * 32 + bb] = 0x88;
              continue;
            }
            const uint8_t* row = q + (e * N + n) * (K / 2);
            const int lo = i4_code_at(row + pos / 64 * 32, pos % 64), hi = i4_code_at(row + pos / 64 * 32, pos % 64 + 2);
            d[st * 32 + bb] = static_cast<uint8_t>(lo | hi << 4);
          }
        S* sc = reinterpret_cast<S*>(d + 8 * G);
        for (int64_t z = 0; z < Z; ++z)
          for (int64_t j = 0; j < I4_TILE; ++j) {
            const int64_t n = t * I4_TILE + j;
            sc[z * I4_TILE + j] = n < N ? sp[((e * N + n) * ng + g) * Z + z] : S(0.f);
          }
      }
    }
  });
  return out;
}

// acc + the products of w's 16-bit lanes with the pair of 16-bit x at p broadcast to every 32-bit lane, summed per
// lane pair (vpdpwssd with an embedded broadcast). Inline assembly: GCC 12's intrinsic for it copied every
// accumulator to another register and back around each product (2 extra moves per vpdpwssd in the 8-row loop).
inline __m512i dpwssd_bcast(__m512i acc, __m512i w, const int16_t* p) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// MR rows of quantized x (xq [MR, K] in the integer kernels' order, sx / xs [MR, K/G]) through one tile at p ->
// y[m * ldy + n0 + i] for n0 + i < n1 (n1 - n0 <= 16). A int32 accumulators per row (chains: 4 at 1 row, 2 up to 4
// rows, 1 above), summed per group (exact).
template <int MR, int A, typename T, typename S>
inline void int4_tile_block(const int16_t* xq, const float* sx, const float* xs, int64_t K, int64_t G, int64_t Z,
                            const uint8_t* p, T* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int U = A == 4 ? 2 : 1;  // steps per iteration
  const int64_t ng = K / G, gb = i4_tile_group_bytes<S>(G, Z), steps = G / 4;
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  __m512 tot[MR], off[MR];
  for (int m = 0; m < MR; ++m) tot[m] = _mm512_setzero_ps(), off[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g, p += gb) {
    __m512i acc[MR][A];
    for (int m = 0; m < MR; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_si512();
    const int16_t* xg = xq + g * G;
    for (int64_t st = 0; st < steps; st += U) {
      // the weight stream 1 KB ahead, non-temporal (a hint: no number changes, and one past a tile's end cannot
      // fault): llama's int4 batch-8 step 1.09-1.18x paired in three same-run A/Bs, batch 1 0.97-1.06x (README)
      _mm_prefetch(reinterpret_cast<const char*>(p + st * 32 + 1024), _MM_HINT_NTA);
      for (int u = 0; u < U; ++u) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (st + u) * 32)));
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi16(v, 4);
        for (int m = 0; m < MR; ++m) {  // x positions (4 s, 4 s + 1) against lo, (4 s + 2, 4 s + 3) against hi
          const int16_t* xp = xg + m * K + 4 * (st + u);
          acc[m][(2 * u) % A] = dpwssd_bcast(acc[m][(2 * u) % A], lo, xp);
          acc[m][(2 * u + 1) % A] = dpwssd_bcast(acc[m][(2 * u + 1) % A], hi, xp + 2);
        }
      }
    }
    const S* sc = reinterpret_cast<const S*>(p + 8 * G);
    const __m512 s = load16_f32<S>(sc), z = Z > 1 ? load16_f32<S>(sc + I4_TILE) : _mm512_setzero_ps();
    const __m512 zt = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);  // zero - 8 scale (8 scale exact: one rounding)
    for (int m = 0; m < MR; ++m) {
      __m512i a = acc[m][0];
      for (int i = 1; i < A; ++i) a = _mm512_add_epi32(a, acc[m][i]);
      tot[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(s, _mm512_set1_ps(sx[m * ng + g])), tot[m]);
      off[m] = _mm512_fmadd_ps(zt, _mm512_set1_ps(xs[m * ng + g]), off[m]);
    }
  }
  const int64_t left = n1 - n0;
  const __mmask16 keep = left >= I4_TILE ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  for (int m = 0; m < MR; ++m) store16_rounded<T>(y + m * ldy + n0, _mm512_add_ps(tot[m], off[m]), keep);
}

// outputs n0..n1 (n0 a multiple of 16) of the tile copy ``tiles`` (one expert's) for M rows of quantized x: each
// tile through the rows 8 at a time (the tile stays in L1 for the next 8)
template <typename T, typename S>
void int4_tile_span(const int16_t* xq, const float* sx, const float* xs, int64_t M, const uint8_t* tiles, int64_t Z,
                    int64_t K, int64_t G, T* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t ng = K / G, tb = ng * i4_tile_group_bytes<S>(G, Z);
  for (int64_t a = n0; a < n1; a += I4_TILE) {
    const uint8_t* p = tiles + a / I4_TILE * tb;
    const int64_t b = std::min(n1, a + I4_TILE);
    for (int64_t m0 = 0; m0 < M;) {
      const int16_t* xm = xq + m0 * K;
      const float *sm = sx + m0 * ng, *zm = xs + m0 * ng;
      T* ym = y + m0 * ldy;
      const int64_t r = std::min<int64_t>(8, M - m0);
      switch (r) {
        case 1: int4_tile_block<1, 4, T, S>(xm, sm, zm, K, G, Z, p, ym, ldy, a, b); break;
        case 2: int4_tile_block<2, 2, T, S>(xm, sm, zm, K, G, Z, p, ym, ldy, a, b); break;
        case 3: int4_tile_block<3, 2, T, S>(xm, sm, zm, K, G, Z, p, ym, ldy, a, b); break;
        case 8: int4_tile_block<8, 1, T, S>(xm, sm, zm, K, G, Z, p, ym, ldy, a, b); break;
        default: int4_tile_block<4, 2, T, S>(xm, sm, zm, K, G, Z, p, ym, ldy, a, b); break;  // 4 of 4..7
      }
      m0 += r >= 4 && r < 8 ? 4 : r;
    }
  }
}
#endif

// v at least n long: a buffer kept from call to call grows and never shrinks, so a call after a larger one does not
// zero-fill what it then overwrites (a decode step's MoE jobs change size from step to step)
template <typename V>
inline void at_least(V& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

struct I16Rows {  // M rows of a product's input as 16-bit fixed point (i16_quantize) for groups of G
  std::vector<int16_t> xq;
  std::vector<float> sx, xs;
  int64_t M = 0, K = 0, G = 0;
  void resize(int64_t M_, int64_t K_, int64_t G_) {
    M = M_, K = K_, G = G_;
    at_least(xq, M * K), at_least(sx, M * (K / G)), at_least(xs, M * (K / G));
  }
  void set(const float* xf, int64_t M_, int64_t K_, int64_t G_) {
    resize(M_, K_, G_);
    i16_quantize(xf, M, K, G, xq.data(), sx.data(), xs.data());
  }
  void set_row(int64_t m, const float* xf) {  // row m alone (the same numbers: rows are quantized independently)
    const int64_t ng = K / G;
    i16_quantize(xf, 1, K, G, xq.data() + m * K, sx.data() + m * ng, xs.data() + m * ng);
  }
};

// M rows (any number) of 16-bit x through the int4 weight, 4 rows at a time over each weight row (it stays in L1)
template <typename T, typename S>
void int4_rows_i16(const float* xf, int64_t M, const uint8_t* q, const S* sz, int64_t Z, int64_t N, int64_t K,
                   int64_t G, T* y, int64_t ldy, const uint8_t* tiles = nullptr) {
  I16Rows x;
  x.set(xf, M, K, G);
#ifdef WAFERLINE_INT4_TILES
  if (tiles != nullptr) {  // the weight's tile copy (int4_tiles), split across threads by tiles
    const int64_t nt = (N + I4_TILE - 1) / I4_TILE;
    at::parallel_for(0, nt, std::max<int64_t>(1, 32768 / (I4_TILE * K)), [&](int64_t t0, int64_t t1) {
      int4_tile_span<T, S>(x.xq.data(), x.sx.data(), x.xs.data(), M, tiles, Z, K, G, y, ldy, t0 * I4_TILE,
                           std::min(N, t1 * I4_TILE));
    });
    return;
  }
#endif
  (void)tiles;
  at::parallel_for(0, N, std::max<int64_t>(16, 16384 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    int4_i16_span<T, S>(x.xq.data(), x.sx.data(), x.xs.data(), M, q, sz, Z, K, G, y, ldy, n0, n1);
  });
}

template <typename S>
inline void int4_dequant_row_avx2(const uint8_t* q, const S* sz, int64_t Z, int64_t K, int64_t G, float* w) {
  const Int4Widen wd;
  const int64_t K64 = K / INT4_BLOCK * INT4_BLOCK;
  __m256 sl, zl, sh, zh, v[8];
  for (int64_t k0 = 0; k0 < K64; k0 += INT4_BLOCK) {
    int4_scale(sz, Z, k0 / G, sl, zl);
    int4_scale(sz, Z, (k0 + 32) / G, sh, zh);
    wd.block(q + k0 / 2, sl, zl, sh, zh, v);
    for (int t = 0; t < 8; ++t) _mm256_storeu_ps(w + k0 + 8 * t, v[t]);
  }
  if (K64 < K) {
    int4_scale(sz, Z, K64 / G, sl, zl);
    wd.tail(q + K64 / 2, sl, zl, v);
    for (int t = 0; t < 4; ++t) _mm256_storeu_ps(w + K64 + 8 * t, v[t]);
  }
}
#endif

template <typename S>
inline void int4_dequant_row(const uint8_t* q, const S* sz, int64_t Z, int64_t K, int64_t G, float* w) {
#if defined(__AVX2__) && defined(__FMA__)
  if (!g_portable.load(std::memory_order_relaxed)) return int4_dequant_row_avx2<S>(q, sz, Z, K, G, w);
#endif
  int4_dequant_row_generic<S>(q, sz, Z, K, G, w);
}

// waferline::i16_rows: fp32 rows x [M, K] as the integer-activation kernels hold them, per row and group of G inputs
// (i16_quantize; the scalar loop with use_portable): (xq int16 [M, K] in the kernels' lane order per 64 inputs, sx
// [M, K / G], sx * sum xq [M, K / G]). For tests: the vector quantizer against the scalar one and the fixed point.
std::tuple<at::Tensor, at::Tensor, at::Tensor> i16_rows(const at::Tensor& x, int64_t G) {
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "waferline::i16_rows: x must be fp32 [M, K] on the CPU");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(G > 0 && G % INT4_BLOCK == 0 && G <= I16_MAX_GROUP && K % G == 0,
              "waferline::i16_rows: the group must be a multiple of 64, at most 4096, and divide K");
  auto xc = x.contiguous();
  auto xq = at::empty({M, K}, x.options().dtype(at::kShort));
  auto sx = at::empty({M, K / G}, x.options()), xs = at::empty({M, K / G}, x.options());
  i16_quantize(xc.data_ptr<float>(), M, K, G, xq.data_ptr<int16_t>(), sx.data_ptr<float>(), xs.data_ptr<float>());
  return {xq, sx, xs};
#else
  (void)x, (void)G;
  TORCH_CHECK(false, "waferline::i16_rows: the integer-activation kernels are AVX2 code");
#endif
}

// The tile copy of an int4 weight (packed [(E,) N, K/2], scales [(E,) N, K/G, Z]) for the integer kernel, made at its
// first use and kept as bf16_tiles keeps its copies (the scales' storage and version checked too); an undefined tensor
// where the row kernel runs (no AVX512-VNNI, tiles or integer activations off, groups the integer kernel does not
// take, not contiguous, an inference tensor). Costs a second copy of the weight (its scales laid out per tile).
at::Tensor int4_tiles(const at::Tensor& packed, const at::Tensor& sz, int64_t G) {
#ifdef WAFERLINE_INT4_TILES
  if (!g_int_tiles.load(std::memory_order_relaxed) || g_portable.load(std::memory_order_relaxed) ||
      !g_int_act.load(std::memory_order_relaxed) || G <= 0 || G % INT4_BLOCK != 0 || G > I16_MAX_GROUP ||
      packed.scalar_type() != at::kByte || (packed.dim() != 2 && packed.dim() != 3) || sz.dim() != packed.dim() + 1 ||
      packed.size(-1) * 2 % G != 0 || !packed.is_contiguous() || !sz.is_contiguous() || packed.is_inference() ||
      sz.is_inference() || !packed.has_storage() || !sz.has_storage() || packed.numel() == 0)
    return at::Tensor();
  switch (sz.scalar_type()) {
    case at::kBFloat16:
      return cached_tiles(TILE_INT4, packed, sz, [&] { return pack_int4_tiles<c10::BFloat16>(packed, sz, G); });
    case at::kHalf: return cached_tiles(TILE_INT4, packed, sz, [&] { return pack_int4_tiles<c10::Half>(packed, sz, G); });
    case at::kFloat: return cached_tiles(TILE_INT4, packed, sz, [&] { return pack_int4_tiles<float>(packed, sz, G); });
    default: return at::Tensor();
  }
#else
  (void)packed, (void)sz, (void)G;
  return at::Tensor();
#endif
}

// where expert e (e < 0: not stacked) of an int4 weight's tile copy starts, for the weight ``packed``; null where it
// has none
const uint8_t* int4_tiles_of(const at::Tensor& tiles, const at::Tensor& packed, int64_t e) {
  if (!tiles.defined()) return nullptr;
  const int64_t E = packed.dim() == 3 ? packed.size(0) : 1;
  return tiles.data_ptr<uint8_t>() + std::max<int64_t>(e, 0) * (tiles.numel() / E);
}

// y[m * ldy + n] for m < M <= 8: the vector kernel where the CPU has AVX2 + FMA (and the portable loop is not forced)
template <typename T, typename S>
void int4_few_rows(const float* xf, int64_t M, const uint8_t* q, const S* sz, int64_t Z, int64_t N, int64_t K,
                   int64_t G, T* y, int64_t ldy, const uint8_t* tiles = nullptr) {
#if defined(__AVX2__) && defined(__FMA__)
  if (!g_portable.load(std::memory_order_relaxed)) {
    if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {  // 16-bit x: integer kernel
      if (G % INT4_BLOCK == 0 && G <= I16_MAX_GROUP && g_int_act.load(std::memory_order_relaxed))
        return int4_rows_i16<T, S>(xf, M, q, sz, Z, N, K, G, y, ldy, tiles);
    }
    switch (M) {
      case 1: return int4_rows_avx2<1, T, S>(xf, q, sz, Z, N, K, G, y, ldy);
      case 2: return int4_rows_avx2<2, T, S>(xf, q, sz, Z, N, K, G, y, ldy);
      case 3: return int4_rows_avx2<3, T, S>(xf, q, sz, Z, N, K, G, y, ldy);
      case 4: return int4_rows_avx2<4, T, S>(xf, q, sz, Z, N, K, G, y, ldy);
      case 5: return int4_rows_avx2<5, T, S>(xf, q, sz, Z, N, K, G, y, ldy);
      case 6: return int4_rows_avx2<6, T, S>(xf, q, sz, Z, N, K, G, y, ldy);
      case 7: return int4_rows_avx2<7, T, S>(xf, q, sz, Z, N, K, G, y, ldy);
      case 8: return int4_rows_avx2<8, T, S>(xf, q, sz, Z, N, K, G, y, ldy);
    }
  }
#endif
  int4_rows_generic<T, S>(xf, M, q, sz, Z, N, K, G, y, ldy);
}

// more rows without a tile copy: dequantise once, fp32 GEMM (measured about even with the row kernel at 16 rows)
constexpr int64_t INT4_KERNEL_ROWS = 16;
// rows per pass of the tile kernel over a weight in a many-row product: their 16-bit inputs (128 x K int16) stay in
// L2 while each 16-output tile of the weight passes over them
constexpr int64_t INT4_CHUNK_ROWS = 128;

// whether X's rows may go through the integer int4 kernel with 16-bit activations, where the weight has a tile copy
// (any number of rows: a prefill's through the tile kernel ran 2-3x the fp32 GEMM path's multiply-adds per second on
// a 2-core Zen 4, and each row's result equals that row's alone: a prompt's numbers are its decode steps')
inline bool int4_int_rows(const at::Tensor& X) {
  return X.scalar_type() == at::kBFloat16 || X.scalar_type() == at::kHalf;
}

// X [R, K] (contiguous) through an int4 weight (packed [N, K/2], sz [N, K/G, Z]) -> [R, N] contiguous, X's dtype;
// ``tiles``: the weight's tile copy (int4_tiles), where it has one, for 16-bit X
at::Tensor int4_mm(const at::Tensor& X, const at::Tensor& packed, const at::Tensor& sz, int64_t G,
                   const uint8_t* tiles = nullptr) {
  const int64_t R = X.size(0), K = X.size(1), N = packed.size(0), Z = sz.size(2);
  if (R == 0 || N == 0) return at::empty({R, N}, X.options());
  at::Tensor y;  // the many-row path's GEMM allocates its own result
  const uint8_t* q = packed.data_ptr<uint8_t>();
  auto run = [&](auto s_tag) {
    using S = decltype(s_tag);
    const S* sp = reinterpret_cast<const S*>(sz.data_ptr());
    if (R > INT4_KERNEL_ROWS && tiles == nullptr) {
      auto W = at::empty({N, K}, X.options().dtype(at::kFloat));
      float* wp = W.data_ptr<float>();
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) int4_dequant_row<S>(q + n * (K / 2), sp + n * (K / G) * Z, Z, K, G, wp + n * K);
      });
      auto Xf = X.scalar_type() == at::kFloat ? X : widen(X);
      y = narrow_to(at::mm(Xf, W.t()), X.scalar_type());
      return;
    }
    y = at::empty({R, N}, X.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, X.scalar_type(), "waferline_int4_rows", [&] {
      const scalar_t* xp = X.data_ptr<scalar_t>();
      scalar_t* yp = y.data_ptr<scalar_t>();
      if (tiles != nullptr && (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>)) {
        std::vector<float> xf(std::min(R, INT4_CHUNK_ROWS) * K);  // (a chunk's rows in fp32 at a time)
        for (int64_t r0 = 0; r0 < R; r0 += INT4_CHUNK_ROWS) {  // (up to a chunk: one pass)
          const int64_t rows = std::min(INT4_CHUNK_ROWS, R - r0);
          load_f32<scalar_t>(xp + r0 * K, xf.data(), rows * K);
          int4_few_rows<scalar_t, S>(xf.data(), rows, q, sp, Z, N, K, G, yp + r0 * N, N, tiles);
        }
        return;
      }
      std::vector<float> xf(R * K);
      load_f32<scalar_t>(xp, xf.data(), R * K);
      for (int64_t r0 = 0; r0 < R; r0 += 8)
        int4_few_rows<scalar_t, S>(xf.data() + r0 * K, std::min<int64_t>(8, R - r0), q, sp, Z, N, K, G, yp + r0 * N, N);
    });
  };
  switch (sz.scalar_type()) {
    case at::kBFloat16: run(c10::BFloat16()); break;
    case at::kHalf: run(c10::Half()); break;
    case at::kFloat: run(0.f); break;
    default: TORCH_CHECK(false, "waferline::int4_linear: scales must be bf16, fp16 or fp32");
  }
  return y;
}

bool int4_shaped(const at::Tensor& packed, const at::Tensor& sz, int64_t G, int64_t N, int64_t K) {
  return packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(0) == N && packed.size(1) * 2 == K &&
         G > 0 && G % 32 == 0 && K % G == 0 && sz.dim() == 3 && sz.size(0) == N && sz.size(1) == K / G &&
         (sz.size(2) == 1 || sz.size(2) == 2) && packed.is_contiguous() && sz.is_contiguous();
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t group) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && sz.device().is_cpu(), "waferline::int4_linear: CPU tensors only");
  const int64_t N = packed.dim() == 2 ? packed.size(0) : 0, K = x.size(-1);
  TORCH_CHECK(int4_shaped(packed, sz, group, N, K),
              "waferline::int4_linear: x [..., K], packed uint8 [N, K/2], scales [N, K/group, 1 or 2], group a multiple "
              "of 32 dividing K, all contiguous");
  auto xc = x.contiguous();
  auto X = xc.reshape({-1, K});
  const auto tiles = int4_int_rows(X) ? int4_tiles(packed, sz, group) : at::Tensor();
  auto y = int4_mm(X, packed, sz, group, int4_tiles_of(tiles, packed, -1));
  auto sizes = xc.sizes().vec();
  sizes.back() = N;
  return y.reshape(sizes);
}

// ---------------------------------------------------------------- int8 LM head
// y [R, N] (fp32) = x [R, K] @ (q [N, K] int8 * scale [N])^T: the head of a small model is the largest matrix a decode
// step reads (32000 x 512 for the 135M dsv3). Where the CPU has AVX2, x is held per 64 inputs as 16-bit fixed point
// (as int4_rows_i16 holds it: x_k ~ sx * xi_k, |xi| <= 32767) and the int8 weights widen to 16-bit lanes for vpmaddwd:
// exact int32 sums per 64 inputs, scaled in fp32. ATen's _weight_int8pack_mm ran this product at ~5.5 GB/s on one
// Zen 3 core (fp32 FMAs on widened weights) and returned x's 16-bit dtype. Elsewhere a portable fp32 loop.
constexpr int64_t I8_GROUP = 64;

template <typename S>
void int8_rows_generic(const float* xf, int64_t M, const int8_t* q, const S* scale, int64_t N, int64_t K, float* y) {
  at::parallel_for(0, N, std::max<int64_t>(16, 16384 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    std::vector<float> w(K);
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t k = 0; k < K; ++k) w[k] = static_cast<float>(q[n * K + k]);
      const float s = f32(scale[n]);
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = s * dotf(xf + m * K, w.data(), K);
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
template <int M, typename S>
void int8_block_i16(const int16_t* xq, const float* sx, const int8_t* q, const S* scale, int64_t N, int64_t K,
                    float* y, int64_t n0, int64_t n1) {
  const int64_t ng = (K + I8_GROUP - 1) / I8_GROUP, K64 = K / I8_GROUP * I8_GROUP, K16 = K / 16 * 16;
  auto ld16 = [](const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  auto w16 = [](const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qr = q + n * K;
    __m256 tot[M];
    for (int m = 0; m < M; ++m) tot[m] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K64; k0 += I8_GROUP) {  // whole groups: 4 x 16 weights, then one scale per row
      const __m256i w0 = w16(qr + k0), w1 = w16(qr + k0 + 16), w2 = w16(qr + k0 + 32), w3 = w16(qr + k0 + 48);
      const int64_t g = k0 / I8_GROUP;
      for (int m = 0; m < M; ++m) {
        const int16_t* xm = xq + m * K + k0;
        __m256i a = _mm256_add_epi32(_mm256_madd_epi16(w0, ld16(xm)), _mm256_madd_epi16(w1, ld16(xm + 16)));
        const __m256i b = _mm256_add_epi32(_mm256_madd_epi16(w2, ld16(xm + 32)), _mm256_madd_epi16(w3, ld16(xm + 48)));
        a = _mm256_add_epi32(a, b);
        tot[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(sx[m * ng + g]), tot[m]);
      }
    }
    float tail[M] = {};
    if (K64 < K) {  // a shorter last group: whole 16s, then single inputs
      const int64_t g = K64 / I8_GROUP;
      for (int m = 0; m < M; ++m) {
        __m256i a = _mm256_setzero_si256();
        for (int64_t k = K64; k < K16; k += 16)
          a = _mm256_add_epi32(a, _mm256_madd_epi16(w16(qr + k), ld16(xq + m * K + k)));
        int32_t t = 0;
        for (int64_t k = K16; k < K; ++k) t += qr[k] * xq[m * K + k];
        tot[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(sx[m * ng + g]), tot[m]);
        tail[m] = static_cast<float>(t) * sx[m * ng + g];
      }
    }
    const float s = f32(scale[n]);
    for (int m = 0; m < M; ++m) y[m * N + n] = s * (hsum8(tot[m]) + tail[m]);
  }
}

#ifdef WAFERLINE_INT4_TILES
// The int8 head in tiles of 16 outputs (as the int4 weights' tiles, above): per tile, K / 2 steps of 32 bytes (byte
// 2 j + u: output j's weight at input 2 s + u; widened to 16-bit lanes, the pairs (2 s, 2 s + 1) of the 16 outputs)
// against x's pair broadcast, one vpdpwssd per 32 products, then the tile's 16 scales (S). Per output the same exact
// integer sum per 64 inputs as int8_block_i16 and the same float steps in one lane (sx times that, summed over the
// groups, times the scale): rows do not change each other's results. K even.
template <typename S>
constexpr int64_t i8_tile_bytes(int64_t K) {
  return 16 * K + I4_TILE * static_cast<int64_t>(sizeof(S));
}

template <typename S>
at::Tensor pack_int8_tiles(const at::Tensor& q, const at::Tensor& scale) {
  const int64_t N = q.size(0), K = q.size(1), T = (N + I4_TILE - 1) / I4_TILE, tb = i8_tile_bytes<S>(K);
  auto out = tile_buffer(T * tb);
  const int8_t* qp = q.data_ptr<int8_t>();
  const S* sp = reinterpret_cast<const S*>(scale.data_ptr());
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, T, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      int8_t* d = reinterpret_cast<int8_t*>(dst + t * tb);
      for (int64_t st = 0; st < K / 2; ++st)
        for (int bb = 0; bb < 32; ++bb) {
          const int64_t n = t * I4_TILE + bb / 2;
          d[st * 32 + bb] = n < N ? qp[n * K + 2 * st + bb % 2] : 0;
        }
      S* sc = reinterpret_cast<S*>(d + 16 * K);
      for (int64_t j = 0; j < I4_TILE; ++j) sc[j] = t * I4_TILE + j < N ? sp[t * I4_TILE + j] : S(0.f);
    }
  });
  return out;
}

// MR rows of 16-bit x (xq [MR, K], sx [MR, groups of 64]) through one int8 tile at p -> y[m * ldy + n0 + i] (fp32)
// for n0 + i < n1; A accumulators per row (chains), summed per group (exact)
template <int MR, int A, typename S>
inline void int8_tile_block(const int16_t* xq, const float* sx, int64_t K, const uint8_t* p, float* y, int64_t ldy,
                            int64_t n0, int64_t n1) {
  const int64_t ng = (K + I8_GROUP - 1) / I8_GROUP;
  __m512 tot[MR];
  for (int m = 0; m < MR; ++m) tot[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t s0 = g * I8_GROUP / 2, s1 = std::min(K, (g + 1) * I8_GROUP) / 2;
    __m512i acc[MR][A];
    for (int m = 0; m < MR; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_si512();
    int64_t st = s0;
    auto step = [&](int64_t s, int a) {
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + s * 32)));
      for (int m = 0; m < MR; ++m) acc[m][a] = dpwssd_bcast(acc[m][a], w, xq + m * K + 2 * s);
    };
    for (; st + A <= s1; st += A)
      for (int a = 0; a < A; ++a) step(st + a, a);
    for (; st < s1; ++st) step(st, 0);
    for (int m = 0; m < MR; ++m) {
      __m512i a = acc[m][0];
      for (int i = 1; i < A; ++i) a = _mm512_add_epi32(a, acc[m][i]);
      tot[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(sx[m * ng + g]), tot[m]);
    }
  }
  const __m512 s = load16_f32<S>(reinterpret_cast<const S*>(p + 16 * K));
  const int64_t left = n1 - n0;
  const __mmask16 keep = left >= I4_TILE ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * ldy + n0, keep, _mm512_mul_ps(s, tot[m]));
}

template <typename S>
void int8_tile_rows(const int16_t* xq, const float* sx, int64_t M, const uint8_t* tiles, int64_t N, int64_t K,
                    float* y) {
  const int64_t nt = (N + I4_TILE - 1) / I4_TILE, tb = i8_tile_bytes<S>(K), ng = (K + I8_GROUP - 1) / I8_GROUP;
  at::parallel_for(0, nt, std::max<int64_t>(1, 32768 / (I4_TILE * K)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* p = tiles + t * tb;
      const int64_t a = t * I4_TILE, b = std::min(N, a + I4_TILE);
      for (int64_t m0 = 0; m0 < M;) {
        const int64_t r = std::min<int64_t>(8, M - m0);
        const int16_t* xm = xq + m0 * K;
        const float* sm = sx + m0 * ng;
        switch (r) {
          case 1: int8_tile_block<1, 4, S>(xm, sm, K, p, y + m0 * N, N, a, b); break;
          case 2: int8_tile_block<2, 2, S>(xm, sm, K, p, y + m0 * N, N, a, b); break;
          case 3: int8_tile_block<3, 2, S>(xm, sm, K, p, y + m0 * N, N, a, b); break;
          case 8: int8_tile_block<8, 1, S>(xm, sm, K, p, y + m0 * N, N, a, b); break;
          default: int8_tile_block<4, 2, S>(xm, sm, K, p, y + m0 * N, N, a, b); break;  // 4 of 4..7
        }
        m0 += r >= 4 && r < 8 ? 4 : r;
      }
    }
  });
}
#endif

template <typename S>
void int8_rows_i16(const float* xf, int64_t M, const int8_t* q, const S* scale, int64_t N, int64_t K, float* y,
                   const uint8_t* tiles = nullptr) {
  const int64_t ng = (K + I8_GROUP - 1) / I8_GROUP;
  std::vector<int16_t> xq(M * K);
  std::vector<float> sx(M * ng);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t k0 = g * I8_GROUP, k1 = std::min(K, k0 + I8_GROUP);
      const float inv = fixed16_inv(xf + m * K + k0, k1 - k0, &sx[m * ng + g]);
      for (int64_t k = k0; k < k1; ++k) xq[m * K + k] = fixed16(xf[m * K + k], inv);
    }
#ifdef WAFERLINE_INT4_TILES
  if (tiles != nullptr) return int8_tile_rows<S>(xq.data(), sx.data(), M, tiles, N, K, y);
#endif
  (void)tiles;
  at::parallel_for(0, N, std::max<int64_t>(16, 16384 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += I16_TILE) {  // a tile of weight rows stays in L1 for every 4 rows of x
      const int64_t t1 = std::min(n1, t0 + I16_TILE);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int16_t* xm = xq.data() + m0 * K;
        const float* sm = sx.data() + m0 * ng;
        float* ym = y + m0 * N;
        switch (std::min<int64_t>(4, M - m0)) {
          case 1: int8_block_i16<1, S>(xm, sm, q, scale, N, K, ym, t0, t1); break;
          case 2: int8_block_i16<2, S>(xm, sm, q, scale, N, K, ym, t0, t1); break;
          case 3: int8_block_i16<3, S>(xm, sm, q, scale, N, K, ym, t0, t1); break;
          default: int8_block_i16<4, S>(xm, sm, q, scale, N, K, ym, t0, t1); break;
        }
      }
    }
  });
}
#endif

// ---------------------------------------------------------------- greedy sampling
// the index of the first largest value of x[0..n) (a NaN counts as larger than any number: its first index), what
// torch.argmax returns. ATen's reduction took ~35 us for a 32000-token vocabulary on a 2-core AVX2 CPU (~1% of a
// small model's decode step); this is one vector pass for the largest value and one for its first index.
inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
#if defined(__AVX2__)
  __m256 mv = _mm256_set1_ps(m), nan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mv = _mm256_max_ps(mv, v);
  }
  if (_mm256_movemask_ps(nan)) {
    for (int64_t k = 0; k < n; ++k)
      if (std::isnan(x[k])) return k;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (float v : lanes) m = std::max(m, v);
#endif
  for (int64_t k = i; k < n; ++k) {
    if (std::isnan(x[k])) {
      for (int64_t j = 0; j <= k; ++j)
        if (std::isnan(x[j])) return j;
    }
    m = std::max(m, x[k]);
  }
  int64_t k = 0;
#if defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(m);
  for (; k + 8 <= n; k += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + k), target, _CMP_EQ_OQ));
    if (hit) return k + __builtin_ctz(hit);
  }
#endif
  for (; k < n; ++k)
    if (x[k] == m) return k;
  return 0;  // (unreachable: m is one of the values)
}

// argmax over the last dimension of fp32 logits [..., V] -> int64 [...]
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() >= 1 &&
                  logits.size(-1) > 0, "waferline::argmax_rows: fp32 CPU logits [..., V] with V > 0");
  auto x = logits.contiguous();
  const int64_t V = x.size(-1), rows = x.numel() / V;
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto out = at::empty(sizes, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 18) / V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

// The tile copy of an int8 head (q [N, K], scale [N]) for the integer kernel, kept as int4_tiles keeps its copies;
// an undefined tensor where the row kernel runs (no AVX512-VNNI, tiles or integer activations off, odd K, not
// contiguous, an inference tensor).
at::Tensor int8_tiles(const at::Tensor& q, const at::Tensor& scale) {
#ifdef WAFERLINE_INT4_TILES
  if (!g_int_tiles.load(std::memory_order_relaxed) || g_portable.load(std::memory_order_relaxed) ||
      !g_int_act.load(std::memory_order_relaxed) || q.size(1) % 2 != 0 || q.numel() == 0 || !q.is_contiguous() ||
      !scale.is_contiguous() || q.is_inference() || scale.is_inference() || !q.has_storage() || !scale.has_storage())
    return at::Tensor();
  switch (scale.scalar_type()) {
    case at::kBFloat16: return cached_tiles(TILE_INT8, q, scale, [&] { return pack_int8_tiles<c10::BFloat16>(q, scale); });
    case at::kHalf: return cached_tiles(TILE_INT8, q, scale, [&] { return pack_int8_tiles<c10::Half>(q, scale); });
    case at::kFloat: return cached_tiles(TILE_INT8, q, scale, [&] { return pack_int8_tiles<float>(q, scale); });
    default: return at::Tensor();
  }
#else
  (void)q, (void)scale;
  return at::Tensor();
#endif
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scale.device().is_cpu(),
              "waferline::int8_linear: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && scale.dim() == 1 && scale.size(0) == q.size(0) &&
                  x.size(-1) == q.size(1),
              "waferline::int8_linear: x [..., K], q int8 [N, K], scale [N]");
  const int64_t N = q.size(0), K = q.size(1);
  auto xc = x.contiguous();
  const int64_t R = K ? xc.numel() / K : 0;
  auto xf = xc.scalar_type() == at::kFloat ? xc : xc.to(at::kFloat);
  auto qc = q.contiguous();
  auto sc = scale.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = N;
  auto y = at::empty(sizes, xc.options().dtype(at::kFloat));
  if (R == 0 || N == 0) return y;
  auto run = [&](auto s_tag) {
    using S = decltype(s_tag);
    const S* sp = reinterpret_cast<const S*>(sc.data_ptr());
    const int8_t* qp = qc.data_ptr<int8_t>();
#if defined(__AVX2__) && defined(__FMA__)
    if (!g_portable.load(std::memory_order_relaxed) && g_int_act.load(std::memory_order_relaxed)) {
      const auto tiles = int8_tiles(qc, sc);
      return int8_rows_i16<S>(xf.data_ptr<float>(), R, qp, sp, N, K, y.data_ptr<float>(),
                              tiles.defined() ? tiles.data_ptr<uint8_t>() : nullptr);
    }
#endif
    int8_rows_generic<S>(xf.data_ptr<float>(), R, qp, sp, N, K, y.data_ptr<float>());
  };
  switch (sc.scalar_type()) {
    case at::kBFloat16: run(c10::BFloat16()); break;
    case at::kHalf: run(c10::Half()); break;
    case at::kFloat: run(0.f); break;
    default: TORCH_CHECK(false, "waferline::int8_linear: scales must be bf16, fp16 or fp32");
  }
  return y;
}

// ---------------------------------------------------------------- MoE FFN (routed experts + shared expert)
// The decode step's MoE block after the router, as one call: for each expert hit by the (token, expert) pairs
// ``idx [N, k]`` its tokens' rows go through gate_up [2I, D], silu(gate) * up, down [D, I] (each product rounded to
// x's dtype, as the eager chain's are), and are summed into fp32 weighted by ``weights [N, k]``; the sum is rounded to
// x's dtype and the shared expert's output (gate_up [2S, D], down [D, S]; S = 0: none) added, rounded again.
// A weight is either dense (x's dtype; ``[E, out, in]`` for the experts, ``[out, in]`` for the shared one) or int4
// in waferline's layout (``sz`` non-empty: packed uint8 [E, out, in / 2] and scales [E, out, in / group, 1 or 2], as
// int4_linear takes them), multiplied by int4_mm. Dense products of up to 8 rows run few_rows, larger groups of rows
// ATen's mm.
struct Bundle {
  const at::Tensor& w;
  const at::Tensor& sz;
  int64_t group;
  bool int4() const { return sz.numel() > 0; }
};

// rows X [R, K] (contiguous) through weight b (expert e, or e < 0: b is not stacked) -> [R, n_out] (row stride >= n_out)
at::Tensor bundle_linear(const at::Tensor& X, const Bundle& b, int64_t e, int64_t n_out) {
  if (b.int4()) {
    const auto tiles = int4_int_rows(X) ? int4_tiles(b.w, b.sz, b.group) : at::Tensor();
    return int4_mm(X, e >= 0 ? b.w.select(0, e) : b.w, e >= 0 ? b.sz.select(0, e) : b.sz, b.group,
                   int4_tiles_of(tiles, b.w, e));
  }
  const int64_t R = X.size(0), K = X.size(1);
  auto W = e >= 0 ? b.w.select(0, e) : b.w;
  if (R > FEW_ROWS) return mm_rows(X, W);
  auto y = at::empty({R, n_out}, X.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, X.scalar_type(), "waferline_moe_linear", [&] {
    if (!few_rows_tiled<scalar_t>(e >= 0 ? b.w : W, e, X.data_ptr<scalar_t>(), R, n_out, K, y.data_ptr<scalar_t>(),
                                  n_out))
      few_rows<scalar_t>(X.data_ptr<scalar_t>(), R, W.data_ptr<scalar_t>(), n_out, K, y.data_ptr<scalar_t>(), n_out);
  });
  return y;
}

template <typename T>
at::Tensor gated_ffn(const at::Tensor& X, const Bundle& gu, const Bundle& dn, int64_t e, int64_t I, int64_t D) {
  auto h = bundle_linear(X, gu, e, 2 * I);  // [R, 2I], row stride h.stride(0)
  auto a = at::empty({X.size(0), I}, X.options());
  silu_mul_rows<T>(h.data_ptr<T>(), a.data_ptr<T>(), X.size(0), I, h.stride(0));
  return bundle_linear(a, dn, e, D);
}

// per expert, the (token * k + slot) pairs of idx [N, k] routed to it, in token order
std::vector<std::vector<int64_t>> expert_pairs(const int64_t* ip, int64_t pairs, int64_t E) {
  std::vector<std::vector<int64_t>> out(E);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ip[p] >= 0 && ip[p] < E, "waferline::moe_ffn: expert index ", ip[p], " out of range");
    out[ip[p]].push_back(p);
  }
  return out;
}

template <typename T>
at::Tensor moe_ffn_impl(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& idx, const Bundle& gu,
                        const Bundle& dn, const Bundle& sgu, const Bundle& sdn, int64_t I, int64_t S) {
  const int64_t N = x.size(0), D = x.size(1), k = idx.size(1), E = gu.w.size(0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = weights.data_ptr<float>();
  const auto pairs = expert_pairs(ip, N * k, E);
  auto acc = at::zeros({N, D}, x.options().dtype(at::kFloat));
  float* ap = acc.data_ptr<float>();
  const T* xp = x.data_ptr<T>();
  for (int64_t e = 0; e < E; ++e) {
    const auto& ps = pairs[e];
    if (ps.empty()) continue;
    const int64_t R = static_cast<int64_t>(ps.size());
    at::Tensor xs;
    if (N == 1) {
      xs = x;
    } else {
      xs = at::empty({R, D}, x.options());
      T* dst = xs.data_ptr<T>();
      for (int64_t r = 0; r < R; ++r) std::copy(xp + (ps[r] / k) * D, xp + (ps[r] / k + 1) * D, dst + r * D);
    }
    at::Tensor o = gated_ffn<T>(xs, gu, dn, e, I, D);
    const T* op = o.data_ptr<T>();
    const int64_t ldo = o.stride(0);
    for (int64_t r = 0; r < R; ++r) {
      float* dst = ap + (ps[r] / k) * D;
      const float wt = wp[ps[r]];
      const T* src = op + r * ldo;
      for (int64_t j = 0; j < D; ++j) dst[j] += f32(src[j]) * wt;
    }
  }
  auto y = acc.to(x.scalar_type());
  if (S > 0) {
    at::Tensor s = gated_ffn<T>(x, sgu, sdn, -1, S, D);
    T* yp = y.data_ptr<T>();
    const T* sp = s.data_ptr<T>();
    const int64_t lds = s.stride(0);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t j = 0; j < D; ++j) yp[t * D + j] = static_cast<T>(f32(yp[t * D + j]) + f32(sp[t * lds + j]));
  }
  return y;
}

at::Tensor moe_ffn(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& idx, const at::Tensor& gu,
                   const at::Tensor& gu_sz, const at::Tensor& dn, const at::Tensor& dn_sz, const at::Tensor& sgu,
                   const at::Tensor& sgu_sz, const at::Tensor& sdn, const at::Tensor& sdn_sz, int64_t group,
                   int64_t inter, int64_t shared_inter) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "waferline::moe_ffn: contiguous CPU x [N, D]");
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == x.size(0) && idx.scalar_type() == at::kLong && idx.is_contiguous() &&
                  weights.sizes() == idx.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "waferline::moe_ffn: weights fp32 and idx int64, both [N, k] and contiguous");
  Bundle b_gu{gu, gu_sz, group}, b_dn{dn, dn_sz, group}, b_sgu{sgu, sgu_sz, group}, b_sdn{sdn, sdn_sz, group};
  for (const Bundle* b : {&b_gu, &b_dn, &b_sgu, &b_sdn}) {
    if (b->int4()) {
      TORCH_CHECK(b->w.scalar_type() == at::kByte && b->w.is_contiguous() && b->sz.is_contiguous(),
                  "waferline::moe_ffn: int4 weights are contiguous uint8 codes with contiguous scales");
    } else if (b->w.numel()) {
      TORCH_CHECK(b->w.scalar_type() == x.scalar_type() && b->w.is_contiguous(),
                  "waferline::moe_ffn: dense weights must be contiguous and of x's dtype");
    }
  }
  // every weight's shape (no product may read past a weight): dense [(E,) out, in]; int4 codes [(E,) out, in / 2] and
  // scales [(E,) out, in / G, 1 or 2]
  const int64_t D = x.size(1), E = gu.dim() ? gu.size(0) : 0;
  auto shaped = [&](const Bundle& b, bool stacked, int64_t out, int64_t in) {
    const at::Tensor& t = b.int4() ? b.sz : b.w;
    const int64_t lead = stacked ? 1 : 0;
    if (stacked && (t.dim() < 1 || t.size(0) != E || b.w.size(0) != E)) return false;
    if (b.int4())
      return int4_shaped(stacked ? b.w.select(0, 0) : b.w, stacked ? b.sz.select(0, 0) : b.sz, b.group, out, in);
    return t.dim() == 2 + lead && t.size(lead) == out && t.size(lead + 1) == in;
  };
  TORCH_CHECK(E > 0 && inter > 0 && shaped(b_gu, true, 2 * inter, D) && shaped(b_dn, true, D, inter),
              "waferline::moe_ffn: experts must be gate_up [E, 2I, D] and down [E, D, I] (or their int4 layouts)");
  TORCH_CHECK(shared_inter == 0 || (shaped(b_sgu, false, 2 * shared_inter, D) && shaped(b_sdn, false, D, shared_inter)),
              "waferline::moe_ffn: the shared expert must be gate_up [2S, D] and down [D, S] (or their int4 layouts)");
  at::Tensor y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "waferline_moe_ffn", [&] {
    y = moe_ffn_impl<scalar_t>(x, weights, idx, b_gu, b_dn, b_sgu, b_sdn, inter, shared_inter);
  });
  return y;
}

// ---------------------------------------------------------------- attention softmax
// In place over L scores (-inf = masked): p = exp(s - max) / sum, with an optional sink logit (-inf = none) that joins
// the sum and is dropped; a row with every score masked (and no sink) becomes all zeros.
inline void softmax_masked(float* s, int64_t L, float sink) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float m16[16];  // the largest score: 16 running maxima (one chain of scalar maxes waits on each; vmaxps's pattern)
  std::fill(m16, m16 + 16, sink);
  int64_t l16 = 0;
  for (; l16 + 16 <= L; l16 += 16)
    for (int i = 0; i < 16; ++i) m16[i] = s[l16 + i] > m16[i] ? s[l16 + i] : m16[i];
  float mx = sink;
  for (; l16 < L; ++l16) mx = std::max(mx, s[l16]);
  for (int i = 0; i < 16; ++i) mx = std::max(mx, m16[i]);
  if (mx == ninf) {
    std::fill(s, s + L, 0.f);
    return;
  }
  float den = sink - mx < -87.f ? 0.f : vexp(sink - mx);  // (vexp, vectorised: std::exp is a libm call per score)
#pragma omp simd reduction(+ : den)
  for (int64_t l = 0; l < L; ++l) {
    const float d = s[l] - mx;  // below e^-87 of the largest (masked -inf too): 0
    const float e = d < -87.f ? 0.f : vexp(d);
    s[l] = e;
    den += e;
  }
  const float inv = 1.f / den;
#pragma omp simd
  for (int64_t l = 0; l < L; ++l) s[l] *= inv;
}

// ---------------------------------------------------------------- grouped-query attention, decode
// q [B, T, H, Dk] (any dtype), kv [B, L, 2 Hkv, D] (the cache rows: Hkv key heads, then Hkv value heads; any dtype),
// blocked bool [B, T, L] (True = masked) or empty, sinks [H] fp32 or empty (a per-head logit that joins the softmax
// and is dropped: GPT-OSS). Per (b, t, head), in fp32: s_l = scale q . k_l; p = softmax(s [, sink]); o = sum_l p_l v_l
// -> [B, T, H, D] in q's dtype. Head h reads key / value head h / (H / Hkv). What `attend` computes for Hkv > 1 in one
// pass over the cache rows (no fp32 copies of the cache, no permuted views, no mask broadcast).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 vectors -> one whose lane i is the sum of v[i]'s 16 lanes, each summed in the same order ((e0 + e2) + (e1 + e3)
// in each 128-bit quarter, then (q0 + q1) + (q2 + q3)): 45 instructions for 16 sums, where one horizontal sum each
// takes ~8
inline __m512 sum16_lanes(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// the 16 dot products q . rows[i] over 16 nc fp32 values, as one vector (lane i: row i's): 16 independent sums in
// registers, then sum16_lanes
inline __m512 dot16(const float* q, const float* const* rows, int64_t nc) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nc; ++j) {
    const __m512 qj = _mm512_loadu_ps(q + 16 * j);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(qj, _mm512_loadu_ps(rows[i] + 16 * j), acc[i]);
  }
  return sum16_lanes(acc);
}

// o[g] = sum over the unmasked l < L of p[g L16 + l] v_l for gn (<= GN) heads g, the value rows v_l = v + l stride
// (16 NC of C) widened in registers, the gn x NC sums held in registers (gn a template argument: no branch per row)
template <int NC, typename C, int GN = 16 / NC>
void gqa_values16(int gn, const C* v, int64_t stride, const bool* mk, int64_t L, const float* p, int64_t L16,
                  float* o) {
  if constexpr (GN > 1) {
    if (gn < GN) return gqa_values16<NC, C, GN - 1>(gn, v, stride, mk, L, p, L16, o);
  }
  __m512 acc[GN][NC];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t l = 0; l < L; ++l) {
    if (mk && mk[l]) continue;
    __m512 vl[NC];
    for (int c = 0; c < NC; ++c) vl[c] = load16_f32<C>(v + l * stride + 16 * c);
    for (int g = 0; g < GN; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * L16 + l]);
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(pg, vl[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + g * 16 * NC + 16 * c, acc[g][c]);
}

#if defined(__AVX512BF16__)
// gqa_item16's scores for bf16 queries and a bf16 cache: q . k_l by vdpbf16ps straight from the cache rows, 32 inputs
// an instruction (bf16 x bf16 products are exact in fp32; each of an input pair's products is added in one rounding,
// as two fmas would; denormal products flush to zero), 16 keys at a time into 16 independent sums per head, then
// sum16_lanes. Each 16-key block also asks for its value rows (the value pass reads them next) and, given nk / nv,
// the next item's key and value rows at the same positions (_MM_HINT_T1; T0 measured slower): the cache rows' latency,
// not their bytes, held llama's attention layer at ~8 GB/s from memory. ~2.5x fewer instructions than widening the
// keys to fp32 first. A key's score still does not depend on L or on its place in its block.
template <int NB>
void gqa_scores_bf16(const uint16_t* qb, const uint16_t* kb, const uint16_t* vb, int64_t stride, int64_t G, int64_t L,
                     int64_t L16, float* sc, const uint16_t* nk, const uint16_t* nv) {
  constexpr int64_t D = 32 * NB;
  alignas(64) static const uint16_t zero_row[D] = {};  // (keys past L: the last block's missing rows)
  for (int64_t l0 = 0; l0 < L; l0 += 16) {
    const uint16_t* rows[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t l = l0 + i;
      rows[i] = l < L ? kb + l * stride : zero_row;
      if (l < L)
        for (int64_t c = 0; c < D * 2; c += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(vb + l * stride) + c, _MM_HINT_T0);
          if (nk != nullptr) {
            _mm_prefetch(reinterpret_cast<const char*>(nk + l * stride) + c, _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(nv + l * stride) + c, _MM_HINT_T1);
          }
        }
    }
    for (int64_t g = 0; g < G; ++g) {
      __m512bh qv[NB];
      for (int c = 0; c < NB; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qb + g * D + 32 * c);
      __m512 acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(rows[i]));
        for (int c = 1; c < NB; ++c)
          acc[i] = _mm512_dpbf16_ps(acc[i], qv[c], (__m512bh)_mm512_loadu_si512(rows[i] + 32 * c));
      }
      _mm512_storeu_ps(sc + g * L16 + l0, sum16_lanes(acc));
    }
  }
}
#endif

// one item of gqa_items with head size D = 16 NC: the G query heads (qf [G, D] fp32) of kv head j over the L key /
// value rows at bb. Scores 16 keys at a time (the block's keys widened to fp32 once for all G heads, 16 independent
// sums per head, then sum16_lanes), the values widened in registers and summed into G x NC accumulators held in
// registers (up to 16: heads GT at a time). A key's score and a value's share do not depend on L or on the key's
// place in its block: a verify's rows equal one-token steps bitwise, as in the generic path. With qbits (the G heads'
// bf16 bits) a bf16 cache's scores are gqa_scores_bf16's instead, which also asks for the next item's rows (next, its
// kv head next_j) while it scores.
template <int NC, typename C>
void gqa_item16(const float* qf, const C* bb, int64_t Hkv, int64_t j, const bool* mk, const float* sinks, int64_t G,
                int64_t L, float scale, float* kb, float* sc, float* o, const uint16_t* qbits = nullptr,
                const C* next = nullptr, int64_t next_j = 0) {
  constexpr int64_t D = 16 * NC, GT = 16 / NC;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t L16 = (L + 15) / 16 * 16;
  bool scored = false;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    if (qbits != nullptr) {  // (the caller's queries are bf16 themselves)
      const uint16_t* base = reinterpret_cast<const uint16_t*>(bb);
      const uint16_t* nb = reinterpret_cast<const uint16_t*>(next);
      gqa_scores_bf16<NC / 2>(qbits, base + j * D, base + (Hkv + j) * D, 2 * Hkv * D, G, L, L16, sc,
                              nb ? nb + next_j * D : nullptr, nb ? nb + (Hkv + next_j) * D : nullptr);
      scored = true;
    }
  }
#else
  (void)qbits;
#endif
  for (int64_t l0 = 0; l0 < L && !scored; l0 += 16) {
    for (int64_t i = 0; i < 16; ++i) {  // the block's keys in fp32 (past L or masked: zeros)
      const int64_t l = l0 + i;
      if (l >= L || (mk && mk[l])) {
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(kb + i * D + 16 * c, _mm512_setzero_ps());
        continue;
      }
      const C* kr = bb + (l * 2 * Hkv + j) * D;
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(kb + i * D + 16 * c, load16_f32<C>(kr + 16 * c));
    }
    const float* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = kb + i * D;
    for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(sc + g * L16 + l0, dot16(qf + g * D, rows, NC));
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = sc + g * L16;
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) s[l] *= scale;
    if (mk)
      for (int64_t l = 0; l < L; ++l) s[l] = mk[l] ? ninf : s[l];
    softmax_masked(s, L, sinks ? sinks[j * G + g] : ninf);
  }
  for (int64_t g0 = 0; g0 < G; g0 += GT)
    gqa_values16<NC, C>(static_cast<int>(std::min(GT, G - g0)), bb + (Hkv + j) * D, 2 * Hkv * D, mk, L,
                        sc + g0 * L16, L16, o + g0 * D);
}
#endif

// items i0..i1 of B T Hkv (query row bt = i / Hkv, kv head j = i % Hkv): the G query heads of kv head j over the L
// key / value rows of row b's cache block, base(b) ([L, 2 Hkv, D]: keys then values)
template <typename Q, typename C, typename F>
void gqa_items(const Q* q, F&& base, const bool* blocked, const float* sinks, Q* out, int64_t T, int64_t H,
               int64_t Hkv, int64_t D, int64_t L, float scale, int64_t i0, int64_t i1) {
  const int64_t G = H / Hkv;
  const float ninf = -std::numeric_limits<float>::infinity();
  thread_local std::vector<float> kbuf, vbuf;  // (kept between calls: ~L * D floats each, not zeroed per call)
  const int64_t kn = std::max<int64_t>(L, 16) * D;  // (gqa_item16: 16 keys)
  if (static_cast<int64_t>(kbuf.size()) < kn) kbuf.resize(kn), vbuf.resize(kn);
  float* kf = kbuf.data();
  float* vf = vbuf.data();
  std::vector<float> qf(G * D), sc(G * ((L + 15) / 16 * 16)), o(G * D);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  constexpr bool wide = std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16> || std::is_same_v<C, c10::Half>;
  const int nc = wide && D % 16 == 0 ? static_cast<int>(D / 16) : 0;
  const bool fast = (nc == 2 || nc == 4 || nc == 8) && !g_portable.load(std::memory_order_relaxed);
#else
  constexpr bool fast = false;
#endif
#if defined(__AVX512BF16__)
  // bf16 queries against a bf16 cache: gqa_item16 scores from the queries' own bits (no fp32 copy of them needed)
  constexpr bool bf16_scores = std::is_same_v<Q, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
#else
  constexpr bool bf16_scores = false;
#endif
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t bt = i / Hkv, j = i % Hkv, b = bt / T;
    if (!(bf16_scores && fast))
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = f32(q[(bt * H + j * G + g) * D + d]);
    const bool* mk = blocked ? blocked + bt * L : nullptr;
    const C* bb = base(b);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if constexpr (wide) {
      if (fast) {
        float *qp = qf.data(), *sp = sc.data(), *op = o.data();
        const uint16_t* qb = nullptr;  // (bf16_scores: the queries' bits, for the vdpbf16ps scores)
        if constexpr (bf16_scores) qb = reinterpret_cast<const uint16_t*>(q + (bt * H + j * G) * D);
        const C* nx = i + 1 < i1 ? base((i + 1) / Hkv / T) : nullptr;  // the next item's rows, asked for early
        const int64_t nj = (i + 1) % Hkv;
        switch (nc) {
          case 2: gqa_item16<2, C>(qp, bb, Hkv, j, mk, sinks, G, L, scale, kf, sp, op, qb, nx, nj); break;
          case 4: gqa_item16<4, C>(qp, bb, Hkv, j, mk, sinks, G, L, scale, kf, sp, op, qb, nx, nj); break;
          default: gqa_item16<8, C>(qp, bb, Hkv, j, mk, sinks, G, L, scale, kf, sp, op, qb, nx, nj); break;
        }
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d) out[(bt * H + j * G + g) * D + d] = static_cast<Q>(o[g * D + d]);
        continue;
      }
    }
#endif
    // this kv head's key and value rows in fp32, widened once (vectorised) for all G query heads; masked rows zero
    for (int64_t l = 0; l < L; ++l) {
      if (mk && mk[l]) {
        std::fill(kf + l * D, kf + (l + 1) * D, 0.f);
        std::fill(vf + l * D, vf + (l + 1) * D, 0.f);
        continue;
      }
      load_f32<C>(bb + (l * 2 * Hkv + j) * D, kf + l * D, D);
      load_f32<C>(bb + (l * 2 * Hkv + Hkv + j) * D, vf + l * D, D);
    }
    for (int64_t g = 0; g < G; ++g) {  // scores: four keys at a time (independent sums)
      float* s = sc.data() + g * L;
      const float* qg = qf.data() + g * D;
      int64_t l = 0;
      for (; l + 4 <= L; l += 4) dot4(qg, kf + l * D, D, D, s + l);
      for (; l < L; ++l) s[l] = dotf(qg, kf + l * D, D);
      for (l = 0; l < L; ++l) s[l] = mk && mk[l] ? ninf : s[l] * scale;
      softmax_masked(s, L, sinks ? sinks[j * G + g] : ninf);
    }
    std::fill(o.begin(), o.end(), 0.f);
    for (int64_t l = 0; l < L; ++l) {
      if (mk && mk[l]) continue;
      const float* vr = vf + l * D;
      for (int64_t g = 0; g < G; ++g) {
        const float p = sc[g * L + l];
        float* og = o.data() + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) og[d] += p * vr[d];
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) out[(bt * H + j * G + g) * D + d] = static_cast<Q>(o[g * D + d]);
  }
}

template <typename Q, typename C>
void gqa_rows(const Q* q, const C* kv, int64_t kvb, const bool* blocked, const float* sinks, Q* out, int64_t B,
              int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t L, float scale) {  // kvb: kv's batch stride
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * T * Hkv, std::max<int64_t>(1, 32768 / std::max<int64_t>(L * D * G, 1)), [&](int64_t i0, int64_t i1) {
    gqa_items<Q, C>(q, [&](int64_t b) { return kv + b * kvb; }, blocked, sinks, out, T, H, Hkv, D, L, scale, i0, i1);
  });
}

at::Tensor gqa_decode(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& blocked, const at::Tensor& sinks,
                      double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 4 && kv.dim() == 4, "waferline::gqa_decode: q [B, T, H, D], kv [B, L, 2 Hkv, D]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3), L = kv.size(1), Hkv = kv.size(2) / 2;
  TORCH_CHECK(kv.size(0) == B && kv.size(3) == D && kv.size(2) % 2 == 0 && Hkv > 0 && H % Hkv == 0,
              "waferline::gqa_decode: kv must be [B, L, 2 Hkv, D] with Hkv dividing H");
  const bool has_mask = blocked.numel() > 0, has_sinks = sinks.numel() > 0;
  if (has_mask) {
    TORCH_CHECK(blocked.scalar_type() == at::kBool && blocked.numel() == B * T * L, "waferline::gqa_decode: mask [B, T, L]");
  }
  if (has_sinks) {
    TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.numel() == H, "waferline::gqa_decode: sinks fp32 [H]");
  }
  auto qc = q.contiguous();
  // each row's [L, 2 Hkv, D] block must be contiguous; the rows may sit apart (the cache's slots, read in place)
  const bool rows_in_place = kv.stride(3) == 1 && kv.stride(2) == D && kv.stride(1) == 2 * Hkv * D;
  auto kc = rows_in_place ? kv : kv.contiguous();
  const int64_t kvb = B > 1 ? kc.stride(0) : 0;
  auto mk = has_mask ? blocked.contiguous() : blocked;
  auto sk = has_sinks ? sinks.contiguous() : sinks;
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "waferline_gqa_decode_q", [&] {
    using Q = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kc.scalar_type(), "waferline_gqa_decode_kv", [&] {
      gqa_rows<Q, scalar_t>(qc.data_ptr<Q>(), kc.data_ptr<scalar_t>(), kvb, has_mask ? mk.data_ptr<bool>() : nullptr,
                            has_sinks ? sk.data_ptr<float>() : nullptr, out.data_ptr<Q>(), B, T, H, Hkv, D, L,
                            static_cast<float>(scale));
    });
  });
  return out;
}

// ---------------------------------------------------------------- MLA, absorbed decode
// q_nope [B, T, H, n], q_rope [B, T, H, p] (any dtype), latents [B, L, r + p] (the cache: c_KV | k_rope),
// blocked bool [B, T, L] (True = masked) or an empty tensor, w_uk [H, n, r] and w_uv [H, v, r], both fp32 or both
// bf16 (a bf16 model's absorbed weights as it holds them: half the bytes a step reads; each weight row widened to fp32
// once per call, so the numbers are those of their fp32 copies).
// Per (b, t, h), all in fp32: q_lat = q_nope W_UK; s_l = scale (q_lat . c_l + q_rope . k_rope_l); p = softmax(s);
// o = sum_l p_l c_l; out = o W_UV^T -> [B, T, H * v] in ``out_dtype``.
// In three passes: W_UK into every query row (head by head, so each head's W_UK is read once for all rows), then
// attention for blocks of MLA_HEADS heads of one query row at a time (each cache row is loaded once for the block),
// then W_UV (head by head again). The first version, one (row, head) at a time, re-read each head's weights per row
// and each cache row per head.
constexpr int64_t MLA_HEADS = 4;

// s[h * L + l] = scale * (q_h . c_l) for the MLA_HEADS query rows q_h = q + h * R and cache rows c_l = lat + l * R
inline void mla_scores(const float* q, const float* lat, int64_t L, int64_t R, float scale, float* s) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (R % 16 == 0 && !g_portable.load(std::memory_order_relaxed)) {  // 16 keys at a time, one lane-sum tree each
    const int64_t nc = R / 16;
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
      const int64_t n = std::min<int64_t>(16, L - l0);
      const float* c[16];  // the block's cache rows (past L: the last one again, its sums not stored)
      for (int i = 0; i < 16; ++i) c[i] = lat + (l0 + std::min<int64_t>(i, n - 1)) * R;
      for (int k = 0; k < MLA_HEADS; ++k)
        _mm512_mask_storeu_ps(s + k * L + l0, static_cast<__mmask16>((1u << n) - 1),
                              _mm512_mul_ps(dot16(q + k * R, c, nc), sv));
    }
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (R % 8 == 0 && !g_portable.load(std::memory_order_relaxed)) {
    for (int64_t l = 0; l < L; ++l) {
      const float* c = lat + l * R;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t j = 0; j < R; j += 8) {
        const __m256 cv = _mm256_loadu_ps(c + j);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), cv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + R + j), cv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * R + j), cv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * R + j), cv, a3);
      }
      // the four sums at once: pairwise adds down to [a0 a1 a2 a3] in one 128-bit vector
      const __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
      const __m256 h = _mm256_hadd_ps(h01, h23);  // per 128-bit half: a0 a1 a2 a3 partial sums
      const __m128 t = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)),
                                  _mm_set1_ps(scale));
      alignas(16) float v[4];
      _mm_store_ps(v, t);
      for (int k = 0; k < 4; ++k) s[k * L + l] = v[k];
    }
    return;
  }
#endif
  for (int64_t l = 0; l < L; ++l) {
    float a[4];
    dot4(lat + l * R, q, R, R, a);
    for (int k = 0; k < 4; ++k) s[k * L + l] = a[k] * scale;
  }
}

// o[h * r + j] = sum_l p[h * L + l] c_l[j] for the MLA_HEADS heads (c_l = lat + l * R, its first r entries); masked
// cache rows (mk[l]) are skipped: whatever they hold (a slot's stale or unwritten rows) does not reach o
inline void mla_weighted(const float* p, const float* lat, const bool* mk, int64_t L, int64_t R, int64_t r, float* o) {
  int64_t j0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (!g_portable.load(std::memory_order_relaxed)) {
    for (; j0 + 64 <= r; j0 += 64) {  // 64 columns x 4 heads in 16 registers, over every cache row
      __m512 a[4][4];
      for (int k = 0; k < 4; ++k)
        for (int c = 0; c < 4; ++c) a[k][c] = _mm512_setzero_ps();
      for (int64_t l = 0; l < L; ++l) {
        if (mk && mk[l]) continue;
        const float* cl = lat + l * R + j0;
        __m512 cv[4];
        for (int c = 0; c < 4; ++c) cv[c] = _mm512_loadu_ps(cl + 16 * c);
        for (int k = 0; k < 4; ++k) {
          const __m512 pk = _mm512_set1_ps(p[k * L + l]);
          for (int c = 0; c < 4; ++c) a[k][c] = _mm512_fmadd_ps(pk, cv[c], a[k][c]);
        }
      }
      for (int k = 0; k < 4; ++k)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + k * r + j0 + 16 * c, a[k][c]);
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (!g_portable.load(std::memory_order_relaxed)) {
    for (; j0 + 16 <= r; j0 += 16) {  // 16 columns x 4 heads in 8 registers, over every cache row
      __m256 a[4][2];
      for (int k = 0; k < 4; ++k) a[k][0] = a[k][1] = _mm256_setzero_ps();
      for (int64_t l = 0; l < L; ++l) {
        if (mk && mk[l]) continue;
        const float* c = lat + l * R + j0;
        const __m256 c0 = _mm256_loadu_ps(c), c1 = _mm256_loadu_ps(c + 8);
        for (int k = 0; k < 4; ++k) {
          const __m256 pk = _mm256_broadcast_ss(p + k * L + l);
          a[k][0] = _mm256_fmadd_ps(pk, c0, a[k][0]);
          a[k][1] = _mm256_fmadd_ps(pk, c1, a[k][1]);
        }
      }
      for (int k = 0; k < 4; ++k) {
        _mm256_storeu_ps(o + k * r + j0, a[k][0]);
        _mm256_storeu_ps(o + k * r + j0 + 8, a[k][1]);
      }
    }
  }
#endif
  for (int k = 0; k < 4; ++k)
    for (int64_t j = j0; j < r; ++j) o[k * r + j] = 0.f;
  if (j0 == r) return;
  for (int64_t l = 0; l < L; ++l) {
    if (mk && mk[l]) continue;
    const float* c = lat + l * R;
    for (int k = 0; k < 4; ++k) {
      const float pk = p[k * L + l];
      float* ok = o + k * r;
#pragma omp simd
      for (int64_t j = j0; j < r; ++j) ok[j] += pk * c[j];
    }
  }
}

// softmax over L scores in place; masked ones (mk[l], when mk is given; whatever their score) get probability 0; all
// masked: all 0. exp by vexp, vectorised (std::exp is a libm call per score).
inline void mla_softmax(float* s, int64_t L, const bool* mk) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float mx = ninf;
  for (int64_t l = 0; l < L; ++l)
    if (mk && mk[l])
      s[l] = ninf;
    else
      mx = std::max(mx, s[l]);
  if (mx == ninf) {
    for (int64_t l = 0; l < L; ++l) s[l] = 0.f;
    return;
  }
  float den = 0.f;
#pragma omp simd reduction(+ : den)
  for (int64_t l = 0; l < L; ++l) {
    // below e^-87 (~1.6e-38 of the largest): 0 (masked scores, -inf, land here too)
    const float d = s[l] - mx;
    const float e = d < -87.f ? 0.f : vexp(d);
    s[l] = e;
    den += e;
  }
  const float inv = 1.f / den;
#pragma omp simd
  for (int64_t l = 0; l < L; ++l) s[l] *= inv;
}

// The absorbed decode's shapes and buffers: qf [BT, Hp, R] (each row's queries: latent | rope; heads padded with zeros
// to a multiple of MLA_HEADS), ol [BT, Hp, r] (attention's latent outputs)
struct MlaDims {
  int64_t BT, T, H, n, p, r, v, L, R, Hp;
  MlaDims(int64_t B, int64_t T_, int64_t H_, int64_t n_, int64_t p_, int64_t r_, int64_t v_, int64_t L_)
      : BT(B * T_), T(T_), H(H_), n(n_), p(p_), r(r_), v(v_), L(L_), R(r_ + p_),
        Hp((H_ + MLA_HEADS - 1) / MLA_HEADS * MLA_HEADS) {}
  int64_t blocks() const { return Hp / MLA_HEADS; }
  int64_t head_grain() const { return std::max<int64_t>(1, 32768 / std::max<int64_t>(BT * n * r, 1)); }
};

// rows [size] of an absorbed weight in fp32: themselves, or bf16 widened into buf (exactly: the bits shifted up)
inline const float* rows_f32(const float* w, int64_t, float*) { return w; }
inline const float* rows_f32(const c10::BFloat16* w, int64_t size, float* buf) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= size; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i));
    _mm256_storeu_ps(buf + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
#endif
  for (; i < size; ++i) buf[i] = static_cast<float>(w[i]);
  return buf;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// mla_absorb's sums for head h with r = 16 NC, MB query rows at a time in registers over the head's weight rows (wf,
// [n, r] fp32): the same sums in the same order as the loop below, without a load and store of qf per product
template <int NC>
void mla_absorb16(const MlaDims& d, const float* qn, const float* wf, float* qf, int64_t h) {
  constexpr int MB = 16 / NC;
  for (int64_t b0 = 0; b0 < d.BT; b0 += MB) {
    const int mb = static_cast<int>(std::min<int64_t>(MB, d.BT - b0));
    __m512 acc[MB][NC];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < d.n; ++k) {
      const float* row = wf + k * d.r;
      for (int m = 0; m < MB; ++m) {
        if (m >= mb) break;
        const __m512 qk = _mm512_set1_ps(qn[((b0 + m) * d.H + h) * d.n + k]);
        for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_fmadd_ps(qk, _mm512_loadu_ps(row + 16 * c), acc[m][c]);
      }
    }
    for (int m = 0; m < mb; ++m)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(qf + ((b0 + m) * d.Hp + h) * d.R + 16 * c, acc[m][c]);
  }
}
#endif

// pass 1, heads h0..h1: W_UK into every row's query (qf zeroed by the caller), the rope part copied beside it. Each
// weight row is read (and widened, if bf16) once for all query rows; every qf element still sums over k in order.
template <typename W>
void mla_absorb(const MlaDims& d, const float* qn, const float* qr, const W* wuk, float* qf, int64_t h0, int64_t h1) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if ((d.r == 64 || d.r == 128) && !g_portable.load(std::memory_order_relaxed)) {
    std::vector<float> wf(d.n * d.r);
    for (int64_t h = h0; h < h1; ++h) {
      const float* w = rows_f32(wuk + h * d.n * d.r, d.n * d.r, wf.data());
      if (d.r == 64) mla_absorb16<4>(d, qn, w, qf, h);
      else mla_absorb16<8>(d, qn, w, qf, h);
      for (int64_t bt = 0; bt < d.BT; ++bt)
        std::copy(qr + (bt * d.H + h) * d.p, qr + (bt * d.H + h + 1) * d.p, qf + (bt * d.Hp + h) * d.R + d.r);
    }
    return;
  }
#endif
  std::vector<float> buf(d.r);
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t k = 0; k < d.n; ++k) {
      const float* row = rows_f32(wuk + (h * d.n + k) * d.r, d.r, buf.data());
      for (int64_t bt = 0; bt < d.BT; ++bt) {
        float* qh = qf + (bt * d.Hp + h) * d.R;
        const float qk = qn[(bt * d.H + h) * d.n + k];
#pragma omp simd
        for (int64_t j = 0; j < d.r; ++j) qh[j] += qk * row[j];
      }
    }
    for (int64_t bt = 0; bt < d.BT; ++bt)
      std::copy(qr + (bt * d.H + h) * d.p, qr + (bt * d.H + h + 1) * d.p, qf + (bt * d.Hp + h) * d.R + d.r);
  }
}

// pass 2, tasks i0..i1 of BT * blocks (a row's block of MLA_HEADS heads): scores, softmax, weighted latents
void mla_attend_blocks(const MlaDims& d, const float* qf, const float* lat, const bool* blocked, float scale, float* ol,
                       int64_t i0, int64_t i1) {
  std::vector<float> sc(MLA_HEADS * d.L);
  const int64_t blocks = d.blocks();
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t bt = i / blocks, hb = (i % blocks) * MLA_HEADS, b = bt / d.T;
    const float* lb = lat + b * d.L * d.R;
    const bool* mk = blocked ? blocked + bt * d.L : nullptr;
    mla_scores(qf + (bt * d.Hp + hb) * d.R, lb, d.L, d.R, scale, sc.data());
    for (int64_t k = 0; k < MLA_HEADS; ++k) mla_softmax(sc.data() + k * d.L, d.L, mk);
    mla_weighted(sc.data(), lb, mk, d.L, d.R, d.r, ol + (bt * d.Hp + hb) * d.r);
  }
}

// pass 3, heads h0..h1: W_UV after attention -> out [BT, H * v]; four weight rows at a time, read (and widened) once
// for all query rows
template <typename W>
void mla_unabsorb(const MlaDims& d, const float* ol, const W* wuv, float* out, int64_t h0, int64_t h1) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (d.v % 16 == 0 && d.r % 16 == 0 && !g_portable.load(std::memory_order_relaxed)) {
    // 16 weight rows at a time per query row: 16 dot products, one lane-sum tree (the head's rows widened once)
    std::vector<float> wf(d.v * d.r);
    const int64_t nc = d.r / 16;
    for (int64_t h = h0; h < h1; ++h) {
      const float* w = rows_f32(wuv + h * d.v * d.r, d.v * d.r, wf.data());
      for (int64_t bt = 0; bt < d.BT; ++bt) {
        const float* oh = ol + (bt * d.Hp + h) * d.r;
        for (int64_t k = 0; k < d.v; k += 16) {
          const float* rows[16];
          for (int i = 0; i < 16; ++i) rows[i] = w + (k + i) * d.r;
          _mm512_storeu_ps(out + (bt * d.H + h) * d.v + k, dot16(oh, rows, nc));
        }
      }
    }
    return;
  }
#endif
  std::vector<float> buf(4 * d.r);
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t k = 0; k < d.v; k += 4) {
      const int64_t nk = std::min<int64_t>(4, d.v - k);
      const float* wv = rows_f32(wuv + (h * d.v + k) * d.r, nk * d.r, buf.data());
      for (int64_t bt = 0; bt < d.BT; ++bt) {
        const float* oh = ol + (bt * d.Hp + h) * d.r;
        float* o = out + (bt * d.H + h) * d.v + k;
        if (nk == 4) dot4(oh, wv, d.r, d.r, o);
        else for (int64_t j = 0; j < nk; ++j) o[j] = dotf(oh, wv + j * d.r, d.r);
      }
    }
  }
}

template <typename W>
void mla_rows(const float* qn, const float* qr, const float* lat, const bool* blocked, const W* wuk, const W* wuv,
              float* out, int64_t B, int64_t T, int64_t H, int64_t n, int64_t p, int64_t r, int64_t v, int64_t L,
              float scale) {
  const MlaDims d(B, T, H, n, p, r, v, L);
  std::vector<float> qf(d.BT * d.Hp * d.R, 0.f), ol(d.BT * d.Hp * d.r);
  at::parallel_for(0, H, d.head_grain(), [&](int64_t h0, int64_t h1) { mla_absorb(d, qn, qr, wuk, qf.data(), h0, h1); });
  at::parallel_for(0, d.BT * d.blocks(), 1, [&](int64_t i0, int64_t i1) {
    mla_attend_blocks(d, qf.data(), lat, blocked, scale, ol.data(), i0, i1);
  });
  at::parallel_for(0, H, d.head_grain(), [&](int64_t h0, int64_t h1) { mla_unabsorb(d, ol.data(), wuv, out, h0, h1); });
}

at::Tensor mla_decode(const at::Tensor& q_nope, const at::Tensor& q_rope, const at::Tensor& latents,
                      const at::Tensor& blocked, const at::Tensor& w_uk, const at::Tensor& w_uv, double scale,
                      at::ScalarType out_dtype) {
  TORCH_CHECK(q_nope.dim() == 4 && q_rope.dim() == 4 && latents.dim() == 3, "waferline::mla_decode: bad ranks");
  TORCH_CHECK(w_uk.scalar_type() == w_uv.scalar_type() &&
                  (w_uk.scalar_type() == at::kFloat || w_uk.scalar_type() == at::kBFloat16),
              "waferline::mla_decode: W_UK/W_UV both fp32 or both bf16");
  const int64_t B = q_nope.size(0), T = q_nope.size(1), H = q_nope.size(2), n = q_nope.size(3), p = q_rope.size(3);
  const int64_t L = latents.size(1), r = w_uk.size(2), v = w_uv.size(1);
  TORCH_CHECK(latents.size(0) == B && latents.size(2) == r + p, "waferline::mla_decode: latents must be [B, L, r + rope]");
  TORCH_CHECK(w_uk.size(0) == H && w_uk.size(1) == n && w_uv.size(0) == H && w_uv.size(2) == r,
              "waferline::mla_decode: W_UK [H, n, r] and W_UV [H, v, r]");
  const bool has_mask = blocked.numel() > 0;
  if (has_mask) {
    TORCH_CHECK(blocked.scalar_type() == at::kBool && blocked.numel() == B * T * L, "waferline::mla_decode: mask [B, T, L]");
  }
  auto qn = q_nope.to(at::kFloat).contiguous();
  auto qr = q_rope.to(at::kFloat).contiguous();
  // the cache rows in fp32 once (each head reads them; converting 16-bit rows inside the dot products was slower:
  // 71 vs 60 us per call at the 135M dsv3's shapes, 130 cached tokens, 1 thread, by hand)
  auto lat = latents.to(at::kFloat).contiguous();
  auto mk = has_mask ? blocked.contiguous() : blocked;
  auto wk = w_uk.contiguous();
  auto wv = w_uv.contiguous();
  auto out = at::empty({B, T, H * v}, qn.options());
  const bool* mp = has_mask ? mk.data_ptr<bool>() : nullptr;
  if (wk.scalar_type() == at::kBFloat16)
    mla_rows(qn.data_ptr<float>(), qr.data_ptr<float>(), lat.data_ptr<float>(), mp, wk.data_ptr<c10::BFloat16>(),
             wv.data_ptr<c10::BFloat16>(), out.data_ptr<float>(), B, T, H, n, p, r, v, L, static_cast<float>(scale));
  else
    mla_rows(qn.data_ptr<float>(), qr.data_ptr<float>(), lat.data_ptr<float>(), mp, wk.data_ptr<float>(),
             wv.data_ptr<float>(), out.data_ptr<float>(), B, T, H, n, p, r, v, L, static_cast<float>(scale));
  return out_dtype == at::kFloat ? out : out.to(out_dtype);
}

// ---------------------------------------------------------------- MLA attention block, one decode token per row
// What MLAttention.forward computes for rows of one new token each when every projection is an int4 weight in
// waferline's layout (no biases), as one call: q = q_b(rms(q_a(x))) (or q_proj(x) without a q LoRA), ckv = kv_a(x),
// c = rms(ckv[:r]), the rope part of q and ckv's rope key rotated together, [c | k_rope] written into ``cache`` at
// (slots[b], pos[b]), mla_decode over keys 0..max(pos) (keys past a row's own position masked when rows differ),
// then o_proj. Rows may share a slot at distinct positions (a speculative verify's T tokens as T rows: each sees
// the entries the earlier ones wrote). The same operators as the eager chain, in the same order, on the same
// tensors: the same numbers. It
// saves the ~30 eager ops and the Python between them (per layer ~0.1-0.2 ms of a ~6 ms step of the 135M dsv3).
// w: packed / scales of q_a, q_b, kv_a, o (q_a's both empty: q_b is q_proj); groups: their group sizes. A projection
// may instead be a dense 16-bit weight [out, in] with empty scales (a bf16 model's, for rows of up to FEW_ROWS):
// linear_rows then multiplies it, as Linear does for such rows.
// A step's rows in a token cache [slots, capacity, W] (one new token per row): each row's slot and position checked,
// the keys' end (max position + 1), whether the slots are consecutive (the keys a view) and the positions one (no mask)
struct CacheRows {
  at::Tensor sl, ps;
  const int64_t* sp = nullptr;
  const int64_t* pp = nullptr;
  int64_t B = 0, end = 0;
  bool consecutive = true, uniform = true;
  CacheRows(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos, int64_t rows, const char* op)
      : B(rows) {
    TORCH_CHECK(slots.scalar_type() == at::kLong && pos.scalar_type() == at::kLong && slots.numel() == B &&
                    pos.numel() == B, op, ": slots and pos are int64 [B]");
    sl = slots.contiguous(), ps = pos.contiguous();
    sp = sl.data_ptr<int64_t>(), pp = ps.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(sp[b] >= 0 && sp[b] < cache.size(0) && pp[b] >= 0 && pp[b] < cache.size(1), op,
                  ": slot or position outside the cache");
      end = std::max(end, pp[b] + 1);
      consecutive = consecutive && sp[b] == sp[0] + b;
      uniform = uniform && pp[b] == pp[0];
    }
  }
  // this step's entries: the parts' rows ([B, ...] each, B = rows, the cache's dtype) side by side, in order, make a
  // row's W values, copied straight into the cache (its callers check it contiguous and of x's dtype): one memcpy a
  // part and row instead of a cat and B dispatched copies (~0.05 ms a layer at 8 rows)
  void write(at::Tensor& cache, std::initializer_list<at::Tensor> parts) const {
    const int64_t W = cache.size(2), cap = cache.size(1), es = cache.element_size();
    TORCH_CHECK(cache.is_contiguous(), "waferline: the cache must be contiguous");
    char* base = static_cast<char*>(cache.data_ptr());
    int64_t off = 0;
    for (const auto& t : parts) {
      TORCH_CHECK(t.scalar_type() == cache.scalar_type(), "waferline: a cache entry of another dtype than the cache");
      const auto tc = t.contiguous();
      const int64_t w = tc.numel() / std::max<int64_t>(B, 1);
      TORCH_CHECK(off + w <= W, "waferline: cache entries wider than the cache's ", W, " values");
      const char* src = static_cast<const char*>(tc.data_ptr());
      for (int64_t b = 0; b < B; ++b) std::memcpy(base + ((sp[b] * cap + pp[b]) * W + off) * es, src + b * w * es, w * es);
      off += w;
    }
    TORCH_CHECK(off == W, "waferline: a cache entry of ", off, " values, the cache holds ", W);
    if (!cache.is_inference()) cache.unsafeGetTensorImpl()->bump_version();  // (as the dispatched copies would)
  }
  at::Tensor keys(const at::Tensor& cache) const {  // [B, end, W]: the rows' slots, positions 0..end-1
    return consecutive ? cache.narrow(0, sp[0], B).narrow(1, 0, end) : cache.index_select(0, sl).narrow(1, 0, end);
  }
  at::Tensor blocked(const at::TensorOptions& o) const {  // rows at different positions: each sees its own keys only
    if (uniform) return at::empty({0}, o.dtype(at::kBool));
    return at::arange(end, o.dtype(at::kLong)).view({1, 1, end}) > ps.view({B, 1, 1});
  }
};

at::Tensor block_proj(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sz, int64_t group) {
  return sz.numel() ? int4_linear(x, w, sz, group) : linear_rows(x, w);
}

at::Tensor mla_attend_int4(const at::Tensor& x, at::TensorList w, at::IntArrayRef groups, const at::Tensor& qa_norm,
                           const at::Tensor& kva_norm, double eps_q, double eps_kv, const at::Tensor& cos2,
                           const at::Tensor& sin2, bool interleaved, at::Tensor& cache, const at::Tensor& slots,
                           const at::Tensor& pos, const at::Tensor& w_uk, const at::Tensor& w_uv, double scale) {
  TORCH_CHECK(w.size() == 8 && groups.size() == 4,
              "waferline::mla_attend_int4: 4 weights (int4 packed and scales, or dense and empty) and 4 groups");
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1, "waferline::mla_attend_int4: x must be [B, 1, D]");
  TORCH_CHECK(cache.dim() == 3 && cache.scalar_type() == x.scalar_type() && cache.is_contiguous(),
              "waferline::mla_attend_int4: cache must be a contiguous [slots, capacity, r + rope] tensor of x's dtype");
  const int64_t B = x.size(0), H = w_uk.size(0), n = w_uk.size(1), r = w_uk.size(2), R = cache.size(2), p = R - r;
  const CacheRows rows(cache, slots, pos, B, "waferline::mla_attend_int4");
  at::Tensor q;
  if (w[0].numel()) {
    q = block_proj(rms_norm(block_proj(x, w[0], w[1], groups[0]), qa_norm, eps_q), w[2], w[3], groups[1]);
  } else {
    q = block_proj(x, w[2], w[3], groups[1]);
  }
  TORCH_CHECK(q.size(-1) == H * (n + p), "waferline::mla_attend_int4: q has ", q.size(-1),
              " outputs, want H (nope + rope)");
  q = q.view({B, 1, H, n + p});
  auto ckv = block_proj(x, w[4], w[5], groups[2]);  // [B, 1, r + rope]
  auto c = rms_norm(ckv.narrow(-1, 0, r), kva_norm, eps_kv);
  auto roped = rope(at::cat({q.narrow(-1, n, p), ckv.narrow(-1, r, p).unsqueeze(2)}, 2), cos2, sin2, p, interleaved);
  rows.write(cache, {c, roped.select(2, H)});  // [B, 1, r] and [B, 1, rope]: this token's cache entry
  auto out = mla_decode(q.narrow(-1, 0, n), roped.narrow(2, 0, H), rows.keys(cache), rows.blocked(x.options()), w_uk,
                        w_uv, scale, x.scalar_type());
  return block_proj(out, w[6], w[7], groups[3]);
}

// ---------------------------------------------------------------- GQA attention block, one decode token per row
// What GQAttention.forward computes for rows of one new token each (a decode step; a verify's tokens as rows, as
// mla_attend_int4 takes them) with a full-attention cache and no biases, as one call: q, k, v = the projections of x
// (block_proj: int4, or dense bf16 with empty scales), the q and k RMSNorms over the head dim (empty weights: none),
// the first ``rot`` channels of q and k rotated together (rope; rot 0: none), [k | v] written into ``cache`` [slots,
// capacity, 2 Hkv hd] at (slots[b], pos[b]), gqa_decode over keys 0..max(pos) (keys past a row's own position masked
// when rows differ; ``sinks`` fp32 [H] or empty), then o_proj. The same operators on the same tensors, in the same
// order, as the modules run: the same numbers. w: q, k, v, o (weight, scales); groups: their group sizes.
at::Tensor gqa_attend(const at::Tensor& x, at::TensorList w, at::IntArrayRef groups, const at::Tensor& q_norm,
                      const at::Tensor& k_norm, double qk_eps, const at::Tensor& cos2, const at::Tensor& sin2,
                      int64_t rot, bool interleaved, at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos,
                      const at::Tensor& sinks, double scale, int64_t H, int64_t Hkv) {
  TORCH_CHECK(w.size() == 8 && groups.size() == 4, "waferline::gqa_moe_layer: 4 weights (int4 packed and scales, or "
              "dense and empty) and 4 groups");
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1, "waferline::gqa_moe_layer: x must be [B, 1, D]");
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && cache.dim() == 3 && cache.scalar_type() == x.scalar_type() &&
                  cache.is_contiguous() && cache.size(2) % (2 * Hkv) == 0,
              "waferline::gqa_moe_layer: cache must be a contiguous [slots, capacity, 2 Hkv hd] tensor of x's dtype");
  const int64_t B = x.size(0), hd = cache.size(2) / (2 * Hkv);
  const CacheRows rows(cache, slots, pos, B, "waferline::gqa_moe_layer");
  auto q = block_proj(x, w[0], w[1], groups[0]);
  auto k = block_proj(x, w[2], w[3], groups[1]);
  auto v = block_proj(x, w[4], w[5], groups[2]);
  TORCH_CHECK(q.size(-1) == H * hd && k.size(-1) == Hkv * hd && v.size(-1) == Hkv * hd,
              "waferline::gqa_moe_layer: q / k / v widths must be H hd / Hkv hd / Hkv hd");
  q = q.view({B, 1, H, hd});
  k = k.view({B, 1, Hkv, hd});
  v = v.view({B, 1, Hkv, hd});
  if (q_norm.numel()) q = rms_norm(q, q_norm, qk_eps), k = rms_norm(k, k_norm, qk_eps);
  if (rot) {
    auto qk = rope(at::cat({q, k}, 2), cos2, sin2, rot, interleaved);
    q = qk.narrow(2, 0, H), k = qk.narrow(2, H, Hkv);
  }
  rows.write(cache, {k, v});  // [B, 1, Hkv, hd] each: this token's cache entry
  auto out = gqa_decode(q, rows.keys(cache).reshape({B, rows.end, 2 * Hkv, hd}), rows.blocked(x.options()), sinks,
                        scale);
  return block_proj(out.reshape({B, 1, H * hd}), w[6], w[7], groups[3]);
}

// ---------------------------------------------------------------- a decoder layer's decode step, one thread team
// The same layer (mla_moe_layer below) with its operators' work split over one OpenMP team per half (attention, then
// the experts), with barriers between the stages, instead of one fork-join per product: the decode step's products
// are small (~10 us each at the 135M dsv3's shapes), and split one by one they gained little from a second thread
// (the whole layer 1.07x at 2 threads, measured). Every output element is computed by the same functions as on the
// composed path (int4_i16_span, rms_rows, rope_rows, the absorbed decode's passes, silu_mul_rows, the experts' sum in
// expert order): the same numbers, whichever thread computes it. Taken for bf16 / fp16 activations on the integer
// int4 kernel (AVX2, groups of a multiple of 64) with every projection and expert int4; otherwise the composed path.
#if defined(__AVX2__) && defined(__FMA__) && defined(_OPENMP)
template <typename S>
struct I4W {  // an int4 weight in waferline's layout (one expert's, for stacked experts), and its tile copy if any
  const uint8_t* q = nullptr;
  const S* sz = nullptr;
  int64_t Z = 0, N = 0, K = 0, G = 0;
  const uint8_t* tiles = nullptr;
  at::Tensor hold;  // (the tile copy, held while the weight is used)
};

// ``tiles``: the weight's tile copy (int4_tiles), looked up by the caller and held by it for the call; null: looked up
// here and held by the I4W
template <typename S>
I4W<S> i4w(const at::Tensor& packed, const at::Tensor& sz, int64_t G, int64_t e = -1,
           const at::Tensor* tiles = nullptr) {
  I4W<S> w;
  w.N = packed.size(packed.dim() - 2), w.K = packed.size(packed.dim() - 1) * 2, w.Z = sz.size(sz.dim() - 1), w.G = G;
  w.q = packed.data_ptr<uint8_t>() + (e >= 0 ? e * w.N * (w.K / 2) : 0);
  w.sz = reinterpret_cast<const S*>(sz.data_ptr()) + (e >= 0 ? e * w.N * (w.K / G) * w.Z : 0);
  if (tiles == nullptr) w.hold = int4_tiles(packed, sz, G);
  w.tiles = int4_tiles_of(tiles != nullptr ? *tiles : w.hold, packed, e);
  return w;
}

template <typename T, typename S>
void i4_span(const I16Rows& x, const I4W<S>& w, T* y, int64_t ldy, int64_t n0, int64_t n1) {
#ifdef WAFERLINE_INT4_TILES
  if (w.tiles != nullptr)
    return int4_tile_span<T, S>(x.xq.data(), x.sx.data(), x.xs.data(), x.M, w.tiles, w.Z, w.K, w.G, y, ldy, n0, n1);
#endif
  int4_i16_span<T, S>(x.xq.data(), x.sx.data(), x.xs.data(), x.M, w.q, w.sz, w.Z, w.K, w.G, y, ldy, n0, n1);
}

inline std::pair<int64_t, int64_t> share(int64_t items, int tid, int nt) {  // this thread's even share of items
  return {items * tid / nt, items * (tid + 1) / nt};
}

// products of rows[j] output rows each, in one index space of I16_TILE-row tiles: f(j, n0, n1) for this thread's
template <typename F>
void share_tiles(const std::vector<int64_t>& rows, int tid, int nt, F&& f) {
  int64_t total = 0;
  for (int64_t nr : rows) total += (nr + I16_TILE - 1) / I16_TILE;
  const auto [lo, hi] = share(total, tid, nt);
  int64_t base = 0;
  for (size_t j = 0; j < rows.size(); ++j) {
    const int64_t tiles = (rows[j] + I16_TILE - 1) / I16_TILE, a = std::max(lo, base), b = std::min(hi, base + tiles);
    if (a < b) f(j, (a - base) * I16_TILE, std::min(rows[j], (b - base) * I16_TILE));
    base += tiles;
  }
}

bool i4_fits(const at::Tensor& packed, const at::Tensor& sz, int64_t G, int64_t N, int64_t K, at::ScalarType st,
             int64_t E = 0) {  // int4 [(E,) N, K / 2] with scales of dtype st, on the integer kernel's groups
  if (sz.numel() == 0 || sz.scalar_type() != st || G % INT4_BLOCK != 0 || G > I16_MAX_GROUP) return false;
  if (E == 0) return int4_shaped(packed, sz, G, N, K);
  // (int4_shaped's checks on the stacked shapes: a select per weight costs ~1 us a call)
  return packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(0) == E && packed.size(1) == N &&
         packed.size(2) * 2 == K && K % G == 0 && sz.dim() == 4 && sz.size(0) == E && sz.size(1) == N &&
         sz.size(2) == K / G && (sz.size(3) == 1 || sz.size(3) == 2) && packed.is_contiguous() && sz.is_contiguous();
}

// a team half's residual, columns n0..n1 of its M rows of width D: h = x + o, rounded to T as the composed path's
// add rounds it. Each thread adds the columns of o it has just written (in its last split: no pass after the team)
template <typename T>
void residual_cols(const T* x, const T* o, T* h, int64_t M, int64_t D, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = m * D + n0; i < m * D + n1; ++i) h[i] = static_cast<T>(f32(x[i]) + f32(o[i]));
}

// the attention half: x + mla(rms(x)) -> [B, 1, D]
template <typename T, typename S>
at::Tensor mla_team(const at::Tensor& x, const at::Tensor& mix_norm, double mix_eps, at::TensorList w,
                    at::IntArrayRef groups, const at::Tensor& qa_norm, const at::Tensor& kva_norm, double eps_q,
                    double eps_kv, const at::Tensor& cos2, const at::Tensor& sin2, bool interleaved, at::Tensor& cache,
                    const int64_t* sp, const int64_t* pp, int64_t end, bool uniform, const at::Tensor& w_uk,
                    const at::Tensor& w_uv, double scale) {
  const int64_t B = x.size(0), D = x.size(2), H = w_uk.size(0), n = w_uk.size(1), r = w_uk.size(2);
  const int64_t R = cache.size(2), p = R - r, v = w_uv.size(1), cap = cache.size(1), Hv = H * v;
  const bool lora = w[0].numel() > 0;
  const I4W<S> qa = lora ? i4w<S>(w[0], w[1], groups[0]) : I4W<S>(), qb = i4w<S>(w[2], w[3], groups[1]);
  const I4W<S> kva = i4w<S>(w[4], w[5], groups[2]), ow = i4w<S>(w[6], w[7], groups[3]);
  const int64_t Nqa = qa.N, Nq = qb.N, Nkv = kva.N;
  // buffers kept on this thread from call to call (at_least: they keep their largest size, the next step needs
  // about as much): allocating and zeroing them per call was ~5% of a layer op's perf samples (malloc, free,
  // memset). (Named by references: inside the parallel region a thread_local's own name would mean each thread's own
  // copy.)
  struct Bufs {
    std::vector<T> xn, qa_out, qa_n, ckv, c_in, c, q, rin, roped, att, o;
    std::vector<float> xf, qn, qr, lat, attf, qf, ol;
    I16Rows x_qa, x_kv, x_qb, x_o;
  };
  thread_local Bufs bufs;
  auto &xn = bufs.xn, &qa_out = bufs.qa_out, &qa_n = bufs.qa_n, &ckv = bufs.ckv, &c_in = bufs.c_in, &c = bufs.c;
  auto &q = bufs.q, &rin = bufs.rin, &roped = bufs.roped, &att = bufs.att, &o = bufs.o;
  auto &xf = bufs.xf, &qn = bufs.qn, &qr = bufs.qr, &lat = bufs.lat, &attf = bufs.attf, &qf = bufs.qf, &ol = bufs.ol;
  auto &x_qa = bufs.x_qa, &x_kv = bufs.x_kv, &x_qb = bufs.x_qb, &x_o = bufs.x_o;
  const MlaDims md(B, 1, H, n, p, r, v, end);
  for (auto [buf, size] : {std::pair{&xn, B * D}, {&qa_out, B * Nqa}, {&qa_n, B * Nqa}, {&ckv, B * Nkv}, {&c_in, B * r},
                           {&c, B * r}, {&q, B * Nq}, {&rin, B * (H + 1) * p}, {&roped, B * (H + 1) * p},
                           {&att, B * Hv}, {&o, B * D}})
    at_least(*buf, size);
  for (auto [buf, size] : {std::pair{&xf, B * std::max({D, Nqa, Hv})}, {&qn, B * H * n}, {&qr, B * H * p},
                           {&lat, B * end * R}, {&attf, B * Hv}, {&qf, md.BT * md.Hp * md.R}, {&ol, md.BT * md.Hp * r}})
    at_least(*buf, size);
  std::fill(qf.begin(), qf.begin() + md.BT * md.Hp * md.R, 0.f);  // (the padding heads' queries must be zero)
  std::unique_ptr<bool[]> blocked(uniform ? nullptr : new bool[B * end]);
  // the attention's first two products read the same normed x: quantized once when their groups agree
  const bool shared_x = lora && qa.G == kva.G;
  const I16Rows& xq_a = shared_x ? x_kv : x_qa;
  T* cp = cache.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  auto h = at::empty(x.sizes(), x.options());  // x + the half's output (residual_cols)
  T* hp = h.data_ptr<T>();
  const T *n1 = mix_norm.data_ptr<T>(), *nq = lora ? qa_norm.data_ptr<T>() : nullptr, *nkv = kva_norm.data_ptr<T>();
  const float *cs = cos2.data_ptr<float>(), *sn = sin2.data_ptr<float>();
  const bool wbf = w_uk.scalar_type() == at::kBFloat16;  // else fp32 (mla_team_fits)
  const int nt = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#pragma omp single
    {
      rms_rows<T>(xp, n1, xn.data(), B, D, static_cast<float>(mix_eps));
      load_f32<T>(xn.data(), xf.data(), B * D);
      x_kv.set(xf.data(), B, D, kva.G);
      if (lora && !shared_x) x_qa.set(xf.data(), B, D, qa.G);
      if (!lora) x_qb.set(xf.data(), B, D, qb.G);
    }
    share_tiles({Nqa, Nkv}, tid, nth, [&](size_t j, int64_t n0, int64_t n1_) {
      if (j == 0) i4_span<T, S>(xq_a, qa, qa_out.data(), Nqa, n0, n1_);
      else i4_span<T, S>(x_kv, kva, ckv.data(), Nkv, n0, n1_);
    });
#pragma omp barrier
#pragma omp single
    {
      if (lora) {
        rms_rows<T>(qa_out.data(), nq, qa_n.data(), B, Nqa, static_cast<float>(eps_q));
        load_f32<T>(qa_n.data(), xf.data(), B * Nqa);
        x_qb.set(xf.data(), B, Nqa, qb.G);
      }
      for (int64_t b = 0; b < B; ++b) std::copy(ckv.data() + b * Nkv, ckv.data() + b * Nkv + r, c_in.data() + b * r);
      rms_rows<T>(c_in.data(), nkv, c.data(), B, r, static_cast<float>(eps_kv));
    }
    share_tiles({Nq}, tid, nth, [&](size_t, int64_t n0, int64_t n1_) { i4_span<T, S>(x_qb, qb, q.data(), Nq, n0, n1_); });
#pragma omp barrier
#pragma omp single
    {  // rope over the queries' rope parts and the rope key together; the cache entries; fp32 queries; the mask
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          const T* src = q.data() + b * Nq + h * (n + p) + n;
          std::copy(src, src + p, rin.data() + (b * (H + 1) + h) * p);
        }
        std::copy(ckv.data() + b * Nkv + r, ckv.data() + b * Nkv + r + p, rin.data() + (b * (H + 1) + H) * p);
      }
      rope_rows<T>(rin.data(), cs, sn, roped.data(), B, H + 1, p, p, interleaved);
      for (int64_t b = 0; b < B; ++b) {
        T* dst = cp + (sp[b] * cap + pp[b]) * R;
        std::copy(c.data() + b * r, c.data() + (b + 1) * r, dst);
        std::copy(roped.data() + (b * (H + 1) + H) * p, roped.data() + (b * (H + 1) + H + 1) * p, dst + r);
        for (int64_t h = 0; h < H; ++h) {
          load_f32<T>(q.data() + b * Nq + h * (n + p), qn.data() + (b * H + h) * n, n);
          load_f32<T>(roped.data() + (b * (H + 1) + h) * p, qr.data() + (b * H + h) * p, p);
        }
        if (blocked)
          for (int64_t l = 0; l < end; ++l) blocked[b * end + l] = l > pp[b];
      }
    }
    {  // the keys (cache rows 0..end-1 of each row's slot) in fp32
      const auto [i0, i1] = share(B * end, tid, nth);
      for (int64_t i = i0; i < i1; ++i)
        load_f32<T>(cp + (sp[i / end] * cap + i % end) * R, lat.data() + i * R, R);
    }
    {  // (no barrier between: W_UK into the queries does not read the keys)
      const auto [h0, h1] = share(H, tid, nth);
      if (wbf) mla_absorb(md, qn.data(), qr.data(), w_uk.data_ptr<c10::BFloat16>(), qf.data(), h0, h1);
      else mla_absorb(md, qn.data(), qr.data(), w_uk.data_ptr<float>(), qf.data(), h0, h1);
    }
#pragma omp barrier
    {
      const auto [i0, i1] = share(md.BT * md.blocks(), tid, nth);
      mla_attend_blocks(md, qf.data(), lat.data(), blocked.get(), static_cast<float>(scale), ol.data(), i0, i1);
    }
    // one row (a batch-1 decode step) whose head blocks split over the threads as its heads do: each thread's W_UV
    // pass reads only what its own attention pass wrote, so it needs no barrier (the same for every thread)
    bool own_heads = md.BT == 1;
    for (int t = 0; t < nth && own_heads; ++t) {
      const auto [h0, h1] = share(H, t, nth);
      const auto [b0, b1] = share(md.blocks(), t, nth);
      own_heads = h0 == std::min(H, b0 * MLA_HEADS) && h1 == std::min(H, b1 * MLA_HEADS);
    }
    if (!own_heads) {
#pragma omp barrier
    }
    {
      const auto [h0, h1] = share(H, tid, nth);
      if (wbf) mla_unabsorb(md, ol.data(), w_uv.data_ptr<c10::BFloat16>(), attf.data(), h0, h1);
      else mla_unabsorb(md, ol.data(), w_uv.data_ptr<float>(), attf.data(), h0, h1);
    }
#pragma omp barrier
#pragma omp single
    {  // the attention output in x's dtype (what mla_decode returns), then o_proj's input
      store_f32<T>(attf.data(), att.data(), B * Hv);
      load_f32<T>(att.data(), xf.data(), B * Hv);
      x_o.set(xf.data(), B, Hv, ow.G);
    }
    share_tiles({D}, tid, nth, [&](size_t, int64_t n0, int64_t n1_) {
      i4_span<T, S>(x_o, ow, o.data(), D, n0, n1_);
      residual_cols<T>(xp, o.data(), hp, B, D, n0, n1_);
    });
  }
  return h;
}

// weight rows n0..n1 of a dense bf16 weight [N, K] for the M rows of x [M, K] (ffn_team's dense products: the kernel
// linear_rows runs, row by row the same numbers at any split of the rows n)
template <typename T>
void dense_span(const T* x, int64_t M, const uint16_t* w, const uint16_t* tiles, int64_t K, T* y, int64_t ldy,
                int64_t n0, int64_t n1) {  // (tiles: w's tile copy, or null; n0 a multiple of I16_TILE)
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (tiles) bf16_tile_span(reinterpret_cast<const uint16_t*>(x), M, tiles, K, y, ldy, n0, n1);
    else bf16_span(reinterpret_cast<const uint16_t*>(x), M, w, K, y, ldy, n0, n1);
  }
#endif
}  // (other T, or no AVX512-BF16: ffn_team_dense_fits keeps them off the team)

// one of the attention half's products on a thread team: int4 (the integer kernel; inputs quantized per row) or dense
// bf16 (the few-row bf16 kernel; inputs as they are), weight rows n0..n1 for the M rows of x
template <typename T, typename S>
struct TeamProj {
  bool dense = false;
  I4W<S> w4;
  const uint16_t* dw = nullptr;  // dense: the weight [N, K] and its tile copy (or null)
  const uint16_t* dt = nullptr;
  at::Tensor hold;
  int64_t N = 0, K = 0;
  TeamProj(const at::Tensor& w, const at::Tensor& sz, int64_t G, bool dense_) : dense(dense_) {
    N = w.size(0);
    if (dense) {
      K = w.size(1), dw = reinterpret_cast<const uint16_t*>(w.data_ptr());
      hold = bf16_tiles(w);
      dt = tiles_of(hold, -1);
    } else {
      w4 = i4w<S>(w, sz, G), K = w4.K;
    }
  }
  void span(const T* x, const I16Rows& xq, int64_t M, T* y, int64_t ldy, int64_t n0, int64_t n1) const {
    if (dense) dense_span<T>(x, M, dw, dt, K, y, ldy, n0, n1);
    else i4_span<T, S>(xq, w4, y, ldy, n0, n1);
  }
};

// the attention half of a GQA layer (gqa_attend's decode step) on one thread team: x + o(attn(rope(norm(q, k)), v))
// for B rows of one token each -> [B, 1, D]. Every output element comes from the functions the composed path runs
// (rms_rows, the products' spans, rope_rows, gqa_items; the cache entries written as CacheRows::write writes them):
// the same numbers. Projections all int4 or (``dense``) all bf16.
template <typename T, typename S>
at::Tensor gqa_team(const at::Tensor& x, const at::Tensor& mix_norm, double mix_eps, at::TensorList w,
                    at::IntArrayRef groups, const at::Tensor& q_norm, const at::Tensor& k_norm, double qk_eps,
                    const at::Tensor& cos2, const at::Tensor& sin2, int64_t rot, bool interleaved, at::Tensor& cache,
                    const int64_t* sp, const int64_t* pp, int64_t end, bool uniform, const at::Tensor& sinks,
                    double scale, int64_t H, int64_t Hkv, bool dense) {
  const int64_t B = x.size(0), D = x.size(2), W = cache.size(2), cap = cache.size(1), hd = W / (2 * Hkv);
  const int64_t Nq = H * hd, Nkv = Hkv * hd, Hr = H + Hkv;
  const TeamProj<T, S> pq(w[0], w[1], groups[0], dense), pk(w[2], w[3], groups[1], dense),
      pv(w[4], w[5], groups[2], dense), po(w[6], w[7], groups[3], dense);
  struct Bufs {  // kept on this thread from call to call, named by references (as mla_team's are)
    std::vector<T> xn, qkv, normed, roped, att, o;
    std::vector<float> xf;
    I16Rows x_q, x_k, x_v, x_o;
  };
  thread_local Bufs bufs;
  auto &xn = bufs.xn, &qkv = bufs.qkv, &normed = bufs.normed, &roped = bufs.roped, &att = bufs.att, &o = bufs.o;
  auto& xf = bufs.xf;
  auto &x_q = bufs.x_q, &x_k = bufs.x_k, &x_v = bufs.x_v, &x_o = bufs.x_o;
  at_least(xn, B * D), at_least(qkv, B * (Nq + 2 * Nkv)), at_least(normed, B * Hr * hd), at_least(roped, B * Hr * hd);
  at_least(att, B * Nq), at_least(o, B * D), at_least(xf, B * std::max(D, Nq));
  T* qp = qkv.data();  // q [B, Nq], then k [B, Nkv], then v [B, Nkv]
  T* kp = qp + B * Nq;
  T* vp = kp + B * Nkv;
  // which quantized rows each input product reads: one set per distinct group (the same numbers: rows are quantized
  // independently, by group)
  const I16Rows& xq_k = pk.dense || pk.w4.G == pq.w4.G ? x_q : x_k;
  const I16Rows& xq_v = pv.dense || pv.w4.G == pq.w4.G ? x_q : pv.w4.G == pk.w4.G ? xq_k : x_v;
  std::unique_ptr<bool[]> blocked(uniform ? nullptr : new bool[B * end]);
  T* cp = cache.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  auto h = at::empty(x.sizes(), x.options());  // x + the half's output (residual_cols)
  T* hp = h.data_ptr<T>();
  const bool qk_norm = q_norm.numel() > 0;
  const T* qwp = qk_norm ? q_norm.data_ptr<T>() : nullptr;
  const T* kwp = qk_norm ? k_norm.data_ptr<T>() : nullptr;
  const float* skp = sinks.numel() ? sinks.data_ptr<float>() : nullptr;
  const T* qfin = qp;  // the queries attention reads, [B, H, hd] with row stride qstride
  int64_t qstride = Nq;
  const int nt = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#pragma omp single
    {
      rms_rows<T>(xp, mix_norm.data_ptr<T>(), xn.data(), B, D, static_cast<float>(mix_eps));
      if (!dense) {
        load_f32<T>(xn.data(), xf.data(), B * D);
        x_q.set(xf.data(), B, D, pq.w4.G);
        if (&xq_k == &x_k) x_k.set(xf.data(), B, D, pk.w4.G);
        if (&xq_v == &x_v) x_v.set(xf.data(), B, D, pv.w4.G);
      }
    }
    share_tiles({Nq, Nkv, Nkv}, tid, nth, [&](size_t j, int64_t n0, int64_t n1_) {
      if (j == 0) pq.span(xn.data(), x_q, B, qp, Nq, n0, n1_);
      else if (j == 1) pk.span(xn.data(), xq_k, B, kp, Nkv, n0, n1_);
      else pv.span(xn.data(), xq_v, B, vp, Nkv, n0, n1_);
    });
#pragma omp barrier
#pragma omp single
    {  // q / k norms per head, rope over the queries and keys together, the cache entries, the mask
      const T* kfin = kp;
      int64_t kstride = Nkv;
      if (qk_norm || rot) {
        for (int64_t b = 0; b < B; ++b) {  // [B, H + Hkv, hd]: a row's query heads, then its key heads
          std::copy(qp + b * Nq, qp + (b + 1) * Nq, normed.data() + b * Hr * hd);
          std::copy(kp + b * Nkv, kp + (b + 1) * Nkv, normed.data() + b * Hr * hd + Nq);
        }
        if (qk_norm) {  // (in place per head: rms_rows reads a row before it writes it)
          for (int64_t b = 0; b < B; ++b) {
            T* r = normed.data() + b * Hr * hd;
            rms_rows<T>(r, qwp, r, H, hd, static_cast<float>(qk_eps));
            rms_rows<T>(r + Nq, kwp, r + Nq, Hkv, hd, static_cast<float>(qk_eps));
          }
        }
        const T* src = normed.data();
        if (rot) {
          rope_rows<T>(normed.data(), cos2.data_ptr<float>(), sin2.data_ptr<float>(), roped.data(), B, Hr, hd, rot,
                       interleaved);
          src = roped.data();
        }
        qfin = src, kfin = src + Nq, qstride = kstride = Hr * hd;
      }
      for (int64_t b = 0; b < B; ++b) {
        T* dst = cp + (sp[b] * cap + pp[b]) * W;
        std::copy(kfin + b * kstride, kfin + b * kstride + Nkv, dst);
        std::copy(vp + b * Nkv, vp + (b + 1) * Nkv, dst + Nkv);
        if (blocked)
          for (int64_t l = 0; l < end; ++l) blocked[b * end + l] = l > pp[b];
      }
      if (qstride != Nq)  // the queries as gqa_items reads them: [B, H, hd] contiguous
        for (int64_t b = 0; b < B; ++b)
          std::copy(qfin + b * qstride, qfin + b * qstride + Nq, normed.data() + b * Nq);
      if (qstride != Nq) qfin = normed.data(), qstride = Nq;
    }
    {
      const auto [i0, i1] = share(B * Hkv, tid, nth);
      gqa_items<T, T>(qfin, [&](int64_t b) -> const T* { return cp + sp[b] * cap * W; }, blocked.get(), skp,
                      att.data(), 1, H, Hkv, hd, end, static_cast<float>(scale), i0, i1);
    }
#pragma omp barrier
#pragma omp single
    {
      if (!dense) {
        load_f32<T>(att.data(), xf.data(), B * Nq);
        x_o.set(xf.data(), B, Nq, po.w4.G);
      }
    }
    share_tiles({D}, tid, nth, [&](size_t, int64_t n0, int64_t n1_) {
      po.span(att.data(), x_o, B, o.data(), D, n0, n1_);
      residual_cols<T>(xp, o.data(), hp, B, D, n0, n1_);
    });
  }
  return h;
}

// the FFN half: h + ffn(rms(h)) for N = h.numel() / D tokens -> (that, the experts chosen [N, k]). ffn: the routed
// experts (gate_w non-empty: routed by moe_route, each token's top k) and the shared expert (shared_inter > 0), or a
// dense FFN alone (gate_w empty; its weights where the shared expert's go, k = 0). Weights int4 (the integer kernel,
// inputs quantized per row), or with ``dense`` every one bf16 (the few-row bf16 kernel, inputs as they are; MoE blocks).
template <typename T, typename S>
std::tuple<at::Tensor, at::Tensor> ffn_team(const at::Tensor& h, const at::Tensor& ffn_norm, double ffn_eps,
                                            const at::Tensor& gate_w, const at::Tensor& gate_b, const at::Tensor& corr,
                                            int64_t k, bool softmax_scores, bool softmax_after_topk, int64_t n_group,
                                            int64_t topk_group, bool group_top2, bool norm, double scaling,
                                            at::TensorList moe_w, int64_t group, int64_t inter, int64_t shared_inter,
                                            bool dense) {
  const int64_t D = h.size(-1), B = h.numel() / D;
  const T* hp = h.data_ptr<T>();
  auto hn = at::empty({B, D}, h.options());
  rms_rows<T>(hp, ffn_norm.data_ptr<T>(), hn.data_ptr<T>(), B, D, static_cast<float>(ffn_eps));
  const bool routing = gate_w.numel() > 0;
  std::tuple<at::Tensor, at::Tensor> routed;
  if (routing) {
    routed = moe_route(hn, gate_w, gate_b, corr, k, softmax_scores, softmax_after_topk, n_group, topk_group,
                       group_top2, norm, scaling);
  } else {
    routed = {at::empty({B, 0}, h.options().dtype(at::kFloat)), at::empty({B, 0}, h.options().dtype(at::kLong))};
    k = 0;
  }
  const at::Tensor& idx = std::get<1>(routed);
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = std::get<0>(routed).data_ptr<float>();
  // the experts hit, in expert order, then the shared expert: their tokens, weights and buffers (kept on this thread
  // from call to call, as mla_team's are)
  struct Job {
    I4W<S> gu, dn;
    const uint16_t *dgu = nullptr, *ddn = nullptr;  // dense: bf16 gate_up [2I, D] and down [D, I]
    const uint16_t *tgu = nullptr, *tdn = nullptr;  // their tile copies (bf16_tiles), or null
    int64_t I = 0;
    std::vector<int64_t> tok;  // its rows' tokens
    std::vector<float> wt;     // their routing weights
    std::vector<int64_t> row;  // per token, its row here (-1: not routed here)
    const I16Rows* x = nullptr;  // its input rows: every token's (xq) when it takes them all in order, else xg
    const T* xd = nullptr;       // dense: its input rows, hn's when it takes them all in order, else xt's
    I16Rows xg, a;
    std::vector<T> xt, hb, ab, y;  // (dense) its tokens' rows of hn; gate_up out [rows, 2I], silu(gate) * up [rows, I],
                                   // down out [rows, D]
  };
  struct Bufs {
    std::vector<Job> pool;
    std::vector<float> hf;
    I16Rows xq;  // every token's normed input, quantized once (rows are quantized independently)
    std::vector<int64_t> gu_rows, task_job, task_row;
  };
  thread_local Bufs bufs;  // (named by references, as in mla_team)
  auto &pool = bufs.pool, &task_job = bufs.task_job, &task_row = bufs.task_row, &gu_rows = bufs.gu_rows;
  auto& hf = bufs.hf;
  auto& xq = bufs.xq;
  size_t njobs = 0;
  at::Tensor tiles[8];  // the weights' tile copies (bf16_tiles, int4_tiles; held for this call)
  for (int i = 0; i < 8; i += 2)
    tiles[i] = dense ? bf16_tiles(moe_w[i]) : int4_tiles(moe_w[i], moe_w[i + 1], group);
  // a job's two products (gate_up at i, down at i + 2 of moe_w) of expert e (e < 0: not stacked)
  auto add_job = [&](int i, int64_t e, int64_t I) -> Job& {
    if (njobs == pool.size()) pool.emplace_back();
    Job& jb = pool[njobs++];
    jb.tok.clear(), jb.wt.clear();
    jb.I = I;
    if (dense) {
      auto dw = [&](const at::Tensor& w) {
        return reinterpret_cast<const uint16_t*>(w.data_ptr()) + (e >= 0 ? e * w.size(1) * w.size(2) : 0);
      };
      jb.dgu = dw(moe_w[i]), jb.ddn = dw(moe_w[i + 2]);
      jb.tgu = tiles_of(tiles[i], e), jb.tdn = tiles_of(tiles[i + 2], e);
    } else {
      jb.gu = i4w<S>(moe_w[i], moe_w[i + 1], group, e, &tiles[i]);
      jb.dn = i4w<S>(moe_w[i + 2], moe_w[i + 3], group, e, &tiles[i + 2]);
    }
    return jb;
  };
  const int64_t E = routing ? moe_w[0].size(0) : 0;
  for (int64_t pr = 0; pr < B * k; ++pr)
    TORCH_CHECK(ip[pr] >= 0 && ip[pr] < E, "waferline::ffn_residual: expert index ", ip[pr], " out of range");
  for (int64_t e = 0; e < E; ++e) {  // (a scan per expert: B k is at most a few dozen pairs)
    Job* jb = nullptr;
    for (int64_t pr = 0; pr < B * k; ++pr) {
      if (ip[pr] != e) continue;
      if (jb == nullptr) jb = &add_job(0, e, inter);
      jb->tok.push_back(pr / k), jb->wt.push_back(wp[pr]);
    }
  }
  const size_t routed_jobs = njobs;
  if (shared_inter > 0) {
    Job& jb = add_job(4, -1, shared_inter);
    for (int64_t t = 0; t < B; ++t) jb.tok.push_back(t), jb.wt.push_back(1.f);
  }
  Job* jobs = pool.data();
  const T* hnp = hn.data_ptr<T>();
  if (!dense) {
    at_least(hf, B * D);
    load_f32<T>(hnp, hf.data(), B * D);
    xq.set(hf.data(), B, D, group);
  }
  gu_rows.clear(), task_job.clear(), task_row.clear();
  const int64_t ng = dense ? 0 : D / group;  // (dense: no quantized rows)
  for (size_t j = 0; j < njobs; ++j) {
    Job& jb = jobs[j];
    const int64_t M = static_cast<int64_t>(jb.tok.size());
    jb.row.assign(B, -1);
    bool in_order = M == B;
    for (int64_t m = 0; m < M; ++m) {
      jb.row[jb.tok[m]] = m;
      in_order = in_order && jb.tok[m] == m;
      task_job.push_back(static_cast<int64_t>(j)), task_row.push_back(m);
    }
    if (in_order) {
      jb.x = &xq, jb.xd = hnp;
    } else if (dense) {  // its tokens' rows of hn, as moe_ffn gathers them
      at_least(jb.xt, M * D);
      for (int64_t m = 0; m < M; ++m) std::copy(hnp + jb.tok[m] * D, hnp + (jb.tok[m] + 1) * D, jb.xt.begin() + m * D);
      jb.xd = jb.xt.data();
    } else {  // its tokens' rows of xq (the numbers quantizing those rows alone gives)
      jb.xg.resize(M, D, group);
      for (int64_t m = 0; m < M; ++m) {
        const int64_t t = jb.tok[m];
        std::copy(xq.xq.begin() + t * D, xq.xq.begin() + (t + 1) * D, jb.xg.xq.begin() + m * D);
        std::copy(xq.sx.begin() + t * ng, xq.sx.begin() + (t + 1) * ng, jb.xg.sx.begin() + m * ng);
        std::copy(xq.xs.begin() + t * ng, xq.xs.begin() + (t + 1) * ng, jb.xg.xs.begin() + m * ng);
      }
      jb.x = &jb.xg;
    }
    if (!dense) jb.a.resize(M, jb.I, group);
    at_least(jb.hb, M * 2 * jb.I), at_least(jb.ab, M * jb.I), at_least(jb.y, M * D);
    gu_rows.push_back(2 * jb.I);
  }
  auto out = at::empty_like(h);
  T* op = out.data_ptr<T>();
  const int nt = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    share_tiles(gu_rows, tid, nth, [&](size_t j, int64_t n0, int64_t n1_) {
      const Job& jb = jobs[j];
      if (dense) {
        dense_span<T>(jb.xd, static_cast<int64_t>(jb.tok.size()), jb.dgu, jb.tgu, D, jobs[j].hb.data(), 2 * jb.I, n0,
                      n1_);
      } else {
        i4_span<T, S>(*jb.x, jb.gu, jobs[j].hb.data(), 2 * jb.I, n0, n1_);
      }
    });
#pragma omp barrier
    {  // silu(gate) * up per row, and that row as the down product's input
      const auto [i0, i1] = share(static_cast<int64_t>(task_job.size()), tid, nth);
      thread_local std::vector<float> af;  // (each thread's own)
      for (int64_t i = i0; i < i1; ++i) {
        Job& jb = jobs[task_job[i]];
        const int64_t m = task_row[i], I = jb.I;
        silu_mul_rows<T>(jb.hb.data() + m * 2 * I, jb.ab.data() + m * I, 1, I, 2 * I);
        if (dense) continue;  // (the bf16 kernel takes the rows as they are)
        af.resize(I);
        load_f32<T>(jb.ab.data() + m * I, af.data(), I);
        jb.a.set_row(m, af.data());
      }
    }
#pragma omp barrier
    {  // the down products by output rows: this thread's rows of every job, then their sum, shared part, residual
      const auto [t0, t1] = share((D + I16_TILE - 1) / I16_TILE, tid, nth);
      const int64_t d0 = t0 * I16_TILE, d1 = std::min(D, t1 * I16_TILE);
      if (d0 < d1) {
        for (size_t j = 0; j < njobs; ++j) {
          Job& jb = jobs[j];
          if (dense) {
            dense_span<T>(jb.ab.data(), static_cast<int64_t>(jb.tok.size()), jb.ddn, jb.tdn, jb.I, jb.y.data(), D, d0,
                          d1);
          } else {
            i4_span<T, S>(jb.a, jb.dn, jb.y.data(), D, d0, d1);
          }
        }
        // per token, in fp32 chunks of its columns (loops the compiler vectorises; each output's sums in the order
        // and roundings of one column at a time: the routed experts' weighted sum in expert order rounded to T, plus
        // the shared expert's rounded to T, plus h rounded to T)
        constexpr int64_t CH = 256;
        float acc[CH], yb[CH];
        for (int64_t t = 0; t < B; ++t) {
          for (int64_t c0 = d0; c0 < d1; c0 += CH) {
            const int64_t n = std::min(CH, d1 - c0);
            std::fill(acc, acc + n, 0.f);
            for (size_t j = 0; j < routed_jobs; ++j) {
              const int64_t m = jobs[j].row[t];
              if (m < 0) continue;
              const float w = jobs[j].wt[m];
              load_f32<T>(jobs[j].y.data() + m * D + c0, yb, n);
#pragma omp simd
              for (int64_t i = 0; i < n; ++i) acc[i] += yb[i] * w;
            }
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) acc[i] = round_to<T>(acc[i]);
            if (routed_jobs < njobs) {
              load_f32<T>(jobs[njobs - 1].y.data() + t * D + c0, yb, n);
#pragma omp simd
              for (int64_t i = 0; i < n; ++i) acc[i] = round_to<T>(acc[i] + yb[i]);
            }
            load_f32<T>(hp + t * D + c0, yb, n);
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) acc[i] += yb[i];
            store_f32<T>(acc, op + t * D + c0, n);
          }
        }
      }
    }
  }
  return {out, idx};
}

// a team half's rows (one token each): slots and positions int64 [B] inside the cache, no two rows at one slot and
// position (a verify's tokens, as rows, sit at distinct positions); -> the keys' end and whether all share a position
bool team_rows_fit(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos, int64_t B, int64_t& end,
                   bool& uniform) {
  if (slots.scalar_type() != at::kLong || pos.scalar_type() != at::kLong || slots.numel() != B || pos.numel() != B ||
      !slots.is_contiguous() || !pos.is_contiguous())
    return false;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  end = 0, uniform = true;
  for (int64_t b = 0; b < B; ++b) {
    if (sp[b] < 0 || sp[b] >= cache.size(0) || pp[b] < 0 || pp[b] >= cache.size(1)) return false;
    for (int64_t c = 0; c < b; ++c)
      if (sp[c] == sp[b] && pp[c] == pp[b]) return false;
    end = std::max(end, pp[b] + 1);
    uniform = uniform && pp[b] == pp[0];
  }
  return true;
}

// whether mla_team takes this attention block (else the composed path, which checks and reports bad arguments): its
// int4 weights' scale dtype, and the rows' key range and whether they share a position
bool mla_team_fits(const at::Tensor& x, const at::Tensor& mix_norm, at::TensorList w, at::IntArrayRef groups,
                   const at::Tensor& qa_norm, const at::Tensor& kva_norm, const at::Tensor& cos2, const at::Tensor& sin2,
                   const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos, const at::Tensor& w_uk,
                   const at::Tensor& w_uv, at::ScalarType& st, int64_t& end, bool& uniform) {
  if (w.size() != 8 || groups.size() != 4 || w_uk.dim() != 3 || w_uv.dim() != 3 || !w[3].numel()) return false;
  const at::ScalarType dt = x.scalar_type();
  st = w[3].scalar_type();
  if (st != at::kBFloat16 && st != at::kHalf && st != at::kFloat) return false;
  const int64_t B = x.size(0), D = x.size(2), H = w_uk.size(0), n = w_uk.size(1), r = w_uk.size(2), v = w_uv.size(1);
  const at::ScalarType wt = w_uk.scalar_type();
  if (B < 1 || (wt != at::kFloat && wt != at::kBFloat16) || w_uv.scalar_type() != wt || !w_uk.is_contiguous() ||
      !w_uv.is_contiguous() || w_uv.size(0) != H || w_uv.size(2) != r)
    return false;
  if (cache.dim() != 3 || cache.scalar_type() != dt || !cache.is_contiguous() || cache.size(2) <= r) return false;
  const int64_t p = cache.size(2) - r;
  if (p % 2 || cos2.scalar_type() != at::kFloat || sin2.scalar_type() != at::kFloat || !cos2.is_contiguous() ||
      !sin2.is_contiguous() || cos2.numel() != B * p || sin2.numel() != B * p)
    return false;
  const bool lora = w[0].numel() > 0;
  const int64_t Nqa = lora ? w[0].size(0) : 0;
  auto normed = [&](const at::Tensor& t, int64_t len) { return t.scalar_type() == dt && t.numel() == len && t.is_contiguous(); };
  if (!normed(mix_norm, D) || !normed(kva_norm, r) || (lora && !normed(qa_norm, Nqa))) return false;
  if ((lora && !i4_fits(w[0], w[1], groups[0], Nqa, D, st)) ||
      !i4_fits(w[2], w[3], groups[1], H * (n + p), lora ? Nqa : D, st) ||
      !i4_fits(w[4], w[5], groups[2], r + p, D, st) || !i4_fits(w[6], w[7], groups[3], D, H * v, st))
    return false;
  return team_rows_fit(cache, slots, pos, B, end, uniform);
}

// whether ffn_team takes this FFN (else the composed path): routed experts [E, 2I, D] / [E, D, I] (gate_w non-empty)
// and a shared expert [2S, D] / [D, S] (shared_inter > 0), or the dense FFN alone, all int4 with scales of dtype st
bool ffn_team_fits(const at::Tensor& h, const at::Tensor& ffn_norm, const at::Tensor& gate_w, at::TensorList moe_w,
                   int64_t group, int64_t inter, int64_t shared_inter, at::ScalarType st) {
  if (moe_w.size() != 8 || !h.is_contiguous() || h.dim() < 2) return false;
  const int64_t D = h.size(-1);
  if (D < 1 || h.numel() / D > INT4_KERNEL_ROWS) return false;  // more rows: int4_mm's GEMM path (other numbers)
  if (ffn_norm.scalar_type() != h.scalar_type() || ffn_norm.numel() != D || !ffn_norm.is_contiguous()) return false;
  if (st != at::kBFloat16 && st != at::kHalf && st != at::kFloat) return false;
  if (gate_w.numel() > 0) {
    const int64_t E = moe_w[0].dim() == 3 ? moe_w[0].size(0) : 0;
    if (E < 1 || inter < 1 || gate_w.dim() != 2 || gate_w.size(0) != E || !i4_fits(moe_w[0], moe_w[1], group, 2 * inter, D, st, E) ||
        !i4_fits(moe_w[2], moe_w[3], group, D, inter, st, E))
      return false;
  } else if (shared_inter < 1) {
    return false;
  }
  return shared_inter < 1 || (i4_fits(moe_w[4], moe_w[5], group, 2 * shared_inter, D, st) &&
                              i4_fits(moe_w[6], moe_w[7], group, D, shared_inter, st));
}

// whether ffn_team takes this FFN with dense weights: a MoE block (routed experts, a shared one or none), bf16 h of at
// most FEW_ROWS rows (the composed path's products run few_rows then, the same kernel) and every weight bf16 with no
// scales, on a CPU with the AVX512-BF16 kernel. A dense FFN keeps the composed path: on Llama-type layers the team was
// level in one process and 0.85x in decode_ab.py's separate ones (session 23), where MoE blocks gained 1.05-1.15x.
bool ffn_team_dense_fits(const at::Tensor& h, const at::Tensor& ffn_norm, const at::Tensor& gate_w, at::TensorList moe_w,
                         int64_t inter, int64_t shared_inter) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (moe_w.size() != 8 || !h.is_contiguous() || h.dim() < 2 || h.scalar_type() != at::kBFloat16) return false;
  const int64_t D = h.size(-1);
  if (D < 1 || h.numel() / D > FEW_ROWS) return false;
  if (ffn_norm.scalar_type() != h.scalar_type() || ffn_norm.numel() != D || !ffn_norm.is_contiguous()) return false;
  auto fits = [](const at::Tensor& w, const at::Tensor& sz, int64_t N, int64_t K, int64_t E) {
    return sz.numel() == 0 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
           (E ? w.dim() == 3 && w.size(0) == E && w.size(1) == N && w.size(2) == K
              : w.dim() == 2 && w.size(0) == N && w.size(1) == K);
  };
  if (gate_w.numel() == 0)  // a dense FFN alone (its weights where the shared expert's go)
    return shared_inter >= 1 && fits(moe_w[4], moe_w[5], 2 * shared_inter, D, 0) &&
           fits(moe_w[6], moe_w[7], D, shared_inter, 0);
  const int64_t E = moe_w[0].dim() == 3 ? moe_w[0].size(0) : 0;
  if (E < 1 || inter < 1 || gate_w.dim() != 2 || gate_w.size(0) != E ||
      !fits(moe_w[0], moe_w[1], 2 * inter, D, E) || !fits(moe_w[2], moe_w[3], D, inter, E))
    return false;
  return shared_inter < 1 ||
         (fits(moe_w[4], moe_w[5], 2 * shared_inter, D, 0) && fits(moe_w[6], moe_w[7], D, shared_inter, 0));
#else
  return false;
#endif
}

// whether gqa_team takes this attention half (else gqa_attend, which checks and reports bad arguments): one token a
// row, the four projections all int4 on the integer kernel's groups (scales of dtype st) or (``dense``) all bf16 with
// at most FEW_ROWS rows on an AVX512-BF16 CPU (as ffn_team_dense_fits); -> the keys' end, whether rows share a position
bool gqa_team_fits(const at::Tensor& x, const at::Tensor& mix_norm, at::TensorList w, at::IntArrayRef groups,
                   const at::Tensor& q_norm, const at::Tensor& k_norm, const at::Tensor& cos2, const at::Tensor& sin2,
                   int64_t rot, const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos,
                   const at::Tensor& sinks, int64_t H, int64_t Hkv, at::ScalarType& st, bool& dense, int64_t& end,
                   bool& uniform) {
  if (w.size() != 8 || groups.size() != 4 || x.dim() != 3 || x.size(1) != 1 || !x.is_contiguous()) return false;
  const at::ScalarType dt = x.scalar_type();
  const int64_t B = x.size(0), D = x.size(2);
  if (B < 1 || H < 1 || Hkv < 1 || H % Hkv != 0) return false;
  if (cache.dim() != 3 || cache.scalar_type() != dt || !cache.is_contiguous() || cache.size(2) % (2 * Hkv) != 0 ||
      cache.size(2) == 0)
    return false;
  const int64_t hd = cache.size(2) / (2 * Hkv), Nq = H * hd, Nkv = Hkv * hd;
  auto normed = [&](const at::Tensor& t, int64_t len) { return t.scalar_type() == dt && t.numel() == len && t.is_contiguous(); };
  if (!normed(mix_norm, D) || ((q_norm.numel() || k_norm.numel()) && !(normed(q_norm, hd) && normed(k_norm, hd))))
    return false;
  if (rot != 0 && (rot < 0 || rot % 2 != 0 || rot > hd || cos2.scalar_type() != at::kFloat ||
                   sin2.scalar_type() != at::kFloat || !cos2.is_contiguous() || !sin2.is_contiguous() ||
                   cos2.numel() != B * rot || sin2.numel() != B * rot))
    return false;
  if (sinks.numel() && (sinks.scalar_type() != at::kFloat || sinks.numel() != H || !sinks.is_contiguous())) return false;
  const int n_int4 = (w[1].numel() > 0) + (w[3].numel() > 0) + (w[5].numel() > 0) + (w[7].numel() > 0);
  if (n_int4 == 4) {
    dense = false, st = w[1].scalar_type();
    if (st != at::kBFloat16 && st != at::kHalf && st != at::kFloat) return false;
    if (!i4_fits(w[0], w[1], groups[0], Nq, D, st) || !i4_fits(w[2], w[3], groups[1], Nkv, D, st) ||
        !i4_fits(w[4], w[5], groups[2], Nkv, D, st) || !i4_fits(w[6], w[7], groups[3], D, Nq, st))
      return false;
  } else if (n_int4 == 0) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    dense = true, st = at::kBFloat16;
    auto fits = [](const at::Tensor& t, int64_t N, int64_t K) {
      return t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == 2 && t.size(0) == N && t.size(1) == K;
    };
    if (dt != at::kBFloat16 || B > FEW_ROWS || !fits(w[0], Nq, D) || !fits(w[2], Nkv, D) || !fits(w[4], Nkv, D) ||
        !fits(w[6], D, Nq))
      return false;
#else
    return false;
#endif
  } else {
    return false;
  }
  return team_rows_fit(cache, slots, pos, B, end, uniform);
}

// f(T tag, S tag) for activations of dtype dt (bf16 / fp16) and int4 scales of dtype st
template <typename F>
auto with_team_types(at::ScalarType dt, at::ScalarType st, F&& f) {
  auto with_s = [&](auto t_tag) {
    switch (st) {
      case at::kBFloat16: return f(t_tag, c10::BFloat16());
      case at::kHalf: return f(t_tag, c10::Half());
      default: return f(t_tag, 0.f);
    }
  };
  return dt == at::kBFloat16 ? with_s(c10::BFloat16()) : with_s(c10::Half());
}

// the team path's common conditions: the integer int4 kernel on (AVX2, not forced portable), 16-bit activations
bool team_on(const at::Tensor& x) {
  return !g_portable.load(std::memory_order_relaxed) && g_int_act.load(std::memory_order_relaxed) &&
         (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
}
#endif

// ---------------------------------------------------------------- a decoder layer's FFN half, decode and verify
// What DecoderLayer.forward computes after its mixer when its FFN is a MoE block that runs as moe_route + moe_ffn
// (gate_w non-empty) or a dense SwiGLU FFN of int4 weights (gate_w empty; its gate_up / down where the shared expert's
// go, shared_inter its width): h + ffn(rms(h)) for the N tokens of h [..., D]; with the experts chosen [N, k]
// (k = 0 for a dense FFN). On one thread team when the weights fit the integer int4 kernel, else the same operators
// composed (moe_route, moe_ffn; for a dense FFN the gated product moe_ffn's shared expert runs). The same numbers.
std::tuple<at::Tensor, at::Tensor> ffn_residual(const at::Tensor& h, const at::Tensor& ffn_norm, double ffn_eps,
                                                const at::Tensor& gate_w, const at::Tensor& gate_b,
                                                const at::Tensor& corr, int64_t k, bool softmax_scores,
                                                bool softmax_after_topk, int64_t n_group, int64_t topk_group,
                                                bool group_top2, bool norm, double scaling, at::TensorList moe_w,
                                                int64_t group, int64_t inter, int64_t shared_inter) {
  TORCH_CHECK(moe_w.size() == 8, "waferline::ffn_residual: 8 FFN weights (gate_up, down, shared gate_up, shared "
              "down, each with its scales)");
  TORCH_CHECK(h.device().is_cpu() && h.dim() >= 2 && h.is_contiguous(), "waferline::ffn_residual: contiguous CPU h [..., D]");
  const int64_t D = h.size(-1), N = h.numel() / std::max<int64_t>(D, 1);
#if defined(__AVX2__) && defined(__FMA__) && defined(_OPENMP)
  const at::ScalarType st = moe_w[5].numel() ? moe_w[5].scalar_type() : moe_w[1].scalar_type();
  bool dense = false;
  if (team_on(h) && (ffn_team_fits(h, ffn_norm, gate_w, moe_w, group, inter, shared_inter, st) ||
                     (dense = ffn_team_dense_fits(h, ffn_norm, gate_w, moe_w, inter, shared_inter)))) {
    g_team_halves.fetch_add(1, std::memory_order_relaxed);
    return with_team_types(h.scalar_type(), st, [&](auto t_tag, auto s_tag) {
      return ffn_team<decltype(t_tag), decltype(s_tag)>(h, ffn_norm, ffn_eps, gate_w, gate_b, corr, k, softmax_scores,
                                                        softmax_after_topk, n_group, topk_group, group_top2, norm,
                                                        scaling, moe_w, group, inter, shared_inter, dense);
    });
  }
#endif
  auto hn = rms_norm(h, ffn_norm, ffn_eps).view({N, D});
  if (gate_w.numel() > 0) {
    auto routed = moe_route(hn, gate_w, gate_b, corr, k, softmax_scores, softmax_after_topk, n_group, topk_group,
                            group_top2, norm, scaling);
    auto m = moe_ffn(hn.contiguous(), std::get<0>(routed), std::get<1>(routed), moe_w[0], moe_w[1], moe_w[2],
                     moe_w[3], moe_w[4], moe_w[5], moe_w[6], moe_w[7], group, inter, shared_inter);
    return {h + m.view(h.sizes()), std::get<1>(routed)};
  }
  TORCH_CHECK(shared_inter > 0 && moe_w[4].numel() && moe_w[6].numel(),
              "waferline::ffn_residual: a dense FFN (no gate) needs its gate_up and down weights");
  Bundle gu{moe_w[4], moe_w[5], group}, dn{moe_w[6], moe_w[7], group};
  for (const Bundle* b : {&gu, &dn}) {
    TORCH_CHECK(b->int4() ? int4_shaped(b->w, b->sz, group, b->w.size(0), b->w.size(1) * 2)
                          : b->w.scalar_type() == h.scalar_type() && b->w.is_contiguous() && b->w.dim() == 2,
                "waferline::ffn_residual: dense FFN weights are int4 (waferline's layout) or of h's dtype");
  }
  TORCH_CHECK(gu.w.size(0) == 2 * shared_inter && dn.w.size(0) == D, "waferline::ffn_residual: gate_up [2S, D], down [D, S]");
  at::Tensor m;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "waferline_ffn_residual", [&] {
    m = gated_ffn<scalar_t>(hn.contiguous(), gu, dn, -1, shared_inter, D);
  });
  return {h + m.view(h.sizes()), at::empty({N, 0}, h.options().dtype(at::kLong))};
}

// A decoder layer's decode step with GQA attention as one call: h = x + gqa(rms(x)); out = h + ffn(rms(h)), the FFN
// as ffn_residual runs it. Returns (out, the experts chosen [B T, k]), as mla_moe_layer does. The attention half on a
// thread team (gqa_team) where its products fit one, else composed (gqa_attend): the same numbers.
std::tuple<at::Tensor, at::Tensor> gqa_moe_layer(
    const at::Tensor& x, const at::Tensor& mix_norm, double mix_eps, at::TensorList w, at::IntArrayRef groups,
    const at::Tensor& q_norm, const at::Tensor& k_norm, double qk_eps, const at::Tensor& cos2, const at::Tensor& sin2,
    int64_t rot, bool interleaved, at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos,
    const at::Tensor& sinks, double scale, int64_t heads, int64_t kv_heads, const at::Tensor& ffn_norm,
    double ffn_eps, const at::Tensor& gate_w, const at::Tensor& gate_b, const at::Tensor& corr, int64_t k,
    bool softmax_scores, bool softmax_after_topk, int64_t n_group, int64_t topk_group, bool group_top2, bool norm,
    double scaling, at::TensorList moe_w, int64_t group, int64_t inter, int64_t shared_inter) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "waferline::gqa_moe_layer: contiguous x [B, T, D]");
  const at::Tensor xr = x.view({-1, 1, x.size(2)});  // the tokens as rows (slots, pos, cos2, sin2: one per token)
  at::Tensor h;
#if defined(__AVX2__) && defined(__FMA__) && defined(_OPENMP)
  at::ScalarType st;
  bool dense = false, uniform = true;
  int64_t end = 0;
  if (team_on(xr) && gqa_team_fits(xr, mix_norm, w, groups, q_norm, k_norm, cos2, sin2, rot, cache, slots, pos, sinks,
                                   heads, kv_heads, st, dense, end, uniform)) {
    h = with_team_types(x.scalar_type(), st, [&](auto t_tag, auto s_tag) {
      return gqa_team<decltype(t_tag), decltype(s_tag)>(xr, mix_norm, mix_eps, w, groups, q_norm, k_norm, qk_eps, cos2,
                                                        sin2, rot, interleaved, cache, slots.data_ptr<int64_t>(),
                                                        pos.data_ptr<int64_t>(), end, uniform, sinks, scale, heads,
                                                        kv_heads, dense);
    });
    g_team_halves.fetch_add(1, std::memory_order_relaxed);
  }
#endif
  if (!h.defined()) {
    h = xr + gqa_attend(rms_norm(xr, mix_norm, mix_eps), w, groups, q_norm, k_norm, qk_eps, cos2, sin2, rot,
                        interleaved, cache, slots, pos, sinks, scale, heads, kv_heads);
  }
  return ffn_residual(h.view(x.sizes()), ffn_norm, ffn_eps, gate_w, gate_b, corr, k, softmax_scores,
                      softmax_after_topk, n_group, topk_group, group_top2, norm, scaling, moe_w, group, inter,
                      shared_inter);
}

// ---------------------------------------------------------------- a decoder layer's decode step, MLA + FFN
// What DecoderLayer.forward computes for rows of T new tokens each (a decode step, T = 1, or a speculative verify's
// few; the attention takes the B T tokens as rows, each with its slot and position) when its mixer runs as
// mla_attend_int4 and its FFN as ffn_residual does: h = x + mla(rms(x)); out = h + ffn(rms(h)). The same functions
// in the same order on the same tensors (the same numbers); it saves the Python of the layer, its two norms, the
// attention block and the FFN and their ~10 op calls between them. On two thread teams (attention, FFN) when the weights fit the integer int4 kernel.
// Returns (out, the experts chosen [B T, k]: what an op counter needs to price the expert products).
std::tuple<at::Tensor, at::Tensor> mla_moe_layer(const at::Tensor& x, const at::Tensor& mix_norm, double mix_eps, at::TensorList w,
                         at::IntArrayRef groups, const at::Tensor& qa_norm, const at::Tensor& kva_norm, double eps_q,
                         double eps_kv, const at::Tensor& cos2, const at::Tensor& sin2, bool interleaved,
                         at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos, const at::Tensor& w_uk,
                         const at::Tensor& w_uv, double scale, const at::Tensor& ffn_norm, double ffn_eps,
                         const at::Tensor& gate_w, const at::Tensor& gate_b, const at::Tensor& corr, int64_t k,
                         bool softmax_scores, bool softmax_after_topk, int64_t n_group, int64_t topk_group,
                         bool group_top2, bool norm, double scaling, at::TensorList moe_w, int64_t group, int64_t inter,
                         int64_t shared_inter) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "waferline::mla_moe_layer: contiguous x [B, T, D]");
  const at::Tensor xr = x.view({-1, 1, x.size(2)});  // the tokens as rows (slots, pos, cos2, sin2: one per token)
  at::Tensor h;
#if defined(__AVX2__) && defined(__FMA__) && defined(_OPENMP)
  at::ScalarType st;
  int64_t end = 0;
  bool uniform = true;
  if (team_on(xr) && mla_team_fits(xr, mix_norm, w, groups, qa_norm, kva_norm, cos2, sin2, cache, slots, pos, w_uk, w_uv,
                                   st, end, uniform)) {
    h = with_team_types(x.scalar_type(), st, [&](auto t_tag, auto s_tag) {
      return mla_team<decltype(t_tag), decltype(s_tag)>(xr, mix_norm, mix_eps, w, groups, qa_norm, kva_norm, eps_q, eps_kv,
                                                        cos2, sin2, interleaved, cache, slots.data_ptr<int64_t>(),
                                                        pos.data_ptr<int64_t>(), end, uniform, w_uk, w_uv, scale);
    });
    g_team_halves.fetch_add(1, std::memory_order_relaxed);
  }
#endif
  if (!h.defined()) {
    h = xr + mla_attend_int4(rms_norm(xr, mix_norm, mix_eps), w, groups, qa_norm, kva_norm, eps_q, eps_kv, cos2, sin2,
                             interleaved, cache, slots, pos, w_uk, w_uv, scale);
  }
  h = h.view(x.sizes());
  return ffn_residual(h, ffn_norm, ffn_eps, gate_w, gate_b, corr, k, softmax_scores, softmax_after_topk, n_group,
                      topk_group, group_top2, norm, scaling, moe_w, group, inter, shared_inter);
}

// ---------------------------------------------------------------- Mamba-2 state update (decode, speculative verify)
// h [Bs, H, P, N] fp32, updated in place; dA [Bs, T, H], dtx = dt x [Bs, T, H, P], Bm / Cm [Bs, T, G, N], all fp32;
// heads of a group share B and C (group = head / (H / G)). For each new token t in order:
//   h = h * dA_t + dtx_t * B_t ;  y_t = sum_n h * C_t     (the caller adds D x)
// -> y [Bs, T, H, P]; ``trail`` [Bs, T, H, P, N] (or empty) receives the state after each token. One pass over the
// state per token instead of the eager chain's broadcast products ([.., P, N] temporaries written and read again);
// the arithmetic per token does not depend on T, so a T-token verify computes what T one-token steps compute.
void ssm_rows(float* h, const float* dA, const float* dtx, const float* Bm, const float* Cm, float* y, float* trail,
              int64_t Bs, int64_t T, int64_t H, int64_t P, int64_t N, int64_t G) {
  const int64_t R = H / G;
  at::parallel_for(0, Bs * H, std::max<int64_t>(1, 4096 / std::max<int64_t>(P * N * T, 1)), [&](int64_t i0, int64_t i1) {
    for (int64_t bh = i0; bh < i1; ++bh) {
      const int64_t b = bh / H, hd = bh % H, g = hd / R;
      for (int64_t pp = 0; pp < P; ++pp) {
        float* hs = h + (bh * P + pp) * N;
        for (int64_t t = 0; t < T; ++t) {
          const int64_t bt = b * T + t;
          const float a = dA[bt * H + hd];
          const float x = dtx[(bt * H + hd) * P + pp];
          const float* Bv = Bm + (bt * G + g) * N;
          const float* Cv = Cm + (bt * G + g) * N;
          y[(bt * H + hd) * P + pp] = ssm_token(hs, a, x, Bv, Cv, N);
          if (trail) {
            float* tr = trail + ((bt * H + hd) * P + pp) * N;
            for (int64_t k = 0; k < N; ++k) tr[k] = hs[k];
          }
        }
      }
    }
  });
}

at::Tensor ssm_update(at::Tensor& h, const at::Tensor& dA, const at::Tensor& dtx, const at::Tensor& Bm,
                      const at::Tensor& Cm, at::Tensor& trail) {
  TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kFloat && h.is_contiguous() && h.dim() == 4,
              "waferline::ssm_update: h must be a contiguous fp32 CPU tensor [B, H, P, N]");
  const int64_t Bs = h.size(0), H = h.size(1), P = h.size(2), N = h.size(3);
  TORCH_CHECK(dA.dim() == 3 && dA.size(0) == Bs && dA.size(2) == H, "waferline::ssm_update: dA must be [B, T, H]");
  const int64_t T = dA.size(1);
  TORCH_CHECK(dtx.dim() == 4 && dtx.size(0) == Bs && dtx.size(1) == T && dtx.size(2) == H && dtx.size(3) == P,
              "waferline::ssm_update: dtx must be [B, T, H, P]");
  TORCH_CHECK(Bm.dim() == 4 && Bm.sizes() == Cm.sizes() && Bm.size(0) == Bs && Bm.size(1) == T && Bm.size(3) == N,
              "waferline::ssm_update: B and C must be [B, T, G, N]");
  const int64_t G = Bm.size(2);
  TORCH_CHECK(G > 0 && H % G == 0, "waferline::ssm_update: heads must divide into groups");
  for (const at::Tensor* t : {&dA, &dtx, &Bm, &Cm}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, "waferline::ssm_update: fp32 inputs only");
  }
  const bool record = trail.numel() > 0;
  if (record) {
    TORCH_CHECK(trail.scalar_type() == at::kFloat && trail.is_contiguous() && trail.numel() == Bs * T * H * P * N,
                "waferline::ssm_update: trail must be a contiguous fp32 [B, T, H, P, N] tensor (or empty)");
  }
  auto a = dA.contiguous();
  auto x = dtx.contiguous();
  auto bm = Bm.contiguous();
  auto cm = Cm.contiguous();
  auto y = at::empty({Bs, T, H, P}, h.options());
  ssm_rows(h.data_ptr<float>(), a.data_ptr<float>(), x.data_ptr<float>(), bm.data_ptr<float>(), cm.data_ptr<float>(),
           y.data_ptr<float>(), record ? trail.data_ptr<float>() : nullptr, Bs, T, H, P, N, G);
  return y;
}

// ---------------------------------------------------------------- Mamba-2 mixer between its two projections
// zxbcdt [B, T, d_inner + C + H] (in_proj's output, dtype X) for rows continuing the sequences of cache ``slots``;
// conv [S, C, K-1] (X) and ssm [S, H, P, N] (fp32) are the cache, updated in place at those slots. Per row, token
// after token, what Mamba2Mixer._step computes (and _recurrent for a T-token verify), with its rounding points:
//   window = [conv state | xBC_t]; xBC = act(round(sum_k round(window_k w_k)) + b) (X; silu), state shifted;
//   dt = softplus(dt_t + dt_bias) (clamped when asked), dA = exp(dt A); the SSM update as ssm_update does;
//   y = C . h + D x; g = y * silu(z), RMS-normalised per group, times the norm weight -> out [B, T, d_inner] (X).
// ``record`` (a speculative verify): ssm_prev[slot] gets the state before the tokens, and the per-token inputs of the
// update (dA, dt x, B, C) and the conv state after each token come back, for Mamba2Cache.rewind. ~40 eager ops per
// layer and token (slicing, casts, the conv window, activations, the gated norm) become one call.
inline float softplus1(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

template <typename X>
void mamba2_rows(const X* zx, X* conv, const int64_t* slots, const X* cw, const X* cb, const float* dtb, const float* A,
                 const float* Dp, const float* nw, float* ssm, float* prev, X* out, float* rdA, float* rdtx, float* rB,
                 float* rC, X* ctrail, int64_t Bs, int64_t T, int64_t F, int64_t Din, int64_t C, int64_t K, int64_t H,
                 int64_t P, int64_t N, int64_t G, float eps, bool clamp, float lo, float hi) {
  const int64_t R = H / G, gw = Din / G, Km = K - 1;
  std::vector<float> xbc(T * C), dt(T * H), dA(T * H), y(T * H * P), sz(Din), zf(Din), of(Din);
  // the conv in fp32 lanes across channels: the weight's taps and the state's entries tap-major ([k][c], exact: X
  // values), the state a ring of Km rows plus the new input's; each product and sum rounded to X as the eager conv
  // rounds it, the same order of taps (channel by channel, c10's conversions kept the loop scalar).
  std::vector<float> wt(K * C), ring((Km + 1) * C), pre(C);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t k = 0; k < K; ++k) wt[k * C + c] = f32(cw[c * K + k]);
  std::vector<float*> tap(Km + 1);
  for (int64_t b = 0; b < Bs; ++b) {
    const int64_t s = slots[b];
    X* cs = conv + s * C * Km;
    float* hs = ssm + s * H * P * N;
    if (prev) std::copy(hs, hs + H * P * N, prev + s * H * P * N);
    for (int64_t k = 0; k <= Km; ++k) tap[k] = ring.data() + k * C;
    for (int64_t c = 0; c < C; ++c)
      for (int64_t k = 0; k < Km; ++k) tap[k][c] = f32(cs[c * Km + k]);
    for (int64_t t = 0; t < T; ++t) {  // causal depthwise conv + activation, dt; the conv state shifts
      const X* row = zx + (b * T + t) * F;
      load_f32<X>(row + Din, tap[Km], C);
      for (int64_t c = 0; c < C; ++c) pre[c] = 0.f;
      for (int64_t k = 0; k <= Km; ++k) {
        const float *a = tap[k], *w = wt.data() + k * C;
        float* pc = pre.data();
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) pc[c] += round_to<X>(a[c] * w[c]);
      }
      float* xt = xbc.data() + t * C;
      float* pc = pre.data();
      if (cb) {
        for (int64_t c = 0; c < C; ++c) pc[c] = round_to<X>(round_to<X>(pc[c]) + f32(cb[c]));
      } else {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) pc[c] = round_to<X>(pc[c]);
      }
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) xt[c] = round_to<X>(silu1(pc[c]));
      std::rotate(tap.begin(), tap.begin() + 1, tap.end());  // the oldest entry leaves; the new input is the last
      if (ctrail || t + 1 == T) {  // the state after this token, channel-major [C, Km], X
        X* dst = ctrail ? ctrail + (b * T + t) * C * Km : cs;
        for (int64_t c = 0; c < C; ++c)
          for (int64_t k = 0; k < Km; ++k) dst[c * Km + k] = static_cast<X>(tap[k][c]);
        if (ctrail && t + 1 == T) std::copy(dst, dst + C * Km, cs);
      }
      for (int64_t h = 0; h < H; ++h) {
        float d = softplus1(f32(row[Din + C + h]) + dtb[h]);
        if (clamp) d = std::min(std::max(d, lo), hi);
        dt[t * H + h] = d;
        dA[t * H + h] = std::exp(d * A[h]);
      }
    }
    at::parallel_for(0, H, std::max<int64_t>(1, 4096 / std::max<int64_t>(P * N * T, 1)), [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; ++h) {  // the state update, head by head (heads of a group share B and C)
        const int64_t g = h / R;
        for (int64_t pp = 0; pp < P; ++pp) {
          float* hv = hs + (h * P + pp) * N;
          for (int64_t t = 0; t < T; ++t) {
            const float a = dA[t * H + h];
            const float xv = xbc[t * C + h * P + pp];
            const float x = dt[t * H + h] * xv;
            const float* Bv = xbc.data() + t * C + Din + g * N;
            const float* Cv = xbc.data() + t * C + Din + G * N + g * N;
            y[(t * H + h) * P + pp] = ssm_token(hv, a, x, Bv, Cv, N) + Dp[h] * xv;
          }
        }
      }
    });
    for (int64_t t = 0; t < T; ++t) {  // y * silu(z), RMS-normalised per group, times the norm weight
      const X* z = zx + (b * T + t) * F;
      X* o = out + (b * T + t) * Din;
      float* yt = y.data() + t * H * P;
      load_f32<X>(z, zf.data(), Din);
      const float* zp = zf.data();
      float* szp = sz.data();
#pragma omp simd
      for (int64_t j = 0; j < Din; ++j) szp[j] = silu1(zp[j]);
      for (int64_t gi = 0; gi < G; ++gi) {
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = gi * gw; j < (gi + 1) * gw; ++j) {
          const float v = yt[j] * sz[j];
          yt[j] = v;
          ss += v * v;
        }
        const float rs = 1.f / std::sqrt(ss / static_cast<float>(gw) + eps);
        float* op = of.data();
#pragma omp simd
        for (int64_t j = gi * gw; j < (gi + 1) * gw; ++j) op[j] = yt[j] * rs * nw[j];
      }
      store_f32<X>(of.data(), o, Din);
      if (rdA) {  // the verify's replay record
        const int64_t bt = b * T + t;
        for (int64_t h = 0; h < H; ++h) {
          rdA[bt * H + h] = dA[t * H + h];
          for (int64_t pp = 0; pp < P; ++pp) rdtx[(bt * H + h) * P + pp] = dt[t * H + h] * xbc[t * C + h * P + pp];
        }
        std::copy(xbc.data() + t * C + Din, xbc.data() + t * C + Din + G * N, rB + bt * G * N);
        std::copy(xbc.data() + t * C + Din + G * N, xbc.data() + t * C + Din + 2 * G * N, rC + bt * G * N);
      }
    }
  }
}

// a verify's record (``record`` below): the per-token update inputs and conv states mamba2_rows writes, the tensors
// that hold them (empty ones when not recording), and ssm_prev's data (the state before the tokens goes there)
struct MambaRecord {
  std::vector<at::Tensor> out;  // dA [B, T, H], dt x [B, T, H, P], B and C [B, T, G, N], conv after each token [B, T, C, K-1]
  float *prev = nullptr, *dA = nullptr, *dtx = nullptr, *Bm = nullptr, *Cm = nullptr;
  void* conv = nullptr;  // of the activations' dtype
  MambaRecord(bool record, at::Tensor& ssm_prev, int64_t B, int64_t T, int64_t H, int64_t P, int64_t G, int64_t N,
              int64_t C, int64_t K, const at::TensorOptions& xo) {
    const auto fo = xo.dtype(at::kFloat);
    if (!record) {
      out.assign(5, at::empty({0}, fo));
      return;
    }
    out = {at::empty({B, T, H}, fo), at::empty({B, T, H, P}, fo), at::empty({B, T, G, N}, fo),
           at::empty({B, T, G, N}, fo), at::empty({B, T, C, K - 1}, xo)};
    prev = ssm_prev.data_ptr<float>();
    dA = out[0].data_ptr<float>(), dtx = out[1].data_ptr<float>(), Bm = out[2].data_ptr<float>();
    Cm = out[3].data_ptr<float>(), conv = out[4].data_ptr();
  }
};

std::vector<at::Tensor> mamba2_mix(const at::Tensor& zxbcdt, at::Tensor& conv, const at::Tensor& slots,
                                   const at::Tensor& conv_w, const at::Tensor& conv_b, const at::Tensor& dt_bias,
                                   const at::Tensor& A, const at::Tensor& D, const at::Tensor& norm_w, at::Tensor& ssm,
                                   at::Tensor& ssm_prev, int64_t groups, double eps, bool clamp, double lo, double hi,
                                   bool record) {
  TORCH_CHECK(zxbcdt.dim() == 3 && conv.dim() == 3 && ssm.dim() == 4 && slots.dim() == 1,
              "waferline::mamba2_mix: zxbcdt [B, T, F], conv [S, C, K-1], ssm [S, H, P, N], slots [B]");
  const int64_t Bs = zxbcdt.size(0), T = zxbcdt.size(1), F = zxbcdt.size(2);
  const int64_t C = conv.size(1), K = conv.size(2) + 1, H = ssm.size(1), P = ssm.size(2), N = ssm.size(3), G = groups;
  const int64_t Din = H * P;
  TORCH_CHECK(G >= 1 && H % G == 0 && C == Din + 2 * G * N && F == Din + C + H,
              "waferline::mamba2_mix: widths must be d_inner = H P, conv = d_inner + 2 G N, in_proj = d_inner + conv + H");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.size(0) == Bs, "waferline::mamba2_mix: int64 slots [B]");
  TORCH_CHECK(zxbcdt.scalar_type() == conv.scalar_type() && conv_w.scalar_type() == conv.scalar_type() &&
                  conv_w.sizes() == at::IntArrayRef({C, K}) && conv.is_contiguous() && ssm.is_contiguous() &&
                  ssm.scalar_type() == at::kFloat,
              "waferline::mamba2_mix: conv state and weight [C, K] of the activations' dtype, contiguous; fp32 state");
  TORCH_CHECK(conv_b.numel() == 0 || (conv_b.numel() == C && conv_b.scalar_type() == conv.scalar_type()),
              "waferline::mamba2_mix: conv bias [C] of the activations' dtype, or empty");
  for (const at::Tensor* t : {&dt_bias, &A, &D}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == H, "waferline::mamba2_mix: dt_bias, A, D fp32 [H]");
  }
  TORCH_CHECK(norm_w.scalar_type() == at::kFloat && norm_w.numel() == Din, "waferline::mamba2_mix: fp32 norm weight [d_inner]");
  TORCH_CHECK(!record || (ssm_prev.sizes() == ssm.sizes() && ssm_prev.scalar_type() == at::kFloat && ssm_prev.is_contiguous()),
              "waferline::mamba2_mix: recording needs ssm_prev shaped like ssm");
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t b = 0; b < Bs; ++b) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < ssm.size(0) && sp[b] < conv.size(0), "waferline::mamba2_mix: slot out of range");
  }
  auto zx = zxbcdt.contiguous();
  auto cw = conv_w.contiguous();
  auto cb = conv_b.numel() ? conv_b.contiguous() : conv_b;
  auto out = at::empty({Bs, T, Din}, zx.options());
  MambaRecord rec(record, ssm_prev, Bs, T, H, P, G, N, C, K, zx.options());
  auto dtb = dt_bias.contiguous(), Ac = A.contiguous(), Dc = D.contiguous(), nwc = norm_w.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, zx.scalar_type(), "waferline_mamba2_mix", [&] {
    mamba2_rows<scalar_t>(zx.data_ptr<scalar_t>(), conv.data_ptr<scalar_t>(), sp, cw.data_ptr<scalar_t>(),
                          cb.numel() ? cb.data_ptr<scalar_t>() : nullptr, dtb.data_ptr<float>(), Ac.data_ptr<float>(),
                          Dc.data_ptr<float>(), nwc.data_ptr<float>(), ssm.data_ptr<float>(), rec.prev,
                          out.data_ptr<scalar_t>(), rec.dA, rec.dtx, rec.Bm, rec.Cm, static_cast<scalar_t*>(rec.conv),
                          Bs, T, F, Din, C, K, H, P, N, G, static_cast<float>(eps), clamp, static_cast<float>(lo),
                          static_cast<float>(hi));
  });
  rec.out.insert(rec.out.begin(), out);
  return rec.out;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(_OPENMP)
// the Mamba-2 mixer half on one thread team: x + out_proj(mamba2_mix(in_proj(rms(x)))) -> [B, Tn, D]. The products
// split by 16-row tiles (in_proj, then out_proj, all B Tn token rows), the mixer between them (conv, state update,
// gated norm, token after token: mamba2_rows, as mamba2_mix runs it) on one thread of the team; the same functions as
// the composed path, so the same numbers. ``rec`` (a verify's record, MambaRecord): as mamba2_mix's record.
template <typename T, typename S>
at::Tensor mamba_team(const at::Tensor& x, const at::Tensor& mix_norm, double mix_eps, const at::Tensor& in_w,
                      const at::Tensor& in_sz, int64_t in_group, at::Tensor& conv, const at::Tensor& slots,
                      const at::Tensor& conv_w, const at::Tensor& conv_b, const at::Tensor& dt_bias, const at::Tensor& A,
                      const at::Tensor& Dp, const at::Tensor& norm_w, at::Tensor& ssm, int64_t G, double eps, bool clamp,
                      double lo, double hi, const at::Tensor& out_w, const at::Tensor& out_sz, int64_t out_group,
                      MambaRecord& rec) {
  const int64_t B = x.size(0), Tn = x.size(1), BT = B * Tn, Dm = x.size(2), C = conv.size(1), K = conv.size(2) + 1;
  const int64_t H = ssm.size(1), P = ssm.size(2), N = ssm.size(3), Din = H * P;
  const I4W<S> iw = i4w<S>(in_w, in_sz, in_group), ow = i4w<S>(out_w, out_sz, out_group);
  const int64_t F = iw.N;
  struct Bufs {  // kept on this thread from call to call, named by references (as mla_team's are)
    std::vector<T> xn, zx, mixed, o;
    std::vector<float> xf;
    I16Rows x_in, x_out;
  };
  thread_local Bufs bufs;
  auto &xn = bufs.xn, &zx = bufs.zx, &mixed = bufs.mixed, &o = bufs.o;
  auto& xf = bufs.xf;
  auto &x_in = bufs.x_in, &x_out = bufs.x_out;
  at_least(xn, BT * Dm), at_least(zx, BT * F), at_least(mixed, BT * Din), at_least(o, BT * Dm);
  at_least(xf, BT * std::max(Dm, Din));
  const T* xp = x.data_ptr<T>();
  auto h = at::empty(x.sizes(), x.options());  // x + the half's output (residual_cols)
  T* hp = h.data_ptr<T>();
  const T* n1 = mix_norm.data_ptr<T>();
  const int nt = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#pragma omp single
    {
      rms_rows<T>(xp, n1, xn.data(), BT, Dm, static_cast<float>(mix_eps));
      load_f32<T>(xn.data(), xf.data(), BT * Dm);
      x_in.set(xf.data(), BT, Dm, iw.G);
    }
    share_tiles({F}, tid, nth, [&](size_t, int64_t n0, int64_t n1_) { i4_span<T, S>(x_in, iw, zx.data(), F, n0, n1_); });
#pragma omp barrier
#pragma omp single
    {  // (mamba2_rows' head loop runs inline here: at::parallel_for inside a parallel region does)
      mamba2_rows<T>(zx.data(), conv.data_ptr<T>(), slots.data_ptr<int64_t>(), conv_w.data_ptr<T>(),
                     conv_b.numel() ? conv_b.data_ptr<T>() : nullptr, dt_bias.data_ptr<float>(), A.data_ptr<float>(),
                     Dp.data_ptr<float>(), norm_w.data_ptr<float>(), ssm.data_ptr<float>(), rec.prev, mixed.data(),
                     rec.dA, rec.dtx, rec.Bm, rec.Cm, static_cast<T*>(rec.conv), B, Tn, F, Din, C, K, H, P, N, G,
                     static_cast<float>(eps), clamp, static_cast<float>(lo), static_cast<float>(hi));
      load_f32<T>(mixed.data(), xf.data(), BT * Din);
      x_out.set(xf.data(), BT, Din, ow.G);
    }
    share_tiles({Dm}, tid, nth, [&](size_t, int64_t n0, int64_t n1_) {
      i4_span<T, S>(x_out, ow, o.data(), Dm, n0, n1_);
      residual_cols<T>(xp, o.data(), hp, BT, Dm, n0, n1_);
    });
  }
  return h;
}

// whether mamba_team takes this mixer half (else the composed path, which checks and reports bad arguments), and
// its int4 weights' scale dtype
bool mamba_team_fits(const at::Tensor& x, const at::Tensor& mix_norm, const at::Tensor& in_w, const at::Tensor& in_sz,
                     int64_t in_group, const at::Tensor& conv, const at::Tensor& slots, const at::Tensor& conv_w,
                     const at::Tensor& conv_b, const at::Tensor& dt_bias, const at::Tensor& A, const at::Tensor& Dp,
                     const at::Tensor& norm_w, const at::Tensor& ssm, int64_t G, const at::Tensor& out_w,
                     const at::Tensor& out_sz, int64_t out_group, const at::Tensor& ssm_prev, bool record,
                     at::ScalarType& st) {
  const at::ScalarType dt = x.scalar_type();
  st = in_sz.scalar_type();
  if (st != at::kBFloat16 && st != at::kHalf && st != at::kFloat) return false;
  if (conv.dim() != 3 || ssm.dim() != 4 || slots.dim() != 1 || in_w.dim() != 2 || out_w.dim() != 2) return false;
  const int64_t B = x.size(0), Dm = x.size(2), C = conv.size(1), K = conv.size(2) + 1, H = ssm.size(1);
  const int64_t P = ssm.size(2), N = ssm.size(3), Din = H * P, F = in_w.size(0);
  if (B < 1 || B * x.size(1) > INT4_KERNEL_ROWS || G < 1 || H % G != 0 || C != Din + 2 * G * N || F != Din + C + H)
    return false;
  if (record && !(ssm_prev.sizes() == ssm.sizes() && ssm_prev.scalar_type() == at::kFloat && ssm_prev.is_contiguous()))
    return false;
  auto is = [](const at::Tensor& t, at::ScalarType type, int64_t n) {
    return t.scalar_type() == type && t.numel() == n && t.is_contiguous();
  };
  if (!is(mix_norm, dt, Dm) || !is(conv_w, dt, C * K) || !(conv_b.numel() == 0 || is(conv_b, dt, C)) ||
      !is(dt_bias, at::kFloat, H) || !is(A, at::kFloat, H) || !is(Dp, at::kFloat, H) || !is(norm_w, at::kFloat, Din) ||
      conv.scalar_type() != dt || !conv.is_contiguous() || ssm.scalar_type() != at::kFloat || !ssm.is_contiguous() ||
      !is(slots, at::kLong, B))
    return false;
  if (!i4_fits(in_w, in_sz, in_group, F, Dm, st) || !i4_fits(out_w, out_sz, out_group, Dm, Din, st)) return false;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    if (sp[b] < 0 || sp[b] >= ssm.size(0) || sp[b] >= conv.size(0)) return false;
  return true;
}
#endif

// ---------------------------------------------------------------- a decoder layer's decode step, Mamba-2 + FFN
// What DecoderLayer.forward computes for rows of T new tokens each (a decode step: T = 1; a speculative verify: a
// few, with ``record``) when its mixer is a Mamba-2 mixer whose step runs as in_proj -> mamba2_mix -> out_proj with
// int4 projections (Mamba2Mixer's fused path) and its FFN as ffn_residual runs it:
// h = x + out_proj(mamba2_mix(in_proj(rms(x)))); out = h + ffn(rms(h)). The same functions on the same tensors (the
// same numbers), without the Python of the layer, the mixer and the FFN; the conv and SSM states are updated in place
// as mamba2_mix updates them, and with ``record`` ssm_prev and the returned record are what mamba2_mix's record is.
// Returns [out, the experts chosen [B T, k]] and, with ``record``, mamba2_mix's five record tensors.
std::vector<at::Tensor> mamba_ffn_layer(
    const at::Tensor& x, const at::Tensor& mix_norm, double mix_eps, const at::Tensor& in_w, const at::Tensor& in_sz,
    int64_t in_group, at::Tensor& conv, const at::Tensor& slots, const at::Tensor& conv_w, const at::Tensor& conv_b,
    const at::Tensor& dt_bias, const at::Tensor& A, const at::Tensor& D, const at::Tensor& norm_w, at::Tensor& ssm,
    int64_t groups, double eps, bool clamp, double lo, double hi, const at::Tensor& out_w, const at::Tensor& out_sz,
    int64_t out_group, at::Tensor& ssm_prev, bool record, const at::Tensor& ffn_norm, double ffn_eps,
    const at::Tensor& gate_w, const at::Tensor& gate_b, const at::Tensor& corr, int64_t k, bool softmax_scores,
    bool softmax_after_topk, int64_t n_group, int64_t topk_group, bool group_top2, bool norm, double scaling,
    at::TensorList moe_w, int64_t group, int64_t inter, int64_t shared_inter) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "waferline::mamba_ffn_layer: contiguous x [B, T, D]");
  at::Tensor h;
  std::vector<at::Tensor> recorded;
#if defined(__AVX2__) && defined(__FMA__) && defined(_OPENMP)
  at::ScalarType st;
  if (team_on(x) && mamba_team_fits(x, mix_norm, in_w, in_sz, in_group, conv, slots, conv_w, conv_b, dt_bias, A, D,
                                    norm_w, ssm, groups, out_w, out_sz, out_group, ssm_prev, record, st)) {
    MambaRecord rec(record, ssm_prev, x.size(0), x.size(1), ssm.size(1), ssm.size(2), groups, ssm.size(3), conv.size(1),
                    conv.size(2) + 1, x.options());
    h = with_team_types(x.scalar_type(), st, [&](auto t_tag, auto s_tag) {
      return mamba_team<decltype(t_tag), decltype(s_tag)>(x, mix_norm, mix_eps, in_w, in_sz, in_group, conv, slots,
                                                          conv_w, conv_b, dt_bias, A, D, norm_w, ssm, groups, eps, clamp,
                                                          lo, hi, out_w, out_sz, out_group, rec);
    });
    recorded = std::move(rec.out);
    g_team_halves.fetch_add(1, std::memory_order_relaxed);
  }
#endif
  if (!h.defined()) {
    auto zx = int4_linear(rms_norm(x, mix_norm, mix_eps), in_w, in_sz, in_group);
    recorded = mamba2_mix(zx, conv, slots, conv_w, conv_b, dt_bias, A, D, norm_w, ssm, ssm_prev, groups, eps, clamp,
                          lo, hi, record);
    h = x + int4_linear(recorded[0], out_w, out_sz, out_group);
    recorded.erase(recorded.begin());
  }
  auto [out, experts] = ffn_residual(h, ffn_norm, ffn_eps, gate_w, gate_b, corr, k, softmax_scores, softmax_after_topk,
                                     n_group, topk_group, group_top2, norm, scaling, moe_w, group, inter, shared_inter);
  std::vector<at::Tensor> ret{out, experts};
  if (record) ret.insert(ret.end(), recorded.begin(), recorded.end());
  return ret;
}

// ---------------------------------------------------------------- a decode step's ops, replayed from C++
// DecoderModel's step plan (decoder.py, _StepPlan) keeps a step's whole-layer ops (mla_moe_layer, mamba_ffn_layer)
// and their arguments from one step to the next; this holds those arguments here, as the dispatcher's values, and
// runs the ops back to back, each through the dispatcher (callBoxed: what a Python call of the op reaches after its
// arguments are converted, so a dispatch mode, the profiler and the ops' own checks see every op as before), each
// op's first output going into the next one. A decode step's program may also begin with the embedding and end with
// the final norm, the LM head and the argmax (DecoderModel.step_logits). Per step only the per-step tensors (the
// tokens, the rotary rows, caches, slots, positions) come in from Python. It saves, per op, converting its Python
// arguments (~40 for a layer) and the Python between the ops (~15-25 us a layer on a 2-core CPU, where the second
// thread waits for it). The same ops on the same arguments: the same numbers.
struct StepProgram : torch::CustomClassHolder {
  struct Op {
    c10::OperatorHandle op;
    std::vector<c10::IValue> args;  // all its arguments; None where the running tensor and the per-step ones go
    std::vector<int64_t> dyn;       // where the per-step tensors go (ascending)
    int64_t xpos = 0, lead = 1;     // where the running tensor goes; how many outputs lead (the rest: its extras)
    bool keep_input = false;        // return its running input too (the final norm's: the hidden states)
  };
  std::vector<Op> ops;
  int64_t ndyn = 0;

  // op ``name`` ("waferline::mla_moe_layer", "aten::embedding"), its arguments (Python values, converted as the op's
  // schema types them), the per-step positions, the running tensor's position, its leading outputs, whether its
  // running input is returned too
  void add(const std::string& name, std::vector<c10::IValue> args, std::vector<int64_t> dyn, int64_t xpos,
           int64_t lead, bool keep_input) {
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
    const auto& params = op.schema().arguments();
    const int64_t n = static_cast<int64_t>(args.size());
    TORCH_CHECK(args.size() == params.size(), "StepProgram.add: ", name, " takes ", params.size(), " arguments, got ",
                args.size());
    TORCH_CHECK(xpos >= 0 && xpos < n && lead >= 1, "StepProgram.add: bad running-tensor position or lead");
    for (size_t i = 0; i < dyn.size(); ++i)
      TORCH_CHECK(dyn[i] >= 0 && dyn[i] < n && dyn[i] != xpos && (i == 0 || dyn[i] > dyn[i - 1]),
                  "StepProgram.add: per-step positions must be ascending argument positions");
    for (int64_t i = 0; i < n; ++i) {
      if (i == xpos || std::find(dyn.begin(), dyn.end(), i) != dyn.end()) continue;
      const c10::TypePtr& want = params[i].type();
      if (want->kind() == c10::TypeKind::FloatType && args[i].isInt()) args[i] = static_cast<double>(args[i].toInt());
      TORCH_CHECK(args[i].type()->isSubtypeOf(*want), "StepProgram.add: ", name, " argument ", params[i].name(),
                  " wants ", want->repr_str(), ", got ", args[i].type()->repr_str());
    }
    ndyn += static_cast<int64_t>(dyn.size());
    ops.push_back({op, std::move(args), std::move(dyn), xpos, lead, keep_input});
  }

  // x through every op, the per-step tensors in op order -> [[the last op's first output, then the running inputs
  // kept]], followed, when any op returned outputs beyond its leading ones (a Mamba-2 verify's record), by each op's
  // list of those
  std::vector<std::vector<at::Tensor>> run(at::Tensor x, std::vector<at::Tensor> dyn) {
    TORCH_CHECK(static_cast<int64_t>(dyn.size()) == ndyn, "StepProgram.run: ", ndyn, " per-step tensors, got ",
                dyn.size());
    std::vector<std::vector<at::Tensor>> ret(1);
    bool extras = false;
    size_t d = 0;
    torch::jit::Stack stack;
    std::vector<at::Tensor> out, kept;
    for (const Op& o : ops) {
      if (o.keep_input) kept.push_back(x);
      stack.clear();
      stack.reserve(o.args.size());
      size_t k = 0;
      for (size_t i = 0; i < o.args.size(); ++i) {
        if (static_cast<int64_t>(i) == o.xpos) {
          stack.emplace_back(std::move(x));
        } else if (k < o.dyn.size() && o.dyn[k] == static_cast<int64_t>(i)) {
          stack.emplace_back(dyn[d++]);
          ++k;
        } else {
          stack.push_back(o.args[i]);
        }
      }
      o.op.callBoxed(stack);
      out.clear();  // ((Tensor, Tensor) leaves two values, Tensor[] one list)
      for (auto& v : stack) {
        if (v.isTensorList()) {
          for (const at::Tensor& t : v.toTensorList()) out.push_back(t);
        } else {
          out.push_back(v.toTensor());
        }
      }
      TORCH_CHECK(static_cast<int64_t>(out.size()) >= o.lead, "StepProgram.run: ", o.op.schema().name(), " returned ",
                  out.size(), " tensors");
      x = std::move(out[0]);
      ret.emplace_back(out.begin() + o.lead, out.end());
      extras = extras || static_cast<int64_t>(out.size()) > o.lead;
    }
    if (!extras) ret.resize(1);
    ret[0].push_back(std::move(x));
    ret[0].insert(ret[0].end(), kept.begin(), kept.end());
    return ret;
  }
};

}  // namespace

TORCH_LIBRARY(waferline, m) {
  m.class_<StepProgram>("StepProgram")
      .def(torch::init<>())
      .def("add", &StepProgram::add)
      .def("run", &StepProgram::run);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor h) -> Tensor");
  m.def("rope(Tensor x, Tensor cos2, Tensor sin2, int d, bool interleaved) -> Tensor");
  m.def("moe_route(Tensor x, Tensor gate_w, Tensor gate_b, Tensor corr, int k, bool softmax_scores, "
        "bool softmax_after_topk, int n_group, int topk_group, bool group_top2, bool norm, float scaling) -> (Tensor, Tensor)");
  m.def("gqa_decode(Tensor q, Tensor kv, Tensor blocked, Tensor sinks, float scale) -> Tensor");
  m.def("mla_decode(Tensor q_nope, Tensor q_rope, Tensor latents, Tensor blocked, Tensor w_uk, Tensor w_uv, float scale, "
        "ScalarType out_dtype) -> Tensor");
  m.def("mla_attend_int4(Tensor x, Tensor[] w, int[] groups, Tensor qa_norm, Tensor kva_norm, float eps_q, float eps_kv, "
        "Tensor cos2, Tensor sin2, bool interleaved, Tensor(a!) cache, Tensor slots, Tensor pos, Tensor w_uk, "
        "Tensor w_uv, float scale) -> Tensor");
  m.def("ffn_residual(Tensor h, Tensor norm, float eps, Tensor gate_w, Tensor gate_b, Tensor corr, int k, "
        "bool softmax_scores, bool softmax_after_topk, int n_group, int topk_group, bool group_top2, bool norm_topk, "
        "float scaling, Tensor[] moe_w, int group, int inter, int shared_inter) -> (Tensor, Tensor)");
  m.def("mamba_ffn_layer(Tensor x, Tensor mix_norm, float mix_eps, Tensor in_w, Tensor in_sz, int in_group, "
        "Tensor(a!) conv, Tensor slots, Tensor conv_w, Tensor conv_b, Tensor dt_bias, Tensor A, Tensor D, Tensor norm_w, "
        "Tensor(b!) ssm, int groups, float eps, bool clamp, float lo, float hi, Tensor out_w, Tensor out_sz, "
        "int out_group, Tensor(c!) ssm_prev, bool record, Tensor ffn_norm, float ffn_eps, Tensor gate_w, Tensor gate_b, "
        "Tensor corr, int k, bool softmax_scores, bool softmax_after_topk, int n_group, int topk_group, "
        "bool group_top2, bool norm_topk, float scaling, Tensor[] moe_w, int group, int inter, int shared_inter) "
        "-> Tensor[]");
  m.def("mla_moe_layer(Tensor x, Tensor mix_norm, float mix_eps, Tensor[] w, int[] groups, Tensor qa_norm, "
        "Tensor kva_norm, float eps_q, float eps_kv, Tensor cos2, Tensor sin2, bool interleaved, Tensor(a!) cache, "
        "Tensor slots, Tensor pos, Tensor w_uk, Tensor w_uv, float scale, Tensor ffn_norm, float ffn_eps, "
        "Tensor gate_w, Tensor gate_b, Tensor corr, int k, bool softmax_scores, bool softmax_after_topk, int n_group, "
        "int topk_group, bool group_top2, bool norm, float scaling, Tensor[] moe_w, int group, int inter, "
        "int shared_inter) -> (Tensor, Tensor)");
  m.def("gqa_moe_layer(Tensor x, Tensor mix_norm, float mix_eps, Tensor[] w, int[] groups, Tensor q_norm, "
        "Tensor k_norm, float qk_eps, Tensor cos2, Tensor sin2, int rot, bool interleaved, Tensor(a!) cache, "
        "Tensor slots, Tensor pos, Tensor sinks, float scale, int heads, int kv_heads, Tensor ffn_norm, float ffn_eps, "
        "Tensor gate_w, Tensor gate_b, Tensor corr, int k, bool softmax_scores, bool softmax_after_topk, int n_group, "
        "int topk_group, bool group_top2, bool norm, float scaling, Tensor[] moe_w, int group, int inter, "
        "int shared_inter) -> (Tensor, Tensor)");
  m.def("linear_rows(Tensor x, Tensor w) -> Tensor");
  m.def("linear_wide(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, int group) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("i16_rows(Tensor x, int group) -> (Tensor, Tensor, Tensor)");
  m.def("use_portable(bool on) -> bool");
  m.def("use_int_activations(bool on) -> bool");
  m.def("use_bf16_tiles(bool on) -> bool");
  m.def("bf16_tile_copies() -> (int, int)");
  m.def("use_int_tiles(bool on) -> bool");
  m.def("int4_tile_copies() -> (int, int)");
  m.def("int8_tile_copies() -> (int, int)");
  m.def("team_halves() -> int");
  m.def("mamba2_mix(Tensor zxbcdt, Tensor(a!) conv, Tensor slots, Tensor conv_w, Tensor conv_b, Tensor dt_bias, Tensor A, "
        "Tensor D, Tensor norm_w, Tensor(b!) ssm, Tensor(c!) ssm_prev, int groups, float eps, bool clamp, float lo, "
        "float hi, bool record) -> Tensor[]");
  m.def("moe_ffn(Tensor x, Tensor weights, Tensor idx, Tensor gu, Tensor gu_sz, Tensor dn, Tensor dn_sz, Tensor sgu, "
        "Tensor sgu_sz, Tensor sdn, Tensor sdn_sz, int group, int inter, int shared_inter) -> Tensor");
  m.def("ssm_update(Tensor(a!) h, Tensor dA, Tensor dtx, Tensor Bm, Tensor Cm, Tensor(b!) trail) -> Tensor");
}

TORCH_LIBRARY_IMPL(waferline, CompositeExplicitAutograd, m) { m.impl("use_portable", &use_portable);
  m.impl("use_int_activations", &use_int_activations);
  m.impl("use_bf16_tiles", &use_bf16_tiles);
  m.impl("bf16_tile_copies", &bf16_tile_copies);
  m.impl("use_int_tiles", &use_int_tiles);
  m.impl("int4_tile_copies", &int4_tile_copies);
  m.impl("int8_tile_copies", &int8_tile_copies);
  m.impl("team_halves", &team_halves);
}

TORCH_LIBRARY_IMPL(waferline, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
  m.impl("moe_route", &moe_route);
  m.impl("gqa_decode", &gqa_decode);
  m.impl("mla_decode", &mla_decode);
  m.impl("mla_attend_int4", &mla_attend_int4);
  m.impl("mla_moe_layer", &mla_moe_layer);
  m.impl("gqa_moe_layer", &gqa_moe_layer);
  m.impl("ffn_residual", &ffn_residual);
  m.impl("mamba_ffn_layer", &mamba_ffn_layer);
  m.impl("ssm_update", &ssm_update);
  m.impl("linear_rows", &linear_rows);
  m.impl("linear_wide", &linear_wide);
  m.impl("int4_linear", &int4_linear);
  m.impl("i16_rows", &i16_rows);
  m.impl("int8_linear", &int8_linear);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("mamba2_mix", &mamba2_mix);
  m.impl("moe_ffn", &moe_ffn);
}
