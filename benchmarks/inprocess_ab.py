"""What the in-process A/B scripts (program_ab.py, layer_ops_ab.py) share: their common options, the check that the
fused operators are built, and the alternating rounds of ``LLM.generate`` with a switch flipped between them.

On this project's 2-core machines a decode step's speed drifts by 10-50% between seconds and between processes, so a
change of 10-30% is read from the same process, the two settings alternating round by round (the order flipped every
other round), as the median of the rounds' paired ratios; both settings must generate the same tokens."""

from __future__ import annotations

import argparse
import statistics
import sys
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


def finish(a: argparse.Namespace, rows: list[dict], table: Any, extra: dict[str, Any] | None = None) -> int:
    """Print the table, write the rows (and the run's settings, with ``extra``) to --json, and return the exit status:
    1 where a setting generated other tokens than the other."""
    import json
    from pathlib import Path

    from rich.console import Console

    Console(width=140).print(table)
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": a.threads, "tokens": a.tokens, "rounds": a.rounds,
                                            **(extra or {}), "rows": rows}, indent=1))
        print(f"wrote {a.json}")
    return 0 if all(r["same_tokens"] for r in rows) else 1
