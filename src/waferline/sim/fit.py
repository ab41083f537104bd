"""Fit the simulator's non-datasheet parameters on a published-results CSV (MAP fit with physical priors) and store
them marked fitted."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from waferline.errors import FitError, WaferlineError
from waferline.sim.cost import (
    ACCEPT_BOUNDS,
    CLASS_PARAMS,
    FITTED_PATH,
    TTFT_OVERHEAD_BOUNDS,
    ClassParams,
    SimParams,
    load_params,
)
from waferline.sim.validate import Row, RowModel, build_models, error_factor, read_published

# Priors per device class (value, log-sd). Physically: GPUs pay kernel launches + syncs per layer (~10 us with
# CUDA graphs); a wafer pays a synchronisation per layer (~us) and streams its activation vectors through the mesh
# (sim/wafer.py: the fitted term is how many links a vector is spread over).
_GPU_LIKE = {"bw_eff": (0.75, 0.3), "layer_latency_s": (10e-6, 1.0), "flops_eff": (0.5, 0.5)}
CLASS_PRIORS: dict[str, dict[str, tuple[float, float]]] = {
    "gpu": _GPU_LIKE | {"moe_latency_s": (30e-6, 1.0)},
    "tpu": _GPU_LIKE | {"moe_latency_s": (30e-6, 1.0)},
    "rdu": _GPU_LIKE | {"moe_latency_s": (10e-6, 1.0)},
    "lpu": _GPU_LIKE | {"layer_latency_s": (10e-6, 1.5), "moe_latency_s": (10e-6, 1.0)},
    "wafer": {"bw_eff": (0.75, 0.3), "layer_latency_s": (5e-6, 1.5), "fabric_links": (4.0, 2.0),
              "moe_latency_s": (1e-6, 0.0), "hop_latency_s": (5e-6, 1.0), "flops_eff": (0.5, 0.5)},
    # a host CPU running the torch engine eagerly: ~15-20 ops per layer at ~10 us of dispatch each
    "cpu": {"bw_eff": (0.6, 0.5), "layer_latency_s": (150e-6, 1.5), "moe_latency_s": (100e-6, 1.0),
            "flops_eff": (0.3, 0.5), "hop_latency_s": (50e-6, 1.5)},
}
# Classes with no rows in the data: these take the fitted gpu values (their own priors otherwise).
LIKE_GPU = ("tpu", "asic")
# Parameters one physical mechanism sets for several classes, fitted once per group: the fraction of peak memory
# bandwidth decode achieves is a property of the memory (HBM stacks behind a memory controller; SRAM next to the
# compute), not of the vendor, so GPUs, TPUs and RDUs share one and wafers and LPUs another.
SHARED: dict[str, tuple[tuple[str, ...], ...]] = {"bw_eff": (("gpu", "tpu", "rdu"), ("wafer", "lpu"))}
# Which priors the data may move (sd 0 = held at the prior: physically motivated, not fitted).
FITTABLE = ("layer_latency_s", "fabric_links", "bw_eff", "moe_latency_s", "hop_latency_s")
ACCEPT_PRIOR = {"draft": 0.8, "mtp": 0.85, "eagle": 0.8, "medusa": 0.7, "ngram": 0.5}
PRIOR_WEIGHT = 0.05
TTFT_PRIOR = (0.05, 2.0, *TTFT_OVERHEAD_BOUNDS)  # request overhead in a client-measured TTFT (value, log-sd, lo, hi)
OUTLIER_LOG = math.log(1.9)


@dataclass
class _Param:
    key: tuple  # ("class", cname, pname) | ("accept", method) | ("ttft",)
    prior: float
    sd: float
    lo: float
    hi: float
    classes: tuple[str, ...] = ()  # a class parameter: every class it sets (more than one where SHARED groups them)

    def to_value(self, z: float) -> float:
        """Unconstrained z -> value in [lo, hi] (logistic in log space)."""
        llo, lhi = math.log(self.lo), math.log(self.hi)
        s = 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, z))))
        return math.exp(llo + (lhi - llo) * s)

    def to_z(self, v: float) -> float:
        llo, lhi = math.log(self.lo), math.log(self.hi)
        s = (math.log(min(max(v, self.lo * 1.0001), self.hi * 0.9999)) - llo) / (lhi - llo)
        return math.log(s / (1 - s))


def _set(params: SimParams, p: _Param, v: float) -> None:
    if p.key[0] == "class":
        for c in p.classes:
            setattr(params.classes[c], p.key[2], v)
    elif p.key[0] == "accept":
        params.accept_rate[p.key[1]] = v
    else:
        params.ttft_overhead_s = v


def _free_params(models: list[tuple[Row, RowModel]], base: SimParams) -> list[_Param]:
    """Only parameters the data can inform: classes present, MoE / hop / speculation terms that occur."""
    out: list[_Param] = []
    seen: set[tuple] = set()

    def add(key: tuple, prior: float, sd: float, lo: float, hi: float) -> None:
        if key[0] == "class":  # one parameter per SHARED group: the first class of its group names it
            cname, pname = key[1], key[2]
            group = next((g for g in SHARED.get(pname, ()) if cname in g), (cname,))
            key = ("class", group[0], pname)
            joined = next((q for q in out if q.key == key), None)
            if joined is not None:  # (in the group's order, whatever the rows' order)
                joined.classes = tuple(c for c in group if c in joined.classes or c == cname)
                return
            seen.add(key)
            out.append(_Param(key, prior, sd, lo, hi, (cname,)))
        elif key not in seen:
            seen.add(key)
            out.append(_Param(key, prior, sd, lo, hi))

    for row, rm in models:
        kind = rm.hw.kind
        cname = kind if kind in CLASS_PRIORS else "gpu"
        pri = CLASS_PRIORS[cname]
        if cname not in base.classes:
            base.classes[cname] = ClassParams(hop_latency_s=None)
            for pname, (v, _) in pri.items():
                setattr(base.classes[cname], pname, v)
        if row.metric != "ttft_s":
            for pname in ("layer_latency_s", "fabric_links", "bw_eff"):
                if pname in pri and pri[pname][1] > 0:
                    _, _, lo, hi, _ = CLASS_PARAMS[pname]  # efficiencies stay <= 1, assumed peaks included
                    add(("class", cname, pname), pri[pname][0], pri[pname][1], lo, hi)
            if pri.get("moe_latency_s", (0, 0))[1] > 0 and any(
                lc.ffn is not None and lc.ffn.kind == "moe" for lc in rm.spec.layers
            ):
                _, _, lo, hi, _ = CLASS_PARAMS["moe_latency_s"]
                add(("class", cname, "moe_latency_s"), *pri["moe_latency_s"], lo, hi)
            if "hop_latency_s" in pri and rm.plan.num_stages > 1:
                _, _, lo, hi, _ = CLASS_PARAMS["hop_latency_s"]
                add(("class", cname, "hop_latency_s"), *pri["hop_latency_s"], lo, hi)
            m = rm.plan.speculative.method
            if m != "none":
                add(("accept", m), ACCEPT_PRIOR.get(m, 0.7), 0.3, *ACCEPT_BOUNDS)
        else:
            add(("ttft",), *TTFT_PRIOR)
    return out


def _nelder_mead(
    f: Callable[[list[float]], float], x0: list[float], step: float = 0.7, iters: int = 4000, tol: float = 1e-7
) -> list[float]:
    n = len(x0)
    pts = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) < tol:
            break
        c = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        xr = [c[j] + (c[j] - pts[-1][j]) for j in range(n)]
        fr = f(xr)
        if fr < vals[0]:
            xe = [c[j] + 2 * (c[j] - pts[-1][j]) for j in range(n)]
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = [c[j] + 0.5 * (pts[-1][j] - c[j]) for j in range(n)]
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                for i in range(1, n + 1):
                    pts[i] = [pts[0][j] + 0.5 * (pts[i][j] - pts[0][j]) for j in range(n)]
                    vals[i] = f(pts[i])
    return pts[min(range(n + 1), key=lambda i: vals[i])]


BOOTSTRAP_SETS = 32  # parameter sets stored for intervals (`calibrate --published --bootstrap N`)
BOOTSTRAP_SEED = 1


@dataclass
class Problem:
    """A fit's data, built once: the rows that simulate (placed once), those skipped, the parameters at their priors."""

    models: list[tuple[Row, RowModel]]
    skipped: list[tuple[str, str]]
    base: SimParams

    def subset(self, keep: list[int]) -> Problem:
        return Problem([self.models[i] for i in keep], self.skipped, self.base)


