"""This machine's operators, one thread, outside the engine: copy and elementwise bandwidth, square matmuls, the
engine's own linear products (fp32 / bf16 / int4) swept over rows and weight sizes, the fused CPU operators' rates,
the last-level cache size, and a CUDA device's numbers when one is present."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from waferline.sim.calibrate.common import _best, _nnls_rel
from waferline.sim.calibrate.opcount import fused_units


def memory_bandwidth(mb: int, threads: int) -> float:
    """Copy bandwidth (read + write bytes / s) of a ``mb`` MB tensor copy with ``threads`` torch threads: the better
    of 4 KiB and huge pages."""
    import torch

    from waferline.model.arena import huge_buffer

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for make in (lambda: torch.empty(mb << 20, dtype=torch.uint8), lambda: huge_buffer(mb << 20)):
            a, b = make().fill_(1), make()  # in 4 KiB pages, and in huge pages as the engine's weights are
            b.copy_(a)
            t = _best(lambda: b.copy_(a), 5, time.process_time if threads == 1 else time.perf_counter)
            best = max(best, 2 * (mb << 20) / t)
        return best
    finally:
        torch.set_num_threads(old)


def memory_bandwidth_small(nbytes: int) -> float:
    """Copy bandwidth of a working set that stays in cache (``nbytes`` copied 200 times), 1 thread."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.ones(nbytes // 4)
        b = torch.empty_like(a)

        def run() -> None:
            for _ in range(200):
                b.copy_(a)
        run()
        return 2 * 200 * a.numel() * 4 / _best(run, 5)
    finally:
        torch.set_num_threads(old)


def elementwise_bandwidth(numel: int, dtype: str, reps: int) -> float:
    """Bytes / s of z = x * y (read 2, write 1) on ``numel``-element tensors in ``dtype``, 1 thread."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dt = torch.bfloat16 if dtype == "bf16" else torch.float32
        x = torch.ones(numel, dtype=dt)
        y = torch.ones(numel, dtype=dt)
        z = torch.empty_like(x)

        def run() -> None:
            for _ in range(reps):
                torch.mul(x, y, out=z)
        run()
        return 3 * reps * x.numel() * x.element_size() / _best(run, 5)
    finally:
        torch.set_num_threads(old)


def matmul_flops(n: int, dtype: str, threads: int) -> float:
    """Square n^3 matmul FLOP/s in ``dtype`` (fp32 | bf16) with ``threads`` torch threads, as the engine multiplies
    (its ``linear()``: a 16-bit product is widened to fp32 where oneDNN has no bf16 GEMM; ATen's own bf16 loop ran
    ~1 GFLOP/s on such a CPU)."""
    import torch

    from waferline.model.layers import linear

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dt = torch.float32 if dtype == "fp32" else torch.bfloat16
        a = torch.randn(n, n).to(dt)
        b = torch.randn(n, n).to(dt)
        linear(a, b)
        return 2.0 * n ** 3 / _best(lambda: linear(a, b), 3)
    finally:
        torch.set_num_threads(old)


def _int4_weight(K: int, N: int, group: int = 128) -> Any | None:
    """A random symmetric int4 weight packed as the engine packs it on this machine (``Int4Weight``, its default CPU
    backend), or None where no int4 kernel runs here (the dequantise fallback is not an int4 product)."""
    import torch

    from waferline.model.quant import Int4Tensor, Int4Weight

    codes = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    w = Int4Weight(Int4Tensor(codes, torch.full((N, K // group), 0.01, dtype=torch.bfloat16)), "cpu")
    return None if w.backend == "dequant" else w


def linear_sweep(
    dtype: str, ms: list[int], sizes: list[int], pool_mb: float, hot: bool = False
) -> list[dict[str, float]]:
    """Seconds per linear call y = x W^T through the engine's own ``linear`` (int4: its ``Int4Weight``) for each token
    count M and square size K = N, cycling through a pool of distinct weights of up to ``pool_mb`` MB, one torch thread,
    process CPU time. A pool bigger than the last-level cache measures weights read from memory; ``hot``: a pool that
    fits in it (half of it: a model whose weights stay in the last-level cache, not in the core's own L2)."""
    import torch

    from waferline.model.arena import move_to_huge_pages
    from waferline.model.layers import packed_linear

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for n in sizes:
            group = 128 if n % 128 == 0 else 32
            if dtype == "int4":
                probe = _int4_weight(n, n, group)
                if probe is None:
                    return []
                one = probe.nbytes()
            else:
                one = n * n * (4 if dtype == "fp32" else 2)
            count = max(2, min(512 if hot else 64, int(pool_mb * (1 << 20)) // one))
            if dtype == "int4":  # distinct copies of one packed weight (packing each anew took as long as the timing)
                pool: Any = torch.nn.ModuleList([probe] + [copy.deepcopy(probe) for _ in range(count - 1)])
            else:
                dt = torch.float32 if dtype == "fp32" else torch.bfloat16
                pool = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n, n).to(dt), requires_grad=False)
                                               for _ in range(count)])
            move_to_huge_pages(pool)  # where the engine keeps its weights (model/arena.py)
            ws = list(pool)
            for m in ms:
                x = torch.randn(m, n).to(torch.float32 if dtype == "fp32" else torch.bfloat16)
                use = ws[: max(2, min(len(ws), int(3e8 / (2.0 * m * n * n))))]  # bound the probe's time
                if dtype == "int4":
                    def run() -> None:  # as the engine's int4 projections call it
                        for w in use:
                            w.linear(x)
                else:
                    packs: dict[Any, Any] = {}

                    def run() -> None:  # as the engine's Linear calls it (16-bit weights packed once for 2+ rows)
                        for i, w in enumerate(use):
                            packed_linear(x, w, None, packs, i)
                run()
                t = _best(run, 3) / len(use)
                rows.append({"m": m, "k": n, "n": n, "bytes": float(one), "flops": 2.0 * m * n * n, "seconds": t})
    finally:
        torch.set_num_threads(old)
    return rows


