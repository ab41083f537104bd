"""A pipeline's stages and AFD's ranks convert their weights on load as the single-process engine does: int4 (RTN)
on a 16-bit checkpoint with ``weight_bits=4``, the LM head in int8 with ``head_bits=8`` (the last stage's, the attention
ranks'), the MTP drafter's head in int4 where the layers are; the same weights give the same tokens and log-probs (both
options were refused: `serve --stages 2 --weight-bits 4` needed a `waferline quantize` first, and `--head-bits 8` and
AFD's int4 were single-process only)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tiny_models
from waferline import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
CONVERT = {"weight_bits": 4, "group_size": 32, "head_bits": 8}


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    d = tmp_path_factory.mktemp("convert") / "dsv3"
    tiny_models.build("deepseek_v3", d)  # MLA + MoE, two layers: one per stage
    return d


def _prompts(vocab: int) -> list[list[int]]:
    return [[(i * 7 + j * 3 + 1) % vocab for j in range(n)] for i, n in enumerate([5, 23, 3, 11])]


GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(dsv3):
    """The single-process engine's answers with CONVERT: greedy and seeded tokens, a prompt's log-probs."""
    one = LLM(dsv3, **CONVERT)
    prompts = _prompts(one.spec.vocab_size)
    return {"prompts": prompts, "greedy": [o.token_ids for o in one.generate(prompts, GREEDY)],
            "sampled": [o.token_ids for o in one.generate(prompts, SAMPLED)], "lp": one.prompt_logprobs(prompts[1])}


def _answers_as(llm, ref) -> None:
    assert [o.token_ids for o in llm.generate(ref["prompts"], GREEDY)] == ref["greedy"]
    assert [o.token_ids for o in llm.generate(ref["prompts"], SAMPLED)] == ref["sampled"]
    diff = (llm.prompt_logprobs(ref["prompts"][1]) - ref["lp"]).abs().max().item()
    assert diff < 1e-4, f"prompt log-probs differ by {diff:.2e}"


def test_a_pipeline_quantizes_its_stages_on_load_as_one_process_does(dsv3, reference):
    plain = [o.token_ids for o in LLM(dsv3).generate(reference["prompts"], GREEDY)]
    assert plain != reference["greedy"]  # (int4 weights and an int8 head answer otherwise: the check can fail)
    with LLM(dsv3, stages=2, threads_per_stage=1, **CONVERT) as llm:
        _answers_as(llm, reference)


def test_afd_ffn_ranks_multiply_int4_in_the_load_dtype(dsv3, reference):
    """float16 with weight_bits=4: an FFN rank's int4 experts (RTN on load) multiply in float16 as one process's do
    (they ran in bfloat16, as the blocks carry no dtype of their own: prompt log-probs 1.6 apart)."""
    one = LLM(dsv3, dtype="float16", **CONVERT)
    prompts = reference["prompts"]
    want, want_lp = [o.token_ids for o in one.generate(prompts, GREEDY)], one.prompt_logprobs(prompts[1])
    with LLM(dsv3, dtype="float16", afd=True, ffn_ranks=2, micro_batches=1, threads_per_rank=1, **CONVERT) as llm:
        diff = (llm.prompt_logprobs(prompts[1]) - want_lp).abs().max().item()
        assert diff < 1e-3, f"prompt log-probs differ by {diff:.2e}"
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_a_pipelines_mtp_drafter_takes_the_int8_head_and_int4_layers(tmp_path):
    """With MTP speculation the pipeline's drafter (loaded apart from the stages) drafts with the same weights as the
    single-process engine's: a seeded sampled request gets the same tokens."""
    from waferline.demo import SOL_DEMO_CONFIG
    from waferline.model.init import write_random_checkpoint

    cfg = dict(SOL_DEMO_CONFIG, num_hidden_layers=2, mixer_types=["mla", "mla"], ffn_types=["dense", "moe"],
               num_nextn_predict_layers=1)
    ck = write_random_checkpoint(cfg, tmp_path / "fp32")
    prompts = [[7, 8, 9, 10, 11, 12] * 3, list(range(40, 60))]
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    with LLM(ck, speculative="mtp", **CONVERT) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, sp)]
    for engine in ({"stages": 2, "threads_per_stage": 1}, {"afd": True, "ffn_ranks": 2, "threads_per_rank": 1}):
        with LLM(ck, speculative="mtp", **engine, **CONVERT) as llm:
            assert [o.token_ids for o in llm.generate(prompts, sp)] == ref, engine
            drafter = llm._spec.drafter.model
            assert drafter.lm_head is None and drafter.lm_head_int8 is not None  # (the int8 head, as the engine's)


