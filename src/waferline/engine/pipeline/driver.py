"""The pipeline engine's driver, ``Pipeline``: this process is stage 0 and the scheduler, stages 1..S-1 are worker
processes; start-up (local or torchrun) and the public API (run_generate, run_stream, prompt_logprobs, stream).
The decode ring is ``ring.DecodeRing``, the hold on the workers ``supervise.Supervision``.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from waferline.engine.pipeline.launch import (
    _env_run_id,
    _main_hidden,
    _reap,
    _rendezvous_env,
    ids_downstream,
    stage_ranges,
)
from waferline.engine.pipeline.ring import DECODE, DONE, PREFILL, DecodeRing, _Seq, _SpecRun
from waferline.engine.pipeline.supervise import StageError, Supervision
from waferline.engine.sampling import SamplingParams, resolve_dtype
from waferline.engine.stage import (
    LOOPBACK,
    Control,
    Link,
    StageRunner,
    check_mtp,
    loopback_store,
    make_group,
    worker_main,
)
from waferline.errors import ConfigError, counted
from waferline.spec.configs import spec_from_pretrained

if TYPE_CHECKING:
    from waferline.engine.llm import LLM
    from waferline.plan.plan import Plan

DEFAULT_PREFILL_CHUNK = 256
DEFAULT_HANG_TIMEOUT_S = 8.0


class Pipeline(DecodeRing, Supervision):
    """S stages over ``torch.distributed`` point-to-point; this process is stage 0 and the scheduler.

    >>> with Pipeline("ckpt", stages=2, micro_batches=2) as pipe:
    ...     toks, reasons, metrics = pipe.run_generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8))
    """

    def __init__(self, path: str | Path, dtype: str | torch.dtype = "float32", *, stages: int | None = None,
                 layers_per_stage: int | None = None, micro_batches: int | None = None, plan: Plan | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, threads_per_stage: int | None = None,
                 hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S, device: str = "cpu", start_method: str = "forkserver",
                 launch: str = "auto", load_kwargs: dict[str, Any] | None = None, speculative: str | None = None,
                 num_speculative_tokens: int = 4, speculative_adaptive: bool = True):

        dtype = resolve_dtype(dtype)
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"model directory {self.path} does not exist")
        self.spec = spec_from_pretrained(self.path)
        self.ranges = stage_ranges(self.spec.num_layers, stages, layers_per_stage, plan)
        self.num_stages = S = len(self.ranges)
        self.ids_downstream = ids_downstream(self.spec, self.ranges)  # (DeepSeek-V4's hash-routed layers)
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
            raise ConfigError(
                f"launch must be 'auto', 'local' (spawn stage processes here) or 'env' (torchrun), got {launch!r}"
            )
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
        self.store = loopback_store(S, datetime.timedelta(seconds=60))
        load["store_addr"] = (LOOPBACK, self.store.port)
        self.ctl = Control(self.store, self.run_id)
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(["waferline.engine.stage", "waferline.model.load"])
        for r in range(1, S):
            stage_load = dict(load, layer_range=self.ranges[r])
            p = ctx.Process(
                target=worker_main,
                args=(r, S, stage_load, self.run_id, self.threads, self.device.type, os.getpid()),
                name=f"waferline-stage{r}",
                daemon=True,
            )
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
            raise ConfigError(f"torchrun started {counted(world, 'process', 'processes')} but the pipeline has "
                              f"{counted(self.num_stages, 'stage')}; launch with "
                              f"{counted(self.num_stages, 'process', 'processes')} in total (nnodes x nproc-per-node)")
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

    # ------------------------------------------------------------ public API
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

    def stream(self, llm: LLM, ids: list[list[int]], params: SamplingParams) -> Iterator[Any]:
        """The LLM.stream contract for already-validated prompts: (row, token) events, then the list of Outputs."""
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(llm.eos_token_ids))
        final: Any = None
        for ev in self.run_stream(ids, params, stop_ids, lambda toks, stops: llm._hit_stop(toks, stops)):
            if len(ev) == 3:
                final = ev
            else:
                yield ev
        outs, reasons, metrics = final
        yield [
            llm.make_output(p, toks, reason, stop_ids, params, m)
            for p, toks, reason, m in zip(ids, outs, reasons, metrics)
        ]

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """Process ids of the worker stages 1..S-1 (stage 0 is this process)."""
        return [p.pid for p in self._procs]
