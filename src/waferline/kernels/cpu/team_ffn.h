// The FFN half of a decoder layer on one thread team (routed and shared experts, or a dense FFN), and the checks
// that choose a team for each half (else the composed path runs).
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

#if defined(__AVX2__) && defined(__FMA__) && defined(_OPENMP)

// the FFN half: h + ffn(rms(h)) for N = h.numel() / D tokens -> (that, the experts chosen [N, k]). ffn: the routed
// experts (gate_w non-empty: routed by moe_route, each token's top k) and the shared expert (shared_inter > 0), or a
// dense FFN alone (gate_w empty; its weights where the shared expert's go, k = 0). Weights int4 (the integer kernel,
// inputs quantized per row), or with ``dense`` every one bf16 (the few-row bf16 kernel, inputs as they are; MoE blocks).
template <typename T, typename S>
std::tuple<at::Tensor, at::Tensor> ffn_team(const at::Tensor& h, const at::Tensor& ffn_norm, double ffn_eps,
                                            const at::Tensor& gate_w, const at::Tensor& gate_b, const at::Tensor& corr,
                                            int64_t k, bool softmax_scores, bool softmax_after_topk, int64_t n_group,
                                            int64_t topk_group, bool group_top2, bool norm, double scaling,
                                            at::TensorList moe_w, int64_t group, int64_t inter, int64_t shared_inter,
                                            bool dense) {
  const int64_t D = h.size(-1), B = h.numel() / D;
  const T* hp = h.data_ptr<T>();
  auto hn = at::empty({B, D}, h.options());
  rms_rows<T>(hp, ffn_norm.data_ptr<T>(), hn.data_ptr<T>(), B, D, static_cast<float>(ffn_eps));
  const bool routing = gate_w.numel() > 0;
  std::tuple<at::Tensor, at::Tensor> routed;
  if (routing) {
    routed = moe_route(hn, gate_w, gate_b, corr, k, softmax_scores, softmax_after_topk, n_group, topk_group,
                       group_top2, norm, scaling);
  } else {
    routed = {at::empty({B, 0}, h.options().dtype(at::kFloat)), at::empty({B, 0}, h.options().dtype(at::kLong))};
    k = 0;
  }
  const at::Tensor& idx = std::get<1>(routed);
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = std::get<0>(routed).data_ptr<float>();
  // the experts hit, in expert order, then the shared expert: their tokens, weights and buffers (kept on this thread
  // from call to call, as mla_team's are)
  struct Job {
    I4W<S> gu, dn;
    const uint16_t *dgu = nullptr, *ddn = nullptr;  // dense: bf16 gate_up [2I, D] and down [D, I]
    const uint16_t *tgu = nullptr, *tdn = nullptr;  // their tile copies (bf16_tiles), or null
    int64_t I = 0;
    std::vector<int64_t> tok;  // its rows' tokens
    std::vector<float> wt;     // their routing weights
    std::vector<int64_t> row;  // per token, its row here (-1: not routed here)
    const I16Rows* x = nullptr;  // its input rows: every token's (xq) when it takes them all in order, else xg
    const T* xd = nullptr;       // dense: its input rows, hn's when it takes them all in order, else xt's
    I16Rows xg, a;
    std::vector<T> xt, hb, ab, y;  // (dense) its tokens' rows of hn; gate_up out [rows, 2I], silu(gate) * up [rows, I],
                                   // down out [rows, D]
  };
  struct Bufs {
    std::vector<Job> pool;
    std::vector<float> hf;
    I16Rows xq;  // every token's normed input, quantized once (rows are quantized independently)
    std::vector<int64_t> gu_rows, task_job, task_row;
  };
  thread_local Bufs bufs;  // (named by references, as in mla_team)
  auto &pool = bufs.pool, &task_job = bufs.task_job, &task_row = bufs.task_row, &gu_rows = bufs.gu_rows;
  auto& hf = bufs.hf;
  auto& xq = bufs.xq;
  size_t njobs = 0;
  at::Tensor tiles[8];  // the weights' tile copies (bf16_tiles, int4_tiles; held for this call)
  for (int i = 0; i < 8; i += 2)
    tiles[i] = dense ? bf16_tiles(moe_w[i]) : int4_tiles(moe_w[i], moe_w[i + 1], group);
  // a job's two products (gate_up at i, down at i + 2 of moe_w) of expert e (e < 0: not stacked)
  auto add_job = [&](int i, int64_t e, int64_t I) -> Job& {
    if (njobs == pool.size()) pool.emplace_back();
    Job& jb = pool[njobs++];
    jb.tok.clear(), jb.wt.clear();
    jb.I = I;
    if (dense) {
      auto dw = [&](const at::Tensor& w) {
        return reinterpret_cast<const uint16_t*>(w.data_ptr()) + (e >= 0 ? e * w.size(1) * w.size(2) : 0);
      };
      jb.dgu = dw(moe_w[i]), jb.ddn = dw(moe_w[i + 2]);
      jb.tgu = tiles_of(tiles[i], e), jb.tdn = tiles_of(tiles[i + 2], e);
    } else {
      jb.gu = i4w<S>(moe_w[i], moe_w[i + 1], group, e, &tiles[i]);
      jb.dn = i4w<S>(moe_w[i + 2], moe_w[i + 3], group, e, &tiles[i + 2]);
    }
    return jb;
  };
  const int64_t E = routing ? moe_w[0].size(0) : 0;
  for (int64_t pr = 0; pr < B * k; ++pr)
    TORCH_CHECK(ip[pr] >= 0 && ip[pr] < E, "waferline::ffn_residual: expert index ", ip[pr], " out of range");
  for (int64_t e = 0; e < E; ++e) {  // (a scan per expert: B k is at most a few dozen pairs)
    Job* jb = nullptr;
    for (int64_t pr = 0; pr < B * k; ++pr) {
      if (ip[pr] != e) continue;
      if (jb == nullptr) jb = &add_job(0, e, inter);
      jb->tok.push_back(pr / k), jb->wt.push_back(wp[pr]);
    }
  }
  const size_t routed_jobs = njobs;
  if (shared_inter > 0) {
    Job& jb = add_job(4, -1, shared_inter);
    for (int64_t t = 0; t < B; ++t) jb.tok.push_back(t), jb.wt.push_back(1.f);
  }
  Job* jobs = pool.data();
  const T* hnp = hn.data_ptr<T>();
  if (!dense) {
    at_least(hf, B * D);
    load_f32<T>(hnp, hf.data(), B * D);
    xq.set(hf.data(), B, D, group);
  }
  gu_rows.clear(), task_job.clear(), task_row.clear();
  const int64_t ng = dense ? 0 : D / group;  // (dense: no quantized rows)
  for (size_t j = 0; j < njobs; ++j) {
    Job& jb = jobs[j];
    const int64_t M = static_cast<int64_t>(jb.tok.size());
    jb.row.assign(B, -1);
    bool in_order = M == B;
    for (int64_t m = 0; m < M; ++m) {
      jb.row[jb.tok[m]] = m;
      in_order = in_order && jb.tok[m] == m;
      task_job.push_back(static_cast<int64_t>(j)), task_row.push_back(m);
    }
    if (in_order) {
      jb.x = &xq, jb.xd = hnp;
    } else if (dense) {  // its tokens' rows of hn, as moe_ffn gathers them
      at_least(jb.xt, M * D);
      for (int64_t m = 0; m < M; ++m) std::copy(hnp + jb.tok[m] * D, hnp + (jb.tok[m] + 1) * D, jb.xt.begin() + m * D);
      jb.xd = jb.xt.data();
    } else {  // its tokens' rows of xq (the numbers quantizing those rows alone gives)
      jb.xg.resize(M, D, group);
      for (int64_t m = 0; m < M; ++m) {
        const int64_t t = jb.tok[m];
        std::copy(xq.xq.begin() + t * D, xq.xq.begin() + (t + 1) * D, jb.xg.xq.begin() + m * D);
        std::copy(xq.sx.begin() + t * ng, xq.sx.begin() + (t + 1) * ng, jb.xg.sx.begin() + m * ng);
        std::copy(xq.xs.begin() + t * ng, xq.xs.begin() + (t + 1) * ng, jb.xg.xs.begin() + m * ng);
      }
      jb.x = &jb.xg;
    }
    if (!dense) jb.a.resize(M, jb.I, group);
    at_least(jb.hb, M * 2 * jb.I), at_least(jb.ab, M * jb.I), at_least(jb.y, M * D);
    gu_rows.push_back(2 * jb.I);
  }
  auto out = at::empty_like(h);
  T* op = out.data_ptr<T>();
  const int nt = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    share_tiles(gu_rows, tid, nth, [&](size_t j, int64_t n0, int64_t n1_) {
      const Job& jb = jobs[j];
      if (dense) {
        dense_span<T>(jb.xd, static_cast<int64_t>(jb.tok.size()), jb.dgu, jb.tgu, D, jobs[j].hb.data(), 2 * jb.I, n0,
                      n1_);
      } else {
        i4_span<T, S>(*jb.x, jb.gu, jobs[j].hb.data(), 2 * jb.I, n0, n1_);
      }
    });
#pragma omp barrier
    {  // silu(gate) * up per row, and that row as the down product's input
      const auto [i0, i1] = share(static_cast<int64_t>(task_job.size()), tid, nth);
      thread_local std::vector<float> af;  // (each thread's own)
      for (int64_t i = i0; i < i1; ++i) {
        Job& jb = jobs[task_job[i]];
        const int64_t m = task_row[i], I = jb.I;
        silu_mul_rows<T>(jb.hb.data() + m * 2 * I, jb.ab.data() + m * I, 1, I, 2 * I);
        if (dense) continue;  // (the bf16 kernel takes the rows as they are)
        af.resize(I);
        load_f32<T>(jb.ab.data() + m * I, af.data(), I);
        jb.a.set_row(m, af.data());
      }
    }
#pragma omp barrier
    {  // the down products by output rows: this thread's rows of every job, then their sum, shared part, residual
      const auto [t0, t1] = share((D + I16_TILE - 1) / I16_TILE, tid, nth);
      const int64_t d0 = t0 * I16_TILE, d1 = std::min(D, t1 * I16_TILE);
      if (d0 < d1) {
        for (size_t j = 0; j < njobs; ++j) {
          Job& jb = jobs[j];
          if (dense) {
            dense_span<T>(jb.ab.data(), static_cast<int64_t>(jb.tok.size()), jb.ddn, jb.tdn, jb.I, jb.y.data(), D, d0,
                          d1);
          } else {
            i4_span<T, S>(jb.a, jb.dn, jb.y.data(), D, d0, d1);
          }
        }
        // per token, in fp32 chunks of its columns (loops the compiler vectorises; each output's sums in the order
        // and roundings of one column at a time: the routed experts' weighted sum in expert order rounded to T, plus
        // the shared expert's rounded to T, plus h rounded to T)
        constexpr int64_t CH = 256;
        float acc[CH], yb[CH];
        for (int64_t t = 0; t < B; ++t) {
          for (int64_t c0 = d0; c0 < d1; c0 += CH) {
            const int64_t n = std::min(CH, d1 - c0);
            std::fill(acc, acc + n, 0.f);
            for (size_t j = 0; j < routed_jobs; ++j) {
              const int64_t m = jobs[j].row[t];
              if (m < 0) continue;
              const float w = jobs[j].wt[m];
              load_f32<T>(jobs[j].y.data() + m * D + c0, yb, n);
#pragma omp simd
              for (int64_t i = 0; i < n; ++i) acc[i] += yb[i] * w;
            }
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) acc[i] = round_to<T>(acc[i]);
            if (routed_jobs < njobs) {
              load_f32<T>(jobs[njobs - 1].y.data() + t * D + c0, yb, n);
#pragma omp simd
              for (int64_t i = 0; i < n; ++i) acc[i] = round_to<T>(acc[i] + yb[i]);
            }
            load_f32<T>(hp + t * D + c0, yb, n);
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) acc[i] += yb[i];
            store_f32<T>(acc, op + t * D + c0, n);
          }
        }
      }
    }
  }
  return {out, idx};
}

