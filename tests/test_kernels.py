"""The fused CPU operators (waferline.kernels) compute what the eager chains they replace compute."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tiny_models import build, decode_logits
from waferline import kernels
from waferline.model.context import StepBatch
from waferline.model.layers import RMSNorm
from waferline.model.load import load_model
from waferline.model.moe import gated_act

SOL_MINI = Path(__file__).resolve().parents[1] / "models" / "sol-mini"

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"fused CPU operators not built: {kernels.status()['error']}")


@pytest.fixture
def eager():
    """Run a block with the fused operators off (the eager reference), restoring the setting afterwards."""
    class _Off:
        def __enter__(self):
            self.prev = kernels.use(False)

        def __exit__(self, *exc):
            kernels.use(self.prev)

    return _Off()


def _close_16bit(a: torch.Tensor, b: torch.Tensor) -> None:
    """16-bit results may differ by one rounding step where the fp32 sums (different order) straddle a boundary."""
    assert a.dtype == b.dtype
    diff = (a.float() - b.float()).abs()
    ulp = b.float().abs().clamp_min(1e-3) * (2.0 ** -7 if a.dtype == torch.bfloat16 else 2.0 ** -10)
    assert bool((diff <= ulp * 1.01).all()), f"max diff {diff.max().item()}"
    assert (diff > 0).float().mean().item() < 0.02  # only rare rounding flips, not a different computation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 96), (3, 5, 64), (7, 33)])
def test_rms_norm(dtype, shape, eager):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], eps=1e-5, dtype=dtype)
    norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    fused = norm(x)
    with eager:
        ref = norm(x)
    if dtype == torch.float32:
        torch.testing.assert_close(fused, ref, rtol=1e-6, atol=1e-6)
    else:
        _close_16bit(fused, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("B, T, H, W, d", [(1, 1, 9, 32, 32), (2, 5, 3, 96, 32), (3, 2, 4, 64, 64)])
def test_rope(dtype, interleaved, B, T, H, W, d, eager):
    """The fused rotary op against Rotary.apply's eager chain: rotated part (half-split or de-interleaved), pass-through
    channels beyond ``d``, ragged positions per row, and YaRN's attention scaling folded into the tables."""
    from waferline.model.layers import Rotary

    rot = Rotary(d, {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 64}},
                 interleaved=interleaved)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(B, T, H, W, generator=g) * 2).to(dtype)
    pos = torch.randint(0, 500, (B, 1), generator=g) + torch.arange(T)[None]
    cos, sin = rot.cos_sin(pos)
    fused = rot.apply(x, cos, sin)
    with eager:
        ref = rot.apply(x, cos, sin)
    assert fused.shape == ref.shape and fused.dtype == ref.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(fused, ref, rtol=1e-6, atol=1e-6)
    else:
        _close_16bit(fused, ref)
    assert torch.equal(fused[..., d:], x[..., d:])
    assert not torch.allclose(fused[..., :d].float(), x[..., :d].float())  # it did rotate


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral", "gpt_oss", "nemotron_h"])
def test_moe_route(tmp_path, model_type, eager):
    """The fused router against MoE.route's eager chain for every routing flavour the tiny checkpoints carry: softmax
    (renormalised or not), sigmoid with a correction bias and group-limited top-k (top-2 group scores or the max),
    GPT-OSS's softmax over the top-k logits with a router bias, routed scaling: the same experts in the same order,
    the same weights to float rounding."""
    from waferline.model.moe import MoE

    build(model_type, tmp_path)
    moes = [m for m in load_model(tmp_path, torch.float32).modules() if isinstance(m, MoE)]
    assert moes
    g = torch.Generator().manual_seed(5)
    for moe in moes:
        if moe.e_score_correction_bias is not None:  # zeros in a fresh checkpoint: make it matter
            moe.e_score_correction_bias.copy_(torch.randn(moe.num_experts, generator=g) * 0.3)
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(37, moe.hidden_size, generator=g) * 3).to(dtype)
            w, idx = moe.route(x)
            with eager:
                w_ref, idx_ref = moe.route(x)
            assert idx.dtype == torch.int64 and w.dtype == torch.float32
            torch.testing.assert_close(idx, idx_ref, rtol=0, atol=0)
            torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H, Hkv", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("masked, sinks", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("D", [32, 64, 128, 24])
def test_gqa_decode(dtype, H, Hkv, masked, sinks, D):
    """The fused grouped-query attention against attend(): grouped, multi-head and multi-query heads, with a mask
    (a sliding window's or a ragged batch's) and GPT-OSS's sinks, over cache rows laid out [keys | values]; kv also
    as the first L positions of a longer cache's rows (each row's block contiguous, the rows apart: read in place),
    the same numbers; and L - 5 keys against L with the last 5 masked, bitwise (what lets a verify's rows equal
    one-token steps). Head sizes 32, 64 and 128 take the AVX-512 kernel (16 keys at a time; bf16 scores by vdpbf16ps
    where the CPU has AVX512-BF16) where the CPU has it, 24 the portable loop."""
    from waferline.model.attention import attend

    g = torch.Generator().manual_seed(6)
    B, T, L = 3, 2, 37
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    kv = torch.randn(B, L, 2 * Hkv, D, generator=g).to(dtype)
    blocked = torch.rand(B, T, L, generator=g) < 0.3 if masked else None
    if blocked is not None:
        blocked[:, :, 0] = False  # every query sees at least one key
    sk = torch.randn(H, generator=g) if sinks else None
    fused = torch.ops.waferline.gqa_decode(q, kv, blocked if masked else torch.empty(0, dtype=torch.bool),
                                           sk if sinks else torch.empty(0), 0.17)
    ref = attend(q, kv[:, :, :Hkv], kv[:, :, Hkv:], blocked, 0.17, sk)
    assert fused.shape == ref.shape and fused.dtype == ref.dtype
    cache = torch.randn(B, L + 9, 2 * Hkv, D, generator=g).to(dtype)
    cache[:, :L] = kv
    apart = torch.ops.waferline.gqa_decode(q, cache.narrow(1, 0, L),
                                           blocked if masked else torch.empty(0, dtype=torch.bool),
                                           sk if sinks else torch.empty(0), 0.17)
    assert torch.equal(apart, fused)
    if dtype == torch.float32:  # (scores' rounding grows with the head size: summation orders differ)
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-6 * D / 32)
    else:
        _close_16bit(fused, ref)
    cut = blocked[:, :, : L - 5].contiguous() if masked else torch.empty(0, dtype=torch.bool)
    short = torch.ops.waferline.gqa_decode(q, kv[:, : L - 5].contiguous(), cut, sk if sinks else torch.empty(0), 0.17)
    tail = torch.zeros(B, T, L, dtype=torch.bool) if blocked is None else blocked.clone()
    tail[:, :, L - 5:] = True
    longer = torch.ops.waferline.gqa_decode(q, kv, tail, sk if sinks else torch.empty(0), 0.17)
    assert torch.equal(short, longer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype, eager):
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(4, 2, 256, generator=g) * 4).to(dtype)
    fused = gated_act(h, F.silu)
    with eager:
        ref = gated_act(h, F.silu)
    if dtype == torch.float32:
        torch.testing.assert_close(fused, ref, rtol=1e-6, atol=1e-6)
    else:
        _close_16bit(fused, ref)
    # many rows, a width across the kernel's 256-wide chunks with a ragged tail, and the exp's edges (its argument
    # beyond +-87: 0 / inf; NaN stays NaN)
    wide = (torch.randn(37, 2 * 300, generator=g) * 8).to(dtype)
    wide[0, :6] = torch.tensor([-200.0, -88.5, 0.0, 88.5, 200.0, float("nan")]).to(dtype)
    fused = torch.ops.waferline.silu_mul(wide)
    ref = F.silu(wide[:, :300]) * wide[:, 300:]
    assert fused[0, 5].isnan() and ref[0, 5].isnan()
    fused[0, 5] = ref[0, 5] = 0
    if dtype == torch.float32:
        torch.testing.assert_close(fused, ref, rtol=1e-6, atol=1e-30)
    else:
        _close_16bit(fused, ref)
    gelu = gated_act(h, F.gelu)  # other activations keep the eager chain
    gate, up = h.chunk(2, dim=-1)
    torch.testing.assert_close(gelu, F.gelu(gate) * up, rtol=0, atol=0)


