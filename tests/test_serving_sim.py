"""Request-level serving simulation: streaming quantiles, the event-driven loop against a per-token reference, the
work and memory of 100k requests, chunked prefill, prefill/decode disaggregation, MoE expert skew, input errors."""

import bisect
import itertools
import json
import math
import random
import subprocess
import sys

import pytest

from waferline.errors import ConfigError
from waferline.plan.place import batch_capacity, place
from waferline.sim.cost import load_params
from waferline.sim.pipeline import simulate
from waferline.sim.serving import (
    DEFAULT_TOKEN_BUDGET,
    SKETCH_REL_ERROR,
    QuantileSketch,
    _Pricer,
    expert_load_factor,
    expert_ranks,
    simulate_serving,
)
from waferline.spec.catalog import load_hardware, load_model

QS = (0.01, 0.1, 0.5, 0.9, 0.99, 0.999)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def test_quantile_sketch_is_within_its_relative_error_of_exact_percentiles():
    rng = random.Random(7)
    for xs in ([rng.lognormvariate(-5.0, 1.5) for _ in range(20000)],  # latencies over decades
               [0.2 + rng.expovariate(50.0) for _ in range(5000)],  # TTFT-like: overhead plus a queueing tail
               [0.0025] * 900 + [0.03] * 100):  # ITL-like: two values
        sk = QuantileSketch()
        for x in xs:
            sk.add(x)
        for q in QS:
            exact = _pct(xs, q)
            assert sk.quantile(q) == pytest.approx(exact, rel=SKETCH_REL_ERROR * 1.0001), (q, exact)
        assert sk.mean == pytest.approx(sum(xs) / len(xs), rel=1e-9)
    # a weight is that many equal values; an empty sketch answers 0
    a, b = QuantileSketch(), QuantileSketch()
    for x, w in ((0.001, 3), (0.01, 5), (0.1, 2)):
        a.add(x, w)
        for _ in range(w):
            b.add(x)
    assert [a.quantile(q) for q in QS] == [b.quantile(q) for q in QS]
    assert QuantileSketch().quantile(0.5) == 0.0
    tight = QuantileSketch(rel_error=0.001)
    for x in (1.0, 2.0, 3.0):
        tight.add(x)
    assert tight.quantile(0.5) == pytest.approx(2.0, rel=0.001)


def test_quantile_sketch_holds_its_error_past_a_million_seconds():
    # an overloaded queue's TTFT passes the sketch's initial range (1e6 s): its percentiles keep their relative error
    xs = [1e4 * i for i in range(1, 1001)]  # 10^4 .. 10^7 s
    sk = QuantileSketch()
    for x in xs:
        sk.add(x)
    for q in QS:
        assert sk.quantile(q) == pytest.approx(_pct(xs, q), rel=SKETCH_REL_ERROR * 1.0001), q


def _per_token_reference(plan, rate: float, n: int, P: int, O: int, seed: int) -> dict[str, list[float]]:
    """The straightforward loop: stop-the-world prefill, every running request visited every decode step."""
    params, spec, hw = load_params(), load_model(plan.model), load_hardware(plan.hardware)
    cap = batch_capacity(plan, spec, P + O)
    rates: dict[int, float] = {}

    def per_user(b: int) -> float:
        if b not in rates:
            rates[b] = simulate(plan, prompt_len=P, output_len=O, concurrency=b, params=params, spec=spec,
                                hardware=hw).decode_tokens_per_s_per_user
        return rates[b]

    prefill = simulate(plan, prompt_len=P, output_len=1, concurrency=1, params=params, spec=spec, hardware=hw).prefill_s
    rng = random.Random(seed)
    arrivals, ta = [], 0.0
    for _ in range(n):
        ta += rng.expovariate(rate)
        arrivals.append(ta)
    t, nxt, running = 0.0, 0, []
    ttft, itl, e2e = [], [], []
    ovh = params.ttft_overhead_s
    while nxt < n or running:
        if not running and nxt < n and arrivals[nxt] > t:
            t = arrivals[nxt]
        while nxt < n and arrivals[nxt] <= t and len(running) < cap:
            t += prefill
            running.append([arrivals[nxt], 1, t])
            ttft.append(t - arrivals[nxt] + ovh)
            nxt += 1
        t += 1.0 / per_user(len(running))
        for r in running:
            itl.append(t - r[2])
            r[2] = t
            r[1] += 1
        for r in [r for r in running if r[1] >= O]:
            e2e.append(t - r[0] + ovh)
            running.remove(r)
    return {"ttft": ttft, "itl": itl, "e2e": e2e, "duration": [t - arrivals[0]]}


@pytest.mark.parametrize("rate", [0.5, 50.0])
def test_event_loop_matches_the_per_token_reference(rate):
    """Jumping over stretches of identical decode steps and streaming the latencies loses nothing beyond the
    sketch's error: percentiles within 1 % of the exact ones of the per-token loop (light load and queueing)."""
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=1024)
    ref = _per_token_reference(plan, rate, 300, 512, 128, seed=3)
    r = simulate_serving(plan, arrival_rate=rate, num_requests=300, prompt_len=512, output_len=128, seed=3,
                         max_num_batched_tokens=0)
    assert r.prefill_mode == "stop-the-world"
    assert r.duration_s == pytest.approx(ref["duration"][0], rel=1e-9)
    for key, got in (("ttft", (r.ttft_p50_s, r.ttft_p90_s, r.ttft_p99_s)),
                     ("itl", (r.itl_p50_s, r.itl_p90_s, r.itl_p99_s)),
                     ("e2e", (r.e2e_p50_s, r.e2e_p90_s, r.e2e_p99_s))):
        for q, v in zip((0.5, 0.9, 0.99), got):
            assert v == pytest.approx(_pct(ref[key], q), rel=0.01), (key, q)
    assert r.itl_mean_s == pytest.approx(sum(ref["itl"]) / len(ref["itl"]), rel=1e-6)


