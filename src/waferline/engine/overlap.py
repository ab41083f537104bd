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
import time
from typing import Any

import torch

from waferline.engine.scheduler import Scheduler
from waferline.engine.sequence import StepPlan, StepResult


def can_overlap(sch: Scheduler) -> bool:
    """The runner keeps steps in flight (speculative ones too where the scheduler speculates) and the scheduler does
    not burst (bursts stay step by step)."""
    r = sch.runner
    return (bool(getattr(r, "overlap", False)) and hasattr(r, "submit")
            and (sch.spec_dec is None or bool(getattr(r, "verify_in_flight", False)))
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
        self.in_flight: collections.deque[tuple[StepPlan, Any, float]] = collections.deque()  # (+ launch seconds)
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
            if plan.decodes or plan.prefills or plan.verifies:
                self._submit(plan)
                if len(self.in_flight) < self.depth:
                    return 0
        if not self.in_flight:
            return 0
        return self._collect()

    def _submit(self, plan: StepPlan) -> None:
        sch, spec = self.sch, self.sch.spec_dec
        dec_rows, chunks = sch.rows(plan)
        verifies = spec.verify_rows(plan.verifies) if plan.verifies else []  # type: ignore[union-attr]
        t0 = time.perf_counter()
        handle = sch.runner.submit(dec_rows, chunks, *([verifies] if verifies else []))  # type: ignore[attr-defined]
        sch.busy.update(s.request_id for s in _seqs(plan))
        self.in_flight.append((plan, handle, time.perf_counter() - t0))

    def _collect(self) -> int:
        """Read the oldest plan's answers and postprocess it: its verify rows judged and kept first, the drafter handed
        its plain rows' hidden states, adaptive K the plan's cost: the time its launch took (the first stage's layers
        run in this process) and the time spent waiting for its answers. (Its time in flight would count the work of
        the plans around it, drafting included: a plain step beside a verify would look as dear as the verify.)"""
        sch, spec = self.sch, self.sch.spec_dec
        plan, handle, seconds = self.in_flight.popleft()
        res = StepResult()
        t0 = time.perf_counter()
        got = sch.runner.collect(handle)  # type: ignore[attr-defined]
        seconds += time.perf_counter() - t0
        if plan.verifies:
            outs, res.decoded, res.prefilled = got
            res.verified, res.fed = spec.judged(sch.runner, plan.verifies, outs)  # type: ignore[union-attr]
        else:
            res.decoded, res.prefilled = got
        if spec is not None:
            if not plan.prefills and bool(plan.verifies) != bool(plan.decodes):  # (a step of one kind, as execute)
                spec.record(len(plan.verifies) or len(plan.decodes),
                            max([len(p.tokens) + 1 for _, p in plan.verifies] or [1]), seconds)
            spec.after_step(plan.decodes, plan.prefills, res.decoded, res.prefilled)
        seqs = _seqs(plan)
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


def _seqs(plan: StepPlan) -> list[Any]:
    """The sequences of ``plan``: its verify rows', its decode rows', its prefill chunks'."""
    return [s for s, _ in plan.verifies] + list(plan.decodes) + [s for s, _ in plan.prefills]
