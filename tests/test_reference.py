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