def test_100k_requests_price_steps_by_events_and_take_little_memory():
    """The documented 80-wafer serving example at 100k requests (the per-token loop took ~20 s and ~2.5 GB): the loop
    prices a stretch of identical decode steps at once, so its work grows with the requests (~5 priced steps each),
    not with the ~10M decode steps it simulates; and it keeps no per-token samples."""
    code = (
        "import json, resource\n"
        "from waferline.plan.place import place\n"
        "from waferline.plan.plan import SpeculativeConfig\n"
        "from waferline.sim.serving import _Pricer, simulate_serving\n"
        "priced = [0]\n"
        "def counted(real):\n"
        "    def spy(self, n):\n"
        "        priced[0] += 1\n"
        "        return real(self, n)\n"
        "    return spy\n"
        "_Pricer.decode_step, _Pricer.chunk = counted(_Pricer.decode_step), counted(_Pricer.chunk)\n"
        "plan = place('gpt-5.6-sol', 'wse-3', weight_bits=4, devices=80, speculative=SpeculativeConfig('mtp'))\n"
        "r = simulate_serving(plan, arrival_rate=10, num_requests=100_000)\n"
        # peak RSS of this process's own address space (VmHWM): ru_maxrss would carry over the high-water mark of
        # the test process it was forked from
        "try:\n"
        "    rss = [int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM:')][0] / 1024\n"
        "except OSError:\n"
        "    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
        "print(json.dumps({'priced': priced[0], 'rss_mb': rss, 'r': r.to_dict()}))\n"
    )
    out = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                    text=True).stdout)
    # (not timed: a step-by-step loop prices each of the ~10M steps, the event loop ~5 per request)
    assert out["r"]["steps"] > 50 * out["r"]["requests"], out["r"]["steps"]
    assert out["priced"] < 10 * out["r"]["requests"], out["priced"]
    assert out["rss_mb"] < 1024, out["rss_mb"]  # ~100 MB, most of it the interpreter and imports
    r = out["r"]
    assert r["requests"] == 100_000 and r["prefill_mode"] == "chunked"
    assert r["output_tokens_per_s"] == pytest.approx(10 * load_params().default_output_len, rel=0.02)
    assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] < 1.0 and 0 < r["itl_p50_s"] <= r["itl_p99_s"]


def test_chunked_prefill_lowers_ttft_and_itl_tails_under_load():
    """70B on 4 wafers at 20 req/s: stop-the-world prefills one prompt at a time with decode paused, so prompts
    queue behind each other and decoding stalls; chunked prefill packs prompt chunks into the decode steps, streaming
    them through the pipeline's stages back to back."""
    plan = place("llama-3.1-70b", "wse-3", devices=4)
    kw = dict(arrival_rate=20.0, num_requests=400, prompt_len=1000, output_len=200, seed=1)
    stw = simulate_serving(plan, max_num_batched_tokens=0, **kw)
    chunked = simulate_serving(plan, max_num_batched_tokens=512, **kw)
    assert chunked.prefill_mode == "chunked" and chunked.max_num_batched_tokens == 512
    assert chunked.ttft_p99_s < 0.7 * stw.ttft_p99_s
    assert chunked.itl_p99_s < 0.2 * stw.itl_p99_s
    # chunked keeps up with the offered load (20 req/s x 200 tokens); pausing decode for every prompt costs throughput
    assert chunked.output_tokens_per_s == pytest.approx(20.0 * 200, rel=0.05)
    assert chunked.output_tokens_per_s >= stw.output_tokens_per_s
    # a GPU with short prompts: a 64-token prefill alone reads all the weights like a decode step; batched into one
    # step's budget many prompts share one read
    gpu = place("llama-3.1-8b", "h100-sxm", devices=1, context=1024)
    kw = dict(arrival_rate=300.0, num_requests=600, prompt_len=64, output_len=128, seed=1)
    stw = simulate_serving(gpu, max_num_batched_tokens=0, **kw)
    chunked = simulate_serving(gpu, **kw)
    assert chunked.ttft_p99_s < 0.5 * stw.ttft_p99_s
    assert chunked.output_tokens_per_s > 1.2 * stw.output_tokens_per_s
    # decode steps without prompt chunks are the pipeline model's decode steps: at light load ITL p50 is unchanged
    light = dict(arrival_rate=0.5, num_requests=50, prompt_len=512, output_len=128, seed=1)
    assert simulate_serving(gpu, **light).itl_p50_s == pytest.approx(
        simulate_serving(gpu, max_num_batched_tokens=0, **light).itl_p50_s, rel=1e-9)


def test_pd_handover_of_an_afd_plan_leaves_from_its_attention_ranks_only():
    """The KV cache of an AFD plan lives on its attention ranks (2 H200s of 14): the handover was priced as if all
    14 devices, FFN ranks included, sent a share of it."""
    from waferline.sim.cost import hop_time

    plan = place("deepseek-v3", "h200-sxm", afd=True, attention_ranks=2, ffn_ranks=3, batch=16, context=1500)
    assert plan.num_devices == 14 and sum(s.num_devices for s in plan.stages if s.role == "attention") == 2
    r = simulate_serving(plan, arrival_rate=2.0, num_requests=20, prompt_len=1000, output_len=500,
                         pd_disaggregation=True)
    hw = load_hardware("h200-sxm")
    kv = load_model("deepseek-v3").cache_bytes_per_seq(1000, 16)
    # (each attention rank is one H200 holding whole caches of its share of the sequences: one device sends it)
    assert r.kv_handover_s == pytest.approx(hop_time(hw, load_params().for_hardware(hw), 0, 8, kv), rel=1e-9)


