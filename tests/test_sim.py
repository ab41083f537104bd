"""Simulator physics: batch-1 latency sums all stages, wafers are latency-bound, speculative decoding, concurrency."""

import subprocess
import sys

import pytest

from waferline.plan.place import place
from waferline.plan.plan import SpeculativeConfig
from waferline.sim.cost import ClassParams, SimParams, expected_tokens_per_step, load_params
from waferline.sim.pipeline import simulate
from waferline.spec.catalog import load_hardware, load_model


def test_batch1_token_latency_is_the_sum_over_stages_and_hops():
    """GenZ / llm-analysis bug: one stage's latency reported as the per-token latency."""
    plan = place("llama-3.1-70b", "wse-3", devices=4)
    r = simulate(plan, prompt_len=128, output_len=128)
    assert r.num_stages == 4
    assert r.step_latency_s == pytest.approx(sum(s.total for s in r.stages), rel=1e-9)
    assert r.decode_tokens_per_s_per_user == pytest.approx(1.0 / r.step_latency_s, rel=1e-9)
    assert all(s.hop > 0 for s in r.stages)
    # twice the stages at batch 1 must not double one user's speed (the per-stage bug would)
    r8 = simulate(place("llama-3.1-70b", "wse-3", devices=8), prompt_len=128, output_len=128)
    assert r8.decode_tokens_per_s_per_user < 1.3 * r.decode_tokens_per_s_per_user


def test_wafer_decode_is_latency_bound_not_roofline():
    """Roofline peers predict ~0.002-0.02 ms/token for 70B on 4 WSE-3; Cerebras measured ~2.2 ms."""
    spec = load_model("llama-3.1-70b")
    hw = load_hardware("wse-3")
    roofline_s = spec.weight_bytes(16) / (4 * hw.memory_bandwidth)
    r = simulate(place(spec, hw, devices=4), prompt_len=128, output_len=128)
    assert r.bound.startswith("latency")
    assert 1.0 / r.decode_tokens_per_s_per_user > 25 * roofline_s
    assert 200 < r.decode_tokens_per_s_per_user < 1000
    latency = sum(s.fixed + s.hop + s.fabric for s in r.stages)  # per-layer constant, wafer hops, the mesh
    assert latency > 0.8 * r.step_latency_s


def test_gpu_decode_is_bandwidth_bound():
    r = simulate(place("llama-3.1-8b", "h100-sxm", devices=1), prompt_len=128, output_len=128)
    assert r.bound == "memory bandwidth"
    assert 100 < r.decode_tokens_per_s_per_user < 250


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens_per_step(0.8, 3) == pytest.approx((1 - 0.8 ** 4) / 0.2)
    assert expected_tokens_per_step(1.0, 5) == 6.0


@pytest.mark.parametrize("method", ["draft", "mtp", "eagle", "medusa", "ngram"])
def test_speculation_helps_with_good_acceptance_and_hurts_with_none(method):
    base = simulate(place("llama-3.1-70b", "h200-sxm", devices=8), prompt_len=256, output_len=256)
    good = simulate(place("llama-3.1-70b", "h200-sxm", devices=8, speculative=SpeculativeConfig(method, 4, 0.9)),
                    prompt_len=256, output_len=256)
    bad = simulate(place("llama-3.1-70b", "h200-sxm", devices=8, speculative=SpeculativeConfig(method, 4, 0.0)),
                   prompt_len=256, output_len=256)
    assert good.decode_tokens_per_s_per_user > 1.5 * base.decode_tokens_per_s_per_user
    assert bad.decode_tokens_per_s_per_user <= base.decode_tokens_per_s_per_user * 1.0001
    assert good.speculative["expected_tokens_per_step"] == pytest.approx(expected_tokens_per_step(0.9, 4))
    assert good.speculative["verify_s"] >= base.step_latency_s * 0.999


def test_concurrency_raises_aggregate_and_lowers_per_user_speed_on_gpus():
    plan = place("llama-3.1-70b", "h200-sxm", devices=8, batch=64, context=2048)
    r1 = simulate(plan, prompt_len=1024, output_len=1024, concurrency=1)
    r64 = simulate(plan, prompt_len=1024, output_len=1024, concurrency=64)
    assert r64.aggregate_tokens_per_s > 10 * r1.aggregate_tokens_per_s
    assert r64.decode_tokens_per_s_per_user < r1.decode_tokens_per_s_per_user


