"""Fit the simulator's non-datasheet parameters on a published-results CSV (MAP fit with physical priors) and store
them marked fitted."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from waferline.errors import FitError
from waferline.sim.cost import CLASS_PARAMS, FITTED_PATH, ClassParams, SimParams, load_params
from waferline.sim.validate import Row, RowModel, build_models, read_published

# Priors per device class (value, log-sd). Physically: GPUs pay kernel launches + syncs per layer (~10 us with
# CUDA graphs); a wafer pays mesh reductions per layer (~us) and a d-vector streamed through the fabric (~1 cycle per
# element).
CLASS_PRIORS: dict[str, dict[str, tuple[float, float]]] = {
    "gpu": {"bw_eff": (0.75, 0.3), "layer_latency_s": (10e-6, 1.0), "moe_latency_s": (30e-6, 1.0),
            "hidden_latency_s": (0.0, 0.0), "flops_eff": (0.5, 0.5)},
    "tpu": {"bw_eff": (0.75, 0.3), "layer_latency_s": (10e-6, 1.0), "moe_latency_s": (30e-6, 1.0),
            "hidden_latency_s": (0.0, 0.0), "flops_eff": (0.5, 0.5)},
    "rdu": {"bw_eff": (0.75, 0.3), "layer_latency_s": (10e-6, 1.0), "moe_latency_s": (10e-6, 1.0),
            "hidden_latency_s": (0.0, 0.0), "flops_eff": (0.5, 0.5)},
    "lpu": {"bw_eff": (0.75, 0.3), "layer_latency_s": (10e-6, 1.5), "moe_latency_s": (10e-6, 1.0),
            "hidden_latency_s": (0.0, 0.0), "flops_eff": (0.5, 0.5)},
    "wafer": {"bw_eff": (0.75, 0.3), "layer_latency_s": (5e-6, 1.5), "hidden_latency_s": (1e-9, 1.5),
              "moe_latency_s": (1e-6, 0.0), "hop_latency_s": (5e-6, 1.0), "flops_eff": (0.5, 0.5)},
    # a host CPU running the torch engine eagerly: ~15-20 ops per layer at ~10 us of dispatch each
    "cpu": {"bw_eff": (0.6, 0.5), "layer_latency_s": (150e-6, 1.5), "moe_latency_s": (100e-6, 1.0),
            "hidden_latency_s": (0.0, 0.0), "flops_eff": (0.3, 0.5), "hop_latency_s": (50e-6, 1.5)},
}
# Classes with no rows in the data: these take the fitted gpu values (their own priors otherwise).
LIKE_GPU = ("tpu", "asic")
# Which priors the data may move (sd 0 = held at the prior: physically motivated, not fitted).
FITTABLE = ("layer_latency_s", "hidden_latency_s", "bw_eff", "moe_latency_s", "hop_latency_s")
# A device whose peak bandwidth is only assumed (no datasheet) may show an effective bandwidth above it.
ASSUMED_BW_EFF_MAX = 4.0
ACCEPT_PRIOR = {"draft": 0.8, "mtp": 0.85, "eagle": 0.8, "medusa": 0.7, "ngram": 0.5}
ACCEPT_BOUNDS = (0.3, 0.97)
PRIOR_WEIGHT = 0.05
OUTLIER_LOG = math.log(1.9)


@dataclass
class _Param:
    key: tuple  # ("class", cname, pname) | ("accept", method) | ("ttft",)
    prior: float
    sd: float
    lo: float
    hi: float

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
        setattr(params.classes[p.key[1]], p.key[2], v)
    elif p.key[0] == "accept":
        params.accept_rate[p.key[1]] = v
    else:
        params.ttft_overhead_s = v


def _free_params(models: list[tuple[Row, RowModel]], base: SimParams) -> list[_Param]:
    """Only parameters the data can inform: classes present, MoE / hop / speculation terms that occur."""
    out: list[_Param] = []
    seen: set[tuple] = set()

    def add(key: tuple, prior: float, sd: float, lo: float, hi: float) -> None:
        if key not in seen:
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
            for pname in ("layer_latency_s", "hidden_latency_s", "bw_eff"):
                if pname in pri and pri[pname][1] > 0:
                    _, _, lo, hi, _ = CLASS_PARAMS[pname]
                    if (
                        pname == "bw_eff"
                        and rm.hw.sources.get("memory_bandwidth")
                        and rm.hw.sources["memory_bandwidth"].status == "assumed"
                    ):
                        hi = ASSUMED_BW_EFF_MAX
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
            add(("ttft",), 0.05, 2.0, 1e-4, 2.0)
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


def fit(
    csv_path: str | Path, base: SimParams | None = None, restarts: int = 3, iters: int = 3000
) -> tuple[SimParams, dict[str, Any]]:
    """Fit the free parameters on the CSV; returns the new parameters and a report (before/after errors)."""
    t0 = time.time()
    base = (base or load_params()).copy()
    base.classes = {}  # every fit starts from the physical priors (reproducible), not from a previous fit
    base.status = {}
    rows = read_published(csv_path)
    built = build_models(rows, base)
    models = [(r, m) for r, m, _ in built if m is not None]
    skipped = [(r.id, why) for r, m, why in built if m is None]
    if not models:
        raise FitError(f"no usable rows in {csv_path}: " + "; ".join(f"{i}: {w}" for i, w in skipped[:5]))
    free = _free_params(models, base)
    for p in free:
        if p.key[0] == "class" and getattr(base.classes[p.key[1]], p.key[2]) is None:
            setattr(base.classes[p.key[1]], p.key[2], p.prior)

    def errors(params: SimParams) -> list[float]:
        out = []
        for row, rm in models:
            pred, _ = rm.predict(params)
            out.append(math.log(pred / row.value) if pred > 0 else 50.0)
        return out

    work = base.copy()

    def objective(z: list[float]) -> float:
        for p, zi in zip(free, z):
            _set(work, p, p.to_value(zi))
        e = errors(work)
        loss = sum(x * x for x in e) + 10.0 * sum(max(0.0, abs(x) - OUTLIER_LOG) ** 2 for x in e)
        loss += PRIOR_WEIGHT * sum(
            ((math.log(p.to_value(zi)) - math.log(p.prior)) / p.sd) ** 2 for p, zi in zip(free, z)
        )
        return loss

    before = [math.exp(abs(x)) for x in errors(base)]
    start = [p.to_z(_current(base, p)) for p in free]
    best = start
    best_val = objective(start)
    for r in range(restarts):
        x = _nelder_mead(objective, best, step=0.8 / (r + 1), iters=iters)
        v = objective(x)
        if v < best_val:
            best, best_val = x, v
    fitted = base.copy()
    for p, zi in zip(free, best):
        v = p.to_value(zi)
        _set(fitted, p, v)
        if p.key[0] == "class":
            fitted.classes[p.key[1]].status[p.key[2]] = "fitted"
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
            fitted.classes[cname] = cp
    fitted.fitted_on = f"{Path(csv_path).name} ({len(models)} rows)"
    after = [math.exp(abs(x)) for x in errors(fitted)]
    report = {
        "rows": len(models),
        "skipped": skipped,
        "free_parameters": len(free),
        "seconds": time.time() - t0,
        "params": {".".join(str(k) for k in p.key): p.to_value(z) for p, z in zip(free, best)},
        "before": {"median": _median(before), "max": max(before)},
        "after": {"median": _median(after), "max": max(after)},
        "per_row": {r.id: e for (r, _), e in zip(models, after)},
    }
    return fitted, report


def _current(params: SimParams, p: _Param) -> float:
    if p.key[0] == "class":
        v = getattr(params.classes[p.key[1]], p.key[2])
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
        "# on that file only (MAP fit: log error factors, weak physical priors); values marked `assumed` are priors\n"
        "# the data could not constrain. Classes without rows: tpu and asic take the gpu values; cpu (a host running\n"
        "# the torch engine) keeps its priors until engine runs are added to the CSV.\n"
        "# Meanings: " + "; ".join(f"{k}: {v[4]}" for k, v in CLASS_PARAMS.items())
    )
    params.save(path, header=header)