def test_pd_handover_of_afd_ranks_leaves_from_the_one_attention_rank_a_request_lives_on():
    """The engine's AFD attention ranks are data-parallel: a request's cache lives whole on one of them, so its
    handover does not get faster with more attention ranks (it was priced as shared over all of them: 4x faster on
    4 ranks of one device than on one)."""
    from waferline.sim.cost import hop_time

    kw = dict(arrival_rate=1.0, num_requests=3, prompt_len=2000, output_len=10, pd_disaggregation=True)
    got = {}
    for m in (1, 4):
        plan = place("qwen3-30b-a3b", "h100-sxm", afd=True, attention_ranks=m, ffn_ranks=2, context=2010)
        assert [s.num_devices for s in plan.stages if s.role == "attention"] == [1] * m
        got[m] = simulate_serving(plan, **kw).kv_handover_s
    hw = load_hardware("h100-sxm")
    kv = load_model("qwen3-30b-a3b").cache_bytes_per_seq(2000, 16)
    assert got[4] == pytest.approx(got[1], rel=1e-12)
    assert got[1] == pytest.approx(hop_time(hw, load_params().for_hardware(hw), 0, 8, kv), rel=1e-9)


def test_pd_disaggregation_removes_prefill_from_decode_steps():
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=1024)
    kw = dict(arrival_rate=40.0, num_requests=400, prompt_len=512, output_len=128, seed=1)
    colo = simulate_serving(plan, **kw)
    pd = simulate_serving(plan, pd_disaggregation=True, **kw)
    assert pd.pd_disaggregation and pd.prefill_devices == 1 and not colo.pd_disaggregation
    # the decode pool only decodes: the ITL tail is the decode step, not a step carrying prompt chunks
    assert pd.itl_p99_s < 0.3 * colo.itl_p99_s
    assert pd.e2e_p50_s < colo.e2e_p50_s
    # the handover is the prompt's KV cache over the scale-out link, and it delays the first decoded token
    hw = load_hardware("h100-sxm")
    kv = load_model("llama-3.1-8b").cache_bytes_per_seq(512, plan.kv_bits)
    assert pd.kv_handover_s >= kv / hw.scale_out.bandwidth
    assert pd.kv_handover_s < 0.01
    one = dict(arrival_rate=1.0, num_requests=1, prompt_len=512, output_len=128)  # one value: the sketch is exact
    a = simulate_serving(plan, **one)
    b = simulate_serving(plan, pd_disaggregation=True, **one)
    assert b.ttft_p50_s == pytest.approx(a.ttft_p50_s, rel=1e-9)
    assert b.e2e_p50_s - a.e2e_p50_s == pytest.approx(b.kv_handover_s, rel=1e-6)
    assert (b.itl_mean_s - a.itl_mean_s) * 127 == pytest.approx(b.kv_handover_s, rel=1e-6)  # the 2nd token waits
    # a prefill pool on more devices prefills faster
    big = simulate_serving(plan, prefill_plan=place("llama-3.1-8b", "h100-sxm", devices=4, context=1024), **kw)
    assert big.prefill_devices == 4 and big.ttft_p50_s < pd.ttft_p50_s


def test_expert_skew_slows_compute_bound_steps():
    assert expert_load_factor(128, 8, 0.0) == 1.0 and expert_load_factor(128, 8, 0.0, ranks=4) == 1.0
    fs = [expert_load_factor(128, 8, s) for s in (0.1, 0.3, 0.6, 1.0, 3.0)]  # one rank per expert: the hottest
    assert fs == sorted(fs) and fs[0] > 1.0 and fs[-1] == pytest.approx(128 / 8, rel=1e-3)  # bounded by E / top_k
    moe = place("qwen3-30b-a3b", "h100-sxm", devices=4, context=4200)  # one stage, experts over 4 GPUs
    kw = dict(arrival_rate=5.0, num_requests=200, prompt_len=4000, output_len=128, seed=2)
    base = simulate_serving(moe, **kw)
    assert base.expert_load_factor == 1.0 and base.expert_skew == 0.0 and base.expert_placement == ""
    assert simulate_serving(moe, expert_skew=0.0, **kw).to_dict() == base.to_dict()
    mild = simulate_serving(moe, expert_skew=0.3, **kw)
    hot = simulate_serving(moe, expert_skew=0.6, **kw)
    assert 1.0 < mild.expert_load_factor < hot.expert_load_factor <= 4.0  # the busiest of 4 ranks
    assert hot.expert_load_factor == pytest.approx(expert_load_factor(128, 8, 0.6, ranks=4), rel=1e-12)
    assert "contiguous expert blocks over each stage's 4 devices" in hot.expert_placement
    assert base.ttft_p50_s < mild.ttft_p50_s < hot.ttft_p50_s  # prefill is compute-bound
    assert base.ttft_p99_s < mild.ttft_p99_s < hot.ttft_p99_s
    assert base.e2e_p50_s < hot.e2e_p50_s and base.itl_p99_s < hot.itl_p99_s
    # one GPU holds every expert and does their total work, however it is spread over them
    one = place("qwen3-30b-a3b", "h100-sxm", devices=1, context=4200)
    on_one = simulate_serving(one, expert_skew=0.6, **kw)
    assert on_one.expert_load_factor == 1.0 and "one device" in on_one.expert_placement
    assert on_one.ttft_p50_s == simulate_serving(one, **kw).ttft_p50_s


