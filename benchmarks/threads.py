"""Decode tokens/s of one greedy request by torch intra-op threads and OpenMP wait policy, on an idle machine and
beside busy processes: what a default thread count costs or saves where other work shares the cores.

Each case runs `waferline generate --json` in a fresh process (OpenMP reads its environment once, at start) with
``OMP_NUM_THREADS`` and, where named, ``OMP_WAIT_POLICY``; "busy" cases start that many pure-Python busy loops first
(one per core they take) and stop them after. Best of ``--repeats`` per case; the cases of one repeat run back to back
and the repeats interleave, so a slow minute of a shared host falls on every case. Prints a table (and with --out
writes it as JSON).

    python benchmarks/threads.py                               # sol-mini, ~2 minutes on a 2-core CPU
    python benchmarks/threads.py --model PATH --weight-bits 4 --busy 0,1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _spin() -> None:
    while True:
        pass


def decode_tok_s(model: str, threads: int, policy: str | None, tokens: int, weight_bits: int, dtype: str) -> float:
    """One `waferline generate` of ``tokens`` greedy tokens in a fresh process: its decode tokens/s."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, "-m", "waferline", "generate", "--model", model, "--prompt-ids", "5 6 7 8 9 10 11 12",
           "--max-tokens", str(tokens), "--weight-bits", str(weight_bits), "--dtype", dtype, "--json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "sol-mini"), help="checkpoint (default models/sol-mini)")
    ap.add_argument("--weight-bits", type=int, default=16, choices=[16, 4])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens per run (default 128)")
    ap.add_argument("--busy", default="0,1", help="busy processes beside the run, comma-separated (default 0,1)")
    ap.add_argument("--threads", default=None, help="thread counts (default 1 and the cores)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per case; the best counts (default 3)")
    ap.add_argument("--out", default=None, help="also write the rows as JSON to this file")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, cores})
    cases = [(b, t, p) for b in (int(x) for x in args.busy.split(",")) for t in threads
             for p in ((None, "PASSIVE") if t > 1 else (None,))]
    best: dict[tuple, float] = {}
    for r in range(args.repeats):
        for busy, t, policy in cases:
            procs = [mp.Process(target=_spin, daemon=True) for _ in range(busy)]
            for p in procs:
                p.start()
            try:
                time.sleep(0.2 if busy else 0)
                v = decode_tok_s(args.model, t, policy, args.tokens, args.weight_bits, args.dtype)
            finally:
                for p in procs:
                    p.terminate()
                    p.join()
            best[(busy, t, policy)] = max(best.get((busy, t, policy), 0.0), v)
            print(f"  repeat {r + 1}/{args.repeats}: busy {busy}, {t} thread(s), wait policy {policy or 'default'}: "
                  f"{v:.1f} tok/s", file=sys.stderr)
    rows = [{"busy_processes": b, "threads": t, "omp_wait_policy": p or "default", "decode_tok_s": best[(b, t, p)]}
            for b, t, p in cases]
    print(f"\n{Path(args.model).name}, {args.dtype}, int{args.weight_bits} weights" if args.weight_bits == 4 else
          f"\n{Path(args.model).name}, {args.dtype}", f"; {cores} cores; best of {args.repeats}; greedy, batch 1,"
          f" {args.tokens} tokens\n")
    print("| busy processes | threads | OpenMP wait policy | decode tok/s | vs 1 thread |")
    print("|---|---|---|---|---|")
    for row in rows:
        one = best[(row["busy_processes"], 1, None)] if (row["busy_processes"], 1, None) in best else None
        rel = f"{row['decode_tok_s'] / one:.2f}x" if one else "-"
        print(f"| {row['busy_processes']} | {row['threads']} | {row['omp_wait_policy']} | {row['decode_tok_s']:.1f} "
              f"| {rel} |")
    if not args.out:
        return
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "weight_bits": args.weight_bits,
                               "tokens": args.tokens, "repeats": args.repeats, "cores": cores,
                               "cpu": platform.processor() or platform.machine(),
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, indent=1))
    tmp.replace(args.out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
