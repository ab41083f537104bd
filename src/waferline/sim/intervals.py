"""90% intervals on the simulator's predictions from the fit's uncertainty.

`calibrate --published` refits the fitted parameters on resamples of the published rows (a bootstrap) and stores
the parameter sets in sim/fitted.yaml; here a plan is predicted once per set and each figure's interval is the
5th-95th percentile of those predictions (widened to hold the point estimate where a skewed set of refits leaves
it outside). It is the uncertainty of the fitted parameters only: it does not include the model's own error
(`waferline validate --cross-validate vendor` measures that)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from waferline.plan.plan import Plan
    from waferline.sim.cost import SimParams
    from waferline.sim.result import SimResult

LEVEL = 0.9
# SimResult's predicted figures (every float the simulator predicts at the top level) and the speculative ones
FIGURES = ("step_latency_s", "decode_tokens_per_s_per_user", "aggregate_tokens_per_s", "ttft_s", "prefill_s",
           "end_to_end_s", "first_answer_s")
SPEC_FIGURES = ("accept_rate", "expected_tokens_per_step", "verify_s", "draft_s", "speedup")
# the serving simulation's predicted figures (sim/serving.py ServingResult)
SERVING_FIGURES = ("output_tokens_per_s", "duration_s", "mean_batch", "kv_handover_s",
                   *(f"{m}_{q}_s" for m in ("ttft", "itl", "e2e") for q in ("mean", "p50", "p90", "p99")))
# requests simulated in all for the serving figures' intervals (one serving run per parameter set and acceptance
# end; ~1 s per 100,000 requests on a 2-core machine): above it they are left out and a note says so
SERVING_INTERVAL_BUDGET = 1_000_000


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 1])."""
    s = sorted(xs)
    if not s:
        raise ValueError("percentile of nothing")
    pos = q * (len(s) - 1)
    i = int(pos)
    j = min(i + 1, len(s) - 1)
    return s[i] + (s[j] - s[i]) * (pos - i)


def interval(point: float, values: list[float], level: float = LEVEL) -> list[float]:
    """[low, high] holding ``level`` of ``values`` (central), widened to hold ``point``."""
    tail = (1.0 - level) / 2.0
    return [min(point, percentile(values, tail)), max(point, percentile(values, 1.0 - tail))]


def _over_ends(point: float, ends: list[list[float]], level: float) -> list[float]:
    """The interval of a figure predicted with each parameter set at each end of an acceptance range: each end's
    interval, joined (the lowest low, the highest high), so a range only ever widens what one acceptance gives (the
    percentiles of both ends' predictions pooled could narrow it). A figure the acceptance does not move (a step
    without speculation, the prefill): one end's."""
    if all(e == ends[0] for e in ends):
        return interval(point, ends[0], level)
    each = [interval(point, e, level) for e in ends]
    return [min(i[0] for i in each), max(i[1] for i in each)]


def attach_intervals(result: SimResult, plan: Plan, params: SimParams, level: float = LEVEL,
                     accept_range: tuple[float, float] | None = None, **simulate_kwargs: Any) -> SimResult:
    """Fill ``result.intervals`` (and the speculative figures' ``X_interval``) by predicting ``plan`` with each
    stored parameter set; ``simulate_kwargs`` are what produced ``result`` (prompt_len, output_len, concurrency,
    spec, hardware). ``accept_range``: a given range of speculative acceptance, each set predicted at both ends (the
    intervals then hold the acceptance's range and the parameters' uncertainty). Without stored sets and without a
    range the intervals are None (the parameters carry no uncertainty estimate)."""
    from dataclasses import replace

    from waferline.sim.pipeline import simulate

    sets = params.parameter_sets()
    if not sets and accept_range is None:
        result.intervals = {f: None for f in FIGURES}
        for f in SPEC_FIGURES:
            if f in result.speculative:
                result.speculative[f + "_interval"] = None
        return result
    plans = [plan]
    if accept_range is not None and plan.speculative.method != "none":
        plans = [replace(plan, speculative=replace(plan.speculative, accept_rate=a)) for a in accept_range]
    if not sets:  # (the range's two ends alone: the interval spans them, not a percentile between them)
        level = 1.0
    by_end = [[simulate(p, params=s, **simulate_kwargs) for s in (sets or [params])] for p in plans]

    def ends(get: Any) -> list[list[float]]:
        return [[float(get(r)) for r in preds] for preds in by_end]

    result.intervals = {f: _over_ends(getattr(result, f), ends(lambda r, f=f: getattr(r, f)), level)
                        for f in FIGURES}
    for f in SPEC_FIGURES:
        v = result.speculative.get(f)
        if isinstance(v, (int, float)):
            result.speculative[f + "_interval"] = _over_ends(float(v), ends(lambda r, f=f: r.speculative[f]), level)
    return result


def serving_intervals(serving: Any, plan: Plan, params: SimParams, run: Any, level: float = LEVEL,
                      accept_range: tuple[float, float] | None = None) -> str | None:
    """Fill ``serving.intervals`` (a ServingResult's predicted figures) by running the serving simulation once per
    stored parameter set, and at both ends of ``accept_range`` where given: ``run(plan, params)`` runs it as it ran
    for ``serving`` (the same arrivals: the spread is the parameters', and the acceptance range's). Returns why they
    were left out (no parameter sets, or more simulated requests than SERVING_INTERVAL_BUDGET), else None."""
    from dataclasses import replace

    sets = params.parameter_sets()
    if not sets and accept_range is None:
        return None  # (_params_notes already says the parameters carry no sets)
    plans = [plan]
    if accept_range is not None and plan.speculative.method != "none":
        plans = [replace(plan, speculative=replace(plan.speculative, accept_rate=a)) for a in accept_range]
    runs = len(plans) * len(sets or [params])
    if runs * serving.requests > SERVING_INTERVAL_BUDGET:
        return (f"serving figures without intervals: {runs} re-runs of {serving.requests:,} requests would simulate "
                f"more than {SERVING_INTERVAL_BUDGET:,} (--num-requests {SERVING_INTERVAL_BUDGET // runs:,} or fewer "
                "gives them)")
    if not sets:  # (the range's two ends alone: the interval spans them)
        level = 1.0
    by_end = [[run(p, s) for s in (sets or [params])] for p in plans]

    figures = SERVING_FIGURES + (("arrival_rate",) if serving.users else ())  # (a closed loop's: the rate reached)
    serving.intervals = {f: _over_ends(float(getattr(serving, f)), [[float(getattr(r, f)) for r in preds]
                                                                     for preds in by_end], level) for f in figures}
    return None


def fmt(value: float, iv: list[float] | None, f: str = ",.1f", scale: float = 1.0) -> str:
    """'125.3 (90%: 80.1-190.2)' (just the value when there is no interval or it has no spread)."""
    s = format(value * scale, f)
    if not iv or format(iv[0] * scale, f) == format(iv[1] * scale, f):  # none, or no spread at this precision
        return s
    return f"{s} (90%: {format(iv[0] * scale, f)}-{format(iv[1] * scale, f)})"
