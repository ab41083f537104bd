"""``simulate --explain``: what one user's decode token is spent on, and what would have to change to reach a target
rate. Arithmetic on a SimResult only: the same terms the simulator added up, regrouped."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from waferline.sim.cost import expected_tokens_per_step

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from waferline.sim.result import SimResult

# term -> what it is and where its numbers come from
TERMS: dict[str, str] = {
    "weights and cache read": "bytes / (peak bandwidth x fitted bw_eff <= 1): datasheet bandwidth",
    "compute": "FLOPs / (peak FLOP/s x flops_eff <= 1), where it exceeds the read time",
    "fixed per layer": "fitted per-layer latency (launches, synchronisation) + MoE routing constant",
    "mesh streaming": "activation vectors (from the layer's shapes) at the mesh's per-link bandwidth x fitted links",
    "mesh distance": "the layer's region crossed per phase, one clock cycle a hop (smaller regions: fewer hops)",
    "collectives": "all-reduce / exchange inside a stage (link bandwidth and latency)",
    "device hops": "activations between stages (link latency, fitted where the class has data)",
    # attention/FFN disaggregation: the two sides run at once, each side's ranks in parallel
    "attention side": "an attention rank's busy time: its layers' reads, compute and fixed latency, and the LM head",
    "FFN side": "an FFN rank's busy time: its experts' reads, compute and fixed latency",
    "attention-FFN transfers": "hidden states to the FFN ranks and back (link bandwidth and latency)",
}


def _afd_sides(r: SimResult) -> dict[str, float] | None:
    """An attention/FFN-disaggregated result's sides, each counted once (every attention rank carries its side's
    totals, every FFN rank its own: the busiest one's); None for any other result."""
    if not r.sides_overlap:
        return None
    a = next((s for s in r.stages if s.role == "attention"), None)
    ffn = max((s.total for s in r.stages if s.role == "ffn"), default=0.0)
    return {"attention side": a.total if a else 0.0, "FFN side": ffn, "attention-FFN transfers": a.hop if a else 0.0}


def _solve_accept(need: float, k: int) -> float | None:
    """The per-token acceptance at which k drafts yield ``need`` tokens per step (None: not reachable with k)."""
    if need <= 1.0:
        return 0.0
    if need >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_step(mid, k) < need:
            lo = mid
        else:
            hi = mid
    return hi


def _read_lever(r: SimResult, cut: float, tokens: int) -> tuple[float, float] | None:
    """(read time after, factor) for reading every stage's bytes that many times faster so that the step falls by
    ``cut``; None when no factor does it. A stage's reads hide its compute (a layer costs the larger of the two), so
    they can only shorten the step down to that compute: ``tokens`` (k+1 when a verify step checks k drafts) times
    the one-token compute."""
    pairs = [(m, c * tokens) for s in r.stages for c, m in _ops(s)]
    f = _roofline_factor(pairs, cut)
    return (sum(m for m, _ in pairs) / f, f) if f is not None else None


def _compute_lever(r: SimResult, cut: float, tokens: int = 1) -> tuple[float, float] | None:
    """(one-token compute beyond the reads after, factor) for every stage's FLOPs that many times faster so that a
    step of ``tokens`` tokens (k+1 when a verify step checks k drafts: k+1 times the one-token compute) falls by
    ``cut``; None when no factor does it. The factor divides the whole FLOP time, not only the part beyond the reads:
    a stage's compute shortens the step only down to its reads."""
    f = _roofline_factor([(c * tokens, m) for s in r.stages for c, m in _ops(s)], cut)
    return (_compute_after(r, f), f) if f is not None else None


def _compute_after(r: SimResult, f: float) -> float:
    """The one-token compute beyond the reads with every FLOP ``f`` times faster (op by op, as the simulator adds
    it)."""
    return sum(max(0.0, c / f - m) for s in r.stages for c, m in _ops(s))


