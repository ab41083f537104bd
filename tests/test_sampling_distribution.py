"""The sampler's distribution against an independent fp64 reference (vLLM's / transformers' semantics): temperature,
top-k (ties at the k-th value kept), min-p, top-p (the token that crosses the threshold kept), their order, penalties
and logit_bias, masked tokens, fp16/bf16 logits, the tail of a 150k vocabulary; the speculative verifier's output
against the target whatever the draft distribution. Counts are judged by their total-variation distance from the
exact distribution, within 4x the distance sampling noise alone gives (a wrong distribution is far outside it)."""

import math

import pytest
import torch

from waferline.engine.sampling import SamplingParams, adjust_logits, draw, greedy, sample, target_probs
from waferline.engine.speculative import verify, verify_sampled
from waferline.errors import RequestError


def reference_probs(logits: torch.Tensor, t: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> torch.Tensor:
    """softmax(logits / t) in fp64; top-k keeps every token at least the k-th largest logit; min-p drops tokens below
    min_p x the likeliest; top-p keeps the likeliest tokens until their mass reaches top_p (that token included)."""
    x = logits.double() / t
    if top_k and top_k < x.numel():
        x = x.masked_fill(x < x.sort(descending=True).values[top_k - 1], -math.inf)
    p = torch.softmax(x, -1)
    if min_p > 0:
        p = p.masked_fill(p < min_p * p.max(), 0.0)
        p = p / p.sum()
    if top_p < 1:
        sp, idx = p.sort(descending=True, stable=True)
        sp = sp.masked_fill(sp.cumsum(0) - sp >= top_p, 0.0)
        p = torch.zeros_like(p).scatter(0, idx, sp)
        p = p / p.sum()
    return p


def tv_ok(counts: torch.Tensor, p: torch.Tensor) -> tuple[bool, float, float]:
    """Whether ``counts`` could be draws of ``p``: no draw of a zero-probability token, and a total-variation distance
    within 4x its expected value under sampling noise (E|c/N - p_i| ~ sqrt(2 p_i (1 - p_i) / (pi N)))."""
    counts, p = counts.double(), p.double()
    n = counts.sum()
    tv = 0.5 * float((counts / n - p).abs().sum())
    noise = 0.5 * float(torch.sqrt(2 * p * (1 - p) / (math.pi * n)).sum())
    return bool(counts[p == 0].sum() == 0) and tv <= 4 * noise, tv, 4 * noise


LOGITS = torch.tensor([2.0, 1.5, 0.3, -1.0, 0.9, 1.1, -0.2, 0.0, 1.5, -3.0, float("-inf"), 0.4])

CASES = [dict(t=1.0), dict(t=0.4), dict(t=2.5), dict(t=1.0, top_k=3), dict(t=1.0, top_k=2),  # (2: a tie at the 2nd)
         dict(t=0.8, top_p=0.7), dict(t=1.0, top_p=0.5), dict(t=1.3, top_p=0.999), dict(t=1.0, min_p=0.2),
         dict(t=0.7, top_k=6, top_p=0.9, min_p=0.1), dict(t=1.2, top_k=8, min_p=0.3, top_p=0.6), dict(t=1.0, top_k=1)]


def _params(c: dict, **extra) -> SamplingParams:
    return SamplingParams(temperature=c["t"], top_k=c.get("top_k", 0), top_p=c.get("top_p", 1.0),
                          min_p=c.get("min_p", 0.0), **extra)


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_target_probs_is_the_reference_distribution(case):
    got = target_probs(LOGITS, _params(case)).double()
    want = reference_probs(LOGITS, **case)
    assert torch.equal(got > 0, want > 0), (got, want)
    assert torch.allclose(got, want, atol=1e-6)
    # as rows of a verify's [k+1, V] too
    rows = target_probs(torch.stack([LOGITS, LOGITS.flip(0)]), _params(case)).double()
    assert torch.allclose(rows[0], want, atol=1e-6) and torch.allclose(rows[1], reference_probs(LOGITS.flip(0), **case),
                                                                      atol=1e-6)


def test_top_p_of_a_150k_vocabulary_keeps_the_reference_set():
    torch.manual_seed(0)
    logits = torch.randn(151_936) * 0.5
    for p in (0.5, 0.9, 0.99, 0.9999):
        got = target_probs(logits, SamplingParams(temperature=1.0, top_p=p)).double()
        want = reference_probs(logits, top_p=p)
        assert abs(int((got > 0).sum()) - int((want > 0).sum())) <= 1 and 0.5 * float((got - want).abs().sum()) < 1e-5



@pytest.mark.parametrize("t", [1e8, 1e30, 1e300])
def test_a_hot_temperature_keeps_min_p_and_top_p_to_the_likeliest_tokens(t):
    # softmax(logits / t) rounds every probability to the same fp32 value: the tokens kept are still the likeliest
    # (the logits' order), not whichever the sort of equal probabilities puts first
    kept = target_probs(LOGITS, SamplingParams(temperature=t, top_p=0.3)) > 0
    assert kept.nonzero().flatten().tolist() == [0, 1, 5, 8]
    assert (target_probs(LOGITS, SamplingParams(temperature=t, min_p=1.0)) > 0).nonzero().flatten().tolist() == [0]
    assert int((target_probs(LOGITS, SamplingParams(temperature=t, min_p=0.5)) > 0).sum()) == 11  # (all but -inf)


def test_stop_and_stop_token_ids_of_the_wrong_type_are_request_errors():
    for kw, says in [(dict(stop_token_ids=5), "stop_token_ids must be a list of integers"),
                     (dict(stop_token_ids=2.0), "stop_token_ids must be a list of integers"),
                     (dict(stop=5), "stop must be a string or a list of strings")]:
        with pytest.raises(RequestError, match=says):
            SamplingParams(**kw)
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3, 4)).stop_token_ids == [3, 4]

