// waferline's fused CPU operators for the decode step (torch.ops.waferline.*).
//
// Why: a batch-1 decode step of a small MoE is ~1,100 eager aten ops of 2-4 us each; the weights' GEMVs are already
// near one core's memory bandwidth, so the ops around them are what is left to cut. Each operator here replaces a
// chain of eager ops with one call and computes what that chain computes (same dtypes, fp32 where it is fp32, the
// same rounding points to 16 bits); tests/test_kernels.py checks each against the eager path.
//
// Plain C++ loops the compiler vectorises (-O3, `omp simd` reductions); no intrinsics, so any CPU with a C++ compiler
// builds it. Sums of products run in a different order than ATen's, so results agree to float rounding, not bitwise.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

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
// h [..., 2F] = [gate | up] -> [..., F]; silu is rounded to the dtype before the multiply, as the eager chain does.
template <typename T>
void silu_mul_rows(const T* h, T* y, int64_t rows, int64_t F) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(F, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = h + r * 2 * F;
      const T* u = g + F;
      T* o = y + r * F;
      for (int64_t i = 0; i < F; ++i) {
        float a = f32(g[i]);
        T s = static_cast<T>(a / (1.f + std::exp(-a)));
        o[i] = static_cast<T>(f32(s) * f32(u[i]));
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
    silu_mul_rows<scalar_t>(hc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, F2 / 2);
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

// ---------------------------------------------------------------- MLA, absorbed decode
// q_nope [B, T, H, n], q_rope [B, T, H, p] (any dtype), latents [B, L, r + p] (the cache: c_KV | k_rope),
// blocked bool [B, T, L] (True = masked) or an empty tensor, w_uk [H, n, r] and w_uv [H, v, r] fp32.
// Per (b, t, h), all in fp32: q_lat = q_nope W_UK; s_l = scale (q_lat . c_l + q_rope . k_rope_l); p = softmax(s);
// o = sum_l p_l c_l; out = o W_UV^T -> [B, T, H * v] in ``out_dtype``.
template <typename C>
void mla_rows(const float* qn, const float* qr, const C* lat, const bool* blocked, const float* wuk, const float* wuv,
              float* out, int64_t B, int64_t T, int64_t H, int64_t n, int64_t p, int64_t r, int64_t v, int64_t L,
              float scale) {
  const int64_t R = r + p;
  const float ninf = -std::numeric_limits<float>::infinity();
  // one (sequence, token) per task: its cache rows are read once for all heads
  at::parallel_for(0, B * T, std::max<int64_t>(1, 65536 / std::max<int64_t>(L * R * H, 1)), [&](int64_t i0, int64_t i1) {
    std::vector<float> ql(H * r), sc(H * L), ol(H * r), c(R);
    for (int64_t bt = i0; bt < i1; ++bt) {
      const int64_t b = bt / T;
      for (int64_t h = 0; h < H; ++h) {  // absorb W_UK into the query
        const float* q = qn + (bt * H + h) * n;
        const float* wk = wuk + h * n * r;
        float* qh = ql.data() + h * r;
        for (int64_t j = 0; j < r; ++j) qh[j] = 0.f;
        for (int64_t k = 0; k < n; ++k) {
          const float qk = q[k];
          const float* row = wk + k * r;
          for (int64_t j = 0; j < r; ++j) qh[j] += qk * row[j];
        }
      }
      const C* lb = lat + b * L * R;
      const bool* mk = blocked ? blocked + bt * L : nullptr;
      for (int64_t l = 0; l < L; ++l) {  // scores
        if (mk && mk[l]) {
          for (int64_t h = 0; h < H; ++h) sc[h * L + l] = ninf;
          continue;
        }
        for (int64_t j = 0; j < R; ++j) c[j] = f32(lb[l * R + j]);
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = ql.data() + h * r;
          const float* qrp = qr + (bt * H + h) * p;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t j = 0; j < r; ++j) s += qh[j] * c[j];
          float s2 = 0.f;
#pragma omp simd reduction(+ : s2)
          for (int64_t j = 0; j < p; ++j) s2 += qrp[j] * c[r + j];
          sc[h * L + l] = (s + s2) * scale;
        }
      }
      for (int64_t h = 0; h < H; ++h) {  // softmax per head
        float* sh = sc.data() + h * L;
        float mx = ninf;
        for (int64_t l = 0; l < L; ++l) mx = std::max(mx, sh[l]);
        float den = 0.f;
        for (int64_t l = 0; l < L; ++l) {
          const float e = sh[l] == ninf ? 0.f : std::exp(sh[l] - mx);
          sh[l] = e;
          den += e;
        }
        const float inv = den > 0.f ? 1.f / den : 0.f;
        for (int64_t l = 0; l < L; ++l) sh[l] *= inv;
      }
      for (int64_t j = 0; j < H * r; ++j) ol[j] = 0.f;
      for (int64_t l = 0; l < L; ++l) {  // probabilities x latents
        if (mk && mk[l]) continue;
        for (int64_t j = 0; j < r; ++j) c[j] = f32(lb[l * R + j]);
        for (int64_t h = 0; h < H; ++h) {
          const float pl = sc[h * L + l];
          float* oh = ol.data() + h * r;
          for (int64_t j = 0; j < r; ++j) oh[j] += pl * c[j];
        }
      }
      for (int64_t h = 0; h < H; ++h) {  // W_UV after attention
        const float* oh = ol.data() + h * r;
        const float* wv = wuv + h * v * r;
        float* o = out + (bt * H + h) * v;
        for (int64_t k = 0; k < v; ++k) {
          const float* row = wv + k * r;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t j = 0; j < r; ++j) s += oh[j] * row[j];
          o[k] = s;
        }
      }
    }
  });
}

