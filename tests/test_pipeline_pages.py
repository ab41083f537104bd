"""The scheduler over a pipeline: the stages' paged caches follow the scheduler's page table (so a prefix the scheduler
shares is shared in every stage process, copy-free), and a speculative step's plain rows ride the verify's trip."""

import dataclasses
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import tiny_models
from server_helpers import run_to_end
from waferline import LLM, SamplingParams
from waferline.engine.runner import DecodeRow, PrefillChunk
from waferline.engine.scheduler import Scheduler, SchedulerConfig, runner_for
from waferline.engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("pipeline-pages")
    out = {}
    for mt in ("deepseek_v3", "llama", "nemotron_h"):  # MLA latents, GQA: every layer paged; a Mamba-2 hybrid
        tiny_models.build(mt, tmp / mt)
        out[mt] = tmp / mt
    return out


def _seq(rid: str, prompt: list[int]) -> Sequence:
    return Sequence(rid, prompt, GREEDY)


_AFD1 = dict(afd=True, attention_ranks=1, ffn_ranks=2, threads_per_rank=1)


@pytest.mark.parametrize("mt,engine", [("deepseek_v3", dict(stages=2, threads_per_stage=1)),
                                       ("llama", dict(stages=2, threads_per_stage=1)),
                                       ("deepseek_v3", _AFD1)], ids=["mla-pipeline", "gqa-pipeline", "mla-afd"])
def test_a_prefix_shared_by_page_in_every_stage(ckpts, mt, engine):
    """B starts with A's first 24 tokens: after A finishes, B's first pages are A's stored pages (no copy, in the
    scheduler's table, which every stage follows, or AFD's one attention rank) and only B's rest is computed; B's
    tokens are the single-process engine's. O runs in between, in A's slot: a stage that allocated pages of its own
    would hand A's pages to O, and B would read O's keys (checked: such a stage gives B other tokens)."""
    base = [(7 * j + 3) % tiny_models.VOCAB for j in range(26)]
    a, b, o = base + [5, 9], base[:24] + [11, 12, 13], [(5 * j + 2) % tiny_models.VOCAB for j in range(30)]
    want = [o.token_ids for o in LLM(ckpts[mt]).generate([a, o, b], GREEDY)]
    with LLM(ckpts[mt], **engine) as llm:
        cfg = SchedulerConfig(max_num_seqs=4, max_model_len=128, page_tokens=8, prefix_caching=True)
        sch = Scheduler(llm, cfg, runner_for(llm, 4))
        assert sch.prefix is not None and sch.runner.prefix_caches() == []
        got = run_to_end(sch, [_seq("a", a)]) + run_to_end(sch, [_seq("o", o)])
        stored = [sch.prefix.page_of(blk) for blk in sch.prefix.match(b)]
        assert len(stored) == 3 and sch.prefix.hit_tokens == 0  # 24 tokens of 8-token pages; O shares nothing
        sb = _seq("b", b)
        sch.add(sb)
        sch.step()  # admitted with the prefix hit: only B's last 3 tokens are prefilled
        assert sch.prefix.hit_tokens == 24 and sch.cache.table.slots[sb.slot][:3] == stored
        assert all(sch.cache.table.refs[p] == 1 and sch.cache.table.stored[p] for p in stored)
        while sch.has_work():
            sch.step()
        assert got + [sb.output_ids] == want


