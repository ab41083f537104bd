// The MoE FFN after the router: routed experts and the shared expert as one call.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

// ---------------------------------------------------------------- MoE FFN (routed experts + shared expert)
// The decode step's MoE block after the router, as one call: for each expert hit by the (token, expert) pairs
// ``idx [N, k]`` its tokens' rows go through gate_up [2I, D], silu(gate) * up, down [D, I] (each product rounded to
// x's dtype, as the eager chain's are), and are summed into fp32 weighted by ``weights [N, k]``; the sum is rounded to
// x's dtype and the shared expert's output (gate_up [2S, D], down [D, S]; S = 0: none) added, rounded again.
// A weight is either dense (x's dtype; ``[E, out, in]`` for the experts, ``[out, in]`` for the shared one) or int4
// in waferline's layout (``sz`` non-empty: packed uint8 [E, out, in / 2] and scales [E, out, in / group, 1 or 2], as
// int4_linear takes them), multiplied by int4_mm. Dense products of up to 8 rows run few_rows, larger groups of rows
// ATen's mm.
struct Bundle {
  const at::Tensor& w;
  const at::Tensor& sz;
  int64_t group;
  bool int4() const { return sz.numel() > 0; }
};

// rows X [R, K] (contiguous) through weight b (expert e, or e < 0: b is not stacked) -> [R, n_out] (row stride >= n_out)
at::Tensor bundle_linear(const at::Tensor& X, const Bundle& b, int64_t e, int64_t n_out) {
  if (b.int4()) {
    const auto tiles = int4_int_rows(X) ? int4_tiles(b.w, b.sz, b.group) : at::Tensor();
    return int4_mm(X, e >= 0 ? b.w.select(0, e) : b.w, e >= 0 ? b.sz.select(0, e) : b.sz, b.group,
                   int4_tiles_of(tiles, b.w, e));
  }
  const int64_t R = X.size(0), K = X.size(1);
  auto W = e >= 0 ? b.w.select(0, e) : b.w;
  if (R > FEW_ROWS) return mm_rows(X, W);
  auto y = at::empty({R, n_out}, X.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, X.scalar_type(), "waferline_moe_linear", [&] {
    if (!few_rows_tiled<scalar_t>(e >= 0 ? b.w : W, e, X.data_ptr<scalar_t>(), R, n_out, K, y.data_ptr<scalar_t>(),
                                  n_out))
      few_rows<scalar_t>(X.data_ptr<scalar_t>(), R, W.data_ptr<scalar_t>(), n_out, K, y.data_ptr<scalar_t>(), n_out);
  });
  return y;
}

template <typename T>
at::Tensor gated_ffn(const at::Tensor& X, const Bundle& gu, const Bundle& dn, int64_t e, int64_t I, int64_t D) {
  auto h = bundle_linear(X, gu, e, 2 * I);  // [R, 2I], row stride h.stride(0)
  auto a = at::empty({X.size(0), I}, X.options());
  silu_mul_rows<T>(h.data_ptr<T>(), a.data_ptr<T>(), X.size(0), I, h.stride(0));
  return bundle_linear(a, dn, e, D);
}

// per expert, the (token * k + slot) pairs of idx [N, k] routed to it, in token order
std::vector<std::vector<int64_t>> expert_pairs(const int64_t* ip, int64_t pairs, int64_t E) {
  std::vector<std::vector<int64_t>> out(E);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ip[p] >= 0 && ip[p] < E, "waferline::moe_ffn: expert index ", ip[p], " out of range");
    out[ip[p]].push_back(p);
  }
  return out;
}