def test_pipeline_micro_batches_fill_the_ring():
    plan = place("llama-3.1-70b", "wse-3", devices=4, batch=4)
    r = simulate(plan, prompt_len=128, output_len=128)
    assert r.micro_batches == 4
    assert r.aggregate_tokens_per_s > 3 * simulate(place("llama-3.1-70b", "wse-3", devices=4), prompt_len=128,
                                                   output_len=128).aggregate_tokens_per_s


def test_micro_batches_of_unequal_size_are_not_priced_as_the_largest():
    """The engine splits B sequences into M micro-batches of near-equal size (pipeline/serving.py _split): 59 on 58
    stages are one micro-batch of 2 and 57 of 1, not 58 of 2. Priced as 58 of 2, one more user cut the aggregate rate
    (deepseek-v3 on wse-2 with MTP: 34,656 -> 31,043 tok/s from 58 to 59 users; 116 -> 117 without speculation)."""
    plan = place("deepseek-v3", "wse-2", context=3000, batch=128, speculative=SpeculativeConfig("mtp", 0))
    assert plan.micro_batches == plan.num_stages == 58
    for spec in ("mtp", "none"):
        p = plan if spec == "mtp" else place("deepseek-v3", "wse-2", context=3000, batch=128)
        rates = [simulate(p, prompt_len=2000, output_len=500, concurrency=b).aggregate_tokens_per_s
                 for b in (58, 59, 116, 117)]
        assert rates[0] < rates[1] and rates[2] < rates[3], (spec, rates)


def test_ttft_grows_with_prompt_and_includes_overhead():
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=9000)
    short = simulate(plan, prompt_len=100, output_len=10)
    long = simulate(plan, prompt_len=8000, output_len=10)
    assert long.ttft_s > short.ttft_s >= load_params().ttft_overhead_s
    assert long.end_to_end_s > long.ttft_s


def test_afd_simulates_with_two_hops_per_layer():
    plan = place("deepseek-v3", "wse-3", weight_bits=4, afd=True)
    r = simulate(plan, prompt_len=256, output_len=256)
    att = [s for s in r.stages if s.role == "attention"]
    assert r.decode_tokens_per_s_per_user > 0 and sum(s.hop for s in att) > 2 * 61 * 1e-7


def test_afd_ranks_are_timed_each_on_its_own_devices_and_slowest_link():
    """The engine's AFD layout: a micro-batch waits for every FFN rank. The simulator timed the FFN rank with the
    most devices (kimi-k2's 3-device rank of 76 experts shown as fast as the 4-device ones of 77) and priced the
    round trip on the link to the first FFN rank (gpt-oss-120b: NVLink, though rank 7 sits on the next node); a rank
    across two nodes sends the rows of the experts on the other node over the scale-out link."""
    from dataclasses import replace

    r = simulate(place("kimi-k2", "h200-sxm", afd=True, attention_ranks=3, ffn_ranks=5, batch=64))
    ffn = [s for s in r.stages if s.role == "ffn"]
    assert [s.devices for s in ffn] == [4, 4, 4, 4, 3] and ffn[4].memory > 1.2 * ffn[0].memory
    plan = place("gpt-oss-120b", "h200-sxm", afd=True, attention_ranks=1, ffn_ranks=8, batch=1)
    assert plan.stages[-1].device_ids == [8]  # (node 1; the rest on node 0)
    hw = load_hardware("h200-sxm")
    apart = simulate(plan, hardware=replace(hw, devices_per_node=1))  # every device on a node of its own
    assert simulate(plan).stages[0].hop == pytest.approx(apart.stages[0].hop, rel=1e-9)
    plan = place("deepseek-v3", "h200-sxm", afd=True, attention_ranks=1, ffn_ranks=1, batch=1)
    assert plan.stages[1].device_ids == list(range(1, 11))  # (7 of its 10 devices on the attention rank's node)
    one = simulate(plan, prompt_len=512, output_len=2)
    near = simulate(plan, prompt_len=512, output_len=2, hardware=replace(hw, devices_per_node=16))
    assert one.prefill_s > 1.3 * near.prefill_s  # (512 x 8 rows of 7168 a layer: 30% of them at 50 GB/s)