def test_afd_over_two_attention_ranks_shares_prefixes_on_the_rank_that_holds_them(ckpts):
    """Two attention ranks: slot i lives on rank i % 2 and takes pages from that rank's part of the scheduler's table
    (odd ids rank 0, even ids rank 1; each rank knows them as its own 1, 2, ...). A and C run side by side (A on rank
    0, C on rank 1); O and P then run on both ranks in their slots. B starts with C's first 24 tokens: it goes to rank
    1, which holds them (by free slots alone it would go to rank 0), gets those very pages, and computes only its
    rest; every output is the single process's (checked: placing B by free slots alone fails this test)."""
    base = [(7 * j + 3) % tiny_models.VOCAB for j in range(26)]
    a, c = [(3 * j + 1) % tiny_models.VOCAB for j in range(27)], base + [5, 9]
    o, p = [(5 * j + 2) % tiny_models.VOCAB for j in range(30)], [(11 * j + 4) % tiny_models.VOCAB for j in range(25)]
    b = base[:24] + [11, 12, 13]
    want = [x.token_ids for x in LLM(ckpts["deepseek_v3"]).generate([a, c, o, p, b], GREEDY)]
    with LLM(ckpts["deepseek_v3"], **dict(_AFD1, attention_ranks=2, ffn_ranks=1)) as llm:
        cfg = SchedulerConfig(max_num_seqs=4, max_model_len=128, page_tokens=8, prefix_caching=True)
        sch = Scheduler(llm, cfg, runner_for(llm, 4))
        t = sch.cache.table
        assert sch.prefix is not None and t.parts == 2
        sa, sc = _seq("a", a), _seq("c", c)
        got = run_to_end(sch, [sa, sc]) + run_to_end(sch, [_seq("o", o), _seq("p", p)])
        assert (sa.slot % 2, sc.slot % 2) == (0, 1)
        stored = [sch.prefix.page_of(blk) for blk in sch.prefix.match(b, 1)]
        assert len(stored) == 3 and all(t.owner(q) == 1 for q in stored) and not sch.prefix.match(b, 0)
        sb = _seq("b", b)
        sch.add(sb)
        sch.step()
        assert sb.slot % 2 == 1 and sch.prefix.hit_tokens == 24 and t.slots[sb.slot][:3] == stored
        while sch.has_work():
            sch.step()
        assert got + [sb.output_ids] == want
        rank0 = sch.runner.pipe.runner.rt.table  # attention rank 0's own table: local ids of its part's pages
        assert 1 < rank0.num_pages <= 1 + t._made[0]


def test_afd_over_two_attention_ranks_preempts_within_a_rank(ckpts):
    """A cache budget split over two attention ranks, 9 pages of 8 tokens each: six prompts with four slots finish
    with the single process's tokens. Rank 0's two sequences (28 and 27 prompt tokens) outgrow its pages first: the
    scheduler preempts one of them (the one admitted first), not rank 1's sequences admitted later, whose pages would
    not help (checked: without that preference three sequences are preempted). A budget whose per-rank share cannot
    hold one sequence is refused with a clear error."""
    from waferline.errors import ConfigError

    prompts = [[(3 * j + i) % tiny_models.VOCAB for j in range(n)] for i, n in enumerate([28, 25, 27, 26, 24, 23])]
    want = [x.token_ids for x in LLM(ckpts["deepseek_v3"]).generate(prompts, GREEDY)]
    with LLM(ckpts["deepseek_v3"], **dict(_AFD1, attention_ranks=2, ffn_ranks=1)) as llm:
        probe = Scheduler(llm, SchedulerConfig(max_num_seqs=4, max_model_len=64, page_tokens=8), runner_for(llm, 4))
        page = probe.cache.paged_page_bytes
        cfg = SchedulerConfig(max_num_seqs=4, max_model_len=64, page_tokens=8, cache_bytes=2 * 9 * page)
        sch = Scheduler(llm, cfg, runner_for(llm, 4))
        assert sch.cache.table.part_pages == 9
        assert run_to_end(sch, [_seq(str(i), q) for i, q in enumerate(prompts)]) == want
        assert sch.stats["preemptions"] == 1
        with pytest.raises(ConfigError, match="attention ranks"):
            Scheduler(llm, dataclasses.replace(cfg, cache_bytes=12 * page), runner_for(llm, 4))


@pytest.mark.parametrize("engine", [dict(stages=2, threads_per_stage=1), dict(_AFD1, attention_ranks=2, ffn_ranks=1)],
                         ids=["pipeline", "afd"])
