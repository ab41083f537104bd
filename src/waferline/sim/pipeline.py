"""Pipeline simulation of a Plan: per-token latency (sum over stages + hops), throughput, TTFT, speculative decoding."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from waferline.errors import ConfigError
from waferline.plan.plan import Plan, Stage
from waferline.sim.chunking import pipelined_prefill
from waferline.sim.cost import (
    STATE_BITS,
    ClassParams,
    LayerCost,
    SimParams,
    StepCost,
    expected_tokens_per_step,
    hop_time,
    layer_table,
    load_params,
    region_bytes,
    stage_step,
)
from waferline.sim.result import SimResult, StageTiming
from waferline.spec.hardware import HardwareSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    from waferline.spec.model import ModelSpec

PREFILL_CHUNK = 512
# An EAGLE-3 draft head projects onto a reduced ("hot") vocabulary: draft_vocab_size 32000 in the released heads'
# configs (EAGLE3-LLaMA3.1-Instruct-8B and its Qwen3 / GPT-OSS counterparts, whose targets have 128k-201k tokens);
# the target's LM head still verifies every token
EAGLE_DRAFT_VOCAB = 32000



def micro_batches(plan: Plan, B: int) -> int:
    """Micro-batches ``B`` sequences go through the stages in: the plan's own at its batch, else one per stage (at
    most B)."""
    M = plan.micro_batches if B == plan.batch else max(1, min(B, plan.num_stages))
    return max(1, min(M, B))


def layout_rows(plan: Plan, B: int) -> int:
    """The decode micro-batch of ``B`` sequences: what a wafer's regions are laid out for."""
    return math.ceil(B / micro_batches(plan, B))


