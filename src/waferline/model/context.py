"""StepBatch: which cache rows and positions one forward call over [B, T] new tokens touches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StepBatch:
    """B sequences each appending T new tokens. Row b lives in cache slot ``slots[b]`` and its first new
    token sits at absolute position ``start[b]`` (the number of tokens already cached for it).

    Prefill with T > 1 on a slot whose ``start`` is 0 begins a fresh sequence; T > 1 with ``start`` > 0 is a
    chunked-prefill (or speculative verify) continuation; T == 1 is a decode step.

    ``make`` also keeps the slots and starts as Python ints, so the layers can take views instead of gathers
    (``slot0``), skip masks nobody needs (``uniform``) and size caches (``end``) without reading tensors back;
    ``memo`` holds what every layer of one step shares (positions, masks, rotary tables), computed once per step.
    """

    slots: torch.Tensor  # int64 [B]
    start: torch.Tensor  # int64 [B]
    T: int
    host_slots: tuple[int, ...] | None = None
    host_start: tuple[int, ...] | None = None
    memo: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def B(self) -> int:
        return int(self.slots.shape[0])

    def positions(self) -> torch.Tensor:
        """Absolute positions of the new tokens, int64 [B, T]."""
        pos = self.memo.get("pos")
        if pos is None:  # (a decode step's: a view of start, no op)
            pos = self.memo["pos"] = (self.start[:, None] if self.T == 1 else
                                      self.start[:, None] + torch.arange(self.T, device=self.start.device)[None, :])
        return pos

    @property
    def end(self) -> int:
        """One past the last position any row writes: max(start) + T."""
        if "end" not in self.memo:
            top = max(self.host_start) if self.host_start is not None else int(self.start.max())
            self.memo["end"] = top + self.T
        return self.memo["end"]

    @property
    def slot0(self) -> int | None:
        """The first slot when the rows' slots are consecutive (s0, s0+1, ...): the cache rows are then a view."""
        if "slot0" not in self.memo:
            s = self.host_slots
            consecutive = s is not None and all(b == s[0] + i for i, b in enumerate(s))
            self.memo["slot0"] = s[0] if consecutive else None
        return self.memo["slot0"]

    @property
    def uniform(self) -> bool:
        """Every row starts at the same position (no ragged lengths: causal masks are the same for all rows)."""
        if "uniform" not in self.memo:
            h = self.host_start
            self.memo["uniform"] = h is not None and all(x == h[0] for x in h)
        return self.memo["uniform"]

    def rows(self) -> StepBatch:
        """This step's B x T new tokens as B·T rows of one token each (row b·T + t: slot ``slots[b]``, position
        ``start[b] + t``), for operators that take a verify's tokens as decode rows; itself when T == 1. Built once
        per step (the layers share it and its memo)."""
        if self.T == 1:
            return self
        r = self.memo.get("rows")
        if r is None:
            T = self.T
            hs = None if self.host_slots is None else tuple(s for s in self.host_slots for _ in range(T))
            hp = None if self.host_start is None else tuple(p + t for p in self.host_start for t in range(T))
            r = self.memo["rows"] = StepBatch(self.slots.repeat_interleave(T), self.positions().reshape(-1), 1, hs, hp)
        return r

    @classmethod
    def static(cls, slots: torch.Tensor, start: torch.Tensor, end: int) -> StepBatch:
        """A one-token step of fixed shape: the rows' slots and positions only as tensors (``start`` may change in
        place between steps), the caches sized to ``end`` (past every position it will hold): the layers read
        nothing back from the device and every shape is the same at every position, so the step can be captured
        (a CUDA graph; engine/graphs.py). Attention then covers all ``end`` cache rows, the later ones masked."""
        b = cls(slots, start, 1)
        b.memo.update(end=end, slot0=None, uniform=False)
        return b

    @classmethod
    def decode(cls, tokens: list[int], slots: list[int], start: list[int],
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, StepBatch]:
        """A one-token step's input tokens [B, 1] and its batch, from one tensor made on ``device`` (on a GPU, one
        host-to-device copy instead of three: each is synchronous)."""
        slots, start = [int(s) for s in slots], [int(s) for s in start]
        packed = torch.tensor([[int(t) for t in tokens], slots, start], dtype=torch.long, device=device)
        return packed[0].view(-1, 1), cls(packed[1], packed[2], 1, tuple(slots), tuple(start))

    @classmethod
    def chunks(cls, tokens: list[list[int]], slots: list[int], start: list[int], device: torch.device | str = "cpu",
               extra: list[int] | tuple = ()) -> tuple[torch.Tensor, StepBatch, torch.Tensor]:
        """A step of B rows of T tokens each (``tokens``: B lists of T ints; a prefill call's chunks, a verify's
        rows): its input tokens [B, T], its batch and ``extra`` (ints the step indexes by) as a tensor, all from one
        tensor made on ``device`` (on a GPU, one host-to-device copy instead of one each: each is synchronous)."""
        B, T = len(tokens), len(tokens[0])
        slots, start = [int(s) for s in slots], [int(s) for s in start]
        flat = [int(t) for row in tokens for t in row]
        if len(flat) != B * T:
            raise ValueError("StepBatch.chunks: every row needs the same number of tokens")
        packed = torch.tensor(flat + slots + start + [int(x) for x in extra], dtype=torch.long, device=device)
        n = B * T
        return (packed[:n].view(B, T), cls(packed[n:n + B], packed[n + B:n + 2 * B], T, tuple(slots), tuple(start)),
                packed[n + 2 * B:])

    @classmethod
    def make(cls, slots: list[int], start: list[int], T: int, device: torch.device | str = "cpu") -> StepBatch:
        slots, start = [int(s) for s in slots], [int(s) for s in start]
        return cls(
            torch.tensor(slots, dtype=torch.long, device=device),
            torch.tensor(start, dtype=torch.long, device=device),
            T,
            tuple(slots),
            tuple(start),
        )