def _ops(s: Any) -> list[tuple[float, float]]:
    """A stage's (compute, memory) op by op (each layer, the LM head: the simulator takes the larger of each), or its
    sums where the result does not carry them. A faster term saves only in the ops it binds: the stage's sums would say
    FLOPs that outlast the reads in some layers cannot shorten a stage whose reads, summed, are the longer."""
    return getattr(s, "ops", None) or [(s.compute, s.memory)]


def _roofline_factor(pairs: list[tuple[float, float]], cut: float) -> float | None:
    """The factor the first of each (shrinking, staying) pair has to shrink by for the sum of the pairs' maxima to
    fall by ``cut`` (None when removing it is not enough)."""

    def gain(f: float) -> float:
        return sum(max(x, y) - max(y, x / f) for x, y in pairs)

    if gain(math.inf) <= cut * (1 + 1e-9):
        return None
    return _least_factor(lambda f: gain(f) < cut)


def _least_factor(short: Callable[[float], bool]) -> float:
    """The least factor f >= 1 that is not ``short`` (``short`` true below it, false above): doubled until past it,
    then halved to a relative 1e-12."""
    lo, hi = 1.0, 2.0
    while short(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        if short(mid):
            lo = mid
        else:
            hi = mid
    return hi


def _beyond_reads(s: Any) -> float:
    """A stage's compute beyond its reads as the simulator added it up: each layer costs the larger of its two, so a
    layer whose FLOPs outlast its reads adds the difference even where the stage's reads, summed, are the longer."""
    left = s.total - s.hop - s.fixed - s.comm - s.fabric - s.memory
    return left if left > 1e-9 * s.total else 0.0  # (a rounding residue of the subtraction is no term)


def _stage_terms(s: Any) -> dict[str, float]:
    """One stage's share of each term (as ``explain`` sums them), hop included."""
    return {"compute": _beyond_reads(s), "fixed per layer": s.fixed,
            "mesh streaming": s.fabric - s.fabric_distance, "mesh distance": s.fabric_distance,
            "collectives": s.comm, "device hops": s.hop}


def _interval(r: SimResult, term: str, f: float) -> float:
    """Seconds between a user's tokens (without speculation) with ``term`` ``f`` times shorter in every stage: the
    larger of one step through every stage and hop and the slowest stage's time on every micro-batch (sim.pipeline:
    those a sequence smaller on the timings of theirs)."""
    def step(stages: list[Any]) -> tuple[float, float]:
        total = slowest = 0.0
        for s in stages:
            t, hop = s.total - s.hop, s.hop
            if term == "weights and cache read":  # (a stage's reads hide its compute: it shortens down to that)
                t -= sum(max(m, c) - max(c, m / f) for c, m in _ops(s))
            elif term == "compute":  # (all of its FLOPs faster; it shortens down to its reads)
                t -= sum(max(m, c) - max(m, c / f) for c, m in _ops(s))
            elif term == "device hops":
                hop /= f
            else:
                t -= _stage_terms(s)[term] * (1.0 - 1.0 / f)
            total += t + hop
            slowest = max(slowest, t)
        return total, slowest

    total, slowest = step(r.stages)
    full = r.micro_batches if r.full_micro_batches is None else r.full_micro_batches
    rest = (r.micro_batches - full) * step(r.smaller_stages)[1] if r.smaller_stages else 0.0
    return max(total, full * slowest + rest)


def _exact_factor(r: SimResult, term: str, need: float) -> float | None:
    """The factor ``term`` has to shrink by for the interval between a user's tokens to fall to ``need`` (None when
    removing it is not enough)."""
    if _interval(r, term, math.inf) > need * (1 + 1e-9):
        return None
    return _least_factor(lambda f: _interval(r, term, f) > need)


def _resimulated_factor(rate_with: Callable[[str, float], float], term: str, target: float) -> float | None:
    """The factor ``term`` has to shrink by for the re-simulated rate to reach ``target`` (None when removing it is
    not enough)."""
    if rate_with(term, math.inf) < target * (1 - 1e-9):
        return None
    return _least_factor(lambda f: rate_with(term, f) < target)


def explain(r: SimResult, target_tokens_per_s: float | None = None,
            mtp_step_s: float | None = None, rate_with: Callable[[str, float], float] | None = None) -> dict[str, Any]:
    """The per-token breakdown of ``r`` (one user; the step at concurrency 1 of the plan) and, for a target rate, what
    each term (alone) or speculative decoding would have to reach. ``mtp_step_s``: for a result without speculation,
    the simulated seconds of one MTP step of the same plan (k=3 drafts and the verify of k+1 tokens, at the default
    acceptance: the first draft pass runs over the tokens a verify emits, so the step moves with it, by ~0.1% where
    checked), which the speculation lever is sized with; without it the lever assumes a free
    drafter and a verify step as cheap as a one-token step. ``rate_with(term, f)``: the plan re-simulated with
    ``term`` f times shorter in every step (``SimParams.sped_up``), which sizes the levers under speculation exactly
    (a verify step of k+1 tokens and the drafter's steps do not split as the one-token step does)."""
    st = r.stages
    sides = _afd_sides(r)
    parts = sides if sides is not None else {
        "weights and cache read": sum(s.memory for s in st),
        "compute": sum(_beyond_reads(s) for s in st),
        "fixed per layer": sum(s.fixed for s in st),
        "mesh streaming": sum(s.fabric - s.fabric_distance for s in st),
        "mesh distance": sum(s.fabric_distance for s in st),
        "collectives": sum(s.comm for s in st),
        "device hops": sum(s.hop for s in st),
    }
    # the stages' totals, regrouped (a layer's roofline split into read + extra compute); under AFD the sides overlap
    # (per layer the slower side or the round trip), so the step is the simulated one and the sides add to more
    step = r.step_latency_s if sides is not None else sum(parts.values())
    rate = r.decode_tokens_per_s_per_user
    sp = r.speculative or {}
    tokens_per_step = float(sp.get("expected_tokens_per_step", 1.0))
    spec_step = tokens_per_step / rate if sp.get("method", "none") != "none" and rate > 0 else step
    out: dict[str, Any] = {
        "step_s": step,
        "overlapped": sides is not None,
        "tokens_per_step": tokens_per_step,
        "decode_tokens_per_s_per_user": rate,
        "micro_batches": r.micro_batches,
        "terms": [{"term": k, "seconds_per_step": v, "share": v / step if step else 0.0, "basis": TERMS[k]}
                  for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v > 0],
        "dominant": max(parts, key=lambda k: parts[k]) if step else None,
    }
    if target_tokens_per_s is None:
        return out
    if target_tokens_per_s <= 0:
        raise ValueError("the target rate must be > 0")
    tgt: dict[str, Any] = {"tokens_per_s": target_tokens_per_s, "met": rate >= target_tokens_per_s}
    # without changing speculation: the one-token step has to shrink to tokens_per_step / target (per-step overhead
    # of drafting scaled with it)
    need_step = step * rate / target_tokens_per_s
    cut = step - need_step
    tgt["step_needed_s"] = need_step
    levers = []
    if cut > 0 and sides is not None:  # overlapped sides: each one has to fit in the step
        # (the transfers count every micro-batch's, which overlap one another: one micro-batch's round trip, its
        # share, is what has to fit)
        room = {k: need_step * (max(1, r.micro_batches) if k == "attention-FFN transfers" else 1) for k in parts}
        levers = [{"term": k, "from_s": v, "to_s": room[k], "factor": v / room[k]}
                  for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v > room[k]]
    elif cut > 0:
        verified = int(sp.get("num_tokens") or 0) + 1 if sp.get("method", "none") != "none" else 1
        for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
            if v <= 0:
                continue
            if k == "weights and cache read":  # (faster reads leave the compute they hid: the step stops there)
                read = _read_lever(r, cut, verified)
                levers.append({"term": k, "from_s": v, "to_s": read[0] if read else None,
                               "factor": read[1] if read else None,
                               "floor_s": sum(min(m, c * verified) for s in st for c, m in _ops(s))})
            elif k == "compute":  # (the factor is of the FLOP time: the part beyond the reads falls faster; a
                # verify step's k+1 tokens have k+1 times the FLOPs, sized on the speculative step itself)
                comp = _compute_lever(r, cut, 1) if verified == 1 else \
                    _compute_lever(r, spec_step - tokens_per_step / target_tokens_per_s, verified)
                levers.append({"term": k, "from_s": v, "to_s": comp[0] if comp else None,
                               "factor": comp[1] if comp else None, "flops_s": sum(s.compute for s in st)})
            elif v > cut:
                levers.append({"term": k, "from_s": v, "to_s": v - cut, "factor": v / (v - cut)})
            else:
                levers.append({"term": k, "from_s": v, "to_s": None, "factor": None})
    if levers and sides is None and sp.get("method", "none") == "none":
        # the rate is 1 / max(step, slowest stage x micro-batches): a lever sized on the step alone may leave the
        # pipeline bound short of the target (or the step may not be what binds): size it on the simulated interval
        tgt["interval_s"] = _interval(r, "device hops", 1.0)
        tgt["interval_needed_s"] = 1.0 / target_tokens_per_s
        for lv in levers:
            f = _exact_factor(r, lv["term"], 1.0 / target_tokens_per_s)
            lv["factor"], lv["to_s"] = f, (lv["from_s"] / f if f is not None else None)
            if lv["term"] == "compute" and f is not None:  # (what is left beyond the reads)
                lv["to_s"] = _compute_after(r, f)
    resimulated = bool(levers) and sides is None and sp.get("method", "none") != "none" and rate_with is not None
    if resimulated:
        for lv in levers:
            f = _resimulated_factor(rate_with, lv["term"], target_tokens_per_s)  # type: ignore[arg-type]
            lv["factor"], lv["to_s"] = f, (lv["from_s"] / f if f is not None else None)
            if lv["term"] == "compute" and f is not None:
                lv["to_s"] = _compute_after(r, f)
            lv.pop("floor_s", None)  # (the one-token step's floor does not bound a verify step)
    tgt["levers"] = levers
    tgt["levers_note"] = ("with speculation each factor is sized by re-simulating the speculative step (the drafter's "
                          "steps and the verify of k+1 tokens) with that term shorter; the us figures are the "
                          "one-token step's" if resimulated else
                          "with speculation these are approximate (off by up to ~12% where checked): sized on the "
                          "one-token step's terms, while a verify step of k+1 tokens and the drafter's own steps do "
                          "not split alike; re-simulate the changed hardware to check"
                          if sp.get("method", "none") != "none" and levers else
                          "each side within the step is needed, not enough: per layer a round trip (attention, the "
                          "transfers and the FFN in turn) can bind instead; re-simulate the changed hardware to check"
                          if sides is not None and levers else None)
    # when no term alone suffices: the cut shared by every term in proportion
    alone = any(lv["to_s"] is not None for lv in levers)
    tgt["together"] = {"cut_s": cut, "fraction": cut / step} if cut > 0 and not alone and sides is None else None
    # speculative decoding: tokens each step must yield at the current step cost
    k = int(sp.get("num_tokens") or 3)
    speculating = sp.get("method", "none") != "none"
    if not speculating and mtp_step_s is not None:
        spec_step = mtp_step_s
    need_tokens = target_tokens_per_s * spec_step
    tgt["speculative"] = {"method": sp.get("method", "none") if sp.get("method", "none") != "none" else "mtp",
                          "num_tokens": k, "tokens_per_step_needed": need_tokens,
                          "accept_rate_needed": _solve_accept(need_tokens, k),
                          "assumes": "the current speculative step cost" if speculating
                          else "the simulated MTP step cost" if mtp_step_s is not None
                          else "a free drafter (MTP-like) and a verify step as cheap as a one-token step"}
    out["target"] = tgt
    return out


def render(con: Console, ex: dict[str, Any]) -> None:
    """The explanation as text (what ``--explain`` prints after the tables)."""
    from rich.table import Table

    per = f"; {ex['tokens_per_step']:.2f} tokens per verify step with speculation" if ex["tokens_per_step"] > 1 else ""
    over = ("; the attention and FFN sides overlap, so their shares add to more than 100%"
            if sum(row["share"] for row in ex["terms"]) > 1 + 1e-9 else
            "; a layer's round trip (attention, the transfers and the FFN in turn) binds the step, so the sides' "
            "shares add to at most 100%") if ex.get("overlapped") else ""
    t = Table(title=f"where one decode step goes ({ex['step_s'] * 1e6:.0f} us without speculation{per}{over})")
    for c in ("term", "us per step", "share", "basis"):
        t.add_column(c, justify="right" if c in ("us per step", "share") else "left")
    for row in ex["terms"]:
        t.add_row(row["term"], f"{row['seconds_per_step'] * 1e6:.1f}", f"{row['share']:.0%}", row["basis"])
    con.print(t)
    tgt = ex.get("target")
    if not tgt:
        return
    if tgt["met"]:
        con.print(f"target {tgt['tokens_per_s']:g} tok/s per user: met ({ex['decode_tokens_per_s_per_user']:.0f})")
        return
    which = "Each side's busy time within it:" if ex.get("overlapped") else "Any one of:"
    if tgt.get("interval_s", 0.0) > ex["step_s"] * (1 + 1e-9):  # (the slowest stage x micro-batches binds)
        con.print(f"target {tgt['tokens_per_s']:g} tok/s per user: the time between a user's tokens (the slowest "
                  f"stage x {ex['micro_batches']} micro-batches) must fall to {tgt['interval_needed_s'] * 1e6:.0f} us "
                  f"(now {tgt['interval_s'] * 1e6:.0f} us). {which}")
    else:
        con.print(f"target {tgt['tokens_per_s']:g} tok/s per user: the step must fall to "
                  f"{tgt['step_needed_s'] * 1e6:.0f} us (now {ex['step_s'] * 1e6:.0f} us). {which}")
    if ex.get("overlapped") and not tgt["levers"]:
        con.print("  - neither side is busy that long: the round trips between them bound the step (a layer's "
                  "attention, transfers and FFN in turn; more micro-batches in flight raise the aggregate rate, not "
                  "a user's)")
    tog = tgt.get("together")
    if tog:
        con.print(f"  - no one term is enough alone: every term {tog['fraction']:.0%} shorter "
                  f"({tog['cut_s'] * 1e6:.0f} us in all)")
    for lv in tgt["levers"]:
        if lv["to_s"] is None and "floor_s" in lv:
            con.print(f"  - {lv['term']}: not enough alone ({lv['from_s'] * 1e6:.0f} us; faster reads save at most "
                      f"{(lv['from_s'] - lv['floor_s']) * 1e6:.0f} us: the compute they overlap stays)")
        elif lv["to_s"] is None:
            con.print(f"  - {lv['term']}: removing it entirely is not enough ({lv['from_s'] * 1e6:.0f} us)")
        elif "flops_s" in lv:
            con.print(f"  - {lv['term']}: {lv['from_s'] * 1e6:.0f} -> {lv['to_s'] * 1e6:.0f} us beyond the reads "
                      f"(the FLOPs {lv['factor']:.2f}x faster: {lv['flops_s'] * 1e6:.0f} -> "
                      f"{lv['flops_s'] / lv['factor'] * 1e6:.0f} us)")
        else:
            per = (f", one micro-batch's of {ex['micro_batches']} within the step: they overlap"
                   if ex.get("overlapped") and lv["term"] == "attention-FFN transfers" and ex["micro_batches"] > 1
                   else "")
            con.print(f"  - {lv['term']}: {lv['from_s'] * 1e6:.0f} -> {lv['to_s'] * 1e6:.0f} us "
                      f"({lv['factor']:.2f}x less{per})")
    if tgt.get("levers_note"):
        con.print(f"  note: {tgt['levers_note']}")
    s = tgt["speculative"]
    a = s["accept_rate_needed"]
    how = (f"acceptance >= {a:.2f}" if a is not None else f"more than {s['num_tokens']} drafts (k+1 tokens a step "
           f"is the most k drafts give)")
    con.print(f"  - or speculation ({s['method']}, k={s['num_tokens']}): {s['tokens_per_step_needed']:.2f} tokens per "
              f"step, i.e. {how} ({s['assumes']})")
