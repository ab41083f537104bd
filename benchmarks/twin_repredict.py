"""The twin's recorded predictions against what this tree's simulator predicts from the same stored inputs.

    python benchmarks/twin_repredict.py                          # every benchmarks/results/twin_*.json
    python benchmarks/twin_repredict.py twin_avx512_sol-mini     # the named result files

Each row of a twin result (`waferline twin`) keeps its Plan (``plan_json``, with the acceptance fed to it), the
engine's counted ops (``ops``) and its measurement; the prompt and output lengths are the result's. This script prices
every row again with sim.twin.predict on the host YAML whose recorded canary time is the one the result was
calibrated with (``canary.calibration_s``), prints the rows whose prediction moved, and the median / max error factor
of every metric against the stored measurement, as recorded and as predicted now. Nothing is run on the engine and no
time is measured. A result whose calibration was not kept (no host YAML in benchmarks/results/ with its canary time)
is named and skipped: another calibration's figures are not its prediction. Models: models/<name> where it has a
config.json, else dsv3-100m from benchmarks/twin_grid.py's config (only the config is read, no weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
METRICS = ("tokens_per_s_per_user", "aggregate_tokens_per_s", "ttft_s")


def model_spec(name: str, tmp: Path):
    from waferline.spec.configs import spec_from_config_file

    cfg = ROOT / "models" / name / "config.json"
    if not cfg.is_file():
        if name != "dsv3-100m":
            raise SystemExit(f"error: {name}: no models/{name}/config.json")
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from twin_grid import DSV3_100M

        cfg = tmp / "config.json"
        cfg.write_text(json.dumps(DSV3_100M))
    return spec_from_config_file(cfg, name=name)


def repredict_file(path: Path, hosts: dict[float, Path], tmp: Path) -> dict | None:
    from waferline.plan.plan import Plan
    from waferline.sim.host import HostParams
    from waferline.sim.twin import error_factor, predict
    from waferline.spec.hardware import load_hardware_file

    d = json.loads(path.read_text())
    y = hosts.get((d.get("canary") or {}).get("calibration_s"))
    if y is None:
        print(f"{path.name}: its calibration was not kept (no host YAML with canary "
              f"{(d.get('canary') or {}).get('calibration_s')} s): skipped")
        return None
    spec, hw, host = model_spec(d["model_name"], tmp), load_hardware_file(y), HostParams.load(y)
    rows, before, after = [], [], []
    for r in d["rows"]:
        if r.get("status") != "ok":
            continue
        plan = Plan.from_json(r["plan_json"])
        sim = predict(plan, spec, hw, host, r["ops"], d["prompt_len"], d["output_len"], r["point"]["batch"],
                      plan.speculative.accept_rate)
        now = {"tokens_per_s_per_user": sim.decode_tokens_per_s_per_user,
               "aggregate_tokens_per_s": sim.aggregate_tokens_per_s, "ttft_s": sim.ttft_s}
        for m in METRICS:
            was, meas = r["predicted"][m], r["measured"][m]
            before.append(error_factor(was, meas))
            after.append(error_factor(now[m], meas))
            if abs(now[m] / was - 1) > 1e-6:
                rows.append((r["plan"], m, was, now[m], error_factor(was, meas), error_factor(now[m], meas)))
    print(f"{path.name} (host {y.name}): {len(rows)} of {len(before)} predictions moved")
    for plan, m, was, now, e0, e1 in rows:
        print(f"  {plan:22s} {m:24s} {was:10.4g} -> {now:10.4g} (x{now / was:.3f}); error x{e0:.3f} -> x{e1:.3f}")
    out = {"recorded": {"median": statistics.median(before), "max": max(before)},
           "now": {"median": statistics.median(after), "max": max(after)}, "n": len(after)}
    print(f"  all metrics, median / max error: recorded x{out['recorded']['median']:.3f} / "
          f"x{out['recorded']['max']:.3f}, now x{out['now']['median']:.3f} / x{out['now']['max']:.3f} "
          f"({out['n']} metrics)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="*", help="result file names in benchmarks/results/ (default: twin_*.json)")
    args = ap.parse_args()
    from waferline.sim.host import HostParams

    hosts = {HostParams.load(y).canary_s: y for y in sorted(RESULTS.glob("twin_host*.yaml"))}
    files = [RESULTS / (n if n.endswith(".json") else n + ".json") for n in args.results] or sorted(
        RESULTS.glob("twin_*.json"))
    for f in files:
        if not f.is_file():
            print(f"error: {f.name}: no such result in {RESULTS}", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            repredict_file(f, hosts, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
