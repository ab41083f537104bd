"""Launching the pipeline's processes: the stage split, torchrun ranks and rendezvous, starting workers cleanly."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from waferline import kernels
from waferline.engine.sampling import resolve_dtype
from waferline.engine.stage import first_line, loopback_host, loopback_store, serve
from waferline.errors import ConfigError, counted
from waferline.spec.configs import spec_from_pretrained

if TYPE_CHECKING:
    from waferline.plan.plan import Plan
    from waferline.spec.model import ModelSpec


# ---------------------------------------------------------------- the stage split

def ids_downstream(spec: ModelSpec, ranges: list[tuple[int, int]]) -> bool:
    """Whether a stage holding layers ``ranges[1:]`` needs the step's token ids: it holds a hash-routed DeepSeek-V4
    MoE layer (one without a correction bias, as V4MoE reads its spec). Only then do the groups carry them."""
    if spec.model_type != "deepseek_v4":
        return False
    return any(not getattr(spec.layers[i].ffn, "correction_bias", True) for a, b in ranges[1:] for i in range(a, b))


def stage_ranges(num_layers: int, stages: int | None = None, layers_per_stage: int | None = None,
                 plan: Plan | None = None, costs: list[float] | None = None,
                 last_extra: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous layer ranges [a, b) per stage: from a Plan, from K layers per stage, or S balanced stages (``costs``:
    each layer's work, ``last_extra`` the last stage's own, e.g. the LM head: the split whose largest stage costs
    least; without costs, layer counts as even as they go)."""
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
                raise ConfigError(
                    f"plan stage {st.index} holds layers {st.layers}: a stage needs a non-empty contiguous range"
                )
            out.append((ls[0], ls[-1] + 1))
        if [a for a, _ in out] != [0] + [b for _, b in out[:-1]] or out[-1][1] != num_layers:
            raise ConfigError(
                f"plan stages {out} do not cover layers 0..{num_layers - 1} in order; re-plan for this model"
            )
        return out
    if layers_per_stage is not None:
        if layers_per_stage < 1:
            raise ConfigError(f"layers_per_stage must be >= 1, got {layers_per_stage}")
        return [(a, min(a + layers_per_stage, num_layers)) for a in range(0, num_layers, layers_per_stage)]
    S = 1 if stages is None else int(stages)
    if S < 1:
        raise ConfigError(f"stages must be >= 1, got {S}")
    if S > num_layers:
        raise ConfigError(f"{S} stages for a model of {counted(num_layers, 'layer')}: each stage needs at least one "
                          f"layer; use stages <= {num_layers} (or layers_per_stage=1)")
    if costs is not None and S > 1:
        return _min_max_split(costs, S, last_extra)
    base, extra = divmod(num_layers, S)
    out, a = [], 0
    for i in range(S):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def _min_max_split(costs: list[float], S: int, last_extra: float) -> list[tuple[int, int]]:
    """S contiguous non-empty ranges of the layers minimising the largest range's cost (the last range also pays
    ``last_extra``); among equal ones, the first found scanning cut points from the front."""
    L = len(costs)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    inf = float("inf")
    # best[s][i]: the least largest cost of the first i layers in s ranges; cut[s][i]: where the last range starts
    best = [[inf] * (L + 1) for _ in range(S + 1)]
    cut = [[0] * (L + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for s in range(1, S + 1):
        for i in range(s, L - (S - s) + 1):
            tail = last_extra if i == L else 0.0
            for j in range(s - 1, i):
                v = max(best[s - 1][j], pre[i] - pre[j] + tail)
                if v < best[s][i] - 1e-9 * abs(v):
                    best[s][i], cut[s][i] = v, j
    out, i = [], L
    for s in range(S, 0, -1):
        j = cut[s][i]
        out.append((j, i))
        i = j
    return out[::-1]


def balanced_ranges(spec: Any, stages: int | None = None, layers_per_stage: int | None = None,
                    plan: Plan | None = None) -> list[tuple[int, int]]:
    """``stage_ranges`` for a model: S stages balanced by each layer's decode FLOPs per token (ModelSpec's), the LM
    head's product on the last stage (on a small model the head is a large share: an even split left the last stage
    the slowest)."""
    costs = [layer.flops_per_token() for layer in spec.layers]
    return stage_ranges(spec.num_layers, stages, layers_per_stage, plan, costs=costs,
                        last_extra=spec.lm_head_flops_per_token())


def _env_int(name: str, default: str | None = None) -> int:
    """An env:// variable as a whole number (a ConfigError naming it, not a traceback, for anything else)."""
    value = os.environ.get(name, default)
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"env:// launch: {name} must be a whole number, got {value!r}") from None


def env_world_size() -> int:
    """WORLD_SIZE from the environment (1 when unset): above 1, this process is one rank of an env:// launch."""
    return _env_int("WORLD_SIZE", "1")


def _env_rank(world: int) -> int:
    """RANK from the environment (0 when unset), checked against the world size: 0 <= RANK < WORLD_SIZE."""
    rank = _env_int("RANK", "0")
    if not 0 <= rank < world:
        raise ConfigError(f"env:// launch: RANK {rank} is outside 0..{world - 1} (WORLD_SIZE {world})")
    return rank


def torchrun_rank() -> int:
    """This process's rank when launched by torchrun (env:// with WORLD_SIZE > 1), else 0."""
    world = env_world_size()
    if world > 1:
        return _env_rank(world)
    return 0


# ---------------------------------------------------------------- local workers

def _start_forkserver(ctx: Any, preload: list[str]) -> None:
    """Start the forkserver that forks the workers, ``preload`` imported in it, with Ctrl-C ignored there.

    A Ctrl-C reaches the whole process group; the forkserver ignores SIGINT only once its preload (torch, the model
    code: seconds) is imported, so a Ctrl-C while it imports printed a KeyboardInterrupt traceback from it under the
    driver's one line. Started while this process ignores SIGINT, it inherits that from its first moment, and so do the
    workers it forks (worker_start ignores it again). A forkserver already running is kept as it is.
    """
    from multiprocessing import forkserver

    ctx.set_forkserver_preload(preload)
    if threading.current_thread() is not threading.main_thread():  # (signal.signal works in the main thread only)
        forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


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


def _reap(procs: list[Any], pid: int | None = None) -> None:
    """Finalizer: never leave stage processes behind (those process ``pid`` started: not in a forked child)."""
    if pid is not None and os.getpid() != pid:
        return
    for p in procs:
        try:
            if p.exitcode is None:
                p.kill()
                p.join(timeout=2)
        except Exception:
            pass


# ---------------------------------------------------------------- torchrun (env://)

def _env_run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "env") + "-" + os.environ.get("MASTER_PORT", "0")


