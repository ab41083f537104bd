"""What every calibration probe shares: the calibration models (random `sol` checkpoints of the engine's own layer
kinds), timing helpers (fastest of several runs, per-token differences, a process's CPU seconds), the relative
non-negative least squares the fits use, a measured figure's YAML form, and running a probe in a fresh process."""

from __future__ import annotations

import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from waferline.engine.llm import LLM

Progress = Callable[[str, float], None]  # (what is being measured, fraction done)

# A tiny model of the engine's own architecture with every layer kind the engine runs on this repo's models (Mamba-2,
# MLA, dense and MoE FFNs): its decode step is all per-op overhead, so its step time over its op count measures it.
_TINY_BASE = {
    "model_type": "sol", "architectures": ["SolForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 64, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1,
    "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_chunk_size": 16, "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1,
}
_TINY_PATTERN = [("mamba2", "dense"), ("mla", "moe"), ("mamba2", "moe"), ("mla", "dense")]


def tiny_config(layers: int) -> dict[str, Any]:
    """The calibration model with ``layers`` layers (kinds cycle through Mamba-2/MLA x dense/MoE)."""
    kinds = [_TINY_PATTERN[i % len(_TINY_PATTERN)] for i in range(layers)]
    return dict(
        _TINY_BASE, num_hidden_layers=layers, mixer_types=[m for m, _ in kinds], ffn_types=[f for _, f in kinds]
    )


def calibration_checkpoint(workdir: str | Path, hidden: int, layers: int) -> Path:
    """The random calibration model of (hidden, layers) under ``workdir`` (FFN 2 x hidden, experts' hidden), written
    on first use; every probe of a calibration shares it."""
    from waferline.model.init import write_random_checkpoint

    h, L = hidden, layers
    d = Path(workdir) / (f"tiny-{L}" if h == 64 else f"tiny-h{h}-{L}")
    if not (d / "config.json").is_file():
        write_random_checkpoint(dict(tiny_config(L), hidden_size=h, intermediate_size=2 * h, moe_intermediate_size=h),
                                d, seed=L + h)
    return d


def _best(fn: Callable[[], Any], repeat: int = 5, clock: Callable[[], float] = time.process_time) -> float:
    """Fastest of ``repeat`` runs. Single-threaded probes are timed in this process's CPU time: on a machine shared with
    other work, wall time would count the time the core spent on someone else (on a quiet machine both agree)."""
    best = float("inf")
    for _ in range(repeat):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def _fig(value: float, tag: str, method: str) -> dict[str, Any]:
    """A measured figure: value, a source line the catalog loader reads, and {date, method}."""
    return {
        "value": float(value),
        "source": f"{tag}: {method}",
        "measured": {"date": tag.split()[-1], "method": method},
    }


def _timed_cpu(fn: Callable[[], Any]) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def _nnls_rel(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative errors with non-negative coefficients (drop negative ones and refit)."""
    Xr, yr = X / y[:, None], np.ones(len(y))
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    for _ in range(X.shape[1]):
        c, *_ = np.linalg.lstsq(Xr[:, active], yr, rcond=None)
        coef[:] = 0.0
        coef[active] = c
        neg = [a for a, v in zip(active, c) if v < 0]
        if not neg:
            break
        active = [a for a in active if a not in neg]
    return coef


PER_TOKEN_MAX_ROUNDS = 10  # _per_token runs up to this many times its repeats while a difference is not positive


def _per_token(llm: LLM, prompts: list[list[int]], n: int, clock: Callable[[], float], repeats: int) -> float:
    """Seconds per decode token on ``clock``: (generating n + 1 tokens - generating 1) / n, each the fastest of
    ``repeats`` (the prefill and the first token cancel out). The fastest of each, not the smallest difference: one
    slow short run made that difference small, even negative on a busy machine."""
    return _per_token_clocks(llm, prompts, n, [clock], repeats)[0]


def _per_token_clocks(llm: LLM, prompts: list[list[int]], n: int, clocks: list[Callable[[], float]],
                      repeats: int) -> list[float]:
    """_per_token on several clocks read around the same runs (wall time and the CPU of a pipeline's processes: each
    the fastest of the same ``repeats``, instead of one clock's runs and then the other's, fewer of them)."""
    from waferline.engine.sampling import SamplingParams

    short, long = [float("inf")] * len(clocks), [float("inf")] * len(clocks)
    for i in range(PER_TOKEN_MAX_ROUNDS * repeats):
        t0 = [c() for c in clocks]
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        t1 = [c() for c in clocks]
        llm.generate(prompts, SamplingParams(max_tokens=n + 1, ignore_eos=True))
        t2 = [c() for c in clocks]
        short = [min(s, b - a) for s, a, b in zip(short, t0, t1)]
        long = [min(g, b - a) for g, a, b in zip(long, t1, t2)]
        if i + 1 >= repeats and all(g > s for g, s in zip(long, short)):
            break  # (more rounds only while a busy machine leaves a difference at or below zero)
    else:  # (no measurement: a time per token at or below zero would be written as the machine's)
        from waferline.errors import WaferlineError

        raise WaferlineError(
            f"could not measure a time per decode token: over {PER_TOKEN_MAX_ROUNDS * repeats} rounds the fastest "
            f"{n + 1}-token run never took longer than the fastest 1-token run (load average "
            f"{os.getloadavg()[0]:.1f}: other work on this machine); measure again when it is idle")
    return [(g - s) / n for g, s in zip(long, short)]


BIG_CALIBRATION_MODEL = (1024, 4, 4096)  # (hidden, layers, FFN): ~100 MB in bf16, more than a last-level cache
# the from-memory prefill probe's model: as far beyond the cache (~130 MB in bf16), products of 1-5 MB like the twin's
# models' (the big model's 8-17 MB products run slower against the table than products of these sizes)
PREFILL_CALIBRATION_MODEL = (768, 8, 1536)


def big_calibration_checkpoint(workdir: str | Path, big: tuple[int, int, int] = BIG_CALIBRATION_MODEL) -> Path:
    """The random calibration model beyond the last-level cache, (hidden, layers, FFN) = ``big``, under ``workdir``
    (written on first use, from a fixed seed: the same weights wherever it is written)."""
    from waferline.model.init import write_random_checkpoint

    h, L, ffn = big
    d = Path(workdir) / f"big-h{h}-{L}"
    if not (d / "config.json").is_file():
        write_random_checkpoint(
            dict(
                tiny_config(L),
                hidden_size=h,
                intermediate_size=ffn,
                moe_intermediate_size=ffn // 2,
                num_attention_heads=8,
                kv_lora_rank=128,
                qk_nope_head_dim=64,
                qk_rope_head_dim=32,
                v_head_dim=64,
                mamba_n_heads=16,
                mamba_d_head=64,
                mamba_d_state=64,
            ),
            d,
            seed=7,
        )
    return d


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds of a local process so far: the scheduler's nanosecond run time summed over its threads
    (/proc/PID/task/*/schedstat), else user + system time from /proc/PID/stat (10 ms ticks: too coarse for the
    sub-millisecond differences the pipeline probe takes); NaN where unreadable."""
    try:
        return sum(int((t / "schedstat").read_text().split()[0]) for t in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Iteration|Warning))(?::\s*(.*))?$"
)


