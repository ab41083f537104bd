"""The pipeline engine's driver, ``Pipeline``: this process is stage 0 and the scheduler, stages 1..S-1 are worker
processes; start-up (local or torchrun) and the chain stage 0 launches micro-batches into and reads the last stage's
answers from. The scheduler drives it through ``serving.PipelineRunner``; the hold on the workers is
``supervise.Supervision``.
"""

from __future__ import annotations

import datetime
import math
import os
import threading
import uuid
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from waferline import kernels
from waferline.engine.pipeline.launch import (
    _env_run_id,
    _main_hidden,
    _rendezvous_env,
    _start_forkserver,
    balanced_ranges,
    env_world_size,
    ids_downstream,
)
from waferline.engine.pipeline.supervise import StageError, Supervision
from waferline.engine.sampling import SamplingParams, resolve_dtype
from waferline.engine.stage import (
    BEGIN,
    FEEDBACK,
    LOOPBACK,
    STEP,
    Control,
    Group,
    Link,
    MicroBatch,
    StageRunner,
    json_meta,
    loopback_store,
    make_group,
    worker_main,
)
from waferline.errors import ConfigError
from waferline.spec.configs import spec_from_pretrained

if TYPE_CHECKING:
    from waferline.plan.plan import Plan

DEFAULT_PREFILL_CHUNK = 256
DEFAULT_HANG_TIMEOUT_S = 8.0


def checked_hang_timeout(value: float) -> float:
    """``hang_timeout_s`` as seconds: a finite number > 0 (0, a negative, NaN or inf turned the watchdog off)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if not (v > 0 and math.isfinite(v)):
        raise ConfigError(f"hang_timeout_s must be a finite number of seconds > 0, got {value}")
    return v


def checked_threads(value: Any, name: str = "threads_per_stage") -> int | None:
    """Torch threads per stage or rank process: None (the cores divided among them) or a whole number >= 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a whole number >= 1 (or None: the cores divided among the processes), "
                          f"got {value!r}")
    return value


