"""Planner: catalog accounting facts, placement, memory fit and no-fit explanations, Plan JSON round trip."""

import json

import pytest

from waferline.errors import ConfigError, FitError
from waferline.plan.place import context_capacity, place, restage_memory
from waferline.plan.plan import Plan, SpeculativeConfig
from waferline.spec.catalog import list_models, load_model, model_config
from waferline.spec.configs import parse_hf_config

ISSUE_MODELS = {
    "gpt-5.6-sol",
    "gpt-5.6-sol-mla",
    "gpt-5.6-sol-hybrid",
    "gpt-5.6-sol-gqa",
    "kimi-k2.6",
    "deepseek-v3",
    "deepseek-r1",
    "qwen3-235b-a22b",
    "qwen3-32b",
    "glm-4.6",
    "gpt-oss-120b",
    "llama-4-maverick",
    "llama-3-8b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.3-70b",
    "llama-3.1-405b",
    "llama-2-70b",
    "mixtral-8x7b",
    "qwen3-next-80b-a3b",
    "jamba-1.5-large",
}


def within(x, target, rel=0.02):
    return abs(x - target) <= rel * target


@pytest.mark.parametrize("name", sorted(ISSUE_MODELS))
def test_catalog_models_are_hf_configs_with_provenance(name):
    cfg = model_config(name)
    assert "model_type" in cfg and cfg["_waferline"]["source"]
    spec = load_model(name)
    assert spec.num_layers > 0 and spec.params_total() > spec.params_active() * 0.99


def test_all_issue_models_present():
    assert ISSUE_MODELS <= set(list_models())


def test_accounting_facts():
    assert load_model("deepseek-v3").cache_bytes_per_token(16) == 70272
    assert load_model("llama-3.1-405b").cache_bytes_per_token(16) == 516096
    ds = load_model("deepseek-v3")
    assert within(ds.params_total(), 671e9) and within(ds.params_active(), 37e9)
    kimi = load_model("kimi-k2.6")
    assert within(kimi.params_total(), 1.04e12) and within(kimi.params_active(), 32e9, rel=0.05)
    assert within(load_model("gpt-oss-120b").params_total(), 117e9)


def test_sol_variants_are_about_3t_150b_and_differ_in_cache():
    sols = {v: load_model(f"gpt-5.6-sol-{v}") for v in ("mla", "hybrid", "gqa")}
    for s in sols.values():
        assert 2.7e12 < s.params_total() < 3.2e12 and 140e9 < s.params_active() < 170e9 and s.num_layers == 80
        assert s.mtp_layers
    kinds = [layer.mixer.kind for layer in sols["hybrid"].layers]
    assert kinds.count("mla") == 20 and kinds.count("mamba2") == 60
    per_tok = {v: s.cache_bytes_per_token(16) for v, s in sols.items()}
    assert per_tok["hybrid"] < per_tok["mla"] < per_tok["gqa"]


def test_fewest_wafers_for_llama_70b_is_four():
    plan = place("llama-3.1-70b", "wse-3")
    assert plan.fits and plan.num_devices == 4 and plan.num_stages == 4
    assert plan.stages[0].has_embedding and plan.stages[-1].has_lm_head
    assert sorted(i for s in plan.stages for i in s.layers) == list(range(80))


def test_per_stage_memory_counts_only_its_layers():
    """llm-analysis 0.2.2 bug: pipeline stages each charged all layers' weights."""
    spec = load_model("llama-3.1-70b")
    plan = place(spec, "h100-sxm", devices=4, layers_per_stage=20)
    total = spec.weight_bytes(16)
    assert plan.num_stages == 4
    per_stage = [s.memory.weights * s.num_devices for s in plan.stages]
    assert within(sum(per_stage), total, rel=1e-6)
    assert max(per_stage) < total / 3


def test_experts_are_sharded_and_counted_once():
    """GenZ bug: 721 GB per chip for DeepSeek-V3 because experts were not sharded."""
    spec = load_model("deepseek-v3")
    plan = place(spec, "h200-sxm", weight_bits=8)
    assert plan.fits and plan.num_devices == 8
    per_device = plan.stages[0].memory.weights
    assert per_device < 100e9
    assert within(per_device * 8, spec.weight_bytes(8), rel=1e-6)


def test_no_fit_explains_device_term_and_bytes():
    plan = place("llama-3.1-70b", "wse-3", devices=2)
    assert not plan.fits and len(plan.problems) == 2
    msg = plan.problems[0]
    assert (
        "stage 0" in msg and "weights" in msg and "by 29." in msg and "bytes" in msg and "largest term: weights" in msg
    )
    with pytest.raises(FitError, match="stage 0"):
        place("llama-3.1-70b", "wse-3", devices=2, require_fit=True)


def test_cache_overflow_names_the_cache():
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=131072, batch=16)
    assert not plan.fits and "largest term: cache" in plan.problems[0]


def test_several_devices_per_layer_when_a_layer_does_not_fit():
    plan = place("gpt-5.6-sol", "wse-3", weight_bits=16)
    assert plan.fits and plan.num_stages == 80 and all(s.num_devices == 2 for s in plan.stages)


def test_given_devices_go_where_the_end_stages_need_them():
    """--devices N with more devices than layers: an end stage whose embedding or LM head does not fit the even share
    gets what it needs (before: an even split that did not fit, and devices left idle), the rest go to the stage with
    the most bytes per device; a count the even split fits stays even."""
    fewest = place("llama-3.1-8b", "groq-lpu-v1", weight_bits=8)
    assert fewest.fits and fewest.num_devices == 74
    same = place("llama-3.1-8b", "groq-lpu-v1", weight_bits=8, devices=74)
    assert same.fits and [s.num_devices for s in same.stages] == [s.num_devices for s in fewest.stages]
    more = place("llama-3.1-8b", "groq-lpu-v1", weight_bits=8, devices=80)
    assert more.fits and more.num_devices == 80 and [more.stages[i].num_devices for i in (0, 1, -1)] == [10, 2, 10]
    assert not place("llama-3.1-8b", "groq-lpu-v1", weight_bits=8, devices=73).fits  # fewer than the fewest
    even = place("llama-3.1-8b", "wse-3", devices=64)  # a wafer holds a layer and the embedding: even shares
    assert even.fits and {s.num_devices for s in even.stages} == {2}


def test_one_layer_per_wafer_at_4_bits():
    plan = place("gpt-5.6-sol", "wse-3", weight_bits=4, devices=80)
    assert plan.fits and plan.num_stages == 80 and all(len(s.layers) == 1 for s in plan.stages)
    fewest = place("gpt-5.6-sol", "wse-3", weight_bits=4)
    assert fewest.fits and fewest.num_devices < 80