def prior_params(base: SimParams | None = None) -> SimParams:
    """``base`` with every parameter a fit may move put back to its prior: classes, acceptance rates and the TTFT
    request overhead (a fit must not start from, or fall back to, a previous fit's values)."""
    out = (base or load_params()).copy()
    out.classes = {}
    out.status = {}
    out.accept_rate = dict(out.accept_rate) | dict(ACCEPT_PRIOR)
    out.ttft_overhead_s = TTFT_PRIOR[0]
    out.bootstrap = []
    return out


def problem(csv_path: str | Path, base: SimParams | None = None) -> Problem:
    """Read and place every row of the CSV once (placement does not depend on the fitted parameters)."""
    base = prior_params(base)
    rows = read_published(csv_path)
    built = build_models(rows, base)
    for k, (r, m, _) in enumerate(built):
        if m is None:
            continue
        try:  # (a row the simulator refuses is skipped, as `validate` skips it; whatever the parameters' values)
            m.predict(base)
        except WaferlineError as e:
            built[k] = (r, None, str(e))
    models = [(r, m) for r, m, _ in built if m is not None]
    skipped = [(r.id, why) for r, m, why in built if m is None]
    if not models:
        why = "; ".join(f"{i}: {w}" for i, w in skipped[:5])
        why += f"; and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        raise FitError(f"no usable rows in {csv_path}: " + (why or "it has no data rows, only a header"))
    return Problem(models, skipped, base)


