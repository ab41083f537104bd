"""The twin section of the HTML report: predicted vs measured per Plan, and one run's per-stage timeline with the
simulator's predicted timeline beside it (from a `waferline twin` JSON result)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
RESULTS = REPO / "benchmarks" / "results"
DEFAULT_RESULT = RESULTS / "twin_sol-mini.json"


def latest_result() -> Path:
    """The newest sol-mini twin result shipped in benchmarks/results/ (by the date each file records)."""
    def date(p: Path) -> str:
        try:
            return str(json.loads(p.read_text()).get("date") or "")
        except (OSError, json.JSONDecodeError):
            return ""

    found = sorted(RESULTS.glob("twin*_sol-mini.json"), key=date)
    return found[-1] if found else DEFAULT_RESULT


def load_result(path: str | Path | None = None) -> tuple[dict[str, Any] | None, str]:
    """A twin result and where it came from: ``path``, else the newest sol-mini result shipped in
    benchmarks/results/ (``latest_result``: a run made before, on the machine it names, not in this run); (None, why)
    if none."""
    p = Path(path) if path else latest_result()
    if not p.is_file():
        return None, (f"no twin result at {p}: run `waferline twin --model models/sol-mini --out {p}` "
                      "(or `python benchmarks/twin_grid.py`) to add this section")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        return None, f"{p} is not valid JSON ({e}); re-run `waferline twin ... --out {p}`"
    where = (f"twin result {p}" if path else
             f"the newest twin result shipped with waferline ({p.relative_to(REPO)}): measured by an earlier "
             "`waferline twin` run on the machine it names, not in this run; `waferline twin --model models/sol-mini "
             "--out FILE` measures this machine")
    return d, where


def _ok(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in result.get("rows", []) if r.get("status") == "ok"]


CATEGORIES = (("tab:orange", "1 process"), ("tab:blue", "pipeline"), ("tab:green", "speculative"),
              ("tab:red", "attention/FFN disaggregation (AFD)"))


def _category_color(row: dict[str, Any]) -> str:
    pt = row["point"]
    return ("tab:red" if pt["afd"] else "tab:green" if pt["speculative"] != "none" else
            "tab:blue" if pt["stages"] != 1 else "tab:orange")


def _log_ticks(axis: Any, lo: float, hi: float) -> None:
    """Plain-number tick labels on a log axis: 1-2-5 steps when it spans few decades (else a log axis that spans
    less than a decade shows one label or none), decades otherwise."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    decades = math.log10(hi / lo)
    subs = (1.0, 2.0, 5.0) if decades <= 2.6 else (1.0, 3.0) if decades <= 4 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def figure_pred_vs_meas(result: dict[str, Any]) -> Any:
    """Log-log scatter: predicted vs measured tokens/s per user, aggregate tokens/s and TTFT, one point per Plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from waferline.report.layout import place_labels

    rows = _ok(result)
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.6), layout="constrained")
    drawn = []
    for ax, (key, label, scale) in zip(axes, (("tokens_per_s_per_user", "decode tokens/s per user", 1.0),
                                              ("aggregate_tokens_per_s", "aggregate tokens/s", 1.0),
                                              ("ttft_s", "TTFT (ms)", 1e3))):
        xs = [r["measured"][key] * scale for r in rows]
        ys = [r["predicted"][key] * scale for r in rows]
        if not xs:
            ax.set_axis_off()
            continue
        lo, hi = min(xs + ys) / 1.6, max(xs + ys) * 1.6
        ax.plot([lo, hi], [lo, hi], color="k", lw=1)
        for f, st in ((1.1, ":"), (1.5, "--")):
            ax.plot([lo, hi], [lo * f, hi * f], color="gray", lw=0.8, ls=st)
            ax.plot([lo, hi], [lo / f, hi / f], color="gray", lw=0.8, ls=st)
        ax.scatter(xs, ys, c=[_category_color(r) for r in rows], s=28, zorder=3)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        _log_ticks(ax.xaxis, lo, hi)
        _log_ticks(ax.yaxis, lo, hi)
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        s = result["summary"].get(key, {})
        if s.get("n"):
            ax.set_title(f"{label}: median x{s['median']:.2f}, max x{s['max']:.2f}", fontsize=10)
        drawn.append((ax, xs, ys))
    handles = [Line2D([], [], color="k", lw=1, label="exact"),
               Line2D([], [], color="gray", lw=0.8, ls=":", label="x1.1 either way"),
               Line2D([], [], color="gray", lw=0.8, ls="--", label="x1.5 either way")]
    handles += [Line2D([], [], ls="", marker="o", color=c, label=name) for c, name in CATEGORIES]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle("twin: simulator vs engine, one point per Plan", fontsize=11)
    names = [r["plan"] for r in rows]
    for ax, xs, ys in drawn:  # after the layout is final: the labels are placed in screen space
        place_labels(ax, xs, ys, names, fontsize=6.5)
    return fig


def pick_timeline_row(result: dict[str, Any]) -> dict[str, Any] | None:
    """The pipeline Plan with the most stages (then micro-batches) that was compared, else any compared Plan."""
    rows = [r for r in _ok(result) if r.get("run", {}).get("arrivals_row0")]
    if not rows:
        return None
    return max(rows, key=lambda r: (r["sim"]["num_stages"] if not r["point"]["afd"] else 0, r["sim"]["micro_batches"],
                                    r["point"]["batch"]))


def figure_timeline(result: dict[str, Any], row: dict[str, Any]) -> Any:
    """Left: token arrivals of one sequence, measured vs predicted. Middle: the simulator's per-stage timeline of the
    first decode cycles (busy per micro-batch, hops). Right: CPU seconds per stage process over the run, measured
    (from /proc) vs predicted (decode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 5.0), gridspec_kw={"width_ratios": [1.0, 1.4, 0.9]},
                                     layout="constrained")
    arr = [t * 1e3 for t in row["run"]["arrivals_row0"]]
    p = row["predicted"]
    rate = p["tokens_per_s_per_user"]
    pred = [p["ttft_s"] * 1e3 + i * 1e3 / rate for i in range(len(arr))]
    a1.step(arr, range(1, len(arr) + 1), where="post", color="tab:blue")
    a1.step(pred, range(1, len(pred) + 1), where="post", ls="--", color="tab:orange")
    a1.set_xlabel("ms since the request")
    a1.set_ylabel("tokens of sequence 0")
    a1.set_title(f"{row['plan']}: token arrivals", fontsize=10)
    # predicted Gantt: micro-batch j enters stage i after stage i-1 and its hop; each stage serves one at a time
    stages = row["sim"]["stages"]
    M = max(1, row["sim"]["micro_batches"])
    S = len(stages)
    busy = [s["total"] - s["hop"] for s in stages]
    hops = [s["hop"] for s in stages]
    free = [0.0] * S
    cycles = 3
    ready = [0.0] * M
    cmap = plt.get_cmap("viridis")  # not tab10: its blue and orange mean measured and predicted in this figure
    for c in range(cycles):
        for j in range(M):
            t = ready[j]
            for i in range(S):
                start = max(t, free[i])
                a2.barh(i, busy[i] * 1e3, left=start * 1e3, color=cmap(0.9 * j / max(1, M - 1)),
                        alpha=0.85 if c % 2 == 0 else 0.55,
                        edgecolor="k", lw=0.3)
                free[i] = start + busy[i]
                t = free[i] + hops[i]
            ready[j] = t
    every = -(-S // 12)  # at most 12 stage names, so they never overlap
    a2.set_yticks(range(0, S, every))
    a2.set_yticklabels([f"stage {s['index']} ({s['role']}, L{s['layers']})" for s in stages[::every]], fontsize=7)
    a2.invert_yaxis()
    a2.set_xlabel("ms (predicted)")
    a2.set_title(f"predicted per-stage timeline: {cycles} cycles x {M} micro-batch(es), colour = micro-batch\n"
                 "(stage busy, then the hop; processes sharing cores not drawn)", fontsize=9)
    # CPU per process
    meas = row["run"].get("cpu_s_per_process") or []
    host = row["sim"].get("host", {})
    cpu = host.get("cpu_per_stage_s") or busy
    n_tok = max(1, result["output_len"] - 1)
    tpc = max(1.0, (row.get("acceptance") or {}).get("tokens_per_verify_step", 1.0))
    pred_cpu = [c * M * n_tok / tpc for c in cpu]
    x = range(max(len(meas), len(pred_cpu)))
    a3.bar([i - 0.2 for i in range(len(meas))], meas, width=0.4, color="tab:blue")
    a3.bar([i + 0.2 for i in range(len(pred_cpu))], pred_cpu, width=0.4, color="tab:orange")
    a3.set_xlim(-0.6, len(x) - 0.4)
    a3.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=12))
    a3.set_xlabel("stage process")
    a3.set_ylabel("CPU seconds in the timed run")
    a3.set_title("CPU per stage process", fontsize=10)
    # one legend for the figure, below the panels: blue is always measured, orange always predicted
    handles = [Line2D([], [], color="tab:blue", label="measured token arrivals (engine)"),
               Line2D([], [], color="tab:orange", ls="--", label="predicted token arrivals (simulator)"),
               Patch(color="tab:blue", label="measured CPU per process (/proc, whole run)"),
               Patch(color="tab:orange", label="predicted CPU per process (decode)")]
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    return fig


