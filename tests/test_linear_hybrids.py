"""Qwen3-Next (Gated DeltaNet) and Kimi Linear (KDA): the chunked and recurrent delta rule agree, prompts spanning
several chunks match transformers, the spec's cache accounting is what the caches hold, speculative rollback keeps
greedy output exact, and the models run as a 2-stage pipeline, with attention and FFN disaggregated, and in int4."""

import copy
from pathlib import Path

import pytest
import torch

from tiny_models import VOCAB, build
from waferline import LLM, SamplingParams
from waferline.engine.scheduler import Scheduler, SchedulerConfig
from waferline.engine.speculative import VerifyRollback
from waferline.model.context import StepBatch
from waferline.model.decoder import DecoderModel
from waferline.model.delta_rule import delta_rule_chunked, delta_rule_steps
from waferline.model.linear_attention import DeltaRuleMixer, LinearAttentionCache
from waferline.spec.configs import parse_hf_config, spec_from_pretrained

pytestmark = pytest.mark.usefixtures("one_thread")

TYPES = ("qwen3_next", "kimi_linear")
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for mt in TYPES:
        d = tmp_path_factory.mktemp(mt)
        out[mt] = (d, build(mt, d))
    return out


def _mixers(llm: LLM) -> list[DeltaRuleMixer]:
    return [layer.mixer for layer in llm.model.layers if isinstance(layer.mixer, DeltaRuleMixer)]


@pytest.mark.parametrize("per_channel", [False, True])
def test_chunked_delta_rule_equals_the_recurrence(per_channel):
    """From a nonzero state, a run of tokens that is not a multiple of the chunk: same outputs and final state."""
    g = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 21, 3, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g)
    g_log = -torch.rand(B, T, H, K if per_channel else 1, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, K, V, generator=g)
    s_rec, s_chunk = s0.clone(), s0.clone()
    want, states = delta_rule_steps(s_rec, q, k, v, g_log, beta, record=True)
    got = delta_rule_chunked(s_chunk, q, k, v, g_log, beta, chunk=4)
    assert (got - want).abs().max() < 1e-5 and (s_chunk - s_rec).abs().max() < 1e-5
    assert torch.equal(states[:, -1], s_rec) and not torch.allclose(s_rec, s0, atol=1e-2)


@pytest.mark.parametrize("mt", TYPES)
def test_prompts_across_chunks_match_reference(ckpts, mt):
    """A 150-token prompt prefilled in chunks of 8 (the tiny config's ``linear_chunk_size``) and of 64 (the default)
    lands as close to the exact answer (transformers in float64) as float32 rounding allows: within 1e-4 plus three
    times transformers' own float32 distance from it (up to ~1e-3 on these random models; a wrong chunk boundary is
    off by ~0.1). tests/test_reference.py holds 20-token prompts (3 chunks) to 1e-4 of transformers' float32."""
    d, ref = ckpts[mt]
    llm = LLM(d)
    assert {m.chunk_size for m in _mixers(llm)} == {8}
    ref64 = copy.deepcopy(ref).double()
    ref64.set_experts_implementation("eager")  # (the grouped expert product takes no float64)
    ids = torch.randint(3, VOCAB, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        exact = torch.log_softmax(ref64(torch.tensor([ids])).logits[0], dim=-1)
        hf32 = torch.log_softmax(ref(torch.tensor([ids])).logits[0].double(), dim=-1)
    bound = 1e-4 + 3 * (hf32 - exact).abs().max().item()
    for chunk in (8, 64):
        for m in _mixers(llm):
            m.chunk_size = chunk
        diff = (llm.prompt_logprobs(ids).double() - exact).abs().max().item()
        assert diff < bound, (mt, chunk, diff, bound)


def test_kimi_hub_config_parses_as_transformers_reads_it():
    """A hub-style Kimi Linear config.json (``linear_attn_config`` with 1-based layer lists, the hub's MoE field
    names) gives the same layers as the config transformers builds from it and saves."""
    import transformers

    hub = {"model_type": "kimi_linear", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
           "qk_rope_head_dim": 8, "v_head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
           "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_renormalize": True,
           "num_expert_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
           "model_max_length": 1024, "linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3],
                                                            "head_dim": 16, "num_heads": 4,
                                                            "short_conv_kernel_size": 4}}
    ours = parse_hf_config(hub)
    theirs = parse_hf_config(transformers.AutoConfig.for_model(**hub).to_dict())
    assert [layer.mixer.kind for layer in ours.layers] == ["kda", "mla", "kda", "mla"]
    assert [layer.ffn.kind for layer in ours.layers] == ["dense", "moe", "moe", "moe"]
    assert ours.layers == theirs.layers and ours.max_position_embeddings == theirs.max_position_embeddings == 1024
    assert ours.layers[1].ffn.n_group == 4 and ours.layers[0].mixer.head_dim == 16


