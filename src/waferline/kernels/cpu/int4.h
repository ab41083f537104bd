// int4 weights (W4A16) in waferline's layout: the fp32 and 16-bit-integer row kernels.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

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

// NR weight rows at a time, straight through, into NR x M x 2 accumulators. Every output of every row of x is summed
// the same way whatever M and NR: two chains (a half block's vectors 0, 2 and 1, 3), blocks in order, the chains
// added at the end, so a row's result does not depend on the rows beside it (a decode step's row equals that
// sequence decoded alone). NR = 2 for one row gives it four independent chains (FMA latency), as M >= 2 rows have.
template <int M, int NR, typename T, typename S>
void int4_block_avx2(const float* xf, const uint8_t* q, const S* sz, int64_t Z, int64_t K, int64_t G, T* y,
                     int64_t ldy, int64_t n0, int64_t n1) {
  const Int4Widen wd;
  const int64_t ng = K / G, K64 = K / INT4_BLOCK * INT4_BLOCK;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    __m256 acc[NR][M][2];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) acc[r][m][0] = acc[r][m][1] = _mm256_setzero_ps();
    __m256 sl[NR], zl[NR], sh[NR], zh[NR];
    for (int64_t k0 = 0; k0 < K64; k0 += INT4_BLOCK) {
      for (int r = 0; r < NR; ++r) {
        const S* sr = sz + (n + r) * ng * Z;
        // (a group of an odd number of 32s, 96 or 160, starts mid-block: the next block's low half is its group)
        if (k0 % G == 0) int4_scale(sr, Z, k0 / G, sl[r], zl[r]);
        else if (k0 % G == 32) sl[r] = sh[r], zl[r] = zh[r];
        if ((k0 + 32) % G == 0) int4_scale(sr, Z, (k0 + 32) / G, sh[r], zh[r]);
        else if (k0 % G == 0) sh[r] = sl[r], zh[r] = zl[r];
        // one nibble half at a time (4 weight vectors live, not 8: with 8 rows' accumulators that spilled)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (n + r) * (K / 2) + k0 / 2));
        for (int h = 0; h < 2; ++h) {
          __m256 w[4];
          wd.half(_mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, wd.low4), h ? sh[r] : sl[r], h ? zh[r] : zl[r], w);
          for (int t = 0; t < 4; ++t)
            for (int m = 0; m < M; ++m)
              acc[r][m][t % 2] =
                  _mm256_fmadd_ps(w[t], _mm256_loadu_ps(xf + m * K + k0 + 32 * h + 8 * t), acc[r][m][t % 2]);
        }
      }
    }
    if (K64 < K) {
      for (int r = 0; r < NR; ++r) {
        int4_scale(sz + (n + r) * ng * Z, Z, K64 / G, sl[r], zl[r]);
        __m256 w[4];
        wd.tail(q + (n + r) * (K / 2) + K64 / 2, sl[r], zl[r], w);
        for (int t = 0; t < 4; ++t)
          for (int m = 0; m < M; ++m)
            acc[r][m][t % 2] = _mm256_fmadd_ps(w[t], _mm256_loadu_ps(xf + m * K + K64 + 8 * t), acc[r][m][t % 2]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) y[m * ldy + n + r] = static_cast<T>(hsum8(_mm256_add_ps(acc[r][m][0], acc[r][m][1])));
  }
  if constexpr (NR > 1)
    if (n < n1) int4_block_avx2<M, 1, T, S>(xf, q, sz, Z, K, G, y, ldy, n, n1);  // (an odd last weight row)
}

template <int M, typename T, typename S>
void int4_rows_avx2(const float* xf, const uint8_t* q, const S* sz, int64_t Z, int64_t N, int64_t K, int64_t G, T* y,
                    int64_t ldy) {
  at::parallel_for(0, N, std::max<int64_t>(16, 16384 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    int4_block_avx2<M, M == 1 ? 2 : 1, T, S>(xf, q, sz, Z, K, G, y, ldy, n0, n1);
  });
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
// (what std::max(mx, |x|) gives: max is exact, and a NaN is skipped the same way; a group holding a NaN or an infinity
// is fixed16_inv's: sx = sx * sum xi = NaN, xi = 0), x * inv rounded to nearest even
// (the default mode, nearbyint's) and clamped to +-32767, narrowed, and put in lane order by one permute per 32. The
// scalar loop took ~2% of a 1-thread llama int4 batch-8 step (its max does not vectorise: fp max is not reassociated)
inline void i16_quantize_avx512(const float* xf, int64_t M, int64_t K, int64_t G, int16_t* xq, float* sx, float* xs) {
  const int64_t ng = K / G;
  const __m512i lo_idx = _mm512_load_si512(kI16LaneOrder.idx), hi_idx = _mm512_load_si512(kI16LaneOrder.idx + 32);
  const __m512i top = _mm512_set1_epi32(32767), bottom = _mm512_set1_epi32(-32767);
  const __m512 top_f = _mm512_set1_ps(std::numeric_limits<float>::max());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      const float* x = xf + m * K + g * G;
      __m512 mv = _mm512_setzero_ps();
      __mmask16 bad = 0;  // lanes that saw a NaN or an infinity (|x| > FLT_MAX, unordered)
      for (int64_t k = 0; k < G; k += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + k));
        mv = _mm512_max_ps(a, mv);
        bad |= _mm512_cmp_ps_mask(a, top_f, _CMP_NLE_UQ);
      }
      int16_t* out = xq + m * K + g * G;
      if (bad) {  // (fixed16_inv's: sx NaN, xi 0)
        std::fill(out, out + G, int16_t(0));
        sx[m * ng + g] = xs[m * ng + g] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float mx = _mm512_reduce_max_ps(mv);
      float s;
      const __m512 inv = _mm512_set1_ps(fixed16_scale(mx, &s));  // (fixed16_inv's)
      __m512i sum = _mm512_setzero_si512();
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
// 0-10% on 768-input rows). (A prefetch past the weight's end is harmless: it never faults.)
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
#endif  // AVX2 + FMA (the 16-bit-integer kernels go on in int4_tiles.h)

}  // namespace
