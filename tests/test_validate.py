"""Validation and calibration: the published CSV, arbitrary CSVs, fitting, and the CLI commands."""

import json
import math
from pathlib import Path

import pytest
import yaml

from waferline.cli import main as cli_main
from waferline.errors import ConfigError
from waferline.plan import commands
from waferline.sim.cost import FITTED_PATH, load_params
from waferline.sim.fit import fit, save_fitted
from waferline.sim.validate import PUBLISHED_PATH, error_factor, read_published, validate

PUBLISHED = PUBLISHED_PATH  # shipped in the package: sim/data/published_results.csv
HEADER = ("id,system,model,hardware,num_chips,weight_bits,spec_decoding,concurrency,input_len,output_len,metric,value,"
          "unit,date,source,notes\n")



REASONING_HEAD = ("id,system,model,hardware,num_chips,weight_bits,spec_decoding,concurrency,input_len,output_len,"
                  "reasoning_tokens,metric,value,unit,date\n")
RATE_ROW = "rate,S,llama-3.1-8b,h100-sxm,1,16,none,1,2000,500,unstated,decode_tokens_per_s_per_user,150,tok/s,2026-05"

def _csv(tmp_path, rows, name="r.csv"):
    p = tmp_path / name
    p.write_text("# comment line\n" + HEADER + "".join(r + "\n" for r in rows))
    return p


def test_error_factor_is_symmetric():
    assert error_factor(200, 100) == pytest.approx(2.0) and error_factor(50, 100) == pytest.approx(2.0)
    assert error_factor(100, 100) == 1.0


def test_published_calibration_set_meets_the_target():
    results, summary = validate(PUBLISHED)
    assert summary["predicted"] == summary["rows"] - len(summary["not_comparable"]) >= 15
    assert summary["median_error_factor"] <= 1.15
    assert all(r.predicted > 0 for r in results if r.row.id not in summary["not_comparable"])
    # every row within 2x but those no fit can reach: SambaNova's 16-bit Llamas need more than the SN40L's published
    # HBM bandwidth (1.6 TB/s; the 405B's 129 tok/s on 16 sockets would need 6.5), and no efficiency may exceed 1
    over = {r.row.id for r in results if (r.error_factor or 0) > 2.0}
    assert over <= set(summary["beyond_ceiling"]) <= {"cal-10", "cal-11"}
    assert max(r.error_factor for r in results if r.error_factor and r.row.id not in over) <= 1.5


