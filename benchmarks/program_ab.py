"""What replaying a decode step through a StepProgram buys: the same engine, the same process, program on and off.

    python benchmarks/program_ab.py [--model DIR ...] [--batch 1,8] [--rounds 10] [--json PATH]

DecoderModel replays a decode step's layer ops from a plan (decoder.py, _StepPlan). With the program (the default)
the plan's ops run back to back from C++ (waferline.StepProgram: the embedding, the layer ops, the final norm, the
int8 head and the argmax, one call from Python per step); without it (``decoder._USE_PROGRAM = False``) the plan
replays op by op from Python and the embedding, norm, head and argmax run as modules and ops, as before the program.
Each round runs ``LLM.generate`` (int4 weights, bf16 compute, int8 head, greedy, 64-token prompts, --tokens new tokens
per row) both ways in one process, in alternating order; a table gives the best and median tok/s of each and the median
of the rounds' paired ratios (the steadier measure on a machine whose speed drifts between seconds), and checks that
both ways generate the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODELS = [ROOT / "benchmarks" / ".cache" / "dsv3" / "hf", ROOT / "models" / "sol-mini"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", action="append", default=None,
                    help="checkpoint directory (repeatable; default: decode_speed.py's dsv3 and models/sol-mini)")
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes (default 1,8)")
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds per cell (default 10)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per row (default 128)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)

    import torch
    from rich.console import Console
    from rich.table import Table

    import waferline.model.decoder as decoder
    from waferline import LLM, SamplingParams, kernels

    if not kernels.available():
        print(f"the fused CPU operators are not built ({kernels.status()['error']}): nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(a.threads)
    models = [Path(m) for m in a.model] if a.model else DEFAULT_MODELS
    batches = [int(b) for b in a.batch.split(",")]
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    rows = []
    for path in models:
        if not (path / "config.json").is_file():
            print(f"{path}: no checkpoint (run benchmarks/decode_speed.py once to build dsv3)", file=sys.stderr)
            continue
        llm = LLM(str(path), dtype="bfloat16", weight_bits=4, head_bits=8)
        V = llm.spec.vocab_size
        for B in batches:
            prompts = [[(3 + 7 * b + 13 * i) % V for i in range(64)] for b in range(B)]
            toks, rates = {}, {True: [], False: []}
            for on in (True, False):  # warm-up, and the tokens each way generates
                decoder._USE_PROGRAM = on
                toks[on] = [o.token_ids for o in llm.generate(prompts, params)]
            for r in range(a.rounds):
                for on in ((True, False) if r % 2 else (False, True)):
                    decoder._USE_PROGRAM = on
                    rates[on].append(llm.generate(prompts, params)[0].metrics["decode_tokens_per_s"])
            decoder._USE_PROGRAM = True
            ratios = [p / q for p, q in zip(rates[True], rates[False])]
            row = {"model": path.name if path.name != "hf" else path.parent.name, "batch": B,
                   "replay_best": max(rates[False]), "replay_median": statistics.median(rates[False]),
                   "program_best": max(rates[True]), "program_median": statistics.median(rates[True]),
                   "paired_median": statistics.median(ratios), "same_tokens": toks[True] == toks[False],
                   "rounds_replay": [round(x, 1) for x in rates[False]],
                   "rounds_program": [round(x, 1) for x in rates[True]]}
            rows.append(row)
            print(f"{row['model']} b={B}: replay {row['replay_median']:.1f} / program {row['program_median']:.1f} tok/s "
                  f"(median), paired {row['paired_median']:.3f}x, same tokens {row['same_tokens']}", flush=True)
    t = Table(title=f"decode tok/s (aggregate), int4 + int8 head, bf16, {a.threads} threads: program off / on, "
                    f"{a.rounds} alternating rounds")
    for c in ("model", "batch", "replay best", "replay median", "program best", "program median", "paired",
              "same tokens"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["model"], str(r["batch"]), f"{r['replay_best']:.1f}", f"{r['replay_median']:.1f}",
                  f"{r['program_best']:.1f}", f"{r['program_median']:.1f}", f"{r['paired_median']:.3f}x",
                  str(r["same_tokens"]))
    Console(width=140).print(t)
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": a.threads, "tokens": a.tokens, "rounds": a.rounds,
                                            "rows": rows}, indent=1))
        print(f"wrote {a.json}")
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
