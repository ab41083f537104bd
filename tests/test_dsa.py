"""DeepSeek-V3.2 sparse attention (MLA + lightning indexer, top-k tokens per query): transformers' numbers on prompts
many times longer than the top-k, the cache against the ModelSpec's accounting, fp8 indexer keys, and the engine's
other paths (speculative decoding, MTP, pipeline stages, int4 weights) keeping the selection."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tiny_models import VOCAB, build, configs, decode_logits
from waferline import LLM, SamplingParams
from waferline.model.context import StepBatch
from waferline.model.init import write_random_checkpoint
from waferline.model.load import load_model
from waferline.model.sparse_attention import DSACache, DSAttention, top_k
from waferline.spec.model import DSASpec

pytestmark = pytest.mark.usefixtures("one_thread")

MT = "deepseek_v32"
TOPK = configs()[MT]["index_topk"]
LONG = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(5)).tolist()  # 15x the top-k
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp(MT)
    ref = build(MT, d)
    return d, ref


def _variant(src: Path, dst: Path, **fields) -> Path:
    """The checkpoint ``src`` with config fields changed (None: removed), same weights."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    for k, v in fields.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _hf_logprobs(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_long_prompt_logprobs_match_and_the_selection_matters(ckpt, tmp_path):
    d, ref = ckpt
    want = _hf_logprobs(ref, LONG)
    got = LLM(d).prompt_logprobs(LONG)
    assert got.shape == want.shape == (len(LONG), VOCAB)
    assert (got - want).abs().max().item() < TOL
    # the same weights attending to every token (top-k above the prompt length) give other numbers
    dense = LLM(_variant(d, tmp_path / "dense", index_topk=len(LONG))).prompt_logprobs(LONG)
    assert (dense[:TOPK] - want[:TOPK]).abs().max().item() < TOL  # up to k tokens: every one is selected
    assert (dense - want).abs().max().item() > 1e-2


def test_decode_steps_match_the_reference(ckpt):
    """Ragged rows (60 and 9 tokens) decoded together: each step's log-probs are transformers' at that position."""
    d, ref = ckpt
    prompts = [LONG, LONG[20:29]]
    steps = 6
    logits = decode_logits(load_model(d), prompts, [1, 0], 3, steps=steps)  # [steps + 1, B, V]
    for b, p in enumerate(prompts):
        ids = p + logits[:-1, b].argmax(-1).tolist()  # the prompt and the tokens fed back
        want = _hf_logprobs(ref, ids)[len(p) - 1:]
        got = torch.log_softmax(logits[:, b], dim=-1)
        assert (got - want).abs().max().item() < TOL, b


def test_slot_layouts_agree(ckpt):
    """Consecutive slots (cache views), scattered slots (gathers) and one sequence at a time give the same logits,
    with ragged and with equal lengths above the top-k."""
    d, _ = ckpt
    model = load_model(d)
    g = torch.Generator().manual_seed(1)
    for lens in ((9, 26), (17, 17)):
        prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]
        with torch.inference_mode():
            together = decode_logits(model, prompts, [0, 1], 2)
            scattered = decode_logits(model, prompts, [3, 1], 4)
            alone = torch.stack([decode_logits(model, [p], [0], 1)[:, 0] for p in prompts], dim=1)
        torch.testing.assert_close(scattered, together, rtol=0, atol=1e-5)
        torch.testing.assert_close(alone, together, rtol=0, atol=1e-5)


def test_bf16_runs_close_to_fp32_up_to_the_top_k(ckpt):
    """bf16 weights, activations and cache (fp32 head weights of the indexer, as the reference keeps them): up to k
    tokens every one is attended and the log-probs stay near fp32's (DeepSeek-V3's tiny model: 0.02 there too).
    Beyond, a bf16 rounding can reorder near-equal indexer scores of this random model and change the selection."""
    d, _ = ckpt
    llm = LLM(d, dtype="bfloat16")
    assert llm.model.layers[0].mixer.indexer.weights_proj.dtype == torch.float32
    assert llm.model.layers[0].mixer.indexer.wq_b.weight.dtype == torch.bfloat16
    a, b = LLM(d).prompt_logprobs(LONG), llm.prompt_logprobs(LONG)
    assert b.isfinite().all()
    assert (a - b)[:TOPK].abs().mean().item() < 0.05  # (seen: 0.024)