def last_level_cache_bytes() -> float | None:
    """The largest CPU cache of this machine (sysfs), or None where it is not readable."""
    best = None
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            s = (d / "size").read_text().strip().upper()
            v = float(s[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[s[-1]] if s[-1] in "KMG" else float(s)
        except (OSError, ValueError, KeyError, IndexError):
            continue
        best = v if best is None else max(best, v)
    return best


def hot_tables(lin: dict[str, Any]) -> dict[str, Any]:
    """The cache-resident linear tables (the calibration models' weights all fit in the last-level cache), else the
    sweep's."""
    return {k: linear_table(v.get("hot") or v["points"]) for k, v in lin.items()}


def linear_table(rows: list[dict[str, float]]) -> dict[str, Any]:
    """The sweep as a lookup table: seconds[i][j] for token count m[i] and weight bytes bytes[j]."""
    ms = sorted({int(r["m"]) for r in rows})
    bs = sorted({float(r["bytes"]) for r in rows})
    sec = {(int(r["m"]), float(r["bytes"])): r["seconds"] for r in rows}
    return {"m": ms, "bytes": bs, "seconds": [[sec.get((m, b), float("nan")) for b in bs] for m in ms]}


def fit_linear(rows: list[dict[str, float]]) -> dict[str, float]:
    """Fit seconds = t0 + bytes / bytes_per_s + flops / flops_per_s (non-negative terms, relative least squares)."""
    if not rows:
        return {}
    t = np.array([r["seconds"] for r in rows])
    X = np.array([[1.0, r["bytes"], r["flops"]] for r in rows])
    coef = _nnls_rel(X, t)
    pred = X @ coef
    err = float(np.exp(np.median(np.abs(np.log(np.maximum(pred, 1e-12) / t)))))
    return {"t0_s": float(max(coef[0], 0.0)), "bytes_per_s": float(1.0 / coef[1]) if coef[1] > 0 else float("inf"),
            "flops_per_s": float(1.0 / coef[2]) if coef[2] > 0 else float("inf"), "median_fit_error_factor": err}


# head shapes of the fused-operator probe: a sol-mini-like and a DeepSeek-V3-like MLA head set (H, nope, rank, rope, v),
# and Mamba-2 state shapes (heads, head dim, state size)
FUSED_PROBE_MLA = [(4, 32, 64, 16, 32), (12, 64, 256, 32, 64)]
FUSED_PROBE_SSM = [(4, 16, 16), (8, 64, 32)]
FUSED_PROBE_ROWS = (1, 8, 32, 256)  # rows of silu_mul / rms_norm (decode, batched decode and verify, prefill)
FUSED_PROBE_WIDTHS = (256, 1024, 3072)  # their output widths (hidden sizes, FFN / expert widths)


def fused_op_probe(quick: bool = False) -> dict[str, Any] | None:
    """Seconds per call of waferline's fused CPU operators (mla_decode, ssm_update) against their work units (FLOPs;
    state elements updated) over rows x tokens 1-4 (mla_decode) and 1-32, one thread, the same call back to back (best
    of 3 x 5), as the engine calls them (ssm_update with its states gathered and scattered back, a verify's kept first);
    fit
    t = t0 + units / rate. The host model prices these operators with it: the linear fit's FLOP rate put the absorbed
    MLA decode of 8 rows at half its time, the elementwise bandwidth the state update at a fifth. None where the
    operators are not built. (Timed after a 64 MB copy instead, every call costs ~0.1 ms more here, small ones too:
    that measures the copy's eviction of everything, code included, more than the operator, so it is not used.)"""
    import torch

    from waferline import kernels

    if not kernels.available():
        return None
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    no_mask = torch.empty(0, dtype=torch.bool)
    pts: dict[str, list[dict[str, float]]] = {"mla_decode": [], "ssm_update": [], "mamba2_mix": [], "silu_mul": [],
                                              "rms_norm": []}

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        return _best(lambda: [fn() for _ in range(5)], 3) / 5

    try:
        for H, n, r, p, v in FUSED_PROBE_MLA[-1:] if quick else FUSED_PROBE_MLA:
            w_uk, w_uv = torch.randn(H, n, r).bfloat16(), torch.randn(H, v, r).bfloat16()  # as a bf16 model holds them
            # the engine runs the fused op for at most MLA_FUSED_MAX_ROWS query rows (more go through batched GEMMs)
            for B, T in ((1, 1), (1, 4)) if quick else ((1, 1), (2, 1), (4, 1), (1, 2), (1, 4)):
                L = 48
                qn, qr = torch.randn(B, T, H, n).bfloat16(), torch.randn(B, T, H, p).bfloat16()
                lat = torch.randn(B, L, r + p).bfloat16()
                mask = torch.zeros(B, T, L, dtype=torch.bool) if T > 1 else no_mask
                sec = timed(lambda: torch.ops.waferline.mla_decode(qn, qr, lat, mask, w_uk, w_uv, 0.1, torch.bfloat16))
                units = fused_units("mla_decode", [qn, qr, lat, mask, w_uk, w_uv], [torch.empty(B, T, H * v)])
                pts["mla_decode"].append({"heads": H, "rank": r, "rows": B * T, "units": units, "seconds": sec})
        for H, P, N in FUSED_PROBE_SSM[-1:] if quick else FUSED_PROBE_SSM:
            cache, prev, no_trail = torch.randn(16, H, P, N), torch.empty(16, H, P, N), torch.empty(0)
            for B, T in ((1, 1), (8, 4)) if quick else ((1, 1), (8, 1), (1, 4), (8, 4)):
                slots = torch.arange(B) * 2
                dA, dtx = torch.rand(B, T, H), torch.randn(B, T, H, P)
                Bm, Cm = torch.randn(B, T, 1, N), torch.randn(B, T, 1, N)

                def step() -> None:  # as the engine calls it: states gathered (a verify keeps them), scattered back
                    h = cache.index_select(0, slots)
                    if T > 1:
                        prev.index_copy_(0, slots, h)
                    torch.ops.waferline.ssm_update(h, dA, dtx, Bm, Cm, no_trail)
                    cache.index_copy_(0, slots, h)

                pts["ssm_update"].append({"heads": H, "rows": B, "tokens": T, "units": float(B * T * H * P * N),
                                          "seconds": timed(step)})
            # the whole mixer between its projections, as the engine's decode (T = 1) and verify (recorded) call it
            C = H * P + 2 * N
            conv, cw, no_bias = torch.randn(16, C, 3).bfloat16(), torch.randn(C, 4).bfloat16() * 0.3, torch.empty(0)
            dtb, A, D, nw = torch.randn(H), -torch.rand(H), torch.ones(H), torch.ones(H * P)
            for B, T in ((1, 1), (8, 4)) if quick else ((1, 1), (8, 1), (1, 4), (8, 4)):
                slots = torch.arange(B) * 2
                zx = torch.randn(B, T, H * P + C + H).bfloat16()
                sec = timed(lambda: torch.ops.waferline.mamba2_mix(zx, conv, slots, cw, no_bias, dtb, A, D, nw, cache,
                                                                   prev, 1, 1e-6, False, 0.0, 1e30, T > 1))
                pts["mamba2_mix"].append({"heads": H, "rows": B, "tokens": T, "units": float(B * T * H * P * N),
                                          "seconds": sec})
        # the elementwise ones: bf16 rows the previous op just wrote (in cache, as in the engine); exp and a division
        # per element make them slower than their bytes at the copy-like elementwise bandwidth (silu_mul of 256 x 512:
        # ~70 us here, ~35 us by bytes)
        for rows in FUSED_PROBE_ROWS[::3] if quick else FUSED_PROBE_ROWS:
            for width in FUSED_PROBE_WIDTHS[:1] if quick else FUSED_PROBE_WIDTHS:
                g = torch.randn(rows, 2 * width).bfloat16()
                x, w = torch.randn(rows, width).bfloat16(), torch.randn(width).bfloat16()
                pts["silu_mul"].append({"rows": rows, "width": width, "units": float(rows * width),
                                        "seconds": timed(lambda: torch.ops.waferline.silu_mul(g))})
                pts["rms_norm"].append({"rows": rows, "width": width, "units": float(rows * width),
                                        "seconds": timed(lambda: torch.ops.waferline.rms_norm(x, w, 1e-6))})
    finally:
        torch.set_num_threads(old)
    out: dict[str, Any] = {}
    for name, ps in pts.items():
        X = np.array([[1.0, q["units"]] for q in ps])
        y = np.array([q["seconds"] for q in ps])
        t0, inv = (float(c) for c in _nnls_rel(X, y))
        if inv <= 0:
            inv = float(np.median(y / X[:, 1]))
        pred = X @ np.array([t0, inv])
        out[name] = {"t0_s": t0, "units_per_s": 1.0 / inv, "points": ps,
                     "fit_error_factor": float(np.exp(np.median(np.abs(np.log(pred / y)))))}
    return out


def cuda_numbers() -> dict[str, float] | None:
    """bf16 matmul FLOP/s, device copy bandwidth and host-to-device bandwidth of CUDA device 0, or None."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        dev = torch.device("cuda")
        n = 8192
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

        def sync(fn: Callable[[], Any]) -> Callable[[], None]:
            def run() -> None:
                fn()
                torch.cuda.synchronize()
            return run

        sync(lambda: a @ b)()
        fl = 2.0 * n ** 3 / _best(sync(lambda: a @ b), 5, time.perf_counter)
        x = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
        y = torch.empty_like(x)
        sync(lambda: y.copy_(x))()
        bw = 2 * x.numel() / _best(sync(lambda: y.copy_(x)), 5, time.perf_counter)
        h = torch.empty(1 << 26, dtype=torch.uint8).pin_memory()
        h2d = h.numel() / _best(sync(lambda: x[: h.numel()].copy_(h, non_blocking=True)), 5, time.perf_counter)
        return {"name": torch.cuda.get_device_name(0), "bf16_flops": fl, "memory_bandwidth": bw, "h2d_bytes_per_s": h2d,
                "memory_bytes": float(torch.cuda.get_device_properties(0).total_memory)}
    except Exception:  # noqa: BLE001 - a GPU probe must never break calibration of the host
        return None