def _zipf_top_k_counts(E: int, K: int, s: float, tokens: int, seed: int) -> list[int]:
    """Monte-Carlo of Zipf(s) routing: each token draws K distinct experts, each draw by popularity i^-s."""
    cum = list(itertools.accumulate((i + 1) ** -s for i in range(E)))
    rng = random.Random(seed)
    cnt = [0] * E
    for _ in range(tokens):
        chosen: set[int] = set()
        while len(chosen) < K:
            chosen.add(min(E - 1, bisect.bisect_right(cum, rng.random() * cum[-1])))
        for e in chosen:
            cnt[e] += 1
    return cnt


def test_expert_load_factor_is_the_busiest_rank_not_the_hottest_expert():
    """deepseek-v3 (256 routed experts, top 8) expert-parallel over 8 GPUs at Zipf 1.0: a step waits for the GPU whose
    32 experts (contiguous, the most popular first) get the most tokens, ~4.9x the mean GPU's, not for the hottest
    expert's 25x applied to every expert's work (the factor was 32 = E / top_k)."""
    E, K, R, N = 256, 8, 8, 4000
    for s in (0.5, 1.0):
        cnt = _zipf_top_k_counts(E, K, s, N, seed=0)
        busiest_rank = max(sum(cnt[r * E // R:(r + 1) * E // R]) for r in range(R)) / (N * K / R)
        f = expert_load_factor(E, K, s, ranks=R)
        assert f == pytest.approx(busiest_rank, rel=0.15), (s, f, busiest_rank)
        assert expert_load_factor(E, K, s) == pytest.approx(max(cnt) / (N * K / E), rel=0.15)  # one rank per expert
    assert expert_load_factor(E, K, 1.0, ranks=R) < 0.25 * E / K
    for s in (0.3, 1.0, 2.0, 8.0):  # physics: no rank takes more than every token's experts, nor more than all
        fs = [expert_load_factor(E, K, s, ranks=r) for r in (1, 2, 4, 8, 16, 64, 256)]
        assert fs[0] == 1.0 and fs == sorted(fs)
        assert all(f <= min(r, E / K) * (1 + 1e-9) for f, r in zip(fs, (1, 2, 4, 8, 16, 64, 256)))
    # experts that do not split evenly (8 over 3 ranks: 3/3/2): continuous at skew 0, within the bound at any skew
    assert expert_load_factor(8, 2, 1e-6, ranks=3) == pytest.approx(1.0, abs=1e-5)
    assert all(expert_load_factor(8, 2, s, ranks=r) <= min(r, 4) * (1 + 1e-9) for s in (0.5, 5.0, 50.0)
               for r in (3, 5, 7))
    # a very large skew (the rarest experts' popularity underflows): the top_k most popular take every pick
    for s in (400.0, 1000.0, 1e308):
        assert expert_load_factor(128, 8, s) == pytest.approx(128 / 8, rel=1e-9), s
        assert expert_load_factor(E, K, s, ranks=R) == pytest.approx(R, rel=1e-9), s
    # the ranks come from the plan: deepseek-v3 8-bit on one stage of 8 H200s
    ds = place("deepseek-v3", "h200-sxm", weight_bits=8, context=1100)
    assert ds.num_stages == 1 and ds.stages[0].num_devices == 8
    r = simulate_serving(ds, arrival_rate=2.0, num_requests=5, prompt_len=1000, output_len=8, expert_skew=1.0)
    assert r.expert_load_factor == pytest.approx(expert_load_factor(E, K, 1.0, ranks=8), rel=1e-12)
    assert "8 devices" in r.expert_placement and "contiguous" in r.expert_placement
    # on a wafer each expert's weights (and work) stay on their own cores: one rank per expert
    wafer = place("qwen3-30b-a3b", "wse-3", devices=1)
    assert expert_ranks(wafer, load_hardware("wse-3"))[0] is None


@pytest.mark.parametrize("model, hardware, bits, devices", [("gpt-5.6-sol", "wse-3", 4, 80),
                                                             ("llama-3.1-70b", "groq-lpu-v1", 8, 800)])
def test_serving_ttft_never_falls_as_the_prompt_grows_on_a_pipeline(model, hardware, bits, devices):
    """One client on a multi-stage plan: a prompt past one step's 2,048 tokens is prefilled in several chunks, and
    its first token cannot come before its first (larger) chunk has left the last stage. 2,049 tokens used to take
    the 1-token chunk's drain only (gpt-5.6-sol on 80 wafers: 176 ms against 219 ms at 2,048)."""
    plan = place(model, hardware, weight_bits=bits, devices=devices, context=64_100)
    assert plan.num_stages > 1
    params, spec, hw = load_params(), load_model(model), load_hardware(hardware)
    ttft: dict[int, float] = {}
    cap: dict[int, int] = {}  # (the run's regions are laid out for the most sequences it can hold)
    for P in (500, 2048, 2049, 4096, 64_000):
        r = simulate_serving(plan, users=1, num_requests=2, prompt_len=P, output_len=2)
        ttft[P], cap[P] = r.ttft_mean_s - params.ttft_overhead_s, r.max_batch
        # the flow shop by hand: chunk j leaves at max(its step's end + its drain, chunk j-1's exit + its hold)
        pr = _Pricer(plan, spec, hw, params, P, 2, 0.0, layout=cap[P])
        t = ex = 0.0
        for c in [DEFAULT_TOKEN_BUDGET] * (P // DEFAULT_TOKEN_BUDGET) + [P % DEFAULT_TOKEN_BUDGET] * bool(
                P % DEFAULT_TOKEN_BUDGET):
            hold, drain = pr.chunk(c)
            t += hold
            ex = max(ex + hold, t + drain)
        assert ttft[P] == pytest.approx(ex, rel=1e-9), P
    assert list(ttft.values()) == sorted(ttft.values()), ttft
    pr = _Pricer(plan, spec, hw, params, 2049, 2, 0.0, layout=cap[2049])
    (h, d), (h1, d1) = pr.chunk(2048), pr.chunk(1)
    assert d > 0 and h + d > h + h1 + d1  # (why it mattered: the big chunk's drain dwarfs the small one's)
    assert ttft[2048] == pytest.approx(h + d, rel=1e-9)  # one chunk: hold + drain
    assert ttft[2049] == pytest.approx(h + d + h1, rel=1e-9)  # the 1-token chunk leaves right behind it
    h4, d4 = _Pricer(plan, spec, hw, params, 4096, 2, 0.0, layout=cap[4096]).chunk(2048)
    assert ttft[4096] == pytest.approx(2 * h4 + d4, rel=1e-9)  # Σ stages + (chunks - 1) x slowest
    # a separate prefill pool (a second copy of the plan) times its chunks the same way
    for P in (2048, 2049):
        one = dict(arrival_rate=1.0, num_requests=1, prompt_len=P, output_len=2)
        assert simulate_serving(plan, pd_disaggregation=True, **one).ttft_mean_s == pytest.approx(
            ttft[P] + params.ttft_overhead_s, rel=1e-9)


@pytest.mark.parametrize("model, hardware, bits, devices", [("llama-3.1-70b", "h100-sxm", 16, 4),
                                                             ("gpt-5.6-sol", "wse-3", 4, 80),
                                                             ("llama-3.1-70b", "groq-lpu-v1", 8, 800)])
def test_one_chunk_rule_for_the_steady_state_and_the_serving_ttft(model, hardware, bits, devices):
    """The steady-state TTFT prices a prompt in 512-token chunks, the last at its real size (a 513-token prompt used
    to cost as much as 1,024 tokens), by the serving simulation's rule: one client with 512-token steps gets exactly
    the steady-state TTFT, on one stage or 80; the two modes differ only by the chunk (the step budget, default
    2,048)."""
    plan = place(model, hardware, weight_bits=bits, devices=devices, context=4200)
    pre = {}
    for P in (300, 512, 513, 1000, 1024, 1025, 2049, 4000):
        one = simulate_serving(plan, users=1, num_requests=2, prompt_len=P, output_len=2, max_num_batched_tokens=512)
        # (the serving run lays a wafer's regions out for the most sequences it can hold)
        steady = simulate(plan, prompt_len=P, output_len=2, concurrency=1, layout_concurrency=one.max_batch)
        pre[P] = steady.prefill_s
        assert one.ttft_mean_s == pytest.approx(steady.ttft_s, rel=1e-12), P
    assert list(pre.values()) == sorted(pre.values()), pre
    if plan.num_stages == 1:  # one stage: chunk after chunk, 513 tokens = one 512-token pass + one 1-token pass
        assert pre[512] < pre[513] < 0.8 * pre[1024] and pre[1024] < pre[1025] < 1.2 * pre[1024]


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 0}, {"pd_disaggregation": True}])
def test_single_token_outputs_and_prompts_longer_than_the_budget(kw):
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=8192)
    r = simulate_serving(plan, arrival_rate=5.0, num_requests=50, prompt_len=100, output_len=1, **kw)
    assert r.e2e_p50_s == r.ttft_p50_s and r.itl_p50_s == 0.0 and r.mean_batch == 0.0
    one = simulate_serving(plan, arrival_rate=1.0, num_requests=1, prompt_len=5000, output_len=10,
                           **{"max_num_batched_tokens": 512, **kw})
    assert one.steps == (0 if kw else math.ceil(5000 / 512)) + 9  # ten chunks of at most 512 tokens, nine decodes
    whole = simulate_serving(plan, arrival_rate=1.0, num_requests=1, prompt_len=5000, output_len=10,
                             max_num_batched_tokens=0)
    assert one.ttft_p50_s == pytest.approx(whole.ttft_p50_s, rel=0.1)


