"""The engine on a CUDA GPU: skipped where torch sees none (CI), run by a session that is lent one (README, "Decode
speed": the prepared device command). Tiny checkpoints, as everywhere: the GPU path's tokens and numbers against its
own eager steps and against the CPU engine, the int4 weights repacked for torch's tinygemm."""

import pytest
import torch

from tiny_models import build
from waferline import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for mt in ("deepseek_v3", "llama", "qwen3_moe", "bamba"):
        d = tmp_path_factory.mktemp(mt)
        build(mt, d)
        out[mt] = d
    return out


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.mark.parametrize("mt", ["deepseek_v3", "llama", "qwen3_moe"])
def test_cuda_graph_decode_is_the_eager_decode(ckpts, mt):
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    graphed = LLM(ckpts[mt], dtype="bfloat16", device="cuda")
    got = [o.token_ids for o in graphed.generate(PROMPTS, p)]
    assert graphed.graph_note is None  # the step was captured
    eager = LLM(ckpts[mt], dtype="bfloat16", device="cuda", cuda_graphs=False)
    assert got == [o.token_ids for o in eager.generate(PROMPTS, p)]
    # again on the same engine (a new request captures its own step)
    assert [o.token_ids for o in graphed.generate(PROMPTS[:1], p)] == got[:1]


@pytest.mark.parametrize("mt", ["deepseek_v3", "llama", "qwen3_moe", "bamba"])
def test_gpu_logprobs_match_the_cpu_engine(ckpts, mt):
    ids = [3, 9, 27, 81, 14, 42, 7, 5]
    cpu = LLM(ckpts[mt]).prompt_logprobs(ids)
    gpu = LLM(ckpts[mt], device="cuda").prompt_logprobs(ids)
    assert gpu.device.type == "cpu" and gpu.shape == cpu.shape
    torch.testing.assert_close(gpu, cpu, atol=2e-3, rtol=1e-3)  # fp32 on both; TF32 is off by default in torch


def test_int4_on_the_gpu_is_the_cpu_int4(ckpts):
    ids = [3, 9, 27, 81, 14, 42, 7, 5]
    gpu = LLM(ckpts["llama"], dtype="bfloat16", weight_bits=4, group_size=32, device="cuda")
    backends = {m.backend for m in gpu.model.modules() if type(m).__name__ == "Int4Weight"}
    assert backends == {"cuda_tinygemm"}
    cpu = LLM(ckpts["llama"], dtype="bfloat16", weight_bits=4, group_size=32)
    torch.testing.assert_close(gpu.prompt_logprobs(ids), cpu.prompt_logprobs(ids), atol=0.1, rtol=0.05)
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(gpu.generate(PROMPTS, p)[0].token_ids) == 8
