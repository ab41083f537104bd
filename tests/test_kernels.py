"""The fused CPU operators (waferline.kernels) compute what the eager chains they replace compute."""

from __future__ import annotations

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


@pytest.mark.parametrize("portable", [False, True])
def test_attention_of_a_nan_query_is_nan(portable):
    """A head whose query holds a NaN (every score NaN) gives NaN outputs in gqa_decode and mla_decode, as attend's
    softmax does, not the zeros of a head whose keys are all masked (the softmax's maximum skips NaN, so every score
    NaN looked like every key masked); the other heads are what they are without it, bitwise, and a row whose keys
    are all masked still gives zeros. Head sizes 32 (the AVX-512 kernel where the CPU has it) and 24 (the loop)."""
    from waferline.model.attention import attend_chain

    g = torch.Generator().manual_seed(8)
    prev = torch.ops.waferline.use_portable(portable)
    try:
        for D in (32, 24):
            for dtype in (torch.float32, torch.bfloat16):
                q = torch.randn(2, 1, 4, D, generator=g).to(dtype)
                kv = torch.randn(2, 19, 4, D, generator=g).to(dtype)
                blocked = torch.zeros(2, 1, 19, dtype=torch.bool)
                blocked[0, 0, 15:] = True
                blocked[1] = True  # row 1: every key masked
                clean = torch.ops.waferline.gqa_decode(q, kv, blocked, torch.empty(0), 0.2)
                q[0, 0, 1, 5] = float("nan")
                out = torch.ops.waferline.gqa_decode(q, kv, blocked, torch.empty(0), 0.2)
                ref = attend_chain(q[:1], kv[:1, :, :2], kv[:1, :, 2:], blocked[:1], 0.2)
                assert out[0, 0, 1].isnan().all() and ref[0, 0, 1].isnan().all(), (D, dtype)
                keep = torch.ones(4, dtype=torch.bool)
                keep[1] = False
                assert torch.equal(out[0, 0, keep], clean[0, 0, keep])
                assert not out[1].any()  # all masked: zeros
        B, T, H, n, p, r, v, L = 2, 1, 5, 16, 8, 64, 16, 21
        qn, qr = torch.randn(B, T, H, n, generator=g), torch.randn(B, T, H, p, generator=g)
        lat = torch.randn(B, L, r + p, generator=g)
        wuk, wuv = torch.randn(H, n, r, generator=g) * 0.1, torch.randn(H, v, r, generator=g) * 0.1
        blocked = torch.zeros(B, T, L, dtype=torch.bool)
        blocked[1] = True
        clean = torch.ops.waferline.mla_decode(qn, qr, lat, blocked, wuk, wuv, 0.1, torch.float32)
        qn[0, 0, 2, 3] = float("nan")
        out = torch.ops.waferline.mla_decode(qn, qr, lat, blocked, wuk, wuv, 0.1, torch.float32)
        assert out[0, 0, 2 * v:3 * v].isnan().all()
        others = torch.cat([torch.arange(2 * v), torch.arange(3 * v, H * v)])
        assert torch.equal(out[0, 0, others], clean[0, 0, others])
        assert not out[1].any()
    finally:
        torch.ops.waferline.use_portable(prev)


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



