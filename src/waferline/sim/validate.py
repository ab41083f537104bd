"""Validation against published results: read a results CSV, plan and simulate every row, report error factors."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from waferline.errors import ConfigError, WaferlineError
from waferline.sim.cost import SimParams, load_params

# the published results waferline ships (each row with its sources): `waferline validate` and
# `waferline calibrate --published` read it unless given another CSV
PUBLISHED_PATH = Path(__file__).with_name("data") / "published_results.csv"
METRICS = ("decode_tokens_per_s_per_user", "ttft_s", "end_to_end_latency_s", "aggregate_tokens_per_s")
REQUIRED_COLUMNS = ("model", "hardware", "metric", "value")
# the reasoning_tokens cell of a reasoning model whose hidden reasoning length the source does not state
UNSTATED = "unstated"
# the `unit` column: each metric's units and their factor to the metric's own unit (seconds, tokens per second); a
# blank unit is the metric's own
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}  # (the Greek mu reads as the micro sign)
RATE_UNITS = {"tok/s": 1.0, "tokens/s": 1.0, "tok/s/user": 1.0, "tokens/s/user": 1.0}
METRIC_UNITS = {"decode_tokens_per_s_per_user": RATE_UNITS, "ttft_s": TIME_UNITS, "end_to_end_latency_s": TIME_UNITS,
                "aggregate_tokens_per_s": RATE_UNITS}
# the count columns: the least each may be (a blank cell takes its documented default)
COUNT_COLUMNS = {"num_chips": 1, "weight_bits": 1, "concurrency": 1, "input_len": 1, "output_len": 1}


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
    date: str = ""
    # hidden tokens generated before the output_len answer tokens (a reasoning model's thinking); None: the model
    # reasons but the source does not say how long (an end-to-end time is then not comparable)
    reasoning_tokens: int | None = 0
    unit: str = ""  # as the CSV gives it; ``value`` is in the metric's own unit (s, tok/s)
    # the speedup of the row's speculation over the same system without it, where the source states it: the row is
    # then predicted as the system without speculation times this speedup (no acceptance rate is fitted on it)
    spec_speedup: float | None = None
    # why the row cannot be predicted (a count that is not a whole number in range, a unit that does not fit the
    # metric): the row is skipped with this reason, as rows of an unknown model or hardware are
    problem: str = ""


def _beside(csv_path: Path, cell: str) -> str:
    """A model or hardware cell: a relative path (a user's hardware YAML, a config.json or checkpoint folder) is read
    beside the CSV, where it names something there; a catalog id, an absolute path or anything else stays as
    written."""
    from waferline.spec.catalog import _looks_like_path

    if not _looks_like_path(cell) or cell.startswith("~") or Path(cell).is_absolute():
        return cell
    there = csv_path.parent / cell
    return str(there) if there.exists() else cell


def read_published(path: str | Path) -> list[Row]:
    """Parse a published-results CSV ('#' lines are comments); blank cells take documented defaults."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"no CSV at {p}")
    try:
        text = p.read_text(encoding="utf-8-sig")  # (a spreadsheet's byte-order mark is not part of the first name)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p} is not a text CSV ({e})") from None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    reader = csv.DictReader(lines)
    if reader.fieldnames:  # (a column named with a space after its comma is that column, as its cells are stripped)
        reader.fieldnames = [c.strip() for c in reader.fieldnames]
    cols = reader.fieldnames or []
    missing = [c for c in REQUIRED_COLUMNS if c not in cols]
    if missing:
        raise ConfigError(
            f"{p}: missing column(s) {', '.join(missing)}; expected a header like "
            "id,system,model,hardware,num_chips,weight_bits,spec_decoding,concurrency,input_len,output_len,metric,value,unit,..."
        )
    rows: list[Row] = []

    def reasoning(v: str | None) -> int | None:
        v = (v or "").strip()
        if v.lower() == UNSTATED:
            return None
        x = _number(v)[1] if v else 0.0
        if not (math.isfinite(x) and x >= 0 and x == math.floor(x)):
            raise ValueError(f"reasoning_tokens {v} is not a whole number >= 0")
        return int(x)

    seen: dict[str, int] = {}
    for i, r in enumerate(reader):
        extra = [c for c in r.get(None) or [] if c.strip()]  # (DictReader's key for cells past the header's)
        if extra:
            raise ConfigError(f"{p}: row {i + 1} has {len(cols) + len(r[None])} cells, the header {len(cols)} "
                              f"columns (extra: {', '.join(repr(c) for c in extra[:3])}); quote a cell that holds a "
                              "comma, and write numbers without thousands separators")
        blank = [c for c in REQUIRED_COLUMNS if not (r.get(c) or "").strip()]
        if blank:
            raise ConfigError(f"{p}: row {i + 1} has no {', '.join(blank)}")
        try:
            value = float(r["value"])
        except ValueError:
            raise ConfigError(f"{p}: row {i + 1}: value {r['value']!r} is not a number") from None
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{p}: row {i + 1}: value must be a finite number > 0 (a speed or a time), got {value}")
        rid = (r.get("id") or f"row-{i + 1}").strip()
        if rid in seen:
            raise ConfigError(f"{p}: row {i + 1}: id {rid!r} repeats row {seen[rid]}'s; every row needs its own id")
        seen[rid] = i + 1
        problems: list[str] = []
        counts = {c: _count(r.get(c), c, least, problems) for c, least in COUNT_COLUMNS.items()}
        method = (r.get("spec_decoding") or "none").strip() or "none"
        speedup = _speedup(r.get("spec_speedup"), method, (r.get("metric") or "").strip(), problems)
        metric, unit = r["metric"].strip(), (r.get("unit") or "").strip().replace("\u03bc", "\u00b5")
        units = METRIC_UNITS.get(metric)
        if units is not None:  # (an unknown metric is skipped with its own reason)
            if unit and unit not in units:
                problems.append(f"unit {unit!r} does not fit metric {metric}; use {', '.join(units)} "
                                f"(blank: {next(iter(units))})")
            else:
                value *= units.get(unit, 1.0)
        try:
            rows.append(
                Row(
                    id=rid,
                    model=_beside(p, r["model"].strip()),
                    hardware=_beside(p, r["hardware"].strip()),
                    num_chips=counts["num_chips"],
                    weight_bits=counts["weight_bits"] or 16,
                    spec_decoding=method,
                    concurrency=counts["concurrency"] or 1,
                    input_len=counts["input_len"],
                    output_len=counts["output_len"],
                    metric=metric,
                    value=value,
                    system=(r.get("system") or "").strip(),
                    source=(r.get("source") or "").strip(),
                    date=(r.get("date") or "").strip(),
                    reasoning_tokens=reasoning(r.get("reasoning_tokens")),
                    unit=unit,
                    spec_speedup=speedup,
                    problem="; ".join(problems),
                )
            )
        except (ValueError, KeyError) as e:
            raise ConfigError(
                f"{p}: row {i + 1} is malformed ({e}); numbers must be plain numbers, blanks allowed "
                f"(reasoning_tokens: a count >= 0 or {UNSTATED!r})"
            ) from None
    return rows


def _number(cell: str | None) -> tuple[str, float]:
    """A cell's text, stripped, and its value (NaN where it is not a number; the text is empty for a blank cell)."""
    v = (cell or "").strip()
    try:
        return v, float(v)
    except ValueError:
        return v, math.nan


def _speedup(cell: str | None, method: str, metric: str, problems: list[str]) -> float | None:
    """A spec_speedup cell: blank -> None; a finite number > 0 on a decode-rate row with speculation; anything else is
    added to ``problems`` (the row is skipped with that reason)."""
    v, x = _number(cell)
    if not v:
        return None
    if not (math.isfinite(x) and x > 0):
        problems.append(f"spec_speedup must be a number > 0 (or blank), got {v!r}")
    elif method == "none":
        problems.append(f"spec_speedup {v} on a row without speculation (spec_decoding none)")
    elif metric != "decode_tokens_per_s_per_user":
        problems.append(f"spec_speedup is a decode-rate ratio; metric {metric} does not take it")
    else:
        return x
    return None


def _count(cell: str | None, column: str, least: int, problems: list[str]) -> int | None:
    """A count cell: blank -> None (the documented default); a whole number >= ``least``; anything else (0
    concurrency, 1.5 chips, a negative length, text) is added to ``problems`` (the row is skipped with that reason),
    never rounded or replaced by the default."""
    v, x = _number(cell)
    if not v:
        return None
    if not math.isfinite(x) or x != math.floor(x) or x < least:
        problems.append(f"{column} must be a whole number >= {least} (or blank), got {v!r}")
        return None
    return int(x)


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
        if row.problem:
            raise ConfigError(row.problem)
        self.row = row
        self.spec = load_model(row.model)
        self.hw = load_hardware(row.hardware)
        self.P = row.input_len or params.default_prompt_len
        self.O = row.output_len or params.default_output_len
        self.R = row.reasoning_tokens or 0
        method = row.spec_decoding if row.spec_decoding else "none"
        if row.spec_speedup is not None:  # (the system without speculation; its stated speedup applied in predict)
            method = "none"
        self.plan = place(
            self.spec,
            self.hw,
            devices=row.num_chips,
            weight_bits=row.weight_bits,
            context=self.P + self.R + self.O,
            batch=row.concurrency,
            speculative=SpeculativeConfig(method),
        )

    def predict(self, params: SimParams) -> tuple[float, Any]:
        from waferline.sim.pipeline import simulate

        r = simulate(self.plan, prompt_len=self.P, output_len=self.O, concurrency=self.row.concurrency, params=params,
                     spec=self.spec, hardware=self.hw, reasoning_tokens=self.R)
        value = {
            "decode_tokens_per_s_per_user": r.decode_tokens_per_s_per_user,
            "ttft_s": r.ttft_s,
            "end_to_end_latency_s": r.end_to_end_s,
            "aggregate_tokens_per_s": r.aggregate_tokens_per_s,
        }[self.row.metric]
        if self.row.spec_speedup is not None:
            value *= self.row.spec_speedup
        return value, r


def beyond_ceiling(rm: RowModel, ceiling: SimParams) -> float | None:
    """The row's metric at ``ceiling`` (``SimParams.ceiling``) where the published value lies beyond it (faster
    than the model allows with any setting of its fitted terms), else None: such a row needs a mechanism or a
    hardware number that neither the row nor the catalog states (undisclosed speculation or precision, an assumed
    bandwidth or latency that is off)."""
    best, _ = rm.predict(ceiling)
    lower_is_faster = rm.row.metric in ("ttft_s", "end_to_end_latency_s")
    return best if (rm.row.value < best if lower_is_faster else rm.row.value > best) else None


def not_comparable(row: Row) -> bool:
    """An end-to-end time of a reasoning model whose hidden reasoning length is not stated: the time covers tokens
    the row does not count, so no prediction can be compared with it."""
    return row.metric == "end_to_end_latency_s" and row.reasoning_tokens is None


NOT_COMPARABLE = "not comparable: a reasoning model's end-to-end time, its hidden reasoning length not stated"


def unstated_reasoning(row: Row, params: SimParams, rows: list[Row]) -> dict[str, Any]:
    """What a ``not_comparable`` row can still be checked against: the model's end-to-end time with no reasoning at
    all (a floor: the published time may not be below it), and the hidden tokens the difference implies at the
    predicted decode rate; where ``rows`` hold the same measurement's published decode rate (same system, model,
    hardware, date and lengths), also at that rate."""
    rm = RowModel(replace(row, reasoning_tokens=0), params)
    floor, r = rm.predict(params)
    rate = r.decode_tokens_per_s_per_user
    out = {"no_reasoning_s": floor, "decode_tokens_per_s": rate, "consistent": row.value >= floor,
           "implied_reasoning_tokens": max(0.0, (row.value - floor) * rate)}
    same = [c for c in rows if c.metric == "decode_tokens_per_s_per_user"
            and (c.system, c.model, c.hardware, c.date, c.input_len, c.output_len)
            == (row.system, row.model, row.hardware, row.date, row.input_len, row.output_len)]
    if same:  # the answer's own decode at the published rate, the predicted TTFT before it
        c = same[0]
        out |= {"published_rate_row": c.id, "published_decode_tokens_per_s": c.value,
                "implied_reasoning_tokens_at_published_rate":
                    max(0.0, (row.value - r.ttft_s) * c.value - (rm.O - 1))}
    return out


def summarize(results: list[RowResult]) -> dict[str, Any]:
    """Median / max error factor and counts over the predicted rows, the rows beyond the physical ceiling, and the
    rows not comparable (with what they imply)."""
    errs = [r.error_factor for r in results if r.error_factor is not None]
    nc = {r.row.id: r.detail["unstated_reasoning"] for r in results if r.detail.get("unstated_reasoning")}
    # every row is exactly one of: predicted, skipped (its reason in RowResult.skipped), not comparable
    return {"rows": len(results), "predicted": len(errs), "skipped": sum(bool(r.skipped) for r in results),
            "not_comparable": nc,
            "median_error_factor": statistics.median(errs) if errs else None,
            "max_error_factor": max(errs) if errs else None,
            "within_1_25": sum(e <= 1.25 for e in errs), "within_2": sum(e <= 2.0 for e in errs),
            "beyond_ceiling": {r.row.id: r.detail["ceiling"] for r in results if r.detail.get("ceiling")}}


def error_factor(pred: float, actual: float) -> float:
    """exp(|ln(pred / actual)|): 1.0 is exact, 2.0 is off by 2x either way."""
    return math.exp(abs(math.log(pred / actual)))


def build_models(rows: list[Row], params: SimParams) -> list[tuple[Row, RowModel | None, str]]:
    out = []
    for row in rows:
        try:
            rm = RowModel(row, params)
        except WaferlineError as e:
            out.append((row, None, str(e)))
            continue
        if not rm.plan.fits:  # (a deployment that cannot hold the model says nothing about the fitted terms)
            out.append((row, None, f"does not fit on {rm.plan.num_devices} x {row.hardware}: "
                                   + "; ".join(rm.plan.problems)[:200]))
            continue
        out.append((row, None, NOT_COMPARABLE) if not_comparable(row) else (row, rm, ""))
    return out


def skipped_result(row: Row, why: str, params: SimParams, rows: list[Row]) -> RowResult:
    """A row not predicted: skipped (``why`` in ``skipped``), or not comparable (``why`` is NOT_COMPARABLE:
    ``skipped`` stays empty and ``detail`` carries what the row can still be checked against; ``rows``: the CSV's
    rows, where the same measurement's decode rate may be)."""
    if why == NOT_COMPARABLE:
        return RowResult(row, None, None, detail={"unstated_reasoning": unstated_reasoning(row, params, rows)})
    return RowResult(row, None, None, skipped=why or "not predicted")


def validate(path: str | Path, params: SimParams | None = None) -> tuple[list[RowResult], dict[str, Any]]:
    """Predict every row of the CSV; return per-row results and a summary (median / max error factor). A ConfigError
    (naming the file and what each row lacked) when no row could be compared: there is no error factor to report."""
    params = params or load_params()
    ceiling = params.ceiling()
    results = []
    rows = read_published(path)
    for row, rm, why in build_models(rows, params):
        if rm is None:
            results.append(skipped_result(row, why, params, rows))
            continue
        try:
            pred, r = rm.predict(params)
            top = beyond_ceiling(rm, ceiling)
        except WaferlineError as e:  # (a row the simulator refuses is skipped like one the planner refuses)
            results.append(skipped_result(row, str(e), params, rows))
            continue
        results.append(RowResult(row, pred, error_factor(pred, row.value), devices=rm.plan.num_devices,
                                 detail={"fits": rm.plan.fits, "stages": rm.plan.num_stages, "bound": r.bound,
                                         "speculative": r.speculative.get("speedup"), "ceiling": top}))
    summary = summarize(results)
    if not summary["predicted"]:
        skipped = [f"{r.row.id}: {r.skipped[:120]}" for r in results if r.skipped]
        why = "; ".join(skipped[:5]) + (f"; and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        raise ConfigError(
            f"{path}: no row could be compared ({summary['rows']} rows: {summary['skipped']} skipped, "
            f"{len(summary['not_comparable'])} not comparable)" + (f": {why}" if why else "")
        )
    return results, summary | {"params": params.fitted_on or "defaults"}
