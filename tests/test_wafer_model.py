"""The mechanistic wafer term (activations streamed through the mesh), efficiencies bounded by physics, `simulate
--explain`, acceptance given as a range, and drafts that must share the target's tokenizer."""

import argparse
import json
import math

import pytest

from waferline.cli import main
from waferline.plan.commands import accept_rate_arg
from waferline.plan.place import place
from waferline.sim.cost import CLASS_PARAMS, expected_tokens_per_step, layer_table, load_params, stage_step
from waferline.sim.explain import _solve_accept, explain
from waferline.sim.pipeline import simulate
from waferline.sim.wafer import Fabric, fabric_work
from waferline.spec.catalog import load_hardware, load_model


def test_fabric_work_of_a_gqa_layer_is_its_vectors():
    """Llama-3.1-8B: the layer input, q, k, v, the attention output and the projection back cross the mesh."""
    spec = load_model("llama-3.1-8b")
    layer = spec.layers[0]
    d, H, kv, hd = 4096, 32, 8, 128
    fw = fabric_work(layer)
    assert fw.mixer_elems == d + H * hd + 2 * kv * hd + H * hd  # in, q + k + v out, attention out -> o_proj
    assert fw.ffn_elems == d + 2 * 14336 + d  # in, gate and up outputs, down output


def test_fabric_work_of_an_mla_layer_counts_its_low_rank_vectors():
    """gpt-5.6-sol's MLA (and -dsa's, MLA + an indexer): the low-rank products read their rank's width, not d, so
    their vectors come from the shapes (`matmul params / d` gave 19,008 elements, a third of them)."""
    d, H, q_lora, kv_lora, rope, nope, v = 12288, 96, 2048, 512, 64, 128, 128
    mla = d + q_lora + H * (nope + rope) + (kv_lora + rope) + H * (nope + v) + H * v  # in, q_a, q_b, kv_a, kv_b, o in
    assert fabric_work(load_model("gpt-5.6-sol").layers[0]).mixer_elems == mla == d + 57_920
    assert fabric_work(load_model("gpt-5.6-sol-dsa").layers[0]).mixer_elems == mla + 64 * 128 + 128  # + wq_b, wk


def test_fabric_work_of_a_v4_compressed_attention_layer_counts_its_low_rank_vectors():
    """gpt-5.6-sol-v4 (DeepSeek-V4-style compressed attention: low-rank query, grouped low-rank output): counted as
    `matmul params / d` it streamed 32,256 elements; by its shapes it writes 118,272."""
    d, H, hd, q_lora, g, o_lora = 12288, 96, 512, 2048, 16, 1024
    # in, q_a, q_b, the shared K=V head, the attention's output (wo_a's input), wo_a, the compressor's kv and gate
    v4 = d + q_lora + H * hd + hd + H * hd + g * o_lora + 2 * hd
    assert fabric_work(load_model("gpt-5.6-sol-v4").layers[0]).mixer_elems == v4 == d + 118_272


def test_fabric_constants_come_from_the_catalog():
    hw = load_hardware("wse-3")
    f = Fabric.of(hw)
    assert f.pes == hw.cores == 900000
    assert f.link_bytes_per_s == pytest.approx(hw.on_chip.bandwidth / (hw.cores * 8))
    assert f.hop_s == pytest.approx(1 / 1.1e9, rel=1e-3)  # one cycle at 1.1 GHz
    assert f.side(1.0) == pytest.approx(math.sqrt(900000))
    assert Fabric.of(load_hardware("h100-sxm")) is None


def _llama8b_on_wse3():
    hw = load_hardware("wse-3")
    spec = load_model("llama-3.1-8b")
    return hw, load_params().for_hardware(hw), spec, layer_table(spec, 16, 16, 2048)


