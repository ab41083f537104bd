"""Every engine architecture matches the Hugging Face reference on tiny random checkpoints built here."""

import pytest
import torch

from tiny_models import build, configs
from waferline import LLM, SamplingParams

MODEL_TYPES = sorted(configs())
PROMPTS = [[1, 17, 42, 99, 5, 23, 64, 11, 87, 3, 45, 120, 7], [1, 66, 8, 31, 100, 2 + 4, 77]]


@pytest.fixture(scope="module", params=MODEL_TYPES)
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    ref = build(request.param, d)
    return request.param, ref, LLM(d)


def test_prompt_logprobs_match(pair):
    mt, ref, llm = pair
    ids = PROMPTS[0] + PROMPTS[1]  # 20 tokens: more than gpt_oss's window (8) and the mamba chunk (8)
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = llm.prompt_logprobs(ids)
    assert got.shape == want.shape == (len(ids), configs()[mt]["vocab_size"])
    assert (got - want).abs().max().item() < 1e-4, mt
    # through the scheduler (as the server scores an echoed prompt): each prompt token's and the top 2
    o = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert [lp.token for lp in o.prompt_logprobs] == ids[1:]
    rows = torch.arange(len(ids) - 1)
    assert (torch.tensor([lp.logprob for lp in o.prompt_logprobs]) - want[rows, ids[1:]]).abs().max() < 1e-4, mt
    top = torch.tensor([[v for _, v in lp.top] for lp in o.prompt_logprobs])
    assert (top - want[:-1].topk(2, dim=-1).values).abs().max() < 1e-4, mt


def test_greedy_batch_matches_generate(pair):
    mt, ref, llm = pair
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    want = []
    for p in PROMPTS:
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)
        want.append(out[0, len(p):].tolist())
    got = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in got] == want, mt
    assert all(o.finish_reason == "length" for o in got)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_generated_logprobs_match(pair, temperature):
    """Each generated token's log-probability (and the top 3) is the reference's log-softmax at its position, greedy
    and sampled (log-probabilities of the raw logits, before temperature and top-p)."""
    mt, ref, llm = pair
    params = SamplingParams(max_tokens=6, temperature=temperature, top_p=0.9, seed=3, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params)
    for p, o in zip(PROMPTS, outs):
        assert [lp.token for lp in o.logprobs] == o.token_ids and len(o.token_ids) == 6
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([p + o.token_ids[:-1]])).logits[0, len(p) - 1:].float(), -1)
        got = torch.tensor([lp.logprob for lp in o.logprobs])
        assert (got - want[torch.arange(6), o.token_ids]).abs().max().item() < 1e-4, mt
        for i, lp in enumerate(o.logprobs):
            ids, vals = zip(*lp.top)
            assert len(ids) == 3 and list(vals) == sorted(vals, reverse=True)
            assert (torch.tensor(vals) - want[i, list(ids)]).abs().max().item() < 1e-4, mt
            assert (want[i].topk(3).values - torch.tensor(vals)).abs().max().item() < 1e-4, mt
            if temperature == 0:
                assert ids[0] == o.token_ids[i]
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].logprobs is None


def test_penalties_and_logit_bias_match(pair):
    """repetition_penalty as transformers' generate applies it; OpenAI's frequency / presence penalties as a greedy loop
    over the reference's logits applies them (logit - f x count - p x [count > 0], generated tokens only); a
    logit_bias of +100 forces its token."""
    mt, ref, llm = pair
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    p = PROMPTS[0]
    with torch.no_grad():
        out = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, repetition_penalty=1.3)
    got = llm.generate([p], SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.3))[0].token_ids
    assert got == out[0, len(p):].tolist(), mt
    want: list[int] = []
    for _ in range(8):
        with torch.no_grad():
            x = ref(torch.tensor([p + want])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(want, dtype=torch.long), minlength=x.numel())[:x.numel()].float()
        want.append(int((x - 0.7 * counts - 0.4 * (counts > 0).float()).argmax()))
    got = llm.generate([p], SamplingParams(max_tokens=8, ignore_eos=True, frequency_penalty=0.7,
                                           presence_penalty=0.4))[0].token_ids
    assert got == want, mt
    biased = SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={7: 100.0})
    assert llm.generate([p], biased)[0].token_ids == [7] * 4


def test_sampling_is_seeded_and_valid(pair):
    mt, _, llm = pair
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=20, seed=7, ignore_eos=True)
    a = llm.generate(PROMPTS, p)
    b = llm.generate(PROMPTS, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 8 for o in a)
    c = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.9, seed=8, ignore_eos=True))
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_modelspec_counts_exactly_the_loaded_parameters(pair):
    """The one accounting (ModelSpec) equals what the engine actually holds, element for element."""
    mt, _, llm = pair
    m = llm.model
    held = sum(p.numel() for n, p in m.named_parameters() if not n.startswith("mtp."))
    held += sum(b.numel() for n, b in m.named_buffers() if "correction_bias" in n and not n.startswith("mtp."))
    assert held == llm.spec.params_total(), mt
    if len(m.mtp):
        assert sum(p.numel() for p in m.mtp.parameters()) == llm.spec.mtp_params()
