"""Cross-validation (every fitted parameter refit without the held-out rows) and the 90% intervals from the fit's
bootstrap parameter sets."""

import json
import re

import pytest

from waferline.plan import commands
from waferline.plan.place import place
from waferline.sim.cost import SimParams, load_params
from waferline.sim.crossval import cross_validate
from waferline.sim.fit import TTFT_PRIOR, fit, fit_rows, problem
from waferline.sim.intervals import FIGURES, SPEC_FIGURES, attach_intervals, interval, percentile
from waferline.sim.pipeline import simulate
from waferline.sim.validate import unstated_reasoning

HEADER = ("id,system,model,hardware,num_chips,weight_bits,spec_decoding,concurrency,input_len,output_len,metric,value,"
          "unit,date,source,notes\n")
ROWS = [
    "a,SysA,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,150,tok/s,,,",
    "b,SysA,llama-3.1-70b,h100-sxm,4,16,none,1,,,decode_tokens_per_s_per_user,45,tok/s,,,",
    "c,SysB,llama-3.1-8b,h100-sxm,2,16,none,1,,,decode_tokens_per_s_per_user,260,tok/s,,,",
]


def _csv(tmp_path, rows, name="r.csv"):
    p = tmp_path / name
    p.write_text(HEADER + "".join(r + "\n" for r in rows))
    return p


def test_row_fold_refits_without_the_held_out_row(tmp_path):
    """A fold's prediction of its held-out row does not depend on that row's published value, and the fold's
    parameters differ from the fit on every row."""
    p1 = _csv(tmp_path, ROWS, "one.csv")
    p2 = _csv(tmp_path, ROWS[:2] + [ROWS[2].replace(",260,", ",900,")], "two.csv")
    r1, s1 = cross_validate(p1, "row", iters=40)
    r2, _ = cross_validate(p2, "row", iters=40)
    assert s1["folds"] == 3 and s1["predicted"] == 3
    assert r1[2].predicted == pytest.approx(r2[2].predicted, rel=1e-12)  # c held out: its value is never seen
    assert r1[0].predicted != pytest.approx(r2[0].predicted, rel=1e-6)  # a's fold saw c's (changed) value
    full, _ = fit(p1, iters=40)
    prob = problem(p1)
    fold = fit_rows(prob.subset([0, 1]), iters=40)
    assert fold.classes["gpu"].bw_eff != pytest.approx(full.classes["gpu"].bw_eff, rel=1e-4)
    assert r1[2].error_factor == pytest.approx(max(r1[2].predicted / 260, 260 / r1[2].predicted))


def test_a_parameter_only_the_held_out_rows_inform_goes_back_to_its_prior(tmp_path):
    """The TTFT request overhead (and acceptance rates) are refit too: held out with their only row, the fold
    predicts with the prior, never with the shipped fit's value."""
    rows = ROWS[:2] + ["t,SysT,llama-3.1-8b,h100-sxm,1,16,none,1,1000,,ttft_s,0.5,s,,,"]
    p = _csv(tmp_path, rows)
    res, _ = cross_validate(p, "vendor", iters=40)
    prob = problem(p)
    assert load_params().ttft_overhead_s != pytest.approx(TTFT_PRIOR[0])
    fold = fit_rows(prob.subset([0, 1]), iters=40)
    assert fold.ttft_overhead_s == TTFT_PRIOR[0]
    assert res[2].predicted == pytest.approx(prob.models[2][1].predict(fold)[0], rel=1e-9)