// a team half's rows (one token each): slots and positions int64 [B] inside the cache, no two rows at one slot and
// position (a verify's tokens, as rows, sit at distinct positions); -> the keys' end and whether all share a position
bool team_rows_fit(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos, int64_t B, int64_t& end,
                   bool& uniform) {
  if (slots.scalar_type() != at::kLong || pos.scalar_type() != at::kLong || slots.numel() != B || pos.numel() != B ||
      !slots.is_contiguous() || !pos.is_contiguous())
    return false;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  end = 0, uniform = true;
  for (int64_t b = 0; b < B; ++b) {
    if (sp[b] < 0 || sp[b] >= cache.size(0) || pp[b] < 0 || pp[b] >= cache.size(1)) return false;
    for (int64_t c = 0; c < b; ++c)
      if (sp[c] == sp[b] && pp[c] == pp[b]) return false;
    end = std::max(end, pp[b] + 1);
    uniform = uniform && pp[b] == pp[0];
  }
  return true;
}

// whether mla_team takes this attention block (else the composed path, which checks and reports bad arguments): its
// int4 weights' scale dtype, and the rows' key range and whether they share a position
bool mla_team_fits(const at::Tensor& x, const at::Tensor& mix_norm, at::TensorList w, at::IntArrayRef groups,
                   const at::Tensor& qa_norm, const at::Tensor& kva_norm, const at::Tensor& cos2, const at::Tensor& sin2,
                   const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos, const at::Tensor& w_uk,
                   const at::Tensor& w_uv, at::ScalarType& st, int64_t& end, bool& uniform) {
  if (w.size() != 8 || groups.size() != 4 || w_uk.dim() != 3 || w_uv.dim() != 3 || !w[3].numel()) return false;
  const at::ScalarType dt = x.scalar_type();
  st = w[3].scalar_type();
  if (st != at::kBFloat16 && st != at::kHalf && st != at::kFloat) return false;
  const int64_t B = x.size(0), D = x.size(2), H = w_uk.size(0), n = w_uk.size(1), r = w_uk.size(2), v = w_uv.size(1);
  const at::ScalarType wt = w_uk.scalar_type();
  if (B < 1 || (wt != at::kFloat && wt != at::kBFloat16) || w_uv.scalar_type() != wt || !w_uk.is_contiguous() ||
      !w_uv.is_contiguous() || w_uv.size(0) != H || w_uv.size(2) != r)
    return false;
  if (cache.dim() != 3 || cache.scalar_type() != dt || !cache.is_contiguous() || cache.size(2) <= r) return false;
  const int64_t p = cache.size(2) - r;
  if (p % 2 || cos2.scalar_type() != at::kFloat || sin2.scalar_type() != at::kFloat || !cos2.is_contiguous() ||
      !sin2.is_contiguous() || cos2.numel() != B * p || sin2.numel() != B * p)
    return false;
  const bool lora = w[0].numel() > 0;
  const int64_t Nqa = lora ? w[0].size(0) : 0;
  auto normed = [&](const at::Tensor& t, int64_t len) { return t.scalar_type() == dt && t.numel() == len && t.is_contiguous(); };
  if (!normed(mix_norm, D) || !normed(kva_norm, r) || (lora && !normed(qa_norm, Nqa))) return false;
  if ((lora && !i4_fits(w[0], w[1], groups[0], Nqa, D, st)) ||
      !i4_fits(w[2], w[3], groups[1], H * (n + p), lora ? Nqa : D, st) ||
      !i4_fits(w[4], w[5], groups[2], r + p, D, st) || !i4_fits(w[6], w[7], groups[3], D, H * v, st))
    return false;
  return team_rows_fit(cache, slots, pos, B, end, uniform);
}

