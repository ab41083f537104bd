"""The planner's and the simulator's AFD layout against the engine's: what an attention rank and an FFN rank hold, and
what one micro-batch's round trip through a layer waits for."""

import json
import math

import pytest
import torch

import tiny_models
from waferline.plan.place import expert_split, ffn_owner, place
from waferline.sim.cost import layer_table, load_params
from waferline.sim.pipeline import _afd_hop, _afd_node_shares, _Ctx, simulate
from waferline.spec.catalog import load_hardware, load_model
from waferline.spec.model import MoESpec


def test_attention_ranks_hold_the_routers_and_ffn_norms():
    """docs/afd.md: an attention rank holds the embedding, every mixer with its norm, every FFN pre-norm, every MoE
    router, the final norm and LM head; an FFN rank its experts and the shared experts / dense FFN it owns."""
    spec = load_model("deepseek-v3")
    M, N, wb = 2, 4, 8
    plan = place("deepseek-v3", "h200-sxm", afd=True, attention_ranks=M, ffn_ranks=N, batch=8, weight_bits=wb)
    routers = sum(layer.ffn.router_params() for layer in spec.layers if isinstance(layer.ffn, MoESpec))
    att = spec.embed_bytes(16) + spec.lm_head_bytes(16) + sum(
        layer.mixer_weight_bytes(wb) + layer.hidden_size * 2 for layer in spec.layers) + routers * 2
    a = plan.stages[0]
    assert a.memory.weights * a.num_devices == pytest.approx(att, rel=1e-12)
    for n in range(N):
        held = 0.0
        for layer in spec.layers:
            f, own = layer.ffn, ffn_owner(layer.index, N) == n
            if isinstance(f, MoESpec):
                e0, e1 = expert_split(f.num_experts, N)[n]
                held += (e1 - e0) * f.expert_bytes(wb)
                if own:
                    held += layer.ffn_weight_bytes(wb) - f.num_experts * f.expert_bytes(wb) - (
                        layer.hidden_size + f.router_params()) * 2
            elif own:
                held += layer.ffn_weight_bytes(wb) - layer.hidden_size * 2
        s = plan.stages[M + n]
        assert s.memory.weights * s.num_devices == pytest.approx(held, rel=1e-12)


def test_attention_rank_bytes_are_what_the_engine_loads(tmp_path):
    from waferline.engine.afd import load_attention_side

    d = tmp_path / "dsv3"
    tiny_models.build("deepseek_v3", d)
    plan = place(str(d), "h200-sxm", afd=True, attention_ranks=2, ffn_ranks=2, batch=2)
    model, fronts = load_attention_side(d, torch.bfloat16)
    loaded = 2 * (sum(p.numel() for p in model.parameters())
                  + sum(p.numel() for f in fronts.values() for p in f.parameters()))
    a = plan.stages[0]
    # (the routers' correction biases are buffers, not parameters: 8 experts x 2 MoE layers, 16-bit)
    assert 0 <= a.memory.weights * a.num_devices - loaded <= 8 * 2 * 2


def test_a_dense_layer_waits_for_its_owner_whole():
    """A dense layer's FFN runs on one FFN rank (its owner): more FFN ranks do not shorten a micro-batch's round
    trip, so with one micro-batch (each side idle while the other works) the step does not depend on N."""
    steps = []
    for N in (1, 2, 4):
        plan = place("llama-3.1-8b", "h200-sxm", afd=True, attention_ranks=1, ffn_ranks=N, batch=8, micro_batches=1)
        steps.append(simulate(plan, prompt_len=1000, output_len=500).step_latency_s)
    assert steps[1] == pytest.approx(steps[0], rel=1e-9) and steps[2] == pytest.approx(steps[0], rel=1e-9)
    # with two micro-batches the FFN ranks take turns by layer, and the round trip still binds
    two = place("llama-3.1-8b", "h200-sxm", afd=True, attention_ranks=1, ffn_ranks=4, batch=8)
    assert simulate(two, prompt_len=1000, output_len=500).step_latency_s > steps[0] / 2


