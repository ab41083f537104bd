// Mamba-2: the state update, the mixer between its projections, its thread-team half and its layer.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

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

}  // namespace
