"""The twin: run the engine on a grid of Plans, predict the same Plans with the simulator calibrated to this host, and
report measured vs predicted decode tokens/s (per user and aggregate) and TTFT with error factors exp(|ln(pred/meas)|).

Each engine run happens in a fresh child process (sim/twin_engine.py; killed with its stage processes on a timeout),
one torch thread per process. The simulator side uses only: the Plan, the model's ModelSpec accounting, the hardware
YAML that
`waferline calibrate` measured, the engine's op counts for the Plan (counted, not timed, in the child) and the measured
speculative acceptance of the run; never a time measured on the grid.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from waferline.errors import ConfigError, WaferlineError
from waferline.sim.calibrate.common import cpu_model, machine_differences, machine_identity
from waferline.sim.host_work import ChunkOps, Work, chunk_key, counted_op_count
from waferline.spec.configs import spec_from_pretrained

if TYPE_CHECKING:
    from waferline.plan.plan import Plan
    from waferline.sim.host import HostParams
    from waferline.spec.hardware import HardwareSpec
    from waferline.spec.model import ModelSpec

SPEC_METHODS = ("none", "ngram", "mtp")
# the most a grid point may ask for: sequences a point runs on this host, processes (micro-batches are a batch's
# parts), drafts a step (the planner's MAX_DRAFT_TOKENS); a batch of 10^20 built prompts until the point's timeout
POINT_LIMITS = {"batch": 4096, "micro_batches": 4096, "attention_ranks": 64, "ffn_ranks": 64, "k": 32}
POINT_TIMEOUT_S = 300.0
MEASURED_INPUTS = (
    "per-op and per-step engine overhead, GEMV/GEMM speed per dtype (fp32/bf16/int4), copy bandwidth, "
    "gloo link latency/bandwidth/CPU per message, pipeline per-hop overhead (all from `waferline calibrate`); "
    "aten op counts per layer of each Plan (counted from the engine, not timed); speculative acceptance "
    "(measured in each run)"
)
MODELLED_INPUTS = ("bytes and FLOPs per layer (ModelSpec accounting), experts touched per step, stage sums and hops, "
                   "the pipeline bound (micro-batches x busiest stage), the cores bound (processes vs cores), prefill "
                   "micro-batching, tokens per verify step from the acceptance")


class GridPointError(ConfigError):
    """A grid point with a wrong field; ``problem`` says which, without the point."""

    def __init__(self, message: str, problem: str):
        super().__init__(message)
        self.problem = problem


@dataclass
class GridPoint:
    """One engine configuration = one Plan: stages (1, 2, ... or "L" = one layer per stage), micro-batches, weight
    bits, speculation, batch (concurrent sequences), AFD."""

    name: str = ""
    stages: int | str = 1
    micro_batches: int = 1
    weight_bits: int = 16
    speculative: str = "none"
    k: int = 3
    batch: int = 1
    afd: bool = False
    attention_ranks: int = 1
    ffn_ranks: int = 1

    def __post_init__(self) -> None:
        where = f"grid point {self.name!r}" if isinstance(self.name, str) and self.name else "grid point"
        problem = self.problem()
        if problem:
            raise GridPointError(f"{where}: {problem}", problem)
        if not self.name:
            st = "L" if self.stages == "L" else str(self.stages)
            self.name = (
                (f"afd{self.attention_ranks}x{self.ffn_ranks}" if self.afd else f"S{st}")
                + (f"-M{self.micro_batches}" if self.stages != 1 or self.afd else "")
                + f"-{'int4' if self.weight_bits == 4 else 'bf16'}"
                + (f"-{self.speculative}{self.k}" if self.speculative != "none" else "")
                + f"-B{self.batch}"
            )

    def problem(self) -> str | None:
        """What is wrong with the point (a wrong type or value, or a field its engine would ignore), or None."""
        if not isinstance(self.name, str):
            return f"name must be a string, got {self.name!r}"
        if self.stages != "L" and (not _is_int(self.stages) or self.stages < 1):
            return f"stages must be a positive integer or 'L' (one layer per stage), got {self.stages!r}"
        for f in ("micro_batches", "weight_bits", "k", "batch", "attention_ranks", "ffn_ranks"):
            v = getattr(self, f)
            if not _is_int(v):
                return f"{f} must be an integer, got {v!r}"
            if v < 1:
                return f"{f} must be >= 1, got {v}"
            if v > POINT_LIMITS.get(f, v):
                return f"{f} must be at most {POINT_LIMITS[f]:,}, got {v:,}"
        if _is_int(self.stages) and self.stages > 4096:
            return f"stages must be at most 4,096 (or 'L'), got {self.stages:,}"
        if self.weight_bits not in (16, 4):
            return f"weight_bits must be 16 or 4, got {self.weight_bits}"
        if not isinstance(self.speculative, str) or self.speculative not in SPEC_METHODS:
            return f"speculative must be one of {', '.join(SPEC_METHODS)}, got {self.speculative!r}"
        if not isinstance(self.afd, bool):
            return f"afd must be true or false, got {self.afd!r}"
        if self.afd and self.stages != 1:  # (as `generate` refuses --afd with --stages)
            return (f"afd and stages are two different engines: drop stages ({self.stages!r}) from an AFD point "
                    "(its processes are attention_ranks + ffn_ranks)")
        if not self.afd and (self.attention_ranks != 1 or self.ffn_ranks != 1):
            return "attention_ranks and ffn_ranks need afd: true"
        if not self.afd and self.stages == 1 and self.micro_batches != 1:
            return "micro_batches needs stages 2+, stages L or afd: true (one process runs one batch)"
        return None

    @property
    def pipeline(self) -> bool:
        return self.stages != 1 and not self.afd


def _is_int(x: Any) -> bool:
    """An integer proper: not a bool (YAML's true), not a float, not a string of digits."""
    return isinstance(x, int) and not isinstance(x, bool)


def default_grid() -> list[GridPoint]:
    """16 Plans: stages 1 / 2 / one layer per stage, micro-batches 1 / 2 / 4 / L, bf16 vs int4, speculation off /
    ngram / mtp (also under the pipeline), batch 1 / 8, AFD (1 attention + 1 FFN rank) on/off."""
    G = GridPoint
    return [
        G(stages=1, batch=1),
        G(stages=1, batch=8),
        G(stages=1, weight_bits=4, batch=1),
        G(stages=1, weight_bits=4, batch=8),
        G(stages=2, micro_batches=1, batch=1),
        G(stages=2, micro_batches=2, batch=8),
        G(stages=2, micro_batches=4, batch=8),
        G(stages=2, micro_batches=2, weight_bits=4, batch=8),
        G(stages="L", micro_batches=1, batch=1),
        G(stages="L", micro_batches=8, batch=8),
        G(stages=1, speculative="ngram", batch=1),
        G(stages=1, speculative="mtp", batch=1),
        G(stages=1, speculative="mtp", batch=8),
        G(stages=2, micro_batches=2, speculative="ngram", batch=8),
        G(stages=2, micro_batches=1, speculative="mtp", batch=1),
        G(afd=True, micro_batches=2, batch=8),
    ]


def load_grid(grid: str | list[dict[str, Any]] | None) -> list[GridPoint]:
    """``default``, a YAML file with a list of grid points (fields of GridPoint), or such a list."""
    if grid is None or grid == "default":
        return default_grid()
    if isinstance(grid, str):
        p = Path(grid)
        if not p.is_file():
            raise ConfigError(f"no grid file at {p}; use --grid default or a YAML file with a list of points "
                              "(e.g. a line - {stages: 2, micro_batches: 2, batch: 8})")
        try:
            grid = yaml.safe_load(p.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p} is not valid YAML: {e}") from None
        if isinstance(grid, dict):
            grid = grid.get("points")
    if not isinstance(grid, list) or not grid:
        raise ConfigError("a grid is a non-empty list of points such as {stages: 2, micro_batches: 2, batch: 8}")
    out: list[GridPoint] = []
    for i, d in enumerate(grid, 1):
        if not isinstance(d, dict):
            raise ConfigError(f"grid point {i}: expected a mapping, got {d!r}")
        unknown = set(d) - set(GridPoint.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"grid point {i}: unknown field(s) {', '.join(sorted(map(str, unknown)))}; known: "
                              f"{', '.join(GridPoint.__dataclass_fields__)}")
        try:
            pt = GridPoint(**d)
        except GridPointError as e:
            raise ConfigError(f"grid point {i} ({d}): {e.problem}") from None
        if "k" in d and pt.speculative == "none":  # (as `generate` refuses --num-speculative-tokens without it)
            raise ConfigError(f"grid point {i} ({d}): k needs speculative ngram or mtp (without speculation it would "
                              "be ignored)")
        same = next((j for j, q in enumerate(out, 1) if q.name == pt.name), None)
        if same is not None:
            raise ConfigError(f"grid points {same} and {i} are both {pt.name}: give each Plan once (or a name)")
        out.append(pt)
    return out


def error_factor(pred: float | None, meas: float | None) -> float | None:
    """exp(|ln(pred / meas)|): 1.0 is exact, 2.0 is off by a factor of two either way."""
    if not pred or not meas or pred <= 0 or meas <= 0:
        return None
    return math.exp(abs(math.log(pred / meas)))


def accept_from_tokens_per_step(tokens_per_step: float, k: int) -> float:
    """The per-token acceptance α with (1 - α^(k+1)) / (1 - α) = the measured tokens per verify step."""
    from waferline.sim.cost import expected_tokens_per_step

    if tokens_per_step <= 1.0:
        return 0.0
    if tokens_per_step >= k + 1 - 1e-6:
        return 0.999
    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < tokens_per_step else (lo, mid)
    return 0.5 * (lo + hi)


# ----------------------------------------------------------------------------- the parent: plans, predictions, table


class CountedOps(ChunkOps):
    """An ops profile for sim.host from the counts of one grid point (decode at its micro-batch rows, prefill). A
    pipeline prompt longer than one chunk, or split where a micro-batch's budget ends, is priced chunk by chunk from
    each chunk's own forward counted at its position (``ops["prefill_chunks"]``: count_prefill_chunks), as the TTFT
    benchmark prices it (host_work.ChunkOps); a chunk not counted there falls back to the position-0 forward plus the
    attention term (host_work.prefill_chunk_count)."""

    def __init__(self, ops: dict[str, Any]):
        self.ops, self.counts, self.at_position, self.host = ops, ops.get("prefill_chunks") or {}, True, None

    @staticmethod
    def _count(d: dict[str, Any]) -> Any:
        return counted_op_count(d)

    def decode(self, rows: int, tokens: int) -> Any:
        return self._count(self.ops["decode"])

    def ffn(self, phase: str) -> dict[int, Any]:
        """The FFN part of each layer (what AFD's FFN ranks run), for ``decode`` or ``prefill``."""
        return {int(k): Work.from_counts(v.get("ops", 0.0), v) for k, v in (self.ops[phase].get("ffn") or {}).items()}

    def prefill(self, rows: int, prompt_len: int) -> Any:
        """The forward of ``rows`` x ``prompt_len`` at position 0 where counted, else the grid point's one counted
        prefill forward (its prompt, at its prefill rows)."""
        return self.count(rows, prompt_len, 0) or self._count(self.ops["prefill"])

    def prefill_ffn(self, rows: int, tokens: int, start: int) -> dict[int, Any] | None:
        """The FFN part of each layer of the counted prefill forward of ``rows`` x ``tokens`` at ``start`` (else at
        position 0: an FFN's work does not depend on the position); None where none was counted with it."""
        for key in (chunk_key(rows, tokens, start), chunk_key(rows, tokens, 0)):
            d = self.counts.get(key)
            if d is not None and "ffn" in d:
                return {int(k): Work.from_counts(v.get("ops", 0.0), v) for k, v in d["ffn"].items()}
        return None


def count_prefill_chunks(path: str, sweeps: list[list[int]], dtype: str = "bfloat16") -> dict[str, Any]:
    """Child process: the engine's op stream (sim/calibrate/opcount.py OpCounter, per layer and outside the layers;
    counted, not timed) of every prefill forward of each sweep (rows, prompt length, chunk): the prompts fed in chunks
    of ``chunk`` tokens into the same caches, as the pipeline feeds them (chunk = prompt length: the single process's
    one forward). Returns host_work.chunk_key(rows, tokens, start) -> {"layers": {i: work}, "ffn": {i: the layer's FFN
    part, within its work}, "other": work, "logits": whether the forward ends its prompts}."""
    import torch

    from waferline.engine.llm import LLM
    from waferline.model.context import StepBatch
    from waferline.sim.calibrate.opcount import OpCounter
    from waferline.sim.twin_engine import _both, _merged, label_layers, make_prompts

    torch.set_num_threads(1)
    llm = LLM(path, dtype=dtype)
    model = llm.model
    counter = OpCounter()
    hooks = label_layers(model, counter)
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for rows, P, chunk in sweeps:
            prompts = torch.tensor(make_prompts(llm.spec.vocab_size, rows, P))
            caches = model.new_caches(rows)
            for s in range(0, P, chunk):
                t = min(chunk, P - s)
                counter.counts, counter.work, counter.label = {}, {}, None
                with counter:
                    h = model(prompts[:, s:s + t], caches, StepBatch.make(list(range(rows)), [s] * rows, t))
                    if s + t >= P:
                        model.logits(h[:, -1]).argmax(-1)
                c = _merged(counter)
                key = chunk_key(rows, t, s)
                if key not in out:
                    out[key] = {"layers": {str(i): _both(c, i) for i in model.layer_range},
                                "ffn": {str(i): c.get(f"f{i}", {"ops": 0.0}) for i in model.layer_range},
                                "other": c.get(None, {"ops": 0.0}), "logits": s + t >= P}
    for h_ in hooks:
        h_.remove()
    llm.close()
    return out


def cache_dir() -> Path:
    d = Path(os.environ.get("WAFERLINE_CACHE", Path.home() / ".cache" / "waferline"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def cached_hardware(max_age_h: float = 24.0, recalibrate: bool = False, quick: bool = False,
                    progress: Callable[[str, float], None] | None = None) -> Path:
    """This host's calibrated hardware YAML: the cached one when younger than ``max_age_h``, else measured now."""
    from waferline.sim.calibrate.hardware_yaml import write_host_yaml

    host = (platform.node() or "host").lower().replace(" ", "-")
    p = cache_dir() / f"host-{host}{'-quick' if quick else ''}.yaml"
    if recalibrate or not p.is_file() or time.time() - p.stat().st_mtime > max_age_h * 3600:
        write_host_yaml(p, quick=quick, progress=progress)
    return p


def int4_checkpoint(path: Path) -> Path:
    """An int4 (RTN, group 128) copy of ``path`` in the cache (made once); an int4 checkpoint is returned as is."""
    import json

    from waferline.model.load import checkpoint_files
    from waferline.model.quant import QuantOptions, quant_method, quantize_checkpoint

    cfg = json.loads((path / "config.json").read_text())
    if quant_method(cfg) is not None:
        return path
    # (each weight file and config.json: a sharded checkpoint saved again, or its config edited, is quantized again)
    stamp = f"{path.resolve()}:" + ",".join(f"{f.name}:{f.stat().st_mtime}:{f.stat().st_size}"
                                           for f in (path / "config.json", *checkpoint_files(path)))
    out = cache_dir() / "int4" / (path.name + "-" + hashlib.sha1(stamp.encode()).hexdigest()[:10])  # stable across runs
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        quantize_checkpoint(str(path), str(out), QuantOptions())
    return out


def _plan_for(point: GridPoint, spec: ModelSpec, hw: HardwareSpec, prompt_len: int, output_len: int) -> Plan:
    from waferline.plan.place import place
    from waferline.plan.plan import SpeculativeConfig

    spc = SpeculativeConfig(method=point.speculative, num_tokens=point.k if point.speculative != "none" else 0)
    common = dict(
        weight_bits=point.weight_bits, context=prompt_len + output_len + 8, batch=point.batch, speculative=spc
    )
    if point.afd:
        return place(spec, hw, afd=True, attention_ranks=point.attention_ranks, ffn_ranks=point.ffn_ranks,
                     micro_batches=point.micro_batches, **common)
    if point.stages == "L":
        return place(spec, hw, layers_per_stage=1, micro_batches=point.micro_batches, **common)
    S = int(point.stages)
    if S > spec.num_layers:
        raise ConfigError(f"{point.name}: {S} stages for {spec.num_layers} layers")
    return place(spec, hw, devices=S, micro_batches=point.micro_batches if S > 1 else 1, **common)


def predict(
    plan: Plan,
    spec: ModelSpec,
    hw: HardwareSpec,
    host: HostParams,
    ops: dict[str, Any] | None,
    prompt_len: int,
    output_len: int,
    batch: int,
    accept: float | None,
) -> Any:
    """The simulator's prediction of ``plan`` on the calibrated host (sim.pipeline.simulate with host=)."""
    from waferline.sim.pipeline import simulate

    if accept is not None:
        plan.speculative.accept_rate = min(max(accept, 0.0), 0.999)
    return simulate(plan, prompt_len=prompt_len, output_len=output_len, concurrency=batch, spec=spec, hardware=hw,
                    host=host, ops=CountedOps(ops) if ops else None)


def run_twin(model: str | Path, hardware: str | Path | None = None, grid: Any = "default", *, prompt_len: int = 32,
             output_len: int = 32, repeats: int = 2, quick_calibration: bool = False, recalibrate: bool = False,
             progress: Callable[[str, float], None] | None = None, host_override: Any = None,
             timeout_s: float = POINT_TIMEOUT_S, drift_check: bool = True, passes: int = 2,
             canary_runs: bool = True) -> dict[str, Any]:
    """Run every grid point on the engine and the simulator; return rows, summary and provenance (JSON-able).
    ``passes``: measure the whole grid this many times (the second pass in reverse order, so no Plan is always first or
    last) and keep each Plan's fastest pass: this machine runs up to 1.3-2.4x slower for seconds to minutes at a time,
    longer than one Plan's runs, so repeats back to back do not see past it; the spread between passes is reported
    per Plan.
    ``drift_check`` (one pass only): run the first measured point once more at the end; how far its speed moved over
    the grid (``drift``) is how much of an error factor this machine's own drift accounts for.
    ``canary_runs`` (calibrations that recorded the canary): run the canary (calibrate.engine.Canary) before each
    Plan's every pass, and compare each Plan also at the machine's speed of its runs (``error_factor_at_canary``, see
    compare())."""
    from waferline.sim.host import HostParams
    from waferline.spec.hardware import load_hardware_file

    say = progress or (lambda what, frac: None)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {path}: not a checkpoint directory (no config.json); e.g. models/sol-mini")
    if prompt_len < 2 or output_len < 3:
        raise ConfigError("--prompt-len must be >= 2 and --output-len >= 3")
    if passes < 1:
        raise ConfigError("--passes must be >= 1")
    spec = spec_from_pretrained(path)
    check_context(spec, path, prompt_len, output_len)
    points = load_grid(grid)
    if hardware is None:
        say("calibrating this host (cached for a day)", 0.0)
        hardware = cached_hardware(recalibrate=recalibrate, quick=quick_calibration)
    hw_path = Path(hardware)
    hw = load_hardware_file(hw_path)
    host = host_override or HostParams.load(hw_path)
    note = calibration_note(host)
    has_mtp = bool(getattr(spec, "mtp_layers", None))
    canary = None
    if host.canary_s and canary_runs:  # the machine's speed before each Plan, against the calibration's (Canary)
        from waferline.sim.calibrate.engine import Canary

        say("loading the canary workload", 0.0)
        canary = Canary(cache_dir() / "calibration-models")
    try:
        result = _run_grid(
            points,
            path,
            spec,
            hw,
            host,
            hw_path,
            has_mtp,
            canary,
            prompt_len,
            output_len,
            repeats,
            passes,
            timeout_s,
            drift_check,
            say,
        )
    finally:
        if canary is not None:
            canary.close()
    result["calibration_note"] = note
    return result


def calibration_note(host: Any) -> str | None:
    """What says the calibration was measured on another machine than this one (its name, logical CPUs, CPU model or
    vector instructions differ, where it records them), or None: its figures then price another machine's engine."""
    diff = machine_differences(dict(host.measured, cores=host.cores), machine_identity())
    if not diff:
        return None
    return (f"the calibration {host.source} was measured on another machine ({', '.join(diff)}: calibrated vs this "
            "one); its predictions are that machine's: run `waferline calibrate` here")


def check_context(spec: ModelSpec, path: Path, prompt_len: int, output_len: int) -> None:
    """Refuse a prompt and output longer than the model's context (max_position_embeddings), which the engine refuses
    (LLM._check_len) in every Plan: said once, before anything runs."""
    ctx = spec.max_position_embeddings
    if prompt_len + output_len > ctx:
        raise ConfigError(
            f"--prompt-len {prompt_len} + --output-len {output_len} = {prompt_len + output_len} tokens exceeds the "
            f"context of {path} ({ctx} tokens, max_position_embeddings): lower --prompt-len or --output-len"
        )


def failure_reason(e: BaseException) -> str:
    """Why an isolated run failed, in one line: the child's exception (run_isolated's ``reason``: its last exception
    line, e.g. ``RequestError: prompt of ...``), else the error's own message (a timeout)."""
    return getattr(e, "reason", None) or " ".join(str(e).split())


def _run_grid(
    points: list[GridPoint],
    path: Path,
    spec: ModelSpec,
    hw: HardwareSpec,
    host: HostParams,
    hw_path: Path,
    has_mtp: bool,
    canary: Any,
    prompt_len: int,
    output_len: int,
    repeats: int,
    passes: int,
    timeout_s: float,
    drift_check: bool,
    say: Callable[[str, float], None],
) -> dict[str, Any]:
    from waferline.engine.inputs import is_int4_checkpoint
    from waferline.sim.calibrate.common import run_isolated
    from waferline.sim.host_params import PIPELINE_PREFILL_CHUNK
    from waferline.sim.host_work import afd_prefill_steps, chunk_sweeps, prefill_micro_batches

    def probe() -> float | None:
        return canary.seconds() if canary is not None else None

    rows = []
    todo: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (row, measure_point kwargs) of the Plans that ran
    int4_path: Path | None = None
    int4_failed: str | None = None  # why the int4 copy could not be made
    int4_model = is_int4_checkpoint(path)  # (the engine runs its int4 weights whatever the Plan's weight bits)
    first_run: tuple[str, dict[str, Any], float] | None = None  # (plan, measure_point kwargs, tokens/s per user)
    for i, pt in enumerate(points):
        say(f"{pt.name}: engine" + (f", pass 1 of {passes}" if passes > 1 else ""), (i + 0.1) / len(points) / passes)
        row: dict[str, Any] = {"plan": pt.name, "point": asdict(pt)}
        rows.append(row)
        if pt.speculative == "mtp" and not has_mtp:
            row["status"] = "not available: the model has no MTP layers"
            continue
        if pt.weight_bits == 16 and int4_model:
            row["status"] = f"not available: {path} is an int4 checkpoint; a 16-bit Plan needs the 16-bit one"
            continue
        try:
            plan = _plan_for(pt, spec, hw, prompt_len, output_len)
        except Exception as e:  # noqa: BLE001 - a point the planner cannot place is reported, not fatal
            row["status"] = f"not available: planner: {e}"
            continue
        ckpt = path
        if pt.weight_bits == 4:
            if int4_path is None and int4_failed is None:
                say("quantizing an int4 copy (cached)", (i + 0.1) / len(points) / passes)
                try:
                    int4_path = int4_checkpoint(path)
                except WaferlineError as e:  # (this Plan and the other int4 ones are not available; the rest run)
                    int4_failed = " ".join(str(e).split())
            if int4_path is None:
                row["status"] = f"not available: the int4 copy: {int4_failed}"
                continue
            ckpt = int4_path
        if pt.afd:  # rows per micro-batch on one attention rank; a prefill's: its whole prompts in one micro-batch
            Ba = math.ceil(pt.batch / max(1, sum(1 for s in plan.stages if s.role == "attention")))
            b = math.ceil(Ba / max(1, min(plan.micro_batches, Ba)))
            afd_groups = [g for step in afd_prefill_steps(Ba, prompt_len, PIPELINE_PREFILL_CHUNK, plan.micro_batches)
                          for mb in step for g in mb]
            prefill_rows = max((r for r, t, s in afd_groups if t == prompt_len and s == 0), default=1)
        else:
            M = plan.micro_batches if plan.num_stages > 1 else 1
            b = math.ceil(pt.batch / max(1, min(M, pt.batch)))
            prefill_rows = 1 if plan.num_stages == 1 else min(pt.batch, max(1, 256 // prompt_len))
        kwargs = {
            "path": str(ckpt),
            "point": asdict(pt),
            "plan_json": plan.to_json(indent=None) if pt.pipeline else None,
            "prompt_len": prompt_len,
            "output_len": output_len,
            "repeats": repeats,
            "decode_rows": b,
            "prefill_rows": prefill_rows,
        }
        try:
            canary_s = probe()
            meas = run_isolated("waferline.sim.twin_engine:measure_point", kwargs, timeout_s)
        except RuntimeError as e:
            why = failure_reason(e)
            if "ConfigError" in why or "does not run" in why or "unexpected keyword" in why or "not supported" in why:
                row["status"] = "not available: " + why.split(": ", 1)[-1]
            else:
                row["status"] = "engine failed: " + why
            continue
        row["measured"] = {k: meas[k] for k in ("tokens_per_s_per_user", "aggregate_tokens_per_s", "ttft_s")}
        row["passes"] = [dict(_pass_record(meas), canary_s=canary_s)]
        todo.append((row, kwargs))
        if first_run is None and meas["tokens_per_s_per_user"] > 0:
            first_run = (pt.name, kwargs, meas["tokens_per_s_per_user"])
        row["run"] = _run_record(meas)
        if pt.afd and any(g != (prefill_rows, prompt_len, 0) for g in afd_groups) or (
                plan.num_stages > 1 and not pt.afd and any(
                    g != (prefill_rows, prompt_len, 0)
                    for mb in prefill_micro_batches(pt.batch, prompt_len, PIPELINE_PREFILL_CHUNK) for g in mb)):
            # a prefill micro-batch other than the counted forward (a prompt longer than one chunk, or one split where
            # a chunk's budget ends; AFD's also split in the engine's micro-batches): each chunk's own forward at its
            # position, counted (untimed)
            cases = [(Ba, prompt_len)] if pt.afd else [(pt.batch, prompt_len)]
            try:
                meas["ops"]["prefill_chunks"] = run_isolated("waferline.sim.twin:count_prefill_chunks", {
                    "path": str(ckpt), "sweeps": [list(x) for x in chunk_sweeps(
                        cases, PIPELINE_PREFILL_CHUNK, plan.micro_batches if pt.afd else None)]}, timeout_s)
            except RuntimeError as e:
                row["status"] = "engine failed: counting the prefill chunks: " + failure_reason(e)
                continue
        row["ops"] = meas["ops"]
        accept = None
        if pt.speculative != "none":
            em = meas.get("engine_metrics", {})
            tps = em.get("spec_mean_accepted_length")
            if tps:
                accept = accept_from_tokens_per_step(tps, pt.k)
                row["acceptance"] = {"tokens_per_verify_step": tps, "alpha_fed": accept,
                                     "per_token_acceptance": em.get("spec_acceptance_rate")}
            elif em.get("spec_acceptance_rate") is not None:
                accept = em["spec_acceptance_rate"]
                row["acceptance"] = {"alpha_fed": accept, "per_token_acceptance": accept}
        say(f"{pt.name}: simulator", (i + 0.9) / len(points) / passes)
        try:
            sim = predict(plan, spec, hw, host, meas["ops"], prompt_len, output_len, pt.batch, accept)
        except ConfigError as e:
            row["status"] = f"measured; not modelled: {e}"
            continue
        row["plan_json"] = plan.to_json(indent=None)
        row["predicted"] = {"tokens_per_s_per_user": sim.decode_tokens_per_s_per_user,
                            "aggregate_tokens_per_s": sim.aggregate_tokens_per_s, "ttft_s": sim.ttft_s}
        compare(row, host)
        row["sim"] = {
            "bound": sim.bound,
            "stages": [asdict(s) for s in sim.stages],
            "host": sim.speculative.get("host", {}),
            "num_stages": sim.num_stages,
            "micro_batches": sim.micro_batches,
        }
        row["status"] = "ok"
    for p in range(2, passes + 1):
        order = todo[::-1] if p % 2 == 0 else todo
        for j, (row, kwargs) in enumerate(order):
            say(
                f"{row['plan']}: engine, pass {p} of {passes}", ((p - 1) * len(points) + j + 0.5) / len(points) / passes
            )
            try:
                canary_s = probe()
                again = run_isolated("waferline.sim.twin_engine:measure_point", dict(kwargs, count=False), timeout_s)
            except RuntimeError as e:
                row["passes"].append({"error": failure_reason(e)})
                continue
            row["passes"].append(dict(_pass_record(again), canary_s=canary_s))
            if again["tokens_per_s_per_user"] > row["measured"]["tokens_per_s_per_user"]:  # rates of the same run
                row["measured"]["tokens_per_s_per_user"] = again["tokens_per_s_per_user"]
                row["measured"]["aggregate_tokens_per_s"] = again["aggregate_tokens_per_s"]
                run = _run_record(again)  # (and how that run went: its load, its processes' share of the cores)
                run["engine_metrics"] = run["engine_metrics"] or row["run"]["engine_metrics"]
                # (row 0's token arrivals are recorded by the first pass only, which counts: the report's timeline)
                run["arrivals_row0"] = run["arrivals_row0"] or row["run"].get("arrivals_row0")
                row["run"] = run
            row["measured"]["ttft_s"] = min(row["measured"]["ttft_s"], again["ttft_s"])
    for row, _ in todo:
        rates = [q["tokens_per_s_per_user"] for q in row["passes"] if q.get("tokens_per_s_per_user")]
        if len(rates) > 1:
            row["pass_spread"] = max(rates) / min(rates)
        if row.get("predicted"):
            compare(row, host)
    drift = None
    if drift_check and passes == 1 and first_run is not None and len(points) > 1:
        say(f"{first_run[0]} again (the machine's drift over the grid)", 0.99)
        try:
            again = run_isolated("waferline.sim.twin_engine:measure_point", first_run[1], timeout_s)[
                "tokens_per_s_per_user"
            ]
            drift = {
                "plan": first_run[0],
                "start_tokens_per_s_per_user": first_run[2],
                "end_tokens_per_s_per_user": again,
                "factor": error_factor(again, first_run[2]),
            }
        except RuntimeError as e:
            drift = {"plan": first_run[0], "error": failure_reason(e)}
    say("done", 1.0)
    return {
        "drift": drift,
        "model": str(path.resolve()),
        "model_name": spec.name,
        "hardware": str(hw_path),
        "host": host.measured,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "prompt_len": prompt_len,
        "output_len": output_len,
        "repeats": repeats,
        "passes": passes,
        "threads_per_process": 1,
        "inputs": {"measured": MEASURED_INPUTS, "modelled": MODELLED_INPUTS},
        "canary": {"calibration_s": host.canary_s, "ran": canary is not None},
        "rows": rows,
        "summary": summarize(rows),
    }


def _run_record(meas: dict[str, Any]) -> dict[str, Any]:
    """How the run whose rates a row keeps went (its load, the share of the cores its processes got, ...)."""
    run = {k: meas.get(k) for k in ("total_s", "tokens", "cpu_s_per_process", "load_average_1m", "start_s",
                                    "engine_metrics", "arrivals_row0")}
    cpu = [c for c in (meas.get("cpu_s_per_process") or []) if c == c]
    if cpu and meas.get("total_s"):  # the share of the cores the engine's processes got (low: a busy machine)
        run["cpu_share"] = sum(cpu) / (meas["total_s"] * min(len(cpu), os.cpu_count() or 1))
    return run


def _pass_record(meas: dict[str, Any]) -> dict[str, Any]:
    """What one pass of one Plan measured (kept per pass in the result)."""
    return {k: meas.get(k) for k in ("tokens_per_s_per_user", "aggregate_tokens_per_s", "ttft_s", "ttft_s_runs",
                                     "load_average_1m")}


def compare(row: dict[str, Any], host: Any) -> None:
    """A Plan's error factors; and, where the canary ran before its passes and the calibration recorded it, how much
    slower (> 1) or faster the machine ran then than during the calibration (``machine_factor``: the shortest canary
    time of its passes over the calibration's, as the fastest of its passes is what is kept) and the error factors
    with the prediction scaled by it (``error_factor_at_canary``: rates / factor, TTFT x factor). The canary is a
    fixed engine workload, not the Plan: the scaled comparison stays a prediction, with the machine's speed of that
    minute measured apart."""
    m, p = row["measured"], row["predicted"]
    row["error_factor"] = {k: error_factor(p[k], m[k]) for k in m}
    runs = [q["canary_s"] for q in row.get("passes", []) if q.get("canary_s")]
    if not (runs and getattr(host, "canary_s", None)):
        row.pop("machine_factor", None)
        row.pop("error_factor_at_canary", None)
        return
    f = min(runs) / host.canary_s
    row["machine_factor"] = f
    scaled = {k: (p[k] * f if k == "ttft_s" else p[k] / f) if p[k] is not None else None for k in p}
    row["error_factor_at_canary"] = {k: error_factor(scaled[k], m[k]) for k in m}


def repredict(result: dict[str, Any], host: Any) -> dict[str, Any]:
    """The same twin result with every prediction redone from ``host`` (other hardware figures), measurements kept:
    shows how the error factors depend on the figures (a wrong figure must make them worse)."""
    import copy

    from waferline.plan.plan import Plan
    from waferline.spec.hardware import load_hardware_file

    out = copy.deepcopy(result)
    spec = spec_from_pretrained(Path(result["model"]))
    hw = load_hardware_file(result["hardware"])
    for row in out["rows"]:
        if row.get("status") != "ok":
            continue
        plan = Plan.from_json(row["plan_json"])
        sim = predict(
            plan,
            spec,
            hw,
            host,
            row["ops"],
            result["prompt_len"],
            result["output_len"],
            row["point"]["batch"],
            plan.speculative.accept_rate,
        )
        row["predicted"] = {"tokens_per_s_per_user": sim.decode_tokens_per_s_per_user,
                            "aggregate_tokens_per_s": sim.aggregate_tokens_per_s, "ttft_s": sim.ttft_s}
        compare(row, host)
    out["summary"] = summarize(out["rows"])
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and max error factor over every predicted metric (and per metric)."""
    out: dict[str, Any] = {}
    allf = []
    for m in ("tokens_per_s_per_user", "aggregate_tokens_per_s", "ttft_s"):
        fs = [r["error_factor"][m] for r in rows if r.get("status") == "ok" and r["error_factor"].get(m)]
        allf += fs
        out[m] = {"median": statistics.median(fs) if fs else None, "max": max(fs) if fs else None, "n": len(fs)}
    out["all"] = {
        "median": statistics.median(allf) if allf else None,
        "max": max(allf) if allf else None,
        "n": len(allf),
    }
    at = [f for r in rows if r.get("status") == "ok" for f in (r.get("error_factor_at_canary") or {}).values() if f]
    mf = [r["machine_factor"] for r in rows if r.get("status") == "ok" and r.get("machine_factor")]
    if at:  # the same comparison with each prediction scaled by the machine's speed at its Plan's runs (compare())
        out["at_canary"] = {"median": statistics.median(at), "max": max(at), "n": len(at),
                            "machine_factor": {"median": statistics.median(mf), "min": min(mf), "max": max(mf)}}
    spread = [r["pass_spread"] for r in rows if r.get("pass_spread")]
    if spread:  # how far one Plan's passes lay apart: the machine's own noise, for reading the error factors
        out["pass_spread"] = {"median": statistics.median(spread), "max": max(spread), "n": len(spread)}
    out["plans_compared"] = sum(1 for r in rows if r.get("status") == "ok")
    out["plans_skipped"] = [{"plan": r["plan"], "status": r.get("status")} for r in rows if r.get("status") != "ok"]
    return out


def render(result: dict[str, Any], console: Any) -> None:
    """The twin table (rich): names, paths and messages in it printed as they are, not as markup."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(
        title=f"twin: {escape(result['model_name'])} on {escape(result['machine'])} ({result['cores']} cores, 1 thread "
        f"per process; prompt {result['prompt_len']}, {result['output_len']} new tokens; load average "
        f"{result['load_average'][0]:.2f})"
    )
    for c in ("plan", "stages", "M", "B", "tok/s/user meas", "pred", "err x", "agg tok/s meas", "pred", "err x",
              "TTFT ms meas", "pred", "err x", "accept", "bound / status"):
        t.add_column(c, justify="left" if c in ("plan", "bound / status") else "right")

    def col(e: float | None) -> str:
        if e is None:
            return "-"
        c = "green" if e <= 1.1 else "yellow" if e <= 1.5 else "red"
        return f"[{c}]{e:.2f}[/{c}]"

    for r in result["rows"]:
        pt = r["point"]
        st = "afd" if pt["afd"] else str(pt["stages"])
        if r.get("status") != "ok" and "measured" not in r:
            t.add_row(escape(r["plan"]), st, str(pt["micro_batches"]), str(pt["batch"]), *["-"] * 10,
                      escape(r.get("status", "")))
            continue
        m, p, e = r["measured"], r.get("predicted", {}), r.get("error_factor", {})
        acc = r.get("acceptance", {}).get("alpha_fed")
        t.add_row(
            escape(r["plan"]),
            st,
            str(r.get("sim", {}).get("micro_batches", pt["micro_batches"])),
            str(pt["batch"]),
            f"{m['tokens_per_s_per_user']:.1f}",
            f"{p['tokens_per_s_per_user']:.1f}" if p else "-",
            col(e.get("tokens_per_s_per_user")),
            f"{m['aggregate_tokens_per_s']:.1f}",
            f"{p['aggregate_tokens_per_s']:.1f}" if p else "-",
            col(e.get("aggregate_tokens_per_s")),
            f"{m['ttft_s'] * 1e3:.1f}",
            f"{p['ttft_s'] * 1e3:.1f}" if p else "-",
            col(e.get("ttft_s")),
            f"{acc:.2f}" if acc is not None else "",
            escape(r.get("sim", {}).get("bound", "")[:70] if r.get("status") == "ok" else r.get("status", "")),
        )
    console.print(t)
    s = result["summary"]
    for k, label in (("tokens_per_s_per_user", "tokens/s per user"), ("aggregate_tokens_per_s", "aggregate tokens/s"),
                     ("ttft_s", "TTFT"), ("all", "all metrics")):
        v = s[k]
        if v["n"]:
            what = "figures (plans x metrics)" if k == "all" else "plans"
            console.print(f"{label}: median error x{v['median']:.3f}, max x{v['max']:.3f} over {v['n']} {what}")
    for line in (drift_line(result), canary_line(result)):
        if line:
            console.print(line, markup=False)
    if result.get("calibration_note"):
        console.print(f"note: {result['calibration_note']}", style="yellow", markup=False)
    console.print(f"measured inputs: {result['inputs']['measured']}")
    console.print(f"modelled: {result['inputs']['modelled']}")
    console.print(f"hardware: {result['hardware']} (calibrated {result['host'].get('date', '?')}, load average then "
                  f"{result['host'].get('load_average_1m', float('nan')):.2f})", markup=False)


def markdown(result: dict[str, Any]) -> str:
    """The twin table as Markdown (for docs)."""
    lines = [
        f"`{result['model_name']}`, {result['date']}, {result['machine']} ({result['cores']} cores), load average "
        f"{result['load_average'][0]:.2f} at the end; prompt {result['prompt_len']}, {result['output_len']} new "
        "tokens, "
        f"best of {result['repeats']} runs"
        + (f" in each of {result['passes']} passes" if result.get("passes", 1) > 1 else "")
        + ". load = 1-minute load average at the run; CPU share = CPU seconds of the engine's "
        "processes / (wall x the cores they could use): well below 1 for a single process means other work took the "
        "core.",
        "",
        "| Plan | tok/s/user meas | pred | err x | aggregate meas | pred | err x | TTFT ms meas | pred | err x | "
        "accept α | load | CPU share | tok/s/user per pass | machine x |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "measured" not in r:
            lines.append(f"| {r['plan']} | {r.get('status', '')} |  |  |  |  |  |  |  |  |  |  |  |  |  |")
            continue
        m, p, e = r["measured"], r.get("predicted", {}), r.get("error_factor", {})

        def f(x: Any, d: int = 1) -> str:
            return "-" if x is None else f"{x:.{d}f}"
        acc = (r.get("acceptance") or {}).get("alpha_fed")
        load = (r.get("run") or {}).get("load_average_1m") or [None]
        lines.append(
            f"| {r['plan']} | {f(m['tokens_per_s_per_user'])} | {f(p.get('tokens_per_s_per_user'))} | "
            f"{f(e.get('tokens_per_s_per_user'), 2)} | {f(m['aggregate_tokens_per_s'])} | "
            f"{f(p.get('aggregate_tokens_per_s'))} | {f(e.get('aggregate_tokens_per_s'), 2)} | "
            f"{f(m['ttft_s'] * 1e3)} | {f(p['ttft_s'] * 1e3 if p else None)} | {f(e.get('ttft_s'), 2)} | "
            f"{f(acc, 2) if acc is not None else ''} | {f(load[0], 1)} | "
            f"{f((r.get('run') or {}).get('cpu_share'), 2)} | "
            + " / ".join(f(q.get("tokens_per_s_per_user")) for q in r.get("passes", []))
            + " | "
            + f(r.get("machine_factor"), 2)
            + " |"
        )
    s = result["summary"]
    lines.append("")
    lines.append("; ".join(f"{label}: median **x{s[k]['median']:.2f}**, max x{s[k]['max']:.2f}" for k, label in
                           (("tokens_per_s_per_user", "tokens/s per user"), ("aggregate_tokens_per_s", "aggregate"),
                            ("ttft_s", "TTFT"), ("all", "all")) if s[k]["n"]) + f" ({s['plans_compared']} Plans).")
    for line in (drift_line(result), canary_line(result), result.get("calibration_note")):
        if line:
            lines.append("")
            lines.append(line + ".")
    return "\n".join(lines)


def canary_line(result: dict[str, Any]) -> str | None:
    """One sentence on the canary (compare()): how fast the machine ran at the Plans' runs against the calibration,
    and the error factors with each prediction scaled by that."""
    c = (result.get("summary") or {}).get("at_canary")
    if not c:
        return None
    mf = c["machine_factor"]
    return (f"the canary (a fixed engine workload, run before each Plan's every pass) took x{mf['median']:.2f} its "
            f"calibration time in median ({mf['min']:.2f}-{mf['max']:.2f} per Plan, 'machine x'; > 1: the machine ran "
            f"slower than when calibrated); with each prediction scaled by it: median error x{c['median']:.2f}, max "
            f"x{c['max']:.2f} over {c['n']} metrics")


def drift_line(result: dict[str, Any]) -> str | None:
    """One sentence on how far the machine itself moved over the grid: the spread between a Plan's passes, or (one
    pass) the first Plan measured again at the end."""
    sp = (result.get("summary") or {}).get("pass_spread")
    if sp:
        worst = max((r for r in result["rows"] if r.get("pass_spread")), key=lambda r: r["pass_spread"])
        return (
            f"machine noise: each Plan measured in {result.get('passes')} passes over the grid, the fastest kept; one "
            f"Plan's passes lay x{sp['median']:.2f} apart in median, x{sp['max']:.2f} at most ({worst['plan']}): "
            "error factors within that are this machine's own noise"
        )
    d = result.get("drift") or {}
    if "factor" not in d:
        return None
    return (
        f"machine drift: {d['plan']} measured again after the grid ran {d['end_tokens_per_s_per_user']:.1f} tok/s per "
        f"user against {d['start_tokens_per_s_per_user']:.1f} at the start (x{d['factor']:.2f}): error factors "
        f"within that are this machine's own noise"
    )