def _logits(model, prompts, steps=4):
    """Ragged prompts prefilled into slots 0..B-1 and decoded together (a mask; one prompt: no mask), then a 3-token
    verify-shaped step (T > 1 with a causal mask) for the first sequence; logits of every step."""
    out, caches = decode_logits(model, prompts, list(range(len(prompts))), len(prompts), steps, return_caches=True)
    h = model(torch.tensor([[5, 6, 7]]), caches, StepBatch.make([0], [len(prompts[0]) + steps], 3))
    return torch.cat([out, model.logits(h[0]).expand(len(prompts), 3, -1)[:, -1][None]])


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe"])
def test_model_decode_matches_eager(tmp_path, model_type, eager, one_thread):
    """Whole-model decode in fp32 (MLA absorbed decode, RMSNorm, SwiGLU all fused where they apply) against the eager
    path: the same logits to float rounding, for ragged batches (masks), one sequence (no mask) and a T = 3 step."""
    build(model_type, tmp_path)
    model = load_model(tmp_path, torch.float32)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 120, (n,), generator=g).tolist() for n in (7, 12)]
    with torch.inference_mode():
        fused = _logits(model, prompts)
        fused_one = _logits(model, prompts[:1])
        with eager:
            model2 = load_model(tmp_path, torch.float32)
            ref = _logits(model2, prompts)
            ref_one = _logits(model2, prompts[:1])
    torch.testing.assert_close(fused, ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(fused_one, ref_one, rtol=0, atol=2e-5)
    assert not torch.equal(ref, _perturbed(model2, prompts, eager))  # the comparison can fail: a changed weight shows


def _perturbed(model, prompts, eager):
    with torch.inference_mode(), eager:
        w = model.layers[0].mixer_norm.weight
        w.mul_(1.001)
        try:
            return _logits(model, prompts)
        finally:
            w.div_(1.001)


def test_mla_decode_bf16_matches_eager(tmp_path, eager, one_thread):
    """bf16 DeepSeek-V3 decode: the fused and eager paths pick the same greedy tokens and agree to bf16 rounding.
    Dense FFNs in every layer: with routed experts, a one-step bf16 rounding difference upstream (the fused RMSNorm's
    fp32 sums in another order) can flip an expert choice at a near-tie and move the logits far more than rounding
    (seen on an AVX2 CPU: a T = 3 verify step 9% apart, every module before the MoE within 0.5%)."""
    build("deepseek_v3", tmp_path, first_k_dense_replace=3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 120, (n,), generator=g).tolist() for n in (5, 9)]
    with torch.inference_mode():
        fused = _logits(load_model(tmp_path, torch.bfloat16), prompts).float()
        with eager:
            ref = _logits(load_model(tmp_path, torch.bfloat16), prompts).float()
    assert (fused - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    assert torch.equal(fused[:-1].argmax(-1), ref[:-1].argmax(-1))


@pytest.mark.parametrize("portable", [False, True])
def test_mla_decode_op_against_float64(portable):
    """waferline::mla_decode (absorbed MLA attention: W_UK into the queries, scores, softmax, weighted latents, W_UV)
    against the same formula in float64: one row and many, T > 1 with per-token masks, heads not a multiple of the
    kernel's block of 4, latent widths with and without a vector tail (AVX-512: 16 keys at a time where r + p is a
    multiple of 16, W_UK's sums in registers for r = 64 and 128); masked cache rows holding NaN (a slot's stale
    or unwritten rows) do not reach the output; the vector kernels and the portable loops. bf16 absorbed weights give
    bitwise what their fp32 copies give."""
    g = torch.Generator().manual_seed(5)
    prev = torch.ops.waferline.use_portable(portable)
    try:
        for B, T, H, n, p, r, v, L in [(1, 1, 8, 64, 32, 128, 64, 131), (3, 1, 8, 64, 32, 128, 64, 40),
                                       (2, 3, 5, 16, 8, 32, 16, 9), (1, 1, 3, 16, 4, 20, 12, 7),
                                       (5, 2, 4, 32, 16, 64, 32, 21)]:
            qn, qr = torch.randn(B, T, H, n, generator=g), torch.randn(B, T, H, p, generator=g)
            lat = torch.randn(B, L, r + p, generator=g)
            wuk, wuv = torch.randn(H, n, r, generator=g) * 0.1, torch.randn(H, v, r, generator=g) * 0.1
            blocked = torch.rand(B, T, L, generator=g) < 0.3
            blocked[..., 0] = False
            for mask in (None, blocked):
                q_lat = torch.einsum("bthn,hnr->bthr", qn.double(), wuk.double())
                s = (torch.einsum("bthr,blr->bthl", q_lat, lat[..., :r].double())
                     + torch.einsum("bthp,blp->bthl", qr.double(), lat[..., r:].double())) * 0.1
                if mask is not None:
                    s = s.masked_fill(mask[:, :, None, :], float("-inf"))
                o = torch.einsum("bthl,blr->bthr", torch.softmax(s, -1), lat[..., :r].double())
                ref = torch.einsum("bthr,hvr->bthv", o, wuv.double()).reshape(B, T, H * v)
                stale = lat.clone()
                if mask is not None:
                    stale[mask.all(1)] = float("nan")  # rows every token of the row masks
                none = torch.empty(0, dtype=torch.bool)
                out = torch.ops.waferline.mla_decode(qn, qr, stale, none if mask is None else mask, wuk, wuv, 0.1,
                                                     torch.float32)
                torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
                # bf16 W_UK / W_UV (a bf16 model's, as absorbed() keeps them) are widened exactly: bitwise what their
                # fp32 copies give
                wk16, wv16 = wuk.bfloat16(), wuv.bfloat16()
                args = (qn, qr, stale, none if mask is None else mask)
                wide = torch.ops.waferline.mla_decode(*args, wk16.float(), wv16.float(), 0.1, torch.float32)
                assert torch.equal(torch.ops.waferline.mla_decode(*args, wk16, wv16, 0.1, torch.float32), wide)
    finally:
        torch.ops.waferline.use_portable(prev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba_state_update_matches_eager(tmp_path, eager, one_thread, dtype):
    """Mamba-2's fused mixer (waferline::mamba2_mix: conv, activations, state update and gated norm between the two
    projections) against the eager chain: one-token steps (slots in order and not) and a recorded 3-token verify give
    the same outputs, states, per-token trail (replayed, with the operator) and rewound states to float rounding (to
    16-bit rounding in bf16); with the operator, the verify and its rewind to 1, 2 or 3 kept tokens agree with
    one-token steps (to rounding: the projections' GEMMs differ in rounding with the row count, in the eager path
    too)."""
    from waferline.model.ssm import Mamba2Mixer

    build("bamba", tmp_path)  # 2 groups of heads: the group indexing is exercised
    mixer = next(layer.mixer for layer in load_model(tmp_path, dtype).layers
                 if isinstance(layer.mixer, Mamba2Mixer))
    x = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    assert mixer._mixes_fused(mixer.new_cache(1), x)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}

    def run(slots):
        c = mixer.new_cache(4)
        mixer(x[:, :5], c, StepBatch.make(slots, [0] * 3, 5))  # prefill (the chunked scan: not fused)
        step = mixer(x[:, 5:6], c, StepBatch.make(slots, [5] * 3, 1))
        c.keep_trail = True
        verify = mixer(x[:, 6:9], c, StepBatch.make(slots, [6] * 3, 3))
        trail = torch.stack([torch.stack([c.ssm_after(s, k) for k in (1, 2, 3)]) for s in slots])
        after = c.ssm.clone()
        c.rewind(torch.tensor(slots), [1, 2, 3])  # row b keeps its first b + 1 tokens
        return step, verify, after, trail, c.ssm.clone(), c.conv.clone()

    with torch.inference_mode():
        for slots in ([0, 1, 2], [3, 0, 2]):
            fused = run(slots)
            with eager:
                ref = run(slots)
            for a, b in zip(fused, ref):
                torch.testing.assert_close(a, b, **tol)
            c = mixer.new_cache(4)  # the verify's three tokens one at a time
            mixer(x[:, :5], c, StepBatch.make(slots, [0] * 3, 5))
            mixer(x[:, 5:6], c, StepBatch.make(slots, [5] * 3, 1))
            outs, kept = [], []
            for t in range(6, 9):
                outs.append(mixer(x[:, t:t + 1], c, StepBatch.make(slots, [t] * 3, 1)))
                b = t - 6  # row b's rewind kept b + 1 tokens: its state is the one after this step
                kept.append((c.ssm[slots[b]].clone(), c.conv[slots[b]].clone()))
            torch.testing.assert_close(torch.cat(outs, 1), fused[1], **tol)
            torch.testing.assert_close(c.ssm, fused[2], **tol)
            for b, (ssm, conv) in enumerate(kept):
                torch.testing.assert_close(fused[4][slots[b]], ssm, **tol)
                torch.testing.assert_close(fused[5][slots[b]], conv, **tol)
    assert not torch.allclose(fused[2], torch.zeros_like(fused[2]))  # states really moved


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_mla_attend_int4_is_the_eager_chain(tmp_path, model_type, monkeypatch, one_thread):
    """waferline::mla_attend_int4 (an int4 MLA block's decode step as one op) against MLAttention.forward's eager
    chain: bitwise the same logits and caches over prefill + 4 decode steps, for 1 row, 3 rows in scattered slots at
    different positions (masks), 4 rows at one position; short prefills (their tokens as rows of one slot); with a q
    LoRA (V3) and without (V2); rows past MLA_FUSED_MAX_ROWS, fp32 activations or a projection that is not waferline's
    Linear keep the eager chain (the op is not called); bf16 weights go in as dense projections; the op's
    arguments, kept between calls, follow a replaced projection."""
    from waferline.model.attention import MLA_FUSED_MAX_ROWS, MLAttention
    from waferline.model.quant import QuantOptions, quantize_model

    build(model_type, tmp_path, **({"q_lora_rank": 64} if model_type == "deepseek_v3" else {}))  # K % 32 == 0
    model = load_model(tmp_path, torch.bfloat16)
    quantize_model(model, QuantOptions(group_size=32))
    calls = {"n": 0}
    op, layer_op = torch.ops.waferline.mla_attend_int4, torch.ops.waferline.mla_moe_layer

    def counting(*a):
        calls["n"] += 1
        return op(*a)

    def counting_layer(*a):  # an MLA + MoE layer runs mla_attend_int4 inside its own op
        calls["n"] += 1
        return layer_op(*a)

    g = torch.Generator().manual_seed(11)
    cases = [([9], [0], 1), ([5, 12, 7], [2, 0, 5], 6), ([4, 4, 4, 4], [0, 1, 2, 3], 4),
             ([3] * (MLA_FUSED_MAX_ROWS + 1), list(range(MLA_FUSED_MAX_ROWS + 1)), MLA_FUSED_MAX_ROWS + 1)]
    with torch.inference_mode():
        for lens, slots, nslots in cases:
            prompts = [torch.randint(3, 120, (k,), generator=g).tolist() for k in lens]
            with monkeypatch.context() as mp:
                mp.setattr(MLAttention, "_int4_block", lambda self, x, cache: None)
                eager, ce = decode_logits(model, prompts, slots, nslots, return_caches=True)
            calls["n"] = 0
            with monkeypatch.context() as mp:
                mp.setattr(torch.ops.waferline, "mla_attend_int4", counting)
                mp.setattr(torch.ops.waferline, "mla_moe_layer", counting_layer)
                fused, cf = decode_logits(model, prompts, slots, nslots, return_caches=True)
            n_mla = sum(isinstance(m, MLAttention) for m in model.modules())
            # the 4 decode steps (rows past MLA_FUSED_MAX_ROWS keep the chain), and each prefill of at most that many
            # tokens (they go in as rows of one token, as a verify's do)
            steps = (4 if len(lens) <= MLA_FUSED_MAX_ROWS else 0) + sum(k <= MLA_FUSED_MAX_ROWS for k in lens)
            assert calls["n"] == steps * n_mla, (lens, calls)
            assert torch.equal(fused, eager), lens
            for a, b in zip(cf, ce):
                if a is not None and hasattr(a, "data"):
                    assert torch.equal(a.data, b.data)
    for m in model.modules():
        if isinstance(m, MLAttention):
            x = torch.zeros(1, 1, model.spec.hidden_size, dtype=torch.bfloat16)
            assert m._int4_block(x, m.new_cache(1)) is not None
            assert m._int4_block(x.float(), m.new_cache(1)) is None  # the weights compute in bf16
            o = m.o_proj  # the arguments are kept between calls, but follow the module
            m.o_proj = torch.nn.Linear(o.in_features, o.out_features, bias=False, dtype=torch.bfloat16)
            assert m._int4_block(x, m.new_cache(1)) is None
            m.o_proj = o
            assert m._int4_block(x, m.new_cache(1))[0][6] is o.int4.packed
    dense = load_model(tmp_path, torch.bfloat16)  # bf16 projections: the op multiplies them with linear_rows
    att = next(m for m in dense.modules() if isinstance(m, MLAttention))
    x = torch.zeros(1, 1, dense.spec.hidden_size, dtype=torch.bfloat16)
    assert att._int4_block(x, att.new_cache(1))[6] and att._int4_block(x.float(), att.new_cache(1)) is None


def test_op_counter_sees_inside_mla_attend_int4(tmp_path, monkeypatch, one_thread):
    """The twin's op counter prices mla_attend_int4 by the operators it runs: the same int4 linear calls (rows, weight
    bytes), rms_norm elements and mla_decode FLOPs as it counts on the eager chain the op replaces, for a decode step
    of 3 rows at different positions; fewer ops in all (the eager chain's views and casts are gone)."""
    from waferline.model.attention import MLAttention
    from waferline.model.quant import QuantOptions, quantize_model
    from waferline.sim.calibrate.opcount import OpCounter

    build("deepseek_v3", tmp_path, q_lora_rank=64)
    model = load_model(tmp_path, torch.bfloat16)
    quantize_model(model, QuantOptions(group_size=32))

    def step_work(fused: bool) -> tuple[dict[str, float], int]:
        with monkeypatch.context() as mp:
            if not fused:
                mp.setattr(MLAttention, "_int4_block", lambda self, x, cache: None)
            caches = model.new_caches(3)
            with torch.inference_mode():
                for b, k in enumerate((5, 9, 7)):
                    model(torch.arange(3, 3 + k)[None], caches, StepBatch.make([b], [0], k))
                with OpCounter() as c:
                    c.label = "step"
                    model(torch.tensor([[4], [5], [6]]), caches, StepBatch.make([0, 1, 2], [5, 9, 7], 1))
        return c.work["step"], c.total

    (eager, n_eager), (fused, n_fused) = step_work(False), step_work(True)
    keys = [k for k in eager if k.startswith("call|int4")]
    assert keys and {k: fused.get(k) for k in keys} == {k: eager[k] for k in keys}
    for k in ("fused|mla_decode|units", "fused|mla_decode|calls", "fused|rms_norm|units"):
        assert fused[k] == pytest.approx(eager[k]), k
    assert n_fused < n_eager


def test_op_counter_sees_inside_layer_ops(tmp_path, monkeypatch, one_thread):
    """The op counter prices a whole layer's decode step as one op (waferline::mla_moe_layer with a MoE block or a
    dense FFN, int4 or bf16; gqa_moe_layer; mamba_ffn_layer) by its parts: the same linear calls (the mixer's, the
    experts' as routed, the dense FFN's), rms_norm and silu_mul elements, mla_decode FLOPs and mamba2_mix state
    elements as the modules' path
    counts for a decode step of 3 rows at different positions, the FFN's under ``ffn_label`` as the twin's label-only
    hooks put the modules' FFN ops; no more ops than the modules' path."""
    from waferline.model.quant import QuantOptions, quantize_model

    build("deepseek_v3", tmp_path, q_lora_rank=64)
    model = load_model(tmp_path, torch.bfloat16)
    quantize_model(model, QuantOptions(group_size=32))
    for layer in (model.layers[-1], model.layers[0]):  # MLA + MoE, MLA + a dense FFN
        _counted_layer_parts(model, layer, monkeypatch)
    bf16 = load_model(tmp_path, torch.bfloat16)  # the same layers with bf16 weights (3 rows: few_rows() or fewer)
    for layer in (bf16.layers[-1], bf16.layers[0]):
        _counted_layer_parts(bf16, layer, monkeypatch)
    for model_type in ("qwen3_moe", "llama"):  # GQA + MoE, GQA + a dense FFN: waferline::gqa_moe_layer
        build(model_type, tmp_path / model_type)
        gqa = load_model(tmp_path / model_type, torch.bfloat16)
        quantize_model(gqa, QuantOptions(group_size=32))
        _counted_layer_parts(gqa, gqa.layers[-1], monkeypatch)
    sol = load_model(SOL_MINI, torch.bfloat16)
    quantize_model(sol, QuantOptions(group_size=64))
    assert type(sol.layers[1].mixer).__name__ == "Mamba2Mixer"
    _counted_layer_parts(sol, sol.layers[1], monkeypatch)  # Mamba-2 + MoE: waferline::mamba_ffn_layer


def _counted_layer_parts(model, layer, monkeypatch):
    from waferline.model.decoder import LABEL_ONLY, DecoderLayer
    from waferline.sim.calibrate.opcount import OpCounter, _priced_calls

    i = list(model.layers).index(layer)
    seen: list[tuple[int, float]] = []

    def step_work(fused: bool) -> dict:
        c = OpCounter()
        c.ffn_label = lambda lab: "ffn"
        pre = lambda m, a: setattr(c, "label", "ffn")  # noqa: E731
        post = lambda m, a, o: setattr(c, "label", "layer")  # noqa: E731
        for f in (pre, post):
            setattr(f, LABEL_ONLY, True)
        hooks = [layer.ffn.register_forward_pre_hook(pre), layer.ffn.register_forward_hook(post)]
        with monkeypatch.context() as mp:
            if not fused:
                mp.setattr(DecoderLayer, "_fused_step", lambda self, x, cache, batch: None)
            else:
                _counting_layer_ops(mp, seen)
            caches = model.new_caches(3)
            with torch.inference_mode():
                for b, k in enumerate((5, 9, 7)):
                    model(torch.arange(3, 3 + k)[None], caches, StepBatch.make([b], [0], k))
                x = torch.randn(3, 1, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
                with c:
                    c.label = "layer"
                    layer(x.to(torch.bfloat16), caches[i], StepBatch.make([0, 1, 2], [5, 9, 7], 1))
        for h in hooks:
            h.remove()
        return c

    eager, fused = step_work(False), step_work(True)
    for lab in ("layer", "ffn"):
        e, f = eager.work[lab], fused.work[lab]
        keys = [k for k in e if k.startswith("call|")]
        assert keys and {k: f.get(k) for k in keys} == {k: e[k] for k in keys}, lab
        assert not [k for k in f if k.startswith("call|") and k not in e], lab
    for k in [k for k in eager.work["layer"] if k.startswith("fused|")]:  # rms_norm, mla_decode or mamba2_mix
        assert fused.work["layer"].get(k) == pytest.approx(eager.work["layer"][k]), k
    for k in [k for k in eager.work["ffn"] if k.startswith("fused|")]:  # the dense FFN's silu_mul
        assert fused.work["ffn"].get(k) == pytest.approx(eager.work["ffn"][k]), k
    assert sum(fused.counts.values()) <= sum(eager.counts.values())
    # the layer operator is one dispatch: beyond the calls it makes that are priced per call (linear, fused), it counts
    # one op (the per-op overhead's), where the modules' path dispatches its casts, adds, rope and cache writes apart
    assert seen and all(ops == priced + 1 for ops, priced in seen), seen
    unpriced = [sum(c.counts.values()) - sum(_priced_calls(w) for w in c.work.values()) for c in (fused, eager)]
    assert unpriced[0] < unpriced[1], unpriced


def _counting_layer_ops(monkeypatch, seen: list) -> None:
    """Record (ops counted, calls priced per call) for each layer operator an OpCounter sees."""
    from waferline.sim.calibrate.opcount import _LAYER_OPS, OpCounter, _priced_calls

    record = OpCounter._record

    def spy(self, func, args, out):  # noqa: ANN001
        n0, p0 = sum(self.counts.values()), sum(_priced_calls(w) for w in self.work.values())
        record(self, func, args, out)
        if func.__name__.split(".")[0] in _LAYER_OPS:
            seen.append((sum(self.counts.values()) - n0, sum(_priced_calls(w) for w in self.work.values()) - p0))

    monkeypatch.setattr(OpCounter, "_record", spy)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v3-8heads", "deepseek_v2", "qwen3_moe", "sol-mini"])
@pytest.mark.parametrize("group,threads", [(32, 1), (64, 1), (64, 2), (0, 2)])
def test_fused_layers_are_the_modules_path(tmp_path, model_type, group, threads, monkeypatch, one_thread):
    """A layer's step as one op against DecoderLayer's modules (norms, mixer, FFN blocks, residual adds): bitwise the
    same logits and caches over prefill + 4 decode steps for 1 row, 3 rows in scattered slots at different positions
    and 8 and 9 rows. waferline::mla_moe_layer runs the whole decode step of every MLA layer with an int4 MoE or dense
    FFN, waferline::gqa_moe_layer of every GQA layer (Qwen3-MoE), waferline::mamba_ffn_layer of every Mamba-2 layer
    (sol-mini: Mamba-2 and MLA mixers, MoE and dense FFNs), one call per layer and step (MLA and GQA: up to
    MLA_FUSED_MAX_ROWS tokens, prefills that short too); waferline::ffn_residual the FFN half of the other steps
    (prefill, more rows). Groups of 32 take the ops' composed paths; groups of 64 (the
    integer int4 kernel, where the CPU has AVX2) their thread-team paths, both halves of a whole layer's op (the
    mixer's, MLA, GQA or Mamba-2, and the FFN's), with 1 and 2 threads (the stages split between them; 8 heads: at 2
    threads a one-row step's attention and W_UV passes run without a barrier between them). Group 0: bf16 weights, not
    quantized; a MoE block's FFN half and a GQA layer's attention half run on thread teams with the bf16 kernel where
    the CPU has AVX512-BF16 (up to 8 rows). A forward hook on a part keeps the modules' path (the op would skip it)
    unless marked label-only."""
    from waferline.model.attention import GQA_FUSED_MAX_ROWS, MLA_FUSED_MAX_ROWS, GQAttention, MLAttention
    from waferline.model.decoder import LABEL_ONLY, DecoderLayer
    from waferline.model.moe import MoE
    from waferline.model.quant import QuantOptions, quantize_model
    from waferline.model.ssm import Mamba2Mixer

    if model_type == "sol-mini":
        tmp_path = SOL_MINI
    else:
        extra = {"q_lora_rank": 64} if model_type.startswith("deepseek_v3") else {}
        if model_type == "deepseek_v3-8heads":  # two head blocks: at 2 threads a batch-1 step skips a barrier
            model_type, extra["num_attention_heads"] = "deepseek_v3", 8
        build(model_type, tmp_path, moe_intermediate_size=64, **extra)  # every routed product's K a multiple of 64
    model = load_model(tmp_path, torch.bfloat16)
    if group:
        quantize_model(model, QuantOptions(group_size=group))
    torch.set_num_threads(threads)
    flags = kernels._cpu_flags().split()
    team = "avx2" in flags and "fma" in flags  # the team path needs the integer int4 kernel (built with -march=native)
    dense_team = "avx512_bf16" in flags  # a bf16 FFN's team: the AVX512-BF16 few-row kernel
    probe = torch.zeros(1, 1, model.spec.hidden_size, dtype=torch.bfloat16)
    fusable = [layer.ffn.residual_args(probe) is not None for layer in model.layers]
    assert sum(fusable) >= 2 and any(isinstance(layer.ffn, MoE) for layer in model.layers)
    mla = sum(f and isinstance(layer.mixer, MLAttention) for f, layer in zip(fusable, model.layers))
    mamba = sum(f and isinstance(layer.mixer, Mamba2Mixer) for f, layer in zip(fusable, model.layers))
    gqa = sum(f and isinstance(layer.mixer, GQAttention) for f, layer in zip(fusable, model.layers))
    assert (mamba > 0) == (model_type == "sol-mini") and (gqa > 0) == (model_type == "qwen3_moe")
    assert GQA_FUSED_MAX_ROWS == MLA_FUSED_MAX_ROWS
    calls = {"layer": 0, "gqa": 0, "mamba": 0, "ffn": 0}
    ops = {name: getattr(torch.ops.waferline, op)
           for name, op in (("layer", "mla_moe_layer"), ("gqa", "gqa_moe_layer"), ("mamba", "mamba_ffn_layer"),
                            ("ffn", "ffn_residual"))}

    def counting(name):
        def call(*a):
            calls[name] += 1
            return ops[name](*a)
        return call

    def run(fuse_layers: bool, prompts, slots, nslots):
        calls.update(layer=0, gqa=0, mamba=0, ffn=0)
        with monkeypatch.context() as mp:
            mp.setattr(torch.ops.waferline, "mla_moe_layer", counting("layer"))
            mp.setattr(torch.ops.waferline, "gqa_moe_layer", counting("gqa"))
            mp.setattr(torch.ops.waferline, "mamba_ffn_layer", counting("mamba"))
            mp.setattr(torch.ops.waferline, "ffn_residual", counting("ffn"))
            if not fuse_layers:
                mp.setattr(DecoderLayer, "_fused_step", lambda self, x, cache, batch: None)
            return decode_logits(model, prompts, slots, nslots, return_caches=True)

    g = torch.Generator().manual_seed(12)
    cases = [([9], [0], 1), ([5, 12, 7], [2, 0, 5], 6), ([3] * 8, list(range(8)), 8),
             ([3] * (MLA_FUSED_MAX_ROWS + 1), list(range(MLA_FUSED_MAX_ROWS + 1)), MLA_FUSED_MAX_ROWS + 1)]
    ffn_halves = 0
    with torch.inference_mode():
        for lens, slots, nslots in cases:
            prompts = [torch.randint(3, 120, (k,), generator=g).tolist() for k in lens]
            ref, cr = run(False, prompts, slots, nslots)
            assert calls == {"layer": 0, "gqa": 0, "mamba": 0, "ffn": 0}
            teams = torch.ops.waferline.team_halves()
            out, co = run(True, prompts, slots, nslots)
            # MLA: the decode steps (up to MLA_FUSED_MAX_ROWS rows) and the prefills that short (tokens as rows)
            steps = (4 if len(lens) <= MLA_FUSED_MAX_ROWS else 0) + sum(k <= MLA_FUSED_MAX_ROWS for k in lens)
            assert calls["layer"] == steps * mla and calls["gqa"] == steps * gqa, (lens, calls)
            assert calls["mamba"] == (4 * mamba if group else 0), (lens, calls)  # (mamba_ffn_layer: int4 only)
            ffn_halves += calls["ffn"]
            ran_teams = torch.ops.waferline.team_halves() - teams
            if group == 0:  # (the FFN half on a team for up to 8 rows)
                assert (ran_teams > 0) == (dense_team and min(len(lens), max(lens)) <= 8), (lens, ran_teams)
                if dense_team:  # a GQA layer's op (up to 8 rows) runs both halves on teams
                    assert ran_teams >= 2 * calls["gqa"], (ran_teams, calls)
            else:
                assert (ran_teams > 0) == (team and group == 64), ran_teams
            if team and group == 64:  # a whole layer's op runs both halves on teams (mixer: MLA, GQA or Mamba-2; FFN)
                assert ran_teams >= 2 * (calls["layer"] + calls["gqa"] + calls["mamba"]), (ran_teams, calls)
            assert torch.equal(out, ref), lens
            for a, b in zip(co, cr):
                for name in ("data", "conv", "ssm"):  # attention caches; Mamba-2 conv and SSM states
                    if hasattr(a, name):
                        assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert ffn_halves > 0  # the FFN half alone ran too (prefills, 9 rows)
        prompts = [[5, 6, 7]]
        i = next(i for i, layer in enumerate(model.layers) if fusable[i] and isinstance(layer.ffn, MoE))
        layer, n_fused = model.layers[i], sum(fusable)
        seen = []
        plain = layer.ffn.register_forward_hook(lambda m, a, o: seen.append(1))
        run(True, prompts, [0], 1)
        assert sum(calls.values()) == 5 * (n_fused - 1) and len(seen) == 5  # that layer ran its modules
        plain.remove()
        marked = lambda m, a, o: seen.append(2)  # noqa: E731
        setattr(marked, LABEL_ONLY, True)
        handle = layer.ffn.register_forward_hook(marked)
        run(True, prompts, [0], 1)
        handle.remove()
        assert sum(calls.values()) == 5 * n_fused and 2 not in seen  # prefill and steps ran as the ops


@pytest.mark.parametrize("group,threads", [(32, 1), (64, 2)])
def test_verify_steps_run_as_layer_ops(group, threads, monkeypatch, one_thread):
    """A speculative verify (T tokens per row) runs every layer as one op (MLA: its tokens as rows of one token each;
    Mamba-2: recording the trail a rewind replays) and computes what one-token decode steps compute, bitwise: the
    verify's logits; then, rewound to each row's first k tokens, the Mamba-2 states and the next step's logits. sol-mini
    (Mamba-2 and MLA mixers, MoE and dense FFNs) with int4 groups of 32 (the ops' composed paths) and 64 (their thread
    teams, 2 threads), 2 rows of 3 tokens in swapped slots at different positions."""
    from waferline.engine.speculative import VerifyRollback
    from waferline.model.quant import QuantOptions, quantize_model

    model = load_model(SOL_MINI, torch.bfloat16)
    quantize_model(model, QuantOptions(group_size=group))
    torch.set_num_threads(threads)
    ops = {name: getattr(torch.ops.waferline, name) for name in ("mla_moe_layer", "mamba_ffn_layer")}
    calls = {name: 0 for name in ops}

    def counting(name):
        def call(*a):
            calls[name] += 1
            return ops[name](*a)
        return call

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 4000, (k,), generator=g).tolist() for k in (9, 14)]
    drafts = torch.randint(3, 4000, (2, 3), generator=g).tolist()
    slots, starts = [1, 0], [9, 14]

    def prefilled() -> list:
        caches = model.new_caches(2)
        for p, s in zip(prompts, slots):
            model(torch.tensor([p]), caches, StepBatch.make([s], [0], len(p)))
        return caches

    def one_token_steps(caches: list, upto: list[int]) -> list[list[torch.Tensor]]:  # row by row, token by token
        return [[model.logits(model(torch.tensor([[tok]]), caches, StepBatch.make([s], [st + t], 1)))[0, 0]
                 for t, tok in enumerate(row[:k])] for row, s, st, k in zip(drafts, slots, starts, upto)]

    with torch.inference_mode():
        plain = one_token_steps(prefilled(), [3, 3])
        caches = prefilled()
        batch = StepBatch.make(slots, starts, 3)
        rb = VerifyRollback(caches, batch)
        with monkeypatch.context() as mp:
            for name in ops:
                mp.setattr(torch.ops.waferline, name, counting(name))
            logits = model.logits(model(torch.tensor(drafts), caches, batch))
        mixers = [type(layer.mixer).__name__ for layer in model.layers]
        assert calls == {"mla_moe_layer": mixers.count("MLAttention"), "mamba_ffn_layer": mixers.count("Mamba2Mixer")}
        for b in range(2):
            for t in range(3):
                assert torch.equal(logits[b, t], plain[b][t]), (b, t)
        keep = [1, 2]
        rb.done(keep)
        kept = prefilled()
        one_token_steps(kept, keep)
        nxt = StepBatch.make(slots, [st + k for st, k in zip(starts, keep)], 1)
        for a, b in zip(caches, kept):
            for name in ("conv", "ssm"):
                if hasattr(a, name):
                    assert torch.equal(getattr(a, name), getattr(b, name)), name
        la = model.logits(model(torch.tensor([[7], [8]]), caches, nxt))
        assert torch.equal(la, model.logits(model(torch.tensor([[7], [8]]), kept, nxt)))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("variant", ["fp32", "bf16", "bf16-portable", "int4"])