def test_context_capacity_orders_kv_variants():
    caps = {v: context_capacity(place(f"gpt-5.6-sol-{v}", "wse-3", weight_bits=4, devices=80), f"gpt-5.6-sol-{v}")
            for v in ("mla", "gqa", "hybrid")}
    assert caps["gqa"] < caps["mla"] <= caps["hybrid"]
    assert caps["mla"] > 1_000_000


def test_the_capacities_reported_fit_when_placed():
    """The batch and context capacities count the tested batch's activations and the drafter's cache at the tested
    context and batch: placing what they report fits, one more does not."""
    from waferline.plan.place import batch_capacity
    from waferline.sim.cost import load_params
    from waferline.sim.pipeline import drafter_memory, plan_drafter

    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=256)
    n = batch_capacity(plan, "llama-3.1-8b", 256)
    assert n > 512  # (past the prefill chunk: the workspace grows with the batch)
    assert place("llama-3.1-8b", "h100-sxm", devices=1, context=256, batch=n).fits
    assert not place("llama-3.1-8b", "h100-sxm", devices=1, context=256, batch=n + 1).fits

    params, sp, spec = load_params(), SpeculativeConfig(method="eagle"), load_model("llama-3.1-70b")

    def placed(context):
        d = drafter_memory(spec, sp, params, weight_bits=8, kv_bits=16, embed_bits=16, group_size=128,
                           context=context, batch=1)
        return place("llama-3.1-70b", "h200-sxm", devices=2, weight_bits=8, context=context, speculative=sp,
                     drafter=d)

    plan = placed(32768)
    mc = context_capacity(plan, spec, plan_drafter(plan, params))
    assert placed(mc).fits and not placed(mc + 1).fits
    assert context_capacity(plan, spec) > mc  # (without the drafter's cache: more than fits)


def test_fewer_devices_than_a_system_ships_with_are_noted():
    plan = place("llama-3.1-8b", "sn40l", devices=4)
    assert any("sn40l is deployed from 8 devices up (min_devices); 4 is below" in n for n in plan.notes)
    assert not any("min_devices" in n for n in place("llama-3.1-8b", "sn40l", devices=8).notes)


def test_capacities_under_attention_ranks_count_a_ranks_share():
    """Each of M attention ranks holds the caches of ceil(batch / M) sequences: what the plan placed fits within the
    capacities it reports (they counted the whole batch on every rank: 414 sequences for a plan of 1,024)."""
    from waferline.plan.place import batch_capacity

    plan = place("deepseek-v3", "h200-sxm", weight_bits=8, afd=True, attention_ranks=4, ffn_ranks=4, batch=1024,
                 context=4096)
    assert plan.fits and plan.attention_ranks == 4
    assert batch_capacity(plan, "deepseek-v3", 4096) >= 1024 and context_capacity(plan, "deepseek-v3") >= 4096
    # a Llama 4 config without no_rope_layers: transformers' default, every 4th layer global
    cfg = {k: v for k, v in model_config("llama-4-scout").items() if k != "no_rope_layers"}
    assert [layer.mixer.sliding_window for layer in parse_hf_config(cfg).layers[:4]] == [8192, 8192, 8192, None]


def test_a_tensor_parallel_stage_stays_inside_a_node():
    """--layers-per-stage with more devices than a node: the tensor-parallel group is capped at the node (its
    all-reduces priced on the node's links), the rest said to be idle."""
    plan = place("llama-3.1-70b", "h100-sxm", devices=64, layers_per_stage=80)
    assert plan.num_stages == 1 and plan.stages[0].num_devices == 8
    assert any("56 of 64 devices left idle" in n for n in plan.notes)


def test_afd_splits_attention_and_ffn():
    plan = place("deepseek-v3", "wse-3", weight_bits=4, afd=True)
    roles = {s.role for s in plan.stages}
    assert roles == {"attention", "ffn"} and plan.fits
    att = sorted(i for s in plan.stages if s.role == "attention" for i in s.layers)
    assert att == list(range(61))
    ffn = sorted(i for s in plan.stages if s.role == "ffn" for i in s.layers)
    assert ffn == list(range(61))
    assert not set(plan.stages[0].device_ids) & set(plan.stages[-1].device_ids)


def test_plan_json_round_trip(tmp_path):
    plan = place("qwen3-32b", "h200-sxm", devices=2, weight_bits=8, speculative=SpeculativeConfig("eagle", 4, 0.7))
    path = tmp_path / "plan.json"
    plan.save(path)
    back = Plan.load(path)
    assert back.to_dict() == plan.to_dict()
    assert back.speculative.method == "eagle" and back.stages[0].num_devices == 2
    d = json.loads(path.read_text())
    assert d["stages"][0]["role"] == "full" and "weights" in d["stages"][0]["memory"]


def test_bad_inputs_raise_config_errors():
    with pytest.raises(ConfigError):
        place("llama-3.1-8b", "wse-3", weight_bits=3)
    with pytest.raises(ConfigError):
        place("not-a-model", "wse-3")
    with pytest.raises(ConfigError):
        Plan.from_json('{"model": "x"}')
    with pytest.raises(ConfigError):
        SpeculativeConfig("telepathy")


def test_config_json_path_is_accepted(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(model_config("llama-3.1-8b")))
    plan = place(str(p), "h100-sxm")
    assert plan.fits and plan.num_devices == 1


def test_gqa_cache_is_not_split_below_one_kv_head_per_device():
    spec = load_model("llama-3.1-70b")  # 8 KV heads
    per_seq = spec.cache_bytes_per_seq(8192)
    p8 = place(spec, "gb200-nvl72", devices=8, context=8192)
    p16 = place(spec, "gb200-nvl72", devices=16, layers_per_stage=80, context=8192)  # (one NVLink domain of 72)
    assert p16.num_stages == 1 and p16.stages[0].num_devices == 16
    assert p8.stages[0].memory.cache == pytest.approx(per_seq / 8, rel=1e-6)
    assert p16.stages[0].memory.cache == pytest.approx(per_seq / 8, rel=1e-6)  # replicated, not /16
    assert p16.stages[0].memory.weights == pytest.approx(p8.stages[0].memory.weights / 2, rel=1e-6)


