"""The host-engine cost model of an AFD Plan (sim.host): attention and FFN ranks ping-ponging per layer."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from waferline.errors import ConfigError
from waferline.sim.host_params import PIPELINE_PREFILL_CHUNK, HostParams
from waferline.sim.host_work import (
    OpCount,
    OpsProfile,
    Work,
    _hot,
    _work_time,
    afd_prefill_steps,
    compute_dtype,
    host_speculation,
    prefill_chunk_count,
)

if TYPE_CHECKING:
    from waferline.plan.plan import Plan
    from waferline.spec.model import ModelSpec


def _less(w: Work, fw: Work) -> Work:
    """A layer's work ``w`` less its FFN part ``fw`` (what the attention side runs)."""
    out = w.scaled(1.0)
    out.add(fw.scaled(-1.0))
    return out


def _simulate_host_afd(
    plan: Plan, spec: ModelSpec, host: HostParams, profile: OpsProfile | None, P: int, O: int, B: int
) -> Any:
    """AFD as engine/afd/ runs it: Ma attention ranks (data parallel over sequences: mixers, head, sampling) and Nf FFN
    ranks (the FFN work of the Ma ranks' tokens, split over them); per layer and micro-batch one message each way
    between
    every attention and FFN rank; K micro-batches ping-pong, so per layer the step is bounded by the busier side x K or
    by one micro-batch's attention + FFN on the layer's owner rank + two hops; all ranks share the cores."""
    from waferline.plan.place import expert_split, ffn_owner, ffn_rank_share
    from waferline.sim.result import SimResult, StageTiming
    from waferline.spec.model import MoESpec

    if profile is None or not hasattr(profile, "ffn"):
        raise ConfigError(
            "the host model of AFD needs the engine's op counts split into FFN and the rest (run it from `waferline "
            "twin`)"
        )
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
    # speculative decoding: a step is one verify of k + 1 tokens per sequence (its op count includes the drafting), at
    # the speculative per-step overhead, and emits (1 - a^(k+1)) / (1 - a) tokens per sequence
    k, tokens_per_step, spec_info = host_speculation(plan)
    t = k + 1
    step_over = host.spec_step_overhead_s.get(comp, over) if k > 0 else over

    hop = host.hop
    hot = _hot(host, plan)

    by_index = {layer.index: layer for layer in spec.layers}

    def owner_share(i: int) -> float:
        """Layer i's FFN work on its slowest FFN rank, per attention rank's share (the averaged share is 1 / Nf): the
        owner (``ffn_owner``) runs a dense FFN whole, and for an MoE its routed experts plus the shared experts whole,
        as engine/afd/sides.py lays them out; one micro-batch's round trip waits for it (the averaged share prices the
        side's busy time: round robin by layer spreads the owners' extra work over a step)."""
        f = getattr(by_index.get(i), "ffn", None)
        if not isinstance(f, MoESpec):
            return 1.0
        routed, o = f.top_k * f.expert_params(), ffn_owner(i, Nf)  # (the work split by parameters)
        return max(ffn_rank_share(routed, f.shared_params(), e1 - e0, f.num_experts, n == o)
                   for n, (e0, e1) in enumerate(expert_split(f.num_experts, Nf)))

    def side_times(count: OpCount, ffn_w: dict[int, Work], prefill: bool,
                   prefill_tokens: float = 0.0) -> tuple[list[float], list[float], list[float], float]:
        # prefill with the prefill constants (per op, linear scale, int4 scale), decode with the decode ones
        pf = host.prefill.get(comp) if prefill else None
        kw: dict[str, Any] = {"multi_s": host.multi_call_overhead_s.get(comp, 0.0)}
        if pf:
            kw.update(
                scale=(host.prefill_dram_scale(comp, prefill_tokens) if comp in host.prefill_scale_dram else pf[1])
                if not hot
                else pf[1],
                int4_scale=host.prefill_int4_scale.get(comp),
            )
        cop = pf[0] if pf else c_op
        rs = host.prefill_dram_scale(comp, prefill_tokens, rest=True) if pf and not hot else 1.0

        def secs(w: Work) -> float:  # (other ops' parts at the prefill's measured ratio)
            ops_s, mm_s, other_s = _work_time(host, w, cop, comp, hot=hot, **kw)
            return (ops_s + other_s) * rs + mm_s

        # f_t: an FFN rank's averaged share (the Ma attention ranks' tokens over Nf ranks); r_t: the slowest rank's
        # part, the layer's owner (what one micro-batch's round trip waits for)
        a_t, f_t, r_t = [], [], []
        for i, w in sorted(count.layers.items()):
            fw = ffn_w.get(i, Work())
            a_t.append(secs(_less(w, fw)))
            f_t.append(secs(fw.scaled(Ma / Nf)) if fw.ops else 0.0)
            r_t.append(secs(fw.scaled(Ma * owner_share(i))) if fw.ops else 0.0)
        return a_t, f_t, r_t, secs(count.other)

    dc = profile.decode(b, t)
    a_t, f_t, r_t, other = side_times(dc, profile.ffn("decode"), False)
    nb = b * t * spec.hidden_size * act
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
    # by the other), the FFN on the layer's owner (fo), the message back, each end's CPU included
    per_layer = [max(K * (a + msg_a), K * (f + msg_f), a + fo + msg_a + msg_f + 2 * hop_afd(0.0)) if f > 0 else K * a
                 for a, f, fo in zip(a_t, f_t, r_t)]
    # each side waits per micro-batch what the other side and the hops take: a longer wait, a slower (idle) hop
    per_layer = [
        max(
            K * (a + msg_a),
            K * (f + msg_f),
            a + fo + msg_a + msg_f + hop_afd(max(0.0, pl / K - fo - msg_f)) + hop_afd(max(0.0, pl / K - a - msg_a)),
        )
        if f > 0
        else K * a
        for a, f, fo, pl in zip(a_t, f_t, r_t, per_layer)
    ]
    row_over = host.row_overhead_s.get(comp, 0.0) + len(a_t) * host.row_layer_overhead_s.get(comp, 0.0)
    step = sum(per_layer) + K * (other + b * row_over) + step_over
    cpu_total = (
        Ma * (K * (sum(a_t) + other + b * row_over) + step_over)
        + Nf * K * sum(f_t)
        + K * len(a_t) * (Ma * msg_a + Nf * msg_f)
    )
    cores_bound = cpu_total / host.parallel(Ma + Nf)
    bound = (
        "cores (ranks share them)"
        if cores_bound > step
        else "ping-pong per layer (busier side or one micro-batch's round trip)"
    )
    step = max(step, cores_bound)
    rate = tokens_per_step / step
    # TTFT: the prompts of the busiest attention rank prefilled as the engine packs them (afd_prefill_steps: steps of
    # its prefill chunk, a prompt split where one ends, each step's rows split in its micro-batches), each group priced
    # from its own forward at its position (prefill_chunk_count); a step's micro-batches ping-pong between the sides as
    # a decode step's do: per layer the busier side over all of them, or the largest one's round trip
    kv_bytes = 4.0 if comp == "fp32" else 2.0
    prefill_ffn = getattr(profile, "prefill_ffn", None)
    ttft = over
    for step_mbs in afd_prefill_steps(Ba, P, PIPELINE_PREFILL_CHUNK, K):
        Kp, pother, per_mb = len(step_mbs), 0.0, []
        for mb in step_mbs:
            # each group's mixers (its forward less its FFN part); the FFN of all the micro-batch's tokens at once
            # (engine/afd/ranks.py sends them together), counted as one forward of them where it was
            n_tok = sum(r * tok for r, tok, _ in mb)
            whole = prefill_ffn(1, n_tok, 0) if prefill_ffn is not None and len(mb) > 1 else None
            layers: dict[int, Work] = {}
            fw: dict[int, Work] = {}
            oth = Work()
            for r, tok, start in mb:
                c = prefill_chunk_count(profile, spec, r, tok, start, host.small_op_bytes, kv_bytes)
                gf = prefill_ffn(r, tok, start) if prefill_ffn is not None else None
                gf = gf if gf is not None else profile.ffn("prefill")
                for i, w in c.layers.items():
                    layers.setdefault(i, Work()).add(_less(w, gf.get(i, Work())) if whole is not None else w)
                if whole is None:
                    for i, w in gf.items():
                        fw.setdefault(i, Work()).add(w)
                oth.add(c.other)
            if whole is not None:
                for i, w in whole.items():
                    layers.setdefault(i, Work()).add(w)
                    fw.setdefault(i, Work()).add(w)
            pa, pf, pr, po = side_times(OpCount(layers, oth), fw, True, n_tok)
            per_mb.append((pa, pf, pr, hop(n_tok * spec.hidden_size * act)))
            pother += po
        per_layer_p = []
        for j in range(len(per_mb[0][0])):
            sum_a = sum(m[0][j] for m in per_mb)
            sum_f = sum(m[1][j] for m in per_mb)
            if sum_f > 0:  # (one micro-batch's round trip: attention, the owner's FFN, a message and a hop each way)
                trip = max(m[0][j] + m[2][j] + 2 * m[3] for m in per_mb) + msg_a + msg_f
                per_layer_p.append(max(sum_a + Kp * msg_a, sum_f + Kp * msg_f, trip))
            else:
                per_layer_p.append(sum_a)
        ttft += sum(per_layer_p) + pother
    timings = [
        StageTiming(
            index=s.index,
            role=s.role,
            layers=f"{s.layers[0]}-{s.layers[-1]}" if len(s.layers) > 1 else str(s.layers[0]),
            devices=s.num_devices,
            compute=0.0,
            memory=0.0,
            fixed=K * (sum(a_t) + other) if s.role == "attention" else K * sum(f_t),
            comm=0.0,
            hop=h,
            total=K * (sum(a_t) + other) if s.role == "attention" else K * sum(f_t),
        )
        for s in plan.stages
    ]
    return SimResult(
        model=plan.model,
        hardware=plan.hardware,
        num_devices=plan.num_devices,
        num_stages=plan.num_stages,
        fits=plan.fits,
        concurrency=B,
        micro_batches=K,
        prompt_len=P,
        output_len=O,
        step_latency_s=step,
        decode_tokens_per_s_per_user=rate,
        aggregate_tokens_per_s=rate * B,
        ttft_s=ttft,
        prefill_s=ttft,
        end_to_end_s=ttft + (O - 1) / rate,
        bound=bound,
        stages=timings,
        speculative={
            **spec_info,
            "host": {
                "attention_ranks": Ma,
                "ffn_ranks": Nf,
                "micro_batch_rows": b,
                "cycle_s": step,
                "cores": host.cores,
            },
        },
        problems=list(plan.problems),
    )
