"""Placement: put a model's layers on devices, check memory per device, and explain in bytes why a plan does not fit."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from waferline.errors import ConfigError, FitError
from waferline.plan.plan import MAX_DEVICES, MemoryBreakdown, Plan, SpeculativeConfig, Stage
from waferline.spec.hardware import HardwareSpec

if TYPE_CHECKING:
    from waferline.spec.model import ModelSpec

# Activation workspace per stage: tokens in flight x hidden x 2 bytes x this factor (residual, q/k/v, MLP
# intermediate, attention scores, double buffers). Assumed, not fitted: it is small next to weights and cache.
ACTIVATION_FACTOR = 8
DEFAULT_PREFILL_CHUNK = 512
STATE_BITS = 16


def _resolve(model: Any, hardware: Any) -> tuple[Any, HardwareSpec]:
    from waferline.spec.catalog import load_hardware, load_model

    if isinstance(model, str):
        model = load_model(model)
    if isinstance(hardware, str):
        hardware = load_hardware(hardware)
    return model, hardware


@dataclass
class _Part:
    """The memory a placement unit (a layer, or its attention / FFN half) needs, summed over all its devices."""

    layer: int
    weights: float
    cache: float  # (with ``rollback``)
    kv_shards: int = 0  # most devices the cache can be split over (GQA: its KV heads); 0 = no limit
    rollback: float = 0.0  # of ``cache``, the states a speculative verify keeps for its rollback (_seq_bytes)


@dataclass(frozen=True)
class _Ends:
    """The weights a stage holds besides its layers', by whether it is the first (the embedding table) and the last
    (the final norm and LM head, with ``head`` any drafter beside it). ``table``: a tied model's (tie_word_embeddings)
    LM head is its embedding table, which a last stage without the embedding holds a copy of (the engine's does); a
    stage holding both holds it once."""

    emb: float = 0.0
    head: float = 0.0
    table: float = 0.0

    def __call__(self, first: bool, last: bool) -> float:
        return (self.emb if first else 0.0) + ((self.head + (0.0 if first else self.table)) if last else 0.0)

    def each(self, n: int) -> list[float]:
        """The extras of ``n`` consecutive stages, the first holding the embedding and the last the LM head."""
        return [self(i == 0, i == n - 1) for i in range(n)]


_NO_ENDS = _Ends()


def _ends(spec: ModelSpec, embed_bits: int, drafter: float = 0.0) -> _Ends:
    table = spec.embed_bytes(embed_bits)
    return _Ends(table, spec.lm_head_bytes(embed_bits) + drafter, table if spec.tie_word_embeddings else 0.0)


_PARTS_CACHE: dict[tuple, tuple[Any, list[_Part]]] = {}  # (the spec held: its id is not reused)


def _seq_bytes(layer: Any, context: int, kv_bits: int, spec_tokens: int) -> tuple[float, float]:
    """What one sequence of ``context`` tokens keeps on ``layer``: its cache, and, speculating ``spec_tokens`` drafts a
    step, the states a verify keeps for its rollback (``LayerSpec.rollback_bytes_per_seq``: the state after each of
    its k + 1 tokens on a recurrent-state layer; 0 for attention). Placing, restaging and the capacity searches all
    count a sequence so. The cache is the most it holds on its way to ``context`` tokens (a compressed cache holds
    less just after a compression window closes than just before)."""
    return (layer.peak_cache_bytes_per_seq(context, kv_bits, STATE_BITS),
            layer.rollback_bytes_per_seq(spec_tokens, STATE_BITS))


def _drafts(sp: SpeculativeConfig, spec_tokens: int | None) -> int:
    """The drafts a verify of ``sp`` checks per step: ``spec_tokens`` where the caller knows them (its simulator
    parameters' ``draft_tokens``), else as the default parameters count them."""
    if spec_tokens is not None or sp.method == "none":
        return spec_tokens or 0
    from waferline.sim.cost import load_params

    return load_params().draft_tokens(sp)


def _parts(
    spec: ModelSpec, role: str, weight_bits: int, kv_bits: int, context: int, batch: int, group: int,
    spec_tokens: int = 0
) -> list[_Part]:
    """Per-layer memory of ``role`` parts (cached per model and precision: sweeps reuse it); ``spec_tokens``: the
    drafts a speculative verify checks (its rollback states counted with the cache, ``_seq_bytes``)."""
    key = (id(spec), spec.name, role, weight_bits, kv_bits, context, batch, group, spec_tokens)
    hit = _PARTS_CACHE.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    memo: dict[tuple, tuple[float, float, int, float]] = {}
    out = []
    for layer in spec.layers:
        sig = (repr(layer.mixer), repr(layer.ffn))
        wc = memo.get(sig)
        if wc is None:
            cache, rollback = (batch * x for x in _seq_bytes(layer, context, kv_bits, spec_tokens))
            shards = layer.cache_shard_limit()
            if role == "full":
                wc = (layer.weight_bytes(weight_bits, group), cache + rollback, shards, rollback)
            elif role == "attention":
                wc = (layer.mixer_weight_bytes(weight_bits, group), cache + rollback, shards, rollback)
            else:
                wc = (layer.ffn_weight_bytes(weight_bits, group), 0.0, 0, 0.0)
            memo[sig] = wc
        out.append(_Part(layer.index, *wc))
    if len(_PARTS_CACHE) > 512:
        _PARTS_CACHE.clear()
    _PARTS_CACHE[key] = (spec, out)
    return out


def cache_per_device(cache: float, n_dev: int, shards: int) -> float:
    """Bytes of a cache of ``cache`` bytes on each of ``n_dev`` devices, given its shard limit."""
    return cache / (min(n_dev, shards) if shards else n_dev)


def _activation_bytes(spec: ModelSpec, batch: int, chunk: int) -> float:
    return max(batch, chunk) * spec.hidden_size * 2 * ACTIVATION_FACTOR


def _stage_memory(
    parts: list[_Part], n_dev: int, hw: HardwareSpec, act: float, extra_weights: float
) -> MemoryBreakdown:
    w = (sum(p.weights for p in parts) + extra_weights) / n_dev
    c = sum(cache_per_device(p.cache - p.rollback, n_dev, p.kv_shards) for p in parts)
    r = sum(cache_per_device(p.rollback, n_dev, p.kv_shards) for p in parts)  # (split as the state it copies)
    return MemoryBreakdown(weights=w, cache=c, activations=act, reserve=hw.memory_bytes * hw.reserve_fraction,
                           capacity=hw.memory_bytes, rollback=r)


def _devices_needed(total: float, hw: HardwareSpec, act: float) -> int:
    avail = hw.memory_bytes * (1 - hw.reserve_fraction) - act
    if avail <= 0:  # (the reserve and the activation workspace fill a device: no count holds it, explain() says so)
        return 1
    return min(MAX_DEVICES, max(1, math.ceil(total / avail - 1e-12)))  # (a stage's device ids are listed)


def _cache_floor(parts: list[_Part]) -> float:
    """The cache bytes each device of a stage holding ``parts`` keeps however many devices it has: a cache past its
    shard limit (GQA: its KV heads; an MLA latent: 1) is held whole by every device."""
    return sum(p.cache / p.kv_shards for p in parts if p.kv_shards)


def _devices_for(parts: list[_Part], hw: HardwareSpec, act: float, extra: float = 0.0) -> int:
    """The fewest devices whose memory holds ``parts`` (plus ``extra`` weights) as ``_stage_memory`` counts it: past
    a cache's shard limit (GQA: its KV heads) more devices do not split it further, so the bytes-over-capacity
    estimate alone can come up short. Where no count holds it (that cache alone fills a device), the estimate (the
    plan then says why it does not fit), not the search's cap."""
    n = _devices_needed(sum(p.weights + p.cache for p in parts) + extra, hw, act)
    if n >= MAX_DEVICES or _stage_memory(parts, n, hw, act, extra).fits:
        return n
    if _cache_floor(parts) >= hw.memory_bytes * (1 - hw.reserve_fraction) - act:
        return n
    lo, hi = n, n * 2  # (fitting is monotone in the devices: an exponential search, then bisection)
    while hi < MAX_DEVICES and not _stage_memory(parts, hi, hw, act, extra).fits:
        lo, hi = hi, hi * 2
    if hi >= MAX_DEVICES:
        return MAX_DEVICES
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _stage_memory(parts, mid, hw, act, extra).fits else (mid, hi)
    return hi


def _balanced_split(parts: list[_Part], n: int, ends: _Ends = _NO_ENDS, width: int = 1) -> list[list[_Part]]:
    """Split parts into n contiguous non-empty groups minimising the largest group's memory per device (extras on the
    ends) on ``width`` devices a group, as ``_stage_memory`` counts it: a cache past its shard limit (an MLA latent,
    GQA's KV heads) is not divided by all of them, so the groups of least bytes are not those of least bytes per
    device."""
    n = max(1, min(n, len(parts)))
    sizes = [p.weights + p.cache + e if width == 1 else (p.weights + e) / width + cache_per_device(p.cache, width,
                                                                                                  p.kv_shards)
             for p, e in zip(parts, ends.each(len(parts)))]

    def cuts(limit: float) -> list[int] | None:
        starts, acc = [0], 0.0
        for i, x in enumerate(sizes):
            if acc + x > limit and i > starts[-1]:
                starts.append(i)
                acc = 0.0
            acc += x
        return starts if len(starts) <= n else None

    lo, hi = max(sizes), sum(sizes)
    while hi - lo > 1e-9 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if cuts(mid) else (mid, hi)
    starts = cuts(hi) or [0]
    bounds = starts + [len(parts)]
    # use every device: split the largest splittable group (the first of equals) in halves until there are n; a heap
    # of (-memory, start, end) (a scan of every group per split made this O(parts^2))
    def entry(a: int, b: int) -> tuple[float, int, int]:
        return -sum(p.weights + p.cache for p in parts[a:b]), a, b

    heap = [entry(bounds[i], bounds[i + 1]) for i in range(len(starts))]
    done = [h for h in heap if h[2] - h[1] <= 1]
    heap = [h for h in heap if h[2] - h[1] > 1]
    heapq.heapify(heap)
    while len(heap) + len(done) < n:
        _, a, b = heapq.heappop(heap)
        half = a + (b - a) // 2
        for h in (entry(a, half), entry(half, b)):
            if h[2] - h[1] > 1:
                heapq.heappush(heap, h)
            else:
                done.append(h)
    return [parts[a:b] for _, a, b in sorted(heap + done, key=lambda h: h[1])]


def _greedy_pack(parts: list[_Part], hw: HardwareSpec, act: float, ends: _Ends) -> list[tuple[list[_Part], int]]:
    """Fewest devices: fill one device with consecutive parts; a part too big for one device gets several."""
    avail = hw.memory_bytes * (1 - hw.reserve_fraction) - act
    out: list[tuple[list[_Part], int]] = []
    cur: list[_Part] = []
    used = 0.0  # cur's bytes, with the extras it holds
    for i, p in enumerate(parts):
        last = i == len(parts) - 1
        if cur:
            first = not out
            grown = used - ends(first, False) + ends(first, last) + p.weights + p.cache
            if grown <= avail:
                cur.append(p)
                used = grown
                continue
            out.append((cur, 1))
            cur, used = [], 0.0
        extra = ends(not out, last)
        size = p.weights + p.cache + extra
        if size > avail:
            out.append(([p], _devices_for([p], hw, act, extra)))
        else:
            cur, used = [p], size
    if cur:
        out.append((cur, 1))
    return out


def _tp_sizes(hw: HardwareSpec) -> list[int]:
    sizes, t = [], 1
    while t < hw.devices_per_node:
        sizes.append(t)
        t *= 2
    sizes.append(hw.devices_per_node)
    return sorted({s for s in sizes if s >= min(hw.min_devices, hw.devices_per_node)})


def _tp_widths(spec: ModelSpec, hw: HardwareSpec) -> list[int]:
    """The tensor-parallel group widths a stage may have, narrowest first: inside a node, splitting every layer's
    attention heads evenly (``_head_split``)."""
    heads = _head_split(spec)
    return [t for t in _tp_sizes(hw) if heads % t == 0] or [1]  # (groups that split the heads evenly)


def expert_split(num_experts: int, ranks: int) -> list[tuple[int, int]]:
    """AFD expert parallelism: contiguous expert ranges [e0, e1) per FFN rank; the first ``num_experts mod ranks``
    ranks hold one expert more (the engine and the planner both use this split)."""
    base, extra = divmod(num_experts, ranks)
    out, a = [], 0
    for n in range(ranks):
        b = a + base + (1 if n < extra else 0)
        out.append((a, b))
        a = b
    return out


def ffn_owner(layer: int, ranks: int) -> int:
    """AFD: the FFN rank that holds layer ``layer``'s shared experts or dense FFN."""
    return layer % ranks


def ffn_rank_share(routed: float, shared: float, experts: int, num_experts: int, owner: bool) -> float:
    """AFD: the fraction of an MoE layer's FFN work on an FFN rank holding ``experts`` of its ``num_experts`` routed
    experts, and as the layer's owner (``ffn_owner``) its shared experts whole; the work split between the routed
    experts a token takes and the shared ones as ``routed`` (top-k experts' size) to ``shared`` (their size)."""
    frac = routed / (routed + shared) if routed + shared > 0 else 1.0
    return frac * experts / num_experts + (1.0 - frac if owner else 0.0)


def _place_afd_ranks(spec: ModelSpec, hw: HardwareSpec, M: int, N: int, weight_bits: int, kv_bits: int, context: int,
                     batch: int, group: int, act: float, ends: _Ends, spec_tokens: int) -> list[Stage]:
    """The engine's AFD layout: M attention ranks, each a data-parallel replica of every mixer layer (plus embedding
    and LM head) holding the caches of ceil(batch / M) sequences, and N FFN ranks, each holding its expert range of
    every MoE layer plus the shared experts / dense FFN of the layers it owns. Each rank gets the fewest devices its
    memory needs; on GPU-style hardware an attention rank is one tensor-parallel group (``_tp_widths``: it splits the
    heads evenly, inside a node), the narrowest that holds it, else the widest (the plan then says why it does not
    fit)."""
    att, ffn_ranks = _afd_rank_parts(spec, M, N, weight_bits, kv_bits, context, batch, group, spec_tokens)
    both = ends(True, True)  # (an attention rank holds the embedding and the LM head: a tied table once)
    if hw.placement == "tensor":
        widths = _tp_widths(spec, hw)
        n_dev = next((t for t in widths if _stage_memory(att, t, hw, act, both).fits), widths[-1])
    else:
        n_dev = _devices_for(att, hw, act, both)
    stages: list[Stage] = []
    dev = 0
    for m in range(M):
        stages.append(
            Stage(
                index=m,
                role="attention",
                layers=[p.layer for p in att],
                device=hw.name,
                device_ids=list(range(dev, dev + n_dev)),
                weight_bits=weight_bits,
                kv_bits=kv_bits,
                has_embedding=True,
                has_lm_head=True,
                memory=_stage_memory(att, n_dev, hw, act, both),
            )
        )
        dev += n_dev
    for n, parts in enumerate(ffn_ranks):
        n_dev = _devices_for(parts, hw, act)
        stages.append(Stage(index=M + n, role="ffn", layers=[p.layer for p in parts], device=hw.name,
                            device_ids=list(range(dev, dev + n_dev)), weight_bits=weight_bits, kv_bits=kv_bits,
                            memory=_stage_memory(parts, n_dev, hw, act, 0.0)))
        dev += n_dev
    return stages


def _afd_rank_parts(spec: ModelSpec, M: int, N: int, weight_bits: int, kv_bits: int, context: int, batch: int,
                    group: int, spec_tokens: int = 0) -> tuple[list[_Part], list[list[_Part]]]:
    """The engine's AFD layout in parts: an attention rank's (every mixer, every FFN pre-norm and MoE router, the
    caches of ceil(batch / M) sequences) and each of the N FFN ranks' (its expert range of every MoE layer, the
    shared experts / dense FFN of the layers it owns)."""
    from waferline.spec.model import BYTES_16, MoESpec

    if M < 1 or N < 1:
        raise ConfigError(f"--attention-ranks and --ffn-ranks must be >= 1 (got {M}, {N})")
    # what the attention side keeps of each FFN layer (engine/afd/sides.py FFNFront): its pre-norm, an MoE's router
    front = {layer.index: (layer.hidden_size + (layer.ffn.router_params() if isinstance(layer.ffn, MoESpec) else 0))
             * BYTES_16 for layer in spec.layers if layer.ffn is not None}
    share = math.ceil(batch / M) / batch
    att = [_Part(p.layer, p.weights + front.get(p.layer, 0.0), p.cache * share, p.kv_shards, p.rollback * share)
           for p in _parts(spec, "attention", weight_bits, kv_bits, context, batch, group, spec_tokens)]
    ffn = {p.layer: p for p in _parts(spec, "ffn", weight_bits, kv_bits, context, batch, group) if p.weights > 0}
    routed: dict[int, tuple[float, int]] = {}  # layer -> (bytes of one routed expert, experts)
    for layer in spec.layers:
        f = layer.ffn
        if isinstance(f, MoESpec) and layer.index in ffn:
            if f.num_experts < N:
                raise ConfigError(f"layer {layer.index} has {f.num_experts} experts: at most {f.num_experts} FFN ranks")
            routed[layer.index] = (f.expert_bytes(weight_bits, group), f.num_experts)
    if not ffn:
        raise ConfigError(f"{spec.name}: no layer has an FFN; attention/FFN disaggregation has nothing to split")
    if not routed and N > len(ffn):
        raise ConfigError(f"{spec.name} is dense: at most {len(ffn)} FFN ranks (one per FFN layer)")
    splits = {E: expert_split(E, N) for E in {E for _, E in routed.values()}}
    ranks = []
    for n in range(N):
        parts = []
        for i, p in sorted(ffn.items()):
            w = p.weights - front[i]
            if i in routed:
                eb, E = routed[i]
                e0, e1 = splits[E][n]
                w = (w - E * eb) * (ffn_owner(i, N) == n) + (e1 - e0) * eb
            elif ffn_owner(i, N) != n:
                w = 0.0
            parts.append(_Part(i, w, 0.0))
        ranks.append(parts)
    return att, ranks


DRAFTER_NOTE_END = " sits with the LM head"


def drafter_note(size: float, what: str) -> str:
    """The plan's note on the drafter that speculative decoding adds beside the LM head (``size`` bytes)."""
    return f"the {what} ({size / 1e9:,.2f} GB){DRAFTER_NOTE_END}"


def place(model: Any, hardware: Any, *, devices: int | None = None, weight_bits: int = 16, kv_bits: int = 16,
          embed_bits: int = 16, group_size: int = 128, context: int = 4096, batch: int = 1,
          layers_per_stage: int | None = None, afd: bool = False, micro_batches: int | None = None,
          speculative: SpeculativeConfig | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
          require_fit: bool = False, attention_ranks: int | None = None, ffn_ranks: int | None = None,
          drafter: tuple[float, str] | None = None, spec_tokens: int | None = None) -> Plan:
    """Place ``model`` on ``hardware``: the fewest devices that fit when ``devices`` is None, else exactly ``devices``.

    ``afd=True`` with ``attention_ranks`` / ``ffn_ranks``: the layout the AFD engine runs (data-parallel attention
    ranks, expert-sharded FFN ranks, each rank sized to fit); ``afd=True`` alone: attention and FFN device pools
    with layers packed onto them, or in stages of ``layers_per_stage`` layers on each side (planner/simulator only).
    ``drafter``: the bytes speculative decoding's drafter adds to the stage that holds the LM head, and what it is
    (sim.pipeline.drafter_memory). ``spec_tokens``: the drafts a verify of ``speculative`` checks per step
    (SimParams.draft_tokens; default: as the default parameters count them), for which each stage holding
    recurrent-state layers keeps the states a verify rolls back to."""
    spec, hw = _resolve(model, hardware)
    if (attention_ranks is not None or ffn_ranks is not None) and not afd:
        raise ConfigError("--attention-ranks / --ffn-ranks need --afd")
    if weight_bits not in (4, 8, 16):
        raise ConfigError(f"--weight-bits must be 4, 8 or 16, got {weight_bits}")
    if kv_bits not in (4, 8, 16):
        raise ConfigError(f"--kv-bits must be 4, 8 or 16, got {kv_bits}")
    if batch < 1 or context < 1:
        raise ConfigError(f"batch and context must be >= 1 (got batch={batch}, context={context})")
    if devices is not None and not 1 <= devices <= MAX_DEVICES:
        raise ConfigError(f"--devices must be from 1 to {MAX_DEVICES:,}, got {devices:,}")
    if layers_per_stage is not None and layers_per_stage < 1:
        raise ConfigError(f"--layers-per-stage must be >= 1, got {layers_per_stage}")
    if micro_batches is not None and micro_batches < 1:  # (more than the batch: a prompt's chunks fill the rest)
        raise ConfigError(f"--micro-batches must be >= 1, got {micro_batches}")
    for flag, v in (("--attention-ranks", attention_ranks), ("--ffn-ranks", ffn_ranks)):
        if v is not None and not 1 <= v <= MAX_DEVICES:  # (a rank takes a device at least)
            raise ConfigError(f"{flag} must be from 1 to {MAX_DEVICES:,}, got {v:,}")
    act = _activation_bytes(spec, batch, prefill_chunk)
    notes: list[str] = []
    if devices is not None and devices < hw.min_devices:
        notes.append(f"{hw.name} is deployed from {hw.min_devices} devices up (min_devices); {devices} is below "
                     "that: a configuration its vendor does not ship")
    if drafter and drafter[0] > 0:  # (the drafts are made where the target's last hidden state and LM head are)
        notes.append(drafter_note(*drafter))
    ends = _ends(spec, embed_bits, drafter[0] if drafter and drafter[0] > 0 else 0.0)
    speculative = speculative or SpeculativeConfig()
    drafts = _drafts(speculative, spec_tokens)
    kw = dict(weight_bits=weight_bits, kv_bits=kv_bits, embed_bits=embed_bits, group_size=group_size,
              context_len=context, batch=batch, afd=afd, speculative=speculative)

    def mk_stages(groups: list[tuple[list[_Part], int]], role: str, start_dev: int, start_idx: int,
                  with_ends: bool) -> list[Stage]:
        stages, dev = [], start_dev
        for gi, (g, n) in enumerate(groups):
            first = with_ends and gi == 0
            last = with_ends and gi == len(groups) - 1
            extra = ends(first, last)
            stages.append(Stage(index=start_idx + gi, role=role, layers=[p.layer for p in g], device=hw.name,
                                device_ids=list(range(dev, dev + n)), weight_bits=weight_bits, kv_bits=kv_bits,
                                has_embedding=first, has_lm_head=last, memory=_stage_memory(g, n, hw, act, extra)))
            dev += n
        return stages

    if afd and (attention_ranks is not None or ffn_ranks is not None):
        if devices is not None or layers_per_stage is not None:
            raise ConfigError(
                "--attention-ranks/--ffn-ranks size each rank to fit; drop --devices / --layers-per-stage"
            )
        M, N = attention_ranks or 1, ffn_ranks or 1
        stages = _place_afd_ranks(spec, hw, M, N, weight_bits, kv_bits, context, batch, group_size, act, ends,
                                  drafts)
        notes.append(f"attention/FFN disaggregation as the engine runs it: {M} data-parallel attention rank(s) "
                     f"({stages[0].num_devices} device(s) each), {N} expert-parallel FFN rank(s)")
        if hw.placement == "tensor" and not stages[0].memory.fits:
            notes.append(f"an attention rank is one tensor-parallel group inside a node (at most "
                         f"{stages[0].num_devices} devices here, splitting {spec.name}'s {_head_split(spec)} heads "
                         "evenly): more devices per rank are not an option; use fewer bits, --kv-bits 8, a shorter "
                         "--context, or more attention ranks (each holds a smaller share of the batch's caches)")
        micro_batches = micro_batches or 2
    elif afd:
        att = _parts(spec, "attention", weight_bits, kv_bits, context, batch, group_size, drafts)
        ffn = [p for p in _parts(spec, "ffn", weight_bits, kv_bits, context, batch, group_size) if p.weights > 0]
        ma = sum(p.weights + p.cache for p in att) + ends(True, True)
        mf = sum(p.weights for p in ffn)
        if devices is not None:
            if devices < 2:
                raise ConfigError("--afd needs at least 2 devices (one attention, one FFN)")
            na = min(devices - 1, max(1, round(devices * ma / (ma + mf))))
            if layers_per_stage is not None:  # (each side in stages of K layers: a device a stage at least)
                n_st = math.ceil(len(att) / layers_per_stage), math.ceil(len(ffn) / layers_per_stage)
                if devices < sum(n_st):
                    raise ConfigError(f"--afd in stages of {layers_per_stage} layers takes {n_st[0]} attention and "
                                      f"{n_st[1]} FFN stages: use --devices >= {sum(n_st)} or a larger "
                                      "--layers-per-stage")
                na = min(max(na, n_st[0]), devices - n_st[1])
            if hw.placement != "tensor":  # (each side the devices its stages need, where those given hold both)
                need = [sum(n for _, n in (_chunks(x, layers_per_stage, hw, act, e) if layers_per_stage is not None
                                           else _greedy_pack(x, hw, act, e)))
                        for x, e in ((att, ends), (ffn, _NO_ENDS))]
                if sum(need) <= devices:
                    na = min(max(na, need[0]), devices - need[1])
        if hw.placement == "tensor":
            # GPU-style pools: the attention side placed as a model is (tensor-parallel groups that split the heads
            # evenly inside a node; pipeline stages over nodes where one group does not hold it, or stages of
            # --layers-per-stage layers) and the FFN side one stage (experts sharded over the pool; with --devices,
            # the devices the attention side leaves), or stages of --layers-per-stage layers
            att_notes: list[str] = []
            stages = _place_tensor(spec, hw, None if devices is None else na, layers_per_stage, weight_bits, kv_bits,
                                   context, batch, group_size, act, ends, mk_stages, att_notes, drafts,
                                   role="attention")
            notes += [n for n in att_notes if "left idle" not in n]  # (the FFN stage takes them)
            n_att = stages[-1].device_ids[-1] + 1
            if layers_per_stage is None:
                gf = [(ffn, _devices_for(ffn, hw, act) if devices is None else devices - n_att)]
            elif devices is None:
                gf = _chunks(ffn, layers_per_stage, hw, act)
            else:
                gf = _split_into(ffn, devices - n_att, hw, act, layers_per_stage)
        else:
            if devices is None and layers_per_stage is not None:
                ga = _chunks(att, layers_per_stage, hw, act, ends)
                gf = _chunks(ffn, layers_per_stage, hw, act)
            elif devices is None:
                ga = _greedy_pack(att, hw, act, ends)
                gf = _greedy_pack(ffn, hw, act, _NO_ENDS)
            else:
                ga = _split_into(att, na, hw, act, layers_per_stage, ends)
                gf = _split_into(ffn, devices - na, hw, act, layers_per_stage)
            stages = mk_stages(ga, "attention", 0, 0, True)
            n_att = sum(n for _, n in ga)
        stages += mk_stages(gf, "ffn", n_att, len(stages), False)
        n_ast = len(stages) - len(gf)
        notes.append(
            f"attention/FFN disaggregation: {n_att} attention device(s), {sum(n for _, n in gf)} FFN device(s)"
            + (f"; the attention side in {n_ast} pipeline stages of {stages[0].num_devices} device(s) (a "
               "tensor-parallel group splits the heads evenly inside a node; planner/simulator only: the engine runs "
               "attention ranks that each hold every layer)"
               if hw.placement == "tensor" and n_ast > 1 else "")
        )
    elif hw.placement == "pipeline":
        parts = _parts(spec, "full", weight_bits, kv_bits, context, batch, group_size, drafts)
        if devices is None and layers_per_stage is None:
            groups = _greedy_pack(parts, hw, act, ends)
        elif devices is None:
            groups = _chunks(parts, layers_per_stage, hw, act, ends)
        else:
            groups = _split_into(parts, devices, hw, act, layers_per_stage, ends)
            used = sum(n for _, n in groups)
            if used < devices:
                notes.append(
                    f"{devices - used} of {devices} devices left idle: {len(parts)} layers cannot use them evenly"
                )
        stages = mk_stages(groups, "full", 0, 0, True)
    else:
        stages = _place_tensor(
            spec,
            hw,
            devices,
            layers_per_stage,
            weight_bits,
            kv_bits,
            context,
            batch,
            group_size,
            act,
            ends,
            mk_stages,
            notes,
            drafts,
        )

    plan = Plan(model=_model_ref(model, spec), hardware=_hardware_ref(hw), stages=stages, notes=notes, **kw)
    if devices is not None and plan.num_devices < devices and not any("left idle" in n for n in notes):
        notes.append(f"{devices - plan.num_devices} of {devices} devices left idle: the layout uses "
                     f"{plan.num_devices} (stages of whole tensor-parallel groups)")
    plan.micro_batches = micro_batches if micro_batches else max(1, min(batch, plan.num_stages))
    floors = {}
    if afd and (attention_ranks is not None or ffn_ranks is not None):  # (a rank holds its share of the batch's caches)
        att = _afd_rank_parts(spec, M, N, weight_bits, kv_bits, context, batch, group_size, drafts)[0]
        floors = {s.index: _cache_floor(att) for s in stages if s.role == "attention" and not s.memory.fits}
    else:
        for s in stages:
            if not s.memory.fits:
                by_layer = {p.layer: p for p in _parts(spec, s.role, weight_bits, kv_bits, context, batch, group_size,
                                                       drafts)}
                floors[s.index] = _cache_floor([by_layer[i] for i in s.layers])
    plan.problems = explain(plan, floors)
    plan.fits = not plan.problems
    if not plan.fits and require_fit:
        raise FitError("; ".join(plan.problems))
    return plan


def _hardware_ref(hw: HardwareSpec) -> str:
    """What a Plan records to find the hardware again: the catalog id, or the user's YAML path."""
    return _hardware_ref_cached(hw.name, hw.path)


@lru_cache(maxsize=256)
def _hardware_ref_cached(name: str, path: str) -> str:
    from waferline.spec.catalog import HARDWARE_DIR

    p = Path(path) if path else None
    if p is None or not p.is_file() or HARDWARE_DIR.resolve() in p.resolve().parents:
        return name
    return str(p.resolve())


def _model_ref(model: Any, spec: ModelSpec) -> str:
    """The catalog id, or the config path / checkpoint dir the model came from."""
    from waferline.spec.catalog import is_catalog_model

    if isinstance(model, (str, Path)) and not is_catalog_model(str(model)) and Path(model).exists():
        return str(Path(model).resolve())
    return spec.name


def _by_k(parts: list[_Part], k: int) -> list[list[_Part]]:
    """Consecutive groups of ``k`` parts (--layers-per-stage), the last holding what is left."""
    return [parts[i:i + k] for i in range(0, len(parts), k)]


def _chunks(parts: list[_Part], k: int, hw: HardwareSpec, act: float,
            ends: _Ends = _NO_ENDS) -> list[tuple[list[_Part], int]]:
    """Stages of ``k`` consecutive parts, each on the fewest devices that hold it."""
    chunks = _by_k(parts, k)
    return [(c, _devices_for(c, hw, act, e)) for c, e in zip(chunks, ends.each(len(chunks)))]


def _split_into(parts: list[_Part], devices: int, hw: HardwareSpec, act: float, k: int | None,
                ends: _Ends = _NO_ENDS) -> list[tuple[list[_Part], int]]:
    """Use exactly ``devices`` devices (or as many as divide evenly): stages of layers, devices per stage."""
    if k is not None:
        groups = _by_k(parts, k)
    elif devices >= len(parts):
        groups = [[p] for p in parts]
    else:
        groups = _balanced_split(parts, devices, ends)
    if devices < len(groups):
        raise ConfigError(f"{devices} devices cannot hold {len(groups)} stages of at most {k} layers; "
                          f"use --devices >= {len(groups)} or a larger --layers-per-stage")

    def needs(gs: list[list[_Part]]) -> list[int]:
        return [_devices_for(g, hw, act, e) for g, e in zip(gs, ends.each(len(gs)))]

    need = needs(groups)
    if k is None and sum(need) > devices:
        # a stage needs more than one device (an end stage's embedding or LM head, a layer larger than a device): one
        # stage per device leaves none for it; fewer stages do, where the fewest devices that fit (the greedy
        # packing) are not more than those given (a tied model's counted without the table's copy on the last stage,
        # which fewer stages, one holding both ends, may not need)
        packed = _greedy_pack(parts, hw, act, ends)
        bound = _greedy_pack(parts, hw, act, replace(ends, table=0.0)) if ends.table else packed
        if sum(n for _, n in bound) <= devices:
            for g in range(len(groups) - 1, 0, -1):
                fewer = _balanced_split(parts, g, ends)
                n = needs(fewer)
                if sum(n) <= devices:
                    groups, need = fewer, n
                    break
            else:
                if sum(n for _, n in packed) <= devices:
                    groups, need = [g for g, _ in packed], [n for _, n in packed]
    per = max(1, devices // len(groups))
    sizes = [sum(p.weights + p.cache for p in g) + e for g, e in zip(groups, ends.each(len(groups)))]
    if all(n <= per for n in need) or sum(need) > devices:  # the even split fits (or no split of these stages does)
        return [(g, per) for g in groups]
    # an end stage's embedding or LM head does not fit the even share: every stage gets the devices it needs, then
    # the rest go one at a time to the stage with the most bytes per device
    alloc = list(need)
    for _ in range(devices - sum(need)):
        i = max(range(len(alloc)), key=lambda j: sizes[j] / alloc[j])
        alloc[i] += 1
    return list(zip(groups, alloc))


def _place_tensor(spec: ModelSpec, hw: HardwareSpec, devices: int | None, k: int | None, weight_bits: int, kv_bits: int,
                  context: int, batch: int, group: int, act: float, ends: _Ends, mk_stages: Any,
                  notes: list[str], spec_tokens: int = 0, role: str = "full") -> list[Stage]:
    """GPU-style: tensor/expert parallel inside a node first, pipeline stages across nodes (``role``: the whole
    layers, or AFD's attention side)."""
    parts = _parts(spec, role, weight_bits, kv_bits, context, batch, group, spec_tokens)
    total = sum(p.weights + p.cache for p in parts) + ends(True, True)

    def build(tp: int, pp: int) -> list[tuple[list[_Part], int]]:
        if k is not None:
            groups = _by_k(parts, k)
        else:
            groups = _balanced_split(parts, pp, ends, tp)
        return [(g, tp) for g in groups]

    def fits(groups: list[tuple[list[_Part], int]]) -> bool:
        for (g, n), extra in zip(groups, ends.each(len(groups))):
            if not _stage_memory(g, n, hw, act, extra).fits:
                return False
        return True

    heads = _head_split(spec)
    if devices is not None:
        tp = min(devices, hw.devices_per_node)
        if k is not None:
            n_st = math.ceil(len(parts) / k)
            if devices < n_st:
                raise ConfigError(f"{devices} devices cannot hold {n_st} stages of at most {k} layers; "
                                  f"use --devices >= {n_st} or a larger --layers-per-stage")
            tp = max(1, min(devices // n_st, hw.devices_per_node))  # (a group's all-reduces run on the node's links)
            pp = n_st
        else:
            pp = max(1, devices // tp)
        split_note = heads % tp != 0
        if split_note:  # (a tensor-parallel group splits every layer's attention heads evenly, as vLLM requires)
            ok = [t for t in range(1, tp + 1) if heads % t == 0]
            if k is None:  # the group that uses the most devices (then the widest): stages of it fill the rest
                was, (tp, pp) = tp, max(((t, min(devices // t, len(parts))) for t in ok),
                                        key=lambda tp_pp: (tp_pp[0] * tp_pp[1], tp_pp[0]))
            else:
                was, tp = tp, max(ok)
            notes.append(f"tensor-parallel groups of {tp}, not {was}: {spec.name}'s {heads} heads split evenly over "
                         f"{tp} devices" + (f" ({pp} pipeline stages)" if k is None and pp > 1 else ""))
        if k is None and not fits(build(tp, pp)):
            # more stages of a narrower group hold what fewer, wider ones do not (a cache split over no more devices
            # than its KV heads, an MLA latent over none): of the layouts that fit, the one that uses the most
            # devices, then the widest group
            fit = [(t, p) for t in range(1, min(devices, hw.devices_per_node) + 1) if heads % t == 0
                   for p in (min(devices // t, len(parts)),) if fits(build(t, p))]
            if fit:
                if split_note:
                    notes.pop()  # (the note on the heads' split names the group that does not fit)
                was, (tp, pp) = (tp, pp), max(fit, key=lambda tp_pp: (tp_pp[0] * tp_pp[1], tp_pp[0]))
                notes.append(f"tensor-parallel groups of {tp} in {pp} pipeline stages: {was[1]} stage(s) of "
                             f"{was[0]} do not fit")
        if tp * pp < devices:
            notes.append(f"{devices - tp * pp} of {devices} devices left idle (stages use {tp} device(s) each)")
        return mk_stages(build(tp, pp), role, 0, 0, True)
    sizes = _tp_widths(spec, hw)
    if k is not None:
        n_st = math.ceil(len(parts) / k)
        for tp in sizes:
            g = build(tp, n_st)
            if fits(g):
                return mk_stages(g, role, 0, 0, True)
        return mk_stages(build(sizes[-1], n_st), role, 0, 0, True)
    for tp in sizes:
        g = build(tp, 1)
        if fits(g):
            return mk_stages(g, role, 0, 0, True)
    tp = sizes[-1]
    last = build(tp, len(parts))
    if not fits(last):  # one part a stage does not fit either: no stage count does (a scan of them all was O(parts^2))
        return mk_stages(last, role, 0, 0, True)
    # the fewest stages that fit, from the memory's lower bound: more stages never hold more a stage (each split
    # minimises its largest group), so steps doubling to the first count that fits, then halving back between it and
    # the last that did not (one count after another was O(parts^2) where the bound is far off)
    lo = min(max(2, math.ceil(total / (tp * (hw.memory_bytes * (1 - hw.reserve_fraction) - act)))), len(parts)) - 1
    step, hi = 1, None
    while hi is None:
        cand = min(lo + step, len(parts))
        g = build(tp, cand)
        if fits(g):
            hi, best = cand, g
        else:
            lo, step = cand, 2 * step
    while hi - lo > 1:  # lo does not fit, hi does
        mid = (lo + hi) // 2
        g = build(tp, mid)
        if fits(g):
            hi, best = mid, g
        else:
            lo = mid
    # a narrower group can hold those stages in fewer devices, or in more stages in fewer nodes (where a cache that
    # splits over no more devices than its KV heads binds, the widest group holds it no better: an MLA latent is held
    # whole by every device): of each group's fewest stages that fit, the fewest devices, taken where it adds no stage
    # or saves a whole node (deeper pipelines of narrower groups inside the same nodes would serve each token slower)
    n_best, n_stages, avail = tp * hi, hi, hw.memory_bytes * (1 - hw.reserve_fraction) - act
    nodes = lambda n: -(-n // hw.devices_per_node)  # noqa: E731
    for t in reversed(sizes[:-1]):  # (the widest first: of two layouts of as many devices, the one of fewer stages)
        top = min(len(parts), (n_best - 1) // t)  # (more stages of t use no fewer devices than the best so far)
        lo_t = max(hi - 1, math.ceil(total / (t * avail) - 1e-12) - 1)  # (neither the widest group's lo nor fewer
        if top <= lo_t or not fits(build(t, top)):  # stages than the memory's lower bound fit)
            continue
        hi_t, g_t = top, None
        while hi_t - lo_t > 1:  # lo_t does not fit, hi_t does
            mid = (lo_t + hi_t) // 2
            g = build(t, mid)
            lo_t, hi_t, g_t = (lo_t, mid, g) if fits(g) else (mid, hi_t, g_t)
        if hi_t > n_stages and nodes(t * hi_t) >= nodes(n_best):
            continue
        n_best, n_stages, best = t * hi_t, hi_t, g_t or build(t, hi_t)
    return mk_stages(best, role, 0, 0, True)


def _head_split(spec: ModelSpec) -> int:
    """The most devices every layer's attention (or SSM) heads split over evenly: their greatest common divisor."""
    return math.gcd(*(int(lc.mixer.num_heads) for lc in spec.layers if getattr(lc.mixer, "num_heads", 0))) or 1


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def explain(plan: Plan, cache_floors: dict[int, float] | None = None) -> list[str]:
    """One line per stage that does not fit: which devices, which term dominates, by how many bytes.
    ``cache_floors``: per stage index, the cache each device holds however many devices the stage has
    (``_cache_floor``); where that alone overflows, more devices are not suggested."""
    out = []
    for s in plan.stages:
        m = s.memory
        if m.fits:
            continue
        terms = {"weights": m.weights, "cache": m.cache, "rollback": m.rollback, "activations": m.activations,
                 "reserve": m.reserve}
        big = max(terms, key=terms.get)  # type: ignore[arg-type]
        layers = f"layer {s.layers[0]}" if len(s.layers) == 1 else f"layers {s.layers[0]}-{s.layers[-1]}"
        hint = {"weights": "use fewer bits (--weight-bits), more devices, or fewer layers per stage",
                "cache": "use a shorter --context, a smaller --batch, --kv-bits 8, or more devices",
                "rollback": "use fewer drafts a step (--num-speculative-tokens), a smaller --batch, or more devices",
                "activations": "use a smaller --batch or prefill chunk",
                "reserve": "the device is too small for this model"}[big]
        floor = (cache_floors or {}).get(s.index)
        if m.activations + m.reserve >= m.capacity:  # (every device of a stage holds the workspace whole)
            hint = (f"no number of devices holds it: each keeps the activation workspace ({_gb(m.activations)}) "
                    f"and the reserve ({_gb(m.reserve)}) whole, and they alone fill its {_gb(m.capacity)}; "
                    + ("use a smaller --batch or " if plan.batch > DEFAULT_PREFILL_CHUNK else "use ")
                    + "a device with more memory")
        elif big in ("weights", "cache", "rollback") and floor is not None \
                and floor + m.activations + m.reserve > m.capacity:
            hint = (f"more devices in the stage do not help: each holds {_gb(floor)} of cache however many share "
                    "it (a layer's cache splits over at most its KV heads; an MLA latent over none); use a shorter "
                    "--context, a smaller --batch"
                    + (", --kv-bits 8 or more --attention-ranks (each holds a smaller share of the batch's caches)"
                       if plan.attention_ranks else ", --kv-bits 8 or fewer layers per stage" if len(s.layers) > 1
                       else " or --kv-bits 8"))
        out.append(
            f"stage {s.index} ({s.role}, {layers}, {s.num_devices} x {s.device}): per device weights {_gb(m.weights)}"
            f" + cache {_gb(m.cache)}" + (f" + speculation's rollback states {_gb(m.rollback)}" if m.rollback else "")
            + f" + activations {_gb(m.activations)} + reserve {_gb(m.reserve)}"
            f" = {_gb(m.total)} > capacity {_gb(m.capacity)} by {_gb(m.total - m.capacity)} "
            f"({m.total - m.capacity:.0f} bytes);"
            f" largest term: {big}; {hint}"
        )
    return out


def _fits_cache(plan: Plan, spec: ModelSpec, hw: HardwareSpec, ctx: int, batch: int,
                drafter: Callable[[int, int], float] | None = None, spec_tokens: int = 0) -> bool:
    """Whether every stage of ``plan`` holds ``batch`` sequences of ``ctx`` tokens: its weights, their cache (with the
    states a verify of ``spec_tokens`` drafts keeps for its rollback, ``_seq_bytes``), the activation workspace of
    that batch, and (``drafter``: bytes at (context, batch), sim.pipeline.drafter_memory) its drafter's cache beside
    the LM head, which the plan sized for its own context and batch."""
    by_index = {layer.index: layer for layer in spec.layers}
    act = _activation_bytes(spec, batch, DEFAULT_PREFILL_CHUNK)
    grow = drafter(ctx, batch) - drafter(plan.context_len, plan.batch) if drafter else 0.0
    held = math.ceil(batch / plan.attention_ranks) if plan.attention_ranks else batch  # (AFD: a rank's share)
    for s in plan.stages:
        if s.role == "ffn":
            continue
        cache = sum(
            cache_per_device(
                held * sum(_seq_bytes(by_index[i], ctx, plan.kv_bits, spec_tokens)),
                s.num_devices,
                by_index[i].cache_shard_limit(),
            )
            for i in s.layers
        )
        weights = s.memory.weights + (grow / s.num_devices if s.has_lm_head else 0.0)
        if not MemoryBreakdown(weights=weights, cache=cache, activations=act, reserve=s.memory.reserve,
                               capacity=hw.memory_bytes).fits:  # (as a placed stage is judged)
            return False
    return True


def _max_int(ok: Any, hi: int) -> int:
    if not ok(1):
        return 0
    if ok(hi):
        return hi
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def restage_memory(plan: Plan, model: Any, drafter: float = 0.0, spec_tokens: int | None = None) -> list[str]:
    """Recompute the memory of every stage of ``plan`` from its layers, role, devices, bits, context and batch as
    ``place`` computes it (``drafter``: the bytes its drafter adds beside the LM head; ``spec_tokens``: the drafts
    its verify checks, as ``place`` takes them; AFD ranks: the engine's layout, an attention rank holding a share of
    the batch's caches, an FFN rank its experts), replacing what the plan says (its ``fits`` and ``problems`` too, as
    ``place`` sets them): a plan file edited, or placed by an older planner, is judged on the model and hardware as
    they are.
    Returns one line per stage whose stored memory differed by more than 0.5%."""
    spec, hw = _resolve(model, plan.hardware)
    act = _activation_bytes(spec, plan.batch, DEFAULT_PREFILL_CHUNK)
    ends = _ends(spec, plan.embed_bits, drafter)
    args = (plan.weight_bits, plan.kv_bits, plan.context_len, plan.batch, plan.group_size,
            _drafts(plan.speculative, spec_tokens))
    by_role: dict[str, dict[int, _Part]] = {}
    ffn_ranks: list[dict[int, _Part]] = []
    if plan.attention_ranks:  # (the engine's layout: data-parallel attention ranks, expert-sharded FFN ranks)
        n_ffn = sum(1 for st in plan.stages if st.role == "ffn")
        att, ranks = _afd_rank_parts(spec, plan.attention_ranks, n_ffn, *args)
        by_role["attention"] = {p.layer: p for p in att}
        ffn_ranks = [{p.layer: p for p in r} for r in ranks]
    changed = []
    for st in plan.stages:
        if st.role == "ffn" and ffn_ranks:
            parts = ffn_ranks.pop(0)
        else:
            if st.role not in by_role:
                by_role[st.role] = {p.layer: p for p in _parts(spec, st.role, *args)}
            parts = by_role[st.role]
        extra = ends(st.has_embedding, st.has_lm_head)
        mem = _stage_memory([parts[i] for i in st.layers if i in parts], st.num_devices, hw, act, extra)
        if abs(mem.total - st.memory.total) > 0.005 * mem.total:
            changed.append(f"stage {st.index}'s memory is {mem.total / 1e9:,.2f} GB per device placed as the plan "
                           f"says ({st.num_devices} devices, layers {st.layers[0]}-{st.layers[-1]}); the file said "
                           f"{st.memory.total / 1e9:,.2f} GB")
        st.memory = mem
    # (what fits, and why not, from the memory as recomputed: not the file's, placed on other numbers)
    floors = {st.index: _cache_floor([by_role[st.role][i] for i in st.layers if i in by_role[st.role]])
              for st in plan.stages if not st.memory.fits and st.role in by_role}  # (AFD ranks: an FFN rank's none)
    plan.problems = explain(plan, floors)
    plan.fits = not plan.problems
    return changed


CONTEXT_SEARCH_LIMIT = 1 << 34  # context_capacity searches up to this many tokens: at it, the memory holds at least it
BATCH_SEARCH_LIMIT = 1 << 24  # batch_capacity's, in sequences


def context_capacity(plan: Plan, model: Any, drafter: Callable[[int, int], float] | None = None,
                     spec_tokens: int | None = None) -> int:
    """Longest context (tokens) every stage of ``plan`` can hold for its batch, given its weights (CONTEXT_SEARCH_LIMIT:
    at least that); ``drafter``: its drafter's bytes at (context, batch), as ``_fits_cache`` takes them;
    ``spec_tokens``: the drafts its verify checks, as ``place`` takes them."""
    spec, hw = _resolve(model, plan.hardware)
    k = _drafts(plan.speculative, spec_tokens)
    return _max_int(lambda c: _fits_cache(plan, spec, hw, c, plan.batch, drafter, k), CONTEXT_SEARCH_LIMIT)


def batch_capacity(plan: Plan, model: Any, context: int, drafter: Callable[[int, int], float] | None = None,
                   spec_tokens: int | None = None) -> int:
    """Most sequences of ``context`` tokens whose cache and activations every stage of ``plan`` can hold next to its
    weights (BATCH_SEARCH_LIMIT: at least that); ``drafter`` and ``spec_tokens`` as for ``context_capacity``."""
    spec, hw = _resolve(model, plan.hardware)
    k = _drafts(plan.speculative, spec_tokens)
    return _max_int(lambda b: _fits_cache(plan, spec, hw, context, b, drafter, k), BATCH_SEARCH_LIMIT)
