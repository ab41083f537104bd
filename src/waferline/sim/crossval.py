"""Out-of-fold validation of the fitted simulator: every fitted parameter refit from the priors without the held-out
rows (one row, or every row of one vendor), the held-out rows predicted with that refit (`waferline validate
--cross-validate row|vendor`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from waferline.errors import ConfigError
from waferline.sim.cost import SimParams, load_params
from waferline.sim.fit import fit_rows, problem
from waferline.sim.validate import (
    NOT_COMPARABLE,
    Row,
    RowResult,
    beyond_ceiling,
    error_factor,
    read_published,
    skipped_result,
    summarize,
)

CROSS_VALIDATE = ("row", "vendor")


def fold_key(row: Row, by: str) -> str:
    """The group a row is held out with: itself (``row``) or every row of its system/vendor (``vendor``: the CSV's
    system column, the hardware id where that is blank)."""
    if by == "row":
        return row.id
    if by == "vendor":
        return row.system or row.hardware
    raise ConfigError(f"--cross-validate {by!r} unknown; use one of {', '.join(CROSS_VALIDATE)}")


def cross_validate(path: str | Path, by: str = "row", params: SimParams | None = None, iters: int = 200,
                   progress: Any = None) -> tuple[list[RowResult], dict[str, Any]]:
    """Out-of-fold validation: for each group of rows (one row, or one vendor's rows), refit every fitted parameter
    (classes, acceptance rates, TTFT overhead) from the priors on the other rows only, and predict the held-out rows
    with that refit. Rows carry the out-of-fold prediction and error factor; the summary the median and max."""
    if by not in CROSS_VALIDATE:
        raise ConfigError(f"--cross-validate {by!r} unknown; use one of {', '.join(CROSS_VALIDATE)}")
    t0 = time.time()
    prob = problem(path, params)
    ceiling = (params or load_params()).ceiling()
    groups: dict[str, list[int]] = {}
    for i, (row, _) in enumerate(prob.models):
        groups.setdefault(fold_key(row, by), []).append(i)
    out: dict[int, RowResult] = {}
    refits: dict[str, SimParams] = {}
    for g, held in groups.items():
        train = [i for i in range(len(prob.models)) if i not in held]
        if not train:
            raise ConfigError(f"cross-validation by {by}: every row is in group {g!r}; nothing left to fit on")
        refit = refits[g] = fit_rows(prob.subset(train), iters=iters)
        for i in held:
            row, rm = prob.models[i]
            pred, r = rm.predict(refit)
            out[i] = RowResult(row, pred, error_factor(pred, row.value) if pred > 0 else None,
                               devices=rm.plan.num_devices,
                               detail={"fold": g, "trained_on": len(train), "bound": r.bound,
                                       "ceiling": beyond_ceiling(rm, ceiling)})
        if progress:
            progress(g, [out[i] for i in held])
    results = [out[i] for i in range(len(prob.models))]
    rows = read_published(path)
    published = {r.id: r for r in rows}
    # a row left out of every fit is checked with its group's refit (where the group has fitted rows), else the fit on
    # every predicted row of this CSV (which never saw it either; not the shipped fit, made on other rows)
    full: list[SimParams] = []

    def without(row: Row) -> SimParams:
        if fold_key(row, by) in refits:
            return refits[fold_key(row, by)]
        if not full:
            full.append(fit_rows(prob, iters=iters))
        return full[0]

    for rid, why in prob.skipped:  # (only a row not comparable is simulated)
        r = skipped_result(published[rid], why, without(published[rid]) if why == NOT_COMPARABLE else prob.base, rows)
        if why == NOT_COMPARABLE:  # (the fold whose refit checked it; None: the fit on every predicted row)
            key = fold_key(published[rid], by)
            r.detail["fold"] = key if key in refits else None
        results.append(r)
    return results, summarize(results) | {
        "cross_validate": by, "folds": len(groups),
        "params": f"refit per fold from the priors on the other rows of {Path(path).name}",
        "seconds": round(time.time() - t0, 1)}
