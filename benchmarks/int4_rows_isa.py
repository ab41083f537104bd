"""The fp32 int4 row kernel (decode steps of 1-8 rows) built for this CPU and for an AVX2-only CPU, side by side.

    python benchmarks/int4_rows_isa.py                      # builds each variant once (~75 s each), then ~1 min
    python benchmarks/int4_rows_isa.py --march native haswell --n 4096 --k 4096

Each ``--march`` builds waferline's CPU operators with that -march (in its own cache directory, in a subprocess:
one process loads one build) and times ``waferline::int4_linear`` on fp32 activations for 1..8 rows through one
N x K int4 weight (groups of 32, asymmetric), best of --repeats, on one thread. Beside each row count: the same rows
as passes of at most 4 rows (4, then the rest), the dispatch an AVX2-only build uses for 7 and 8 rows (the one-pass
kernel's 7-8 rows keep 14-16 accumulators, which 16 vector registers cannot hold beside the weights). With AVX-512
the compiler has 32 vector registers. -march=haswell runs on any x86-64 CPU with AVX2 + FMA, so this host measures
an AVX2-only build. Every variant's outputs are checked equal, bitwise, to the first's. Writes
benchmarks/results/int4_rows_isa.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "int4_rows_isa"


def measure(march: str, n: int, k: int, repeats: int) -> dict:
    """In this process: build for ``march``, time 1..8 rows one call and in <= 4-row passes; outputs to compare."""
    os.environ["WAFERLINE_KERNELS_DIR"] = str(CACHE / march)
    import waferline.kernels as kernels

    kernels._CFLAGS = [f"-march={march}" if f.startswith("-march") else f for f in kernels._CFLAGS]
    if not kernels.prepare(progress=True):
        raise SystemExit(f"the operators did not build with -march={march}: {kernels.status().get('error')}")
    import torch

    from waferline.model.quant import Int4Weight, rtn_quantize

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q = Int4Weight(rtn_quantize(torch.randn(n, k, generator=g), 32, symmetric=False), compute_dtype=torch.float32)
    x = torch.randn(8, k, generator=g)

    def op(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.waferline.int4_linear(rows, q.packed, q.scales_zeros, 32)

    def best(f) -> float:
        f()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return min(times)

    rows = []
    for m in range(1, 9):
        xs = x[:m].contiguous()
        parts = [xs[i:i + 4].contiguous() for i in range(0, m, 4)]
        rows.append({"rows": m, "one_call_ms": 1e3 * best(lambda: op(xs)),
                     "passes_of_4_ms": 1e3 * best(lambda: [op(p) for p in parts]),
                     "out": hashlib.sha256(op(xs).numpy().tobytes()).hexdigest()})
    return {"march": march, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--march", nargs="+", default=["native", "haswell"], help="-march values to build and time")
    ap.add_argument("--n", type=int, default=4096, help="weight rows (outputs)")
    ap.add_argument("--k", type=int, default=4096, help="weight columns (inputs), a multiple of 32")
    ap.add_argument("--repeats", type=int, default=25, help="timed calls per case (the best is kept)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # (internal: measure one -march in this process)
    args = ap.parse_args()
    if args.k % 32 or args.n % 16 or min(args.n, args.k, args.repeats) < 1:
        ap.error("--k must be a multiple of 32 and --n of 16, both positive; --repeats at least 1")
    if args.one:
        print(json.dumps(measure(args.one, args.n, args.k, args.repeats)))
        return
    runs = []
    for march in args.march:
        cmd = [sys.executable, __file__, "--one", march, "--n", str(args.n), "--k", str(args.k),
               "--repeats", str(args.repeats)]
        print(f"-march={march} ...", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    same = all(a["out"] == b["out"] for r in runs[1:] for a, b in zip(runs[0]["rows"], r["rows"], strict=True))

    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"waferline::int4_linear, fp32 x, int4 {args.n} x {args.k} g32, 1 thread, ms (best of "
                    f"{args.repeats})")
    t.add_column("rows", justify="right")
    for r in runs:
        t.add_column(f"{r['march']}: one call", justify="right")
        t.add_column(f"{r['march']}: passes of <= 4", justify="right")
    for i in range(8):
        t.add_row(str(i + 1), *[f"{c:.2f}" for r in runs for c in (r["rows"][i]["one_call_ms"],
                                                                   r["rows"][i]["passes_of_4_ms"])])
    Console().print(t)
    print(f"outputs bitwise equal across builds: {same}")
    for r in runs:
        for row in r["rows"]:
            del row["out"]
    out = ROOT / "results" / "int4_rows_isa.json"
    out.write_text(json.dumps({"n": args.n, "k": args.k, "group": 32, "threads": 1, "repeats": args.repeats,
                               "bitwise_equal": same, "runs": runs}, indent=1) + "\n")
    print(f"wrote {out}")
    if not same:
        raise SystemExit("the builds' outputs differ")


if __name__ == "__main__":
    main()