template <typename T>
at::Tensor moe_ffn_impl(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& idx, const Bundle& gu,
                        const Bundle& dn, const Bundle& sgu, const Bundle& sdn, int64_t I, int64_t S) {
  const int64_t N = x.size(0), D = x.size(1), k = idx.size(1), E = gu.w.size(0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = weights.data_ptr<float>();
  const auto pairs = expert_pairs(ip, N * k, E);
  auto acc = at::zeros({N, D}, x.options().dtype(at::kFloat));
  float* ap = acc.data_ptr<float>();
  const T* xp = x.data_ptr<T>();
  for (int64_t e = 0; e < E; ++e) {
    const auto& ps = pairs[e];
    if (ps.empty()) continue;
    const int64_t R = static_cast<int64_t>(ps.size());
    at::Tensor xs;
    if (N == 1 && R == 1) {  // (one token, once: an expert twice in its row takes two rows, gathered below)
      xs = x;
    } else {
      xs = at::empty({R, D}, x.options());
      T* dst = xs.data_ptr<T>();
      for (int64_t r = 0; r < R; ++r) std::copy(xp + (ps[r] / k) * D, xp + (ps[r] / k + 1) * D, dst + r * D);
    }
    at::Tensor o = gated_ffn<T>(xs, gu, dn, e, I, D);
    const T* op = o.data_ptr<T>();
    const int64_t ldo = o.stride(0);
    for (int64_t r = 0; r < R; ++r) {
      float* dst = ap + (ps[r] / k) * D;
      const float wt = wp[ps[r]];
      const T* src = op + r * ldo;
      for (int64_t j = 0; j < D; ++j) dst[j] += f32(src[j]) * wt;
    }
  }
  auto y = acc.to(x.scalar_type());
  if (S > 0) {
    at::Tensor s = gated_ffn<T>(x, sgu, sdn, -1, S, D);
    T* yp = y.data_ptr<T>();
    const T* sp = s.data_ptr<T>();
    const int64_t lds = s.stride(0);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t j = 0; j < D; ++j) yp[t * D + j] = static_cast<T>(f32(yp[t * D + j]) + f32(sp[t * lds + j]));
  }
  return y;
}

at::Tensor moe_ffn(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& idx, const at::Tensor& gu,
                   const at::Tensor& gu_sz, const at::Tensor& dn, const at::Tensor& dn_sz, const at::Tensor& sgu,
                   const at::Tensor& sgu_sz, const at::Tensor& sdn, const at::Tensor& sdn_sz, int64_t group,
                   int64_t inter, int64_t shared_inter) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "waferline::moe_ffn: contiguous CPU x [N, D]");
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == x.size(0) && idx.scalar_type() == at::kLong && idx.is_contiguous() &&
                  weights.sizes() == idx.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "waferline::moe_ffn: weights fp32 and idx int64, both [N, k] and contiguous");
  Bundle b_gu{gu, gu_sz, group}, b_dn{dn, dn_sz, group}, b_sgu{sgu, sgu_sz, group}, b_sdn{sdn, sdn_sz, group};
  for (const Bundle* b : {&b_gu, &b_dn, &b_sgu, &b_sdn}) {
    if (b->int4()) {
      TORCH_CHECK(b->w.scalar_type() == at::kByte && b->w.is_contiguous() && b->sz.is_contiguous(),
                  "waferline::moe_ffn: int4 weights are contiguous uint8 codes with contiguous scales");
    } else if (b->w.numel()) {
      TORCH_CHECK(b->w.scalar_type() == x.scalar_type() && b->w.is_contiguous(),
                  "waferline::moe_ffn: dense weights must be contiguous and of x's dtype");
    }
  }
  // every weight's shape (no product may read past a weight): dense [(E,) out, in]; int4 codes [(E,) out, in / 2] and
  // scales [(E,) out, in / G, 1 or 2]
  const int64_t D = x.size(1), E = gu.dim() ? gu.size(0) : 0;
  auto shaped = [&](const Bundle& b, bool stacked, int64_t out, int64_t in) {
    const at::Tensor& t = b.int4() ? b.sz : b.w;
    const int64_t lead = stacked ? 1 : 0;
    if (stacked && (t.dim() < 1 || t.size(0) != E || b.w.size(0) != E)) return false;
    if (b.int4())
      return int4_shaped(stacked ? b.w.select(0, 0) : b.w, stacked ? b.sz.select(0, 0) : b.sz, b.group, out, in);
    return t.dim() == 2 + lead && t.size(lead) == out && t.size(lead + 1) == in;
  };
  TORCH_CHECK(E > 0 && inter > 0 && shaped(b_gu, true, 2 * inter, D) && shaped(b_dn, true, D, inter),
              "waferline::moe_ffn: experts must be gate_up [E, 2I, D] and down [E, D, I] (or their int4 layouts)");
  TORCH_CHECK(shared_inter == 0 || (shaped(b_sgu, false, 2 * shared_inter, D) && shaped(b_sdn, false, D, shared_inter)),
              "waferline::moe_ffn: the shared expert must be gate_up [2S, D] and down [D, S] (or their int4 layouts)");
  at::Tensor y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "waferline_moe_ffn", [&] {
    y = moe_ffn_impl<scalar_t>(x, weights, idx, b_gu, b_dn, b_sgu, b_sdn, inter, shared_inter);
  });
  return y;
}

}  // namespace
