"""The calibrated figures of the host-engine cost model (sim.host): what `waferline calibrate` wrote in a hardware
file's ``host_engine`` section, read into HostParams, with the measured linear tables and the hop, parallelism and
prefill-scale lookups the pricing uses."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from waferline.errors import ConfigError

OVERSUB_KEYS = ("stages", "m1_step_cpu_s", "m1_cpu_inflation", "m1_wall_per_cpu", "mS_step_cpu_s", "mS_cpu_inflation")
PREFILL_PROBE_TOKENS = 32  # tokens of calibrate's one-prompt prefill probe (sim.calibrate.engine)
PIPELINE_PREFILL_CHUNK = 256  # engine/pipeline/driver.py DEFAULT_PREFILL_CHUNK: prompt tokens per prefill micro-batch


ENGINE_FEW_ROWS = 8  # = waferline.model.layers.FEW_ROWS (tests check): bf16 products the engine's own kernel runs
# (8 on every CPU; a calibration that records 4, where oneDNN had bf16 GEMMs, is honoured: engine_few_rows)


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
    def from_dict(cls, d: dict[str, Any]) -> LinearTable:
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

    def scaled(self, factor: float) -> LinearTable:
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
    # engine compute dtype -> in-engine linear time / the isolated sweep's (cache-resident)
    linear_scale: dict[str, float]
    row_overhead_s: dict[str, float]  # engine compute dtype -> the loop's Python seconds per sequence per step
    # engine compute dtype -> seconds per sequence per layer per step (old files)
    row_layer_overhead_s: dict[str, float]
    # engine compute dtype -> (per-op, linear scale, per prompt) in prefill
    prefill: dict[str, tuple[float, float, float]]
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
    # with stage_step_cpu_s on the calibration pipelines; 0: a calibration without the fit, whose
    # stage_step_cpu_s is the median of fixed + inflation)
    stage_cpu_inflation: float = 0.0
    # "fp32_small" | "fp32_large" | "bf16_small" | ... -> bytes/s
    elementwise: dict[str, float] = field(default_factory=dict)
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
    # the canary's wall seconds per token during the calibration (calibrate.engine.Canary): twin compares each Plan's
    # own
    # canary run with it (None: calibrated before the canary existed)
    canary_s: float | None = None
    source: str = ""
    measured: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "<host_engine>") -> HostParams:
        he = d.get("host_engine") if "host_engine" in d else d
        if not isinstance(he, dict) or ("host_engine" not in d and "engine" not in d):  # (e.g. a catalog device's YAML)
            raise ConfigError(
                f"{where}: no host_engine section; run `waferline calibrate` on this machine to write one"
            )
        try:
            lin = {k: LinearFit(_v(v["t0_s"], where), _v(v["bytes_per_s"], where), _v(v["flops_per_s"], where))
                   for k, v in (he.get("linear") or {}).items()}
            tabs = {k: LinearTable.from_dict(v["table"]) for k, v in (he.get("linear") or {}).items() if v.get("table")}
            eng = he["engine"]
            link = he.get("link") or {}
            pipe = he.get("pipeline") or {}
            bw = _v(he["memory_bandwidth_1_thread"], where)
            return cls(
                cores=int(_v(he["cores"], where)),
                memory_bandwidth=bw,
                cache_bandwidth=_v(he.get("cache_bandwidth_1_thread", bw), where),
                small_op_bytes=_v(he.get("small_op_bytes", 1 << 20), where),
                linear=lin,
                tables=tabs,
                op_overhead_s={k: _v(v["op_overhead_s"], where) for k, v in eng.items()},
                linear_scale={k: _v(v.get("linear_scale", 1.0), where) for k, v in eng.items()},
                linear_scale_dram={
                    k: _v(v["linear_scale_dram"], where)
                    for k, v in eng.items()
                    if isinstance(v.get("linear_scale_dram"), dict) and "value" in v["linear_scale_dram"]
                },
                linear_scale_dram_multi={
                    k: _v(v["linear_scale_dram_multi"], where)
                    for k, v in eng.items()
                    if isinstance(v.get("linear_scale_dram_multi"), dict) and "value" in v["linear_scale_dram_multi"]
                },
                row_overhead_s={k: _v(v.get("row_overhead_s", 0.0), where) for k, v in eng.items()},
                row_layer_overhead_s={k: _v(v.get("row_layer_overhead_s", 0.0), where) for k, v in eng.items()},
                prefill={
                    k: (
                        _v(v.get("prefill_op_overhead_s", v["op_overhead_s"]), where),
                        _v(v.get("prefill_linear_scale", v.get("linear_scale", 1.0)), where),
                        _v(v.get("prefill_overhead_s", 0.0), where),
                    )
                    for k, v in eng.items()
                },
                step_overhead_s={k: _v(v["step_overhead_s"], where) for k, v in eng.items()},
                spec_step_overhead_s={
                    k: _v(v.get("spec_step_overhead_s", v["step_overhead_s"]), where) for k, v in eng.items()
                },
                ops_per_layer={k: _v(v["ops_per_layer"], where) for k, v in eng.items()},
                link_latency_s=_v(link.get("latency_s", 1e-4), where),
                link_bytes_per_s=_v(link.get("bytes_per_s", 1e9), where),
                link_cpu_s=_v(link.get("cpu_per_message_s", 0.0), where),
                hop_overhead_s=_v(pipe.get("hop_overhead_s", 0.0), where),
                hop_latency_s=_v(pipe["hop_latency_s"], where) if "hop_latency_s" in pipe else None,
                source=where,
                parallel_ceiling=_v(he["parallel_ceiling"], where) if "parallel_ceiling" in he else None,
                engine_few_rows=int(_v(he.get("engine_few_rows", ENGINE_FEW_ROWS), where)),
                tables_hot={
                    k: LinearTable.from_dict(v["table_hot"])
                    for k, v in (he.get("linear") or {}).items()
                    if v.get("table_hot")
                },
                llc_bytes=_v(he["llc_bytes"], where) if "llc_bytes" in he else None,
                stage_step_cpu_s=_v(pipe["stage_step_cpu_s"], where) if "stage_step_cpu_s" in pipe else None,
                stage_cpu_inflation=_v(pipe["stage_cpu_inflation"], where) if "stage_cpu_inflation" in pipe else 0.0,
                afd_message_cpu_s=_v(pipe["afd_message_cpu_s"], where)
                if isinstance(pipe.get("afd_message_cpu_s"), dict)
                and pipe["afd_message_cpu_s"].get("value") is not None
                else None,
                afd_overlapped_hop_s=_v(pipe["afd_overlapped_hop_s"], where)
                if isinstance(pipe.get("afd_overlapped_hop_s"), dict)
                else None,
                afd_overlapped_message_cpu_s=_v(pipe["afd_overlapped_message_cpu_s"], where)
                if isinstance(pipe.get("afd_overlapped_message_cpu_s"), dict)
                else None,
                hop_vs_idle=tuple(
                    sorted((float(a), float(b)) for a, b in (pipe.get("hop_vs_idle") or {}).get("points", []))
                ),
                elementwise={k: _v(v, where) for k, v in (he.get("elementwise") or {}).items()},
                prefill_int4_scale={
                    k: _v(v["prefill_linear_scale_int4"], where)
                    for k, v in eng.items()
                    if isinstance(v.get("prefill_linear_scale_int4"), dict)
                    and "value" in v["prefill_linear_scale_int4"]
                },
                prefill_scale_dram={
                    k: _v(v["prefill_linear_scale_dram"], where)
                    for k, v in eng.items()
                    if isinstance(v.get("prefill_linear_scale_dram"), dict)
                },
                prefill_scale_dram_batch=_sized(eng, "prefill_linear_scale_dram_batch", where),
                prefill_rest_dram={
                    k: _v(v["prefill_rest_scale_dram"], where)
                    for k, v in eng.items()
                    if isinstance(v.get("prefill_rest_scale_dram"), dict)
                },
                prefill_rest_dram_batch=_sized(eng, "prefill_rest_scale_dram_batch", where),
                other_mm_unscaled=bool(he.get("other_matmuls_at_roofline", False)),
                canary_s=_v(he["canary_s"], where) if isinstance(he.get("canary_s"), dict) else None,
                fused={
                    k: (_v(v["t0_s"], where), _v(v["units_per_s"], where))
                    for k, v in (he.get("fused_ops") or {}).items()
                },
                multi_call_overhead_s={
                    k: _v(v["multi_call_overhead_s"], where)
                    for k, v in eng.items()
                    if v.get("multi_call_overhead_s") is not None
                },
                oversubscribed={
                    k: _v(v, where) for k, v in (pipe.get("oversubscribed") or {}).items() if k in OVERSUB_KEYS
                },
                chain_wall_per_cpu=_chain_wall_per_cpu(pipe, where),
                measured=dict(he.get("measured") or {}),
            )
        except KeyError as e:
            raise ConfigError(f"{where}: host_engine is missing {e.args[0]!r}; re-run `waferline calibrate`") from None

    @classmethod
    def load(cls, path: str | Path) -> HostParams:
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

    def scaled(self, *, bandwidth: float = 1.0, op_overhead: float = 1.0, link_latency: float = 1.0) -> HostParams:
        """A copy with figures multiplied (to show that a wrong figure makes predictions worse)."""
        return replace(
            self,
            memory_bandwidth=self.memory_bandwidth * bandwidth,
            cache_bandwidth=self.cache_bandwidth * bandwidth,
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
            link_latency_s=self.link_latency_s * link_latency,
            hop_overhead_s=self.hop_overhead_s * link_latency,
            hop_latency_s=None if self.hop_latency_s is None else self.hop_latency_s * link_latency,
            hop_vs_idle=tuple((a, b * link_latency) for a, b in self.hop_vs_idle),
            stage_step_cpu_s=None if self.stage_step_cpu_s is None else self.stage_step_cpu_s * link_latency,
            afd_message_cpu_s=None if self.afd_message_cpu_s is None else self.afd_message_cpu_s * link_latency,
            afd_overlapped_hop_s=None
            if self.afd_overlapped_hop_s is None
            else self.afd_overlapped_hop_s * link_latency,
            afd_overlapped_message_cpu_s=None
            if self.afd_overlapped_message_cpu_s is None
            else self.afd_overlapped_message_cpu_s * link_latency,
            oversubscribed={
                k: v * link_latency if k.endswith("_step_cpu_s") else v for k, v in self.oversubscribed.items()
            },
        )

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
