"""Supervising the pipeline's worker processes: start-up checks, the watchdog, naming the stage at fault, the guard
around each run, and shutdown. ``Supervision`` is a part of ``Pipeline`` (driver.py), which AFD specialises."""

from __future__ import annotations

import datetime
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from waferline import errors
from waferline.engine.pipeline.launch import _reap
from waferline.engine.stage import EXIT_ABORTED, EXIT_PEER_LOST, LOOPBACK, SHUTDOWN, Control, PeerLost, first_line
from waferline.errors import WaferlineError

WATCH_INTERVAL_S = 0.2
START_TIMEOUT_S = 120.0
START_SETTLE_S = 0.3  # a start-up error: the wait for a worker's exit that may be its cause to be seen
BEAT_LOST_S = 1.0  # env://: once a link broke, a stage silent this long (no heartbeat, no status) is the one that died

_started: weakref.WeakSet[Any] = weakref.WeakSet()  # the drivers whose workers this process started
_inherited: list[Any] = []  # (a forked child) the drivers it inherited, held for as long as it lives


def _hold_inherited() -> None:
    """In a forked child: hold every driver it inherited. Their process groups are the parent's (gloo's threads did
    not come with the fork): freeing one here crashes the child, and its finalizer must not stop the parent's
    workers."""
    _inherited.extend(_started)
    _started.clear()


os.register_at_fork(after_in_child=_hold_inherited)


def _watchdog(ref: weakref.ref[Any], stop: threading.Event) -> None:
    """The watchdog thread's loop over a weakly held driver (``Supervision._start_watchdog``)."""
    sup = ref()
    if sup is None:
        return
    state = sup._watch_setup()
    del sup
    while not stop.wait(WATCH_INTERVAL_S):
        sup = ref()
        if sup is None or not sup._watch_tick(state):
            return
        del sup


class StageError(WaferlineError):
    """A pipeline stage died, hung or failed; the message names the stage. The pipeline is unusable afterwards."""


