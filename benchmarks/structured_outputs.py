"""What a structured output costs: decode tokens/s of sampled requests held to a JSON object, a JSON Schema, a regex, a
choice and a Lark grammar, beside the same requests unconstrained (plain, and with ``logprobs=0``, which takes the
same logits path a constrained row takes: no greedy bursts, its logits sampled in the scheduler), in one run; the
scheduler's sampling time per token in the engine (the mask, advance and draw included); and the mask's own time per
token (``GrammarConstraint.allowed`` + ``advance``, timed alone over the tokens the engine drew).

    python benchmarks/structured_outputs.py                      # sol-mini, batch 1 and 8
    python benchmarks/structured_outputs.py --model DIR --batches 1 --max-tokens 128

The engine's own tokens/s (``decode_tokens_per_s``) are per run: the best of ``--repeat``. Constrained requests stop
where their text is whole, so their outputs are shorter; tokens/s, not wall time, is the comparison. Prints a table and
writes ``benchmarks/results/structured_outputs.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCHEMA = {"type": "object", "properties": {"speaker": {"type": "string", "maxLength": 24},
                                           "act": {"type": "integer", "minimum": 1, "maximum": 5},
                                           "lines": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["speaker", "act", "lines"], "additionalProperties": False}
CASES = {
    "plain": {},
    "logprobs=0 (logits path)": {"logprobs": 0},
    "json_object": {"json_object": True},
    "json_schema": {"json_schema": SCHEMA},
    "regex": {"regex": r"([A-Z][a-z]+ ){1,12}[A-Z][a-z]+[.!?]"},
    "choice": {"choice": ["Denmark", "Norway", "England", "France", "Scotland"]},
    "grammar (Lark)": {"grammar": 'start: line (" " line){0,6}\nline: WORD "," | WORD "."\nWORD: /[A-Za-z]{1,10}/'},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default=str(ROOT / "models" / "sol-mini"), help="checkpoint with a tokenizer")
    ap.add_argument("--batches", default="1,8", help="batch sizes (comma-separated; default 1,8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="runs per case (best kept)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "structured_outputs.json"))
    args = ap.parse_args()
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(args.out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    if not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches {args.batches}: expected comma-separated integers")

    import torch
    from rich.console import Console
    from rich.table import Table

    from waferline import LLM, SamplingParams
    from waferline.engine import structured

    torch.set_num_threads(args.threads)
    rows = []
    import waferline.engine.scheduler as scheduler_module

    in_engine = {"s": 0.0}
    plain_sample = scheduler_module.sample

    def timed_sample(*a, **k):  # the scheduler's per-row sampling (mask, advance and draw included), timed in place
        t0 = time.perf_counter()
        try:
            return plain_sample(*a, **k)
        finally:
            in_engine["s"] += time.perf_counter() - t0

    scheduler_module.sample = timed_sample
    with LLM(args.model) as llm:
        prompts = [llm.encode(p) for p in ("HAMLET. Who is there?", "KING. Speak, what news?", "Enter a Messenger.",
                                          "OPHELIA. My lord,", "MACBETH. So foul and fair", "Act I. Scene 2.",
                                          "FALSTAFF. Now, Hal,", "PORTIA. The quality of mercy")]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
        for batch in batches:
            for name, kw in CASES.items():
                best, outs, sample_us = 0.0, [], 0.0
                for r in range(args.repeat):
                    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=r, **kw)
                    in_engine["s"] = 0.0
                    got = llm.generate([prompts[i % len(prompts)] for i in range(batch)], params)
                    tps = got[0].metrics["decode_tokens_per_s"]
                    if tps > best:
                        best, outs = tps, got
                        sample_us = in_engine["s"] / max(1, sum(len(o.token_ids) for o in got)) * 1e6
                mask_us = None
                if kw and "logprobs" not in kw:  # the mask alone, over the tokens the engine drew
                    n, spent = 0, 0.0
                    for o in outs:
                        c = structured.constraint(llm.tokenizer, llm.spec.vocab_size,
                                                  frozenset(llm.eos_token_ids), SamplingParams(**kw))
                        for t in o.token_ids:
                            t0 = time.perf_counter()
                            c.allowed()
                            c.advance(t)
                            spent += time.perf_counter() - t0
                            n += 1
                    mask_us = spent / max(n, 1) * 1e6
                rows.append({"batch": batch, "case": name, "decode_tokens_per_s": best,
                             "tokens_per_request": sum(len(o.token_ids) for o in outs) / len(outs),
                             "stopped": sum(o.finish_reason == "stop" for o in outs) / len(outs),
                             "sample_us_per_token": sample_us, "mask_us_per_token": mask_us})

    table = Table(title=f"structured outputs on {Path(args.model).name}: sampled (T=1), {args.max_tokens} tokens at "
                        f"most, best of {args.repeat}, {args.threads} threads")
    for col in ("batch", "case", "decode tok/s", "vs plain", "tokens/request", "whole", "sampling µs/token",
                "mask µs/token", "mask share"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        plain = next(x for x in rows if x["batch"] == r["batch"] and x["case"] == "plain")["decode_tokens_per_s"]
        table.add_row(str(r["batch"]), r["case"], f"{r['decode_tokens_per_s']:.0f}",
                      f"{r['decode_tokens_per_s'] / plain:.2f}x", f"{r['tokens_per_request']:.1f}",
                      f"{r['stopped']:.0%}", f"{r['sample_us_per_token']:.0f}",
                      "" if r["mask_us_per_token"] is None else f"{r['mask_us_per_token']:.0f}",
                      "" if r["mask_us_per_token"] is None else
                      f"{r['mask_us_per_token'] * 1e-6 * r['decode_tokens_per_s']:.0%}")
    Console(width=150).print(table)
    print("whole: the share of requests that ended with their text whole (the rest reached --max-tokens). sampling: "
          "the scheduler's per-row sampling in the engine (mask, advance and draw included), per token. mask: "
          "allowed() + advance() timed alone; mask share: that time x the tokens/s, the part of decode spent in masks "
          "(computed one row after another). Constrained rows end early and unevenly, so their tokens/s also counts "
          "ragged batches and short runs.")
    out = Path(args.out)
    write_text_atomic(out, json.dumps({"model": args.model, "max_tokens": args.max_tokens, "repeat": args.repeat,
                                       "threads": args.threads, "machine": platform.processor() or platform.machine(),
                                       "rows": rows}, indent=1), make_parents=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
