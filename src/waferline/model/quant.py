"""W4A16: the canonical group-wise int4 weight format, RTN/GPTQ quantizers, int4 matmul per device, and import.

On disk (safetensors, one set per quantized ``X.weight`` of shape ``[..., N, K]``)::

    X.qweight  uint8 [..., N, K/2]   two 4-bit codes per byte, even k in the low nibble, codes 0..15
    X.scales   16-bit float [..., N, K/G]
    X.zeros    16-bit float [..., N, K/G]   (asymmetric only)
    w = (code - 8) * scale + zero           (zero = 0 when absent: symmetric)

``config.json`` records it as ``quantization_config = {"quant_method": "waferline", "bits": 4, "group_size": G,
...}``. The group size of one tensor is ``K / scales.shape[-1]`` (a tensor with ``K < G`` uses one group per row).
At load the codes are repacked for the device: waferline's own CPU kernel (``waferline::int4_linear``,
kernels/cpu_ops.cpp; ATen's CPU int4pack ops where that is not built), torch's CUDA tinygemm op, or (other devices,
group sizes the kernels do not take) dequantise-then-matmul. Activations and accumulation stay 16/32-bit.

Checkpoints in compressed-tensors ``pack-quantized`` int4 (Kimi K2.6) and GPTQ format are read into the same
in-memory form without re-quantizing. Which checkpoint tensor feeds which module weight (fused gate/up, stacked
experts) is found by :func:`trace_layer`: it runs the modules' own ``load_hf`` on element indices.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from waferline.errors import CheckpointError, ConfigError
from waferline.model.layers import linear as dense_linear
from waferline.model.weights import WeightSource

QUANT_METHOD = "waferline"
KERNEL_GROUPS = (32, 64, 128, 256)  # group sizes the int4pack kernels take
# what stays 16-bit whatever the user asks: recorded in config.json
ALWAYS_16BIT = ("embeddings", "lm_head", "router", "norms", "mamba conv and per-head scalars", "biases", "mtp heads")
DEFAULT_KEEP = (r"kv_b_proj",)  # MLA's absorbed W_UK/W_UV come from kv_b_proj: kept 16-bit by default (as vLLM does)


# ----------------------------------------------------------------------------- the canonical tensors


@dataclass
class Int4Tensor:
    """One group-wise int4 weight in canonical form: ``codes`` uint8 ``[..., N, K]`` (0..15), ``scales`` and
    optional ``zeros`` ``[..., N, K/G]``; ``w = (codes - 8) * scales + zeros``."""

    codes: Tensor
    scales: Tensor
    zeros: Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def group_size(self) -> int:
        return self.codes.shape[-1] // self.scales.shape[-1]

    def dequantize(self) -> Tensor:
        """The weight in fp32, ``[..., N, K]``."""
        *lead, N, K = self.codes.shape
        G = self.group_size
        q = self.codes.float().view(*lead, N, K // G, G) - 8.0
        w = q * self.scales.float().unsqueeze(-1)
        if self.zeros is not None:
            w = w + self.zeros.float().unsqueeze(-1)
        return w.view(*lead, N, K)

    def nbytes(self) -> int:
        """Bytes on disk: packed codes + scales (+ zeros)."""
        return self.codes.numel() // 2 + _nbytes(self.scales) + (_nbytes(self.zeros) if self.zeros is not None else 0)

    def to_safetensors(self, base: str) -> dict[str, Tensor]:
        out = {base + ".qweight": pack_nibbles(self.codes).contiguous(), base + ".scales": self.scales.contiguous()}
        if self.zeros is not None:
            out[base + ".zeros"] = self.zeros.contiguous()
        return out


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 codes ``[..., K]`` (K even) -> ``[..., K/2]``: even k in the low nibble, odd k in the high nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def group_for(K: int, group_size: int) -> int | None:
    """The group size used for a tensor with ``K`` inputs: ``group_size`` if it divides K, else ``K`` when
    ``K < group_size``, else the largest halving of it (>= 16) that divides K; None when none does."""
    if K % group_size == 0:
        return group_size
    if K < group_size and K % 2 == 0:
        return K
    g = group_size // 2
    while g >= 16:
        if K % g == 0:
            return g
        g //= 2
    return None


# ----------------------------------------------------------------------------- quantizers


def _group_params(wg: Tensor, symmetric: bool, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """Scale (and zero) per group for ``wg [..., n_groups, G]``, rounded to ``scale_dtype`` (returned fp32)."""
    if symmetric:
        amax = wg.abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / 7.5, torch.ones_like(amax))
        r = scale.to(scale_dtype)
        r = torch.where(r.float() < scale, torch.nextafter(r, torch.full_like(r, math.inf)), r)  # round up: |w| <= 7.5 s
        return r.float(), None
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = (hi - lo) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = scale.to(scale_dtype).float()
    zero = (lo + 8.0 * scale).to(scale_dtype).float()
    return scale, zero


def _codes(w: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
    x = w if zero is None else w - zero
    return torch.clamp(torch.round(x / scale) + 8.0, 0.0, 15.0)


def rtn_quantize(w: Tensor, group_size: int, symmetric: bool = True, scale_dtype: torch.dtype = torch.bfloat16) -> Int4Tensor:
    """Round-to-nearest group-wise int4 of ``w [..., N, K]`` (groups of ``group_size`` along K)."""
    *lead, N, K = w.shape
    G = group_size
    if K % G:
        raise ConfigError(f"group size {G} does not divide in_features {K}")
    wg = w.float().reshape(*lead, N, K // G, G)
    scale, zero = _group_params(wg, symmetric, scale_dtype)
    codes = _codes(wg, scale.unsqueeze(-1), None if zero is None else zero.unsqueeze(-1))
    return Int4Tensor(codes.to(torch.uint8).reshape(*lead, N, K), scale.to(scale_dtype),
                      None if zero is None else zero.to(scale_dtype))


def gptq_quantize(w: Tensor, H: Tensor, group_size: int, symmetric: bool = True, damp: float = 0.01,
                  block: int = 128, scale_dtype: torch.dtype = torch.bfloat16) -> Int4Tensor:
    """GPTQ (Frantar et al. 2022) of ``w [N, K]`` given the input Hessian ``H = sum x x^T [K, K]``.

    Columns are quantized left to right; each column's rounding error is spread over the columns not yet
    quantized through the inverse Hessian's Cholesky factor. A group's scale (and zero) is set from the
    error-updated weights when its first column is reached.
    """
    N, K = w.shape
    G = group_size
    if K % G:
        raise ConfigError(f"group size {G} does not divide in_features {K}")
    W = w.float().clone()
    H = H.float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += torch.eye(K) * (damp * torch.mean(torch.diag(H)))
    try:
        L = torch.linalg.cholesky(H)
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    except RuntimeError:  # not positive definite even after damping: fall back to RTN
        return rtn_quantize(w, G, symmetric, scale_dtype)
    B = G * max(1, block // G)
    codes = torch.empty(N, K, dtype=torch.uint8)
    scales = torch.empty(N, K // G)
    zeros = None if symmetric else torch.empty(N, K // G)
    scale = zero = None
    for i1 in range(0, K, B):
        i2 = min(i1 + B, K)
        W1 = W[:, i1:i2].clone()
        Err = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % G == 0:
                scale, zero = _group_params(W1[:, i:i + G].unsqueeze(1), symmetric, scale_dtype)
                scale, zero = scale[:, 0], None if zero is None else zero[:, 0]
                scales[:, col // G] = scale
                if zeros is not None:
                    zeros[:, col // G] = zero
            wcol = W1[:, i]
            q = _codes(wcol, scale, zero)
            codes[:, col] = q.to(torch.uint8)
            deq = (q - 8.0) * scale + (0.0 if zero is None else zero)
            err = (wcol - deq) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err[:, i] = err
        W[:, i2:] -= Err @ Hinv[i1:i2, i2:]
    return Int4Tensor(codes, scales.to(scale_dtype), None if zeros is None else zeros.to(scale_dtype))


# ----------------------------------------------------------------------------- the device kernels


def _cpu_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


KERNEL_BLOCK = 64  # inputs per block of waferline's CPU int4 layout (32 bytes; a last block of 32 where K % 64 == 32)


def _kernel_lo_k(b: int) -> int:
    """The input (0..31) of a 64-input block whose code the low nibble of byte ``b`` holds (the high nibble: that +
    32): the order in which the AVX2 kernel widens a block (``int4_lo_k`` in kernels/cpu_ops.cpp)."""
    u, p = (b // 8) % 2, b % 8 + 8 * (b // 16)
    return 8 * (2 * u + p % 2) + p // 2


_LO_K = [_kernel_lo_k(b) for b in range(32)]


def pack_kernel(codes: Tensor) -> Tensor:
    """uint8 codes ``[..., K]`` (K a multiple of 32) -> ``[..., K/2]`` in waferline's CPU kernel layout: per block of
    64 inputs, byte b = code(lo_k(b)) | code(lo_k(b) + 32) << 4; a last block of 32, byte j = code(j) | code(j + 16)
    << 4."""
    *lead, K = codes.shape
    K64 = K // KERNEL_BLOCK * KERNEL_BLOCK
    c = codes.to(torch.uint8)
    b = c[..., :K64].reshape(*lead, K64 // KERNEL_BLOCK, KERNEL_BLOCK)
    lo = torch.tensor(_LO_K, device=codes.device)
    parts = [(b[..., lo] | (b[..., lo + 32] << 4)).reshape(*lead, K64 // 2)]
    if K64 < K:
        parts.append(c[..., K64:K64 + 16] | (c[..., K64 + 16:] << 4))
    return torch.cat(parts, dim=-1).contiguous()


def unpack_kernel(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_kernel`."""
    *lead, H = packed.shape
    H32 = H // 32 * 32
    p = packed[..., :H32].reshape(*lead, H32 // 32, 32)
    inv = torch.argsort(torch.tensor(_LO_K, device=packed.device))
    parts = [torch.cat([(p & 0xF)[..., inv], (p >> 4)[..., inv]], dim=-1).reshape(*lead, 2 * H32)]
    if H32 < H:
        t = packed[..., H32:]
        parts += [t & 0xF, t >> 4]
    return torch.cat(parts, dim=-1)


def _waferline_kernel_available() -> bool:
    from waferline import kernels

    return kernels.available()


def _inner_k_tiles(K: int) -> int | None:
    for t in (8, 4, 2):
        if K % (t * 16) == 0:
            return t
    return None


def choose_backend(device: torch.device, K: int, group_size: int) -> str:
    """``cpu_waferline`` | ``cpu_int4pack`` | ``cuda_tinygemm`` | ``dequant`` for a weight with ``K`` inputs on
    ``device``."""
    if group_size not in KERNEL_GROUPS or K % group_size or K % 2:
        return "dequant"
    if device.type == "cpu" and _waferline_kernel_available():
        return "cpu_waferline"
    if device.type == "cpu" and _cpu_kernel_available():
        return "cpu_int4pack"
    if device.type == "cuda" and hasattr(torch.ops.aten, "_weight_int4pack_mm") and _inner_k_tiles(K) is not None \
            and torch.cuda.get_device_capability(device)[0] >= 8:
        return "cuda_tinygemm"
    return "dequant"


_LOAD_BACKEND: ContextVar[str | None] = ContextVar("waferline_int4_load_backend", default=None)


@contextmanager
def loading_for(device: torch.device | str) -> Iterator[None]:
    """Int4 weights made inside (a checkpoint being loaded on CPU) keep a layout that ``move_model`` reads back
    exactly when they are bound for another device (``dequant``'s plain nibbles; the CPU kernels' own layouts may be
    ATen's opaque one where waferline's operators are not built); for a CPU, nothing changes."""
    token = _LOAD_BACKEND.set("dequant" if torch.device(device).type != "cpu" else None)
    try:
        yield
    finally:
        _LOAD_BACKEND.reset(token)


class Int4Weight(nn.Module):
    """An int4 weight ``[*lead, N, K]`` (``lead`` = experts, or nothing) packed for this device's kernel.

    ``linear(x, bias, index)`` computes ``x @ W[index].T (+ bias)`` with 16-bit activations on the kernel paths
    (bf16, or fp16 when the model is fp16) and returns ``x.dtype``. N is zero-padded to the kernel's multiple and
    the output sliced. The packed layouts are opaque: they are only ever produced by the ops that read them.
    """

    def __init__(self, t: Int4Tensor, device: torch.device | str | None = None, compute_dtype: torch.dtype = torch.bfloat16,
                 backend: str | None = None):
        super().__init__()
        device = torch.device(device) if device is not None else t.codes.device
        *lead, N, K = t.shape
        self.lead, self.out_features, self.in_features = tuple(lead), N, K
        self.group_size = t.group_size
        self.symmetric = t.zeros is None
        self.compute_dtype = compute_dtype if compute_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        self.backend = backend or _LOAD_BACKEND.get() or choose_backend(device, K, self.group_size)
        if self.backend == "cuda_tinygemm":
            self.compute_dtype = torch.bfloat16  # tinygemm takes bf16 only
        codes = t.codes.to(device).reshape(-1, N, K)
        scales = t.scales.to(device).reshape(-1, N, K // self.group_size)
        zeros = None if t.zeros is None else t.zeros.to(device).reshape(-1, N, K // self.group_size)
        if self.backend == "dequant":
            self.register_buffer("qweight", pack_nibbles(codes).reshape(*lead, N, K // 2))
            self.register_buffer("scales", scales.reshape(*lead, N, -1))
            self.register_buffer("zeros", None if zeros is None else zeros.reshape(*lead, N, -1))
            self.n_padded = N
            return
        if self.backend == "cpu_waferline":  # packed [*lead, N, K/2], scales (and zeros) [*lead, N, K/G, 1 or 2]
            self.register_buffer("packed", pack_kernel(codes).reshape(*lead, N, K // 2))
            sz = scales.unsqueeze(-1) if zeros is None else torch.stack([scales, zeros.to(scales.dtype)], dim=-1)
            self.register_buffer("scales_zeros", sz.contiguous().reshape(*lead, N, K // self.group_size, -1))
            self.n_padded = N
            return
        mult = 16 if self.backend == "cpu_int4pack" else 8
        Np = -(-N // mult) * mult
        self.n_padded = Np
        if Np != N:  # padded rows: code 8 and scale 0 -> weight 0, sliced off the output
            codes = F.pad(codes, (0, 0, 0, Np - N), value=8)
            scales = F.pad(scales, (0, 0, 0, Np - N))
            zeros = None if zeros is None else F.pad(zeros, (0, 0, 0, Np - N))
        z = torch.zeros_like(scales) if zeros is None else zeros
        sz = torch.stack([scales, z], dim=-1).transpose(1, 2).to(self.compute_dtype).contiguous()  # [E, K/G, Np, 2]
        packed = []
        for e in range(codes.shape[0]):
            if self.backend == "cpu_int4pack":
                packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes[e].to(torch.int32).contiguous(), 1))
            else:
                u8 = ((codes[e, :, 0::2] << 4) | codes[e, :, 1::2]).to(torch.uint8).contiguous()  # high nibble first
                packed.append(torch.ops.aten._convert_weight_to_int4pack(u8, _inner_k_tiles(K)))
        self.register_buffer("packed", torch.stack(packed).reshape(*lead, *packed[0].shape) if lead else packed[0])
        self.register_buffer("scales_zeros", sz.reshape(*lead, *sz.shape[1:]) if lead else sz[0])

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.lead, self.out_features, self.in_features)

    def nbytes(self) -> int:
        return sum(_nbytes(b) for b in self.buffers())

    def _pick(self, name: str, index: int | None) -> Tensor:
        t = getattr(self, name)
        return t if index is None else t[index]

    def dequantize(self, index: int | None = None) -> Tensor:
        """The weight (``[N, K]`` of expert ``index``, or all of it) in fp32."""
        if index is None and self.lead:
            return torch.stack([self.dequantize(e) for e in range(self.lead[0])])
        if self.backend == "dequant":
            z = self._pick("zeros", index) if self.zeros is not None else None
            return Int4Tensor(unpack_nibbles(self._pick("qweight", index)), self._pick("scales", index), z).dequantize()
        if self.backend == "cpu_waferline":
            sz = self._pick("scales_zeros", index)
            return Int4Tensor(unpack_kernel(self._pick("packed", index)), sz[..., 0],
                              sz[..., 1] if sz.shape[-1] == 2 else None).dequantize()
        # the kernel layouts are opaque: read the weight back through the kernel itself
        eye = torch.eye(self.in_features, dtype=self.compute_dtype, device=self._pick("packed", index).device)
        return self._mm(eye, index).float().t().contiguous()

    def int4_tensor(self) -> Int4Tensor:
        """The stored codes, scales and zeros (exactly) where this backend's layout can be read back (``dequant``,
        ``cpu_waferline``); the ATen kernels' layouts are opaque (ConfigError)."""
        if self.backend == "dequant":
            return Int4Tensor(unpack_nibbles(self.qweight), self.scales, self.zeros)
        if self.backend == "cpu_waferline":
            sz = self.scales_zeros
            return Int4Tensor(unpack_kernel(self.packed), sz[..., 0], sz[..., 1] if sz.shape[-1] == 2 else None)
        raise ConfigError(f"an int4 weight packed for {self.backend} cannot be repacked (its layout is the kernel's); "
                          "load the checkpoint again for the other device")

    def _kernel_args(self, index: int | None) -> tuple[Tensor, Tensor]:
        """(packed, scales_zeros) of the whole weight or of expert ``index``: views kept in a list, so the decode loop
        does not pay an indexing op per expert matmul (rebuilt if the buffers move, e.g. ``.to(device)``)."""
        if index is None:
            return self.packed, self.scales_zeros
        views = self.__dict__.get("_views")
        if views is None or views[0] != self.packed.data_ptr():
            views = (self.packed.data_ptr(), list(zip(self.packed.unbind(0), self.scales_zeros.unbind(0))))
            self.__dict__["_views"] = views
        return views[1][index]

    def _mm(self, x2: Tensor, index: int | None) -> Tensor:
        packed, sz = self._kernel_args(index)
        xc = x2 if x2.dtype == self.compute_dtype and x2.is_contiguous() else x2.to(self.compute_dtype).contiguous()
        if self.backend == "cpu_waferline":
            y = torch.ops.waferline.int4_linear(xc, packed, sz, self.group_size)
        elif self.backend == "cpu_int4pack":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xc, packed, self.group_size, sz)
        else:
            y = torch.ops.aten._weight_int4pack_mm(xc, packed, self.group_size, sz)
        return y[:, : self.out_features] if self.n_padded != self.out_features else y

    def linear(self, x: Tensor, bias: Tensor | None = None, index: int | None = None) -> Tensor:
        """``x [..., K] @ W[index].T (+ bias)`` -> ``[..., N]`` in ``x.dtype``."""
        if index is None and bias is None and self.backend == "cpu_waferline" and x.dtype == self.compute_dtype:
            # the decode step's common case, straight to the op (it takes any leading dims): no reshapes around it
            return torch.ops.waferline.int4_linear(x, self.packed, self.scales_zeros, self.group_size)
        flat = x.dim() == 2
        x2 = x if flat else x.reshape(-1, self.in_features)
        if self.backend == "dequant":  # (the engine's linear: no generic 16-bit loop on a CPU without bf16 GEMMs)
            y = dense_linear(x2, self.dequantize(index).to(x.dtype))
        else:
            y = self._mm(x2, index)
            if y.dtype != x.dtype:
                y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)

    def expert_linear(self, x: Tensor, experts: int | Tensor, bias: Tensor | None = None) -> Tensor:
        """MoE form: ``experts`` an int (all rows through it) or a LongTensor ``[M]`` (row m through expert m)."""
        if isinstance(experts, int):
            return self.linear(x, None if bias is None else bias[experts], experts)
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        for e in experts.unique().tolist():
            rows = experts == e
            y[rows] = self.linear(x[rows], None if bias is None else bias[e], int(e))
        return y


class QuantLinear(nn.Module):
    """A projection whose weight is int4 (replaces ``layers.Linear`` / ``nn.Linear`` after quantization)."""

    def __init__(self, weight: Int4Weight, bias: Tensor | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.int4 = weight
        self.dtype = dtype
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.int4.linear(x, self.bias)

    @property
    def weight(self) -> Tensor:
        """The dequantized weight, for code that needs the matrix itself (e.g. MLA's absorbed weights)."""
        return self.int4.dequantize().to(self.dtype)


# ----------------------------------------------------------------------------- which module weights are int4


def matmul_weights(root: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(param path, owner module, leaf)`` for every matmul weight under ``root`` that int4 can replace:
    projections (``Linear``/``nn.Linear``: attention, MLA, Mamba-2 in/out) and FFN/expert weights (``w_*`` of
    DenseFFN and MoE). Embeddings, the LM head, routers, norms, convs and MTP heads are not listed."""
    from waferline.model.layers import Linear
    from waferline.model.moe import DenseFFN, MoE

    out = []
    for name, mod in root.named_modules():
        if name == "mtp" or name.startswith("mtp."):
            continue
        if isinstance(mod, (Linear, nn.Linear)) and isinstance(getattr(mod, "weight", None), Tensor):
            out.append((f"{name}.weight" if name else "weight", mod, "weight"))
        elif isinstance(mod, (DenseFFN, MoE)):
            for leaf in ("w_gate_up", "w_up", "w_down"):
                if isinstance(getattr(mod, leaf, None), Tensor):
                    out.append((f"{name}.{leaf}" if name else leaf, mod, leaf))
    return out


def install(root: nn.Module, path: str, weight: Int4Weight) -> None:
    """Put ``weight`` in place of the fp weight at ``path`` (as returned by :func:`matmul_weights`)."""
    from waferline.model.moe import MoE

    owner_path, _, leaf = path.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    if leaf == "weight":
        parent_path, _, child = owner_path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        setattr(parent, child, QuantLinear(weight, owner.bias, owner.weight.dtype))
        return
    owner.register_module("q_" + leaf[2:], weight)
    setattr(owner, leaf, None)
    if isinstance(owner, MoE):
        owner.gather_max = 0  # int4 experts run per expert (the gather path would dequantize)


def is_int4(model: nn.Module) -> bool:
    return any(isinstance(m, Int4Weight) for m in model.modules())


def _kept(path: str, keep: Iterable[str]) -> bool:
    return any(re.search(p, path) for p in keep)


@dataclass
class QuantOptions:
    """How to quantize: bits (4 only), group size, symmetric or not, method, and what to keep 16-bit."""

    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    method: str = "rtn"
    keep: tuple[str, ...] = DEFAULT_KEEP
    scale_dtype: torch.dtype = torch.bfloat16

    def validate(self) -> None:
        if self.bits != 4:
            raise ConfigError(f"only 4-bit weights are supported, got --bits {self.bits}")
        if self.group_size < 16 or self.group_size % 16:
            raise ConfigError(f"group size must be a multiple of 16 (32, 64 or 128 are usual), got {self.group_size}")
        if self.method not in ("rtn", "gptq"):
            raise ConfigError(f"quantization method must be rtn or gptq, got {self.method!r}")
        for p in self.keep:
            try:
                re.compile(p)
            except re.error as e:
                raise ConfigError(f"--keep {p!r} is not a valid regular expression ({e})") from None


def _quantize_param(w: Tensor, opts: QuantOptions, H: Tensor | None) -> Int4Tensor | None:
    G = group_for(w.shape[-1], opts.group_size)
    if G is None:
        return None
    if opts.method == "gptq" and H is not None:
        if w.dim() == 2:
            return gptq_quantize(w, H, G, opts.symmetric, scale_dtype=opts.scale_dtype)
        parts = [gptq_quantize(w[e], H[e], G, opts.symmetric, scale_dtype=opts.scale_dtype) if H[e].any()
                 else rtn_quantize(w[e], G, opts.symmetric, opts.scale_dtype) for e in range(w.shape[0])]
        return Int4Tensor(torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts]),
                          None if opts.symmetric else torch.stack([p.zeros for p in parts]))
    return rtn_quantize(w, G, opts.symmetric, opts.scale_dtype)


def quantize_model(model: nn.Module, opts: QuantOptions | None = None, hessians: dict[str, Tensor] | None = None,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Quantize the matmul weights of a loaded model in place (RTN, or GPTQ given ``hessians`` by param path).
    Returns what was done: counts and the paths kept 16-bit."""
    opts = opts or QuantOptions()
    opts.validate()
    kept, done = [], 0
    compute = _compute_dtype(model)
    for path, owner, leaf in matmul_weights(model):
        if _kept(path, opts.keep):
            kept.append(path)
            continue
        w = getattr(owner, leaf)
        t = _quantize_param(w.detach(), opts, None if hessians is None else hessians.get(path))
        if t is None:
            kept.append(path)
            continue
        install(model, path, Int4Weight(t, w.device, compute))
        done += 1
        if progress:
            progress(path)
    return {"quantized": done, "kept_16bit": kept}


def move_model(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Move a loaded (and possibly quantized) model to ``device``: its int4 weights repacked for that device's kernel
    (``choose_backend``: tinygemm on a CUDA GPU of compute capability 8 or more, waferline's layout on CPU) from their
    exact codes and scales, everything else ``.to(device)``. Call before the first forward (modules keep per-weight
    views and tile copies from then on)."""
    device = torch.device(device)
    for path, mod in list(model.named_modules()):
        if not isinstance(mod, Int4Weight):
            continue
        backend = choose_backend(device, mod.in_features, mod.group_size)
        if backend == mod.backend:
            continue
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        t = mod.int4_tensor()
        t = Int4Tensor(t.codes.cpu(), t.scales.cpu(), None if t.zeros is None else t.zeros.cpu())
        setattr(parent, child, Int4Weight(t, device, mod.compute_dtype, backend))
    return model.to(device)


def _compute_dtype(model: nn.Module) -> torch.dtype:
    dt = getattr(model, "dtype", torch.float32)
    return dt if dt in (torch.bfloat16, torch.float16) else torch.bfloat16


# ----------------------------------------------------------------------------- checkpoint formats


@dataclass
class _Entry:
    """A quantized checkpoint weight: its logical name/shape, the raw tensors it is stored in, and a decoder."""

    logical: str
    shape: tuple[int, ...]
    raw: list[str]
    decode: Callable[[WeightSource], Int4Tensor]


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
    out = []
    for name in src.names_with_prefix(""):
        if not name.endswith(".qweight"):
            continue
        base = name[: -len(".qweight")]
        shp = src.shape(name)
        shape = (*shp[:-1], shp[-1] * 2)
        raw = [name, base + ".scales"] + ([base + ".zeros"] if src.has(base + ".zeros") else [])

        def decode(s: WeightSource, base: str = base, raw: list[str] = raw) -> Int4Tensor:
            q = s.get(base + ".qweight")
            if q.dtype != torch.uint8:
                raise CheckpointError(f"{base}.qweight has dtype {q.dtype}; the waferline int4 format stores uint8 codes")
            return Int4Tensor(unpack_nibbles(q), s.get(base + ".scales"), s.get(base + ".zeros") if len(raw) == 3 else None)

        out.append(_Entry(base + ".weight", shape, raw, decode))
    return out


def _ct_entries(src: WeightSource, qc: dict[str, Any]) -> list[_Entry]:
    if qc.get("format") not in ("pack-quantized", None):
        raise CheckpointError(f"compressed-tensors format {qc.get('format')!r} is not supported; waferline reads "
                              "'pack-quantized' int4 (re-export with llm-compressor's W4A16 scheme)")
    for g in (qc.get("config_groups") or {}).values():
        w = (g or {}).get("weights") or {}
        if w and (w.get("num_bits") != 4 or w.get("type", "int") != "int" or w.get("strategy", "group") != "group"):
            raise CheckpointError(f"compressed-tensors weights {w} are not group-wise int4; only W4A16 int4 is supported")
    out = []
    for name in src.names_with_prefix(""):
        if not name.endswith(".weight_packed"):
            continue
        base = name[: -len(".weight_packed")]
        if src.has(base + ".weight_zero_point"):
            raise CheckpointError(f"{base} is asymmetric compressed-tensors int4 (weight_zero_point); only the symmetric "
                                  "scheme (as Kimi K2.6 ships) is supported")
        shape = tuple(int(v) for v in src.get(base + ".weight_shape").tolist())
        raw = [name, base + ".weight_scale", base + ".weight_shape"]

        def decode(s: WeightSource, base: str = base, shape: tuple[int, ...] = shape) -> Int4Tensor:
            codes = _unpack_int32(s.get(base + ".weight_packed"), -1)[..., : shape[-1]]  # stored as signed + 8
            s.get(base + ".weight_shape")
            return Int4Tensor(codes.contiguous(), s.get(base + ".weight_scale"))

        out.append(_Entry(base + ".weight", shape, raw, decode))
    return out


def _gptq_entries(src: WeightSource, qc: dict[str, Any]) -> list[_Entry]:
    if int(qc.get("bits", 4)) != 4:
        raise CheckpointError(f"GPTQ checkpoint has bits={qc.get('bits')}; only 4-bit is supported")
    v1 = qc.get("checkpoint_format", "gptq") != "gptq_v2"  # v1 stores zero points minus one
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
            scales = s.get(base + ".scales")  # [K/G, N]
            G = K // scales.shape[0]
            zp = _unpack_int32(s.get(base + ".qzeros"), -1)[:, :N].float() + (1.0 if v1 else 0.0)  # [K/G, N]
            if len(raw) == 4:
                g_idx = s.get(base + ".g_idx").long()
                if not torch.equal(g_idx, torch.arange(K) // G):
                    raise CheckpointError(f"{base}: act-order GPTQ (desc_act, permuted g_idx) is not supported; "
                                          "re-quantize with desc_act=False")
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
        qc = c.get("quantization_config") or c.get("compression_config")
        if qc:
            return qc
    return None


def quant_method(cfg: dict[str, Any]) -> str | None:
    """The int4 format named by a config's ``quantization_config``: None when the checkpoint is not int4 (16-bit,
    or another scheme such as fp8 / MXFP4, which the regular loader reports)."""
    qc = _qconfig(cfg)
    m = (qc or {}).get("quant_method")
    return m if m in FORMATS else None


class Int4Source(WeightSource):
    """A checkpoint's tensors with every int4 weight shown under its logical name (``X.weight``, served
    dequantized to fp32); :meth:`canonical` gives the codes/scales/zeros themselves."""

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
            return self.canonical(name).dequantize()
        return self.raw.get(name)

    def canonical(self, name: str) -> Int4Tensor:
        e = self.entries[name]
        t = e.decode(self.raw)
        if t.shape != e.shape:
            raise CheckpointError(f"int4 tensor {name!r} decodes to shape {list(t.shape)} but is declared {list(e.shape)}")
        return t


# ----------------------------------------------------------------------------- checkpoint <-> module mapping


def trace_layer(spec: Any, i: int, shapes: dict[str, tuple[int, ...]], selected: list[str]) -> dict[str, Tensor]:
    """Which checkpoint elements feed each matmul weight of decoder layer ``i``.

    Runs the layer's own ``load_hf`` on a float64 probe whose checkpoint tensors hold element ids
    (``(tensor number << 32) + flat index`` for the ``selected`` names, -1 for the others). Returns, for each
    weight fed only by selected tensors, an int64 tensor of those ids in the module's layout.
    """
    from waferline.model.decoder import DecoderModel

    number = {n: j for j, n in enumerate(selected)}

    def load(name: str) -> Tensor:
        shape = shapes[name]
        if name in number:
            return (torch.arange(math.prod(shape), dtype=torch.int64) + (number[name] << 32)).double().view(shape)
        return torch.full((), -1.0, dtype=torch.float64).expand(shape)

    probe = DecoderModel(spec, torch.float64, range(i, i + 1), has_embed=False, has_head=False)
    probe.load_hf(WeightSource(list(shapes), load, dict(shapes)))
    out = {}
    for path, owner, leaf in matmul_weights(probe.layers[0]):
        ids = getattr(owner, leaf).detach()
        if ids.dtype != torch.float64:
            continue
        fed = ids >= 0
        if bool(fed.all()):
            out[path] = ids.long()
        elif bool(fed.any()):
            raise CheckpointError(f"layer {i}: {path} is fed partly by int4 and partly by 16-bit tensors; quantize "
                                  "all of its parts or none")
    return out


def _used_tensors(ids: Tensor) -> list[int]:
    """The selected-tensor numbers that occur in ``ids``."""
    return torch.bincount((ids >> 32).flatten()).nonzero().flatten().tolist()


def _group_ids(ids: Tensor, tensors: list[int], shapes: list[tuple[int, ...]], G: int) -> tuple[Tensor, Tensor, Tensor]:
    """For every element of ``ids``: its index in the concatenation of ``tensors`` (flattened, in that order) and
    its group's index in the concatenation of their ``[..., N_t, K_t/G]`` scale grids. Also each tensor's K_t."""
    n = int(ids.max() >> 32) + 1
    lut = torch.full((n,), -1, dtype=torch.int64)
    lut[torch.tensor(tensors)] = torch.arange(len(tensors))
    numel = torch.tensor([math.prod(sh) for sh in shapes])
    Ks = torch.tensor([sh[-1] for sh in shapes])
    base = torch.cumsum(numel, 0) - numel
    gbase = torch.cumsum(numel // G, 0) - numel // G
    flat = ids & 0xFFFFFFFF
    if len(tensors) == 1:  # the common case: plain scalar arithmetic
        K = int(Ks[0])
        row = flat // K
        return flat, row * (K // G) + (flat - row * K) // G, Ks
    local = lut[ids >> 32]
    K = Ks[local]
    row = flat // K
    return base[local] + flat, gbase[local] + row * (K // G) + (flat - row * K) // G, Ks


def _groups_line_up(gid: Tensor, G: int) -> bool:
    """True when every module group of G inputs is exactly one checkpoint group (so scales map one-to-one)."""
    *lead, N, K = gid.shape
    if K % G:
        return False
    heads = gid.view(*lead, N, K // G, G)
    if not bool((heads == heads[..., :1]).all()):
        return False
    return int(torch.bincount(heads[..., 0].flatten()).max()) <= 1


def gather_int4(ids: Tensor, selected: list[str], get: Callable[[str], Int4Tensor]) -> Int4Tensor:
    """Assemble the module-layout int4 weight for ``ids`` (from :func:`trace_layer`) out of checkpoint tensors."""
    used = _used_tensors(ids)
    parts = [get(selected[j]) for j in used]
    G = parts[0].group_size
    if any(p.group_size != G for p in parts) or any((p.zeros is None) != (parts[0].zeros is None) for p in parts):
        raise CheckpointError(f"{', '.join(selected[j] for j in used)} feed one weight but differ in group size or "
                              "symmetry; waferline needs them alike")
    elem, gid, _ = _group_ids(ids, used, [p.shape for p in parts], G)
    if not _groups_line_up(gid, G):
        raise CheckpointError(f"the int4 groups of {selected[used[0]]} do not run along the module's input dimension "
                              "(a transposed layout, e.g. gpt_oss experts); keep those weights 16-bit")
    codes = torch.cat([p.codes.flatten() for p in parts])[elem]
    heads = gid[..., ::G]
    scales = torch.cat([p.scales.flatten() for p in parts])[heads]
    zeros = None if parts[0].zeros is None else torch.cat([p.zeros.flatten() for p in parts])[heads]
    return Int4Tensor(codes, scales, zeros)


def attach_int4(model: nn.Module, src: Int4Source) -> int:
    """Replace the fp weights of ``model`` (already loaded from ``src``) that the checkpoint stores in int4
    with :class:`Int4Weight` modules built from the stored codes. Returns how many were replaced."""
    spec = model.spec
    selected = sorted(src.entries)
    shapes = dict(src._shapes)
    compute = _compute_dtype(model)
    cache: dict[str, Int4Tensor] = {}

    def get(name: str) -> Int4Tensor:
        if name not in cache:
            cache[name] = src.canonical(name)
        return cache[name]

    n = 0
    for layer, i in zip(model.layers, model.layer_range):
        for path, ids in trace_layer(spec, i, shapes, selected).items():
            t = gather_int4(ids, selected, get)
            w = layer.get_parameter(path)
            install(layer, path, Int4Weight(t, w.device, compute))
            n += 1
        cache.clear()
    return n


# ----------------------------------------------------------------------------- calibration (GPTQ)


def calibration_tokens(path: str, tokenizer: Any, max_tokens: int) -> list[int]:
    """Token ids from a calibration file: text (needs the checkpoint's tokenizer) or whitespace-separated ids."""
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"calibration file {p} does not exist")
    text = p.read_text(errors="replace")[: max_tokens * 16]  # more characters than max_tokens tokens need
    parts = text.split()
    if parts and all(s.isdigit() for s in parts[:1000]):
        ids = [int(s) for s in parts]
    elif tokenizer is None:
        raise ConfigError(f"{p} is text but the checkpoint has no tokenizer: give token ids (whitespace-separated) instead")
    else:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) < 16:
        raise ConfigError(f"calibration file {p} gives only {len(ids)} tokens; GPTQ needs at least a few hundred")
    return ids[:max_tokens]


def _chunks(tokens: list[int], seq_len: int) -> list[list[int]]:
    return [tokens[s:s + seq_len] for s in range(0, len(tokens), seq_len) if len(tokens[s:s + seq_len]) >= 2]


@torch.inference_mode()
def collect_hessians(model: nn.Module, tokens: list[int], seq_len: int = 256) -> dict[str, Tensor]:
    """``H = sum x x^T`` of the inputs of every matmul weight (per expert for MoE) of the whole model, from one
    pass over the calibration tokens (keys: paths as in :func:`matmul_weights`)."""
    from waferline.model.context import StepBatch

    def run() -> None:
        for chunk in _chunks(tokens, seq_len):
            model(torch.tensor([chunk]), model.new_caches(1), StepBatch.make([0], [0], len(chunk)))

    return hessians(model, run)


def hessians(root: nn.Module, run: Callable[[], None]) -> dict[str, Tensor]:
    """``H = sum x x^T`` of the inputs of every matmul weight under ``root`` (per expert for MoE) while ``run()``
    drives data through it. Keys are the paths of :func:`matmul_weights` relative to ``root``."""
    from waferline.model.moe import DenseFFN, MoE

    H: dict[str, Tensor] = {}

    def acc(key: str, x: Tensor, K: int, expert: int | None = None, E: int = 0) -> None:
        x = x.reshape(-1, K).double()
        if key not in H:
            H[key] = torch.zeros((E, K, K) if E else (K, K), dtype=torch.float64)
        (H[key][expert] if expert is not None else H[key]).add_(x.t() @ x)

    hooks, patched = [], []
    for path, owner, leaf in matmul_weights(root):
        K = getattr(owner, leaf).shape[-1]
        if leaf == "weight":
            hooks.append(owner.register_forward_pre_hook(
                lambda m, args, key=path, K=K: acc(key, args[0], K)))
    for name, mod in root.named_modules():
        pre = name + "." if name else ""
        if isinstance(mod, MoE) and isinstance(getattr(mod, "w_down", None), Tensor):
            orig, E = mod.expert_linear, mod.num_experts

            def ex(x: Tensor, which: str, experts: Any, orig: Any = orig, pre: str = pre, mod: MoE = mod, E: int = E) -> Tensor:
                K = getattr(mod, "w_" + which).shape[-1]
                if isinstance(experts, int):
                    acc(f"{pre}w_{which}", x, K, experts, E)
                else:
                    for e in experts.unique().tolist():
                        acc(f"{pre}w_{which}", x[experts == e], K, int(e), E)
                return orig(x, which, experts)

            mod.expert_linear = ex
            patched.append((mod, mod.gather_max))
            mod.gather_max = 0
        elif isinstance(mod, DenseFFN) and isinstance(getattr(mod, "w_down", None), Tensor):
            orig = mod.linear

            def lin(x: Tensor, which: str, orig: Any = orig, pre: str = pre, mod: DenseFFN = mod) -> Tensor:
                acc(f"{pre}w_{which}", x, getattr(mod, "w_" + which).shape[-1])
                return orig(x, which)

            mod.linear = lin
            patched.append((mod, None))
    try:
        with torch.inference_mode():
            run()
    finally:
        for h in hooks:
            h.remove()
        for mod, gm in patched:
            for attr in ("expert_linear", "linear"):
                mod.__dict__.pop(attr, None)
            if gm is not None:
                mod.gather_max = gm
    return {k: v.float() for k, v in H.items()}


class SequentialCalibration:
    """GPTQ's layer-by-layer calibration: the inputs of layer i come from layers < i *after* they were quantized,
    so each layer's quantization sees (and corrects for) the error of the ones before it."""

    def __init__(self, model: nn.Module, tokens: list[int], seq_len: int = 256):
        from waferline.model.context import StepBatch

        self.chunks = _chunks(tokens, seq_len)
        self.batches = [StepBatch.make([0], [0], len(c)) for c in self.chunks]
        with torch.inference_mode():
            self.xs = [model.embed_tokens(torch.tensor([c])) for c in self.chunks]

    def _run(self, layer: nn.Module) -> list[Tensor]:
        return [layer(x, layer.new_cache(1), b) for x, b in zip(self.xs, self.batches)]

    def hessians(self, layer: nn.Module) -> dict[str, Tensor]:
        """Hessians of ``layer``'s matmul weights (keys relative to the layer) on its current inputs."""
        return hessians(layer, lambda: self._run(layer))

    @torch.inference_mode()
    def advance(self, layer: nn.Module) -> None:
        """Feed the (now quantized) ``layer``: its outputs become the next layer's inputs."""
        self.xs = self._run(layer)


# ----------------------------------------------------------------------------- config record


def quantization_config(opts: QuantOptions, kept: list[str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``quantization_config`` entry written to config.json."""
    d = {"quant_method": QUANT_METHOD, "format": "int4-grouped", "bits": opts.bits, "group_size": opts.group_size,
         "symmetric": opts.symmetric, "method": opts.method, "scale_dtype": str(opts.scale_dtype).removeprefix("torch."),
         "dequant": "w = (q - 8) * scale + zero", "always_16bit": list(ALWAYS_16BIT), "keep_patterns": list(opts.keep),
         "modules_not_quantized": kept}
    d.update(extra or {})
    return d


__all__ = ["Int4Tensor", "Int4Weight", "QuantLinear", "QuantOptions", "Int4Source", "rtn_quantize", "gptq_quantize",
           "quantize_model", "attach_int4", "trace_layer", "gather_int4", "collect_hessians", "hessians",
           "SequentialCalibration", "calibration_tokens",
           "matmul_weights", "install", "is_int4", "pack_nibbles", "unpack_nibbles", "pack_kernel", "unpack_kernel",
           "group_for", "choose_backend",
           "quant_method", "quantization_config", "FORMATS", "KERNEL_GROUPS", "ALWAYS_16BIT", "DEFAULT_KEEP"]


# ----------------------------------------------------------------------------- writing an int4 checkpoint


def _scatter(t: Int4Tensor, ids: Tensor, selected: list[str], shapes: dict[str, tuple[int, ...]],
             outs: dict[str, dict[str, Tensor]], covered: dict[str, int]) -> bool:
    """Write module-layout ``t`` back into per-checkpoint-tensor codes/scales/zeros (``outs``); False (nothing
    written) when the module's groups do not map one-to-one onto groups along each checkpoint tensor's last dim."""
    G = t.group_size
    used = _used_tensors(ids)
    shp = [shapes[selected[j]] for j in used]
    if any(sh[-1] % G for sh in shp):
        return False
    elem, gid, _ = _group_ids(ids, used, shp, G)
    if not _groups_line_up(gid, G):
        return False
    numel = [math.prod(sh) for sh in shp]
    codes = torch.full((sum(numel),), 8, dtype=torch.uint8)
    codes[elem.flatten()] = t.codes.flatten()
    heads = gid[..., ::G].flatten()
    scales = torch.zeros(sum(numel) // G, dtype=t.scales.dtype)
    scales[heads] = t.scales.flatten()
    zeros = None
    if t.zeros is not None:
        zeros = torch.zeros(sum(numel) // G, dtype=t.zeros.dtype)
        zeros[heads] = t.zeros.flatten()
    counts = torch.bincount(ids.flatten() >> 32, minlength=max(used) + 1)
    e0 = g0 = 0
    for j, sh, n in zip(used, shp, numel):
        name = selected[j]
        if name in outs:
            raise CheckpointError(f"{name} feeds more than one weight; waferline cannot quantize it")
        grid = (*sh[:-1], sh[-1] // G)
        outs[name] = {"codes": codes[e0:e0 + n].view(sh), "scales": scales[g0:g0 + n // G].view(grid)}
        if zeros is not None:
            outs[name]["zeros"] = zeros[g0:g0 + n // G].view(grid)
        covered[name] = int(counts[j])
        e0, g0 = e0 + n, g0 + n // G
    return True


def quantize_checkpoint(model_dir: Any, out_dir: Any, opts: QuantOptions, calibration: str | None = None,
                        calibration_max_tokens: int = 4096, force: bool = False,
                        progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Quantize a 16-bit checkpoint directory to the canonical int4 format in ``out_dir`` (written to a temporary
    directory beside it, then renamed into place). Returns a summary (tensors, bytes, the accounting's bytes)."""
    import os
    import shutil
    import tempfile
    import time
    from pathlib import Path

    from safetensors.torch import save_file

    from waferline.model.load import checkpoint_files, load_model, open_weights
    from waferline.spec.model import ModelSpec

    t0 = time.perf_counter()
    opts.validate()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"{model_dir} has no config.json: pass a Hugging Face checkpoint directory to --model")
    cfg = json.loads((model_dir / "config.json").read_text())
    if _qconfig(cfg):
        raise ConfigError(f"{model_dir} is already quantized ({_qconfig(cfg).get('quant_method')}); quantize a 16-bit checkpoint")
    if out_dir.resolve() == model_dir.resolve():
        raise ConfigError("--out must differ from --model")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise ConfigError(f"{out_dir} exists and is not empty; choose another --out or pass --force to replace it")
    if opts.method == "gptq" and not calibration:
        raise ConfigError("GPTQ needs calibration data: pass --calibration FILE (text, or whitespace-separated token ids)")

    spec = ModelSpec.from_pretrained(model_dir)
    model = load_model(model_dir, torch.float32)
    calib = None
    n_calib = 0
    if opts.method == "gptq":
        from waferline.engine.llm import _load_tokenizer

        tokens = calibration_tokens(calibration, _load_tokenizer(model_dir), calibration_max_tokens)
        n_calib = len(tokens)
        calib = SequentialCalibration(model, tokens)
    raw = open_weights(model_dir)
    names = raw.names_with_prefix("")
    shapes = {n: tuple(raw.shape(n)) for n in names}
    selected = [n for n in names if n.endswith(".weight") and len(shapes[n]) >= 2]
    outs: dict[str, dict[str, Tensor]] = {}
    covered: dict[str, int] = {}
    kept: list[str] = []
    total = len(model.layers)
    for pos, (layer, i) in enumerate(zip(model.layers, model.layer_range)):
        traced = trace_layer(spec, i, shapes, selected)
        hess = calib.hessians(layer) if calib is not None else {}
        for path, owner, leaf in matmul_weights(layer):
            mpath = f"layers.{pos}.{path}"
            ids = traced.get(path)
            feeds = [] if ids is None else [selected[j] for j in _used_tensors(ids)]
            if ids is None or _kept(mpath, opts.keep) or any(_kept(f, opts.keep) for f in feeds):
                kept.append(", ".join(feeds) if feeds else mpath)
                continue
            w = getattr(owner, leaf).detach()
            t = _quantize_param(w, opts, hess.get(path))
            if t is None or not _scatter(t, ids, selected, shapes, outs, covered):
                kept.append(", ".join(feeds))
            elif calib is not None:  # later layers calibrate on this layer's int4 outputs
                install(layer, path, Int4Weight(t, w.device, torch.bfloat16))
        if calib is not None:
            calib.advance(layer)
        if progress:
            progress(pos + 1, total, f"layer {i}")
    tensors: dict[str, Tensor] = {}
    n_q = 0
    int4_bytes = 0
    for name in names:
        c = covered.get(name, 0)
        if c and c != math.prod(shapes[name]):
            raise CheckpointError(f"{name} would be only partly int4 ({c} of {math.prod(shapes[name])} elements); "
                                  "keep the weights it feeds all 16-bit or all int4 (--keep)")
        if c:
            o = outs[name]
            t = Int4Tensor(o["codes"], o["scales"], o.get("zeros"))
            tensors.update(t.to_safetensors(name[: -len(".weight")]))
            int4_bytes += t.nbytes()
            n_q += 1
        else:
            v = raw.get(name)
            tensors[name] = (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
    qcfg = quantization_config(opts, sorted(set(kept)), {"calibration_tokens": n_calib} if n_calib else None)
    cfg["quantization_config"] = qcfg
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the checkpoint should not be
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "quantization": QUANT_METHOD})
        (tmp / "model.safetensors").chmod(0o666 & ~umask)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        skip = {f.name for f in checkpoint_files(model_dir)} | {"config.json", "model.safetensors.index.json"}
        for f in model_dir.iterdir():
            if f.is_file() and f.name not in skip and not f.name.endswith(".safetensors"):
                shutil.copy2(f, tmp / f.name)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{int(time.time())}")
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    bytes_in = sum(f.stat().st_size for f in checkpoint_files(model_dir))
    bytes_out = (out_dir / "model.safetensors").stat().st_size
    return {"out": str(out_dir), "method": opts.method, "bits": opts.bits, "group_size": opts.group_size,
            "symmetric": opts.symmetric, "tensors_int4": n_q, "tensors_16bit": len(names) - n_q,
            "modules_not_quantized": qcfg["modules_not_quantized"], "calibration_tokens": n_calib,
            "bytes_in": bytes_in, "bytes_out": bytes_out,
            "accounting_bytes": spec.weight_bytes(4, opts.group_size, zeros=not opts.symmetric),
            "accounting_bytes_16bit": spec.weight_bytes(16), "seconds": round(time.perf_counter() - t0, 2)}


__all__ += ["quantize_checkpoint"]
