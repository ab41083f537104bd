"""Steps in flight: the engine loop (engine/loop.py) keeps up to M scheduler steps in flight over a runner that can
launch a step and read its answers later (``submit`` / ``collect``: a pipeline's, engine/pipeline/serving.py), so
the stages keep working while the scheduler postprocesses one step and schedules the next.

Each step in flight holds a disjoint set of sequences (``Scheduler.busy``): a sequence is in one plan at a time, and is
scheduled again once its plan is postprocessed. Page accounting happens when a plan is scheduled, as in a plain step;
a sequence in flight is never preempted, and an abort of one waits until its plan is collected. A plan takes at most
1/M of the active sequences (``Scheduler.plan_cap``) so that the steps in flight are of similar size.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

from waferline.engine.scheduler import Scheduler
from waferline.engine.sequence import StepPlan, StepResult


def can_overlap(sch: Scheduler) -> bool:
    """The runner keeps steps in flight and the scheduler does not speculate or burst (those stay step by step)."""
    r = sch.runner
    return (bool(getattr(r, "overlap", False)) and hasattr(r, "submit") and sch.spec_dec is None
            and not sch.config.greedy_bursts and _depth(sch) > 1)


def _depth(sch: Scheduler) -> int:
    pipe = getattr(sch.runner, "pipe", None)
    return max(1, int(getattr(pipe, "micro_batches", 1))) if getattr(pipe, "num_stages", 1) > 1 else 1


class OverlapStepper:
    """Drives ``sch`` with up to M plans in flight; ``step`` submits a plan where one fits, else collects the
    oldest."""

    def __init__(self, sch: Scheduler):
        self.sch = sch
        self.depth = _depth(sch)
        self.in_flight: collections.deque[tuple[StepPlan, Any]] = collections.deque()
        self._aborts: set[str] = set()

    def has_work(self) -> bool:
        return bool(self.in_flight) or self.sch.has_work()

    @torch.inference_mode()
    def step(self) -> int:
        """Submit one more plan if there is room and anything to run; otherwise collect and postprocess the oldest.
        Returns the tokens fed through the model by a collected plan (0 after a submit)."""
        sch = self.sch
        if len(self.in_flight) < self.depth:
            active = len(sch.running) + len(sch.waiting)
            sch.plan_cap = max(1, math.ceil(active / self.depth))
            try:
                plan = sch.schedule()
            finally:
                sch.plan_cap = sch.config.max_num_seqs
            if plan.decodes or plan.prefills:
                self._submit(plan)
                if len(self.in_flight) < self.depth:
                    return 0
        if not self.in_flight:
            return 0
        return self._collect()

    def _submit(self, plan: StepPlan) -> None:
        sch = self.sch
        dec_rows, chunks = sch.rows(plan)
        handle = sch.runner.submit(dec_rows, chunks)  # type: ignore[attr-defined]
        sch.busy.update(s.request_id for s in plan.decodes)
        sch.busy.update(s.request_id for s, _ in plan.prefills)
        self.in_flight.append((plan, handle))

    def _collect(self) -> int:
        sch = self.sch
        plan, handle = self.in_flight.popleft()
        res = StepResult()
        res.decoded, res.prefilled = sch.runner.collect(handle)  # type: ignore[attr-defined]
        seqs = list(plan.decodes) + [s for s, _ in plan.prefills]
        for s in seqs:
            sch.busy.discard(s.request_id)
        fed = sch.postprocess(plan, res)
        for s in seqs:
            if s.request_id in self._aborts:
                self._aborts.discard(s.request_id)
                sch.abort(s.request_id)
        return fed

    def abort(self, request_id: str) -> bool:
        """Abort a request; one in flight is aborted when its plan is collected."""
        if request_id in self.sch.busy:
            self._aborts.add(request_id)
            return True
        return self.sch.abort(request_id)

    def drop(self) -> None:
        """Forget the plans in flight (after a fault: the scheduler fails their sequences, the runner recovers)."""
        self.in_flight.clear()
        self._aborts.clear()
        self.sch.busy.clear()
