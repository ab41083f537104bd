"""The planner figures README.md and docs/planner.md quote are what the commands beside them print now, as rounded in
the text: `waferline validate`'s in-sample table and summary, the out-of-sample columns (as `python
benchmarks/crossval_fit.py` wrote them, `benchmarks/results/crossval_fit.json`), the fitted wafer parameters and
their bootstrap ranges (`sim/fitted.yaml`), and a few `simulate` figures. A refit that moves one fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
FITTED = ROOT / "src" / "waferline" / "sim" / "fitted.yaml"
CROSSVAL = ROOT / "benchmarks" / "results" / "crossval_fit.json"


def _text(name: str) -> str:
    return " ".join((ROOT / name).read_text().split())


def _run(argv: list[str], capsys) -> dict:
    from waferline.cli import main

    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _validate(capsys) -> dict:
    return _run(["validate"], capsys)


def _shown(value: float) -> str:
    """A predicted figure as the validation table shows it: 3 decimals below 10 (a time in s), else whole, with
    thousands separators."""
    return f"{value:.3f}" if value < 10 else f"{value:,.0f}"


def test_in_sample_figures_are_what_validate_prints(capsys):
    out = _validate(capsys)
    median, worst = f"{out['summary']['median_error_factor']:.2f}", f"{out['summary']['max_error_factor']:.2f}"
    readme, planner = _text("README.md"), _text("docs/planner.md")
    quoted = re.findall(r"in-sample (\d\.\d\d) / (\d\.\d\d)", readme) + re.findall(r"in-sample (\d\.\d\d) / (\d\.\d\d)",
                                                                                  planner)
    assert len(quoted) == 2, "a sentence moved: update this test with it"
    assert set(quoted) == {(median, worst)}
    m = re.search(r"\*\*In-sample: median error factor (\d\.\d\d), max (\d\.\d\d);", planner)
    assert m and m.groups() == (median, worst)
    m = re.search(r"\| in-sample \(`waferline validate`\) \| (\d\.\d\d) \| (\d\.\d\d) \(cal-11\) \|", planner)
    assert m and m.groups() == (median, worst)


def test_the_validation_table_is_what_validate_and_the_cross_validation_print(capsys):
    rows = {r["id"]: r for r in _validate(capsys)["rows"]}
    folds = json.loads(CROSSVAL.read_text())
    table = re.findall(r"^\| (cal-\d+) \|(.*)\|$", (ROOT / "docs" / "planner.md").read_text(), re.MULTILINE)
    assert len(table) == len(rows)
    checked = 0
    for rid, cells in table:
        cells = [c.strip() for c in cells.split("|")]
        if rows[rid]["predicted"] is None:  # (not comparable: its own sentence)
            continue
        predicted, in_sample, row_out, vendor_out = cells[-4:]
        assert (predicted, in_sample) == (_shown(rows[rid]["predicted"]), f"{rows[rid]['error_factor']:.2f}"), rid
        assert row_out == f"{folds['row']['rows'][rid]['error_factor']:.2f}", rid
        assert vendor_out == f"{folds['vendor']['rows'][rid]['error_factor']:.2f}", rid
        checked += 1
    assert checked == 16


def test_the_kimi_out_of_vendor_figure_is_the_cross_validations():
    vendor = json.loads(CROSSVAL.read_text())["vendor"]["rows"]["cal-06"]["error_factor"]
    m = re.search(r"Kimi K2\.6 \(the only MoE wafer row and the only 4-bit one\) is predicted (\d\.\d)× too fast",
                  _text("docs/planner.md"))
    assert m and m.group(1) == f"{vendor:.1f}"


def test_the_fitted_wafer_parameters_and_their_ranges_are_fitted_yamls():
    fitted = yaml.safe_load(FITTED.read_text())
    wafer = {k: v["value"] for k, v in fitted["classes"]["wafer"].items()}
    planner = _text("docs/planner.md")
    us = {k: f"{wafer[k] * 1e6:.1f} µs" for k in ("layer_latency_s", "hop_latency_s")}
    shown_as = {"bw_eff": f"{wafer['bw_eff']:.2f}", "fabric_links": f"{wafer['fabric_links']:.1f}", **us}
    for name, shown in shown_as.items():
        assert re.findall(rf"\| wafer(?:, lpu \(SRAM\))? \| {name} \| ([^|]+?) \|", planner) == [shown], name
    assert f"`layer_latency_s` {us['layer_latency_s']}, `hop_latency_s` {us['hop_latency_s']}; `bw_eff` " \
           f"{wafer['bw_eff']:.2f}" in planner
    assert f"({us['hop_latency_s']} fitted latency + the transfer)" in planner
    boot = fitted["bootstrap"]
    ranges = []
    for name, scale in (("wafer.layer_latency_s", 1e6), ("wafer.fabric_links", 1), ("wafer.hop_latency_s", 1e6)):
        i = boot["names"].index(name)
        values = sorted(s[i] * scale for s in boot["sets"])
        ranges.append(f"{values[1]:.1f}–{values[-2]:.1f}")
    assert f"second-lowest to second-highest: {ranges[0]} µs, {ranges[1]} links, {ranges[2]} µs)" in planner


def test_the_quoted_simulate_figures_are_what_it_prints(capsys):
    planner = _text("docs/planner.md")
    gb = _run(["simulate", "gpt-5.6-sol", "--hardware", "gb200-nvl72", "--weight-bits", "4", "--devices", "72",
               "--batch", "256", "--concurrency", "256", "--no-intervals"], capsys)
    assert (f"{gb['decode_tokens_per_s_per_user']:.0f} tok/s per user × 256 users = "
            f"**{gb['aggregate_tokens_per_s']:,.0f}** tok/s aggregate") in planner
    qn = _run(["simulate", "qwen3-next-80b-a3b", "--hardware", "h200-sxm", "--devices", "2", "--speculative", "eagle",
               "--concurrency", "64", "--batch", "64", "--no-intervals"], capsys)
    m = re.search(r"on 2 H200s at concurrency 64: the verify [\d.]+ -> ([\d.]+) ms, [\d.]+ -> ([\d.]+) tok/s per user",
                  planner)
    verify_ms, per_user = qn["speculative"]["verify_s"] * 1e3, qn["decode_tokens_per_s_per_user"]
    assert m and m.groups() == (f"{verify_ms:.1f}", f"{per_user:.1f}")
