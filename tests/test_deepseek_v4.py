"""DeepSeek-V4 (compressed sparse / heavily compressed attention, hyper-connections, hash-routed MoE) against the
transformers reference on prompts far past every window, ratio and top-k of the tiny config (sliding window 6, CSA
ratio 4 with top-2 entries, HCA ratio 8): prefill, chunked prefill, batched decode, the cache's contents, and the
ModelSpec's accounting of the bytes the caches hold."""

import pytest
import torch

from server_helpers import run_to_end
from tiny_models import build, configs, decode_logits
from waferline import LLM, SamplingParams
from waferline.engine.paging import CacheManager
from waferline.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from waferline.model.context import StepBatch

LONG = [1] + [(7 * i * i + 3 * i + 5) % 125 + 3 for i in range(69)]  # 70 tokens: 17 CSA entries, 8 HCA entries
SHORT = LONG[5:46]  # 41 tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek_v4")
    return d, build("deepseek_v4", d)


@pytest.fixture(scope="module")
def pair(checkpoint):
    return checkpoint[1], LLM(checkpoint[0])


def _ref_logprobs(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_long_prompt_logprobs_match(pair):
    ref, llm = pair
    want = _ref_logprobs(ref, LONG)
    got = llm.prompt_logprobs(LONG)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4


def test_chunked_prefill_matches_the_whole_prompt(pair):
    """Chunk edges inside compression windows: the open window and CSA's overlap carry over between calls."""
    ref, llm = pair
    model, caches, hs, s = llm.model, llm.model.new_caches(1), [], 0
    with torch.no_grad():
        for n in (13, 30, 1, 26):
            hs.append(model(torch.tensor([LONG[s: s + n]]), caches, StepBatch.make([0], [s], n))[0])
            s += n
        got = torch.log_softmax(model.logits(torch.cat(hs)), dim=-1)
    assert (got - _ref_logprobs(ref, LONG)).abs().max().item() < 1e-4


def test_batched_decode_logits_match_reference(pair):
    """Two rows of different lengths decode together; the reference decodes each alone through its cache."""
    ref, llm = pair
    prompts, steps = [LONG, SHORT], 9
    with torch.no_grad():
        got = torch.log_softmax(decode_logits(llm.model, prompts, [1, 0], 2, steps=steps), dim=-1)  # [steps+1, B, V]
        for b, p in enumerate(prompts):
            out = ref(torch.tensor([p]), use_cache=True)
            want = [out.logits[0, -1]]
            for i in range(steps):
                tok = int(got[i, b].argmax())
                out = ref(torch.tensor([[tok]]), cache=out.cache, use_cache=True,
                          position_ids=torch.tensor([[len(p) + i]]))
                want.append(out.logits[0, -1])
            want = torch.log_softmax(torch.stack(want).float(), dim=-1)
            assert (got[:, b] - want).abs().max().item() < 1e-4, b


def test_cache_holds_what_the_reference_holds(pair):
    """After a prefill and a few decode steps: the same window rows, compressed entries, indexer keys, open window
    and overlap as the reference's cache layers."""
    ref, llm = pair
    model, caches = llm.model, llm.model.new_caches(1)
    ids = LONG[:43]
    with torch.no_grad():
        out = ref(torch.tensor([ids[:38]]), use_cache=True)
        model(torch.tensor([ids[:38]]), caches, StepBatch.make([0], [0], 38))
        for t in range(38, 43):
            out = ref(torch.tensor([[ids[t]]]), cache=out.cache, use_cache=True, position_ids=torch.tensor([[t]]))
            model(torch.tensor([[ids[t]]]), caches, StepBatch.make([0], [t], 1))
    types = configs()["deepseek_v4"]["layer_types"]
    for i, (mine, theirs) in enumerate(zip(caches, out.cache.layers)):
        torch.testing.assert_close(mine.window[0], theirs.keys[0, 0])
        assert mine.window[0].shape[0] == configs()["deepseek_v4"]["sliding_window"] - 1
        if types[i] == "sliding_attention":
            assert mine.kv[0] is None and mine.index[0] is None
            continue
        pairs = [(mine.kv[0], "compressor")] + ([(mine.index[0], "indexer")] if mine.index[0] is not None else [])
        for series, name in pairs:
            torch.testing.assert_close(series.entries, theirs.compressed_kv[name][0])
            torch.testing.assert_close(series.pending_kv, theirs.buffer_kv[name][0])
            torch.testing.assert_close(series.pending_gate, theirs.buffer_gate[name][0])
            if hasattr(theirs, "overlap_kv"):
                torch.testing.assert_close(series.overlap_kv, theirs.overlap_kv[name][0])
                torch.testing.assert_close(series.overlap_gate, theirs.overlap_gate[name][0])
        assert (mine.index[0] is not None) == (types[i] == "compressed_sparse_attention")


@pytest.mark.parametrize("dtype,bits", [("float32", 32), ("bfloat16", 16)])
def test_cache_bytes_equal_the_modelspec(checkpoint, dtype, bits):
    """Per layer, at lengths below, at and past every window and ratio (open windows of every size)."""
    llm = LLM(checkpoint[0], dtype=dtype)
    model, spec = llm.model, llm.spec
    for length in (1, 3, 5, 8, 13, 29, 44, 70):
        caches = model.new_caches(2)
        with torch.no_grad():
            model(torch.tensor([LONG[:length]]), caches, StepBatch.make([1], [0], length))
        for cache, layer in zip(caches, spec.layers):
            assert cache.bytes_held(1) == layer.cache_bytes_per_seq(length, bits, bits), (length, layer.index)
            assert cache.bytes_held(0) == 0
        assert sum(c.bytes_held(1) for c in caches) == spec.cache_bytes_per_seq(length, bits, bits)


def test_cache_grows_by_the_modelspec_bytes_per_token(pair):
    """Past the window, between lengths with the same open window: growth per token = cache_bytes_per_token."""
    _, llm = pair
    held = {}
    for n in (22, 70):  # (70 - 22 = 48 tokens: whole CSA and HCA windows)
        caches = llm.model.new_caches(1)
        with torch.no_grad():
            llm.model(torch.tensor([LONG[:n]]), caches, StepBatch.make([0], [0], n))
        held[n] = sum(c.bytes_held(0) for c in caches)
    per_token = llm.spec.cache_bytes_per_token(32)
    assert per_token == 2 * (32 + 16) * 4 / 4 + 32 * 4 / 8  # two CSA layers (kv + index key per 4), one HCA (per 8)
    assert (held[70] - held[22]) / 48 == per_token


def test_the_scheduler_counts_what_the_caches_hold(pair):
    """The scheduler's budget covers V4 caches: the compressed entries a page of tokens adds, and per sequence every
    layer's window and compressor state at their largest, never less than the ModelSpec's bytes at any length so
    far; served under a budget of two sequences, the caches never hold more than the budget (the sliding-window
    layer went uncounted and the entries were paged as if each token cached one: four sequences ran at once, holding
    14x the budget)."""
    _, llm = pair
    page, mml = 8, 64
    one = CacheManager(llm.spec, 1, mml, page, kv_bits=32, state_bits=32)
    most = 0.0
    for n in range(1, mml + 1):
        most = max(most, llm.spec.cache_bytes_per_seq(n, 32, 32))
        assert one.bytes_for(n) >= most, n
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=4, max_model_len=mml, page_tokens=page,
                                         cache_bytes=2 * one.bytes_for(mml), prefix_caching=False))
    caches, cm, real, seen = sch.runner.caches, sch.cache, sch.runner.step, []

    def step(decodes, prefills):
        out = real(decodes, prefills)
        held = sum(c.bytes_held(s) for c in caches for s in range(4))
        seen.append((held, cm.used_bytes, len(decodes) + len(prefills)))
        return out

    sch.runner.step = step
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    out = run_to_end(sch, [Sequence(f"r{i}", LONG[i: i + 44], sp) for i in range(4)])
    assert all(len(t) == 20 for t in out)
    assert all(held <= used <= cm.budget for held, used, _ in seen)
    assert max(rows for _, _, rows in seen) == 2


def test_the_indexer_choice_matters(tmp_path):
    """The tiny config's top-2 keeps fewer entries than a long prompt has: attending to all of them differs (so the
    tests above check the indexer's selection, not only dense attention over the entries)."""
    sparse = _ref_logprobs(build("deepseek_v4", tmp_path / "a"), LONG)
    dense = _ref_logprobs(build("deepseek_v4", tmp_path / "b", index_topk=64), LONG)
    assert (sparse - dense).abs().max().item() > 1e-3