def test_rows_beyond_the_physical_ceiling_are_named(tmp_path, capsys):
    """A published figure faster than the model allows with every fitted term at its most favourable bound is named,
    with that bound: a row no fit can reach (here 8B at 5,000 tok/s on one H100, and a 405B TTFT of 0.1 ms)."""
    p = _csv(tmp_path, ["ok,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,150,tok/s,,,",
                        "fast,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,5000,tok/s,,,",
                        "ttft,x,llama-3.1-405b,h200-sxm,8,8,none,1,1000,,ttft_s,0.0001,s,,,"])
    results, summary = validate(p)
    assert set(summary["beyond_ceiling"]) == {"fast", "ttft"}
    h100 = 3.35e12 / ((8.03e9 - 128256 * 4096) * 2)  # the 8B's 16-bit weights (but the embedding table) read once
    assert h100 / 1.05 < summary["beyond_ceiling"]["fast"] <= h100  # per token at the datasheet bandwidth
    assert results[0].detail["ceiling"] is None and results[0].predicted < h100
    assert commands.main(["validate", "--data", str(p)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "beyond the model's physical ceiling" in out and "fast (published 5000" in out and "ok (" not in out
    assert commands.main(["validate", "--data", str(p), "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["ok"]["beyond_ceiling"] is None and rows["fast"]["beyond_ceiling"] > 0


def test_the_ceiling_is_never_slower_than_the_fit():
    """SimParams.ceiling bounds every fitted prediction of the shipped rows: faster (or, for TTFT, sooner) than or
    equal to it; the SambaNova rows lie beyond it (the catalog's SN40L bandwidth and link latency are assumed)."""
    results, summary = validate(PUBLISHED)
    from waferline.sim.validate import build_models

    ceiling = load_params().ceiling()
    for row, rm, _ in build_models(read_published(PUBLISHED), load_params()):
        if rm is None:  # (the not-comparable end-to-end row)
            continue
        best = rm.predict(ceiling)[0]
        fitted = next(r.predicted for r in results if r.row.id == row.id)
        assert (best <= fitted * 1.0001) if row.metric == "ttft_s" else (best >= fitted * 0.9999), row.id
    assert set(summary["beyond_ceiling"]) == {"cal-10", "cal-11"}


def test_a_reasoning_models_end_to_end_time_of_unstated_length_is_not_comparable(tmp_path, capsys):
    """An end-to-end row of a reasoning model whose hidden reasoning length is not stated is not predicted (nor fitted):
    it is checked against the model's time with no reasoning (the fastest it can be) and the hidden tokens the
    difference implies, at the predicted rate and at the published rate of the same measurement's decode row. A row
    whose reasoning length is stated is predicted with it."""
    from waferline.plan.place import place
    from waferline.sim.fit import problem
    from waferline.sim.pipeline import simulate
    from waferline.spec.catalog import load_hardware, load_model

    p = tmp_path / "r.csv"
    p.write_text(REASONING_HEAD + "\n".join([
        RATE_ROW,
        "e2e,S,llama-3.1-8b,h100-sxm,1,16,none,1,2000,500,unstated,end_to_end_latency_s,30,s,2026-05",
        "fast,S,llama-3.1-8b,h100-sxm,1,16,none,1,2000,500,unstated,end_to_end_latency_s,0.5,s,2026-04",
        "stated,S,llama-3.1-8b,h100-sxm,1,16,none,1,2000,500,1500,end_to_end_latency_s,14,s,2026-05"]) + "\n")
    results, summary = validate(p)
    res = {r.row.id: r for r in results}
    assert set(summary["not_comparable"]) == {"e2e", "fast"} and summary["predicted"] == 2
    assert summary["skipped"] == 0 and res["e2e"].predicted is None and res["e2e"].error_factor is None
    params = load_params()
    plan = place(load_model("llama-3.1-8b"), load_hardware("h100-sxm"), devices=1, context=2500)
    r0 = simulate(plan, prompt_len=2000, output_len=500, params=params)
    u = summary["not_comparable"]["e2e"]
    assert u["no_reasoning_s"] == pytest.approx(r0.end_to_end_s) and u["consistent"]
    assert u["implied_reasoning_tokens"] == pytest.approx((30 - r0.end_to_end_s) * r0.decode_tokens_per_s_per_user)
    assert u["published_rate_row"] == "rate"
    assert u["implied_reasoning_tokens_at_published_rate"] == pytest.approx((30 - r0.ttft_s) * 150 - 499)
    f = summary["not_comparable"]["fast"]
    assert not f["consistent"] and f["implied_reasoning_tokens"] == 0 and "published_rate_row" not in f  # (date)
    stated = simulate(plan, prompt_len=2000, output_len=500, params=params, reasoning_tokens=1500)
    assert res["stated"].predicted == pytest.approx(stated.end_to_end_s) and stated.end_to_end_s > r0.end_to_end_s
    assert {i for i, _ in problem(p, params).skipped} == {"e2e", "fast"}  # (the fit leaves them out)
    assert commands.main(["validate", "--data", str(p)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "2 not comparable" in out and "e2e is the end-to-end time of a reasoning model" in out
    assert "at the published 150 tok/s of rate" in out and "inconsistent: faster than no reasoning at all" in out
    assert commands.main(["validate", "--data", str(p), "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["e2e"]["not_comparable"]["consistent"] and rows["stated"]["reasoning_tokens"] == 1500
    p.write_text(REASONING_HEAD + "x,S,llama-3.1-8b,h100-sxm,1,16,none,1,2000,500,-3,end_to_end_latency_s,30,s,\n")
    with pytest.raises(ConfigError, match="reasoning_tokens"):
        read_published(p)


def test_the_ceiling_keeps_values_past_the_fits_bounds(tmp_path):
    """A parameter file may hold no request overhead or an acceptance above the fit's cap: the ceiling then keeps
    those (it is never slower than the parameters it starts from)."""
    p = tmp_path / "p.yaml"
    p.write_text("ttft_overhead_s: 0\nspeculative:\n  accept_rate:\n    eagle: 0.99\n")
    params = load_params(p)
    c = params.ceiling()
    assert c.ttft_overhead_s == 0 and c.accept_rate["eagle"] == 0.99 and c.accept_rate["mtp"] == 0.97


def test_any_csv_unknown_rows_are_skipped_not_fatal(tmp_path):
    p = _csv(tmp_path, ["a,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,150,tok/s,,,",
                        "b,x,no-such-model,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,150,tok/s,,,",
                        "c,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,bogus_metric,1,x,,,",
                        "d,x,qwen3-32b,b200,,8,none,8,2000,500,aggregate_tokens_per_s,2000,tok/s,,,"])
    results, summary = validate(p)
    assert summary["rows"] == 4 and summary["predicted"] == 2 and summary["skipped"] == 2
    assert "no-such-model" in results[1].skipped and "bogus_metric" in results[2].skipped
    assert results[3].devices == 1 and results[3].predicted > 0


def test_csv_missing_columns_is_a_config_error(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("model,hardware\nllama-3.1-8b,h100-sxm\n")
    with pytest.raises(ConfigError, match="metric"):
        read_published(p)


def test_fit_reduces_error_and_marks_parameters_fitted(tmp_path):
    p = _csv(tmp_path, ["a,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,120,tok/s,,,",
                        "b,x,llama-3.1-70b,h100-sxm,4,16,none,1,,,decode_tokens_per_s_per_user,40,tok/s,,,"])
    base = load_params().copy()
    before = validate(p, base)[1]["median_error_factor"]
    fitted, report = fit(p, base=base, restarts=1, iters=150)
    after = validate(p, fitted)[1]["median_error_factor"]
    assert after < before and report["after"]["median"] == pytest.approx(after, rel=1e-6)
    assert fitted.classes["gpu"].status["bw_eff"] == "fitted"
    out = tmp_path / "fitted.yaml"
    save_fitted(fitted, out, str(p))
    d = yaml.safe_load(out.read_text())
    assert d["classes"]["gpu"]["bw_eff"]["fitted"] is True
    assert "assumed" in d["classes"]["gpu"]["flops_eff"]
    again = load_params(out)
    assert again.classes["gpu"].bw_eff == pytest.approx(fitted.classes["gpu"].bw_eff)


def test_shipped_parameters_are_all_marked():
    d = yaml.safe_load((Path(load_params.__code__.co_filename).parent / "fitted.yaml").read_text())
    for cls in d["classes"].values():
        for v in cls.values():
            assert "fitted" in v or "assumed" in v
    assert any(v.get("fitted") for cls in d["classes"].values() for v in cls.values())
    assert all(0 < v["value"] < 1 for v in d["speculative"]["accept_rate"].values())


def test_cli_plan_simulate_validate_calibrate(tmp_path, capsys):
    assert commands.main(["plan", "llama-3.1-70b", "--hardware", "wse-3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["stages"]) == 4 and d["max_context_per_sequence"] > 0
    assert commands.main(["plan", "llama-3.1-70b", "--hardware", "wse-3", "--devices", "2"]) == 2
    assert "does not fit" in capsys.readouterr().out
    plan_path = tmp_path / "p.json"
    assert commands.main(["plan", "gpt-5.6-sol", "--hardware", "wse-3", "--weight-bits", "4", "--devices", "80",
                          "--out", str(plan_path), "--json"]) == 0
    capsys.readouterr()
    assert commands.main(["simulate", "gpt-5.6-sol", "--hardware", "wse-3", "--plan", str(plan_path),
                          "--speculative", "mtp", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["num_stages"] == 80 and s["decode_tokens_per_s_per_user"] > 0 and s["speculative"]["method"] == "mtp"
    assert commands.main(["simulate", "llama-3.1-8b", "--hardware", "h100-sxm"]) == 0
    assert "decode tokens/s per user" in capsys.readouterr().out
    csv = _csv(tmp_path, ["a,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,150,tok/s,,,"])
    assert commands.main(["validate", "--data", str(csv), "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert v["summary"]["predicted"] == 1 and math.isfinite(v["rows"][0]["error_factor"])
    out = tmp_path / "f.yaml"
    assert cli_main(["calibrate", "--published", str(csv), "--out", str(out), "--iters", "60", "--restarts", "1",
                          "--bootstrap", "2", "--json"]) == 0
    assert out.is_file() and json.loads(capsys.readouterr().out)["rows"] == 1
    assert commands.main(["plan", "no-such-model", "--hardware", "wse-3"]) == 1
    assert "unknown model" in capsys.readouterr().err


def test_calibrate_params_sets_what_the_fit_keeps_not_where_it_starts(tmp_path, capsys):
    """`calibrate --published --params FILE`: the fitted values come from the priors whatever FILE holds (its help says
    so); FILE's draft lengths are what the fit keeps."""
    csv = _csv(tmp_path, ["a,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,150,tok/s,,,",
                          "b,x,llama-3.1-70b,h100-sxm,4,16,none,1,,,decode_tokens_per_s_per_user,45,tok/s,,,"])
    start = yaml.safe_load(FITTED_PATH.read_text())
    start["classes"]["gpu"]["layer_latency_s"]["value"] = 1.9e-4
    start["classes"]["gpu"]["bw_eff"]["value"] = 0.1
    start["speculative"]["num_tokens"]["draft"]["value"] = 7
    other = tmp_path / "start.yaml"
    other.write_text(yaml.safe_dump(start))
    fits = []
    for extra in ([], ["--params", str(other)]):
        out = tmp_path / f"fit{len(fits)}.yaml"
        assert cli_main(["calibrate", "--published", str(csv), "--out", str(out), "--iters", "40", "--bootstrap", "0",
                         "--json"] + extra) == 0
        fits.append((json.loads(capsys.readouterr().out)["params"], load_params(out)))
    assert fits[0][0] == fits[1][0]
    assert fits[0][1].num_tokens["draft"] == 5 and fits[1][1].num_tokens["draft"] == 7
    with pytest.raises(SystemExit):
        cli_main(["calibrate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "starting parameters" not in text and "starts from its prior" in text


def test_validate_and_calibrate_default_to_the_shipped_results_from_any_directory(tmp_path, capsys, monkeypatch):
    """No --data: `waferline validate` reads the published results shipped in the package, from a working directory
    that is not the repository, and reports every row (each with its source); `calibrate --published` alone fits on
    the same file."""
    rows = read_published(PUBLISHED)
    assert len(rows) >= 15 and all(r.source for r in rows)
    monkeypatch.chdir(tmp_path)
    assert commands.main(["validate", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in v["rows"]] == [r.id for r in rows]
    comparable = len(rows) - len(v["summary"]["not_comparable"])
    assert v["summary"]["rows"] == len(rows) and v["summary"]["predicted"] == comparable
    assert commands.main(["validate"]) == 0
    assert "validation on" in capsys.readouterr().out
    out = tmp_path / "f.yaml"
    assert cli_main(["calibrate", "--published", "--out", str(out), "--iters", "30", "--restarts", "1",
                          "--bootstrap", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == comparable
    assert "published_results.csv" in out.read_text()


def test_the_unit_column_is_read_and_a_unit_that_does_not_fit_the_metric_skips_the_row(tmp_path):
    """`ttft_s,240,ms` is 0.24 s (it was read as 240 s: an error factor of ~1,000); a rate given in seconds, or a time
    in minutes, is skipped with the units the metric takes; a blank unit is the metric's own."""
    row = "x,llama-3.1-8b,h100-sxm,1,16,none,1,1000,,{metric},{value},{unit},,,"
    p = _csv(tmp_path, [f"{i}," + row.format(metric=m, value=v, unit=u) for i, (m, v, u) in enumerate([
        ("ttft_s", "240", "ms"), ("ttft_s", "0.24", "s"), ("ttft_s", "240000", "us"), ("ttft_s", "240000", "μs"),
        ("ttft_s", "0.24", ""), ("decode_tokens_per_s_per_user", "150", "tokens/s"), ("ttft_s", "4", "min"),
        ("decode_tokens_per_s_per_user", "150", "s")])])
    rows = read_published(p)
    assert [r.value for r in rows[:5]] == pytest.approx([0.24] * 5) and rows[0].unit == "ms"
    results, summary = validate(p)
    assert results[0].error_factor == pytest.approx(results[1].error_factor) and results[0].error_factor < 2
    assert summary["predicted"] == 6 and summary["skipped"] == 2
    assert results[6].skipped == "unit 'min' does not fit metric ttft_s; use s, ms, us, µs (blank: s)"
    assert results[7].skipped.startswith("unit 's' does not fit metric decode_tokens_per_s_per_user; use tok/s")


@pytest.mark.parametrize("column, cell, message", [
    ("concurrency", "0", "concurrency must be a whole number >= 1 (or blank), got '0'"),  # (was replaced by 1)
    ("num_chips", "1.5", "num_chips must be a whole number >= 1 (or blank), got '1.5'"),  # (was truncated to 1)
    ("input_len", "-5", "input_len must be a whole number >= 1 (or blank), got '-5'"),  # (aborted the whole run)
    ("output_len", "0", "output_len must be a whole number >= 1 (or blank), got '0'"),  # (was the default 500)
    ("weight_bits", "0", "weight_bits must be a whole number >= 1 (or blank), got '0'"),  # (was 16)
    ("concurrency", "many", "concurrency must be a whole number >= 1 (or blank), got 'many'"),
])
def test_counts_that_are_not_whole_numbers_in_range_skip_their_row(tmp_path, column, cell, message):
    cells = dict(num_chips="1", weight_bits="16", concurrency="1", input_len="", output_len="")
    cells[column] = cell
    bad = ("bad,x,llama-3.1-8b,h100-sxm,{num_chips},{weight_bits},none,{concurrency},{input_len},{output_len},"
           "decode_tokens_per_s_per_user,150,tok/s,,,").format(**cells)
    p = _csv(tmp_path, ["ok,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,150,tok/s,,,", bad])
    results, summary = validate(p)
    assert results[0].predicted > 0 and results[1].predicted is None and results[1].skipped == message
    assert (summary["predicted"], summary["skipped"]) == (1, 1)


def test_duplicate_ids_are_refused(tmp_path):
    p = _csv(tmp_path, ["x-01,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,150,tok/s,,,",
                        "x-01,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,160,tok/s,,,"])
    with pytest.raises(ConfigError, match=r"r\.csv: row 2: id 'x-01' repeats row 1's"):
        read_published(p)


def test_a_csv_with_nothing_to_compare_fails_with_its_summary(tmp_path, capsys):
    """Every row skipped (or no row at all): rc 2 and one line naming the file, the counts and each row's reason
    (it was rc 0 with no summary line)."""
    p = _csv(tmp_path, ["a,x,llama-9,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,150,tok/s,,,",
                        "b,x,llama-3.1-8b,h100-sxm,1,16,none,0,,,decode_tokens_per_s_per_user,150,tok/s,,,"])
    for argv in (["validate", "--data", str(p)], ["validate", "--data", str(p), "--json"]):
        assert cli_main(argv) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert len(err.splitlines()) == 1 and captured.out == ""
        assert f"{p}: no row could be compared (2 rows: 2 skipped, 0 not comparable): a: unknown model 'llama-9'" in err
        assert "b: concurrency must be a whole number >= 1" in err
    empty = _csv(tmp_path, [], name="empty.csv")
    assert cli_main(["validate", "--data", str(empty)]) == 2
    assert "empty.csv: no row could be compared (0 rows" in capsys.readouterr().err


def test_every_row_is_counted_once_predicted_skipped_or_not_comparable(tmp_path, capsys):
    """A not-comparable row carries its detail under not_comparable and no skip reason; `skipped` counts the rows
    with a reason, so rows = predicted + skipped + not comparable (`--json` used to show cal-16 with a skip reason
    while the summary said 0 skipped)."""
    p = tmp_path / "r.csv"
    p.write_text(REASONING_HEAD + "\n".join([
        RATE_ROW,
        "e2e,S,llama-3.1-8b,h100-sxm,1,16,none,1,2000,500,unstated,end_to_end_latency_s,30,s,2026-05",
        "gone,S,llama-9,h100-sxm,1,16,none,1,2000,500,,decode_tokens_per_s_per_user,150,tok/s,2026-05"]) + "\n")
    assert cli_main(["validate", "--data", str(p), "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    s, rows = v["summary"], {r["id"]: r for r in v["rows"]}
    assert (s["rows"], s["predicted"], s["skipped"], list(s["not_comparable"])) == (3, 1, 1, ["e2e"])
    assert s["rows"] == s["predicted"] + s["skipped"] + len(s["not_comparable"])
    assert rows["e2e"]["skipped"] == "" and rows["e2e"]["not_comparable"]["consistent"]
    assert rows["gone"]["skipped"].startswith("unknown model 'llama-9'") and rows["gone"]["not_comparable"] is None
    shipped = validate(PUBLISHED)[1]
    assert shipped["rows"] == shipped["predicted"] + shipped["skipped"] + len(shipped["not_comparable"])


def test_the_text_table_gives_each_skipped_rows_reason_whole(tmp_path, capsys):
    from waferline.cli import main

    f = tmp_path / "mine.csv"
    f.write_text("id,system,model,hardware,num_chips,weight_bits,spec_decoding,concurrency,input_len,output_len,metric,"
                 "value,unit,source,date,notes\n"
                 "x-1,s,llama-3.1-8b,h100-sxm,1,16,none,1,1000,100,decode_tokens_per_s_per_user,150,tok/s,me,,\n"
                 "x-2,s,nosuch-model,h100-sxm,1,16,none,1,1000,100,decode_tokens_per_s_per_user,150,tok/s,me,,\n")
    assert main(["validate", "--data", str(f)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "skipped: x-2: unknown model 'nosuch-model'" in out and "a config.json path or a checkpoint directory" in out


def test_a_stated_speculation_speedup_is_applied_to_the_system_without_speculation(tmp_path):
    """A row whose source states its speculation's speedup is predicted as the system without speculation times it,
    and no acceptance rate is fitted on it; a malformed or misplaced speedup skips its row with the reason."""
    head = ("id,system,model,hardware,num_chips,weight_bits,spec_decoding,concurrency,input_len,output_len,"
            "spec_speedup,metric,value,unit\n")
    body = ["plain,S,llama-3.1-70b,h200-sxm,8,8,none,1,,,,decode_tokens_per_s_per_user,150,tok/s",
            "stated,S,llama-3.1-70b,h200-sxm,8,8,medusa,1,,,1.9,decode_tokens_per_s_per_user,285,tok/s",
            "fitted,S,llama-3.1-70b,h200-sxm,8,8,medusa,1,,,,decode_tokens_per_s_per_user,285,tok/s",
            "none,S,llama-3.1-70b,h200-sxm,8,8,none,1,,,1.9,decode_tokens_per_s_per_user,285,tok/s",
            "ttft,S,llama-3.1-70b,h200-sxm,8,8,medusa,1,,,1.9,ttft_s,0.2,s",
            "zero,S,llama-3.1-70b,h200-sxm,8,8,medusa,1,,,0,decode_tokens_per_s_per_user,285,tok/s"]
    p = tmp_path / "s.csv"
    p.write_text(head + "".join(r + "\n" for r in body))
    rows = read_published(p)
    assert rows[1].spec_speedup == 1.9 and rows[2].spec_speedup is None
    results, _ = validate(p)
    assert results[1].predicted == pytest.approx(1.9 * results[0].predicted)
    assert results[2].predicted != pytest.approx(results[1].predicted)  # (the fitted acceptance's prediction)
    assert results[3].skipped == "spec_speedup 1.9 on a row without speculation (spec_decoding none)"
    assert results[4].skipped == "spec_speedup is a decode-rate ratio; metric ttft_s does not take it"
    assert results[5].skipped == "spec_speedup must be a number > 0 (or blank), got '0'"
    from waferline.sim.fit import fit

    for keep, accept_fitted in (([0, 1], False), ([0, 2], True)):
        q = tmp_path / f"k{keep[1]}.csv"
        q.write_text(head + "".join(body[i] + "\n" for i in keep))
        params, _ = fit(q)
        assert (params.status.get("accept_rate.medusa") == "fitted") is accept_fitted


def test_a_byte_order_mark_and_spaces_around_column_names_are_read(tmp_path):
    """A CSV saved by a spreadsheet starts with a byte-order mark, and a header may put a space after each comma:
    the columns are still the ones named (the first column's name was read with the mark: the shipped file, saved
    that way, had no model column; a ' num_chips' column was ignored, its row planned on the fewest devices)."""
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + PUBLISHED.read_bytes())
    assert [r.id for r in read_published(bom)] == [r.id for r in read_published(PUBLISHED)]
    p = tmp_path / "spaced.csv"
    p.write_text("\ufeffid, model, hardware, metric, value, num_chips\n"
                 "r1, llama-3.1-70b, h100-sxm, decode_tokens_per_s_per_user, 50, 8\n")
    (row,) = read_published(p)
    assert (row.id, row.model, row.num_chips) == ("r1", "llama-3.1-70b", 8)
    results, _ = validate(p)
    assert results[0].devices == 8


def test_a_row_with_more_cells_than_the_header_is_refused(tmp_path):
    """An unquoted comma (a thousands separator in the value) makes more cells than columns: refused with the row,
    not read as the value 1 with '042' dropped."""
    p = tmp_path / "r.csv"
    p.write_text("id,model,hardware,metric,value\nr1,llama-3.1-8b,h100-sxm,decode_tokens_per_s_per_user,1,042\n")
    with pytest.raises(ConfigError, match=r"r\.csv: row 1 has 6 cells, the header 5 columns \(extra: '042'\)"):
        read_published(p)
    p.write_text("id,model,hardware,metric,value\nr1,llama-3.1-8b,h100-sxm,decode_tokens_per_s_per_user,150,\n")
    assert read_published(p)[0].value == 150  # (a trailing empty cell is nothing)


@pytest.mark.parametrize("cell", ["inf", "1e400", "abc"])
def test_reasoning_tokens_that_are_not_a_finite_count_are_a_config_error(tmp_path, cell):
    p = tmp_path / "r.csv"
    p.write_text(REASONING_HEAD + f"x,S,llama-3.1-8b,h100-sxm,1,16,none,1,2000,500,{cell},end_to_end_latency_s,30,s,\n")
    with pytest.raises(ConfigError, match=f"row 1 is malformed \\(reasoning_tokens {cell} is not a whole number"):
        read_published(p)


def test_calibrate_names_the_rows_it_leaves_out_and_the_parameters_at_a_bound(tmp_path, capsys):
    """The table of `calibrate --published` says which rows the fit left out (and why) and which fitted values sat
    at an end of their physical range (here the HBM efficiency at 1: 8B at 300 tok/s on one H100 wants more)."""
    csv = _csv(tmp_path, ["fast,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,300,tok/s,,,",
                          "typo,x,llama-3.1-8bb,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,150,tok/s,,,"])
    out = tmp_path / "f.yaml"
    assert cli_main(["calibrate", "--published", str(csv), "--out", str(out), "--bootstrap", "0"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "left out of the fit: typo: unknown model 'llama-3.1-8bb'" in text
    assert "class.gpu.bw_eff = 1 (upper bound)" in text
    assert cli_main(["calibrate", "--published", str(csv), "--out", str(out), "--bootstrap", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["at_bound"] == {"class.gpu.bw_eff": [1.0, "upper"]}


def test_a_relative_hardware_yaml_and_config_in_a_csv_are_read_beside_it(tmp_path, monkeypatch):
    """A user's results CSV naming its own hardware YAML and config.json by relative paths finds them beside the CSV,
    wherever validate runs from (they were looked up from the working directory: the row was skipped as unknown
    hardware)."""
    import shutil

    from waferline.spec.catalog import HARDWARE_DIR, MODELS_DIR

    data = tmp_path / "mine"
    (data / "hw").mkdir(parents=True)
    shutil.copy(HARDWARE_DIR / "h100-sxm.yaml", data / "hw" / "asic.yaml")
    shutil.copy(MODELS_DIR / "llama-3.1-8b.json", data / "model.json")
    p = _csv(data, ["a,S,model.json,hw/asic.yaml,1,16,none,1,1000,100,decode_tokens_per_s_per_user,150,tok/s,,,",
                    "b,S,llama-3.1-8b,hw/asic.yaml,1,16,none,1,1000,100,decode_tokens_per_s_per_user,150,tok/s,,,"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    results, summary = validate(p)
    assert [r.skipped for r in results] == ["", ""] and summary["predicted"] == 2
    assert results[0].predicted == pytest.approx(results[1].predicted)
    monkeypatch.chdir(data)  # (the same cells read from the CSV's own folder as before)
    assert validate(p)[1]["predicted"] == 2
