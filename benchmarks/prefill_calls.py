"""A step's prefill chunks of different lengths: one padded model call (engine/padding.py) against one call per
distinct length, side by side in one run, in the single-process runner.

    python benchmarks/prefill_calls.py --threads 2

The checkpoint is decode_speed.py's "llama" (124.7M parameters, random weights; built and cached under
benchmarks/.cache/llama), int4 g128 with an int8 LM head and bf16 activations unless --dtype / --weight-bits say
otherwise. Each case is a scheduler step as a serving load makes it: ``--decodes`` decode rows beside ``--chunks``
prompts of lengths spread over ``--lengths LO:HI``. The two variants alternate, ``--rounds`` times; the table shows the
best and the median time of a step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decode_speed_models import CACHE, build_checkpoint


def lengths(text: str) -> tuple[int, int]:
    """--lengths LO:HI, two prompt lengths of at least 1 token."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI (two integers), got {text!r}") from None
    if min(lo, hi) < 1:
        raise argparse.ArgumentTypeError(f"expected lengths of at least 1 token, got {text!r}")
    return lo, hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--weight-bits", type=int, default=4, choices=[4, 16])
    ap.add_argument("--decodes", type=int, default=57)
    ap.add_argument("--chunks", type=int, default=7)
    ap.add_argument("--lengths", type=lengths, default=(62, 68), help="prompt lengths LO:HI, spread evenly over the "
                    "chunks")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    from waferline import LLM
    from waferline.engine.padding import pads_safely
    from waferline.engine.runner import WANT_LOGITS, DecodeRow, LocalRunner, PrefillChunk

    torch.set_num_threads(args.threads)
    d = build_checkpoint("llama", False, CACHE)
    opts = dict(weight_bits=4, head_bits=8, group_size=128) if args.weight_bits == 4 else {}
    llm = LLM(d / "hf", dtype=args.dtype, **opts)
    lo, hi = args.lengths
    lens = [lo + (hi - lo) * i // max(1, args.chunks - 1) for i in range(args.chunks)]
    slots = args.decodes + args.chunks
    runners = {}
    for name, pad in (("one call per length", False), ("padded calls", True)):
        r = LocalRunner(llm.model, slots)
        r._pad_ok = pad  # (off: one call per distinct length, as before padded calls)
        runners[name] = r
    if not pads_safely(runners["padded calls"].caches):
        raise SystemExit("this model's caches do not take padded rows")
    for r in runners.values():  # the decode rows' prompts
        r.step([], [PrefillChunk(s, 0, [1 + s % 50] * 16, WANT_LOGITS) for s in range(args.decodes)])

    def step(r: LocalRunner) -> float:
        dec = [DecodeRow(s, 16, 5, WANT_LOGITS) for s in range(args.decodes)]
        pre = [PrefillChunk(args.decodes + j, 0, [(7 * i + j) % 500 + 1 for i in range(n)], WANT_LOGITS)
               for j, n in enumerate(lens)]
        t = time.perf_counter()
        r.step(dec, pre)
        return time.perf_counter() - t

    times: dict[str, list[float]] = {k: [] for k in runners}
    for k in runners:
        step(runners[k])  # warm-up
    for i in range(args.rounds):
        for k in (list(runners) if i % 2 == 0 else list(reversed(runners))):
            times[k].append(step(runners[k]))
    t = Table(title=f"{args.decodes} decode rows + {args.chunks} prompts of {lens} tokens, {args.dtype}, "
                    f"{'int4' if args.weight_bits == 4 else '16-bit'} weights, {args.threads} threads, "
                    f"{args.rounds} rounds")
    for c in ("variant", "model calls", "best ms", "median ms", "vs per length (best)"):
        t.add_column(c, justify="left" if c == "variant" else "right")
    base = min(times["one call per length"])
    for k, r in runners.items():
        calls = len(r._prefill_calls([PrefillChunk(0, 0, [1] * n) for n in lens]))
        t.add_row(k, str(calls + 1), f"{min(times[k]) * 1e3:.1f}", f"{statistics.median(times[k]) * 1e3:.1f}",
                  f"{base / min(times[k]):.2f}x")
    Console(width=140).print(t)


if __name__ == "__main__":
    main()