def test_a_row_no_fold_holds_is_checked_with_the_fit_on_this_csv_not_the_shipped_one(tmp_path):
    """A not comparable row (left out of every fit) in its own fold is checked with the fit on the CSV's other rows,
    never with the shipped fit (made on other data)."""
    p = tmp_path / "nc.csv"
    p.write_text("id,system,model,hardware,num_chips,weight_bits,spec_decoding,concurrency,input_len,output_len,"
                 "reasoning_tokens,metric,value\n"
                 "a,SysA,llama-3.1-8b,h100-sxm,1,16,none,1,,,,decode_tokens_per_s_per_user,150\n"
                 "b,SysA,llama-3.1-70b,h100-sxm,4,16,none,1,,,,decode_tokens_per_s_per_user,45\n"
                 "n,SysN,llama-3.1-8b,h100-sxm,1,16,none,1,1000,500,unstated,end_to_end_latency_s,20\n")
    res, s = cross_validate(p, "row", iters=40)
    assert s["folds"] == 2 and list(s["not_comparable"]) == ["n"]
    got = res[2].detail["unstated_reasoning"]["decode_tokens_per_s"]
    prob = problem(p)
    own = fit_rows(prob, iters=40)
    assert got == pytest.approx(unstated_reasoning(res[2].row, own, [])["decode_tokens_per_s"], rel=1e-9)
    assert got != pytest.approx(unstated_reasoning(res[2].row, load_params(), [])["decode_tokens_per_s"], rel=1e-3)
    assert res[2].detail["fold"] is None  # (no fold's refit: the fit on every predicted row)
    # by vendor, with its vendor's rows: checked with that fold's refit, and the row says which (it said none)
    p.write_text(p.read_text().replace("n,SysN,", "n,SysA,").replace("b,SysA,", "b,SysB,"))
    res, s = cross_validate(p, "vendor", iters=40)
    assert s["folds"] == 2 and res[-1].row.id == "n" and res[-1].detail["fold"] == "SysA"


def test_memory_efficiency_is_one_parameter_per_memory_kind(tmp_path):
    """GPUs and RDUs (HBM) share one fitted bandwidth efficiency: it is fitted once from both classes' rows, and a
    fit whose rows hold only GPUs gives the RDU the GPUs' value, not its prior; per-layer latency stays per class."""
    rows = ROWS[:2] + ["s,SysS,llama-3.1-8b,sn40l,8,16,none,1,,,decode_tokens_per_s_per_user,900,tok/s,,,"]
    both, _ = fit(_csv(tmp_path, rows, "both.csv"), iters=40)
    assert both.classes["rdu"].bw_eff == both.classes["gpu"].bw_eff
    assert both.classes["rdu"].status["bw_eff"] == "fitted, shared by gpu, rdu"
    assert both.classes["rdu"].layer_latency_s != both.classes["gpu"].layer_latency_s
    gpu_only = fit_rows(problem(_csv(tmp_path, rows, "both.csv")).subset([0, 1]), iters=40)
    assert gpu_only.classes["rdu"].bw_eff == gpu_only.classes["gpu"].bw_eff != pytest.approx(0.75)
    assert gpu_only.classes["rdu"].layer_latency_s == pytest.approx(10e-6)  # its prior: no RDU rows


def test_a_class_that_takes_a_shared_fitted_value_follows_each_parameter_set(tmp_path):
    """A class without rows that takes its memory kind's fitted bandwidth efficiency (the RDU from GPU-only rows)
    takes each bootstrap set's value of it too, in memory and read back from the file: its intervals hold that
    parameter's uncertainty, not its point value alone."""
    fitted, _ = fit(_csv(tmp_path, ROWS), iters=40, bootstrap_sets=4)
    assert fitted.classes["rdu"].status["bw_eff"] == "fitted, shared by gpu"
    out = tmp_path / "f.yaml"
    fitted.save(out)
    for params in (fitted, load_params(out)):
        sets = params.parameter_sets()
        assert len({s.classes["gpu"].bw_eff for s in sets}) > 1
        assert [s.classes["rdu"].bw_eff for s in sets] == [s.classes["gpu"].bw_eff for s in sets]
        assert all(s.classes["rdu"].layer_latency_s == params.classes["rdu"].layer_latency_s for s in sets)


def test_vendor_folds_group_by_the_system_column(tmp_path):
    res, s = cross_validate(_csv(tmp_path, ROWS), "vendor", iters=40)
    assert s["folds"] == 2 and [r.detail["fold"] for r in res] == ["SysA", "SysA", "SysB"]
    assert all(r.detail["trained_on"] == (1 if r.row.system == "SysA" else 2) for r in res)


