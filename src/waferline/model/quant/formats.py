"""Reading int4 checkpoints: waferline's own format, compressed-tensors ``pack-quantized`` (Kimi K2.6) and GPTQ,
each into the canonical form without re-quantizing (``Int4Source``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from waferline.errors import CheckpointError, ConfigError
from waferline.model.quant.tensor import Int4Tensor, unpack_nibbles
from waferline.model.weights import WeightSource


@dataclass
class _Entry:
    """A quantized checkpoint weight: its logical name/shape, the raw tensors it is stored in, and a decoder."""

    logical: str
    shape: tuple[int, ...]
    raw: list[str]
    decode: Callable[[WeightSource], Int4Tensor]
    transposed: bool = False  # stored as the int4 of ``logical.transpose(-1, -2)`` (groups along its axis -2)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the decoded codes: ``shape``, its last two axes swapped when ``transposed``."""
        return (*self.shape[:-2], self.shape[-1], self.shape[-2]) if self.transposed else self.shape


def _unpack_int32(packed: Tensor, dim: int) -> Tensor:
    """int32 words holding eight 4-bit values (value j at bits 4j..4j+3) -> uint8 values, expanded along ``dim``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    p = packed.to(torch.int32)
    if dim == -1 or dim == p.dim() - 1:
        vals = (p.unsqueeze(-1) >> shifts) & 0xF
        return vals.flatten(-2).to(torch.uint8)
    vals = (p.unsqueeze(dim + 1) >> shifts.view(-1, *([1] * (p.dim() - dim - 1)))) & 0xF
    return vals.flatten(dim, dim + 1).to(torch.uint8)


def _waferline_entries(src: WeightSource, qc: dict[str, Any]) -> list[_Entry]:
    # a tensor listed in "transposed" (its full checkpoint name X, or X.weight) is stored as X.qweight / X.scales /
    # X.zeros of its last two axes swapped: its groups run along the checkpoint tensor's axis -2 (gpt-oss's experts)
    flipped = {n.removesuffix(".weight"): n for n in qc.get("transposed") or []}
    missing = [n for b, n in flipped.items() if not src.has(b + ".qweight")]
    if missing:
        raise CheckpointError(f"quantization_config lists {missing[0]} as transposed but the checkpoint has no "
                              f"{missing[0].removesuffix('.weight')}.qweight")
    out = []
    for name in src.names_with_prefix(""):
        if not name.endswith(".qweight"):
            continue
        base = name[: -len(".qweight")]
        shp = src.shape(name)
        shape = (*shp[:-1], shp[-1] * 2)
        if base in flipped:
            shape = (*shape[:-2], shape[-1], shape[-2])
        raw = [name, base + ".scales"] + ([base + ".zeros"] if src.has(base + ".zeros") else [])

        def decode(s: WeightSource, base: str = base, raw: list[str] = raw) -> Int4Tensor:
            q = s.get(base + ".qweight")
            if q.dtype != torch.uint8:
                raise CheckpointError(
                    f"{base}.qweight has dtype {q.dtype}; the waferline int4 format stores uint8 codes"
                )
            return Int4Tensor(
                unpack_nibbles(q), s.get(base + ".scales"), s.get(base + ".zeros") if len(raw) == 3 else None
            )

        out.append(_Entry(flipped.get(base, base + ".weight"), shape, raw, decode, base in flipped))
    return out


def _ct_entries(src: WeightSource, qc: dict[str, Any]) -> list[_Entry]:
    if qc.get("format") not in ("pack-quantized", None):
        raise CheckpointError(f"compressed-tensors format {qc.get('format')!r} is not supported; waferline reads "
                              "'pack-quantized' int4 (re-export with llm-compressor's W4A16 scheme)")
    sizes: set[int] = set()  # the config's group sizes (a weight whose K one does not divide: _short_last_group)
    for g in (qc.get("config_groups") or {}).values():
        w = (g or {}).get("weights") or {}
        if w and (w.get("num_bits") != 4 or w.get("type", "int") != "int" or w.get("strategy", "group") != "group"):
            raise CheckpointError(
                f"compressed-tensors weights {w} are not group-wise int4; only W4A16 int4 is supported"
            )
        if isinstance(w.get("group_size"), int) and w["group_size"] > 0:
            sizes.add(w["group_size"])
    out = []
    for name in src.names_with_prefix(""):
        if not name.endswith(".weight_packed"):
            continue
        base = name[: -len(".weight_packed")]
        if src.has(base + ".weight_zero_point"):
            raise CheckpointError(
                f"{base} is asymmetric compressed-tensors int4 (weight_zero_point); only the symmetric "
                "scheme (as Kimi K2.6 ships) is supported"
            )
        shape = tuple(int(v) for v in src.get(base + ".weight_shape").tolist())
        raw = [name, base + ".weight_scale", base + ".weight_shape"]

        def decode(s: WeightSource, base: str = base, shape: tuple[int, ...] = shape) -> Int4Tensor:
            codes = _unpack_int32(s.get(base + ".weight_packed"), -1)[..., : shape[-1]]  # stored as signed + 8
            s.get(base + ".weight_shape")
            return Int4Tensor(codes.contiguous(), _short_last_group(s.get(base + ".weight_scale"), shape[-1], sizes))

        out.append(_Entry(base + ".weight", shape, raw, decode))
    return out


def _short_last_group(scales: Tensor, K: int, sizes: set[int]) -> Tensor:
    """compressed-tensors ``scales [..., ceil(K/G)]`` of a weight whose K inputs the group size G does not divide (its
    last group is short, as llm-compressor quantizes such a weight) as equal groups of gcd(K, G) inputs; ``scales`` as
    they are where a group size of the config splits K into equal groups, one per scale."""
    n = scales.shape[-1] if scales.dim() else 0
    if n < 2 or any(K % G == 0 and K // G == n for G in sizes):
        return scales
    for G in sorted(sizes):
        if K % G and -(-K // G) == n:
            return scales[..., torch.arange(0, K, math.gcd(K, G)) // G].contiguous()
    return scales


def _gptq_entries(src: WeightSource, qc: dict[str, Any]) -> list[_Entry]:
    if int(qc.get("bits", 4)) != 4:
        raise CheckpointError(f"GPTQ checkpoint has bits={qc.get('bits')}; only 4-bit is supported")
    # the layout: "checkpoint_format" (AutoGPTQ, and written beside "format" by transformers and GPTQModel) or "format"
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"GPTQ checkpoint_format {fmt!r} is not supported; waferline reads 'gptq' and 'gptq_v2'")
    v1 = fmt == "gptq"  # v1 stores zero points minus one
    group = int(qc.get("group_size") or -1)
    out = []
    for name in src.names_with_prefix(""):
        if not name.endswith(".qweight"):
            continue
        base = name[: -len(".qweight")]
        k8, N = src.shape(name)
        raw = [name, base + ".qzeros", base + ".scales"] + ([base + ".g_idx"] if src.has(base + ".g_idx") else [])

        def decode(s: WeightSource, base: str = base, raw: list[str] = raw) -> Int4Tensor:
            codes = _unpack_int32(s.get(base + ".qweight"), 0).t().contiguous()  # [N, K]
            N, K = codes.shape
            scales = s.get(base + ".scales")  # [ceil(K/G), N]
            n = scales.shape[0]
            qz = s.get(base + ".qzeros").to(torch.int64) & 0xFFFFFFFF
            if v1:  # written as the v2 words minus 0x11111111 (GPTQModel): a zero point of 0 borrows from the next
                qz = (qz + 0x11111111) & 0xFFFFFFFF
            zp = _unpack_int32(qz, -1)[:, :N].float()  # [ceil(K/G), N]
            if len(raw) == 4:
                g_idx = s.get(base + ".g_idx").long()
            else:  # the last group is short where K is not a multiple of the group size
                g_idx = torch.arange(K) // (group if 0 < group < K and -(-K // group) == n else -(-K // n))
            starts = (torch.nonzero(g_idx[1:] != g_idx[:-1]).flatten() + 1).tolist() if g_idx.shape == (K,) else []
            if g_idx.shape != (K,) or not torch.equal(g_idx[[0, *starts]], torch.arange(n)):
                raise CheckpointError(f"{base}: act-order GPTQ (desc_act, permuted g_idx) is not supported; "
                                      "re-quantize with desc_act=False")
            # groups in order, each of contiguous columns: held as equal groups of the widest width that divides K
            # and where every group starts (its own group size, unless the last group is short)
            rows = g_idx[:: math.gcd(K, *starts)]
            scales, zp = scales[rows], zp[rows]
            if bool((zp == 8).all()):
                return Int4Tensor(codes, scales.t().contiguous())
            zeros = ((8.0 - zp) * scales.float()).t().contiguous()  # w = (q - zp) s = (q - 8) s + (8 - zp) s
            return Int4Tensor(codes, scales.t().contiguous(), zeros)

        out.append(_Entry(base + ".weight", (N, k8 * 8), raw, decode))
    return out


FORMATS: dict[str, Callable[[WeightSource, dict[str, Any]], list[_Entry]]] = {
    "waferline": _waferline_entries, "compressed-tensors": _ct_entries, "gptq": _gptq_entries,
}


def _qconfig(cfg: dict[str, Any]) -> dict[str, Any] | None:
    for c in (cfg, cfg.get("text_config") or {}):  # multimodal configs (Kimi K2.6) nest it under text_config
        if not isinstance(c, dict):
            continue
        for key in ("quantization_config", "compression_config"):
            qc = c.get(key)
            if qc and not isinstance(qc, dict):  # (one line, not an AttributeError where it is read)
                raise ConfigError(f"config.json: {key} is a {type(qc).__name__}, not a JSON object; fix or "
                                  "remove it")
            if qc:
                return qc
    return None


def quant_method(cfg: dict[str, Any]) -> str | None:
    """The int4 format named by a config's ``quantization_config``: None when the checkpoint is not int4 (16-bit,
    or another scheme such as fp8 / MXFP4, which the regular loader reports)."""
    qc = _qconfig(cfg)
    m = (qc or {}).get("quant_method")
    return m if m in FORMATS else None


def int4_group_size(cfg: dict[str, Any], default: int = 128) -> int:
    """The group size an int4 checkpoint's weights were quantized at (its ``quantization_config``), where it is one
    the int4 kernels take; else ``default`` (a 16-bit checkpoint, per-channel GPTQ, no group size recorded)."""
    from waferline.spec.model import INT4_GROUP_SIZES

    qc = _qconfig(cfg) or {}
    sizes = [qc.get("group_size")] + [((g or {}).get("weights") or {}).get("group_size")
                                      for g in (qc.get("config_groups") or {}).values()]
    return next((int(g) for g in sizes if isinstance(g, int) and g in INT4_GROUP_SIZES), default)


def check_readable_quantization(cfg: dict[str, Any], where: object) -> None:
    """Raise a CheckpointError where ``cfg``'s ``quantization_config`` names a scheme this loader does not read
    (fp8, MXFP4, AWQ, bitsandbytes, ...): its weights are stored in tensors no module takes (said before a model of
    its size is allocated, not as missing or extra tensors after). ``where``: the config.json, for the message."""
    m = (_qconfig(cfg) or {}).get("quant_method")
    if isinstance(m, str) and m not in FORMATS:
        raise CheckpointError(f"{where}: quantization_config names quant_method {m!r}, which waferline does not "
                              f"read (it loads 16-bit checkpoints, and int4 ones: {', '.join(FORMATS)}); load the "
                              "16-bit original (or the int4 `waferline quantize` writes from it)")


class Int4Source(WeightSource):
    """A checkpoint's tensors with every int4 weight shown under its logical name (``X.weight``, served
    dequantized to fp32 in the checkpoint's own layout); :meth:`canonical` gives the codes/scales/zeros themselves
    (of the stored layout: last two axes swapped for an entry that is ``transposed``)."""

    def __init__(self, raw: WeightSource, cfg: dict[str, Any]):
        method = quant_method(cfg)
        if method is None:
            raise CheckpointError("config.json has no int4 quantization_config")
        qc = _qconfig(cfg)
        self.raw, self.method = raw, method
        self.entries = {e.logical: e for e in FORMATS[method](raw, qc)}
        hidden = {n for e in self.entries.values() for n in e.raw}
        plain = [n for n in raw.names_with_prefix("") if n not in hidden]
        shapes = {n: raw.shape(n) for n in plain}
        shapes.update({k: e.shape for k, e in self.entries.items()})
        super().__init__(list(shapes), self._load_any, shapes)

    def _load_any(self, name: str) -> Tensor:
        if name in self.entries:
            w = self.canonical(name).dequantize()
            return w.transpose(-1, -2).contiguous() if self.entries[name].transposed else w
        return self.raw.get(name)

    def canonical(self, name: str) -> Int4Tensor:
        e = self.entries[name]
        t = e.decode(self.raw)
        if t.shape != e.stored_shape:
            raise CheckpointError(
                f"int4 tensor {name!r} decodes to shape {list(t.shape)} but is declared {list(e.stored_shape)}"
            )
        # scales (and zeros): one per group of the codes' rows, [..., N, K/G] (a file of another layout, or corrupt)
        *lead, N, K = t.shape
        for what, v in (("scales", t.scales), ("zeros", t.zeros)):
            if v is not None and (not v.is_floating_point() or v.dim() != t.codes.dim() or list(v.shape[:-1]) !=
                                  [*lead, N] or not v.shape[-1] or K % v.shape[-1] or v.shape != t.scales.shape):
                raise CheckpointError(f"int4 tensor {name!r} has {what} of shape {list(v.shape)} and dtype "
                                      f"{str(v.dtype).removeprefix('torch.')}; its codes {[*lead, N, K]} need float "
                                      f"{what} [..., {N}, K/group] with the group dividing {K}")
        return t
