"""Leave-one-out check of the fitted physics: fit on all rows but one, predict that row; print the table and
median/max."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from waferline.sim.fit import fit
from waferline.sim.validate import PUBLISHED_PATH, validate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default=str(PUBLISHED_PATH))
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--out", default="benchmarks/results/crossval_fit.json")
    args = ap.parse_args()
    lines = [ln for ln in Path(args.data).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    head, rows = lines[0], lines[1:]
    t0 = time.perf_counter()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for i, r in enumerate(rows):
            train, test = Path(d) / "train.csv", Path(d) / "test.csv"
            train.write_text("\n".join([head] + rows[:i] + rows[i + 1:]) + "\n")
            test.write_text("\n".join([head, r]) + "\n")
            params, _ = fit(train, restarts=1, iters=args.iters)
            res, _ = validate(test, params)
            out[res[0].row.id] = {
                "published": res[0].row.value,
                "predicted": res[0].predicted,
                "error_factor": res[0].error_factor,
            }
            print(
                f"{res[0].row.id:8s} {res[0].row.model:16s} {res[0].row.hardware:12s} published {res[0].row.value:>9g} "
                f"held-out prediction {res[0].predicted:>9.4g}  error x{res[0].error_factor:.2f}",
                flush=True,
            )
    errs = [v["error_factor"] for v in out.values()]
    summary = {
        "median_error_factor": statistics.median(errs),
        "max_error_factor": max(errs),
        "seconds": time.perf_counter() - t0,
    }
    print(
        f"leave-one-out: median error factor {summary['median_error_factor']:.3f}, max "
        f"{summary['max_error_factor']:.3f} "
        f"({summary['seconds']:.0f} s)"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "rows": out}, indent=1))


if __name__ == "__main__":
    main()