def test_afd_ffn_side_gets_the_rows_the_engine_sends():
    """64 sequences on 6 attention ranks in 2 micro-batches reach the FFN side as 34 + 30 rows (the engine's split),
    not 2 x 6 x 6 = 72; one prompt's prefill sends its own chunk, not one per attention rank (8 ranks doubled the
    prefill of 4; 6 ranks decoded 5% slower than 4)."""
    from waferline.sim.pipeline import _afd_ffn_rows

    assert _afd_ffn_rows(64, 6, 2) == [34, 30] and _afd_ffn_rows(64, 4, 2) == [32, 32]
    assert _afd_ffn_rows(1, 8, 1) == [1] and _afd_ffn_rows(5, 2, 2) == [3, 2]

    from dataclasses import replace

    hw = replace(load_hardware("h200-sxm"), devices_per_node=64)  # (every rank on one node: links alike)

    def run(M: int, batch: int):
        plan = place("deepseek-v3", hw, afd=True, attention_ranks=M, ffn_ranks=1, batch=batch)
        return simulate(plan, hardware=hw)

    assert run(6, 64).aggregate_tokens_per_s >= run(4, 64).aggregate_tokens_per_s
    assert run(8, 8).prefill_s == pytest.approx(run(1, 8).prefill_s, rel=1e-6)


def test_parameters_change_predictions_by_class():
    plan = place("llama-3.1-70b", "wse-3", devices=4)
    slow = SimParams(classes={"wafer": ClassParams(layer_latency_s=50e-6), "gpu": ClassParams()})
    fast = SimParams(classes={"wafer": ClassParams(layer_latency_s=5e-6), "gpu": ClassParams()})
    assert (
        simulate(plan, params=fast).decode_tokens_per_s_per_user
        > 3 * simulate(plan, params=slow).decode_tokens_per_s_per_user
    )


def test_no_torch_in_planner_and_simulator():
    code = (
        "import sys, waferline.plan.commands, waferline.plan.place, waferline.sim.pipeline, waferline.sim.fit, "
        "waferline.sim.validate, waferline.spec.catalog, waferline.spec.hardware; "
        "from waferline.plan.place import place; from waferline.sim.pipeline import simulate; "
        "simulate(place('gpt-5.6-sol', 'wse-3', weight_bits=4)); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_serving_queues_and_batches_under_load():
    from waferline.sim.serving import simulate_serving

    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=1024)
    light = simulate_serving(plan, arrival_rate=0.05, num_requests=30, prompt_len=512, output_len=128, seed=1)
    heavy = simulate_serving(plan, arrival_rate=50.0, num_requests=200, prompt_len=512, output_len=128, seed=1)
    assert light.mean_batch < 1.5 < heavy.mean_batch
    assert heavy.output_tokens_per_s > 3 * light.output_tokens_per_s
    assert heavy.ttft_p99_s > light.ttft_p99_s and heavy.itl_p50_s > light.itl_p50_s
    assert light.ttft_p50_s >= load_params().ttft_overhead_s
    capped = simulate_serving(plan, arrival_rate=50.0, num_requests=100, prompt_len=512, output_len=128, max_batch=4)
    assert capped.max_batch == 4 and capped.mean_batch <= 4.0001


def test_an_eagle_head_drafts_over_its_32k_draft_vocabulary(monkeypatch):
    """An EAGLE-3 head projects onto a 32,000-token draft vocabulary (the released heads' draft_vocab_size): a draft
    token of Llama-3.1-8B (128,256 tokens) reads a quarter of the LM head, not all of it (it was charged in full)."""
    from waferline.sim import pipeline as sim_pipeline

    spec, hw = load_model("llama-3.1-8b"), load_hardware("h100-sxm")
    plan = place(spec, hw, devices=1, speculative=SpeculativeConfig("eagle"))

    def draft_s(vocab):
        monkeypatch.setattr(sim_pipeline, "EAGLE_DRAFT_VOCAB", vocab)
        r = simulate(plan, prompt_len=100, output_len=100, spec=spec, hardware=hw)
        return r.speculative["draft_s"], r.speculative

    reduced, info = draft_s(32000)
    full, _ = draft_s(spec.vocab_size)
    k = info["num_tokens"]
    head = spec.lm_head_bytes(16) / (hw.memory_bandwidth * load_params().classes["gpu"].bw_eff)
    assert full - reduced == pytest.approx(k * head * (1 - 32000 / spec.vocab_size), rel=0.02)
    assert "32,000-token draft vocabulary" in info["drafter"]


