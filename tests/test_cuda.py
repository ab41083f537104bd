"""The engine on a CUDA GPU: skipped where torch sees none (CI), run on a machine that has one (README, "Decode
speed": the prepared device command). Tiny checkpoints, as everywhere: the GPU path's tokens and numbers against its
own eager steps and against the CPU engine, the int4 weights repacked for torch's tinygemm."""

import pytest
import torch

from conftest import tiny_checkpoints
from waferline import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, ("deepseek_v3", "llama", "qwen3_moe", "bamba"))


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.mark.parametrize("mt", ["deepseek_v3", "llama", "qwen3_moe"])
def test_cuda_graph_decode_is_the_eager_decode(ckpts, mt):
    # fp32 (TF32 off, torch's default for matmuls): the graph's step attends over its fixed end, the eager one over
    # the positions so far; the masked rows add exact zeros, so the tokens agree (bf16 GEMMs of other shapes might
    # round otherwise: checked by log-probs below)
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    graphed = LLM(ckpts[mt], device="cuda")
    got = [o.token_ids for o in graphed.generate(PROMPTS, p)]
    assert graphed.graph_note is None  # the step was captured
    eager = LLM(ckpts[mt], device="cuda", cuda_graphs=False)
    assert got == [o.token_ids for o in eager.generate(PROMPTS, p)]
    # again on the same engine (a new request captures its own step)
    assert [o.token_ids for o in graphed.generate(PROMPTS[:1], p)] == got[:1]


@pytest.mark.parametrize("mt", ["deepseek_v3", "llama", "qwen3_moe"])
def test_captured_bf16_step_logits_are_the_eager_steps(ckpts, mt):
    # bf16, MoE experts as grouped products: the captured step's logits against an eager step at the same positions
    from waferline.engine.graphs import StaticDecode
    from waferline.model.context import StepBatch

    dev = torch.device("cuda:1" if torch.cuda.device_count() > 1 else "cuda")  # (not the current device, where two)
    llm = LLM(ckpts[mt], dtype="bfloat16", device=str(dev))
    with torch.inference_mode():  # (as the engine decodes)
        caches = llm.model.new_caches(2, dev)
        step = StaticDecode(llm.model, caches, [0, 1], 40, dev, capture=True)
        assert step.graph is not None
        for b, n in enumerate((7, 4)):
            llm.model(torch.arange(3, 3 + n, device=dev)[None], caches, StepBatch.make([b], [0], n, dev))
        for tokens, starts in (([5, 9], [7, 4]), ([6, 2], [8, 5])):
            logits, _ = step.run(tokens, starts)
            logits = logits.clone()
            ref = llm.model.step_logits(torch.tensor(tokens, device=dev)[:, None], caches,
                                        StepBatch.make([0, 1], starts, 1, dev))[0][:, 0]
            torch.testing.assert_close(logits.log_softmax(-1), ref.log_softmax(-1), atol=0.05, rtol=0.02)


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
