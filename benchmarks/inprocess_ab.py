"""What the in-process A/B scripts (program_ab.py, layer_ops_ab.py) share: their common options, the check that the
fused operators are built, and the alternating rounds of ``LLM.generate`` with a switch flipped between them.

On this project's 2-core machines a decode step's speed drifts by 10-50% between seconds and between processes, so a
change of 10-30% is read from the same process, the two settings alternating round by round (the order flipped every
other round), as the median of the rounds' paired ratios; both settings must generate the same tokens."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Callable


def parser(doc: str, models_help: str, batch: str, rounds: int, tokens: int) -> argparse.ArgumentParser:
    """The options every in-process A/B script takes (its own added after)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=doc)
    ap.add_argument("--model", action="append", default=None, help=f"checkpoint directory (repeatable; {models_help})")
    ap.add_argument("--batch", default=batch, help=f"comma-separated batch sizes (default {batch})")
    ap.add_argument("--rounds", type=int, default=rounds, help=f"alternating rounds per cell (default {rounds})")
    ap.add_argument("--tokens", type=int, default=tokens, help=f"new tokens per row (default {tokens})")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--json", default=None, help="write the rows here")
    return ap


CACHE = Path(__file__).resolve().parent / ".cache"
CHECKPOINTS = [CACHE / "dsv3" / "hf", CACHE / "qwen3moe" / "hf", CACHE / "llama" / "hf"]  # decode_speed.py's
VARIANTS = {"bf16": dict(weight_bits=16, head_bits=16), "int4": dict(weight_bits=4, head_bits=8)}  # LLM's options


def start(doc: str, argv: list[str] | None) -> tuple[argparse.Namespace, list[tuple[str, Path]], list[str],
                                                     list[int], Any] | None:
    """For the scripts that run decode_speed.py's checkpoints as bf16 and / or int4: parse parser()'s options and
    --variants, check the fused operators are built (None if not), and return the options, (name, checkpoint) of each
    --model that exists (default CHECKPOINTS; a missing one is reported and skipped), the variants, the batch sizes and
    greedy SamplingParams of --tokens. A bad --variants is a usage error."""
    ap = parser(doc, "default: decode_speed.py's dsv3, qwen3moe and llama", "1", 6, 64)
    ap.add_argument("--variants", default="bf16,int4", help="comma-separated: bf16 (16-bit head), int4 (int8 head)")
    a = ap.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    if any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: bf16 and/or int4, got {a.variants!r}")
    if not ready(a.threads):
        return None
    from waferline import SamplingParams

    models = []
    for path in [Path(m) for m in a.model] if a.model else CHECKPOINTS:
        if (path / "config.json").is_file():
            models.append((path.name if path.name != "hf" else path.parent.name, path))
        else:
            print(f"{path}: no checkpoint (run benchmarks/decode_speed.py once to build it)", file=sys.stderr)
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    return a, models, variants, [int(b) for b in a.batch.split(",")], params


def table(title: str, columns: list[str], rows: list[list[str]]) -> Any:
    """A rich table of right-aligned columns."""
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(*r)
    return t


def ready(threads: int) -> bool:
    """Whether the fused CPU operators are built (else there is nothing to compare); sets torch's threads."""
    import torch

    from waferline import kernels

    if not kernels.available():
        print(f"the fused CPU operators are not built ({kernels.status()['error']}): nothing to compare", file=sys.stderr)
        return False
    torch.set_num_threads(threads)
    return True


def alternate(llm: Any, prompts: list[list[int]], params: Any, switch: Callable[[bool], None],
              rounds: int) -> dict[str, Any]:
    """``llm.generate(prompts, params)`` with ``switch(True)`` and ``switch(False)``: a warm-up each way (and the tokens
    each generates), then ``rounds`` alternating rounds; decode tok/s (the engine's own metric) per round, their
    medians, the median of the paired ratios (True over False), whether both generated the same tokens. Leaves the
    switch on True."""
    toks, rates = {}, {True: [], False: []}
    for on in (True, False):
        switch(on)
        toks[on] = [o.token_ids for o in llm.generate(prompts, params)]
    for r in range(rounds):
        for on in ((True, False) if r % 2 else (False, True)):
            switch(on)
            rates[on].append(llm.generate(prompts, params)[0].metrics["decode_tokens_per_s"])
    switch(True)
    return {"on_best": max(rates[True]), "on_median": statistics.median(rates[True]),
            "off_best": max(rates[False]), "off_median": statistics.median(rates[False]),
            "paired_median": statistics.median([p / q for p, q in zip(rates[True], rates[False])]),
            "same_tokens": toks[True] == toks[False],
            "rounds_on": [round(x, 1) for x in rates[True]], "rounds_off": [round(x, 1) for x in rates[False]]}


def cells(models: list[tuple[str, Path]], variants: list[str], batches: list[int], params: Any,
          switch: Callable[[bool], None], rounds: int) -> Any:
    """For each checkpoint, variant (an LLM of it, bf16 compute) and batch size: (name, variant, batch, alternate()'s
    result) over ``batches`` prompts of 64 tokens each."""
    from waferline import LLM

    for name, path in models:
        for variant in variants:
            llm = LLM(str(path), dtype="bfloat16", **VARIANTS[variant])
            V = llm.spec.vocab_size
            for B in batches:
                prompts = [[(3 + 7 * b + 13 * i) % V for i in range(64)] for b in range(B)]
                yield name, variant, B, alternate(llm, prompts, params, switch, rounds)
            del llm


def finish(a: argparse.Namespace, rows: list[dict], table: Any, extra: dict[str, Any] | None = None) -> int:
    """Print the table, write the rows (and the run's settings, with ``extra``) to --json, and return the exit status:
    1 where a setting generated other tokens than the other."""
    import json

    from rich.console import Console

    Console(width=140).print(table)
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": a.threads, "tokens": a.tokens, "rounds": a.rounds,
                                            **(extra or {}), "rows": rows}, indent=1))
        print(f"wrote {a.json}")
    return 0 if all(r["same_tokens"] for r in rows) else 1
