"""The host-engine cost model: how long waferline's own CPU engine takes for a Plan on a calibrated machine.

A stage process's decode step is priced op by op over the engine's own op stream (counted, not timed, by the twin):
  linear calls (x W^T, int4,       the measured linear table (seconds per call by rows and weight bytes) x linear_scale,
  the expert products in moe_ffn)  + a fitted in-engine cost per oneDNN/MKL product of 2+ rows
  fused operators (waferline.      measured t0 + work units / rate
  kernels: mla_decode, ssm_update,
  mamba2_mix, silu_mul, rms_norm)
  other matmuls (attention, scans) roofline: bytes / bandwidth + FLOPs / FLOP/s of the measured linear fit
  every other aten op              the per-op overhead + its bytes at the measured elementwise bandwidth
plus per-sequence work (sampling on the head's stage) and the scheduler's per-step overhead,
all measured/fitted by `waferline calibrate` on calibration models. Between stages one message costs the measured
pipeline hop + bytes / link bandwidth. With S stage processes on C cores, a micro-batch cycle is bounded by the round
trip, by M x the busiest stage and by M x all stages' CPU work / C. Speculative decoding: a cycle is one verify step
and emits (1 - a^(k+1)) / (1 - a) tokens. AFD: attention and FFN sides ping-pong per layer.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import yaml

from waferline.errors import ConfigError

OVERSUB_KEYS = ("stages", "m1_step_cpu_s", "m1_cpu_inflation", "m1_wall_per_cpu", "mS_step_cpu_s", "mS_cpu_inflation")
PREFILL_PROBE_TOKENS = 32  # tokens of calibrate's one-prompt prefill probe (sim.measure)
PIPELINE_PREFILL_CHUNK = 256  # engine/pipeline.py DEFAULT_PREFILL_CHUNK: prompt tokens per prefill micro-batch


ENGINE_FEW_ROWS = 8  # = waferline.model.layers.FEW_ROWS (tests check): bf16 products the engine's own kernel runs
# (8 on every CPU since session 22; calibrations from before it record 4 where oneDNN had bf16 GEMMs: engine_few_rows)


def _v(x: Any, where: str) -> float:
    if isinstance(x, dict):
        if "value" not in x:
            raise ConfigError(f"{where}: a mapping without 'value'")
        x = x["value"]
    try:
        return float(x)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a number, got {x!r}") from None


@dataclass(frozen=True)
class LinearFit:
    """Seconds of one linear call = t0 + bytes / bytes_per_s + flops / flops_per_s (t0 is part of the per-op cost)."""

    t0_s: float
    bytes_per_s: float
    flops_per_s: float

    def time(self, nbytes: float, flops: float) -> float:
        return nbytes / self.bytes_per_s + flops / self.flops_per_s


@dataclass(frozen=True)
class LinearTable:
    """Measured seconds per linear call (x W^T) by token count m and weight bytes: linear in m between measured
    counts, log-log in bytes between measured sizes; beyond the largest size, proportional to bytes; beyond the largest
    m, proportional to m."""

    m: tuple[int, ...]
    nbytes: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]  # [i_m][j_bytes]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LinearTable":
        return cls(tuple(int(x) for x in d["m"]), tuple(float(x) for x in d["bytes"]),
                   tuple(tuple(float(x) for x in row) for row in d["seconds"]))

    def _at_m(self, i: int, b: float) -> float:
        bs, row = self.nbytes, self.seconds[i]
        if b <= bs[0]:
            return row[0]
        if b >= bs[-1]:
            return row[-1] * b / bs[-1]
        j = next(j for j in range(1, len(bs)) if bs[j] >= b)
        f = math.log(b / bs[j - 1]) / math.log(bs[j] / bs[j - 1])
        return math.exp(math.log(row[j - 1]) * (1 - f) + math.log(row[j]) * f)

    def time(self, m: int, nbytes: float) -> float:
        ms = self.m
        if m <= ms[0]:
            return self._at_m(0, nbytes)
        if m >= ms[-1]:
            return self._at_m(len(ms) - 1, nbytes) * m / ms[-1]
        i = next(i for i in range(1, len(ms)) if ms[i] >= m)
        f = (m - ms[i - 1]) / (ms[i] - ms[i - 1])
        return self._at_m(i - 1, nbytes) * (1 - f) + self._at_m(i, nbytes) * f

    def scaled(self, factor: float) -> "LinearTable":
        return replace(self, seconds=tuple(tuple(x * factor for x in row) for row in self.seconds))


def _sized(eng: dict[str, Any], key: str, where: str) -> dict[str, tuple[float, float]]:
    """compute dtype -> (tokens, value) of a figure measured at a stated prefill size."""
    return {k: (_v(v[key]["tokens"], where), _v(v[key], where)) for k, v in eng.items()
            if isinstance(v.get(key), dict) and "tokens" in v[key]}


def _chain_wall_per_cpu(pipe: dict[str, Any], where: str) -> float | None:
    """The pipeline's chain_wall_per_cpu figure; for calibrations written before it, the median over their stored
    2-stage probes (per-token wall time / CPU of both processes per token); None without either."""
    if "chain_wall_per_cpu" in pipe:
        return _v(pipe["chain_wall_per_cpu"], where)
    r = [p["per_token_s"] / p["pipeline_cpu_s"] for p in pipe.get("probes") or []
         if p.get("pipeline_cpu_s") and p.get("per_token_s")]
    return statistics.median(r) if r else None


@dataclass(frozen=True)
class HostParams:
    """What `waferline calibrate` measured about this host and the engine on it (the ``host_engine`` YAML section)."""

    cores: int
    memory_bandwidth: float  # one thread, copy (DRAM)
    cache_bandwidth: float  # one thread, copy of a working set that stays in cache
    small_op_bytes: float  # non-matmul ops at most this big run from cache
    linear: dict[str, LinearFit]  # fp32 | bf16 | int4
    tables: dict[str, LinearTable]  # fp32 | bf16 | int4: seconds per linear call (measured sweep, weights from memory)
    op_overhead_s: dict[str, float]  # engine compute dtype (fp32 | bf16) -> seconds per aten op
    linear_scale: dict[str, float]  # engine compute dtype -> in-engine linear time / the isolated sweep's (cache-resident)
    row_overhead_s: dict[str, float]  # engine compute dtype -> the loop's Python seconds per sequence per step
    row_layer_overhead_s: dict[str, float]  # engine compute dtype -> seconds per sequence per layer per step (old files)
    prefill: dict[str, tuple[float, float, float]]  # engine compute dtype -> (per-op, linear scale, per prompt) in prefill
    step_overhead_s: dict[str, float]  # per decode step of the single-process engine / the pipeline scheduler
    spec_step_overhead_s: dict[str, float]  # per verify step of the speculative engine (Python work without aten ops)
    ops_per_layer: dict[str, float]  # default op count when no engine profile is given
    link_latency_s: float
    link_bytes_per_s: float
    link_cpu_s: float  # CPU seconds per message (each side)
    hop_overhead_s: float  # the pipeline engine's extra seconds per hop (stage loop, packing) beyond the link latency
    hop_latency_s: float | None = None  # one pipeline hop as the engine sees it (measured on a 2-stage pipeline)
    parallel_ceiling: float | None = None  # what one process per core gets together, in cores (measured; <= cores)
    tables_hot: dict[str, LinearTable] = field(default_factory=dict)  # the same with the weights in the caches
    llc_bytes: float | None = None  # last-level cache: a host whose weights fit in it prices linears from tables_hot
    linear_scale_dram: dict[str, float] = field(default_factory=dict)  # the same for weights read from memory
    linear_scale_dram_multi: dict[str, float] = field(default_factory=dict)  # the same for products of 2+ rows
    hop_vs_idle: tuple[tuple[float, float], ...] = ()  # (receiver idle s, hop s) measured on 2-stage pipelines
    stage_step_cpu_s: float | None = None  # a stage process's CPU per micro-batch step besides computing (measured)
    # a stage process's compute takes this much more CPU than in one process (cold caches after each wake-up; fitted
    # with stage_step_cpu_s on the calibration pipelines; 0: stage_step_cpu_s is the old median of fixed + inflation)
    stage_cpu_inflation: float = 0.0
    elementwise: dict[str, float] = field(default_factory=dict)  # "fp32_small" | "fp32_large" | "bf16_small" | ... -> bytes/s
    prefill_int4_scale: dict[str, float] = field(default_factory=dict)  # compute dtype -> prefill scale of int4 linears
    afd_message_cpu_s: float | None = None  # CPU per AFD message besides compute (measured on an AFD calibration run)
    afd_overlapped_hop_s: float | None = None  # one AFD message's link time while both sides work (measured, 2 mbs)
    afd_overlapped_message_cpu_s: float | None = None  # CPU per AFD message end at several rows in 2 mbs (measured)
    # engine compute dtype -> in-engine seconds per 16-bit linear call of 2+ rows beyond its table price (fitted)
    multi_call_overhead_s: dict[str, float] = field(default_factory=dict)
    engine_few_rows: int = ENGINE_FEW_ROWS  # bf16 products of up to this many rows run the engine's own kernel here
    fused: dict[str, tuple[float, float]] = field(default_factory=dict)  # fused operator -> (t0 s, work units per s)
    prefill_scale_dram: dict[str, float] = field(default_factory=dict)  # prefill linear scale, weights from memory
    # the same scale measured on a prefill forward of several prompts at once: compute dtype -> (tokens in that
    # forward, scale); a forward of n tokens takes the scale interpolated (log-log) between the one-prompt probe's
    # tokens and these, flat outside
    prefill_scale_dram_batch: dict[str, tuple[float, float]] = field(default_factory=dict)
    # the same prefills' other ops (per-op cost + bytes + fused operators) measured (profiler) over priced: compute
    # dtype -> at one prompt, and (tokens, ratio) at the batch; interpolated like the linear scale
    prefill_rest_dram: dict[str, float] = field(default_factory=dict)
    prefill_rest_dram_batch: dict[str, tuple[float, float]] = field(default_factory=dict)
    # calibrations that price matmuls without a weight (attention, scans) at their roofline, apart from the linear
    # scale (older ones folded them into it, and the model scales them as those fits did)
    other_mm_unscaled: bool = False
    # more stage processes than cores (measured on a one-layer-per-stage pipeline): "m1_step_cpu_s",
    # "m1_cpu_inflation", "m1_wall_per_cpu" (one micro-batch: a serial chain of wake-ups), "mS_step_cpu_s",
    # "mS_cpu_inflation" (as many micro-batches as stages: every process busy), "stages" (of the probe)
    oversubscribed: dict[str, float] = field(default_factory=dict)
    # one micro-batch through a pipeline is a serial chain of stage steps: its wall time per CPU second of all the
    # stage processes (measured on the 2-stage probes; ~0.9-1.0: what a hop costs beyond CPU is waking up)
    chain_wall_per_cpu: float | None = None
    # the canary's wall seconds per token during the calibration (measure.Canary): twin compares each Plan's own
    # canary run with it (None: calibrated before the canary existed)
    canary_s: float | None = None
    source: str = ""
    measured: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "<host_engine>") -> "HostParams":
        he = d.get("host_engine") if "host_engine" in d else d
        if not isinstance(he, dict):
            raise ConfigError(f"{where}: no host_engine section; run `waferline calibrate` on this machine to write one")
        try:
            lin = {k: LinearFit(_v(v["t0_s"], where), _v(v["bytes_per_s"], where), _v(v["flops_per_s"], where))
                   for k, v in (he.get("linear") or {}).items()}
            tabs = {k: LinearTable.from_dict(v["table"]) for k, v in (he.get("linear") or {}).items() if v.get("table")}
            eng = he["engine"]
            link = he.get("link") or {}
            pipe = he.get("pipeline") or {}
            bw = _v(he["memory_bandwidth_1_thread"], where)
            return cls(cores=int(_v(he["cores"], where)), memory_bandwidth=bw,
                       cache_bandwidth=_v(he.get("cache_bandwidth_1_thread", bw), where),
                       small_op_bytes=_v(he.get("small_op_bytes", 1 << 20), where), linear=lin, tables=tabs,
                       op_overhead_s={k: _v(v["op_overhead_s"], where) for k, v in eng.items()},
                       linear_scale={k: _v(v.get("linear_scale", 1.0), where) for k, v in eng.items()},
                       linear_scale_dram={k: _v(v["linear_scale_dram"], where) for k, v in eng.items()
                                          if isinstance(v.get("linear_scale_dram"), dict) and "value" in v["linear_scale_dram"]},
                       linear_scale_dram_multi={k: _v(v["linear_scale_dram_multi"], where) for k, v in eng.items()
                                                if isinstance(v.get("linear_scale_dram_multi"), dict)
                                                and "value" in v["linear_scale_dram_multi"]},
                       row_overhead_s={k: _v(v.get("row_overhead_s", 0.0), where) for k, v in eng.items()},
                       row_layer_overhead_s={k: _v(v.get("row_layer_overhead_s", 0.0), where) for k, v in eng.items()},
                       prefill={k: (_v(v.get("prefill_op_overhead_s", v["op_overhead_s"]), where),
                                    _v(v.get("prefill_linear_scale", v.get("linear_scale", 1.0)), where),
                                    _v(v.get("prefill_overhead_s", 0.0), where)) for k, v in eng.items()},
                       step_overhead_s={k: _v(v["step_overhead_s"], where) for k, v in eng.items()},
                       spec_step_overhead_s={k: _v(v.get("spec_step_overhead_s", v["step_overhead_s"]), where) for k, v in eng.items()},
                       ops_per_layer={k: _v(v["ops_per_layer"], where) for k, v in eng.items()},
                       link_latency_s=_v(link.get("latency_s", 1e-4), where), link_bytes_per_s=_v(link.get("bytes_per_s", 1e9), where),
                       link_cpu_s=_v(link.get("cpu_per_message_s", 0.0), where),
                       hop_overhead_s=_v(pipe.get("hop_overhead_s", 0.0), where),
                       hop_latency_s=_v(pipe["hop_latency_s"], where) if "hop_latency_s" in pipe else None, source=where,
                       parallel_ceiling=_v(he["parallel_ceiling"], where) if "parallel_ceiling" in he else None,
                       engine_few_rows=int(_v(he.get("engine_few_rows", ENGINE_FEW_ROWS), where)),
                       tables_hot={k: LinearTable.from_dict(v["table_hot"]) for k, v in (he.get("linear") or {}).items()
                                   if v.get("table_hot")},
                       llc_bytes=_v(he["llc_bytes"], where) if "llc_bytes" in he else None,
                       stage_step_cpu_s=_v(pipe["stage_step_cpu_s"], where) if "stage_step_cpu_s" in pipe else None,
                       stage_cpu_inflation=_v(pipe["stage_cpu_inflation"], where) if "stage_cpu_inflation" in pipe else 0.0,
                       afd_message_cpu_s=_v(pipe["afd_message_cpu_s"], where)
                       if isinstance(pipe.get("afd_message_cpu_s"), dict) and pipe["afd_message_cpu_s"].get("value") is not None
                       else None,
                       afd_overlapped_hop_s=_v(pipe["afd_overlapped_hop_s"], where)
                       if isinstance(pipe.get("afd_overlapped_hop_s"), dict) else None,
                       afd_overlapped_message_cpu_s=_v(pipe["afd_overlapped_message_cpu_s"], where)
                       if isinstance(pipe.get("afd_overlapped_message_cpu_s"), dict) else None,
                       hop_vs_idle=tuple(sorted((float(a), float(b)) for a, b in (pipe.get("hop_vs_idle") or {}).get("points", []))),
                       elementwise={k: _v(v, where) for k, v in (he.get("elementwise") or {}).items()},
                       prefill_int4_scale={k: _v(v["prefill_linear_scale_int4"], where) for k, v in eng.items()
                                           if isinstance(v.get("prefill_linear_scale_int4"), dict)
                                           and "value" in v["prefill_linear_scale_int4"]},
                       prefill_scale_dram={k: _v(v["prefill_linear_scale_dram"], where) for k, v in eng.items()
                                           if isinstance(v.get("prefill_linear_scale_dram"), dict)},
                       prefill_scale_dram_batch=_sized(eng, "prefill_linear_scale_dram_batch", where),
                       prefill_rest_dram={k: _v(v["prefill_rest_scale_dram"], where) for k, v in eng.items()
                                          if isinstance(v.get("prefill_rest_scale_dram"), dict)},
                       prefill_rest_dram_batch=_sized(eng, "prefill_rest_scale_dram_batch", where),
                       other_mm_unscaled=bool(he.get("other_matmuls_at_roofline", False)),
                       canary_s=_v(he["canary_s"], where) if isinstance(he.get("canary_s"), dict) else None,
                       fused={k: (_v(v["t0_s"], where), _v(v["units_per_s"], where))
                              for k, v in (he.get("fused_ops") or {}).items()},
                       multi_call_overhead_s={k: _v(v["multi_call_overhead_s"], where) for k, v in eng.items()
                                              if v.get("multi_call_overhead_s") is not None},
                       oversubscribed={k: _v(v, where) for k, v in (pipe.get("oversubscribed") or {}).items()
                                       if k in OVERSUB_KEYS},
                       chain_wall_per_cpu=_chain_wall_per_cpu(pipe, where),
                       measured=dict(he.get("measured") or {}))
        except KeyError as e:
            raise ConfigError(f"{where}: host_engine is missing {e.args[0]!r}; re-run `waferline calibrate`") from None

    @classmethod
    def load(cls, path: str | Path) -> "HostParams":
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"no hardware file at {p}")
        return cls.from_dict(yaml.safe_load(p.read_text()) or {}, str(p))

    def linear_for(self, weight_bits: int, compute: str) -> LinearFit:
        key = "int4" if weight_bits == 4 else compute
        if key not in self.linear:
            key = next(iter(self.linear), None)  # type: ignore[arg-type]
            if key is None:
                raise ConfigError(f"{self.source}: no linear (GEMV) measurements; re-run `waferline calibrate`")
        return self.linear[key]

    def scaled(self, *, bandwidth: float = 1.0, op_overhead: float = 1.0, link_latency: float = 1.0) -> "HostParams":
        """A copy with figures multiplied (to show that a wrong figure makes predictions worse)."""
        return replace(self, memory_bandwidth=self.memory_bandwidth * bandwidth, cache_bandwidth=self.cache_bandwidth * bandwidth,
                       linear={k: replace(v, bytes_per_s=v.bytes_per_s * bandwidth) for k, v in self.linear.items()},
                       tables={k: v.scaled(1.0 / bandwidth) for k, v in self.tables.items()},
                       tables_hot={k: v.scaled(1.0 / bandwidth) for k, v in self.tables_hot.items()},
                       elementwise={k: v * bandwidth for k, v in self.elementwise.items()},
                       op_overhead_s={k: v * op_overhead for k, v in self.op_overhead_s.items()},
                       step_overhead_s={k: v * op_overhead for k, v in self.step_overhead_s.items()},
                       row_overhead_s={k: v * op_overhead for k, v in self.row_overhead_s.items()},
                       row_layer_overhead_s={k: v * op_overhead for k, v in self.row_layer_overhead_s.items()},
                       multi_call_overhead_s={k: v * op_overhead for k, v in self.multi_call_overhead_s.items()},
                       fused={k: (t0 * op_overhead, rate * bandwidth) for k, (t0, rate) in self.fused.items()},
                       prefill={k: (v[0] * op_overhead, v[1], v[2] * op_overhead) for k, v in self.prefill.items()},
                       spec_step_overhead_s={k: v * op_overhead for k, v in self.spec_step_overhead_s.items()},
                       link_latency_s=self.link_latency_s * link_latency, hop_overhead_s=self.hop_overhead_s * link_latency,
                       hop_latency_s=None if self.hop_latency_s is None else self.hop_latency_s * link_latency,
                       hop_vs_idle=tuple((a, b * link_latency) for a, b in self.hop_vs_idle),
                       stage_step_cpu_s=None if self.stage_step_cpu_s is None else self.stage_step_cpu_s * link_latency,
                       afd_message_cpu_s=None if self.afd_message_cpu_s is None else self.afd_message_cpu_s * link_latency,
                       afd_overlapped_hop_s=None if self.afd_overlapped_hop_s is None
                       else self.afd_overlapped_hop_s * link_latency,
                       afd_overlapped_message_cpu_s=None if self.afd_overlapped_message_cpu_s is None
                       else self.afd_overlapped_message_cpu_s * link_latency,
                       oversubscribed={k: v * link_latency if k.endswith("_step_cpu_s") else v
                                       for k, v in self.oversubscribed.items()})

    def prefill_dram_scale(self, comp: str, tokens: float, rest: bool = False) -> float:
        """The from-memory prefill linear scale (``rest``: the other ops' ratio, 1 where not measured) for a forward
        of ``tokens`` tokens (all its prompts together): the one-prompt probe's (PREFILL_PROBE_TOKENS) and, where
        measured, the batch probe's, log-log in between."""
        ones = self.prefill_rest_dram if rest else self.prefill_scale_dram
        batch = self.prefill_rest_dram_batch if rest else self.prefill_scale_dram_batch
        one = ones.get(comp, 1.0)
        if comp not in ones or comp not in batch:
            return one
        n, many = batch[comp]
        if n <= PREFILL_PROBE_TOKENS or tokens <= PREFILL_PROBE_TOKENS:
            return one
        if tokens >= n:
            return many
        f = math.log(tokens / PREFILL_PROBE_TOKENS) / math.log(n / PREFILL_PROBE_TOKENS)
        return math.exp(math.log(one) * (1 - f) + math.log(many) * f)

    def parallel(self, processes: int) -> float:
        """How many cores' worth of work ``processes`` single-thread processes get at once: the measured parallel
        ceiling (one process per core) when there is one, else the core count; never more than ``processes``."""
        full = self.cores if self.parallel_ceiling is None else min(float(self.cores), self.parallel_ceiling)
        return float(min(processes, full)) if processes < self.cores else full

    def cached(self, weight_bytes: float) -> bool:
        """Whether weights of this many bytes (every process on the host together) stay in the last-level cache."""
        return bool(self.tables_hot) and self.llc_bytes is not None and weight_bytes <= self.llc_bytes

    def hop(self, nbytes: float, idle_s: float = 0.0) -> float:
        """One message between stage / rank processes: the engine's measured hop latency (after the receiver was idle
        for ``idle_s``: interpolated in the measured hop-vs-idle points, flat beyond them; else the hop of the smallest
        probe, else the link's latency + the pipeline overhead) + bytes / link bandwidth."""
        pts = self.hop_vs_idle
        if pts:
            if idle_s <= pts[0][0]:
                lat = pts[0][1]
            elif idle_s >= pts[-1][0]:
                lat = pts[-1][1]
            else:
                j = next(j for j in range(1, len(pts)) if pts[j][0] >= idle_s)
                f = (idle_s - pts[j - 1][0]) / max(pts[j][0] - pts[j - 1][0], 1e-12)
                lat = pts[j - 1][1] * (1 - f) + pts[j][1] * f
        else:
            lat = self.hop_latency_s if self.hop_latency_s is not None else self.link_latency_s + self.hop_overhead_s
        return lat + nbytes / self.link_bytes_per_s


@dataclass
class Work:
    """What one part of a forward dispatches: aten ops, matmul bytes and FLOPs by dtype (fp32 | bf16 | int4), and the
    bytes of the other ops (small ones run from cache, large ones from memory)."""

    ops: float = 0.0
    mm_bytes: dict[str, float] = field(default_factory=dict)
    mm_flops: dict[str, float] = field(default_factory=dict)
    small_bytes: float = 0.0
    large_bytes: float = 0.0
    calls: dict[str, float] = field(default_factory=dict)  # "dtype|rows|weight bytes" -> linear calls (x W^T)
    small_bytes_bf16: float = 0.0  # the part of small / large bytes moved by 16-bit ops
    large_bytes_bf16: float = 0.0
    fused: dict[str, float] = field(default_factory=dict)  # "op|calls" | "op|units" | "op|bytes" of fused operators

    @classmethod
    def from_counts(cls, ops: float, w: dict[str, float] | None) -> "Work":
        w = w or {}
        return cls(ops=float(ops), mm_bytes={k[9:]: float(v) for k, v in w.items() if k.startswith("mm_bytes_")},
                   mm_flops={k[9:]: float(v) for k, v in w.items() if k.startswith("mm_flops_")},
                   small_bytes=float(w.get("small_bytes", 0.0)), large_bytes=float(w.get("large_bytes", 0.0)),
                   calls={k[5:]: float(v) for k, v in w.items() if k.startswith("call|") and v},
                   small_bytes_bf16=float(w.get("small_bytes_bf16", 0.0)), large_bytes_bf16=float(w.get("large_bytes_bf16", 0.0)),
                   fused={k[6:]: float(v) for k, v in w.items() if k.startswith("fused|")})

    def add(self, o: "Work") -> None:
        self.ops += o.ops
        for k, v in o.mm_bytes.items():
            self.mm_bytes[k] = self.mm_bytes.get(k, 0.0) + v
        for k, v in o.mm_flops.items():
            self.mm_flops[k] = self.mm_flops.get(k, 0.0) + v
        self.small_bytes += o.small_bytes
        self.large_bytes += o.large_bytes
        for k, v in o.calls.items():
            self.calls[k] = self.calls.get(k, 0.0) + v
        self.small_bytes_bf16 += o.small_bytes_bf16
        self.large_bytes_bf16 += o.large_bytes_bf16
        for k, v in o.fused.items():
            self.fused[k] = self.fused.get(k, 0.0) + v


@dataclass
class OpCount:
    """One forward's work: per layer (index -> Work) and outside the layers (embedding, final norm, LM head, sampling,
    drafting, the engine loop). ``traced``: counted from the engine (bytes and FLOPs per op); else only op counts, and
    weights come from the ModelSpec accounting."""

    layers: dict[int, Work]
    other: Work
    traced: bool = True
    # prefill with MTP under a pipeline: the last stage's MTP pass over the prompt and first drafts, which it runs
    # before the first token goes back to stage 0 (engine/speculative.py, the last stage's draft())
    first_draft: Work | None = None


class OpsProfile(Protocol):
    """Where the host model gets op counts: counted from the engine (the twin) or a per-layer default."""

    def decode(self, rows: int, tokens: int) -> OpCount: ...

    def prefill(self, rows: int, prompt_len: int) -> OpCount: ...


@dataclass
class DefaultOps:
    """No engine at hand: every layer dispatches the calibration models' mean ops per layer; outside the layers the
    same again (a stated estimate, not a count)."""

    num_layers: int
    per_layer: float

    def decode(self, rows: int, tokens: int) -> OpCount:
        return OpCount({i: Work(self.per_layer) for i in range(self.num_layers)}, Work(self.per_layer), traced=False)

    def prefill(self, rows: int, prompt_len: int) -> OpCount:
        return OpCount({i: Work(self.per_layer * 1.5) for i in range(self.num_layers)}, Work(self.per_layer), traced=False)


def compute_dtype(plan: Any) -> str:
    """The engine's activation dtype for a Plan: 32-bit weights run fp32; 16- and 4-bit weights run bf16 (W4A16)."""
    return "fp32" if getattr(plan, "weight_bits", 16) >= 32 else "bf16"


# ----------------------------------------------------------------------------- per-stage costs


@dataclass
class _StageCost:
    ops_s: float  # per-op overhead
    linear_s: float  # weights (and LM head) through the linear kernels
    cache_s: float  # cache reads
    extra_s: float  # scheduler step overhead (stage 0)

    @property
    def total(self) -> float:
        return self.ops_s + self.linear_s + self.cache_s + self.extra_s


def _touched(num_experts: int, top_k: int, tokens: float) -> float:
    if num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def multi_row_product(dtype: str, rows: int, few: int = ENGINE_FEW_ROWS) -> bool:
    """A linear call that carries the fitted in-engine per-call cost: 16-bit (oneDNN / MKL) with 2+ rows, except bf16
    products of up to ``few`` rows (waferline::linear_rows, no oneDNN). int4 calls run their own kernel, priced by its
    table."""
    return dtype != "int4" and rows > 1 and not (dtype == "bf16" and rows <= few)


def _work_time(host: HostParams, w: Work, c_op: float, comp: str = "bf16", scale: float | None = None,
               hot: bool = False, int4_scale: float | None = None, multi_s: float = 0.0) -> tuple[float, float, float]:
    """(per-op overhead, matmul time, other ops' bytes) seconds of traced work: linear calls (x W^T) from the measured
    linear table (which includes their call overhead); other matmuls (attention, scans) by roofline from the linear fit;
    every other op the per-op overhead + its bytes at cache or memory bandwidth. ``int4_scale``: int4 linear calls
    scaled by it instead of ``scale`` (prefill, where the two were measured apart). ``multi_s``: the fitted in-engine
    seconds each 16-bit linear call of 2+ rows costs beyond its table price. The fused operators (mla_decode,
    ssm_update) at their measured t0 + units / rate are added to the third term."""
    mm = mm4 = mm_multi = 0.0
    n_calls = n_multi = 0.0
    # products of 2+ rows (oneDNN) get their own in-engine scale when the weights come from memory and one was measured
    multi_scale = (host.linear_scale_dram_multi.get(comp)
                   if scale is None and host.tables_hot and not hot else None)
    for key, n in w.calls.items():
        dt, rows, nb = key.split("|")
        tabs = host.tables_hot if hot and host.tables_hot else host.tables
        tab = tabs.get(dt) or tabs.get("bf16")
        if tab is None:  # an old calibration without tables: the fit
            fit = host.linear.get(dt) or host.linear_for(16, "bf16")
            mm += n * (fit.t0_s + fit.time(float(nb), 0.0))
        elif dt == "int4" and int4_scale is not None:
            mm4 += n * tab.time(int(rows), float(nb))
        elif multi_scale is not None and int(rows) > 1 and dt != "int4":
            mm_multi += n * tab.time(int(rows), float(nb))
        else:
            mm += n * tab.time(int(rows), float(nb))
        n_calls += n
        if multi_row_product(dt, int(rows), host.engine_few_rows):
            n_multi += n
    other_mm = 0.0  # matmuls without a weight (attention, scans): their roofline, not scaled (calibrate prices them so)
    for dt, b in w.mm_bytes.items():
        fit = host.linear.get(dt) or host.linear_for(16, "bf16")
        other_mm += fit.time(b, w.mm_flops.get(dt, 0.0))
    ew = host.elementwise
    fused_s = 0.0
    for name in {k.split("|")[0] for k in w.fused}:  # waferline.kernels operators: their own measured rates
        calls, units, nb = (w.fused.get(f"{name}|{k}", 0.0) for k in ("calls", "units", "bytes"))
        if name in host.fused:
            t0, rate = host.fused[name]
            fused_s += calls * t0 + units / rate
            if not hot and host.tables_hot:  # measured back to back with its operands in cache; in a Plan whose
                # weights do not fit in the last-level cache it reads them (MLA's absorbed W_UK / W_UV: ~1.5 MB a layer
                # on dsv3-100m) from memory: ~2x the probe's time there, by hand)
                fused_s += nb / host.memory_bandwidth
            n_calls += calls
        elif name == "mla_decode":  # an older calibration: an fp32 matmul of its FLOPs and bytes
            fused_s += (host.linear.get("fp32") or host.linear_for(16, "bf16")).time(nb, units)
        else:  # elementwise bytes (from memory beyond the small-op size per call)
            big = calls > 0 and nb / calls > host.small_op_bytes
            fused_s += nb / (ew.get("fp32_large" if big else "fp32_small") or
                             (host.memory_bandwidth if big else host.cache_bandwidth))

    def rate(key: str, fallback: float) -> float:
        return ew.get(key) or fallback

    other = (w.small_bytes / rate("fp32_small", host.cache_bandwidth) + w.large_bytes / rate("fp32_large", host.memory_bandwidth)
             + w.small_bytes_bf16 / rate("bf16_small", host.cache_bandwidth)
             + w.large_bytes_bf16 / rate("bf16_large", host.memory_bandwidth))
    if scale is None:
        scale = host.linear_scale.get(comp, 1.0) if hot or not host.tables_hot else \
            host.linear_scale_dram.get(comp, host.linear_scale.get(comp, 1.0))
    return (c_op * max(0.0, w.ops - n_calls),
            mm * scale + mm4 * (int4_scale or 0.0) + mm_multi * (multi_scale or 0.0) + multi_s * n_multi
            + other_mm * (1.0 if host.other_mm_unscaled else scale), other + fused_s)


def _hot(host: HostParams, plan: Any) -> bool:
    """Whether the Plan's weights (all its processes on this host together) stay in the last-level cache."""
    return host.cached(sum(float(getattr(getattr(s, "memory", None), "weights", 0.0) or 0.0) for s in plan.stages))


def _stage_cost(host: HostParams, plan: Any, spec: Any, table: list[Any], layers: list[int], count: OpCount, rows: int,
                tokens: int, has_head: bool, head_tokens: int, ops_other: bool, step_extra: float,
                prefill: bool = False) -> _StageCost:
    comp = compute_dtype(plan)
    c_op = host.op_overhead_s.get(comp, next(iter(host.op_overhead_s.values())))
    scale = int4_scale = None
    multi_s = host.multi_call_overhead_s.get(comp, 0.0)
    hot = _hot(host, plan)
    rest_scale = 1.0
    if prefill and comp in host.prefill:
        c_op, scale = host.prefill[comp][0], host.prefill[comp][1]
        if not hot and comp in host.prefill_scale_dram:  # GEMMs a real model's size, weights from memory
            scale = host.prefill_dram_scale(comp, rows * tokens)
            rest_scale = host.prefill_dram_scale(comp, rows * tokens, rest=True)
        int4_scale = host.prefill_int4_scale.get(comp)  # (multi_s stays: calibrate fits prefill with it)
    if count.traced:  # a roofline per op of the engine's own op stream, plus the per-op overhead
        w = Work()
        for i in layers:
            if i in count.layers:
                w.add(count.layers[i])
        if ops_other:
            w.add(count.other)
        ops_s, mm_s, other_s = _work_time(host, w, c_op, comp, scale, hot=hot, int4_scale=int4_scale,
                                          multi_s=multi_s)
        return _StageCost(ops_s=ops_s * rest_scale, linear_s=mm_s, cache_s=other_s * rest_scale, extra_s=step_extra)
    # no trace: op counts per layer, and weights / FLOPs / cache from the ModelSpec accounting
    lin = host.linear_for(plan.weight_bits, comp)
    n = rows * tokens
    ops = sum(count.layers[i].ops for i in layers if i in count.layers) + (count.other.ops if ops_other else 0.0)
    lin_s = cache_s = 0.0
    for i in layers:
        lc = table[i]
        if lc.is_moe:
            read = lc.weight_bytes - lc.num_experts * lc.expert_bytes + _touched(lc.num_experts, lc.top_k, n) * lc.expert_bytes
        else:
            read = lc.weight_bytes
        lin_s += lin.time(read, (lc.mixer_flops + lc.ffn_flops) * n)
        cache_s += lc.cache_bytes * rows / host.memory_bandwidth
    if has_head:
        hl = host.linear_for(16, comp)  # the LM head stays 16-bit
        head_b = spec.lm_head_bytes(plan.embed_bits) if spec.lm_head_params() else spec.embed_bytes(plan.embed_bits)
        lin_s += hl.time(head_b, 2.0 * spec.vocab_size * spec.hidden_size * head_tokens)
    return _StageCost(ops_s=c_op * ops, linear_s=lin_s, cache_s=cache_s, extra_s=step_extra)


def simulate_host(plan: Any, spec: Any, hw: Any, host: HostParams, profile: OpsProfile | None, *, prompt_len: int,
                  output_len: int, concurrency: int) -> Any:
    """SimResult of ``plan`` run by waferline's own engine on the calibrated host (see the module docstring)."""
    from waferline.sim.cost import expected_tokens_per_step, layer_table
    from waferline.sim.pipeline import SimResult, StageTiming

    P, O, B = int(prompt_len), int(output_len), int(concurrency)
    if P < 1 or O < 1 or B < 1:
        raise ConfigError(f"prompt, output and concurrency must be >= 1 (got {P}, {O}, {B})")
    if plan.afd:
        return _simulate_host_afd(plan, spec, host, profile, P, O, B)
    profile = profile or DefaultOps(spec.num_layers, host.ops_per_layer.get(compute_dtype(plan), 150.0))
    comp = compute_dtype(plan)
    S = plan.num_stages
    M = max(1, min(plan.micro_batches if S > 1 else 1, B))
    b = math.ceil(B / M)
    table = layer_table(spec, plan.weight_bits, plan.kv_bits, P + O // 2, plan.group_size)
    sp = plan.speculative
    k = sp.num_tokens if sp.method != "none" else 0
    t = k + 1
    plain_over = host.step_overhead_s.get(comp, 0.0)
    step_over = host.spec_step_overhead_s.get(comp, plain_over) if k > 0 else plain_over
    act_bytes = 2.0 if comp == "bf16" else 4.0

    hop = host.hop
    # A hop costs more the longer its receiving process waited (measured on 2-stage pipelines, one process per core).
    # With more stage processes than cores it is still the process's own wait that counts, not a core's share of it:
    # sol-mini one layer per stage (8 processes on 2 cores, one row) measured ~0.67 ms per hop, the hop-vs-idle curve
    # at the process's ~3.9 ms wait, where a core's quarter of it priced 0.32 ms (twin run E, session 8).

    # ---- decode
    count = profile.decode(b, t)
    costs = []
    row_over = host.row_overhead_s.get(comp, 0.0)
    rl_over = host.row_layer_overhead_s.get(comp, 0.0)
    for i, s in enumerate(plan.stages):  # per-sequence work: sampling where the head is, bookkeeping in every layer
        costs.append(_stage_cost(host, plan, spec, table, list(s.layers), count, b, t, s.has_lm_head, b * t,
                                 ops_other=s.has_lm_head,
                                 step_extra=(step_over if i == 0 else 0.0) + (b * row_over if s.has_lm_head else 0.0)
                                 + b * len(s.layers) * rl_over))
    stage_s = [c.total for c in costs]
    hop_bytes = [b * t * spec.hidden_size * act_bytes if i + 1 < S else 8.0 * b * t for i in range(S)]
    per_step = host.stage_step_cpu_s if host.stage_step_cpu_s is not None else 2 * host.link_cpu_s
    inflation = host.stage_cpu_inflation
    ov = host.oversubscribed
    # more stage processes than cores: a stage step's CPU as measured on a pipeline in that regime (each process
    # sleeps while others use its core and wakes with cold caches), with one micro-batch or with every process busy
    wall_per_cpu = host.chain_wall_per_cpu
    if S > host.cores and ov:
        key = "m1" if M == 1 else "mS"
        if f"{key}_step_cpu_s" in ov:
            per_step, inflation = ov[f"{key}_step_cpu_s"], ov[f"{key}_cpu_inflation"]
            wall_per_cpu = ov.get("m1_wall_per_cpu", wall_per_cpu)
    chain = S > 1 and M == 1 and wall_per_cpu is not None
    cpu = [st * (1.0 + inflation) + per_step for st in stage_s] if S > 1 else list(stage_s)
    hops = [hop(nb) for nb in hop_bytes] if S > 1 else [0.0]
    if chain:  # one micro-batch: a serial chain of stage steps, each one stage process's CPU (its compute slowed by
        # the caches it finds cold, receiving, sending, waking), at the wall time per CPU second measured on such chains
        round_trip = sum(cpu) * wall_per_cpu
        hops = [max(0.0, (round_trip - sum(stage_s)) / S)] * S  # for the timeline: a hop = a stage's time beyond its compute
    for it in range(3):  # a hop costs more the longer its receiver waited: per micro-batch, cycle / M - its own work
        if not chain:
            round_trip = sum(stage_s) + sum(hops)
        cycle = max(round_trip, M * max(cpu), M * sum(cpu) / host.parallel(S) if S > 1 else 0.0)
        if S == 1 or chain or it == 2:
            break
        hops = [hop(nb, max(0.0, cycle / M - cpu[(i + 1) % S])) for i, nb in enumerate(hop_bytes)]
    bound = ("round trip (latency)" if cycle == round_trip else
             "busiest stage x micro-batches" if cycle == M * max(cpu) else f"CPU cores ({S} processes on {host.cores} cores)")
    spec_info: dict[str, Any] = {"method": sp.method}
    tokens_per_cycle = 1.0
    if k > 0:
        a = sp.accept_rate if sp.accept_rate is not None else 0.5
        E = expected_tokens_per_step(a, k)
        tokens_per_cycle = E  # one cycle is one verify step (its op count includes the drafting): E tokens per row
        spec_info.update(num_tokens=k, accept_rate=a, expected_tokens_per_step=E,
                         accept_rate_source="given" if sp.accept_rate is not None else "assumed 0.5")
    rate = tokens_per_cycle / cycle
    # ---- TTFT: every row's first token (prefill)
    if S == 1:
        pc = profile.prefill(1, P)
        one = _stage_cost(host, plan, spec, table, list(plan.stages[0].layers), pc, 1, P, True, 1, True, 0.0, prefill=True)
        ttft = B * (one.total + host.prefill.get(comp, (0, 0, 0.0))[2]) + plain_over
    else:
        rows_per_mb = max(1, PIPELINE_PREFILL_CHUNK // P) if P <= PIPELINE_PREFILL_CHUNK else 1
        chunks_per_row = math.ceil(P / PIPELINE_PREFILL_CHUNK)
        r = min(B, rows_per_mb)
        n_mb = math.ceil(B / rows_per_mb) * chunks_per_row
        tok = min(P, PIPELINE_PREFILL_CHUNK)
        pc = profile.prefill(r, tok)
        # a stage process's prefill chunk costs the per-step CPU its decode steps do (receive, send, wake; cpu above);
        # not the inflation of its compute, measured with every stage busy at once: one chunk runs one stage at a time
        pst = [_stage_cost(host, plan, spec, table, list(s.layers), pc, r, tok, s.has_lm_head, r, s.has_lm_head,
                           plain_over if i == 0 else 0.0, prefill=True).total + per_step for i, s in enumerate(plan.stages)]
        if sp.method == "mtp" and pc.first_draft is not None:  # the last stage drafts before the first token returns
            pst[-1] += _stage_cost(host, plan, spec, table, [], OpCount({}, pc.first_draft), r, tok, False, 0, True, 0.0,
                                   prefill=True).total
        # each hop's receiver waited for the stages ahead of it (and, before the first chunk, since the last request)
        phop = [hop(r * tok * spec.hidden_size * act_bytes if i + 1 < S else 8.0 * r, sum(pst[:i + 1]))
                for i in range(S)]
        ttft = sum(pst) + sum(phop) + (n_mb - 1) * max(pst)
    timings = [StageTiming(index=s.index, role=s.role, layers=f"{s.layers[0]}-{s.layers[-1]}" if len(s.layers) > 1 else str(s.layers[0]),
                           devices=s.num_devices, compute=c.linear_s, memory=c.cache_s, fixed=c.ops_s + c.extra_s, comm=0.0,
                           hop=h, total=c.total + h) for s, c, h in zip(plan.stages, costs, hops)]
    spec_info["host"] = {"micro_batch_rows": b, "tokens_per_row_per_step": t, "cycle_s": cycle, "round_trip_s": round_trip,
                         "ops_per_step": sum(w.ops for w in count.layers.values()) + count.other.ops,
                         "cpu_per_stage_s": cpu, "cores": host.cores}
    return SimResult(model=plan.model, hardware=plan.hardware, num_devices=plan.num_devices, num_stages=S, fits=plan.fits,
                     concurrency=B, micro_batches=M, prompt_len=P, output_len=O, step_latency_s=round_trip,
                     decode_tokens_per_s_per_user=rate, aggregate_tokens_per_s=rate * B, ttft_s=ttft, prefill_s=ttft,
                     end_to_end_s=ttft + (O - 1) / rate, bound=bound, stages=timings, speculative=spec_info,
                     problems=list(plan.problems))


def _simulate_host_afd(plan: Any, spec: Any, host: HostParams, profile: OpsProfile | None, P: int, O: int, B: int) -> Any:
    """AFD as engine/afd.py runs it: Ma attention ranks (data parallel over sequences: mixers, head, sampling) and Nf FFN
    ranks (the FFN work of the Ma ranks' tokens, split over them); per layer and micro-batch one message each way between
    every attention and FFN rank; K micro-batches ping-pong, so per layer the step is bounded by the busier side x K or
    by one micro-batch's attention + FFN + two hops; all ranks share the cores."""
    from waferline.sim.pipeline import SimResult, StageTiming

    if profile is None or not hasattr(profile, "ffn"):
        raise ConfigError("the host model of AFD needs the engine's op counts split into FFN and the rest (run it from `waferline twin`)")
    att = [s for s in plan.stages if s.role == "attention"]
    ffn = [s for s in plan.stages if s.role == "ffn"]
    Ma, Nf = max(1, len(att)), max(1, len(ffn))
    comp = compute_dtype(plan)
    c_op = host.op_overhead_s.get(comp, next(iter(host.op_overhead_s.values())))
    over = host.step_overhead_s.get(comp, 0.0)
    Ba = math.ceil(B / Ma)
    K = max(1, min(plan.micro_batches, Ba))
    b = math.ceil(Ba / K)
    act = 2.0 if comp == "bf16" else 4.0

    hop = host.hop
    hot = _hot(host, plan)

    def side_times(count: OpCount, ffn_w: dict[int, Work], prefill: bool,
                   prefill_tokens: float = 0.0) -> tuple[list[float], list[float], float]:
        # prefill with the prefill constants (per op, linear scale, int4 scale), decode with the decode ones
        pf = host.prefill.get(comp) if prefill else None
        kw: dict[str, Any] = {"multi_s": host.multi_call_overhead_s.get(comp, 0.0)}
        if pf:
            kw.update(scale=(host.prefill_dram_scale(comp, prefill_tokens) if comp in host.prefill_scale_dram else pf[1])
                      if not hot else pf[1],
                      int4_scale=host.prefill_int4_scale.get(comp))
        cop = pf[0] if pf else c_op
        rs = host.prefill_dram_scale(comp, prefill_tokens, rest=True) if pf and not hot else 1.0

        def secs(w: Work) -> float:  # (other ops' parts at the prefill's measured ratio)
            ops_s, mm_s, other_s = _work_time(host, w, cop, comp, hot=hot, **kw)
            return (ops_s + other_s) * rs + mm_s

        a_t, f_t = [], []
        for i, w in sorted(count.layers.items()):
            fw = ffn_w.get(i, Work())
            aw = Work(w.ops - fw.ops, {k: v - fw.mm_bytes.get(k, 0.0) for k, v in w.mm_bytes.items()},
                      {k: v - fw.mm_flops.get(k, 0.0) for k, v in w.mm_flops.items()},
                      w.small_bytes - fw.small_bytes, w.large_bytes - fw.large_bytes,
                      {k: v - fw.calls.get(k, 0.0) for k, v in w.calls.items()},
                      w.small_bytes_bf16 - fw.small_bytes_bf16, w.large_bytes_bf16 - fw.large_bytes_bf16,
                      {k: v - fw.fused.get(k, 0.0) for k, v in w.fused.items()})
            a_t.append(secs(aw))
            scaled = Work(fw.ops * Ma / Nf, {k: v * Ma / Nf for k, v in fw.mm_bytes.items()},
                          {k: v * Ma / Nf for k, v in fw.mm_flops.items()}, fw.small_bytes * Ma / Nf, fw.large_bytes * Ma / Nf,
                          {k: v * Ma / Nf for k, v in fw.calls.items()}, fw.small_bytes_bf16 * Ma / Nf,
                          fw.large_bytes_bf16 * Ma / Nf, {k: v * Ma / Nf for k, v in fw.fused.items()})
            f_t.append(secs(scaled) if fw.ops else 0.0)
        return a_t, f_t, secs(count.other)

    dc = profile.decode(b, 1)
    a_t, f_t, other = side_times(dc, profile.ffn("decode"), False)
    nb = b * spec.hidden_size * act
    h = hop(nb)
    # CPU per message besides compute (receive, unpack, send, wake-up): measured on an AFD calibration run; else half a
    # pipeline stage's step CPU (one receive and one send on the same transport); else the link probe's
    per_msg = (host.afd_message_cpu_s if host.afd_message_cpu_s is not None else
               host.stage_step_cpu_s / 2 if host.stage_step_cpu_s is not None else host.link_cpu_s)
    if K > 1 and host.afd_overlapped_message_cpu_s is not None:  # measured with micro-batches of several rows
        per_msg = host.afd_overlapped_message_cpu_s
    msg_a, msg_f = 2 * Nf * per_msg, 2 * Ma * per_msg
    # With 2+ micro-batches both sides work while a message is under way, and it takes the hop measured so (a message
    # then waits for a core busy with the other rank's compute); else the idle hop at the receiver's wait
    busy = host.afd_overlapped_hop_s if K > 1 and host.afd_overlapped_hop_s is not None else None

    def hop_afd(idle: float) -> float:
        return hop(nb, idle) if busy is None else busy + nb / host.link_bytes_per_s

    # one micro-batch's round trip through a layer is serial: attention, its message out (sent by one side, received
    # by the other), the FFN, the message back, each end's CPU included
    per_layer = [max(K * (a + msg_a), K * (f + msg_f), a + f + msg_a + msg_f + 2 * hop_afd(0.0)) if f > 0 else K * a
                 for a, f in zip(a_t, f_t)]
    # each side waits per micro-batch what the other side and the hops take: a longer wait, a slower (idle) hop
    per_layer = [max(K * (a + msg_a), K * (f + msg_f),
                     a + f + msg_a + msg_f + hop_afd(max(0.0, pl / K - f - msg_f)) + hop_afd(max(0.0, pl / K - a - msg_a)))
                 if f > 0 else K * a for a, f, pl in zip(a_t, f_t, per_layer)]
    row_over = host.row_overhead_s.get(comp, 0.0) + len(a_t) * host.row_layer_overhead_s.get(comp, 0.0)
    step = sum(per_layer) + K * (other + b * row_over) + over
    cpu_total = Ma * (K * (sum(a_t) + other + b * row_over) + over) + Nf * K * sum(f_t) + K * len(a_t) * (Ma * msg_a + Nf * msg_f)
    cores_bound = cpu_total / host.parallel(Ma + Nf)
    bound = "cores (ranks share them)" if cores_bound > step else "ping-pong per layer (busier side or one micro-batch's round trip)"
    step = max(step, cores_bound)
    rate = 1.0 / step
    # TTFT: prompts prefilled in steps of the engine's prefill budget (r rows per attention rank); the engine splits a
    # step's rows into its micro-batches as it does a decode step's, so the prefill ping-pongs between the sides too:
    # per layer the busier side over all micro-batches, or one micro-batch's round trip (the counted prefill is one
    # micro-batch's rows, rp)
    r = min(Ba, max(1, PIPELINE_PREFILL_CHUNK // P))
    Kp = max(1, min(K, r))
    rp = math.ceil(r / Kp)
    n_steps = math.ceil(Ba / r)
    pc = profile.prefill(rp, P)
    pa, pf, pother = side_times(pc, profile.ffn("prefill"), True, rp * P)
    ph = hop(rp * P * spec.hidden_size * act)
    per_layer_p = [max(Kp * (a + msg_a), Kp * (f + msg_f), a + f + msg_a + msg_f + 2 * ph) if f > 0 else Kp * a
                   for a, f in zip(pa, pf)]
    ttft = n_steps * (sum(per_layer_p) + Kp * pother) + over
    timings = [StageTiming(index=s.index, role=s.role, layers=f"{s.layers[0]}-{s.layers[-1]}" if len(s.layers) > 1 else str(s.layers[0]),
                           devices=s.num_devices, compute=0.0, memory=0.0,
                           fixed=K * (sum(a_t) + other) if s.role == "attention" else K * sum(f_t),
                           comm=0.0, hop=h, total=K * (sum(a_t) + other) if s.role == "attention" else K * sum(f_t))
               for s in plan.stages]
    return SimResult(model=plan.model, hardware=plan.hardware, num_devices=plan.num_devices, num_stages=plan.num_stages,
                     fits=plan.fits, concurrency=B, micro_batches=K, prompt_len=P, output_len=O, step_latency_s=step,
                     decode_tokens_per_s_per_user=rate, aggregate_tokens_per_s=rate * B, ttft_s=ttft, prefill_s=ttft,
                     end_to_end_s=ttft + (O - 1) / rate, bound=bound, stages=timings,
                     speculative={"method": "none", "host": {"attention_ranks": Ma, "ffn_ranks": Nf, "micro_batch_rows": b,
                                                             "cycle_s": step, "cores": host.cores}},
                     problems=list(plan.problems))
