"""CLI subcommands of the planner/simulator: plan, simulate, validate, calibrate, twin (register() adds them to
argparse)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from waferline.errors import ConfigError, WaferlineError

# the published results shipped in the package (sim.validate.PUBLISHED_PATH), as --help names them
DEFAULT_DATA = "sim/data/published_results.csv, shipped with waferline"


def _default_data() -> str:
    """The published-results CSV shipped in the package: found wherever waferline is installed or run from."""
    from waferline.sim.validate import PUBLISHED_PATH

    return str(PUBLISHED_PATH)


def _console():
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def _add_plan_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("model", nargs="?" if optional else None,
                   help="catalog model id (e.g. gpt-5.6-sol, deepseek-v3), a config.json path, or a checkpoint dir")
    p.add_argument("--hardware", "-H", required=not optional,
                   help="catalog hardware id (e.g. wse-3, h200-sxm, gb200-nvl72) or a YAML file")
    p.add_argument("--devices", type=int, default=None, help="number of devices (default: the fewest that fit)")
    p.add_argument("--weight-bits", type=int, default=16, choices=(16, 8, 4))
    p.add_argument("--kv-bits", type=int, default=16, choices=(16, 8, 4))
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="context length per sequence for memory sizing (default 4096; simulate: prompt+output)",
    )
    p.add_argument("--batch", type=int, default=1, help="sequences resident at once (memory sizing)")
    p.add_argument("--layers-per-stage", type=int, default=None, help="K layers per stage (default: as many as fit)")
    p.add_argument(
        "--afd", action="store_true", help="attention/FFN disaggregation: separate attention and FFN device pools"
    )
    p.add_argument(
        "--attention-ranks",
        type=int,
        default=None,
        metavar="M",
        help="with --afd: M attention ranks, each holding every layer's mixer for its share of the sequences "
        "(the layout the engine's `generate --afd` runs)",
    )
    p.add_argument("--ffn-ranks", type=int, default=None, metavar="N",
                   help="with --afd: N FFN ranks, each holding a shard of every layer's experts")
    p.add_argument(
        "--micro-batches", type=int, default=None, help="micro-batches in flight (default min(batch, stages))"
    )
    p.add_argument("--out", default=None, help="write the plan as JSON to this file")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _spec_cfg(args: argparse.Namespace):
    from waferline.plan.plan import SpeculativeConfig

    method = getattr(args, "speculative", "none") or "none"
    return SpeculativeConfig(
        method=method,
        num_tokens=getattr(args, "num_speculative_tokens", None) or 0,
        accept_rate=getattr(args, "accept_rate", None),
        draft_model=getattr(args, "draft_model", None),
    )


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse flags that would be silently ignored in the combination given."""
    from waferline.errors import UsageError

    given = [f for f, v in (("--attention-ranks", getattr(args, "attention_ranks", None)),
                            ("--ffn-ranks", getattr(args, "ffn_ranks", None))) if v is not None]
    if given and not getattr(args, "afd", False):
        raise UsageError(f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} --afd")
    method = getattr(args, "speculative", "none") or "none"
    spec_flags = [f for f, v in (("--accept-rate", getattr(args, "accept_rate", None)),
                                 ("--num-speculative-tokens", getattr(args, "num_speculative_tokens", None)),
                                 ("--draft-model", getattr(args, "draft_model", None))) if v is not None]
    if spec_flags and method == "none":
        raise UsageError(
            f"{' and '.join(spec_flags)} {'need' if len(spec_flags) > 1 else 'needs'} --speculative METHOD"
        )
    if getattr(args, "draft_model", None) is not None and method != "draft":
        raise UsageError(f"--draft-model is for --speculative draft, not --speculative {method}")
    rate = getattr(args, "arrival_rate", None)
    if rate is not None and not (rate > 0 and math.isfinite(rate)):  # 0 would silently skip the serving simulation
        raise UsageError(f"--arrival-rate must be > 0 requests/s, got {rate}")
    if getattr(args, "num_requests", None) is not None and not getattr(args, "arrival_rate", None):
        raise UsageError("--num-requests sizes the serving simulation: give --arrival-rate too")
    serving_flags = [f for f, v in (("--max-num-batched-tokens", getattr(args, "max_num_batched_tokens", None)),
                                    ("--pd-disaggregation", getattr(args, "pd_disaggregation", None) or None),
                                    ("--prefill-devices", getattr(args, "prefill_devices", None)),
                                    ("--expert-skew", getattr(args, "expert_skew", None))) if v is not None]
    if serving_flags and not getattr(args, "arrival_rate", None):
        raise UsageError(f"{' and '.join(serving_flags)} shape{'' if len(serving_flags) > 1 else 's'} the serving "
                         "simulation: give --arrival-rate too")
    if getattr(args, "prefill_devices", None) is not None and args.prefill_devices < 1:
        raise UsageError(f"--prefill-devices must be >= 1, got {args.prefill_devices}")
    if getattr(args, "prefill_devices", None) is not None and getattr(args, "plan", None):
        raise UsageError("--prefill-devices places the prefill pool anew: give MODEL --hardware, not --plan "
                         "(--pd-disaggregation alone uses a second copy of the plan)")


