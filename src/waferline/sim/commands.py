"""CLI subcommands that measure: calibrate (this host, or the fit on published results) and twin (the engine's runs
against the calibrated simulator). register() adds them to argparse."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from waferline.argtypes import int_range, nonnegative_int, out_path, positive_int, timeout_seconds
from waferline.files import check_writable
from waferline.plan.commands import DEFAULT_DATA, _console, _default_data, _esc, _load_params

MAX_BOOTSTRAP = 1_000  # bootstrap sets calibrate --published refits (each a whole fit; 32 by default)


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
    fit_flags = [f for f, v in (("--params", args.params), ("--restarts", args.restarts), ("--iters", args.iters),
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
    check_writable(args.out or FITTED_PATH)  # (before the fit's minute, not after it)
    with _progress_bar(args.json) as say:
        params, report = fit(data, base=_load_params(args), restarts=args.restarts or 0,
                             iters=200 if args.iters is None else args.iters,
                             bootstrap_sets=BOOTSTRAP_SETS if args.bootstrap is None else args.bootstrap,
                             progress=say)
        say("done", 1.0)
    out = Path(args.out) if args.out else FITTED_PATH
    save_fitted(params, out, args.published)
    report["written"] = str(out)
    if args.json:
        print(json.dumps(report, indent=1, default=str))
        return 0
    from rich.table import Table

    con = _console()
    t = Table(
        title=f"fitted on {_esc(data)} ({report['rows']} rows, {report['free_parameters']} parameters, "
              f"{report['seconds']:.1f} s)"
    )
    t.add_column("parameter")
    t.add_column("value", justify="right")
    for k, v in report["params"].items():
        t.add_row(_esc(k), f"{v:.4g}")  # (a class may be named after a device of the user's)
    con.print(t)
    if report["at_bound"]:
        con.print("at an end of its physical range (the rows want it further: a catalog number or a mechanism they do "
                  "not state may be off): " + ", ".join(f"{_esc(k)} = {b:g} ({end} bound)"
                                                       for k, (b, end) in report["at_bound"].items()))
    for rid, why in report["skipped"]:  # (each reason whole: the fit leaves these rows out)
        con.print(f"left out of the fit: {_esc(rid)}: {_esc(why)}")
    con.print(f"error factor before: median {report['before']['median']:.3f}, max {report['before']['max']:.3f}; "
              f"after: median {report['after']['median']:.3f}, max {report['after']['max']:.3f}")
    con.print(f"{report['bootstrap_sets']} bootstrap parameter sets stored (fit {report['fit_seconds']:.1f} s, "
              f"total {report['seconds']:.1f} s)")
    con.print(f"written to {_esc(out)}")
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
        # (a description may name a grid point of the user's: shown as it is, not as markup)
        prog = Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                        TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
                        console=Console(stderr=True, emoji=False), transient=False)
        task = None

        def say(what: str, frac: float) -> None:
            nonlocal task
            if task is None:  # (drawn at the first report: an error found before any work shows no empty bar)
                prog.start()
                task = prog.add_task(what, total=1.0)
            prog.update(task, completed=frac, description=what)

        try:
            yield say
        finally:
            if task is not None:
                prog.stop()
    return bar()


def _combine_calibrations(args: argparse.Namespace) -> int:
    """`waferline calibrate --combine A.yaml B.yaml ... --out FILE`: the median of several calibrations."""
    from waferline.sim.calibrate.hardware_yaml import write_combined_yaml
    from waferline.sim.host import HostParams

    out = check_writable(args.out or "hardware-host.yaml", file_only=True)  # (read back below)
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
        _console().print(f"median of {len(args.combine)} calibrations written to {_esc(out)} (per-op cost: {per_op})")
    return 0


def _calibrate_host(args: argparse.Namespace) -> int:
    """`waferline calibrate [--quick] [--out FILE]`: measure this host, write its hardware YAML."""
    import time

    from waferline.sim.calibrate.hardware_yaml import write_host_yaml
    from waferline.sim.host import HostParams
    from waferline.spec.hardware import load_hardware_file

    out = check_writable(args.out or "hardware-host.yaml", file_only=True)  # before the ~2-3 min of probes
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
        title=f"{_esc(d['name'])}: measured in {secs:.0f} s (load average {summary['load_average_1m']:.2f}; one thread "
              "per process)"
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
    con.print(f"written to {_esc(out)} (use --hardware {_esc(out)}; `waferline twin --hardware {_esc(out)}` compares "
              "it with the engine)")
    return 0


def cmd_twin(args: argparse.Namespace) -> int:
    """Run the engine on a grid of Plans and predict each with the simulator calibrated to this host."""
    from waferline.errors import ConfigError
    from waferline.files import write_text_atomic
    from waferline.sim.twin import render, run_twin

    if args.recalibrate and args.hardware:  # (a given calibration is used as it is: nothing would be re-measured)
        from waferline.errors import UsageError

        raise UsageError("--recalibrate re-measures this host for a twin without --hardware; drop one of them")
    if args.out:  # before the grid's tens of minutes, not after them
        check_writable(args.out)
    with _progress_bar(args.json) as say:
        result = run_twin(args.model, args.hardware, args.grid, prompt_len=args.prompt_len, output_len=args.output_len,
                          repeats=args.repeats, passes=args.passes, recalibrate=args.recalibrate, progress=say,
                          timeout_s=args.timeout, canary_runs=not args.no_canary)
    text = json.dumps(result, indent=1)
    if args.json:
        print(text)
    else:
        render(result, _console())
    if args.out:  # (the result is on the screen first: a write that fails now loses nothing)
        try:
            write_text_atomic(args.out, text, make_parents=True)
        except OSError as e:
            raise ConfigError(f"--out {args.out}: cannot write the result ({e.strerror or e})") from None
        if not args.json:
            _console().print(f"written to {_esc(args.out)}")
    return 0 if result["summary"]["plans_compared"] else 1


def register(subparsers: Any) -> None:
    """Add calibrate and twin to an argparse subparsers object."""
    c = subparsers.add_parser(
        "calibrate",
        help="measure this host and write its hardware YAML (or --published: re-fit the simulator)",
        description="Without --published: measure this machine (~2-3 min) -- copy bandwidth, fp32/bf16/int4 "
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
        "--out", type=out_path, default=None,
        help="where to write (default: hardware-host.yaml; with --published: sim/fitted.yaml)"
    )
    c.add_argument("--params", default=None,
                   help="with --published: the settings the fit keeps (draft lengths and models, default prompt and "
                   "output lengths; default: sim/fitted.yaml); every fitted parameter starts from its prior, never "
                   "from this file's value")
    c.add_argument("--restarts", type=nonnegative_int, default=None,
                   help="with --published: Nelder-Mead polishes after the Levenberg-Marquardt fit (default 0)")
    c.add_argument("--iters", type=positive_int, default=None,
                   help="with --published: most Levenberg-Marquardt iterations (default 200)")
    c.add_argument("--bootstrap", type=int_range(0, MAX_BOOTSTRAP, " (a set is a whole refit)"), default=None,
                   metavar="N",
                   help="with --published: refit on N resamples of the rows and store the parameter sets for "
                   "simulate's 90%% intervals (default 32; 0: none)")
    c.add_argument("--json", action="store_true", help="print the result as JSON (the fit, or the measured host)")
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
        help="'default' or a YAML file with a list of points, e.g. a line "
        "'- {stages: 2, micro_batches: 2, batch: 8, weight_bits: 4}' (fields: stages (int or L), micro_batches, "
        "weight_bits 16|4, speculative none|ngram|mtp, k, batch, afd, attention_ranks, ffn_ranks)",
    )
    tw.add_argument("--prompt-len", type=positive_int, default=32, help="prompt tokens per sequence (default 32)")
    tw.add_argument("--output-len", type=positive_int, default=32, help="new tokens per sequence (default 32)")
    tw.add_argument("--repeats", type=positive_int, default=2,
                    help="timed runs per Plan; the fastest counts (default 2)")
    tw.add_argument("--passes", type=positive_int, default=2,
                    help="measure the whole grid this many times and keep each Plan's fastest pass (default 2; 1 "
                         "halves the time)")
    tw.add_argument(
        "--recalibrate", action="store_true", help="re-measure this host even if a cached calibration exists"
    )
    tw.add_argument("--timeout", type=timeout_seconds, default=300.0,
                    help="seconds per Plan before its engine run is killed (default 300; at most a week)")
    tw.add_argument(
        "--no-canary",
        action="store_true",
        help="do not run the canary (a fixed engine workload, ~0.2 s) "
        "before each Plan; by default, with a calibration that recorded it, each Plan is also compared at the "
        "machine's speed of its runs ('machine x')",
    )
    tw.add_argument(
        "--out", type=out_path, default=None,
        help="also write the JSON result here (e.g. benchmarks/results/twin_sol-mini.json)"
    )
    tw.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    tw.set_defaults(func=cmd_twin)