def table_rows(result: dict[str, Any]) -> list[list[Any]]:
    head = ["plan", "stages", "M", "B", "tok/s/user meas", "pred", "err x", "agg tok/s meas", "pred", "err x",
            "TTFT ms meas", "pred", "err x", "status"]
    out: list[list[Any]] = [head]

    def f(x: float | None, d: int = 1) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    for r in result.get("rows", []):
        pt = r["point"]
        m, p, e = r.get("measured", {}), r.get("predicted", {}), r.get("error_factor", {})
        out.append(
            [
                r["plan"],
                "afd" if pt["afd"] else pt["stages"],
                r.get("sim", {}).get("micro_batches", pt["micro_batches"]),  # (as run: at most one per sequence)
                pt["batch"],
                f(m.get("tokens_per_s_per_user")),
                f(p.get("tokens_per_s_per_user")),
                f(e.get("tokens_per_s_per_user"), 2),
                f(m.get("aggregate_tokens_per_s")),
                f(p.get("aggregate_tokens_per_s")),
                f(e.get("aggregate_tokens_per_s"), 2),
                f(m["ttft_s"] * 1e3 if m.get("ttft_s") else None),
                f(p["ttft_s"] * 1e3 if p.get("ttft_s") else None),
                f(e.get("ttft_s"), 2),
                r.get("status", "")[:60],
            ]
        )
    return out


