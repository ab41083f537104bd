"""Request-level serving simulation: Poisson arrivals, continuous batching within the memory budget, chunked prefill
mixed into decode steps, optional prefill/decode disaggregation and MoE expert skew, streaming latency quantiles."""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from waferline.errors import ConfigError
from waferline.plan.plan import Plan
from waferline.sim.chunking import ChunkExit
from waferline.sim.cost import SimParams, load_params

if TYPE_CHECKING:
    from waferline.sim.cost import LayerCost
    from waferline.spec.hardware import HardwareSpec
    from waferline.spec.model import ModelSpec

DEFAULT_TOKEN_BUDGET = 2048  # max_num_batched_tokens: vLLM's and SGLang's default chunk budget for online serving
SKETCH_REL_ERROR = 0.005  # relative error of every reported percentile (QuantileSketch)
_INF = math.inf


# ----------------------------------------------------------------------------- streaming quantiles


class QuantileSketch:
    """Streaming quantiles in fixed log-spaced bins (DDSketch-style), with weights.

    Bin ``i`` holds the values in (g^(i-1), g^i] with g = (1 + a) / (1 - a); a quantile is answered with
    2 g^i / (g + 1), which is within relative error ``a`` of every value in that bin, so each reported percentile is
    within ``a`` (default 0.5 %) of the exact order statistic of the same rank (the smallest x with at least
    ceil(q n) values <= x). Values at or below ``lo`` (1 ns) count in one bin reported as the smallest value seen;
    answers are clamped to [min, max] of what was added. Memory: one float per bin (~3,500 bins for 1 ns..1e6 s, ``hi``;
    more are added as larger values come, as an overloaded queue's do), whatever the number of values.
    """

    def __init__(self, rel_error: float = SKETCH_REL_ERROR, lo: float = 1e-9, hi: float = 1e6) -> None:
        if not 0.0 < rel_error < 0.5:
            raise ConfigError(f"sketch relative error must be in (0, 0.5), got {rel_error}")
        self.rel_error = rel_error
        self._g = (1.0 + rel_error) / (1.0 - rel_error)
        self._inv_log_g = 1.0 / math.log(self._g)
        self._lo = lo
        self._off = math.ceil(math.log(lo) * self._inv_log_g)  # index of the bin holding lo
        self._bins = [0.0] * (math.ceil(math.log(hi) * self._inv_log_g) - self._off + 2)
        self.count = 0.0
        self.total = 0.0
        self.min = _INF
        self.max = -_INF

    def add(self, x: float, weight: float = 1.0) -> None:
        """Record ``weight`` occurrences of value ``x``."""
        if weight <= 0:
            return
        if x <= self._lo:
            i = 0
        else:
            i = math.ceil(math.log(x) * self._inv_log_g) - self._off
            if i >= len(self._bins):  # (past ``hi``: the bins grow, each keeping its relative error)
                self._bins.extend([0.0] * (i + 1 - len(self._bins)))
        self._bins[i] += weight
        self.count += weight
        self.total += x * weight
        if x < self.min:
            self.min = x
        if x > self.max:
            self.max = x

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def quantile(self, q: float) -> float:
        """The value of rank ceil(q n) (as an exact sorted-list percentile), within ``rel_error``; 0 when empty."""
        if not self.count:
            return 0.0
        rank = min(self.count, max(1.0, math.ceil(q * self.count - 1e-9)))
        acc = 0.0
        for i, c in enumerate(self._bins):
            acc += c
            if acc >= rank:
                if i == 0:
                    return self.min
                est = 2.0 * self._g ** (i + self._off) / (self._g + 1.0)
                return min(self.max, max(self.min, est))
        return self.max


# ----------------------------------------------------------------------------- result


