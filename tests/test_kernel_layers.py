"""Whole-layer fused operators, the fused MoE FFN and the replayed step program compute what the modules compute."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from tiny_models import build, decode_logits
from waferline import kernels
from waferline.model.context import StepBatch
from waferline.model.load import load_model

SOL_MINI = Path(__file__).resolve().parents[1] / "models" / "sol-mini"

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"fused CPU operators not built: {kernels.status()['error']}")


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
                    a.flush(), b.flush()  # (a paged cache's entries still in a staging copy go to their pages)
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
    hooks put the modules' FFN ops, an MoE router's under the layer's (AFD routes on the attention side); no more ops
    than the modules' path."""
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


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "modules"])
def test_the_twin_counts_an_moe_router_as_its_layers_part(tmp_path, monkeypatch, one_thread, fused):
    """AFD's attention ranks route their tokens (engine/afd/): the twin's op counts put an MoE router's work under its
    layer, not under the FFN part the FFN ranks run (it was under the FFN's, in the fused layer operators and the
    modules' path alike)."""
    from waferline.model.moe import MoE
    from waferline.model.quant import QuantOptions, quantize_model
    from waferline.sim.calibrate.opcount import OpCounter
    from waferline.sim.twin_engine import label_layers

    build("qwen3_moe", tmp_path)
    model = load_model(tmp_path, torch.bfloat16)
    quantize_model(model, QuantOptions(group_size=32))
    routed: list = []
    account = OpCounter._account

    def spy(self, name, lab, *a, **kw):  # noqa: ANN001 - a fused layer operator's routing part
        if name == "moe_route":
            routed.append(lab)
        return account(self, name, lab, *a, **kw)

    route = MoE.route

    def routing(self, x):  # noqa: ANN001 - the modules' path: the label its ops are counted under
        routed.append(c.label)
        return route(self, x)

    monkeypatch.setattr(OpCounter, "_account", spy)
    monkeypatch.setattr(MoE, "route", routing)
    c = OpCounter()
    hooks = label_layers(model, c)
    prev = kernels.use(fused)
    try:
        caches = model.new_caches(3)
        with torch.inference_mode(), c:
            for b, k in enumerate((5, 9, 7)):
                model(torch.arange(3, 3 + k)[None], caches, StepBatch.make([b], [0], k))
            x = torch.arange(3, 6)[:, None]
            model(x, caches, StepBatch.make([0, 1, 2], [5, 9, 7], 1))
    finally:
        kernels.use(prev)
        for h in hooks:
            h.remove()
    assert routed and all(isinstance(lab, int) for lab in routed), routed
    assert "route" not in model.layers[-1].ffn.__dict__  # (removed with the hooks)


def _counted_layer_parts(model, layer, monkeypatch):
    from waferline.model.decoder import LABEL_ONLY, DecoderLayer
    from waferline.sim.calibrate.opcount import OpCounter, _priced_calls
    from waferline.sim.twin_engine import _RouteAsLayer

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
        if callable(getattr(layer.ffn, "route", None)):  # (the router: the layer's part, as AFD routes)
            hooks.append(_RouteAsLayer(layer.ffn, c, "layer"))
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


def test_moe_ffn_of_one_token_routed_twice_to_an_expert():
    """One token whose row of idx names an expert twice goes through it twice (two rows, each weighted), as two
    tokens' rows do: not one row read as two (the second past the end of the expert's output)."""
    g = torch.Generator().manual_seed(0)
    D, I, E = 64, 32, 4
    gu, dn = torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g)
    x = torch.randn(1, D, generator=g)
    none = torch.empty(0)

    def moe(x, weights, idx):
        return torch.ops.waferline.moe_ffn(x, weights, idx, gu, none, dn, none, none, none, none, none, 0, I, 0)

    once = moe(x, torch.ones(1, 1), torch.tensor([[2]]))
    twice = moe(x, torch.tensor([[0.5, 0.25]]), torch.tensor([[2, 2]]))
    torch.testing.assert_close(twice, 0.75 * once)
    pair = moe(torch.cat([x, x]), torch.tensor([[0.5, 0.25]] * 2), torch.tensor([[2, 2]] * 2))
    assert torch.equal(twice[0], pair[0])


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_int4_sequence_decodes_beside_others_as_alone(tmp_path, dtype, one_thread):
    """A prompt of a random int4 sol (MLA + MoE, groups of 32: the fp32 int4 kernel) decoded beside 1..7 others (a
    step of up to MLA_FUSED_MAX_ROWS rows) gets the log-probabilities it gets alone: within 1e-5 in fp32 (the LM
    head's GEMM differs by a rounding with its row count), bitwise in bf16. Its int4 products summed each row in
    chains that depended on the row count, and the attention's softmax on the batch's longest row: 1e-4 in fp32
    and 8e-3 in bf16 over these 24 tokens."""
    import random

    from waferline.demo import DEMO_TEXT, SOL_DEMO_CONFIG, write_tokenizer
    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams
    from waferline.model.init import write_random_checkpoint

    cfg = dict(SOL_DEMO_CONFIG, num_hidden_layers=2, mixer_types=["mla", "mla"], ffn_types=["moe", "moe"])
    write_random_checkpoint(cfg, tmp_path, seed=0 if dtype == "float32" else 1)  # (seeds where it showed)
    write_tokenizer(tmp_path, DEMO_TEXT, cfg["vocab_size"])
    llm = LLM(tmp_path, dtype=dtype, weight_bits=4, group_size=32)
    rng = random.Random(1)
    prompts = [[1] + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 12))] for _ in range(8)]
    sp = SamplingParams(max_tokens=24, logprobs=0)
    for p in (0, 2):
        alone = llm.generate([prompts[p]], sp)[0]
        for n in range(1, 8):
            out = llm.generate([prompts[p]] + [q for i, q in enumerate(prompts) if i != p][:n], sp)[0]
            assert out.token_ids == alone.token_ids, (p, n)
            diff = max(abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, alone.logprobs))
            assert diff <= (1e-5 if dtype == "float32" else 0.0), (p, n, diff)
