// waferline's fused CPU operators for the decode step (torch.ops.waferline.*).
//
// Why: a batch-1 decode step of a small MoE is ~1,100 eager aten ops of 2-4 us each; the weights' GEMVs are already
// near one core's memory bandwidth, so the ops around them are what is left to cut. Each operator here replaces a
// chain of eager ops with one call and computes what that chain computes (same dtypes, fp32 where it is fp32, the
// same rounding points to 16 bits); tests/test_kernels.py and tests/test_kernel_layers.py check each against the
// eager path.
//
// Plain C++ loops the compiler vectorises (-O3, `omp simd` reductions), so any CPU with a C++ compiler builds it; the
// exceptions, the few-row bf16 product (AVX512-BF16 intrinsics where the CPU has them, AVX2 + FMA ones where it has
// those) and the int4 and int8 products (AVX2 + FMA; tile copies with AVX512-VNNI), have a portable loop beside them
// for other CPUs. Built with OpenMP, so at::parallel_for splits work across torch's threads (torch.set_num_threads).
// Sums of products run in a different order than ATen's, so results agree to float rounding, not bitwise.
//
// The operators live in cpu/*.h, one file per family, compiled here as one translation unit (the parts are
// included in order; each uses the ones before it); this file registers them.

#include "cpu/common.h"
#include "cpu/elementwise.h"
#include "cpu/linear_bf16.h"
#include "cpu/int4.h"
#include "cpu/int4_tiles.h"
#include "cpu/int8.h"
#include "cpu/argmax.h"
#include "cpu/moe_ffn.h"
#include "cpu/gqa.h"
#include "cpu/mla.h"
#include "cpu/attention_blocks.h"
#include "cpu/team.h"
#include "cpu/team_ffn.h"
#include "cpu/layers.h"
#include "cpu/mamba.h"
#include "cpu/program.h"

