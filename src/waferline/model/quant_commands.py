"""`waferline quantize`: write a 16-bit checkpoint as group-wise int4 (RTN or GPTQ) in waferline's canonical format."""

from __future__ import annotations

import argparse
import glob
import json
import sys
from typing import Any

from waferline.argtypes import out_path, positive_int
from waferline.spec.configs import spec_from_pretrained
from waferline.spec.model import INT4_GROUP_SIZES

CALIBRATION_TOKENS = 4096  # GPTQ calibration tokens unless --calibration-tokens says otherwise


def _check_paths(model: str, out: str, force: bool) -> None:
    """Refuse an ``--out`` that would destroy ``--model`` when it is replaced (the same directory or one above it:
    ``check_out_dir``, which also refuses a file) or lies inside it, and (with ``--force``) a directory that holds
    something other than a checkpoint: replacing ``--out`` deletes what it held."""
    from pathlib import Path

    from waferline.errors import ConfigError
    from waferline.model.quant.write import check_out_dir

    check_out_dir(model, out)
    m, o = Path(model).resolve(), Path(out).resolve()
    if m in o.parents:
        raise ConfigError(f"--out {out} is inside --model {model}; choose an --out outside the checkpoint directory")
    if force and o.is_dir() and any(o.iterdir()) and not (o / "config.json").is_file():
        raise ConfigError(f"--out {out} holds files but no checkpoint (no config.json); --force replaces only a "
                          "checkpoint directory: choose another --out")


def _has_mla(model: str) -> bool:
    """Whether the checkpoint has an MLA layer (an unreadable one answers True: quantize reports what is wrong)."""
    from pathlib import Path

    from waferline.errors import WaferlineError

    try:
        spec = spec_from_pretrained(Path(model))
    except WaferlineError:
        return True
    return any(layer.mixer is not None and layer.mixer.kind == "mla" for layer in spec.layers)


def _remove_leftovers(out: str) -> None:
    """Remove what a run that was killed left beside ``--out``: its temporary directory (``.NAME.tmp-*``; not that of
    a writer on this host whose process still runs, nor one another host's writer names as its own: whether that one
    runs cannot be told from here), and the previous output it had moved aside (``.NAME.old-*``) once ``--out``
    itself is in place again."""
    import shutil
    from pathlib import Path

    from waferline.model.quant.write import _writer, _writer_alive

    o = Path(out)
    if o.name in ("", ".", "..") or not o.parent.is_dir():
        return
    stale = [d for d in o.parent.glob(f".{glob.escape(o.name)}.tmp-*")
             if (alive := _writer_alive(d, o)) is False or (alive is None and _writer(d, o) is None)]
    if o.is_dir():
        stale += o.parent.glob(f".{glob.escape(o.name)}.old-*")
    for d in stale:
        if d.is_symlink():  # (a link moved aside: only the link goes)
            d.unlink(missing_ok=True)
        elif d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


