"""The server's scheduler over a pipeline: ``PipelineRunner`` runs each scheduler step (engine/runner.py) through the
stage processes of a ``Pipeline``.

The scheduler stays in this process (stage 0); the stages keep their slices of layers and per-slot caches, one slot
per scheduler slot (one BEGIN at start-up sizes them; a RESET message clears the slots of newly admitted sequences).
A step's rows are split into up to M micro-batches that are all launched before the first answer is read, so stage
r works on micro-batch k while stage r-1 works on k+1. The last stage answers greedy rows with their argmax
(EMIT_TOKEN, sampled at temperature 0) and sampled rows with their fp32 logits (EMIT_LOGITS): the scheduler samples
those with each request's own generator, so per-request parameters and seeds hold as in the single-process engine.

Faults are the pipeline's own (supervise.py): a stage that dies or hangs makes the step raise ``StageError``; the
runner then reports the fault and ``recover`` builds a new pipeline (new stage processes) when it was given a way to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from waferline.engine.pipeline.supervise import StageError
from waferline.engine.runner import WANT_ARGMAX, WANT_LOGITS, WANT_NONE, DecodeRow, PrefillChunk, RowOutput
from waferline.engine.sampling import SamplingParams
from waferline.engine.stage import EMIT_LOGITS, EMIT_NONE, EMIT_TOKEN, RESET, Group, MicroBatch
from waferline.errors import ConfigError

if TYPE_CHECKING:
    from waferline.engine.pipeline.driver import Pipeline

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)  # how the last stage samples EMIT_TOKEN rows
_EMITS = {WANT_NONE: EMIT_NONE, WANT_ARGMAX: EMIT_TOKEN, WANT_LOGITS: EMIT_LOGITS}

# a row of a step as it travels: (slot, start, tokens, want, index into the step's outputs)
_Row = tuple[int, int, list[int], int, int]


def _once(fn: Callable[[], Any]) -> Iterator[Any]:
    """``fn`` as a one-item iterator, for ``Pipeline._guarded`` (which turns transport failures into StageError)."""
    yield fn()


class PipelineRunner:
    """A ``Runner`` over the stage processes of ``pipe``; ``rebuild`` returns a new Pipeline after a fault."""

    def __init__(self, pipe: Pipeline, num_slots: int, rebuild: Callable[[], Pipeline] | None = None):
        self.rebuild = rebuild
        self.num_slots = num_slots
        self._attach(pipe)

    def _attach(self, pipe: Pipeline) -> None:
        if pipe.speculative:
            raise ConfigError("the server's scheduler does not speculate: build the pipeline without speculative")
        self.pipe = pipe
        self.spec = pipe.spec
        self.cache_bits = torch.finfo(pipe.dtype).bits
        self._begin()

    def _begin(self) -> None:
        """Fresh caches of ``num_slots`` rows on every stage; the last stage samples EMIT_TOKEN rows greedily."""
        self._guard(lambda: self.pipe._begin(self.num_slots, _GREEDY))

    def _guard(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` under the pipeline's guard; a fault raises StageError with the fault's own words."""
        try:
            return list(self.pipe._guarded(_once(fn)))[0]  # (run to the end: the guard holds the pipeline's lock)
        except StageError as e:
            raise type(e)(self.fault() or str(e)) from None

    # -- the Runner interface
    def step(self, decodes: list[DecodeRow], prefills: list[PrefillChunk]
             ) -> tuple[list[RowOutput | None], list[RowOutput | None]]:
        rows: list[_Row] = [(r.slot, r.position, [r.token], r.want, i) for i, r in enumerate(decodes)]
        rows += [(c.slot, c.start, c.tokens, c.want, len(decodes) + i) for i, c in enumerate(prefills)]
        outs: list[RowOutput | None] = [None] * len(rows)
        if rows:
            self._guard(lambda: self._run(self._split(rows, len(decodes)), outs))
        return outs[:len(decodes)], outs[len(decodes):]

    def reset_slots(self, slots: list[int]) -> None:
        def reset() -> None:
            self.pipe.runner.reset_slots(slots)
            if self.pipe.num_stages > 1:
                self.pipe._send_chain(RESET, list(slots))

        self._guard(reset)

    def prefix_caches(self) -> list[Any] | None:
        return None  # the caches live in the stage processes

    def fault(self) -> str | None:
        """Why the pipeline cannot run a step (a stage died, hung or failed), or None."""
        p = self.pipe
        if p._fault is not None:  # (the watchdog's diagnosis names the process)
            return f"{p._engine_name} failed: {p._fault}"
        if p._broken is not None:
            return str(p._broken)
        if p._closed:
            return f"the {p._engine_name} is closed"
        return None

    def recover(self) -> None:
        """A healthy pipeline gets fresh caches (a BEGIN); a broken one is replaced by a new one (new processes)."""
        if self.fault() is None:
            self._begin()
            return
        self.pipe.close()
        if self.rebuild is None:
            raise StageError(f"{self.fault()}; no way to start new processes was given")
        self._attach(self.rebuild())

    def close(self) -> None:
        self.pipe.close()

    # -- micro-batches
    def _split(self, rows: list[_Row], n_decodes: int) -> list[list[_Row]]:
        """Up to M micro-batches: the decode rows in M contiguous runs of near-equal size, then each prefill chunk
        into the micro-batch with the fewest tokens so far."""
        M = max(1, min(self.pipe.micro_batches, len(rows)))
        mbs: list[list[_Row]] = [[] for _ in range(M)]
        for k, row in enumerate(rows[:n_decodes]):
            mbs[k * M // max(n_decodes, 1)].append(row)
        load = [len(mb) for mb in mbs]
        for row in rows[n_decodes:]:
            i = load.index(min(load))
            mbs[i].append(row)
            load[i] += len(row[2])
        return [mb for mb in mbs if mb]

    def _run(self, mbs: list[list[_Row]], outs: list[RowOutput | None]) -> None:
        """Launch every micro-batch (stage 0 computes its layers on each, then sends it on), then read the last
        stage's answers and put them where their rows' outputs go."""
        pipe = self.pipe
        where: dict[int, dict[int, int]] = {}  # mb id -> slot -> output index
        for rows in mbs:
            by_T: dict[int, list[_Row]] = {}
            for row in rows:
                by_T.setdefault(len(row[2]), []).append(row)
            groups, toks = [], []
            for T in sorted(by_T):
                g = Group(T)
                for slot, start, _, want, _ in by_T[T]:
                    g.seqs.append(slot)
                    g.slots.append(slot)
                    g.starts.append(start)
                    g.emits.append(_EMITS[want])
                groups.append(g)
                toks.append(torch.tensor([r[2] for r in by_T[T]], dtype=torch.long))
            pipe._carry_ids(groups, toks)
            pipe._mb_ids += 1
            mb = MicroBatch(pipe._mb_ids, groups)
            where[mb.mb_id] = {r[0]: r[4] for r in rows if r[3] != WANT_NONE}
            pipe._launch(mb, toks)
        while where:
            mb_id, tokens, logits, _ = pipe._next_feedback()
            slots = where.pop(mb_id, None)
            if slots is None:
                raise StageError(f"protocol error: an answer for micro-batch {mb_id}, which is not in flight")
            for slot, i in slots.items():
                if slot in logits:
                    outs[i] = RowOutput(logits=logits[slot][0].clone())
                elif tokens.get(slot):
                    outs[i] = RowOutput(argmax=tokens[slot][0])
        if pipe.num_stages > 1:
            pipe.act.flush()
