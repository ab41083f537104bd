"""Measure this host for the twin: memory bandwidth, fp32/bf16/int4 matmul and GEMV speed, the engine's per-op and
per-step overhead, and the gloo link between two local processes; write a hardware YAML with every figure marked
measured (date, method).

The device of the YAML is *one core* of this machine (the engine runs one torch thread per stage process), the
scale-up link is gloo over loopback as the pipeline engine uses it, and the ``host_engine`` section holds the numbers
the simulator's host-engine model (``sim/host.py``) needs. Probes take the best of several repeats: other work on a
shared machine only ever slows a probe down.
"""

from __future__ import annotations

import copy
import datetime as _dt
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

from waferline.errors import ConfigError

Progress = Callable[[str, float], None]  # (what is being measured, fraction done)

# A tiny model of the engine's own architecture with every layer kind the engine runs on this repo's models (Mamba-2,
# MLA, dense and MoE FFNs): its decode step is all per-op overhead, so its step time over its op count measures it.
_TINY_BASE = {
    "model_type": "sol", "architectures": ["SolForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 64, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1,
    "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_chunk_size": 16, "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1,
}
_TINY_PATTERN = [("mamba2", "dense"), ("mla", "moe"), ("mamba2", "moe"), ("mla", "dense")]


def tiny_config(layers: int) -> dict[str, Any]:
    """The calibration model with ``layers`` layers (kinds cycle through Mamba-2/MLA x dense/MoE)."""
    kinds = [_TINY_PATTERN[i % len(_TINY_PATTERN)] for i in range(layers)]
    return dict(_TINY_BASE, num_hidden_layers=layers, mixer_types=[m for m, _ in kinds], ffn_types=[f for _, f in kinds])


def calibration_checkpoint(workdir: str | Path, hidden: int, layers: int) -> Path:
    """The random calibration model of (hidden, layers) under ``workdir`` (FFN 2 x hidden, experts' hidden), written
    on first use; every probe of a calibration shares it."""
    from waferline.model.init import write_random_checkpoint

    h, L = hidden, layers
    d = Path(workdir) / (f"tiny-{L}" if h == 64 else f"tiny-h{h}-{L}")
    if not (d / "config.json").is_file():
        write_random_checkpoint(dict(tiny_config(L), hidden_size=h, intermediate_size=2 * h, moe_intermediate_size=h),
                                d, seed=L + h)
    return d


def _best(fn: Callable[[], Any], repeat: int = 5, clock: Callable[[], float] = time.process_time) -> float:
    """Fastest of ``repeat`` runs. Single-threaded probes are timed in this process's CPU time: on a machine shared with
    other work, wall time would count the time the core spent on someone else (on a quiet machine both agree)."""
    best = float("inf")
    for _ in range(repeat):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def _fig(value: float, tag: str, method: str) -> dict[str, Any]:
    """A measured figure: value, a source line the catalog loader reads, and {date, method}."""
    return {"value": float(value), "source": f"{tag}: {method}", "measured": {"date": tag.split()[-1], "method": method}}


# ----------------------------------------------------------------------------- probes


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


def linear_sweep(dtype: str, ms: list[int], sizes: list[int], pool_mb: float, hot: bool = False) -> list[dict[str, float]]:
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


SMALL_OP_BYTES = 1 << 20  # a non-matmul op moving at most this many bytes runs from cache (assumed: L2 is 0.5-2 MB)
_WEIGHT_OPS = {"linear", "mm", "addmm", "_weight_int4pack_mm_for_cpu", "_weight_int4pack_mm", "_linear_pointwise",
               "linear_rows", "linear_wide", "int4_linear"}
_MATMUL_OPS = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "_weight_int4pack_mm_for_cpu", "_weight_int4pack_mm",
               "einsum", "_linear_pointwise", "linear_rows", "linear_wide", "int4_linear"}


def _tensors(x: Any) -> list[Any]:
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


# ops that only make a new view (no data moves)
_VIEW_OPS = {"view", "_unsafe_view", "reshape", "select", "slice", "unsqueeze", "squeeze", "expand", "permute", "transpose",
             "t", "as_strided", "alias", "detach", "split", "split_with_sizes", "chunk", "unbind", "narrow", "diagonal",
             "unflatten", "flatten", "movedim", "view_as_real", "view_as_complex", "lift_fresh", "expand_as", "view_as"}
# ops that read only the selected rows of their (possibly large) input
_GATHER_OPS = {"index_select", "gather", "embedding", "index", "take"}


def _op_bytes(name: str, ins: list[Any], outs: list[Any]) -> float:
    """Bytes an op moves: views move none; in-place updates read and write the size of their source (not the whole
    destination); gathers read the selected rows; everything else reads its inputs and writes its outputs."""
    def nb(ts: list[Any]) -> float:
        return float(sum(t.numel() * t.element_size() for t in ts))

    if name in _VIEW_OPS:
        return 0.0
    if name in _GATHER_OPS:
        return 2.0 * nb(outs) + nb([t for t in ins[1:] if not t.is_floating_point()])
    if name.endswith("_") and not name.startswith("_") and ins:
        src = ins[1:]
        return 2.0 * (nb(src) if src else nb(ins[:1]))
    return nb(ins) + nb(outs)


def _einsum_flops(eq: str, ops: list[Any]) -> float:
    if "..." in eq or "->" not in eq:
        return 0.0
    ins = eq.replace(" ", "").split("->")[0].split(",")
    size: dict[str, int] = {}
    for sub, t in zip(ins, ops):
        for ch, n in zip(sub, t.shape):
            size[ch] = int(n)
    return 2.0 * math.prod(size.values()) if size else 0.0


FUSED_OPS = ("mla_decode", "ssm_update", "mamba2_mix", "silu_mul", "rms_norm")  # waferline.kernels, own calibrated rates


def mla_decode_flops(heads: int, rows: int, nope: int, rank: int, rope: int, v: int, seen: float) -> float:
    """FLOPs of the absorbed MLA decode: per head and query row W_UK into the query and W_UV after attention; per
    (query row, key) pair attended (``seen``) the score over latent and rope parts and the weighted latent sum."""
    return 2.0 * heads * (rows * (nope * rank + v * rank) + seen * (2 * rank + rope))


def fused_units(name: str, ins: list[Any], outs: list[Any]) -> float:
    """The work unit a fused operator's time is proportional to: mla_decode, its FLOPs (absorbed MLA: W_UK into the
    query, scores and weighted sum over the latents, W_UV); ssm_update and mamba2_mix (the whole Mamba-2 mixer between
    its projections), state elements updated (batch x tokens x heads x head dim x state size)."""
    if name == "mla_decode":
        qn, qr, lat, w_uk = ins[0], ins[1], ins[2], ins[-2]  # q_nope, q_rope, latents, (mask,) W_UK, W_UV
        B, T, H, n = qn.shape
        L, r, p, v = lat.shape[1], w_uk.shape[-1], qr.shape[-1], outs[0].shape[-1] // max(H, 1)
        mask = ins[3] if len(ins) == 6 else None
        # (token, latent) pairs attended: masked ones are skipped (a causal prefill attends to about half)
        seen = float((~mask).sum()) if mask is not None and mask.numel() else float(B * T * L)
        return mla_decode_flops(H, B * T, n, r, p, v, seen)
    if name == "ssm_update":
        h, dA = ins[0], ins[1]  # h [B, H, P, N], dA [B, T, H]
        return float(h.numel() * dA.shape[1])
    if name == "mamba2_mix":  # zxbcdt [B, T, F], ..., the cache's ssm [slots, H, P, N] (10th tensor argument)
        zx, ssm = ins[0], ins[9]
        return float(zx.shape[0] * zx.shape[1] * ssm[0].numel())
    if name in ("silu_mul", "rms_norm"):  # elements written
        return float(outs[0].numel())
    raise ValueError(name)


def moe_ffn_calls(args: Any) -> dict[str, float]:
    """The linear calls inside one ``waferline::moe_ffn`` (its arguments ``x, weights, idx, gate_up, its scales, down,
    its scales, shared gate_up, scales, shared down, scales, ...``) as OpCounter's ``call|dtype|rows|weight bytes``
    keys: per expert hit, its gate_up and down product over the rows routed to it; the shared expert's over all rows."""
    import torch

    x, _, idx, gu, gu_sz, dn, dn_sz, sgu, sgu_sz, sdn, sdn_sz = args[:11]
    dense = "fp32" if x.dtype == torch.float32 else "bf16"
    E = int(gu.shape[0])
    per_expert = [0] * E
    for e in idx.reshape(-1).tolist():
        per_expert[e] += 1
    calls: dict[str, float] = {}

    def add(wt: Any, sz: Any, rows: int, share: int) -> None:
        nbytes = (wt.numel() * wt.element_size() + sz.numel() * sz.element_size()) // share
        key = f"call|{'int4' if sz.numel() else dense}|{rows}|{int(nbytes)}"
        calls[key] = calls.get(key, 0.0) + 1.0

    for rows in per_expert:
        if rows:
            add(gu, gu_sz, rows, E)
            add(dn, dn_sz, rows, E)
    if sgu.numel():
        add(sgu, sgu_sz, int(x.shape[0]), 1)
        add(sdn, sdn_sz, int(x.shape[0]), 1)
    return calls


