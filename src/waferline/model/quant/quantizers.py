"""Quantizing one weight to int4: round-to-nearest per group, and GPTQ (rounding errors spread over the columns not
yet quantized through the inverse Hessian)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from waferline.errors import ConfigError
from waferline.model.quant.tensor import Int4Tensor


def _group_params(wg: Tensor, symmetric: bool, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """Scale (and zero) per group for ``wg [..., n_groups, G]``, rounded to ``scale_dtype`` (returned fp32)."""
    if symmetric:
        amax = wg.abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / 7.5, torch.ones_like(amax))
        r = scale.to(scale_dtype)
        # round up: |w| <= 7.5 s
        r = torch.where(r.float() < scale, torch.nextafter(r, torch.full_like(r, math.inf)), r)
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


def rtn_quantize(
    w: Tensor, group_size: int, symmetric: bool = True, scale_dtype: torch.dtype = torch.bfloat16
) -> Int4Tensor:
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
