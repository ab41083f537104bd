"""decode_speed.py's rooflines: the memory bandwidths measured on the machine, the bytes a decode step reads, and
the compute ceiling of waferline's own kernels (their in-cache product rates)."""

from __future__ import annotations

import time
from typing import Any

import torch

from decode_speed_engines import sync


def _best_time(f: Any, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best



def device_bandwidths(device: str, mib: int = 1024, reps: int = 10) -> tuple[float, float]:
    """(copy, read) bytes/s of ``device``'s memory: a torch copy of ``mib`` MiB (read + write bytes) and a torch amax
    over as many (reads only), best of ``reps`` each, timed to the device's completion. On a GPU, the measured HBM
    bandwidth its decode roofline is put over (bytes a token / measured copy bandwidth)."""
    src = torch.ones(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    x = src.view(torch.float32)

    def timed(f: Any) -> float:  # (a warm-up, then the best of reps, each to the device's completion)
        f()
        return _best_time(lambda: (f(), sync(device)), reps)

    return 2 * (mib << 20) / timed(lambda: dst.copy_(src)), (mib << 20) / timed(lambda: x.amax())


def copy_bandwidths(mib: int = 256, reps: int = 5) -> tuple[float, float]:
    """(4 KiB pages, transparent huge pages): bytes/s moved by a torch copy of ``mib`` MiB (read + write), best of
    ``reps`` each."""
    from waferline.model.arena import huge_buffer

    out = []
    for make in (lambda: torch.empty(mib << 20, dtype=torch.uint8), lambda: huge_buffer(mib << 20)):
        src, dst = make().fill_(1), make().fill_(0)
        out.append(2 * (mib << 20) / _best_time(lambda: dst.copy_(src), reps))
    return out[0], out[1]


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """The better of copy_bandwidths(): huge pages are where waferline keeps its weights (model/arena.py)."""
    return max(copy_bandwidths(mib, reps))


def read_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Bytes/s read by a reduction over a large fp32 tensor in huge pages (torch amax: reads only), best of ``reps``.
    A decode step only reads its weights, and this machine reads faster than it copies: the tighter ceiling."""
    from waferline.model.arena import huge_buffer

    x = huge_buffer(mib << 20).view(torch.float32).fill_(1.0)
    return (mib << 20) / _best_time(lambda: x.amax(), reps)


def experts_touched(n_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts a step of ``batch`` tokens uses when routing is uniform (random weights)."""
    return n_experts * (1 - (1 - top_k / n_experts) ** batch)


def step_bytes(
    spec: Any, bits: int, group: int, kv_bits: int, batch: int, context: int, head_bits: float | None = None
) -> float:
    """Bytes one decode step of ``batch`` sequences reads: weights (no embedding table; idle experts not read; the LM
    head at ``head_bits``: 8 = int8 with a 16-bit scale per row, 6.5625 = llama.cpp's Q6_K, None = the embedding's
    bits, 32 for fp32 weights) and each sequence's cache at ``context`` tokens."""
    from waferline.spec.model import MoESpec, quantized_bytes

    embed_bits = 32 if bits == 32 else 16
    total = spec.weight_bytes(bits, group, embed_bits=embed_bits) - spec.embed_bytes(embed_bits)
    head_bits = embed_bits if head_bits is None else head_bits
    if head_bits != embed_bits:  # int8: ModelSpec's accounting with one scale per row; Q6_K: its 6.5625 bits flat
        n = spec.lm_head_params()
        head = quantized_bytes(n, 8, group_size=spec.hidden_size) if head_bits == 8 else n * head_bits / 8
        total += head - quantized_bytes(n, embed_bits)
    for layer in spec.layers:
        if isinstance(layer.ffn, MoESpec):
            f = layer.ffn
            idle = f.num_experts - experts_touched(f.num_experts, f.top_k, batch)
            total -= idle * f.expert_bytes(bits, group)  # (as weight_bytes counts it: its groups, 16-bit biases)
    return total + batch * spec.cache_bytes_per_seq(context, kv_bits=kv_bits)


def product_rate(fmt: str, rows: int, threads: int, reps: int = 9) -> float | None:
    """Multiply-adds/s of waferline's own product of ``rows`` rows through one weight of 1024 x 1024 per thread, read
    over and over (bf16 2 MiB, fp32 4 MiB, int4 0.5 MiB, int8 1 MiB a thread; it must fit in half the last-level
    cache), called as the engine calls it (fp32 / bf16: its ``packed_linear``; int4: ``Int4Weight``; int8: the int8
    head's operator), ``threads`` torch threads, best of ``reps`` blocks. With no weight bytes to wait for from
    memory this is the compute ceiling of waferline's kernels of that format on this machine — not the CPU's peak: a
    better kernel could raise it. A call's fixed cost is in it (a few % at this size; smaller weights measured
    lower), so an engine step whose products run inside one fused layer op may come out a little above it. None
    where the format's kernel does not run here or the weight would not fit."""
    from waferline.model.layers import packed_linear
    from waferline.sim.calibrate.ops import _int4_weight, last_level_cache_bytes

    llc = last_level_cache_bytes()
    if not llc or 1024 * threads * 1024 * {"fp32": 4, "bf16": 2, "int8": 1, "int4": 0.5}[fmt] > llc / 2:
        return None
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        N, K = 1024 * threads, 1024
        if fmt == "int8":  # the int8 LM head of the int4 engine (decoder.quantize_head)
            from waferline import kernels

            if not kernels.available():
                return None
            q8, s8 = torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.rand(N).to(torch.bfloat16)
            x = torch.randn(rows, K, dtype=torch.bfloat16)
            call: Any = lambda: torch.ops.waferline.int8_linear(x, q8, s8)  # noqa: E731
        elif fmt == "int4":
            w4 = _int4_weight(K, N)
            if w4 is None:
                return None
            x = torch.randn(rows, K, dtype=torch.bfloat16)
            call = lambda: w4.linear(x)  # noqa: E731
        else:
            dt = torch.float32 if fmt == "fp32" else torch.bfloat16
            w, x, packs = torch.randn(N, K).to(dt), torch.randn(rows, K).to(dt), {}
            call = lambda: packed_linear(x, w, None, packs, 0)  # noqa: E731
        n = max(4, int(4e8 / (rows * N * K)))  # ~0.4 G multiply-adds a block

        def block() -> None:
            for _ in range(n):
                call()
        block()
        return n * rows * N * K / _best_time(block, reps)
    finally:
        torch.set_num_threads(old)


def step_macs_per_token(spec: Any, context: int) -> float:
    """Multiply-adds one token of a decode step costs: ModelSpec's forward FLOPs / 2 at ``context`` (the active
    weights' products, the router, the LM head, attention over the cache)."""
    return spec.flops_per_token(context) / 2


RATE_FORMATS = {"wl_fp32": ("fp32", "fp32"), "wl_bf16": ("bf16", "bf16"), "wl_int4": ("int4", "int8")}  # (body, head)


def product_rates(batches: list[int], threads: int) -> dict[str, float]:
    """product_rate() of every format waferline's rows use, at each batch size: {"bf16@8": MAC/s, ...}."""
    out = {}
    for fmt in sorted({f for pair in RATE_FORMATS.values() for f in pair}):
        for b in batches:
            r = product_rate(fmt, b, threads)
            if r:
                out[f"{fmt}@{b}"] = r
    return out


def compute_ceiling(engine: str, batch: int, macs: float, head_macs: float, rates: dict[str, float]) -> float | None:
    """Aggregate tok/s at which a step's multiply-adds (``macs`` a token, ``head_macs`` of them the LM head's) run at
    the in-cache rates of waferline's kernels (product_rates): the compute side of the roofline. Waferline rows only
    (another engine's kernels have other ceilings)."""
    if engine not in RATE_FORMATS:
        return None
    body, head = (rates.get(f"{f}@{batch}") for f in RATE_FORMATS[engine])
    if not body or not head:
        return None
    return 1.0 / ((macs - head_macs) / body + head_macs / head)



if __name__ == "__main__":  # a part of decode_speed.py, with nothing to run on its own
    import sys

    print("decode_speed_roofline.py: decode_speed.py's helpers, not a benchmark of its own; run "
          "python benchmarks/decode_speed.py (--help says what it does)", file=sys.stderr)
    raise SystemExit(0 if {"-h", "--help"} & set(sys.argv[1:]) else 2)