class Pipeline(Supervision):
    """S stages over ``torch.distributed`` point-to-point; this process is stage 0 and the scheduler's. ``LLM(path,
    stages=S)`` makes one and runs its requests through the scheduler (``serving.PipelineRunner``)."""

    def __init__(self, path: str | Path, dtype: str | torch.dtype = "float32", *, stages: int | None = None,
                 layers_per_stage: int | None = None, micro_batches: int | None = None, plan: Plan | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, threads_per_stage: int | None = None,
                 hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S, device: str = "cpu", start_method: str = "forkserver",
                 launch: str = "auto", load_kwargs: dict[str, Any] | None = None,
                 convert: dict[str, int] | None = None):

        dtype = resolve_dtype(dtype)
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"model directory {self.path} does not exist")
        self.spec = spec_from_pretrained(self.path)
        if isinstance(plan, (str, Path)):  # (a plan file: its micro-batches too, as the Plan it holds)
            from waferline.plan.plan import Plan

            plan = Plan.load(plan)
        if plan is not None:  # (a plan of another model: said so, not which of its layers are not there)
            plan.check_model(self.spec, self.path)
        self.ranges = balanced_ranges(self.spec, stages, layers_per_stage, plan)
        self.num_stages = S = len(self.ranges)
        self.ids_downstream = ids_downstream(self.spec, self.ranges)  # (DeepSeek-V4's hash-routed layers)
        if micro_batches is None and plan is not None:
            micro_batches = plan.micro_batches
        self.micro_batches = int(micro_batches) if micro_batches is not None else S
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = int(prefill_chunk)
        self.hang_timeout_s = checked_hang_timeout(hang_timeout_s)
        default_threads = torch.get_num_threads() if S == 1 else max(1, (os.cpu_count() or 1) // S)
        self.threads = checked_threads(threads_per_stage) or default_threads
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but CUDA is not available; use device='cpu'")
        if self.device.type == "cuda" and S > torch.cuda.device_count() and launch != "env" \
                and env_world_size() <= 1:  # (NCCL refuses two ranks on one GPU)
            raise ConfigError(f"a pipeline on CUDA runs one stage per GPU: {S} stages need {S} GPUs, torch sees "
                              f"{torch.cuda.device_count()}; use fewer stages, more GPUs or device='cpu'")
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
            raise ConfigError(
                f"launch must be 'auto', 'local' (spawn stage processes here) or 'env' (torchrun), got {launch!r}"
            )
        self._env = launch == "env" or (launch == "auto" and env_world_size() > 1)
        # (weight_bits / group_size / head_bits: what each stage does to its layers once loaded, convert_loaded)
        self.convert = dict(convert or {})
        load = {"path": str(self.path), "dtype": dtype, "extra": dict(load_kwargs or {}), "convert": self.convert}
        self._started_here()
        try:
            self._start(load, start_method)
        except BaseException:
            self._kill_all()
            self._closed = True
            raise

    # ------------------------------------------------------------ start-up
    def _start(self, load: dict[str, Any], start_method: str) -> None:
        from waferline.model.load import load_model

        S = self.num_stages
        if S > 1 and self.device.type == "cpu":  # built (first run) or loaded once, here: not by a stage inside its
            load["kernels"] = kernels.prepare()  # first step, where the hang timeout stops it, nor by each stage
        if S > 1:  # after a failure (under torchrun each rank prepares its own before the rendezvous)
            if self._env:
                self._start_env(load)
            else:
                self._start_local(load, start_method)
            self._connect()
        from waferline.model.quant import convert_loaded, loading_for, move_model

        a, b = self.ranges[0]
        with loading_for(self.device):
            model = load_model(self.path, self.dtype, range(a, b), has_embed=True, has_head=S == 1, **load["extra"])
        if self.device.type != "cpu":  # (int4 weights repacked for the device's kernel)
            move_model(model, self.device)
        convert_loaded(model, **self.convert)
        self.runner = StageRunner(model, 0, S, self.device)
        if S > 1:
            self._wait_for("ready", "load its layers")
            self._start_watchdog("waferline-pipeline-watchdog")

    def _start_local(self, load: dict[str, Any], start_method: str) -> None:
        import torch.multiprocessing as mp

        S = self.num_stages
        self.run_id = uuid.uuid4().hex[:12]
        self.store = loopback_store(S, datetime.timedelta(seconds=60))
        load["store_addr"] = (LOOPBACK, self.store.port)
        self.ctl = Control(self.store, self.run_id)
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            _start_forkserver(ctx, ["waferline.engine.stage", "waferline.model.load"])
        for r in range(1, S):
            stage_load = dict(load, layer_range=self.ranges[r])
            p = ctx.Process(
                target=worker_main,
                args=(r, S, stage_load, self.run_id, self.threads, str(self.device), os.getpid()),
                name=f"waferline-stage{r}",
                daemon=True,
            )
            with _main_hidden():
                p.start()
            self._procs.append(p)
        self._wait_for("alive", "start")

    def _start_env(self, load: dict[str, Any]) -> None:
        store, rank, _ = _rendezvous_env(self.num_stages)
        if rank != 0:
            raise ConfigError(f"rank {rank}: under torchrun only rank 0 drives the pipeline; other ranks run "
                              "waferline.engine.pipeline.serve_from_env (the CLI does this for you)")
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
                    box[name] = make_group(
                        self.store, f"waferline/{self.run_id}/{name}", 0, self.num_stages, self.device, not self._env
                    )
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        self._connect_watching(build, box)
        self.act, self.fb = Link(box["act"], self.device), Link(box["fb"], self.device)

    # ------------------------------------------------------------ the chain
    def _send_chain(self, kind: int, meta: list[int], tensors: list[torch.Tensor] = ()) -> None:
        self.act.send(1, kind, meta, list(tensors))
        self._chain_sent += 1

    def _launch(self, mb: MicroBatch, tokens: list[torch.Tensor]) -> None:
        """Run stage 0's layers on ``mb`` and send it down the chain (one stage: answer it here)."""
        hs = self.runner.forward(mb, tokens)
        if self.num_stages == 1:
            self._local_fb.append(self.runner.feedback(mb, hs))
        else:
            self._send_chain(STEP, mb.encode(), list(hs))

    def _recv_feedback(self) -> tuple[list[int], torch.Tensor]:
        """The next FEEDBACK message from the last stage: its meta and its raw bytes (on the host)."""
        if self.num_stages == 1:
            meta, ts = self._local_fb.popleft()
            tail = ts[0].reshape(-1).view(torch.uint8) if ts else torch.empty(0, dtype=torch.uint8)
        else:
            kind, meta, tail = self.fb.recv(self.num_stages - 1)
            if kind != FEEDBACK:
                raise StageError(f"protocol error: expected feedback from stage {self.num_stages - 1}, got kind {kind}")
        return meta, tail.cpu()

    def _begin(self, num_slots: int, params: SamplingParams, hidden: bool = False, page_tokens: int | None = None,
               max_pages: int | None = None) -> None:
        """Fresh caches of ``num_slots`` rows on every stage; the last stage samples EMIT_TOKEN rows with ``params``
        (and with ``hidden`` sends back every row's final hidden states); with ``page_tokens`` the paged caches
        follow the pages the micro-batches name (the scheduler's page table), in pools of ``max_pages`` pages where
        given."""
        cfg: dict[str, Any] = {
            "num_slots": num_slots,
            "params": {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                       "seed": params.seed},
        }
        if hidden:
            cfg["hidden"] = True
        if page_tokens:
            cfg["page_tokens"] = page_tokens
            if max_pages:
                cfg["max_pages"] = max_pages
        self.runner.begin(cfg)
        if self.num_stages > 1:
            self._send_chain(BEGIN, json_meta(cfg))

    def _carry_ids(self, groups: list[Group], toks: list[torch.Tensor]) -> None:
        """Give each group its input ids [B*T] when a later stage holds a hash-routed layer (``ids_downstream``)."""
        if self.ids_downstream:
            for g, t in zip(groups, toks):
                if g.tokens is None:
                    g.tokens = t.reshape(-1).tolist()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """Process ids of the worker stages 1..S-1 (stage 0 is this process)."""
        return [p.pid for p in self._procs]