// whether ffn_team takes this FFN (else the composed path): routed experts [E, 2I, D] / [E, D, I] (gate_w non-empty)
// and a shared expert [2S, D] / [D, S] (shared_inter > 0), or the dense FFN alone, all int4 with scales of dtype st
bool ffn_team_fits(const at::Tensor& h, const at::Tensor& ffn_norm, const at::Tensor& gate_w, at::TensorList moe_w,
                   int64_t group, int64_t inter, int64_t shared_inter, at::ScalarType st) {
  if (moe_w.size() != 8 || !h.is_contiguous() || h.dim() < 2) return false;
  const int64_t D = h.size(-1);
  if (D < 1 || h.numel() / D > INT4_KERNEL_ROWS) return false;  // more rows: int4_mm's GEMM path (other numbers)
  if (ffn_norm.scalar_type() != h.scalar_type() || ffn_norm.numel() != D || !ffn_norm.is_contiguous()) return false;
  if (st != at::kBFloat16 && st != at::kHalf && st != at::kFloat) return false;
  if (gate_w.numel() > 0) {
    const int64_t E = moe_w[0].dim() == 3 ? moe_w[0].size(0) : 0;
    if (E < 1 || inter < 1 || gate_w.dim() != 2 || gate_w.size(0) != E || !i4_fits(moe_w[0], moe_w[1], group, 2 * inter, D, st, E) ||
        !i4_fits(moe_w[2], moe_w[3], group, D, inter, st, E))
      return false;
  } else if (shared_inter < 1) {
    return false;
  }
  return shared_inter < 1 || (i4_fits(moe_w[4], moe_w[5], group, 2 * shared_inter, D, st) &&
                              i4_fits(moe_w[6], moe_w[7], group, D, shared_inter, st));
}

