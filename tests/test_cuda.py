"""The engine on a CUDA GPU: skipped where torch sees none (CI), run on a machine that has one (README, "Decode
speed": the prepared device command). Tiny checkpoints, as everywhere: the GPU path's tokens and numbers against its
own eager steps and against the CPU engine, the int4 weights repacked for torch's tinygemm, speculative decoding
(n-gram, MTP, a draft model) against plain decoding on the GPU, and `serve --device cuda` through the openai client."""

import pytest
import torch

from conftest import tiny_checkpoints
from waferline import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    import json

    from test_speculative import SOL, _perturbed_copy
    from waferline.model.init import write_random_checkpoint

    out = tiny_checkpoints(tmp_path_factory, ("deepseek_v3", "llama", "qwen3_moe", "bamba"))
    cfg = json.loads((out["deepseek_v3"] / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1  # MLA with an MTP head
    out["deepseek_v3:mtp"] = write_random_checkpoint(cfg, tmp_path_factory.mktemp("dsv3_mtp"), seed=3)
    out["sol:mtp"] = write_random_checkpoint(SOL, tmp_path_factory.mktemp("sol_mtp"), seed=4)  # Mamba-2 + MLA + GQA
    out["bamba:draft"] = _perturbed_copy(out["bamba"], tmp_path_factory.mktemp("bamba_draft"), 0.05)
    return out


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10]]


def _count_replays(monkeypatch) -> list[int]:
    """Counts CUDA graph replays from now on (in the returned list's one element)."""
    n = [0]
    real = torch.cuda.CUDAGraph.replay

    def replay(self):
        n[0] += 1
        return real(self)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", replay)
    return n


@pytest.mark.parametrize("mt", ["deepseek_v3", "llama", "qwen3_moe"])
def test_cuda_graph_decode_is_the_eager_decode(ckpts, mt, monkeypatch):
    # fp32 (TF32 off, torch's default for matmuls): the graph's step attends over its fixed end, the eager one over
    # the positions so far; the masked rows add exact zeros, so the tokens agree (bf16 GEMMs of other shapes might
    # round otherwise: checked by log-probs below)
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    graphed = LLM(ckpts[mt], device="cuda")
    replays = _count_replays(monkeypatch)
    got = [o.token_ids for o in graphed.generate(PROMPTS, p)]
    assert graphed.graph_note is None  # the step was captured ...
    assert replays[0] >= 10  # ... and replayed at each step (the page table's copy under "cuda" vs "cuda:0" had
    # dropped the graph at its first replay, with no note)
    eager = LLM(ckpts[mt], device="cuda", cuda_graphs=False)
    assert got == [o.token_ids for o in eager.generate(PROMPTS, p)]
    # again on the same engine (a new request captures its own step)
    assert [o.token_ids for o in graphed.generate(PROMPTS[:1], p)] == got[:1]


@pytest.mark.parametrize("mt", ["deepseek_v3", "llama", "qwen3_moe"])
def test_captured_bf16_step_logits_are_the_eager_steps(ckpts, mt, monkeypatch):
    # bf16, MoE experts as grouped products: the captured step's logits against an eager step at the same positions
    from waferline.engine.graphs import StaticDecode
    from waferline.model.context import StepBatch

    dev = torch.device("cuda:1" if torch.cuda.device_count() > 1 else "cuda")  # (not the current device, where two)
    llm = LLM(ckpts[mt], dtype="bfloat16", device=str(dev))
    with torch.inference_mode():  # (as the engine decodes)
        caches = llm.model.new_caches(2, dev)
        step = StaticDecode(llm.model, caches, [0, 1], 40, dev, capture=True)
        assert step.graph is not None
        replays = _count_replays(monkeypatch)
        for b, n in enumerate((7, 4)):
            llm.model(torch.arange(3, 3 + n, device=dev)[None], caches, StepBatch.make([b], [0], n, dev))
        for tokens, starts in (([5, 9], [7, 4]), ([6, 2], [8, 5])):
            logits, _ = step.run(tokens, starts)
            logits = logits.clone()
            ref = llm.model.step_logits(torch.tensor(tokens, device=dev)[:, None], caches,
                                        StepBatch.make([0, 1], starts, 1, dev))[0][:, 0]
            torch.testing.assert_close(logits.log_softmax(-1), ref.log_softmax(-1), atol=0.05, rtol=0.02)
        assert replays[0] == 2 and step.graph is not None and step.dropped is None  # (replayed, not run eagerly)