def test_the_processes_pools_hold_the_pages_the_budget_pays_for(ckpts, engine):
    """The scheduler bounds its page table once it has attached it: a stage's (an attention rank's) paged pools are
    made that size, as in one process (9 pages a part and the sink), not grown by doubling to 16 or more pages, which
    would hold up to twice the cache budget (checked: without the bound they reach 18)."""
    from waferline.model.attention import TokenCache

    prompts = [[(3 * j + i) % tiny_models.VOCAB for j in range(n)] for i, n in enumerate([28, 25, 27, 26])]
    want = [x.token_ids for x in LLM(ckpts["deepseek_v3"]).generate(prompts, GREEDY)]
    with LLM(ckpts["deepseek_v3"], **engine) as llm:
        parts = engine.get("attention_ranks", 1)
        probe = Scheduler(llm, SchedulerConfig(max_num_seqs=4, max_model_len=64, page_tokens=8), runner_for(llm, 4))
        cfg = SchedulerConfig(max_num_seqs=4, max_model_len=64, page_tokens=8,
                              cache_bytes=parts * 9 * probe.cache.paged_page_bytes)
        sch = Scheduler(llm, cfg, runner_for(llm, 4))
        assert sch.cache.table.part_pages == 9
        assert run_to_end(sch, [_seq(str(i), q) for i, q in enumerate(prompts)]) == want
        rt = sch.runner.pipe.runner
        pools = [c.data.shape[0] for c in getattr(rt, "rt", rt).caches if isinstance(c, TokenCache) and c.paged]
        assert pools and set(pools) == {10}, pools


def test_afd_over_two_attention_ranks_evicts_only_the_prefix_pages_of_the_rank_that_needs_room(ckpts):
    """Two attention ranks of 4 pages each: A (rank 0) and B (rank 1) run together and their 3 pages each stay
    stored, B's (which ends first) less recently used. D, on rank 0, needs 4 pages: rank 0's own stored pages are
    evicted, not B's (they give rank 0 no room). E, B's prompt and one token more, then goes to rank 1 and shares B's
    3 pages, needing 1 page of its own: nothing of B's is evicted for it (checked: B's pages were evicted for D, and,
    once not, for E itself, which then computed its whole prompt). Every output is the single process's."""
    a, b, d = list(range(10, 22)), list(range(30, 42)), list(range(50, 65))
    e = b + [5]
    one, three = SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True)
    want = [x.token_ids for x in LLM(ckpts["deepseek_v3"]).generate([a, b, d, e], [three, one, one, one])]
    with LLM(ckpts["deepseek_v3"], **dict(_AFD1, attention_ranks=2, ffn_ranks=1)) as llm:
        cfg = SchedulerConfig(max_num_seqs=2, max_model_len=16, page_tokens=4)
        cfg.cache_bytes = 8 * Scheduler(llm, cfg, runner_for(llm, 2)).cache.paged_page_bytes
        sch = Scheduler(llm, cfg, runner_for(llm, 2))
        t = sch.cache.table
        seqs = {k: Sequence(k, q, three if k == "a" else one) for k, q in zip("abde", (a, b, d, e))}
        got = run_to_end(sch, [seqs["a"], seqs["b"]])
        assert (seqs["a"].slot % 2, seqs["b"].slot % 2) == (0, 1) and t.store_only_in == [3, 3]
        got += run_to_end(sch, [seqs["d"]])
        assert seqs["d"].slot % 2 == 0 and sch.prefix.evicted_pages == 3 and t.store_only_in == [3, 3]
        got += run_to_end(sch, [seqs["e"]])
        assert seqs["e"].slot % 2 == 1 and seqs["e"].cached_tokens == 12 and sch.prefix.evicted_pages == 3
        assert got == want and t.live == 0


def test_serve_afd_over_two_attention_ranks_shares_a_prefix(ckpts):
    """`serve --afd --attention-ranks 2` through the openai client: A and C run together (on the two ranks), then B,
    which starts with C's first 24 tokens, is served partly from C's cached pages (the hit-token metric counts them)
    with the single process's tokens."""
    import httpx
    import openai

    from server_helpers import serve_in_thread
    from waferline.server.commands import build_server

    base = [(7 * j + 3) % tiny_models.VOCAB for j in range(26)]
    a, c, b = [(3 * j + 1) % tiny_models.VOCAB for j in range(27)], base + [5, 9], base[:24] + [11, 12, 13]
    want = [x.token_ids for x in LLM(ckpts["deepseek_v3"]).generate([a, c, b], GREEDY)]
    app = build_server(ckpts["deepseek_v3"], max_num_seqs=4, max_model_len=128, page_tokens=8,
                       afd=True, attention_ranks=2, ffn_ranks=1)
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        name = client.models.list().data[0].id

        def ids(prompt: list[int]) -> list[int]:
            out = client.completions.create(model=name, prompt=prompt, max_tokens=GREEDY.max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            return out.choices[0].model_extra["token_ids"]

        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(ids, [a, c]))
        got.append(ids(b))
        hits = [ln for ln in httpx.get(url + "/metrics").text.splitlines()
                if ln.startswith("waferline_prefix_cache_hit_tokens_total ")]
    assert got == want
    assert float(hits[0].split()[1]) == 24


