// The MLA and GQA attention blocks, one decode token per row: projections, norms, rotary, the
// cache write and the attention as one call each.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

// ---------------------------------------------------------------- what both blocks share
// A step's rows in a token cache [slots, capacity, W] (one new token per row): each row's slot and position checked,
// the keys' end (max position + 1), whether the slots are consecutive (the keys a view) and the positions one (no mask)
struct CacheRows {
  at::Tensor sl, ps;
  const int64_t* sp = nullptr;
  const int64_t* pp = nullptr;
  int64_t B = 0, end = 0;
  bool consecutive = true, uniform = true;
  CacheRows(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos, int64_t rows, const char* op)
      : B(rows) {
    TORCH_CHECK(slots.scalar_type() == at::kLong && pos.scalar_type() == at::kLong && slots.numel() == B &&
                    pos.numel() == B, op, ": slots and pos are int64 [B]");
    sl = slots.contiguous(), ps = pos.contiguous();
    sp = sl.data_ptr<int64_t>(), pp = ps.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(sp[b] >= 0 && sp[b] < cache.size(0) && pp[b] >= 0 && pp[b] < cache.size(1), op,
                  ": slot or position outside the cache");
      end = std::max(end, pp[b] + 1);
      consecutive = consecutive && sp[b] == sp[0] + b;
      uniform = uniform && pp[b] == pp[0];
    }
  }
  // this step's entries: the parts' rows ([B, ...] each, B = rows, the cache's dtype) side by side, in order, make a
  // row's W values, copied straight into the cache (its callers check it contiguous and of x's dtype): one memcpy a
  // part and row instead of a cat and B dispatched copies (~0.05 ms a layer at 8 rows)
  void write(at::Tensor& cache, std::initializer_list<at::Tensor> parts) const {
    const int64_t W = cache.size(2), cap = cache.size(1), es = cache.element_size();
    TORCH_CHECK(cache.is_contiguous(), "waferline: the cache must be contiguous");
    char* base = static_cast<char*>(cache.data_ptr());
    int64_t off = 0;
    for (const auto& t : parts) {
      TORCH_CHECK(t.scalar_type() == cache.scalar_type(), "waferline: a cache entry of another dtype than the cache");
      const auto tc = t.contiguous();
      const int64_t w = tc.numel() / std::max<int64_t>(B, 1);
      TORCH_CHECK(off + w <= W, "waferline: cache entries wider than the cache's ", W, " values");
      const char* src = static_cast<const char*>(tc.data_ptr());
      for (int64_t b = 0; b < B; ++b) std::memcpy(base + ((sp[b] * cap + pp[b]) * W + off) * es, src + b * w * es, w * es);
      off += w;
    }
    TORCH_CHECK(off == W, "waferline: a cache entry of ", off, " values, the cache holds ", W);
    if (!cache.is_inference()) cache.unsafeGetTensorImpl()->bump_version();  // (as the dispatched copies would)
  }
  at::Tensor keys(const at::Tensor& cache) const {  // [B, end, W]: the rows' slots, positions 0..end-1
    return consecutive ? cache.narrow(0, sp[0], B).narrow(1, 0, end) : cache.index_select(0, sl).narrow(1, 0, end);
  }
  at::Tensor blocked(const at::TensorOptions& o) const {  // rows at different positions: each sees its own keys only
    if (uniform) return at::empty({0}, o.dtype(at::kBool));
    return at::arange(end, o.dtype(at::kLong)).view({1, 1, end}) > ps.view({B, 1, 1});
  }
};

// a block's projection: an int4 weight (scales non-empty) or a dense 16-bit one of up to FEW_ROWS rows
at::Tensor block_proj(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sz, int64_t group) {
  return sz.numel() ? int4_linear(x, w, sz, group) : linear_rows(x, w);
}