def test_messages_carry_the_routed_rows_and_the_shared_experts_batch():
    """Per layer an attention rank sends an FFN rank its routed rows, and the layer's owner the whole micro-batch
    only where there are shared experts (qwen3-30b-a3b has none; DeepSeek-V3 one)."""
    params = load_params()
    for model, shared_rows in (("qwen3-30b-a3b", False), ("deepseek-v3", True)):
        spec, hw = load_model(model), load_hardware("h200-sxm")
        M, N, B = 2, 4, 16
        plan = place(model, hw, afd=True, attention_ranks=M, ffn_ranks=N, batch=B, weight_bits=8)
        r = simulate(plan, prompt_len=1000, output_len=500)
        ctx = _Ctx(plan, spec, hw, params.for_hardware(hw), params)
        att = [s for s in plan.stages if s.role == "attention"]
        shares = _afd_node_shares(ctx, att, [s for s in plan.stages if s.role == "ffn"])
        K, bm, D = r.micro_batches, math.ceil(B / M / r.micro_batches), spec.hidden_size
        want = 0.0
        for lc in layer_table(spec, 8, 16, 1250):
            rows = bm * (lc.top_k / N if lc.is_moe else 1.0)
            if lc.is_moe and shared_rows:
                rows += bm
            want += K * 2 * _afd_hop(ctx, shares, rows * D * 2.0)
        assert r.stages[0].hop == pytest.approx(want, rel=1e-9)


def test_a_wafer_attention_rank_counts_its_lm_head_resident():
    """On a wafer every layer of a stage is read at its region's share of the bandwidth (``cost.stage_step``): an
    attention rank's resident bytes include the LM head it holds, as a pipeline stage's do. The regions are laid out
    for the plan's context (4,096 tokens here); each reads the cache it holds at the workload's."""
    spec, hw = load_model("qwen3-30b-a3b"), load_hardware("wse-3")
    B = 8
    plan = place("qwen3-30b-a3b", hw, afd=True, attention_ranks=1, ffn_ranks=2, batch=B)
    r = simulate(plan, prompt_len=1000, output_len=500)
    prm = load_params().for_hardware(hw)
    table = layer_table(spec, 16, 16, 1000 + 250)
    regions = layer_table(spec, 16, 16, plan.context_len)
    head = spec.lm_head_bytes(16)
    room = [lc.mixer_bytes + rg.cache_bytes * B for lc, rg in zip(table, regions)]
    resident = sum(room) + head
    a = r.stages[0]
    bw = hw.memory_bandwidth * prm.bw_eff
    want = sum(resident * (lc.mixer_bytes + lc.cache_bytes * B) / x for lc, x in zip(table, room)) / a.devices / bw
    assert a.memory == pytest.approx(r.micro_batches * want, rel=1e-9)


def test_the_transfers_lever_counts_one_micro_batch_on_the_steps_path():
    """The K micro-batches' transfers overlap one another: the step needs one micro-batch's to fit, not all K (it
    said the transfers had to fall 3.31x for 2,000 tok/s per user, where 1.9x faster hops, the rest 10x, gave
    2,028); and the bound never calls a side more than 100% busy."""
    from dataclasses import replace

    from waferline.sim.explain import explain

    plan = place("qwen3-30b-a3b", "wse-3", afd=True, attention_ranks=2, ffn_ranks=4, batch=8)
    params = load_params()
    r = simulate(plan, params=params)
    assert r.bound == "AFD: round-trip latency (micro-batches too small to hide it)"
    lever = next(lv for lv in explain(r, 2000.0)["target"]["levers"] if lv["term"] == "attention-FFN transfers")
    terms = ("weights and cache read", "compute", "fixed per layer", "mesh streaming", "mesh distance", "collectives")
    faster = replace(params, speedup={**{t: 10.0 for t in terms}, "device hops": 1.9})
    assert simulate(plan, params=faster).decode_tokens_per_s_per_user >= 2000.0
    assert lever["factor"] <= 1.9 and lever["to_s"] == pytest.approx(2 / 2000.0, rel=1e-9)


