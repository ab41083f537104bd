"""Request-level serving simulation: Poisson arrivals, continuous batching within the memory budget, latency
distributions."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

from waferline.errors import ConfigError
from waferline.plan.plan import Plan
from waferline.sim.cost import SimParams, load_params


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
    mean_batch: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def simulate_serving(plan: Plan, *, arrival_rate: float, num_requests: int = 200, prompt_len: int | None = None,
                     output_len: int | None = None, max_batch: int | None = None, seed: int = 0,
                     params: SimParams | None = None) -> ServingResult:
    """Serve ``num_requests`` Poisson arrivals at ``arrival_rate``/s with continuous batching.

    Prefills run one request at a time and pause decoding (no mixing of prefill chunks into decode steps); each
    decode step advances every running request by one token at the per-user rate the pipeline model gives for the
    current batch (speculative decoding included).
    """
    from waferline.plan.place import batch_capacity
    from waferline.sim.pipeline import simulate
    from waferline.spec.catalog import load_hardware, load_model

    if arrival_rate <= 0 or num_requests < 1:
        raise ConfigError(f"arrival rate must be > 0 and requests >= 1 (got {arrival_rate}, {num_requests})")
    params = params or load_params()
    spec = load_model(plan.model)
    hw = load_hardware(plan.hardware)
    P = prompt_len or params.default_prompt_len
    O = output_len or params.default_output_len
    cap = max_batch or batch_capacity(plan, spec, P + O)
    if cap < 1:
        raise ConfigError(
            f"not even one sequence of {P + O} tokens fits next to the weights; plan more devices or a shorter context"
        )
    rates: dict[int, float] = {}

    def per_user_rate(b: int) -> float:
        if b not in rates:
            rates[b] = simulate(plan, prompt_len=P, output_len=O, concurrency=b, params=params, spec=spec,
                                hardware=hw).decode_tokens_per_s_per_user
        return rates[b]

    prefill = simulate(plan, prompt_len=P, output_len=1, concurrency=1, params=params, spec=spec, hardware=hw).prefill_s
    rng = random.Random(seed)
    arrivals, t_arr = [], 0.0
    for _ in range(num_requests):
        t_arr += rng.expovariate(arrival_rate)
        arrivals.append(t_arr)
    t = 0.0
    nxt = 0
    running: list[list[float]] = []  # [arrival, first_token_time, tokens_done, last_token_time]
    ttft, itl, e2e = [], [], []
    batch_time = 0.0
    while nxt < num_requests or running:
        if not running and nxt < num_requests and arrivals[nxt] > t:
            t = arrivals[nxt]
        while nxt < num_requests and arrivals[nxt] <= t and len(running) < cap:
            t += prefill
            running.append([arrivals[nxt], t, 1.0, t])
            ttft.append(t - arrivals[nxt] + params.ttft_overhead_s)
            nxt += 1
        if not running:
            continue
        dt = 1.0 / per_user_rate(len(running))
        t += dt
        batch_time += dt * len(running)
        done = []
        for r in running:
            itl.append(t - r[3])
            r[3] = t
            r[2] += 1
            if r[2] >= O:
                done.append(r)
        for r in done:
            e2e.append(t - r[0] + params.ttft_overhead_s)
            running.remove(r)
    duration = t - (arrivals[0] if arrivals else 0.0)
    return ServingResult(requests=num_requests, arrival_rate=arrival_rate, max_batch=cap, duration_s=duration,
                         output_tokens_per_s=num_requests * O / duration if duration > 0 else 0.0,
                         ttft_p50_s=_pct(ttft, 0.5), ttft_p90_s=_pct(ttft, 0.9), ttft_p99_s=_pct(ttft, 0.99),
                         itl_p50_s=_pct(itl, 0.5), itl_p99_s=_pct(itl, 0.99), e2e_p50_s=_pct(e2e, 0.5),
                         e2e_p99_s=_pct(e2e, 0.99), mean_batch=batch_time / duration if duration > 0 else 0.0)