def test_an_mla_latent_is_held_whole_by_every_tensor_parallel_rank():
    """One latent every query head reads cannot be split by heads: each of 8 H200s holds (and a decode step reads)
    every sequence's whole latent, so the longest context is what one device's free memory holds (it said 8x that)."""
    from waferline.sim.cost import layer_table

    spec = load_model("deepseek-v3")
    plan = place(spec, "h200-sxm", weight_bits=8, context=8192)
    st = plan.stages[0]
    assert st.num_devices == 8 and st.memory.cache == pytest.approx(spec.cache_bytes_per_seq(8192), rel=1e-6)
    free = st.memory.capacity - st.memory.weights - st.memory.activations - st.memory.reserve
    assert context_capacity(plan, spec) == pytest.approx(free / spec.cache_bytes_per_token(16), rel=1e-3)
    assert {lc.kv_shards for lc in layer_table(spec, 8, 16, 8192)} == {1}  # (the decode step's read, per device)
    for name, want in (("gpt-5.6-sol-dsa", {"dsa": 1}), ("gpt-5.6-sol-v4", {"compressed": 1}),
                       ("qwen3-next-80b-a3b", {"gdn": 0, "gqa": 2})):  # (recurrent state: split by its heads)
        assert {layer.mixer.kind: layer.cache_shard_limit() for layer in load_model(name).layers} == want


