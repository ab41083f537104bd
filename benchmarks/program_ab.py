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

import sys
from pathlib import Path

import inprocess_ab

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODELS = [ROOT / "benchmarks" / ".cache" / "dsv3" / "hf", ROOT / "models" / "sol-mini"]


def main(argv: list[str] | None = None) -> int:
    a = inprocess_ab.parser(__doc__, "default: decode_speed.py's dsv3 and models/sol-mini", "1,8", 10,
                            128).parse_args(argv)
    import waferline.model.decoder as decoder
    from waferline import LLM, SamplingParams

    if not inprocess_ab.ready(a.threads):
        return 1
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
            r = inprocess_ab.alternate(llm, prompts, params, lambda on: setattr(decoder, "_USE_PROGRAM", on), a.rounds)
            row = {"model": path.name if path.name != "hf" else path.parent.name, "batch": B,
                   "replay_best": r["off_best"], "replay_median": r["off_median"],
                   "program_best": r["on_best"], "program_median": r["on_median"],
                   "paired_median": r["paired_median"], "same_tokens": r["same_tokens"],
                   "rounds_replay": r["rounds_off"], "rounds_program": r["rounds_on"]}
            rows.append(row)
            print(f"{row['model']} b={B}: replay {row['replay_median']:.1f} / program {row['program_median']:.1f} tok/s "
                  f"(median), paired {row['paired_median']:.3f}x, same tokens {row['same_tokens']}", flush=True)
    t = inprocess_ab.table(
        f"decode tok/s (aggregate), int4 + int8 head, bf16, {a.threads} threads: program off / on, {a.rounds} "
        "alternating rounds",
        ["model", "batch", "replay best", "replay median", "program best", "program median", "paired", "same tokens"],
        [[r["model"], str(r["batch"]), f"{r['replay_best']:.1f}", f"{r['replay_median']:.1f}", f"{r['program_best']:.1f}",
          f"{r['program_median']:.1f}", f"{r['paired_median']:.3f}x", str(r["same_tokens"])] for r in rows])
    return inprocess_ab.finish(a, rows, t)


if __name__ == "__main__":
    raise SystemExit(main())