at::Tensor mla_decode(const at::Tensor& q_nope, const at::Tensor& q_rope, const at::Tensor& latents,
                      const at::Tensor& blocked, const at::Tensor& w_uk, const at::Tensor& w_uv, double scale,
                      at::ScalarType out_dtype) {
  TORCH_CHECK(q_nope.dim() == 4 && q_rope.dim() == 4 && latents.dim() == 3, "waferline::mla_decode: bad ranks");
  TORCH_CHECK(w_uk.scalar_type() == at::kFloat && w_uv.scalar_type() == at::kFloat, "waferline::mla_decode: fp32 W_UK/W_UV");
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
  auto lat = latents.contiguous();
  auto mk = has_mask ? blocked.contiguous() : blocked;
  auto wk = w_uk.contiguous();
  auto wv = w_uv.contiguous();
  auto out = at::empty({B, T, H * v}, qn.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, lat.scalar_type(), "waferline_mla_decode", [&] {
    mla_rows<scalar_t>(qn.data_ptr<float>(), qr.data_ptr<float>(), lat.data_ptr<scalar_t>(),
                       has_mask ? mk.data_ptr<bool>() : nullptr, wk.data_ptr<float>(), wv.data_ptr<float>(),
                       out.data_ptr<float>(), B, T, H, n, p, r, v, L, static_cast<float>(scale));
  });
  return out_dtype == at::kFloat ? out : out.to(out_dtype);
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
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < N; ++k) {
            const float v = hs[k] * a + x * Bv[k];
            hs[k] = v;
            acc += v * Cv[k];
          }
          y[(bt * H + hd) * P + pp] = acc;
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

}  // namespace

TORCH_LIBRARY(waferline, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor h) -> Tensor");
  m.def("rope(Tensor x, Tensor cos2, Tensor sin2, int d, bool interleaved) -> Tensor");
  m.def("mla_decode(Tensor q_nope, Tensor q_rope, Tensor latents, Tensor blocked, Tensor w_uk, Tensor w_uv, float scale, "
        "ScalarType out_dtype) -> Tensor");
  m.def("ssm_update(Tensor(a!) h, Tensor dA, Tensor dtx, Tensor Bm, Tensor Cm, Tensor(b!) trail) -> Tensor");
}

TORCH_LIBRARY_IMPL(waferline, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
  m.impl("mla_decode", &mla_decode);
  m.impl("ssm_update", &ssm_update);
}