@pytest.mark.parametrize("mt", TYPES)
@pytest.mark.parametrize("dtype,bits", [(torch.float32, 32), (torch.bfloat16, 16)])
def test_spec_cache_accounting_equals_the_caches(ckpts, mt, dtype, bits):
    """Per layer: a linear layer's cache holds exactly ``state_bytes_per_seq`` per slot (whatever the prompt length),
    an attention layer's cache ``cache_bytes_per_token`` per cached token and no state."""
    spec = spec_from_pretrained(ckpts[mt][0])
    model = DecoderModel(spec, dtype)
    slots = 3
    caches = model.new_caches(slots)
    kinds = set()
    for layer, cache in zip(spec.layers, caches):
        if isinstance(cache, LinearAttentionCache):
            kinds.add("linear")
            assert layer.cache_bytes_per_token(bits) == 0
            assert cache.nbytes() == slots * layer.mixer.state_bytes_per_seq(bits) > 0
            assert cache.ssm.dtype == torch.float32 and cache.conv.dtype == dtype
        else:
            kinds.add("attention")
            assert layer.mixer.state_bytes_per_seq(bits) == 0
            per_token = cache.data.shape[2] * cache.data.element_size()
            assert per_token == layer.cache_bytes_per_token(bits) > 0
            assert layer.cache_bytes_per_seq(100, bits, bits) == 100 * per_token
    assert kinds == {"linear", "attention"}
    held = sum(c.nbytes() for c in caches if isinstance(c, LinearAttentionCache))
    state = sum(layer.mixer.state_bytes_per_seq(bits) for layer in spec.layers if layer.mixer.kind in ("gdn", "kda"))
    assert held == slots * state


@pytest.mark.parametrize("mt", TYPES)
def test_verify_rollback_equals_running_only_the_accepted_prefix(ckpts, mt):
    """After a 6-token verify and a rollback to its first k tokens, the next token's logits equal those of caches that
    only ever saw the k tokens (the linear layers' conv window and state from the verify's trail)."""
    m = LLM(ckpts[mt][0]).model
    prompt = torch.arange(3, 3 + 13)[None] % VOCAB
    new = torch.tensor([[17, 40, 9, 88, 5, 61]])
    with torch.inference_mode():
        for keep in (1, 3, 6):
            a, b = m.new_caches(2), m.new_caches(2)
            for c in (a, b):
                m(prompt, c, StepBatch.make([1], [0], 13))
            batch = StepBatch.make([1], [13], 6)
            rb = VerifyRollback(a, batch)
            m(new, a, batch)
            rb.done([keep])
            m(new[:, :keep], b, StepBatch.make([1], [13], keep))
            nxt = torch.tensor([[33]])
            la = m.logits(m(nxt, a, StepBatch.make([1], [13 + keep], 1)))
            lb = m.logits(m(nxt, b, StepBatch.make([1], [13 + keep], 1)))
            assert torch.allclose(la, lb, atol=1e-4), (keep, float((la - lb).abs().max()))
            assert all(not c.trail for c in a if isinstance(c, LinearAttentionCache))


@pytest.mark.parametrize("mt", TYPES)
def test_a_verify_keeps_what_the_accounting_counts_and_the_scheduler_budgets_it(ckpts, mt):
    """A verify of k drafts keeps, per linear layer and sequence until its rewind, the state after each of its k + 1
    tokens (``LayerSpec.rollback_bytes_per_seq``); a scheduler speculating k drafts counts those bytes per sequence in
    its budget (they went uncounted: a tight --cache-mb admitted more than it held), one without speculation does
    not."""
    llm = LLM(ckpts[mt][0])
    m, spec, k = llm.model, llm.spec, 5
    with torch.inference_mode():
        caches = m.new_caches(2)
        m(torch.arange(3, 16)[None] % VOCAB, caches, StepBatch.make([1], [0], 13))
        batch = StepBatch.make([1], [13], k + 1)
        rb = VerifyRollback(caches, batch)
        m(torch.tensor([[17, 40, 9, 88, 5, 61]]), caches, batch)
        for layer, c in zip(spec.layers, caches):
            if isinstance(c, LinearAttentionCache):
                kept = sum(t.numel() * t.element_size() for t in c.trail[1])
                assert kept == layer.rollback_bytes_per_seq(k, 32) > 2 * (k + 1) * c.ssm[0].numel()
        rb.done([2])
    mml = 64
    plain = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=mml, page_tokens=8))
    spec_k = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=mml, page_tokens=8, speculative="ngram",
                                            num_speculative_tokens=k, speculative_adaptive=False))
    assert plain.cache.max_seq_bytes == spec.cache_bytes_per_seq(mml, 32, 32)
    assert spec_k.cache.max_seq_bytes == plain.cache.max_seq_bytes + spec.rollback_bytes_per_seq(k, 32)
    assert spec.rollback_bytes_per_seq(k, 32) > plain.cache.max_seq_bytes
    # a draft model with recurrent layers keeps a copy of its state before each drafted token but the last
    drafted = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=mml, page_tokens=8, speculative="draft:"
                                             + str(ckpts[mt][0]), num_speculative_tokens=k, speculative_adaptive=False))
    state = sum(layer.mixer.state_bytes_per_seq(32) for layer in spec.layers)
    assert sum(p.page_bytes for p in drafted.cache.pools if p.draft and p.per_seq) == (1 + k) * state > 0


