"""The background loop that drives a ``Scheduler`` (engine/scheduler.py) for the server: requests come in from the
HTTP handlers' threads, events go back through each request's sink, and a failed step is recovered from."""

from __future__ import annotations

import collections
import logging
import threading
import uuid
from collections.abc import Callable

import torch

from waferline.engine.overlap import OverlapStepper, can_overlap
from waferline.engine.sampling import SamplingParams
from waferline.engine.scheduler import Scheduler
from waferline.engine.sequence import Event, Sequence, check_request, request_generator
from waferline.errors import RequestError, WaferlineError

log = logging.getLogger("waferline.engine")


class QueueFullError(WaferlineError):
    """The server's waiting queue is full (HTTP 429): retry later, or raise --max-queue / --max-num-seqs."""


class EngineUnavailableError(WaferlineError):
    """The engine cannot take requests now (HTTP 503): it is rebuilding after a fault, or it stopped for good."""


class EngineLoop:
    """Runs a Scheduler in a background thread. ``submit``/``abort`` are thread-safe; events reach each
    request's ``sink`` from the engine thread (the server forwards them into its event loop).

    A step that fails (a bug, an out-of-memory, a pipeline stage that died or hung) ends every running, waiting and
    queued request with an error, then the runner recovers (fresh caches; a pipeline is rebuilt with new stage
    processes). While it recovers the loop is not ``healthy`` and ``submit`` refuses requests; if recovery fails the
    loop stops for good (``fatal``) and calls ``on_fatal`` (the CLI's server then exits non-zero), as it does when the
    loop itself fails outside a step."""

    def __init__(self, scheduler: Scheduler, torch_threads: int | None = None,
                 on_fatal: Callable[[str], None] | None = None):
        self.scheduler = scheduler
        self.torch_threads = torch_threads
        self.on_fatal = on_fatal
        self.recovering = False
        self.fatal: str | None = None
        self.recoveries = 0  # faults recovered from since start
        self._lock = threading.Condition()
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._stop = False
        self._paused = False
        self.stepper = OverlapStepper(scheduler) if can_overlap(scheduler) else None  # steps in flight
        self._thread = threading.Thread(target=self._run, name="waferline-engine", daemon=True)
        self.last_error: str | None = None

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (failing what is left) and release the runner."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.scheduler.runner.close()

    @property
    def healthy(self) -> bool:
        """The loop runs and can take requests (not recovering from a fault, not stopped)."""
        return (self.fatal is None and not self.recovering and not self._stop and self._thread.is_alive()
                and self.scheduler.runner.fault() is None)

    def pause(self) -> None:
        """Stop stepping (requests still queue up): for maintenance and for tests of the queue bound."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    # -- thread-safe API
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[Event], None],
               request_id: str | None = None) -> str:
        """Queue a request; raises RequestError (never runnable), QueueFullError (try again later) or
        EngineUnavailableError (the engine is recovering from a fault, or stopped)."""
        return self.submit_many([(prompt_ids, params, sink, request_id)])[0]

    def submit_many(self, requests: list[tuple[list[int], SamplingParams, Callable[[Event], None], str | None]]
                    ) -> list[str]:
        """Queue several requests (prompt ids, params, sink, id) all or none: as ``submit``, where any that cannot
        run, or a queue without room for all of them, queues none."""
        seqs = []
        for prompt_ids, params, sink, request_id in requests:
            seq = Sequence(request_id or uuid.uuid4().hex, list(prompt_ids), params, sink)
            sch = self.scheduler
            check_request(seq.prompt_ids, params, sch.spec.vocab_size, sch.max_model_len, sch.llm.tokenizer)
            seq.generator = request_generator(params)
            seqs.append(seq)
        with self._lock:
            if not self.healthy:
                raise EngineUnavailableError(self.unavailable_reason())
            # those free slots take at the next step do not wait: none while paused, or while the queue's head waits
            # (the cache budget, not the slots, holds it back)
            cfg, sch = self.scheduler.config, self.scheduler
            free = 0 if self._paused or sch.waiting else max(0, cfg.max_num_seqs - len(sch.running))
            if self.num_waiting + len(seqs) > cfg.max_queue + free:
                raise QueueFullError(
                    f"the server's queue is full ({cfg.max_queue} waiting requests); retry later"
                )
            self._inbox.extend(seqs)
            self._lock.notify_all()
        return [s.request_id for s in seqs]

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify_all()

    # -- the thread
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # (outside a step: admission or abort bookkeeping) no request may wait on a dead loop
            self.fatal = f"the engine loop failed: {type(e).__name__}: {e}"
            log.error("%s", self.fatal, exc_info=True)
            with self._lock:
                queued = list(self._inbox)
                self._inbox.clear()
            try:
                self._fail_everything(self.fatal, queued)
            finally:
                if self.on_fatal is not None:
                    self.on_fatal(self.fatal)

    def _loop(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        sch = self.scheduler
        while True:
            with self._lock:
                while not self._stop and (self._paused or not (self._inbox or self._aborts or self._has_work())):
                    self._lock.wait(0.5)
                    if sch.runner.fault() is not None:  # (a stage died while the engine was idle)
                        break
                if self._stop:
                    break
                incoming = list(self._inbox)
                self._inbox.clear()
                aborts = list(self._aborts)
                self._aborts.clear()
            for seq in incoming:
                try:
                    sch.add(seq)
                except Exception as e:  # this request cannot run; the others are untouched
                    if not isinstance(e, WaferlineError):
                        log.warning("request %s could not be admitted", seq.request_id, exc_info=True)
                    seq.status = "finished"
                    msg = str(e) if isinstance(e, WaferlineError) else f"request failed: {type(e).__name__}: {e}"
                    seq.emit(Event(None, "", True, "error", len(seq.prompt_ids), 0, msg,
                                   invalid=isinstance(e, RequestError)))
            for rid in aborts:  # (an id not queued yet, still in the inbox of a later wakeup, or already done: no-op)
                if self.stepper is not None:
                    self.stepper.abort(rid)
                else:
                    sch.abort(rid)
            fault = sch.runner.fault()
            if fault is not None:
                self.last_error = fault
                log.error("the engine's runner failed: %s", fault)
                if not self._recover():
                    break
                continue
            if not self._has_work():
                continue
            try:
                if self.stepper is not None:
                    self.stepper.step()
                else:
                    sch.step()
            except Exception as e:  # a bug, an out-of-memory, a stage that died: fail everything, recover
                self.last_error = f"{type(e).__name__}: {e}"
                log.error("engine step failed: %s", self.last_error, exc_info=not isinstance(e, WaferlineError))
                if not self._recover():
                    break
        with self._lock:
            queued = list(self._inbox)
            self._inbox.clear()
        self._fail_everything(self.fatal or "server shutting down", queued)

    def _fail_everything(self, msg: str, queued: list[Sequence]) -> None:
        """End every request with the error ``msg``: the steps in flight dropped, the scheduler's requests failed, and
        ``queued`` (taken from the inbox) told it (an engine error: HTTP 503)."""
        if self.stepper is not None:
            self.stepper.drop()
        self.scheduler.fail_all(msg)
        for seq in queued:
            seq.emit(Event(None, "", True, "error", len(seq.prompt_ids), 0, msg, True))

    def _has_work(self) -> bool:
        return self.stepper.has_work() if self.stepper is not None else self.scheduler.has_work()

    def unavailable_reason(self) -> str:
        """Why the loop is not ``healthy`` (what /health and a refused request say)."""
        if self.fatal is not None:
            return f"the engine stopped after a fault it could not recover from: {self.fatal}"
        fault = self.scheduler.runner.fault()
        if self.recovering or fault is not None:
            return f"the engine is recovering from a fault ({fault or self.last_error}); retry shortly"
        return "the engine is not running"

    def _recover(self) -> bool:
        """After a failed step: end every request in flight or queued with the error, then let the runner recover.
        False when it cannot (``fatal`` set, ``on_fatal`` called) or the loop is stopping (a shutdown that closed the
        runner under a step: nothing to rebuild)."""
        sch = self.scheduler
        with self._lock:
            self.recovering = True
            queued = list(self._inbox)
            self._inbox.clear()
            stopping = self._stop
        self._fail_everything(f"engine error: {self.last_error}", queued)
        if sch.prefix is not None:
            sch.prefix.evict(float("inf"))
        if stopping:
            self.recovering = False
            return False
        try:
            sch.runner.recover()
        except Exception as e:
            self.fatal = f"{self.last_error}; recovery failed: {type(e).__name__}: {e}"
            log.error("the engine could not recover: %s", self.fatal)
            if self.on_fatal is not None:
                self.on_fatal(self.fatal)
            return False
        finally:
            self.recovering = False
        self.recoveries += 1
        return True
