"""What session 32 changed in the server's decode steps, measured in one process: the scheduler's steps (no HTTP)
with and without each change, alternating.

    python benchmarks/serve_step_ab.py [--model DIR ...] [--variant int4|bf16] [--batch 1,8] [--tokens 128]
                                       [--switch tail|detok] [--rounds 6] [--json PATH]

``--switch tail``: a decode step through ``step_logits`` (with an int8 / bf16 / fp32 head on this CPU's operators,
the embedding, the layers, the head and the argmax as one program; greedy rows take its argmax) against the
layers' program followed by the head and the sampler from Python (the scheduler before this change: the same
logits). ``--switch detok``: the output text decoded incrementally (``Scheduler._text``) against the whole output
decoded again every token (before); long outputs show the difference (default there: sol-mini, 1024 tokens).
Each round feeds ``--batch`` greedy requests of 64-token prompts to a ``Scheduler`` and steps it until they finish;
decode tok/s = tokens after each request's first over the time after the last first token. A table gives the
median tok/s each way, the median of the rounds' paired ratios (on / off), and whether both ways emitted the same
tokens and text.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import inprocess_ab

SOL = Path(__file__).resolve().parents[1] / "models" / "sol-mini"


def main(argv: list[str] | None = None) -> int:
    ap = inprocess_ab.parser(__doc__, "default: decode_speed.py's checkpoints for tail, sol-mini for detok", "1,8", 6,
                             0)
    ap.add_argument("--variant", default="int4", choices=list(inprocess_ab.VARIANTS), help="weights (default int4)")
    ap.add_argument("--switch", default="tail", choices=["tail", "detok"], help="the change to switch (default tail)")
    a = ap.parse_args(argv)
    tokens = a.tokens or (128 if a.switch == "tail" else 1024)
    if tokens < 2 or a.rounds < 1:
        ap.error("--tokens must be at least 2 and --rounds at least 1")
    try:
        batches = [int(b) for b in a.batch.split(",")]
    except ValueError:
        ap.error(f"--batch: comma-separated batch sizes, got {a.batch!r}")
    paths = [Path(m) for m in a.model] if a.model else (inprocess_ab.CHECKPOINTS if a.switch == "tail" else [SOL])
    if not inprocess_ab.ready(a.threads):
        return 1
    from waferline import LLM, SamplingParams
    from waferline.engine.scheduler import Scheduler, SchedulerConfig, Sequence

    def whole_text(self: Scheduler, seq: Sequence) -> tuple[str, int | None]:  # (before: all of it, every token)
        text = self._decode(seq.output_ids)
        hits = [text.find(s) for s in seq.params.stop if s and s in text]
        return text, (min(hits) if hits else None)

    rows = []
    for path in paths:
        if not (path / "config.json").is_file():
            print(f"{path}: no checkpoint (decode_speed.py builds its own once)", file=sys.stderr)
            continue
        name = path.name if path.name != "hf" else path.parent.name
        llm = LLM(str(path), dtype="bfloat16", **inprocess_ab.VARIANTS[a.variant])
        V, model = llm.spec.vocab_size, llm.model
        held = path / "heldout.txt"
        for B in batches:
            sch = Scheduler(llm, SchedulerConfig(max_num_seqs=B, max_model_len=64 + tokens))
            if held.is_file():
                ids = llm.encode(held.read_text()[: 400 * B])
                prompts = [ids[64 * b: 64 * (b + 1)] for b in range(B)]
            else:
                prompts = [[(3 + 7 * b + 13 * i) % V for i in range(64)] for b in range(B)]

            def switch(on: bool) -> None:
                if a.switch == "tail":
                    if on:
                        model.__dict__.pop("_tail_program", None)
                    else:  # (step_logits then runs the layers, the head and the argmax from Python)
                        model._tail_program = lambda *x: None
                else:
                    if on:
                        sch.__dict__.pop("_text", None)
                    else:
                        sch._text = whole_text.__get__(sch)

            def run() -> tuple[float, list]:
                seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
                        for i, p in enumerate(prompts)]
                texts = {s.request_id: [] for s in seqs}
                for s in seqs:
                    s.sink = lambda ev, r=s.request_id: texts[r].append(ev.text)
                    sch.add(s)
                while any(s.first_token_at is None for s in seqs):
                    sch.step()
                t, n0 = time.perf_counter(), sum(len(s.output_ids) for s in seqs)
                while sch.has_work():
                    sch.step()
                rate = (sum(len(s.output_ids) for s in seqs) - n0) / (time.perf_counter() - t)
                return rate, [(s.output_ids, "".join(texts[s.request_id])) for s in seqs]

            rates, outs = {True: [], False: []}, {}
            for on in (True, False):  # (a warm-up each way)
                switch(on)
                outs[on] = run()[1]
            for r in range(a.rounds):
                for on in ((True, False) if r % 2 else (False, True)):
                    switch(on)
                    rates[on].append(run()[0])
            switch(True)
            med = statistics.median
            row = {"model": name, "variant": a.variant, "batch": B, "tokens": tokens, "switch": a.switch,
                   "off_median": med(rates[False]), "on_median": med(rates[True]),
                   "paired_median": med([p / q for p, q in zip(rates[True], rates[False])]),
                   "same_tokens": outs[True] == outs[False],
                   "rounds_off": [round(x, 1) for x in rates[False]], "rounds_on": [round(x, 1) for x in rates[True]]}
            rows.append(row)
            print(f"{name} b={B}: {row['off_median']:.1f} -> {row['on_median']:.1f} tok/s, paired "
                  f"{row['paired_median']:.3f}x, same tokens and text {row['same_tokens']}", file=sys.stderr,
                  flush=True)
    what = {"tail": "step_logits' whole-step program", "detok": "incremental text"}[a.switch]
    t = inprocess_ab.table(
        f"scheduler decode tok/s (aggregate), {a.threads} threads, {a.variant}: without / with {what}, "
        f"{a.rounds} alternating rounds",
        ["model", "batch", "tokens", "without", "with", "paired", "same tokens"],
        [[r["model"], str(r["batch"]), str(r["tokens"]), f"{r['off_median']:.1f}", f"{r['on_median']:.1f}",
          f"{r['paired_median']:.3f}x", str(r["same_tokens"])] for r in rows])
    a.tokens = tokens
    return inprocess_ab.finish(a, rows, t, {"switch": a.switch, "variant": a.variant})


if __name__ == "__main__":
    raise SystemExit(main())