def test_moe_ffn_matches_eager(tmp_path, model_type, variant, one_thread):
    """The fused MoE block (waferline::moe_ffn: routed experts grouped per expert, their weighted sum, the shared
    expert) against MoE.forward's per-expert eager loop on the same routing, for 1, 3, 8 and 20 tokens (one token,
    several sharing experts), dense fp32 / bf16 weights (bf16-portable: the few-row products' portable loop, what CPUs
    without AVX512-BF16 run) and waferline's CPU int4 layout: the same numbers to the rounding of the products' 16-bit
    outputs."""
    prev = torch.ops.waferline.use_portable(variant.endswith("-portable"))
    try:
        _moe_ffn_vs_eager(tmp_path, model_type, variant.removesuffix("-portable"))
    finally:
        torch.ops.waferline.use_portable(prev)


def _moe_ffn_vs_eager(tmp_path, model_type, variant):
    from waferline.model.moe import MoE
    from waferline.model.quant import Int4Weight, QuantOptions, quantize_model

    build(model_type, tmp_path)
    model = load_model(tmp_path, torch.float32 if variant == "fp32" else torch.bfloat16)
    fused_runs = 0
    if variant == "int4":
        quantize_model(model, QuantOptions(group_size=32))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for moe in moes:
            for n in (1, 3, 8, 20):
                dt = torch.float32 if variant == "fp32" else torch.bfloat16
                x = torch.randn(n, moe.hidden_size, generator=g).to(dt)
                # the fused op is what runs, unless an int4 weight fell back to another backend (K not a multiple
                # of the group or of 64: tiny mixtral's down projection)
                expect = all(q.backend == "cpu_waferline" for q in moe.modules() if isinstance(q, Int4Weight))
                assert (moe._fused_weights(x) is not None) == expect
                assert (moe._fused_args(x) is not None) == expect
                fused_runs += expect
                fused = moe(x)
                ref = _moe_eager(moe, x)
                assert fused.dtype == ref.dtype == x.dtype and fused.shape == ref.shape
                if variant == "fp32":
                    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
                else:
                    diff = (fused.float() - ref.float()).abs()
                    assert diff.max().item() <= 0.02 * ref.float().abs().max().item(), diff.max().item()
                    assert diff.mean().item() <= 2e-3 * ref.float().abs().mean().item(), diff.mean().item()
    assert fused_runs or (variant, model_type) == ("int4", "mixtral")
    if variant != "int4":  # the comparison can fail: a changed expert weight moves the fused output
        moe = moes[-1]
        x = torch.randn(2, moe.hidden_size, generator=g).to(moe.w_down.dtype)
        with torch.inference_mode():
            before = moe(x)
            moe.w_down.mul_(1.5)  # (in place through the parameter: its version moves, as the bf16 tile copy checks)
            assert not torch.equal(before, moe(x))


