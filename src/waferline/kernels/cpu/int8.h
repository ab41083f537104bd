// The int8 LM head: 16-bit-integer row kernel, tiles of 16 outputs, and its entry point.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

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
// The int8 head in tiles of 16 outputs (as int4_tiles.h's): per tile, K / 2 steps of 32 bytes (byte 2 j + u:
// output j's weight at input 2 s + u; widened to 16-bit lanes, the pairs (2 s, 2 s + 1) of the 16 outputs)
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
  if (K == 0) return y.zero_();  // (empty sums)
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

}  // namespace