@pytest.mark.parametrize("mt", TYPES)
def test_state_snapshot_restore_and_reset(ckpts, mt):
    """A slot's snapshot taken after a prompt, restored after more tokens went in, continues as if they never had (a
    drafter's rollback); reset gives a slot a fresh sequence; other slots are untouched throughout."""
    m = LLM(ckpts[mt][0]).model
    prompt, more, nxt = torch.tensor([[5, 9, 31, 7, 77, 12]]), torch.tensor([[40, 41, 42]]), torch.tensor([[33]])
    with torch.inference_mode():
        caches = m.new_caches(3)
        m(prompt, caches, StepBatch.make([2], [0], 6))
        m(prompt[:, :4], caches, StepBatch.make([0], [0], 4))
        linear = [c for c in caches if isinstance(c, LinearAttentionCache)]
        other = [(c.conv[0].clone(), c.ssm[0].clone()) for c in linear]
        slot = torch.tensor([2])
        saved = [c.snapshot(slot) for c in linear]
        want = m.logits(m(nxt, caches, StepBatch.make([2], [6], 1)))
        m(more, caches, StepBatch.make([2], [7], 3))
        for c, st in zip(linear, saved):
            c.restore(slot, st)
        assert torch.equal(m.logits(m(nxt, caches, StepBatch.make([2], [6], 1))), want)
        for c in caches:
            c.reset(slot)
        fresh = m.new_caches(1)
        a = m.logits(m(prompt, caches, StepBatch.make([2], [0], 6)))
        b = m.logits(m(prompt, fresh, StepBatch.make([0], [0], 6)))
        assert torch.equal(a, b)
        assert all(torch.equal(c.conv[0], o[0]) and torch.equal(c.ssm[0], o[1]) for c, o in zip(linear, other))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (3, 11, 6, 19)]
    ps[1] = [7, 8, 9, 10] * 3  # repetitive: the n-gram drafter finds matches
    return ps


@pytest.mark.parametrize("mt", TYPES)
def test_speculative_greedy_identical(ckpts, mt):
    """Greedy output with speculative decoding equals plain decoding: drafts that are right up to a position cycling
    over every depth (so every rollback depth occurs), then the n-gram drafter."""
    from test_speculative import Scripted

    prompts = _prompts()
    ref = [o.token_ids for o in LLM(ckpts[mt][0]).generate(prompts, GREEDY)]
    llm = LLM(ckpts[mt][0], speculative="ngram", num_speculative_tokens=5, speculative_adaptive=False)
    llm._spec.drafter = Scripted([p + r for p, r in zip(prompts, ref)])
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    m = outs[0].metrics
    assert 0 < m["spec_acceptance_rate"] < 1 and m["spec_mean_accepted_length"] > 1.5
    outs = LLM(ckpts[mt][0], speculative="ngram", num_speculative_tokens=4).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref and outs[0].metrics["spec_drafted"] > 0


def _two_layer(mt: str, d: Path) -> None:
    """The tiny model cut to one linear layer and one attention layer (both MoE)."""
    over = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
    over.update({"mlp_only_layers": []} if mt == "qwen3_next" else {"mlp_layer_types": ["sparse", "sparse"]})
    build(mt, d, **over)