def test_an_eagle_heads_memory_holds_its_draft_vocabulary_projection():
    """The memory an EAGLE head adds holds its own output projection over the 32,000-token draft vocabulary (16-bit);
    an MTP module uses the target's LM head."""
    from waferline.sim.pipeline import drafter_memory

    spec = load_model("llama-3.1-8b")
    kw = dict(weight_bits=16, kv_bits=16, embed_bits=16, group_size=128, context=1000, batch=1)
    eagle, _ = drafter_memory(spec, SpeculativeConfig("eagle"), load_params(), **kw)
    mtp_like, _ = drafter_memory(spec, SpeculativeConfig("mtp"), load_params(), **kw)  # (no MTP layers: the same head)
    assert eagle - mtp_like == pytest.approx(32000 * spec.hidden_size * 2)


def test_medusa_heads_of_a_tied_target_hold_their_vocabulary_projections():
    """Each Medusa head has a vocabulary projection of its own, as large for a target whose LM head is its embedding
    table (Llama-3.2-1B) as for one with a separate head (it was counted as the tied head's 0 bytes)."""
    from waferline.sim.pipeline import drafter_memory

    kw = dict(weight_bits=16, kv_bits=16, embed_bits=16, group_size=128, context=1000, batch=1)
    for name in ("llama-3.2-1b", "llama-3.1-8b"):
        spec = load_model(name)
        b, what = drafter_memory(spec, SpeculativeConfig("medusa", 4), load_params(), **kw)
        d = spec.hidden_size
        assert what == "4 Medusa heads"
        assert b == pytest.approx(4 * (spec.vocab_size * d + d * d) * 2, rel=1e-4), name


@pytest.mark.parametrize("method,model", [("mtp", "deepseek-v3"), ("eagle", "llama-3.1-8b"), ("draft", "glm-4.6")])
def test_a_one_layer_drafters_step_reads_and_computes_its_input_projection(monkeypatch, method, model):
    """A one-layer drafter's step (an MTP module, an EAGLE-style head, the draft head a target without a small
    same-vocabulary model falls back to) reads every weight its memory counts, the [2d -> d] input projection
    (eh_proj / fc) included, and computes its 2 x 2d x d FLOPs per token (it was left out of the step)."""
    from types import SimpleNamespace

    import waferline.sim.pipeline as pipeline
    from waferline.sim.cost import layer_table

    seen = []
    real = pipeline.stage_step

    def spy(layers, *a, **kw):
        seen.append(layers)
        return real(layers, *a, **kw)

    monkeypatch.setattr(pipeline, "stage_step", spy)
    spec, hw, params = load_model(model), load_hardware("h200-sxm"), load_params()
    sc = SpeculativeConfig(method, 3, 0.7)
    plan = place(spec, hw, devices=8, weight_bits=4, speculative=sc)
    table = layer_table(spec, 4, plan.kv_bits, 1000, plan.group_size)
    pipeline._draft_time(pipeline._Ctx(plan, spec, hw, params.for_hardware(hw), params), method, 3, 1, table, 1000)
    (lc,), d = seen[-1], spec.hidden_size
    held, _ = pipeline.drafter_memory(spec, sc, params, weight_bits=4, kv_bits=plan.kv_bits, embed_bits=16,
                                      group_size=plan.group_size, context=1000, batch=0)
    head = pipeline._eagle_head(spec, 16)[1] if method == "eagle" else 0.0
    assert lc.weight_bytes + 3 * d * 2 + head == pytest.approx(held, rel=1e-9)  # (+ its three 16-bit norms)
    base = layer_table(SimpleNamespace(layers=spec.mtp_layers[:1], name="m"), 4, plan.kv_bits, 1000,
                       plan.group_size)[0] if method == "mtp" else table[0]
    assert lc.mixer_flops - base.mixer_flops == pytest.approx(4.0 * d * d)


@pytest.mark.parametrize("method,model,draft", [("mtp", "deepseek-v3", None),
                                                 ("draft", "llama-3.1-70b", "llama-3.2-1b")])