def _prepare(prob: Problem) -> tuple[SimParams, list[_Param]]:
    base = prob.base.copy()
    free = _free_params(prob.models, base)
    for p in free:
        for c in p.classes:
            if getattr(base.classes[c], p.key[2]) is None:
                setattr(base.classes[c], p.key[2], p.prior)
    return base, free


def _residuals_fn(prob: Problem, free: list[_Param], work: SimParams,
                  weights: list[float] | None) -> Callable[[Any], Any]:
    """z -> the residual vector whose sum of squares is the MAP objective (weighted rows; zero weight = row out)."""
    import numpy as np

    w = weights or [1.0] * len(prob.models)
    used = [(row, rm, math.sqrt(wi)) for (row, rm), wi in zip(prob.models, w) if wi > 0]
    sq_out, sq_prior = math.sqrt(10.0), math.sqrt(PRIOR_WEIGHT)

    def residuals(z: Any) -> Any:
        for p, zi in zip(free, z):
            _set(work, p, p.to_value(float(zi)))
        r = []
        for row, rm, sw in used:
            pred, _ = rm.predict(work)
            e = math.log(pred / row.value) if pred > 0 else 50.0
            r.append(sw * e)
            r.append(sw * sq_out * math.copysign(max(0.0, abs(e) - OUTLIER_LOG), e))
        for p, zi in zip(free, z):
            r.append(sq_prior * (math.log(p.to_value(float(zi))) - math.log(p.prior)) / p.sd)
        return np.array(r)

    return residuals


def _levenberg_marquardt(residuals: Callable[[Any], Any], z0: list[float], iters: int = 200,
                         rtol: float = 1e-10) -> list[float]:
    """Minimise |residuals(z)|^2 (forward-difference Jacobian, Marquardt scaling)."""
    import numpy as np

    z = np.array(z0, dtype=float)
    r = residuals(z)
    f = float(r @ r)
    lam, h = 1e-2, 1e-5
    for _ in range(iters):
        J = np.empty((len(r), len(z)))
        for j in range(len(z)):
            zz = z.copy()
            zz[j] += h
            J[:, j] = (residuals(zz) - r) / h
        A, g = J.T @ J, J.T @ r
        while True:
            dz = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), -g)
            rn = residuals(z + dz)
            fn = float(rn @ rn)
            if fn < f:
                break
            lam *= 4.0
            if lam > 1e10:
                return [float(x) for x in z]
        z, r, lam, gain, f = z + dz, rn, max(lam / 3.0, 1e-12), f - fn, fn
        if gain < rtol * max(1.0, f):
            break
    return [float(x) for x in z]


