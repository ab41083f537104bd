"""The decode fast paths (views for consecutive slots, shared per-step tables, one-token MoE, fp32 attention on CPU,
int8 LM head) compute the same thing as the general paths they short-cut."""

from __future__ import annotations

import pytest
import torch

from tiny_models import build, decode_logits
from waferline import kernels
from waferline.errors import ConfigError
from waferline.model.context import StepBatch
from waferline.model.layers import Rotary
from waferline.model.load import load_model


@pytest.mark.parametrize("model_type", ["deepseek_v3", "nemotron_h", "gpt_oss", "qwen3_moe"])
def test_slot_layouts_agree(tmp_path, model_type, one_thread):
    """Consecutive slots (cache views, in-place state updates), scattered slots (gather/scatter) and one sequence at a
    time (no mask at all) give the same logits, with ragged and with equal lengths."""
    build(model_type, tmp_path)
    model = load_model(tmp_path, torch.float32)
    g = torch.Generator().manual_seed(1)
    for lens in ((7, 12), (9, 9)):
        prompts = [torch.randint(3, 120, (n,), generator=g).tolist() for n in lens]
        with torch.inference_mode():
            together = decode_logits(model, prompts, [0, 1], 2)
            scattered = decode_logits(model, prompts, [3, 1], 4)
            alone = torch.stack([decode_logits(model, [p], [0], 1)[:, 0] for p in prompts], dim=1)
        torch.testing.assert_close(scattered, together, rtol=0, atol=1e-5)
        torch.testing.assert_close(alone, together, rtol=0, atol=1e-5)


def test_rotary_tables_are_shared_only_between_equal_rotaries():
    batch = StepBatch.make([0, 1], [5, 9], 2)
    a = Rotary(16, {"rope_theta": 10000.0})
    b = Rotary(16, {"rope_theta": 10000.0})
    c = Rotary(16, {"rope_theta": 500000.0})
    ca = a.cos_sin(batch.positions(), batch)
    assert b.cos_sin(batch.positions(), batch)[0] is ca[0]  # computed once per step
    cc = c.cos_sin(batch.positions(), batch)
    assert not torch.allclose(cc[0], ca[0])
    torch.testing.assert_close(cc[0], c.cos_sin(batch.positions())[0])  # the memo returns what a fresh computation does


