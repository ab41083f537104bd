// Multi-head latent attention (MLA), the absorbed decode.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

// ---------------------------------------------------------------- MLA, absorbed decode
// q_nope [B, T, H, n], q_rope [B, T, H, p] (any dtype), latents [B, L, r + p] (the cache: c_KV | k_rope),
// blocked bool [B, T, L] (True = masked) or an empty tensor, w_uk [H, n, r] and w_uv [H, v, r], both fp32 or both
// bf16 (a bf16 model's absorbed weights as it holds them: half the bytes a step reads; each weight row widened to fp32
// once per call, so the numbers are those of their fp32 copies).
// Per (b, t, h), all in fp32: q_lat = q_nope W_UK; s_l = scale (q_lat . c_l + q_rope . k_rope_l); p = softmax(s);
// o = sum_l p_l c_l; out = o W_UV^T -> [B, T, H * v] in ``out_dtype``.
// In three passes: W_UK into every query row (head by head, so each head's W_UK is read once for all rows), then
// attention for blocks of MLA_HEADS heads of one query row at a time (each cache row is loaded once for the block),
// then W_UV (head by head again). One (row, head) at a time would re-read each head's weights per row and each
// cache row per head.
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
// masked: all 0; every unmasked score NaN (a NaN query's: the maximum below skips NaN): all NaN, as softmax gives.
// exp by vexp, vectorised (std::exp is a libm call per score).
inline void mla_softmax(float* s, int64_t L, const bool* mk) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float mx = ninf;
  for (int64_t l = 0; l < L; ++l)
    if (mk && mk[l])
      s[l] = ninf;
    else
      mx = std::max(mx, s[l]);
  if (mx == ninf) {
    bool nan = false;
    for (int64_t l = 0; l < L; ++l) nan = nan || s[l] != s[l];
    for (int64_t l = 0; l < L; ++l) s[l] = nan ? std::numeric_limits<float>::quiet_NaN() : 0.f;
    return;
  }
#pragma omp simd
  for (int64_t l = 0; l < L; ++l) {
    // below e^-87 (~1.6e-38 of the largest): 0 (masked scores, -inf, land here too)
    const float d = s[l] - mx;
    s[l] = d < -87.f ? 0.f : vexp(d);
  }
  const float inv = 1.f / sum_by16(s, L);  // (a row's keys padded with masked ones: the same sum)
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
  TORCH_CHECK(q_nope.dim() == 4 && q_rope.dim() == 4 && latents.dim() == 3 && w_uk.dim() == 3 && w_uv.dim() == 3,
              "waferline::mla_decode: bad ranks");
  TORCH_CHECK(w_uk.scalar_type() == w_uv.scalar_type() &&
                  (w_uk.scalar_type() == at::kFloat || w_uk.scalar_type() == at::kBFloat16),
              "waferline::mla_decode: W_UK/W_UV both fp32 or both bf16");
  const int64_t B = q_nope.size(0), T = q_nope.size(1), H = q_nope.size(2), n = q_nope.size(3), p = q_rope.size(3);
  const int64_t L = latents.size(1), r = w_uk.size(2), v = w_uv.size(1);
  TORCH_CHECK(q_rope.size(0) == B && q_rope.size(1) == T && q_rope.size(2) == H,
              "waferline::mla_decode: q_rope must be [B, T, H, rope] as q_nope is [B, T, H, nope]");
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

}  // namespace
