"""AFD's driver, ``AFD``: this process is attention rank 0 and the scheduler; a ``Pipeline`` whose workers are the
other attention ranks and the FFN ranks (start-up, watchdog, scheduling per attention rank, time split)."""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
import uuid
from collections.abc import Container, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from waferline import kernels
from waferline.engine.afd.layout import DEFAULT_MICRO_BATCHES, STATS, AFDError, make_layout, plan_ranks
from waferline.engine.afd.link import AFLink, Clock
from waferline.engine.afd.ranks import AttentionRunner, encode_step, worker_main
from waferline.engine.afd.sides import _check_checkpoint, load_attention_side
from waferline.engine.pipeline.driver import (
    DEFAULT_HANG_TIMEOUT_S,
    DEFAULT_PREFILL_CHUNK,
    Pipeline,
    checked_hang_timeout,
    checked_threads,
)
from waferline.engine.pipeline.launch import _main_hidden, _start_forkserver
from waferline.engine.pipeline.supervise import StageError
from waferline.engine.sampling import SamplingParams, resolve_dtype
from waferline.engine.stage import (
    BEGIN,
    FEEDBACK,
    LOOPBACK,
    RESET,
    SHUTDOWN,
    STEP,
    Control,
    Group,
    MicroBatch,
    json_meta,
    loopback_store,
    make_group,
)
from waferline.errors import ConfigError
from waferline.model.block_table import local_page
from waferline.model.quant import convert_loaded, quant_method
from waferline.spec.configs import spec_from_pretrained

if TYPE_CHECKING:
    from waferline.plan.plan import Plan