RENDEZVOUS_TIMEOUT_S = 300.0  # env://: how long a rank waits for the rendezvous store (rank 0's, or torchrun's)


def _rendezvous_env(stages: int | None = None) -> tuple[Any, int, int]:
    """(store, rank, world size) from torchrun's env:// variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE);
    ``stages``: the pipeline's, which the world size must equal (checked before the rendezvous, on every rank: rank 0
    refusing after it left the others waiting for a store that was gone)."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:
        raise ConfigError(
            f"env:// launch needs {', '.join(missing)} in the environment (start the command with torchrun)"
        )
    timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    world = env_world_size()
    rank = _env_rank(world)
    if stages is not None and world != stages:
        raise ConfigError(f"torchrun started {counted(world, 'process', 'processes')} but the pipeline has "
                          f"{counted(stages, 'stage')}; launch with {counted(stages, 'process', 'processes')} in "
                          "total (nnodes x nproc-per-node)")
    port = _env_int("MASTER_PORT")
    if not 0 < port < 65536:
        raise ConfigError(f"env:// launch: MASTER_PORT must be a port number (1-65535), got {port}")
    addr = os.environ["MASTER_ADDR"]
    host = loopback_host(addr)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # (torchrun's agent hosts the store, up by now)
    where = f"MASTER_ADDR {addr} MASTER_PORT {port}"
    if rank == 0 and not agent:
        try:
            if host is not None:  # this rank hosts the store, and the address says one host: listen there only, not
                return loopback_store(world, timeout, port, host), rank, world  # on every interface
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        except (OSError, RuntimeError) as e:  # (the port taken, the address not this host's: a DistNetworkError)
            raise ConfigError(f"env:// launch: rank 0 could not listen on {where} for the rendezvous "
                              f"({first_line(e)}); pick a free MASTER_PORT on every rank") from None
        return store, rank, world
    if not agent:  # (a store client that finds nothing to connect to retries for the whole timeout, then logs C++
        _wait_for_store(addr, port, where)  # frames and raises: it is waited for here, and named in one line)
    try:
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"env:// launch: rank {rank} could not join the rendezvous at {where} "
                          f"({first_line(e)})") from None
    return store, rank, world


def _wait_for_store(addr: str, port: int, where: str) -> None:
    """Wait (at most RENDEZVOUS_TIMEOUT_S) until the rendezvous store at ``addr``:``port`` takes connections."""
    import socket
    import time

    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(left, 5.0))):
                return
        except OSError:
            if left <= 0:
                break
            time.sleep(min(0.2, max(0.0, left)))
    raise ConfigError(f"env:// launch: no rendezvous store answered at {where} within {RENDEZVOUS_TIMEOUT_S:g} s; "
                      "start rank 0 (the driver) with the same MASTER_ADDR and MASTER_PORT")


def serve_from_env(path: str | Path, dtype: str = "float32", *, stages: int | None = None,
                   layers_per_stage: int | None = None, plan: Plan | None = None, device: str = "cpu",
                   threads_per_stage: int | None = None, load_kwargs: dict[str, Any] | None = None,
                   convert: dict[str, int] | None = None) -> int:
    """Run this torchrun rank (>= 1) as a worker stage until the driver (rank 0) shuts the pipeline down
    (``convert``: the driver's weight_bits / group_size / head_bits, applied to this stage's layers)."""
    spec = spec_from_pretrained(Path(path))
    ranges = balanced_ranges(spec, stages, layers_per_stage, plan)
    if torch.device(device).type == "cpu":  # built (first run) or loaded now, not inside this stage's first step
        kernels.prepare()  # (where the pipeline's hang timeout would stop a build)
    store, rank, _ = _rendezvous_env(len(ranges))
    if threads_per_stage:
        torch.set_num_threads(threads_per_stage)
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    load = {"path": str(path), "dtype": resolve_dtype(dtype), "layer_range": ranges[rank],
            "extra": dict(load_kwargs or {}), "convert": dict(convert or {}),
            "store_addr": (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))}
    return serve(store, _env_run_id(), rank, len(ranges), load, dev, local=False)