def _solve(
    prob: Problem, weights: list[float] | None = None, start: SimParams | None = None, iters: int = 200,
    restarts: int = 0,
) -> tuple[SimParams, list[_Param], list[float]]:
    """MAP fit on ``prob`` (optionally weighted rows); Levenberg-Marquardt from ``start`` (default: the priors),
    then ``restarts`` Nelder-Mead polishes (``iters`` caps both). Returns (parameters with the fitted values set,
    the free parameters, their unconstrained values)."""
    base, free = _prepare(prob)
    work = base.copy()
    res = _residuals_fn(prob, free, work, weights)
    z = [p.to_z(_current(start or base, p)) for p in free]
    if free:
        z = _levenberg_marquardt(res, z, iters=iters)
        for r in range(restarts):

            def objective(x: list[float]) -> float:
                v = res(x)
                return float(v @ v)

            x = _nelder_mead(objective, z, step=0.8 / (r + 1), iters=iters)
            if objective(x) < objective(z):
                z = x
    fitted = base.copy()
    for p, zi in zip(free, z):
        _set(fitted, p, p.to_value(zi))
    return fitted, free, z


def _finish(fitted: SimParams, free: list[_Param]) -> SimParams:
    """Mark fitted values, give data-less classes their priors (tpu / asic: the gpu values)."""
    for p in free:
        if p.key[0] == "class":
            for c in p.classes:
                fitted.classes[c].status[p.key[2]] = "fitted" if len(p.classes) == 1 else (
                    "fitted, shared by " + ", ".join(p.classes))
        elif p.key[0] == "accept":
            fitted.status[f"accept_rate.{p.key[1]}"] = "fitted"
        else:
            fitted.status["ttft_overhead_s"] = "fitted"
    for cname in LIKE_GPU:
        if cname not in fitted.classes and "gpu" in fitted.classes:
            g = fitted.classes["gpu"]
            fitted.classes[cname] = replace(g, status={k: "assumed: as gpu (no data)" for k in g.status} | {
                k: "assumed: as gpu (no data)" for k in CLASS_PARAMS if getattr(g, k) is not None})
    for cname, pri in CLASS_PRIORS.items():
        if cname not in fitted.classes:
            cp = ClassParams(hop_latency_s=None)
            for pname, (v, _) in pri.items():
                setattr(cp, pname, v)
            for p in free:  # a class without rows takes what its SHARED group's rows say
                if p.key[0] == "class" and cname in next((g for g in SHARED.get(p.key[2], ()) if p.key[1] in g), ()):
                    setattr(cp, p.key[2], getattr(fitted.classes[p.classes[0]], p.key[2]))
                    cp.status[p.key[2]] = "fitted, shared by " + ", ".join(p.classes)
            fitted.classes[cname] = cp
    return fitted


def param_names(p: _Param) -> list[str]:
    """The names a free parameter's value goes by in fitted.yaml's bootstrap sets (one per class it sets)."""
    if p.key[0] == "class":
        return [f"{c}.{p.key[2]}" for c in p.classes]
    return [param_name(p)]


def param_name(p: _Param) -> str:
    """A free parameter's name in fitted.yaml's bootstrap sets: class.param, accept_rate.method, ttft_overhead_s."""
    if p.key[0] == "class":
        return f"{p.key[1]}.{p.key[2]}"
    if p.key[0] == "accept":
        return f"accept_rate.{p.key[1]}"
    return "ttft_overhead_s"


def fit_rows(prob: Problem, iters: int = 200, restarts: int = 0) -> SimParams:
    """Fit every fitted parameter on the rows of ``prob`` only, from the priors (what cross-validation refits)."""
    fitted, free, _ = _solve(prob, iters=iters, restarts=restarts)
    return _finish(fitted, free)


def bootstrap(prob: Problem, fitted: SimParams, sets: int = BOOTSTRAP_SETS, seed: int = BOOTSTRAP_SEED,
              iters: int = 60, progress: Callable[[int], None] | None = None) -> list[dict[str, float]]:
    """Resample the rows with replacement ``sets`` times and refit (from the full fit's values: a warm start);
    returns each set's free parameters by name. A parameter whose rows all fall out of a resample goes back to its
    prior: that is what the data says without them. ``progress(k)``: called after the k-th refit."""
    import random

    rng = random.Random(seed)
    n = len(prob.models)
    out = []
    for _ in range(sets):
        counts = [0.0] * n
        for _ in range(n):
            counts[rng.randrange(n)] += 1.0
        p, free, _ = _solve(prob, weights=counts, start=fitted, iters=iters)
        out.append({name: _current(p, f) for f in free for name in param_names(f)})
        if progress is not None:
            progress(len(out))
    return out


