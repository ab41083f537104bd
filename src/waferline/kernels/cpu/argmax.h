// Greedy sampling: the first index of each row's largest value.
// Part of cpu_ops.cpp's single translation unit: included there in order, after the parts it uses.

#pragma once

namespace {

// ---------------------------------------------------------------- greedy sampling
// the index of the first largest value of x[0..n) (a NaN counts as larger than any number: its first index), what
// torch.argmax returns. ATen's reduction took ~35 us for a 32000-token vocabulary on a 2-core AVX2 CPU (~1% of a
// small model's decode step); this is one vector pass for the largest value and one for its first index.
inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
#if defined(__AVX2__)
  __m256 mv = _mm256_set1_ps(m), nan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mv = _mm256_max_ps(mv, v);
  }
  if (_mm256_movemask_ps(nan)) {
    for (int64_t k = 0; k < n; ++k)
      if (std::isnan(x[k])) return k;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (float v : lanes) m = std::max(m, v);
#endif
  for (int64_t k = i; k < n; ++k) {
    if (std::isnan(x[k])) {
      for (int64_t j = 0; j <= k; ++j)
        if (std::isnan(x[j])) return j;
    }
    m = std::max(m, x[k]);
  }
  int64_t k = 0;
#if defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(m);
  for (; k + 8 <= n; k += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + k), target, _CMP_EQ_OQ));
    if (hit) return k + __builtin_ctz(hit);
  }
#endif
  for (; k < n; ++k)
    if (x[k] == m) return k;
  return 0;  // (unreachable: m is one of the values)
}

// argmax over the last dimension of fp32 logits [..., V] -> int64 [...]
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() >= 1 &&
                  logits.size(-1) > 0, "waferline::argmax_rows: fp32 CPU logits [..., V] with V > 0");
  auto x = logits.contiguous();
  const int64_t V = x.size(-1), rows = x.numel() / V;
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto out = at::empty(sizes, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 18) / V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

}  // namespace