def test_caches_not_made_of_pages_keep_prefixes_off(ckpts):
    """A Mamba-2 hybrid: its recurrent state is not a per-token prefix, so the pipeline's runner offers no prefix
    caches (the attention layers' pages still follow the scheduler's table) and outputs are the single process's."""
    prompts = [[(3 * j + i) % tiny_models.VOCAB for j in range(10 + i)] for i in range(3)]
    want = [o.token_ids for o in LLM(ckpts["nemotron_h"]).generate(prompts, GREEDY)]
    with LLM(ckpts["nemotron_h"], layers_per_stage=2, threads_per_stage=1) as llm:
        sch = Scheduler(llm, SchedulerConfig(max_num_seqs=4, max_model_len=128, page_tokens=8), runner_for(llm, 4))
        assert sch.prefix is None and sch.runner.prefix_caches() is None and sch.cache.table is not None
        assert run_to_end(sch, [_seq(str(i), p) for i, p in enumerate(prompts)]) == want


def test_the_scheduler_pages_match_every_model_kind(tmp_path):
    """The layers the pipeline's runner counts as paged are exactly those whose caches the model makes in pages, for
    every supported model type (the scheduler's page accounting and prefix sharing rely on it)."""
    from waferline.engine.pipeline.serving import _paged_mixer
    from waferline.model.attention import TokenCache
    from waferline.model.load import load_model

    for mt in tiny_models.configs():
        tiny_models.build(mt, tmp_path / mt)
        model = load_model(tmp_path / mt, torch.float32)
        real = [isinstance(c, TokenCache) and c.paged for c in model.new_caches(1)]
        assert real == [_paged_mixer(layer.mixer) for layer in model.spec.layers], mt


def test_afd_speculates_through_the_scheduler(ckpts):
    """``LLM(afd=True, speculative=...)``: the scheduler drafts and verifies through the attention and FFN ranks (a
    verify, then the step's plain rows); greedy tokens are the single-process engine's."""
    prompts = [[7, 8, 9, 10, 11, 12] * 3, [(5 * j + 1) % tiny_models.VOCAB for j in range(9)]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in LLM(ckpts["deepseek_v3"]).generate(prompts, params)]
    with LLM(ckpts["deepseek_v3"], afd=True, attention_ranks=1, ffn_ranks=2, threads_per_rank=1,
             speculative="ngram", num_speculative_tokens=3, speculative_adaptive=False) as llm:
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == want and outs[0].metrics["spec_drafted"] > 0


@pytest.mark.parametrize("engine", [dict(stages=2, threads_per_stage=1),
                                    dict(afd=True, attention_ranks=2, ffn_ranks=1, threads_per_rank=1)],
                         ids=["pipeline", "afd"])
def test_plain_rows_ride_the_verify_trip(ckpts, engine):
    """n-gram speculation over 2 stages (or 2 attention ranks and an FFN rank) with one prompt that repeats itself (it
    drafts) beside others that do not: steps that verify some sequences and decode others send both in one trip (the
    runner's verify, or a pipeline's submit of a step in flight, is given the step's decode rows; AFD: verify groups
    and plain groups in the same micro-batches), and the tokens are the single-process engine's."""
    sys.path.insert(0, str(Path(__file__).parent))
    prompts = [[7, 8, 9, 10, 11, 12] * 4, [(5 * j + 1) % tiny_models.VOCAB for j in range(9)],
               [(3 * j + 2) % tiny_models.VOCAB for j in range(13)]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in LLM(ckpts["llama"]).generate(prompts, params)]
    with LLM(ckpts["llama"], speculative="ngram", num_speculative_tokens=3, speculative_adaptive=False,
             **engine) as llm:
        runner = llm._engine(len(prompts)).runner
        seen = []
        if getattr(runner, "overlap", False) and getattr(runner, "verify_in_flight", False):
            submit = runner.submit

            def counting(decodes, prefills, verifies=(), parts=None):
                seen.append((len(verifies), len(decodes) + len(prefills)))
                return submit(decodes, prefills, verifies, parts)

            runner.submit = counting
        else:
            verify = runner.verify

            def counting(rows, decodes=(), prefills=()):
                seen.append((len(rows), len(decodes) + len(prefills)))
                return verify(rows, decodes, prefills)

            runner.verify = counting
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
        assert any(v > 0 and p > 0 for v, p in seen), seen
        assert outs[0].metrics["spec_accepted"] > 0