def _make_plan(args: argparse.Namespace, context: int):
    from waferline.plan.place import place

    _check_flags(args)
    if not args.model or not args.hardware:
        raise ConfigError("give MODEL and --hardware (or --plan PLAN.json for simulate)")
    batch = max(args.batch, getattr(args, "concurrency", None) or 1)  # size memory for every concurrent sequence
    return place(args.model, args.hardware, devices=args.devices, weight_bits=args.weight_bits, kv_bits=args.kv_bits,
                 context=context, batch=batch, layers_per_stage=args.layers_per_stage, afd=args.afd,
                 micro_batches=args.micro_batches, speculative=_spec_cfg(args),
                 attention_ranks=args.attention_ranks, ffn_ranks=args.ffn_ranks)


def cmd_plan(args: argparse.Namespace) -> int:
    """Place a model on hardware; print per-stage memory; exit 2 if it does not fit."""
    from waferline.plan.place import batch_capacity, context_capacity
    from waferline.spec.catalog import load_model

    ctx = args.context or 4096
    plan = _make_plan(args, ctx)
    if args.out:
        plan.save(args.out)
    spec = load_model(args.model)
    max_ctx = context_capacity(plan, spec) if plan.fits else 0
    max_batch = batch_capacity(plan, spec, plan.context_len) if plan.fits else 0
    if args.json:
        d = plan.to_dict()
        d["max_context_per_sequence"] = max_ctx
        d["max_sequences_at_context"] = max_batch
        print(json.dumps(d, indent=1))
        return 0 if plan.fits else 2
    from rich.table import Table

    con = _console()
    t = Table(
        title=f"{plan.model} on {plan.hardware}: {plan.num_devices} device(s), {plan.num_stages} stage(s), "
        f"{plan.weight_bits}-bit weights, {plan.kv_bits}-bit KV, context {plan.context_len:,}, batch {plan.batch}"
    )
    for c in (
        "stage",
        "role",
        "layers",
        "devices",
        "weights GB",
        "cache GB",
        "act GB",
        "reserve GB",
        "total GB",
        "capacity GB",
        "fits",
    ):
        t.add_column(c, justify="right" if c not in ("role", "fits") else "left")
    rows = plan.stages
    show = rows if len(rows) <= 24 else rows[:10] + [None] + rows[-10:]  # type: ignore[list-item]
    for s in show:
        if s is None:
            t.add_row("...", "", f"({len(rows) - 20} more)", "", "", "", "", "", "", "", "")
            continue
        m = s.memory
        t.add_row(
            str(s.index),
            s.role,
            f"{s.layers[0]}-{s.layers[-1]}" if len(s.layers) > 1 else str(s.layers[0]),
            str(s.num_devices),
            _gb(m.weights),
            _gb(m.cache),
            _gb(m.activations),
            _gb(m.reserve),
            _gb(m.total),
            _gb(m.capacity),
            "yes" if m.fits else "[red]NO[/red]",
        )
    con.print(t)
    for n in plan.notes:
        con.print(f"note: {n}")
    if plan.fits:
        con.print(f"fits. Longest context per sequence at batch {plan.batch}: {max_ctx:,} tokens; "
                  f"sequences of {plan.context_len:,} tokens that fit: {max_batch:,}")
    else:
        con.print("[red]does not fit:[/red]")
        for p in plan.problems:
            con.print(f"  {p}")
    if args.out:
        con.print(f"plan written to {args.out}")
    return 0 if plan.fits else 2


def _load_params(args: argparse.Namespace):
    from waferline.sim.cost import load_params

    return load_params(getattr(args, "params", None))


