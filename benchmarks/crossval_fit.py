"""Cross-validation of the fitted simulator: a thin wrapper over `waferline validate --cross-validate row|vendor`
(every fitted parameter refit from the priors without the held-out rows, the held-out rows predicted with that
refit). Prints the table and median/max error factors and writes the JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from waferline.sim.crossval import CROSS_VALIDATE, cross_validate
from waferline.sim.validate import PUBLISHED_PATH


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default=str(PUBLISHED_PATH))
    ap.add_argument("--by", default="both", choices=(*CROSS_VALIDATE, "both"))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "crossval_fit.json"))
    args = ap.parse_args()
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(args.out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    out = {}
    for by in CROSS_VALIDATE if args.by == "both" else (args.by,):
        results, summary = cross_validate(args.data, by)
        for r in results:
            if r.predicted is not None:
                print(f"{by:6s} {r.row.id:8s} {r.row.model:16s} {r.row.hardware:12s} published {r.row.value:>9g} "
                      f"out-of-fold {r.predicted:>9.4g}  error x{r.error_factor:.2f}  (fold {r.detail['fold']})")
        print(f"leave-one-{by}-out: median error factor {summary['median_error_factor']:.3f}, max "
              f"{summary['max_error_factor']:.3f} ({summary['folds']} folds, {summary['seconds']:.0f} s)", flush=True)
        out[by] = {"summary": summary, "rows": {r.row.id: {"published": r.row.value, "predicted": r.predicted,
                                                           "error_factor": r.error_factor,
                                                           "fold": r.detail.get("fold")} for r in results}}
    write_text_atomic(args.out, json.dumps(out, indent=1), make_parents=True)


if __name__ == "__main__":
    import sys

    from waferline.errors import WaferlineError

    try:
        main()
    except WaferlineError as e:  # (a bad --hardware, --data or --weight-bits: one line, as the CLI says it)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