def _moe_eager(moe, x):
    """``moe(x)`` with the fused ops turned off for this module."""
    moe._fused_args = lambda x: None
    moe._fused_weights = lambda x: None
    try:
        return moe(x)
    finally:
        del moe._fused_args, moe._fused_weights


def test_moe_fused_arguments_follow_the_module(tmp_path, one_thread):
    """The fused MoE path's arguments are built once and reused: replacing the weights (quantizing), forcing the
    gather path or installing a matmul hook must be seen at the next call, not hidden by the cached copy."""
    from waferline.model.moe import MoE
    from waferline.model.quant import QuantOptions, quantize_model

    build("deepseek_v3", tmp_path)
    model = load_model(tmp_path, torch.bfloat16)
    moe = next(m for m in model.modules() if isinstance(m, MoE) and m.shared is not None)
    x = torch.randn(1, moe.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.inference_mode():
        dense = moe(x)
        args = moe._fused_args(x)
        assert args is not None and moe._fused_args(x) is args  # built once, then reused
        quantize_model(model, QuantOptions(group_size=32))
        assert moe._fused_args(x) is not args  # the new (int4) weights, seen
        int4 = moe(x)
        assert not torch.equal(int4, dense)
        torch.testing.assert_close(int4, _moe_eager(moe, x), rtol=0.02, atol=0.02 * int4.abs().max().item())
        moe.gather_on_cpu = True
        assert moe._fused_args(x) is None
        moe.gather_on_cpu = False
        assert moe._fused_args(x) is not None
        moe.expert_linear = lambda *a: None  # what quant.hessians installs
        assert moe._fused_args(x) is None
        del moe.expert_linear
        assert moe._fused_args(x) is not None
    # the kept arguments make no reference cycle: dropping the model frees the block's weights at once
    ref = weakref.ref(moe.gate_weight)
    gc.disable()
    try:
        del model, moe, args
        assert ref() is None
    finally:
        gc.enable()


def test_moe_ffn_falls_back_where_it_does_not_apply(tmp_path):
    """GPT-OSS's clamped SwiGLU with expert biases, installed matmul hooks (GPTQ's Hessians) and prefill-sized token
    counts keep the eager loop."""
    from waferline.model.moe import MOE_FUSED_MAX_ROWS, MoE

    build("gpt_oss", tmp_path)
    moe = next(m for m in load_model(tmp_path, torch.float32).modules() if isinstance(m, MoE))
    assert moe._fused_weights(torch.zeros(1, moe.hidden_size)) is None
    assert moe._fused_args(torch.zeros(1, moe.hidden_size)) is None
    build("qwen3_moe", tmp_path / "q")
    moe = next(m for m in load_model(tmp_path / "q", torch.float32).modules() if isinstance(m, MoE))
    assert moe._fused_weights(torch.zeros(1, moe.hidden_size)) is not None
    assert moe._fused_weights(torch.zeros(MOE_FUSED_MAX_ROWS + 1, moe.hidden_size)) is None
    assert moe._fused_args(torch.zeros(MOE_FUSED_MAX_ROWS + 1, moe.hidden_size)) is None
    moe.expert_linear = lambda *a: None  # what quant.hessians installs
    assert moe._fused_weights(torch.zeros(1, moe.hidden_size)) is None


@pytest.mark.parametrize("program", [True, False], ids=["program", "python-replay"])
def test_step_plan_replays_and_follows_the_model(monkeypatch, one_thread, program):
    """Decode steps and verifies replay the layer ops recorded at the first step of their shape (DecoderModel's
    _StepPlan) and compute what the layers' module calls compute, bitwise, and the replay follows the model: a forward
    hook set between steps runs (and the steps stay the same numbers), a weight replaced or changed in place between
    steps is used at once. sol-mini, int4 groups of 64 (Mamba-2 and MLA layers): one cache set stepped with plans, one
    with them off (the modules path), the same tokens into both. The replay runs through the plan's StepProgram (the
    ops called from C++; the Mamba-2 verifies' records come back through it) or op by op from Python."""
    import waferline.model.decoder as decoder

    monkeypatch.setattr(decoder, "_USE_PROGRAM", program)
    programs, built = [], decoder._StepPlan.program  # (what each replay ran through)
    monkeypatch.setattr(decoder._StepPlan, "program", lambda plan: programs.append(built(plan)) or programs[-1])
    from waferline.engine.speculative import VerifyRollback
    from waferline.model.quant import QuantOptions, quantize_model

    model = load_model(SOL_MINI, torch.bfloat16)
    quantize_model(model, QuantOptions(group_size=64))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 4000, (1, 12), generator=g)
    toks = torch.randint(3, 4000, (18, 3), generator=g).tolist()  # (the last 8 steps: replays of both shapes)

    def step(caches, planned: bool, tokens: list[int], start: int):
        monkeypatch.setattr(decoder, "_PLAN_MAX_ROWS", 8 if planned else 0)
        b = StepBatch.make([0], [start], len(tokens))
        return model.logits(model(torch.tensor([tokens]), caches, b))[0], b

    with torch.inference_mode():
        sets = {True: model.new_caches(1), False: model.new_caches(1)}
        for caches in sets.values():
            model(prompt, caches, StepBatch.make([0], [0], 12))
        pos, seen, mamba = 12, [], next(l.mixer for l in model.layers if type(l.mixer).__name__ == "Mamba2Mixer")
        for i, row in enumerate(toks):
            if i == 2:  # a hook between steps: it runs, as it would without plans
                handle = model.layers[1].ffn.register_forward_hook(lambda m, a, o: seen.append(i))
            if i == 4:
                handle.remove()
            if i == 6:  # a weight replaced (a new tensor), then one changed in place (its version)
                norm = model.layers[2].ffn_norm
                norm.weight = torch.nn.Parameter(norm.weight * 1.5, requires_grad=False)
            if i == 8:
                mamba.A_log.mul_(0.5)
            tokens = row[:1] if i % 3 else row  # one-token steps and 3-token verifies (rewound to 2 tokens)
            out = {}
            for planned, caches in sets.items():
                rb = VerifyRollback(caches, StepBatch.make([0], [pos], len(tokens))) if len(tokens) > 1 else None
                out[planned], _ = step(caches, planned, tokens, pos)
                if rb is not None:
                    rb.done([2])
            assert torch.equal(out[True], out[False]), i
            pos += 1 if len(tokens) == 1 else 2
        assert seen == [2, 2, 3, 3]  # (both cache sets, steps 2 and 3)
        assert {k[2] for k in model.__dict__["_step_plans"]} == {(1, 1, 256), (1, 3, 256)}  # (what was planned)
        assert len(programs) >= 8 if program else not programs  # (replays, each through a built program)
        assert all(p is not None for p in programs)


