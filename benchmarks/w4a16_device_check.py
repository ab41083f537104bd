"""One prepared device check for W4A16: int4 matmul correctness per shape path and int4-vs-16-bit matmul speed.

On a CUDA GPU (compute capability >= 8) this exercises torch's tinygemm path (``cuda_tinygemm``), which the CPU-only
test suite cannot; on CPU it runs the same checks on the int4pack kernel. Correctness: every output within a few
bf16 ulps of sum |x||w| against the fp32 matmul of the dequantized weight. Speed: M = 1 and 8 rows against a
bf16 ``F.linear`` of the same shape. Prints a table, writes benchmarks/results/w4a16_device_check_<device>.json.

    python benchmarks/w4a16_device_check.py                  # cuda when available, else cpu
    python benchmarks/w4a16_device_check.py --device cpu
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from waferline.model.quant import Int4Weight, rtn_quantize

SHAPES = [  # (N, K, G, symmetric): kernel shapes, a padded N, a group the kernels reject
    (4096, 4096, 128, True), (11008, 4096, 128, False), (4096, 11008, 64, True), (1000, 4096, 32, True),
    (512, 1536, 48, True),
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device: torch.device, reps: int) -> float:
    fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    try:
        device = torch.device(a.device)
    except RuntimeError:
        ap.error(f"--device {a.device}: give cpu or cuda[:N]")
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        ap.error(f"--device {a.device}: no such CUDA device here (torch {torch.__version__} sees "
                 f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA devices)")
    if device.type not in ("cpu", "cuda"):
        ap.error(f"--device {a.device}: give cpu or cuda[:N]")
    out = Path(a.out or Path(__file__).resolve().parent / "results" / f"w4a16_device_check_{device.type}.json")
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    g = torch.Generator().manual_seed(0)
    rows, ok = [], True
    for N, K, G, sym in SHAPES:
        w = torch.randn(N, K, generator=g) / K ** 0.5
        t = rtn_quantize(w, G, sym)
        q = Int4Weight(t, device)
        deq = t.dequantize().to(device)
        for M in (1, 8):
            x = torch.randn(M, K, generator=g).to(device, torch.bfloat16)
            y = q.linear(x).float()
            ref = x.float() @ deq.t()
            bound = 2.0 ** -7 * (x.float().abs() @ deq.abs().t()) + 1e-6
            good = bool(((y - ref).abs() <= bound).all())
            ok &= good
            wb = deq.to(torch.bfloat16)
            t4 = timeit(lambda: q.linear(x), device, a.reps)
            t16 = timeit(lambda: F.linear(x, wb), device, a.reps)
            rows.append({"N": N, "K": K, "group": G, "symmetric": sym, "M": M, "backend": q.backend, "correct": good,
                         "max_err_over_bound": round(float(((y - ref).abs() / bound).max()), 3),
                         "int4_us": round(t4 * 1e6, 1), "bf16_us": round(t16 * 1e6, 1),
                         "speedup": round(t16 / t4, 2)})
            r = rows[-1]
            print(f"N={N:>6} K={K:>6} G={G:>3} M={M}: {r['backend']:>13} correct={good}  int4 {r['int4_us']:9.1f} us  "
                  f"bf16 {r['bf16_us']:9.1f} us  ({r['speedup']:.2f}x)", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    res = {"device": name, "torch": torch.__version__, "all_correct": ok, "rows": rows}
    write_text_atomic(out, json.dumps(res, indent=2), make_parents=True)
    print(f"{'all correct' if ok else 'MISMATCH'} on {name}; wrote {out}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
