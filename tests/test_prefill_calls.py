"""A step's prefill chunks of different lengths share one padded model call where every cache is a full-attention
token cache (LocalRunner._prefill_calls), and give the logits and tokens of each chunk run alone; sliding windows and
recurrent states keep one call per length."""

import itertools

import pytest
import torch

import tiny_models
from conftest import tiny_checkpoints
from server_helpers import run_to_end
from waferline import LLM, SamplingParams
from waferline.engine.runner import WANT_LOGITS, WANT_NONE, DecodeRow, LocalRunner, PrefillChunk
from waferline.engine.scheduler import Scheduler, SchedulerConfig, Sequence

ARCHS = ("llama", "deepseek_v3", "gpt_oss", "bamba")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, ARCHS)


def _prompt(n: int, salt: int, V: int) -> list[int]:
    return [(7 * i + 11 * salt + 3) % V for i in range(n)]


def _run(model, batch: bool, calls: list) -> list[torch.Tensor]:
    """Three steps of prefill chunks (three prompts of 7, 5 and 3 tokens; then row 0's next 4 tokens beside a fourth
    prompt of 6, a chunk that does not end its prompt among them; then prompts of 3 and 2 tokens, few enough rows for
    the fused CPU attention ops), then four decode steps of all rows: every row's logits."""
    V = model.spec.vocab_size
    r = LocalRunner(model, 6)
    r.batch_prefills = batch
    real = r._prefill_calls
    r._prefill_calls = lambda pre: calls.append([[len(pre[i].tokens) for i in idx] for idx, _ in real(pre)]) or \
        real(pre)
    p = [_prompt(n, s, V) for s, n in enumerate((11, 5, 3, 6))]
    out = []
    _, pre = r.step([], [PrefillChunk(0, 0, p[0][:7], WANT_NONE), PrefillChunk(1, 0, p[1], WANT_LOGITS),
                         PrefillChunk(2, 0, p[2], WANT_LOGITS)])
    out += [o.logits for o in pre[1:]]
    assert pre[0] is None
    _, pre = r.step([], [PrefillChunk(3, 0, p[3], WANT_LOGITS), PrefillChunk(0, 7, p[0][7:], WANT_LOGITS)])
    out += [o.logits for o in pre]
    _, pre = r.step([], [PrefillChunk(4, 0, p[2][:3], WANT_LOGITS), PrefillChunk(5, 0, p[1][:2], WANT_LOGITS)])
    out += [o.logits for o in pre]
    pos = [11, 5, 3, 6, 3, 2]
    tok = [int(x.argmax()) for x in (out[3], out[0], out[1], out[2], out[4], out[5])]
    for _ in range(4):
        dec, _ = r.step([DecodeRow(s, pos[s], tok[s], WANT_LOGITS) for s in range(6)], [])
        out += [o.logits for o in dec]
        tok = [int(o.logits.argmax()) for o in dec]
        pos = [x + 1 for x in pos]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_prefill_calls_give_each_chunks_own_logits(ckpts, arch):
    model = LLM(ckpts[arch]).model
    lone, joint = [], []
    want = _run(model, False, lone)
    got = _run(model, True, joint)
    assert all(len(c) == 1 for step in lone for c in step)
    mixed = any(len(set(c)) > 1 for step in joint for c in step)
    assert mixed == (arch in ("llama", "deepseek_v3"))  # a window or a recurrent state: one call per length
    if mixed:
        assert joint[0] == [[7, 5], [3]]  # (3 with them: past the padding slack)
        assert joint[2] == [[3, 2]]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_served_prompts_of_different_lengths_equal_generate(ckpts, arch):
    # the scheduler's managed page table: a padded position its row has no page for goes to the sink page
    llm = LLM(ckpts[arch])
    V = llm.model.spec.vocab_size
    prompts = [_prompt(n, s, V) for s, n in enumerate((13, 10, 21, 9, 12))]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, sp)]
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=4, max_model_len=64, page_tokens=8, chunk_tokens=16))
    calls = []
    real = sch.runner._prefill_calls
    sch.runner._prefill_calls = lambda pre: calls.append([[len(pre[i].tokens) for i in idx]
                                                          for idx, _ in real(pre)]) or real(pre)
    ids = itertools.count()
    got = run_to_end(sch, [Sequence(f"r{next(ids)}", p, sp) for p in prompts])
    assert got == want
    assert any(len(set(c)) > 1 for step in calls for c in step)  # (padded calls ran)
    assert sch.cache.table.live == 0


def test_pipeline_stages_merge_prefill_groups_of_different_lengths(ckpts):
    # stage 0 runs in this process: its merged calls are seen here; stage 1 merges the same groups in its own
    prompts = [_prompt(n, s, tiny_models.VOCAB) for s, n in enumerate((13, 10, 12, 9))]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(ckpts["llama"]).generate(prompts, sp)]
    with LLM(ckpts["llama"], stages=2, threads_per_stage=1, micro_batches=1) as llm:
        stage0 = llm._pipeline.runner
        merged = []
        real = stage0._merged

        def seen(mb, inputs):
            out = real(mb, inputs)
            merged.append(out is not None)
            return out

        stage0._merged = seen
        got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    assert any(merged)
