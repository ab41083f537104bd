"""Int4 weights on a device: the layouts of waferline's CPU kernel, ATen's int4pack ops and CUDA's tinygemm, the
choice among them, and the modules the model runs (``Int4Weight``, ``QuantLinear``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from waferline.errors import ConfigError
from waferline.model.layers import linear as dense_linear
from waferline.model.quant.tensor import KERNEL_GROUPS, Int4Tensor, _nbytes, pack_nibbles, unpack_nibbles


def _cpu_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


KERNEL_BLOCK = 64  # inputs per block of waferline's CPU int4 layout (32 bytes; a last block of 32 where K % 64 == 32)


def _kernel_lo_k(b: int) -> int:
    """The input (0..31) of a 64-input block whose code the low nibble of byte ``b`` holds (the high nibble: that +
    32): the order in which the AVX2 kernel widens a block (``int4_lo_k`` in kernels/cpu/int4.h)."""
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

    def __init__(
        self,
        t: Int4Tensor,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        backend: str | None = None,
    ):
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
                packed.append(
                    torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes[e].to(torch.int32).contiguous(), 1)
                )
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
