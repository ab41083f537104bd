"""What session 22's layer ops buy: the same engine, the same process, the new whole-layer paths on and off.

    python benchmarks/layer_ops_ab.py [--model DIR ...] [--variants bf16,int4] [--batch 1] [--rounds 6] [--json PATH]

Session 22 let more decoder layers run a decode step as one op, and so replay from the step plan (decoder.py,
_StepPlan) through its StepProgram: GQA layers (Qwen3-MoE, Llama: ``waferline::gqa_moe_layer``), MLA layers with bf16
projections (``mla_attend_int4`` / ``mla_moe_layer`` taking dense weights) and bf16 dense FFNs (``ffn_residual``).
"Off" returns None from those three argument builders only (GQAttention._block; MLAttention._int4_block and
DenseFFN.residual_args where their weights are dense bf16), so the layers run as before the session (int4 MLA layers
stay one op both ways). Each round runs ``LLM.generate`` (greedy, 64-token prompts, --tokens new tokens per row) both
ways in one process, in alternating order; the table gives the median tok/s of each and the median of the rounds'
paired ratios, and checks that both ways generate the same tokens (the op computes what the modules compute).
Checkpoints: decode_speed.py's (run it once to build them). int4: RTN groups of 128 with an int8 LM head, as
decode_speed.py's waferline int4; bf16: a 16-bit head.
"""

from __future__ import annotations

import inprocess_ab


def _switch():
    """(on, off): install the session-22 argument builders, or wrappers that decline what they newly accept."""
    from waferline.model.attention import GQAttention, MLAttention
    from waferline.model.moe import DenseFFN

    mla, gqa, dense = MLAttention._int4_block, GQAttention._block, DenseFFN.residual_args

    def mla_old(self, x, cache):  # noqa: ANN001
        args = mla(self, x, cache)
        return None if args is not None and args[6] else args  # (dense projections: new)

    def dense_old(self, x):  # noqa: ANN001
        args = dense(self, x)
        return None if args is not None and args[-3] == 0 else args  # (group 0: dense bf16 weights, new)

    def on() -> None:
        MLAttention._int4_block, GQAttention._block, DenseFFN.residual_args = mla, gqa, dense

    def off() -> None:
        MLAttention._int4_block, GQAttention._block = mla_old, lambda self, x, cache: None
        DenseFFN.residual_args = dense_old

    return on, off


def main(argv: list[str] | None = None) -> int:
    got = inprocess_ab.start(__doc__, argv)
    if got is None:
        return 1
    a, models, variants, batches, params = got
    on, off = _switch()
    rows = []
    try:
        for name, variant, B, r in inprocess_ab.cells(models, variants, batches, params,
                                                      lambda new: (on if new else off)(), a.rounds):
            row = {"model": name, "variant": variant, "batch": B, "before_median": r["off_median"],
                   "after_median": r["on_median"], "paired_median": r["paired_median"],
                   "same_tokens": r["same_tokens"], "rounds_before": r["rounds_off"], "rounds_after": r["rounds_on"]}
            rows.append(row)
            print(f"{name} {variant} b={B}: before {row['before_median']:.1f} / after {row['after_median']:.1f} "
                  f"tok/s (median), paired {row['paired_median']:.3f}x, same tokens {row['same_tokens']}", flush=True)
    finally:
        on()
    t = inprocess_ab.table(
        f"decode tok/s (aggregate), {a.threads} threads: session 22's layer ops off / on, {a.rounds} alternating rounds",
        ["model", "variant", "batch", "before (median)", "after (median)", "paired", "same tokens"],
        [[r["model"], r["variant"], str(r["batch"]), f"{r['before_median']:.1f}", f"{r['after_median']:.1f}",
          f"{r['paired_median']:.3f}x", str(r["same_tokens"])] for r in rows])
    return inprocess_ab.finish(a, rows, t)


if __name__ == "__main__":
    raise SystemExit(main())