// whether ffn_team takes this FFN with dense weights: a MoE block (routed experts, a shared one or none), bf16 h of at
// most FEW_ROWS rows (the composed path's products run few_rows then, the same kernel) and every weight bf16 with no
// scales, on a CPU with the AVX512-BF16 kernel. A dense FFN keeps the composed path: on Llama-type layers the team was
// level in one process and 0.85x in decode_ab.py's separate ones, where MoE blocks gained 1.05-1.15x.
bool ffn_team_dense_fits(const at::Tensor& h, const at::Tensor& ffn_norm, const at::Tensor& gate_w, at::TensorList moe_w,
                         int64_t inter, int64_t shared_inter) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (moe_w.size() != 8 || !h.is_contiguous() || h.dim() < 2 || h.scalar_type() != at::kBFloat16) return false;
  const int64_t D = h.size(-1);
  if (D < 1 || h.numel() / D > FEW_ROWS) return false;
  if (ffn_norm.scalar_type() != h.scalar_type() || ffn_norm.numel() != D || !ffn_norm.is_contiguous()) return false;
  auto fits = [](const at::Tensor& w, const at::Tensor& sz, int64_t N, int64_t K, int64_t E) {
    return sz.numel() == 0 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
           (E ? w.dim() == 3 && w.size(0) == E && w.size(1) == N && w.size(2) == K
              : w.dim() == 2 && w.size(0) == N && w.size(1) == K);
  };
  if (gate_w.numel() == 0)  // a dense FFN alone (its weights where the shared expert's go)
    return shared_inter >= 1 && fits(moe_w[4], moe_w[5], 2 * shared_inter, D, 0) &&
           fits(moe_w[6], moe_w[7], D, shared_inter, 0);
  const int64_t E = moe_w[0].dim() == 3 ? moe_w[0].size(0) : 0;
  if (E < 1 || inter < 1 || gate_w.dim() != 2 || gate_w.size(0) != E ||
      !fits(moe_w[0], moe_w[1], 2 * inter, D, E) || !fits(moe_w[2], moe_w[3], D, inter, E))
    return false;
  return shared_inter < 1 ||
         (fits(moe_w[4], moe_w[5], 2 * shared_inter, D, 0) && fits(moe_w[6], moe_w[7], D, shared_inter, 0));