@pytest.mark.parametrize("head", ["int8", "bf16"])
def test_step_logits_program_is_the_modules_path(monkeypatch, one_thread, head):
    """A step's logits, hidden states and greedy tokens (DecoderModel.step_logits) through one StepProgram (embedding,
    layers, final norm, the int8 head or the bf16 one, argmax) are bitwise the modules path's, step after step (decode
    steps of 2 rows, and 3-token verifies of one row: Mamba-2 records through the program, then a rewind); a forward
    hook on the final norm runs (that step goes through the modules), and a head made again (new tensors) is used at
    once. sol-mini, int4 groups of 64."""
    import waferline.model.decoder as decoder
    from waferline.engine.speculative import VerifyRollback
    from waferline.model.quant import QuantOptions, quantize_model

    model = load_model(SOL_MINI, torch.bfloat16)
    quantize_model(model, QuantOptions(group_size=64))
    model.quantize_head(8 if head == "int8" else 16)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 4000, (2, 9), generator=g)
    toks = torch.randint(3, 4000, (10, 2, 1), generator=g)
    tails, built = [], decoder._StepPlan.program
    monkeypatch.setattr(decoder._StepPlan, "program",
                        lambda plan, tail=(): tails.append(bool(tail)) or built(plan, tail))
    seen = []
    with torch.inference_mode():
        sets = {True: model.new_caches(2), False: model.new_caches(2)}
        for caches in sets.values():
            for b in range(2):
                model(prompt[b:b + 1], caches, StepBatch.make([b], [0], 9))
        pos = [9, 9]
        for i, t in enumerate(toks):
            if i == 4:
                handle = model.norm.register_forward_hook(lambda m, a, o: seen.append(i))
            if i == 5:
                handle.remove()
            if i == 6 and head == "int8":
                w = (model.lm_head_int8.float() * model.lm_head_scale.float()[:, None] * 1.5).to(torch.bfloat16)
            if i == 6 and head == "bf16":
                w = model.lm_head * 1.5
            if i == 7:  # the head again (new tensors: int8 ones from a 16-bit head made aside, or a new bf16 matrix)
                if head == "int8":
                    del model.lm_head_int8, model.lm_head_scale
                model.lm_head = torch.nn.Parameter(w, requires_grad=False)
                model.quantize_head(8 if head == "int8" else 16)
            verify = i % 3 == 2
            batch = StepBatch.make([0], pos[:1], 3) if verify else StepBatch.make([0, 1], pos, 1)
            tokens = t.view(1, 2).repeat(1, 2)[:, :3] if verify else t
            got = {}
            for planned, caches in sets.items():
                rb = VerifyRollback(caches, batch) if verify else None
                monkeypatch.setattr(decoder, "_PLAN_MAX_ROWS", 8 if planned else 0)
                got[planned] = model.step_logits(tokens, caches, batch, argmax=True)
                if rb is not None:
                    rb.done([2])
            assert got[True][0].shape == (tokens.shape[0], tokens.shape[1], 4096)
            assert all(torch.equal(a, b) for a, b in zip(got[True], got[False])), i  # (logits, hidden states, tokens)
            assert torch.equal(got[True][2], got[True][0].argmax(-1)), i
            pos = [pos[0] + 2, pos[1]] if verify else [p + 1 for p in pos]  # (row 1 sits the verifies out)
    assert seen == [4, 4]  # (step 4 of both sets: the hooked norm ran in the planned one too)
    assert tails.count(True) >= 5  # (the steps that replayed did so with the embedding, norm and head in the program)