def _proc_state(pid: int) -> str:
    """The one-letter state of a local process (R, S, T for stopped, Z, ...); '' when unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


# ---------------------------------------------------------------- the driver (attention rank 0 + scheduler)

class AFD(Pipeline):
    """Attention/FFN disaggregation over M attention ranks and N FFN ranks; this process is attention rank 0 and
    the scheduler's. ``LLM(path, afd=True, attention_ranks=M, ffn_ranks=N)`` makes one and runs its requests through
    the scheduler (``serving.AFDRunner``)."""

    def __init__(self, path: str | Path, dtype: str | torch.dtype = "float32", *, attention_ranks: int | None = None,
                 ffn_ranks: int | None = None, micro_batches: int | None = None, plan: Plan | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, threads_per_rank: int | None = None,
                 threads_per_stage: int | None = None, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
                 device: str = "cpu", start_method: str = "forkserver", convert: dict[str, int] | None = None):

        dtype = resolve_dtype(dtype)
        self.convert = dict(convert or {})  # (weight_bits / group_size / head_bits: each rank converts its part)
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"model directory {self.path} does not exist")
        _check_checkpoint(self.path, device)
        self.spec = spec_from_pretrained(self.path)
        if plan is not None:
            if attention_ranks is not None or ffn_ranks is not None:
                raise ConfigError("give a plan or attention_ranks/ffn_ranks, not both")
            if isinstance(plan, (str, Path)):
                from waferline.plan.plan import Plan

                plan = Plan.load(plan)
            plan.check_model(self.spec, self.path)  # (a plan of another model: said so, not how its ranks differ)
            attention_ranks, ffn_ranks, plan_mb = plan_ranks(plan, self.spec)
            micro_batches = micro_batches if micro_batches is not None else plan_mb
        self.layout = make_layout(self.spec, 1 if attention_ranks is None else attention_ranks,
                                  1 if ffn_ranks is None else ffn_ranks)
        self.M, self.N = self.layout.attention_ranks, self.layout.ffn_ranks
        self.num_stages = self.layout.world  # processes (the Pipeline base reports it as "stages")
        self.micro_batches = int(micro_batches) if micro_batches is not None else DEFAULT_MICRO_BATCHES
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = int(prefill_chunk)
        self.hang_timeout_s = checked_hang_timeout(hang_timeout_s)
        threads = checked_threads(threads_per_rank, "threads_per_rank") or checked_threads(threads_per_stage)
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.layout.world)
        self.device = torch.device("cpu")
        self.dtype = dtype
        self.ranges = [(0, self.spec.num_layers)]
        self._procs: list[Any] = []
        self._closed = False
        self._broken: StageError | None = None
        self._fault: str | None = None
        self._lock = threading.Lock()
        self._env = False
        self._busy_since: float | None = None
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None
        self._started_here()
        try:
            self._start_afd(start_method)
        except BaseException:
            self._kill_all()
            self._closed = True
            raise

    # ------------------------------------------------------------ start-up
    def _start_afd(self, start_method: str) -> None:
        import torch.multiprocessing as mp

        W = self.layout.world
        # built (first run) or loaded once, here: not by a rank inside its first step, where the hang timeout stops it,
        # nor by each rank after a failure
        kernels_on = kernels.prepare()
        self.run_id = uuid.uuid4().hex[:12]
        self.store = loopback_store(W, datetime.timedelta(seconds=60))
        self.ctl = Control(self.store, self.run_id)
        load = {"path": str(self.path), "dtype": self.dtype, "layout": self.layout, "hidden": self.spec.hidden_size,
                "store_addr": (LOOPBACK, self.store.port), "kernels": kernels_on, "convert": self.convert,
                "int4": quant_method(self.spec.hf_config) is not None}  # (an int4 checkpoint: its own codes)
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            _start_forkserver(ctx, ["waferline.engine.afd", "waferline.model.load"])
        for r in range(1, W):
            p = ctx.Process(target=worker_main, args=(r, load, self.run_id, self.threads, os.getpid()),
                            name=f"waferline-afd{r}", daemon=True)
            with _main_hidden():
                p.start()
            self._procs.append(p)
        self._wait_for("alive", "start")
        self._connect_afd()
        model, fronts = load_attention_side(self.path, self.dtype)
        convert_loaded(model, **self.convert)
        self.runner = AttentionRunner(model, fronts, self.layout, self.link)
        self._wait_for("ready", "load its part of the model")
        self._start_watchdog("waferline-afd-watchdog")

    def _connect_afd(self) -> None:
        box: dict[str, Any] = {}

        def build() -> None:
            try:
                box["pg"] = make_group(self.store, f"waferline/{self.run_id}/afd", 0, self.layout.world,
                                       torch.device("cpu"), True)
            except BaseException as e:  # noqa: BLE001 - re-raised by _connect_watching
                box["error"] = e

        self._connect_watching(build, box)
        self.link = AFLink(box["pg"], Clock())

    # fault messages name ranks the AFD way (the Pipeline's start-up checks and diagnosis use these)
    _error_cls = AFDError
    _peers_name = "ranks"
    _engine_name = "AFD"

    def _rank_name(self, r: int) -> str:
        return self.layout.describe(r)

    # ------------------------------------------------------------ watchdog
    def _watch_setup(self) -> Any:
        ctl = Control(dist.TCPStore(LOOPBACK, self.store.port, is_master=False, timeout=datetime.timedelta(seconds=30)),
                      self.run_id)
        W = self.layout.world
        return ctl, [ctl.key("progress", r) for r in range(1, W)], {r: (-1, time.monotonic()) for r in range(1, W)}

    def _watch_tick(self, state: Any) -> bool:
        """A dead rank or one that reported an error is a fault; so is a step during which no rank progressed for
        ``hang_timeout_s``. On a fault every rank is stopped, which unblocks the driver. False: the watch is over."""
        ctl, keys, last = state
        W = self.layout.world
        try:
            fault = self._diagnose(ctl)
            if fault is None and self.hang_timeout_s > 0:
                now = time.monotonic()
                prog = [int(v) for v in ctl.store.multi_get(keys)]
                for r in range(1, W):
                    if prog[r - 1] != last[r][0]:
                        last[r] = (prog[r - 1], now)
                busy = self._busy_since
                if busy is not None and now - busy > self.hang_timeout_s:
                    stalled = [r for r in range(1, W) if now - last[r][1] > self.hang_timeout_s]
                    if len(stalled) == W - 1:
                        # a stopped process is the cause; otherwise blame the rank that stalled first
                        stopped = [q for q in stalled if _proc_state(self._procs[q - 1].pid) in ("T", "t")]
                        r = stopped[0] if stopped else min(stalled, key=lambda q: last[q][1])
                        why = "is stopped (state T)" if stopped else "stalled first"
                        # (since the step began, or the rank's last progress in it: not the idle time before it)
                        fault = (f"{self.layout.describe(r)} hung: no rank made progress for "
                                 f"{now - max(last[r][1], busy):.1f} s of a step (hang timeout "
                                 f"{self.hang_timeout_s:g} s); "
                                 f"{self.layout.describe(r)} {why}")
        except Exception as e:  # the store itself went away
            if self._closed:
                return False
            fault = f"lost contact with the AFD ranks ({e})"
        return self._watch_fault(fault)

    def _guarded(self, it: Iterator[Any]) -> Iterator[Any]:
        """The Pipeline's guard (lock, fault naming, Ctrl-C shutdown), raising AFDError for every rank failure."""
        try:
            yield from super()._guarded(it)
        except StageError as e:
            if isinstance(e, AFDError):
                raise
            raise AFDError(str(e)) from None

    # ------------------------------------------------------------ scheduling
    def _rank_of(self, i: int) -> int:
        return i % self.M

    def _micro_batches(
        self, rows: list[tuple[int, list[int], int, int]], verify: Container[int] = ()
    ) -> tuple[list[MicroBatch], list[list[torch.Tensor]]]:
        """K micro-batches balanced by tokens (largest rows first), each split into groups of equal T. A row is
        (global row, tokens, start, emit); row i lives in slot i // M of attention rank i % M. The rows in ``verify``
        go in verify groups (a row's tokens are its last token, then its drafts), the others in plain ones."""
        K = self.micro_batches
        bins: list[list[tuple[int, list[int], int, int]]] = [[] for _ in range(K)]
        load = [0] * K
        for row in sorted(rows, key=lambda r: -len(r[1])):
            k = min(range(K), key=lambda j: (load[j], j))
            bins[k].append(row)
            load[k] += len(row[1])
        mbs, toks = [], []
        for rows_k in bins:
            groups: dict[tuple[int, bool], tuple[Group, list[list[int]]]] = {}
            for i, t, start, emit in sorted(rows_k, key=lambda r: r[0]):
                v = i in verify
                g, tl = groups.setdefault((len(t), v), (Group(len(t), drafts=[] if v else None), []))
                if g.drafts is not None:
                    g.drafts.append(list(t[1:]))
                g.seqs.append(i)
                g.slots.append(i // self.M)
                g.starts.append(start)
                g.emits.append(emit)
                tl.append(t)
            self._mb_ids += 1
            mbs.append(MicroBatch(self._mb_ids, [groups[key][0] for key in sorted(groups)]))
            toks.append([torch.tensor(groups[key][1], dtype=torch.long) for key in sorted(groups)])
        return mbs, toks

    def _begin_ranks(self, n: int, params: SamplingParams, hidden: bool = False, page_tokens: int | None = None,
                     max_pages: int | None = None) -> None:
        """Fresh caches for ``n`` global rows on the attention ranks (row i: rank i % M); sampling ``params``; with
        ``hidden`` the feedback carries every row's final hidden states; with ``page_tokens`` their paged caches follow
        the scheduler's page table, split in one part per rank (the changes ride on each rank's first micro-batch), in
        pools of ``max_pages`` pages (one part's and the sink) where given."""
        cfg: dict[str, Any] = {"num_slots": n, "params": {"temperature": params.temperature, "top_p": params.top_p,
                                                          "top_k": params.top_k, "seed": params.seed}}
        if hidden:
            cfg["hidden"] = True
        if page_tokens:
            cfg["page_tokens"] = page_tokens
            if max_pages:
                cfg["max_pages"] = max_pages
        self._mb_ids = 0
        self.runner.begin(dict(cfg, local_slots=len(range(0, n, self.M))))
        for m in range(1, self.M):
            self.link.send(m, BEGIN, json_meta(dict(cfg, local_slots=len(range(m, n, self.M)))))

    def _step_raw(self, per: list[list[tuple[int, list[int], int, int]]], verify: Container[int] = (),
                  rewinds: list[tuple[int, int]] = (), pages: list[tuple[int, list[int]]] = ()
                  ) -> tuple[list[tuple[list[int], torch.Tensor]], dict[int, list[Group]]]:
        """One step of every attention rank's rows (``per[m]``) through the ranks: the feedback as (meta, raw bytes)
        per micro-batch, and each micro-batch's groups by id. ``verify``: the global rows that are verify rows;
        ``rewinds``: (global row, keep) of earlier verifies, which ride on the first micro-batch of each row's
        attention rank; ``pages``: the page-table changes (global row, page ids of the table split in M parts) the
        attention ranks follow first (as their own slots and pages: ``BlockTable.local``)."""
        self._busy_since = time.monotonic()
        mine = None
        groups: dict[int, list[Group]] = {}
        for m in range(self.M):
            mbs, toks = self._micro_batches(per[m], verify)
            mbs[0].rewinds = [(i // self.M, k) for i, k in rewinds if i % self.M == m]
            mbs[0].pages = [(i // self.M, [local_page(p, self.M) for p in ids]) for i, ids in pages if i % self.M == m]
            groups.update({mb.mb_id: mb.groups for mb in mbs})
            if m == 0:
                mine = (mbs, toks)
            else:
                meta, ts = encode_step(mbs, toks)
                self.link.send(m, STEP, meta, ts)
        feedback = self.runner.step(*mine)
        for m in range(1, self.M):
            for _ in range(self.micro_batches):
                kind, meta, tail = self.link.recv(m)
                if kind != FEEDBACK:
                    raise AFDError(f"protocol error: expected feedback from attention rank {m}, got kind {kind}")
                feedback.append((meta, [tail]))
        self._busy_since = None
        out = []
        for meta, ts in feedback:
            out.append((meta, ts[0].reshape(-1).view(torch.uint8) if ts else torch.empty(0, dtype=torch.uint8)))
        return out, groups

    def _reset_rows(self, rows: list[int]) -> None:
        """New sequences start in global ``rows``: each attention rank clears its slots of them."""
        for m in range(self.M):
            local = [i // self.M for i in rows if i % self.M == m]
            if not local:
                continue
            if m == 0:
                self.runner.rt.reset_slots(local)
            else:
                self.link.send(m, RESET, local)

    # ------------------------------------------------------------ measurement
    def time_split(self, reset: bool = True) -> dict[str, Any]:
        """Seconds of compute / transfer / idle per rank since the last reset, and the sums per side."""
        self._check_process()
        if self._broken is not None or self._closed:
            raise AFDError(str(self._broken or "this AFD engine is closed"))
        with self._lock:
            for r in range(1, self.layout.world):
                self.ctl.store.delete_key(self.ctl.key("stats", r))
                self.link.send(r, STATS, [1 if reset else 0])
            self.link.flush()
            ranks = {0: self.link.clock.as_dict()}
            if reset:
                self.link.clock.__init__()
            deadline = time.monotonic() + 10
            for r in range(1, self.layout.world):
                while (v := self.ctl.get("stats", r)) is None:
                    if time.monotonic() > deadline:
                        raise AFDError(f"{self.layout.describe(r)} did not report its time split")
                    time.sleep(0.005)
                ranks[r] = json.loads(v)
        sides: dict[str, dict[str, float]] = {}
        for r, c in ranks.items():
            side = sides.setdefault(
                "attention" if r < self.M else "ffn", {"compute": 0.0, "transfer": 0.0, "idle": 0.0}
            )
            for k in side:
                side[k] += c[k]
        return {"ranks": {self.layout.describe(r): c for r, c in ranks.items()}, "sides": sides}

    # ------------------------------------------------------------ shutdown
    def _send_shutdown(self) -> None:
        """SHUTDOWN to every rank (the Pipeline's close() calls this)."""
        for r in range(1, self.layout.world):
            self.link.send(r, SHUTDOWN, [])
        self.link.flush()