class ChildFailed(RuntimeError):
    """run_isolated's child failed. The message: its exit status and last output lines; ``reason``: its exception in
    one line (``RequestError: prompt of ...``, the module path dropped), or its last output line where it printed
    none."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``), recorded with a calibration and a twin
    result so that a report can say which machine measured it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


MACHINE_KEYS = ("host", "cores", "cpu_model", "cpu_capability")


def machine_identity() -> dict[str, Any]:
    """What tells this machine from another: its name, logical CPUs, CPU model and the vector instructions torch runs
    on it (AVX2, AVX512, ...). Machines of one name can differ (2-core VMs all named ``vm``, some with AVX-512 and
    some without), so a calibration records all of them."""
    import torch

    return {"host": platform.node() or "host", "cores": os.cpu_count() or 1, "cpu_model": cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def machine_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """How two machine identities (machine_identity's keys; one recorded before a key existed lacks it) differ, as
    ``key a vs b`` for each key both have."""
    return [f"{k} {a[k]} vs {b[k]}" for k in MACHINE_KEYS
            if a.get(k) is not None and b.get(k) is not None and str(a[k]) != str(b[k])]


def not_measured(e: BaseException) -> str:
    """Why a calibration probe was not measured, as its record says it: a run_isolated child's own exception
    (ChildFailed's ``reason``, not the traceback lines before it), else the exception's type and message."""
    return f"not measured: {e.reason if isinstance(e, ChildFailed) else f'{type(e).__name__}: {e}'}"[:200]


def child_reason(output: str) -> str:
    """The last exception line of a child's output (a traceback's last line: the exception and its message), without
    the exception's module path; else the last non-empty line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        m = _EXCEPTION_LINE.match(line)
        if m:
            return m.group(1) + (f": {m.group(2)}" if m.group(2) else "")
    return lines[-1] if lines else "no output"


def run_isolated(target: str, kwargs: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Call ``module:function(**kwargs)`` in a fresh Python process (its own session, killed with its stage processes
    after ``timeout`` s) and return its JSON result; a hang or crash in an engine run cannot take the caller with it.
    Raises RuntimeError with the child's last output lines when it fails (ChildFailed, whose ``reason`` is the child's
    exception in one line; a plain RuntimeError on a timeout)."""
    import json
    import signal
    import subprocess
    import sys

    code = ("import json, sys, importlib; a = json.loads(sys.stdin.read()); m, f = a['target'].split(':'); "
            "r = getattr(importlib.import_module(m), f)(**a['kwargs']); print('\\n@@RESULT@@' + json.dumps(r))")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        out, _ = p.communicate(json.dumps({"target": target, "kwargs": kwargs}), timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise RuntimeError(f"{target} did not finish within {timeout:.0f} s (killed)") from None
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # stage processes it may have left behind
        except (ProcessLookupError, PermissionError):
            pass
    if p.returncode != 0 or "@@RESULT@@" not in out:
        tail = " | ".join(out.strip().splitlines()[-3:])
        raise ChildFailed(f"{target} failed (exit {p.returncode}): {tail}", child_reason(out))
    return json.loads(out.rsplit("@@RESULT@@", 1)[1])
