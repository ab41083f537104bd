"""Sampling parameters and token selection: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from waferline import kernels
from waferline.errors import RequestError


@dataclass
class SamplingParams:
    """How to continue a prompt. ``temperature == 0`` is greedy; ``seed`` makes sampling reproducible per request."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g


def greedy(logits: torch.Tensor) -> list[int]:
    """The argmax over the last dimension of logits [..., V], as (nested) Python ints: torch.argmax's indices (the
    first largest; a NaN first), by waferline::argmax_rows for fp32 CPU logits (one vector pass instead of ATen's
    reduction, ~35 us a step for a 32000-token vocabulary), else by torch.argmax."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() >= 1 and kernels.available():
        return torch.ops.waferline.argmax_rows(logits).tolist()
    return logits.argmax(-1).tolist()


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Pick one token from fp32 logits [V]."""
    if params.temperature == 0:
        return greedy(logits.reshape(-1))
    probs = target_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=gen))


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T) restricted by top-k and top-p, renormalised."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        cum = sp.cumsum(-1)
        drop = cum - sp > params.top_p  # keep the smallest prefix whose mass reaches top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