def test_a_layer_alone_on_a_wafer_takes_the_region_fastest_for_it():
    """One layer alone on a wafer is not spread over every PE: a smaller region reads its bytes at its cores' share of
    the bandwidth but its vectors cross fewer hops. Its region is the fastest between the fewest cores whose SRAM holds
    it and the whole wafer, so a layer alone is never slower than the same layer sharing the wafer with 31 others."""
    hw, prm, spec, table = _llama8b_on_wse3()
    lc, f = table[0], Fabric.of(hw)
    alone = stage_step(table[:1], "full", 1, hw, prm, spec.hidden_size, 1, 1, 16)
    shared = stage_step(table, "full", 1, hw, prm, spec.hidden_size, 1, 1, 16)
    assert alone.total <= shared.total / len(table) * (1 + 1e-9)
    phases = lc.fabric_mixer_phases + lc.fabric_ffn_phases
    share = (alone.fabric_distance / (phases * f.hop_s)) ** 2 / f.pes  # (distance = phases x side x hop)
    assert lc.weight_bytes + lc.cache_bytes <= share * hw.usable_bytes() * (1 + 1e-6)  # (its SRAM holds it)
    assert share < 0.1  # (a small part of the wafer: the 8B layer needs 1.1% of its SRAM)
    def step(s):  # (the layer's decode step on a region of share s)
        stream, dist = f.time(lc.fabric_mixer_elems + lc.fabric_ffn_elems, phases, 1, s, prm.fabric_links)
        return max(alone.memory * share / s, alone.compute * share / s) + stream + dist
    assert step(share) == pytest.approx(alone.roofline + alone.fabric, rel=1e-9)
    for other in (share * 0.8, share * 1.25, 1.0):  # (the least near it, and the whole wafer is slower)
        assert step(other) > step(share)
    gpu = stage_step(table, "full", 1, load_hardware("h100-sxm"), prm, spec.hidden_size, 1, 1, 16)
    assert gpu.fabric == 0.0


def test_a_region_is_no_smaller_than_its_bytes_need():
    """A layer whose bytes need most of a wafer's SRAM keeps at least that share of its cores, however far its vectors
    travel: the fewest cores whose SRAM holds it (here, a gpt-5.6-sol layer on one wafer, 8-bit: ~36 GB)."""
    hw = load_hardware("wse-3")
    prm = load_params().for_hardware(hw)
    spec = load_model("gpt-5.6-sol")
    lc = layer_table(spec, 8, 16, 2048)[0]
    one = stage_step([lc], "full", 1, hw, prm, spec.hidden_size, 1, 1, 8)
    f = Fabric.of(hw)
    share = (one.fabric_distance / ((lc.fabric_mixer_phases + lc.fabric_ffn_phases) * f.hop_s)) ** 2 / f.pes
    assert share == pytest.approx((lc.weight_bytes + lc.cache_bytes) / hw.usable_bytes(), rel=1e-6)


def test_a_region_keeps_its_size_whatever_step_runs_on_it():
    """The region is laid out once, for the plan's decode step: a verify or a prefill chunk runs on the same cores."""
    hw, prm, spec, table = _llama8b_on_wse3()
    f = Fabric.of(hw)
    lc = table[0]
    phases = lc.fabric_mixer_phases + lc.fabric_ffn_phases
    shares = []
    for batch, tokens in ((1, 1), (1, 5), (1, 512)):
        sc = stage_step(table[:1], "full", 1, hw, prm, spec.hidden_size, batch, tokens, 16, resident_batch=1)
        shares.append((sc.fabric_distance / (phases * f.hop_s)) ** 2 / f.pes)
    assert shares == pytest.approx([shares[0]] * 3, rel=1e-9)


def test_prefill_streams_tokens_side_by_side():
    """A prompt's vectors share the region's bisection: 1000 tokens cost far less than 1000 single-token steps."""
    f = Fabric.of(load_hardware("wse-3"))
    one, _ = f.time(10000, 4, 1, 1.0, 4.0)
    many, _ = f.time(10000, 4, 1000, 1.0, 4.0)
    assert many < 1000 * one / 50


def test_every_efficiency_is_at_most_one():
    """Fitted efficiencies stay physical (no bandwidth above the peak), in the fit and in every bootstrap set."""
    p = load_params()
    for name, cp in p.classes.items():
        assert 0 < cp.bw_eff <= 1.0 and 0 < cp.flops_eff <= 1.0, name
        assert cp.fabric_links >= CLASS_PARAMS["fabric_links"][2], name
    for s in p.parameter_sets():
        for name, cp in s.classes.items():
            assert cp.bw_eff <= 1.0, name
    assert CLASS_PARAMS["bw_eff"][3] == 1.0 and CLASS_PARAMS["flops_eff"][3] == 1.0