@dataclass
class ServingResult:
    """Per-request latency percentiles and throughput of one simulated serving run."""

    requests: int
    arrival_rate: float
    max_batch: int
    duration_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    mean_batch: float  # requests decoding at once, averaged over the run's duration (idle time included)
    # added with the event-driven loop; older readers ignore them
    prefill_mode: str = "chunked"  # chunked (mixed into decode steps) | stop-the-world (one prompt at a time)
    max_num_batched_tokens: int = 0  # token budget of one step (0 with stop-the-world prefill)
    pd_disaggregation: bool = False
    prefill_devices: int = 0  # devices of the prefill pool (PD), else 0
    kv_handover_s: float = 0.0  # one request's KV cache from the prefill to the decode pool (PD)
    expert_skew: float = 0.0  # Zipf exponent of expert popularity (0 = uniform routing)
    expert_load_factor: float = 1.0  # busiest expert-parallel rank's load over the mean rank's (MoE compute x)
    ttft_mean_s: float = 0.0
    itl_p90_s: float = 0.0
    itl_mean_s: float = 0.0
    e2e_p90_s: float = 0.0
    e2e_mean_s: float = 0.0
    steps: int = 0  # engine iterations simulated (decode pool)
    quantile_rel_error: float = SKETCH_REL_ERROR  # bound on each percentile's relative error (streaming sketch)
    users: int = 0  # closed loop: this many clients, each sending its next request when the last one ends (else 0)
    expert_placement: str = ""  # expert skew: the expert placement ``expert_load_factor`` assumes (else "")
    # Poisson arrivals the run may not have kept up with: the requests/s this engine completes with every request
    # queued from the start (0: not measured -- the run kept up with its arrivals, or a closed loop)
    capacity_rps: float = 0.0
    overloaded: bool = False  # arrival_rate > capacity_rps: queues grow without bound, latencies with the run's length
    # 90% interval of each predicted figure (sim/intervals.py SERVING_FIGURES) over the fit's parameter sets; {}: none
    intervals: dict[str, list[float] | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("intervals")
        return d | {f"{k}_interval": v for k, v in self.intervals.items()}


# ----------------------------------------------------------------------------- pricing


def _inclusion(num_experts: int, top_k: int, skew: float) -> list[float]:
    """Probability that expert i (i = 0 the most popular) is among a token's ``top_k`` distinct experts when a
    routing slot picks expert i with probability p_i ~ (i + 1)^-skew, drawn without replacement: Rosén's
    approximation of successive sampling, q_i = 1 - exp(-p_i tau) with tau such that sum q_i = top_k (within a few %
    of a Monte-Carlo for E = 64..384, top_k 6..8). Solved in logarithms (log p_i, log tau): at a large skew the
    rarest experts' p_i underflow and tau passes the largest float, where the top_k most popular are picked."""
    k = min(top_k, num_experts)
    if k >= num_experts:
        return [1.0] * num_experts
    skew = min(skew, 1e6)  # (past this the top_k most popular take every pick, to rounding, for any E up to 10^5)
    lw = [-skew * math.log(i + 1) for i in range(num_experts)]  # (the most popular first: lw[0] = 0 is the largest)
    lse = math.log(sum(math.exp(x) for x in lw))
    lp = [x - lse for x in lw]

    def mass(lt: float) -> float:
        return sum(-math.expm1(-math.exp(min(x + lt, 700.0))) for x in lp)

    lo = math.log(k)  # (mass(tau) < tau: tau > k)
    hi = lo + 1.0
    while mass(hi) < k * (1 - 1e-12):
        hi = lo + 2.0 * (hi - lo)
        if hi > 1e300:
            break
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mass(mid) < k:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12:
            break
    q = [-math.expm1(-math.exp(min(x + hi, 700.0))) for x in lp]
    f = k / sum(q)  # (the bisection's last rounding)
    return [min(1.0, x * f) for x in q]


@functools.lru_cache(maxsize=256)
def expert_load_factor(num_experts: int, top_k: int, skew: float, ranks: int | None = None) -> float:
    """The busiest expert-parallel rank's expected load over the mean rank's when expert popularity follows
    Zipf(``skew``): the compute multiplier of the routed experts in a step that waits for its slowest rank.

    ``ranks``: how many devices (or, on a wafer, core regions) the layer's experts are spread over, in contiguous
    blocks -- the first ``num_experts mod ranks`` ranks one expert more, as ``plan.place.expert_split`` splits them
    and as vLLM's and SGLang's default (linear) expert placement does -- with the most popular experts numbered first,
    so the hottest experts share rank 0 (the worst case of that placement). A rank's load is the sum over its experts
    of the chance a token picks that expert (``_inclusion``), against that rank's load under uniform routing (the
    pipeline model's assumption, which prices a layer's experts as spread evenly: a rank holding one expert more than
    another is not counted at any skew, so the factor is continuous at skew 0). Default (``ranks`` None): one rank
    per expert, the hottest expert's load over the mean. 1 at skew 0 (uniform routing) or on one rank (a device
    holding every expert does their total work whatever the split); at most min(ranks, E / top_k): a rank's experts
    take at most every token's top_k picks."""
    if skew <= 0 or num_experts <= 0 or top_k <= 0:
        return 1.0
    R = num_experts if ranks is None else max(1, min(int(ranks), num_experts))
    if R == 1:
        return 1.0
    q = _inclusion(num_experts, top_k, skew)
    base, extra = divmod(num_experts, R)
    busiest, a = 0.0, 0
    for r in range(R):
        b = a + base + (1 if r < extra else 0)
        busiest = max(busiest, sum(q[a:b]) / (b - a))  # (over its uniform load: its experts x top_k / E)
        a = b
    return max(1.0, busiest * num_experts / sum(q))


def expert_ranks(plan: Plan, hw: HardwareSpec) -> tuple[dict[int, int] | None, str]:
    """Per MoE layer index: over how many ranks its routed experts are spread in ``plan`` (``expert_load_factor``'s
    ``ranks``; None: one rank per expert for every layer), and the assumption in words.

    GPU-style stage: expert parallel over the stage's devices (contiguous blocks). The engine's AFD layout: over the
    FFN ranks (``expert_split``), each rank's devices splitting its share evenly. A wafer: weight-stationary, each
    expert's weights sit on their own cores, which do that expert's work: one rank per expert."""
    from waferline.sim.pipeline import is_afd_ranks

    if hw.kind == "wafer":
        return None, "wafer: each expert's weights stay on their own cores (one rank per expert)"
    out: dict[int, int] = {}
    if is_afd_ranks(plan):
        ffn = [s for s in plan.stages if s.role == "ffn"]
        for s in ffn:
            for j in s.layers:
                out[j] = len(ffn)
        return out, f"contiguous expert blocks over the {len(ffn)} FFN rank(s), most popular experts first"
    for s in plan.stages:
        if s.role in ("full", "ffn"):
            for j in s.layers:
                out[j] = max(out.get(j, 1), s.num_devices)
    n = sorted(set(out.values()))
    if n == [1] or not n:
        return out, ("every expert on one device: it does their total work whatever the skew (factor 1; one hot "
                     "expert's GEMM is not priced apart)")
    return out, (f"contiguous expert blocks over each stage's {'/'.join(str(x) for x in n)} devices (expert "
                 "parallel), most popular experts first")


def _skewed(table: list[LayerCost], skew: float, ranks: dict[int, int] | None = None
            ) -> tuple[list[LayerCost], float]:
    """The layer table with each MoE layer's routed-expert FLOPs multiplied by its expert load factor.

    The devices a layer's experts are spread over (``ranks``: layer index -> count; a layer not in it, or ``ranks``
    None, has one rank per expert) wait for the busiest, so the routed part of the FFN compute scales with the
    busiest rank's load over the mean rank's. Weight reads are left as they are: each touched expert is read once
    however many tokens it serves (skew in fact touches fewer experts at small batch; not credited here), so
    memory-bound decode barely changes and compute-bound steps (prefill, large batches) slow down.
    """
    if skew <= 0:
        return table, 1.0
    out, worst = [], 1.0
    for lc in table:
        if not lc.is_moe or lc.num_experts <= 0:
            out.append(lc)
            continue
        f = expert_load_factor(lc.num_experts, lc.top_k, skew, None if ranks is None else ranks.get(lc.index))
        worst = max(worst, f)
        routed = lc.top_k * lc.expert_bytes
        frac = routed / (routed + lc.dense_ffn_bytes) if routed + lc.dense_ffn_bytes > 0 else 0.0
        out.append(replace(lc, ffn_flops=lc.ffn_flops * (1.0 + frac * (f - 1.0))))
    return out, worst


class _Pricer:
    """Step times of one pool's plan, cached per batch size / chunk size (the pipeline model is priced once each)."""

    def __init__(self, plan: Plan, spec: ModelSpec, hw: HardwareSpec, params: SimParams, P: int, O: int,
                 skew: float, layout: int | None = None) -> None:
        from waferline.sim.cost import layer_table
        from waferline.sim.pipeline import _Ctx, is_afd_ranks, layout_rows

        self.plan, self.spec, self.hw, self.params, self.P, self.O = plan, spec, hw, params, P, O
        # one layout of a wafer's regions for the whole run, made for ``layout`` sequences (the most it holds at once):
        # a deployment is compiled once, not for each batch it happens to step (None: each step laid out for its own)
        self.layout = layout
        self.ctx = _Ctx(plan, spec, hw, params.for_hardware(hw), params,
                        layout_batch=layout_rows(plan, layout) if layout else None)
        self.afd = is_afd_ranks(plan)
        self.dtable = layer_table(spec, plan.weight_bits, plan.kv_bits, P + O // 2, plan.group_size)
        self.ptable = layer_table(spec, plan.weight_bits, plan.kv_bits, max(1, P // 2), plan.group_size)
        ranks, self.expert_placement = expert_ranks(plan, hw)
        self.dtable_s, self.load_factor = _skewed(self.dtable, skew, ranks)
        self.ptable_s, _ = _skewed(self.ptable, skew, ranks)
        self.skew = skew
        self._dec: dict[int, float] = {}
        self._chunk: dict[int, tuple[float, float]] = {}

    def _price(self, table: list[LayerCost], batch: int, tokens: int, resident: int) -> tuple[float, float]:
        """(latency of one step through every stage and hop, time the slowest stage is busy with it); the LM head at
        one position per sequence (a chunk's last, as the pipeline model prices prefill)."""
        from waferline.sim.pipeline import _afd_ffn_rows, _afd_layer_times, _step

        if self.afd:
            M = sum(1 for s in self.plan.stages if s.role == "attention")
            b = math.ceil(batch / M)
            K = max(1, min(self.plan.micro_batches, b))
            t = _afd_layer_times(self.ctx, table, math.ceil(b / K), tokens, K, max(resident, b),
                                 _afd_ffn_rows(batch, M, K))[0]
            return t, t
        total, _, slowest = _step(self.ctx, table, batch, tokens, resident, want_timings=False, head_tokens=1)
        return total, min(total, slowest)

    def decode_step(self, b: int) -> float:
        """Seconds per token of every one of ``b`` decoding requests: 1 / the pipeline model's per-user rate
        (micro-batching and speculative decoding included), times the expert-skew slowdown of one decode step."""
        t = self._dec.get(b)
        if t is None:
            from waferline.sim.pipeline import simulate

            t = 1.0 / simulate(self.plan, prompt_len=self.P, output_len=self.O, concurrency=b, params=self.params,
                               spec=self.spec, hardware=self.hw,
                               layout_concurrency=self.layout).decode_tokens_per_s_per_user
            if self.skew > 0:
                S = max(1, self.plan.num_stages)
                bm = math.ceil(b / max(1, min(b, S)))
                t *= self._price(self.dtable_s, bm, 1, b)[0] / self._price(self.dtable, bm, 1, b)[0]
            self._dec[b] = t
        return t

    def chunk(self, n: int) -> tuple[float, float]:
        """A forward pass of ``n`` tokens (weights read once; attention priced at half the prompt's context, as the
        pipeline model prices prefill): (how long it holds the pipeline -- its slowest stage, so that the next step
        can enter behind it as the pipeline model's chunked prefill does --, the further time until its last stage is
        done -- the drain, 0 on one stage)."""
        t = self._chunk.get(n)
        if t is None:
            total, slowest = self._price(self.ptable_s, 1, n, 1)
            t = self._chunk[n] = (slowest, total - slowest)
        return t

    def whole_prefill(self) -> float:
        """One prompt prefilled alone, the pipeline model's prefill (chunks of 512 pipelined through the stages)."""
        from waferline.sim.pipeline import PREFILL_CHUNK, simulate

        t = simulate(self.plan, prompt_len=self.P, output_len=1, concurrency=1, params=self.params, spec=self.spec,
                     hardware=self.hw, layout_concurrency=self.layout).prefill_s
        if self.skew > 0:
            C = min(self.P, PREFILL_CHUNK)
            t *= self._price(self.ptable_s, 1, C, 1)[0] / self._price(self.ptable, 1, C, 1)[0]
        return t


def _arrivals(rng: random.Random, rate: float, n: int) -> Iterator[float]:
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        yield t


def _take_chunks(queue: deque[list[float]], room: int) -> tuple[int, int]:
    """Fill ``room`` tokens with prompt chunks from the front of ``queue`` ([arrival, tokens left] each): (tokens
    taken, requests whose prompt is now complete -- a prefix of the queue)."""
    c = finished = 0
    for r in queue:
        take = min(r[1], room - c)
        r[1] -= take
        c += int(take)
        if r[1] > 0:
            break
        finished += 1
        if c >= room:
            break
    return c, finished


def _prefill_pool(pr: _Pricer, arrivals: Iterator[float], budget: int, handover: float, ttft: QuantileSketch,
                  overhead: float) -> Iterator[tuple[float, float, float]]:
    """PD disaggregation's prefill pool: yields (ready for decode, arrival, first token time) in time order.

    Chunked (``budget`` > 0): each step prefills up to ``budget`` prompt tokens of the queue, first come first
    served, in one forward pass. Otherwise one prompt at a time. The first token leaves with the prefill; the KV cache
    then takes ``handover`` seconds to reach the decode pool."""
    P = pr.P
    nxt = next(arrivals, _INF)
    t = 0.0
    if budget <= 0:
        whole = pr.whole_prefill()
        while nxt < _INF:
            t = max(t, nxt) + whole
            ttft.add(t - nxt + overhead)
            yield t + handover, nxt, t
            nxt = next(arrivals, _INF)
        return
    q: deque[list[float]] = deque()  # [arrival, prompt tokens left]
    out: list[tuple[float, float, float]] = []  # done, not yet yielded (the drain makes them finish out of order)
    ex = ChunkExit()
    while True:
        while nxt <= t:
            q.append([nxt, float(P)])
            nxt = next(arrivals, _INF)
        start = t if q else nxt
        while out and out[0][0] <= start:  # later steps end after ``start``: nothing can come before these
            yield heapq.heappop(out)
        if not q:
            if nxt == _INF:
                while out:
                    yield heapq.heappop(out)
                return
            t = nxt
            continue
        c, done = _take_chunks(q, budget)
        hold, drain = pr.chunk(c)
        n = 1 if done else math.ceil(q[0][1] / c)  # (the same chunk of one long prompt, step after step: one jump)
        q[0][1] -= (n - 1) * c
        t += n * hold
        ft = ex.after(t, n * hold, drain)  # the chunk leaves the last stage (not before the chunk ahead of it)
        for _ in range(done):
            a = q.popleft()[0]
            ttft.add(ft - a + overhead)
            heapq.heappush(out, (ft + handover, a, ft))


# ----------------------------------------------------------------------------- the simulation


def simulate_serving(plan: Plan, *, arrival_rate: float | None = None, num_requests: int = 200,
                     prompt_len: int | None = None, output_len: int | None = None, max_batch: int | None = None,
                     seed: int = 0, params: SimParams | None = None, max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET,
                     pd_disaggregation: bool = False, prefill_plan: Plan | None = None,
                     expert_skew: float = 0.0, users: int | None = None, check_capacity: bool = True,
                     _saturated: list[float] | None = None) -> ServingResult:
    """Serve ``num_requests`` Poisson arrivals at ``arrival_rate``/s with continuous batching, event by event; or,
    with ``users`` (a closed loop, as load generators such as genai-perf or vLLM's benchmark at a fixed concurrency
    drive a server), that many clients that start together and each send their next request the moment the last one
    ends (its end-to-end latency, the request overhead included, after it was sent), until ``num_requests`` have been
    sent (the reported ``arrival_rate`` is then the achieved one; the first wave, sent all at once, is a warm-up left
    out of TTFT and end-to-end).

    At most ``max_batch`` requests (default: what fits in the plan's memory) hold a KV cache at once, counting those
    being prefilled. Every step each decoding request gains one token at the per-user rate the pipeline model gives
    for the batch (speculative decoding included, cached per batch size); stretches of steps in which nothing arrives
    or finishes are taken in one jump, so the cost grows with the number of requests, not tokens.

    Prefill, colocated (``max_num_batched_tokens`` > 0, vLLM / SGLang chunked prefill): a step carries one token per
    decoding request and fills the rest of the token budget with prompt chunks of admitted requests, first come first
    served. The step is one forward pass: the weights are read once for decode and prefill tokens together and the
    FLOPs of every token are done, so it costs max(decode step at batch b, one pass of b + c tokens) -- the decode
    step is memory- or latency-bound, the chunk compute-bound, and the fused pass pays the larger, not the sum (the
    sum would read the weights and pay the fixed per-layer latency twice). A step with no chunk is the plain decode
    step, so the decode numbers are the pipeline model's. On several stages a step holds the pipeline for its
    slowest stage, then the next step enters behind it; the stages take chunks in order, so a chunk leaves the last
    stage at max(its step's end + its drain, the chunk ahead's exit + its own slowest stage) -- the steady-state
    TTFT's rule too (``sim.chunking``) --, and a prompt's first token comes when its last chunk leaves, never before
    an earlier, larger chunk of it has.
    ``max_num_batched_tokens=0``: stop-the-world prefill -- each admitted prompt is prefilled alone (the pipeline
    model's prefill time) while decoding pauses.

    ``pd_disaggregation`` (or a ``prefill_plan``): prompts are prefilled on a separate pool (``prefill_plan``, default a
    second copy of ``plan``) with the same token budget; after the first token the request's KV cache
    (ModelSpec.cache_bytes_per_seq at the prompt length) moves to the decode pool over the scale-out link, each of
    min(prefill, decode devices that hold its cache; not AFD's FFN ranks, and of the engine's data-parallel AFD
    attention ranks only the one it lives on) devices sending its share in parallel; the decode pool only decodes. The
    prefill pool keeps a finished prompt's cache until the decode pool has room for it (its memory is not capped).

    ``expert_skew`` (MoE): Zipf exponent of expert popularity; the routed-expert FLOPs of every step scale by the
    busiest expert-parallel rank's expected load over the mean rank's (``expert_load_factor`` over the ranks
    ``expert_ranks`` finds in the plan: contiguous expert blocks, most popular experts first; 1 on one device; on a
    wafer one rank per expert; 0 = uniform routing, the pipeline model's assumption).

    Latencies go into streaming quantile sketches (relative error ``SKETCH_REL_ERROR``); memory stays bounded by the
    requests in flight and in the queue.

    ``check_capacity``: where Poisson arrivals finish more slowly than they came (fewer than 97 % of ``arrival_rate``
    requests/s over the run, the last one ending later after it came than the fastest request took by over 5 % of
    the arrivals' span), the engine's capacity -- the rate at which it completes requests with all of them queued
    from the start, in its steady stretch -- is measured by a second run (``_saturation_rate``): above it
    (``overloaded``) the queues grow without bound, so TTFT and end-to-end grow with ``num_requests``, not to a steady
    state. ``_saturated`` (internal): every request arrives at 0 and each end time is appended to this list.
    """
    from waferline.plan.place import batch_capacity
    from waferline.sim.pipeline import plan_drafter
    from waferline.spec.catalog import load_hardware, load_model

    if users is not None:
        if arrival_rate is not None or users < 1 or pd_disaggregation or prefill_plan is not None:
            raise ConfigError(f"a closed loop takes users >= 1 (got {users}), without an arrival rate or a separate "
                              "prefill pool")
    elif arrival_rate is None or not (arrival_rate > 0 and math.isfinite(arrival_rate)):
        raise ConfigError(f"arrival rate must be > 0 (got {arrival_rate})")
    if num_requests < 1:
        raise ConfigError(f"the simulation needs requests >= 1 (got {num_requests})")
    if users is not None and users > 1 and num_requests <= users:  # (one client's first request is reported)
        raise ConfigError(f"a closed loop of {users} clients needs more than {users} requests (got {num_requests}): "
                          "the first wave, one request per client, is warm-up and not reported")
    if max_num_batched_tokens is None or max_num_batched_tokens < 0:
        raise ConfigError(f"the step token budget (--max-num-batched-tokens) must be >= 0 (0 = stop-the-world "
                          f"prefill), got {max_num_batched_tokens}")
    if not (expert_skew >= 0 and math.isfinite(expert_skew)):
        raise ConfigError(f"expert skew (--expert-skew, a Zipf exponent) must be a finite number >= 0, "
                          f"got {expert_skew}")
    if max_batch is not None and max_batch < 1:
        raise ConfigError(f"max batch must be >= 1, got {max_batch}")
    params = params or load_params()
    spec = load_model(plan.model)
    hw = load_hardware(plan.hardware)
    P = int(prompt_len if prompt_len is not None else params.default_prompt_len)
    O = int(output_len if output_len is not None else params.default_output_len)
    if P < 1 or O < 1:
        raise ConfigError(f"prompt and output lengths must be >= 1 (got {P}, {O})")
    if expert_skew > 0 and not any(getattr(layer.ffn, "num_experts", 0) for layer in spec.layers):
        raise ConfigError(f"expert skew is for MoE models; {spec.name} has no routed experts")
    cap = max_batch or batch_capacity(plan, spec, P + O, plan_drafter(plan, params),
                                      params.draft_tokens(plan.speculative))
    if cap < 1:
        raise ConfigError(
            f"not even one sequence of {P + O} tokens fits next to the weights; plan more devices or a shorter context"
        )
    budget = int(max_num_batched_tokens)
    pd = pd_disaggregation or prefill_plan is not None
    if prefill_plan is not None and prefill_plan.model != plan.model:
        raise ConfigError(f"the prefill pool serves {prefill_plan.model}, the decode pool {plan.model}: use one model")
    dec = _Pricer(plan, spec, hw, params, P, O, expert_skew, layout=cap)
    ovh = params.ttft_overhead_s
    ttft, itl, e2e = QuantileSketch(), QuantileSketch(), QuantileSketch()
    # arrivals: Poisson, or (closed loop) a heap of the clients' next sends, refilled as requests end
    pending = [0.0] * min(users, num_requests) if users else []
    issued = len(pending)
    arr = _arrivals(random.Random(seed), arrival_rate, num_requests) if not users else iter(())
    if _saturated is not None:
        arr = iter([0.0] * num_requests)

    def first_wave(a: float) -> bool:
        """Closed loop with several clients: their first requests, all sent at once, are a warm-up (their queueing
        behind one another is the start, not the steady state): left out of TTFT and end-to-end."""
        return users is not None and users > 1 and a == 0.0

    def advance() -> float:
        """The arrival after the one just taken (``nxt_arr``)."""
        if users:
            heapq.heappop(pending)
            return pending[0] if pending else _INF
        return next(arr, _INF)

    handover = 0.0
    pplan = None
    source: Iterator[tuple[float, float, float]] | None = None
    nxt_src: tuple[float, float, float] | None = None
    if pd:
        pplan = prefill_plan or plan
        if pplan is not plan and batch_capacity(pplan, spec, P, spec_tokens=0) < 1:  # (a prefill verifies nothing)
            raise ConfigError(f"the prefill pool ({pplan.num_devices} x {pplan.hardware}) cannot hold the weights and "
                              f"one {P}-token prompt's cache; give it more devices (--prefill-devices) or fewer bits")
        phw = load_hardware(pplan.hardware)
        pre_pool = _Pricer(pplan, spec, phw, params, P, O, expert_skew) if pplan is not plan else dec
        from waferline.sim.cost import hop_time
        from waferline.sim.pipeline import is_afd_ranks

        def holders(pl: Plan) -> int:  # (devices that hold one request's cache: not an AFD plan's FFN ranks; under
            # the engine's AFD ranks, the one data-parallel attention rank the request lives on)
            if is_afd_ranks(pl):
                return min(st.num_devices for st in pl.stages if st.role == "attention")
            return len({d for st in pl.stages if st.role != "ffn" for d in st.device_ids})

        links = max(1, min(holders(pplan), holders(plan)))
        kv = spec.cache_bytes_per_seq(P, plan.kv_bits)
        dpn = max(1, hw.devices_per_node)
        handover = hop_time(hw, dec.ctx.prm, 0, dpn, kv / links)  # device 0 to a device of another node
        source = _prefill_pool(pre_pool, arr, budget, handover, ttft, ovh)
        nxt_src = next(source, None)
        nxt_arr = _INF
    else:
        nxt_arr = pending[0] if users else next(arr, _INF)
    whole = dec.whole_prefill() if not pd and budget == 0 else 0.0

    waiting: deque[float] = deque()  # colocated: arrived, not admitted yet
    prefilling: deque[list[float]] = deque()  # chunked: [arrival, prompt tokens left], holding KV memory
    ready: list[tuple[float, float, float]] = []  # heap: (may start decoding at, arrival, first token time)
    heap: list[tuple[int, float]] = []  # decoding: (step after which its last token is out, arrival)
    joiners: list[float] = []  # first-token times of requests whose first decode step is the next one
    t = t_prev = t_last = 0.0
    ex = ChunkExit()
    first_arrival = _INF
    last_arrival = 0.0
    k = 0  # decode steps done; a request joining after step k has its O-th token after step k + O - 1
    steps = done = 0
    busy = 0.0  # sum over steps of batch x step time

    def finish(a: float, when: float) -> None:
        nonlocal done, t_last, issued, nxt_arr
        if not first_wave(a):
            e2e.add(when - a + ovh)
        done += 1
        t_last = max(t_last, when)
        if _saturated is not None:
            _saturated.append(when)
        if users and issued < num_requests:  # (closed loop: this client sends its next request once it has this
            # one's end, the request overhead after the last token: its cycle is the end-to-end latency it measures)
            heapq.heappush(pending, when + ovh)
            issued += 1
            nxt_arr = pending[0]

    def join(a: float, ft: float) -> None:
        if O == 1:
            finish(a, ft)
        else:
            heapq.heappush(heap, (k + O - 1, a))
            joiners.append(ft)

    while done < num_requests:
        # 1. arrivals (PD: requests handed over by the prefill pool) up to now
        if pd:
            while nxt_src is not None and nxt_src[0] <= t:
                heapq.heappush(ready, nxt_src)
                first_arrival = min(first_arrival, nxt_src[1])
                last_arrival = max(last_arrival, nxt_src[1])
                nxt_src = next(source, None)  # type: ignore[arg-type]
        else:
            while nxt_arr <= t:
                waiting.append(nxt_arr)
                first_arrival = min(first_arrival, nxt_arr)
                last_arrival = max(last_arrival, nxt_arr)
                nxt_arr = advance()
        # 2. requests whose first token is out start decoding (PD: when the decode pool has room for their cache)
        while ready and ready[0][0] <= t and len(heap) < cap:
            _, a, ft = heapq.heappop(ready)
            join(a, ft)
        # 3. prefill
        c = finished = room = 0
        if not pd and budget == 0:  # stop-the-world: prefill every admissible waiting prompt, decode paused
            while waiting and len(heap) < cap:
                a = waiting.popleft()
                busy += len(heap) * whole  # (the batch holds its places, paused: they count as decoding, as its ITL)
                t += whole
                if not first_wave(a):
                    ttft.add(t - a + ovh)
                join(a, t)
                while nxt_arr <= t:
                    waiting.append(nxt_arr)
                    nxt_arr = advance()
        elif not pd:  # chunked: admit, then fill what decoding leaves of the token budget with prompt chunks
            while waiting and len(heap) + len(prefilling) + len(ready) < cap:
                prefilling.append([waiting.popleft(), float(P)])
            room = budget - len(heap) - len(ready)  # (ready: prompts still draining, about to decode a token a step)
            if prefilling and room > 0:
                c, finished = _take_chunks(prefilling, room)
        b = len(heap)
        # the next moment something could join the batch
        if pd:
            nxt_time = min(ready[0][0] if ready else _INF, nxt_src[0] if nxt_src is not None else _INF) \
                if b < cap else _INF
        else:
            nxt_time = ready[0][0] if ready else _INF
            if (b < cap and budget == 0) or (room > 0 and b + len(prefilling) + len(ready) < cap):
                nxt_time = min(nxt_time, nxt_arr)
        if b == 0 and c == 0:  # idle
            if done >= num_requests:
                break
            if nxt_time == _INF:
                raise AssertionError("serving simulation stalled with requests outstanding")
            t = t_prev = max(t, nxt_time)
            continue
        # 4. price the step, or a stretch of identical decode steps up to the next event
        hold = drain = 0.0
        if c == 0:
            T = dec.decode_step(b)
        else:
            hold, drain = dec.chunk(b + c)
            T = max(dec.decode_step(b), hold) if b else hold
        # (a chunk that leaves its prompt unfinished takes the whole room: the steps after it take the same chunk of
        # the same prompt, up to the step that finishes it -- a long prompt under a small budget is one jump too)
        n = heap[0][0] - k if c == 0 else (math.ceil(prefilling[0][1] / c) if not finished else 1)
        if n > 1:  # until the next request finishes...
            if b:
                n = min(n, heap[0][0] - k)
            if nxt_time < _INF:
                n = min(n, math.ceil((nxt_time - t) / T))  # ...or the next one could join
            n = max(1, n)
            if c:
                prefilling[0][1] -= (n - 1) * c
        # 5. every decoding request gets a token per step
        if b:
            old = b - len(joiners)
            if old:
                itl.add(t + T - t_prev, old)
            for ft in joiners:
                itl.add(t + T - ft)
            if n > 1:
                itl.add(T, b * (n - 1))
            busy += b * n * T
        joiners.clear()
        t += n * T
        k += n
        steps += n
        t_prev = t
        # a chunk leaves the last stage after the pipeline drains, and not before the chunk ahead of it
        # (n identical chunks: the exit of the last, max(the previous exit + n holds, this step's end + its drain), as
        # n calls would give: each step takes T >= hold)
        ft = ex.after(t, n * hold, drain) if c else t
        for _ in range(finished):
            a = prefilling.popleft()[0]
            if not first_wave(a):
                ttft.add(ft - a + ovh)
            if ft > t:
                heapq.heappush(ready, (ft, a, ft))
            else:
                join(a, ft)
        while heap and heap[0][0] <= k:
            finish(heapq.heappop(heap)[1], t)

    duration = t_last - first_arrival
    rate = arrival_rate if arrival_rate is not None else (num_requests / duration if duration > 0 else 0.0)
    capacity = 0.0
    # (a queue that may have grown: requests finished more slowly than they came, and the last one ended later after
    # it came than the fastest request took by over 5 % of the arrivals' span -- an overloaded queue's backlog at the
    # last arrival takes (arrival rate / capacity - 1) x that span to clear)
    if check_capacity and not users and _saturated is None and arrival_rate is not None and duration > 0 \
            and num_requests / duration < 0.97 * arrival_rate \
            and t_last - last_arrival > (e2e.min - ovh) * (1 + 1e-9) + 0.05 * (last_arrival - first_arrival):
        capacity = _saturation_rate(plan, cap, prompt_len=P, output_len=O, max_batch=max_batch, params=params,
                                    max_num_batched_tokens=budget, pd_disaggregation=pd_disaggregation,
                                    prefill_plan=prefill_plan, expert_skew=expert_skew)
    return ServingResult(
        requests=num_requests, arrival_rate=rate, max_batch=cap, duration_s=duration,
        output_tokens_per_s=num_requests * O / duration if duration > 0 else 0.0,
        ttft_p50_s=ttft.quantile(0.5), ttft_p90_s=ttft.quantile(0.9), ttft_p99_s=ttft.quantile(0.99),
        itl_p50_s=itl.quantile(0.5), itl_p99_s=itl.quantile(0.99), e2e_p50_s=e2e.quantile(0.5),
        e2e_p99_s=e2e.quantile(0.99), mean_batch=busy / duration if duration > 0 else 0.0,
        prefill_mode="chunked" if budget > 0 else "stop-the-world", max_num_batched_tokens=budget,
        pd_disaggregation=pd, prefill_devices=pplan.num_devices if pplan is not None else 0, kv_handover_s=handover,
        expert_skew=expert_skew, expert_load_factor=dec.load_factor, ttft_mean_s=ttft.mean,
        itl_p90_s=itl.quantile(0.9), itl_mean_s=itl.mean, e2e_p90_s=e2e.quantile(0.9), e2e_mean_s=e2e.mean,
        steps=steps, quantile_rel_error=ttft.rel_error, users=users or 0,
        expert_placement=dec.expert_placement if expert_skew > 0 else "",
        capacity_rps=capacity, overloaded=0 < capacity < rate,
    )


def _saturation_rate(plan: Plan, cap: int, **kw: Any) -> float:
    """Requests/s the engine completes with every request queued from the start, over its steady stretch: from the
    ``cap``-th end (the first batch, filled from empty, left out) over a whole number of batches (at least 4 and 400
    requests: a stop-the-world batch refills and ends together, and a stretch of a batch and a half would count one
    burst of ends too many), before the last batch drains."""
    m = max(4, math.ceil(400 / cap))
    i = cap - 1
    j = i + m * cap
    ends: list[float] = []
    simulate_serving(plan, arrival_rate=1.0, num_requests=j + 1 + cap, check_capacity=False, _saturated=ends, **kw)
    ends.sort()
    return (j - i) / (ends[j] - ends[i]) if ends[j] > ends[i] else _INF