def test_adaptive_k_prices_a_step_in_flight_by_its_own_launch_and_wait(ckpts):
    """Over a pipeline with steps in flight, adaptive K prices a step by the time its launch took (stage 0's layers
    run in the scheduler's process) and the time spent waiting for its answers, not by its time in flight, which
    counted the launches (and drafting) of the steps around it: a plain step beside a verify looked as dear as the
    verify, so K kept drafting where verifies cost 3-4x a plain step (8 rows on 2 stages ran at 0.4-0.55x plain
    decoding). Here a verify's launch is made 50 ms dearer: plain steps must still measure far below it."""
    import time

    prompts = [[7, 8, 9, 10, 11, 12] * 4 for _ in range(4)]  # (they repeat themselves: the n-grams draft)
    with LLM(ckpts["llama"], speculative="ngram", num_speculative_tokens=3, stages=2, micro_batches=2) as llm:
        runner = llm._engine(len(prompts)).runner
        submit = runner.submit

        def slow(decodes, prefills, verifies=(), parts=None):
            if verifies:
                time.sleep(0.05)
            return submit(decodes, prefills, verifies, parts)

        runner.submit = slow
        llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
        observed = dict(llm._spec.ctl.observed)
    plain = [v for (_, t), v in observed.items() if t == 1]
    verify = [v for (_, t), v in observed.items() if t > 1]
    assert plain and verify, observed
    assert max(plain) < 0.025 and min(verify) >= 0.05, observed


def _hand_a_page_over(runner) -> torch.Tensor:
    """X (slot 0) and A (slot 1) decode a token each, one row per step (their pages are not consecutive: each row goes
    through a staging copy whose entries reach the pages later); A ends, C takes its slot, and X grows into A's last
    page, where X then decodes two tokens before C's prompt runs. The logits of X's next token."""
    t = runner.block_table(2)
    for slot, n in ((0, 2), (1, 2), (0, 4), (1, 4)):  # X: pages 1 and 3, A: pages 2 and 4
        t.grow(slot, n)
    runner.reset_slots([0, 1])
    runner.step([], [PrefillChunk(0, 0, [5, 6, 7]), PrefillChunk(1, 0, [9, 10, 11])])
    runner.step([DecodeRow(0, 3, 8)], [])
    runner.step([DecodeRow(1, 3, 12)], [])  # A's entry at position 3: page 4
    t.release(1)  # A ends; C takes slot 1 (A's pages are free again: C gets page 2), X grows into page 4
    t.grow(1, 2)
    t.grow(0, 6)
    runner.step([DecodeRow(0, 4, 20)], [])
    runner.step([DecodeRow(0, 5, 21)], [])  # X's position 5: where A's position 3 was, in page 4
    runner.reset_slots([1])
    runner.step([], [PrefillChunk(1, 0, [13, 14])])
    t.grow(0, 8)
    decoded, _ = runner.step([DecodeRow(0, 6, 22)], [])
    return decoded[0].logits


@pytest.mark.parametrize("engine", [dict(stages=2, micro_batches=2, threads_per_stage=1), _AFD1], ids=["pipeline",
                                                                                                      "afd"])
def test_a_page_that_changes_hands_holds_its_new_slots_entries(ckpts, engine):
    """A slot whose sequence ended and whose slot a new one took before the processes heard of it: they are told of
    the old sequence's end before another slot's rows use its pages, so what they held of its rows (entries not yet
    written to its pages) goes to those pages first, not over the new owner's entries later (checked: telling them
    only with the new sequence's pages gives X other logits). X's logits are the single process's, page for page."""
    want = _hand_a_page_over(runner_for(LLM(ckpts["llama"]), 2))
    with LLM(ckpts["llama"], **engine) as llm:
        got = _hand_a_page_over(runner_for(llm, 2))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
