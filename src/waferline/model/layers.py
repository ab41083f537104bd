"""Small shared building blocks: RMSNorm, linear layers, and rotary position embeddings (default/linear/llama3/YaRN)."""

from __future__ import annotations

import math
import operator
import os
from typing import Any

import torch
from torch import nn

from waferline import kernels
from waferline.errors import ConfigError
from waferline.model.weights import WeightSource, copy_into


def kept_args(owner: nn.Module, slot: str, dtype: torch.dtype, build: Any) -> Any:
    """A fused op's arguments for ``owner``, built once per dtype by ``build(deps)`` and reused while every
    ``(dict, key, value)`` the builder appended to ``deps`` still holds that value (checked by identity at each call:
    quantizing, a hook or ``.to()`` replace a tensor or module, and the arguments are rebuilt). The decode step then
    does not look its weights up through the modules every token. ``deps`` must not hold ``owner.__dict__`` itself
    (a cycle: the weights would outlive the model until the garbage collector ran)."""
    c = owner.__dict__.get(slot)
    # (the check in C loops: map over the dicts' get, then identity; a generator expression cost ~3x as much)
    if c is not None and c[0] is dtype and all(map(operator.is_, map(dict.get, c[1], c[2]), c[3])):
        return c[4]
    deps: list[tuple[dict, str, Any]] = []
    args = build(deps)
    dicts, keys, values = (list(t) for t in zip(*deps)) if deps else ([], [], [])
    owner.__dict__[slot] = (dtype, dicts, keys, values, args)
    return args

class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as the reference implementations do."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt, w = x.dtype, self.weight
        if dt == w.dtype and x.device.type == "cpu" and kernels.available():
            return torch.ops.waferline.rms_norm(x, w, self.eps)  # the same arithmetic, one fused op
        # torch's rms_norm: in fp32 for 16-bit x, rounded once to x's dtype (what the reference computes); one fused
        # kernel on a GPU (_fused_rms_norm) where the chain it replaced was ~6 (docs/results/decode-speed.md)
        return w * nn.functional.rms_norm(x, (x.shape[-1],), eps=self.eps)

    def load_hf(self, src: WeightSource, name: str) -> None:
        copy_into(self.weight, src.get(name, tuple(self.weight.shape)))


# bf16 products of up to this many rows run waferline's own kernel on CPU (linear_rows), on every CPU: each row of x
# sums in the same order whatever the number of rows (so a speculative verify's T tokens, and a batch's rows, compute
# what one-token steps compute, bitwise); oneDNN multiplies 5-8 rows faster on an AVX512-BF16 CPU, but its sums
# differ from the kernel's, so the bound is 8 rather than 4 to keep a batch of 8 rows bitwise equal as well.
FEW_ROWS = 8