@pytest.mark.parametrize("portable", [False, True])
def test_attention_rows_do_not_depend_on_the_rows_beside_them(portable):
    """A decode step's attention over a batch takes every row's keys up to the batch's longest row, a shorter row's
    keys past its own end masked: its result is bitwise that row's alone (its own keys, no mask), for mla_decode
    and gqa_decode (with and without sinks), at lengths on both sides of the 16-key blocks. (The softmax's
    denominator, a vectorised sum grouped by the padded length, once moved a row by a float rounding: int4 sol
    decoded beside others drifted by up to ~1e-2 in log-probability over 24 tokens in bf16.)"""
    g = torch.Generator().manual_seed(12)
    prev = torch.ops.waferline.use_portable(portable)
    try:
        lengths = [3, 17, 40, 5, 31, 64]
        B, L = len(lengths), max(lengths)
        blocked = torch.arange(L).view(1, 1, L) >= torch.tensor(lengths).view(B, 1, 1)  # [B, 1, L]
        none = torch.empty(0, dtype=torch.bool)
        H, n, p, r, v = 4, 16, 8, 32, 16
        qn, qr = torch.randn(B, 1, H, n, generator=g), torch.randn(B, 1, H, p, generator=g)
        lat = torch.randn(B, L, r + p, generator=g)
        wuk, wuv = torch.randn(H, n, r, generator=g), torch.randn(H, v, r, generator=g)
        out = torch.ops.waferline.mla_decode(qn, qr, lat, blocked, wuk, wuv, 0.3, torch.float32)
        for b, lb in enumerate(lengths):
            one = torch.ops.waferline.mla_decode(qn[b:b + 1], qr[b:b + 1], lat[b:b + 1, :lb].contiguous(), none, wuk,
                                                 wuv, 0.3, torch.float32)
            assert torch.equal(one[0], out[b]), ("mla", lb)
        H, Hkv, D = 4, 2, 32
        q, kv = torch.randn(B, 1, H, D, generator=g), torch.randn(B, L, 2 * Hkv, D, generator=g)
        for sinks in (torch.empty(0), torch.randn(H, generator=g)):
            out = torch.ops.waferline.gqa_decode(q, kv, blocked, sinks, 0.2)
            for b, lb in enumerate(lengths):
                one = torch.ops.waferline.gqa_decode(q[b:b + 1], kv[b:b + 1, :lb].contiguous(), none, sinks, 0.2)
                assert torch.equal(one[0], out[b]), ("gqa", lb, sinks.numel())
    finally:
        torch.ops.waferline.use_portable(prev)

def test_mla_decode_refuses_rope_queries_of_other_rows():
    """waferline::mla_decode reads q_rope at q_nope's [B, T, H]: a q_rope of other leading sizes is refused with a
    clear error (it read past q_rope's end: other memory's values in the output), as are weights of another rank."""
    g = torch.Generator().manual_seed(9)
    B, T, H, n, p, r, v, L = 2, 3, 4, 16, 8, 32, 16, 5
    qn, qr = torch.randn(B, T, H, n, generator=g), torch.randn(B, T, H, p, generator=g)
    lat = torch.randn(B, L, r + p, generator=g)
    wuk, wuv = torch.randn(H, n, r, generator=g), torch.randn(H, v, r, generator=g)
    none = torch.empty(0, dtype=torch.bool)
    assert torch.ops.waferline.mla_decode(qn, qr, lat, none, wuk, wuv, 0.1, torch.float32).shape == (B, T, H * v)
    for short in (qr[:1].clone(), qr[:, :1].clone(), qr[:, :, :1].clone()):
        with pytest.raises(RuntimeError, match="q_rope must be"):
            torch.ops.waferline.mla_decode(qn, short, lat, none, wuk, wuv, 0.1, torch.float32)
    with pytest.raises(RuntimeError, match="bad ranks"):
        torch.ops.waferline.mla_decode(qn, qr, lat, none, wuk[..., None], wuv, 0.1, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_over_no_inputs_are_zero(dtype):
    """linear_rows and int8_linear over K = 0 inputs return zeros (F.linear's empty sums), not uninitialised memory."""
    x = torch.randn(3, 0).to(dtype)
    for _ in range(3):  # (fresh allocations: uninitialised memory shows in some of them)
        torch.randn(64, 64).mul_(1e30)
        assert torch.equal(torch.ops.waferline.linear_rows(x, torch.empty(5, 0, dtype=dtype)),
                           torch.zeros(3, 5, dtype=dtype))
        assert torch.equal(torch.ops.waferline.int8_linear(x, torch.empty(5, 0, dtype=torch.int8), torch.ones(5)),
                           torch.zeros(3, 5))
