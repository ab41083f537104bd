// Few-row 16-bit products (y = x W^T for up to 8 rows), the bf16 tile copies and the cache of
// tile copies every weight kind shares.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

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
// the decode-step work bought").
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

// the kinds of tile copy (bf16_tiles; int4_tiles and int8_tiles: int4_tiles.h, int8.h)
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
  if (K == 0) return at::zeros(sizes, xc.options());  // (empty sums)
  auto y = at::empty(sizes, xc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "waferline_linear_rows", [&] {
    if (!few_rows_tiled<scalar_t>(wc, -1, xc.data_ptr<scalar_t>(), M, N, K, y.data_ptr<scalar_t>(), N))
      few_rows<scalar_t>(xc.data_ptr<scalar_t>(), M, wc.data_ptr<scalar_t>(), N, K, y.data_ptr<scalar_t>(), N);
  });
  return y;
}

}  // namespace