def test_rotary_rows_from_the_table_are_computed_rows():
    """A step's rotary rows come from a table kept between steps (Rotary._rows: a view for one row of consecutive
    positions, a gather otherwise; the table grows past 256 positions by doubling): bitwise what cos_sin computes
    for those positions, for default and YaRN settings and several rotated widths."""
    from waferline.model.layers import Rotary

    yarn = {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                                "mscale": 1.0, "mscale_all_dim": 1.0}}
    for cfg in ({"rope_theta": 10000.0}, yarn):
        for dim in (24, 32, 64):
            r = Rotary(dim, cfg)
            rows = (([0], [5], 1), ([0], [250], 9), ([1, 0, 2], [3, 700, 41], 1), ([0, 1], [1000, 2], 3))
            for slots, start, T in rows:
                b = StepBatch.make(slots, start, T)
                got = r.cos_sin(b.positions(), b)
                want = r.cos_sin(b.positions())
                assert all(torch.equal(g, w) for g, w in zip(got, want)), (dim, start, T)
            assert r._table[1].shape[0] >= 1003


def test_argmax_rows_is_torch_argmax():
    """waferline::argmax_rows (greedy sampling's argmax) returns torch.argmax's indices: the first of tied largest
    values, a NaN first, -inf rows, vocabularies that are not a multiple of the vector width, batches of rows."""
    from waferline.engine.sampling import greedy

    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(1, 32000, generator=g), torch.randn(5, 1003, generator=g), torch.randn(7, generator=g),
             torch.full((2, 33), float("-inf")), torch.tensor([[0.0, -0.0, 0.0], [-0.0, 0.0, 1.0]])]
    tied = torch.randn(3, 100, generator=g)
    tied[:, 17] = tied[:, 61] = tied[:, 99] = 10.0
    cases.append(tied)
    nan = torch.randn(4, 50, generator=g)
    nan[0, 3] = nan[0, 40] = float("nan")
    nan[1, 49] = float("nan")
    nan[2, 9] = float("inf")
    cases.append(nan)
    for x in cases:
        want = x.argmax(-1)
        assert torch.equal(torch.ops.waferline.argmax_rows(x), want), x.shape
        assert greedy(x) == want.tolist()
    xb = torch.randn(2, 9, generator=g).to(torch.bfloat16)  # other dtypes: torch.argmax itself
    assert greedy(xb) == xb.argmax(-1).tolist()


