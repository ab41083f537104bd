// Whole decoder layers' decode steps (attention or MLA + FFN) as one call each.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

// ---------------------------------------------------------------- a decoder layer's FFN half, decode and verify
// What DecoderLayer.forward computes after its mixer when its FFN is a MoE block that runs as moe_route + moe_ffn
// (gate_w non-empty) or a dense SwiGLU FFN of int4 weights (gate_w empty; its gate_up / down where the shared expert's
// go, shared_inter its width): h + ffn(rms(h)) for the N tokens of h [..., D]; with the experts chosen [N, k]
// (k = 0 for a dense FFN). On one thread team when the weights fit the integer int4 kernel, else the same operators
// composed (moe_route, moe_ffn; for a dense FFN the gated product moe_ffn's shared expert runs). The same numbers.
std::tuple<at::Tensor, at::Tensor> ffn_residual(const at::Tensor& h, const at::Tensor& ffn_norm, double ffn_eps,
                                                const at::Tensor& gate_w, const at::Tensor& gate_b,
                                                const at::Tensor& corr, int64_t k, bool softmax_scores,
                                                bool softmax_after_topk, int64_t n_group, int64_t topk_group,
                                                bool group_top2, bool norm, double scaling, at::TensorList moe_w,
                                                int64_t group, int64_t inter, int64_t shared_inter) {
  TORCH_CHECK(moe_w.size() == 8, "waferline::ffn_residual: 8 FFN weights (gate_up, down, shared gate_up, shared "
              "down, each with its scales)");
  TORCH_CHECK(h.device().is_cpu() && h.dim() >= 2 && h.is_contiguous(), "waferline::ffn_residual: contiguous CPU h [..., D]");
  const int64_t D = h.size(-1), N = h.numel() / std::max<int64_t>(D, 1);
#if defined(__AVX2__) && defined(__FMA__) && defined(_OPENMP)
  const at::ScalarType st = moe_w[5].numel() ? moe_w[5].scalar_type() : moe_w[1].scalar_type();
  bool dense = false;
  if (team_on(h) && (ffn_team_fits(h, ffn_norm, gate_w, moe_w, group, inter, shared_inter, st) ||
                     (dense = ffn_team_dense_fits(h, ffn_norm, gate_w, moe_w, inter, shared_inter)))) {
    g_team_halves.fetch_add(1, std::memory_order_relaxed);
    return with_team_types(h.scalar_type(), st, [&](auto t_tag, auto s_tag) {
      return ffn_team<decltype(t_tag), decltype(s_tag)>(h, ffn_norm, ffn_eps, gate_w, gate_b, corr, k, softmax_scores,
                                                        softmax_after_topk, n_group, topk_group, group_top2, norm,
                                                        scaling, moe_w, group, inter, shared_inter, dense);
    });
  }
#endif
  auto hn = rms_norm(h, ffn_norm, ffn_eps).view({N, D});
  if (gate_w.numel() > 0) {
    auto routed = moe_route(hn, gate_w, gate_b, corr, k, softmax_scores, softmax_after_topk, n_group, topk_group,
                            group_top2, norm, scaling);
    auto m = moe_ffn(hn.contiguous(), std::get<0>(routed), std::get<1>(routed), moe_w[0], moe_w[1], moe_w[2],
                     moe_w[3], moe_w[4], moe_w[5], moe_w[6], moe_w[7], group, inter, shared_inter);
    return {h + m.view(h.sizes()), std::get<1>(routed)};
  }
  TORCH_CHECK(shared_inter > 0 && moe_w[4].numel() && moe_w[6].numel(),
              "waferline::ffn_residual: a dense FFN (no gate) needs its gate_up and down weights");
  Bundle gu{moe_w[4], moe_w[5], group}, dn{moe_w[6], moe_w[7], group};
  for (const Bundle* b : {&gu, &dn}) {
    TORCH_CHECK(b->int4() ? int4_shaped(b->w, b->sz, group, b->w.size(0), b->w.size(1) * 2)
                          : b->w.scalar_type() == h.scalar_type() && b->w.is_contiguous() && b->w.dim() == 2,
                "waferline::ffn_residual: dense FFN weights are int4 (waferline's layout) or of h's dtype");
  }
  TORCH_CHECK(gu.w.size(0) == 2 * shared_inter && dn.w.size(0) == D, "waferline::ffn_residual: gate_up [2S, D], down [D, S]");
  at::Tensor m;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "waferline_ffn_residual", [&] {
    m = gated_ffn<scalar_t>(hn.contiguous(), gu, dn, -1, shared_inter, D);
  });
  return {h + m.view(h.sizes()), at::empty({N, 0}, h.options().dtype(at::kLong))};
}

// A decoder layer's decode step with GQA attention as one call: h = x + gqa(rms(x)); out = h + ffn(rms(h)), the FFN
// as ffn_residual runs it. Returns (out, the experts chosen [B T, k]), as mla_moe_layer does. The attention half on a
// thread team (gqa_team) where its products fit one, else composed (gqa_attend): the same numbers.
std::tuple<at::Tensor, at::Tensor> gqa_moe_layer(
    const at::Tensor& x, const at::Tensor& mix_norm, double mix_eps, at::TensorList w, at::IntArrayRef groups,
    const at::Tensor& q_norm, const at::Tensor& k_norm, double qk_eps, const at::Tensor& cos2, const at::Tensor& sin2,
    int64_t rot, bool interleaved, at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos,
    const at::Tensor& sinks, double scale, int64_t heads, int64_t kv_heads, const at::Tensor& ffn_norm,
    double ffn_eps, const at::Tensor& gate_w, const at::Tensor& gate_b, const at::Tensor& corr, int64_t k,
    bool softmax_scores, bool softmax_after_topk, int64_t n_group, int64_t topk_group, bool group_top2, bool norm,
    double scaling, at::TensorList moe_w, int64_t group, int64_t inter, int64_t shared_inter) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "waferline::gqa_moe_layer: contiguous x [B, T, D]");
  const at::Tensor xr = x.view({-1, 1, x.size(2)});  // the tokens as rows (slots, pos, cos2, sin2: one per token)
  at::Tensor h;