@pytest.mark.parametrize("name,value", [("gpu.bw_eff", 3.0), ("wafer.fabric_links", 0.2),
                                        ("accept_rate.draft", 1.2), ("gpu.warp_factor", 0.5)])
def test_bootstrap_sets_stay_in_the_physical_ranges(tmp_path, name, value):
    """A parameter file's bootstrap sets are held to the bounds its values are (bw_eff 3 in every set once widened
    llama-3.1-70b on h200-sxm's 90% interval to 59.8-158.6 tok/s, past the peak bandwidth)."""
    import yaml

    from waferline.errors import ConfigError
    from waferline.sim.cost import FITTED_PATH

    d = yaml.safe_load(FITTED_PATH.read_text())
    bs = d["bootstrap"]
    if name not in bs["names"]:
        bs["names"].append(name)
        for row in bs["sets"]:
            row.append(value)
    else:
        i = bs["names"].index(name)
        for row in bs["sets"]:
            row[i] = value
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        load_params(p)


def test_explain_regroups_the_step_and_sizes_the_levers():
    plan = place("gpt-5.6-sol", "wse-3", devices=80, weight_bits=4)
    r = simulate(plan)
    ex = explain(r, 750.0)
    assert sum(t["seconds_per_step"] for t in ex["terms"]) == pytest.approx(ex["step_s"])
    assert ex["step_s"] == pytest.approx(sum(s.total for s in r.stages), rel=1e-9)
    terms = {t["term"]: t["seconds_per_step"] for t in ex["terms"]}
    assert terms["mesh distance"] + terms["mesh streaming"] == pytest.approx(sum(s.fabric for s in r.stages))
    assert terms["mesh distance"] == pytest.approx(sum(s.fabric_distance for s in r.stages))
    assert terms["mesh distance"] > 0
    tgt = ex["target"]
    assert not tgt["met"] and tgt["step_needed_s"] == pytest.approx(1 / 750.0, rel=1e-6)
    for lv in tgt["levers"]:
        if lv["to_s"] is not None:
            assert lv["from_s"] - lv["to_s"] == pytest.approx(ex["step_s"] - tgt["step_needed_s"])
    a = tgt["speculative"]["accept_rate_needed"]
    assert expected_tokens_per_step(a, 3) == pytest.approx(tgt["speculative"]["tokens_per_step_needed"], rel=1e-6)
    assert explain(r, 1.0)["target"]["met"]


def test_explain_read_lever_stops_at_the_compute_it_hides():
    """Faster reads shorten a layer only down to its compute (the roofline): the read lever, applied to the hardware,
    reaches the target (to 0.1%: a wafer with faster reads lays its regions out a little smaller), and where the
    compute would bound the step first it is not offered (it once said 206 -> 23 us for 551 tok/s; with that bandwidth
    the rate stayed 543)."""
    import dataclasses

    plan = place("llama-3.1-70b", "wse-3")  # (486 tok/s; at most 524 however fast the reads)
    r = simulate(plan)
    lever = next(lv for lv in explain(r, 515.0)["target"]["levers"] if lv["term"] == "weights and cache read")
    assert lever["to_s"] is not None and lever["from_s"] / lever["to_s"] == pytest.approx(lever["factor"])
    hw = load_hardware("wse-3")
    faster = dataclasses.replace(hw, memory_bandwidth=hw.memory_bandwidth * lever["factor"])
    assert simulate(plan, hardware=faster).decode_tokens_per_s_per_user == pytest.approx(515.0, rel=1e-3)
    lever = next(lv for lv in explain(r, 530.0)["target"]["levers"] if lv["term"] == "weights and cache read")
    assert lever["to_s"] is None and 0 < lever["floor_s"] < lever["from_s"]
    much = dataclasses.replace(hw, memory_bandwidth=hw.memory_bandwidth * 1000)
    assert simulate(plan, hardware=much).decode_tokens_per_s_per_user < 530.0
    assert explain(r, 530.0)["target"]["levers_note"] is None  # (without speculation the levers are exact)
    from waferline.plan.plan import SpeculativeConfig

    spec_r = simulate(place("llama-3.1-70b", "wse-3", speculative=SpeculativeConfig("draft", 5, 0.8)))
    assert "approximate" in explain(spec_r, 4000.0)["target"]["levers_note"]