def test_one_token_moe_path_matches_sorted_path(tmp_path, one_thread):
    build("deepseek_v3", tmp_path)
    model = load_model(tmp_path, torch.float32)
    moe = next(l.ffn for l in model.layers if type(l.ffn).__name__ == "MoE")
    x = torch.randn(3, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        w, idx = moe.route(x)
        batched = moe.experts_forward(x, w, idx)  # N = 3: the sorted path
        one_by_one = torch.cat([moe.experts_forward(x[i: i + 1], w[i: i + 1], idx[i: i + 1]) for i in range(3)])
    torch.testing.assert_close(one_by_one, batched, rtol=0, atol=1e-6)


@pytest.mark.skipif(not kernels.available(), reason="fused CPU operators not built")
@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe", "llama"])
@pytest.mark.parametrize("variant", ["bf16", "int4"])
def test_attention_layers_run_as_one_op(tmp_path, monkeypatch, model_type, variant, one_thread):
    """Decode steps and verifies of DeepSeek-V3 (MLA), Qwen3-MoE and Llama (GQA) layers, bf16 or int4, run each layer
    as one op (mla_moe_layer / gqa_moe_layer: the attention block with int4 or dense bf16 projections, the FFN in
    ffn_residual, the dense FFNs' bf16 weights too) up to few_rows() bf16 rows, so the step plan holds: bitwise the
    logits and greedy tokens of the modules (the same kernels: linear_rows or int4_linear, rms_norm, rope, the
    attention op), step after step, for 1, 2 and few_rows() rows, rows at different positions and a 2-token verify.
    More bf16 rows than few_rows() keep the modules (where oneDNN multiplies them). On AVX512-BF16 CPUs a bf16 GQA
    layer's op runs both halves on thread teams (the attention's and the FFN's, dense or MoE)."""
    from waferline.model.attention import GQAttention, MLAttention
    from waferline.model.layers import few_rows
    from waferline.model.moe import DenseFFN
    from waferline.model.quant import QuantOptions, quantize_model

    build(model_type, tmp_path, **({"q_lora_rank": 64} if model_type == "deepseek_v3" else {}))  # (int4 groups of 32)
    model = load_model(tmp_path, torch.bfloat16)
    if variant == "int4":
        quantize_model(model, QuantOptions(group_size=32))
    if model_type == "deepseek_v3":
        assert any(type(layer.ffn) is DenseFFN for layer in model.layers)  # (the dense first layer is covered)
    fused = {(MLAttention, "_int4_block"): MLAttention._int4_block, (GQAttention, "_block"): GQAttention._block,
             (DenseFFN, "residual_args"): DenseFFN.residual_args}
    V, most = model.spec.vocab_size, few_rows(torch.bfloat16) if variant == "bf16" else 8
    dense_teams = variant == "bf16" and "avx512_bf16" in kernels._cpu_flags().split()  # (the bf16 kernel's teams)

    def use(on: bool) -> None:
        for (cls, name), f in fused.items():
            monkeypatch.setattr(cls, name, f if on else lambda self, *a: None)

    def step(tokens: torch.Tensor, pos: list[int], sets: dict) -> torch.Tensor:
        got = {}
        B, T = tokens.shape
        for on, caches in sets.items():
            use(on)
            teams = torch.ops.waferline.team_halves()
            got[on] = model.step_logits(tokens, caches, StepBatch.make(list(range(B)), pos, T), argmax=True)
            if on:  # (every layer one op: the step recorded a plan)
                planned = any(p is not None for p in model.__dict__.get("_step_plans", {}).values())
                assert planned == (B * T <= most), (B, T)
                if dense_teams and model_type != "deepseek_v3" and B * T <= most:  # both GQA halves on teams
                    assert torch.ops.waferline.team_halves() - teams >= 2 * len(model.layers), (B, T)
        assert all(torch.equal(a, b) for a, b in zip(got[True], got[False])), (B, T, pos)
        return got[True][2]

    for B in sorted({1, 2, most, most + 1}):
        model.__dict__.pop("_step_plans", None)
        sets = {True: model.new_caches(B), False: model.new_caches(B)}
        lens = [11 + 2 * (b % 2) for b in range(B)]  # (odd rows two tokens ahead: rows at different positions)
        with torch.inference_mode():
            for on, caches in sets.items():
                use(on)
                for b in range(B):
                    model((torch.arange(3, 3 + lens[b])[None] * (b + 1)) % V, caches, StepBatch.make([b], [0], lens[b]))
            pos, tok = list(lens), torch.arange(5, 5 + B)[:, None]
            for _ in range(3):
                tok, pos = step(tok, pos, sets), [p + 1 for p in pos]
            if 2 * B <= most:  # a verify: 2 tokens per row (its tokens go in as rows)
                step(torch.cat([tok, tok + 1], dim=1), pos, sets)


def test_bf16_attention_close_to_fp32(tmp_path, one_thread):
    """16-bit models compute the attention matmuls in fp32 on CPU; the logits stay within bf16 rounding of fp32."""
    build("deepseek_v3", tmp_path)
    prompts = [[5, 9, 33, 71, 2 + 3, 8, 100], [40, 41, 42]]
    with torch.inference_mode():
        ref = decode_logits(load_model(tmp_path, torch.float32), prompts, [0, 1], 2, steps=2)
        bf = decode_logits(load_model(tmp_path, torch.bfloat16), prompts, [0, 1], 2, steps=2)
    assert (bf - ref).abs().max() < 0.05 * ref.abs().max()


def test_int8_head(tmp_path, one_thread):
    build("llama", tmp_path)
    model = load_model(tmp_path, torch.float32)
    h = torch.randn(4, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model.logits(h)
        model.quantize_head(8)
        assert model.lm_head is None and model.lm_head_int8.dtype == torch.int8
        q = model.logits(h)
    err = (q - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.02  # quantized (not the same numbers), but close
    with pytest.raises(ConfigError, match="head_bits"):
        load_model(tmp_path, torch.float32).quantize_head(4)


@pytest.mark.parametrize("width", [64, 40])
def test_int8_head_any_width(tmp_path, width, one_thread):
    """The int8 LM head over states whose width is and is not a multiple of 16 (ATen's int8pack kernel reads garbage
    for the latter, so those take the dequantized product): within the int8 error of the 16-bit head's."""
    build("llama", tmp_path)
    model = load_model(tmp_path, torch.float32)
    g = torch.Generator().manual_seed(0)
    model.lm_head = torch.nn.Parameter(torch.randn(model.spec.vocab_size, width, generator=g), requires_grad=False)
    hn = torch.randn(3, width, generator=g)
    with torch.inference_mode():
        ref = model.project(hn)
        model.quantize_head(8)
        q = model.project(hn)
    err = (q - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.02


def test_llm_head_bits(tmp_path, one_thread):
    from waferline import LLM

    build("llama", tmp_path)
    with pytest.raises(ConfigError, match="head_bits"):
        LLM(tmp_path, head_bits=5)
    llm = LLM(tmp_path, head_bits=8)
    assert llm.model.lm_head is None
    assert (
        len(
            llm.generate([[5, 6, 7]], __import__("waferline").SamplingParams(max_tokens=4, ignore_eos=True))[
                0
            ].token_ids
        )
        == 4
    )


def test_causal_depthwise_conv_is_the_depthwise_conv1d():
    """The Mamba-2 prefill's conv as K shifted multiply-adds: F.conv1d's last T outputs (fp32 to float rounding; bf16
    within one rounding of the fp32 result of the same bf16 inputs), with and without a bias."""
    import torch.nn.functional as F

    from waferline.model.ssm import causal_depthwise_conv

    g = torch.Generator().manual_seed(5)
    C, K, T = 24, 4, 7
    full = torch.randn(2, C, K - 1 + T, generator=g)
    w, b = torch.randn(C, K, generator=g), torch.randn(C, generator=g)
    for bias in (None, b):
        ref = F.conv1d(full, w[:, None, :], bias, groups=C)
        torch.testing.assert_close(causal_depthwise_conv(full, w, bias, T), ref, rtol=1e-6, atol=1e-6)
        f16, w16 = full.bfloat16(), w.bfloat16()
        ref16 = F.conv1d(
            f16.float(), w16.float()[:, None, :], None if bias is None else bias.bfloat16().float(), groups=C
        )
        out = causal_depthwise_conv(f16, w16, None if bias is None else bias.bfloat16(), T)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref16, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("variant", ["bf16", "int4"])
def test_weights_in_huge_pages_compute_the_same(tmp_path, variant, one_thread):
    """move_to_huge_pages (model/arena.py) puts every weight of a model in one huge-page region: the same logits bit
    for bit and the same greedy tokens, every moved tensor inside the region, argument caches rebuilt on the new
    tensors, a second call moving nothing; a tensor two modules share stays one tensor."""
    from waferline import LLM, SamplingParams
    from waferline.model.arena import huge_pages_possible, move_to_huge_pages

    if not huge_pages_possible():
        pytest.skip("no transparent huge pages on this machine (THP 'never' or not Linux)")
    build("deepseek_v3", tmp_path)
    llm = LLM(tmp_path, dtype="bfloat16", weight_bits=16 if variant == "bf16" else 4, huge_pages=False)
    assert llm.arena is None
    seq = [5, 9, 14, 3, 7, 21, 2]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before, toks = llm.prompt_logprobs(seq), llm.generate([seq, seq[:3]], params)

    def tensors():  # every parameter and buffer (state_dict() leaves out the non-persistent buffers)
        return {name: t.data_ptr() for name, t in [*llm.model.named_parameters(), *llm.model.named_buffers()]}

    old = tensors()
    arena = move_to_huge_pages(llm.model, min_bytes=1)
    assert arena is not None and arena.tensors > 0 and arena.end - arena.start == arena.nbytes
    moved = tensors()
    inside = [name for name, p in moved.items() if arena.start <= p < arena.end]
    assert len(inside) == arena.tensors and all(old[n] != moved[n] for n in inside)
    assert torch.equal(llm.prompt_logprobs(seq), before)
    assert [o.token_ids for o in llm.generate([seq, seq[:3]], params)] == [o.token_ids for o in toks]
    assert 0 <= (arena.huge_bytes() or 0) <= arena.nbytes
    assert move_to_huge_pages(llm.model, min_bytes=1) is None  # (views of the arena stay: nothing is copied twice)

    shared = torch.nn.Linear(64, 64, bias=False)
    root = torch.nn.ModuleDict({"a": torch.nn.Sequential(shared), "b": torch.nn.Sequential(shared)})
    w = shared.weight.detach().clone()
    assert move_to_huge_pages(root, min_bytes=1).tensors == 1
    assert root["a"][0].weight is root["b"][0].weight and torch.equal(root["a"][0].weight, w)


def test_no_huge_pages_moves_nothing(tmp_path, monkeypatch):
    """Where the kernel gives no transparent huge pages (THP 'never'), nothing moves; the LLM's arena is None."""
    from waferline import LLM
    from waferline.model import arena

    thp = tmp_path / "enabled"
    thp.write_text("always madvise [never]\n")
    monkeypatch.setattr(arena, "THP_ENABLED", thp)
    assert arena.thp_mode() == "never" and not arena.huge_pages_possible()
    lin = torch.nn.Linear(256, 256)
    w = lin.weight
    assert arena.move_to_huge_pages(lin, min_bytes=1) is None and lin.weight is w
    build("llama", tmp_path / "ckpt")
    assert LLM(tmp_path / "ckpt").arena is None
    monkeypatch.setattr(arena, "THP_ENABLED", tmp_path / "missing")
    assert arena.thp_mode() is None
