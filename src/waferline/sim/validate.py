"""Validation against published results: read a results CSV, plan and simulate every row, report error factors."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waferline.errors import ConfigError, WaferlineError
from waferline.sim.cost import SimParams, load_params

# the published results waferline ships (each row with its sources): `waferline validate` and
# `waferline calibrate --published` read it unless given another CSV
PUBLISHED_PATH = Path(__file__).with_name("data") / "published_results.csv"
METRICS = ("decode_tokens_per_s_per_user", "ttft_s", "end_to_end_latency_s", "aggregate_tokens_per_s")
REQUIRED_COLUMNS = ("model", "hardware", "metric", "value")


@dataclass
class Row:
    """One published result (the CSV format of sim/data/published_results.csv)."""

    id: str
    model: str
    hardware: str
    num_chips: int | None
    weight_bits: int
    spec_decoding: str
    concurrency: int
    input_len: int | None
    output_len: int | None
    metric: str
    value: float
    system: str = ""
    source: str = ""


def read_published(path: str | Path) -> list[Row]:
    """Parse a published-results CSV ('#' lines are comments); blank cells take documented defaults."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"no CSV at {p}")
    lines = [ln for ln in p.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    reader = csv.DictReader(lines)
    cols = reader.fieldnames or []
    missing = [c for c in REQUIRED_COLUMNS if c not in cols]
    if missing:
        raise ConfigError(
            f"{p}: missing column(s) {', '.join(missing)}; expected a header like "
            "id,system,model,hardware,num_chips,weight_bits,spec_decoding,concurrency,input_len,output_len,metric,value,unit,..."
        )
    rows = []

    def opt_int(v: str | None) -> int | None:
        v = (v or "").strip()
        return int(float(v)) if v else None

    for i, r in enumerate(reader):
        try:
            rows.append(
                Row(
                    id=(r.get("id") or f"row-{i + 1}").strip(),
                    model=r["model"].strip(),
                    hardware=r["hardware"].strip(),
                    num_chips=opt_int(r.get("num_chips")),
                    weight_bits=opt_int(r.get("weight_bits")) or 16,
                    spec_decoding=(r.get("spec_decoding") or "none").strip() or "none",
                    concurrency=opt_int(r.get("concurrency")) or 1,
                    input_len=opt_int(r.get("input_len")),
                    output_len=opt_int(r.get("output_len")),
                    metric=r["metric"].strip(),
                    value=float(r["value"]),
                    system=(r.get("system") or "").strip(),
                    source=(r.get("source") or "").strip(),
                )
            )
        except (ValueError, KeyError) as e:
            raise ConfigError(
                f"{p}: row {i + 1} is malformed ({e}); numbers must be plain numbers, blanks allowed"
            ) from None
    return rows


@dataclass
class RowResult:
    row: Row
    predicted: float | None
    error_factor: float | None
    devices: int | None = None
    skipped: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


class RowModel:
    """A row's plan, placed once (placement does not depend on fitted parameters), simulated on demand."""

    def __init__(self, row: Row, params: SimParams):
        from waferline.plan.place import place
        from waferline.plan.plan import SpeculativeConfig
        from waferline.spec.catalog import load_hardware, load_model

        if row.metric not in METRICS:
            raise ConfigError(f"metric {row.metric!r} unknown; use one of {', '.join(METRICS)}")
        self.row = row
        self.spec = load_model(row.model)
        self.hw = load_hardware(row.hardware)
        self.P = row.input_len or params.default_prompt_len
        self.O = row.output_len or params.default_output_len
        method = row.spec_decoding if row.spec_decoding else "none"
        self.plan = place(
            self.spec,
            self.hw,
            devices=row.num_chips,
            weight_bits=row.weight_bits,
            context=self.P + self.O,
            batch=row.concurrency,
            speculative=SpeculativeConfig(method),
        )

    def predict(self, params: SimParams) -> tuple[float, Any]:
        from waferline.sim.pipeline import simulate

        r = simulate(self.plan, prompt_len=self.P, output_len=self.O, concurrency=self.row.concurrency, params=params,
                     spec=self.spec, hardware=self.hw)
        value = {
            "decode_tokens_per_s_per_user": r.decode_tokens_per_s_per_user,
            "ttft_s": r.ttft_s,
            "end_to_end_latency_s": r.end_to_end_s,
            "aggregate_tokens_per_s": r.aggregate_tokens_per_s,
        }[self.row.metric]
        return value, r


def error_factor(pred: float, actual: float) -> float:
    """exp(|ln(pred / actual)|): 1.0 is exact, 2.0 is off by 2x either way."""
    return math.exp(abs(math.log(pred / actual)))


def build_models(rows: list[Row], params: SimParams) -> list[tuple[Row, RowModel | None, str]]:
    out = []
    for row in rows:
        try:
            out.append((row, RowModel(row, params), ""))
        except WaferlineError as e:
            out.append((row, None, str(e)))
    return out


def validate(path: str | Path, params: SimParams | None = None) -> tuple[list[RowResult], dict[str, Any]]:
    """Predict every row of the CSV; return per-row results and a summary (median / max error factor)."""
    params = params or load_params()
    results = []
    for row, rm, why in build_models(read_published(path), params):
        if rm is None:
            results.append(RowResult(row, None, None, skipped=why))
            continue
        pred, r = rm.predict(params)
        results.append(RowResult(row, pred, error_factor(pred, row.value), devices=rm.plan.num_devices,
                                 detail={"fits": rm.plan.fits, "stages": rm.plan.num_stages, "bound": r.bound,
                                         "speculative": r.speculative.get("speedup")}))
    errs = [r.error_factor for r in results if r.error_factor is not None]
    summary = {"rows": len(results), "predicted": len(errs), "skipped": len(results) - len(errs),
               "median_error_factor": statistics.median(errs) if errs else None,
               "max_error_factor": max(errs) if errs else None,
               "within_1_25": sum(e <= 1.25 for e in errs), "within_2": sum(e <= 2.0 for e in errs),
               "params": params.fitted_on or "defaults"}
    return results, summary


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
    import time

    from waferline.sim.fit import fit_rows, problem

    if by not in CROSS_VALIDATE:
        raise ConfigError(f"--cross-validate {by!r} unknown; use one of {', '.join(CROSS_VALIDATE)}")
    t0 = time.time()
    prob = problem(path, params)
    groups: dict[str, list[int]] = {}
    for i, (row, _) in enumerate(prob.models):
        groups.setdefault(fold_key(row, by), []).append(i)
    out: dict[int, RowResult] = {}
    for g, held in groups.items():
        train = [i for i in range(len(prob.models)) if i not in held]
        if not train:
            raise ConfigError(f"cross-validation by {by}: every row is in group {g!r}; nothing left to fit on")
        refit = fit_rows(prob.subset(train), iters=iters)
        for i in held:
            row, rm = prob.models[i]
            pred, r = rm.predict(refit)
            out[i] = RowResult(row, pred, error_factor(pred, row.value) if pred > 0 else None,
                               devices=rm.plan.num_devices,
                               detail={"fold": g, "trained_on": len(train), "bound": r.bound})
        if progress:
            progress(g, [out[i] for i in held])
    results = [out[i] for i in range(len(prob.models))]
    results += [RowResult(next(r for r in read_published(path) if r.id == rid), None, None, skipped=why)
                for rid, why in prob.skipped]
    errs = [r.error_factor for r in results if r.error_factor is not None]
    summary = {"rows": len(results), "predicted": len(errs), "skipped": len(results) - len(errs),
               "cross_validate": by, "folds": len(groups),
               "median_error_factor": statistics.median(errs) if errs else None,
               "max_error_factor": max(errs) if errs else None,
               "within_1_25": sum(e <= 1.25 for e in errs), "within_2": sum(e <= 2.0 for e in errs),
               "params": f"refit per fold from the priors on the other rows of {Path(path).name}",
               "seconds": round(time.time() - t0, 1)}
    return results, summary