TORCH_LIBRARY(waferline, m) {
  m.class_<StepProgram>("StepProgram")
      .def(torch::init<>())
      .def("add", &StepProgram::add)
      .def("run", &StepProgram::run);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor h) -> Tensor");
  m.def("rope(Tensor x, Tensor cos2, Tensor sin2, int d, bool interleaved) -> Tensor");
  m.def("moe_route(Tensor x, Tensor gate_w, Tensor gate_b, Tensor corr, int k, bool softmax_scores, "
        "bool softmax_after_topk, int n_group, int topk_group, bool group_top2, bool norm, float scaling) -> (Tensor, Tensor)");
  m.def("gqa_decode(Tensor q, Tensor kv, Tensor blocked, Tensor sinks, float scale) -> Tensor");
  m.def("mla_decode(Tensor q_nope, Tensor q_rope, Tensor latents, Tensor blocked, Tensor w_uk, Tensor w_uv, float scale, "
        "ScalarType out_dtype) -> Tensor");
  m.def("mla_attend_int4(Tensor x, Tensor[] w, int[] groups, Tensor qa_norm, Tensor kva_norm, float eps_q, float eps_kv, "
        "Tensor cos2, Tensor sin2, bool interleaved, Tensor(a!) cache, Tensor slots, Tensor pos, Tensor w_uk, "
        "Tensor w_uv, float scale) -> Tensor");
  m.def("ffn_residual(Tensor h, Tensor norm, float eps, Tensor gate_w, Tensor gate_b, Tensor corr, int k, "
        "bool softmax_scores, bool softmax_after_topk, int n_group, int topk_group, bool group_top2, bool norm_topk, "
        "float scaling, Tensor[] moe_w, int group, int inter, int shared_inter) -> (Tensor, Tensor)");
  m.def("mamba_ffn_layer(Tensor x, Tensor mix_norm, float mix_eps, Tensor in_w, Tensor in_sz, int in_group, "
        "Tensor(a!) conv, Tensor slots, Tensor conv_w, Tensor conv_b, Tensor dt_bias, Tensor A, Tensor D, Tensor norm_w, "
        "Tensor(b!) ssm, int groups, float eps, bool clamp, float lo, float hi, Tensor out_w, Tensor out_sz, "
        "int out_group, Tensor(c!) ssm_prev, bool record, Tensor ffn_norm, float ffn_eps, Tensor gate_w, Tensor gate_b, "
        "Tensor corr, int k, bool softmax_scores, bool softmax_after_topk, int n_group, int topk_group, "
        "bool group_top2, bool norm_topk, float scaling, Tensor[] moe_w, int group, int inter, int shared_inter) "
        "-> Tensor[]");
  m.def("mla_moe_layer(Tensor x, Tensor mix_norm, float mix_eps, Tensor[] w, int[] groups, Tensor qa_norm, "
        "Tensor kva_norm, float eps_q, float eps_kv, Tensor cos2, Tensor sin2, bool interleaved, Tensor(a!) cache, "
        "Tensor slots, Tensor pos, Tensor w_uk, Tensor w_uv, float scale, Tensor ffn_norm, float ffn_eps, "
        "Tensor gate_w, Tensor gate_b, Tensor corr, int k, bool softmax_scores, bool softmax_after_topk, int n_group, "
        "int topk_group, bool group_top2, bool norm, float scaling, Tensor[] moe_w, int group, int inter, "
        "int shared_inter) -> (Tensor, Tensor)");
  m.def("gqa_moe_layer(Tensor x, Tensor mix_norm, float mix_eps, Tensor[] w, int[] groups, Tensor q_norm, "
        "Tensor k_norm, float qk_eps, Tensor cos2, Tensor sin2, int rot, bool interleaved, Tensor(a!) cache, "
        "Tensor slots, Tensor pos, Tensor sinks, float scale, int heads, int kv_heads, Tensor ffn_norm, float ffn_eps, "
        "Tensor gate_w, Tensor gate_b, Tensor corr, int k, bool softmax_scores, bool softmax_after_topk, int n_group, "
        "int topk_group, bool group_top2, bool norm, float scaling, Tensor[] moe_w, int group, int inter, "
        "int shared_inter) -> (Tensor, Tensor)");
  m.def("linear_rows(Tensor x, Tensor w) -> Tensor");
  m.def("linear_wide(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, int group) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("i16_rows(Tensor x, int group) -> (Tensor, Tensor, Tensor)");
  m.def("use_portable(bool on) -> bool");
  m.def("use_int_activations(bool on) -> bool");
  m.def("use_bf16_tiles(bool on) -> bool");
  m.def("bf16_tile_copies() -> (int, int)");
  m.def("use_int_tiles(bool on) -> bool");
  m.def("int4_tile_copies() -> (int, int)");
  m.def("int8_tile_copies() -> (int, int)");
  m.def("team_halves() -> int");
  m.def("mamba2_mix(Tensor zxbcdt, Tensor(a!) conv, Tensor slots, Tensor conv_w, Tensor conv_b, Tensor dt_bias, Tensor A, "
        "Tensor D, Tensor norm_w, Tensor(b!) ssm, Tensor(c!) ssm_prev, int groups, float eps, bool clamp, float lo, "
        "float hi, bool record) -> Tensor[]");
  m.def("moe_ffn(Tensor x, Tensor weights, Tensor idx, Tensor gu, Tensor gu_sz, Tensor dn, Tensor dn_sz, Tensor sgu, "
        "Tensor sgu_sz, Tensor sdn, Tensor sdn_sz, int group, int inter, int shared_inter) -> Tensor");
  m.def("ssm_update(Tensor(a!) h, Tensor dA, Tensor dtx, Tensor Bm, Tensor Cm, Tensor(b!) trail) -> Tensor");
}

TORCH_LIBRARY_IMPL(waferline, CompositeExplicitAutograd, m) { m.impl("use_portable", &use_portable);
  m.impl("use_int_activations", &use_int_activations);
  m.impl("use_bf16_tiles", &use_bf16_tiles);
  m.impl("bf16_tile_copies", &bf16_tile_copies);
  m.impl("use_int_tiles", &use_int_tiles);
  m.impl("int4_tile_copies", &int4_tile_copies);
  m.impl("int8_tile_copies", &int8_tile_copies);
  m.impl("team_halves", &team_halves);
}

TORCH_LIBRARY_IMPL(waferline, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
  m.impl("moe_route", &moe_route);
  m.impl("gqa_decode", &gqa_decode);
  m.impl("mla_decode", &mla_decode);
  m.impl("mla_attend_int4", &mla_attend_int4);
  m.impl("mla_moe_layer", &mla_moe_layer);
  m.impl("gqa_moe_layer", &gqa_moe_layer);
  m.impl("ffn_residual", &ffn_residual);
  m.impl("mamba_ffn_layer", &mamba_ffn_layer);
  m.impl("ssm_update", &ssm_update);
  m.impl("linear_rows", &linear_rows);
  m.impl("linear_wide", &linear_wide);
  m.impl("int4_linear", &int4_linear);
  m.impl("i16_rows", &i16_rows);
  m.impl("int8_linear", &int8_linear);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("mamba2_mix", &mamba2_mix);
  m.impl("moe_ffn", &moe_ffn);
}
