// int4 weights in tiles of 16 outputs (AVX512-VNNI), and the int4 products' entry points.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

#if defined(__AVX2__) && defined(__FMA__)  // (to the #endif after int4_dequant_row_avx2)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define WAFERLINE_INT4_TILES 1
// ---------------------------------------------------------------- int4 weights in tiles of 16 outputs (AVX512-VNNI)
// The integer row kernel (int4.h) sums each weight row across its 8 lanes at the end (a horizontal sum per output
// and row of x), widens every code twice per 64 inputs and multiplies with vpmaddwd + vpaddd (two instructions per 16 products):
// at 8 rows of x it ran at 40-64 G MAC/s on 2 Zen 4 cores, the int4 batch-8 step's ceiling (decode_speed).
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
#if defined(__AVX512F__)
      case 7: return int4_rows_avx2<7, T, S>(xf, q, sz, Z, N, K, G, y, ldy);
      case 8: return int4_rows_avx2<8, T, S>(xf, q, sz, Z, N, K, G, y, ldy);
#else  // 16 vector registers: 7-8 rows' 14-16 accumulators spill (8 rows ran 1.3x the time of two 4-row passes on
       // an AVX2 build); 4 rows, then the rest. A row's sums are its own: the result is bitwise the one-pass kernel's
      case 7:
      case 8:
        int4_rows_avx2<4, T, S>(xf, q, sz, Z, N, K, G, y, ldy);
        if (M == 7) return int4_rows_avx2<3, T, S>(xf + 4 * K, q, sz, Z, N, K, G, y + 4 * ldy, ldy);
        return int4_rows_avx2<4, T, S>(xf + 4 * K, q, sz, Z, N, K, G, y + 4 * ldy, ldy);
#endif
    }
  }
#endif
  int4_rows_generic<T, S>(xf, M, q, sz, Z, N, K, G, y, ldy);
}

// more rows without a tile copy: dequantise once, fp32 GEMM (measured about even with the row kernel at 16 rows)
constexpr int64_t INT4_KERNEL_ROWS = 16;
// bytes of one fp32 slice of a weight dequantised for a many-row product (about half a core's L2 here)
constexpr int64_t INT4_SLICE_BYTES = 256 * 1024;
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
      // fp32 GEMMs over slices of the weight, each dequantised into a buffer that stays in the core's L2 right
      // before its product (a whole dequantised weight is written to memory, then read and packed again by the GEMM)
      auto Xf = X.scalar_type() == at::kFloat ? X : widen(X);
      auto Y = at::empty({R, N}, X.options().dtype(at::kFloat));
      const int64_t NT = std::clamp<int64_t>((INT4_SLICE_BYTES / (4 * K)) / 16 * 16, 16, 512);
      const bool inference = c10::InferenceMode::is_enabled();
      at::parallel_for(0, (N + NT - 1) / NT, 1, [&](int64_t t0, int64_t t1) {
        c10::InferenceMode mode(inference);  // (the pool's threads do not inherit it; Y is an inference tensor)
        auto buf = at::empty({NT, K}, X.options().dtype(at::kFloat));
        float* wp = buf.data_ptr<float>();
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t n0 = t * NT, n = std::min(N, n0 + NT) - n0;
          for (int64_t i = 0; i < n; ++i)
            int4_dequant_row<S>(q + (n0 + i) * (K / 2), sp + (n0 + i) * (K / G) * Z, Z, K, G, wp + i * K);
          auto out = Y.narrow(1, n0, n);
          at::mm_out(out, Xf, buf.narrow(0, 0, n).t());
        }
      });
      y = narrow_to(Y, X.scalar_type());
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

}  // namespace