@pytest.mark.parametrize("threads", [1, 2])
def test_int4_one_row_is_a_row_of_two(threads, one_thread):
    """A batch-1 product (the integer kernel runs weight rows two at a time for it: int4_pairs_i16) computes every
    output exactly as the two-row kernel computes that row, bitwise, for odd and even weight-row counts, groups of 64
    and 128, symmetric and asymmetric weights; and both are within bf16 rounding of the dequantized fp32 product."""
    from waferline.model.quant import Int4Weight, rtn_quantize

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(4)
    for N in (1, 17, 41, 64):
        for K, G in ((128, 64), (512, 128), (192, 64)):
            for sym in (True, False):
                t = rtn_quantize(torch.randn(N, K, generator=g), G, symmetric=sym)
                q = Int4Weight(t, compute_dtype=torch.bfloat16)
                x = torch.randn(2, K, generator=g).to(torch.bfloat16)
                one = torch.ops.waferline.int4_linear(x[:1], q.packed, q.scales_zeros, G)
                two = torch.ops.waferline.int4_linear(x, q.packed, q.scales_zeros, G)
                assert torch.equal(one[0], two[0]), (N, K, G, sym)
                ref = x[:1].float() @ t.dequantize().t()
                assert torch.allclose(one.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item()), (N, K, G)


# ---------------------------------------------------------------- the build: cached, loaded without ninja, announced

def _fake_compile(monkeypatch, calls: list, fail: bool = False) -> None:
    """Stand in for the C++ build (a minute): _compile "builds" by copying the library this test run already loaded."""
    real = kernels.library()
    assert real.is_file()

    def compile_(out):
        calls.append(out)
        if fail:
            raise RuntimeError("no compiler here")
        (out / "half-written.o").write_bytes(b"\0")
        shutil.copyfile(real, out / "waferline_cpu_ops.so")

    monkeypatch.setattr(kernels, "_compile", compile_)