def fit(
    csv_path: str | Path, base: SimParams | None = None, restarts: int = 0, iters: int = 200,
    bootstrap_sets: int = 0, seed: int = BOOTSTRAP_SEED, progress: Callable[[str, float], None] | None = None,
) -> tuple[SimParams, dict[str, Any]]:
    """Fit the free parameters on the CSV; returns the new parameters and a report (before/after errors).
    ``bootstrap_sets`` > 0: also refit on that many resamples of the rows and store the sets (for intervals).
    ``progress(what, fraction)``: told as the fit and each bootstrap refit finish (most of the time is the refits)."""
    say = progress or (lambda what, frac: None)
    if bootstrap_sets < 0:
        raise FitError(f"bootstrap sets must be >= 0, got {bootstrap_sets}")
    t0 = time.time()
    prob = problem(csv_path, base)
    base0, free = _prepare(prob)
    say("fitting", 0.0)
    fitted, free, z = _solve(prob, iters=iters, restarts=restarts)
    fitted = _finish(fitted, free)
    fitted.fitted_on = f"{Path(csv_path).name} ({len(prob.models)} rows)"
    t_fit = time.time() - t0
    if bootstrap_sets > 0:
        share = 0.1  # (of the bar: the fit; the refits take the rest)
        say(f"bootstrap refit 0/{bootstrap_sets}", share)
        fitted.bootstrap = bootstrap(prob, fitted, sets=bootstrap_sets, seed=seed, progress=lambda k: say(
            f"bootstrap refit {k}/{bootstrap_sets}", share + (1 - share) * k / bootstrap_sets))
        fitted.bootstrap_info = f"{bootstrap_sets} refits on rows resampled with replacement (seed {seed})"

    def errors(params: SimParams) -> list[float]:
        out = []
        for row, rm in prob.models:
            pred, _ = rm.predict(params)
            out.append(error_factor(pred, row.value) if pred > 0 else math.exp(50.0))
        return out

    before = errors(base0)
    after = errors(fitted)
    report = {
        "rows": len(prob.models),
        "skipped": prob.skipped,
        "free_parameters": len(free),
        "seconds": time.time() - t0,
        "fit_seconds": t_fit,
        "bootstrap_sets": len(fitted.bootstrap),
        "params": {".".join(str(k) for k in p.key): p.to_value(zi) for p, zi in zip(free, z)},
        # the parameters the fit left at an end of their physical range: the rows want them further
        "at_bound": {".".join(str(k) for k in p.key): (p.lo, "lower") if v <= p.lo * (1 + 1e-3) else (p.hi, "upper")
                     for p, zi in zip(free, z) for v in [p.to_value(zi)]
                     if v <= p.lo * (1 + 1e-3) or v >= p.hi * (1 - 1e-3)},
        "before": {"median": _median(before), "max": max(before)},
        "after": {"median": _median(after), "max": max(after)},
        "per_row": {r.id: e for (r, _), e in zip(prob.models, after)},
    }
    return fitted, report


def _current(params: SimParams, p: _Param) -> float:
    if p.key[0] == "class":
        v = getattr(params.classes[p.classes[0]], p.key[2])
        return p.prior if v is None else v
    if p.key[0] == "accept":
        return params.accept_rate.get(p.key[1], p.prior)
    return params.ttft_overhead_s or p.prior


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def save_fitted(params: SimParams, path: str | Path = FITTED_PATH, csv_path: str = "") -> None:
    header = (
        "# waferline simulator parameters. Values marked `fitted: true` were fitted by\n"
        f"#   waferline calibrate --published {csv_path or '(the shipped sim/data/published_results.csv)'}\n"
        "# on that file only (MAP fit: log error factors, weak physical priors; Levenberg-Marquardt from the priors);\n"
        "# values marked `assumed` are priors the data could not constrain. Classes without rows: tpu and asic take\n"
        "# the gpu values; cpu (a host running the torch engine) keeps its priors until engine runs are added to the\n"
        "# CSV. `bootstrap`: the fitted parameters refit on resamples of the rows (drawn with replacement; a\n"
        "# parameter whose rows all fall out goes back to its prior), one set per line: `simulate` predicts with each\n"
        "# set and reports the 5th-95th percentile as the 90% interval of every figure.\n"
        "# Meanings: " + "; ".join(f"{k}: {v[4]}" for k, v in CLASS_PARAMS.items())
    )
    params.save(path, header=header)
