"""DeepSeek-V4 as a pipeline of stage processes and with int4 weights. Two stages of one layer each, both layers
hash-routed (their experts are picked by token id, so the ids travel with every micro-batch to the second stage) and
the residual kept as ``hc_mult`` streams (what a stage sends is [B, T, hc_mult, D]): greedy and seeded sampled tokens
and prompt log-probs are the single-process engine's, with and without speculative decoding; an int4 checkpoint
loads and decodes as its dequantized twin, and serves a request through the server's pipeline runner."""

from pathlib import Path

import pytest
import torch

from test_quant import _dequantize_in_place, _int4_weights, _logprobs
from test_speculative_pipeline import Scripted
from tiny_models import VOCAB, build, configs, decode_logits
from waferline import LLM, SamplingParams
from waferline.engine.pipeline import ids_downstream
from waferline.engine.stage import Group, MicroBatch
from waferline.spec.configs import parse_hf_config, spec_from_pretrained

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 16  # prefill chunk: the 40-token prompt goes through the stages in three chunks
LENGTHS = [5, 23, 40, 11]  # past the sliding window (6) and the CSA (4) and HCA (8) compression ratios
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
TOL = 1e-4
TWO_LAYERS = dict(num_hidden_layers=2, layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                  mlp_layer_types=["hash_moe", "hash_moe"])


def _prompts(lengths: list[int]) -> list[list[int]]:
    return [[(i * 7 + j * 3 + 1) % (VOCAB - 3) + 3 for j in range(n)] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("deepseek_v4_two")
    build("deepseek_v4", d, **TWO_LAYERS)
    return d


@pytest.fixture(scope="module")
def reference(ckpt) -> dict:
    """The single-process engine's answers."""
    llm = LLM(ckpt)
    prompts = _prompts(LENGTHS)
    return {"prompts": prompts,
            "greedy": [o.token_ids for o in llm.generate(prompts, GREEDY)],
            "sampled": [o.token_ids for o in llm.generate(prompts[:3], SAMPLED)],
            "logprobs": llm.prompt_logprobs(prompts[2][:CHUNK]),
            "chunked_logprobs": llm.prompt_logprobs(prompts[2])}


def test_token_ids_travel_only_where_a_later_stage_routes_by_them(ckpt, tmp_path):
    spec = spec_from_pretrained(ckpt)
    assert ids_downstream(spec, [(0, 1), (1, 2)]) and not ids_downstream(spec, [(0, 2)])
    cfg = dict(configs()["deepseek_v4"], model_type="deepseek_v4")  # 4 layers, the first two hash-routed
    four = parse_hf_config(cfg)
    assert ids_downstream(four, [(0, 1), (1, 4)]) and not ids_downstream(four, [(0, 2), (2, 4)])
    assert not ids_downstream(parse_hf_config(dict(configs()["deepseek_v3"], model_type="deepseek_v3")),
                              [(0, 1), (1, 2)])  # (routed by score: no correction bias is not hash routing there)
    g = Group(3, [0, 1], [0, 1], [4, 9], [1, 1], tokens=[5, 6, 7, 8, 9, 10])
    back = MicroBatch.decode(MicroBatch(7, [g]).encode())
    assert back.groups[0].tokens == g.tokens and back.groups[0].seqs == [0, 1]


def test_two_stages_match_the_single_process_engine(ckpt, reference):
    ref = reference
    with LLM(ckpt, layers_per_stage=1, prefill_chunk=CHUNK, threads_per_stage=1) as llm:
        pipe = llm._pipeline
        assert pipe.num_stages == 2 and pipe.ids_downstream
        assert [o.token_ids for o in llm.generate(ref["prompts"], GREEDY)] == ref["greedy"]
        assert [o.token_ids for o in llm.generate(ref["prompts"][:3], SAMPLED)] == ref["sampled"]
        lp = llm.prompt_logprobs(ref["prompts"][2][:CHUNK])
        assert lp.shape == ref["logprobs"].shape and (lp - ref["logprobs"]).abs().max().item() < TOL
        lp = llm.prompt_logprobs(ref["prompts"][2])
        assert lp.shape == ref["chunked_logprobs"].shape
        assert (lp - ref["chunked_logprobs"]).abs().max().item() < TOL


def test_speculative_two_stages_match_plain_greedy(ckpt, reference):
    """n-gram drafting, then a scripted drafter whose corrupted drafts make every stage roll back its V4 caches at
    every depth: the tokens of plain greedy decoding."""
    prompts, want = reference["prompts"], reference["greedy"]
    with LLM(ckpt, layers_per_stage=1, prefill_chunk=CHUNK, threads_per_stage=1, speculative="ngram",
             num_speculative_tokens=4, speculative_adaptive=False) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        llm._spec.drafter = Scripted([p + r for p, r in zip(prompts, want)], VOCAB)
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == want
        m = outs[0].metrics
        assert 0 < m["spec_acceptance_rate"] < 1 and m["spec_mean_accepted_length"] > 1.5


@pytest.fixture(scope="module")
def int4_ckpt(ckpt, tmp_path_factory) -> Path:
    from waferline.model.quant import QuantOptions, quantize_checkpoint

    d = tmp_path_factory.mktemp("deepseek_v4_int4") / "q4"
    quantize_checkpoint(ckpt, d, QuantOptions(group_size=16))
    return d


def _twin(ckpt: Path) -> torch.nn.Module:
    """The fp32 model quantized in memory, then holding its dequantized int4 weights as fp32 matrices and its other
    weights rounded to bf16 (as the int4 checkpoint stores them)."""
    from waferline.model.load import load_model
    from waferline.model.quant import QuantOptions, quantize_model

    twin = load_model(ckpt)
    quantize_model(twin, QuantOptions(group_size=16))
    with torch.no_grad():
        for p in twin.parameters():
            p.copy_(p.bfloat16().float())
    return _dequantize_in_place(twin)


def test_int4_checkpoint_decodes_as_its_dequantized_twin(ckpt, int4_ckpt):
    """Every projection and every routed and shared expert int4 (group 16): the int4 engine computes what an fp32
    model holding the dequantized weights computes, in a prefill and in batched decode steps."""
    from waferline.model.load import load_model

    q4 = load_model(int4_ckpt)
    names = {n for n, _, _ in _int4_weights(q4)}
    want = {f"layers.{i}.mixer.{p}.weight" for i in (0, 1) for p in
            ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "compressor.kv_proj")}
    want |= {"layers.0.mixer.indexer.q_b_proj.weight"}
    want |= {f"layers.{i}.ffn.{p}" for i in (0, 1) for p in ("w_gate_up", "w_down", "shared.down_proj.weight")}
    assert want <= names, want - names
    twin = _twin(ckpt)
    prompts = _prompts([40, 23])
    got = _logprobs(q4, prompts[0])
    assert (got - _logprobs(twin, prompts[0])).abs().max().item() < TOL
    assert (got - _logprobs(load_model(ckpt), prompts[0])).abs().max().item() > 1e-2  # (int4: not the fp32 numbers)
    with torch.no_grad():  # two rows of different lengths prefilled, then decoded together
        a = torch.log_softmax(decode_logits(q4, prompts, [1, 0], 2, steps=6), dim=-1)
        b = torch.log_softmax(decode_logits(twin, prompts, [1, 0], 2, steps=6), dim=-1)
    assert torch.equal(a.argmax(-1), b.argmax(-1)) and (a - b).abs().max().item() < TOL
    outs = LLM(int4_ckpt).generate(prompts, SamplingParams(max_tokens=7, ignore_eos=True))
    assert [o.token_ids for o in outs] == a.argmax(-1).T.tolist()