def few_rows(dtype: torch.dtype = torch.bfloat16) -> int:
    """The most rows of a ``dtype`` product that ``waferline::linear_rows`` runs (``FEW_ROWS`` on every CPU, whether
    or not oneDNN has bf16 GEMMs there). The twin's calibration records it (``engine_few_rows``)."""
    return FEW_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except for 16-bit weights on CPU with few rows (decode steps), or on a CPU without 16-bit GEMMs.

    A bf16 product of up to ``few_rows()`` rows (``FEW_ROWS``, 8) runs ``waferline::linear_rows``
    (waferline.kernels: each weight row read once, straight through, into every row's fp32 sums; on this project's
    2-core AVX-512 CPU 22-34 GB/s of weights at one row against ATen's GEMV at 16-33, and 2.7-4.3x oneDNN at 4 rows on
    weights up to 1 MB, 0.8-1.0x on 4-32 MB ones: an ad-hoc loop, README "Decode speed"). Otherwise a
    one-row product bypasses oneDNN, which re-packs a weight it has not seen before on every call (in a decode step
    every
    weight is used once; ~2x slower than ATen's own GEMV for 512 x 1536, ~3x for 512 x 512); for two or more rows
    oneDNN's blocked kernel wins again, except where oneDNN has no 16-bit GEMM (AVX2 only): there 16-bit products of
    more rows are widened to fp32 (README "Decode speed").
    """
    if (weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and x.device.type == "cpu" and weight.dim() == 2
            and x.numel() <= few_rows(weight.dtype) * x.shape[-1] and kernels.available()):
        y = torch.ops.waferline.linear_rows(x, weight)
        return y if bias is None else y + bias
    if (weight.dtype != torch.float32 and x.device.type == "cpu" and x.numel() > x.shape[-1]
            and not prepack_supported(weight.dtype)):
        # no 16-bit GEMM on this CPU (AVX2 only): ATen's generic bf16 loop runs 6-8x slower than widening both to fp32
        # (exact) and running the fp32 GEMM; fp32 sums, rounded once to 16 bits, as a native bf16 GEMM computes them
        if kernels.available():
            return torch.ops.waferline.linear_wide(x, weight, bias)  # the same, as one operator
        y = nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)
    if weight.dtype != torch.float32 and x.device.type == "cpu" and x.numel() == x.shape[-1]:
        prev = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return nn.functional.linear(x, weight, bias)
        finally:
            torch._C._set_mkldnn_enabled(prev)
    return nn.functional.linear(x, weight, bias)


_PREPACK = os.environ.get("WAFERLINE_PREPACK", "1") != "0"
_PREPACK_DTYPES: dict[torch.dtype, bool] = {}


def prepack_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN can lay out and multiply ``dtype`` weights on this CPU (its 16-bit path needs AVX512-BF16/FP16 or
    AVX-NE-CONVERT: an AVX2-only CPU raises instead); tried once per dtype on a tiny product and remembered."""
    ok = _PREPACK_DTYPES.get(dtype)
    if ok is None:
        try:
            w = torch.ones(16, 32, dtype=dtype)
            torch.ops.mkldnn._linear_pointwise(torch.ones(2, 32, dtype=dtype),
                                               torch.ops.mkldnn._reorder_linear_weight(w, None), None, "none", [], "")
            ok = True
        except (RuntimeError, AttributeError, NotImplementedError):
            ok = False
        _PREPACK_DTYPES[dtype] = ok
    return ok


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packs: dict[Any, Any],
                  key: Any) -> torch.Tensor:
    """``linear``, except that a 16-bit product of two or more rows on CPU runs oneDNN on a copy of ``weight`` laid
    out for it once (kept in ``packs[key]``, redone when the weight is modified in place) instead of re-laying the
    weight out on every call: the same kernel, the same results, 1.5-2x faster for 2-8 rows (batched decode,
    speculative verify, the MoE's per-expert groups). Costs a second copy of every 16-bit weight used that way
    (``WAFERLINE_PREPACK=0`` turns it off; a CPU without oneDNN's 16-bit kernels skips it). Few-row bf16 products and
    one-row 16-bit ones go to ``linear`` instead."""
    if (_PREPACK and weight.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu" and weight.dim() == 2
            and x.dtype == weight.dtype and x.numel() > x.shape[-1] and torch._C._get_mkldnn_enabled()
            and not (weight.dtype == torch.bfloat16 and x.numel() <= few_rows(weight.dtype) * x.shape[-1]
                     and kernels.available())
            and not weight.is_inference()  # (weights made under inference_mode keep no version to check the copy by)
            and prepack_supported(weight.dtype)):
        ent = packs.get(key)
        stamp = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if ent is None or ent[0] != stamp:
            ent = packs[key] = (stamp, torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None))
        return torch.ops.mkldnn._linear_pointwise(x, ent[1], bias, "none", [], "")
    return linear(x, weight, bias)


