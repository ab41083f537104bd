"""CLI subcommands of the planner/simulator: plan, simulate, validate (register() adds them to argparse; calibrate
and twin are in sim/commands.py)."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Any

from waferline.argtypes import int_range, nonnegative_int, out_path, positive_float, positive_int
from waferline.errors import ConfigError, WaferlineError
from waferline.plan.plan import MAX_DEVICES, MAX_DRAFT_TOKENS

# the published results shipped in the package (sim.validate.PUBLISHED_PATH), as --help names them
DEFAULT_DATA = "sim/data/published_results.csv, shipped with waferline"
MAX_SERVING_REQUESTS = 10_000_000  # (the serving simulation runs ~4 s per million requests)
device_count = int_range(1, MAX_DEVICES)  # (--devices, --prefill-devices, and the AFD ranks: a device each at least)


def _default_data() -> str:
    """The published-results CSV shipped in the package: found wherever waferline is installed or run from."""
    from waferline.sim.validate import PUBLISHED_PATH

    return str(PUBLISHED_PATH)


def _console():
    from rich.console import Console

    # (no :name: emoji codes: a path, an id or a name prints as it is)
    return Console(emoji=False) if sys.stdout.isatty() else Console(width=160, emoji=False)


def _esc(text: Any) -> str:
    """``text`` as rich prints it verbatim: a name, path, id or message of the user's, or from their files, where it
    meets markup (its brackets are not tags)."""
    from rich.markup import escape

    return escape(str(text))


def _hw_label(ref: str) -> str:
    """A hardware reference as a title shows it: a catalog id as it is, a YAML file (whatever its name ends with) by
    the name it gives."""
    from pathlib import Path

    from waferline.spec.catalog import HARDWARE_DIR, load_hardware

    hw = load_hardware(ref)
    if Path(hw.path) == HARDWARE_DIR / f"{ref}.yaml":  # (a catalog id)
        return _esc(ref)
    return _esc(f"{hw.name} ({Path(ref).name})")


def _same_numbers(a: Any, b: Any) -> bool:
    """Whether two models (ModelSpec) or two devices (HardwareSpec) of one name describe the same thing, whatever
    file or id each was read from."""
    import dataclasses

    from waferline.spec.hardware import HardwareSpec

    if isinstance(a, HardwareSpec):
        return dataclasses.replace(a, path="", description="") == dataclasses.replace(b, path="", description="")
    return all(getattr(a, k) == getattr(b, k) for k in ("vocab_size", "hidden_size", "layers", "mtp_layers",
                                                         "tie_word_embeddings", "max_position_embeddings"))


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def _add_plan_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("model", nargs="?" if optional else None,
                   help="catalog model id (e.g. gpt-5.6-sol, deepseek-v3), a config.json path, or a checkpoint dir")
    p.add_argument("--hardware", "-H", required=not optional,
                   help="catalog hardware id (e.g. wse-3, h200-sxm, gb200-nvl72) or a YAML file")
    p.add_argument("--devices", type=device_count, default=None,
                   help="number of devices (default: the fewest that fit, in tensor-parallel groups of a power of two "
                        "on GPUs; a count the layout cannot use whole, or a group that would not split the attention "
                        "heads evenly, is rounded down, and the plan says so)")
    p.add_argument("--weight-bits", type=int, default=None, choices=(16, 8, 4), help="stored weights (default 16)")
    p.add_argument("--kv-bits", type=int, default=None, choices=(16, 8, 4), help="KV cache (default 16)")
    p.add_argument(
        "--context",
        type=positive_int,
        default=None,
        help="context length per sequence for memory sizing (default 4096; simulate: prompt+output)",
    )
    p.add_argument("--batch", type=positive_int, default=None,
                   help="sequences resident at once (memory sizing; default 1)")
    p.add_argument("--layers-per-stage", type=positive_int, default=None,
                   help="K layers per stage (default: as many as fit)")
    p.add_argument(
        "--afd", action="store_true", help="attention/FFN disaggregation: separate attention and FFN device pools"
    )
    p.add_argument(
        "--attention-ranks",
        type=device_count,
        default=None,
        metavar="M",
        help="with --afd: M attention ranks, each holding every layer's mixer for its share of the sequences "
        "(the layout the engine's `generate --afd` runs)",
    )
    p.add_argument("--ffn-ranks", type=device_count, default=None, metavar="N",
                   help="with --afd: N FFN ranks, each holding a shard of every layer's experts")
    p.add_argument(
        "--micro-batches", type=positive_int, default=None,
        help="decode micro-batches in flight (default min(batch, stages); with --attention-ranks/--ffn-ranks: 2, as "
             "the AFD engine runs them; decode fills at most batch of them); the TTFT streams a prompt's chunks "
             "through the stages back to back whatever this is, as a pipeline of devices streams a prompt"
    )
    p.add_argument("--out", type=out_path, default=None, help="write the plan as JSON to this file")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def accept_rate_arg(text: str) -> tuple[float, float]:
    """``--accept-rate``: one rate (``0.8``) or a range (``0.6:0.9``), each in [0, 1); returns (low, high)."""
    try:
        lo = hi = float(text)  # (one rate, an exponent's '-' included: 5e-1)
    except ValueError:
        parts = re.split(r":|(?<=[0-9.])-", text)  # (a '-' right after a digit separates: 0.6-0.9, 5e-1-9e-1)
        try:
            lo, hi = (float(parts[0]), float(parts[-1])) if len(parts) == 2 else (math.nan, math.nan)
        except ValueError:
            lo = hi = math.nan
    if not (0.0 <= lo <= hi < 1.0):
        raise argparse.ArgumentTypeError(f"expected a rate in [0, 1) or a range LOW:HIGH within it, got {text!r}")
    return lo, hi


def _accept(args: argparse.Namespace) -> float | None:
    """The point acceptance of ``--accept-rate`` (a range's midpoint)."""
    r = getattr(args, "accept_rate", None)
    return None if r is None else (r[0] + r[1]) / 2 if isinstance(r, tuple) else float(r)


def _spec_cfg(args: argparse.Namespace):
    from waferline.plan.plan import SpeculativeConfig

    method = getattr(args, "speculative", "none") or "none"
    return SpeculativeConfig(
        method=method,
        num_tokens=getattr(args, "num_speculative_tokens", None) or 0,
        accept_rate=_accept(args),
        draft_model=getattr(args, "draft_model", None),
    )


MIN_ARRIVAL_RATE = 1e-6  # requests/s


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
    if rate is not None and rate < MIN_ARRIVAL_RATE:  # (the clock, in seconds, would lose a step's milliseconds)
        raise UsageError(f"--arrival-rate {rate:g} is below {MIN_ARRIVAL_RATE:g} requests/s (one request in ~12 days), "
                         "where the simulation's clock cannot resolve a step")
    closed = getattr(args, "closed_loop", False)
    if closed and rate is not None:
        raise UsageError("--closed-loop sends each client's next request when its last ends: drop --arrival-rate")
    if closed and (getattr(args, "pd_disaggregation", False) or getattr(args, "prefill_devices", None) is not None):
        raise UsageError("--closed-loop serves colocated prefill only: drop --pd-disaggregation / --prefill-devices")
    serves = bool(rate) or closed
    if getattr(args, "num_requests", None) is not None and not serves:
        raise UsageError("--num-requests sizes the serving simulation: give --arrival-rate or --closed-loop too")
    serving_flags = [f for f, v in (("--max-num-batched-tokens", getattr(args, "max_num_batched_tokens", None)),
                                    ("--pd-disaggregation", getattr(args, "pd_disaggregation", None) or None),
                                    ("--prefill-devices", getattr(args, "prefill_devices", None)),
                                    ("--expert-skew", getattr(args, "expert_skew", None))) if v is not None]
    if serving_flags and not serves:
        raise UsageError(f"{' and '.join(serving_flags)} shape{'' if len(serving_flags) > 1 else 's'} the serving "
                         "simulation: give --arrival-rate or --closed-loop too")
    target = getattr(args, "target_tokens_per_s", None)
    if target is not None and not getattr(args, "explain", False):
        raise UsageError("--target-tokens-per-s is what --explain works towards: give --explain too")
    if target is not None and not (target > 0 and math.isfinite(target)):
        raise UsageError(f"--target-tokens-per-s must be > 0, got {target}")
    if getattr(args, "prefill_devices", None) is not None and args.prefill_devices < 1:
        raise UsageError(f"--prefill-devices must be >= 1, got {args.prefill_devices}")
    if getattr(args, "prefill_devices", None) is not None and getattr(args, "plan", None):
        raise UsageError("--prefill-devices places the prefill pool anew: give MODEL --hardware, not --plan "
                         "(--pd-disaggregation alone uses a second copy of the plan)")
    if getattr(args, "prefill_devices", None) is not None and given:
        raise UsageError(f"--prefill-devices places the prefill pool on that many devices; {' and '.join(given)} "
                         f"{'size' if len(given) > 1 else 'sizes'} each rank to fit instead: drop one of them "
                         "(--pd-disaggregation alone uses a second copy of the plan)")


def _make_plan(args: argparse.Namespace, context: int):
    from waferline.plan.place import place

    _check_flags(args)
    if not args.model or not args.hardware:
        raise ConfigError("give MODEL and --hardware (or --plan PLAN.json for simulate)")
    batch = max(args.batch or 1, getattr(args, "concurrency", None) or 1)  # memory for every concurrent sequence
    sp, wb, kb, params = _spec_cfg(args), args.weight_bits or 16, args.kv_bits or 16, _load_params(args)
    return place(args.model, args.hardware, devices=args.devices, weight_bits=wb, kv_bits=kb,
                 context=context, batch=batch, layers_per_stage=args.layers_per_stage, afd=args.afd,
                 micro_batches=args.micro_batches, speculative=sp, attention_ranks=args.attention_ranks,
                 ffn_ranks=args.ffn_ranks, drafter=_drafter(args.model, sp, params, wb, kb, 16, 128, context, batch),
                 spec_tokens=params.draft_tokens(sp))


def _drafter(model: Any, sp: Any, params: Any, weight_bits: int, kv_bits: int, embed_bits: int, group_size: int,
             context: int, batch: int) -> tuple[float, str]:
    """What the drafter of ``sp`` adds beside the LM head (sim.pipeline.drafter_memory) for ``model``."""
    from waferline.sim.pipeline import drafter_memory
    from waferline.spec.catalog import load_model

    return drafter_memory(load_model(model), sp, params, weight_bits=weight_bits, kv_bits=kv_bits,
                          embed_bits=embed_bits, group_size=group_size, context=context, batch=batch)


def cmd_plan(args: argparse.Namespace) -> int:
    """Place a model on hardware; print per-stage memory; exit 2 if it does not fit."""
    from waferline.plan.place import BATCH_SEARCH_LIMIT, CONTEXT_SEARCH_LIMIT, batch_capacity, context_capacity
    from waferline.spec.catalog import load_model

    if args.out:  # (before placing: a path that cannot be written is named as such, not by the OS's errno)
        from waferline.files import check_writable

        check_writable(args.out)
    plan = _make_plan(args, args.context or 4096)
    if args.out:
        plan.save(args.out)
    from waferline.sim.pipeline import plan_drafter

    spec = load_model(args.model)
    params = _load_params(args)
    drafter = plan_drafter(plan, params)  # (its cache grows with the context and batch searched)
    k = params.draft_tokens(plan.speculative)
    max_ctx = context_capacity(plan, spec, drafter, k) if plan.fits else 0
    max_batch = batch_capacity(plan, spec, plan.context_len, drafter, k) if plan.fits else 0
    if args.json:
        d = plan.to_dict()
        d["max_context_per_sequence"] = max_ctx
        d["max_sequences_at_context"] = max_batch
        limits = (("max_context_per_sequence", max_ctx, CONTEXT_SEARCH_LIMIT),
                  ("max_sequences_at_context", max_batch, BATCH_SEARCH_LIMIT))
        d["capacity_at_search_limit"] = [k for k, v, cap in limits if v >= cap]  # (at least that: the search's end)
        d["max_position_embeddings"] = spec.max_position_embeddings
        print(json.dumps(d, indent=1))
        return 0 if plan.fits else 2
    from rich.table import Table

    con = _console()
    t = Table(
        title=f"{_esc(plan.model)} on {_hw_label(plan.hardware)}: {plan.num_devices} device(s), {plan.num_stages} "
        f"stage(s), {plan.weight_bits}-bit weights, {plan.kv_bits}-bit KV, context {plan.context_len:,}, batch "
        f"{plan.batch}"
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
        con.print(f"note: {_esc(n)}")
    if plan.fits:
        def at_least(v: int, cap: int) -> str:
            return f"at least {v:,} (the search limit)" if v >= cap else f"{v:,}"

        con.print(f"fits. Longest context per sequence at batch {plan.batch}: "
                  f"{at_least(max_ctx, CONTEXT_SEARCH_LIMIT)} tokens; sequences of {plan.context_len:,} tokens that "
                  f"fit: {at_least(max_batch, BATCH_SEARCH_LIMIT)}")
        if max_ctx > spec.max_position_embeddings:
            con.print(f"note: that is what the memory holds; the model itself takes at most "
                      f"{spec.max_position_embeddings:,} positions (max_position_embeddings)")
    else:
        con.print("[red]does not fit:[/red]")
        for p in plan.problems:
            con.print(f"  {_esc(p)}")
    if args.out:
        con.print(f"plan written to {_esc(args.out)}")
    return 0 if plan.fits else 2


def _fitted_links(plan: Any, params: Any) -> list[str]:
    """Where a hardware file of the user's states a wafer-to-wafer link latency that the device class's fitted hop
    latency replaces (sim/cost.py hop_time: the fit prices a whole hop, link and the stages' hand-off together)."""
    from pathlib import Path

    from waferline.spec.catalog import load_hardware
    from waferline.spec.hardware import catalog_dir

    path = Path(str(plan.hardware))
    if plan.num_stages <= 1 or not path.is_file() or catalog_dir() in path.resolve().parents:
        return []
    hw = load_hardware(path)
    prm = params.for_hardware(hw)
    lat, link = prm.hop_latency_s, hw.scale_out
    within = hw.scale_up is not None and plan.num_devices <= hw.devices_per_node  # (every hop on scale_up: its own)
    if lat is None or link is None or within or link.latency == lat:
        return []
    how = ("fitted on the published " + hw.kind + " rows" if prm.status.get("hop_latency_s", "").startswith("fitted")
           else "assumed")
    return [f"a hop between nodes takes the {hw.kind} class's {lat * 1e6:.3g} us ({how}), not {path.name}'s "
            f"scale_out latency of {link.latency * 1e6:.3g} us (--params sets classes.{hw.kind}.hop_latency_s)"]


def _class_notes(plan: Any, params: Any) -> list[str]:
    """Where the hardware has no rows of its own in the fit: a kind without data (tpu, asic) takes the gpu class's
    values, and a user's file takes its kind's values, fitted on other hardware. The 90% ranges are those parameters'
    uncertainty, not how far they carry over to this device."""
    from pathlib import Path

    from waferline.spec.catalog import load_hardware
    from waferline.spec.hardware import catalog_dir

    hw = load_hardware(plan.hardware)
    cname = next((c for c in (hw.name, hw.kind, "gpu") if c in params.classes), None)
    if cname is None:
        return []
    borrowed = any(s.startswith("assumed: as gpu") for s in params.classes[cname].status.values())
    if params.bootstrap and not borrowed and not any(n.startswith(f"{cname}.") for b in params.bootstrap for n in b):
        # (no parameter set moves this class's parameters: a range of zero width would read as certainty)
        return [f"{hw.name} is simulated with the {cname} class's assumed parameters (no published rows fit them): "
                "the 90% ranges hold none of their uncertainty (a figure that rests on them alone shows no range)"]
    path = Path(str(plan.hardware))
    user = path.is_file() and catalog_dir() not in path.resolve().parents
    if not (borrowed or (user and any(s.startswith("fitted") for s in params.classes[cname].status.values()))):
        return []
    whose = ("the gpu class's fitted parameters (no published rows for " + hw.kind + " devices)" if borrowed
             else f"the {cname} class's parameters, fitted on the published rows of other hardware")
    return [f"{hw.name} is extrapolated: simulated with {whose}; the 90% ranges are their uncertainty only: expect "
            "errors of ~1.5x, 2-3x at worst, on hardware with no rows (docs/planner.md, Validation)"]


def _rollback_note(plan: Any, params: Any) -> list[str]:
    """What speculation keeps on the plan's recurrent-state layers for its rollback (counted in its memory)."""
    most = max((s.memory.rollback for s in plan.stages), default=0.0)
    if not most:
        return []
    k = params.draft_tokens(plan.speculative)
    return [f"speculation keeps the state after each of a verify's {k + 1} tokens on the recurrent-state layers for "
            f"its rollback: {_gb(most)} GB per device on the stage that keeps most, counted in its memory"]


def _params_notes(path: str | None, params: Any, plan: Any, intervals: bool, ranged: bool = False) -> list[str]:
    """What a ``--params`` file leaves out that the shipped fit has, for this plan's hardware: a class it has no
    parameters for, fitted parameters it leaves at their priors, class names nothing matches, the parameter sets the
    intervals come from (``ranged``: an acceptance range gives intervals without them)."""
    if not path:
        return []
    from pathlib import Path

    from waferline.sim.cost import load_params
    from waferline.spec.catalog import load_hardware
    from waferline.spec.hardware import DEVICE_KINDS

    name, hw, shipped = Path(path).name, load_hardware(plan.hardware), load_params(None)

    def resolved(p: Any) -> str | None:  # (SimParams.for_hardware's order)
        return next((c for c in (hw.name, hw.kind, "gpu") if c in p.classes), None)

    out, mine, theirs = [], resolved(params), resolved(shipped)
    if mine != theirs:
        out.append(f"{name} has no parameters for {hw.kind} devices: {hw.name} is simulated with "
                   + (f"the {mine} class's parameters" if mine else "the priors"))
    fitted = {f"{theirs}.{k}" for k, st in (shipped.classes[theirs].status if theirs else {}).items()
              if st.startswith("fitted")}
    if shipped.status.get("ttft_overhead_s", "").startswith("fitted"):
        fitted.add("ttft_overhead_s")
    given = {f"{mine}.{k}" for k in (params.classes[mine].status if mine else {})} | \
        {k for k in params.status if k == "ttft_overhead_s"}
    left = sorted(f for f in fitted if f.replace(f"{theirs}.", f"{mine}.", 1) not in given)
    if left:
        out.append(f"{name} leaves {len(left)} of the shipped fit's fitted parameters for this hardware at their "
                   f"priors: {', '.join(left)}")
    unused = [c for c in params.classes if c not in DEVICE_KINDS and c != hw.name]
    if unused:
        out.append(f"{name}: class(es) {', '.join(unused)} name no device kind ({', '.join(DEVICE_KINDS)}) and not "
                   "this hardware: not used")
    if intervals and not params.parameter_sets():
        out.append(("intervals from the acceptance range alone" if ranged else "no intervals")
                   + f": {name} holds no bootstrap parameter sets (`waferline calibrate --published --out FILE` "
                   "writes them)")
    return out


def _load_params(args: argparse.Namespace):
    from waferline.sim.cost import load_params

    return load_params(getattr(args, "params", None))


def cmd_simulate(args: argparse.Namespace) -> int:
    """Plan (or read --plan) and predict tokens/s, TTFT and a per-stage breakdown."""
    from waferline.errors import UsageError
    from waferline.plan.place import DRAFTER_NOTE_END, drafter_note, restage_memory
    from waferline.plan.plan import Plan
    from waferline.sim.pipeline import simulate
    from waferline.spec.catalog import load_hardware, load_model

    _check_flags(args)
    if args.out:  # (before the work; the plan is written once every prediction below is made)
        from waferline.files import check_writable

        check_writable(args.out)
    restaged: list[str] = []
    params = _load_params(args)
    P = args.prompt_len or params.default_prompt_len
    O = args.output_len or params.default_output_len
    R = args.reasoning_tokens or 0
    held = P + R + O  # what a sequence's cache holds at its end
    what = "prompt + reasoning + output" if R else "prompt + output"
    if args.plan:
        placing = [f for f, v in (("--devices", args.devices),
                                  ("--weight-bits", args.weight_bits), ("--kv-bits", args.kv_bits),
                                  ("--context", args.context), ("--batch", args.batch),
                                  ("--layers-per-stage", args.layers_per_stage), ("--afd", args.afd or None),
                                  ("--attention-ranks", args.attention_ranks), ("--ffn-ranks", args.ffn_ranks),
                                  ("--micro-batches", args.micro_batches)) if v is not None]
        if placing:
            raise UsageError(f"--plan simulates the plan as placed: drop {', '.join(placing)} (or drop --plan and "
                             "place MODEL anew)")
        plan = Plan.load(args.plan)
        spec, hw = load_model(plan.model), load_hardware(plan.hardware)
        for given, placed, flag, ref, placed_ref in (
                (args.model and load_model(args.model), spec, "MODEL", args.model, plan.model),
                (args.hardware and load_hardware(args.hardware), hw, "--hardware", args.hardware, plan.hardware)):
            if given and given.name != placed.name:  # (by what the files name, however their paths are spelled)
                raise UsageError(f"the plan places {spec.name} on {hw.name}; {flag} {given.name} says otherwise "
                                 "(drop it, or drop --plan and place MODEL anew)")
            if given and not _same_numbers(given, placed):  # (one name, two files: the plan's would be simulated)
                raise UsageError(f"the plan places {spec.name} on {hw.name} as {placed_ref} describes it; {flag} {ref} "
                                 f"describes another {given.name} (drop it, or drop --plan and place MODEL anew)")
        if args.speculative is not None:  # (given: it replaces the plan's, `none` included)
            plan.speculative = _spec_cfg(args)
        plan.check(spec, hw)  # (layers, hardware) before the memory of its stages is recomputed from them
        drafter = _drafter(plan.model, plan.speculative, params, plan.weight_bits, plan.kv_bits, plan.embed_bits,
                           plan.group_size, plan.context_len, plan.batch)
        restaged = restage_memory(plan, spec, drafter[0], params.draft_tokens(plan.speculative))
        if args.speculative is not None:  # (the plan's note on its own drafter: this one's instead)
            plan.notes = [n for n in plan.notes if not n.endswith(DRAFTER_NOTE_END)]
            plan.notes += [drafter_note(*drafter)] if drafter[0] > 0 else []
        plan.check(spec, hw)  # (a stage over its capacity now: fits false, with the reason)
        if held > plan.context_len or (args.concurrency or plan.batch) > plan.batch:
            raise ConfigError(f"the plan holds {plan.batch} sequence(s) of {plan.context_len:,} tokens; this workload "
                              f"is {args.concurrency or plan.batch} of {held:,} ({what}): place it anew "
                              "(MODEL --hardware ... --concurrency / --prompt-len) or with a larger --context/--batch")
    else:
        if args.context is not None and args.context < held:
            raise UsageError(f"--context {args.context:,} is shorter than {what} ({held:,}): the memory "
                             "would be sized for less than the workload holds (leave --context out to size it so)")
        plan = _make_plan(args, args.context or held)
    r = simulate(plan, prompt_len=P, output_len=O, concurrency=args.concurrency, params=params, reasoning_tokens=R)
    if not getattr(args, "no_intervals", False):
        from waferline.sim.intervals import attach_intervals

        rng = args.accept_rate if isinstance(args.accept_rate, tuple) and args.accept_rate[0] < args.accept_rate[1] \
            else None
        attach_intervals(r, plan, params, accept_range=rng, prompt_len=P, output_len=O, concurrency=args.concurrency,
                         reasoning_tokens=R)
    ex = None
    if args.explain:
        from waferline.sim.explain import explain

        mtp_step = None
        if args.target_tokens_per_s and plan.speculative.method == "none":  # (what speculation's lever is sized by)
            from dataclasses import replace

            from waferline.plan.plan import SpeculativeConfig

            m = simulate(replace(plan, speculative=SpeculativeConfig("mtp", 3)), prompt_len=P, output_len=O,
                         concurrency=args.concurrency, params=params, reasoning_tokens=R)
            mtp_step = m.speculative["expected_tokens_per_step"] / m.decode_tokens_per_s_per_user
        def rate_with(term: str, f: float) -> float:
            return simulate(plan, prompt_len=P, output_len=O, concurrency=args.concurrency,
                            params=params.sped_up(term, f), reasoning_tokens=R).decode_tokens_per_s_per_user

        ex = explain(r, args.target_tokens_per_s, mtp_step, rate_with)
    serving = serving_note = None
    if args.arrival_rate or args.closed_loop:
        from waferline.sim.serving import simulate_serving

        prefill_plan = None
        if args.prefill_devices is not None:  # the prefill pool: the same model and flags on its own devices
            try:
                prefill_plan = _make_plan(argparse.Namespace(**{**vars(args), "devices": args.prefill_devices}),
                                          args.context or held)
            except ConfigError as e:  # (placement names --devices: here it is the pool's --prefill-devices)
                raise ConfigError(f"the prefill pool (--prefill-devices {args.prefill_devices}): "
                                  + re.sub(r"--devices\b", "--prefill-devices", str(e))) from None
        def serve(pl: Any, prm: Any, check_capacity: bool = False) -> Any:
            return simulate_serving(
                pl,
                arrival_rate=args.arrival_rate,
                users=r.concurrency if args.closed_loop else None,
                num_requests=args.num_requests or (max(200, 10 * r.concurrency) if args.closed_loop else 200),
                prompt_len=P,
                output_len=R + O,  # (the server decodes hidden reasoning tokens like any other)
                params=prm,
                max_num_batched_tokens=2048 if args.max_num_batched_tokens is None else args.max_num_batched_tokens,
                pd_disaggregation=args.pd_disaggregation,
                prefill_plan=prefill_plan,
                expert_skew=args.expert_skew or 0.0,
                check_capacity=check_capacity,
            )

        serving = serve(plan, params, check_capacity=True)
        if not args.no_intervals:
            from waferline.sim.intervals import serving_intervals

            serving_note = serving_intervals(serving, plan, params, serve, accept_range=rng)
    if args.out:  # (a run that fails above leaves an existing file as it was)
        plan.save(args.out)
    mpe = load_model(plan.model).max_position_embeddings
    beyond = (f"{what} ({held:,}) is past the model's {mpe:,} positions (max_position_embeddings): the "
              "prediction is of the hardware, not of a context the model was trained for") if held > mpe else None
    if plan.speculative.method == "draft":  # (a draft model with fewer positions drafts past them untrained)
        from waferline.sim.pipeline import draft_spec

        dspec = draft_spec(load_model(plan.model), plan.speculative.draft_model, params)
        if dspec is not None and held > dspec.max_position_embeddings:
            past = (f"{what} ({held:,}) is past the draft model {dspec.name}'s {dspec.max_position_embeddings:,} "
                    "positions (max_position_embeddings): its acceptance there is assumed, not trained for")
            beyond = f"{beyond}; {past}" if beyond else past
    restaged = [f"{line}: the recomputed memory is used" for line in restaged]
    placed = list(plan.notes) + _fitted_links(plan, params)  # (the plan's own: devices left idle, a regrouping)
    placed += _class_notes(plan, params) + _rollback_note(plan, params)
    if serving is not None and prefill_plan is not None:
        placed += [f"prefill pool: {line}" for line in prefill_plan.notes]
    ranged = not args.no_intervals and rng is not None
    placed += _params_notes(getattr(args, "params", None), params, plan, intervals=not args.no_intervals,
                            ranged=ranged)
    placed += [serving_note] if serving_note else []
    if serving is not None and serving.overloaded:
        placed.append(f"serving: requests arrive at {serving.arrival_rate:g}/s, above the {serving.capacity_rps:.3g}/s "
                      "this engine completes with every request queued: the queue grows without bound, so TTFT and "
                      "end-to-end grow with --num-requests (no steady state); lower --arrival-rate or add devices")
    if args.json:
        d = r.to_dict()
        d["notes"] = placed + restaged + ([beyond] if beyond else [])
        if serving is not None:
            d["serving"] = serving.to_dict()
        if ex is not None:
            d["explain"] = ex
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
        title=f"{_esc(r.model)} on {r.num_devices} x {_hw_label(r.hardware)} ({r.num_stages} stages, "
              f"{plan.weight_bits}-bit weights)"
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
    t.add_row("one decode step through all stages (ms)" + (", without speculation" if r.speculative.get("speedup")
                                                           else ""),
              fmt(r.step_latency_s, iv.get("step_latency_s"), ".3f", 1e3))
    t.add_row(
        f"TTFT, prompt {r.prompt_len:,} (ms)",
        f"{fmt(r.ttft_s, iv.get('ttft_s'), '.1f', 1e3)} (prefill {fmt(r.prefill_s, iv.get('prefill_s'), '.1f', 1e3)}"
        f" + request overhead {(r.ttft_s - r.prefill_s) * 1e3:.1f})",
    )
    if r.reasoning_tokens:
        t.add_row(f"first answer token, after {r.reasoning_tokens:,} reasoning tokens (s)",
                  fmt(r.first_answer_s, iv.get("first_answer_s"), ".3f"))
    t.add_row(f"end-to-end, {r.output_len:,} output tokens" + (f" after {r.reasoning_tokens:,} reasoning"
                                                               if r.reasoning_tokens else "") + " (s)",
              fmt(r.end_to_end_s, iv.get("end_to_end_s"), ".3f"))
    t.add_row("decode is bound by", _esc(r.bound))
    sp = r.speculative
    if sp.get("method", "none") != "none":
        t.add_row(f"speculative: {sp['method']} ({_esc(sp['drafter'])})",
                  f"k={sp['num_tokens']}, accept {fmt(sp['accept_rate'], sp.get('accept_rate_interval'), '.2f')} "
                  f"({_esc(sp['accept_rate_source'])}), "
                  f"{fmt(sp['expected_tokens_per_step'], sp.get('expected_tokens_per_step_interval'), '.2f')} "
                  f"tok/step, x{fmt(sp['speedup'], sp.get('speedup_interval'), '.2f')}")
    notes = []
    if any(iv.values()):
        over = "the fit's bootstrap parameter sets" if params.parameter_sets() else ""
        if ranged:  # (each set, or the parameters alone, at both ends of the given acceptance range)
            over = f"{over} at both ends of the acceptance range" if over else "both ends of the acceptance range"
        notes.append(f"(90%: low-high): range over {over} (" + ("parameter and acceptance uncertainty only)" if ranged
                                                             else "parameter uncertainty only)"))
    if r.concurrency > 1:
        notes.append(f"steady decode of {r.concurrency} users: the other users' prefills between their tokens are not "
                     "counted (" + ("the serving table below counts them)"
                                    if getattr(args, "arrival_rate", None) or getattr(args, "closed_loop", False)
                                    else "--closed-loop simulates serving with them)"))
    notes += [f"note: {line}" for line in placed + restaged]
    if beyond:
        notes.append(f"note: {beyond}")
    t.caption = _esc("\n".join(notes)) or None
    con.print(t)
    st = Table(title="per-stage decode step (us)")
    wafer = any(s.fabric for s in r.stages)
    used = any(s.cores_used for s in r.stages)  # (the share of a stage's cores its wafer regions take)
    cols = ("stage", "role", "layers", "devices") + (("cores",) if used else ()) + (
        "compute", "memory", "fixed") + (("fabric",) if wafer else ()) + ("collective", "hop", "total")
    for c in cols:
        st.add_column(c, justify="right" if c != "role" else "left")
    rows = r.stages
    show = rows if len(rows) <= 16 else rows[:6] + [None] + rows[-6:]  # type: ignore[list-item]
    for s in show:
        if s is None:
            st.add_row("...", "", f"({len(rows) - 12} more)", *[""] * (len(cols) - 3))
            continue
        us = [s.compute, s.memory, s.fixed] + ([s.fabric] if wafer else []) + [s.comm, s.hop, s.total]
        cores = (f"{s.cores_used:.0%}",) if used else ()
        st.add_row(str(s.index), s.role, s.layers, str(s.devices), *cores, *(f"{v * 1e6:.1f}" for v in us))
    con.print(st)
    if ex is not None:
        from waferline.sim.explain import render

        render(con, ex)
    if serving is not None:
        how = (f"chunked prefill, {serving.max_num_batched_tokens} tokens a step" if serving.prefill_mode == "chunked"
               else "stop-the-world prefill")
        if serving.pd_disaggregation:
            how += (f"; prefill on its own {serving.prefill_devices} devices, KV handover "
                    f"{serving.kv_handover_s * 1e3:.2f} ms")
        if serving.expert_skew:
            how += (f"; expert skew {serving.expert_skew:g}: busiest expert-parallel rank x"
                    f"{serving.expert_load_factor:.2f} the mean load ({serving.expert_placement})")
        load = (f"from {serving.users} clients in a closed loop "
                f"({fmt(serving.arrival_rate, serving.intervals.get('arrival_rate'), '.3g')} req/s)" if serving.users
                else f"at {serving.arrival_rate:g} req/s")
        sv = Table(
            title=f"serving {serving.requests} requests {load} (continuous batching, at most {serving.max_batch} in "
                  f"flight; {how})"
        )
        sv.add_column("metric")
        for c in ("mean", "p50", "p99"):
            sv.add_column(c, justify="right")
        siv = serving.intervals
        for label, m, f, scale in (("TTFT (s)", "ttft", ".3f", 1.0), ("inter-token latency (ms)", "itl", ".2f", 1e3),
                                   ("end-to-end (s)", "e2e", ".2f", 1.0)):
            sv.add_row(label, *(fmt(getattr(serving, f"{m}_{q}_s"), siv.get(f"{m}_{q}_s"), f, scale)
                                for q in ("mean", "p50", "p99")))
        sv.caption = (f"output {fmt(serving.output_tokens_per_s, siv.get('output_tokens_per_s'), ',.0f')} tokens/s "
                      f"in all; {fmt(serving.mean_batch, siv.get('mean_batch'))} requests decoding at once on "
                      "average over the run (idle time included)"
                      + (f"; arrivals above the engine's {serving.capacity_rps:.3g} req/s: the queue grows with the "
                         "run, no steady state" if serving.overloaded else ""))
        con.print(sv)
    if not r.fits:
        con.print("[red]warning: the plan does not fit:[/red]")
        for p in r.problems:
            con.print(f"  {_esc(p)}")
        return 2
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Predict every row of a published-results CSV and print error factors, median and max."""
    from waferline.sim.crossval import cross_validate
    from waferline.sim.validate import validate

    data = args.data or _default_data()
    cv = getattr(args, "cross_validate", None)
    if cv is not None:
        say = None
        if not args.json:
            con0 = _console()

            def say(g: str, rs: list) -> None:
                con0.print(f"fold {_esc(g)}: refit without its {len(rs)} row(s)", style="dim")

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
                            "spec_speedup": r.row.spec_speedup,
                            "system": r.row.system,
                            "beyond_ceiling": r.detail.get("ceiling"),
                            "reasoning_tokens": r.row.reasoning_tokens,
                            "not_comparable": r.detail.get("unstated_reasoning"),
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
    title = f"validation on {_esc(data)} (parameters: {_esc(summary['params'])})"
    if cv is not None:
        title = (f"cross-validation by {_esc(cv)} on {_esc(data)}: {summary['folds']} folds, each refit from the "
                 f"priors without its rows; predictions are out-of-fold ({summary['seconds']:.0f} s)")
    t = Table(title=title)
    for c in ("id", "model", "hardware", "chips", "bits", "spec", "metric", "published", "predicted", "error x"):
        t.add_column(c, justify="right" if c in ("chips", "bits", "published", "predicted", "error x") else "left")
    for r in results:
        if r.predicted is None:
            t.add_row(
                _esc(r.row.id),
                _esc(r.row.model),
                _esc(r.row.hardware),
                str(r.row.num_chips or ""),
                str(r.row.weight_bits),
                _esc(r.row.spec_decoding),
                _esc(r.row.metric),
                f"{r.row.value:g}",
                "not comparable" if r.detail.get("unstated_reasoning") else "skipped",
                "(below)",
            )
            continue
        e = r.error_factor or 0
        col = "green" if e <= 1.25 else "yellow" if e <= 2 else "red"
        t.add_row(
            _esc(r.row.id),
            _esc(r.row.model),
            _esc(r.row.hardware),
            str(r.devices),
            str(r.row.weight_bits),
            _esc(r.row.spec_decoding) + (f" x{r.row.spec_speedup:g}" if r.row.spec_speedup is not None else ""),
            _esc(r.row.metric),
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
            + (f"; {len(summary['not_comparable'])} not comparable" if summary["not_comparable"] else "")
        )
    if summary["beyond_ceiling"]:
        rows = {r.row.id: r.row for r in results}
        far = ", ".join(f"{_esc(i)} (published {rows[i].value:g}, the model's best {v:.4g})"
                        for i, v in summary["beyond_ceiling"].items())
        con.print(f"[yellow]beyond the model's physical ceiling[/yellow] (every fitted term at the most favourable end "
                  f"of its bounds, the catalog's numbers as they are): {far}. No fit reaches these rows: they need a "
                  "mechanism or a hardware number that neither the row nor the catalog states (undisclosed "
                  "speculation or precision, an assumed bandwidth or latency that is off).")
    for r in results:  # (each reason whole: the table's column would cut it)
        if r.predicted is None and r.skipped:
            con.print(f"skipped: {_esc(r.row.id)}: {_esc(r.skipped)}")
    rows = {r.row.id: r.row for r in results}
    for i, u in summary["not_comparable"].items():
        row = rows[i]
        at_pub = (f", {u['implied_reasoning_tokens_at_published_rate']:,.0f} at the published "
                  f"{u['published_decode_tokens_per_s']:g} tok/s of {_esc(u['published_rate_row'])}"
                  if "published_rate_row" in u else "")
        con.print(f"[yellow]not comparable[/yellow]: {_esc(i)} is the end-to-end time of a reasoning model whose "
                  f"hidden reasoning length the source does not state. With no reasoning the model predicts "
                  f"{u['no_reasoning_s']:.3g} s; the published {row.value:g} s is "
                  f"{row.value / u['no_reasoning_s']:.1f}x that ("
                  + ("consistent: no reasoning is the fastest the row can be" if u["consistent"]
                     else "[red]inconsistent: faster than no reasoning at all[/red]")
                  + f"). The difference is {u['implied_reasoning_tokens']:,.0f} hidden tokens at the predicted "
                  f"{u['decode_tokens_per_s']:,.0f} tok/s{at_pub}.")
    return 0


def cmd_catalog(args: argparse.Namespace) -> int:
    """The catalog's models and devices: the ids plan and simulate take, with their main numbers."""
    from waferline.spec.catalog import list_hardware, list_models, load_hardware, load_model

    models, devices = [], []
    if args.what in ("all", "models"):
        for name in list_models():
            spec = load_model(name)
            models.append({"id": name, "model_type": spec.model_type, "layers": spec.num_layers,
                           "params_total": spec.params_total(), "params_active": spec.params_active(),
                           "cache_bytes_per_token_bf16": spec.cache_bytes_per_token(16),
                           "cache_bytes_per_context_token_bf16": spec.cache_growth(16)[0],
                           "max_position_embeddings": spec.max_position_embeddings})
    if args.what in ("all", "hardware"):
        for name in list_hardware():
            hw = load_hardware(name)
            devices.append({"id": name, "kind": hw.kind, "memory_bytes": hw.memory_bytes,
                            "memory_bandwidth": hw.memory_bandwidth, "bf16_flops": hw.flops.get("bf16"),
                            "devices_per_node": hw.devices_per_node,
                            "assumed": sorted(k for k, v in hw.sources.items() if v.status == "assumed"),
                            "description": hw.description})
    if args.json:
        print(json.dumps({"models": models, "hardware": devices}, indent=1))
        return 0
    from rich.table import Table

    con = _console()
    if models:
        t = Table(title=f"catalog models ({len(models)}): `waferline info ID` for layer kinds, weight bytes and "
                  "cache bytes per token")
        for c in ("id", "type", "layers", "params", "active", "cache/context token (16-bit)", "positions"):
            t.add_column(c, justify="left" if c in ("id", "type") else "right")
        for m in models:
            t.add_row(m["id"], m["model_type"], str(m["layers"]), f"{m['params_total'] / 1e9:,.1f}B",
                      f"{m['params_active'] / 1e9:,.1f}B", f"{m['cache_bytes_per_context_token_bf16'] / 1e3:,.1f} kB",
                      f"{m['max_position_embeddings']:,}")
        con.print(t)
    if devices:
        t = Table(title=f"catalog hardware ({len(devices)}): every number sourced in its YAML, or marked assumed")
        for c in ("id", "kind", "memory GB", "bandwidth TB/s", "bf16 TFLOP/s", "per node", "assumed numbers"):
            t.add_column(c, justify="left" if c in ("id", "kind", "assumed numbers") else "right")
        for d in devices:
            t.add_row(d["id"], d["kind"], f"{d['memory_bytes'] / 1e9:,.1f}", f"{d['memory_bandwidth'] / 1e12:,.2f}",
                      f"{d['bf16_flops'] / 1e12:,.0f}" if d["bf16_flops"] else "-", str(d["devices_per_node"]),
                      ", ".join(d["assumed"]) or "-")
        con.print(t)
    return 0


def register(subparsers: Any) -> None:
    """Add plan / simulate / validate to an argparse subparsers object (calibrate and twin: sim/commands.py)."""
    c = subparsers.add_parser("catalog", help="list the catalog's models and hardware (the ids plan and simulate "
                                              "take) with their main numbers")
    c.add_argument("what", nargs="?", default="all", choices=("all", "models", "hardware"),
                   help="what to list: models, hardware or all of it (default all)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(func=cmd_catalog)

    p = subparsers.add_parser("plan", help="place a model on hardware and check that it fits")
    _add_plan_args(p)
    p.set_defaults(func=cmd_plan)

    s = subparsers.add_parser("simulate", help="predict tokens/s, TTFT and per-stage latency of a deployment")
    _add_plan_args(s, optional=True)
    s.add_argument("--plan", default=None, help="simulate this plan JSON instead of placing MODEL")
    s.add_argument("--prompt-len", type=positive_int, default=None, help="prompt tokens per request (default 1000)")
    s.add_argument("--output-len", type=positive_int, default=None, help="output tokens per request (default 500)")
    s.add_argument("--reasoning-tokens", type=nonnegative_int, default=None, metavar="N",
                   help="hidden tokens a reasoning model generates before its --output-len answer tokens (decoded like "
                        "any output: they delay the first answer token and the end; default 0)")
    s.add_argument("--concurrency", type=positive_int, default=None, help="concurrent requests (default: --batch)")
    s.add_argument("--speculative", default=None, choices=("none", "draft", "mtp", "ngram", "eagle", "medusa"),
                   help="speculative decoding to predict (default none; with --plan: the plan's, which a given METHOD, "
                        "none included, replaces)")
    s.add_argument("--accept-rate", type=accept_rate_arg, default=None, metavar="RATE|LOW:HIGH",
                   help="per-token acceptance, one rate or a range (the prediction uses its midpoint; the 90%% "
                        "intervals span the range; default: fitted per method, its range from the fit)")
    s.add_argument("--explain", action="store_true",
                   help="say what one decode step is spent on (per term, with its basis) and, with "
                        "--target-tokens-per-s, what would have to change to reach that rate")
    s.add_argument("--target-tokens-per-s", type=positive_float, default=None, metavar="RATE",
                   help="with --explain: the per-user decode rate to reach (e.g. 750)")
    s.add_argument(
        "--num-speculative-tokens", type=int_range(1, MAX_DRAFT_TOKENS, " (draft tokens verified per step)"),
        default=None, help=f"draft tokens per step, 1-{MAX_DRAFT_TOKENS} (default per method)"
    )
    s.add_argument("--draft-model", default=None,
                   help="draft model for --speculative draft; it must share the target's tokenizer (its vocabulary "
                        "size, and the tokenizer the catalog names where two of one size differ; default: the "
                        "family's small catalog model when it does, e.g. llama-3.2-1b, else a one-layer draft head "
                        "of the target's shape)")
    s.add_argument("--params", default=None, help="simulator parameter YAML (default: the fitted sim/fitted.yaml)")
    s.add_argument("--no-intervals", action="store_true",
                   help="skip the 90%% intervals (one prediction per stored bootstrap parameter set)")
    s.add_argument(
        "--arrival-rate", type=float, default=None, help="also simulate serving Poisson arrivals at this rate (req/s)"
    )
    s.add_argument("--closed-loop", action="store_true",
                   help="also simulate serving --concurrency clients in a closed loop (each sends its next request "
                        "when its last ends, as a benchmark at fixed concurrency does): TTFT and ITL with the other "
                        "clients' prefills mixed into the steps")
    s.add_argument("--num-requests", type=int_range(1, MAX_SERVING_REQUESTS, ": the serving simulation's time grows "
                                                    "with it, about 4 s per million"), default=None,
                   help="requests in the serving simulation (default 200; closed loop: 10 per client, at least 200, "
                        f"and with several clients more than one per client: their first wave is warm-up; at most "
                        f"{MAX_SERVING_REQUESTS:,})")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="serving: tokens one step carries, decode tokens first, prompt chunks in the rest (default "
                        "2048; 0 = stop-the-world prefill, one prompt at a time with decode paused)")
    s.add_argument("--pd-disaggregation", action="store_true",
                   help="serving: prefill on a separate pool (a second copy of the plan, or --prefill-devices), the KV "
                        "cache handed to the decode pool over the scale-out link")
    s.add_argument("--prefill-devices", type=device_count, default=None,
                   help="serving: devices of a separate prefill pool, the model placed with the same flags (implies "
                        "--pd-disaggregation)")
    s.add_argument("--expert-skew", type=float, default=None,
                   help="serving, MoE: Zipf exponent of expert popularity; the busiest expert-parallel rank's load "
                        "over the mean rank's scales the routed-expert compute (contiguous expert blocks, the most "
                        "popular first; default 0 = uniform routing)")
    s.set_defaults(func=cmd_simulate)

    v = subparsers.add_parser(
        "validate", help="compare predictions with a CSV of published results",
        description="Plan and simulate every row of a published-results CSV and print the error factor of each "
                    "prediction (exp |ln(predicted / published)|), their median and max. Rows faster than the model's "
                    "physical ceiling (every fitted term at its most favourable bound) are named. A reasoning model's "
                    "end-to-end time whose reasoning length is 'unstated' (the reasoning_tokens column) is not "
                    "comparable: it is checked against the time with no reasoning and the hidden tokens it implies.")
    v.add_argument("--data", default=None, help=f"results CSV (default: {DEFAULT_DATA})")
    v.add_argument("--params", default=None, help="simulator parameter YAML (default: sim/fitted.yaml)")
    v.add_argument("--json", action="store_true", help="machine-readable output (rows and summary)")
    v.add_argument("--cross-validate", nargs="?", const="row", default=None, metavar="row|vendor",
                   help="refit every fitted parameter without each row (row) or each system's rows (vendor: the "
                   "CSV's system column) and predict the held-out rows with that refit (row: ~1-2 min)")
    v.set_defaults(func=cmd_validate)


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
