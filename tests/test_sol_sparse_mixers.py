"""sol with DSA (MLA + lightning indexer) and DeepSeek-V4-style attention (csa / hca: V4 attention as a plain mixer,
no hyper-connections) in the engine: a prompt's log-probs equal incremental decode and chunked prefill, the caches
hold exactly the ModelSpec's bytes, and the sparse selections matter (top-k below the prompt length differs from
attending to everything). sol has no transformers reference: every number here is the engine's own, checked against
itself through other paths."""

import pytest
import torch

from waferline import LLM, SamplingParams
from waferline.model.context import StepBatch
from waferline.model.decoder import DecoderModel
from waferline.model.init import write_random_checkpoint
from waferline.model.load import load_model
from waferline.model.sparse_attention import DSACache, DSAttention
from waferline.model.ssm import Mamba2Cache, Mamba2Mixer
from waferline.model.v4_attention import V4Attention, V4Cache
from waferline.spec.configs import parse_hf_config

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
DSA_TOPK = 8
BASE = dict(model_type="sol", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, scoring_func="sigmoid", topk_method="noaux_tc", n_group=1,
            topk_group=1, norm_topk_prob=True, ffn_types=["dense", "moe"], index_n_heads=2, index_head_dim=16,
            max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=0, eos_token_id=1)
V4 = dict(sliding_window=6, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
          o_groups=2, o_lora_rank=16, index_topk=2)
MIXERS = {
    "dsa": dict(mixer_types=["dsa", "dsa"], index_topk=DSA_TOPK),  # index keys fp8 + scale (the default)
    "csa": dict(V4, mixer_types=["csa", "csa"]),  # 4x compression, top-2 entries, fp8 index keys
    "hca": dict(V4, mixer_types=["hca", "hca"]),  # 8x compression, every entry
    # all of them with a Mamba-2 layer (top-4 for DSA and CSA alike: one index_topk field)
    "mixed": dict(V4, mixer_types=["hca", "dsa", "csa", "mamba2"], num_hidden_layers=4, index_topk=4,
                  ffn_types=["dense", "moe", "dense", "moe"], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
                  mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=16),
}
LONG = [(7 * i * i + 3 * i + 5) % 125 + 3 for i in range(50)]  # 12 CSA / 6 HCA entries, 6x DSA's top-k


def _checkpoint(tmp_path_factory, mixer: str, **fields):
    name = "-".join([mixer, *(f"{k}{v}" for k, v in fields.items())])
    cfg = dict(BASE, **MIXERS[mixer])
    cfg.update(fields)  # (same shapes: the same random weights whatever these fields say)
    return write_random_checkpoint(cfg, tmp_path_factory.mktemp(name), seed=1)


@pytest.fixture(scope="module", params=sorted(MIXERS))
def model(request, tmp_path_factory):
    return request.param, load_model(_checkpoint(tmp_path_factory, request.param))