def test_a_row_the_simulator_refuses_is_skipped_by_the_fit_and_the_folds_as_by_validate(tmp_path):
    """A row the planner places but the simulator refuses (here a user's device YAML with no link between the
    devices of a stage) is skipped with its reason by `validate`; the fit and every fold leave it out the same way,
    rather than refusing the whole CSV."""
    from waferline.sim.validate import validate
    from waferline.spec.hardware import catalog_dir

    src = (catalog_dir() / "h100-sxm.yaml").read_text()
    (tmp_path / "nolink.yaml").write_text(src.replace("name: h100-sxm", "name: nolink").split("links:")[0])
    row = "n,SysN,llama-3.1-70b,nolink.yaml,4,16,none,1,,,decode_tokens_per_s_per_user,60,tok/s,,,"
    p = _csv(tmp_path, [*ROWS, row])
    res, s = validate(p)
    assert s["predicted"] == 3 and s["skipped"] == 1 and "no link" in res[3].skipped
    fitted, report = fit(p, iters=40)
    assert report["rows"] == 3 and [rid for rid, _ in report["skipped"]] == ["n"]
    res, s = cross_validate(p, "vendor", iters=40)
    assert s["predicted"] == 3 and s["skipped"] == 1
    assert [r.row.id for r in res if r.skipped] == ["n"] and "no link" in res[-1].skipped