def cmd_simulate(args: argparse.Namespace) -> int:
    """Plan (or read --plan) and predict tokens/s, TTFT and a per-stage breakdown."""
    from waferline.plan.plan import Plan
    from waferline.sim.pipeline import simulate

    _check_flags(args)
    params = _load_params(args)
    P = args.prompt_len or params.default_prompt_len
    O = args.output_len or params.default_output_len
    if args.plan:
        plan = Plan.load(args.plan)
        if args.speculative != "none":
            plan.speculative = _spec_cfg(args)
    else:
        plan = _make_plan(args, args.context or (P + O))
    r = simulate(plan, prompt_len=P, output_len=O, concurrency=args.concurrency, params=params)
    if not getattr(args, "no_intervals", False):
        from waferline.sim.intervals import attach_intervals

        attach_intervals(r, plan, params, prompt_len=P, output_len=O, concurrency=args.concurrency)
    serving = None
    if args.arrival_rate:
        from waferline.sim.serving import simulate_serving

        prefill_plan = None
        if args.prefill_devices is not None:  # the prefill pool: the same model and flags on its own devices
            prefill_plan = _make_plan(argparse.Namespace(**{**vars(args), "devices": args.prefill_devices}),
                                      args.context or (P + O))
        serving = simulate_serving(
            plan,
            arrival_rate=args.arrival_rate,
            num_requests=args.num_requests or 200,
            prompt_len=P,
            output_len=O,
            params=params,
            max_num_batched_tokens=2048 if args.max_num_batched_tokens is None else args.max_num_batched_tokens,
            pd_disaggregation=args.pd_disaggregation,
            prefill_plan=prefill_plan,
            expert_skew=args.expert_skew or 0.0,
        )
    if args.json:
        d = r.to_dict()
        if serving is not None:
            d["serving"] = serving.to_dict()
        d["plan"] = {
            "weight_bits": plan.weight_bits,
            "kv_bits": plan.kv_bits,
            "afd": plan.afd,
            "context_len": plan.context_len,
        }
        print(json.dumps(d, indent=1))
        return 0 if r.fits else 2
    from rich.table import Table

    con = _console()
    t = Table(
        title=f"{r.model} on {r.num_devices} x {r.hardware} ({r.num_stages} stages, {plan.weight_bits}-bit weights)"
    )
    t.add_column("metric")
    t.add_column("value", justify="right")
    from waferline.sim.intervals import fmt

    iv = r.intervals
    t.add_row("decode tokens/s per user", fmt(r.decode_tokens_per_s_per_user, iv.get("decode_tokens_per_s_per_user")))
    t.add_row(
        f"aggregate tokens/s (concurrency {r.concurrency}, {r.micro_batches} micro-batches)",
        fmt(r.aggregate_tokens_per_s, iv.get("aggregate_tokens_per_s")),
    )
    t.add_row("one decode step through all stages (ms)", fmt(r.step_latency_s, iv.get("step_latency_s"), ".3f", 1e3))
    t.add_row(
        f"TTFT, prompt {r.prompt_len:,} (ms)",
        f"{fmt(r.ttft_s, iv.get('ttft_s'), '.1f', 1e3)} (prefill {fmt(r.prefill_s, iv.get('prefill_s'), '.1f', 1e3)}"
        f" + request overhead {(r.ttft_s - r.prefill_s) * 1e3:.1f})",
    )
    t.add_row(f"end-to-end, {r.output_len:,} output tokens (s)", fmt(r.end_to_end_s, iv.get("end_to_end_s"), ".3f"))
    t.add_row("decode is bound by", r.bound)
    sp = r.speculative
    if sp.get("method", "none") != "none":
        t.add_row(f"speculative: {sp['method']} ({sp['drafter']})",
                  f"k={sp['num_tokens']}, accept {fmt(sp['accept_rate'], sp.get('accept_rate_interval'), '.2f')} "
                  f"({sp['accept_rate_source']}), "
                  f"{fmt(sp['expected_tokens_per_step'], sp.get('expected_tokens_per_step_interval'), '.2f')} "
                  f"tok/step, x{fmt(sp['speedup'], sp.get('speedup_interval'), '.2f')}")
    if any(iv.values()):
        t.caption = "(90%: low-high): range over the fit's bootstrap parameter sets (parameter uncertainty only)"
    con.print(t)
    st = Table(title="per-stage decode step (us)")
    for c in ("stage", "role", "layers", "devices", "compute", "memory", "fixed", "collective", "hop", "total"):
        st.add_column(c, justify="right" if c != "role" else "left")
    rows = r.stages
    show = rows if len(rows) <= 16 else rows[:6] + [None] + rows[-6:]  # type: ignore[list-item]
    for s in show:
        if s is None:
            st.add_row("...", "", f"({len(rows) - 12} more)", "", "", "", "", "", "", "")
            continue
        st.add_row(str(s.index), s.role, s.layers, str(s.devices), f"{s.compute * 1e6:.1f}", f"{s.memory * 1e6:.1f}",
                   f"{s.fixed * 1e6:.1f}", f"{s.comm * 1e6:.1f}", f"{s.hop * 1e6:.1f}", f"{s.total * 1e6:.1f}")
    con.print(st)
    if serving is not None:
        how = (f"chunked prefill, {serving.max_num_batched_tokens} tokens a step" if serving.prefill_mode == "chunked"
               else "stop-the-world prefill")
        if serving.pd_disaggregation:
            how += (f"; prefill on its own {serving.prefill_devices} devices, KV handover "
                    f"{serving.kv_handover_s * 1e3:.2f} ms")
        if serving.expert_skew:
            how += f"; expert skew {serving.expert_skew:g}: hottest expert x{serving.expert_load_factor:.2f} load"
        sv = Table(
            title=f"serving {serving.requests} requests at {serving.arrival_rate:g} req/s (continuous batching, at "
                  f"most {serving.max_batch} in flight; {how})"
        )
        sv.add_column("metric")
        sv.add_column("p50", justify="right")
        sv.add_column("p99", justify="right")
        sv.add_row("TTFT (s)", f"{serving.ttft_p50_s:.3f}", f"{serving.ttft_p99_s:.3f}")
        sv.add_row("inter-token latency (ms)", f"{serving.itl_p50_s * 1e3:.2f}", f"{serving.itl_p99_s * 1e3:.2f}")
        sv.add_row("end-to-end (s)", f"{serving.e2e_p50_s:.2f}", f"{serving.e2e_p99_s:.2f}")
        sv.add_row("output tokens/s, mean batch", f"{serving.output_tokens_per_s:,.0f}", f"{serving.mean_batch:.1f}")
        con.print(sv)
    if not r.fits:
        con.print("[red]warning: the plan does not fit:[/red]")
        for p in r.problems:
            con.print(f"  {p}")
        return 2
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Predict every row of a published-results CSV and print error factors, median and max."""
    from waferline.sim.validate import cross_validate, validate

    data = args.data or _default_data()
    cv = getattr(args, "cross_validate", None)
    if cv is not None:
        say = None
        if not args.json:
            con0 = _console()

            def say(g: str, rs: list) -> None:
                con0.print(f"fold {g}: refit without its {len(rs)} row(s)", style="dim")

        results, summary = cross_validate(data, cv, _load_params(args), progress=say)
    else:
        results, summary = validate(data, _load_params(args))
    if args.json:
        print(
            json.dumps(
                {
                    "summary": summary,
                    "rows": [
                        {
                            "id": r.row.id,
                            "model": r.row.model,
                            "hardware": r.row.hardware,
                            "metric": r.row.metric,
                            "published": r.row.value,
                            "predicted": r.predicted,
                            "error_factor": r.error_factor,
                            "devices": r.devices,
                            "skipped": r.skipped,
                            "spec_decoding": r.row.spec_decoding,
                            "system": r.row.system,
                        }
                        | ({"fold": r.detail.get("fold"), "out_of_fold": True} if cv is not None else {})
                        for r in results
                    ],
                },
                indent=1,
            )
        )
        return 0
    from rich.table import Table

    con = _console()
    title = f"validation on {data} (parameters: {summary['params']})"
    if cv is not None:
        title = (f"cross-validation by {cv} on {data}: {summary['folds']} folds, each refit from the priors without "
                 f"its rows; predictions are out-of-fold ({summary['seconds']:.0f} s)")
    t = Table(title=title)
    for c in ("id", "model", "hardware", "chips", "bits", "spec", "metric", "published", "predicted", "error x"):
        t.add_column(c, justify="right" if c in ("chips", "bits", "published", "predicted", "error x") else "left")
    for r in results:
        if r.predicted is None:
            t.add_row(
                r.row.id,
                r.row.model,
                r.row.hardware,
                "",
                str(r.row.weight_bits),
                r.row.spec_decoding,
                r.row.metric,
                f"{r.row.value:g}",
                "skipped",
                r.skipped[:60],
            )
            continue
        e = r.error_factor or 0
        col = "green" if e <= 1.25 else "yellow" if e <= 2 else "red"
        t.add_row(
            r.row.id,
            r.row.model,
            r.row.hardware,
            str(r.devices),
            str(r.row.weight_bits),
            r.row.spec_decoding,
            r.row.metric,
            f"{r.row.value:g}",
            f"{r.predicted:.4g}",
            f"[{col}]{e:.2f}[/{col}]",
        )
    con.print(t)
    if summary["median_error_factor"] is not None:
        con.print(
            f"median error factor {summary['median_error_factor']:.3f}, max {summary['max_error_factor']:.3f}; "
            f"{summary['within_1_25']}/{summary['predicted']} within 1.25x, "
            f"{summary['within_2']}/{summary['predicted']} within 2x"
            + (f"; {summary['skipped']} skipped" if summary["skipped"] else "")
        )
    return 0


def _check_calibrate_flags(args: argparse.Namespace) -> None:
    """calibrate does one of three things (measure this host, combine calibrations, fit published results): refuse
    the flags of one given to another, which would be ignored."""
    from waferline.errors import UsageError

    fitting = args.published is not None
    if args.combine and (fitting or args.measure):
        raise UsageError("--combine merges host calibrations: drop " + ("--published" if fitting else "--measure"))
    if args.measure and fitting:
        raise UsageError("--measure (this host) and --published (fit the published results) are two different jobs: "
                         "give one of them")
    fit_flags = [f for f, v in (("--restarts", args.restarts), ("--iters", args.iters),
                                ("--bootstrap", args.bootstrap)) if v is not None]
    if fit_flags and not fitting:
        raise UsageError(f"{', '.join(fit_flags)} {'tunes' if len(fit_flags) == 1 else 'tune'} the fit of published "
                         "results: add --published")
    host_flags = [f for f, v in (("--quick", args.quick), ("--no-pipeline", args.no_pipeline)) if v]
    if host_flags and (fitting or args.combine):
        raise UsageError(f"{', '.join(host_flags)} {'applies' if len(host_flags) == 1 else 'apply'} to measuring this "
                         "host: drop " + ("--published" if fitting else "--combine") + " or "
                         + ("it" if len(host_flags) == 1 else "them"))


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure this host and write a hardware YAML (default), or with --published re-fit the simulator's fitted
    parameters on a published-results CSV and store them marked fitted."""
    from waferline.sim.cost import FITTED_PATH
    from waferline.sim.fit import BOOTSTRAP_SETS, fit, save_fitted

    _check_calibrate_flags(args)
    if args.combine:
        return _combine_calibrations(args)
    if args.measure or args.published is None:  # measure this host (the default)
        return _calibrate_host(args)
    data = args.published or _default_data()  # --published alone: the shipped published results
    params, report = fit(data, base=_load_params(args), restarts=args.restarts or 0,
                         iters=200 if args.iters is None else args.iters,
                         bootstrap_sets=BOOTSTRAP_SETS if args.bootstrap is None else args.bootstrap)
    out = Path(args.out) if args.out else FITTED_PATH
    save_fitted(params, out, args.published)
    report["written"] = str(out)
    if args.json:
        print(json.dumps(report, indent=1, default=str))
        return 0
    from rich.table import Table

    con = _console()
    t = Table(
        title=f"fitted on {data} ({report['rows']} rows, {report['free_parameters']} parameters, "
              f"{report['seconds']:.1f} s)"
    )
    t.add_column("parameter")
    t.add_column("value", justify="right")
    for k, v in report["params"].items():
        t.add_row(k, f"{v:.4g}")
    con.print(t)
    con.print(f"error factor before: median {report['before']['median']:.3f}, max {report['before']['max']:.3f}; "
              f"after: median {report['after']['median']:.3f}, max {report['after']['max']:.3f}")
    con.print(f"{report['bootstrap_sets']} bootstrap parameter sets stored (fit {report['fit_seconds']:.1f} s, "
              f"total {report['seconds']:.1f} s)")
    con.print(f"written to {out}")
    return 0