def test_int4_request_served_through_two_stages(int4_ckpt):
    """The server's scheduler over two int4 stages (PipelineRunner): a request's tokens are LLM.generate's."""
    from test_serve_pipeline import LiveServer

    d = int4_ckpt
    prompt = _prompts([30])[0]
    want = LLM(d).generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    s = LiveServer(d, {"layers_per_stage": 1, "micro_batches": 2}, max_num_seqs=2)
    try:
        runner = s.engine.scheduler.runner
        assert runner.pipe.num_stages == 2 and runner.pipe.ids_downstream
        r = s.client.completions.create(model="sol-pipe", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == want
    finally:
        s.close()


def test_gptq_calibration_sees_each_routed_expert(ckpt):
    """GPTQ's layer-by-layer calibration of V4 (each layer alone, the token ids beside its inputs): the experts'
    Hessians, one [K, K] per expert, come from exactly the tokens routed to each."""
    from waferline.model.load import load_model
    from waferline.model.quant.calibration import SequentialCalibration

    model = load_model(ckpt)
    ids = [5, 9, 5, 9, 9, 5] * 3  # (two token ids: at most four of the eight experts)
    calib = SequentialCalibration(model, ids)
    calib.advance(model.layers[0])
    H = calib.hessians(model.layers[1])
    ffn = model.layers[1].ffn
    E, two_i, D = ffn.w_gate_up.shape
    assert H["ffn.w_gate_up"].shape == (E, D, D) and H["ffn.w_down"].shape == (E, two_i // 2, two_i // 2)
    routed = ffn.tid2eid[torch.tensor(ids)].unique().tolist()  # (hash routing: fixed per token id)
    seen = [e for e in range(E) if H["ffn.w_gate_up"][e].abs().sum() > 0]
    assert seen == routed and len(seen) < E