def _as_if_unloaded(monkeypatch) -> list:
    """This process as one that has not loaded the operators yet: load_library records its path instead (the library
    is loaded here already; a second copy would register the operators twice)."""
    loaded: list = []
    monkeypatch.setattr(kernels, "_registered", lambda: False)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(Path(path)))
    monkeypatch.setitem(kernels._state, "loaded", None)
    monkeypatch.setitem(kernels._state, "error", None)
    return loaded


def test_a_cached_build_loads_without_ninja_or_cpp_extension(tmp_path):
    """A process that finds this key's library in the cache loads it directly: a `ninja` first on PATH (here one that
    fails and leaves a mark) is never run, cpp_extension is not imported, and nothing is announced."""
    lib = kernels.library()
    assert lib.is_file()
    bogus = tmp_path / "bin"
    bogus.mkdir()
    mark = tmp_path / "ninja-ran"
    (bogus / "ninja").write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    (bogus / "ninja").chmod(0o755)
    code = ("import sys, torch\nfrom waferline import kernels\nassert kernels.prepare(), kernels.status()\n"
            "y = torch.ops.waferline.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)\nassert y.shape == (2, 8)\n"
            "assert 'torch.utils.cpp_extension' not in sys.modules\nprint(kernels.library())\n")
    env = {**os.environ, "PATH": f"{bogus}{os.pathsep}{os.environ.get('PATH', '')}",
           "WAFERLINE_KERNELS_DIR": str(lib.parent.parent), "WAFERLINE_KERNELS": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(lib)
    assert not mark.exists() and kernels.BUILDING not in r.stderr


def test_prepare_announces_a_build_and_only_a_build(tmp_path, monkeypatch, capsys):
    """prepare() builds where the cache lacks this key's library, with one line on stderr (the build, then done); a
    directory of this key without the library (a build stopped part-way) is rebuilt and replaced, and leftovers of
    a killed build are removed. Once built, prepare() loads that library and prints nothing; available() builds
    without a word."""
    calls: list = []
    _fake_compile(monkeypatch, calls)
    monkeypatch.setenv("WAFERLINE_KERNELS_DIR", str(tmp_path / "cache"))
    d = kernels.build_dir()
    d.mkdir(parents=True)
    (d / "build.ninja").write_text("")  # half-built: no library
    dead = d.parent / f".{d.name}.tmp-killed"
    dead.mkdir()
    (dead / "waferline_cpu_ops.so").write_bytes(b"\x7fELF truncated")
    loaded = _as_if_unloaded(monkeypatch)

    assert kernels.prepare()
    err = capsys.readouterr().err
    assert err.startswith(kernels.BUILDING) and err.rstrip().endswith("s)") and " done (" in err
    assert err.count("\n") == 1
    assert len(calls) == 1 and loaded == [d / "waferline_cpu_ops.so"]
    assert (d / "waferline_cpu_ops.so").read_bytes() == kernels.library().read_bytes()
    assert not (d / "build.ninja").exists()  # the half-built directory was replaced by the build's
    assert not list(d.parent.glob(".*.tmp-*"))  # the killed build's directory and this build's are gone

    monkeypatch.setitem(kernels._state, "loaded", None)
    assert kernels.prepare()
    assert capsys.readouterr().err == "" and len(calls) == 1 and len(loaded) == 2  # cached: loaded, not built

    shutil.rmtree(d)
    monkeypatch.setitem(kernels._state, "loaded", None)
    assert kernels.available()
    assert capsys.readouterr().err == "" and len(calls) == 2  # built again, silently


def test_a_failed_build_leaves_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    """A build that fails: prepare() finishes its line with "failed", returns False with a warning (the eager path
    stays), and leaves no cache entry and no build directory behind for a later process to load."""
    _fake_compile(monkeypatch, [], fail=True)
    monkeypatch.setenv("WAFERLINE_KERNELS_DIR", str(tmp_path / "cache"))
    _as_if_unloaded(monkeypatch)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        assert not kernels.prepare()
    err = capsys.readouterr().err
    assert err.startswith(kernels.BUILDING) and "failed" in err
    assert not kernels.build_dir().exists() and not list((tmp_path / "cache").glob(".*.tmp-*"))
    assert "no compiler here" in str(kernels.status()["error"])


def test_a_build_waits_for_another_process_and_loads_its_library(tmp_path, monkeypatch):
    """Processes that start together take turns on the key's lock: one that finds another building waits, then loads
    the library that one made instead of building again; a lock whose holder was killed does not hold anyone up."""
    calls: list = []
    real = kernels.library()
    _fake_compile(monkeypatch, calls)
    monkeypatch.setenv("WAFERLINE_KERNELS_DIR", str(tmp_path / "cache"))
    d = kernels.build_dir()
    d.parent.mkdir(parents=True)
    lock = d.parent / f"{d.name}.lock"
    holder = subprocess.Popen([sys.executable, "-c", f"import fcntl, time\nf = open({str(lock)!r}, 'a')\n"
                               "fcntl.flock(f, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(120)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        got: list = []
        t = threading.Thread(target=lambda: got.append(kernels._built(False)), daemon=True)
        t.start()
        t.join(0.5)
        assert t.is_alive() and not calls  # waiting on the other process's build
        staged = d.parent / "staged"
        staged.mkdir()
        shutil.copyfile(real, staged / "waferline_cpu_ops.so")
        staged.rename(d)  # the other process's build, renamed into place
        holder.kill()  # killed while holding the lock: the system releases it
        t.join(30)
        assert got == [d / "waferline_cpu_ops.so"] and not calls
    finally:
        holder.kill()
        holder.wait()


def test_the_cache_key_covers_every_source_file_and_the_version(tmp_path, monkeypatch):
    """The cache entry's name changes with any byte of cpu_ops.cpp or of a part it includes (cpu/*.h) and with
    waferline's version, so a changed source or an upgrade never loads an older build."""
    pkg = tmp_path / "kernels"
    shutil.copytree(Path(kernels.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    monkeypatch.setattr(kernels, "_PKG", pkg)
    monkeypatch.setattr(kernels, "_SRC", pkg / "cpu_ops.cpp")
    assert {p.name for p in kernels.sources()} >= {"cpu_ops.cpp", "common.h", "gqa.h", "mla.h", "mamba.h"}
    seen = {kernels.build_dir()}
    for p in kernels.sources():
        p.write_bytes(p.read_bytes() + b"\n")
        seen.add(kernels.build_dir())
    monkeypatch.setattr(kernels, "__version__", "0.0.0-other")
    seen.add(kernels.build_dir())
    assert len(seen) == len(kernels.sources()) + 2


def test_the_package_ships_every_source_file():
    """pyproject's package data takes cpu_ops.cpp and every part it includes: an installed waferline can build them."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["waferline"]
    pkg = root / "src" / "waferline"
    def ships(rel: str, pattern: str) -> bool:  # as setuptools globs them: `*` within one path component
        a, b = rel.split("/"), pattern.split("/")
        return len(a) == len(b) and all(fnmatch.fnmatch(x, y) for x, y in zip(a, b))

    for p in kernels.sources():
        rel = p.resolve().relative_to(pkg).as_posix()
        assert any(ships(rel, pat) for pat in patterns), rel


def test_serve_prepares_the_operators_before_it_listens(monkeypatch):
    """`waferline serve` builds or loads the fused operators before it loads the model and listens: /health answers
    only once they are ready, and no request waits on their build."""
    import argparse
    import types

    import uvicorn

    from waferline.server import commands

    order: list = []
    monkeypatch.setattr(kernels, "prepare", lambda progress=True: order.append("prepare") or True)
    engine = types.SimpleNamespace(shutdown=lambda: order.append("shutdown"))
    server = types.SimpleNamespace(model_name="m", engine=engine)
    app = types.SimpleNamespace(state=types.SimpleNamespace(server=server))
    monkeypatch.setattr(commands, "build_server", lambda *a, **k: order.append("build_server") or app)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: order.append("listen"))
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "x"])
    assert args.func(args) == 0
    assert order == ["prepare", "build_server", "listen", "shutdown"]
