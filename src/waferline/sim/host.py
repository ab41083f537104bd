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

The calibrated figures live in sim.host_params (HostParams), the counted work and per-stage pricing in sim.host_work,
the AFD path in sim.host_afd; this module prices a whole Plan and re-exports their names.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from waferline.errors import ConfigError
from waferline.sim.host_afd import _simulate_host_afd
from waferline.sim.host_params import (
    ENGINE_FEW_ROWS,
    OVERSUB_KEYS,
    PIPELINE_PREFILL_CHUNK,
    PREFILL_PROBE_TOKENS,
    HostParams,
    LinearFit,
    LinearTable,
)
from waferline.sim.host_work import (
    DefaultOps,
    OpCount,
    OpsProfile,
    Work,
    _hot,
    _stage_cost,
    _StageCost,
    _touched,
    _work_time,
    compute_dtype,
    host_speculation,
    multi_row_product,
    prefill_chunk_count,
    prefill_micro_batches,
)

if TYPE_CHECKING:
    from waferline.plan.plan import Plan
    from waferline.spec.hardware import HardwareSpec
    from waferline.spec.model import ModelSpec

# the names importers take from this module, wherever their code now lives
__all__ = ["ENGINE_FEW_ROWS", "OVERSUB_KEYS", "PIPELINE_PREFILL_CHUNK", "PREFILL_PROBE_TOKENS", "DefaultOps",
           "HostParams", "LinearFit", "LinearTable", "OpCount", "OpsProfile", "Work", "_StageCost", "_hot",
           "_simulate_host_afd", "_stage_cost", "_touched", "_work_time", "compute_dtype", "multi_row_product",
           "prefill_chunk_count", "prefill_micro_batches", "simulate_host"]