@pytest.mark.parametrize("kw, says", [
    (dict(arrival_rate=0.0), "arrival rate must be > 0"),
    (dict(arrival_rate=float("nan")), "arrival rate must be > 0"),
    (dict(arrival_rate=1.0, num_requests=0), "requests >= 1"),
    (dict(arrival_rate=1.0, max_num_batched_tokens=-1), "--max-num-batched-tokens"),
    (dict(arrival_rate=1.0, expert_skew=-0.5), "must be a finite number >= 0"),
    (dict(arrival_rate=1.0, expert_skew=float("inf")), "must be a finite number >= 0, got inf"),
    (dict(arrival_rate=1.0, expert_skew=1.0), "llama-3.1-8b has no routed experts"),
    (dict(arrival_rate=1.0, max_batch=0), "max batch must be >= 1"),
    (dict(arrival_rate=1.0, output_len=-3), "lengths must be >= 1"),
    (dict(arrival_rate=1.0, output_len=0), "lengths must be >= 1"),  # (0 was taken for the default length)
    (dict(arrival_rate=1.0, prompt_len=0), "lengths must be >= 1"),
])
def test_bad_inputs_are_one_line_config_errors(kw, says):
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=1024)
    with pytest.raises(ConfigError) as e:
        simulate_serving(plan, **kw)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_prefill_pool_must_serve_the_same_model():
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=1024)
    with pytest.raises(ConfigError, match="use one model"):
        simulate_serving(plan, arrival_rate=1.0, prefill_plan=place("llama-3.2-1b", "h100-sxm", devices=1))


