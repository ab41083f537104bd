"""What putting the weights in transparent huge pages buys (model/arena.py): the same checkpoint loaded twice in one
process, with ``LLM(huge_pages=True)`` and ``huge_pages=False``, the two engines' decode alternating round by round.

    python benchmarks/huge_pages_ab.py [--model DIR ...] [--variants bf16,int4] [--batch 1] [--rounds 6] [--json PATH]

A CPU decode step reads every active weight from DRAM once per token; in 4 KiB pages that stream crosses a page (and
may miss the TLB) every 4 KiB, in 2 MiB pages every 2 MiB. The script also times a torch copy of 256 MiB in each kind
of page, which is what decode_speed.py's roofline rests on. It prints the kernel's THP mode and how much of each
engine's weight arena the kernel actually backs with huge pages (/proc/self/smaps): where that is 0 (THP ``never``,
or no free huge pages) the two settings are the same and the ratio is noise. Both settings must generate the same
tokens (the same weights, bit for bit). Checkpoints: decode_speed.py's (run it once to build them). int4: RTN groups
of 128 with an int8 LM head, as decode_speed.py's waferline int4; bf16: a 16-bit head.
"""

from __future__ import annotations

from typing import Any

import inprocess_ab
from decode_speed import copy_bandwidths


class _Either:
    """One engine to ``inprocess_ab.alternate``: the switch picks which of the two loaded ones generates."""

    def __init__(self, on: Any, off: Any) -> None:
        self.engines, self.current = {True: on, False: off}, on

    def switch(self, on: bool) -> None:
        self.current = self.engines[on]

    def generate(self, prompts: Any, params: Any) -> Any:
        return self.current.generate(prompts, params)


def main(argv: list[str] | None = None) -> int:
    got = inprocess_ab.start(__doc__, argv)
    if got is None:
        return 1
    a, models, variants, batches, params = got
    from waferline import LLM
    from waferline.model.arena import thp_mode
    small, huge = copy_bandwidths()
    print(f"transparent huge pages: {thp_mode()}; torch copy 256 MiB: {small / 1e9:.1f} GB/s in 4 KiB pages, "
          f"{huge / 1e9:.1f} GB/s in huge pages", flush=True)
    rows = []
    for name, path in models:
        for variant in variants:
            bits = inprocess_ab.VARIANTS[variant]
            both = _Either(LLM(str(path), dtype="bfloat16", huge_pages=True, **bits),
                           LLM(str(path), dtype="bfloat16", huge_pages=False, **bits))
            arena = both.engines[True].arena
            arena_mb = arena.nbytes / 1e6 if arena else 0.0
            huge_mb = (arena.huge_bytes() or 0) / 1e6 if arena else 0.0
            V = both.engines[True].spec.vocab_size
            for B in batches:
                prompts = [[(3 + 7 * b + 13 * i) % V for i in range(64)] for b in range(B)]
                r = inprocess_ab.alternate(both, prompts, params, both.switch, a.rounds)
                row = {"model": name, "variant": variant, "batch": B, "arena_MB": round(arena_mb, 1),
                       "huge_MB": round(huge_mb, 1), "small_pages_median": r["off_median"],
                       "huge_pages_median": r["on_median"], "paired_median": r["paired_median"],
                       "same_tokens": r["same_tokens"], "rounds_small_pages": r["rounds_off"],
                       "rounds_huge_pages": r["rounds_on"]}
                rows.append(row)
                print(f"{name} {variant} b={B}: arena {arena_mb:.0f} MB ({huge_mb:.0f} MB huge); 4 KiB pages "
                      f"{row['small_pages_median']:.1f} / huge pages {row['huge_pages_median']:.1f} tok/s (median), "
                      f"paired {row['paired_median']:.3f}x, same tokens {row['same_tokens']}", flush=True)
            del both
    t = inprocess_ab.table(
        f"decode tok/s (aggregate), {a.threads} threads: weights in 4 KiB pages / in huge pages, {a.rounds} alternating "
        f"rounds (THP {thp_mode()}; copy {small / 1e9:.1f} / {huge / 1e9:.1f} GB/s)",
        ["model", "variant", "batch", "arena MB (huge)", "4 KiB pages (median)", "huge pages (median)", "paired",
         "same tokens"],
        [[r["model"], r["variant"], str(r["batch"]), f"{r['arena_MB']:.0f} ({r['huge_MB']:.0f})",
          f"{r['small_pages_median']:.1f}", f"{r['huge_pages_median']:.1f}", f"{r['paired_median']:.3f}x",
          str(r["same_tokens"])] for r in rows])
    return inprocess_ab.finish(a, rows, t, {"thp": thp_mode(), "copy_GBps_small_pages": round(small / 1e9, 2),
                                            "copy_GBps_huge_pages": round(huge / 1e9, 2)})


if __name__ == "__main__":
    raise SystemExit(main())