def _progress_bar(quiet: bool):
    """A rich progress bar on stderr (a no-op callback and context when ``quiet``)."""
    import contextlib

    if quiet:
        return contextlib.nullcontext(lambda what, frac: None)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    @contextlib.contextmanager
    def bar():
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        ) as prog:
            task = prog.add_task("starting", total=1.0)
            yield lambda what, frac: prog.update(task, completed=frac, description=what)
    return bar()


def _combine_calibrations(args: argparse.Namespace) -> int:
    """`waferline calibrate --combine A.yaml B.yaml ... --out FILE`: the median of several calibrations."""
    from waferline.sim.calibrate.hardware_yaml import write_combined_yaml
    from waferline.sim.host import HostParams

    out = Path(args.out or "hardware-host.yaml")
    write_combined_yaml(out, args.combine)
    host = HostParams.load(out)  # the result loads like any calibration
    summary = {
        "written": str(out),
        "combined": list(args.combine),
        "op_overhead_s": host.op_overhead_s,
        "canary_s": host.canary_s,
        "stage_step_cpu_s": host.stage_step_cpu_s,
        "stage_cpu_inflation": host.stage_cpu_inflation,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        per_op = ", ".join(f"{k} {v * 1e6:.2f} us" for k, v in host.op_overhead_s.items())
        _console().print(f"median of {len(args.combine)} calibrations written to {out} (per-op cost: {per_op})")
    return 0


def _calibrate_host(args: argparse.Namespace) -> int:
    """`waferline calibrate [--quick] [--out FILE]`: measure this host, write its hardware YAML."""
    import time

    from waferline.sim.calibrate.hardware_yaml import write_host_yaml
    from waferline.sim.host import HostParams
    from waferline.spec.hardware import load_hardware_file

    out = Path(args.out or "hardware-host.yaml")
    t0 = time.perf_counter()
    with _progress_bar(args.json) as say:
        d = write_host_yaml(out, quick=args.quick, progress=say, pipeline=False if args.no_pipeline else None)
    hw = load_hardware_file(out)
    host = HostParams.load(out)
    secs = time.perf_counter() - t0
    summary = {
        "written": str(out),
        "seconds": secs,
        "phase_seconds": d["host_engine"]["measured"].get("phase_seconds"),
        "name": d["name"],
        "cores": host.cores,
        "memory_bandwidth_1_thread": host.memory_bandwidth,
        "matmul_flops": hw.flops,
        "linear": {
            k: {"bytes_per_s": v.bytes_per_s, "flops_per_s": v.flops_per_s, "t0_s": v.t0_s}
            for k, v in host.linear.items()
        },
        "op_overhead_s": host.op_overhead_s,
        "step_overhead_s": host.step_overhead_s,
        "link": {
            "latency_s": host.link_latency_s,
            "bytes_per_s": host.link_bytes_per_s,
            "cpu_per_message_s": host.link_cpu_s,
        },
        "pipeline_hop_overhead_s": host.hop_overhead_s,
        "pipeline_hop_latency_s": host.hop_latency_s,
        "cuda": d["host_engine"].get("cuda") is not None,
        "load_average_1m": host.measured.get("load_average_1m"),
        "stage_step_cpu_s": host.stage_step_cpu_s,
        "stage_cpu_inflation": host.stage_cpu_inflation,
        "chain_wall_per_cpu": host.chain_wall_per_cpu,
        "oversubscribed": host.oversubscribed,
        "canary_s": host.canary_s,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    from rich.table import Table

    t = Table(
        title=f"{d['name']}: measured in {secs:.0f} s (load average {summary['load_average_1m']:.2f}; one thread per "
              "process)"
    )
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("cores", str(host.cores))
    t.add_row("copy bandwidth, 1 thread", f"{host.memory_bandwidth / 1e9:.1f} GB/s")
    for k, v in hw.flops.items():
        t.add_row(f"matmul {k}, 1 thread", f"{v / 1e9:.1f} GFLOP/s")
    for k, v in host.linear.items():
        t.add_row(
            f"linear {k}: weights / s, FLOP/s, fixed",
            f"{v.bytes_per_s / 1e9:.1f} GB/s, {v.flops_per_s / 1e9:.1f} GFLOP/s, {v.t0_s * 1e6:.1f} us",
        )
    for k, v in host.op_overhead_s.items():
        t.add_row(f"engine per-op overhead ({k})", f"{v * 1e6:.2f} us/op + {host.step_overhead_s[k] * 1e6:.0f} us/step")
    t.add_row(
        "gloo link (engine Link): latency, bandwidth",
        f"{host.link_latency_s * 1e6:.0f} us, {host.link_bytes_per_s / 1e9:.2f} GB/s",
    )
    t.add_row("gloo CPU per message", f"{host.link_cpu_s * 1e6:.0f} us")
    t.add_row(
        "pipeline hop as the engine sees it",
        "not measured" if host.hop_latency_s is None else f"{host.hop_latency_s * 1e6:.0f} us",
    )
    t.add_row("stage process CPU per step besides compute; compute inflation",
              "not measured" if host.stage_step_cpu_s is None else
              f"{host.stage_step_cpu_s * 1e6:.0f} us; +{host.stage_cpu_inflation * 100:.0f}%")
    ov = host.oversubscribed
    if "mS_step_cpu_s" in ov:
        t.add_row(
            f"the same with {ov.get('stages', 0):.0f} stage processes on {host.cores} cores: 1 / all micro-batches",
            f"{ov['m1_step_cpu_s'] * 1e6:.0f} us, +{ov['m1_cpu_inflation'] * 100:.0f}%; "
            f"{ov['mS_step_cpu_s'] * 1e6:.0f} us, +{ov['mS_cpu_inflation'] * 100:.0f}%",
        )
    t.add_row(f"parallel ceiling ({host.cores} processes at once)",
              "not measured" if host.parallel_ceiling is None else f"{host.parallel_ceiling:.2f} cores")
    t.add_row("canary: a fixed engine workload, wall per token (twin reruns it per Plan)",
              "not measured" if host.canary_s is None else f"{host.canary_s * 1e3:.2f} ms")
    t.add_row(
        "last-level cache (weights that fit run from it)",
        "unknown" if host.llc_bytes is None else f"{host.llc_bytes / 2**20:.0f} MB",
    )
    t.add_row("CUDA", "measured" if summary["cuda"] else "no device")
    con = _console()
    con.print(t)
    con.print(f"written to {out} (use --hardware {out}; `waferline twin --hardware {out}` compares it with the engine)")
    return 0


def cmd_twin(args: argparse.Namespace) -> int:
    """Run the engine on a grid of Plans and predict each with the simulator calibrated to this host."""
    from waferline.sim.twin import render, run_twin

    with _progress_bar(args.json) as say:
        result = run_twin(args.model, args.hardware, args.grid, prompt_len=args.prompt_len, output_len=args.output_len,
                          repeats=args.repeats, passes=args.passes, recalibrate=args.recalibrate, progress=say,
                          timeout_s=args.timeout, canary_runs=not args.no_canary)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        render(result, _console())
        if args.out:
            _console().print(f"written to {args.out}")
    return 0 if result["summary"]["plans_compared"] else 1


def register(subparsers: Any) -> None:
    """Add plan / simulate / validate / calibrate to an argparse subparsers object."""
    p = subparsers.add_parser("plan", help="place a model on hardware and check that it fits")
    _add_plan_args(p)
    p.set_defaults(func=cmd_plan)

    s = subparsers.add_parser("simulate", help="predict tokens/s, TTFT and per-stage latency of a deployment")
    _add_plan_args(s, optional=True)
    s.add_argument("--plan", default=None, help="simulate this plan JSON instead of placing MODEL")
    s.add_argument("--prompt-len", type=int, default=None)
    s.add_argument("--output-len", type=int, default=None)
    s.add_argument("--concurrency", type=int, default=None, help="concurrent requests (default: --batch)")
    s.add_argument("--speculative", default="none", choices=("none", "draft", "mtp", "ngram", "eagle", "medusa"))
    s.add_argument("--accept-rate", type=float, default=None, help="per-token acceptance (default: fitted per method)")
    s.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="draft tokens per step (default per method)"
    )
    s.add_argument("--draft-model", default=None, help="draft model for --speculative draft (default llama-3.2-1b)")
    s.add_argument("--params", default=None, help="simulator parameter YAML (default: the fitted sim/fitted.yaml)")
    s.add_argument("--no-intervals", action="store_true",
                   help="skip the 90%% intervals (one prediction per stored bootstrap parameter set)")
    s.add_argument(
        "--arrival-rate", type=float, default=None, help="also simulate serving Poisson arrivals at this rate (req/s)"
    )
    s.add_argument("--num-requests", type=int, default=None,
                   help="requests in the serving simulation (with --arrival-rate; default 200)")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="serving: tokens one step carries, decode tokens first, prompt chunks in the rest (default "
                        "2048; 0 = stop-the-world prefill, one prompt at a time with decode paused)")
    s.add_argument("--pd-disaggregation", action="store_true",
                   help="serving: prefill on a separate pool (a second copy of the plan, or --prefill-devices), the KV "
                        "cache handed to the decode pool over the scale-out link")
    s.add_argument("--prefill-devices", type=int, default=None,
                   help="serving: devices of a separate prefill pool, the model placed with the same flags (implies "
                        "--pd-disaggregation)")
    s.add_argument("--expert-skew", type=float, default=None,
                   help="serving, MoE: Zipf exponent of expert popularity; the hottest expert's load over the mean "
                        "scales the routed-expert compute (default 0 = uniform routing)")
    s.set_defaults(func=cmd_simulate)

    v = subparsers.add_parser("validate", help="compare predictions with a CSV of published results")
    v.add_argument("--data", default=None, help=f"results CSV (default: {DEFAULT_DATA})")
    v.add_argument("--params", default=None, help="simulator parameter YAML (default: sim/fitted.yaml)")
    v.add_argument("--json", action="store_true")
    v.add_argument("--cross-validate", nargs="?", const="row", default=None, metavar="row|vendor",
                   help="refit every fitted parameter without each row (row) or each system's rows (vendor: the "
                   "CSV's system column) and predict the held-out rows with that refit (row: ~1-2 min)")
    v.set_defaults(func=cmd_validate)

    c = subparsers.add_parser(
        "calibrate",
        help="measure this host and write its hardware YAML (or --published: re-fit the simulator)",
        description="Without --published: measure this machine (~1-2 min) -- copy bandwidth, fp32/bf16/int4 "
        "matmul and GEMV speed, the fused operators' rates, the engine's per-op, per-step and per-product decode "
        "and prefill overheads, the gloo link between two "
        "local processes and the pipeline's per-hop overhead (and CUDA numbers when a GPU is present) -- and "
        "write a hardware YAML with every figure marked measured (date, method). With --published [CSV]: "
        "re-fit the simulator's fitted parameters on published results (default: the ones shipped "
        "with waferline).",
    )
    c.add_argument("--published", nargs="?", const="", default=None, metavar="CSV",
                   help=f"re-fit the simulator's parameters on a results CSV (alone: {DEFAULT_DATA})")
    c.add_argument("--measure", action="store_true", help="measure this host (the default without --published)")
    c.add_argument(
        "--quick", action="store_true", help="smaller, noisier probes and no pipeline probe (~20 s; for tests)"
    )
    c.add_argument(
        "--no-pipeline", action="store_true", help="skip the pipeline per-hop probe (it starts a stage process)"
    )
    c.add_argument(
        "--combine",
        nargs="+",
        default=None,
        metavar="YAML",
        help="measure nothing: write the median of these calibrations of this host (every measured figure and "
        "probe point) to --out; steadier than any one run on a machine whose speed drifts",
    )
    c.add_argument(
        "--out", default=None, help="where to write (default: hardware-host.yaml; with --published: sim/fitted.yaml)"
    )
    c.add_argument("--params", default=None, help="starting parameters (default: sim/fitted.yaml)")
    c.add_argument("--restarts", type=int, default=None,
                   help="with --published: Nelder-Mead polishes after the Levenberg-Marquardt fit (default 0)")
    c.add_argument("--iters", type=int, default=None,
                   help="with --published: most Levenberg-Marquardt iterations (default 200)")
    c.add_argument("--bootstrap", type=int, default=None, metavar="N",
                   help="with --published: refit on N resamples of the rows and store the parameter sets for "
                   "simulate's 90%% intervals (default 32; 0: none)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_calibrate)

    tw = subparsers.add_parser(
        "twin",
        help="run the engine on a grid of Plans and compare with the calibrated simulator",
        description="For every Plan of a grid (default: 16 -- stages 1 / 2 / one layer per stage, "
        "micro-batches, bf16 vs int4, speculation off / ngram / mtp, batch 1 / 8, AFD) run the engine "
        "(a child process per Plan, one thread per process), predict the same Plan with the simulator "
        "on this host's calibrated hardware YAML, and print measured vs predicted decode tokens/s per "
        "user and aggregate and TTFT, each with its error factor exp(|ln(pred/meas)|), then median and "
        "max. The grid is measured in --passes passes (the second in reverse order) and each Plan's "
        "fastest pass counts: this machine's speed moves by up to 1.3-2.4x for seconds to minutes at a time; "
        "the spread between a Plan's passes is printed as the machine's own noise (with one pass, the "
        "first Plan is run once more at the end instead). Plans the engine cannot run yet are listed as "
        "not available.",
    )
    tw.add_argument("--model", required=True, help="checkpoint directory (e.g. models/sol-mini)")
    tw.add_argument(
        "--hardware",
        default=None,
        help="hardware YAML from `waferline calibrate` (default: calibrate this host "
        "now, cached for a day under ~/.cache/waferline)",
    )
    tw.add_argument(
        "--grid",
        default="default",
        help="'default' or a YAML list of points, e.g. "
        "'- {stages: 2, micro_batches: 2, batch: 8, weight_bits: 4}' (fields: stages (int or L), micro_batches, "
        "weight_bits 16|4, speculative none|ngram|mtp, k, batch, afd, attention_ranks, ffn_ranks)",
    )
    tw.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence (default 32)")
    tw.add_argument("--output-len", type=int, default=32, help="new tokens per sequence (default 32)")
    tw.add_argument("--repeats", type=int, default=2, help="timed runs per Plan; the fastest counts (default 2)")
    tw.add_argument("--passes", type=int, default=2, help="measure the whole grid this many times and keep each Plan's "
                    "fastest pass (default 2; 1 halves the time)")
    tw.add_argument(
        "--recalibrate", action="store_true", help="re-measure this host even if a cached calibration exists"
    )
    tw.add_argument("--timeout", type=float, default=300.0, help="seconds per Plan before its engine run is killed")
    tw.add_argument(
        "--no-canary",
        action="store_true",
        help="do not run the canary (a fixed engine workload, ~0.2 s) "
        "before each Plan; by default, with a calibration that recorded it, each Plan is also compared at the "
        "machine's speed of its runs ('machine x')",
    )
    tw.add_argument(
        "--out", default=None, help="also write the JSON result here (e.g. benchmarks/results/twin_sol-mini.json)"
    )
    tw.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    tw.set_defaults(func=cmd_twin)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m waferline.plan.commands", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    register(sub)
    args = ap.parse_args(argv)
    try:
        return int(args.func(args))
    except WaferlineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
