"""The canonical int4 weight: group-wise codes and scales (and zeros), their two-per-byte packing on disk, the group
size a tensor uses, and the names config.json records."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from waferline.spec.model import group_for  # noqa: F401  (one rule for the files and the byte accounting)

QUANT_METHOD = "waferline"
KERNEL_GROUPS = (32, 64, 128, 256)  # group sizes the int4pack kernels take
# what stays 16-bit whatever the user asks: recorded in config.json
ALWAYS_16BIT = ("embeddings", "lm_head", "router", "norms", "mamba conv and per-head scalars", "biases", "mtp heads")
DEFAULT_KEEP = (r"kv_b_proj",)  # MLA's absorbed W_UK/W_UV come from kv_b_proj: kept 16-bit by default (as vLLM does)


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