@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[9], CASES[10]], ids=["plain", "top_k-tie", "all", "all2"])
def test_sample_draws_the_reference_distribution(case):
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(LOGITS.numel())
    for _ in range(12_000):
        counts[sample(LOGITS, _params(case), g)] += 1
    ok, tv, tol = tv_ok(counts, reference_probs(LOGITS, **case))
    assert ok, (tv, tol)
    wrong = torch.softmax(LOGITS.double(), -1)  # (the check has the power to tell: the raw softmax is rejected)
    if case != CASES[0]:
        assert not tv_ok(counts, wrong)[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_sample_as_their_fp32_values(dtype):
    logits = LOGITS.to(dtype)
    params = SamplingParams(temperature=0.7, top_p=0.9)
    g = torch.Generator().manual_seed(2)
    counts = torch.zeros(LOGITS.numel())
    for _ in range(8000):
        counts[sample(logits, params, g)] += 1
    ok, tv, tol = tv_ok(counts, reference_probs(logits.float(), t=0.7, top_p=0.9))
    assert ok, (tv, tol)
    assert sample(logits, SamplingParams(temperature=0), None) == 0


def test_greedy_is_the_first_largest():
    assert greedy(torch.tensor([1.0, 3.0, 3.0, 2.0])) == 1
    assert greedy(torch.tensor([[float("-inf"), -1e30, -1e30], [0.0, 5.0, 5.0]])) == [1, 1]
    assert sample(torch.tensor([0.5, 2.0, 2.0, float("-inf")]), SamplingParams(temperature=0), None) == 1


def test_penalties_and_bias_sample_the_reference_distribution():
    """logit_bias, then the repetition penalty on prompt and output tokens (a positive logit divided, a negative one
    multiplied), then OpenAI's frequency and presence penalties on the output's, then temperature."""

    class Seq:
        prompt_ids, output_ids, stop_ids = [0, 3, 3], [1, 1, 4, 3], set()

    logits = LOGITS[:8].clone()
    params = SamplingParams(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
                            logit_bias={2: 1.5, 3: -0.5})
    x = logits.double().clone()
    x[2] += 1.5
    x[3] -= 0.5
    for t in (0, 1, 3, 4):
        x[t] = x[t] / 1.3 if x[t] > 0 else x[t] * 1.3
    counts = torch.bincount(torch.tensor(Seq.output_ids), minlength=8).double()
    x -= 0.3 * counts + 0.5 * (counts > 0).double()
    assert torch.allclose(adjust_logits(logits, params, Seq()).double(), x, atol=1e-6)
    g = torch.Generator().manual_seed(4)
    drawn = torch.zeros(8)
    for _ in range(8000):
        drawn[sample(logits, params, g, Seq())] += 1
    ok, tv, tol = tv_ok(drawn, reference_probs(x, t=0.9))
    assert ok, (tv, tol)


def test_the_tail_of_a_150k_vocabulary_is_drawn_at_its_rate_and_masked_tokens_never():
    """An inverse CDF over 151,936 weights: the last tokens (masked ones among them) drawn at their rate."""
    torch.manual_seed(0)
    logits = torch.randn(151_936)  # (the bulk holds about a third of the mass)
    logits[-6:] = torch.tensor([12.0, float("-inf"), 12.5, float("-inf"), 13.0, float("-inf")])
    probs = target_probs(logits, SamplingParams(temperature=1.0))
    want = reference_probs(logits)
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(logits.numel())
    for _ in range(600):
        counts[draw(probs, g)] += 1
    assert counts[logits == float("-inf")].sum() == 0
    grouped = torch.cat([counts[:-6].sum()[None], counts[-6:]])
    ok, tv, tol = tv_ok(grouped, torch.cat([want[:-6].sum()[None], want[-6:]]))
    assert ok, (tv, tol)


# ------------------------------------------------------------------------------------------ speculative verification

P = torch.tensor([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10], [0.0, 0.40, 0.05, 0.25, 0.30, 0.0],
                  [0.2, 0.2, 0.2, 0.2, 0.2, 0.0]])
