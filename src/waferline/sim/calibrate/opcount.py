"""Counting what the engine runs: a TorchDispatchMode that records every aten op the engine dispatches, with the
bytes and FLOPs it moves and its linear products keyed by dtype, rows and weight bytes (fused CPU operators and whole
C++ layer operators split into the parts they run), and pricing such a work record with the measured tables, rates
and bandwidths; plus the profiler's split of a run's time between products, other matmuls and everything else."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from waferline.engine.llm import LLM

SMALL_OP_BYTES = 1 << 20  # a non-matmul op moving at most this many bytes runs from cache (assumed: L2 is 0.5-2 MB)
_WEIGHT_OPS = {"linear", "mm", "addmm", "_weight_int4pack_mm_for_cpu", "_weight_int4pack_mm", "_linear_pointwise",
               "linear_rows", "linear_wide", "int4_linear"}
_MATMUL_OPS = {
    "linear",
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "matmul",
    "_weight_int4pack_mm_for_cpu",
    "_weight_int4pack_mm",
    "einsum",
    "_linear_pointwise",
    "linear_rows",
    "linear_wide",
    "int4_linear",
}


# torch's fused attention on a CPU (model/attention.py attend_prefill_cpu): priced as a matmul without a weight. Under
# inference mode (the engine's) the counter sees the composite op, its mask among the inputs; outside it, its parts
_FUSED_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu"}


def _tensors(x: Any) -> list[Any]:
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


# ops that only make a new view (no data moves)
_VIEW_OPS = {
    "view",
    "_unsafe_view",
    "reshape",
    "select",
    "slice",
    "unsqueeze",
    "squeeze",
    "expand",
    "permute",
    "transpose",
    "t",
    "as_strided",
    "alias",
    "detach",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "narrow",
    "diagonal",
    "unflatten",
    "flatten",
    "movedim",
    "view_as_real",
    "view_as_complex",
    "lift_fresh",
    "expand_as",
    "view_as",
}
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


# waferline.kernels, own calibrated rates
FUSED_OPS = ("mla_decode", "ssm_update", "mamba2_mix", "silu_mul", "rms_norm")


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
        parts += [("moe_route", None, (hn, *route), (weights, idx)),  # (AFD's attention ranks route: engine/afd/)
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
        # waferline.kernels' MoE block: the expert products it makes, as the linear calls they are
        if name == "moe_ffn":
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
        elif name in _FUSED_ATTENTION and outs:  # torch's fused attention: its two products, the scores never stored
            q, k, v = ins[0], ins[1], ins[2]  # [B, heads, T, dk], [B, kv heads, L, dk], [B, kv heads, L, dv]
            dt = "fp32" if q.dtype == torch.float32 else "bf16"
            flops = 2.0 * (q.numel() // max(1, q.shape[-1])) * k.shape[-2] * (q.shape[-1] + v.shape[-1])
            w[f"mm_bytes_{dt}"] = w.get(f"mm_bytes_{dt}", 0.0) + nbytes
            w[f"mm_flops_{dt}"] = w.get(f"mm_flops_{dt}", 0.0) + flops
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

    def __enter__(self) -> OpCounter:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


def count_generate_ops(llm: LLM, prompts: list[list[int]], max_tokens: int) -> int:
    """aten ops the engine dispatches for ``llm.generate(prompts, max_tokens)`` (greedy, eos ignored)."""
    from waferline.engine.sampling import SamplingParams

    with OpCounter() as c:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return c.total


def _generate_work(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
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
    return sum(
        work.get(f"{size}_bytes{suf}", 0.0) / ew[f"{dt}_{size}"]
        for size in ("small", "large")
        for suf, dt in (("", "fp32"), ("_bf16", "bf16"))
        if ew.get(f"{dt}_{size}")
    )


# products with a weight
# (waferline::ffn_residual, a layer's FFN half as one op: its self time is its experts' or dense FFN's products but for
# a norm, the routing and an add, a few percent of it at prefill sizes; counted as "rest" it doubled the from-memory
# prefill rest scale, 1.37 -> 2.0-2.05, and priced sol-mini's single-process TTFT x1.3-1.4 slow)
_LINEAR_EVENTS = ("linear", "aten::mm", "aten::addmm", "int4pack_mm", "int4_linear", "waferline::moe_ffn",
                  "waferline::ffn_residual")
_OTHER_MM_EVENTS = ("aten::bmm", "aten::baddbmm", "aten::matmul", "aten::einsum",  # matmuls without one
                    "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu")


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