def simulate_host(
    plan: Plan,
    spec: ModelSpec,
    hw: HardwareSpec,
    host: HostParams,
    profile: OpsProfile | None,
    *,
    prompt_len: int,
    output_len: int,
    concurrency: int,
) -> Any:
    """SimResult of ``plan`` run by waferline's own engine on the calibrated host (see the module docstring)."""
    from waferline.sim.cost import layer_table
    from waferline.sim.result import SimResult, StageTiming

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
    # the prompt's own tokens: attention over half the prompt on average (not the decode's context, which the output
    # lengthens; as sim/pipeline.py prices a prefill)
    ptable = layer_table(spec, plan.weight_bits, plan.kv_bits, max(1, P // 2), plan.group_size)
    k, tokens_per_cycle, spec_info = host_speculation(plan)  # one cycle is one verify step (drafting included)
    t = k + 1
    plain_over = host.step_overhead_s.get(comp, 0.0)
    step_over = host.spec_step_overhead_s.get(comp, plain_over) if k > 0 else plain_over
    act_bytes = 2.0 if comp == "bf16" else 4.0

    hop = host.hop
    # A hop costs more the longer its receiving process waited (measured on 2-stage pipelines, one process per core).
    # With more stage processes than cores it is still the process's own wait that counts, not a core's share of it:
    # sol-mini one layer per stage (8 processes on 2 cores, one row) measured ~0.67 ms per hop, the hop-vs-idle curve
    # at the process's ~3.9 ms wait, where a core's quarter of it priced 0.32 ms.

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
        # for the timeline: a hop = a stage's time beyond its compute
        hops = [max(0.0, (round_trip - sum(stage_s)) / S)] * S
    for it in range(3):  # a hop costs more the longer its receiver waited: per micro-batch, cycle / M - its own work
        if not chain:
            round_trip = sum(stage_s) + sum(hops)
        cycle = max(round_trip, M * max(cpu), M * sum(cpu) / host.parallel(S) if S > 1 else 0.0)
        if S == 1 or chain or it == 2:
            break
        hops = [hop(nb, max(0.0, cycle / M - cpu[(i + 1) % S])) for i, nb in enumerate(hop_bytes)]
    bound = (
        "round trip (latency)"
        if cycle == round_trip
        else "busiest stage x micro-batches"
        if cycle == M * max(cpu)
        else f"CPU cores ({S} processes on {host.cores} cores)"
    )
    rate = tokens_per_cycle / cycle
    # ---- TTFT: every row's first token (prefill)
    if S == 1:
        pc = profile.prefill(1, P)
        one = _stage_cost(
            host, plan, spec, ptable, list(plan.stages[0].layers), pc, 1, P, True, 1, True, 0.0, prefill=True
        )
        ttft = B * (one.total + host.prefill.get(comp, (0, 0, 0.0))[2]) + plain_over
        prefill_cpu = [ttft]
    else:
        ttft, prefill_cpu = _pipeline_prefill(plan, spec, host, profile, ptable, P, B, plain_over, per_step, act_bytes)
    timings = [
        StageTiming(
            index=s.index,
            role=s.role,
            layers=f"{s.layers[0]}-{s.layers[-1]}" if len(s.layers) > 1 else str(s.layers[0]),
            devices=s.num_devices,
            compute=c.linear_s,
            memory=c.cache_s,
            fixed=c.ops_s + c.extra_s,
            comm=0.0,
            hop=h,
            total=c.total + h,
        )
        for s, c, h in zip(plan.stages, costs, hops)
    ]
    spec_info["host"] = {
        "micro_batch_rows": b,
        "tokens_per_row_per_step": t,
        "cycle_s": cycle,
        "round_trip_s": round_trip,
        "ops_per_step": sum(w.ops for w in count.layers.values()) + count.other.ops,
        "cpu_per_stage_s": cpu,
        "prefill_cpu_per_stage_s": prefill_cpu,  # each process's CPU seconds until the first tokens (TTFT's work)
        "cores": host.cores,
    }
    return SimResult(
        model=plan.model,
        hardware=plan.hardware,
        num_devices=plan.num_devices,
        num_stages=S,
        fits=plan.fits,
        concurrency=B,
        micro_batches=M,
        prompt_len=P,
        output_len=O,
        step_latency_s=round_trip,
        decode_tokens_per_s_per_user=rate,
        aggregate_tokens_per_s=rate * B,
        ttft_s=ttft,
        prefill_s=ttft,
        end_to_end_s=ttft + (O - 1) / rate,
        bound=bound,
        stages=timings,
        speculative=spec_info,
        problems=list(plan.problems),
    )


def _pipeline_prefill(plan: Plan, spec: ModelSpec, host: HostParams, profile: OpsProfile, table: list[Any], P: int,
                      B: int, plain_over: float, per_step: float, act_bytes: float) -> tuple[float, list[float]]:
    """(seconds, each stage process's CPU seconds) until every one of ``B`` prompts of ``P`` tokens has its first token
    through the pipeline: the prompts packed into micro-batches of PIPELINE_PREFILL_CHUNK tokens as the engine packs
    them (prefill_micro_batches), each chunk priced at its own position (a later chunk's attention layers also score
    the keys before it: prefill_chunk_count), the chunks flowing through the stages with at most M of them in flight
    (stage 0, in the driver, launches the next one when an earlier one's token comes back)."""
    S = plan.num_stages
    M = max(1, plan.micro_batches)
    mbs = prefill_micro_batches(B, P, PIPELINE_PREFILL_CHUNK)
    memo: dict[tuple[int, int, int], list[float]] = {}

    def group_cost(r: int, tok: int, start: int) -> list[float]:  # per stage: one [r, tok] forward at ``start``
        if (r, tok, start) not in memo:
            pc = prefill_chunk_count(profile, spec, r, tok, start, host.small_op_bytes,
                                     4.0 if compute_dtype(plan) == "fp32" else 2.0)  # (the cache's element bytes)
            ends = start + tok >= P  # (the LM head runs on the piece that ends its prompts, as the engine runs it)
            costs = [_stage_cost(host, plan, spec, table, list(s.layers), pc, r, tok, s.has_lm_head and ends, r,
                                 s.has_lm_head, 0.0, prefill=True).total for s in plan.stages]
            memo[(r, tok, start)] = costs
        return memo[(r, tok, start)]

    # a stage process's prefill chunk costs the per-step CPU its decode steps do (receive, send, wake); not the
    # inflation of its compute, measured with every stage busy at once; stage 0 adds the scheduler's step
    cost = []
    for mb in mbs:
        c = [per_step + (plain_over if i == 0 else 0.0) for i in range(S)]
        for g in mb:
            c = [a + b for a, b in zip(c, group_cost(*g))]
        cost.append(c)
    nbytes = [[sum(r * tok for r, tok, _ in mb) * spec.hidden_size * act_bytes if i + 1 < S
               else 8.0 * sum(r for r, _, _ in mb) for i in range(S)] for mb in mbs]
    end: list[list[float]] = []  # [micro-batch][stage] finish times
    back: list[float] = []  # its first tokens back at stage 0
    for j, c in enumerate(cost):
        t0 = max(end[j - 1][0] if j else 0.0, back[j - M] if j >= M else 0.0)
        row = [t0 + c[0]]
        for i in range(1, S):
            # the hop's receiver waited since its previous chunk (before the first: for the stages ahead of it)
            free = end[j - 1][i] if j else 0.0
            arrive = row[i - 1] + host.hop(nbytes[j][i - 1], max(0.0, row[i - 1] - free))
            row.append(max(arrive, free) + c[i])
        end.append(row)
        # stage 0 waits for it since it launched it (approximately: it may launch others meanwhile)
        back.append(row[-1] + host.hop(nbytes[j][-1], max(0.0, row[-1] - row[0])))
    return back[-1], [sum(c[i] for c in cost) for i in range(S)]