def test_the_drafter_reads_its_int4_scales_at_the_plans_group_size(method, model, draft):
    """An MTP module's or a draft model's step reads its int4 weights with the scales of the plan's group size, as its
    memory and the target's step count them (it was timed at groups of 128 whatever the plan said)."""
    spec, hw = load_model(model), load_hardware("h200-sxm")
    drafted = {}
    for g in (128, 32):
        plan = place(spec, hw, devices=8, weight_bits=4, group_size=g,
                     speculative=SpeculativeConfig(method, 3, 0.7, draft))
        drafted[g] = simulate(plan, prompt_len=100, output_len=100, spec=spec, hardware=hw).speculative["draft_s"]
    assert drafted[32] > drafted[128]


def test_a_draft_models_step_reads_its_head_at_the_plans_embed_bits():
    """A draft model's step reads its LM head (llama-3.2-1b: its tied embedding table) at the plan's embed_bits, as
    its memory counts it (it was timed at 16 bits whatever the plan said)."""
    spec, hw = load_model("llama-3.1-70b"), load_hardware("h200-sxm")
    drafted = {}
    for eb in (16, 4):
        plan = place(spec, hw, devices=1, weight_bits=4, embed_bits=eb,
                     speculative=SpeculativeConfig("draft", 3, 0.7, "llama-3.2-1b"))
        drafted[eb] = simulate(plan, prompt_len=100, output_len=100, spec=spec, hardware=hw).speculative["draft_s"]
    dspec = load_model("llama-3.2-1b")
    bw = hw.memory_bandwidth * load_params().for_hardware(hw).bw_eff
    saved = (dspec.embed_bytes(16) - dspec.embed_bytes(4)) / bw
    assert drafted[16] - drafted[4] == pytest.approx(3 * saved, rel=0.05)


def test_deepseek_v4s_mtp_module_is_modelled_as_its_reference_builds_it():
    """DeepSeek-V4's MTP module (num_nextn_predict_layers: 1) is a whole hyper-connected block of the model: attention
    as the compress ratio after the layers' says (0: sliding window only, no compressor or indexer), MoE routed by score
    (not hashed), a [d -> d] projection each for the embedding and the hidden state, three norms and its own collapse
    of the streams; the simulator drafts with it (a one-layer head of the model's first layer stood in for it). A
    model without MTP layers still says so."""
    from waferline.spec.model import CompressedAttentionSpec

    spec = load_model("deepseek-v4-flash")
    assert spec.hf_config["compress_ratios"][spec.num_layers] == 0 and len(spec.mtp_layers) == 1
    mtp = spec.mtp_layers[0]
    assert isinstance(mtp.mixer, CompressedAttentionSpec) and mtp.mixer.compress_ratio == 0
    assert mtp.mixer.index_topk == 0 and mtp.ffn.correction_bias and mtp.hc_mult == 4
    assert spec.layers[0].mixer.compress_ratio != 0 or not spec.layers[0].ffn.correction_bias  # (not layer 0's shape)
    d, n = spec.hidden_size, mtp.hc_mult
    assert spec.mtp_params() == mtp.params() + 2 * d * d + 3 * d + n * (n * d + 1) + 1
    hw = load_hardware("h200-sxm")
    for name, says in (("deepseek-v4-flash", "MTP module"), ("llama-3.1-8b", "MTP-like one-layer head (model has no "
                                                                          "MTP layers)")):
        spec = load_model(name)
        plan = place(spec, hw, speculative=SpeculativeConfig("mtp", 3))
        assert simulate(plan, spec=spec, hardware=hw).speculative["drafter"] == says, name