DRAFTS = {
    "q-random": torch.softmax(torch.randn(2, 6, generator=torch.Generator().manual_seed(9)), -1),
    "q-equals-p": P[:2].clone(),
    "q-zero-where-p-is-not": torch.tensor([[0.5, 0.0, 0.5, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.5, 0.0, 0.0]]),
    "q-mostly-where-p-is-zero": torch.tensor([[0.1, 0.4, 0.1, 0.0, 0.0, 0.4], [0.5, 0.2, 0.0, 0.0, 0.0, 0.3]]),
}


@pytest.mark.parametrize("name", list(DRAFTS))
def test_verifier_emits_the_target_distribution_whatever_the_draft(name):
    """Each emitted position follows the target's row there: the first token p[0], the second (after an accepted
    draft) p[1], the bonus (both accepted) p[2]."""
    q = DRAFTS[name]
    g = torch.Generator().manual_seed(3)
    pos = torch.zeros(3, 6)
    for _ in range(12_000):
        out = verify_sampled(P, q, [draw(q[0], g), draw(q[1], g)], g)
        for i, t in enumerate(out):
            pos[i, t] += 1
    for i in range(3):
        if pos[i].sum() >= 500:
            ok, tv, tol = tv_ok(pos[i], P[i])
            assert ok, (i, tv, tol)


@pytest.mark.parametrize("draft", [[0, 4], [5, 0], [1, 1]])
def test_verifier_of_a_deterministic_draft_emits_the_target_distribution(draft):
    g = torch.Generator().manual_seed(5)
    pos = torch.zeros(3, 6)
    for _ in range(12_000):
        for i, t in enumerate(verify_sampled(P, None, draft, g)):
            pos[i, t] += 1
    for i in range(3):
        if pos[i].sum() >= 500:
            ok, tv, tol = tv_ok(pos[i], P[i])
            assert ok, (i, tv, tol)


def test_seeded_verify_repeats_and_seeds_differ():
    torch.manual_seed(0)
    logits = torch.randn(4, 32)
    q = torch.softmax(torch.randn(3, 32), -1)
    params = SamplingParams(temperature=1.0, top_k=20)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [verify(logits, [draw(q[i], g) for i in range(3)], q, params, g) for _ in range(50)]

    assert run(1) == run(1) and run(1) != run(2)
