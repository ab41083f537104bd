"""What greedy decode in bursts buys: the same engine, the same process, bursts of 8 steps and step by step.

    python benchmarks/burst_ab.py [--model DIR ...] [--variants bf16,int4] [--batch 1,8] [--rounds 6] [--json PATH]

With greedy sampling the engine runs up to ``GREEDY_BURST`` (8) decode steps back to back from one Python call
(``DecoderModel.greedy_steps``: every step's per-step tensors made first, then the whole-step program run step after
step, each step's greedy tokens the next one's input); ``GREEDY_BURST = 1`` runs them step by step, with the Python of
each step between steps. Each round runs ``LLM.generate`` (decode_speed.py's checkpoints as its bf16 variant, 16-bit
head, or its int4 one, int8 head; greedy, 64-token prompts, --tokens new tokens per row) both ways in one process, in
alternating order; a table gives the best and median decode tok/s of each and the median of the rounds' paired ratios,
and checks that both ways generate the same tokens.
"""

from __future__ import annotations

import sys

import inprocess_ab


def main(argv: list[str] | None = None) -> int:
    got = inprocess_ab.start(__doc__, argv)
    if got is None:
        return 1
    a, models, variants, batches, params = got
    import waferline.engine.llm as llm_mod

    def switch(on: bool) -> None:
        llm_mod.GREEDY_BURST = 8 if on else 1

    rows = []
    for name, variant, B, r in inprocess_ab.cells(models, variants, batches, params, switch, a.rounds):
        row = {"model": name, "variant": variant, "batch": B, "steps_best": r["off_best"],
               "steps_median": r["off_median"], "bursts_best": r["on_best"], "bursts_median": r["on_median"],
               "paired_median": r["paired_median"], "same_tokens": r["same_tokens"],
               "rounds_steps": r["rounds_off"], "rounds_bursts": r["rounds_on"]}
        rows.append(row)
        print(f"{name} {variant} b={B}: step by step {row['steps_median']:.1f} / bursts {row['bursts_median']:.1f} "
              f"tok/s (median), paired {row['paired_median']:.3f}x, same tokens {row['same_tokens']}", file=sys.stderr,
              flush=True)
    t = inprocess_ab.table(
        f"greedy decode tok/s (aggregate), {a.threads} threads: step by step / bursts of 8, {a.rounds} alternating rounds",
        ["model", "variant", "batch", "steps best", "steps median", "bursts best", "bursts median", "paired",
         "same tokens"],
        [[r["model"], r["variant"], str(r["batch"]), f"{r['steps_best']:.1f}", f"{r['steps_median']:.1f}",
          f"{r['bursts_best']:.1f}", f"{r['bursts_median']:.1f}", f"{r['paired_median']:.3f}x", str(r["same_tokens"])]
         for r in rows])
    return inprocess_ab.finish(a, rows, t)


if __name__ == "__main__":
    raise SystemExit(main())