#else
  return false;
#endif
}

// whether gqa_team takes this attention half (else gqa_attend, which checks and reports bad arguments): one token a
// row, the four projections all int4 on the integer kernel's groups (scales of dtype st) or (``dense``) all bf16 with
// at most FEW_ROWS rows on an AVX512-BF16 CPU (as ffn_team_dense_fits); -> the keys' end, whether rows share a position
bool gqa_team_fits(const at::Tensor& x, const at::Tensor& mix_norm, at::TensorList w, at::IntArrayRef groups,
                   const at::Tensor& q_norm, const at::Tensor& k_norm, const at::Tensor& cos2, const at::Tensor& sin2,
                   int64_t rot, const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos,
                   const at::Tensor& sinks, int64_t H, int64_t Hkv, at::ScalarType& st, bool& dense, int64_t& end,
                   bool& uniform) {
  if (w.size() != 8 || groups.size() != 4 || x.dim() != 3 || x.size(1) != 1 || !x.is_contiguous()) return false;
  const at::ScalarType dt = x.scalar_type();
  const int64_t B = x.size(0), D = x.size(2);
  if (B < 1 || H < 1 || Hkv < 1 || H % Hkv != 0) return false;
  if (cache.dim() != 3 || cache.scalar_type() != dt || !cache.is_contiguous() || cache.size(2) % (2 * Hkv) != 0 ||
      cache.size(2) == 0)
    return false;
  const int64_t hd = cache.size(2) / (2 * Hkv), Nq = H * hd, Nkv = Hkv * hd;
  auto normed = [&](const at::Tensor& t, int64_t len) { return t.scalar_type() == dt && t.numel() == len && t.is_contiguous(); };
  if (!normed(mix_norm, D) || ((q_norm.numel() || k_norm.numel()) && !(normed(q_norm, hd) && normed(k_norm, hd))))
    return false;
  if (rot != 0 && (rot < 0 || rot % 2 != 0 || rot > hd || cos2.scalar_type() != at::kFloat ||
                   sin2.scalar_type() != at::kFloat || !cos2.is_contiguous() || !sin2.is_contiguous() ||
                   cos2.numel() != B * rot || sin2.numel() != B * rot))
    return false;
  if (sinks.numel() && (sinks.scalar_type() != at::kFloat || sinks.numel() != H || !sinks.is_contiguous())) return false;
  const int n_int4 = (w[1].numel() > 0) + (w[3].numel() > 0) + (w[5].numel() > 0) + (w[7].numel() > 0);
  if (n_int4 == 4) {
    dense = false, st = w[1].scalar_type();
    if (st != at::kBFloat16 && st != at::kHalf && st != at::kFloat) return false;
    if (!i4_fits(w[0], w[1], groups[0], Nq, D, st) || !i4_fits(w[2], w[3], groups[1], Nkv, D, st) ||
        !i4_fits(w[4], w[5], groups[2], Nkv, D, st) || !i4_fits(w[6], w[7], groups[3], D, Nq, st))
      return false;
  } else if (n_int4 == 0) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    dense = true, st = at::kBFloat16;
    auto fits = [](const at::Tensor& t, int64_t N, int64_t K) {
      return t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == 2 && t.size(0) == N && t.size(1) == K;
    };
    if (dt != at::kBFloat16 || B > FEW_ROWS || !fits(w[0], Nq, D) || !fits(w[2], Nkv, D) || !fits(w[4], Nkv, D) ||
        !fits(w[6], D, Nq))
      return false;
#else
    return false;
#endif
  } else {
    return false;
  }
  return team_rows_fit(cache, slots, pos, B, end, uniform);
}

// f(T tag, S tag) for activations of dtype dt (bf16 / fp16) and int4 scales of dtype st
template <typename F>
auto with_team_types(at::ScalarType dt, at::ScalarType st, F&& f) {
  auto with_s = [&](auto t_tag) {
    switch (st) {
      case at::kBFloat16: return f(t_tag, c10::BFloat16());
      case at::kHalf: return f(t_tag, c10::Half());
      default: return f(t_tag, 0.f);
    }
  };
  return dt == at::kBFloat16 ? with_s(c10::BFloat16()) : with_s(c10::Half());
}

// the team path's common conditions: the integer int4 kernel on (AVX2, not forced portable), 16-bit activations
bool team_on(const at::Tensor& x) {
  return !g_portable.load(std::memory_order_relaxed) && g_int_act.load(std::memory_order_relaxed) &&
         (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
}
#endif

}  // namespace