def _engine_prefill_steps(B, P, K, chunk):
    """The prefill steps AFD's scheduler runner sends one attention rank for ``B`` fresh prompts of ``P`` tokens
    (engine/afd/serving.py AFDRunner._rows, then driver.py AFD._micro_batches), run on stubs in place of the ranks: per
    step, each micro-batch's groups as (rows, tokens, latest start)."""
    from types import SimpleNamespace

    from waferline.engine.afd.driver import AFD
    from waferline.engine.afd.serving import AFDRunner
    from waferline.engine.runner import WANT_ARGMAX

    pipe = SimpleNamespace(M=1, prefill_chunk=chunk, micro_batches=K, _mb_ids=0, _rank_of=lambda i: 0)
    pipe._micro_batches = lambda rows, verify=(): AFD._micro_batches(pipe, rows, verify)
    steps = []

    def step(per, verify, rewinds, pages):
        mbs, _ = pipe._micro_batches(per[0], verify)
        steps.append([[(len(g.seqs), g.T, max(g.starts)) for g in mb.groups] for mb in mbs if mb.groups])
        return [], {}

    runner = AFDRunner.__new__(AFDRunner)
    runner.pipe, runner._rewinds, runner._keep_hidden = pipe, [], False
    runner._guard, runner._step, runner._page_changes = (lambda f: f()), step, (lambda rows: [])
    runner._rows([(b, 0, list(range(P)), WANT_ARGMAX, b) for b in range(B)], 0, ())
    return steps


@pytest.mark.parametrize("B,P,K", [(8, 48, 2), (4, 100, 2), (8, 100, 2), (8, 100, 1), (4, 300, 2), (8, 130, 2),
                                   (8, 32, 2), (3, 20, 4), (2, 384, 2), (4, 640, 3)])
def test_afd_prefill_steps_are_the_engines(B, P, K):
    """The host model's AFD prefill steps (sim afd_prefill_steps) are the engine's: a rank's prompts packed in steps of
    its prefill chunk, a prompt split where one ends, each step's rows split in its micro-batches by tokens, each
    micro-batch's group at its own rows' latest position (two prompts' pieces of one length, one a prompt's tail and
    one a prompt's start, in two micro-batches were both priced at the tail's)."""
    from waferline.sim.host_work import afd_prefill_steps

    assert afd_prefill_steps(B, P, 256, K) == _engine_prefill_steps(B, P, K, 256)


@pytest.mark.parametrize("B,P", [(8, 130), (8, 100), (4, 300), (8, 48)])
def test_afd_ttft_prices_the_forwards_the_engine_runs(B, P):
    """An AFD TTFT is priced from the prefill forwards the engine runs (rows, tokens, position of each group of each
    micro-batch of each step: 8 prompts of 130 tokens run as 5 steps of 256 tokens), not from r = 256 // P whole
    prompts a step (8 steps of one prompt), which missed the engine's TTFT by 0.6-1.3x on prompts that do not divide
    256. (sol-mini's AFD Plan of the stored twin result, on an op profile that records what it is asked.)"""
    from pathlib import Path

    from waferline.plan.plan import Plan
    from waferline.sim.host import HostParams, simulate_host
    from waferline.sim.host_work import OpCount, Work
    from waferline.spec.configs import spec_from_pretrained
    from waferline.spec.hardware import load_hardware_file

    root = Path(__file__).resolve().parents[1]
    res = root / "benchmarks" / "results"
    row = next(r for r in json.loads((res / "twin_sol-mini.json").read_text())["rows"] if r["point"]["afd"])
    plan = Plan.from_json(row["plan_json"])
    spec = spec_from_pretrained(root / "models" / "sol-mini")
    L = spec.num_layers

    class Spy:
        def __init__(self):
            self.asked = []

        def decode(self, rows, tokens):
            return OpCount({i: Work(100.0) for i in range(L)}, Work(50.0))

        def ffn(self, phase):
            return {i: Work(40.0) for i in range(L)}

        def prefill(self, rows, tokens):
            return self.prefill_chunk(rows, tokens, 0)

        def prefill_chunk(self, rows, tokens, start):
            self.asked.append((rows, tokens, start))
            return OpCount({i: Work(100.0 + rows * tokens) for i in range(L)}, Work(50.0))

    spy = Spy()
    simulate_host(plan, spec, load_hardware_file(res / "twin_host.yaml"), HostParams.load(res / "twin_host.yaml"),
                  spy, prompt_len=P, output_len=8, concurrency=B)
    engine = [g for step in _engine_prefill_steps(B, P, plan.micro_batches, 256) for mb in step for g in mb]
    assert sorted(spy.asked) == sorted(engine)