def _logprobs(m: DecoderModel, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Log-probs of every position of ``ids`` fed in chunks of these sizes (one slot of three)."""
    caches, hs, s = m.new_caches(3), [], 0
    with torch.no_grad():
        for n in chunks:
            hs.append(m(torch.tensor([ids[s: s + n]]), caches, StepBatch.make([1], [s], n))[0])
            s += n
        return torch.log_softmax(m.logits(torch.cat(hs)), dim=-1)


def test_the_engine_builds_the_sol_mixers(model):
    kind, m = model
    built = {"dsa": (DSAttention, DSACache), "csa": (V4Attention, V4Cache), "hca": (V4Attention, V4Cache),
             "mamba2": (Mamba2Mixer, Mamba2Cache)}
    for lay, cache, mixer in zip(m.layers, m.new_caches(1), MIXERS[kind]["mixer_types"]):
        assert (type(lay.mixer), type(cache)) == built[mixer]
        if mixer in ("csa", "hca"):
            assert (lay.mixer.indexer is not None) == (mixer == "csa")


def test_prefill_equals_incremental_decode_and_chunked_prefill(model):
    """Chunk edges inside compression windows and past the top-k; decode one token at a time from the start."""
    _, m = model
    whole = _logprobs(m, LONG, [len(LONG)])
    assert whole.shape == (len(LONG), BASE["vocab_size"])
    assert (_logprobs(m, LONG, [1] * len(LONG)) - whole).abs().max().item() < TOL
    assert (_logprobs(m, LONG, [13, 6, 1, 21, 9]) - whole).abs().max().item() < TOL


def test_batched_ragged_decode_equals_prefill(model):
    """Two rows of different lengths in scattered slots decode together; each step equals a prefill of its tokens."""
    _, m = model
    prompts, steps = [LONG[:41], LONG[7:16]], 5
    caches, lengths, slots = m.new_caches(4), [len(p) for p in prompts], [3, 0]
    with torch.no_grad():
        for p, s in zip(prompts, slots):
            m(torch.tensor([p]), caches, StepBatch.make([s], [0], len(p)))
        toks, fed = torch.tensor([[5], [9]]), [[5], [9]]
        got = []
        for i in range(steps):
            h = m(toks, caches, StepBatch.make(slots, [n + i for n in lengths], 1))
            got.append(torch.log_softmax(m.logits(h[:, 0]), dim=-1))
            toks = got[-1].argmax(-1, keepdim=True)
            for b in range(2):
                fed[b].append(int(toks[b]))
    got = torch.stack(got, dim=1)  # [B, steps, V]
    for b, p in enumerate(prompts):
        want = _logprobs(m, p + fed[b][:steps], [len(p) + steps])[len(p):]
        assert (got[b] - want).abs().max().item() < TOL, b


def test_llm_generates_as_the_model_decodes(model, tmp_path):
    """The serving path (LLM: scheduler, chunked prefill, whole-step programs where they apply) on a sol checkpoint
    with these mixers: prompt log-probs and greedy tokens as the model's own prefill gives them."""
    kind, m = model
    d = write_random_checkpoint(dict(BASE, **MIXERS[kind]), tmp_path / kind, seed=1)
    llm = LLM(d)
    assert (llm.prompt_logprobs(LONG) - _logprobs(m, LONG, [len(LONG)])).abs().max().item() < TOL
    out = llm.generate([LONG[:30]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    ids = LONG[:30]
    for _ in range(6):
        ids = ids + [int(_logprobs(m, ids, [len(ids)])[-1].argmax())]
    assert out == ids[30:]


@pytest.mark.parametrize("dtype,bits", [(torch.float32, 32), (torch.bfloat16, 16)])
@pytest.mark.parametrize("index_bits", [None, 16])
def test_cache_bytes_equal_the_modelspec(tmp_path_factory, dtype, bits, index_bits):
    """Every tensor each layer's cache holds for a sequence, at lengths below, at and past the window, ratios and
    top-k, against ``LayerSpec.cache_bytes_per_seq`` (V4 caches, sized to what they hold) and
    ``cache_bytes_per_token`` (DSA's token caches, per row of their capacity); index keys fp8 + scale or bf16.
    (The Mamba-2 layer's state is fp32 whatever the model's precision: not this test's subject.)"""
    for kind in sorted(MIXERS):
        fields = {} if index_bits is None else {"index_bits": index_bits}
        m = load_model(_checkpoint(tmp_path_factory, kind, **fields), dtype)
        spec = m.spec
        indexed = {lay.mixer.index_bits for lay in spec.layers if getattr(lay.mixer, "index_n_heads", 0)}
        assert indexed == (set() if kind == "hca" else {index_bits or 8})
        for n in (1, 3, 5, 8, 13, 29, 50):
            caches = m.new_caches(2)
            with torch.no_grad():
                m(torch.tensor([LONG[:n]]), caches, StepBatch.make([1], [0], n))
            for c, layer in zip(caches, spec.layers):
                if isinstance(c, DSACache):
                    parts = c.parts()
                    cap = parts[0].capacity
                    assert cap >= n and all(p.capacity == cap for p in parts)
                    per_row = sum(p.data.nbytes for p in parts) / (2 * cap)
                    assert per_row == c.bytes_per_token() == layer.cache_bytes_per_token(bits), (kind, n)
                    assert per_row * n == layer.cache_bytes_per_seq(n, bits, bits)
                elif isinstance(c, V4Cache):
                    assert c.bytes_held(1) == layer.cache_bytes_per_seq(n, bits, bits), (kind, n, layer.index)
                    assert c.bytes_held(0) == 0
            if kind in ("csa", "hca"):
                assert sum(c.bytes_held(1) for c in caches) == spec.cache_bytes_per_seq(n, bits, bits)


def test_fp8_index_keys_of_csa(tmp_path_factory):
    """CSA's compressed index keys at index_bits 8 are fp8 with a per-key scale, within fp8's rounding of the keys
    index_bits 32 keeps in fp32, from the same weights."""
    m8 = load_model(_checkpoint(tmp_path_factory, "csa"))
    m32 = load_model(_checkpoint(tmp_path_factory, "csa", index_bits=32))
    keys = []
    for m in (m8, m32):
        caches = m.new_caches(1)
        with torch.no_grad():
            m(torch.tensor([LONG]), caches, StepBatch.make([0], [0], len(LONG)))
        keys.append(caches[0].index[0])
    s8, s32 = keys
    assert s8.entries.dtype == torch.float8_e4m3fn and s8.scales.shape == (len(LONG) // 4, 1)
    assert s32.entries.dtype == torch.float32 and s32.scales is None
    exact = s32.values()
    err = (s8.values() - exact).abs()
    assert (err <= torch.maximum(exact.abs() * 2 ** -4, s8.scales * 2 ** -9) + 1e-7).all()
    assert (s8.entries.float().abs().amax(-1) == 448).all()


def test_dsa_top_k_below_the_prompt_differs_from_dense_mla(tmp_path_factory):
    """The same weights as dense MLA (the DSA model's MLA parameters in an MLA sol model): equal up to the top-k
    (every token is selected there), different past it."""
    m = load_model(_checkpoint(tmp_path_factory, "dsa"))
    cfg = dict(m.spec.hf_config, mixer_types=["mla", "mla"])
    mla = DecoderModel(parse_hf_config(cfg), torch.float32)
    missing, unexpected = mla.load_state_dict(m.state_dict(), strict=False)
    assert not missing and unexpected and all(".indexer." in k for k in unexpected)
    sparse, dense = _logprobs(m, LONG, [len(LONG)]), _logprobs(mla, LONG, [len(LONG)])
    assert (sparse[:DSA_TOPK] - dense[:DSA_TOPK]).abs().max().item() < TOL
    assert (sparse - dense).abs().max().item() > 1e-2


@pytest.mark.parametrize("kind,dense_topk", [("dsa", len(LONG)), ("csa", len(LONG))])
def test_a_top_k_above_the_candidates_attends_to_all(tmp_path_factory, kind, dense_topk):
    """Same weights with the top-k raised past every candidate: other numbers (the selection is exercised)."""
    sparse = _logprobs(load_model(_checkpoint(tmp_path_factory, kind)), LONG, [len(LONG)])
    dense = _logprobs(load_model(_checkpoint(tmp_path_factory, kind, index_topk=dense_topk)), LONG, [len(LONG)])
    assert (sparse - dense).abs().max().item() > 1e-3


def test_speculative_greedy_equals_plain_decoding(model, tmp_path):
    """n-gram drafts of a repetitive prompt, some rejected: DSA's token caches need no rollback, the V4 layers' caches
    rewind to the accepted prefix (compressor windows reopened); either way the tokens are plain greedy decoding's."""
    kind, _ = model
    d = write_random_checkpoint(dict(BASE, **MIXERS[kind]), tmp_path / kind, seed=1)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [LONG[:40], [7, 8, 9, 10] * 4]
    want = [o.token_ids for o in LLM(d).generate(prompts, greedy)]
    llm = LLM(d, speculative="ngram", num_speculative_tokens=4, speculative_adaptive=False)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want
