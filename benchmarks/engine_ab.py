"""The same engine workloads under two source trees, alternated in one run: a change's speed beside its baseline.

    git worktree add /tmp/base HEAD~1      # the baseline tree (any checkout of waferline)
    python benchmarks/engine_ab.py --baseline /tmp/base --model models/sol-mini --stages 2 --micro-batches 2

Each case runs in a fresh process per tree (``PYTHONPATH=<tree>/src``), the trees alternating, ``--rounds`` times;
the table shows each tree's best and median. Cases: ``batch`` (``--batch`` prompts of 32 tokens decoding
``--max-tokens`` tokens together, greedy unless ``--temperature``: aggregate decode tokens/s), ``single`` (one
prompt: tokens/s per user) and ``ttft`` (one prompt of ``--long`` tokens, one token out: time to first token). The
outputs of the two trees are compared (``same`` column; with ``--temperature`` they differ where the trees sample
differently). Writes ``benchmarks/results/engine_ab.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import torch
from waferline import LLM, SamplingParams
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
kw = {}
if a["stages"] > 1:
    kw = dict(stages=a["stages"], micro_batches=a["micro_batches"], threads_per_stage=a["threads"])
with LLM(a["model"], dtype=a["dtype"], **kw) as llm:
    V = llm.spec.vocab_size
    case = a["case"]
    if case == "ttft":
        prompts, n = [[(7 * j + 3) % V for j in range(a["long"])]], 1
    elif case == "single":
        prompts, n = [[(5 * j + 1) % V for j in range(32)]], a["max_tokens"]
    else:
        prompts, n = [[(i * 11 + 5 * j + 1) % V for j in range(32)] for i in range(a["batch"])], a["max_tokens"]
    t = a["temperature"]
    p = SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=0 if t else None)
    llm.generate(prompts, SamplingParams(max_tokens=min(n, 4), ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, p)
    wall = time.perf_counter() - t0
    m = outs[0].metrics
    print(json.dumps({"wall_s": wall, "ttft_s": m["ttft_s"], "decode_tokens_per_s": m["decode_tokens_per_s"],
                      "tokens": [o.token_ids for o in outs]}))
"""

CASES = {"batch": ("decode_tokens_per_s", "aggregate decode tok/s", True),
         "single": ("decode_tokens_per_s", "tok/s per user", True),
         "ttft": ("ttft_s", "TTFT s", False)}


def run_case(tree: Path, args: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], env=env, capture_output=True, text=True,
                         timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{tree} {args['case']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    from waferline.argtypes import positive_int

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the baseline source tree (a checkout with src/waferline)")
    ap.add_argument("--tree", default=str(ROOT), help="the tree under test (default: this checkout)")
    ap.add_argument("--model", default=str(ROOT / "models" / "sol-mini"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long", type=int, default=1024, help="prompt tokens of the ttft case")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (seeded per request, so both trees draw the same way; default greedy)")
    ap.add_argument("--cases", default="batch,single,ttft")
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine_ab.json"))
    a = ap.parse_args()
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(a.out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    trees = {"baseline": Path(a.baseline).resolve(), "tree": Path(a.tree).resolve()}
    for name, t in trees.items():
        if not (t / "src" / "waferline").is_dir():
            ap.error(f"--{name} {t}: no src/waferline there")
    cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; choose from {sorted(CASES)}")
    runs: dict[str, dict[str, list[dict]]] = {c: {"baseline": [], "tree": []} for c in cases}
    for r in range(a.rounds):
        for c in cases:
            for name in (("baseline", "tree") if r % 2 == 0 else ("tree", "baseline")):
                args = {"case": c, "model": a.model, "dtype": a.dtype, "stages": a.stages,
                        "micro_batches": a.micro_batches, "threads": a.threads, "batch": a.batch,
                        "max_tokens": a.max_tokens, "long": a.long, "temperature": a.temperature}
                res = run_case(trees[name], args)
                runs[c][name].append(res)
                print(f"round {r + 1}/{a.rounds} {c:6s} {name:8s} {res[CASES[c][0]]:.4g}", file=sys.stderr, flush=True)
    rows = []
    layout = f"stages {a.stages} x micro-batches {a.micro_batches}" if a.stages > 1 else "one process"
    print(f"\n{a.model}, {layout}, {a.threads} thread(s) per process, temperature {a.temperature}, {a.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':8s} {'figure':24s} {'baseline best / median':>24s} {'tree best / median':>22s} {'ratio':>6s} same")
    for c in cases:
        key, label, higher = CASES[c]
        pick = max if higher else min
        b = [x[key] for x in runs[c]["baseline"]]
        t = [x[key] for x in runs[c]["tree"]]
        same = runs[c]["baseline"][0]["tokens"] == runs[c]["tree"][0]["tokens"]
        ratio = pick(t) / pick(b) if higher else pick(b) / pick(t)
        rows.append({"case": c, "figure": label, "baseline": b, "tree": t, "ratio_tree_over_baseline": ratio,
                     "same_tokens": same})
        print(f"{c:8s} {label:24s} {pick(b):11.4g} / {statistics.median(b):<10.4g} {pick(t):10.4g} / "
              f"{statistics.median(t):<10.4g} {ratio:6.2f} {same}")
    print("(ratio > 1: the tree is faster)")
    write_text_atomic(a.out, json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor()
                                         or platform.machine(), "cpus": os.cpu_count(), "args": vars(a),
                                         "trees": {k: str(v) for k, v in trees.items()}, "rows": rows}, indent=1),
                      make_parents=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
