"""Pipeline-parallel engine: stages as processes, activations streamed over torch.distributed, a decode ring of
micro-batches with token feedback from the last stage to the first, chunked pipelined prefill, and a watchdog.

The calling process is stage 0 and the scheduler (it embeds, runs its layers and owns the request table); stages
1..S-1 are worker processes (``waferline.engine.stage``). Every stage owns its layers, their weights and the
per-sequence caches of those layers; the last stage computes logits and samples with the single-process engine's
sampling code and per-row seeds, so outputs match ``LLM`` without stages.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
import threading
import time
import uuid
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from waferline import errors
from waferline.engine.sampling import SamplingParams
from waferline.engine.stage import (BEGIN, EMIT_LOGPROBS, EMIT_NONE, EMIT_TOKEN, EMIT_VERIFY, EXIT_ABORTED,
                                    EXIT_PEER_LOST, FEEDBACK, SHUTDOWN, STEP, Control, Group, Link, MicroBatch, PeerLost,
                                    StageRunner, check_mtp, decode_feedback, json_meta, make_group, serve, worker_main)
from waferline.errors import ConfigError, WaferlineError

DEFAULT_PREFILL_CHUNK = 256
DEFAULT_HANG_TIMEOUT_S = 8.0
WATCH_INTERVAL_S = 0.2
START_TIMEOUT_S = 120.0


class StageError(WaferlineError):
    """A pipeline stage died, hung or failed; the message names the stage. The pipeline is unusable afterwards."""


# ---------------------------------------------------------------- the stage split

def stage_ranges(num_layers: int, stages: int | None = None, layers_per_stage: int | None = None,
                 plan: Any = None) -> list[tuple[int, int]]:
    """Contiguous layer ranges [a, b) per stage: from a Plan, from K layers per stage, or S balanced stages."""
    given = sum(x is not None for x in (stages, layers_per_stage, plan))
    if given > 1:
        raise ConfigError("give only one of stages, layers_per_stage or plan")
    if plan is not None:
        if isinstance(plan, (str, Path)):
            from waferline.plan.plan import Plan

            plan = Plan.load(plan)
        out = []
        for st in plan.stages:
            if st.role != "full":
                raise ConfigError(f"plan stage {st.index} has role {st.role!r}; the pipeline engine runs 'full' stages "
                                  "only (attention/FFN disaggregation is a separate engine)")
            ls = sorted(st.layers)
            if not ls or ls != list(range(ls[0], ls[-1] + 1)):
                raise ConfigError(f"plan stage {st.index} holds layers {st.layers}: a stage needs a non-empty contiguous range")
            out.append((ls[0], ls[-1] + 1))
        if [a for a, _ in out] != [0] + [b for _, b in out[:-1]] or out[-1][1] != num_layers:
            raise ConfigError(f"plan stages {out} do not cover layers 0..{num_layers - 1} in order; re-plan for this model")
        return out
    if layers_per_stage is not None:
        if layers_per_stage < 1:
            raise ConfigError(f"layers_per_stage must be >= 1, got {layers_per_stage}")
        return [(a, min(a + layers_per_stage, num_layers)) for a in range(0, num_layers, layers_per_stage)]
    S = 1 if stages is None else int(stages)
    if S < 1:
        raise ConfigError(f"stages must be >= 1, got {S}")
    if S > num_layers:
        raise ConfigError(f"{S} stages for a model of {num_layers} layers: each stage needs at least one layer; "
                          f"use stages <= {num_layers} (or layers_per_stage=1)")
    base, extra = divmod(num_layers, S)
    out, a = [], 0
    for i in range(S):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def torchrun_rank() -> int:
    """This process's rank when launched by torchrun (env:// with WORLD_SIZE > 1), else 0."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ.get("RANK", "0"))
    return 0


# ---------------------------------------------------------------- request state on the scheduler (stage 0)

PREFILL, DECODE, DONE = 0, 1, 2


@dataclass
class _Seq:
    idx: int
    prompt: list[int]
    out: list[int] = field(default_factory=list)
    next_pos: int = 0  # prompt tokens already launched into the pipeline
    phase: int = PREFILL
    inflight: bool = False
    reason: str = "length"
    ttft: float = 0.0
    token_times: list[float] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # speculative: drafts for the next verify (MTP: from the last stage)
    verify_k: int = -1  # drafts in the verify now in flight (-1: none in flight)
    verify_T: int = 0  # that verify's T (the micro-batch's verify group width)


