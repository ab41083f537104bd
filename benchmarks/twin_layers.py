"""Where the twin's host model is off, layer by layer: one decode (or speculative verify) step of a checkpoint on the
single-process engine, timed per layer (forward hooks, the process's CPU time, 1 thread), beside what sim/host.py
prices each layer's counted op stream at with a calibrated hardware YAML.

    waferline calibrate --out host.yaml
    python benchmarks/twin_layers.py --model models/sol-mini --hardware host.yaml [--speculative mtp] [--batch 8]
    [--json F]

The step is (generating N + 1 tokens - generating 1) / N steps, the fastest of 3, after a warm-up (one-time weight
layouts excluded); for a speculative run a step is one verify step (k = 3, fixed). The priced columns are the host
model's terms for the layer: per-op overhead, linears (tables x scales + the per-call cost of 2+ row products),
other bytes and the fused operators. "other" is everything outside the layers (embedding, head, sampling, drafting,
the engine loop) against its priced ops + the per-step and per-sequence overheads. A diagnostic: the twin itself never
times layers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--hardware", required=True, help="hardware YAML written by `waferline calibrate` on this machine")
    ap.add_argument(
        "--speculative", default="none", choices=["none", "ngram", "mtp"], help="time a verify step (k = 3)"
    )
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    ap.add_argument("--steps", type=int, default=31, help="decode steps per timed run (default 31)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        print(f"error: {args.model} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    if args.json:
        try:  # (before the run: a path that cannot be written fails here, not after the run)
            check_writable(args.json, "--json")
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    import torch
    from rich.console import Console
    from rich.table import Table

    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams
    from waferline.sim.host import HostParams, Work, _work_time
    from waferline.sim.twin_engine import count_ops, make_prompts

    try:
        host = HostParams.load(args.hardware)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    n = args.steps
    ops = count_ops(args.model, "bfloat16", args.speculative, 3, args.batch, 1, 32, steps=n)
    comp = "bf16"
    c_op = host.op_overhead_s[comp]
    multi_s = host.multi_call_overhead_s.get(comp, 0.0)

    kw = ({"speculative": args.speculative, "num_speculative_tokens": 3, "speculative_adaptive": False}
          if args.speculative != "none" else {})
    llm = LLM(args.model, dtype="bfloat16", **kw)
    # the linear tables of weights from memory unless the model's weights fit in the last-level cache
    hot = host.cached(float(sum(t.numel() * t.element_size() for t in llm.model.parameters())))

    def price(d: dict) -> tuple[float, float, float]:
        return _work_time(host, Work.from_counts(d.get("ops", 0.0), d), c_op, comp, hot=hot, multi_s=multi_s)

    spent: dict[int, list[float]] = {}
    for i, layer in zip(llm.model.layer_range, llm.model.layers):
        # (the clock of the step below: this process's CPU time; a layer timed by the wall clock counts the time a
        # busy host runs other work, and "other" = step - layers went below zero)
        layer.register_forward_pre_hook(lambda m, a, i=i: spent.setdefault(i, [0.0]).append(time.process_time()))
        layer.register_forward_hook(lambda m, a, o, i=i: spent[i].__setitem__(0, spent[i][0] + time.process_time()
                                                                               - spent[i].pop()))
    prompts = make_prompts(llm.spec.vocab_size, args.batch, 32)
    gen = lambda k: llm.generate(prompts, SamplingParams(max_tokens=k, ignore_eos=True))  # noqa: E731
    gen(n + 1)  # warm-up
    best = None
    for _ in range(3):
        spent.clear()
        t0 = time.process_time()
        gen(1)
        t1 = time.process_time()
        one = {i: v[0] for i, v in spent.items()}
        spent.clear()
        out = gen(n + 1)
        t2 = time.process_time()
        steps = float(out[0].metrics.get("spec_verify_steps", n)) if args.speculative != "none" else float(n)
        step = ((t2 - t1) - (t1 - t0)) / steps
        if best is None or step < best[0]:
            best = (step, {i: (v[0] - one.get(i, 0.0)) / steps for i, v in spent.items()})
    assert best is not None
    step, layers = best
    rows = []
    for i in sorted(layers):
        p = price(ops["decode"]["layers"][i])
        rows.append({"part": f"layer {i}", "measured_s": layers[i], "priced_s": sum(p), "ops_s": p[0], "linear_s": p[1],
                     "other_s": p[2], "ops": ops["decode"]["layers"][i].get("ops", 0.0)})
    p = price(ops["decode"]["other"])
    extra = (host.spec_step_overhead_s if args.speculative != "none" else host.step_overhead_s).get(comp, 0.0) \
        + args.batch * host.row_overhead_s.get(comp, 0.0)
    rows.append({"part": "other", "measured_s": step - sum(layers.values()), "priced_s": sum(p) + extra, "ops_s": p[0],
                 "linear_s": p[1], "other_s": p[2] + extra, "ops": ops["decode"]["other"].get("ops", 0.0)})
    t = Table(
        title=f"{Path(args.model).name}: one {'verify' if args.speculative != 'none' else 'decode'} step, batch "
        f"{args.batch}, measured {step * 1e3:.2f} ms vs priced {sum(r['priced_s'] for r in rows) * 1e3:.2f} ms"
    )
    for c in (
        "part",
        "aten ops",
        "measured ms",
        "priced ms",
        "meas / priced",
        "per-op ms",
        "linears ms",
        "bytes + fused ms",
    ):
        t.add_column(c, justify="left" if c == "part" else "right")
    for r in rows:
        t.add_row(r["part"], f"{r['ops']:.0f}", f"{r['measured_s'] * 1e3:.3f}", f"{r['priced_s'] * 1e3:.3f}",
                  f"{r['measured_s'] / max(r['priced_s'], 1e-12):.2f}", f"{r['ops_s'] * 1e3:.3f}",
                  f"{r['linear_s'] * 1e3:.3f}", f"{r['other_s'] * 1e3:.3f}")
    Console().print(t)
    if args.json:
        write_text_atomic(
            args.json,
            json.dumps(
                {
                    "model": args.model,
                    "hardware": args.hardware,
                    "speculative": args.speculative,
                    "batch": args.batch,
                    "step_s": step,
                    "rows": rows,
                },
                indent=1,
            ),
            make_parents=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
