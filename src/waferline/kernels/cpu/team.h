// A decoder layer's halves on one OpenMP thread team each: the shared pieces and the attention halves (MLA, GQA);
// team_ffn.h has the FFN half and the checks that choose each half's team.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

// ---------------------------------------------------------------- a decoder layer's decode step, one thread team
// The same layer (layers.h: mla_moe_layer) with its work split over one OpenMP team per half (attention, then
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
#endif

}  // namespace