def test_greedy_generation_matches_generate(ckpt):
    d, ref = ckpt
    prompts = [LONG[:45], LONG[50:], LONG[3:30]]
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    want = []
    for p in prompts:
        with torch.no_grad():
            want.append(ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist())
    assert [o.token_ids for o in LLM(d).generate(prompts, GREEDY)] == want


@pytest.mark.parametrize(("index_bits", "dtype"), [(32, torch.float32), (16, torch.float32), (8, torch.float32),
                                                   (8, torch.bfloat16), (16, torch.bfloat16)])
def test_cache_holds_what_the_spec_counts(ckpt, tmp_path, index_bits, dtype):
    d, _ = ckpt
    model = load_model(_variant(d, tmp_path / "v", index_bits=index_bits), dtype)
    spec = model.spec
    assert {lay.mixer.index_bits for lay in spec.layers} == {index_bits}
    caches = model.new_caches(2)
    assert all(isinstance(c, DSACache) for c in caches)
    n = 37
    model(torch.tensor([LONG[:n]]), caches, StepBatch.make([1], [0], n))
    kv_bits = torch.finfo(dtype).bits
    held = 0
    for c, layer in zip(caches, spec.layers):
        parts = c.parts()
        cap = parts[0].capacity
        assert cap >= n and all(p.capacity == cap and p.data.shape[0] == 2 for p in parts)
        per_token = sum(p.data.nbytes for p in parts) / (2 * cap)  # every tensor the layer holds, per token row
        assert per_token == c.bytes_per_token() == layer.cache_bytes_per_token(kv_bits)
        held += per_token
    assert held == spec.cache_bytes_per_token(kv_bits)
    assert held * n == spec.cache_bytes_per_seq(n, kv_bits)


def test_fp8_index_keys(ckpt, tmp_path):
    """Without index_bits (as DeepSeek-V3.2's own config) the keys are fp8 with a per-key scale: within fp8's rounding
    of the exact keys, scoring within a few percent of the exact scores and choosing nearly the same tokens."""
    d, _ = ckpt
    m8, m32 = load_model(_variant(d, tmp_path / "fp8", index_bits=None)), load_model(d)
    assert m8.spec.layers[0].mixer.index_bits == 8
    n = len(LONG)
    batch = StepBatch.make([0], [0], n)
    scores, caches = [], []
    for m in (m8, m32):  # layer 0: the same inputs in both models
        mix, cache = m.layers[0].mixer, m.new_caches(1)[0]
        x = m.layers[0].mixer_norm(m.embed_tokens(torch.tensor([LONG])))
        q_in, _, _, _, blocked = mix.queries_and_latents(x, cache.latents, batch)
        scores.append(mix.indexer.scores(x, q_in, cache, batch, blocked))
        caches.append(cache)
    exact = caches[1].keys.data[0, :n]
    q, scale = caches[0].keys.data[0, :n], caches[0].scales.data[0, :n]
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    err = (q.float() * scale - exact).abs()
    assert (err <= torch.maximum(exact.abs() * 2 ** -4, scale * 2 ** -9) + 1e-7).all()
    assert (q.float().abs().amax(-1) == 448).all()  # each key's scale maps its largest element to fp8's largest
    s8, s32 = scores
    seen = s32.isfinite()
    assert torch.equal(seen, s8.isfinite())
    rel = ((s8 - s32).abs() / s32.masked_fill(~seen, 0).abs().amax(-1, keepdim=True))[seen]  # of the row's largest
    assert rel.max() < 0.1 and rel.mean() < 0.02  # (seen: 0.06 and 0.01)
    a, b = top_k(s8, TOPK), top_k(s32, TOPK)
    assert (a & b).sum() >= 0.9 * b.sum()