def test_explain_under_afd_ranks_explains_the_simulated_step():
    """Attention/FFN ranks run at once: the step explained is the simulated one (not every rank's busy time added
    up), each side counted once, and a side busier than the target step is what has to shrink."""
    plan = place("deepseek-v3", "h200-sxm", weight_bits=8, afd=True, attention_ranks=2, ffn_ranks=4, batch=16)
    r = simulate(plan)
    ex = explain(r, 100.0)
    assert ex["overlapped"] and ex["step_s"] == pytest.approx(1 / r.decode_tokens_per_s_per_user, rel=1e-9)
    terms = {t["term"]: t["seconds_per_step"] for t in ex["terms"]}
    assert set(terms) == {"attention side", "FFN side", "attention-FFN transfers"}
    assert max(terms.values()) <= ex["step_s"] * (1 + 1e-9)  # (one side's busy time fits in the overlapped step)
    tgt = ex["target"]
    assert tgt["step_needed_s"] == pytest.approx(1 / 100.0, rel=1e-6)
    assert tgt["speculative"]["tokens_per_step_needed"] == pytest.approx(100.0 * ex["step_s"], rel=1e-6)
    assert [lv["term"] for lv in tgt["levers"]] == [k for k, v in terms.items() if v > 1 / 100.0]
    assert not explain(simulate(place("deepseek-v3", "wse-3", weight_bits=4, afd=True)))["overlapped"]


def test_more_users_on_a_wafer_never_make_each_faster():
    """A layer's region holds the cache of every resident sequence: more users sharing the wafers cannot shrink it
    (the share once counted one micro-batch's cache against every sequence's: 330.9 -> 338.6 tok/s at 32 users)."""
    plan = place("gpt-5.6-sol-gqa", "wse-3", devices=80, weight_bits=4, batch=32, context=100_000)
    rates = [simulate(plan, concurrency=c, prompt_len=99_000, output_len=1000).decode_tokens_per_s_per_user
             for c in (1, 8, 32)]
    assert rates == sorted(rates, reverse=True) and rates[0] > rates[-1]


def test_solve_accept_bounds():
    assert _solve_accept(1.0, 3) == 0.0
    assert _solve_accept(4.0, 3) is None
    assert expected_tokens_per_step(_solve_accept(2.5, 4), 4) == pytest.approx(2.5, rel=1e-9)


def test_accept_rate_arg():
    assert accept_rate_arg("0.8") == (0.8, 0.8)
    assert accept_rate_arg("0.6:0.9") == (0.6, 0.9)
    assert accept_rate_arg("0.6-0.9") == (0.6, 0.9)
    assert accept_rate_arg("5e-1") == (0.5, 0.5) and accept_rate_arg("5e-1:9e-1") == (0.5, 0.9)
    assert accept_rate_arg("5e-1-9e-1") == (0.5, 0.9)
    for bad in ("0.9:0.6", "1.2", "-0.5", "abc", "0.1:0.2:0.3", "nan", "0.6-", ":0.6", "0.1-0.2-0.3"):
        with pytest.raises(argparse.ArgumentTypeError):
            accept_rate_arg(bad)


def _sim_json(capsys, *argv):
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_acceptance_range_spans_the_interval(capsys):
    base = ["llama-3.1-70b", "--hardware", "h200-sxm", "--devices", "8", "--speculative", "mtp"]
    lo = _sim_json(capsys, *base, "--accept-rate", "0.5", "--no-intervals")
    hi = _sim_json(capsys, *base, "--accept-rate", "0.9", "--no-intervals")
    mid = _sim_json(capsys, *base, "--accept-rate", "0.5:0.9")
    assert mid["speculative"]["accept_rate"] == pytest.approx(0.7)
    low, high = mid["decode_tokens_per_s_per_user_interval"]
    assert low <= lo["decode_tokens_per_s_per_user"] * 1.0001 and high >= hi["decode_tokens_per_s_per_user"] * 0.9999
    assert mid["speculative"]["accept_rate_interval"][0] <= 0.5 + 1e-9