def _cmd_quantize(args: argparse.Namespace) -> int:
    from waferline.errors import ConfigError
    from waferline.model.quant import DEFAULT_KEEP, QuantOptions, check_quantize, quantize_checkpoint

    _check_paths(args.model, args.out, args.force)
    if args.method != "gptq" and args.calibration is not None:
        raise ConfigError("--calibration is for --method gptq (round-to-nearest needs no calibration data)")
    if args.method != "gptq" and args.calibration_tokens is not None:
        raise ConfigError("--calibration-tokens is for --method gptq")
    if args.calibration_tokens is None:
        args.calibration_tokens = CALIBRATION_TOKENS
    if args.quantize_kv_b and not _has_mla(args.model):
        raise ConfigError(f"--quantize-kv-b is for MLA attention's kv_b_proj, and {args.model} has no MLA layer")
    keep = tuple(args.keep or ()) + (() if args.quantize_kv_b else DEFAULT_KEEP)
    opts = QuantOptions(bits=args.bits, group_size=args.group_size, symmetric=not args.asymmetric, method=args.method,
                        keep=keep)
    check_quantize(args.model, args.out, opts, args.calibration, args.force,  # (before a progress bar is drawn)
                   args.calibration_tokens)
    _remove_leftovers(args.out)  # (a run refused above touches nothing beside --out)
    if args.json:
        summary = quantize_checkpoint(args.model, args.out, opts, args.calibration, args.calibration_tokens, args.force)
        print(json.dumps(summary, indent=2))
        return 0
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("[bold]quantize[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task(f"{opts.method} int4 g{opts.group_size}", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=f"{opts.method} int4 g{opts.group_size} ({what})")

        summary = quantize_checkpoint(args.model, args.out, opts, args.calibration, args.calibration_tokens, args.force,
                                      progress)
    _print_summary(summary)
    return 0


def _print_summary(s: dict[str, Any]) -> None:
    mib = 1 << 20
    print(f"wrote {s['out']}: {_count(s['tensors_int4'], 'int4 tensor')}, {s['tensors_16bit']} kept 16-bit "
          f"({s['method']}, group {s['group_size']}, {'symmetric' if s['symmetric'] else 'asymmetric'})")
    print(
        f"  weights: {s['bytes_in'] / mib:.2f} MiB -> {s['bytes_out'] / mib:.2f} MiB on disk "
        f"(ModelSpec: {s['accounting_bytes'] / mib:.2f} MiB int4 vs {s['accounting_bytes_16bit'] / mib:.2f} MiB bf16), "
        f"{s['seconds']:.1f} s"
    )
    if s["modules_not_quantized"]:
        more = len(s["modules_not_quantized"]) - 6
        print(
            f"  16-bit matmuls: {', '.join(s['modules_not_quantized'][:6])}" + (f" (+{more} more)" if more > 0 else ""),
            file=sys.stdout,
        )
    if s.get("not_in_file_layout"):
        n = _count(len(s["not_in_file_layout"]), "matmul")
        print(f"  of them, {n} the int4 file cannot hold: their checkpoint tensors keep the input dimension on "
              "neither of their last two axes, or last in a tensor not named *.weight (a fused expert save); loading "
              "the 16-bit checkpoint with --weight-bits 4 quantizes them too")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def register(sub: Any) -> None:
    """Add ``quantize`` to the CLI's subparsers."""
    q = sub.add_parser("quantize", help="quantize a 16-bit checkpoint to group-wise int4 (RTN or GPTQ)",
                       description="Write a checkpoint directory as int4 weights + 16-bit scales (W4A16). Embeddings, "
                                   "LM head, routers, norms and MLA's kv_b_proj stay 16-bit; the choice is recorded in "
                                   "config.json's quantization_config.")
    q.add_argument("--model", required=True, help="16-bit checkpoint directory (config.json + *.safetensors)")
    q.add_argument("--out", type=out_path, required=True,
                   help="output directory (written to a temporary directory, then renamed)")
    q.add_argument("--bits", type=int, default=4, help="weight bits (4)")
    q.add_argument("--group-size", type=int, default=128, choices=INT4_GROUP_SIZES,
                   help="weights per scale along the input dim (32, 64 or 128 are usual; default 128)")
    q.add_argument(
        "--method", default="rtn", choices=["rtn", "gptq"],
        help="rtn = round-to-nearest (default), or gptq (needs --calibration)"
    )
    q.add_argument(
        "--calibration", help="calibration file for GPTQ: text (uses the checkpoint's tokenizer) or token ids"
    )
    q.add_argument("--calibration-tokens", type=positive_int, default=None,
                   help=f"with --method gptq: at most this many calibration tokens ({CALIBRATION_TOKENS})")
    q.add_argument("--asymmetric", action="store_true", help="per-group zero as well as scale (default: symmetric)")
    q.add_argument("--keep", action="append", metavar="REGEX",
                   help="keep matching weights 16-bit (module path or checkpoint name; repeatable), and those held "
                        "in one tensor with them: one expert's name keeps its layer's experts")
    q.add_argument("--quantize-kv-b", action="store_true", help="also quantize MLA kv_b_proj (kept 16-bit by default)")
    q.add_argument("--force", action="store_true",
                   help="replace --out if it exists (a checkpoint directory; never one that holds --model)")
    q.add_argument("--json", action="store_true", help="print the summary as JSON (no progress bar)")
    q.set_defaults(func=_cmd_quantize)