@pytest.mark.parametrize("mt", TYPES)
def test_two_stage_pipeline_matches_single_process(tmp_path, mt):
    """One layer per stage (a linear layer, then an attention layer): tokens, chunked-prefill log-probs and
    speculative greedy output are the single-process engine's."""
    _two_layer(mt, tmp_path)
    prompts = [[(i * 7 + j * 3 + 1) % VOCAB for j in range(n)] for i, n in enumerate([5, 23, 3, 40])]
    single = LLM(tmp_path)
    want = [o.token_ids for o in single.generate(prompts, GREEDY)]
    want_lp = single.prompt_logprobs(prompts[3])
    with LLM(tmp_path, layers_per_stage=1, prefill_chunk=16, threads_per_stage=1) as llm:
        assert llm._pipeline.num_stages == 2
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        diff = (llm.prompt_logprobs(prompts[3]) - want_lp).abs().max().item()  # 40 tokens: three 16-token chunks
        assert diff < 1e-4, diff
    # speculative decoding across the stages, every rollback depth (each stage rolls its own linear states back)
    from test_speculative_pipeline import Scripted

    with LLM(tmp_path, layers_per_stage=1, prefill_chunk=16, threads_per_stage=1, speculative="ngram",
             num_speculative_tokens=4, speculative_adaptive=False) as llm:
        llm._spec.drafter = Scripted([p + r for p, r in zip(prompts, want)], VOCAB)
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == want
        m = outs[0].metrics
        assert 0 < m["spec_acceptance_rate"] < 1 and m["spec_mean_accepted_length"] > 1.5


@pytest.mark.parametrize("mt", TYPES)
def test_int4_matches_the_dequantized_twin(ckpts, mt):
    """W4A16 (group 16): every projection of the linear and attention layers and the experts quantized; the int4
    engine computes what an fp32 model holding the dequantized weights computes. (How far int4 lands from fp32 says
    little on these random tiny models: ~0.5-1.7 nats KL, against ~0.03 for the tiny llama.)"""
    from test_quant import _dequantize_in_place, _int4_weights, _logprobs
    from waferline.model.load import load_model
    from waferline.model.quant import QuantOptions, quantize_model

    d = ckpts[mt][0]
    ids = list(range(3, 40))
    q4 = LLM(d, weight_bits=4, group_size=16)
    names = {n for n, _, _ in _int4_weights(q4.model)}
    mixer = ("in_proj_qkvz", "in_proj_ba", "out_proj") if mt == "qwen3_next" else (
        "q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj")
    attn = ("q_proj", "k_proj", "v_proj", "o_proj") if mt == "qwen3_next" else (
        "q_proj", "kv_a_proj_with_mqa", "o_proj")
    want = {f"layers.0.mixer.{p}.weight" for p in mixer} | {f"layers.1.mixer.{p}.weight" for p in attn}
    assert want | {"layers.1.ffn.w_gate_up", "layers.1.ffn.shared.w_down"} <= names
    b = q4.prompt_logprobs(ids)
    assert (b - LLM(d).prompt_logprobs(ids)).abs().max() > 1e-2  # (quantized: not the fp32 numbers)
    twin = load_model(d)
    quantize_model(twin, QuantOptions(group_size=16))
    c = _logprobs(_dequantize_in_place(twin), ids)
    assert (b - c).abs().max() < 1e-4
    assert len(q4.generate([ids], GREEDY)[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("mt", TYPES)
def test_int4_checkpoint_loads_as_quantized_in_memory(ckpts, mt, tmp_path):
    """An int4 checkpoint (``quantize_checkpoint``: codes for the matmuls, bf16 for the rest) loads to exactly the
    model quantized in memory with its other weights rounded to bf16 as the file stores them (Qwen3-Next's norms as
    1 + bf16(w): the file keeps the checkpoint's w)."""
    from test_quant import _logprobs
    from waferline.model.load import load_model
    from waferline.model.quant import QuantOptions, quantize_checkpoint, quantize_model

    d = ckpts[mt][0]
    quantize_checkpoint(d, tmp_path / "q4", QuantOptions(group_size=16))
    twin = load_model(d)
    quantize_model(twin, QuantOptions(group_size=16))
    with torch.no_grad():
        for name, p in twin.named_parameters():
            centred = mt == "qwen3_next" and name.endswith("norm.weight")  # (not the gated norm: norm_weight)
            p.copy_(1 + (p - 1).bfloat16().float() if centred else p.bfloat16().float())
    ids = list(range(3, 40))
    assert torch.equal(_logprobs(load_model(tmp_path / "q4"), ids), _logprobs(twin, ids))


@pytest.mark.parametrize("mt", TYPES)
def test_attention_ffn_disaggregation_matches_single_process(ckpts, mt):
    """AFD (one attention rank, experts split over two FFN ranks): the attention side's FFN norms load as the model's
    own (Qwen3-Next's zero-centred ones included), so tokens and log-probs are the single-process engine's."""
    d = ckpts[mt][0]
    prompts = [[5, 6, 7, 8] * 4, [9, 3, 11], list(range(3, 30))]
    single = LLM(d)
    want = [o.token_ids for o in single.generate(prompts, GREEDY)]
    want_lp = single.prompt_logprobs(prompts[2])
    with LLM(d, afd=True, attention_ranks=1, ffn_ranks=2, threads_per_rank=1) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        assert (llm.prompt_logprobs(prompts[2]) - want_lp).abs().max() < 1e-4