def test_torchrun_ranks_convert_their_stages_from_the_same_flags(dsv3):
    """Under torchrun each rank >= 1 loads its stage from the command line: --weight-bits 4 --group-size 32
    --head-bits 8 reach it (rank 0 alone converting would give other tokens, or a shape error at the head)."""
    one = LLM(dsv3, **CONVERT)
    ids = _prompts(one.spec.vocab_size)[1]
    want = one.generate([ids], SamplingParams(max_tokens=8))[0].token_ids
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "waferline.cli", "generate", "--model", str(dsv3), "--prompt-ids", " ".join(map(str, ids)),
           "--max-tokens", "8", "--stages", "2", "--weight-bits", "4", "--group-size", "32",
           "--head-bits", "8", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"] == want


def test_a_stage_of_an_int4_checkpoint_keeps_the_layers_it_kept_16_bit(tmp_path):
    """An int4 checkpoint whose layer 0 was kept 16-bit (`waferline quantize --keep`) with weight_bits=4: the stage
    that holds only that layer keeps it 16-bit, as one process does (the stage took its slice for a 16-bit
    checkpoint and quantized it at the group size of weight_bits=4: other log-probs, other tokens)."""
    from waferline.model.quant import DEFAULT_KEEP, QuantOptions, is_int4
    from waferline.model.quant.write import quantize_checkpoint

    tiny_models.build("llama", tmp_path / "fp32")  # two layers: one per stage
    q = tmp_path / "int4"
    quantize_checkpoint(tmp_path / "fp32", q, QuantOptions(group_size=32, keep=(r"layers\.0\.", *DEFAULT_KEEP)))
    flags = {"weight_bits": 4, "head_bits": 8}  # (weight_bits=4 names what an int4 checkpoint loads as anyway)
    one = LLM(q, **flags)
    prompts = _prompts(one.spec.vocab_size)
    want, want_lp = [o.token_ids for o in one.generate(prompts, GREEDY)], one.prompt_logprobs(prompts[1])
    with LLM(q, stages=2, threads_per_stage=1, **flags) as llm:
        assert not is_int4(llm._pipeline.runner.model)  # (stage 0: layer 0 alone, 16-bit in the checkpoint)
        diff = (llm.prompt_logprobs(prompts[1]) - want_lp).abs().max().item()
        assert diff < 1e-4, f"prompt log-probs differ by {diff:.2e}"
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_a_4_bit_plan_quantizes_at_its_own_group_size(dsv3):
    """``LLM(path, plan=<4-bit plan, groups of 64>, weight_bits=4)`` on a 16-bit checkpoint quantizes at the plan's 64
    (it took LLM's default 128: the run was not the deployment the plan placed); another group size is refused."""
    from waferline.errors import ConfigError
    from waferline.model.quant.weight import Int4Weight
    from waferline.plan.plan import Plan, Stage
    from waferline.spec.configs import spec_from_pretrained

    n = spec_from_pretrained(dsv3).num_layers
    plan = Plan(model="dsv3", hardware="cpu", weight_bits=4, group_size=64,
                stages=[Stage(index=i, role="full", layers=[i], device="cpu", device_ids=[i]) for i in range(n)])
    with pytest.raises(ConfigError, match="group_size=32 but the plan places int4 weights in groups of 64"):
        LLM(dsv3, plan=plan, weight_bits=4, group_size=32)
    def groups(model) -> dict[str, int]:  # (stage 0's layer: layer 0)
        return {k: m.group_size for k, m in model.named_modules() if isinstance(m, Int4Weight) and "layers.0." in k}

    at = {g: groups(LLM(dsv3, weight_bits=4, group_size=g).model) for g in (64, 128)}
    assert at[64] != at[128]  # (the layer's widths tell the two apart: the check can fail)
    with LLM(dsv3, plan=plan, weight_bits=4, threads_per_stage=1) as llm:
        assert groups(llm._pipeline.runner.model) == at[64]


def test_afd_ranks_convert_their_parts_as_one_process_does(dsv3, reference):
    """AFD with ``weight_bits=4, head_bits=8`` (refused before: AFD ran 16-bit only): the attention ranks' mixers in
    int4 and their LM head in int8, each FFN rank's experts (a slice of each MoE layer) in int4: the single-process
    engine's tokens and log-probs with the same flags."""
    from waferline.model.quant import is_int4

    with LLM(dsv3, afd=True, attention_ranks=1, ffn_ranks=2, threads_per_rank=1, **CONVERT) as llm:
        model = llm._pipeline.runner.model
        assert is_int4(model) and model.lm_head is None and model.lm_head_int8 is not None
        _answers_as(llm, reference)
