// Grouped-query attention's decode over the cache rows, and the masked softmax it uses.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

// ---------------------------------------------------------------- attention softmax
// In place over L scores (-inf = masked): p = exp(s - max) / sum, with an optional sink logit (-inf = none) that joins
// the sum and is dropped; a row with every score masked (and no sink) becomes all zeros, one whose unmasked scores are
// all NaN (a NaN query's: the maxima below skip NaN) all NaN, as softmax gives.
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
    bool nan = false;
    for (int64_t l = 0; l < L; ++l) nan = nan || s[l] != s[l];
    std::fill(s, s + L, nan ? std::numeric_limits<float>::quiet_NaN() : 0.f);
    return;
  }
  const float e_sink = sink - mx < -87.f ? 0.f : vexp(sink - mx);  // (vexp, vectorised: std::exp is a libm call)
#pragma omp simd
  for (int64_t l = 0; l < L; ++l) {
    const float d = s[l] - mx;  // below e^-87 of the largest (masked -inf too): 0
    s[l] = d < -87.f ? 0.f : vexp(d);
  }
  const float inv = 1.f / (e_sink + sum_by16(s, L));  // (a row's keys padded with masked ones: the same sum)
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

}  // namespace