def mla_attend_work(args: Any) -> tuple[dict[str, float], int]:
    """What one ``waferline::mla_attend_int4`` runs inside (its arguments ``x, [q_a, its scales, q_b, scales, kv_a,
    scales, o, scales], groups, q_a norm, kv_a norm, eps, eps, cos, sin, interleaved, cache, slots, pos, W_UK, W_UV,
    scale``), as OpCounter's work keys: the linear calls (``call|int4|rows|weight bytes``, or ``call|bf16|...`` for a
    dense projection), the rms_norm and
    mla_decode fused operators (their calls, units and bytes), and the small ops between them (rope, two cats, the
    cache writes, the latents' view or gather) by their bytes; with the number of ops to count: the calls and fused
    operators (priced per call) and the operator's own dispatch."""
    import torch

    x, w = args[0], list(args[1])
    qa_norm, kva_norm, cos2, cache, pos, w_uk, w_uv = args[3], args[4], args[7], args[10], args[12], args[13], args[14]
    B = int(x.numel() // x.shape[-1])  # rows of one token (a verify's tokens go in as rows)
    H, n, r = (int(d) for d in w_uk.shape)
    R = int(cache.shape[2])
    p, v = R - r, int(w_uv.shape[1])
    el = x.element_size()
    work: dict[str, float] = {}

    def add(key: str, val: float) -> None:
        work[key] = work.get(key, 0.0) + val

    ops = 0
    for packed, scales in zip(w[0::2], w[1::2]):
        if packed.numel():  # int4 (packed, scales), or a dense 16-bit weight (linear_rows) with empty scales
            nbytes = packed.numel() * packed.element_size() + scales.numel() * scales.element_size()
            kind = "int4" if scales.numel() else ("fp32" if packed.dtype == torch.float32 else "bf16")
            add(f"call|{kind}|{B}|{int(nbytes)}", 1.0)
            ops += 1
    for norm in ((qa_norm,) if w[0].numel() else ()) + (kva_norm,):
        units = float(B * norm.numel())
        add("fused|rms_norm|calls", 1.0)
        add("fused|rms_norm|units", units)
        add("fused|rms_norm|bytes", 2.0 * units * el)
        ops += 1
    pl = pos.reshape(-1).tolist()
    end = max(pl) + 1
    seen = float(sum(q + 1 for q in pl))  # keys past a row's own position are masked (skipped)
    add("fused|mla_decode|calls", 1.0)
    add("fused|mla_decode|units", mla_decode_flops(H, B, n, r, p, v, seen))
    add("fused|mla_decode|bytes", float(B * end * R * el + (w_uk.numel() + w_uv.numel()) * w_uk.element_size()
                                        + B * H * (n + p + v) * el))
    ops += 1
    small = float(B * (H + 1) * p * el * 2 * 2  # rope in and out, and the cat that builds its input
                  + B * R * el * 2 * 2  # the cache entry's cat and its write
                  + cos2.numel() * 4 * 2)
    add("small_bytes_bf16" if el == 2 else "small_bytes", small)
    # rope, the cats, the latents' view or gather and the cache writes run inside the C++ operator: their bytes, no
    # per-op dispatch; the operator itself is one dispatch
    return work, ops + 1


def ffn_residual_parts(args: Any, out: Any) -> list[tuple[str, Any, tuple, Any]]:
    """The ops one ``waferline::ffn_residual`` (a decoder layer's FFN half: h + ffn(rms(h))) runs inside, as
    ``(op name, None for the layer's part or "ffn" for the FFN's, its arguments, its output)``: what the modules' path
    dispatches for the same rows: the norm, then the router and the experts (a MoE block) or the gate_up product, the
    SwiGLU and the down product (a dense FFN), then the residual add."""
    import torch

    h, norm, eps, gate_w, route = args[0], args[1], args[2], args[3], args[3:14]
    moe_w, (group, inter, shared) = list(args[14]), args[15:18]
    y, idx = out
    D = int(h.shape[-1])
    hn = h.reshape(-1, D)  # the FFN's input rows (shape and dtype; the op does not return them)
    parts: list[tuple[str, Any, tuple, Any]] = [("rms_norm", None, (h, norm, eps), h)]
    if gate_w.numel():
        weights = idx.new_empty(idx.shape, dtype=torch.float32)
        parts += [("moe_route", "ffn", (hn, *route), (weights, idx)),
                  ("moe_ffn", "ffn", (hn, weights, idx, *moe_w, group, inter, shared), hn)]
    else:  # a dense FFN: its weights where the shared expert's go
        N = int(hn.shape[0])
        gu, act = hn.new_empty((N, 2 * int(shared))), hn.new_empty((N, int(shared)))
        if moe_w[5].numel():  # int4 weights
            parts += [("int4_linear", "ffn", (hn, moe_w[4], moe_w[5], group), gu), ("silu_mul", "ffn", (gu,), act),
                      ("int4_linear", "ffn", (act, moe_w[6], moe_w[7], group), hn)]
        else:  # dense bf16 weights (linear_rows' kernel)
            parts += [("linear_rows", "ffn", (hn, moe_w[4]), gu), ("silu_mul", "ffn", (gu,), act),
                      ("linear_rows", "ffn", (act, moe_w[6]), hn)]
    return parts + [("add", None, (h, h), y)]


def mla_moe_layer_parts(args: Any, out: Any) -> list[tuple[str, Any, tuple, Any]]:
    """The ops one ``waferline::mla_moe_layer`` (a decoder layer's decode step, MLA + FFN) runs inside, as
    ffn_residual_parts lists them: the attention half (the norm, the attention block, the residual add), then the
    FFN half's."""
    x, n1, e1 = args[0], args[1], args[2]
    attn = args[3:18]
    return [("rms_norm", None, (x, n1, e1), x), ("mla_attend_int4", None, (x, *attn), x), ("add", None, (x, x), x),
            *ffn_residual_parts((x, *args[18:]), out)]


def gqa_moe_layer_parts(args: Any, out: Any) -> list[tuple[str, Any, tuple, Any]]:
    """The ops one ``waferline::gqa_moe_layer`` (a decoder layer's decode or verify step, GQA attention + FFN) runs
    inside, as ffn_residual_parts lists them: the norm, the q / k / v projections (int4_linear, or linear_rows for a
    dense bf16 weight), the q and k norms, rope, the cache write, gqa_decode over the keys, o_proj, the residual add,
    then the FFN half's."""
    x, n1, e1, w, groups, qn, kn, eps, cos2, sin2, rot, inter, cache, slots, pos, sinks, scale, H, Hkv = args[:19]
    w = list(w)
    B = int(x.numel() // x.shape[-1])  # rows of one token (a verify's tokens go in as rows)
    hd = int(cache.shape[2]) // (2 * int(Hkv))
    end = int(pos.max()) + 1 if pos.numel() else 0
    q, k, o = x.new_empty((B, 1, int(H), hd)), x.new_empty((B, 1, int(Hkv), hd)), x.new_empty((B, 1, int(H) * hd))
    qk = x.new_empty((B, 1, int(H) + int(Hkv), hd))

    def proj(i: int, xin: Any, y: Any) -> tuple:
        if w[2 * i + 1].numel():
            return ("int4_linear", None, (xin, w[2 * i], w[2 * i + 1], groups[i]), y)
        return ("linear_rows", None, (xin, w[2 * i]), y)

    parts = [("rms_norm", None, (x, n1, e1), x), proj(0, x, q), proj(1, x, k), proj(2, x, k)]
    if qn.numel():
        parts += [("rms_norm", None, (q, qn, eps), q), ("rms_norm", None, (k, kn, eps), k)]
    if int(rot):
        parts.append(("rope", None, (qk, cos2, sin2, rot, inter), qk))
    kv, row = x.new_empty((B, end, 2 * int(Hkv), hd)), x.new_empty((B, 1, 2 * int(Hkv) * hd))
    parts += [("copy_", None, (row, row), row), ("gqa_decode", None, (q, kv, x.new_empty(0), sinks, scale), q),
              proj(3, o, x), ("add", None, (x, x), x)]
    return parts + ffn_residual_parts((x, *args[19:]), out)


def mamba_ffn_layer_parts(args: Any, out: Any) -> list[tuple[str, Any, tuple, Any]]:
    """The ops one ``waferline::mamba_ffn_layer`` (a decoder layer's decode or verify step, Mamba-2 + FFN) runs inside,
    as ffn_residual_parts lists them: the norm, in_proj, the mixer between the projections (mamba2_mix, recording a
    verify), out_proj, the residual add, then the FFN half's."""
    x, n1, e1, in_w, in_sz, in_g = args[:6]
    conv, slots, conv_w, conv_b, dtb, A, D, norm_w, ssm, groups, eps, clamp, lo, hi = args[6:20]
    out_w, out_sz, out_g, prev, record = args[20:25]
    B, T = int(x.shape[0]), int(x.shape[1])
    zx, mixed = x.new_empty((B, T, int(in_w.shape[0]))), x.new_empty((B, T, int(out_w.shape[1]) * 2))
    mix_args = (zx, conv, slots, conv_w, conv_b, dtb, A, D, norm_w, ssm, prev, groups, eps, clamp, lo, hi, record)
    return [("rms_norm", None, (x, n1, e1), x), ("int4_linear", None, (x, in_w, in_sz, in_g), zx),
            ("mamba2_mix", None, mix_args, [mixed, *out[2:]]), ("int4_linear", None, (mixed, out_w, out_sz, out_g), x),
            ("add", None, (x, x), x), *ffn_residual_parts((x, *args[25:]), out[:2])]


def _priced_calls(w: dict[str, float]) -> float:
    """Linear calls and fused-operator calls in a work record: the ops priced per call, not by the per-op overhead."""
    return (sum(v for k, v in w.items() if k.startswith("call|"))
            + sum(w.get(f"fused|{k}|calls", 0.0) for k in FUSED_OPS))


_LAYER_OPS = {"mla_moe_layer": mla_moe_layer_parts, "mamba_ffn_layer": mamba_ffn_layer_parts,
              "gqa_moe_layer": gqa_moe_layer_parts, "ffn_residual": ffn_residual_parts}


class OpCounter:
    """Count the aten ops torch dispatches (a TorchDispatchMode) and the bytes and FLOPs each moves, attributed to a
    label the caller sets: per label {ops, bytes of non-matmul ops, matmul bytes and FLOPs by dtype (fp32, bf16, int4)}.
    The mode sees each op the engine calls once (what an op calls inside is not seen again), so nothing counts twice."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                out = func(*args, **(kwargs or {}))
                counter._record(func, args, out)
                return out

        self.counts: dict[Any, int] = {}
        self.work: dict[Any, dict[str, float]] = {}
        self.label: Any = None
        # the label a fused layer's FFN part is counted under, from the layer's label (the twin: layer i -> "f{i}",
        # as its hooks label the FFN module's own ops); by default the layer's
        self.ffn_label: Any = lambda label: label
        self.mode = _Mode()

    def _record(self, func: Any, args: Any, out: Any) -> None:
        name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
        split = _LAYER_OPS.get(name)
        if split is not None:  # a whole layer, or its FFN half: its parts' work, as the modules run them
            for part, lab, part_args, part_out in split(args, out):
                self._account(part, self.label if lab is None else self.ffn_label(self.label), part_args, part_out,
                              inner=True)
            self.counts[self.label] = self.counts.get(self.label, 0) + 1  # and one dispatch: the layer operator's
            return
        self._account(name, self.label, args, out)

    def _account(self, name: str, lab: Any, args: Any, out: Any, inner: bool = False) -> None:
        """Add one op's work under ``lab``. ``inner``: a part run inside a C++ layer operator, not dispatched on its
        own: it counts as ops only its linear calls and fused operators (priced per call, their count taken off the
        per-op overhead's), none for the elementwise ops between them (their bytes only)."""
        import torch

        w = self.work.setdefault(lab, {})
        n0, d0 = self.counts.get(lab, 0), _priced_calls(w) if inner else 0.0
        self.counts[lab] = n0 + 1
        ins = _tensors(args)
        outs = _tensors(out)
        nbytes = _op_bytes(name, ins, outs)
        if name == "moe_ffn":  # waferline.kernels' MoE block: the expert products it makes, as the linear calls they are
            calls = moe_ffn_calls(args)
            for key, n in calls.items():
                w[key] = w.get(key, 0.0) + n
            # one op per call, as everywhere else: the tables' per-call time carries the dispatch of the op itself
            self.counts[lab] += int(sum(calls.values())) - 1
        elif name == "mla_attend_int4":  # an int4 MLA block's decode step: the operators it runs, as each is priced
            inner, n_ops = mla_attend_work(args)
            for key, val in inner.items():
                w[key] = w.get(key, 0.0) + val
            self.counts[lab] += n_ops - 1
        elif name in FUSED_OPS and outs:  # waferline.kernels: priced by their own measured rates (calibrate)
            units = fused_units(name, ins, outs)
            for key, val in (("calls", 1.0), ("units", units), ("bytes", nbytes)):
                w[f"fused|{name}|{key}"] = w.get(f"fused|{name}|{key}", 0.0) + val
        elif name in _MATMUL_OPS and outs:
            if name == "einsum":
                flops = _einsum_flops(str(args[0]), _tensors(args[1]))
                x = _tensors(args[1])[0] if _tensors(args[1]) else outs[0]
            else:
                x = ins[1] if name in ("addmm", "baddbmm") and len(ins) > 1 else ins[0]
                flops = 2.0 * outs[0].numel() * (x.shape[-1] if x.dim() else 1)
            dt = "int4" if "int4" in name else ("fp32" if x.dtype == torch.float32 else "bf16")
            if name in _WEIGHT_OPS and len(ins) > 1:  # x @ W with a weight matrix: the measured linear table prices it
                wts = ins[2:3] if name == "addmm" else ins[1:2]
                if "int4" in name:
                    wts = [t for t in ins[1:] if t is not x]
                wb = float(sum(t.numel() * t.element_size() for t in wts))
                rows = max(1, x.numel() // max(1, x.shape[-1]))
                key = f"call|{dt}|{rows}|{int(wb)}"
                w[key] = w.get(key, 0.0) + 1.0
            else:
                w[f"mm_bytes_{dt}"] = w.get(f"mm_bytes_{dt}", 0.0) + nbytes
                w[f"mm_flops_{dt}"] = w.get(f"mm_flops_{dt}", 0.0) + flops
        else:  # elementwise, reductions, copies, scans: from cache when small; 16-bit ones convert on CPU
            lead = (ins or outs)[0] if (ins or outs) else None
            half = lead is not None and lead.dtype in (torch.bfloat16, torch.float16)
            key = ("small_bytes" if nbytes <= SMALL_OP_BYTES else "large_bytes") + ("_bf16" if half else "")
            w[key] = w.get(key, 0.0) + nbytes
        if inner:
            self.counts[lab] = n0 + round(_priced_calls(w) - d0)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> "OpCounter":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


def count_generate_ops(llm: Any, prompts: list[list[int]], max_tokens: int) -> int:
    """aten ops the engine dispatches for ``llm.generate(prompts, max_tokens)`` (greedy, eos ignored)."""
    from waferline.engine.sampling import SamplingParams

    with OpCounter() as c:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return c.total


def _generate_work(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """All labels merged: {ops, call|dtype|rows|bytes counts, ...} of one generate call."""
    from waferline.engine.sampling import SamplingParams

    return _forward_work(lambda: llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


def table_seconds(work: dict[str, float], tables: dict[str, Any]) -> tuple[float, float]:
    """(linear calls, their seconds from the measured linear tables) in a work record."""
    from waferline.sim.host import LinearTable

    lt = {k: LinearTable.from_dict(v) for k, v in tables.items()}
    n = t = 0.0
    for k, c in work.items():
        if k.startswith("call|"):
            _, dt, m, b = k.split("|")
            tab = lt.get(dt) or lt.get("bf16")
            n += c
            t += c * (tab.time(int(m), float(b)) if tab else 0.0)
    return n, t


def fused_calls(work: dict[str, float], rates: dict[str, tuple[float, float]] | None) -> float:
    """Calls of the fused operators that have measured rates in a work record (priced apart, not per op)."""
    return sum(work.get(f"fused|{k}|calls", 0.0) for k in (rates or {}))


def fused_seconds(work: dict[str, float], rates: dict[str, tuple[float, float]] | None) -> float:
    """Seconds of the fused operators in a work record at their measured rates (calls x t0 + units / rate)."""
    return sum(work.get(f"fused|{k}|calls", 0.0) * t0 + work.get(f"fused|{k}|units", 0.0) / rate
               for k, (t0, rate) in (rates or {}).items())


def multi_row_calls(work: dict[str, float]) -> float:
    """16-bit (fp32 / bf16) linear calls of two or more rows in a work record (sim.host.multi_row_product): the
    engine's oneDNN (bf16) or MKL (fp32) products, each with a fixed in-engine cost beyond the sweep's."""
    from waferline.model.layers import few_rows
    from waferline.sim.host import multi_row_product

    few = few_rows()
    return sum(v for k, v in work.items() if k.startswith("call|")
               and multi_row_product(k.split("|")[1], int(k.split("|")[2]), few))


def _timed_cpu(fn: Callable[[], Any]) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def _known_seconds(work: dict[str, float], ew: dict[str, float] | None, fused: dict[str, tuple[float, float]] | None,
                   mm_fits: dict[str, tuple[float, float]] | None, cold_bw: float | None = None) -> float:
    """The priced-apart part of a work record: other ops' bytes at the elementwise bandwidths, the fused operators at
    their rates (``cold_bw``: and their operands read from memory at it, as for a model beyond the last-level cache),
    and matmuls without a weight (attention, scans) at the roofline of the linear fit (``mm_fits``: dtype -> (bytes/s,
    FLOP/s)), as the host model prices them."""
    t = _bytes_seconds(work, ew or {}) + fused_seconds(work, fused)
    if cold_bw:
        t += sum(work.get(f"fused|{k}|bytes", 0.0) for k in (fused or {})) / cold_bw
    for dt, (bps, fps) in (mm_fits or {}).items():
        t += work.get(f"mm_bytes_{dt}", 0.0) / bps + work.get(f"mm_flops_{dt}", 0.0) / fps
    return t


def _bytes_seconds(work: dict[str, float], ew: dict[str, float]) -> float:
    """Seconds the non-matmul bytes of a work record take at the measured elementwise bandwidths."""
    return sum(work.get(f"{size}_bytes{suf}", 0.0) / ew[f"{dt}_{size}"]
               for size in ("small", "large") for suf, dt in (("", "fp32"), ("_bf16", "bf16")) if ew.get(f"{dt}_{size}"))


def _nnls_rel(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative errors with non-negative coefficients (drop negative ones and refit)."""
    Xr, yr = X / y[:, None], np.ones(len(y))
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    for _ in range(X.shape[1]):
        c, *_ = np.linalg.lstsq(Xr[:, active], yr, rcond=None)
        coef[:] = 0.0
        coef[active] = c
        neg = [a for a, v in zip(active, c) if v < 0]
        if not neg:
            break
        active = [a for a in active if a not in neg]
    return coef


def _per_token(llm: Any, prompts: list[list[int]], n: int, clock: Callable[[], float], repeats: int) -> float:
    """Seconds per decode token on ``clock``: (generating n + 1 tokens - generating 1) / n, each the fastest of
    ``repeats`` (the prefill and the first token cancel out). The fastest of each, not the smallest difference: one
    slow short run made that difference small, even negative on a busy machine."""
    return _per_token_clocks(llm, prompts, n, [clock], repeats)[0]


def _per_token_clocks(llm: Any, prompts: list[list[int]], n: int, clocks: list[Callable[[], float]],
                      repeats: int) -> list[float]:
    """_per_token on several clocks read around the same runs (wall time and the CPU of a pipeline's processes: each
    the fastest of the same ``repeats``, instead of one clock's runs and then the other's, fewer of them)."""
    from waferline.engine.sampling import SamplingParams

    short, long = [float("inf")] * len(clocks), [float("inf")] * len(clocks)
    for _ in range(repeats):
        t0 = [c() for c in clocks]
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        t1 = [c() for c in clocks]
        llm.generate(prompts, SamplingParams(max_tokens=n + 1, ignore_eos=True))
        t2 = [c() for c in clocks]
        short = [min(s, b - a) for s, a, b in zip(short, t0, t1)]
        long = [min(g, b - a) for g, a, b in zip(long, t1, t2)]
    return [(g - s) / n for g, s in zip(long, short)]


BIG_PREFILL_ROWS = (1, 8)  # prompts of 32 tokens in one prefill forward of the big calibration model


def _prefill_forward(llm: Any, prompts: list[list[int]]) -> Callable[[], Any]:
    """One prefill forward of ``prompts`` (equal lengths) through the single-process engine's model, fresh caches,
    the last position's logits and argmax: what a pipeline of one stage runs for a prefill micro-batch."""
    import torch

    from waferline.model.context import StepBatch

    model = llm.model
    toks = torch.tensor(prompts)
    n, P = toks.shape

    def run() -> Any:
        with torch.inference_mode():
            caches = model.new_caches(n)
            h = model(toks, caches, StepBatch.make(list(range(n)), [0] * n, P))
            return model.logits(h[:, -1]).argmax(-1)
    return run


# products with a weight
# (waferline::ffn_residual, a layer's FFN half as one op: its self time is its experts' or dense FFN's products but for
# a norm, the routing and an add, a few percent of it at prefill sizes; counted as "rest" it doubled the from-memory
# prefill rest scale, 1.37 -> 2.0-2.05, and priced sol-mini's single-process TTFT x1.3-1.4 slow: session 18)
_LINEAR_EVENTS = ("linear", "aten::mm", "aten::addmm", "int4pack_mm", "int4_linear", "waferline::moe_ffn",
                  "waferline::ffn_residual")
_OTHER_MM_EVENTS = ("aten::bmm", "aten::baddbmm", "aten::matmul", "aten::einsum")  # matmuls without one


def _profiled_shares(fn: Callable[[], Any]) -> tuple[float, float, float]:
    """One profiled call of ``fn`` (torch.profiler, CPU): the shares of its ops' self time spent in products with a
    weight (linear layers, oneDNN / MKL / int4 products, the fused MoE block's expert products, the fused FFN half),
    in matmuls without a weight (attention, scans), and in everything else."""
    import sys

    from torch.profiler import ProfilerActivity, profile

    sys.stderr.flush()
    saved = os.dup(2)  # the profiler's C++ side prints a line at start and stop to fd 2 (the progress bar's)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    lin = other = rest = 0.0
    for e in prof.key_averages():
        t = float(e.self_cpu_time_total)
        if any(k in e.key for k in _LINEAR_EVENTS):
            lin += t
        elif any(k == e.key for k in _OTHER_MM_EVENTS):
            other += t
        else:
            rest += t
    tot = lin + other + rest
    return (lin / tot, other / tot, rest / tot) if tot > 0 else (0.0, 0.0, 0.0)


def _forward_work(fn: Callable[[], Any]) -> dict[str, float]:
    """All labels merged: {ops, call|dtype|rows|bytes counts, ...} of one call of ``fn``."""
    with OpCounter() as c:
        fn()
    out: dict[str, float] = {"ops": float(c.total)}
    for w in c.work.values():
        for k, v in w.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _decode_step_probe(llm: Any, prompts: list[list[int]], tokens: int) -> tuple[dict[str, float], float]:
    """One decode step of ``prompts`` on the single-process engine: its counted work (ops, linear calls, bytes: the
    difference between generating ``tokens + 1`` and 1 token, per token) and its CPU seconds (the same difference,
    fastest of 3, after a warm-up; CPU time of this single-threaded process, see _best). The warm-up comes first:
    one-time work (weights laid out for oneDNN, absorbed MLA weights) must not land in either counted run."""
    from waferline.engine.sampling import SamplingParams

    llm.generate(prompts, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))  # warm-up
    w2, w1 = _generate_work(llm, prompts, tokens + 1), _generate_work(llm, prompts, 1)
    step = {k: (w2.get(k, 0.0) - w1.get(k, 0.0)) / tokens for k in set(w1) | set(w2)}
    return step, _per_token(llm, prompts, tokens, time.process_time, 3)


def engine_overhead(dtype: str, models: list[tuple[int, int]], batches: list[int], tokens: int, workdir: Path,
                    tables: dict[str, Any] | None = None, ew: dict[str, float] | None = None,
                    big: tuple[int, int, int] | None = None, dram_tables: dict[str, Any] | None = None,
                    prefill_model: tuple[int, int, int] | None = None,
                    int4_models: list[tuple[int, int]] | None = None,
                    fused: dict[str, tuple[float, float]] | None = None,
                    mm_fits: dict[str, tuple[float, float]] | None = None,
                    dram_bw: float | None = None) -> dict[str, Any]:
    """The single-process engine's decode step on calibration models of its own architecture (random `sol` models of
    (hidden, layers) in ``models``, at each batch in ``batches``): CPU seconds per step - other ops' bytes at the
    elementwise bandwidths = step_overhead + op_overhead x non-linear aten ops + linear_scale x the step's linear calls
    priced by the (cache-resident) linear ``tables`` + row_overhead x sequences in the step (the loop's Python work per
    sequence: sampling, stop checks) + multi_call_overhead x 16-bit linear calls of two or more rows (oneDNN products:
    each costs ~20 us more inside the engine than back to back in the sweep, whatever its size; a step at batch 2,
    flat beyond) -- relative least squares, non-negative. ``linear_scale`` is how much slower a linear runs inside the
    engine (other ops between them, cold caches) than in the isolated sweep.
    ``big`` = (hidden, layers, FFN) of a model whose weights do not fit in the last-level cache: its measured step
    minus the fitted other terms, over its linears priced by ``dram_tables``, is ``linear_scale_dram`` (a linear
    reading its weight from memory inside the engine vs in the sweep). The from-memory prefill scales are measured on
    ``prefill_model`` (same tuple; ``big`` when None): a model as large, whose products are the size of the twin's
    models' (0.5-5 MB), since a product's in-engine scale depends on its shape. Ops are counted (TorchDispatchMode) on
    separate, untimed runs. The fused operators (``fused``: name -> (t0, units/s) from fused_op_probe) are priced
    apart, like the other ops' bytes."""
    import torch

    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    pts: list[dict[str, Any]] = []
    pre: list[dict[str, Any]] = []
    try:
        for h, L in models:
            d = calibration_checkpoint(workdir, h, L)
            llm = LLM(d, dtype="bfloat16" if dtype == "bf16" else "float32")
            for P in (32, 96):  # prefill: one prompt of P tokens (generate with max_tokens=1)
                prompt = [[(5 * j + 3) % 200 + 2 for j in range(P)]]
                llm.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))  # warm-up (one-time work) first
                wp = _generate_work(llm, prompt, 1)
                n_lin, t_lin = table_seconds(wp, tables or {})
                best = min(_timed_cpu(lambda: llm.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))) for _ in range(3))
                pre.append({"hidden": h, "layers": L, "prompt": P, "ops": wp["ops"], "linear_calls": n_lin,
                            "fused_calls": fused_calls(wp, fused), "multi_row_calls": multi_row_calls(wp),
                            "linear_table_s": t_lin,
                            "bytes_s": _known_seconds(wp, ew, fused, mm_fits), "seconds": best})
            for B in batches:
                prompt = [[(3 * j + 5 + 7 * r) % 200 + 2 for j in range(8)] for r in range(B)]
                step, best = _decode_step_probe(llm, prompt, tokens)
                n_lin, t_lin = table_seconds(step, tables or {})
                t_bytes = _known_seconds(step, ew, fused, mm_fits)
                if best <= 0:
                    continue  # a disturbed probe: leave the point out
                pts.append({"hidden": h, "layers": L, "batch": B, "ops_per_step": step["ops"], "linear_calls": n_lin,
                            "multi_row_calls": multi_row_calls(step), "fused_calls": fused_calls(step, fused),
                            "linear_table_s": t_lin, "bytes_s": t_bytes,
                            "seconds_per_step": best})
    finally:
        torch.set_num_threads(old)
    X = np.array([[1.0, p["ops_per_step"] - p["linear_calls"] - p["fused_calls"], p["linear_table_s"], p["batch"],
                   p["multi_row_calls"]] for p in pts])
    y = np.array([max(p["seconds_per_step"] - p["bytes_s"], 1e-7) for p in pts])
    a, c, g, r, dm = (float(v) for v in _nnls_rel(X, y))
    if c <= 0:  # noise: the mean time per op
        c = float(np.mean(y / np.maximum(X[:, 1], 1.0)))
    if g <= 0:
        g = 1.0
    pred = X @ np.array([a, c, g, r, dm])
    one = [p for p in pts if p["hidden"] == models[0][0] and p["batch"] == batches[0]]
    # prefill: its own per-op cost and linear scale (longer tensors per op than decode)
    Xp = np.array([[1.0, p["ops"] - p["linear_calls"] - p["fused_calls"], p["linear_table_s"]] for p in pre])
    # the decode fit's in-engine cost per 16-bit product of 2+ rows (every prefill linear is one) is taken as known:
    # a scale fitted on the calibration models' tiny GEMMs would otherwise carry it to large ones
    yp = np.array([max(p["seconds"] - p["bytes_s"] - dm * p["multi_row_calls"], 1e-7) for p in pre])
    ap, cp, gp = (float(v) for v in _nnls_rel(Xp, yp)) if len(pre) >= 3 else (0.0, c, g)
    predp = Xp @ np.array([ap, cp, gp]) if len(pre) >= 3 else yp
    # int4 prefill: the same models quantized (RTN, group 128); their int4 GEMMs against the int4 table, the other terms
    # from the bf16 fit above (the scale fitted there is a bf16 figure: int4 kernels are compute-bound at 32+ rows)
    g_int4, int4_pts = None, []
    if int4_models and tables and "int4" in tables:
        from waferline.model.quant import QuantOptions, quantize_checkpoint

        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for h, L in int4_models:
                src = calibration_checkpoint(workdir, h, L)
                d = src.with_name(src.name + "-int4")
                if not (d / "config.json").is_file():
                    quantize_checkpoint(str(src), str(d), QuantOptions())
                llm = LLM(d, dtype="bfloat16")
                for P in (32, 96):
                    prompt = [[(5 * j + 3) % 200 + 2 for j in range(P)]]
                    llm.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))  # warm-up (one-time work) first
                    wp = _generate_work(llm, prompt, 1)
                    _, t4 = table_seconds({k: v for k, v in wp.items() if k.startswith("call|int4|")}, tables)
                    n_lin, t_lin = table_seconds(wp, tables)
                    sec = min(_timed_cpu(lambda: llm.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
                              for _ in range(3))
                    rest = (ap + (cp if cp > 0 else c) * (wp["ops"] - n_lin - fused_calls(wp, fused))
                            + (gp if gp > 0 else g) * (t_lin - t4) + _known_seconds(wp, ew, fused, mm_fits)
                            + dm * multi_row_calls(wp))
                    if t4 > 0 and sec > rest:
                        int4_pts.append({"hidden": h, "layers": L, "prompt": P, "seconds": sec, "int4_table_s": t4,
                                         "rest_s": rest, "scale": (sec - rest) / t4})
        finally:
            torch.set_num_threads(old)
        if int4_pts:
            g_int4 = float(np.median([p["scale"] for p in int4_pts]))
    # a model whose weights do not fit in the last-level cache: its linears against the from-memory table, with the
    # other terms from the fit above (its step is mostly linears, so this is well determined)
    g_dram, g_dram_multi, g_pre_dram, g_pre_dram_batch, r_pre_dram, big_pts = g, None, None, None, None, []
    cp_ = cp if cp > 0 else c
    if big is not None and dram_tables:
        h, L, ffn = big
        d = big_calibration_checkpoint(workdir, big)
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            llm = LLM(d, dtype="bfloat16" if dtype == "bf16" else "float32")
            for B in BIG_PROBE_BATCHES:  # 1: one-row products (ATen's GEMV); 8: multi-row ones (oneDNN), apart
                prompt = [[(3 * j + 5 + 7 * r_) % 200 + 2 for j in range(8)] for r_ in range(B)]
                step, sec = _decode_step_probe(llm, prompt, tokens)
                n_lin, t_lin = table_seconds(step, dram_tables)
                _, t_one = table_seconds({k: v for k, v in step.items() if k.startswith("call|") and k.split("|")[2] == "1"},
                                         dram_tables)
                rest = (a + c * (step["ops"] - n_lin - fused_calls(step, fused)) + r * B + dm * multi_row_calls(step)
                        + _known_seconds(step, ew, fused, mm_fits, dram_bw))
                if sec > rest and t_lin > 0:
                    big_pts.append({"hidden": h, "layers": L, "batch": B, "seconds_per_step": sec, "linear_table_s": t_lin,
                                    "one_row_table_s": t_one, "rest_s": rest, "scale": (sec - rest) / t_lin})
            # its prefill: GEMMs the size of a real model's, where the tiny models' prefill scale, fitted on GEMMs
            # dominated by their fixed cost, does not carry. One 32-token prompt (as the single-process engine
            # prefills) and 8 of them in one forward (as a pipeline stage prefills a micro-batch: 256-row GEMMs), each
            # split by the profiler: its products' share of the CPU seconds over their from-memory table price, and
            # the other ops' share over their price (one prompt's products ran ~1.3-1.7x their table price here, a
            # batch's ~0.95-1.1x, so neither scale carries to the other). On the prefill model: the big model's
            # 8-17 MB products ran one prompt at 1.35-1.48x their price where a model of 2-5 MB products, and
            # dsv3-100m, ran at 1.03-1.22x (session 15, interleaved in one process)
            from waferline.sim.host import PREFILL_PROBE_TOKENS as P32

            if prefill_model is not None and prefill_model != big:
                llm.close()
                h, L, _ = prefill_model
                llm = LLM(big_calibration_checkpoint(workdir, prefill_model),
                          dtype="bfloat16" if dtype == "bf16" else "float32")
            for rows in BIG_PREFILL_ROWS:
                prompts = [[(5 * j + 3 + 11 * r_) % 200 + 2 for j in range(P32)] for r_ in range(rows)]
                fwd = _prefill_forward(llm, prompts)
                fwd()  # warm-up (one-time work) first
                wp = _forward_work(fwd)
                n_lin, t_lin = table_seconds(wp, dram_tables)
                sec = min(_timed_cpu(fwd) for _ in range(3))
                # where its time goes (the profiler's self time per op, as shares of the timed seconds): products
                # with a weight, matmuls without one (priced at their roofline, not scaled), everything else
                lin_share, _, rest_share = _profiled_shares(fwd)
                rest = cp_ * (wp["ops"] - n_lin - fused_calls(wp, fused)) + _known_seconds(wp, ew, fused, None, dram_bw)
                lin_s = lin_share * sec - dm * multi_row_calls(wp)
                if lin_s > 0 and t_lin > 0 and rest > 0:
                    pt = {"hidden": h, "layers": L, "prompt": P32, "rows": rows, "tokens": P32 * rows, "seconds": sec,
                          "linear_table_s": t_lin, "linear_share": lin_share, "scale": lin_s / t_lin,
                          "rest_priced_s": rest, "rest_share": rest_share, "rest_scale": rest_share * sec / rest}
                    big_pts.append(pt)
                    if rows == 1:
                        g_pre_dram, r_pre_dram = pt["scale"], pt["rest_scale"]
                    else:
                        g_pre_dram_batch = {"tokens": P32 * rows, "scale": pt["scale"], "rest_scale": pt["rest_scale"]}
        finally:
            torch.set_num_threads(old)
        at1 = [p for p in big_pts if p.get("batch") == 1]
        if at1:
            g_dram = at1[0]["scale"]
        for p in big_pts:  # multi-row calls: what is left after the one-row ones at the batch-1 scale
            if "batch" not in p:
                continue
            multi = p["linear_table_s"] - p["one_row_table_s"]
            if p["batch"] > 1 and multi > 0 and p["seconds_per_step"] - p["rest_s"] > g_dram * p["one_row_table_s"]:
                g_dram_multi = (p["seconds_per_step"] - p["rest_s"] - g_dram * p["one_row_table_s"]) / multi
        if big_pts and not at1:
            g_dram = float(np.median([p["scale"] for p in big_pts if "batch" in p] or [g]))
    return {"prefill_linear_scale_int4": g_int4, "int4_prefill_points": int4_pts,
            "linear_scale_dram": g_dram, "linear_scale_dram_multi": g_dram_multi, "big_points": big_pts, "op_overhead_s": c, "step_overhead_s": a, "linear_scale": g, "row_overhead_s": r, "multi_call_overhead_s": dm,
            "prefill_op_overhead_s": cp if cp > 0 else c, "prefill_linear_scale": gp if gp > 0 else g,
            "prefill_linear_scale_dram": g_pre_dram, "prefill_linear_scale_dram_batch": g_pre_dram_batch,
            "prefill_rest_scale_dram": r_pre_dram,
            "prefill_overhead_s": ap, "prefill_points": pre,
            "prefill_fit_error_factor": float(np.exp(np.median(np.abs(np.log(np.maximum(predp, 1e-9) / yp))))),
            "points": pts,
            "fit_error_factor": float(np.exp(np.median(np.abs(np.log(pred / y))))),
            "ops_per_layer": float((one[-1]["ops_per_step"] - one[0]["ops_per_step"]) / max(one[-1]["layers"] - one[0]["layers"], 1))}


def speculative_overhead(dtype: str, workdir: str | Path, tokens: int, op_s: float, k: int = 3,
                         tables: dict[str, Any] | None = None, scale: float = 1.0,
                         ew: dict[str, float] | None = None, row_s: float = 0.0, multi_s: float = 0.0,
                         fused: dict[str, tuple[float, float]] | None = None,
                         mm_fits: dict[str, tuple[float, float]] | None = None) -> dict[str, float]:
    """Per verify step, the speculative engine's Python work that dispatches no aten op (drafting, verification,
    rollback bookkeeping): CPU seconds per verify step of the 2-layer calibration model with prompt-lookup drafting
    minus per-op overhead x ops per verify step (ops counted on a separate run)."""
    import torch

    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(Path(workdir) / "tiny-2", dtype="bfloat16" if dtype == "bf16" else "float32", speculative="ngram",
                  num_speculative_tokens=k, speculative_adaptive=False)
        prompt = [[(3 * j + 5) % 200 + 2 for j in range(8)] * 2]

        def steps(max_tokens: int) -> float:
            out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
            return float(out.metrics.get("spec_verify_steps", 0.0))

        steps(tokens + 1)  # warm-up: one-time work (weight layouts) must not land in a counted run
        w1, w2 = {}, {}
        for store, mt in ((w1, 1), (w2, tokens + 1)):
            with OpCounter() as c:
                n = steps(mt)
            store["ops"] = float(c.total)
            for wk in c.work.values():
                for kk, vv in wk.items():
                    store[kk] = store.get(kk, 0.0) + vv
        per = {kk: (w2.get(kk, 0.0) - w1.get(kk, 0.0)) / max(n, 1.0) for kk in set(w1) | set(w2)}
        n_lin, t_lin = table_seconds(per, tables or {})
        # one sequence (row_s); multi_s per 16-bit product of 2+ rows (a verify step's tokens)
        t_lin = (t_lin * scale + _known_seconds(per, ew, fused, mm_fits) + row_s + multi_s * multi_row_calls(per))
        ops = per["ops"] - n_lin - fused_calls(per, fused)
        b1 = bn = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            steps(1)
            t1 = time.process_time()
            n = steps(tokens + 1)
            t2 = time.process_time()
            b1, bn = min(b1, t1 - t0), min(bn, t2 - t1)
        best = max(0.0, (bn - b1) / max(n, 1.0))
    finally:
        torch.set_num_threads(old)
    return {"seconds_per_verify_step": best, "ops_per_verify_step": ops,
            "spec_step_overhead_s": max(0.0, best - t_lin - op_s * ops)}


# head shapes of the fused-operator probe: a sol-mini-like and a DeepSeek-V3-like MLA head set (H, nope, rank, rope, v),
# and Mamba-2 state shapes (heads, head dim, state size)
FUSED_PROBE_MLA = [(4, 32, 64, 16, 32), (12, 64, 256, 32, 64)]
FUSED_PROBE_SSM = [(4, 16, 16), (8, 64, 32)]
FUSED_PROBE_ROWS = (1, 8, 32, 256)  # rows of silu_mul / rms_norm (decode, batched decode and verify, prefill)
FUSED_PROBE_WIDTHS = (256, 1024, 3072)  # their output widths (hidden sizes, FFN / expert widths)


def fused_op_probe(quick: bool = False) -> dict[str, Any] | None:
    """Seconds per call of waferline's fused CPU operators (mla_decode, ssm_update) against their work units (FLOPs;
    state elements updated) over rows x tokens 1-4 (mla_decode) and 1-32, one thread, the same call back to back (best
    of 3 x 5), as the engine calls them (ssm_update with its states gathered and scattered back, a verify's kept first); fit
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


BIG_CALIBRATION_MODEL = (1024, 4, 4096)  # (hidden, layers, FFN): ~100 MB in bf16, more than a last-level cache
# the from-memory prefill probe's model: as far beyond the cache (~130 MB in bf16), products of 1-5 MB like the twin's
# models' (the big model's 8-17 MB products run slower against the table than products of these sizes)
PREFILL_CALIBRATION_MODEL = (768, 8, 1536)


def big_calibration_checkpoint(workdir: str | Path, big: tuple[int, int, int] = BIG_CALIBRATION_MODEL) -> Path:
    """The random calibration model beyond the last-level cache, (hidden, layers, FFN) = ``big``, under ``workdir``
    (written on first use, from a fixed seed: the same weights wherever it is written)."""
    from waferline.model.init import write_random_checkpoint

    h, L, ffn = big
    d = Path(workdir) / f"big-h{h}-{L}"
    if not (d / "config.json").is_file():
        write_random_checkpoint(dict(tiny_config(L), hidden_size=h, intermediate_size=ffn, moe_intermediate_size=ffn // 2,
                                     num_attention_heads=8, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                                     v_head_dim=64, mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64), d, seed=7)
    return d


CANARY_TOKENS = 6  # decode tokens per canary run


class Canary:
    """A fixed engine workload that says how fast this machine runs right now: wall seconds per decode token of the big
    calibration model (weights beyond the last-level cache, so it moves both with the CPU time this process gets and
    with memory bandwidth), one 8-token sequence, bf16, one thread, fastest of 2 (~0.2 s). calibrate records it with
    its figures; twin runs it before every Plan it measures, so each Plan's error can be read against how much faster
    or slower the machine ran then than during the calibration (this VM: 1.3-2.4x slower for minutes at a time)."""

    def __init__(self, workdir: str | Path):
        from waferline.engine.llm import LLM
        from waferline.engine.sampling import SamplingParams

        self.llm = LLM(big_calibration_checkpoint(workdir, BIG_CALIBRATION_MODEL), dtype="bfloat16")
        self.prompt = [[(3 * j + 5) % 200 + 2 for j in range(8)]]
        self.llm.generate(self.prompt, SamplingParams(max_tokens=2, ignore_eos=True))  # one-time work off the clock

    def seconds(self, repeats: int = 2) -> float:
        """(generating CANARY_TOKENS + 1 tokens - generating 1) / CANARY_TOKENS, each the fastest of ``repeats``."""
        import torch

        from waferline.engine.sampling import SamplingParams

        def best(n: int) -> float:
            out = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                self.llm.generate(self.prompt, SamplingParams(max_tokens=n, ignore_eos=True))
                out = min(out, time.perf_counter() - t)
            return out

        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return max(best(CANARY_TOKENS + 1) - best(1), 1e-9) / CANARY_TOKENS
        finally:
            torch.set_num_threads(old)

    def close(self) -> None:
        self.llm.close()


BIG_PROBE_BATCHES = (1, 8)  # its decode batches: one-row products at 1, multi-row ones at 8
CPU_PROBE_TOKENS = 96  # tokens per CPU-time probe of the pipeline (workers read through /proc: schedstat, else 10 ms ticks)
HOP_PROBE_MODELS = [(64, 2), (384, 4), (768, 4)]  # (hidden, layers) of the pipeline probe's calibration models
AFD_PROBE_MODEL = (384, 4)  # (hidden, layers) of the AFD probe's calibration model (one of the above)


def pipeline_overhead(workdir: str | Path, tokens: int, link_s: float = 0.0,
                      models: list[tuple[int, int]] | None = None,
                      afd_model: tuple[int, int] = AFD_PROBE_MODEL) -> dict[str, Any]:
    """One pipeline hop as the engine sees it, against how long the receiving stage had been idle: for calibration
    models of growing size, a 2-stage pipeline at one sequence, (per-token time - the single-process step) / 2 hops,
    beside how long a stage waits per token (the per-token time minus its half of the step). A stage process that sleeps longer wakes
    up slower (measured on this VM: ~0.5 ms per hop after ~0.3 ms idle, ~0.8 ms after ~4 ms)."""
    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams

    prompt = [[(3 * j + 5) % 200 + 2 for j in range(8)]]
    points = []
    for h, L in models or HOP_PROBE_MODELS:
        d = calibration_checkpoint(workdir, h, L)
        llm = LLM(d, dtype="float32")
        llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        single = _per_token(llm, prompt, tokens, time.perf_counter, 3)  # wall time, as the pipeline's per-token time is
        single_cpu = _per_token(llm, prompt, CPU_PROBE_TOKENS, time.process_time, 2)
        del llm
        best = float("inf")
        with LLM(d, dtype="float32", stages=2, micro_batches=1, threads_per_stage=1) as pl:
            pl.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
            pids = [os.getpid()] + list(getattr(pl._pipeline, "pids", []) or [])
            for _ in range(3):
                out = pl.generate(prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))[0]
                r = out.metrics.get("tokens_per_s_per_user") or out.metrics.get("decode_tokens_per_s") or 0.0
                if r > 0:
                    best = min(best, 1.0 / r)
            # CPU of all its processes: the workers' is read from /proc in clock ticks (10 ms), so over many tokens
            # (fastest of 3: the stage fit's inflation, from the largest model's difference, moved 0.04-0.55 between
            # calibrations with the fastest of 2)
            pipe_cpu = _per_token(pl, prompt, CPU_PROBE_TOKENS, lambda: sum(process_cpu_seconds(p) for p in pids), 3)
        points.append({"hidden": h, "layers": L, "single_step_s": single, "per_token_s": best,
                       "idle_s": max(0.0, best - single / 2), "hop_s": max(0.0, (best - single) / 2),
                       "single_cpu_s": single_cpu, "pipeline_cpu_s": pipe_cpu,
                       "stage_step_cpu_s": max(0.0, (pipe_cpu - single_cpu) / 2)})
    first = points[0]
    fixed, inflation = stage_cpu_fit(points)
    out = {"per_token_s": first["per_token_s"], "single_process_step_s": first["single_step_s"],
           "hop_latency_s": first["hop_s"], "hop_overhead_s": max(0.0, first["hop_s"] - link_s), "points": points,
           "stage_step_cpu_s": fixed, "stage_cpu_inflation": inflation}
    try:
        out["afd"] = afd_exchange_cpu(Path(workdir), afd_model, prompt)
    except Exception as e:  # noqa: BLE001 - AFD may be unavailable; the pipeline figures stand
        out["afd_error"] = f"{type(e).__name__}: {e}"[:200]
    return out


OVERSUB_STAGES = 8  # stage processes of the oversubscribed probe (the default twin grid's one-layer-per-stage Plans: 8-10)
OVERSUB_PROBE_MODELS = [(64, 8), (768, 8)]  # (hidden, layers): one layer per stage process


def oversubscribed_pipeline(workdir: str | Path, tokens: int, stages: int = OVERSUB_STAGES,
                            models: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """A stage step when there are more stage processes than cores (one layer per stage on a small host): each
    process sleeps between its steps while others run on its core, and wakes with cold caches. For calibration models
    of ``stages`` layers, bf16, one layer per stage process: one sequence (micro-batch 1: one process runs at a time)
    and ``stages`` sequences in ``stages`` micro-batches (every process busy). Per token, CPU of all processes -
    the single process's (x the micro-batches: each stage runs that many one-row steps) = stage steps x fixed +
    inflation x the single process's compute, fitted per regime over the models; and the one-sequence chain's wall
    time over its CPU (the chain is serial: a hop is a process waking up)."""
    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams

    one = [[(3 * j + 5) % 200 + 2 for j in range(8)]]
    many = [[(3 * j + 7 * r + 5) % 200 + 2 for j in range(8)] for r in range(stages)]
    points = []
    for h, L in models or OVERSUB_PROBE_MODELS:
        d = calibration_checkpoint(workdir, h, L)
        llm = LLM(d, dtype="bfloat16")
        llm.generate(one, SamplingParams(max_tokens=4, ignore_eos=True))
        single_cpu = _per_token(llm, one, tokens, time.process_time, 2)
        del llm
        p: dict[str, float] = {"hidden": h, "layers": L, "stages": stages, "single_cpu_s": single_cpu}
        # one sequence makes one micro-batch (the engine splits the rows in min(micro-batches, rows))
        with LLM(d, dtype="bfloat16", stages=stages, micro_batches=stages, threads_per_stage=1) as pl:
            pids = [os.getpid()] + list(getattr(pl._pipeline, "pids", []) or [])
            for key, prompts in (("m1", one), ("mS", many)):
                pl.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
                # wall and CPU around the same three runs, each the fastest (the CPU of one run after two timed
                # ones came out above 2 cores x the fastest wall time: a slow phase of the machine, not the Plan's)
                p[f"{key}_wall_s"], p[f"{key}_cpu_s"] = _per_token_clocks(
                    pl, prompts, tokens, [time.perf_counter, lambda: sum(process_cpu_seconds(q) for q in pids)], 3)
        points.append(p)
    return dict(oversubscribed_fit(points, stages), stages=stages, points=points)


def oversubscribed_fit(points: list[dict[str, float]], stages: int) -> dict[str, float]:
    """The oversubscribed probe's figures from its per-model points (see oversubscribed_pipeline)."""
    out: dict[str, float] = {}
    for key, mb in (("m1", 1), ("mS", stages)):
        steps = stages * mb  # one-row stage steps per token (each of the stages runs one per micro-batch)
        x = np.array([mb * q["single_cpu_s"] for q in points])
        y = np.array([max(0.0, q[f"{key}_cpu_s"] - mb * q["single_cpu_s"]) for q in points])
        out[f"{key}_step_cpu_s"], out[f"{key}_cpu_inflation"] = _fixed_inflation_fit(x, y, float(steps))
    out["m1_wall_per_cpu"] = float(np.median([q["m1_wall_s"] / q["m1_cpu_s"] for q in points if q["m1_cpu_s"] > 0]))
    return out


def oversubscribed_figures(ov: dict[str, Any], tag: str) -> dict[str, Any]:
    """The hardware YAML entries of an oversubscribed_pipeline() result (host_engine.pipeline.oversubscribed)."""
    S = ov["stages"]
    models = [(int(p["hidden"]), int(p["layers"])) for p in ov["points"]]
    base = (f"{S}-stage pipelines (one layer per stage process, more processes than cores) of calibration models "
            f"(hidden, layers) = {models}, bf16, 1 thread per process")
    fit = ("CPU seconds of all processes per token - the single process's x micro-batches = stage steps x "
           "{what}_step_cpu_s + {what}_cpu_inflation x the single process's CPU x micro-batches, least squares over "
           "the models, both >= 0")
    return {
        "stages": S,
        "m1_step_cpu_s": _fig(ov["m1_step_cpu_s"], tag, base + ", 1 sequence (one micro-batch): " + fit.format(what="m1")
                              + "; a stage step's CPU besides computing"),
        "m1_cpu_inflation": _fig(ov["m1_cpu_inflation"], tag, base + ", 1 sequence: the same fit, how much more CPU a "
                                 "stage's compute takes than in one process"),
        "m1_wall_per_cpu": _fig(ov["m1_wall_per_cpu"], tag, base + ", 1 sequence: wall seconds per token / CPU seconds "
                                "of all processes per token, median over the models (the chain is serial)"),
        "mS_step_cpu_s": _fig(ov["mS_step_cpu_s"], tag, base + f", {S} sequences in {S} micro-batches (every process "
                              "busy): " + fit.format(what="mS")),
        "mS_cpu_inflation": _fig(ov["mS_cpu_inflation"], tag, base + f", {S} sequences in {S} micro-batches: the same "
                                 "fit"),
        "probes": ov["points"],
    }


def _fixed_inflation_fit(x: np.ndarray, y: np.ndarray, n_fixed: float) -> tuple[float, float]:
    """y = n_fixed x fixed + inflation x x, least squares with both terms >= 0."""
    X = np.stack([np.full_like(x, n_fixed), x], axis=1)
    c, *_ = np.linalg.lstsq(X, y, rcond=None)
    if c[0] < 0:
        return 0.0, float(max(0.0, x @ y / (x @ x)))
    if c[1] < 0:
        return float(y.mean() / n_fixed), 0.0
    return float(c[0]), float(c[1])


def stage_cpu_fit(points: list[dict[str, float]]) -> tuple[float, float]:
    """(CPU s per stage step besides computing, relative CPU inflation of a stage's compute) from the 2-stage probes:
    pipeline CPU - single-process CPU = 2 x fixed + inflation x single-process CPU per token, least squares with both
    terms >= 0. The extra CPU grows with the model (~0.6 ms per token for the smallest probe, ~2-4 ms for the largest):
    a stage's compute runs slower than in one process (caches cold after each wake-up), besides a fixed cost per step."""
    x = np.array([p["single_cpu_s"] for p in points])
    y = np.array([max(0.0, p["pipeline_cpu_s"] - p["single_cpu_s"]) for p in points])
    return _fixed_inflation_fit(x, y, 2.0)


def afd_exchange_cpu(workdir: Path, model: tuple[int, int], prompt: list[list[int]]) -> dict[str, Any]:
    """CPU per message of attention/FFN disaggregation: one attention and one FFN rank (engine/afd.py) decoding one
    sequence of a calibration model, CPU seconds of all its processes per token minus the single process's, over the 4
    messages of each FFN layer's exchange (each side sends one and receives one)."""
    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams

    h, L = model
    d = calibration_checkpoint(workdir, h, L)
    llm = LLM(d, dtype="bfloat16")
    llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    single_cpu = _per_token(llm, prompt, CPU_PROBE_TOKENS, time.process_time, 2)
    del llm
    with LLM(d, dtype="bfloat16", afd=True, attention_ranks=1, ffn_ranks=1, micro_batches=1, threads_per_rank=1) as al:
        al.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        pids = [os.getpid()] + list(getattr(al._pipeline, "pids", []) or [])
        afd_cpu = _per_token(al, prompt, CPU_PROBE_TOKENS, lambda: sum(process_cpu_seconds(p) for p in pids), 2)
        n_ffn = sum(1 for layer in al.spec.layers if layer.ffn is not None)
    out = {"hidden": h, "layers": L, "ffn_layers": n_ffn, "single_cpu_s": single_cpu, "afd_cpu_s": afd_cpu,
           "message_cpu_s": max(0.0, (afd_cpu - single_cpu) / (4 * max(n_ffn, 1)))}
    out.update(afd_overlapped(d, [[(p_ + 7 * r) % 200 + 2 for p_ in prompt[0]] for r in range(4)], n_ffn))
    return out


def afd_overlapped(d: Path, prompts: list[list[int]], n_ffn: int, micro_batches: int = 2, tokens: int = 32
                   ) -> dict[str, Any]:
    """AFD with both sides working (several sequences in micro-batches ping-ponging): the link time of one message, from
    the engine's own time split (engine/afd.py: issuing sends + the part of each wait after the peer had sent) per
    message, mean of both ranks, fastest of 2 runs -- about twice an idle pipeline's hop here (~0.5-0.65 vs ~0.35 ms):
    a message waits for a core busy with the other rank's compute; and the CPU per message end, as in the one-sequence
    probe but at these rows (dispatching and combining several rows' experts)."""
    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams

    llm = LLM(d, dtype="bfloat16")
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    single_cpu = _per_token(llm, prompts, tokens, time.process_time, 2)
    del llm
    best = float("inf")
    with LLM(d, dtype="bfloat16", afd=True, attention_ranks=1, ffn_ranks=1, micro_batches=micro_batches,
             threads_per_rank=1) as al:
        al.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        pids = [os.getpid()] + list(getattr(al._pipeline, "pids", []) or [])
        for _ in range(2):
            al._pipeline.time_split(reset=True)
            al.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
            ranks = al._pipeline.time_split(reset=True)["ranks"].values()
            per = [r["transfer"] / r["messages"] for r in ranks if r.get("messages")]
            if per:
                best = min(best, float(np.mean(per)))
        afd_cpu = _per_token(al, prompts, tokens, lambda: sum(process_cpu_seconds(p) for p in pids), 2)
    if best == float("inf"):
        return {}
    ends = 4 * max(n_ffn, 1) * min(micro_batches, len(prompts))  # per token: each micro-batch, each FFN layer
    return {"overlapped_hop_s": best, "overlapped_rows": len(prompts), "overlapped_micro_batches": micro_batches,
            "overlapped_single_cpu_s": single_cpu, "overlapped_afd_cpu_s": afd_cpu,
            "overlapped_message_cpu_s": max(0.0, (afd_cpu - single_cpu) / ends)}


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds of a local process so far: the scheduler's nanosecond run time summed over its threads
    (/proc/PID/task/*/schedstat), else user + system time from /proc/PID/stat (10 ms ticks: too coarse for the
    sub-millisecond differences the pipeline probe takes); NaN where unreadable."""
    try:
        return sum(int((t / "schedstat").read_text().split()[0]) for t in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _ceiling_worker(kinds: list[str], seconds: float, q: Any, barrier: Any) -> None:
    import torch

    torch.set_num_threads(1)
    loads = {}
    for kind in kinds:
        if kind == "gemm":  # a 32-row micro-batch through a 1024 x 4096 FFN matrix (compute-bound)
            loads[kind] = (torch.randn(32, 1024), [torch.randn(1024, 4096)])
        else:  # one-row bf16 GEMVs cycling through 64 MB of weights (memory-bound, a batch-1 decode step)
            loads[kind] = (torch.randn(1, 1024).bfloat16(), [torch.randn(1024, 2048).bfloat16() for _ in range(16)])
    for kind in kinds:
        x, ws = loads[kind]
        for w in ws:
            x @ w
        barrier.wait()  # every process starts each loop at once (they start up at different times)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for w in ws:
                x @ w
            n += len(ws)
        q.put((kind, n / (time.perf_counter() - t0)))


def measure_parallel_ceilings(seconds: float = 3.0, kinds: tuple[str, ...] = ("gemm",)) -> dict[str, dict[str, Any]]:
    """The most any multi-process engine can gain on this machine: the same single-thread loop (``gemm``: a stage's
    compute-bound work; ``gemv``: a batch-1 decode step's memory-bound work) in one process alone, then in one process
    per core at once (each loop started by all of them together). Aggregate rate (all) / rate (one alone) is the
    ceiling; on a machine whose cores share execution units or memory bandwidth (SMT siblings, a shared AVX-512 unit,
    a power limit) it is below the core count. Per kind in ``kinds``, all measured by the same processes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    cores = os.cpu_count() or 1

    def run(n: int) -> dict[str, list[float]]:
        q, barrier = ctx.Queue(), ctx.Barrier(n)
        procs = [ctx.Process(target=_ceiling_worker, args=(list(kinds), seconds, q, barrier)) for _ in range(n)]
        for p in procs:
            p.start()
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(n * len(kinds)):
            k, r = q.get(timeout=seconds + 120)
            rates[k].append(r)
        for p in procs:
            p.join(10)
        return rates

    alone, together = run(1), run(cores)
    return {k: {"kind": k, "processes": cores, "rate_alone": alone[k][0], "rates_together": together[k],
                "ceiling": sum(together[k]) / alone[k][0], "loadavg": os.getloadavg()[0]} for k in kinds}


def measure_parallel_ceiling(seconds: float = 3.0, kind: str = "gemm") -> dict:
    """measure_parallel_ceilings for one kind of loop."""
    return measure_parallel_ceilings(seconds, (kind,))[kind]


def run_isolated(target: str, kwargs: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Call ``module:function(**kwargs)`` in a fresh Python process (its own session, killed with its stage processes
    after ``timeout`` s) and return its JSON result; a hang or crash in an engine run cannot take the caller with it.
    Raises RuntimeError with the child's last output lines when it fails."""
    import json
    import signal
    import subprocess
    import sys

    code = ("import json, sys, importlib; a = json.loads(sys.stdin.read()); m, f = a['target'].split(':'); "
            "r = getattr(importlib.import_module(m), f)(**a['kwargs']); print('\\n@@RESULT@@' + json.dumps(r))")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True, env=env)
    try:
        out, _ = p.communicate(json.dumps({"target": target, "kwargs": kwargs}), timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise RuntimeError(f"{target} did not finish within {timeout:.0f} s (killed)") from None
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # stage processes it may have left behind
        except (ProcessLookupError, PermissionError):
            pass
    if p.returncode != 0 or "@@RESULT@@" not in out:
        tail = " | ".join(out.strip().splitlines()[-3:])
        raise RuntimeError(f"{target} failed (exit {p.returncode}): {tail}")
    return json.loads(out.rsplit("@@RESULT@@", 1)[1])


def _hop_peer(port: int, sizes: list[int], reps: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from waferline.engine.stage import Link, make_group

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    link = Link(make_group(store, "calib", 1, 2, torch.device("cpu"), True), torch.device("cpu"))
    for _ in sizes:
        for _ in range(reps):
            kind, meta, payload = link.recv(0)
            link.send(0, kind, meta, [payload])
    link.flush()


def gloo_link(sizes: list[int], reps: int) -> dict[str, Any]:
    """The engine's own transport (engine.stage.Link over a gloo group) between two local processes: one-way time
    per message size (round trip / 2), fitted to latency + bytes / bandwidth, and this process's CPU seconds per
    message (what a hop costs a core on a machine with fewer cores than stages)."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from waferline.engine.stage import Link, make_group

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    p = mp.get_context("spawn").Process(target=_hop_peer, args=(store.port, sizes, reps), daemon=True)
    p.start()
    rows = []
    try:
        link = Link(make_group(store, "calib", 0, 2, torch.device("cpu"), True), torch.device("cpu"))
        for size in sizes:
            buf = torch.zeros(size, dtype=torch.uint8)
            times, cpus = [], []
            for i in range(reps):
                c = time.process_time()
                t = time.perf_counter()
                link.send(1, 1, [1, 2, 3, 4], [buf])
                link.recv(1)
                if i >= min(5, reps // 4):
                    times.append(time.perf_counter() - t)
                    cpus.append(time.process_time() - c)
            times.sort()
            cpus.sort()
            q = len(times) // 10  # 10th percentile: other work on a shared machine only ever slows a round trip down
            rows.append({"bytes": size, "one_way_s": times[q] / 2, "cpu_per_message_s": cpus[q] / 2})
        link.flush()
    finally:
        p.join(20)
        if p.is_alive():
            p.kill()
        torch.set_num_threads(old)
    small = [r for r in rows if r["bytes"] <= 16384] or rows[:1]
    lat = float(min(r["one_way_s"] for r in small))
    big = sorted(rows, key=lambda r: r["bytes"])[-2:]
    if len(big) == 2 and big[1]["one_way_s"] > big[0]["one_way_s"]:
        bw = (big[1]["bytes"] - big[0]["bytes"]) / (big[1]["one_way_s"] - big[0]["one_way_s"])
    else:
        bw = big[-1]["bytes"] / max(big[-1]["one_way_s"] - lat, 1e-9)
    return {"latency_s": lat, "bytes_per_s": float(bw),
            "cpu_per_message_s": float(statistics.median(r["cpu_per_message_s"] for r in small)), "points": rows}


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


# ----------------------------------------------------------------------------- the YAML


def measure_host(quick: bool = False, progress: Progress | None = None, engine: bool = True, link: bool = True,
                 pipeline: bool | None = None) -> dict[str, Any]:
    """A hardware mapping for this machine (one core = one device); every number says when and how it was measured.

    ``quick``: smaller, noisier probes (for tests). ``engine`` / ``link`` / ``pipeline``: include the engine's per-op
    overhead, the gloo link and the pipeline's per-hop overhead (each needs torch and the engine; the pipeline probe
    starts a stage process; default: on unless ``quick``)."""
    import torch

    from waferline.model.layers import few_rows

    phases: dict[str, float] = {}  # wall seconds per phase (each from its progress message to the next)
    last = [None, time.perf_counter()]

    def say(what: str, frac: float) -> None:
        now = time.perf_counter()
        if last[0] is not None:
            phases[last[0]] = phases.get(last[0], 0.0) + now - last[1]
        last[:] = [what, now]
        if progress is not None:
            progress(what, frac)

    if pipeline is None:
        pipeline = not quick  # the pipeline probe starts a stage process (~5 s): off in quick mode unless asked
    host = platform.node() or "host"
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    tag = f"measured on {host} {when}"
    cores = os.cpu_count() or 1
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    load = os.getloadavg()
    say("memory bandwidth", 0.02)
    bw1 = memory_bandwidth(32 if quick else 256, 1)
    bwc = max(memory_bandwidth_small(256 * 1024), bw1)
    ew = {(d, size): elementwise_bandwidth(n, d, r) for d in ("fp32", "bf16")
          for size, n, r in (("small", 64 * 1024 // (4 if d == "fp32" else 2), 200), ("large", (32 << 20) // (4 if d == "fp32" else 2), 2))}
    bwn = memory_bandwidth(32 if quick else 256, cores) if not quick else bw1
    say("matmul FLOP/s", 0.08)
    n = 256 if quick else 1024
    fl = {d: matmul_flops(n, d, 1) for d in ("fp32", "bf16")}
    sweep_ms = [1, 8, 64] if quick else [1, 2, 4, 8, 16, 64, 256]
    sweep_sizes = [64, 256, 1024] if quick else [64, 128, 256, 512, 1024, 2048]
    pool = 8 if quick else 64
    llc = last_level_cache_bytes()
    hot_mb = llc / 2 / (1 << 20) if llc and not quick else 0.0
    lin: dict[str, Any] = {}
    for i, d in enumerate(("fp32", "bf16", "int4")):
        say(f"linear (GEMV/GEMM) sweep {d}", 0.12 + 0.12 * i)
        rows = linear_sweep(d, sweep_ms, sweep_sizes, pool)
        if rows:
            lin[d] = {"fit": fit_linear(rows), "points": rows,
                      "hot": linear_sweep(d, sweep_ms, sweep_sizes, hot_mb, hot=True) if hot_mb else []}
    he: dict[str, Any] = {
        "measured": {"date": when, "host": host, "torch": str(torch.__version__), "load_average_1m": load[0],
                     "clock": "process CPU time for single-threaded probes, wall time for the link and the pipeline",
                     "threads_per_process": 1, "quick": quick},
        "cores": _fig(cores, tag, "os.cpu_count()"),
        "engine_few_rows": _fig(few_rows(torch.bfloat16), tag, "waferline.model.layers.few_rows(bf16): the most rows of a "
                                "bf16 product the engine's own kernel runs on this CPU (4 where oneDNN has bf16 GEMMs, "
                                "else 8)"),
        "memory_bandwidth_1_thread": _fig(bw1, tag, f"torch copy of {32 if quick else 256} MB, 1 thread, read+write bytes / best of 5"),
        "cache_bandwidth_1_thread": _fig(bwc, tag, "torch copy of 256 KB x 200 (stays in cache), 1 thread, read+write bytes / best of 5"),
        "small_op_bytes": {"value": SMALL_OP_BYTES, "assumed": "non-matmul ops moving at most this many bytes run from cache"},
        "elementwise": {f"{d}_{size}": _fig(v, tag, f"z = x * y in {d}, {'64 KB tensors x 200 (in cache)' if size == 'small' else '32 MB tensors'}, "
                                                   "1 thread, (2 reads + 1 write) bytes / best of 5")
                        for (d, size), v in ew.items()},
        "linear": {},
    }
    for d, v in lin.items():
        f = v["fit"]
        meth = (f"{d} y = x W^T, M in {sweep_ms}, K = N in {sweep_sizes}, {pool} MB of distinct weights cycled, 1 thread; "
                f"fit t = t0 + bytes/bw + flops/F (median fit error x{f['median_fit_error_factor']:.2f})")
        he["linear"][d] = {"t0_s": _fig(f["t0_s"], tag, meth), "bytes_per_s": _fig(min(f["bytes_per_s"], 1e15), tag, meth),
                           "flops_per_s": _fig(min(f["flops_per_s"], 1e16), tag, meth),
                           "table": dict(linear_table(v["points"]), measured={"date": when, "method": meth.split("; fit")[0] +
                                                                                  "; seconds per call, best of 3"}),
                           "points": [[r["m"], r["k"], r["n"], r["seconds"]] for r in v["points"]]}
        if v["hot"]:
            he["linear"][d]["table_hot"] = dict(linear_table(v["hot"]), measured={
                "date": when, "method": f"{d} y = x W^T, M in {sweep_ms}, K = N in {sweep_sizes}, {hot_mb:.0f} MB of distinct "
                                        "weights cycled (half the last-level cache: they stay in it), 1 thread; seconds "
                                        "per call, best of 3"})
    if llc:
        he["llc_bytes"] = _fig(llc, tag, "last-level cache size (sysfs /sys/devices/system/cpu/cpu0/cache)")
    say("fused operators (mla_decode, ssm_update, mamba2_mix, silu_mul, rms_norm)", 0.47)
    fo = fused_op_probe(quick)
    if fo:
        he["fused_ops"] = {}
        for name, f in fo.items():
            unit, shapes = {"mla_decode": ("FLOPs", f"rows x tokens 1-4, MLA heads {FUSED_PROBE_MLA}"),
                            "ssm_update": ("state elements updated", f"rows x tokens 1-32, Mamba-2 states {FUSED_PROBE_SSM}"),
                            "mamba2_mix": ("state elements updated", f"rows x tokens 1-32, Mamba-2 states {FUSED_PROBE_SSM}")
                            }.get(name, ("elements written", f"bf16, rows {FUSED_PROBE_ROWS} x widths {FUSED_PROBE_WIDTHS}"))
            meth = (f"torch.ops.waferline.{name} back to back, 1 thread, {shapes}: fit t = t0 + {unit} / rate, fit "
                    f"error x{f['fit_error_factor']:.2f}")
            he["fused_ops"][name] = {"t0_s": _fig(f["t0_s"], tag, meth), "units_per_s": _fig(f["units_per_s"], tag, meth),
                                     "points": f["points"]}
    fused_rates = {k: (v["t0_s"], v["units_per_s"]) for k, v in (fo or {}).items()}
    lk = None
    if link:
        say("gloo link between two processes", 0.85)
        lk = run_isolated("waferline.sim.measure:gloo_link", {"sizes": [0, 4096, 65536, 1 << 20] if quick else
                                                               [0, 1024, 16384, 65536, 1 << 20, 4 << 20],
                                                               "reps": 30 if quick else 120}, 120)
        meth = ("engine.stage.Link over gloo between two local processes, 1 thread each: 10th percentile of round trip / 2 per "
                "size; latency = the smallest over messages <= 16 KB, bandwidth = slope between the two largest")
        he["link"] = {"latency_s": _fig(lk["latency_s"], tag, meth), "bytes_per_s": _fig(lk["bytes_per_s"], tag, meth),
                      "cpu_per_message_s": _fig(lk["cpu_per_message_s"], tag, "process CPU time per message (time.process_time)"),
                      "points": [[r["bytes"], r["one_way_s"], r["cpu_per_message_s"]] for r in lk["points"]]}
    if not quick and cores > 1:
        say("parallel ceiling (one process per core)", 0.88)
        pcs = measure_parallel_ceilings(1.5, ("gemv", "gemm"))
        pc = [pcs[kind]["ceiling"] for kind in ("gemv", "gemm")]
        he["parallel_ceiling"] = _fig(min(float(cores), max(1.0, min(pc))), tag,
                                      f"{cores} single-thread processes at once vs one alone (aggregate rate / rate alone), "
                                      f"bf16 one-row GEMVs over 64 MB of weights {pc[0]:.2f}x and fp32 32-row GEMMs "
                                      f"{pc[1]:.2f}x; the smaller")
    if engine:
        tmp = tempfile.TemporaryDirectory(prefix="waferline-calib-")
        work = Path(tmp.name)
        try:
            cal_models = [(64, 1), (64, 2), (384, 2)] if quick else [(64, 1), (64, 2), (64, 6), (384, 2), (384, 4)]
            # 2, 4 and 8: a multi-row call costs the same at each, a table lookup does not; bf16 products of up to 4
            # rows run the engine's own kernel (no oneDNN call), so only batch 8 shows bf16's multi-row cost
            batches = [1, 8] if quick else [1, 2, 4, 8]
            toks = 8 if quick else 16
            ew_rates = {f"{d}_{size}": v for (d, size), v in ew.items()}
            # matmuls without a weight (attention, scans) at the linear fit's roofline, as the host model prices them
            mm_fits = {k: (min(v["fit"]["bytes_per_s"], 1e15), min(v["fit"]["flops_per_s"], 1e16)) for k, v in lin.items()
                       if k != "int4"}
            he["other_matmuls_at_roofline"] = True
            canary = None if quick else Canary(work)
            canary_runs = [] if canary is None else [canary.seconds(), canary.seconds()]
            he["engine"] = {}
            for i, d in enumerate(("fp32", "bf16")):
                say(f"engine per-op overhead ({d}, tiny models)", 0.5 + 0.1 * i)
                eo = engine_overhead(d, cal_models, batches, toks, work, hot_tables(lin), ew_rates,
                                     # from memory: bf16 only (the twin's Plans and W4A16 compute in 16 bits; an fp32
                                     # Plan whose weights leave the cache takes the cache-resident scales; ~12 s saved)
                                     big=None if quick or d == "fp32" else BIG_CALIBRATION_MODEL,
                                     prefill_model=PREFILL_CALIBRATION_MODEL,
                                     fused=fused_rates, mm_fits=mm_fits,
                                     dram_bw=bw1,
                                     dram_tables={k: linear_table(v["points"]) for k, v in lin.items()},
                                     int4_models=[m for m in cal_models if m[0] % 128 == 0] if d == "bf16" else None)
                meth = (f"single-process engine decode of random sol calibration models (hidden, layers) = {cal_models} "
                        f"(Mamba-2/MLA, dense/MoE) at batch {batches}, 1 thread: CPU seconds per step - other ops' bytes "
                        f"at the elementwise bandwidths = step + op x non-linear aten ops + linear_scale x linear calls priced "
                        f"by the cache-resident linear table + row x sequences + multi_call x 16-bit linear calls of 2+ rows (ops "
                        f"counted by TorchDispatchMode); relative least squares, fit error x{eo['fit_error_factor']:.2f}")
                he["engine"][d] = {"op_overhead_s": _fig(eo["op_overhead_s"], tag, meth),
                                   "step_overhead_s": _fig(eo["step_overhead_s"], tag, meth),
                                   "ops_per_layer": _fig(eo["ops_per_layer"], tag, "aten ops per layer per decode step of the calibration models"),
                                   "linear_scale": _fig(eo["linear_scale"], tag, meth),
                                   "linear_scale_dram": _fig(eo["linear_scale_dram"], tag, (
                                       f"decode of a random sol model (hidden, layers, FFN) = {BIG_CALIBRATION_MODEL} whose "
                                       f"weights exceed the last-level cache, at batch 1: (CPU s per step - the fitted "
                                       f"other terms) / its linears priced by the from-memory table"))
                                   if eo["big_points"] else {"value": float(eo["linear_scale_dram"]),
                                                             "assumed": "not measured (bf16 only, not in --quick): "
                                                                        "as linear_scale"},
                                   **({"linear_scale_dram_multi": _fig(eo["linear_scale_dram_multi"], tag, (
                                       f"the same model at batch {BIG_PROBE_BATCHES[-1]}: (CPU s per step - the fitted other "
                                       f"terms - its one-row linears at linear_scale_dram) / its multi-row linears priced by "
                                       f"the from-memory table"))} if eo["linear_scale_dram_multi"] is not None else {}),
                                   "big_points": eo["big_points"],
                                   "row_overhead_s": _fig(eo["row_overhead_s"], tag, meth),
                                   "multi_call_overhead_s": _fig(eo["multi_call_overhead_s"], tag, meth),
                                   **{k: _fig(eo[k], tag, f"prefill (generate with max_tokens=1) of 32- and 96-token prompts on the "
                                                       f"same calibration models: CPU seconds - bytes = overhead + op x non-linear ops"
                                                       f" + scale x table-priced linears; relative least squares, fit error "
                                                       f"x{eo['prefill_fit_error_factor']:.2f}")
                                      for k in ("prefill_op_overhead_s", "prefill_linear_scale", "prefill_overhead_s")},
                                   "points": eo["points"]}
                for key, how in (
                        ("prefill_linear_scale_dram",
                         f"prefill forward of one 32-token prompt on the random sol model {PREFILL_CALIBRATION_MODEL} "
                         f"(weights beyond the last-level cache): the profiler's share of its ops' self time in products "
                         f"with a weight x its CPU seconds / those products priced by the from-memory table"),
                        ("prefill_linear_scale_int4",
                         f"prefill of 32- and 96-token prompts on int4 copies (RTN, group 128) of the calibration models "
                         f"{[m for m in cal_models if m[0] % 128 == 0]}: (CPU seconds - the fitted prefill terms) / their "
                         f"int4 linears priced by the int4 table, median")):
                    if eo[key] is not None:
                        he["engine"][d][key] = _fig(eo[key], tag, how)
                if eo["prefill_linear_scale_int4"] is not None:
                    he["engine"][d]["int4_prefill_points"] = eo["int4_prefill_points"]
                if eo["prefill_rest_scale_dram"] is not None:
                    he["engine"][d]["prefill_rest_scale_dram"] = _fig(eo["prefill_rest_scale_dram"], tag, (
                        "the same prefill forward: the profiler's share of its ops' self time outside matmuls x its CPU "
                        "seconds / those ops priced as the host model does (per-op cost + bytes at the elementwise "
                        "bandwidths + the fused operators at their rates)"))
                if eo["prefill_linear_scale_dram_batch"] is not None:
                    b_ = eo["prefill_linear_scale_dram_batch"]
                    how = (f"the same model, one prefill forward of {b_['tokens'] // 32} such prompts at once (as a "
                           f"pipeline stage prefills a micro-batch): the same ratio; a forward of n tokens takes the "
                           f"two scales interpolated (log-log in n) between 32 and {b_['tokens']} tokens")
                    he["engine"][d]["prefill_linear_scale_dram_batch"] = dict(_fig(b_["scale"], tag, how),
                                                                              tokens=b_["tokens"])
                    he["engine"][d]["prefill_rest_scale_dram_batch"] = dict(_fig(b_["rest_scale"], tag, how),
                                                                            tokens=b_["tokens"])
            try:
                say("speculative engine per-step overhead (tiny model, n-gram)", 0.68)
                so = speculative_overhead("bf16", work, toks, he["engine"]["bf16"]["op_overhead_s"]["value"]
                                          + 0.0, row_s=he["engine"]["bf16"]["row_overhead_s"]["value"],
                                          multi_s=he["engine"]["bf16"]["multi_call_overhead_s"]["value"],
                                          fused=fused_rates, mm_fits=mm_fits,
                                          tables=hot_tables(lin),
                                          scale=he["engine"]["bf16"]["linear_scale"]["value"], ew=ew_rates)
                he["engine"]["bf16"]["spec_step_overhead_s"] = _fig(
                    so["spec_step_overhead_s"], tag, "single-process speculative decoding (n-gram, k=3) of the 2-layer "
                    "calibration model, bf16, 1 thread: CPU s per verify step - op overhead x ops per verify step")
            except Exception as e:  # noqa: BLE001 - speculative decoding may be unavailable; the rest stands
                he["engine"]["bf16"]["spec_step_overhead_s"] = {"value": 0.0, "assumed": f"not measured: {type(e).__name__}: {e}"[:200]}
            if pipeline:
                say("pipeline hop vs idle time (2 stage processes, 3 model sizes)", 0.72)
                try:
                    po = run_isolated("waferline.sim.measure:pipeline_overhead",
                                      {"workdir": str(work), "tokens": toks, "link_s": lk["latency_s"] if lk else 0.0}, 300)
                except Exception as e:  # noqa: BLE001 - the pipeline engine may be unavailable; the rest stands
                    po = None
                    he["pipeline"] = {"hop_overhead_s": {"value": 0.0, "assumed": f"not measured: {type(e).__name__}: {e}"[:200]}}
                if po is not None:
                    meth = ("2-stage pipeline of calibration models (hidden, layers) = "
                            f"{[(p['hidden'], p['layers']) for p in po['points']]}, 1 sequence, fp32, wall time: "
                            "(per-token time - single-process step) / 2 hops, against the receiving stage's wait per token "
                            "(per-token time - half the step)")
                    he["pipeline"] = {"hop_latency_s": _fig(po["hop_latency_s"], tag, meth + "; the smallest model"),
                                      "hop_overhead_s": _fig(po["hop_overhead_s"], tag, meth + "; the smallest model, "
                                                             "minus the link latency"),
                                      "hop_vs_idle": {"points": [[p["idle_s"], p["hop_s"]] for p in po["points"]],
                                                      "measured": {"date": when, "method": meth}},
                                      "stage_step_cpu_s": _fig(po["stage_step_cpu_s"], tag, (
                                          "the same pipelines: CPU seconds of both processes per token - the "
                                          "single-process CPU per token = 2 stage steps x this + stage_cpu_inflation x "
                                          "the single-process CPU, least squares over the models: what a stage process "
                                          "spends per micro-batch step besides computing (receive, send, unpack, "
                                          "wake-up)")),
                                      "stage_cpu_inflation": _fig(po["stage_cpu_inflation"], tag, (
                                          "the same fit: how much more CPU a stage's compute takes than in one "
                                          "process (caches cold after each wake-up)")),
                                      "per_token_s": po["per_token_s"], "probes": po["points"]}
                    ratios = [p["per_token_s"] / p["pipeline_cpu_s"] for p in po["points"] if p["pipeline_cpu_s"] > 0]
                    if ratios:
                        he["pipeline"]["chain_wall_per_cpu"] = _fig(float(np.median(ratios)), tag, (
                            "the same pipelines (one sequence: a serial chain of stage steps): per-token wall time / "
                            "CPU seconds of both processes per token, median over the models"))
                    if po.get("afd"):
                        a = po["afd"]
                        he["pipeline"]["afd_message_cpu_s"] = _fig(a["message_cpu_s"], tag, (
                            f"attention/FFN disaggregation of the calibration model (hidden, layers) = ({a['hidden']}, "
                            f"{a['layers']}), 1 attention + 1 FFN rank, 1 sequence, bf16: (CPU seconds of all its "
                            f"processes per token - the single process's) / (4 messages x {a['ffn_layers']} FFN layers)"))
                        if a.get("overlapped_hop_s") is not None:
                            he["pipeline"]["afd_overlapped_hop_s"] = _fig(a["overlapped_hop_s"], tag, (
                                f"the same model, {a['overlapped_rows']} sequences in {a['overlapped_micro_batches']} "
                                "micro-batches (both ranks working): link seconds per message in the engine's own time "
                                "split (issuing sends + the part of each wait after the peer had sent), mean of the two "
                                "ranks, best of 2"))
                            he["pipeline"]["afd_overlapped_message_cpu_s"] = _fig(a["overlapped_message_cpu_s"], tag, (
                                f"the same model, {a['overlapped_rows']} sequences in {a['overlapped_micro_batches']} "
                                "micro-batches: (CPU seconds of all its processes per token - the single process's at "
                                "the same sequences) / (4 message ends x FFN layers x micro-batches)"))
                        he["pipeline"]["afd_probe"] = a
                    elif po.get("afd_error"):
                        he["pipeline"]["afd_message_cpu_s"] = {"value": None, "assumed": "not measured: " + po["afd_error"]}
                    if cores < OVERSUB_STAGES and not quick:  # Plans with more stage processes than cores can run here
                        say(f"pipeline with more stage processes than cores ({OVERSUB_STAGES} on {cores})", 0.85)
                        try:
                            ov = run_isolated("waferline.sim.measure:oversubscribed_pipeline",
                                              {"workdir": str(work), "tokens": toks}, 300)
                            he["pipeline"]["oversubscribed"] = oversubscribed_figures(ov, tag)
                        except Exception as e:  # noqa: BLE001 - the 2-stage figures stand for such Plans
                            he["pipeline"]["oversubscribed"] = {"error": f"not measured: {type(e).__name__}: {e}"[:200]}
            if canary is not None:
                canary_runs += [canary.seconds(), canary.seconds()]
                canary.close()
                he["canary_s"] = _fig(statistics.median(canary_runs), tag, (
                    f"wall seconds per decode token of the random sol model {BIG_CALIBRATION_MODEL}, one 8-token "
                    f"sequence, bf16, 1 thread, fastest of 2; median of {len(canary_runs)} runs at the start and the end "
                    "of the engine probes (twin runs the same before each Plan: the machine's speed then against now)"))
        finally:
            tmp.cleanup()
    say("CUDA (if present)", 0.95)
    cu = cuda_numbers()
    if cu:
        he["cuda"] = {"name": cu["name"], "bf16_flops": _fig(cu["bf16_flops"], tag, "8192^3 bf16 matmul, best of 5"),
                      "memory_bandwidth": _fig(cu["memory_bandwidth"], tag, "256 MB device copy, read + write, best of 5"),
                      "h2d_bytes_per_s": _fig(cu["h2d_bytes_per_s"], tag, "64 MB pinned host -> device copy"),
                      "memory_bytes": _fig(cu["memory_bytes"], tag, "torch.cuda.get_device_properties")}
    say("done", 1.0)
    he["measured"]["phase_seconds"] = {k: round(v, 2) for k, v in phases.items()}
    flops = {"bf16": _fig(fl["bf16"], tag, f"bf16 {n}^3 matmul through the engine's linear() (fp32 inside where oneDNN has no bf16 GEMM), 1 thread, best of 3"),
             "fp32": _fig(fl["fp32"], tag, f"fp32 {n}^3 matmul through the engine's linear(), 1 thread, best of 3")}
    links: dict[str, Any] = {"scale_out": "eth-100g"}
    if lk is not None:
        links["scale_up"] = {"name": "gloo-loopback", "bandwidth": he["link"]["bytes_per_s"], "latency": he["link"]["latency_s"]}
    else:
        links["scale_up"] = {"name": "gloo-loopback", "bandwidth": {"value": 1e9, "assumed": "link not measured (--no-link)"},
                             "latency": {"value": 1e-4, "assumed": "link not measured (--no-link)"}}
    return {
        "name": f"cpu-{host}".lower().replace(" ", "-"),
        "kind": "cpu",
        "placement": "pipeline",
        "description": (f"One core of this host ({platform.processor() or platform.machine()}, {cores} logical CPUs, "
                        f"load average {load[0]:.2f} when measured): engine stages are processes with one thread each."),
        "device": {
            "memory_bytes": _fig(mem, tag, "physical memory (sysconf)"),
            "memory_bandwidth": _fig(bw1, tag, f"torch copy of {32 if quick else 256} MB, 1 thread, read + write bytes / best of 5"),
            "memory_bandwidth_all_cores": _fig(bwn, tag, f"same with {cores} threads"),
            "flops": flops,
            "cores": _fig(cores, tag, "os.cpu_count()"),
            "reserve_fraction": {"value": 0.2, "assumed": "OS, Python and torch runtime"},
        },
        "system": {"devices_per_node": _fig(cores, tag, "os.cpu_count(): one device per core")},
        "links": links,
        "host_engine": he,
    }


def combine_host_yamls(paths: list[str | Path]) -> dict[str, Any]:
    """Several calibrations of one host as one hardware mapping: every number found at the same place in all files (a
    figure's ``value``, each number of the probe tables and points) is the median over the files; the rest (text,
    flags) is the first file's. Why: the
    fitted constants of one calibration move with the machine's slow phases (this 2-core VM: the per-op cost 2.8-4.3
    us, the prefill linear scale 1.3-2.0 between runs minutes apart), and the median of a few runs at different times
    is steadier than any one. The files must come from the same host and tree (the same probes); each combined figure
    says so in its ``source``."""
    import json

    if len(paths) < 2:
        raise ConfigError("--combine needs two or more calibrations (hardware YAMLs written by `waferline calibrate`)")
    docs = []
    for p in paths:
        try:
            d = yaml.safe_load(Path(p).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{p}: cannot read ({e})") from None
        if not isinstance(d, dict) or not isinstance(d.get("host_engine"), dict):
            raise ConfigError(f"{p}: no host_engine section (not written by `waferline calibrate`)")
        docs.append(d)
    hosts = {str(d["host_engine"].get("measured", {}).get("host")) for d in docs}
    if len(hosts) > 1:
        raise ConfigError(f"--combine: calibrations of different hosts ({', '.join(sorted(hosts))})")
    n = len(docs)
    note = f" [median of {n} calibrations: {', '.join(str(p) for p in paths)}]"

    def num(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    def merge(dst: Any, srcs: list[Any]) -> None:  # every number that all files have at the same place -> median
        if isinstance(dst, dict):
            keys, subs = list(dst), [[s.get(k) if isinstance(s, dict) else None for s in srcs] for k in dst]
        elif isinstance(dst, list) and all(isinstance(s, list) and len(s) == len(dst) for s in srcs):
            keys, subs = list(range(len(dst))), [[s[i] for s in srcs] for i in range(len(dst))]
        else:
            return
        for k, vals in zip(keys, subs):
            if num(dst[k]) and all(num(v) for v in vals):
                dst[k] = float(statistics.median(vals))
            else:
                merge(dst[k], vals)
        if isinstance(dst, dict) and num(dst.get("value")) and isinstance(dst.get("source"), str):
            dst["source"] += note

    out = json.loads(json.dumps(docs[0]))
    merge(out, docs)
    _refit_pairs(out["host_engine"].get("pipeline") or {}, n)
    out["host_engine"]["measured"]["combined"] = [
        {"file": str(p), "date": str(d["host_engine"].get("measured", {}).get("date")),
         "load_average_1m": d["host_engine"].get("measured", {}).get("load_average_1m")} for p, d in zip(paths, docs)]
    out["description"] = f"{out.get('description', '')} Median of {n} calibrations.".strip()
    return out


def _refit_pairs(pipe: dict[str, Any], n: int) -> None:
    """Figures fitted in pairs (a stage step's fixed CPU and its compute's inflation) refitted from the combined
    (median) probe points: the median of each figure alone can pair one file's fixed cost with another's inflation
    (they trade off against each other from one noisy calibration to the next)."""
    why = f" [refitted on the median probe points of {n} calibrations]"
    pts = pipe.get("probes")
    if isinstance(pts, list) and len(pts) >= 2 and all("pipeline_cpu_s" in p for p in pts) \
            and isinstance(pipe.get("stage_step_cpu_s"), dict) and isinstance(pipe.get("stage_cpu_inflation"), dict):
        fixed, infl = stage_cpu_fit(pts)
        for key, val in (("stage_step_cpu_s", fixed), ("stage_cpu_inflation", infl)):
            pipe[key]["value"] = val
            pipe[key]["source"] = pipe[key].get("source", "").split(" [median of")[0] + why
    ov = pipe.get("oversubscribed")
    if isinstance(ov, dict) and isinstance(ov.get("probes"), list) and len(ov["probes"]) >= 2 and "stages" in ov:
        for key, val in oversubscribed_fit(ov["probes"], int(ov["stages"])).items():
            if isinstance(ov.get(key), dict):
                ov[key]["value"] = val
                ov[key]["source"] = ov[key].get("source", "").split(" [median of")[0] + why


def write_combined_yaml(path: str | Path, paths: list[str | Path]) -> dict[str, Any]:
    """``combine_host_yamls(paths)`` written to ``path`` (via a temporary file: nothing half-written on failure)."""
    d = combine_host_yamls(paths)
    tmp = Path(str(path) + ".tmp")
    tmp.write_text("# written by `waferline calibrate --combine`: the median of several calibrations of this host.\n"
                   + yaml.safe_dump(d, sort_keys=False, width=140))
    tmp.replace(path)
    return d


def write_host_yaml(path: str | Path, quick: bool = False, progress: Progress | None = None, **kw: Any) -> dict[str, Any]:
    """Measure this host and write the hardware YAML to ``path``; returns the mapping."""
    import json

    d = json.loads(json.dumps(measure_host(quick, progress, **kw), default=lambda o: float(o) if hasattr(o, "__float__") else str(o)))
    Path(path).write_text("# written by `waferline calibrate`; re-run to refresh. Every figure is measured (see source).\n"
                          + yaml.safe_dump(d, sort_keys=False, width=140))
    return d