def test_a_csv_with_no_usable_row_says_why_in_one_line(tmp_path, capsys):
    """calibrate --published and validate --cross-validate on a CSV with a header and no data rows, or with only rows
    that cannot be placed, say why (not a message that ends at its colon), each skipped row past the fifth counted."""
    from waferline.cli import main as cli_main

    empty = _csv(tmp_path, [], "empty.csv")
    for argv in (["calibrate", "--published", str(empty), "--out", str(tmp_path / "f.yaml")],
                 ["validate", "--data", str(empty), "--cross-validate", "row"]):
        assert cli_main(argv) != 0
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and not err.endswith(":") and "no data rows" in err
    assert not (tmp_path / "f.yaml").exists()
    unknown = _csv(tmp_path, [f"u{i},S,llama-3.1-8b,nohw,1,16,none,1,,,decode_tokens_per_s_per_user,100,tok/s,,,"
                              for i in range(7)], "unknown.csv")
    assert cli_main(["calibrate", "--published", str(unknown), "--out", str(tmp_path / "f.yaml")]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "u4: unknown hardware 'nohw'" in err and err.endswith("; and 2 more")


def test_bad_cross_validate_values_are_one_line_errors(capsys):
    assert commands.main(["validate", "--cross-validate", "bogus"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "row, vendor" in err


def test_cli_cross_validate_json_rows_are_out_of_fold(tmp_path, capsys):
    assert commands.main(["validate", "--data", str(_csv(tmp_path, ROWS)), "--cross-validate", "vendor",
                          "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["summary"]["cross_validate"] == "vendor" and d["summary"]["median_error_factor"] >= 1.0
    assert all(r["out_of_fold"] and r["fold"] in ("SysA", "SysB") and r["predicted"] > 0 for r in d["rows"])


def test_bootstrap_sets_round_trip_and_intervals_hold_the_point(tmp_path):
    p = _csv(tmp_path, ROWS)
    told: list[tuple[str, float]] = []
    fitted, report = fit(p, iters=40, bootstrap_sets=6, progress=lambda what, frac: told.append((what, frac)))
    assert report["bootstrap_sets"] == 6 and len(fitted.bootstrap) == 6
    # the refits (most of `calibrate --published`'s time) are reported one by one, the bar ending full
    fracs = [f for _, f in told]
    assert fracs == sorted(fracs) and fracs[-1] == pytest.approx(1.0) and told[-1][0] == "bootstrap refit 6/6"
    out = tmp_path / "f.yaml"
    fitted.save(out)
    again = load_params(out)
    assert len(again.bootstrap) == 6 and set(again.bootstrap[0]) == set(fitted.bootstrap[0])
    sets = again.parameter_sets()
    assert sets[0].classes["gpu"].bw_eff == pytest.approx(again.bootstrap[0]["gpu.bw_eff"], rel=1e-5)
    assert sets[0].classes["tpu"].bw_eff == sets[0].classes["gpu"].bw_eff  # tpu takes the gpu values
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, speculative=_spec("eagle"))
    r = simulate(plan, params=again)
    assert r.intervals == {}  # only on request: sweeps stay fast
    attach_intervals(r, plan, again)
    for f in FIGURES:
        lo, hi = r.intervals[f]
        assert lo <= getattr(r, f) <= hi
    for f in SPEC_FIGURES:
        lo, hi = r.speculative[f + "_interval"]
        assert lo <= r.speculative[f] <= hi
    assert r.intervals["decode_tokens_per_s_per_user"][0] < r.intervals["decode_tokens_per_s_per_user"][1]


def _spec(method):
    from waferline.plan.plan import SpeculativeConfig

    return SpeculativeConfig(method)


def test_interval_helpers():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0, 2.0], 0.25) == 1.25
    assert interval(10.0, [1.0, 2.0, 3.0]) == [pytest.approx(1.1), 10.0]
    no_sets = SimParams(classes=dict(load_params().classes))
    plan = place("llama-3.1-8b", "h100-sxm", devices=1)
    r = attach_intervals(simulate(plan, params=no_sets), plan, no_sets)
    assert r.intervals == {f: None for f in FIGURES} and r.to_dict()["ttft_s_interval"] is None


def test_simulate_json_has_an_interval_for_every_predicted_figure(capsys):
    assert commands.main(["simulate", "llama-3.1-70b", "--hardware", "h200-sxm", "--devices", "8", "--weight-bits",
                          "8", "--speculative", "medusa", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for f in FIGURES:
        iv = d[f + "_interval"]
        assert iv is not None and iv[0] <= d[f] <= iv[1], f
    for f in SPEC_FIGURES:
        assert d["speculative"][f + "_interval"][0] <= d["speculative"][f] <= d["speculative"][f + "_interval"][1]
    assert commands.main(["simulate", "llama-3.1-8b", "--hardware", "h100-sxm"]) == 0
    assert "(90%: " in capsys.readouterr().out
    assert commands.main(["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--json", "--no-intervals"]) == 0
    assert "ttft_s_interval" not in json.loads(capsys.readouterr().out)


def test_an_acceptance_ranges_interval_joins_each_ends_interval():
    """Both ends' predictions pooled can put a percentile inside one end's interval (here the 95th: 18.1 of the
    pooled values against 19.1 of the first end's alone): the interval joins each end's instead."""
    from waferline.sim.intervals import _over_ends, interval

    a, b = [float(v) for v in range(1, 21)], [5.0] * 20
    assert interval(10.0, a + b, 0.9)[1] < interval(10.0, a, 0.9)[1]  # (what pooling gave)
    assert _over_ends(10.0, [a, b], 0.9) == [min(interval(10.0, a, 0.9)[0], 5.0), interval(10.0, a, 0.9)[1]]
    assert _over_ends(10.0, [a, a], 0.9) == interval(10.0, a, 0.9)  # (a figure the acceptance does not move)


def test_an_acceptance_range_widens_only_the_figures_acceptance_moves():
    """Each parameter set is predicted at both ends of an acceptance range; a figure that does not depend on the
    acceptance (a step without speculation, the prefill) is taken from one end's predictions (both ends' identical
    copies shifted its interpolated percentiles: the step's interval widened from 4.58 to 5.21 ms)."""
    params = load_params()
    plan = place("gpt-5.6-sol", "wse-3", devices=80, weight_bits=4, speculative=_spec("mtp"))
    alone = attach_intervals(simulate(plan, params=params), plan, params)
    ranged = attach_intervals(simulate(plan, params=params), plan, params, accept_range=(0.7, 0.9))
    for f in ("step_latency_s", "prefill_s", "ttft_s"):
        assert ranged.intervals[f] == alone.intervals[f], f
    for f in ("decode_tokens_per_s_per_user", "end_to_end_s"):
        (lo, hi), (lo1, hi1) = ranged.intervals[f], alone.intervals[f]
        assert lo <= lo1 and hi >= hi1 and (lo, hi) != (lo1, hi1), f
    assert ranged.speculative["accept_rate_interval"] == [0.7, 0.9]


def test_the_serving_figures_carry_intervals(capsys):
    """A serving simulation's figures (TTFT / inter-token / end-to-end mean and percentiles, output tokens/s, the mean
    batch) come with the 90% range over the fit's parameter sets, as every other predicted figure does, in JSON and
    in the table; an acceptance range widens them; past the budget of simulated requests they are left out with a
    note saying how many requests would give them (they had none)."""
    from waferline.sim.intervals import SERVING_FIGURES, SERVING_INTERVAL_BUDGET

    base = ["simulate", "gpt-5.6-sol", "--hardware", "wse-3", "--weight-bits", "4", "--devices", "80", "--speculative",
            "mtp", "--arrival-rate", "10", "--num-requests", "100"]
    assert commands.main([*base, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["serving"]
    for f in SERVING_FIGURES:
        lo, hi = s[f + "_interval"]
        assert lo <= s[f] <= hi, f
    assert s["itl_p50_s_interval"][0] < s["itl_p50_s_interval"][1]  # (the fitted latencies move it)
    assert commands.main([*base, "--json", "--accept-rate", "0.6:0.95"]) == 0
    wide = json.loads(capsys.readouterr().out)["serving"]["output_tokens_per_s_interval"]
    assert wide[0] <= s["output_tokens_per_s_interval"][0] and wide[1] >= s["output_tokens_per_s_interval"][1]
    assert wide != s["output_tokens_per_s_interval"]
    assert commands.main(base) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"output [\d,]+ \(90%: [\d,]+-[\d,]+\) tokens/s in all", out), out[-400:]
    n = SERVING_INTERVAL_BUDGET // len(load_params().parameter_sets()) + 1
    assert commands.main([*base[:-1], str(n), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert not any(k.endswith("_interval") for k in d["serving"])
    assert any("serving figures without intervals" in note and f"{n - 1:,} or fewer" in note for note in d["notes"])
    assert commands.main([*base, "--json", "--no-intervals"]) == 0
    assert not any(k.endswith("_interval") for k in json.loads(capsys.readouterr().out)["serving"])


def test_afd_ranks_with_speculation_print_their_figures(capsys):
    """The AFD ranks layout's speculative figures name where their acceptance comes from, as every other layout's do:
    the table read the key and crashed (KeyError: 'accept_rate_source')."""
    base = ["simulate", "deepseek-v3", "--hardware", "h200-sxm", "--weight-bits", "8", "--afd", "--speculative", "mtp"]
    for extra in (["--devices", "16"], ["--attention-ranks", "8", "--ffn-ranks", "8", "--accept-rate", "0.5:0.9"]):
        assert commands.main([*base, *extra, "--json"]) == 0
        sp = json.loads(capsys.readouterr().out)["speculative"]
        assert sp["accept_rate_source"] == ("assumed default" if "--devices" in extra else "given")
        assert commands.main([*base, *extra]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert re.search(r"accept 0\.\d\d (\(90%: [\d.]+-[\d.]+\) )?\((assumed default|given)\)", out), out[:1500]


def _no_sets(tmp_path):
    p = load_params().copy()
    p.bootstrap = []
    path = tmp_path / "no_sets.yaml"
    p.save(path)
    return path


def test_an_acceptance_range_without_parameter_sets_spans_the_range(tmp_path, capsys):
    """Without parameter sets a given acceptance range is predicted at its two ends only: the intervals span the two
    (a 5th-95th percentile between two values left 0.615-0.885 of a 0.6:0.9 range out of its own interval), the
    table says the ranges are the acceptance range's and the note no longer says there are no intervals."""
    params = load_params(_no_sets(tmp_path))
    plan = place("llama-3.1-70b", "h200-sxm", devices=8, speculative=_spec("mtp"))
    r = attach_intervals(simulate(plan, params=params), plan, params, accept_range=(0.6, 0.9))
    assert r.speculative["accept_rate_interval"] == [0.6, 0.9]
    from dataclasses import replace

    ends = [simulate(replace(plan, speculative=replace(plan.speculative, accept_rate=a)), params=params)
            for a in (0.6, 0.9)]
    assert r.intervals["decode_tokens_per_s_per_user"] == [ends[0].decode_tokens_per_s_per_user,
                                                           ends[1].decode_tokens_per_s_per_user]
    base = ["simulate", "llama-3.1-70b", "--hardware", "h200-sxm", "--devices", "8", "--speculative", "mtp",
            "--accept-rate", "0.6:0.9", "--params", str(tmp_path / "no_sets.yaml"), "--arrival-rate", "2",
            "--num-requests", "50"]
    assert commands.main([*base, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["speculative"]["accept_rate_interval"] == [0.6, 0.9]
    lo, hi = d["serving"]["output_tokens_per_s_interval"]
    assert lo < d["serving"]["output_tokens_per_s"] < hi
    assert not any(n.startswith("no intervals") for n in d["notes"])
    assert any(n.startswith("intervals from the acceptance range alone") for n in d["notes"])
    assert commands.main(base) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "accept 0.75 (90%: 0.60-0.90)" in out
    assert "range over both ends of the acceptance range (parameter and acceptance uncertainty only)" in out
    assert commands.main(base[:10]) == 0  # (with the shipped sets: both named)
    out = " ".join(capsys.readouterr().out.split())
    assert "range over the fit's bootstrap parameter sets at both ends of the acceptance range" in out
    assert commands.main(base[:8]) == 0  # (no range: the parameters' alone)
    assert "range over the fit's bootstrap parameter sets (parameter uncertainty only)" in " ".join(
        capsys.readouterr().out.split())


def test_a_class_no_parameter_set_moves_is_noted(tmp_path, capsys):
    """A device whose class no parameter set moves (kind cpu: assumed values, no published rows) gets ranges of zero
    width from them; a note says so (there was none: the figure read as certain)."""
    from waferline.spec.hardware import catalog_dir

    src = (catalog_dir() / "h100-sxm.yaml").read_text()
    hw = tmp_path / "my-cpu.yaml"
    hw.write_text(src.replace("name: h100-sxm", "name: my-cpu").replace("kind: gpu", "kind: cpu"))
    assert commands.main(["simulate", "llama-3.2-1b", "--hardware", str(hw), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    lo, hi = d["decode_tokens_per_s_per_user_interval"]
    assert lo == hi  # (what the note explains)
    assert any("cpu class's assumed parameters" in n for n in d["notes"]), d["notes"]
    assert commands.main(["simulate", "llama-3.2-1b", "--hardware", "h100-sxm", "--json"]) == 0
    assert not any("assumed parameters" in n for n in json.loads(capsys.readouterr().out)["notes"])


def test_a_closed_loops_request_rate_carries_an_interval(capsys):
    """A closed loop's request rate is what its clients reach (a prediction, not the user's input): it carries its
    range, in JSON and in the table's title; an open loop's given rate does not."""
    base = ["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--batch", "4", "--num-requests", "60"]
    assert commands.main([*base, "--closed-loop", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["serving"]
    lo, hi = s["arrival_rate_interval"]
    assert lo <= s["arrival_rate"] <= hi and lo < hi
    assert commands.main([*base, "--closed-loop"]) == 0
    assert re.search(r"closed loop \([\d.]+ \(90%: [\d.]+-[\d.]+\) req/s\)", " ".join(capsys.readouterr().out.split()))
    assert commands.main([*base, "--arrival-rate", "2", "--json"]) == 0
    assert "arrival_rate_interval" not in json.loads(capsys.readouterr().out)["serving"]