@dataclass
class _SpecRun:
    """Stage 0's per-run state of speculative decoding (see engine/speculative.py, "Under the pipeline")."""

    params: SamplingParams
    ctl: Any  # AdaptiveK, for every drafter (for MTP it picks each row's next K, drafted by the last stage)
    stats: Any  # SpecStats
    gens: list[torch.Generator | None]  # stage 0's drafting streams (a draft model sampling at T > 0)
    rewinds: list[tuple[int, int]] = field(default_factory=list)  # (slot, keep) not yet sent to the stages
    launched: dict[int, tuple] = field(default_factory=dict)  # verify-only mb -> (time, B, T, clean, stage-0 s)
    widths: dict[int, int] = field(default_factory=dict)  # mb in flight -> its verify width T (0: other work too)


class Pipeline:
    """S stages over ``torch.distributed`` point-to-point; this process is stage 0 and the scheduler.

    >>> with Pipeline("ckpt", stages=2, micro_batches=2) as pipe:
    ...     toks, reasons, metrics = pipe.run_generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8))
    """

    def __init__(self, path: str | Path, dtype: str | torch.dtype = "float32", *, stages: int | None = None,
                 layers_per_stage: int | None = None, micro_batches: int | None = None, plan: Any = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, threads_per_stage: int | None = None,
                 hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S, device: str = "cpu", start_method: str = "forkserver",
                 launch: str = "auto", load_kwargs: dict[str, Any] | None = None, speculative: str | None = None,
                 num_speculative_tokens: int = 4, speculative_adaptive: bool = True):
        from waferline.engine.llm import DTYPES
        from waferline.spec.model import ModelSpec

        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
            dtype = DTYPES[dtype]
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"model directory {self.path} does not exist")
        self.spec = ModelSpec.from_pretrained(self.path)
        self.ranges = stage_ranges(self.spec.num_layers, stages, layers_per_stage, plan)
        self.num_stages = S = len(self.ranges)
        if micro_batches is None and plan is not None and not isinstance(plan, (str, Path)):
            micro_batches = plan.micro_batches
        self.micro_batches = int(micro_batches) if micro_batches is not None else S
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = int(prefill_chunk)
        self.hang_timeout_s = float(hang_timeout_s)
        default_threads = torch.get_num_threads() if S == 1 else max(1, (os.cpu_count() or 1) // S)
        self.threads = int(threads_per_stage) if threads_per_stage else default_threads
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but CUDA is not available; use device='cpu'")
        self.dtype = dtype
        self._procs: list[Any] = []  # local worker processes (index r-1 for stage r)
        self._closed = False
        self._broken: StageError | None = None
        self._fault: str | None = None
        self._lock = threading.Lock()
        self._chain_sent = 0  # messages stage 0 put into the activation chain (every stage must process each)
        self._mb_ids = 0
        self._local_fb: deque[tuple[list[int], list[torch.Tensor]]] = deque()
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None
        if launch not in ("auto", "local", "env"):
            raise ConfigError(f"launch must be 'auto', 'local' (spawn stage processes here) or 'env' (torchrun), got {launch!r}")
        self._env = launch == "env" or (launch == "auto" and int(os.environ.get("WORLD_SIZE", "1")) > 1)
        load = {"path": str(self.path), "dtype": dtype, "extra": dict(load_kwargs or {})}
        self._setup_speculative(speculative, num_speculative_tokens, speculative_adaptive, load)
        self._finalizer = weakref.finalize(self, _reap, self._procs)
        try:
            self._start(load, start_method)
        except BaseException:
            self._kill_all()
            self._closed = True
            raise

    def _setup_speculative(self, method: str | None, k: int, adaptive: bool, load: dict[str, Any]) -> None:
        """Speculative decoding under the pipeline: n-gram / draft-model drafting here on stage 0, MTP drafting on the
        last stage (which then loads the embeddings and the MTP head too); the last stage verifies."""
        from waferline.engine.speculative import make_drafter, pipeline_method

        self.speculative = method
        self.spec_method = pipeline_method(method) if method else None
        self.drafter: Any = None
        self._sr: _SpecRun | None = None
        self._costs: Any = None  # AdaptiveK with the step costs measured so far (kept across runs)
        self._hop_s = 0.0  # measured: a step's round trip minus S x stage 0's compute (hops, last-stage extras)
        if not method:
            return
        if k < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {k}")
        windows = [w for w in (getattr(layer.mixer, "sliding_window", None) for layer in self.spec.layers) if w]
        if windows and k >= min(windows):
            k = min(windows) - 1  # a verify must not wrap a sliding-window ring onto itself
        self.k_max, self.spec_adaptive = k, adaptive
        L = max(self.spec.num_layers, 1)
        self.draft_cost = 0.0
        if self.spec_method == "mtp":
            if not self.spec.mtp_layers:
                raise ConfigError(f"speculative='mtp' needs a checkpoint with MTP weights (num_nextn_predict_layers >= 1); "
                                  f"{self.path} has none: use 'ngram' or 'draft:PATH' instead")
            load["mtp"] = True
            self.draft_cost = 1.0 / L
        else:
            self.drafter = make_drafter(method, _VocabOnly(self.spec), self.dtype)
            if self.spec_method == "draft":
                self.draft_cost = self.drafter.model.spec.num_layers / L

    # ------------------------------------------------------------ start-up
    def _start(self, load: dict[str, Any], start_method: str) -> None:
        from waferline.model.load import load_model

        S = self.num_stages
        if S > 1:
            if self._env:
                self._start_env(load)
            else:
                self._start_local(load, start_method)
            self._connect()
        from waferline.model.quant import loading_for, move_model

        a, b = self.ranges[0]
        with loading_for(self.device):
            model = load_model(self.path, self.dtype, range(a, b), has_embed=True, has_head=S == 1, **load["extra"])
        if S == 1 and load.get("mtp"):
            check_mtp(model, self.path)
        if self.device.type != "cpu":  # (int4 weights repacked for the device's kernel)
            move_model(model, self.device)
        self.runner = StageRunner(model, 0, S, self.device)
        if S > 1:
            self._wait_for("ready", "load its layers")
            self._watcher = threading.Thread(target=self._watch, daemon=True, name="waferline-pipeline-watchdog")
            self._watcher.start()

    def _start_local(self, load: dict[str, Any], start_method: str) -> None:
        import torch.multiprocessing as mp

        S = self.num_stages
        self.run_id = uuid.uuid4().hex[:12]
        self.store = dist.TCPStore("127.0.0.1", 0, S, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        load["store_addr"] = ("127.0.0.1", self.store.port)
        self.ctl = Control(self.store, self.run_id)
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(["waferline.engine.stage", "waferline.model.load"])
        for r in range(1, S):
            stage_load = dict(load, layer_range=self.ranges[r])
            p = ctx.Process(target=worker_main, args=(r, S, stage_load, self.run_id, self.threads, self.device.type, os.getpid()),
                            name=f"waferline-stage{r}", daemon=True)
            with _main_hidden():
                p.start()
            self._procs.append(p)
        self._wait_for("alive", "start")

    def _start_env(self, load: dict[str, Any]) -> None:
        store, rank, world = _rendezvous_env()
        if rank != 0:
            raise ConfigError(f"rank {rank}: under torchrun only rank 0 drives the pipeline; other ranks run "
                              "waferline.engine.pipeline.serve_from_env (the CLI does this for you)")
        if world != self.num_stages:
            raise ConfigError(f"torchrun started {world} processes but the pipeline has {self.num_stages} stages; "
                              f"launch with {self.num_stages} processes in total (nnodes x nproc-per-node)")
        self.store = store
        self.run_id = _env_run_id()
        load["store_addr"] = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        self.ctl = Control(store, self.run_id)
        self._store_addr = load["store_addr"]
        self._wait_for("alive", "start")

    def _connect(self) -> None:
        """Build stage 0's two process groups. Building blocks until every stage has joined, so it runs in a helper
        thread while this one keeps checking that the stages are alive (a stage dying now must not hang us)."""
        box: dict[str, Any] = {}

        def build() -> None:
            try:
                for name in ("act", "fb"):
                    box[name] = make_group(self.store, f"waferline/{self.run_id}/{name}", 0, self.num_stages, self.device,
                                           not self._env)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        self._connect_watching(build, box)
        self.act, self.fb = Link(box["act"], self.device), Link(box["fb"], self.device)

    # the names a fault message uses; AFD (engine/afd.py) overrides these three
    _error_cls = StageError
    _peers_name = "stages"
    _engine_name = "pipeline"

    def _rank_name(self, r: int) -> str:
        return f"stage {r} ({_layers(self.ranges[r])})"

    def _connect_watching(self, build: Any, box: dict[str, Any]) -> None:
        """Run ``build`` (which makes the process groups, storing them or an ``"error"`` in ``box``) in a thread while
        watching the other processes: one that fails or dies meanwhile raises instead of a hang."""
        t = threading.Thread(target=build, daemon=True, name="waferline-connect")
        t.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while t.is_alive():
            t.join(0.05)
            if t.is_alive():
                self._check_starting(f"connect to the other {self._peers_name}")
                if time.monotonic() > deadline:
                    raise self._error_cls(f"the {self._peers_name} did not connect within {START_TIMEOUT_S:.0f} s")
        if "error" in box:
            raise self._error_cls(f"{self._rank_name(0)} could not connect to the other {self._peers_name}: {box['error']}")

    def _check_starting(self, doing: str, pending: set[int] | None = None) -> None:
        """Raise if a worker stage reported an error or (local) exited while starting."""
        for r in range(1, self.num_stages):
            status = self.ctl.get("status", r)
            if status is not None:
                raise _status_error(self._rank_name(r), status, self._error_cls)
        for r, p in enumerate(self._procs, start=1):
            if (pending is None or r in pending) and p.exitcode is not None:
                raise self._error_cls(f"{self._rank_name(r)} exited with {_describe_exit(p.exitcode)} "
                                      f"before it could {doing}; see its output above")

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
    def _watch(self) -> None:
        """Every WATCH_INTERVAL_S: a dead stage, an error reported by a stage, or a stage that owes work and has not
        progressed for ``hang_timeout_s`` is a fault; the watchdog then stops every stage, which unblocks the driver."""
        if self._env:
            ctl = Control(dist.TCPStore(self._store_addr[0], self._store_addr[1], is_master=False,
                                        timeout=datetime.timedelta(seconds=30)), self.run_id)
        else:
            ctl = Control(dist.TCPStore("127.0.0.1", self.store.port, is_master=False,
                                        timeout=datetime.timedelta(seconds=30)), self.run_id)
        S = self.num_stages
        keys = [ctl.key("progress", r) for r in range(1, S)]
        last = {r: (0, time.monotonic()) for r in range(1, S)}
        while not self._stop_watch.wait(WATCH_INTERVAL_S):
            try:
                fault = self._diagnose(ctl)
                if fault is None and self.hang_timeout_s > 0:
                    now = time.monotonic()
                    prog = [int(v) for v in ctl.store.multi_get(keys)]
                    upstream = self._chain_sent
                    for r in range(1, S):
                        n = prog[r - 1]
                        if n != last[r][0] or upstream <= n:  # progressed, or owes nothing: restart its clock
                            last[r] = (n, now)
                        elif now - last[r][1] > self.hang_timeout_s:
                            fault = (f"stage {r} ({_layers(self.ranges[r])}) hung: it has work waiting and made no progress "
                                     f"for {now - last[r][1]:.1f} s (hang timeout {self.hang_timeout_s:g} s)")
                            break
                        upstream = n
            except Exception as e:  # the store itself went away
                if self._closed:
                    return
                fault = f"lost contact with the stages ({e})"
            if fault is not None and not self._closed:
                self._fault = fault
                self._kill_all()
                return

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
            detail = f": {status}" if status and p.exitcode not in (EXIT_PEER_LOST,) else ""
            return f"{self._rank_name(r)} (pid {p.pid}) died with {_describe_exit(p.exitcode)}{detail}"
        for r in range(1, self.num_stages):
            status = _safe_status(ctl, r)
            if status is not None and not status.startswith("lost a neighbour"):
                return f"{self._rank_name(r)} failed: {status}"
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
        deadline = time.monotonic() + 3.0
        while self._fault is None and time.monotonic() < deadline and self._watcher is not None and self._watcher.is_alive():
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

    # ------------------------------------------------------------ the chain
    def _send_chain(self, kind: int, meta: list[int], tensors: list[torch.Tensor] = ()) -> None:
        self.act.send(1, kind, meta, list(tensors))
        self._chain_sent += 1

    def _launch(self, mb: MicroBatch, tokens: list[torch.Tensor], extra: list[torch.Tensor] = ()) -> None:
        """Run stage 0's layers on ``mb`` and send it down the chain; ``extra`` (a draft model's probabilities) rides
        behind the hidden states to the last stage."""
        t = time.perf_counter()
        hs = self.runner.forward(mb, tokens)
        if self.num_stages == 1:
            raw = torch.cat([t.reshape(-1).view(torch.uint8) for t in extra]) if extra else None
            self._local_fb.append(self.runner.feedback(mb, hs, raw))
        sent = self._sr.launched.get(mb.mb_id) if self._sr is not None else None
        if sent is not None:  # a verify-only step: its cost ~ S x stage 0's compute + the measured hop overhead
            t_fwd = time.perf_counter() - t
            self._sr.launched[mb.mb_id] = sent[:3] + (sent[3], t_fwd)  # type: ignore[assignment]
            self._sr.ctl.record(sent[1], sent[2], self.num_stages * t_fwd + self._hop_s)
        if self.num_stages > 1:
            self._send_chain(STEP, mb.encode(), list(hs) + list(extra))

    def _next_feedback(self) -> tuple[int, dict[int, list[int]], dict[int, torch.Tensor], dict[int, list[int]]]:
        if self.num_stages == 1:
            meta, ts = self._local_fb.popleft()
            tail = ts[0].reshape(-1).view(torch.uint8) if ts else torch.empty(0, dtype=torch.uint8)
        else:
            kind, meta, tail = self.fb.recv(self.num_stages - 1)
            if kind != FEEDBACK:
                raise StageError(f"protocol error: expected feedback from stage {self.num_stages - 1}, got kind {kind}")
        return decode_feedback(meta, tail.cpu(), self.spec.vocab_size)

    def _begin(self, num_slots: int, params: SamplingParams) -> None:
        cfg: dict[str, Any] = {"num_slots": num_slots, "params": {"temperature": params.temperature, "top_p": params.top_p,
                                                                  "top_k": params.top_k, "seed": params.seed}}
        if self._sr is not None:
            cfg["spec"] = {"method": self.spec_method, "k_max": self.k_max, "adaptive": self.spec_adaptive,
                           "max_tokens": params.max_tokens}
            if self.drafter is not None:
                self.drafter.begin([[] for _ in range(num_slots)], [])
        self.runner.begin(cfg)
        if self.num_stages > 1:
            self._send_chain(BEGIN, json_meta(cfg))

    # ------------------------------------------------------------ scheduling
    def _schedule(self, seqs: list[_Seq], logprobs: bool) -> tuple[MicroBatch, list[torch.Tensor], list[torch.Tensor]] | None:
        """The next micro-batch: ready decode rows (capped so the ring keeps min(M, n) micro-batches busy: no
        collapse into one after a drain), then prefill chunks within the token budget. When speculating, the decode
        rows form one verify group ([last token] + drafts, padded to the longest) and the rows whose earlier verify
        came back ride along as rewinds."""
        rows: dict[int, tuple[Group, list[list[int]]]] = {}
        verify: tuple[Group, list[list[int]], list[torch.Tensor]] | None = None

        def add(s: _Seq, toks: list[int], start: int, emit: int) -> None:
            g, tl = rows.setdefault(len(toks), (Group(len(toks)), []))
            g.seqs.append(s.idx)
            g.slots.append(s.idx)
            g.starts.append(start)
            g.emits.append(emit)
            tl.append(toks)

        decoding = [s for s in seqs if s.phase == DECODE]
        n_dec = 0
        if decoding:
            cap = math.ceil(len(decoding) / min(self.micro_batches, len(decoding)))
            ready = [s for s in decoding if not s.inflight][:cap]
            if self._sr is not None and ready:
                verify = self._verify_group(ready)
                n_dec = verify[0].B * verify[0].T
            for s in ready:
                if verify is None:
                    add(s, [s.out[-1]], len(s.prompt) + len(s.out) - 1, EMIT_TOKEN)
                    n_dec += 1
                s.inflight = True
        budget = max(self.prefill_chunk - n_dec, 1)
        for s in seqs:
            if budget <= 0:
                break
            if s.phase != PREFILL or s.next_pos >= len(s.prompt):
                continue
            n = min(len(s.prompt) - s.next_pos, budget)
            last_chunk = s.next_pos + n == len(s.prompt)
            emit = EMIT_LOGPROBS if logprobs else (EMIT_TOKEN if last_chunk else EMIT_NONE)
            add(s, s.prompt[s.next_pos:s.next_pos + n], s.next_pos, emit)
            s.next_pos += n
            budget -= n
        if not rows and verify is None:
            return None
        self._mb_ids += 1
        groups = [rows[T][0] for T in sorted(rows)]
        toks = [torch.tensor(rows[T][1], dtype=torch.long) for T in sorted(rows)]
        if self.spec_method == "mtp" and self._sr is not None:  # the last stage keeps the token history MTP needs
            for g, T in zip(groups, sorted(rows)):
                g.tokens = [t for row in rows[T][1] for t in row]
                # after a prompt's first token, the last stage drafts K_max (the row's acceptance is not known yet)
                g.ks = [min(self.k_max, max(0, self._sr.params.max_tokens - 2)) for _ in g.seqs]
        extra: list[torch.Tensor] = []
        rewinds: list[tuple[int, int]] = []
        if verify is not None:
            groups.append(verify[0])
            toks.append(torch.tensor(verify[1], dtype=torch.long))
            extra = verify[2]
        if self._sr is not None:
            rewinds, self._sr.rewinds = self._sr.rewinds, []
            # a verify-only micro-batch's round trip is the step's cost — a clean measurement when the micro-batches
            # ahead of it (which it may wait behind at some stage) are steps of the same width
            T = verify[0].T if verify is not None and not rows else 0
            clean = T > 0 and all(w == T for w in self._sr.widths.values())
            self._sr.widths[self._mb_ids] = T
            if T:
                self._sr.launched[self._mb_ids] = (time.perf_counter(), verify[0].B, T, clean)
        return MicroBatch(self._mb_ids, groups, rewinds), toks, extra

    def _verify_group(self, ready: list[_Seq]) -> tuple[Group, list[list[int]], list[torch.Tensor]]:
        """Draft for the ready decode rows (n-gram / draft model here; MTP drafts came back with the feedback) and
        build their verify group: row b's input is [last token] + its drafts, padded to T = 1 + the longest draft."""
        sr = self._sr
        assert sr is not None
        params = sr.params
        idx = [s.idx for s in ready]
        room = [max(0, params.max_tokens - len(s.out) - 1) for s in ready]  # never draft past max_tokens
        probs: list[torch.Tensor | None] = [None] * len(ready)
        ks = sr.ctl.choose(idx)
        next_ks = None
        if self.spec_method == "mtp":  # drafted by the last stage after the previous verify; ks: after this one
            drafts = [s.drafts[:r] for s, r in zip(ready, room)]
            next_ks = [min(k, max(0, r - 1)) for k, r in zip(ks, room)]
        else:
            ks = [min(k, r) for k, r in zip(ks, room)]
            drafts = [[] for _ in ready]
            if max(ks) > 0:
                t = time.perf_counter()
                props = self.drafter.propose(idx, {s.idx: s.prompt + s.out for s in ready}, ks, params, sr.gens)
                sr.ctl.record_draft(len(idx), max(ks), time.perf_counter() - t)
                drafts = [p.tokens for p in props]
                probs = [p.probs for p in props]
        T = 1 + max(len(d) for d in drafts)
        g = Group(T, drafts=drafts, ks=next_ks)
        tl = []
        for s, d in zip(ready, drafts):
            g.seqs.append(s.idx)
            g.slots.append(s.idx)
            g.starts.append(len(s.prompt) + len(s.out) - 1)
            g.emits.append(EMIT_VERIFY)
            tl.append([s.out[-1]] + d + [0] * (T - 1 - len(d)))
            s.verify_k, s.verify_T, s.drafts = len(d), T, []
        extra: list[torch.Tensor] = []
        with_q = [p for p, d in zip(probs, drafts) if d]
        if with_q and all(p is not None for p in with_q):  # a draft model sampling: the verifier needs q
            g.has_q = True
            extra = [torch.cat([p.float().cpu() for p in with_q])]  # type: ignore[union-attr]
        sr.stats.steps += 1
        sr.stats.plain_steps += T == 1
        return g, tl, extra

    def _spec_feedback(self, seqs: list[_Seq], tokens: dict[int, list[int]], drafts: dict[int, list[int]]) -> None:
        """A verify came back: count it, let the drafter (and AdaptiveK) learn the accepted length, queue the rows'
        rollbacks for the stages, and keep MTP's next drafts."""
        sr = self._sr
        assert sr is not None
        for i, toks in tokens.items():
            s = seqs[i]
            s.drafts = drafts.get(i, [])
            if s.verify_k < 0:
                continue
            k, a = s.verify_k, len(toks) - 1
            sr.stats.row_steps += 1
            sr.stats.drafted += k
            sr.stats.accepted += a
            sr.stats.emitted += len(toks)
            sr.ctl.observe(i, k, a)
            if self.drafter is not None:
                self.drafter.accepted([i], None, [a], [k], None)
            if s.verify_T > 1:
                sr.rewinds.append((i, len(toks)))
            s.verify_k = -1

    def _run(self, seqs: list[_Seq], params: SamplingParams, logprobs: bool, on_tokens: Any) -> Iterator[list[tuple[int, int]]]:
        """Keep up to M micro-batches in flight until every sequence is done; yield the (row, token) events of
        each answer from the last stage."""
        self._begin(len(seqs), params)
        inflight: set[int] = set()
        try:
            yield from self._ring(seqs, logprobs, on_tokens, inflight)
        except GeneratorExit:  # the caller stopped reading a stream: collect what is in flight, stay usable
            while inflight:
                inflight.discard(self._next_feedback()[0])
            if self.num_stages > 1:
                self.act.flush()
            raise
        if self.num_stages > 1:
            self.act.flush()

    def _ring(self, seqs: list[_Seq], logprobs: bool, on_tokens: Any, inflight: set[int]) -> Iterator[list[tuple[int, int]]]:
        while True:
            while len(inflight) < self.micro_batches:
                nxt = self._schedule(seqs, logprobs)
                if nxt is None:
                    break
                mb, toks, extra = nxt
                self._launch(mb, toks, extra)
                inflight.add(mb.mb_id)
            if not inflight:
                break
            mb_id, tokens, lps, drafts = self._next_feedback()
            inflight.discard(mb_id)
            if self._sr is not None:
                self._sr.widths.pop(mb_id, None)
                sent = self._sr.launched.pop(mb_id, None)
                if sent is not None and sent[3] and self.num_stages > 1:  # clean: learn the hops' share of a step
                    extra_s = max(0.0, time.perf_counter() - sent[0] - self.num_stages * sent[4])
                    self._hop_s = 0.7 * self._hop_s + 0.3 * extra_s if self._hop_s else extra_s
                self._spec_feedback(seqs, tokens, drafts)
            now = time.perf_counter()
            for i, lp in lps.items():
                seqs[i].logprobs.append(lp.clone())
                if seqs[i].next_pos >= len(seqs[i].prompt) and sum(x.shape[0] for x in seqs[i].logprobs) == len(seqs[i].prompt):
                    seqs[i].phase = DONE
            events: list[tuple[int, int]] = []
            for i, toks in tokens.items():
                events += [(i, t) for t in on_tokens(seqs[i], toks, now)]
            if events:
                yield events

    # ------------------------------------------------------------ public API
    def _guarded(self, it: Iterator[Any]) -> Iterator[Any]:
        """Drive ``it`` (one _run) under the pipeline's lock; turn transport failures into a StageError naming the
        stage, and Ctrl-C into a clean shutdown of every stage."""
        if self._broken is not None:
            raise StageError(str(self._broken))
        if self._closed:
            raise StageError("this pipeline is closed; create a new LLM")
        with self._lock:
            if self._broken is not None:
                raise StageError(str(self._broken))
            old = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            try:
                yield from it
            except PeerLost as e:
                raise self._failed(e) from None
            except KeyboardInterrupt:
                self._broken = StageError("pipeline interrupted (Ctrl-C); every stage was stopped; create a new LLM")
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

    def run_generate(self, prompts: list[list[int]], params: SamplingParams, stop_ids: set[int] | None = None,
                     hit_stop: Any = None) -> tuple[list[list[int]], list[str], list[dict[str, float]]]:
        """Generate for token-id prompts: (tokens per prompt, finish reason per prompt, metrics per prompt)."""
        result: Any = None
        for ev in self.run_stream(prompts, params, stop_ids, hit_stop):
            if isinstance(ev, tuple) and len(ev) == 3:
                result = ev
        return result

    def run_stream(self, prompts: list[list[int]], params: SamplingParams, stop_ids: set[int] | None = None,
                   hit_stop: Any = None) -> Iterator[Any]:
        """Yield (row, token) as tokens arrive from the last stage, then (tokens, reasons, metrics)."""
        stop_ids = set(stop_ids or ())
        seqs = [_Seq(i, list(p)) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        if self.speculative:
            from waferline.engine.speculative import AdaptiveK, SpecStats, reproducible_k

            gens = []
            for i in range(len(prompts)):  # drafting streams of their own, apart from the last stage's verify streams
                g = None
                if params.temperature > 0:
                    g = torch.Generator()
                    g.manual_seed((int(params.seed) * 1_000_003 + i) ^ 0x5EED if params.seed is not None
                                  else int(torch.randint(0, 2**62, (1,))))
                gens.append(g)
            # MTP drafts inside the measured round trip (on the last stage): no separate drafting cost. The measured
            # step costs carry over from earlier runs; a seeded sampled run (which must repeat) uses the prior only
            draft_cost = 0.0 if self.spec_method == "mtp" else self.draft_cost
            if reproducible_k(params):
                ctl = AdaptiveK(self.k_max, self.spec_adaptive, 24.0, None, draft_cost)
            else:
                if self._costs is None:
                    self._costs = AdaptiveK(self.k_max, self.spec_adaptive, 24.0, None, draft_cost, measure=True,
                                            explore_run=self.micro_batches)
                ctl = self._costs
                ctl.alpha = {}
            self._sr = _SpecRun(params, ctl, SpecStats(), gens)

        def on_tokens(s: _Seq, toks: list[int], now: float) -> list[int]:
            if s.phase == PREFILL:
                s.phase, s.ttft = DECODE, now - t0
            s.inflight = False
            kept = []
            for tok in toks:  # a variable number of tokens per row (speculative decoding sends several)
                kept.append(tok)
                s.out.append(tok)
                s.token_times.append(now)
                if tok in stop_ids:
                    s.phase, s.reason = DONE, "stop"
                elif params.stop and hit_stop is not None and hit_stop(s.out, params.stop):
                    s.phase, s.reason = DONE, "stop"
                elif len(s.out) >= params.max_tokens:
                    s.phase = DONE
                if s.phase == DONE:
                    break
            return kept

        try:
            for events in self._guarded(self._run(seqs, params, False, on_tokens)):
                yield from events
        finally:
            sr, self._sr = self._sr, None
        total = time.perf_counter() - t0
        last_prefill = max((s.ttft for s in seqs), default=0.0) + t0
        late = sum(1 for s in seqs for t in s.token_times if t > last_prefill)
        window = t0 + total - last_prefill
        agg = late / window if late and window > 0 else 0.0
        metrics = []
        for s in seqs:
            span = s.token_times[-1] - s.token_times[0] if len(s.token_times) > 1 else 0.0
            metrics.append({"ttft_s": s.ttft, "total_s": total, "decode_tokens_per_s": agg,
                            "tokens_per_s_per_user": (len(s.out) - 1) / span if span > 0 else 0.0,
                            "stages": float(self.num_stages), "micro_batches": float(self.micro_batches),
                            **(sr.stats.metrics() if sr is not None else {})})
        if sr is not None:
            self.last_stats = sr.stats
        yield [s.out for s in seqs], [s.reason for s in seqs], metrics

    def prompt_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """log_softmax of the logits at every prompt position, [len, vocab] fp32 (prefill chunked and pipelined)."""
        seqs = [_Seq(0, list(token_ids))]
        for _ in self._guarded(self._run(seqs, SamplingParams(max_tokens=1), True, lambda *a: [])):
            pass
        return torch.cat(seqs[0].logprobs)

    def stream(self, llm: Any, ids: list[list[int]], params: SamplingParams) -> Iterator[Any]:
        """The LLM.stream contract for already-validated prompts: (row, token) events, then the list of Outputs."""
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(llm.eos_token_ids))
        final: Any = None
        for ev in self.run_stream(ids, params, stop_ids, lambda toks, stops: llm._hit_stop(toks, stops)):
            if len(ev) == 3:
                final = ev
            else:
                yield ev
        outs, reasons, metrics = final
        yield [llm.make_output(p, toks, reason, stop_ids, params, m) for p, toks, reason, m in zip(ids, outs, reasons, metrics)]

    # ------------------------------------------------------------ shutdown
    def _shutdown_now(self) -> None:
        self._closed = True
        self._stop_watch.set()
        self._kill_all()

    def _send_shutdown(self) -> None:
        """Ask the workers to exit (AFD overrides: a SHUTDOWN to every rank)."""
        self.act.send(1, SHUTDOWN, [])  # it travels the chain
        self.act.flush()

    def close(self) -> None:
        """Stop every worker: SHUTDOWN (``_send_shutdown``); workers that do not exit within 5 s are killed."""
        if self._closed:
            return
        idle = self._lock.acquire(timeout=2.0)  # a call still running in another thread: no graceful shutdown
        try:
            self._closed = True
            self._stop_watch.set()
            if idle and self.num_stages > 1 and self._broken is None:
                try:
                    self._send_shutdown()
                except Exception:
                    pass
                for p in self._procs:
                    p.join(timeout=5)
            self._kill_all()
            self._finalizer.detach()
        finally:
            if idle:
                self._lock.release()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """Process ids of the worker stages 1..S-1 (stage 0 is this process)."""
        return [p.pid for p in self._procs]


# ---------------------------------------------------------------- helpers

class _VocabOnly:
    """What make_drafter needs of the target for n-gram / draft-model drafters: its ModelSpec (vocab size)."""

    def __init__(self, spec: Any):
        self.spec = spec


@contextlib.contextmanager
def _main_hidden() -> Any:
    """Start a worker without re-running the caller's ``__main__`` in it.

    multiprocessing's spawn/forkserver children re-import the parent's main script (so scripts need an
    ``if __name__ == "__main__"`` guard). A stage needs nothing from ``__main__`` (its target and arguments live in
    waferline), so the main module's file/spec are hidden while the child's preparation data is taken.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _reap(procs: list[Any]) -> None:
    """Finalizer: never leave stage processes behind."""
    for p in procs:
        try:
            if p.exitcode is None:
                p.kill()
                p.join(timeout=2)
        except Exception:
            pass


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
    return fallback(f"{who} failed: {status}")


def _env_run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "env") + "-" + os.environ.get("MASTER_PORT", "0")


def _rendezvous_env() -> tuple[Any, int, int]:
    """(store, rank, world size) from torchrun's env:// variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:
        raise ConfigError(f"env:// launch needs {', '.join(missing)} in the environment (start the command with torchrun)")
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=300)))
    return store, rank, world