def test_explain_flag_prints_and_json_carries_it(capsys):
    d = _sim_json(capsys, "gpt-5.6-sol", "--hardware", "wse-3", "--devices", "80", "--weight-bits", "4",
                  "--no-intervals", "--explain", "--target-tokens-per-s", "750")
    assert d["explain"]["target"]["tokens_per_s"] == 750 and d["explain"]["terms"]
    assert main(["simulate", "gpt-5.6-sol", "--hardware", "wse-3", "--devices", "80", "--weight-bits", "4",
                 "--no-intervals", "--explain"]) == 0
    assert "where one decode step goes" in capsys.readouterr().out
    assert main(["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--target-tokens-per-s", "750"]) == 2
    assert "--explain" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["gpt-5.6-sol", "--hardware", "wse-3", "--devices", "80", "--weight-bits", "4"],
                                  ["gpt-oss-20b", "--hardware", "h100-sxm"]])
def test_explains_acceptance_reaches_the_target_when_simulated(capsys, argv):
    """The acceptance --explain says MTP needs for the target, simulated with --speculative mtp, reaches it (it was
    sized for a free drafter and a one-token verify step: 0.61 for Sol's 750 tok/s, which gave 722; 0.54 for
    gpt-oss-20b on an H100 at 1.3 times its rate, which gave 73% of it)."""
    base = [*argv, "--no-intervals"]
    rate = _sim_json(capsys, *base)["decode_tokens_per_s_per_user"]
    target = 750.0 if argv[0] == "gpt-5.6-sol" else 1.3 * rate
    sp = _sim_json(capsys, *base, "--explain", "--target-tokens-per-s", str(target))["explain"]["target"]["speculative"]
    a = sp["accept_rate_needed"]
    assert a is not None and sp["num_tokens"] == 3
    got = _sim_json(capsys, *base, "--speculative", "mtp", "--num-speculative-tokens", "3", "--accept-rate",
                    f"{a + 1e-6:.6f}")["decode_tokens_per_s_per_user"]
    assert got == pytest.approx(target, rel=1e-3)


def test_explains_levers_reach_the_target_where_the_slowest_stage_binds():
    """With micro-batches in flight a user's tokens are the slowest stage x micro-batches apart, not one step: the
    fixed-latency lever, applied to the parameters, reaches the target (sized on the step it said 14.0x less, which
    gave 1,556 of 1,628 tok/s)."""
    plan = place("gpt-oss-20b", "groq-lpu-v1", devices=192, weight_bits=4, batch=64)
    params = load_params()
    r = simulate(plan, concurrency=64, params=params)
    assert r.bound.startswith("pipeline")
    target = 3 * r.decode_tokens_per_s_per_user
    tgt = explain(r, target)["target"]
    lever = next(lv for lv in tgt["levers"] if lv["term"] == "fixed per layer")
    assert tgt["interval_needed_s"] == pytest.approx(1 / target) and lever["factor"] is not None
    faster = params.copy()
    cp = faster.for_hardware(load_hardware("groq-lpu-v1"))
    cp.layer_latency_s /= lever["factor"]
    cp.moe_latency_s /= lever["factor"]
    got = simulate(plan, concurrency=64, params=faster).decode_tokens_per_s_per_user
    assert got == pytest.approx(target, rel=1e-6)