// ---------------------------------------------------------------- MLA attention block, one decode token per row
// What MLAttention.forward computes for rows of one new token each when every projection is an int4 weight in
// waferline's layout (no biases), as one call: q = q_b(rms(q_a(x))) (or q_proj(x) without a q LoRA), ckv = kv_a(x),
// c = rms(ckv[:r]), the rope part of q and ckv's rope key rotated together, [c | k_rope] written into ``cache`` at
// (slots[b], pos[b]), mla_decode over keys 0..max(pos) (keys past a row's own position masked when rows differ),
// then o_proj. Rows may share a slot at distinct positions (a speculative verify's T tokens as T rows: each sees
// the entries the earlier ones wrote). The same operators as the eager chain, in the same order, on the same
// tensors: the same numbers. It saves the
// ~30 eager ops and the Python between them (per layer ~0.1-0.2 ms of a ~6 ms step of the 135M dsv3).
// w: packed / scales of q_a, q_b, kv_a, o (q_a's both empty: q_b is q_proj); groups: their group sizes. A projection
// may instead be a dense 16-bit weight [out, in] with empty scales (a bf16 model's, for rows of up to FEW_ROWS):
// linear_rows then multiplies it, as Linear does for such rows.
at::Tensor mla_attend_int4(const at::Tensor& x, at::TensorList w, at::IntArrayRef groups, const at::Tensor& qa_norm,
                           const at::Tensor& kva_norm, double eps_q, double eps_kv, const at::Tensor& cos2,
                           const at::Tensor& sin2, bool interleaved, at::Tensor& cache, const at::Tensor& slots,
                           const at::Tensor& pos, const at::Tensor& w_uk, const at::Tensor& w_uv, double scale) {
  TORCH_CHECK(w.size() == 8 && groups.size() == 4,
              "waferline::mla_attend_int4: 4 weights (int4 packed and scales, or dense and empty) and 4 groups");
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1, "waferline::mla_attend_int4: x must be [B, 1, D]");
  TORCH_CHECK(cache.dim() == 3 && cache.scalar_type() == x.scalar_type() && cache.is_contiguous(),
              "waferline::mla_attend_int4: cache must be a contiguous [slots, capacity, r + rope] tensor of x's dtype");
  const int64_t B = x.size(0), H = w_uk.size(0), n = w_uk.size(1), r = w_uk.size(2), R = cache.size(2), p = R - r;
  const CacheRows rows(cache, slots, pos, B, "waferline::mla_attend_int4");
  at::Tensor q;
  if (w[0].numel()) {
    q = block_proj(rms_norm(block_proj(x, w[0], w[1], groups[0]), qa_norm, eps_q), w[2], w[3], groups[1]);
  } else {
    q = block_proj(x, w[2], w[3], groups[1]);
  }
  TORCH_CHECK(q.size(-1) == H * (n + p), "waferline::mla_attend_int4: q has ", q.size(-1),
              " outputs, want H (nope + rope)");
  q = q.view({B, 1, H, n + p});
  auto ckv = block_proj(x, w[4], w[5], groups[2]);  // [B, 1, r + rope]
  auto c = rms_norm(ckv.narrow(-1, 0, r), kva_norm, eps_kv);
  auto roped = rope(at::cat({q.narrow(-1, n, p), ckv.narrow(-1, r, p).unsqueeze(2)}, 2), cos2, sin2, p, interleaved);
  rows.write(cache, {c, roped.select(2, H)});  // [B, 1, r] and [B, 1, rope]: this token's cache entry
  auto out = mla_decode(q.narrow(-1, 0, n), roped.narrow(2, 0, H), rows.keys(cache), rows.blocked(x.options()), w_uk,
                        w_uv, scale, x.scalar_type());
  return block_proj(out, w[6], w[7], groups[3]);
}

// ---------------------------------------------------------------- GQA attention block, one decode token per row
// What GQAttention.forward computes for rows of one new token each (a decode step; a verify's tokens as rows, as
// mla_attend_int4 takes them) with a full-attention cache and no biases, as one call: q, k, v = the projections of x
// (block_proj: int4, or dense bf16 with empty scales), the q and k RMSNorms over the head dim (empty weights: none),
// the first ``rot`` channels of q and k rotated together (rope; rot 0: none), [k | v] written into ``cache`` [slots,
// capacity, 2 Hkv hd] at (slots[b], pos[b]), gqa_decode over keys 0..max(pos) (keys past a row's own position masked
// when rows differ; ``sinks`` fp32 [H] or empty), then o_proj. The same operators on the same tensors, in the same
// order, as the modules run: the same numbers. w: q, k, v, o (weight, scales); groups: their group sizes.
at::Tensor gqa_attend(const at::Tensor& x, at::TensorList w, at::IntArrayRef groups, const at::Tensor& q_norm,
                      const at::Tensor& k_norm, double qk_eps, const at::Tensor& cos2, const at::Tensor& sin2,
                      int64_t rot, bool interleaved, at::Tensor& cache, const at::Tensor& slots, const at::Tensor& pos,
                      const at::Tensor& sinks, double scale, int64_t H, int64_t Hkv) {
  TORCH_CHECK(w.size() == 8 && groups.size() == 4, "waferline::gqa_moe_layer: 4 weights (int4 packed and scales, or "
              "dense and empty) and 4 groups");
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1, "waferline::gqa_moe_layer: x must be [B, 1, D]");
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && cache.dim() == 3 && cache.scalar_type() == x.scalar_type() &&
                  cache.is_contiguous() && cache.size(2) % (2 * Hkv) == 0,
              "waferline::gqa_moe_layer: cache must be a contiguous [slots, capacity, 2 Hkv hd] tensor of x's dtype");
  const int64_t B = x.size(0), hd = cache.size(2) / (2 * Hkv);
  const CacheRows rows(cache, slots, pos, B, "waferline::gqa_moe_layer");
  auto q = block_proj(x, w[0], w[1], groups[0]);
  auto k = block_proj(x, w[2], w[3], groups[1]);
  auto v = block_proj(x, w[4], w[5], groups[2]);
  TORCH_CHECK(q.size(-1) == H * hd && k.size(-1) == Hkv * hd && v.size(-1) == Hkv * hd,
              "waferline::gqa_moe_layer: q / k / v widths must be H hd / Hkv hd / Hkv hd");
  q = q.view({B, 1, H, hd});
  k = k.view({B, 1, Hkv, hd});
  v = v.view({B, 1, Hkv, hd});
  if (q_norm.numel()) q = rms_norm(q, q_norm, qk_eps), k = rms_norm(k, k_norm, qk_eps);
  if (rot) {
    auto qk = rope(at::cat({q, k}, 2), cos2, sin2, rot, interleaved);
    q = qk.narrow(2, 0, H), k = qk.narrow(2, H, Hkv);
  }
  rows.write(cache, {k, v});  // [B, 1, Hkv, hd] each: this token's cache entry
  auto out = gqa_decode(q, rows.keys(cache).reshape({B, rows.end, 2 * Hkv, hd}), rows.blocked(x.options()), sinks,
                        scale);
  return block_proj(out.reshape({B, 1, H * hd}), w[6], w[7], groups[3]);
}

}  // namespace
