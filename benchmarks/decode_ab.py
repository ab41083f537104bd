"""What a change to the decode step bought: an older revision of waferline against the working tree, same run.

    python benchmarks/decode_ab.py --rev fd94d52 --model models/sol-mini --model DIR ... [--batch 1,8] [--json PATH]
    python benchmarks/decode_ab.py --rev fd94d52 --ops int4:1024x512,int8:32000x512,argmax:32000   # single operators

The older revision's ``src/`` is checked out with ``git worktree`` into a temporary directory; each (revision, model,
dtype/bits, batch) cell runs in its own subprocess with 1 thread (``--threads N``: N threads, timed by the wall
clock), alternating old/new for ``--rounds`` rounds, and reports the best CPU time per decode step
(``time.process_time``: less sensitive to other jobs on a shared machine than wall time, though memory-bandwidth
contention still shows) and the median of the rounds' paired old/new ratios. The step is one decode forward of B rows
(different tokens per row, 64-token prompts already cached) plus logits and argmax, the same for both revisions
(through ``step_logits`` where a revision has it, as its engine runs a step; the same logits).
``--tokens T``: each step feeds T tokens per row instead, the target forward of a speculative verify (Mamba-2
layers record each token's state, as for a rollback) followed by the rollback of its last token (Mamba-2 layers
rewound to T - 1 kept tokens); drafting and acceptance are not in it.
``--prefill P``: each step is instead one prefill forward of B rows of P tokens from fresh caches (what a pipeline
stage runs for a prefill micro-batch) plus the last position's logits and argmax.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STEP = r"""
import json, sys, time, torch
from waferline.model.load import load_model
from waferline.model.context import StepBatch
path, dtype, bits, B, steps, threads, T, P, G, head = (sys.argv[1], sys.argv[2], *map(int, sys.argv[3:11]))
torch.set_num_threads(threads)
clock = time.process_time if threads == 1 else time.perf_counter  # CPU time on one thread, wall time on several
m = load_model(path, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
if bits == 4:
    from waferline.model.quant import QuantOptions, is_int4, quantize_model
    if not is_int4(m):
        quantize_model(m, QuantOptions(group_size=G))
if head != 16:
    m.quantize_head(head)
V = m.spec.vocab_size
caches = m.new_caches(B)
with torch.inference_mode():
    for b in range(B):
        m((torch.arange(3, 67)[None] * (b + 1)) % V, caches, StepBatch.make([b], [0], 64))
    if T > 1:  # a speculative verify's target forward: Mamba-2 layers record every token's state (for a rollback)
        for c in caches:
            if hasattr(c, "keep_trail"):
                c.keep_trail = True
    adv = T - 1 if T > 1 else 1  # a verify keeps T - 1 of its T tokens (its last draft rejected) and rewinds the rest
    def prefill(i):
        fresh = m.new_caches(B)
        toks = (torch.arange(B)[:, None] * 997 + 5 + i + torch.arange(P)[None]) % V
        h = m(toks, fresh, StepBatch.make(list(range(B)), [0] * B, P))
        return m.logits(h[:, -1]).argmax(-1)
    def step(i):
        if P:
            return prefill(i)
        toks = (torch.arange(B)[:, None] * 997 + 5 + i + torch.arange(T)[None]) % V
        batch = StepBatch.make(list(range(B)), [64 + i * adv] * B, T)
        if hasattr(m, "step_logits"):  # (what the engine calls for a step, where the revision has it: the same logits)
            out = m.step_logits(toks, caches, batch, argmax=True)[2]
        else:
            out = m.logits(m(toks, caches, batch)).argmax(-1)
        if T > 1:
            for c in caches:
                if hasattr(c, "rewind"):
                    c.rewind(torch.arange(B), [T - 1] * B)
        return out
    for i in range(3):
        step(i)
    best = float("inf")
    for r in range(3):
        t = clock()
        for i in range(steps):
            step(3 + r * steps + i)
        best = min(best, (clock() - t) / steps)
print(json.dumps({"ms_per_step": best * 1e3}))
"""


OP = r"""
import json, sys, time, torch
from waferline import kernels
from waferline.model.quant import Int4Weight, rtn_quantize
kind, shape, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
assert kernels.available()
torch.manual_seed(0)
dims = [int(v) for v in shape.split("x")]
if kind == "int4":  # one row (a batch-1 decode step) through an N x K int4 weight, groups of 128, bf16 activations
    N, K = dims
    q = Int4Weight(rtn_quantize(torch.randn(N, K), 128, symmetric=False), compute_dtype=torch.bfloat16)
    x = torch.randn(1, K).to(torch.bfloat16)
    f = lambda: torch.ops.waferline.int4_linear(x, q.packed, q.scales_zeros, 128)
elif kind == "int8":  # one row through an N x K int8 weight (the LM head's kernel)
    N, K = dims
    w, sc = torch.randint(-127, 128, (N, K), dtype=torch.int8), (torch.rand(N) * 0.01).to(torch.bfloat16)
    x = torch.randn(1, K).to(torch.bfloat16)
    f = lambda: torch.ops.waferline.int8_linear(x, w, sc)
elif kind == "bf16":  # one row through an N x K bf16 weight (linear_rows: the few-row bf16 kernel)
    N, K = dims
    w, x = torch.randn(N, K).to(torch.bfloat16), torch.randn(1, K).to(torch.bfloat16)
    f = lambda: torch.ops.waferline.linear_rows(x, w)
elif kind == "argmax":  # greedy sampling over V logits
    logits = torch.randn(1, dims[0])
    from waferline.engine.sampling import SamplingParams, sample
    f = lambda: sample(logits[0], SamplingParams(temperature=0.0), None)
elif kind == "gqa":  # decode attention, bf16: B rows of one token, L cached keys, H heads over Hkv kv heads of size D
    B, L, H, Hkv, D = dims
    q, kv = torch.randn(B, 1, H, D).to(torch.bfloat16), torch.randn(B, L, 2 * Hkv, D).to(torch.bfloat16)
    none, nos = torch.empty(0, dtype=torch.bool), torch.empty(0)
    f = lambda: torch.ops.waferline.gqa_decode(q, kv, none, nos, D ** -0.5)
elif kind == "mla":  # absorbed MLA decode attention: B rows, L cached latents, H heads, nope n, rope p, rank r, v; bf16 W
    B, L, H, n, p, r, v = dims
    qn, qr, lat = torch.randn(B, 1, H, n), torch.randn(B, 1, H, p), torch.randn(B, L, r + p)
    wuk, wuv = (torch.randn(H, n, r) * 0.1).to(torch.bfloat16), (torch.randn(H, v, r) * 0.1).to(torch.bfloat16)
    none = torch.empty(0, dtype=torch.bool)
    f = lambda: torch.ops.waferline.mla_decode(qn, qr, lat, none, wuk, wuv, 0.1, torch.bfloat16)
else:
    raise SystemExit(f"unknown op kind {kind!r} (int4, int8, bf16, argmax, gqa, mla)")
for _ in range(50):
    f()
n = 200
best = float("inf")
for _ in range(15):
    t = time.perf_counter()
    for _ in range(n):
        f()
    best = min(best, (time.perf_counter() - t) / n)
print(json.dumps({"us_per_call": best * 1e6}))
"""


def _env(src: Path, threads: int) -> dict[str, str]:
    """A run's environment: ``src`` on the path and, for a checkout other than this one, its own kernel build
    directory (two checkouts of the same cpu_ops.cpp would share one, each rebuilding it over the other's paths)."""
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(threads))
    if src.resolve() != (ROOT / "src").resolve():
        env["WAFERLINE_KERNELS_DIR"] = str(src.parent / ".kernels")
    return env


def run_op(src: Path, kind: str, shape: str, threads: int) -> float:
    env = _env(src, threads)
    out = subprocess.run([sys.executable, "-c", OP, kind, shape, str(threads)], env=env, capture_output=True, text=True,
                         timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{src}: {kind} {shape} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["us_per_call"]


def run_cell(src: Path, model: str, dtype: str, bits: int, batch: int, steps: int, threads: int = 1,
             tokens: int = 1, prefill: int = 0, group: int = 128, head_bits: int = 16) -> float:
    env = _env(src, threads)
    out = subprocess.run([sys.executable, "-c", STEP, model, dtype, str(bits), str(batch), str(steps), str(threads),
                          str(tokens), str(prefill), str(group), str(head_bits)], env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{src}: {model} {dtype} w{bits} b{batch} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["ms_per_step"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True, help="the older revision to compare against (e.g. a commit before the change)")
    ap.add_argument("--model", action="append", default=[], help="checkpoint directory (repeatable)")
    ap.add_argument("--ops", default="", metavar="KIND:SHAPE,...",
                    help="time single operators instead of decode steps, e.g. int4:1024x512,int8:32000x512,argmax:32000 "
                         "(int4 / int8 / bf16: one row through an N x K weight; argmax: greedy sampling over V logits; "
                         "gqa:BxLxHxHkvxD / mla:BxLxHxNxPxRxV: decode attention of B rows over L cached positions); "
                         "microseconds per call, best of 15 blocks of 200 calls")
    ap.add_argument("--variants", default="bf16:16,bf16:4", help="dtype:weight-bits pairs (default bf16:16,bf16:4)")
    ap.add_argument("--batch", default="1,8", help="batch sizes (default 1,8)")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per timing block (best of 3 blocks)")
    ap.add_argument("--rounds", type=int, default=2, help="old/new alternations per cell: the best of each side is kept, and the median of the rounds' "
                         "old/new ratios is reported beside it ('paired': each round's two runs are adjacent in time, so "
                         "on a machine whose speed drifts it is the steadier of the two)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: CPU time per step; more: wall time per step, noisier)")
    ap.add_argument("--tokens", type=int, default=1,
                    help="tokens per row per step (default 1; T > 1: a speculative verify's forward of T tokens, "
                         "Mamba-2 states recorded per token, then rewound to T - 1 kept tokens)")
    ap.add_argument("--prefill", type=int, default=0, metavar="P",
                    help="time prefill forwards of P tokens per row from fresh caches instead of decode steps")
    ap.add_argument("--group", type=int, default=128,
                    help="int4 group size (default 128, the engine's; sessions up to 15 measured 32)")
    ap.add_argument("--head-bits", type=int, default=16, choices=(16, 8),
                    help="LM head bits (8: int8, as LLM(head_bits=8) and decode_speed.py's int4 run it)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.prefill < 0 or args.tokens < 1:
        ap.error("--prefill must be >= 0 and --tokens >= 1")
    if not args.model and not args.ops:
        ap.error("give --model (decode steps) or --ops (single operators)")
    ops = [tuple(o.split(":", 1)) for o in args.ops.split(",") if o]
    if any(len(o) != 2 for o in ops):
        ap.error("--ops takes KIND:SHAPE items, e.g. int4:1024x512")
    from rich.console import Console
    from rich.table import Table

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", args.rev + "^{commit}"],
                            capture_output=True, text=True)
    if commit.returncode != 0:
        ap.error(f"--rev {args.rev!r} is not a commit of {ROOT}")
    with tempfile.TemporaryDirectory() as tmp:
        wt = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(wt), args.rev], check=True,
                       capture_output=True)
        try:
            rows = []
            for kind, shape in ops:
                olds, news = [], []
                for _ in range(args.rounds):
                    olds.append(run_op(wt / "src", kind, shape, args.threads))
                    news.append(run_op(ROOT / "src", kind, shape, args.threads))
                paired = statistics.median(o / n for o, n in zip(olds, news))
                rows.append({"op": kind, "shape": shape, "old_us": min(olds), "new_us": min(news),
                             "speedup": min(olds) / min(news), "paired_speedup": paired, "rounds_old_us": olds,
                             "rounds_new_us": news})
                print(f"{kind} {shape}: {min(olds):.1f} -> {min(news):.1f} us ({min(olds) / min(news):.2f}x; median of "
                      f"the rounds' ratios {paired:.2f}x)", file=sys.stderr)
            for model in args.model:
                for variant in args.variants.split(","):
                    dtype, bits = variant.split(":")
                    for b in (int(x) for x in args.batch.split(",")):
                        olds, news = [], []
                        for _ in range(args.rounds):
                            olds.append(run_cell(wt / "src", model, dtype, int(bits), b, args.steps, args.threads,
                                                 args.tokens, args.prefill, args.group, args.head_bits))
                            news.append(run_cell(ROOT / "src", model, dtype, int(bits), b, args.steps, args.threads,
                                                 args.tokens, args.prefill, args.group, args.head_bits))
                        old, new = min(olds), min(news)
                        paired = statistics.median(o / n for o, n in zip(olds, news))
                        rows.append({"model": model, "dtype": dtype, "weight_bits": int(bits), "batch": b,
                                     "tokens_per_row": args.tokens, "prefill_tokens": args.prefill,
                                     "group": args.group if int(bits) == 4 else None, "head_bits": args.head_bits,
                                     "old_ms": old, "new_ms": new, "speedup": old / new, "paired_speedup": paired,
                                     "rounds_old_ms": olds, "rounds_new_ms": news})
                        print(f"{model} {variant} b{b}: {old:.2f} -> {new:.2f} ms ({old / new:.2f}x; median of the "
                              f"rounds' ratios {paired:.2f}x)", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], capture_output=True)
    clock = "CPU ms per step (1 thread)" if args.threads == 1 else f"wall ms per step ({args.threads} threads)"
    what = (f"prefill forward ({args.prefill} tokens per row)" if args.prefill else
            "decode step" if args.tokens == 1 else f"verify-shaped step ({args.tokens} tokens per row)")
    if ops:
        t = Table(title=f"single operators, us per call ({args.threads} thread(s)): {args.rev} vs working tree")
        for c in ("op", "shape", "old us", "new us", "speed-up", "paired"):
            t.add_column(c, justify="left" if c == "op" else "right")
        for r in rows:
            if "op" in r:
                t.add_row(r["op"], r["shape"], f"{r['old_us']:.1f}", f"{r['new_us']:.1f}", f"{r['speedup']:.2f}x",
                          f"{r['paired_speedup']:.2f}x")
        Console().print(t)
    t = Table(title=f"{what}, {clock}: {args.rev} vs working tree")
    rate = "new tok/s/row" if args.tokens == 1 and not args.prefill else "new steps/s"
    for c in ("model", "dtype", "weights", "batch", "old ms", "new ms", "speed-up", "paired", rate):
        t.add_column(c, justify="right" if c not in ("model",) else "left")
    for r in (r for r in rows if "model" in r):
        name = Path(r["model"]).name if Path(r["model"]).name != "hf" else Path(r["model"]).parent.name  # .cache/<m>/hf
        t.add_row(name, r["dtype"], f"int{r['weight_bits']}" if r["weight_bits"] == 4 else "16-bit",
                  str(r["batch"]), f"{r['old_ms']:.2f}", f"{r['new_ms']:.2f}", f"{r['speedup']:.2f}x",
                  f"{r['paired_speedup']:.2f}x", f"{1e3 / r['new_ms']:.0f}")
    if args.model:
        Console().print(t)
    if args.json:
        Path(args.json).write_text(json.dumps({"rev": args.rev, "commit": commit.stdout.strip(), "threads": args.threads,
                                               "tokens_per_row": args.tokens, "prefill_tokens": args.prefill,
                                               "load_avg": os.getloadavg(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
