"""The server's scheduler over attention/FFN disaggregation: ``AFDRunner`` runs each scheduler step
(engine/runner.py) through the attention and FFN ranks of an ``AFD`` engine.

Scheduler slot i is global row i of the AFD engine: it lives in slot i // M of attention rank i % M, as in
``AFD.generate``. A step gives every attention rank its rows, split into the engine's K micro-batches that ping-pong
with the FFN ranks; the answers come back as in the pipeline (``PipelineRunner``, whose fault handling and
recovery this runner shares): the argmax of greedy rows, the fp32 logits of sampled ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from waferline.engine.pipeline.serving import _EMITS, _GREEDY, PipelineRunner
from waferline.engine.runner import WANT_NONE, DecodeRow, PrefillChunk, RowOutput

if TYPE_CHECKING:
    from waferline.engine.afd.driver import AFD


class AFDRunner(PipelineRunner):
    """A ``Runner`` over the ranks of ``afd``; ``rebuild`` returns a new AFD engine after a fault."""

    pipe: AFD

    def _begin(self) -> None:
        self._guard(lambda: self.pipe._begin_ranks(self.num_slots, _GREEDY))

    def step(self, decodes: list[DecodeRow], prefills: list[PrefillChunk]
             ) -> tuple[list[RowOutput | None], list[RowOutput | None]]:
        afd = self.pipe
        per: list[list[tuple[int, list[int], int, int]]] = [[] for _ in range(afd.M)]
        wanted: dict[int, int] = {}  # slot -> output index
        rows: list[tuple[int, int, list[int], int]] = [(r.slot, r.position, [r.token], r.want) for r in decodes]
        rows += [(c.slot, c.start, c.tokens, c.want) for c in prefills]
        for i, (slot, start, tokens, want) in enumerate(rows):
            per[afd._rank_of(slot)].append((slot, tokens, start, _EMITS[want]))
            if want != WANT_NONE:
                wanted[slot] = i
        outs: list[RowOutput | None] = [None] * len(rows)
        if rows:
            for _, tokens, logits, _ in self._guard(lambda: self._step(per)):
                for slot, t in tokens.items():
                    if slot in wanted and t:
                        outs[wanted[slot]] = RowOutput(argmax=t[0])
                for slot, lg in logits.items():
                    if slot in wanted:
                        outs[wanted[slot]] = RowOutput(logits=lg[0].clone())
        return outs[:len(decodes)], outs[len(decodes):]

    def _step(self, per: list[list[tuple[int, list[int], int, int]]]) -> list[Any]:
        out = self.pipe._step_ranks(per)
        self.pipe.link.flush()
        return out

    def reset_slots(self, slots: list[int]) -> None:
        self._guard(lambda: self.pipe._reset_rows(slots))