def test_cli_serving_flags(capsys):
    from waferline.cli import main

    base = ["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--prompt-len", "256", "--output-len", "64"]
    assert main(base + ["--arrival-rate", "20", "--num-requests", "50", "--max-num-batched-tokens", "0", "--json"]) == 0
    old = json.loads(capsys.readouterr().out)["serving"]
    for key in ("requests", "arrival_rate", "max_batch", "duration_s", "output_tokens_per_s", "ttft_p50_s",
                "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "e2e_p99_s", "mean_batch"):
        assert key in old  # the fields readers of --json had stay
    assert old["prefill_mode"] == "stop-the-world"
    assert main(base + ["--arrival-rate", "20", "--num-requests", "50", "--prefill-devices", "2", "--json"]) == 0
    pd = json.loads(capsys.readouterr().out)["serving"]
    assert pd["pd_disaggregation"] and pd["prefill_devices"] == 2 and pd["max_num_batched_tokens"] == 2048
    assert main(base + ["--arrival-rate", "20", "--num-requests", "50", "--pd-disaggregation"]) == 0
    assert "KV handover" in " ".join(capsys.readouterr().out.split())  # (the title wraps with the table)
    assert main(base + ["--pd-disaggregation"]) == 2
    assert "--pd-disaggregation shapes the serving simulation: give --arrival-rate or --closed-loop too" in \
        capsys.readouterr().err
    assert main(base + ["--arrival-rate", "2", "--expert-skew", "0.5"]) != 0
    err = capsys.readouterr().err
    assert "no routed experts" in err and "Traceback" not in err


def test_a_prefill_pool_that_cannot_hold_the_model_is_refused(capsys):
    """A 70B prefill pool on one 80 GB GPU cannot hold the weights: refused, not simulated as if it fit."""
    plan = place("llama-3.1-70b", "h100-sxm", devices=8, context=1100)
    kw = dict(arrival_rate=5.0, num_requests=20, prompt_len=1000, output_len=100)
    with pytest.raises(ConfigError, match="prefill pool .* cannot hold"):
        simulate_serving(plan, prefill_plan=place("llama-3.1-70b", "h100-sxm", devices=1, context=1100), **kw)
    assert simulate_serving(plan, prefill_plan=place("llama-3.1-70b", "h100-sxm", devices=2, context=1100),
                            **kw).prefill_devices == 2
    from waferline.cli import main

    base = ["simulate", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "8", "--prompt-len", "1000",
            "--output-len", "100", "--arrival-rate", "5", "--num-requests", "20", "--no-intervals"]
    assert main(base + ["--prefill-devices", "1"]) != 0
    assert "cannot hold" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # (refused by the argument's type, before anything runs)
        main(base + ["--prefill-devices", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--prefill-devices: expected an integer from 1 to 100,000, got 0" in err


def test_cli_prefill_pool_notes_and_rank_flags(capsys):
    """The prefill pool's own placement notes (devices left idle) are printed with the plan's; --prefill-devices
    beside --attention-ranks is refused for what it is (it used to say "drop --devices", which was not given)."""
    from waferline.cli import main

    base = ["simulate", "gpt-5.6-sol", "--hardware", "wse-3", "--weight-bits", "4", "--devices", "80",
            "--arrival-rate", "10", "--num-requests", "20", "--no-intervals", "--json"]
    assert main(base + ["--prefill-devices", "163"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["serving"]["prefill_devices"] == 160
    assert "prefill pool: 3 of 163 devices left idle: 80 layers cannot use them evenly" in d["notes"]
    assert main(["simulate", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--afd", "--attention-ranks", "2",
                 "--arrival-rate", "2", "--prefill-devices", "2", "--no-intervals"]) == 2
    err = capsys.readouterr().err
    assert "--prefill-devices" in err and "--attention-ranks" in err and "drop --devices" not in err


def test_cli_a_prefill_pool_that_cannot_be_placed_names_the_pool_and_its_flag(capsys):
    """The prefill pool is placed with the plan's flags on --prefill-devices devices; a placement it cannot make used
    to be reported as if --devices (given, and fine) were wrong: "3 devices cannot hold 8 stages ...; use --devices
    >= 8", "--afd needs at least 2 devices" beside --devices 4."""
    from waferline.cli import main

    assert main(["simulate", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "8", "--layers-per-stage", "10",
                 "--arrival-rate", "10", "--num-requests", "20", "--no-intervals", "--prefill-devices", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the prefill pool (--prefill-devices 3): 3 devices cannot hold 8 stages")
    assert "use --prefill-devices >= 8" in err and "use --devices" not in err and "\n" not in err
    assert main(["simulate", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--devices", "4", "--afd", "--arrival-rate",
                 "2", "--num-requests", "5", "--no-intervals", "--prefill-devices", "1"]) == 2
    assert "the prefill pool (--prefill-devices 1): --afd needs at least 2 devices" in capsys.readouterr().err


@pytest.mark.parametrize("rate", ["0", "-2", "nan"])
def test_cli_a_zero_or_negative_arrival_rate_is_refused_not_ignored(capsys, rate):
    """--arrival-rate 0 used to skip the serving simulation silently (the flag accepted, then ignored)."""
    from waferline.cli import main

    assert main(["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--no-intervals", "--json",
                 "--arrival-rate", rate]) == 2
    assert "--arrival-rate must be > 0" in capsys.readouterr().err


def test_cli_an_arrival_rate_the_clock_cannot_resolve_is_refused(capsys):
    """Below 1e-6 requests/s the simulated clock (seconds) loses a step's milliseconds (near 1e-306: a traceback)."""
    from waferline.cli import main

    for rate in ("1e-7", "1e-307"):
        assert main(["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--no-intervals", "--json",
                     "--arrival-rate", rate]) == 2
        assert "cannot resolve a step" in capsys.readouterr().err
    assert main(["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--no-intervals", "--json",
                 "--arrival-rate", "1e-6", "--num-requests", "20"]) == 0


def test_a_closed_loop_of_clients():
    """Clients that each send their next request when the last ends (a benchmark at fixed concurrency): one client
    runs its requests back to back at the lone request's latencies; more clients share steps, so ITL grows, throughput
    grows, and at most that many requests are in flight; their first wave, sent all at once, is not in TTFT."""
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=2048)
    kw = dict(prompt_len=1024, output_len=64, num_requests=120)
    one = simulate_serving(plan, users=1, **kw)
    assert one.users == 1 and one.arrival_rate == pytest.approx(120 / one.duration_s)
    # (the last request's end is its last token: the overhead after it is outside the duration)
    assert one.e2e_p50_s == pytest.approx((one.duration_s + load_params().ttft_overhead_s) / 120, rel=0.02)
    assert one.mean_batch <= 1.0 + 1e-9
    eight = simulate_serving(plan, users=8, **kw)
    assert eight.users == 8 and eight.mean_batch <= 8.0 + 1e-9
    assert eight.output_tokens_per_s > 3 * one.output_tokens_per_s and eight.itl_p50_s > one.itl_p50_s
    assert eight.ttft_p99_s < 4 * one.ttft_p99_s  # (not the first wave's 8 prompts queued behind one another)
    for bad, says in [(dict(users=0), "users >= 1"), (dict(users=2, arrival_rate=1.0), "without an arrival rate"),
                      (dict(users=2, pd_disaggregation=True), "prefill pool")]:
        with pytest.raises(ConfigError, match=says):
            simulate_serving(plan, **kw, **bad)


def test_a_closed_loop_keeps_littles_law_with_the_request_overhead():
    """A client sends its next request when it has the last one's end, which its end-to-end latency (request
    overhead included) measures: U clients complete U / mean end-to-end requests a second (Little's law). The next
    request used to leave at the server's last token, the overhead left out of the cycle: one client of a 0.71 s
    request ran 1.85 requests/s."""
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=1100, batch=8)
    ovh = load_params().ttft_overhead_s
    assert ovh > 0.05
    for users in (1, 4):
        r = simulate_serving(plan, users=users, num_requests=401, prompt_len=1000, output_len=100)
        assert r.arrival_rate * r.e2e_mean_s == pytest.approx(users, rel=0.03), users
    one = simulate_serving(plan, users=1, num_requests=50, prompt_len=1000, output_len=100)
    assert one.arrival_rate <= 1.0 / one.e2e_mean_s * 1.01


def test_a_closed_loop_of_one_client_may_send_one_request():
    """One client's first request is reported (only several clients' first wave, sent at once, is warm-up), so one
    request is a run: it was refused as "needs more than 1 requests ... the first wave is warm-up and not reported"."""
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=2048)
    r = simulate_serving(plan, users=1, num_requests=1, prompt_len=1024, output_len=64, max_num_batched_tokens=512)
    steady = simulate(plan, prompt_len=1024, output_len=64)
    assert r.requests == 1 and r.ttft_p50_s == pytest.approx(steady.ttft_s, rel=1e-9)
    with pytest.raises(ConfigError, match="a closed loop of 2 clients needs more than 2 requests"):
        simulate_serving(plan, users=2, num_requests=2, prompt_len=1024, output_len=64)


def test_cli_closed_loop(capsys):
    from waferline.cli import main

    base = ["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--prompt-len", "256", "--output-len", "32",
            "--no-intervals"]
    assert main(base + ["--concurrency", "4", "--batch", "4", "--closed-loop", "--json"]) == 0
    sv = json.loads(capsys.readouterr().out)["serving"]
    assert sv["users"] == 4 and sv["requests"] == 200
    assert main(base + ["--concurrency", "4", "--batch", "4", "--closed-loop"]) == 0
    assert "from 4 clients in a closed loop" in " ".join(capsys.readouterr().out.split())  # (a wrapped title)
    assert main(base + ["--closed-loop", "--arrival-rate", "2"]) == 2
    assert "drop --arrival-rate" in capsys.readouterr().err


def test_a_step_carries_no_more_tokens_than_its_budget_on_a_pipeline(monkeypatch):
    """Prompts whose last chunk is still draining through the stages decode a few steps later: their tokens count
    against the budget of the steps that take further chunks. Counted only once in the batch, 8 stages let the decode
    batch grow to ~33 requests under a 16-token budget."""
    plan = place("llama-3.1-70b", "h100-sxm", devices=8, layers_per_stage=10, context=600)
    assert plan.num_stages == 8
    most = {"decode": 0, "chunk": 0}
    decode_step, chunk = _Pricer.decode_step, _Pricer.chunk

    def spy_decode(self, b):
        most["decode"] = max(most["decode"], b)
        return decode_step(self, b)

    def spy_chunk(self, n):
        most["chunk"] = max(most["chunk"], n)
        return chunk(self, n)

    monkeypatch.setattr(_Pricer, "decode_step", spy_decode)
    monkeypatch.setattr(_Pricer, "chunk", spy_chunk)
    r = simulate_serving(plan, arrival_rate=1000.0, num_requests=200, prompt_len=4, output_len=500,
                         max_num_batched_tokens=16)
    assert most["decode"] <= 16 and most["chunk"] <= 16, most
    assert r.mean_batch <= 16


def test_cli_mean_batch_is_read_as_a_time_average(capsys):
    """At a low rate every decode step carries a request, yet the mean over the run is 0.2: the caption said
    "requests decoding per step on average"."""
    from waferline.cli import main

    assert main(["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--devices", "1", "--prompt-len", "1000",
                 "--output-len", "100", "--arrival-rate", "0.5", "--num-requests", "50", "--no-intervals"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "0.2 requests decoding at once on average over the run" in out and "per step on average" not in out


def test_arrivals_above_capacity_are_reported_as_overload(capsys):
    """Above the engine's capacity the queue grows without bound: TTFT and end-to-end grow with the run, not to a
    steady state. The run said nothing (8B on one H100 at 60 req/s: TTFT p50 16 s at 2,000 requests, 155 s at
    20,000); it now measures the capacity (every request queued from the start) and flags the run."""
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=1100)
    kw = dict(prompt_len=1000, output_len=100, max_num_batched_tokens=2048)
    plateau = simulate_serving(plan, arrival_rate=1e4, num_requests=20000, check_capacity=False, **kw)
    served = plateau.requests / plateau.duration_s  # (~31 req/s: the throughput every overloaded run plateaus at)
    for budget in (2048, 0):
        for rate in (0.5 * served, 0.9 * served):
            r = simulate_serving(plan, arrival_rate=rate, num_requests=2000, **{**kw, "max_num_batched_tokens": budget})
            assert not r.overloaded and (r.capacity_rps == 0 or r.capacity_rps > rate), (budget, rate)
    over = simulate_serving(plan, arrival_rate=2 * served, num_requests=2000, **kw)
    assert over.overloaded and over.capacity_rps == pytest.approx(served, rel=0.03)
    assert not simulate_serving(plan, arrival_rate=2 * served, num_requests=2000, check_capacity=False,
                                **kw).overloaded
    from waferline.cli import main

    base = ["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--prompt-len", "1000", "--output-len", "100",
            "--num-requests", "1000", "--no-intervals", "--json", "--arrival-rate"]
    assert main(base + ["60"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["serving"]["overloaded"] and any("the queue grows without bound" in n for n in d["notes"])
    assert main(base + ["10"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert not d["serving"]["overloaded"] and not any("grows without bound" in n for n in d["notes"])


@pytest.mark.parametrize("budget", [2048, 0])
def test_mean_batch_keeps_littles_law(budget):
    """Requests decoding at once, averaged over the run = requests completed per second x the time each spends from
    its first token to its last (Little's law). Stop-the-world prefill pauses the batch, which still holds its places
    (and its inter-token latency counts the pause): the pause was left out of the mean, 5.3 instead of 7.8 at 10
    req/s."""
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=1100)
    for rate in (10.0, 20.0):
        r = simulate_serving(plan, arrival_rate=rate, num_requests=2000, prompt_len=1000, output_len=100,
                             max_num_batched_tokens=budget)
        little = r.requests / r.duration_s * (r.e2e_mean_s - r.ttft_mean_s)
        assert r.mean_batch == pytest.approx(little, rel=1e-6), (rate, r.mean_batch, little)


@pytest.mark.parametrize("pd", [False, True])
def test_a_long_prompt_under_a_small_budget_is_one_jump(monkeypatch, pd):
    """A 32k-token prompt under a 512-token budget is 63 identical chunk steps, each priced and looped over: 100k
    such requests took ~10 s of CPU (a 1-token budget: ~4 minutes). The steps that take the same chunk of one prompt
    are now one jump, as identical decode steps are; the figures are those of the step-by-step loop."""
    plan = place("llama-3.1-8b", "h100-sxm", devices=1, context=33000)
    calls = [0]
    chunk = _Pricer.chunk

    def spy(self, n):
        calls[0] += 1
        return chunk(self, n)

    monkeypatch.setattr(_Pricer, "chunk", spy)
    r = simulate_serving(plan, arrival_rate=0.5, num_requests=500, prompt_len=32000, output_len=50,
                         max_num_batched_tokens=512, pd_disaggregation=pd)
    assert calls[0] < 5 * r.requests, calls[0]
    one = simulate_serving(plan, arrival_rate=1.0, num_requests=1, prompt_len=32000, output_len=10,
                           max_num_batched_tokens=512, pd_disaggregation=pd)
    assert one.steps == (0 if pd else math.ceil(32000 / 512)) + 9  # (a jump counts every step it stands for)
    pre = _Pricer(plan, load_model(plan.model), load_hardware(plan.hardware), load_params(), 32000, 10, 0.0,
                  layout=one.max_batch)
    lone = sum(pre.chunk(512)[0] for _ in range(62)) + pre.chunk(32000 - 62 * 512)[0]  # (one stage: back to back)
    assert one.ttft_p50_s - load_params().ttft_overhead_s == pytest.approx(lone, rel=SKETCH_REL_ERROR)
