"""A decode step of fixed shape, captured once as a CUDA graph and replayed per token (the single-process engine on a
GPU; on CPU the same step runs eagerly, which is how the tests check it).

An eager decode step on a GPU launches a few hundred small kernels from Python, each waiting on the host, so a
small batch is bound by launches rather than by reading the weights from HBM. A captured step replays them all
from one call. What a step must be for that: the same shapes at every position (``StepBatch.static``: attention
over the cache up to a fixed end, later rows masked), nothing read back to the host inside it (MoE experts as
grouped products, ``MoE._grouped_forward``), and caches that stay where they are (grown to that end before the
capture). Only models whose every cache is a full-attention ``TokenCache`` qualify (a Mamba-2 state or a
sliding-window ring would be advanced by the warm-up steps); the caller falls back to eager steps otherwise, and
when the warm-up finds a host read (``torch.cuda`` sync debug mode set to error).
"""

from __future__ import annotations

from typing import Any

import torch

from waferline.model.attention import TokenCache
from waferline.model.context import StepBatch


def graphable(caches: list[Any]) -> bool:
    """Whether a static step can run on these caches: every one a full-attention TokenCache."""
    return bool(caches) and all(isinstance(c, TokenCache) and c.window is None for c in caches)


class StaticDecode:
    """One-token decode steps of the rows in cache slots ``slots``, with positions below ``end``: ``run(tokens,
    starts)`` -> (fp32 logits [B, V], greedy ids [B]) on the model's device. ``capture``: record the step as a CUDA
    graph (a GPU only) after two warm-up steps; the outputs are then the graph's own buffers, overwritten by the next
    run. The warm-up and the capture write cache row ``end - 1`` of each slot, which no step sees before the step at
    that position writes it again (later rows are masked)."""

    def __init__(self, model: Any, caches: list[Any], slots: list[int], end: int, device: torch.device,
                 capture: bool = False):
        if not graphable(caches):
            raise ValueError("a static decode step needs full-attention token caches only")
        self.model, self.caches, self.end = model, caches, end
        self.slot_list = list(slots)
        B = len(slots)
        # the step's inputs, tokens then positions, in one tensor: one host-to-device copy a step (each synchronous)
        self._inputs = torch.full((2, B), end - 1, dtype=torch.long, device=device)
        self._inputs[0] = 0
        self.tokens = self._inputs[0].view(B, 1)
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.start = self._inputs[1]
        for c in caches:  # (the tensors the step holds: they must not move once captured)
            if c.capacity < end:
                c._grow(end)
        self.graph = None
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None
        # paged caches: the page tables' copies on the device, which a captured step reads (refreshed in place as
        # pages are given; a table grown wider makes a new copy, and the step then runs eagerly)
        self._tables = list({id(c.table): c.table for c in caches if c.table is not None}.values())
        self._table_ids: list[torch.Tensor] = []
        self.dropped: str | None = None  # (why a captured graph was given up for eager steps, if it was)
        if capture:
            self._capture(device)

    def _step(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = StepBatch.static(self.slots, self.start, self.end)  # (a fresh memo: per-step tables are recomputed)
        logits = self.model.logits(self.model(self.tokens, self.caches, batch))[:, 0]
        return logits, logits.argmax(-1)

    def _capture(self, device: torch.device) -> None:
        with torch.cuda.device(device):  # (the capture stream must be the model's device's: cuda:N, not the current)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            mode = torch.cuda.get_sync_debug_mode()
            with torch.cuda.stream(side):
                self._step()  # (first: the page tables widened to the end and copied to the device, host to GPU)
                # (the key the step's own reads use: its tensors' device, cuda:N; a bare "cuda" was a second copy,
                # and the graph was dropped at its first replay)
                self._table_ids = [t.ids_on(self.slots.device) for t in self._tables]
                torch.cuda.set_sync_debug_mode("error")  # a host read in the step cannot be captured: say so here
                try:
                    for _ in range(2):
                        self._step()
                finally:
                    torch.cuda.set_sync_debug_mode(mode)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                self.out = self._step()
        self.graph = graph

    def run(self, tokens: list[int], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: row b's token ``tokens[b]`` at position ``starts[b]`` (< end)."""
        self._load(tokens, starts, 1)
        return self._once()

    def burst(self, tokens: list[int], starts: list[int], n: int) -> torch.Tensor:
        """``n`` greedy steps back to back, each step's argmax the next one's token, fed on the device (no host read
        between the steps: on a GPU the replays queue behind each other): the ids [B, n], on the device. Every row
        of the step takes part (its slots are ``slot_list``); the caches must hold pages for all n positions."""
        self._load(tokens, starts, n)
        ids = torch.empty((n, len(tokens)), dtype=torch.long, device=self._inputs.device)
        for j in range(n):
            ids[j].copy_(self._once()[1])
            if j + 1 < n:
                self._inputs[0].copy_(ids[j])
                self._inputs[1].add_(1)
        return ids.t()

    def _load(self, tokens: list[int], starts: list[int], n: int) -> None:
        """The step's inputs for ``n`` steps from (``tokens``, ``starts``); the page tables' device copies current."""
        if max(starts) + n - 1 >= self.end:
            raise ValueError(f"position {max(starts) + n - 1} is past the static step's end {self.end}")
        self._inputs.copy_(torch.tensor([tokens, starts], dtype=torch.long))
        if self.graph is not None and any(t.ids_on(ids.device) is not ids for t, ids in zip(self._tables,
                                                                                         self._table_ids)):
            self.graph = None  # a page table grew wider than the captured step's copy of it: eager from here on
            self.dropped = "a page table grew wider than the captured step's copy"

    def _once(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graph is None:
            return self._step()
        self.graph.replay()
        assert self.out is not None
        return self.out
