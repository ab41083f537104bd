// RMSNorm, SwiGLU's silu(gate) * up, rotary embedding and the MoE router.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

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
inline float silu1(float x) { return x / (1.f + vexp(-x)); }

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

}  // namespace