#if defined(__AVX2__) && defined(__FMA__) && defined(_OPENMP)
  at::ScalarType st;
  bool dense = false, uniform = true;
  int64_t end = 0;
  if (team_on(xr) && gqa_team_fits(xr, mix_norm, w, groups, q_norm, k_norm, cos2, sin2, rot, cache, slots, pos, sinks,
                                   heads, kv_heads, st, dense, end, uniform)) {
    h = with_team_types(x.scalar_type(), st, [&](auto t_tag, auto s_tag) {
      return gqa_team<decltype(t_tag), decltype(s_tag)>(xr, mix_norm, mix_eps, w, groups, q_norm, k_norm, qk_eps, cos2,
                                                        sin2, rot, interleaved, cache, slots.data_ptr<int64_t>(),
                                                        pos.data_ptr<int64_t>(), end, uniform, sinks, scale, heads,
                                                        kv_heads, dense);
    });
    g_team_halves.fetch_add(1, std::memory_order_relaxed);
  }
#endif
  if (!h.defined()) {
    h = xr + gqa_attend(rms_norm(xr, mix_norm, mix_eps), w, groups, q_norm, k_norm, qk_eps, cos2, sin2, rot,
                        interleaved, cache, slots, pos, sinks, scale, heads, kv_heads);
  }
  return ffn_residual(h.view(x.sizes()), ffn_norm, ffn_eps, gate_w, gate_b, corr, k, softmax_scores,
                      softmax_after_topk, n_group, topk_group, group_top2, norm, scaling, moe_w, group, inter,
                      shared_inter);
}

// ---------------------------------------------------------------- a decoder layer's decode step, MLA + FFN
// What DecoderLayer.forward computes for rows of T new tokens each (a decode step, T = 1, or a speculative verify's
// few; the attention takes the B T tokens as rows, each with its slot and position) when its mixer runs as
// mla_attend_int4 and its FFN as ffn_residual does: h = x + mla(rms(x)); out = h + ffn(rms(h)). The same functions
// in the same order on the same tensors (the same numbers); it saves the Python of the layer, its two norms, the
// attention block and the FFN and their ~10 op calls between them. On two thread teams (attention, FFN) when the weights fit the integer int4 kernel.
// Returns (out, the experts chosen [B T, k]: what an op counter needs to price the expert products).
std::tuple<at::Tensor, at::Tensor> mla_moe_layer(const at::Tensor& x, const at::Tensor& mix_norm, double mix_eps, at::TensorList w,
                         at::IntArrayRef groups, const at::Tensor& qa_norm, const at::Tensor& kva_norm, double eps_q,
                         double eps_kv, const at::Tensor& cos2, const at::Tensor& sin2, bool interleaved,
                         at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos, const at::Tensor& w_uk,
                         const at::Tensor& w_uv, double scale, const at::Tensor& ffn_norm, double ffn_eps,
                         const at::Tensor& gate_w, const at::Tensor& gate_b, const at::Tensor& corr, int64_t k,
                         bool softmax_scores, bool softmax_after_topk, int64_t n_group, int64_t topk_group,
                         bool group_top2, bool norm, double scaling, at::TensorList moe_w, int64_t group, int64_t inter,
                         int64_t shared_inter) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "waferline::mla_moe_layer: contiguous x [B, T, D]");
  const at::Tensor xr = x.view({-1, 1, x.size(2)});  // the tokens as rows (slots, pos, cos2, sin2: one per token)
  at::Tensor h;
#if defined(__AVX2__) && defined(__FMA__) && defined(_OPENMP)
  at::ScalarType st;
  int64_t end = 0;
  bool uniform = true;
  if (team_on(xr) && mla_team_fits(xr, mix_norm, w, groups, qa_norm, kva_norm, cos2, sin2, cache, slots, pos, w_uk, w_uv,
                                   st, end, uniform)) {
    h = with_team_types(x.scalar_type(), st, [&](auto t_tag, auto s_tag) {
      return mla_team<decltype(t_tag), decltype(s_tag)>(xr, mix_norm, mix_eps, w, groups, qa_norm, kva_norm, eps_q, eps_kv,
                                                        cos2, sin2, interleaved, cache, slots.data_ptr<int64_t>(),
                                                        pos.data_ptr<int64_t>(), end, uniform, w_uk, w_uv, scale);
    });
    g_team_halves.fetch_add(1, std::memory_order_relaxed);
  }
#endif
  if (!h.defined()) {
    h = xr + mla_attend_int4(rms_norm(xr, mix_norm, mix_eps), w, groups, qa_norm, kva_norm, eps_q, eps_kv, cos2, sin2,
                             interleaved, cache, slots, pos, w_uk, w_uv, scale);
  }
  h = h.view(x.sizes());
  return ffn_residual(h, ffn_norm, ffn_eps, gate_w, gate_b, corr, k, softmax_scores, softmax_after_topk, n_group,
                      topk_group, group_top2, norm, scaling, moe_w, group, inter, shared_inter);
}

}  // namespace