class Supervision:
    """The driver's hold on its worker processes (a part of ``Pipeline``; it uses the attributes Pipeline.__init__
    sets: ``ctl``, ``store``, ``run_id``, ``_procs``, ``_env``, ``ranges``, ``_broken``, ``_fault``, ``_lock``...)."""

    # the names a fault message uses; AFD (engine/afd/driver.py) overrides these three
    _error_cls = StageError
    _peers_name = "stages"
    _engine_name = "pipeline"
    _link_lost = False  # a link to a stage broke (``_failed``): a stage without a heartbeat is named sooner

    def _rank_name(self, r: int) -> str:
        return f"stage {r} ({_layers(self.ranges[r])})"

    def _started_here(self) -> None:
        """Before the workers start: they are this process's; collecting the driver here stops them (``_reap``)."""
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _reap, self._procs, self._pid)
        _started.add(self)

    def _check_process(self) -> None:
        """Refuse to drive the workers from a forked child: their messages would go to (and come from) the parent's
        transport."""
        if os.getpid() != self._pid:
            raise self._error_cls(f"this {self._engine_name}'s {self._peers_name} were started by process {self._pid}; "
                                  "a forked process cannot use them: create a new LLM in this process")

    def _connect_watching(self, build: Any, box: dict[str, Any]) -> None:
        """Run ``build`` (which makes the process groups, storing them or an ``"error"`` in ``box``) in a thread while
        watching the other processes: one that fails or dies meanwhile raises instead of a hang."""
        # (checked through a store connection of its own: a store client runs one request at a time, and the groups'
        # rendezvous holds the driver's while it waits for the address of a process that may have died)
        ctl = Control(self._store_client(), self.run_id)
        t = threading.Thread(target=build, daemon=True, name="waferline-connect")
        t.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while t.is_alive():
            t.join(0.05)
            if t.is_alive():
                self._check_starting(f"connect to the other {self._peers_name}", ctl=ctl)
                if time.monotonic() > deadline:
                    raise self._error_cls(f"the {self._peers_name} did not connect within {START_TIMEOUT_S:.0f} s")
        if "error" in box:  # (a worker that died while the processes connected refuses the connection: it is named)
            time.sleep(START_SETTLE_S)
            self._check_starting(f"connect to the other {self._peers_name}", ctl=ctl)
            raise self._error_cls(
                f"{self._rank_name(0)} could not connect to the other {self._peers_name}: {box['error']}"
            )

    def _check_starting(self, doing: str, pending: set[int] | None = None, ctl: Control | None = None) -> None:
        """Raise if a worker stage reported an error or (local) exited while starting (``ctl``: the store connection
        to read the errors through, default the driver's). A worker that exited without saying why is named before
        those that report an error: while the processes connect, the others fail to connect to the one that died."""
        ctl = ctl or self.ctl
        failed = {r: status for r in range(1, self.num_stages) if (status := ctl.get("status", r)) is not None}

        def silent() -> list[tuple[int, Any]]:
            return [(r, p) for r, p in enumerate(self._procs, start=1)
                    if (pending is None or r in pending) and p.exitcode is not None and r not in failed]

        if failed and self._procs and not silent():
            time.sleep(START_SETTLE_S)  # (the exit of the worker that caused the others' errors is seen a moment late)
        for r, p in silent():
            status = ctl.get("status", r)  # (it may have said why since)
            if status is not None:
                raise _status_error(self._rank_name(r), status, self._error_cls)
            raise self._error_cls(f"{self._rank_name(r)} exited with {_describe_exit(p.exitcode)} "
                                  f"before it could {doing}; see its output above")
        for r, status in failed.items():
            raise _status_error(self._rank_name(r), status, self._error_cls)

    def _wait_for(self, what: str, doing: str) -> None:
        """Wait until every worker stage has set key ``what``; a stage that fails or dies meanwhile raises."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = set(range(1, self.num_stages))
        while pending:
            for r in sorted(pending):
                if self.ctl.get(what, r) is not None:
                    pending.discard(r)
            self._check_starting(doing, pending)
            if pending and time.monotonic() > deadline:
                raise self._error_cls(f"{', '.join(self._rank_name(r) for r in sorted(pending))} did not {doing} "
                                      f"within {START_TIMEOUT_S:.0f} s")
            if pending:
                time.sleep(0.02)

    # ------------------------------------------------------------ watchdog
    def _start_watchdog(self, name: str) -> None:
        """The watchdog thread (``_watch_setup`` once, then ``_watch_tick`` every WATCH_INTERVAL_S until it says stop).
        It holds the driver weakly: a dropped LLM's pipeline is collected, and its finalizer stops the workers."""
        self._watcher = threading.Thread(target=_watchdog, args=(weakref.ref(self), self._stop_watch), daemon=True,
                                         name=name)
        self._watcher.start()

    def _store_client(self) -> Any:
        """A connection of its own to the rendezvous store."""
        host, port = self._store_addr if self._env else (LOOPBACK, self.store.port)
        return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))

    def _watch_setup(self) -> Any:
        ctl = Control(self._store_client(), self.run_id)
        S, now = self.num_stages, time.monotonic()
        keys = [ctl.key("progress", r) for r in range(1, S)]
        if self._env:  # (and every stage's heartbeat: rank 0 cannot see the exit of a process on another host)
            keys += [ctl.key("beat", r) for r in range(1, S)]
        return ctl, keys, {r: (0, now) for r in range(1, S)}, {r: (-1, now) for r in range(1, S)}

    def _watch_tick(self, state: Any) -> bool:
        """A dead stage, an error reported by a stage, a stage that owes work and has not progressed for
        ``hang_timeout_s``, or (env://) one silent for as long (``_silent``) is a fault: every stage is stopped, which
        unblocks the driver. False: the watch is over."""
        ctl, keys, last, beats = state
        S = self.num_stages
        try:
            fault = self._diagnose(ctl)
            if fault is None and self.hang_timeout_s > 0:
                now = time.monotonic()
                prog = [int(v) for v in ctl.store.multi_get(keys)]
                if self._env:  # each stage's heartbeat: when it last changed
                    for r in range(1, S):
                        if prog[S - 2 + r] != beats[r][0]:
                            beats[r] = (prog[S - 2 + r], now)
                    limit = BEAT_LOST_S if self._link_lost else self.hang_timeout_s
                    fault = next((f for r in range(1, S) if (f := self._silent(ctl, beats, r, limit, now))), None)
                upstream = self._chain_sent
                for r in range(1, S):
                    n = prog[r - 1]
                    if n != last[r][0] or upstream <= n:  # progressed, or owes nothing: restart its clock
                        last[r] = (n, now)
                    elif now - last[r][1] > self.hang_timeout_s and fault is None:
                        # (env://: where its heartbeat, or an upstream stage's, stopped too, that one was killed or
                        # stopped: a stage it fed last before it died waits for more)
                        silent = (self._silent(ctl, beats, q, BEAT_LOST_S, now) for q in range(1, r + 1))
                        fault = (next((f for f in silent if f), None) if self._env else None) or (
                            f"stage {r} ({_layers(self.ranges[r])}) hung: it has work waiting and made no progress "
                            f"for {now - last[r][1]:.1f} s (hang timeout {self.hang_timeout_s:g} s)"
                        )
                        break
                    upstream = n
        except Exception as e:  # the store itself went away
            if self._closed:
                return False
            fault = f"lost contact with the stages ({e})"
        return self._watch_fault(fault)

    def _silent(self, ctl: Control, beats: dict[int, tuple[int, float]], r: int, limit: float, now: float
                ) -> str | None:
        """env://: stage ``r`` as a fault if its heartbeat stopped more than ``limit`` s ago and it set no status
        (killed outright, or stopped: rank 0 cannot see the exit of a process on another host). The limit is the hang
        timeout, or BEAT_LOST_S once a link broke (a stage that only lost its neighbour says so first)."""
        quiet = now - beats[r][1]
        if quiet > limit and _safe_status(ctl, r) is None and ctl.get("stopped", r) is None:
            return (f"{self._rank_name(r)} stopped answering: no heartbeat for {quiet:.1f} s (its process died or "
                    "was stopped)")
        return None

    def _watch_fault(self, fault: str | None) -> bool:
        if fault is not None and not self._closed:
            self._fault = fault
            self._kill_all()
            return False
        return True

    def _diagnose(self, ctl: Control) -> str | None:
        """Name the stage that failed first, if any (a stage that only lost its neighbour is not the cause)."""
        if not self._env:
            dead = [(r, p) for r, p in enumerate(self._procs, start=1) if p.exitcode is not None]
            if not dead:
                return None
            time.sleep(0.3)  # let the cause's exit be reaped too before choosing
            dead = [(r, p) for r, p in enumerate(self._procs, start=1) if p.exitcode is not None]
            cause = [(r, p) for r, p in dead if p.exitcode not in (EXIT_PEER_LOST, EXIT_ABORTED)] or dead
            r, p = cause[0]
            status = _safe_status(ctl, r)
            detail = f": {first_line(status)}" if status and p.exitcode not in (EXIT_PEER_LOST,) else ""
            return f"{self._rank_name(r)} (pid {p.pid}) died with {_describe_exit(p.exitcode)}{detail}"
        for r in range(1, self.num_stages):
            status = _safe_status(ctl, r)
            if status is not None and not status.startswith("lost a neighbour"):
                return f"{self._rank_name(r)} failed: {first_line(status)}"
        return None

    def _kill_all(self) -> None:
        """Stop every worker stage now (local: SIGKILL; torchrun: an abort key their publisher threads obey)."""
        for p in self._procs:
            if p.exitcode is None:
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        if self._env and self.num_stages > 1:
            try:
                self.ctl.set("abort", None, "1")
            except Exception:
                pass

    def _failed(self, err: BaseException) -> StageError:
        """Turn a transport failure in the driver into a StageError naming the stage (asks the watchdog first)."""
        self._link_lost = True
        deadline = time.monotonic() + 3.0
        while (
            self._fault is None
            and time.monotonic() < deadline
            and self._watcher is not None
            and self._watcher.is_alive()
        ):
            time.sleep(0.05)
        reason = self._fault
        if reason is None:
            try:
                reason = self._diagnose(self.ctl)
            except Exception:
                reason = None
        one = self._peers_name[:-1]
        reason = reason or f"a {one} stopped answering ({str(err).splitlines()[0][:200]})"
        self._broken = self._error_cls(f"{self._engine_name} failed: {reason}. Every {one} was stopped; create a new "
                                       "LLM to continue.")
        self._shutdown_now()
        return self._broken

    # ------------------------------------------------------------ guarding a run
    def _guarded(self, it: Iterator[Any]) -> Iterator[Any]:
        """Drive ``it`` (one _run) under the pipeline's lock; turn transport failures into a StageError naming the
        stage, and Ctrl-C into a clean shutdown of every stage."""
        self._check_process()
        if self._broken is not None:
            raise StageError(str(self._broken))
        if self._closed:
            raise StageError("this pipeline is closed; create a new LLM")
        with self._lock:
            if self._broken is not None:
                raise StageError(str(self._broken))
            if self._closed:  # (closed while this call waited for the lock: its transport is let go)
                raise StageError("this pipeline is closed; create a new LLM")
            old = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            try:
                yield from it
            except PeerLost as e:
                raise self._failed(e) from None
            except KeyboardInterrupt:
                self._broken = self._error_cls(f"{self._engine_name} interrupted (Ctrl-C); every "
                                               f"{self._peers_name[:-1]} was stopped; create a new LLM")
                self._shutdown_now()
                raise
            except StageError as e:
                self._broken = e
                self._shutdown_now()
                raise
            except GeneratorExit:
                raise
            except BaseException as e:  # an error in stage 0 itself: micro-batches may be in flight, so stop
                self._broken = StageError(f"pipeline stopped after an error in stage 0 ({type(e).__name__}: {e}); "
                                          "create a new LLM")
                self._shutdown_now()
                raise
            finally:
                torch.set_num_threads(old)

    # ------------------------------------------------------------ shutdown
    def _wait_stopped(self, timeout: float) -> None:
        """Under torchrun: wait until every worker has taken the SHUTDOWN (its ``stopped`` key), at most ``timeout``."""
        deadline = time.monotonic() + timeout
        pending = set(range(1, self.num_stages))
        while pending and time.monotonic() < deadline:
            try:
                pending = {r for r in pending if self.ctl.get("stopped", r) is None}
            except Exception:
                return
            if pending:
                time.sleep(0.02)

    def _shutdown_now(self) -> None:
        self._closed = True
        self._stop_watch.set()
        self._kill_all()

    def _send_shutdown(self) -> None:
        """Ask the workers to exit (AFD overrides: a SHUTDOWN to every rank)."""
        self.act.send(1, SHUTDOWN, [])  # it travels the chain
        self.act.flush()

    def close(self) -> None:
        """Stop every worker: SHUTDOWN (``_send_shutdown``); workers that do not exit within 5 s are killed. Then let
        go of the transport (``_release``). In a forked child it only marks the driver closed: the workers and the
        transport are the parent's."""
        if os.getpid() != self._pid:
            self._closed = True
            return
        if self._closed:
            if self._lock.acquire(blocking=False):  # (stopped by a fault: the transport is still held)
                try:
                    self._release()
                finally:
                    self._lock.release()
            return
        idle = self._lock.acquire(timeout=2.0)  # a call still running in another thread: no graceful shutdown
        try:
            self._closed = True
            self._stop_watch.set()
            # (a fault the watchdog saw while idle: every stage was stopped, none would take a SHUTDOWN)
            if idle and self.num_stages > 1 and self._broken is None and self._fault is None:
                try:
                    self._send_shutdown()
                except Exception:
                    pass
                for p in self._procs:
                    p.join(timeout=5)
                if self._env:  # torchrun: no process to join; each worker says it stopped (else the abort key
                    self._wait_stopped(5.0)  # below would end a worker the SHUTDOWN has not reached yet: exit 5)
            self._kill_all()
            self._finalizer.detach()
            if idle:
                self._release()
        finally:
            if idle:
                self._lock.release()

    def _release(self) -> None:
        """Drop the process groups (their threads and sockets) and the store (its listening port), which a closed
        pipeline otherwise held for as long as it was referenced. The fault kept (``_broken``) lets go of its traceback:
        its frames hold this pipeline and the transport's pending work (a cycle only a full collection would free)."""
        for name in ("act", "fb", "link"):
            link = getattr(self, name, None)
            if link is not None:
                link.close()
        self.ctl = self.store = None
        err, seen = self._broken, set()
        while err is not None and id(err) not in seen:
            seen.add(id(err))
            err.__traceback__ = None
            err = err.__cause__ or err.__context__


# ---------------------------------------------------------------- helpers

def _layers(rng: tuple[int, int]) -> str:
    a, b = rng
    return f"layer {a}" if b - a == 1 else f"layers {a}-{b - 1}"


def _describe_exit(code: int | None) -> str:
    import signal

    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return {EXIT_PEER_LOST: "exit code 4 (lost a neighbouring stage)", EXIT_ABORTED: "exit code 5 (aborted)"}.get(
        code, f"exit code {code}")


def _safe_status(ctl: Control, r: int) -> str | None:
    try:
        return ctl.get("status", r)
    except Exception:
        return None


def _status_error(who: str, status: str, fallback: type[WaferlineError] = StageError) -> WaferlineError:
    """Re-raise a worker's load error with its own class when it is a WaferlineError (e.g. CheckpointError)."""
    name, _, msg = status.partition(": ")
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, WaferlineError):
        return cls(f"{who}: {msg}")
    return fallback(f"{who} failed: {first_line(status)}")