def side_by_side(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The tensors ``ts`` as one (their rows stacked, a view) where they already lie one after another in one
    storage (contiguous, same dtype and trailing shape), else None (so None when any is None)."""
    first = ts[0]
    if first is None:
        return None
    try:
        ptr = first.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # an opaque tensor
        return None
    off = first.storage_offset()
    for t in ts:
        if (t is None or not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != ptr or t.storage_offset() != off):
            return None
        off += t.numel()
    return first.as_strided((sum(t.shape[0] for t in ts), *first.shape[1:]), first.stride(), first.storage_offset())


def place_side_by_side(linears: list[nn.Module]) -> None:
    """Re-home the weights (and biases) of 16-bit ``Linear`` modules of one dtype and device into one tensor, each
    module's a view of its rows, so that a caller can multiply them as one product (``side_by_side``); memory stays
    the same. A no-op where any is not a plain Linear (an int4 one) or they already lie so."""
    if not all(type(m) is Linear for m in linears):
        return
    for name in ("weight", "bias"):
        ts = [getattr(m, name) for m in linears]
        if all(t is None for t in ts) or side_by_side(ts) is not None:
            continue
        if any(t is None for t in ts) or len({(t.dtype, t.device, t.shape[1:]) for t in ts}) != 1:
            return
        whole = torch.cat([t.detach() for t in ts])
        off = 0
        for t in ts:
            t.data = whole[off: off + t.shape[0]]
            off += t.shape[0]


class Linear(nn.Module):
    """y = x W^T (+ b). One place for every projection, so weight formats (int4, ...) can be swapped in later."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias, self.__dict__.setdefault("_packs", {}), 0)

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        """Load ``{prefix}.weight`` (and ``{prefix}.bias`` when this layer has one)."""
        copy_into(self.weight, src.get(prefix + ".weight", tuple(self.weight.shape)))
        if self.bias is not None:
            copy_into(self.bias, src.get(prefix + ".bias", tuple(self.bias.shape)))


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rotary settings from either hub ``rope_theta`` + ``rope_scaling`` or transformers-5 ``rope_parameters``; where
    a config has both, ``rope_scaling``, as transformers takes it."""
    rs = cfg.get("rope_scaling")
    params = dict(rs) if isinstance(rs, dict) and rs else dict(cfg.get("rope_parameters") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


class Rotary(nn.Module):
    """Rotary embedding for ``dim`` rotated channels; ``interleaved`` pairs (x0,x1),(x2,x3) as DeepSeek lays them
    out."""

    def __init__(self, dim: int, cfg: dict[str, Any], interleaved: bool = False):
        super().__init__()
        self.dim = dim
        self.interleaved = interleaved
        p = rope_parameters(cfg)
        base = float(p["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.attention_scaling = 1.0
        kind = p["rope_type"]
        if kind == "default":
            pass
        elif kind == "linear":
            inv = inv / float(p["factor"])
        elif kind == "llama3":
            inv = _llama3(inv, p, cfg)
        elif kind == "yarn":
            inv, self.attention_scaling = _yarn(inv, base, dim, p, cfg)
        else:
            raise ConfigError(f"unsupported rope type {kind!r}; supported: default, linear, llama3, yarn")
        self.register_buffer("inv_freq", inv, persistent=False)
        # what makes two rotaries compute the same tables (shared per step through StepBatch.memo)
        self.key = (dim, float(inv[0]), float(inv[-1]), float(inv.sum()), self.attention_scaling)

    def cos_sin(self, positions: torch.Tensor, batch: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotation tables for ``positions``: ``(cos2, sin2)`` of shape [*positions.shape, dim] in fp32, laid out for
        :meth:`apply` (cos twice; sin negated then positive). With ``batch`` (a StepBatch) the tables are computed
        once per step and shared by every layer with the same rotary settings."""
        if batch is not None:
            key = ("rope", self.key)
            hit = batch.memo.get(key)
            if hit is None:
                hit = batch.memo[key] = self._rows(positions, batch)
            return hit
        ang = positions.float()[..., None] * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    def _rows(self, positions: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_sin(positions)`` for a step's positions, as rows of a table of positions 0..n-1 kept between steps
        (grown by doubling): a view when one row's positions are consecutive, else one gather per table. The same
        numbers (the table is computed by the same ops; elementwise, they do not depend on the shape). Computing
        the few rows afresh each step took ~8 small ops (~30-60 us a decode step on a 2-core CPU)."""
        end = batch.end  # (from the host's starts, or preset: a static step reads nothing back; StepBatch.static)
        tab = self.__dict__.get("_table")
        if tab is None or tab[0] is not self.inv_freq or tab[1].shape[0] < end:
            size = max(end, 2 * tab[1].shape[0] if tab is not None and tab[0] is self.inv_freq else 256)
            cos, sin = self.cos_sin(torch.arange(size, device=self.inv_freq.device))
            tab = self.__dict__["_table"] = (self.inv_freq, cos, sin)
        _, cos, sin = tab
        if batch.host_start is not None and len(batch.host_start) == 1 and positions.shape == (1, batch.T):
            s = batch.host_start[0]
            return cos[s: s + batch.T][None], sin[s: s + batch.T][None]
        flat = positions.reshape(-1).to(cos.device)
        return cos.index_select(0, flat).view(*positions.shape, -1), sin.index_select(0, flat).view(
            *positions.shape, -1
        )

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first ``dim`` channels of x [B, T, H, *] (cos/sin from :meth:`cos_sin`); the rest pass through.

        Computed in fp32: out = x * cos2 + swap_halves(x) * sin2. An interleaved layout (x0,x1),(x2,x3)... is first
        de-interleaved to [x0,x2,... | x1,x3,...], as the reference implementations do, so the output is in
        half-split order either way."""
        dt = x.dtype
        d = self.dim
        if (x.device.type == "cpu" and x.dim() == 4 and cos.dtype == torch.float32 and cos.shape[:2] == x.shape[:2]
                and kernels.available()):
            return torch.ops.waferline.rope(x, cos, sin, d, self.interleaved)  # the chain below as one fused op
        rot = x[..., :d] if x.shape[-1] != d else x
        if self.interleaved:
            rot = rot.unflatten(-1, (d // 2, 2)).transpose(-1, -2).flatten(-2)
        rot = rot.float()
        swapped = torch.cat([rot[..., d // 2:], rot[..., : d // 2]], dim=-1)
        out = torch.addcmul(rot * cos[:, :, None, :], swapped, sin[:, :, None, :]).to(dt)
        return torch.cat([out, x[..., d:]], dim=-1) if x.shape[-1] != d else out


def _original_len(p: dict[str, Any], cfg: dict[str, Any]) -> float:
    """The pretraining context a llama3 / yarn scaling starts from, as transformers reads it: a top-level
    ``original_max_position_embeddings`` first (Phi-3 keeps it there), then the rope parameters', else
    ``max_position_embeddings``."""
    n = cfg.get("original_max_position_embeddings") or p.get("original_max_position_embeddings") \
        or cfg.get("max_position_embeddings")
    if not n:
        raise ConfigError(f"rope_type {p.get('rope_type') or p.get('type')!r} needs original_max_position_embeddings "
                          "or max_position_embeddings in the config")
    return float(n)


def _llama3(inv: torch.Tensor, p: dict[str, Any], cfg: dict[str, Any]) -> torch.Tensor:
    factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old = _original_len(p, cfg)
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, smoothed, out)


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_factor(p: dict[str, Any], cfg: dict[str, Any]) -> float:
    """A YaRN scaling's factor; where the config gives none, max_position_embeddings over the original context."""
    orig = _original_len(p, cfg)
    return float(p.get("factor") or cfg.get("max_position_embeddings", orig) / orig)


def _yarn(
    inv: torch.Tensor, base: float, dim: int, p: dict[str, Any], cfg: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    orig = _original_len(p, cfg)
    factor = _yarn_factor(p, cfg)
    att = p.get("attention_factor")
    if att is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        att = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if (m and m_all) else _yarn_mscale(factor)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extra = 1 - ramp
    inv_new = (inv / factor) * (1 - extra) + inv * extra
    return inv_new, float(att)


def attention_softmax_scale(cfg: dict[str, Any], head_dim: int) -> float:
    """1/sqrt(d), times YaRN's mscale² when ``mscale_all_dim`` is set (DeepSeek; under any scaled rope_type, as
    transformers applies it)."""
    scale = head_dim ** -0.5
    p = rope_parameters(cfg)
    if p["rope_type"] != "default" and p.get("mscale_all_dim"):
        factor = _yarn_factor(p, cfg) if p["rope_type"] == "yarn" else float(p["factor"])
        m = _yarn_mscale(factor, float(p["mscale_all_dim"]))
        scale *= m * m
    return scale
