"""`waferline quantize`: write a 16-bit checkpoint as group-wise int4 (RTN or GPTQ) in waferline's canonical format."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _cmd_quantize(args: argparse.Namespace) -> int:
    from waferline.model.quant import DEFAULT_KEEP, QuantOptions, quantize_checkpoint

    keep = tuple(args.keep or ()) + (() if args.quantize_kv_b else DEFAULT_KEEP)
    opts = QuantOptions(bits=args.bits, group_size=args.group_size, symmetric=not args.asymmetric, method=args.method,
                        keep=keep)
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
    print(f"wrote {s['out']}: {s['tensors_int4']} int4 tensors, {s['tensors_16bit']} kept 16-bit "
          f"({s['method']}, group {s['group_size']}, {'symmetric' if s['symmetric'] else 'asymmetric'})")
    print(f"  weights: {s['bytes_in'] / mib:.2f} MiB -> {s['bytes_out'] / mib:.2f} MiB on disk "
          f"(ModelSpec: {s['accounting_bytes'] / mib:.2f} MiB int4 vs {s['accounting_bytes_16bit'] / mib:.2f} MiB bf16), "
          f"{s['seconds']:.1f} s")
    if s["modules_not_quantized"]:
        more = len(s["modules_not_quantized"]) - 6
        print(f"  16-bit matmuls: {', '.join(s['modules_not_quantized'][:6])}" + (f" (+{more} more)" if more > 0 else ""),
              file=sys.stdout)


def register(sub: Any) -> None:
    """Add ``quantize`` to the CLI's subparsers."""
    q = sub.add_parser("quantize", help="quantize a 16-bit checkpoint to group-wise int4 (RTN or GPTQ)",
                       description="Write a checkpoint directory as int4 weights + 16-bit scales (W4A16). Embeddings, "
                                   "LM head, routers, norms and MLA's kv_b_proj stay 16-bit; the choice is recorded in "
                                   "config.json's quantization_config.")
    q.add_argument("--model", required=True, help="16-bit checkpoint directory (config.json + *.safetensors)")
    q.add_argument("--out", required=True, help="output directory (written to a temporary directory, then renamed)")
    q.add_argument("--bits", type=int, default=4, help="weight bits (4)")
    q.add_argument("--group-size", type=int, default=128, help="weights per scale along the input dim (32, 64, 128)")
    q.add_argument("--method", default="rtn", choices=["rtn", "gptq"], help="round-to-nearest, or GPTQ (needs --calibration)")
    q.add_argument("--calibration", help="calibration file for GPTQ: text (uses the checkpoint's tokenizer) or token ids")
    q.add_argument("--calibration-tokens", type=int, default=4096, help="at most this many calibration tokens (4096)")
    q.add_argument("--asymmetric", action="store_true", help="per-group zero as well as scale (default: symmetric)")
    q.add_argument("--keep", action="append", metavar="REGEX",
                   help="keep matching weights 16-bit (module path or checkpoint name; repeatable)")
    q.add_argument("--quantize-kv-b", action="store_true", help="also quantize MLA kv_b_proj (kept 16-bit by default)")
    q.add_argument("--force", action="store_true", help="replace --out if it exists")
    q.add_argument("--json", action="store_true", help="print the summary as JSON (no progress bar)")
    q.set_defaults(func=_cmd_quantize)