def test_a_draft_with_another_tokenizer_is_refused(capsys):
    assert main(["simulate", "llama-3.1-70b", "--hardware", "h200-sxm", "--devices", "8", "--speculative", "draft",
                 "--draft-model", "qwen3-0.6b", "--no-intervals"]) != 0
    assert "tokenizer" in capsys.readouterr().err
    d = _sim_json(capsys, "kimi-k2.6", "--hardware", "wse-3", "--weight-bits", "4", "--speculative", "draft",
                  "--no-intervals")
    assert "draft head" in d["speculative"]["drafter"]  # llama-3.2-1b's vocabulary is not Kimi's
    d = _sim_json(capsys, "llama-3.1-70b", "--hardware", "h200-sxm", "--devices", "8", "--speculative", "draft",
                  "--no-intervals")
    assert "llama-3.2-1b" in d["speculative"]["drafter"]


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused(capsys):
    """Mixtral's and Llama 2's vocabularies both hold 32,000 tokens, not the same ones: the catalog names each one's
    tokenizer, and a draft of the other is refused (it was predicted at the draft-model acceptance, 0.97)."""
    assert main(["simulate", "mixtral-8x7b", "--hardware", "h200-sxm", "--devices", "2", "--speculative", "draft",
                 "--draft-model", "llama-2-70b", "--no-intervals"]) != 0
    err = capsys.readouterr().err
    assert "tokenizer" in err and len(err.strip().splitlines()) == 1
    d = _sim_json(capsys, "mixtral-8x7b", "--hardware", "h200-sxm", "--devices", "2", "--speculative", "draft",
                  "--draft-model", "mixtral-8x7b", "--no-intervals")
    assert "mixtral-8x7b" in d["speculative"]["drafter"]


def test_a_draft_model_with_fewer_positions_than_the_sequence_is_noted(capsys):
    """qwen3-next's default draft (qwen3-0.6b) has 40,960 positions, the target 262,144: a 60,500-token sequence is
    past the draft's, and the prediction says so (as it does past the target's own)."""
    d = _sim_json(capsys, "qwen3-next-80b-a3b", "--hardware", "h200-sxm", "--devices", "4", "--prompt-len", "60000",
                  "--speculative", "draft", "--no-intervals")
    assert any("past the draft model qwen3-0.6b's 40,960 positions" in n for n in d["notes"])
    d = _sim_json(capsys, "qwen3-next-80b-a3b", "--hardware", "h200-sxm", "--devices", "4", "--speculative", "draft",
                  "--no-intervals")
    assert not any("past the draft model" in n for n in d["notes"])


def test_explain_compute_lever_divides_the_whole_flop_time():
    """Where the FLOPs outlast the reads, the compute lever's factor is of the FLOP time and, applied to the hardware,
    reaches the target (sized on the part beyond the reads alone it said 10.13x for 45 tok/s, where 1.36x does it)."""
    import dataclasses

    plan = place("llama-3.1-70b", "h100-sxm", devices=8, batch=512, context=2000)
    r = simulate(plan, concurrency=512)
    assert r.bound == "compute"
    lever = next(lv for lv in explain(r, 45.0)["target"]["levers"] if lv["term"] == "compute")
    assert lever["factor"] is not None
    hw = load_hardware("h100-sxm")

    def rate(f):
        faster = dataclasses.replace(hw, flops={k: v * f for k, v in hw.flops.items()})
        return simulate(plan, concurrency=512, hardware=faster).decode_tokens_per_s_per_user

    assert rate(lever["factor"]) == pytest.approx(45.0, rel=1e-3)
    assert rate(lever["factor"] * 0.97) < 45.0
    assert lever["flops_s"] > lever["from_s"] > lever["to_s"] > 0