@pytest.mark.parametrize("argv, says", [
    (["plan", "gpt-5.6-sol", "--hardware", "wse-3", "--attention-ranks", "2"], "--attention-ranks needs --afd"),
    (["simulate", "gpt-5.6-sol", "--hardware", "wse-3", "--ffn-ranks", "4"], "--ffn-ranks needs --afd"),
    (["simulate", "gpt-5.6-sol", "--hardware", "wse-3", "--accept-rate", "0.7"], "--accept-rate needs --speculative"),
    (["simulate", "gpt-5.6-sol", "--hardware", "wse-3", "--num-speculative-tokens", "3"],
     "--num-speculative-tokens needs --speculative"),
    (["simulate", "gpt-5.6-sol", "--hardware", "wse-3", "--speculative", "mtp", "--draft-model", "llama-3.2-1b"],
     "--draft-model is for --speculative draft"),
    (["simulate", "gpt-5.6-sol", "--hardware", "wse-3", "--num-requests", "10"],
     "give --arrival-rate or --closed-loop too"),
])
def test_flags_that_would_be_ignored_are_refused(argv, says, capsys):
    from waferline.cli import main

    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_flags_in_their_combination_still_run(capsys):
    from waferline.cli import main

    assert main(["simulate", "gpt-5.6-sol", "--hardware", "wse-3", "--weight-bits", "4", "--devices", "80",
                 "--speculative", "mtp", "--accept-rate", "0.7", "--arrival-rate", "1", "--num-requests", "20",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["serving"]["requests"] == 20


@pytest.mark.parametrize("argv, says", [
    (["calibrate", "--combine", "a.yaml", "b.yaml", "--published"], "--combine merges host calibrations"),
    (["calibrate", "--measure", "--published"], "two different jobs"),
    (["calibrate", "--iters", "10"], "--iters tunes the fit of published results"),
    (["calibrate", "--published", "--quick"], "--quick applies to measuring this host"),
    (["calibrate", "--combine", "a.yaml", "b.yaml", "--params", "p.yaml"], "--params tunes the fit"),
])
def test_calibrate_refuses_flags_of_another_job(argv, says, capsys):
    from waferline.cli import main

    assert main(argv) == 2
    assert says in capsys.readouterr().err


# ---------------------------------------------------------------- plan files and drafters, as simulate reads them

def _simulate_json(argv, capsys):
    from waferline.cli import main

    rc = main(["simulate", *argv, "--json", "--no-intervals"])
    return rc, json.loads(capsys.readouterr().out)


def test_a_plan_file_is_judged_on_its_layers_and_devices_not_its_stored_memory(tmp_path, capsys):
    """A saved plan edited to 4 of its 8 H200s (684 GB of 8-bit weights: 171 GB a device) said 'fits'."""
    from waferline.cli import main

    f = tmp_path / "p.json"
    assert main(["plan", "deepseek-v3", "--hardware", "h200-sxm", "--weight-bits", "8", "--out", str(f)]) == 0
    capsys.readouterr()
    rc, d = _simulate_json(["--plan", str(f)], capsys)
    assert rc == 0 and d["fits"] and d["notes"] == []  # (as placed: nothing recomputed differs)
    edited = json.loads(f.read_text())
    edited["stages"][0]["device_ids"] = [0, 1, 2, 3]
    f.write_text(json.dumps(edited))
    rc, d = _simulate_json(["--plan", str(f)], capsys)
    assert rc == 2 and not d["fits"] and "GB > capacity" in d["problems"][0]
    assert any("the file said" in n for n in d["notes"])
    placed = place("deepseek-v3", "h200-sxm", weight_bits=8, devices=4)
    assert not placed.fits and d["problems"] == placed.problems  # (as `plan` says it of the same placement)
    assert within(float(d["problems"][0].split(" = ")[1].split(" GB")[0]) * 1e9, placed.stages[0].memory.total,
                  rel=1e-3)


def test_an_afd_plan_file_is_judged_on_its_ranks_devices_not_its_stored_memory(tmp_path, capsys):
    """A saved AFD plan (1 attention + 2 FFN ranks of 5 H200s) edited to one device for an FFN rank (672 GB of
    experts on it) said 'fits': the ranks kept the memory the file stored."""
    from waferline.cli import main

    f = tmp_path / "p.json"
    assert main(["plan", "deepseek-v3", "--hardware", "h200-sxm", "--afd", "--attention-ranks", "1", "--ffn-ranks",
                 "2", "--batch", "8", "--context", "1500", "--out", str(f)]) == 0
    capsys.readouterr()
    rc, d = _simulate_json(["--plan", str(f)], capsys)
    assert rc == 0 and d["fits"] and not any("the file said" in n for n in d["notes"])  # (as placed)
    edited = json.loads(f.read_text())
    edited["stages"][2]["device_ids"] = edited["stages"][2]["device_ids"][:1]
    f.write_text(json.dumps(edited))
    rc, d = _simulate_json(["--plan", str(f)], capsys)
    assert rc == 2 and not d["fits"] and d["problems"][0].startswith("stage 2 (ffn, layers 0-60, 1 x h200-sxm)")
    assert "= 672.39 GB > capacity" in d["problems"][0]
    assert any("the file said" in n for n in d["notes"])


def test_the_drafter_is_placed_beside_the_lm_head(capsys):
    from waferline.sim.cost import load_params
    from waferline.sim.pipeline import drafter_memory

    spec, params = load_model("deepseek-v3"), load_params(None)
    plain = place(spec, "h200-sxm", weight_bits=8)
    b, what = drafter_memory(spec, SpeculativeConfig("mtp"), params, weight_bits=8, kv_bits=16, embed_bits=16,
                             group_size=128, context=4096, batch=1)
    mtp_cache = 4096 * spec.layers[-1].cache_bytes_per_token(16)  # (8-bit weights: a byte a parameter)
    assert what.startswith("MTP module") and within(b, spec.mtp_params() + mtp_cache, rel=0.05)
    mtp = place(spec, "h200-sxm", weight_bits=8, speculative=SpeculativeConfig("mtp"), drafter=(b, what))
    per_dev = [s.memory.weights for s in mtp.stages if s.has_lm_head][0]
    assert within(per_dev - plain.stages[-1].memory.weights, b / mtp.stages[-1].num_devices, rel=1e-6)
    assert any("MTP module" in n for n in mtp.notes)
    assert drafter_memory(spec, SpeculativeConfig("ngram"), params, weight_bits=8, kv_bits=16, embed_bits=16,
                          group_size=128, context=4096, batch=1) == (0.0, "")
    # llama-3.1-70b on 2 H100s at the longest context that fits: with its draft model (llama-3.2-1b) it no longer does
    base = ["llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "2", "--prompt-len", "38240", "--output-len", "500"]
    rc, d = _simulate_json(base, capsys)
    assert rc == 0 and d["fits"]
    rc, d = _simulate_json([*base, "--speculative", "draft"], capsys)
    assert rc == 2 and not d["fits"]


def test_speculation_counts_the_states_a_verify_keeps_on_recurrent_layers(capsys):
    """A verify of k drafts keeps, per sequence, the state after each of its k + 1 tokens on a recurrent-state layer
    (``LayerSpec.rollback_bytes_per_seq``): a speculating plan of Qwen3-Next (Gated DeltaNet) counts them per stage
    beside the cache, its capacities too (they went uncounted: 629 sequences of 4k tokens on 2 H200s with 6 n-gram
    drafts, where 155 fit), and k is the simulator's (its method's default where the plan gives none)."""
    from waferline.plan.place import batch_capacity
    from waferline.sim.cost import load_params

    spec, params = load_model("qwen3-next-80b-a3b"), load_params(None)
    sp = SpeculativeConfig("ngram", 6)  # (n-grams draft on the host: no drafter beside the LM head)

    def placed(batch, sp=sp, **kw):
        return place(spec, "h200-sxm", devices=2, context=4096, batch=batch, speculative=sp, **kw)

    plain, spec6 = placed(8, None), placed(8)
    rollback = 8 * spec.rollback_bytes_per_seq(6) / 2  # (a state splits over the stage's devices as the cache does)
    assert rollback > 0 and spec.rollback_bytes_per_seq(6) == 7 * sum(
        layer.mixer.state_bytes_per_seq(16) for layer in spec.layers if layer.rollback_bytes_per_seq(6))
    (p,), (s,) = plain.stages, spec6.stages
    assert within(s.memory.cache, p.memory.cache, rel=1e-12)
    assert within(s.memory.total - p.memory.total, rollback, rel=1e-9)
    assert p.memory.rollback == 0 and within(s.memory.rollback, rollback, rel=1e-9)
    assert "rollback" in spec6.to_dict()["stages"][0]["memory"] and "rollback" not in plain.to_dict()["stages"][0][
        "memory"]
    assert within(placed(8, SpeculativeConfig("ngram")).stages[0].memory.rollback,
                  8 * spec.rollback_bytes_per_seq(params.num_tokens["ngram"]) / 2, rel=1e-9)
    n = batch_capacity(spec6, spec, 4096)
    assert n < batch_capacity(plain, spec, 4096) and n == batch_capacity(spec6, spec, 4096, spec_tokens=6)
    assert placed(n).fits and not placed(n + 1).fits and placed(n + 1, None).fits
    assert "rollback states" in placed(n + 1).problems[0]
    # simulate: the workload that fits without speculation does not with it
    base = ["qwen3-next-80b-a3b", "--hardware", "h200-sxm", "--devices", "2", "--prompt-len", "3596", "--output-len",
            "500", "--concurrency", str(n + 1)]
    rc, d = _simulate_json(base, capsys)
    assert rc == 0 and d["fits"]
    rc, d = _simulate_json([*base, "--speculative", "ngram", "--num-speculative-tokens", "6"], capsys)
    assert rc == 2 and not d["fits"] and "rollback states" in d["problems"][0]
    base[base.index("--concurrency") + 1] = str(n)
    rc, d = _simulate_json([*base, "--speculative", "ngram", "--num-speculative-tokens", "6"], capsys)
    assert rc == 0 and d["fits"] and any("each of a verify's 7 tokens" in x and "GB per device" in x
                                         for x in d["notes"])
    rc, d = _simulate_json(base, capsys)
    assert not any("rollback" in x for x in d["notes"])
    # attention alone keeps nothing beside its cache: a speculating plan of it is the plain one
    assert place("llama-3.1-8b", "h100-sxm", speculative=sp).stages[0].memory == \
        place("llama-3.1-8b", "h100-sxm").stages[0].memory


def test_simulate_plan_speculative_none_turns_the_plans_speculation_off(tmp_path, capsys):
    f = tmp_path / "spec.json"
    rc, with_mtp = _simulate_json(["deepseek-v3", "--hardware", "h200-sxm", "--weight-bits", "8",
                                   "--speculative", "mtp", "--out", str(f)], capsys)
    assert rc == 0 and with_mtp["speculative"]["method"] == "mtp"
    rc, kept = _simulate_json(["--plan", str(f)], capsys)
    assert kept["speculative"]["method"] == "mtp"
    rc, off = _simulate_json(["--plan", str(f), "--speculative", "none"], capsys)
    assert off["speculative"]["method"] == "none"
    assert off["decode_tokens_per_s_per_user"] < kept["decode_tokens_per_s_per_user"] / 1.5


def test_a_capacity_at_the_search_limit_is_said_to_be_at_least_it(capsys, monkeypatch):
    """The capacity searches stop at a limit (2^34 tokens); a plan that holds more is said to hold at least that, not
    exactly it (a limit made small here: one H100 holds far more than 8,192 tokens of llama-3.1-8b)."""
    import waferline.plan.place as place_mod
    from waferline.cli import main

    monkeypatch.setattr(place_mod, "CONTEXT_SEARCH_LIMIT", 8192)
    assert main(["plan", "llama-3.1-8b", "--hardware", "h100-sxm"]) == 0
    assert "at least 8,192 (the search limit) tokens" in capsys.readouterr().out
    assert main(["plan", "llama-3.1-8b", "--hardware", "h100-sxm", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["capacity_at_search_limit"] == ["max_context_per_sequence"] and d["max_context_per_sequence"] == 8192
    monkeypatch.undo()
    assert main(["plan", "llama-3.1-8b", "--hardware", "h100-sxm", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["capacity_at_search_limit"] == []


def test_a_plan_too_short_for_the_workload_names_the_workload(tmp_path, capsys):
    from waferline.cli import main

    f = tmp_path / "p.json"
    assert main(["plan", "llama-3.1-8b", "--hardware", "h100-sxm", "--context", "4096", "--out", str(f)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--plan", str(f), "--prompt-len", "5000"]) == 2
    assert "(prompt + output)" in capsys.readouterr().err


def test_a_draft_that_falls_back_to_a_head_takes_the_heads_acceptance():
    """gpt-oss-120b has no small catalog model of its vocabulary: `draft` runs a one-layer head of its shape, and such
    a head accepts as an EAGLE-style head does (it took the fitted draft-model rate, 0.97 at its bound: 658 tok/s)."""
    from waferline.sim.cost import load_params
    from waferline.sim.pipeline import simulate

    params = load_params(None)
    got = {m: simulate(place("gpt-oss-120b", "h200-sxm", weight_bits=8, speculative=SpeculativeConfig(m)),
                       params=params).speculative for m in ("draft", "eagle")}
    assert got["draft"]["accept_rate"] == got["eagle"]["accept_rate"] == params.accept_rate["eagle"]
    assert "EAGLE-style head's acceptance" in got["draft"]["drafter"]
    llama = simulate(place("llama-3.1-70b", "h200-sxm", weight_bits=8, speculative=SpeculativeConfig("draft")),
                     params=params).speculative  # (a real draft model: its own rate)
    assert llama["accept_rate"] == params.accept_rate["draft"] and "llama-3.2-1b" in llama["drafter"]


def test_tensor_parallel_groups_split_the_attention_heads_evenly():
    """kimi-k2's 64 heads cannot be split over 7 GPUs (it said 1 stage of 7 fit): 7 stages of 1 use them all; 72 GPUs
    for gpt-5.6-sol's 96 heads are 3 stages of 24; the default search takes only groups that split the heads."""
    plan = place("kimi-k2", "b200", weight_bits=8, devices=7)
    assert [s.num_devices for s in plan.stages] == [1] * 7 and any("groups of 1, not 7" in n for n in plan.notes)
    plan = place("kimi-k2", "b200", weight_bits=8, devices=7, layers_per_stage=61)  # (one stage: the widest group)
    assert [s.num_devices for s in plan.stages] == [4] and any("groups of 4, not 7" in n for n in plan.notes)
    plan = place("gpt-5.6-sol", "gb200-nvl72", weight_bits=4, devices=72)
    assert [s.num_devices for s in plan.stages] == [24, 24, 24] and any("groups of 24, not 72" in n for n in plan.notes)
    for name in ("gpt-5.6-sol", "llama-3.1-70b", "qwen3-235b-a22b", "deepseek-v3"):
        spec = load_model(name)
        heads = {layer.mixer.num_heads for layer in spec.layers if layer.mixer is not None}
        for bits in (4, 16):
            for st in place(spec, "gb200-nvl72", weight_bits=bits).stages:
                assert all(h % st.num_devices == 0 for h in heads), (name, bits, st.num_devices, heads)


def test_the_latency_bound_names_only_the_terms_the_hardware_has():
    from waferline.sim.pipeline import simulate

    gpu = simulate(place("deepseek-v3", "h200-sxm", weight_bits=8)).bound
    wafer = simulate(place("gpt-5.6-sol", "wse-3", weight_bits=4, devices=80)).bound
    assert gpu == "latency (fixed per-layer, collectives)" and "fabric" in wafer


def test_a_layer_split_over_devices_gets_enough_for_a_cache_it_cannot_split():
    """Groq LPUs (230 MB each) hold a llama-3.1-70b layer over ~20 chips, but its 8 KV heads split the cache at most 8
    ways: the count from bytes alone came up short (it fit at 16,100 tokens, not at 8,300 or 32,100)."""
    counts = []
    for context in (4096, 8300, 16100, 32100, 64100):
        plan = place("llama-3.1-70b", "groq-lpu-v1", weight_bits=8, context=context)
        assert plan.fits, (context, plan.problems[:1])
        counts.append(plan.num_devices)
    assert counts == sorted(counts)


def test_the_fewest_stages_that_fit_are_found_in_few_splits(monkeypatch):
    # a model whose memory bound is far below the stage count it needs: stage counts tried one after another (each a
    # split of every layer) made a 20,000-layer config take minutes; doubling then halving finds the same count
    import waferline.plan.place as pl
    from waferline.spec.configs import parse_hf_config

    calls = [0]
    split = pl._balanced_split

    def counted(*a, **k):
        calls[0] += 1
        return split(*a, **k)

    monkeypatch.setattr(pl, "_balanced_split", counted)
    spec = parse_hf_config({"model_type": "llama", "hidden_size": 65536, "num_hidden_layers": 3000,
                            "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 131072,
                            "vocab_size": 32000, "max_position_embeddings": 4096}, "huge")
    p = pl.place(spec, "h100-sxm")
    assert p.fits and p.num_stages == 375  # (the count the one-by-one scan found: 31 splits, now 14)
    assert calls[0] <= 18  # (and one a narrower group at most: more stages of it that would use fewer devices)


@pytest.mark.parametrize("model, context", [("deepseek-v3", 21_000), ("llama-3.1-70b", 131_072)])
def test_a_cache_no_device_count_holds_is_not_answered_with_more_devices(model, context):
    """On 230 MB LPUs a layer's MLA latent (held whole by every device) or its 8 KV heads' share of 8 x 21k / 128k
    tokens fills a device alone: the planner placed 100,000 devices a stage (6.1M / 8M in all) and advised 'or more
    devices'. Now the stage gets the bytes estimate and the line says more devices in it do not help."""
    plan = place(model, "groq-lpu-v1", weight_bits=8, batch=8, context=context)
    assert not plan.fits and plan.num_devices < 10_000
    assert all("more devices in the stage do not help" in p and "or more devices" not in p for p in plan.problems)
    assert len(plan.problems) == plan.num_stages
    # a stage that more devices do help keeps the hint (llama-3.1-70b's 16-bit weights on one H100)
    tight = place("llama-3.1-70b", "h100-sxm", devices=1)
    assert not tight.fits and "more devices" in tight.problems[0] and "do not help" not in tight.problems[0]


@pytest.mark.parametrize("kind, model", [("lpu", "llama-3.1-405b"), ("asic", "llama-3.1-8b")])
def test_a_device_the_activation_workspace_fills_is_not_answered_with_more_devices(kind, model):
    """A 128 MB SRAM chip of the user's: 405B's activation workspace (512 tokens x 16,384 x 2 bytes x 8, 134 MB) and
    the reserve fill every device whatever the stage's size. The planner placed 100,000 devices a stage (12.6M in
    all) and advised a smaller --batch (it was 1); on a tensor-parallel device it blamed a cache of 0.00 GB and
    advised a shorter --context. Now each stage is one device and the line says no number of devices holds it."""
    from waferline.spec.hardware import hardware_from_dict

    hw = hardware_from_dict({"name": "sram128", "kind": kind, "system": {"devices_per_node": 8},
                             "device": {"memory_bytes": 1.28e8 if kind == "lpu" else 1e7, "memory_bandwidth": 8e13,
                                        "flops": {"bf16": 1e14}}, "links": {"scale_up": "nvlink4",
                                                                            "scale_out": "ib-400g"}})
    plan = place(model, hw, weight_bits=8)
    assert not plan.fits and plan.num_devices < 10_000
    assert len(plan.problems) == plan.num_stages
    for p in plan.problems:
        assert "no number of devices holds it" in p and "device with more memory" in p
        assert "--context" not in p and "--batch" not in p and "or more devices" not in p


@pytest.mark.parametrize("cmd", ["plan", "simulate"])
def test_plan_out_makes_its_directory(tmp_path, capsys, cmd):
    """`plan/simulate --out NEW/DIR/plan.json` makes the directories, as calibrate's and twin's --out do (simulate's
    check before the work passed it, then the write after the work failed: No such file or directory)."""
    from waferline.cli import main

    out = tmp_path / "new" / "dir" / "plan.json"
    assert main([cmd, "qwen3-32b", "-H", "h200-sxm", "--json", "--out", str(out)]) == 0
    capsys.readouterr()
    assert Plan.load(out).model == "qwen3-32b"


def test_devices_at_or_above_the_fewest_that_fit_fit_on_a_pipeline():
    """qwen3-0.6b on Groq LPUs, 4-bit: the fewest that fit are 8 (the embedding's stage takes 2, and the LM head's,
    its tied copy of the table, 2); --devices 6 (or 7, or 12) once gave each of 6 (7, 12) stages one device, the
    embedding's stage over its capacity."""
    fewest = place("qwen3-0.6b", "groq-lpu-v1", weight_bits=4)
    assert fewest.fits and fewest.num_devices == 8
    assert [s.num_devices for s in fewest.stages] == [2, 1, 1, 1, 1, 2]
    for n in (8, 9, 12, 28, 29):
        plan = place("qwen3-0.6b", "groq-lpu-v1", weight_bits=4, devices=n)
        assert plan.fits and plan.num_devices <= n, (n, plan.problems)
        assert [i for s in plan.stages for i in s.layers] == list(range(28))


def test_gpu_devices_take_stages_of_a_narrower_group_where_the_widest_does_not_fit():
    """A cache that splits over no more devices than its KV heads (an MLA latent: none) is held whole by every device
    of a group: glm-4.6 at 128k x 64 fit on 96 GB200s by default, but --devices 96 (2 stages of 48) did not;
    deepseek-v3 with 256 sequences did not fit in one stage of 8 H200s, where 2 stages of 4 hold it."""
    kw = dict(weight_bits=4, context=131072, batch=64)
    default = place("glm-4.6", "gb200-nvl72", **kw)
    assert default.fits
    for n in (default.num_devices, 96):
        plan = place("glm-4.6", "gb200-nvl72", devices=n, **kw)
        assert plan.fits and plan.num_devices <= n, (n, plan.problems)
    plan = place("deepseek-v3", "h200-sxm", devices=8, weight_bits=8, batch=256)
    assert plan.fits and [s.num_devices for s in plan.stages] == [4, 4]
    assert any("groups of 4 in 2 pipeline stages: 1 stage(s) of 8 do not fit" in n for n in plan.notes)
    plan = place("deepseek-v3", "h200-sxm", devices=8, weight_bits=8, batch=256, layers_per_stage=61)  # (as asked)
    assert not plan.fits and [s.num_devices for s in plan.stages] == [8]


def test_default_gpu_stages_take_the_narrowest_group_that_holds_them():
    """deepseek-r1 at 128k x 64, 4-bit, on GB200: every GPU of a stage holds its layers' whole MLA latents, so 4
    stages of 64 GPUs (256, what the planner said were the fewest that fit) hold them no better than 4 of 4. 6 stages
    of one GPU hold them too (--devices 6), but in the same NVLink domain: more stages are taken only where they save
    a whole node (each token would cross 6 stages of one GPU's bandwidth instead of 4 of four)."""
    kw = dict(weight_bits=4, context=131072, batch=64)
    plan = place("deepseek-r1", "gb200-nvl72", **kw)
    assert plan.fits and [s.num_devices for s in plan.stages] == [4] * 4
    assert place("deepseek-r1", "gb200-nvl72", devices=6, **kw).fits
    assert not place("deepseek-r1", "gb200-nvl72", devices=8, layers_per_stage=16, **kw).fits  # (groups of 2)
    assert place("deepseek-r1", "gb200-nvl72", devices=plan.num_devices, **kw).fits


def test_default_gpu_stages_are_the_fewest_devices_over_every_group_width():
    """kimi-k2 at 32k x 16, 4-bit, on H100s: its MLA latents are held whole by every GPU of a stage, so 8 stages of
    one GPU (one node) hold what the planner placed on 2 stages of 8 (16 GPUs, two nodes), and 7 do not; the deeper
    pipeline is taken because it saves a node."""
    kw = dict(weight_bits=4, context=32768, batch=16)
    plan = place("kimi-k2", "h100-sxm", **kw)
    assert plan.fits and plan.num_devices == 8, [s.num_devices for s in plan.stages]
    assert not place("kimi-k2", "h100-sxm", devices=7, **kw).fits
    # where one node-wide stage holds the model, it still takes the narrowest group that does (TP inside a node first)
    assert [s.num_devices for s in place("deepseek-v3", "h200-sxm", weight_bits=8).stages] == [8]


def test_the_capacities_agree_with_fits_at_the_capacity():
    """A stage within a billionth of its capacity fits (MemoryBreakdown.fits); the capacity searches judged it over
    (a strict comparison): gpt-5.6-sol-gqa on MI300X at 82,386 tokens fit, and `plan` said the longest context was
    82,385 and that 0 sequences of 82,386 tokens fit."""
    from waferline.plan.place import batch_capacity

    plan = place("gpt-5.6-sol-gqa", "mi300x", context=82386)
    assert plan.fits and max(s.memory.total - s.memory.capacity for s in plan.stages) > 0  # (within the tolerance)
    assert context_capacity(plan, "gpt-5.6-sol-gqa") >= 82386
    assert batch_capacity(plan, "gpt-5.6-sol-gqa", 82386) >= 1


def test_afd_pools_take_the_fewest_devices_that_fit():
    """--afd on GPUs without --devices sized the attention pool by its bytes over a device's memory: a DSA latent
    that every GPU holds whole left 2 GPUs over their capacity, where 3 hold it (as --devices 156 placed them); the
    narrowest group width a placement takes (as it does without --afd) that holds it is 4."""
    plan = place("gpt-5.6-sol-dsa", "h100-sxm", afd=True, context=32768, batch=16)
    assert plan.fits, plan.problems[:1]
    att = [s for s in plan.stages if s.role == "attention"]
    assert [s.num_devices for s in att] == [4]


def _afd_attention(plan):
    return [s.num_devices for s in plan.stages if s.role == "attention"]


def test_afd_attention_groups_are_tensor_parallel_groups():
    """--afd on GPUs/TPUs gave the attention side (and each --attention-ranks rank) the fewest devices its bytes
    need, whatever that count: 3 devices for DeepSeek-V3's 128 heads on TPU v6e, 14 for Llama 3.1 405B on hosts of
    8 (a group's all-reduces priced on the node's links). A group now splits the heads evenly inside a node, as
    without --afd; where one node-wide group does not hold the attention side, it is a pipeline of groups."""
    plan = place("deepseek-v3", "tpu-v6e", afd=True, batch=8, context=32768)
    assert plan.fits and _afd_attention(plan) == [4] and plan.attention_ranks == 1  # (the engine's layout, M = 1)
    plan = place("llama-3.1-405b", "tpu-v6e", afd=True, batch=128, context=4096)
    assert plan.fits and _afd_attention(plan) == [8, 8]  # (one stage of 14 did not even fit: 8 KV heads)
    assert [s.layers for s in plan.stages if s.role == "attention"] == [list(range(63)), list(range(63, 126))]
    assert plan.stages[0].has_embedding and plan.stages[1].has_lm_head and plan.attention_ranks == 0
    assert any("the attention side in 2 pipeline stages of 8 device(s)" in n for n in plan.notes)
    assert Plan.from_dict(plan.to_dict()).to_dict() == plan.to_dict()
    # --devices: the attention share is placed as a model is, the FFN pool takes the rest
    plan = place("llama-3.1-405b", "tpu-v6e", afd=True, devices=40, batch=128, context=4096)
    assert plan.fits and _afd_attention(plan) == [8, 8]
    assert plan.num_devices == 40 and not any("idle" in n for n in plan.notes)
    # a data-parallel attention rank: one group, the narrowest that holds it, else the widest (and why it cannot grow)
    plan = place("llama-3.1-405b", "tpu-v6e", afd=True, attention_ranks=2, ffn_ranks=2, batch=8)
    assert plan.fits and _afd_attention(plan) == [8, 8]
    plan = place("llama-3.1-405b", "tpu-v6e", afd=True, attention_ranks=1, batch=128, context=4096)
    assert not plan.fits and _afd_attention(plan) == [8]
    assert any("an attention rank is one tensor-parallel group inside a node" in n for n in plan.notes)


def test_every_afd_attention_group_splits_the_heads_inside_a_node():
    from waferline.plan.place import _head_split
    from waferline.spec.catalog import load_hardware

    for model in ("deepseek-v3", "llama-3.1-405b", "llama-4-maverick", "qwen3-235b-a22b"):
        heads = _head_split(load_model(model))
        for hardware in ("h100-sxm", "tpu-v6e", "tpu-v5p", "mi300x"):
            per_node = load_hardware(hardware).devices_per_node
            for batch, context in ((1, 4096), (32, 32768), (128, 8192)):
                for kw in ({}, {"devices": 24}, {"attention_ranks": 2, "ffn_ranks": 2}):
                    plan = place(model, hardware, afd=True, batch=batch, context=context, **kw)
                    for n in _afd_attention(plan):
                        assert heads % n == 0 and n <= per_node, (model, hardware, batch, context, kw, n)


@pytest.mark.parametrize("hardware", ["wse-3", "h100-sxm"])
def test_afd_layers_per_stage_is_taken(hardware):
    """--afd --layers-per-stage K without --devices placed both pools as if K were not given (a wafer per layer
    asked, 1 attention wafer and 9 FFN wafers placed); each side is now in stages of K layers."""
    for k in (1, 8):
        plan = place("deepseek-v3", hardware, afd=True, layers_per_stage=k, weight_bits=4)
        for role in ("attention", "ffn"):
            layers = [s.layers for s in plan.stages if s.role == role]
            assert layers == [list(range(i, min(i + k, 61))) for i in range(0, 61, k)], (role, k)
        assert plan.fits, plan.problems[:1]
    plan = place("deepseek-v3", hardware, afd=True, layers_per_stage=8, devices=24, weight_bits=4)
    assert [len(s.layers) for s in plan.stages] == [8] * 7 + [5] + [8] * 7 + [5] and plan.num_devices == 24
    with pytest.raises(ConfigError, match="8 attention and 8 FFN stages: use --devices >= 16"):
        place("deepseek-v3", hardware, afd=True, layers_per_stage=8, devices=10, weight_bits=4)


@pytest.mark.parametrize("model,hardware,bits,k", [
    ("qwen3-30b-a3b", "groq-lpu-3", 4, 2),
    ("mixtral-8x7b", "groq-lpu-v1", 4, None),
])
def test_afd_pools_on_a_pipeline_take_the_devices_each_side_needs(model, hardware, bits, k):
    """--afd --devices on a pipeline (wafers, LPUs) gave the attention side its share of the bytes: qwen3-30b-a3b in
    stages of 2 layers on 74 LPUs (the fewest that fit placed) or 150 got 24 devices for its 24 stages, the
    embedding's and LM head's stages over capacity, the FFN side the rest; each side now gets at least the devices
    its stages need where the devices given hold both."""
    fewest = place(model, hardware, afd=True, layers_per_stage=k, weight_bits=bits)
    assert fewest.fits
    for n in (fewest.num_devices, fewest.num_devices + 1, 2 * fewest.num_devices):
        plan = place(model, hardware, afd=True, layers_per_stage=k, weight_bits=bits, devices=n)
        assert plan.fits and plan.num_devices <= n, (n, plan.problems[:1])


def _layers_weights(spec, layers, bits=16):
    return sum(spec.layers[i].weight_bytes(bits, 128) for i in layers)


def test_a_tied_models_last_stage_holds_its_copy_of_the_embedding_table():
    """A tied model's (tie_word_embeddings) LM head is its embedding table: the engine's last pipeline stage, which
    holds no embedding, holds a copy of it, which the plan counted as 0 bytes (llama-3.2-1b in 2 stages of 8 layers:
    its last stage ~525 MB short); a stage holding both ends holds it once."""
    spec = load_model("llama-3.2-1b")
    assert spec.tie_word_embeddings and spec.lm_head_params() == 0
    table, head = spec.embed_bytes(16), spec.lm_head_bytes(16)
    plan = place(spec, "h100-sxm", devices=2, layers_per_stage=8)
    first, last = plan.stages
    assert first.memory.weights == pytest.approx(_layers_weights(spec, first.layers) + table, rel=1e-12)
    assert last.memory.weights == pytest.approx(_layers_weights(spec, last.layers) + head + table, rel=1e-12)
    one = place(spec, "h100-sxm", devices=1).stages[0]
    assert one.has_embedding and one.has_lm_head
    assert one.memory.weights == pytest.approx(spec.weight_bytes(16), rel=1e-12)  # (the table once)
    att = place(spec, "h100-sxm", afd=True, attention_ranks=1, ffn_ranks=1).stages[0]  # (both ends: once)
    ffn_norms = sum(spec.layers[i].hidden_size * 2 for i in att.layers)  # (each FFN's pre-norm: attention side)
    assert att.role == "attention" and att.memory.weights == pytest.approx(
        sum(spec.layers[i].mixer_weight_bytes(16, 128) for i in att.layers) + table + head + ffn_norms, rel=1e-9)


def test_untied_models_end_stages_are_counted_as_before():
    for model in ("llama-3.1-8b", "qwen3-8b", "deepseek-v3"):
        spec = load_model(model)
        assert not spec.tie_word_embeddings
        plan = place(spec, "h100-sxm", devices=4, layers_per_stage=spec.num_layers // 2 + 1, weight_bits=4)
        first, last = plan.stages[0], plan.stages[-1]
        n0, n1 = first.num_devices, last.num_devices
        assert first.memory.weights * n0 == pytest.approx(_layers_weights(spec, first.layers, 4) + spec.embed_bytes(16))
        assert last.memory.weights * n1 == pytest.approx(_layers_weights(spec, last.layers, 4) + spec.lm_head_bytes(16))


@pytest.mark.parametrize("model,hardware,bits,kw", [
    ("llama-3.2-1b", "groq-lpu-3", 4, dict(devices=4)),
    ("qwen3-0.6b", "groq-lpu-3", 16, dict(devices=4)),
    ("llama-3.2-1b", "groq-lpu-3", 8, dict(afd=True, devices=8)),
])
def test_a_tied_model_on_the_devices_given_takes_fewer_stages_that_fit(model, hardware, bits, kw):
    """llama-3.2-1b on 4 Groq LPUs, 4-bit: 2 stages of 2 hold it (or 1 stage of 4, the table once), but the search
    for fewer stages ran only where the greedy packing fit the devices given, which the table's copy on the last
    stage (its first and last stages of one layer, 2 devices each: 6) did not; the plan gave 4 stages of 1 device,
    its end stages over capacity."""
    plan = place(model, hardware, weight_bits=bits, **kw)
    assert plan.fits and plan.num_devices <= kw["devices"], plan.problems[:1]


@pytest.mark.parametrize("spare", [0.5, -0.01])
def test_a_tied_model_packed_by_memory_fits_as_placed(spare):
    """The fewest devices that hold a tied model: one holds it with its table once (``spare`` of the table to spare),
    or the stages that hold it each fit with what they hold (the last a copy of the table)."""
    import dataclasses

    from waferline.spec.catalog import load_hardware

    spec = load_model("qwen3-0.6b")
    m = place(spec, "wse-3", devices=1).stages[0].memory
    wse = load_hardware("wse-3")
    room = m.weights + m.cache + m.activations + spare * spec.embed_bytes(16)
    hw = dataclasses.replace(wse, memory_bytes=room / (1 - wse.reserve_fraction))
    plan = place(spec, hw)
    assert plan.fits and plan.num_devices == (1 if spare > 0 else 2)
    table, head = spec.embed_bytes(16), spec.lm_head_bytes(16)
    for st in plan.stages:
        ends = (table if st.has_embedding else 0.0) + (head + table * (not st.has_embedding) if st.has_lm_head else 0.0)
        assert st.num_devices == 1 and st.memory.weights == pytest.approx(_layers_weights(spec, st.layers) + ends)


def test_plans_of_models_made_one_after_another_are_each_their_own():
    """The per-layer bytes are cached by model: a model made after another was let go can take its id (and has the same
    name), and its plan and cost table were the other's layers (a sweep of sizes saw the weights of an earlier size)."""
    import gc

    from waferline.sim.cost import layer_table

    cfg = dict(model_type="llama", vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=4, max_position_embeddings=256)
    for i in range(60):
        spec = parse_hf_config(dict(cfg, intermediate_size=96 * (1 + i)), name="m")
        plan = place(spec, "h100-sxm", devices=1)
        assert sum(s.memory.weights for s in plan.stages) == pytest.approx(spec.weight_bytes(16))
        assert sum(c.weight_bytes for c in layer_table(spec, 16, 16, 4096)) == sum(
            layer.weight_bytes(16) for layer in spec.layers)
        del spec, plan
        gc.collect()


def test_gpu_stages_are_split_by_their_memory_per_device():
    """A stage of a tensor-parallel group holds its MLA latents whole on every device: the split that balances the
    stages' bytes is not the one that balances their bytes per device. deepseek-v3 at 128k x 64, 8-bit, on SN40L
    sockets: 13 stages of 8 hold it (5 layers each, the LM head's stage 1), where the split by bytes took 15 (120
    sockets; --devices 104 fitted it in 26 stages of 4)."""
    kw = dict(weight_bits=8, context=131072, batch=64)
    plan = place("deepseek-v3", "sn40l", **kw)
    assert plan.fits and [s.num_devices for s in plan.stages] == [8] * 13, [s.num_devices for s in plan.stages]
    assert [len(s.layers) for s in plan.stages] == [5] * 12 + [1]
    plan = place("deepseek-v3", "sn40l", devices=104, **kw)
    assert plan.fits and [s.num_devices for s in plan.stages] == [8] * 13


def test_an_attention_rank_whose_cache_no_device_count_holds_is_not_answered_with_more_devices():
    """llama-3.1-8b on wafers, AFD with 2 attention ranks, 128k x 64, 8-bit: each rank's 14 wafers hold 68.72 GB of
    cache each (8 KV heads: a cache splits over 8 devices at most), so more wafers do not help; the plan said to use
    "more devices" (the ranks' stages were explained without their cache floor), in place and when a plan file is
    re-judged; more attention ranks do help (each holds a smaller share of the batch's caches)."""
    plan = place("llama-3.1-8b", "wse-3", weight_bits=8, afd=True, attention_ranks=2, ffn_ranks=1, context=131072,
                 batch=64)
    assert not plan.fits and len(plan.problems) == 2
    placed = list(plan.problems)
    restage_memory(plan, "llama-3.1-8b")
    for problems in (placed, plan.problems):
        assert all("more devices in the stage do not help" in p and "more --attention-ranks" in p
                   and "or more devices" not in p for p in problems), problems
    assert place("llama-3.1-8b", "wse-3", weight_bits=8, afd=True, attention_ranks=4, ffn_ranks=1, context=131072,
                 batch=64).fits