def serve_from_env(path: str | Path, dtype: str = "float32", *, stages: int | None = None,
                   layers_per_stage: int | None = None, plan: Any = None, device: str = "cpu",
                   threads_per_stage: int | None = None, load_kwargs: dict[str, Any] | None = None,
                   speculative: str | None = None) -> int:
    """Run this torchrun rank (>= 1) as a worker stage until the driver (rank 0) shuts the pipeline down.
    ``speculative``: the driver's method ('mtp' makes the last stage load the embeddings and the MTP head)."""
    from waferline.engine.speculative import pipeline_method

    from waferline.engine.llm import DTYPES
    from waferline.spec.model import ModelSpec

    spec = ModelSpec.from_pretrained(Path(path))
    ranges = stage_ranges(spec.num_layers, stages, layers_per_stage, plan)
    store, rank, world = _rendezvous_env()
    if world != len(ranges):
        raise ConfigError(f"torchrun started {world} processes but the pipeline has {len(ranges)} stages")
    if threads_per_stage:
        torch.set_num_threads(threads_per_stage)
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    load = {"path": str(path), "dtype": DTYPES[dtype] if isinstance(dtype, str) else dtype, "layer_range": ranges[rank],
            "extra": dict(load_kwargs or {}), "store_addr": (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
            "mtp": bool(speculative) and pipeline_method(speculative) == "mtp"}
    return serve(store, _env_run_id(), rank, len(ranges), load, dev, local=False)