def test_explain_under_afd_says_a_side_within_the_step_is_not_enough(capsys):
    """Under attention/FFN disaggregation a side cut to the target step is needed, not enough (the FFN side 1.42x
    shorter gave 80 of 100 tok/s), and where the round trips bind, more micro-batches do not raise a user's rate (they
    once were offered as what hides them: 124 tok/s per user fell to 118 with two)."""
    r = simulate(place("deepseek-v3", "h200-sxm", devices=16, weight_bits=8, afd=True, batch=32), concurrency=32)
    tgt = explain(r, 100.0)["target"]
    assert [lv["term"] for lv in tgt["levers"]] == ["FFN side"] and "not enough" in (tgt["levers_note"] or "")
    assert main(["simulate", "deepseek-v3", "--hardware", "h200-sxm", "--devices", "16", "--weight-bits", "8", "--afd",
                 "--no-intervals", "--explain", "--target-tokens-per-s", "200"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "round trips between them bound the step" in out and "not a user's" in out


@pytest.mark.parametrize("batch", ["1", "8"])
def test_explain_under_afd_ranks_says_how_the_shares_add_up(capsys, batch):
    """The AFD sides' shares add to more than the step where they overlap (micro-batches in flight) and to at most it
    where a layer's round trip binds (one sequence: attention, transfers and the FFN in turn); the title once said
    "more than 100%" for both (they added to 98.5% for deepseek-v3 on two H100 attention and FFN ranks, batch 1)."""
    argv = ["simulate", "deepseek-v3", "--hardware", "h100-sxm", "--weight-bits", "4", "--afd", "--attention-ranks",
            "2", "--ffn-ranks", "2", "--batch", batch, "--no-intervals", "--explain"]
    assert main([*argv, "--json"]) == 0
    added = sum(t["share"] for t in json.loads(capsys.readouterr().out)["explain"]["terms"])
    assert (added > 1) == (batch == "8")
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("add to more than 100%" in out) == (added > 1) and ("add to at most 100%" in out) == (added <= 1)


def test_explain_compute_lever_with_speculation_counts_the_verify_tokens():
    """A verify step of k+1 tokens has k+1 times a token's FLOPs: where they bind, faster compute is offered, sized
    on the speculative step (it once said removing the compute was not enough for 30 tok/s; removed, it gave 39)."""
    import dataclasses

    from waferline.plan.plan import SpeculativeConfig

    plan = place("llama-3.1-70b", "h100-sxm", devices=8, batch=512, context=2000,
                 speculative=SpeculativeConfig("eagle"))
    r = simulate(plan, concurrency=512)
    lever = next(lv for lv in explain(r, 30.0)["target"]["levers"] if lv["term"] == "compute")
    assert lever["factor"] is not None
    hw = load_hardware("h100-sxm")
    faster = dataclasses.replace(hw, flops={k: v * lever["factor"] for k, v in hw.flops.items()})
    got = simulate(plan, concurrency=512, hardware=faster).decode_tokens_per_s_per_user
    assert got == pytest.approx(30.0, rel=0.03)


def test_explain_adds_up_to_the_simulated_step_where_some_layers_are_compute_bound():
    """DeepSeek-V3 at 256 users: its dense layers' FLOPs outlast their reads while its MoE layers' reads bind, and
    each layer costs the larger of the two: the terms add up to the simulated step (summed per stage they once came
    to 28,576 of its 28,588 us)."""
    plan = place("deepseek-v3", "h200-sxm", devices=8, weight_bits=8, batch=256, layers_per_stage=61)  # (one stage)
    r = simulate(plan, concurrency=256)
    ex = explain(r)
    assert sum(s.compute for s in r.stages) < sum(s.memory for s in r.stages)
    assert ex["step_s"] == pytest.approx(r.step_latency_s, rel=1e-9)
    assert {t["term"] for t in ex["terms"]} >= {"compute", "weights and cache read"}


def test_explain_levers_reach_the_target_where_some_layers_are_compute_bound():
    """The levers follow the step op by op, as the simulator takes each layer's larger term: DeepSeek-V3's dense
    layers' FLOPs outlast their reads while the MoE layers' reads bind (summed, the reads are the longer), so faster
    FLOPs shorten the step (sized on the stage's sums, the compute lever said removing it was not enough where
    FLOPs 1.09x faster reach the target), and each lever, applied to the hardware, reaches the target."""
    import dataclasses

    plan = place("deepseek-v3", "h200-sxm", devices=8, weight_bits=8, batch=256, layers_per_stage=61)  # (one stage)
    r = simulate(plan, concurrency=256)
    assert sum(s.compute for s in r.stages) < sum(s.memory for s in r.stages)
    hw = load_hardware("h200-sxm")
    terms = {t["term"]: t["seconds_per_step"] for t in explain(r)["terms"]}
    for target, term, field in ((1 / (r.step_latency_s - terms["compute"] / 2), "compute", "flops"),
                                (1.1 * r.decode_tokens_per_s_per_user, "weights and cache read", "memory_bandwidth")):
        lever = next(lv for lv in explain(r, target)["target"]["levers"] if lv["term"] == term)
        assert lever["factor"] is not None, term
        f = lever["factor"]
        faster = dataclasses.replace(hw, flops={k: v * f for k, v in hw.flops.items()}) if field == "flops" else \
            dataclasses.replace(hw, memory_bandwidth=hw.memory_bandwidth * f)
        got = simulate(plan, concurrency=256, hardware=faster).decode_tokens_per_s_per_user
        assert got == pytest.approx(target, rel=1e-6), term


def test_explain_lists_no_compute_term_where_the_reads_hide_it():
    """A wafer's layers compute in far less time than their reads: the breakdown and the levers name no compute term
    (the compute taken as what the step leaves beyond the other terms left a rounding residue, shown as "0.0 us")."""
    r = simulate(place("gpt-5.6-sol", "wse-3", devices=80, weight_bits=4), concurrency=1)
    ex = explain(r, 750.0)
    assert "compute" not in [t["term"] for t in ex["terms"]]
    assert "compute" not in [lv["term"] for lv in ex["target"]["levers"]]


def test_explain_levers_with_speculation_reach_the_target_when_applied(capsys):
    """Under speculation a lever is sized by re-simulating the speculative step (the drafter's steps and the verify of
    k+1 tokens), and applied to the hardware it reaches the target: sized on the one-token step's terms, DeepSeek-V3's
    read lever reached 1.022x the target and Llama-3.1-70B's collectives lever said 12.8x where 7.5x does it."""
    import dataclasses

    from waferline.plan.plan import SpeculativeConfig

    params = load_params()
    cases = (("deepseek-v3", "h200-sxm", dict(devices=8, weight_bits=8, batch=32, layers_per_stage=61), 32, "mtp",
              "weights and cache read"),
             ("llama-3.1-70b", "h100-sxm", dict(devices=8, batch=64, context=2000), 64, "eagle", "collectives"))
    for model, hwname, kw, conc, method, term in cases:
        plan = place(model, hwname, speculative=SpeculativeConfig(method), **kw)
        r = simulate(plan, concurrency=conc, params=params)
        target = 1.3 * r.decode_tokens_per_s_per_user

        def rate_with(t, f, plan=plan, conc=conc):
            return simulate(plan, concurrency=conc, params=params.sped_up(t, f)).decode_tokens_per_s_per_user

        tgt = explain(r, target, None, rate_with)["target"]
        assert "re-simulating" in tgt["levers_note"]
        f = next(lv for lv in tgt["levers"] if lv["term"] == term)["factor"]
        hw = load_hardware(hwname)
        if term == "collectives":  # (an all-reduce's latency steps and bytes, both f times faster)
            link = hw.scale_up
            hw = dataclasses.replace(hw, scale_up=dataclasses.replace(link, latency=link.latency / f,
                                                                      bandwidth=link.bandwidth * f))
        else:
            hw = dataclasses.replace(hw, memory_bandwidth=hw.memory_bandwidth * f)
        got = simulate(plan, concurrency=conc, hardware=hw, params=params).decode_tokens_per_s_per_user
        assert got == pytest.approx(target, rel=1e-6), (model, term, f)
    # the command sizes its levers so
    tgt = _sim_json(capsys, "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "8", "--speculative", "eagle",
                    "--no-intervals", "--explain", "--target-tokens-per-s", "400")["explain"]["target"]
    assert tgt["levers"] and "re-simulating" in tgt["levers_note"]
    # a read lever that is not enough says so without the one-token step's floor (it does not bound a verify step)
    tgt = _sim_json(capsys, "gpt-5.6-sol", "--hardware", "wse-3", "--weight-bits", "4", "--devices", "80",
                    "--speculative", "mtp", "--no-intervals", "--explain", "--target-tokens-per-s",
                    "1500")["explain"]["target"]
    read = next(lv for lv in tgt["levers"] if lv["term"] == "weights and cache read")
    assert read["to_s"] is None and "floor_s" not in read