def test_speculative_greedy_equals_plain_decoding(ckpt, tmp_path):
    d, _ = ckpt
    prompts = [LONG[:40], [7, 8, 9, 10] * 4, LONG[10:22]]  # the repetitive one gets n-gram drafts accepted
    want = [o.token_ids for o in LLM(d).generate(prompts, GREEDY)]
    llm = LLM(d, speculative="ngram", num_speculative_tokens=4, speculative_adaptive=False)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    # an MTP head (transformers drops MTP weights: random ones, a DSA layer too) drafting for the target
    cfg = json.loads((d / "config.json").read_text())
    mtp = write_random_checkpoint(dict(cfg, num_nextn_predict_layers=1), tmp_path / "mtp", seed=3)
    assert isinstance(LLM(mtp).model.mtp[0].layer.mixer, DSAttention)
    want = [o.token_ids for o in LLM(mtp).generate(prompts, GREEDY)]
    llm = LLM(mtp, speculative="mtp", num_speculative_tokens=3, speculative_adaptive=False)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_two_stage_pipeline_matches_single_process(ckpt):
    d, _ = ckpt
    single = LLM(d)
    prompts = [LONG[:33], LONG[40:47], LONG[5:25]]
    want = [o.token_ids for o in single.generate(prompts, GREEDY)]
    want_lp = single.prompt_logprobs(LONG)
    with LLM(d, stages=2, prefill_chunk=16, threads_per_stage=1) as llm:
        assert llm._pipeline.num_stages == 2
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        lp = llm.prompt_logprobs(LONG)  # 60 tokens in 4 chunks: later chunks score the cached indexer keys
        assert (lp - want_lp).abs().max().item() < TOL


def test_int4_decode_keeps_the_selection(ckpt):
    """With int4 weights a DSA layer never runs as the fused MLA ops (they attend to every token): a decode step
    gives the log-probs the prefill of the same tokens gives at that position."""
    d, _ = ckpt
    llm = LLM(d, weight_bits=4, group_size=16)
    model = llm.model
    assert all(isinstance(lay.mixer, DSAttention) and isinstance(lay.mixer.dsa, DSASpec) for lay in model.layers)
    p = LONG[:30]
    logits = decode_logits(model, [p], [0], 1, steps=4)[:, 0]
    ids = p + logits[:-1].argmax(-1).tolist()
    h = model(torch.tensor([ids]), model.new_caches(1), StepBatch.make([0], [0], len(ids)))
    want = torch.log_softmax(model.logits(h[0, len(p) - 1:]), dim=-1)
    got = torch.log_softmax(logits, dim=-1)
    assert (got - want).abs().max().item() < 1e-2


def test_top_k_breaks_ties_by_position_whatever_the_row_length():
    """Tokens no indexer head scores above 0 tie at exactly 0: the earliest of them are chosen, the same in a decode
    row (L keys) as in a prefill or verify row padded with unseen (-inf) keys."""
    row = torch.tensor([0.0, 2.0, 0.0, -1.0, 0.0, 3.0, 0.0])
    assert top_k(row[None], 4)[0].nonzero().view(-1).tolist() == [0, 1, 2, 5]
    for pad in (0, 1, 9, 200):
        padded = torch.cat([row, torch.full((pad,), float("-inf"))])
        assert top_k(padded[None, None], 4)[0, 0, :7].nonzero().view(-1).tolist() == [0, 1, 2, 5]
    few = torch.tensor([[1.0, float("-inf"), float("-inf"), 0.5, float("-inf")]])  # 2 seen tokens, k = 3
    chosen = top_k(few, 3)
    assert chosen.sum().item() == 3 and chosen[0, 0] and chosen[0, 3]
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, 50, generator=g).relu()  # many exact zeros
    chosen = top_k(s, 8)
    assert (chosen.sum(-1) == 8).all()
    assert (s.masked_fill(~chosen, float("inf")).amin(-1) >= s.masked_fill(chosen, float("-inf")).amax(-1)).all()