@dataclass
class _Ctx:
    plan: Plan
    spec: ModelSpec
    hw: HardwareSpec
    prm: ClassParams
    params: SimParams
    hop_memo: dict = field(default_factory=dict)
    keys: list | None = None
    hop_keys: list = field(default_factory=list)
    _regions: list | None = None
    # sequences of the decode micro-batch a wafer's regions are laid out for (cost.region_share): every step runs on
    # that layout (None: each stage_step's resident batch)
    layout_batch: int | None = None

    @property
    def regions(self) -> list[LayerCost]:
        """The layers at the plan's context: what a wafer's regions are laid out for (``cost.stage_step``), each with
        the most cache a sequence holds on its way there (a compressed cache holds more just before a window closes:
        ``LayerSpec.peak_cache_bytes_per_seq``, as the plan's memory counts it)."""
        if self._regions is None:
            p = self.plan
            table = layer_table(self.spec, p.weight_bits, p.kv_bits, p.context_len, p.group_size)
            self._regions = [lc if (peak := self.spec.layers[lc.index].peak_cache_bytes_per_seq(
                p.context_len, p.kv_bits, STATE_BITS)) <= lc.cache_bytes else replace(lc, cache_bytes=peak)
                for lc in table]
        return self._regions

    def hop(self, a: int, b: int, nbytes: float) -> float:
        dpn = max(1, self.hw.devices_per_node)
        key = (a // dpn == b // dpn, nbytes)
        t = self.hop_memo.get(key)
        if t is None:
            t = self.hop_memo[key] = hop_time(self.hw, self.prm, a, b, nbytes)
        return t


def _lm_head(spec: ModelSpec, embed_bits: int) -> tuple[float, float]:
    return spec.lm_head_bytes(embed_bits) if spec.lm_head_params() else spec.embed_bytes(
        embed_bits
    ), spec.lm_head_flops_per_token()


def _eagle_head(spec: ModelSpec, embed_bits: int) -> tuple[int, float, float]:
    """An EAGLE head's own output projection: its draft vocabulary, bytes and FLOPs per token."""
    from waferline.spec.model import matmul_bytes

    v = min(spec.vocab_size, EAGLE_DRAFT_VOCAB)
    return v, matmul_bytes([(spec.hidden_size, v, 1)], embed_bits), 2.0 * v * spec.hidden_size


def _stage_keys(ctx: _Ctx, table: list[LayerCost]) -> list[tuple]:
    """Per stage: a key that is equal for stages with identical layers, role and device count (computed once)."""
    if ctx.keys is None:
        st = ctx.plan.stages
        dpn = max(1, ctx.hw.devices_per_node)
        ctx.keys = [(tuple(table[j].kind_id for j in s.layers), s.role, s.num_devices, s.has_lm_head) for s in st]
        ctx.hop_keys = [(s.device_ids[-1] // dpn == st[(i + 1) % len(st)].device_ids[0] // dpn, i + 1 == len(st))
                        for i, s in enumerate(st)]
    return ctx.keys


def _step(ctx: _Ctx, table: list[LayerCost], batch: int, tokens: int, resident_batch: int,
          want_timings: bool = True, verify: bool = False,
          head_tokens: int | None = None) -> tuple[float, list[StageTiming], float]:
    """(latency of one step through all stages incl. hops, per-stage timings, slowest stage time). ``verify``: a
    speculative verify of ``tokens`` per sequence (the recurrent states it keeps: ``cost.stage_step``).
    ``head_tokens``: positions per sequence the LM head runs over (None: all ``tokens``, as in a decode or verify
    step; a prefill chunk's 1: its last position only, as the engine, vLLM and SGLang compute a prompt's logits)."""
    plan, spec, hw, prm = ctx.plan, ctx.spec, ctx.hw, ctx.prm
    head_b, head_f = _lm_head(spec, plan.embed_bits)
    if head_tokens is not None:
        head_f *= head_tokens / tokens
    act = batch * tokens * spec.hidden_size * 2.0
    timings: list[StageTiming] = []
    total = 0.0
    slowest = 0.0
    stages = plan.stages
    memo: dict[tuple, StepCost] = {}
    hops: dict[tuple, float] = {}
    for i, (s, key) in enumerate(zip(stages, _stage_keys(ctx, table))):
        sc = memo.get(key)
        if sc is None:
            lcs = [table[j] for j in s.layers]
            hb = head_b if s.has_lm_head else 0.0
            regions = [ctx.regions[j] for j in s.layers] if hw.kind == "wafer" else None
            sc = stage_step(lcs, s.role, s.num_devices, hw, prm, spec.hidden_size, batch, tokens, plan.weight_bits,
                            lm_head_bytes=hb, lm_head_flops=head_f if s.has_lm_head else 0.0,
                            resident_batch=resident_batch, verify=verify, regions=regions,
                            layout_batch=ctx.layout_batch)
            memo[key] = sc
        if plan.afd:
            hop = _hops_out(ctx, i, act)
        else:
            hkey = ctx.hop_keys[i]
            hop = hops.get(hkey)
            if hop is None:
                hop = hops[hkey] = _hops_out(ctx, i, act)
        st = sc.total
        if want_timings:
            timings.append(StageTiming(s.index, s.role, _layer_range(s), s.num_devices, sc.compute, sc.memory, sc.fixed,
                                       sc.comm, hop, st + hop, fabric=sc.fabric,
                                       fabric_distance=sc.fabric_distance, ops=list(sc.ops),
                                       cores_used=sc.cores_used))
        total += st + hop
        if st > slowest:
            slowest = st
    return total, timings, slowest


def _hops_out(ctx: _Ctx, i: int, act: float) -> float:
    """Transfers leaving stage i in one step: to the next stage, or (last stage) the sampled tokens back to the
    first."""
    plan = ctx.plan
    stages = plan.stages
    s = stages[i]
    if plan.afd:
        if s.role != "attention":
            return 0.0
        # each of this stage's layers goes attention -> FFN stage -> back
        t = 0.0
        for layer in s.layers:
            f = next((x for x in stages if x.role == "ffn" and layer in x.layers), None)
            if f is not None:
                t += ctx.hop(s.device_ids[0], f.device_ids[0], act) + ctx.hop(f.device_ids[0], s.device_ids[0], act)
        att = [x for x in stages if x.role == "attention"]
        if len(att) > 1:
            nxt = att[(att.index(s) + 1) % len(att)]
            t += ctx.hop(s.device_ids[-1], nxt.device_ids[0], act if nxt is not att[0] else 64.0)
        return t
    if len(stages) == 1:
        return 0.0
    nxt = stages[(i + 1) % len(stages)]
    nbytes = act if i + 1 < len(stages) else 64.0  # token ids back to the embedding stage
    return ctx.hop(s.device_ids[-1], nxt.device_ids[0], nbytes)


def _layer_range(s: Stage) -> str:
    return str(s.layers[0]) if len(s.layers) == 1 else f"{s.layers[0]}-{s.layers[-1]}"


def _tokenizer(spec: ModelSpec) -> str | None:
    """The tokenizer a catalog model names (``_waferline.tokenizer``, where vocabularies of one size differ)."""
    w = spec.hf_config.get("_waferline")
    return w.get("tokenizer") if isinstance(w, dict) else None


def draft_spec(spec: ModelSpec, name: str | None, params: SimParams) -> ModelSpec | None:
    """The draft model for ``spec``: ``name`` if given (ConfigError when its vocabulary or its named tokenizer differs
    from the target's: a draft proposes token ids the target verifies, so both must share one tokenizer), else the
    default for the model family when it shares the tokenizer, else None (the caller models a draft head of the
    target's own shape)."""
    from waferline.spec.catalog import load_model

    if name:
        dspec = load_model(name)
        if dspec.vocab_size != spec.vocab_size:
            raise ConfigError(f"draft model {dspec.name} has a {dspec.vocab_size}-token vocabulary, {spec.name} a "
                              f"{spec.vocab_size}-token one: a draft must share the target's tokenizer")
        dt, tt = _tokenizer(dspec), _tokenizer(spec)
        if dt and tt and dt != tt:
            raise ConfigError(f"draft model {dspec.name} uses the {dt} tokenizer, {spec.name} the {tt} one (the same "
                              "vocabulary size, other tokens): a draft must share the target's tokenizer")
        return dspec
    name = params.draft_models.get(spec.model_type) or params.draft_models.get("default")
    dspec = load_model(name) if name else None
    if dspec is None or dspec.vocab_size != spec.vocab_size:
        return None
    dt, tt = _tokenizer(dspec), _tokenizer(spec)
    return None if dt and tt and dt != tt else dspec


def drafter_memory(spec: ModelSpec, sp: Any, params: SimParams, *, weight_bits: int, kv_bits: int, embed_bits: int,
                   group_size: int, context: int, batch: int) -> tuple[float, str]:
    """Bytes the drafter of ``sp`` (a SpeculativeConfig) adds to the stage that holds the LM head: its weights, and
    its cache for ``batch`` sequences of ``context`` tokens (an MTP module or a draft layer keeps a cache of its own;
    a draft model its whole cache) — and what it is. N-gram lookup runs on the host: nothing."""
    from waferline.spec.model import matmul_bytes

    method = sp.method
    if method in ("none", "ngram"):
        return 0.0, ""
    d = spec.hidden_size
    if method == "medusa":  # k heads, each a residual block [d -> d] and an LM head of its own
        k = params.draft_tokens(sp)
        # (each head's vocabulary projection the size of the target's: its embedding table where it ties the two)
        return k * (_lm_head(spec, embed_bits)[0] + matmul_bytes([(d, d, 1)], weight_bits, group_size)), \
            f"{k} Medusa heads"
    dspec = draft_spec(spec, sp.draft_model, params) if method == "draft" else None
    if dspec is not None:
        return (dspec.weight_bytes(weight_bits, group_size, embed_bits)
                + batch * dspec.cache_bytes_per_seq(context, kv_bits)), f"draft model {dspec.name} and its cache"
    # an MTP module, else a one-layer draft head of the target's shape (EAGLE-style, or a missing drafter's stand-in)
    layers, what = (spec.mtp_layers, "MTP module") if method == "mtp" and spec.mtp_layers else \
        (spec.layers[:1], "one-layer draft head")
    # an EAGLE head's own output projection over its draft vocabulary (an MTP module uses the target's LM head)
    head = _eagle_head(spec, embed_bits)[1] if method == "eagle" else 0.0
    return (spec.mtp_weight_bytes(weight_bits, group_size, layers) + head
            + batch * sum(lc.cache_bytes_per_seq(context, kv_bits) for lc in layers)), f"{what} and its cache"


def plan_drafter(plan: Plan, params: SimParams) -> Callable[[int, int], float] | None:
    """The bytes ``plan``'s drafter adds beside the LM head at (context, batch), for the capacity searches
    (plan.place.batch_capacity / context_capacity); None when it drafts on the host (n-grams) or does not draft."""
    if plan.speculative.method in ("none", "ngram"):
        return None
    from waferline.spec.catalog import load_model

    spec = load_model(plan.model)
    return lambda context, batch: drafter_memory(
        spec, plan.speculative, params, weight_bits=plan.weight_bits, kv_bits=plan.kv_bits,
        embed_bits=plan.embed_bits, group_size=plan.group_size, context=context, batch=batch)[0]


def _rate_method(ctx: _Ctx) -> str:
    """Whose acceptance rate the plan's drafter takes: its method's, but a draft model that falls back to a one-layer
    head of the target's shape (no small model shares the vocabulary) drafts as an EAGLE-style head does."""
    sp = ctx.plan.speculative
    if sp.method == "draft" and draft_spec(ctx.spec, sp.draft_model, ctx.params) is None:
        return "eagle"
    return sp.method


def _accept_source(ctx: _Ctx, rated: str) -> str:
    """Where the plan's acceptance rate comes from: given with the plan, fitted on published rows, or the default."""
    if ctx.plan.speculative.accept_rate is not None:
        return "given"
    return "fitted" if ctx.params.status.get(f"accept_rate.{rated}", "").startswith("fitted") else "assumed default"


def _with_input_projection(lc: LayerCost, d: int, weight_bits: int, group: int, streams: int = 1) -> LayerCost:
    """A one-layer drafter's layer with its [2d -> d] input projection (an MTP module's ``eh_proj``, an EAGLE-style
    head's ``fc``: the token's embedding beside the hidden state, down to d) added to its mixer: the projection's
    bytes, 2 x 2d x d FLOPs per token, and on a wafer one more phase carrying 2d elements in and d out beyond the
    layer input ``fabric_work`` already counts. ``streams``: hyper-connected residual streams (DeepSeek-V4's MTP block
    projects the embedding once and each stream of the hidden state with its own [d -> d])."""
    from waferline.spec.model import matmul_bytes

    pb = matmul_bytes([(2 * d, d, 1)], weight_bits, group)
    return replace(lc, weight_bytes=lc.weight_bytes + pb, mixer_bytes=lc.mixer_bytes + pb,
                   mixer_flops=lc.mixer_flops + 2.0 * d * d * (1 + max(1, streams)),
                   fabric_mixer_elems=lc.fabric_mixer_elems + 2.0 * d,
                   fabric_mixer_phases=lc.fabric_mixer_phases + 1)


def _hidden_drafter_steps(one: Callable[[float], StepCost], k: int, first_tokens: float) -> float:
    """k steps of a drafter fed the target's hidden states (an MTP module, an EAGLE-style head): the first runs its
    layer over the ``first_tokens`` positions the last verify step emitted per sequence (their true hidden states
    replace the drafted guesses, as the engine's MTP drafter commits them), its head over the last only; the others
    over one drafted token each. ``one(t)`` is a step over t positions per sequence."""
    return one(max(1.0, first_tokens)).total + (k - 1) * one(1.0).total


def _one_layer_step(ctx: _Ctx, lc: LayerCost, n: int, batch: int, head_b: float,
                    head_f: float) -> Callable[[float], StepCost]:
    """A one-layer drafter's step over t positions per sequence, its LM head over the last position only."""
    plan, spec = ctx.plan, ctx.spec

    def one(t: float) -> StepCost:
        return stage_step([lc], "full", n, ctx.hw, ctx.prm, spec.hidden_size, batch, t, plan.weight_bits,
                          lm_head_bytes=head_b, lm_head_flops=head_f / t)

    return one


def _draft_time(ctx: _Ctx, method: str, k: int, batch: int, table: list[LayerCost], context: int,
                first_tokens: float = 1.0) -> tuple[float, str]:
    """Seconds to propose k tokens for a micro-batch of ``batch`` sequences, and what did the drafting.
    ``first_tokens``: tokens per sequence the previous verify step emitted (the expected accepted length), which a
    drafter fed the target's hidden states runs its first step over."""
    plan, spec, hw, prm = ctx.plan, ctx.spec, ctx.hw, ctx.prm
    head_b, head_f = _lm_head(spec, plan.embed_bits)
    last = plan.stages[-1] if not plan.afd else next(s for s in plan.stages if s.has_lm_head)
    n = last.num_devices
    if method == "ngram":
        return 0.0, "prompt-lookup n-gram (host)"
    if method == "medusa":
        sc = stage_step([], "full", n, hw, prm, spec.hidden_size, batch, 1, plan.weight_bits,
                        lm_head_bytes=k * head_b, lm_head_flops=k * head_f)
        return sc.total, f"{k} Medusa heads in one pass"
    if method in ("mtp", "eagle"):
        if method == "mtp" and spec.mtp_layers:
            from types import SimpleNamespace

            mspec = SimpleNamespace(layers=spec.mtp_layers[:1], name=spec.name + ":mtp")
            lc = layer_table(mspec, plan.weight_bits, plan.kv_bits, context, plan.group_size)[0]
            what, streams = "MTP module", spec.mtp_layers[0].hc_mult
        else:
            lc, streams = table[0], 1
            what = "MTP-like one-layer head (model has no MTP layers)"
            if method == "mtp" and (spec.hf_config or {}).get("num_nextn_predict_layers"):  # (a parser without them)
                what = (f"one-layer head of {spec.name}'s shape standing in for its MTP module (not modelled for "
                        f"{spec.model_type})")
            if method == "eagle":
                v, head_b, head_f = _eagle_head(spec, plan.embed_bits)
                what = f"one-layer draft head (EAGLE-style, over a {v:,}-token draft vocabulary)"
        lc = _with_input_projection(lc, spec.hidden_size, plan.weight_bits, plan.group_size, streams)
        return _hidden_drafter_steps(_one_layer_step(ctx, lc, n, batch, head_b, head_f), k, first_tokens), what
    if method == "draft":
        from waferline.plan.place import place

        dspec = draft_spec(spec, plan.speculative.draft_model, ctx.params)
        if dspec is None:  # no small catalog model shares the target's tokenizer: a draft head of its own shape
            lc = _with_input_projection(table[0], spec.hidden_size, plan.weight_bits, plan.group_size)
            t = _hidden_drafter_steps(_one_layer_step(ctx, lc, n, batch, head_b, head_f), k, first_tokens)
            return t, (f"one-layer draft head of {spec.name}'s shape (no small catalog model shares its "
                       f"{spec.vocab_size}-token vocabulary), with an EAGLE-style head's acceptance")
        devs = plan.stages[0].num_devices if hw.placement == "tensor" else None
        dplan = place(
            dspec,
            hw,
            devices=devs,
            weight_bits=plan.weight_bits,
            kv_bits=plan.kv_bits,
            embed_bits=plan.embed_bits,
            group_size=plan.group_size,
            context=plan.context_len,
            batch=batch,
        )
        dctx = _Ctx(dplan, dspec, hw, prm, ctx.params)
        dtable = layer_table(dspec, plan.weight_bits, plan.kv_bits, context, plan.group_size)
        t, _, _ = _step(dctx, dtable, batch, 1, batch)
        return k * t, f"draft model {dspec.name} on {dplan.num_devices} x {hw.name}"
    raise ConfigError(f"unknown speculative method {method!r}")


def simulate(
    plan: Plan,
    *,
    prompt_len: int | None = None,
    output_len: int | None = None,
    concurrency: int | None = None,
    params: SimParams | None = None,
    spec: ModelSpec | None = None,
    hardware: HardwareSpec | None = None,
    host: Any = None,
    ops: Any = None,
    reasoning_tokens: int = 0,
    layout_concurrency: int | None = None,
) -> SimResult:
    """Predict decode speed, TTFT and end-to-end latency of ``plan``.

    ``layout_concurrency``: on wafers, the concurrency the regions are laid out for (a deployment compiles one layout,
    for the most sequences it serves: the serving simulation's cap), default ``concurrency`` (a steady state at it).

    ``reasoning_tokens``: hidden tokens a reasoning model generates before its ``output_len`` answer tokens (decoded
    like any output, so they lengthen the end-to-end time and the cache read per step; ``first_answer_s`` is when the
    answer starts).
    ``host`` (a ``sim.host.HostParams`` from `waferline calibrate`): predict waferline's own CPU engine on this host
    instead (per-op overheads, measured GEMV speed, gloo hops, processes vs cores; ``ops``: the engine's op counts)."""
    from waferline.spec.catalog import load_hardware, load_model

    params = params or load_params()
    spec = spec if spec is not None else load_model(plan.model)
    hw = hardware if hardware is not None else load_hardware(plan.hardware)
    prm = params.for_hardware(hw)
    P = int(prompt_len if prompt_len is not None else params.default_prompt_len)
    O = int(output_len if output_len is not None else params.default_output_len)
    if P < 1 or O < 1:
        raise ConfigError(f"prompt and output lengths must be >= 1 (got {P}, {O})")
    R = int(reasoning_tokens)
    if R < 0:
        raise ConfigError(f"reasoning tokens must be >= 0, got {R}")
    O += R  # every generated token, hidden or not, is decoded alike (_answered reports the answer's share)
    B = int(concurrency if concurrency is not None else plan.batch)
    if B < 1:
        raise ConfigError(f"concurrency must be >= 1, got {B}")
    if host is not None:  # waferline's own engine on a calibrated host (sim/host.py)
        from waferline.sim.host import simulate_host

        return _answered(simulate_host(plan, spec, hw, host, ops, prompt_len=P, output_len=O, concurrency=B), R)
    S = plan.num_stages
    M = micro_batches(plan, B)
    b = math.ceil(B / M)
    # (a stage steps one micro-batch at a time: regions are laid out for that micro-batch)
    ctx = _Ctx(plan, spec, hw, prm, params, layout_batch=layout_rows(plan, layout_concurrency or B))
    dec_ctx = P + O // 2
    table = layer_table(spec, plan.weight_bits, plan.kv_bits, dec_ctx, plan.group_size)

    if is_afd_ranks(plan):  # the engine's AFD layout: data-parallel attention ranks, expert-sharded FFN ranks
        return _answered(_simulate_afd_ranks(ctx, table, B, P, O, dec_ctx), R)
    t1, timings, slow1 = _step(ctx, table, b, 1, B)
    # the engine splits the B sequences into M micro-batches of near-equal size (pipeline/serving.py _split): ``full``
    # of b, the rest of b - 1, each once through the slowest stage per step
    full = B - M * (b - 1)
    smaller, slow0 = _step(ctx, table, b - 1, 1, B)[1:] if full < M else ([], 0.0)
    pipe = full * slow1 + (M - full) * slow0
    interval = max(t1, pipe)
    bound = _bound(timings, t1, pipe)
    rate = 1.0 / interval
    spec_info: dict[str, Any] = {"method": plan.speculative.method}
    sp = plan.speculative
    if sp.method != "none":
        k = params.draft_tokens(sp)
        rated = _rate_method(ctx)
        a = sp.accept_rate if sp.accept_rate is not None else params.accept_rate.get(rated, 0.6)
        E = expected_tokens_per_step(a, k)
        tv, _, slowv = _step(ctx, table, b, k + 1, B, want_timings=False, verify=True)
        tdraft, what = _draft_time(ctx, sp.method, k, b, table, dec_ctx, E)
        slowv0 = _step(ctx, table, b - 1, k + 1, B, want_timings=False, verify=True)[2] if full < M else 0.0
        step = max(tv + tdraft, full * slowv + (M - full) * slowv0)
        spec_rate = E / step
        spec_info.update(
            num_tokens=k,
            accept_rate=a,
            expected_tokens_per_step=E,
            verify_s=tv,
            draft_s=tdraft,
            drafter=what,
            speedup=spec_rate / rate,
            accept_rate_source=_accept_source(ctx, rated),
        )
        rate = spec_rate
    # TTFT: chunked prefill pipelined through the stages, the last chunk at its real size (sim/chunking.py)
    ptable = layer_table(spec, plan.weight_bits, plan.kv_bits, max(1, P // 2), plan.group_size)

    def chunk(n: int) -> tuple[float, float]:
        tp, _, slowp = _step(ctx, ptable, 1, n, B, want_timings=False, head_tokens=1)
        return tp, slowp

    ttft = params.ttft_overhead_s + pipelined_prefill(P, min(P, PREFILL_CHUNK), chunk)
    e2e = ttft + (O - 1) / rate
    return _answered(SimResult(
        model=plan.model,
        hardware=plan.hardware,
        num_devices=plan.num_devices,
        num_stages=S,
        fits=plan.fits,
        concurrency=B,
        micro_batches=M,
        prompt_len=P,
        output_len=O,
        step_latency_s=t1,
        decode_tokens_per_s_per_user=rate,
        aggregate_tokens_per_s=rate * B,
        ttft_s=ttft,
        prefill_s=ttft - params.ttft_overhead_s,
        end_to_end_s=e2e,
        bound=bound,
        stages=timings,
        speculative=spec_info,
        problems=list(plan.problems),
        full_micro_batches=full,
        smaller_stages=smaller,
    ), R)


def _answered(r: SimResult, reasoning_tokens: int) -> SimResult:
    """``r`` (simulated over every generated token) as the answer sees it: ``output_len`` the answer's tokens, the
    first of them ``reasoning_tokens`` decode steps after the first token."""
    r.reasoning_tokens = reasoning_tokens
    r.output_len -= reasoning_tokens
    r.first_answer_s = r.ttft_s + reasoning_tokens / r.decode_tokens_per_s_per_user
    return r


def _bound(timings: list[StageTiming], token: float, pipe: float) -> str:
    if pipe > token:
        return "pipeline (slowest stage x micro-batches)"
    fixed = sum(t.fixed + t.comm + t.hop + t.fabric for t in timings)
    mem = sum(t.memory for t in timings)
    cmp_ = sum(t.compute for t in timings)
    terms = [("fixed per-layer", sum(t.fixed for t in timings)), ("fabric", sum(t.fabric for t in timings)),
             ("collectives", sum(t.comm for t in timings)), ("hops", sum(t.hop for t in timings))]
    what = ", ".join(name for name, v in terms if v > 0)  # (the terms this hardware has: no fabric on a GPU)
    best = max((fixed, f"latency ({what})"), (mem, "memory bandwidth"), (cmp_, "compute"))
    return best[1]


# ---------------------------------------------------------------- AFD as the engine runs it

def is_afd_ranks(plan: Plan) -> bool:
    """A plan in the AFD engine's layout (``Plan.attention_ranks``)."""
    return plan.attention_ranks > 0


def _afd_ffn_rows(B: int, M: int, K: int) -> list[int]:
    """Sequences the FFN side gets in each of the K micro-batches of a step of ``B``: sequence i lives on attention
    rank i mod M, and each rank splits its rows into K micro-batches balanced as the engine does (the first ones a
    row more)."""
    rows = [0] * K
    for m in range(min(M, B)):
        q, r = divmod(len(range(m, B, M)), K)
        for k in range(K):
            rows[k] += q + (1 if k < r else 0)
    return rows


def _afd_node_shares(ctx: _Ctx, att: list[Stage], ffn: list[Stage]) -> tuple[tuple, tuple]:
    """The least and the most share of an FFN rank's devices on the node of an attention rank, over every pair, each
    as (share, attention device, FFN device off / on that node): a rank's experts are spread evenly over its devices,
    so that share of the rows an attention rank sends it stays on the node's scale-up link and the rest crosses the
    scale-out link."""
    from collections import Counter

    dpn = max(1, ctx.hw.devices_per_node)
    counts = [Counter(d // dpn for d in s.device_ids) for s in ffn]
    lo: tuple = (2.0, 0, 0)
    hi: tuple = (-1.0, 0, 0)
    for a in {s.device_ids[0] // dpn: s.device_ids[0] for s in att}.values():
        node = a // dpn
        for c, s in zip(counts, ffn):
            share = c.get(node, 0) / s.num_devices
            if share < lo[0]:
                lo = (share, a, next((d for d in s.device_ids if d // dpn != node), a))
            if share > hi[0]:
                hi = (share, a, next((d for d in s.device_ids if d // dpn == node), a))
    return lo, hi


def _afd_hop(ctx: _Ctx, shares: tuple[tuple, tuple], nbytes: float) -> float:
    """One message of ``nbytes`` from an attention rank to an FFN rank, the slowest pair's: the part for devices on
    its node over the scale-up link, the rest over the scale-out link, side by side (``_afd_node_shares``)."""
    (lo, a, off), (hi, b, on) = shares
    t = ctx.hop(b, on, nbytes * hi) if hi > 0 else 0.0
    return max(t, ctx.hop(a, off, nbytes * (1.0 - lo))) if lo < 1 else t


def _afd_layer_times(ctx: _Ctx, table: list[LayerCost], bm: int, tokens: int, K: int, resident_batch: int,
                     ffn_rows: list[int], verify: bool = False) -> tuple[float, dict[str, Any]]:
    """One step of K micro-batches of ``bm`` sequences x ``tokens`` per attention rank, the FFN side getting
    ``ffn_rows[k]`` sequences (over all attention ranks) in micro-batch k: the time (sum over layers of the ping-pong
    bound) and the busy seconds per side / term (``ffn_stages``: per FFN stage index, its own). ``verify``: a
    speculative verify of ``tokens`` per sequence (the recurrent states it keeps: ``cost.stage_step``)."""
    plan, spec, hw, prm = ctx.plan, ctx.spec, ctx.hw, ctx.prm
    att = [s for s in plan.stages if s.role == "attention"]
    ffn = [s for s in plan.stages if s.role == "ffn"]
    N = len(ffn)
    a = att[0]
    D = spec.hidden_size
    wb = plan.weight_bits
    ffn_layers = set(ffn[0].layers)
    spatial = hw.kind == "wafer"
    head_b, head_f = _lm_head(spec, plan.embed_bits)
    # an attention rank's resident bytes (a wafer: every layer's region, and the LM head's, as ``_step`` counts them)
    res_a = sum(region_bytes(lc, "attention", resident_batch, r) for lc, r in zip(table, ctx.regions)) + head_b \
        if spatial else None
    shares = _afd_node_shares(ctx, att, ffn)
    from waferline.plan.place import expert_split, ffn_owner, ffn_rank_share

    splits = {E: [e1 - e0 for e0, e1 in expert_split(E, N)] for E in {lc.num_experts for lc in table if lc.is_moe}}
    shared = {layer.index for layer in spec.layers if getattr(layer.ffn, "shared_intermediate", 0)}

    def local(lc: LayerCost, n: int) -> LayerCost:  # FFN rank n's share of a layer (its experts; shared/dense averaged)
        if not lc.is_moe:
            return replace(lc, ffn_bytes=lc.ffn_bytes / N, ffn_flops=lc.ffn_flops / N)
        e_loc = splits[lc.num_experts][n]
        return replace(lc, num_experts=e_loc, top_k=lc.top_k * e_loc / lc.num_experts,
                       ffn_bytes=lc.dense_ffn_bytes / N + e_loc * lc.expert_bytes,
                       ffn_flops=lc.ffn_flops * e_loc / lc.num_experts)

    def owner(lc: LayerCost, n: int) -> LayerCost:
        """FFN rank n's part of a layer it owns (``ffn_owner``): its experts and the shared experts / dense FFN whole,
        which one micro-batch's round trip waits for (the averaged share prices the side's busy time: round robin by
        layer spreads the owners' extra work over the step)."""
        if not lc.is_moe:
            return lc
        e_loc = splits[lc.num_experts][n]  # (the routed experts' share of the FLOPs by bytes, as serving's skew)
        share = ffn_rank_share(lc.top_k * lc.expert_bytes, lc.dense_ffn_bytes, e_loc, lc.num_experts, True)
        return replace(lc, num_experts=e_loc, top_k=lc.top_k * e_loc / lc.num_experts,
                       ffn_bytes=lc.dense_ffn_bytes + e_loc * lc.expert_bytes, ffn_flops=lc.ffn_flops * share)

    # the FFN ranks of one shape (experts, devices) time alike: one of each; a micro-batch waits for the slowest
    shapes: dict[tuple, list[int]] = {}
    for n, s in enumerate(ffn):
        shapes.setdefault((tuple(splits[E][n] for E in sorted(splits)), s.num_devices), []).append(n)
    ranks = []  # (FFN stage indices of the shape, its local layer table, devices, resident bytes)
    for idx in shapes.values():
        locs = [local(lc, idx[0]) for lc in table]
        res_f = sum(lc.ffn_bytes for lc in locs if lc.index in ffn_layers) if spatial else None
        ranks.append(([ffn[n].index for n in idx], locs, ffn[idx[0]].num_devices, res_f))
    shape_of = {n: ri for ri, idx in enumerate(shapes.values()) for n in idx}
    own_memo: dict[tuple, float] = {}
    tot: dict[str, Any] = {"attention": 0.0, "ffn": 0.0, "transfer": 0.0, "att_compute": 0.0, "att_memory": 0.0,
                           "att_fixed": 0.0, "ffn_stages": {}}
    per_rank = [{"ffn": 0.0, "ffn_compute": 0.0, "ffn_memory": 0.0, "ffn_fixed": 0.0} for _ in ranks]
    rows = sorted(set(ffn_rows))
    step = 0.0
    for li, lc in enumerate(table):
        ta = stage_step([lc], "attention", a.num_devices, hw, prm, D, bm, tokens, wb, spatial_resident=res_a,
                        resident_batch=resident_batch, verify=verify, regions=[ctx.regions[li]] if spatial else None)
        T_a = ta.total
        if lc.index in ffn_layers:
            # the FFN side over the K micro-batches (the slowest rank in each), and its largest micro-batch alone
            by_rows = {r: 0.0 for r in rows}
            for ri, (_, locs, n_dev, res_f) in enumerate(ranks):
                for r in rows:
                    tf = stage_step([locs[li]], "ffn", n_dev, hw, prm, D, r, tokens, wb, spatial_resident=res_f,
                                    layout_batch=ctx.layout_batch)
                    by_rows[r] = max(by_rows[r], tf.total)
                    c = ffn_rows.count(r)
                    pr = per_rank[ri]
                    pr["ffn"] += c * tf.total
                    pr["ffn_compute"] += c * tf.compute
                    pr["ffn_memory"] += c * tf.memory
                    pr["ffn_fixed"] += c * (tf.fixed + tf.comm)
            busy = sum(by_rows[r] for r in ffn_rows)
            # its largest micro-batch alone: on the slowest rank, the layer's owner holding its shared experts or
            # dense FFN whole (a dense layer: on the owner only)
            o = ffn_owner(lc.index, N)
            _, locs, n_dev, res_f = ranks[shape_of[o]]
            key = (lc.kind_id, lc.ffn_flops, shape_of[o], max(ffn_rows))
            t_own = own_memo.get(key)
            if t_own is None:
                t_own = own_memo[key] = stage_step([owner(lc, o)], "ffn", n_dev, hw, prm, D, max(ffn_rows), tokens,
                                                   wb, spatial_resident=res_f, layout_batch=ctx.layout_batch).total
            first = max(t_own, by_rows[max(ffn_rows)] if lc.is_moe and N > 1 else 0.0)
            # rows one attention rank sends one FFN rank, the largest message: the owner's (a dense layer whole; beside
            # its routed rows, the whole micro-batch for the shared experts)
            pairs = bm * tokens * ((lc.top_k / N) if lc.is_moe else 1.0)
            nbytes = pairs * D * 2.0 + (bm * tokens * D * 2.0 if lc.is_moe and lc.index in shared else 0.0)
            T_c = _afd_hop(ctx, shares, nbytes)
            tot["ffn"] += busy
            tot["transfer"] += K * 2 * T_c
            step += max(K * T_a, busy, T_a + first + 2 * T_c)
        else:
            step += K * T_a
        tot["attention"] += K * T_a
        tot["att_compute"] += K * ta.compute
        tot["att_memory"] += K * ta.memory
        tot["att_fixed"] += K * (ta.fixed + ta.comm)
    # the LM head: a verify's at each of its positions, else the last's
    th = stage_step([], "attention", a.num_devices, hw, prm, D, bm, 1, wb, lm_head_bytes=head_b,
                    lm_head_flops=head_f * (tokens if verify else 1), spatial_resident=res_a).total
    step += K * th
    tot["attention"] += K * th
    for (stage_ids, _, _, _), pr in zip(ranks, per_rank):
        for i in stage_ids:
            tot["ffn_stages"][i] = pr
    return step, tot


def _simulate_afd_ranks(ctx: _Ctx, table: list[LayerCost], B: int, P: int, O: int, dec_ctx: int) -> SimResult:
    """Decode: every attention rank runs K micro-batches of its ceil(B / M) sequences through every layer; per layer
    the two sides ping-pong, so a layer costs max(K x attention, the FFN over the K micro-batches, one round trip)
    (MegaScale-Infer's bound), the FFN side timed on the slowest FFN rank with the rows the engine sends it."""
    plan, spec, params = ctx.plan, ctx.spec, ctx.params
    att = [s for s in plan.stages if s.role == "attention"]
    M = len(att)
    b = math.ceil(B / M)
    K = max(1, min(plan.micro_batches, b))
    bm = math.ceil(b / K)
    rows = _afd_ffn_rows(B, M, K)
    step, tot = _afd_layer_times(ctx, table, bm, 1, K, b, rows)
    rate = 1.0 / step
    spec_info: dict[str, Any] = {"method": plan.speculative.method}
    sp = plan.speculative
    if sp.method != "none":
        k = params.draft_tokens(sp)
        rated = _rate_method(ctx)
        acc = sp.accept_rate if sp.accept_rate is not None else params.accept_rate.get(rated, 0.6)
        E = expected_tokens_per_step(acc, k)
        tv, _ = _afd_layer_times(ctx, table, bm, k + 1, K, b, rows, verify=True)
        tdraft, what = _draft_time(ctx, sp.method, k, bm, table, dec_ctx, E)
        spec_info.update(num_tokens=k, accept_rate=acc, expected_tokens_per_step=E, verify_s=tv, draft_s=tdraft,
                         drafter=what, speedup=(E / (tv + K * tdraft)) / rate,
                         accept_rate_source=_accept_source(ctx, rated))
        rate = E / (tv + K * tdraft)
    C = min(P, PREFILL_CHUNK)
    ptable = layer_table(spec, plan.weight_bits, plan.kv_bits, max(1, P // 2), plan.group_size)
    n_full, rest = divmod(P, C)  # chunks one after another, the last at its real size; one prompt: the FFN side gets
    # its chunk alone (the other attention ranks' messages are empty)
    ttft = params.ttft_overhead_s + n_full * _afd_layer_times(ctx, ptable, 1, C, 1, b, [1])[0] + (
        _afd_layer_times(ctx, ptable, 1, rest, 1, b, [1])[0] if rest else 0.0)
    timings = []
    for s in plan.stages:
        if s.role == "attention":
            timings.append(StageTiming(s.index, s.role, _layer_range(s), s.num_devices, tot["att_compute"],
                                       tot["att_memory"], tot["att_fixed"], 0.0, tot["transfer"], tot["attention"]))
        else:
            f = tot["ffn_stages"][s.index]
            timings.append(StageTiming(s.index, s.role, _layer_range(s), s.num_devices, f["ffn_compute"],
                                       f["ffn_memory"], f["ffn_fixed"], 0.0, 0.0, f["ffn"]))
    # (the K micro-batches' transfers overlap one another: one micro-batch's lie on the step's path)
    sides = {"attention": tot["attention"], "FFN": tot["ffn"], "transfer": tot["transfer"] / K}
    big = max(sides, key=sides.get)  # type: ignore[arg-type]
    bound = f"AFD: {big} ({sides[big] / step:.0%} of the step busy)" if sides[big] / step > 0.8 else \
        "AFD: round-trip latency (micro-batches too small to hide it)"
    return SimResult(model=plan.model, hardware=plan.hardware, num_devices=plan.num_devices, num_stages=plan.num_stages,
                     fits=plan.fits, concurrency=B, micro_batches=K, prompt_len=P, output_len=O, step_latency_s=step,
                     decode_tokens_per_s_per_user=rate, aggregate_tokens_per_s=rate * B, ttft_s=ttft,
                     prefill_s=ttft - params.ttft_overhead_s, end_to_end_s=ttft + (O - 1) / rate, bound=bound,
                     stages=timings, speculative=spec_info, problems=list(plan.problems),
                     sides_overlap=True)
