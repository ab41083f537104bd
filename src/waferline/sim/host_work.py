"""The per-stage pricing of the host-engine cost model (sim.host): the engine's counted work (Work, OpCount, the
profiles that supply it) and what one stage process's share of a forward costs on a calibrated host."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from waferline.sim.host_params import ENGINE_FEW_ROWS, HostParams

if TYPE_CHECKING:
    from waferline.plan.plan import Plan
    from waferline.spec.model import ModelSpec


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
    def from_counts(cls, ops: float, w: dict[str, float] | None) -> Work:
        w = w or {}
        return cls(
            ops=float(ops),
            mm_bytes={k[9:]: float(v) for k, v in w.items() if k.startswith("mm_bytes_")},
            mm_flops={k[9:]: float(v) for k, v in w.items() if k.startswith("mm_flops_")},
            small_bytes=float(w.get("small_bytes", 0.0)),
            large_bytes=float(w.get("large_bytes", 0.0)),
            calls={k[5:]: float(v) for k, v in w.items() if k.startswith("call|") and v},
            small_bytes_bf16=float(w.get("small_bytes_bf16", 0.0)),
            large_bytes_bf16=float(w.get("large_bytes_bf16", 0.0)),
            fused={k[6:]: float(v) for k, v in w.items() if k.startswith("fused|")},
        )

    def scaled(self, x: float) -> Work:
        """This work ``x`` times (x < 0: to take it off another's with ``add``)."""
        return Work(self.ops * x, {k: v * x for k, v in self.mm_bytes.items()},
                    {k: v * x for k, v in self.mm_flops.items()}, self.small_bytes * x, self.large_bytes * x,
                    {k: v * x for k, v in self.calls.items()}, self.small_bytes_bf16 * x, self.large_bytes_bf16 * x,
                    {k: v * x for k, v in self.fused.items()})

    def add(self, o: Work) -> None:
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
        return OpCount(
            {i: Work(self.per_layer * 1.5) for i in range(self.num_layers)}, Work(self.per_layer), traced=False
        )


# What attend()'s chain (model/attention.py, fp32 on CPU; a prefill with attention sinks still runs it) moves per
# score element (query x head x key), as the op counter (sim/calibrate/opcount.py) records it and the calibrated rates
# price it: the scores matmul writes the scores and the values matmul reads them back (4 B each); scaling them in
# place (mul_) and the softmax each read and write them (8 B each); the causal mask's masked_fill_ is recorded as its
# bool mask (2 B per query and key, shared by the heads)
SCORE_MATMUL_BYTES = 2 * 4.0
SCORE_PASS_BYTES = 2 * 8.0
MASK_BYTES = 2.0
# attend_prefill_cpu (every other prefill chunk on a CPU: torch's fused attention, the scores never written out): per
# query and key, its mask inverted (1 B read, 1 B written), then read by the fused op (one of its inputs)
FUSED_MASK_BYTES = 2.0
FUSED_MASK_READ_BYTES = 1.0
# the step's causal mask (model/attention.py causal_mask, made once a step by the first attention layer, shared by the
# rest): per query and key 1 B written, per key its position read (8 B)
CAUSAL_MASK_BYTES = 1.0
CAUSAL_MASK_KEY_BYTES = 8.0


def prefill_micro_batches(rows: int, prompt_len: int, chunk: int) -> list[list[tuple[int, int, int]]]:
    """The pipeline's prefill micro-batches for ``rows`` prompts of ``prompt_len`` tokens (engine/pipeline/serving.py
    ``PipelineRunner._split`` with nothing decoding): prompts in order, up to ``chunk`` tokens a micro-batch, a prompt
    split where the budget ends. Each micro-batch is a list of groups (rows, tokens, start): the engine runs one [rows,
    tokens] forward per chunk length, its keys up to the group's furthest row (start: the latest row's first
    position)."""
    return [_grouped(step) for step in _prefill_pieces(rows, prompt_len, chunk)]


def _prefill_pieces(rows: int, prompt_len: int, chunk: int) -> list[list[tuple[int, int]]]:
    """prefill_micro_batches' micro-batches as their rows' pieces (tokens, start), in row order."""
    out: list[list[tuple[int, int]]] = []
    pos = [0] * rows
    while pos[-1] < prompt_len:
        budget, pieces = chunk, []
        for r in range(rows):
            if budget <= 0:
                break
            if pos[r] >= prompt_len:
                continue
            n = min(prompt_len - pos[r], budget)
            pieces.append((n, pos[r]))
            pos[r] += n
            budget -= n
        out.append(pieces)
    return out


def _grouped(pieces: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Rows' pieces (tokens, start) as the groups (rows, tokens, latest start) the engine runs, by tokens."""
    groups: dict[int, list[int]] = {}  # tokens -> [rows, latest start]
    for n, s in pieces:
        g = groups.setdefault(n, [0, 0])
        g[0] += 1
        g[1] = max(g[1], s)
    return [(g[0], n, g[1]) for n, g in sorted(groups.items())]


def afd_prefill_steps(rows: int, prompt_len: int, chunk: int,
                      micro_batches: int) -> list[list[list[tuple[int, int, int]]]]:
    """AFD's prefill steps on one attention rank of ``rows`` prompts of ``prompt_len`` tokens (engine/afd/serving.py
    ``AFDRunner._rows`` with nothing decoding): the prompts packed as a pipeline packs them (prefill_micro_batches, up
    to ``chunk`` tokens a step), each step's rows split into the engine's micro-batches as engine/afd/driver.py
    ``AFD._micro_batches`` splits them (largest first, each to the one with the fewest tokens so far); a micro-batch is
    a list of groups (rows, tokens, start), the empty ones left out."""
    K = max(1, micro_batches)
    out = []
    for step in _prefill_pieces(rows, prompt_len, chunk):
        bins: list[list[tuple[int, int]]] = [[] for _ in range(K)]
        load = [0] * K
        for t, s in sorted(step, key=lambda p: -p[0]):  # (stable: rows of equal tokens in order, as the engine's)
            k = min(range(K), key=lambda j: (load[j], j))
            bins[k].append((t, s))
            load[k] += t
        out.append([_grouped(b) for b in bins if b])
    return out


def attention_context_work(spec: ModelSpec, layers: list[int], rows: int, tokens: int, start: int,
                           small_op_bytes: float, kv_elem_bytes: float = 2.0) -> Work:
    """What a prefill chunk of ``rows`` x ``tokens`` queries at position ``start`` does beyond the same chunk at
    position 0 (the counted forward): every attention layer's queries also score the ``start`` earlier keys (fewer
    under a sliding window). On a CPU (model/attention.py attend_prefill_cpu) that is torch's fused attention in fp32:
    2 FLOPs per query head, key and channel in each of its two products (MLA's latents serve as keys and values whole,
    the values' extra rope channels dropped after), the keys and values read in fp32, a 16-bit cache's keys cast to
    fp32 first (``kv_elem_bytes``: the cache's bytes per element; 4: no cast), and the mask inverted and read (torch
    makes it additive inside the op the counter sees). A layer with attention sinks runs attend()'s chain: its two
    matmuls (the spec's attention FLOPs per key) write and read back the scores, and scale, mask and softmax passes go
    over them. Recurrent mixers (Mamba, linear attention) carry a fixed-size state: nothing grows."""
    from waferline.spec.model import AttentionSpec, MLASpec

    w = Work()
    if start <= 0:
        return w
    first = next((j for j, la in enumerate(spec.layers) if isinstance(la.mixer, (AttentionSpec, MLASpec))), -1)

    def ew(nbytes: float, whole: float, half: bool = False) -> None:  # one op's bytes, from memory past the small size
        if whole > small_op_bytes:
            if half:
                w.large_bytes_bf16 += nbytes
            else:
                w.large_bytes += nbytes
        elif half:
            w.small_bytes_bf16 += nbytes
        else:
            w.small_bytes += nbytes

    for i in layers:
        m = spec.layers[i].mixer if 0 <= i < len(spec.layers) else None
        if not isinstance(m, (AttentionSpec, MLASpec)):
            continue
        keys = m.cached_tokens(start + tokens) - m.cached_tokens(tokens)
        if keys <= 0:
            continue
        seen = m.cached_tokens(start + tokens)
        qk = float(rows * tokens * keys)
        elems = qk * m.num_heads
        width = m.cache_elems_per_token()
        flops = rows * tokens * (m.attention_flops(start + tokens) - m.attention_flops(tokens))  # (the spec's)
        if isinstance(m, AttentionSpec) and m.sinks:
            # the matmuls also read the keys (and values) the queries score, cast to fp32: 2 x the cached width, 4 B
            w.mm_flops["fp32"] = w.mm_flops.get("fp32", 0.0) + flops
            w.mm_bytes["fp32"] = w.mm_bytes.get("fp32", 0.0) + elems * SCORE_MATMUL_BYTES + rows * keys * width * 8.0
            # each pass: one op over all [rows, tokens, heads, seen] scores; the mask's over [rows, tokens, seen]
            whole = rows * tokens * m.num_heads * seen * 4.0
            ew(elems * SCORE_PASS_BYTES, whole)
            ew(qk * MASK_BYTES, whole / m.num_heads / 2.0)
            continue
        # MLA's latents also serve as values whole (their rope channels too, the output's dropped after): 2 FLOPs per
        # score and rope channel more than the spec's. The op reads its keys and values in fp32 (MLA's one latent
        # tensor passed as both) and the mask
        if isinstance(m, MLASpec):
            flops += 2.0 * elems * m.qk_rope_head_dim
            read = 2 * width
        else:
            read = width
        w.mm_flops["fp32"] = w.mm_flops.get("fp32", 0.0) + flops
        w.mm_bytes["fp32"] = w.mm_bytes.get("fp32", 0.0) + rows * keys * read * 4.0 + qk * FUSED_MASK_READ_BYTES
        if kv_elem_bytes < 4.0:  # the cache's keys (and values) cast to fp32, one op over all it holds
            ew(rows * keys * width * (kv_elem_bytes + 4.0), rows * seen * width * (kv_elem_bytes + 4.0),
               half=kv_elem_bytes == 2.0)
        ew(qk * FUSED_MASK_BYTES, rows * tokens * seen * FUSED_MASK_BYTES)
        if i == first:
            ew(qk * CAUSAL_MASK_BYTES + keys * CAUSAL_MASK_KEY_BYTES, rows * tokens * seen * CAUSAL_MASK_BYTES)
    return w


def prefill_chunk_count(profile: OpsProfile, spec: ModelSpec, rows: int, tokens: int, start: int,
                        small_op_bytes: float, kv_elem_bytes: float = 2.0) -> OpCount:
    """The work of one prefill forward of ``rows`` x ``tokens`` at position ``start``: counted there where the profile
    can (``prefill_chunk``), else its forward at position 0 plus each attention layer's extra keys
    (attention_context_work; ``kv_elem_bytes``: the cache's bytes per element, 4 for an fp32 Plan)."""
    exact = getattr(profile, "prefill_chunk", None)
    if exact is not None:
        c = exact(rows, tokens, start)
        if c is not None:
            return c
    c = profile.prefill(rows, tokens)
    if start <= 0 or not c.traced:
        return c
    layers = {}
    for i, w in c.layers.items():
        extra = attention_context_work(spec, [i], rows, tokens, start, small_op_bytes, kv_elem_bytes)
        if extra.mm_flops:
            w2 = Work()
            w2.add(w)
            w2.add(extra)
            layers[i] = w2
        else:
            layers[i] = w
    return OpCount(layers, c.other, c.traced)


def host_speculation(plan: Plan) -> tuple[int, float, dict[str, Any]]:
    """A plan's speculation as the host model prices it: the drafts k a verify step checks per sequence (0: none), the
    tokens a step emits per sequence ((1 - a^(k+1)) / (1 - a); a: the plan's acceptance, else an assumed 0.5; 1.0
    without speculation) and what a result reports of it."""
    from waferline.sim.cost import expected_tokens_per_step

    sp = plan.speculative
    k = sp.num_tokens if sp.method != "none" else 0
    info: dict[str, Any] = {"method": sp.method}
    if k == 0:
        return 0, 1.0, info
    a = sp.accept_rate if sp.accept_rate is not None else 0.5
    e = expected_tokens_per_step(a, k)
    info.update(num_tokens=k, accept_rate=a, expected_tokens_per_step=e,
                accept_rate_source="given" if sp.accept_rate is not None else "assumed 0.5")
    return k, e, info


def compute_dtype(plan: Plan) -> str:
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

    other = (
        w.small_bytes / rate("fp32_small", host.cache_bandwidth)
        + w.large_bytes / rate("fp32_large", host.memory_bandwidth)
        + w.small_bytes_bf16 / rate("bf16_small", host.cache_bandwidth)
        + w.large_bytes_bf16 / rate("bf16_large", host.memory_bandwidth)
    )
    if scale is None:
        scale = host.linear_scale.get(comp, 1.0) if hot or not host.tables_hot else \
            host.linear_scale_dram.get(comp, host.linear_scale.get(comp, 1.0))
    return (c_op * max(0.0, w.ops - n_calls),
            mm * scale + mm4 * (int4_scale or 0.0) + mm_multi * (multi_scale or 0.0) + multi_s * n_multi
            + other_mm * (1.0 if host.other_mm_unscaled else scale), other + fused_s)


def _hot(host: HostParams, plan: Plan) -> bool:
    """Whether the Plan's weights (all its processes on this host together) stay in the last-level cache."""
    return host.cached(sum(float(getattr(getattr(s, "memory", None), "weights", 0.0) or 0.0) for s in plan.stages))


def _stage_cost(
    host: HostParams,
    plan: Plan,
    spec: ModelSpec,
    table: list[Any],
    layers: list[int],
    count: OpCount,
    rows: int,
    tokens: int,
    has_head: bool,
    head_tokens: int,
    ops_other: bool,
    step_extra: float,
    prefill: bool = False,
) -> _StageCost:
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
            read = (
                lc.weight_bytes
                - lc.num_experts * lc.expert_bytes
                + _touched(lc.num_experts, lc.top_k, n) * lc.expert_bytes
            )
        else:
            read = lc.weight_bytes
        lin_s += lin.time(read, (lc.mixer_flops + lc.ffn_flops) * n)
        cache_s += lc.cache_read * rows / host.memory_bandwidth  # (what a step reads: DSA / CSA less than held)
    if has_head:
        hl = host.linear_for(16, comp)  # the LM head stays 16-bit
        head_b = spec.lm_head_bytes(plan.embed_bits) if spec.lm_head_params() else spec.embed_bytes(plan.embed_bits)
        lin_s += hl.time(head_b, 2.0 * spec.vocab_size * spec.hidden_size * head_tokens)
    return _StageCost(ops_s=c_op * ops, linear_s=lin_s, cache_s=cache_s, extra_s=step_extra)


def counted_op_count(d: dict[str, Any]) -> OpCount:
    """An OpCount from one counted forward as the op counter records it ({"layers": {i: counts}, "other": counts};
    each counts dict: ops, matmul bytes/FLOPs by dtype, small/large bytes)."""
    return OpCount({int(k): Work.from_counts(v.get("ops", 0.0), v) for k, v in d["layers"].items()},
                   Work.from_counts(d["other"].get("ops", 0.0), d["other"]))


def chunk_key(rows: int, tokens: int, start: int) -> str:
    """How counted prefill forwards are keyed: ``rows x tokens`` queries at position ``start``."""
    return f"{rows}|{tokens}|{start}"


class ChunkOps:
    """An ops profile's prefill from counted forwards at their positions in the prompt (``counts``: chunk_key ->
    counted forward): a pipeline chunk answered by its own count (``prefill_chunk``), so a later chunk's attention
    layers carry the keys before it as counted. ``at_position`` False: every chunk as its forward at position 0 (the
    host model then adds attention_context_work for the keys before it). Decode: ``decode`` (a profile), else the
    ModelSpec default."""

    def __init__(self, counts: dict[str, Any], spec: ModelSpec, host: HostParams, at_position: bool = True,
                 decode: OpsProfile | None = None):
        self.counts, self.at_position, self.host = counts, at_position, host
        self.default = decode or DefaultOps(spec.num_layers, host.ops_per_layer.get("bf16", 150.0))

    def count(self, rows: int, tokens: int, start: int) -> OpCount | None:
        """The counted forward of ``rows`` x ``tokens`` at ``start``, None where none was counted. (A chunk that does
        not end its prompt ran no LM head, as in the pipeline.)"""
        d = self.counts.get(chunk_key(rows, tokens, start))
        return counted_op_count(d) if d is not None else None

    def decode(self, rows: int, tokens: int) -> OpCount:
        return self.default.decode(rows, tokens)

    def prefill(self, rows: int, prompt_len: int) -> OpCount:
        c = self.count(rows, prompt_len, 0)
        if c is None:
            raise KeyError(f"no counted prefill forward of {rows} x {prompt_len} tokens at position 0")
        return c

    def prefill_chunk(self, rows: int, tokens: int, start: int) -> OpCount | None:
        return self.count(rows, tokens, start) if self.at_position else None


def chunk_sweeps(cases: list[tuple[int, int]], chunk: int, afd_micro_batches: int | None = None
                 ) -> list[tuple[int, int, int]]:
    """The counted sweeps (rows, prompt length, chunk) that reach every pipeline micro-batch group (rows, tokens,
    start) of ``cases`` (rows, prompt length) at its position (where chunks of equal size lead up to it), and at
    position 0: what a counter feeding ``rows`` prompts in chunks of ``chunk`` tokens into the same caches sees.
    ``afd_micro_batches``: the groups of AFD's prefill micro-batches (afd_prefill_steps) instead, and the one forward
    of all its tokens of a micro-batch of several groups (its FFN part: the FFN ranks run them together)."""
    out: set[tuple[int, int, int]] = set()
    for B, P in cases:
        mbs = (prefill_micro_batches(B, P, chunk) if afd_micro_batches is None else
               [mb for step in afd_prefill_steps(B, P, chunk, afd_micro_batches) for mb in step])
        for mb in mbs:
            if afd_micro_batches is not None and len(mb) > 1:
                n = sum(r * t for r, t, _ in mb)
                out.add((1, n, n))
            for r, t, s in mb:
                out.add((r, t, t))
                if s % t == 0:
                    out.add((r, s + t, t))
                elif s % chunk == 0:
                    out.add((r, s + t, chunk))
    longest: dict[tuple[int, int], int] = {}  # a sweep's chunks of its own size are the longer sweep's too
    for r, P, c in out:
        if P % c == 0:
            longest[(r, c)] = max(longest.get((r, c), 0), P)
    return sorted(x for x in out if x[1] % x[2] or x[1] == longest[(x[0], x[2])])