@pytest.mark.parametrize("mt", ["deepseek_v3", "llama", "qwen3_moe", "bamba"])
def test_gpu_logprobs_match_the_cpu_engine(ckpts, mt):
    ids = [3, 9, 27, 81, 14, 42, 7, 5]
    cpu = LLM(ckpts[mt]).prompt_logprobs(ids)
    gpu = LLM(ckpts[mt], device="cuda").prompt_logprobs(ids)
    assert gpu.device.type == "cpu" and gpu.shape == cpu.shape
    torch.testing.assert_close(gpu, cpu, atol=2e-3, rtol=1e-3)  # fp32 on both; TF32 is off by default in torch


def test_int4_checkpoint_moves_to_the_gpu(ckpts, tmp_path):
    # an int4 checkpoint (packed for the CPU at load unless bound for a GPU: loading_for) repacked for tinygemm
    from waferline import cli

    out = tmp_path / "q4"
    assert cli.main(["quantize", "--model", str(ckpts["llama"]), "--out", str(out), "--group-size", "32"]) == 0
    ids = [3, 9, 27, 81, 14, 42, 7, 5]
    gpu = LLM(out, dtype="bfloat16", device="cuda")
    assert {m.backend for m in gpu.model.modules() if type(m).__name__ == "Int4Weight"} == {"cuda_tinygemm"}
    cpu = LLM(out, dtype="bfloat16")
    torch.testing.assert_close(gpu.prompt_logprobs(ids), cpu.prompt_logprobs(ids), atol=0.1, rtol=0.05)


def test_int4_on_the_gpu_is_the_cpu_int4(ckpts):
    ids = [3, 9, 27, 81, 14, 42, 7, 5]
    gpu = LLM(ckpts["llama"], dtype="bfloat16", weight_bits=4, group_size=32, device="cuda")
    backends = {m.backend for m in gpu.model.modules() if type(m).__name__ == "Int4Weight"}
    assert backends == {"cuda_tinygemm"}
    cpu = LLM(ckpts["llama"], dtype="bfloat16", weight_bits=4, group_size=32)
    torch.testing.assert_close(gpu.prompt_logprobs(ids), cpu.prompt_logprobs(ids), atol=0.1, rtol=0.05)
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(gpu.generate(PROMPTS, p)[0].token_ids) == 8


SPEC_PROMPTS = [[7, 8, 9, 10] * 3, [5, 6, 5, 6, 5, 6, 11], [20, 21, 22, 23, 24, 20, 21, 22, 23]]


@pytest.mark.parametrize("mt, method", [("deepseek_v3:mtp", "mtp"), ("deepseek_v3:mtp", "ngram"), ("sol:mtp", "mtp"),
                                        ("bamba", "draft")])
def test_speculation_on_the_gpu_is_plain_decoding(ckpts, mt, method):
    # greedy, fp32: the verify forward's tokens are the one-token steps'; the caches (MLA, GQA, Mamba-2 state), the
    # MTP head and the draft model's caches on the GPU, rolled back there
    method = f"draft:{ckpts['bamba:draft']}" if method == "draft" else method
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(ckpts[mt], device="cuda", cuda_graphs=False).generate(SPEC_PROMPTS, p)]
    spec = LLM(ckpts[mt], device="cuda", speculative=method, num_speculative_tokens=3, speculative_adaptive=False)
    outs = spec.generate(SPEC_PROMPTS, p)
    assert [o.token_ids for o in outs] == ref
    assert outs[0].metrics["spec_drafted"] > 0
    # sampled: drafts verified on the host with each request's own generator (seeded: repeatable)
    q = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    a, b = spec.generate(SPEC_PROMPTS, q), spec.generate(SPEC_PROMPTS, q)
    assert [o.token_ids for o in a] == [o.token_ids for o in b] and all(len(o.token_ids) == 16 for o in a)


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_serve_on_the_gpu_is_generate_on_the_gpu(sol, speculative):
    """`waferline serve --device cuda`: 6 concurrent streams through the official client equal `LLM.generate` on the
    GPU with the same options (greedy: the same text)."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from server_helpers import serve_in_thread
    from waferline.server.commands import build_server

    prompts = ["To be, or not to be", "Friends, Romans, countrymen", "the the the the", "O Romeo, Romeo!",
               "All the world's a stage", "Now is the winter"]
    opts = {"speculative": speculative} if speculative else {}
    llm = LLM(sol, device="cuda", max_model_len=256, **opts)
    want = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))]
    llm.close()
    app = build_server(sol, max_num_seqs=4, max_model_len=256, served_model_name="sol-gpu", device="cuda", **opts)
    with serve_in_thread(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")

        def one(prompt: str) -> str:
            stream = client.completions.create(model="sol-gpu", prompt=prompt, max_tokens=14, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in stream if c.choices)

        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(one, prompts))
        assert app.state.server.engine.scheduler.runner.device.type == "cuda"
    assert got == want