@pytest.mark.parametrize("model", ["qwen3-next-80b-a3b", "gpt-5.6-sol-hybrid", "llama-3.1-8b"])
def test_a_verify_writes_the_recurrent_state_after_each_of_its_tokens(model):
    """A speculative verify of t tokens keeps the state after each of them on a recurrent-state layer for the
    rollback (spec: ``rollback_bytes_per_seq``), so it moves (t - 1) x state x batch bytes more than a plain pass of
    t tokens (which reads and writes the state once); attention keeps nothing, and its verify costs what it did."""
    from waferline.sim.cost import STATE_BITS, layer_table, stage_step

    spec, params = load_model(model), load_params()
    table = layer_table(spec, 16, 16, 1000)
    state = sum(layer.mixer.state_bytes_per_seq(STATE_BITS) for layer in spec.layers if layer.mixer is not None)
    assert (state > 0) == (model != "llama-3.1-8b")
    t, batch = 7, 8
    for hw_name in ("h200-sxm", "wse-3"):
        hw = load_hardware(hw_name)
        prm = params.for_hardware(hw)
        plain, verify = (stage_step(table, "full", 1, hw, prm, spec.hidden_size, batch, t, 16, verify=v)
                         for v in (False, True))
        if not state:
            assert (verify.memory, verify.total) == (plain.memory, plain.total)
        elif hw.kind == "wafer":  # (written at its layers' regions' share of the bandwidth)
            assert verify.memory > plain.memory
        else:
            bw = hw.memory_bandwidth * prm.bw_eff * prm.speedup.get("weights and cache read", 1.0)
            assert (verify.memory - plain.memory) * bw == pytest.approx((t - 1) * state * batch, rel=1e-9)
    # the simulator's verify step is such a step: a plain pass of its t tokens, and the trail on recurrent layers
    import waferline.sim.pipeline as pipeline

    hw = load_hardware("h200-sxm")
    plan = place(spec, hw, devices=8, speculative=SpeculativeConfig("eagle", t - 1, 0.7))
    r = simulate(plan, prompt_len=200, output_len=200, concurrency=batch, spec=spec, hardware=hw)
    ctx = pipeline._Ctx(plan, spec, hw, params.for_hardware(hw), params)
    plain_v = pipeline._step(ctx, layer_table(spec, plan.weight_bits, plan.kv_bits, 300, plan.group_size),
                             -(-batch // r.micro_batches), t, batch, want_timings=False)[0]
    if state:
        assert r.speculative["verify_s"] > plain_v
    else:
        assert r.speculative["verify_s"] == plain_v


def test_a_prefill_computes_the_lm_head_at_the_prompts_last_position_only():
    """The engine (runner: the head at each row's last token), vLLM and SGLang compute a prompt's logits at its last
    position only: a 512-token prefill pays 512 x the layers' FLOPs and one position's LM head, not 512 of them.
    By hand on a compute-bound device (bandwidth and latencies out of the way)."""
    from waferline.spec.hardware import hardware_from_dict

    hw = hardware_from_dict({"name": "compute-bound", "kind": "gpu", "device": {
        "memory_bytes": 1e12, "memory_bandwidth": 1e18, "flops": {"bf16": 1e12}}})
    params = SimParams(classes={"gpu": ClassParams(bw_eff=1.0, flops_eff=1.0, layer_latency_s=1e-7,
                                                   moe_latency_s=1e-8)})
    spec = load_model("qwen3-0.6b")  # (a 151,936-token head: 28% of the layers' FLOPs per token)
    plan = place(spec, hw, devices=1, context=1024)
    P = 512
    r = simulate(plan, prompt_len=P, output_len=2, params=params, spec=spec, hardware=hw)
    layers = sum(lay.flops_per_token(P // 2) for lay in spec.layers)
    fixed = (spec.num_layers + 0.5) * 1e-7
    assert r.prefill_s == pytest.approx((P * layers + spec.lm_head_flops_per_token()) / 1e12 + fixed, rel=1e-3)


def test_an_afd_verify_computes_the_lm_head_at_each_verified_position(monkeypatch):
    """A verify of k + 1 tokens computes the LM head at each of them (the pipeline model charges a plain plan so); the
    AFD ranks' step charged the head at one position per sequence whatever the tokens. By hand: a head of F FLOPs a
    position adds K micro-batches x bm sequences x (k + 1) positions x F / (devices x peak x flops_eff)."""
    import waferline.sim.pipeline as pl

    plan = place("qwen3-30b-a3b", "h100-sxm", afd=True, attention_ranks=1, ffn_ranks=1, batch=64, context=2048,
                 speculative=SpeculativeConfig("eagle", 3, 0.8))
    hw = load_hardware("h100-sxm")
    params = load_params()
    prm = params.for_hardware(hw)
    F = 1e13  # (large enough that the head's compute, not its one byte, sets its time)

    def verify(flops: float) -> float:
        monkeypatch.setattr(pl, "_lm_head", lambda spec, bits: (1.0, flops))
        r = simulate(plan, prompt_len=500, output_len=100, concurrency=64, params=params)
        return r.speculative["verify_s"], r.micro_batches

    (with_head, K), (without, _) = verify(F), verify(1.0)
    att = plan.stages[0]
    bm = 64 // K
    fl = hw.peak_flops(16) * prm.flops_eff
    assert with_head - without == pytest.approx(K * bm * 4 * F / (att.num_devices * fl), rel=1e-6)
