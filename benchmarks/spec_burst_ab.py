"""What bursts of plain steps buy speculative decoding: the same speculative engines, the same process, a greedy
step that drafts nothing run step by step or in bursts, with plain (non-speculative) greedy decode beside them.

    python benchmarks/spec_burst_ab.py [--model models/sol-mini] [--methods mtp,ngram] [--rounds 6] [--tokens 128]
                                       [--batch 1] [--json PATH]

When adaptive K finds that drafting does not pay (k = 0), or the n-gram lookup finds no match, a speculative step
drafts nothing and is a plain decode step. ``Speculator.stream`` runs such steps in bursts (``burst_len``: 1, 2, 4,
then 8 after such steps in a row, through ``DecoderModel.greedy_steps``, as plain greedy decode runs them);
``burst_len = 1`` runs them one by one, each with the speculative loop's Python around it (the engine before this
change). Each round runs ``LLM.generate`` of a speculative method (k <= 3, adaptive K, int4 weights with an int8
head as decode_speed.py's sol-mini rows) both ways, in alternating order (inprocess_ab.alternate); plain greedy
decode runs --rounds times first. Prompts are the checkpoint's held-out text (speculation depends on the text:
random ids would be meaningless). A table gives the median and best decode tok/s of each, the median of the
rounds' paired ratios (bursts over step by step), and checks that every engine and setting generates plain
decoding's tokens.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import inprocess_ab

SOL = Path(__file__).resolve().parents[1] / "models" / "sol-mini"


def main(argv: list[str] | None = None) -> int:
    ap = inprocess_ab.parser(__doc__, "default: models/sol-mini", "1", 6, 128)
    ap.add_argument("--methods", default="mtp,ngram", help="comma-separated speculative methods (default mtp,ngram)")
    a = ap.parse_args(argv)
    path = Path(a.model[0]) if a.model else SOL
    if not (path / "config.json").is_file():
        ap.error(f"--model {path}: no config.json there")
    if a.tokens < 2 or a.rounds < 1:
        ap.error("--tokens must be at least 2 and --rounds at least 1")
    if not a.batch.isdigit() or int(a.batch) < 1:
        ap.error(f"--batch: one batch size, got {a.batch!r}")
    B = int(a.batch)
    if not inprocess_ab.ready(a.threads):
        return 1
    import waferline.engine.speculative as spm
    from waferline import LLM, SamplingParams

    opts = dict(dtype="bfloat16", weight_bits=4, head_bits=8)
    plain = LLM(str(path), **opts)
    held = path / "heldout.txt"
    text = held.read_text() if held.is_file() else "To be, or not to be: " * 40
    ids = plain.encode(text[: 400 * B])  # (~2.5 characters a token: 64 tokens a row, under the tokenizer's limit)
    prompts = [ids[64 * b: 64 * (b + 1)] for b in range(B)]
    if len(prompts[-1]) < 64:
        ap.error(f"{held}: too short for {B} prompts of 64 tokens")
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    engines = {m: LLM(str(path), speculative=m, num_speculative_tokens=3, **opts) for m in a.methods.split(",") if m}
    bursts = spm.burst_len

    def switch(on: bool) -> None:
        spm.burst_len = bursts if on else (lambda idle: 1)

    ref = [o.token_ids for o in plain.generate(prompts, params)]
    plain_rates = [plain.generate(prompts, params)[0].metrics["decode_tokens_per_s"] for _ in range(a.rounds)]
    rows = [{"engine": "plain", "median": statistics.median(plain_rates), "best": max(plain_rates),
             "rounds": [round(x, 1) for x in plain_rates], "same_tokens": True}]
    for m, e in engines.items():
        r = inprocess_ab.alternate(e, prompts, params, switch, a.rounds)  # (leaves bursts on)
        outs = e.generate(prompts, params)
        same = r["same_tokens"] and [o.token_ids for o in outs] == ref
        rows.append({"engine": f"{m} k<=3", "steps_median": r["off_median"], "steps_best": r["off_best"],
                     "bursts_median": r["on_median"], "bursts_best": r["on_best"], "paired_median": r["paired_median"],
                     "rounds_steps": r["rounds_off"], "rounds_bursts": r["rounds_on"], "same_tokens": same,
                     "spec_metrics": {k: round(v, 3) for k, v in outs[0].metrics.items() if k.startswith("spec_")}})
        print(f"{m}: step by step {r['off_median']:.1f} / bursts {r['on_median']:.1f} tok/s (median), plain "
              f"{rows[0]['median']:.1f}", file=sys.stderr, flush=True)
    t = inprocess_ab.table(
        f"{path.name} int4, batch {B}, greedy decode tok/s: plain steps of speculation one by one / in bursts, "
        f"{a.rounds} alternating rounds",
        ["engine", "steps median", "steps best", "bursts median", "bursts best", "paired", "same tokens"],
        [["plain (no speculation)", "", "", f"{rows[0]['median']:.1f}", f"{rows[0]['best']:.1f}", "", "True"]]
        + [[r["engine"], f"{r['steps_median']:.1f}", f"{r['steps_best']:.1f}", f"{r['bursts_median']:.1f}",
            f"{r['bursts_best']:.1f}", f"{r['paired_median']:.3f}x", str(r["same_tokens"])] for r in rows[1:]])
    return inprocess_ab.finish(a, rows, t, {"model": str(path), "batch": B})


if __name__ == "__main__":
    raise SystemExit(main())
