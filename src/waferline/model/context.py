"""StepBatch: which cache rows and positions one forward call over [B, T] new tokens touches."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepBatch:
    """B sequences each appending T new tokens. Row b lives in cache slot ``slots[b]`` and its first new
    token sits at absolute position ``start[b]`` (the number of tokens already cached for it).

    Prefill with T > 1 on a slot whose ``start`` is 0 begins a fresh sequence; T > 1 with ``start`` > 0 is a
    chunked-prefill (or speculative verify) continuation; T == 1 is a decode step.
    """

    slots: torch.Tensor  # int64 [B]
    start: torch.Tensor  # int64 [B]
    T: int

    @property
    def B(self) -> int:
        return int(self.slots.shape[0])

    def positions(self) -> torch.Tensor:
        """Absolute positions of the new tokens, int64 [B, T]."""
        return self.start[:, None] + torch.arange(self.T, device=self.start.device)[None, :]

    @classmethod
    def make(cls, slots: list[int], start: list[int], T: int, device: torch.device | str = "cpu") -> "StepBatch":
        return cls(torch.tensor(slots, dtype=torch.long, device=device), torch.tensor(start, dtype=torch.long, device=device), T)