def machine_text(result: dict[str, Any]) -> str:
    """Which machine the twin result was measured on, from what the result file records: its host name, core
    count, date, torch build and load; the CPU model when the file has one (it says so when it does not)."""
    host = result.get("host") or {}
    name = result.get("machine") or host.get("host") or "an unnamed machine"
    cpu = result.get("cpu_model") or host.get("cpu_model") or host.get("cpu")
    parts = [f"CPU {cpu}" if cpu else "CPU model not recorded in the result file"]
    if result.get("cores"):
        parts.append(f"{result['cores']} logical cores")
    if host.get("torch"):
        parts.append(f"torch {host['torch']}")
    when = str(result.get("date") or host.get("date") or "an unrecorded date")
    when = when.replace("T", " ").replace("+00:00", " UTC")
    load = result.get("load_average") or []
    tail = f", load average {load[0]:.2f} at the end of the run" if load else ""
    return f"Measured by `waferline twin` on the machine named \"{name}\" ({', '.join(parts)}) on {when}{tail}."


def add_twin_sections(report: Any, result: dict[str, Any] | None, source: str) -> None:
    """Append the twin sections to ``report`` (a report.html.Report); with no result, one section that says why."""
    if result is None:
        report.add("The twin: simulator vs engine", text=source)
        return
    s = result["summary"]
    summ = "; ".join(f"{label} median x{s[k]['median']:.2f}, max x{s[k]['max']:.2f}" for k, label in
                     (("tokens_per_s_per_user", "tokens/s per user"), ("aggregate_tokens_per_s", "aggregate"),
                      ("ttft_s", "TTFT")) if s.get(k, {}).get("n"))
    where = machine_text(result)
    note = (f"Source: {source}; model {result.get('model_name')}, one thread per process; "
            f"prompt {result['prompt_len']}, {result['output_len']} new tokens. "
            f"Measured inputs: {result['inputs']['measured']}. "
            f"Modelled: {result['inputs']['modelled']}.")
    report.add("The twin: predicted vs measured per Plan",
               text=f"{where} {s['plans_compared']} Plans compared: {summ}. From {source}.",
               figure=figure_pred_vs_meas(result), table=table_rows(result), note=note)
    row = pick_timeline_row(result)
    if row is not None:
        report.add(
            f"The twin: one run's timeline ({row['plan']})",
            text=where,
            figure=figure_timeline(result, row),
            note="Left: when each token of sequence 0 arrived in the engine run vs when the simulator predicts it "
            "(TTFT + i / predicted rate). Middle: the simulator's per-stage timeline (stage busy time per "
            "micro-batch, then the hop to the next stage). Right: CPU seconds each stage process used in the "
            "timed run (measured from /proc; includes the prefill) vs the simulator's decode CPU per stage.",
        )
