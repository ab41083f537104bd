"""Paged full-attention caches (model/block_table.py, TokenCache with a table): the same numbers as slot-contiguous
caches, pages allocated by the scheduler's CacheManager, prefix hits that share pages instead of copying them, pages
that go back to the free list, and pool bytes that equal the ModelSpec accounting."""

import dataclasses
import itertools

import pytest
import torch

import waferline.model.attention as attention
from conftest import tiny_checkpoints
from server_helpers import run_to_end
from tiny_models import build
from waferline import LLM, SamplingParams
from waferline.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from waferline.model.attention import TokenCache
from waferline.model.block_table import BlockTable
from waferline.model.context import StepBatch

_INT4 = {"dtype": "bfloat16", "weight_bits": 4, "head_bits": 8, "group_size": 32}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = tiny_checkpoints(tmp_path_factory, ("llama", "deepseek_v3"))
    out["deepseek_v3:q"] = d = tmp_path_factory.mktemp("deepseek_v3_q")
    build("deepseek_v3", d, q_lora_rank=64)  # (int4 MLA layers with a q LoRA run as one op: staging copies)
    return out


def _caches(model, slots: int, page_tokens: int | None, monkeypatch) -> list:
    monkeypatch.setattr(attention, "PAGE_TOKENS", page_tokens)  # None: slot-contiguous full-attention caches
    caches = model.new_caches(slots)
    assert all(isinstance(c, TokenCache) and c.paged == (page_tokens is not None) for c in caches)
    return caches


@torch.inference_mode()
def _ragged_run(model, caches) -> list[torch.Tensor]:
    """Chunked prefill of three rows of different lengths (alone and two at once at different starts), then decode
    steps of the three rows together at ragged positions, a fourth row's prompt between two of them: every step's
    logits."""
    out = []
    V = model.spec.vocab_size
    prompts = [[(7 * i + 3) % V for i in range(n)] for n in (11, 3, 21)]
    for slot, (chunks, p) in enumerate(zip(([5, 5], [3], [8, 8]), prompts)):
        start = 0
        for n in chunks:
            h = model(torch.tensor([p[start:start + n]]), caches, StepBatch.make([slot], [start], n))
            out.append(model.logits(h[0, -1]))
            start += n
    # rows 0 and 2 go on together: 1 token of row 0 at 10, row 2's last 5 tokens at 16 (padded to one [2, 5] call)
    h = model(torch.tensor([p[10:11] * 5 for p in prompts[:1]] + [prompts[2][16:21]]), caches,
              StepBatch.make([0, 2], [10, 16], 5))
    out.append(model.logits(h[:, -1]))
    pos = [11 + 4, 3, 21]  # (row 0's 4 padding tokens are in its cache too: it goes on after them)
    tok = [[1], [2], [3]]
    for i in range(12):
        if i == 6:  # another sequence's prompt between two decode steps (the decode rows' staging copy stays)
            h = model(torch.tensor([prompts[2][:9]]), caches, StepBatch.make([3], [0], 9))
            out.append(model.logits(h[0, -1]))
        logits = model.step_logits(torch.tensor(tok), caches, StepBatch.make([0, 1, 2], pos, 1))[0][:, 0]
        out.append(logits)
        tok = logits.argmax(-1)[:, None].tolist()
        pos = [p + 1 for p in pos]
    return out


@pytest.mark.parametrize("arch,opts", [("llama", {}), ("deepseek_v3", {}), ("llama", _INT4), ("deepseek_v3:q", _INT4)],
                         ids=["gqa-fp32", "mla-fp32", "gqa-int4", "mla-int4"])
def test_paged_caches_give_the_contiguous_logits(ckpts, monkeypatch, arch, opts):
    model = LLM(ckpts[arch], **opts).model
    want = _ragged_run(model, _caches(model, 4, None, monkeypatch))
    for page in (4, 16):  # (4: the rows' pages interleave; decode reads them through the block table)
        caches = _caches(model, 4, page, monkeypatch)
        got = _ragged_run(model, caches)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        table = caches[0].table
        assert all(c.table is table for c in caches)  # one table for the model's layers
        if page == 4:
            assert table.run[0] < len(table.slots[0])  # (pages not consecutive: not a view)
        if arch == "deepseek_v3:q":  # the decode steps ran as layer ops over a staging copy of the rows
            assert all([st.slots for st in c._stages] == [(0, 1, 2)] for c in caches)


def test_a_lone_sequence_reads_its_pages_in_place(ckpts, monkeypatch):
    model = LLM(ckpts["llama"]).model
    caches = _caches(model, 2, 4, monkeypatch)
    with torch.inference_mode():
        model(torch.tensor([[5, 6, 7, 8, 9, 10]]), caches, StepBatch.make([1], [0], 6))
        c = caches[0]
        keys, _ = c.update(torch.ones(1, 1, c.data.shape[2]), StepBatch.make([1], [6], 1))
    assert c.table.slots[1] == [1, 2]  # (lowest free pages first: consecutive; page 0 is the sink)
    assert keys.data_ptr() == c.data[1].data_ptr() and keys.shape[1] == 7  # a view of the pool, no gather
    data, rows = c.step_rows(StepBatch.make([1], [7], 1))
    assert data.data_ptr() == c.data[1].data_ptr() and rows.tolist() == [0]


def test_unmanaged_tables_free_pages_when_a_slot_is_reset(ckpts, monkeypatch):
    model = LLM(ckpts["deepseek_v3"]).model
    caches = _caches(model, 2, 4, monkeypatch)
    with torch.inference_mode():
        model(torch.arange(3, 13)[None], caches, StepBatch.make([0], [0], 10))
        model(torch.arange(3, 8)[None], caches, StepBatch.make([1], [0], 5))
    table = caches[0].table
    assert table.live == 3 + 2 and table.num_pages == 1 + 5
    for c in caches:
        c.reset(torch.tensor([0]))
    assert table.live == 2 and table.slots[0] == []
    with torch.inference_mode():  # the slot's old pages come back first
        model(torch.arange(3, 7)[None], caches, StepBatch.make([0], [0], 4))
    assert table.slots[0] == [1] and table.num_pages == 1 + 5


def test_the_page_tables_device_copy_is_refreshed_in_place():
    """A CUDA graph captured over a paged cache reads the page table's device copy: pages given later must show in
    that same tensor, and only a wider table makes a new one (the static step then runs eagerly). ("meta" stands in
    for a GPU here: the copy's identity and shape are what is checked; tests/test_cuda.py runs the graph.)"""
    t = BlockTable(3, page_tokens=2, managed=True)
    t.grow(0, 4)
    dev = torch.device("meta")
    first = t.ids_on(dev)
    assert first.shape == t.ids.shape and t.ids_on(dev) is first
    t.grow(1, 2)  # a page for another slot: the table changed, not its width
    assert t.ids_on(dev) is first
    t.grow(0, 2 * (t.ids.shape[1] + 3))  # wider than the copy
    wider = t.ids_on(dev)
    assert wider is not first and wider.shape == t.ids.shape
    assert t.ids_on(torch.device("cpu")) is t.ids
    # a copy made inside a step (inference mode) is refreshed outside one, and the other way round
    t2 = BlockTable(2, page_tokens=2, managed=True)
    with torch.inference_mode():
        made = t2.ids_on(dev)
    t2.grow(1, 2)
    assert t2.ids_on(dev) is made and not made.is_inference()
    with torch.inference_mode():
        t2.grow(0, 2)
        assert t2.ids_on(dev) is made


def test_block_table_counts_holders_and_never_hands_a_page_out_twice():
    t = BlockTable(3, page_tokens=2, managed=True)
    t.grow(0, 5)
    t.grow(1, 3)
    assert t.slots[0] == [1, 2, 3] and t.slots[1] == [4, 5] and t.live == 5  # (page 0: the sink)
    t.ensure(2, 1)  # a managed table's pages come from its allocator alone
    assert t.slots[2] == [] and t.ids[2].tolist() == [0] * t.ids.shape[1]
    t.release(0)
    assert t.pages_of(0) == [1, 2, 3] and t.live == 2  # parked until slot 0 is used again
    t.store(1)
    t.store(2)
    assert t.store_only == 2
    t.share(2, [1, 2])
    assert t.slots[2] == [1, 2] and t.refs[1] == 1 and t.stored[1] and t.store_only == 0
    assert not t.unstore(1)  # still held by slot 2
    t.release(2)
    assert t.store_only == 1  # page 2 (stored); page 1 parked
    assert t.unstore(2)
    t.grow(0, 2 * 6)  # slot 0 used again: its parked pages are free again
    held = t.slots[0] + t.slots[1]
    assert len(held) == len(set(held)) == 8 and 0 not in held and t.live == 8
    t.release(0)
    t.release(1)
    t.grow(2, 2 * 8)
    assert len(set(t.slots[2])) == 8 and t.live == 8 and t.num_pages == 1 + 8


def test_a_split_block_table_gives_each_slot_pages_of_its_part():
    """Two parts (two attention ranks): slot s takes pages of part s % 2 only (part 0: 1, 3, 5, ...; part 1: 2, 4,
    ...), which its rank knows as 1, 2, 3, ...; each part holds at most its share of ``max_pages``, and a part's
    free, parked and unmade pages are its ``available`` ones."""
    t = BlockTable(4, page_tokens=2, managed=True, max_pages=1 + 8, parts=2)
    t.grow(0, 5)
    t.grow(1, 3)
    t.grow(2, 2)
    assert t.slots[0] == [1, 3, 5] and t.slots[2] == [7] and t.slots[1] == [2, 4]
    assert [t.local(p) for p in [0, 1, 3, 5, 7, 2, 4]] == [0, 1, 2, 3, 4, 1, 2]
    assert t.part_pages == 4 and t.available(0) == 0 and t.available(1) == 2
    with pytest.raises(RuntimeError, match="part 0"):
        t.grow(2, 4)  # part 0 is full, whatever part 1 has
    t.release(0)
    t.store(3)
    assert t.available(0) == 2 and t.store_only_in == [1, 0]  # pages 1 and 5 parked; 3 held by the store alone
    t.grow(2, 2 * 3)
    assert t.slots[2] == [7, 1, 5] and t.available(0) == 0
    assert t.unstore(3) and t.available(0) == 1 and t.store_only_in == [0, 0]
    t.grow(3, 2 * 2)
    assert t.slots[3] == [6, 8] and t.available(1) == 0


def test_a_split_tables_available_pages_count_a_page_once(ckpts):
    """A parked page the prefix store held and let go of is free and still parked (and, taken and released by
    another slot, parked twice): it is one page. Counted twice, a part short of pages said it had them, and the
    scheduler's grow raised "no free cache page" (failing every request) instead of declining (a preemption)."""
    from types import SimpleNamespace

    from waferline.engine.paging import CacheManager
    from waferline.engine.prefix_cache import PrefixCache

    t = BlockTable(3, page_tokens=2, managed=True, max_pages=1 + 4, parts=1)
    t.grow(0, 4)
    t.grow(1, 4)
    t.release(0)
    t.store(1)
    t.store(2)  # (the prefix store keeps slot 0's pages right after its release)
    assert t.unstore(1) and t.unstore(2) and t.available() == 2  # free, and still in slot 0's parked list
    t.grow(2, 2)
    t.release(2)  # page 1 again: parked by slot 2 too
    assert t.available() == 2
    spec = LLM(ckpts["llama"]).spec
    table = BlockTable(8, page_tokens=4, managed=True, parts=2)
    table.layers = frozenset(range(len(spec.layers)))
    cm = CacheManager(spec, 8, 16, page_tokens=4, cache_bytes=16 * 4 * spec.cache_bytes_per_token(32), kv_bits=32)
    cm.attach(SimpleNamespace(block_table=lambda pt: table))
    prefix = PrefixCache(cm)
    slots = {}
    for rid, n in (("a", 8), ("b", 16), ("c", 8)):  # part 0's 8 pages, all held
        slots[rid] = cm.admit(rid, 0)
        assert cm.grow(rid, n)
    prefix.store(list(range(3, 11)), 8, slots["a"], cm.free("a"))  # a's 2 pages, held by the store alone
    cm.admit("d", 0)
    assert not cm.grow("d", 16)  # the store's 2 pages evicted, 2 short: no room
    assert cm.grow("d", 8) and table.available(0) == 0


def test_cache_manager_places_sequences_on_the_parts_of_a_split_table(sol):
    """A page table split in two parts: a new sequence goes to the part with free slots and room, then (no prefix hit)
    the one with more free slots, and its slot is of that part; with no paged pool (no page bound) free slots alone
    decide."""
    from types import SimpleNamespace

    from waferline.engine.paging import CacheManager

    spec = LLM(sol).spec
    mla = frozenset(i for i, layer in enumerate(spec.layers) if layer.mixer is not None and layer.mixer.kind == "mla")
    for layers in (mla, frozenset()):
        table = BlockTable(4, page_tokens=8, managed=True, parts=2)
        table.layers = layers
        cm = CacheManager(spec, 4, 64, page_tokens=8)
        cm.attach(SimpleNamespace(block_table=lambda pt, t=table: t))
        assert cm.parts == 2 and (cm.table.part_pages is None) == (not layers)
        slots = []
        for i in range(4):
            part = cm.place(20)
            assert cm.can_admit(20, part)
            slots.append(cm.admit(str(i), part))
            assert slots[-1] % 2 == part
        assert sorted(slots) == [0, 1, 2, 3] and not cm.can_admit(20, cm.place(20))
        cm.free("0")
        assert cm.place(20) == slots[0] % 2


def test_a_write_past_the_allocated_pages_lands_in_the_sink(ckpts, monkeypatch):
    model = LLM(ckpts["llama"]).model
    caches = _caches(model, 2, 4, monkeypatch)
    table = BlockTable(2, 4, managed=True)
    for c in caches:
        c.bind(table)
    table.grow(0, 4)
    table.grow(1, 8)
    with torch.inference_mode():
        before = [(c.read(0, 4), c.read(1, 8)) for c in caches]
        # slot 0 has one page (positions 0-3): a 6-token write (a verify padded past its drafts) keeps 0-3 only
        model(torch.arange(3, 9)[None], caches, StepBatch.make([0], [0], 6))
    for c, (mine, other) in zip(caches, before):
        assert not torch.equal(c.read(0, 4), mine)  # slot 0's page was written
        assert torch.equal(c.read(1, 8), other)  # slot 1's pages were not
        assert c.data.shape[0] == table.num_pages == 1 + 3


_ids = itertools.count()


def _serve(sch, prompts, params):
    return run_to_end(sch, [Sequence(f"r{next(_ids)}", p, sp) for p, sp in zip(prompts, params)], max_steps=1000)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_a_prefix_hit_shares_the_stored_pages(ckpts, arch):
    llm = LLM(ckpts[arch])
    shared = [(5 * j) % 90 + 3 for j in range(20)]
    a, b = shared + [40, 41], shared[:16] + [50, 51, 52]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    miss = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=64, page_tokens=8, prefix_caching=False))
    want = _serve(miss, [a, b], [sp, sp])
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=64, page_tokens=8, chunk_tokens=16))
    runner, table = sch.runner, sch.cache.table
    assert table is not None and all(c.table is table for c in runner.caches)
    assert _serve(sch, [a], [sp]) == want[:1]
    stored = [sch.prefix.page_of(x) for x in sch.prefix.match(b)]
    assert len(stored) == 2
    before = [c.data[stored].clone() for c in runner.caches]
    seen = []
    real = runner.step

    def step(decodes, prefills):  # the new sequence's table while it runs
        for ch in prefills:
            pages = table.slots[ch.slot]
            seen.append((pages[:2], [table.refs[p] + table.stored[p] for p in pages[:2]], ch.start))
        return real(decodes, prefills)

    runner.step = step
    assert _serve(sch, [b], [sp]) == want[1:]  # the hit gives the miss's tokens
    assert seen[0] == (stored, [2, 2], 16)  # the stored pages themselves (held by the slot and the store), 16 skipped
    assert sch.prefix.hit_tokens == 16
    for c, x in zip(runner.caches, before):  # the stored pages were not written
        assert torch.equal(c.data[stored], x)
    # everything finished: no page held by a sequence; the store's pages are the prefix bytes
    assert table.live == 0 and sch.cache.used_bytes == 0
    assert table.store_only == sch.prefix.num_pages
    assert sch.cache.prefix_bytes == table.store_only * sch.cache.page_bytes
    sch.prefix.evict(float("inf"))
    assert table.held == 0 and sch.cache.prefix_bytes == 0
    n = table.num_pages
    table.grow(0, (n - 1) * 8)  # every page is free again: a slot can take them all, no new page made
    assert sorted(table.slots[0]) == list(range(1, n)) and table.num_pages == n


def test_a_prefix_hit_is_admitted_with_room_for_its_rest_only(ckpts):
    """A full cache of 7 pages: the store holds B's 3 pages and D's 3 (newer), 1 page is free. E is B's prompt and one
    token more: it shares B's 3 pages and needs 1 page of its own, which is free, so nothing is evicted and E computes
    1 token. Its stored pages were counted twice (as the store's and as new pages): E evicted B's pages, least
    recently used, and computed all 13 tokens."""
    llm = LLM(ckpts["llama"])
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    cfg = SchedulerConfig(max_num_seqs=2, max_model_len=16, page_tokens=4)
    cfg.cache_bytes = 7 * Scheduler(llm, cfg).cache.paged_page_bytes
    sch = Scheduler(llm, cfg)
    b, d = list(range(30, 42)), list(range(50, 62))
    want = _serve(Scheduler(llm, dataclasses.replace(cfg, prefix_caching=False)), [b + [5]], [sp])
    _serve(sch, [b], [sp])
    _serve(sch, [d], [sp])
    assert sch.cache.table.store_only == 6 and sch.cache.table.available() == 1
    e = Sequence("e", b + [5], sp)
    assert run_to_end(sch, [e]) == want
    assert e.cached_tokens == 12 and sch.prefix.evicted_pages == 0 and sch.cache.table.live == 0


def test_a_prefix_hit_short_of_room_waits_and_keeps_its_pages(ckpts):
    """7 pages: R holds 4, the store B's 3. E (B's prompt and one token more) needs 1 page beyond B's: none is free
    and only its own prefix could be evicted, which would give it nothing. It waits for R, keeping B's pages, and then
    shares them (they were evicted for it, and it computed its whole prompt)."""
    llm = LLM(ckpts["llama"])
    one, two = SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=2, ignore_eos=True)
    cfg = SchedulerConfig(max_num_seqs=2, max_model_len=16, page_tokens=4)
    cfg.cache_bytes = 7 * Scheduler(llm, cfg).cache.paged_page_bytes
    b, r = list(range(30, 42)), list(range(60, 74))
    want = _serve(Scheduler(llm, dataclasses.replace(cfg, prefix_caching=False)), [r, b + [5]], [two, one])
    sch = Scheduler(llm, cfg)
    _serve(sch, [b], [one])
    sr, se = Sequence("r", r, two), Sequence("e", b + [5], one)
    sch.add(sr)
    sch.step()
    assert sch.cache.table.live == 4 and sch.cache.table.store_only == 3
    assert run_to_end(sch, [se]) == want[1:] and sr.output_ids == want[0]
    assert se.cached_tokens == 12 and sch.prefix.evicted_pages == 0


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_a_sequence_that_hit_stores_its_later_pages_under_their_own_tokens(ckpts, arch):
    # b reuses a's first page and computes three more of its own; once b is done, each of its pages must be filed
    # under the tokens it holds (its released page list keeps the shared first page in front), so b again (a hit on
    # four pages) gives the tokens of b computed without a store
    llm = LLM(ckpts[arch])
    toks = [(5 * j) % 90 + 3 for j in range(40)]
    a, b = toks[:10], toks[:34]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    miss = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=64, page_tokens=8, prefix_caching=False))
    want = _serve(miss, [b], [sp])
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=64, page_tokens=8))
    _serve(sch, [a], [sp])
    assert _serve(sch, [b], [sp]) == want
    assert sch.prefix.hit_tokens == 8
    stored = sch.prefix.match(b)
    assert len(stored) == 4  # b's first four pages, each keyed by its own tokens
    assert _serve(sch, [b], [sp]) == want
    assert sch.prefix.hit_tokens == 8 + 32


def _serve_arriving(sch, prompts, params, arrive):
    """Each request added at its step of ``arrive``; every request's token ids when nothing is left."""
    got = [[] for _ in prompts]
    order, step = sorted(range(len(prompts)), key=arrive.__getitem__), 0
    while (order or sch.has_work()) and step < 1000:
        while order and arrive[order[0]] <= step:
            i = order.pop(0)
            sch.add(Sequence(f"r{next(_ids)}", list(prompts[i]), params[i],
                             lambda ev, i=i: got[i].append(ev.token_id) if ev.token_id is not None else None))
        if sch.has_work():
            sch.step()
        step += 1
    return got


def test_a_slot_reused_with_a_prefix_hit_reads_the_shared_pages_not_an_old_staging_copy(ckpts):
    # d decodes in slot 0 through a staging copy of its rows, kept clean while b prefills in slot 1; d ends and c,
    # a prefix hit, takes slot 0: its first chunk must read the shared pages, not the copy of d's rows (it did, and
    # wrote d's stale rows back over the shared pages, so a later request with the prefix was wrong too)
    llm = LLM(ckpts["llama"])
    shared = list(range(40, 56))  # 16 tokens: 4 pages of 4
    a, d, b = shared + [7, 9, 11], [3, 5, 8, 13, 21, 34, 55, 89], [60 + (i * 7) % 60 for i in range(24)]
    c, e = shared + [99, 98, 97, 96], shared + [17, 19, 23]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 3, 16, 6, 6)]
    want = [llm.generate([p], sp)[0].token_ids for p, sp in zip([a, d, b, c, e], params)]
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=64, page_tokens=4, chunk_tokens=4,
                                         max_num_batched_tokens=64))
    assert _serve_arriving(sch, [a, d, b, c], params[:4], [0, 6, 6, 14]) == want[:4]
    assert sch.prefix.hit_tokens == 16
    assert _serve_arriving(sch, [e], params[4:], [0]) == want[4:]  # (the shared pages as a computed them)
    assert sch.prefix.hit_tokens == 32


def test_mla_and_gqa_layers_share_one_page_per_position(tmp_path):
    """A hybrid with MLA and GQA layers: one page id covers a position in both pools, so one sequence of
    max_model_len needs that many pages, not twice as many (the default budget was refused as too small)."""
    from waferline.demo import SOL_DEMO_CONFIG
    from waferline.model.init import write_random_checkpoint

    cfg = dict(SOL_DEMO_CONFIG, num_hidden_layers=3, mixer_types=["mamba2", "mla", "gqa"],
               ffn_types=["dense", "moe", "moe"])
    llm = LLM(write_random_checkpoint(cfg, tmp_path, seed=4))
    prompts, sp = [[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    lone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == lone and all(len(t) == 4 for t in lone)


def test_release_gives_every_page_in_order_after_a_shared_first_page():
    t = BlockTable(2, 16, managed=True)
    t.grow(0, 48)
    first = t.pages_of(0)[0]
    t.store(first)
    t.release(0)
    t.grow(1, 80)
    t.share(1, [first])
    held = list(t.pages_of(1))
    assert held[0] == first
    # (the shared page is not parked: the parked list, which the prefix store read, starts one page late)
    assert t.release(1) == held and t.pages_of(1) == held[1:]


def test_pool_bytes_are_the_page_accounting(ckpts):
    llm = LLM(ckpts["deepseek_v3"])
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=4, max_model_len=64, page_tokens=8, prefix_caching=False))
    caches, table, cm = sch.runner.caches, sch.cache.table, sch.cache
    # one page of every paged layer's pool is the ModelSpec's bytes of page_tokens tokens of those layers
    assert sum(c.page_bytes() for c in caches) == cm.paged_page_bytes == cm.page_bytes
    assert cm.paged_page_bytes == 8 * llm.spec.cache_bytes_per_token(32)
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    peak = []
    real = sch.runner.step

    def step(decodes, prefills):
        out = real(decodes, prefills)
        peak.append((table.live, cm.used_bytes, [c.data.shape[0] for c in caches]))
        return out

    sch.runner.step = step
    _serve(sch, [[3 + i] * n for i, n in enumerate((9, 17, 30))], [sp] * 3)
    for live, used, pool_pages in peak:
        assert used == live * cm.paged_page_bytes  # the bytes held by sequences are the pages they hold
        assert pool_pages == [table.max_pages] * len(caches)  # the pools: the pages the budget pays for, made once
    assert (table.max_pages - 1) * cm.paged_page_bytes <= cm.budget < table.max_pages * cm.paged_page_bytes
    assert sum(c.data.nbytes for c in caches) == table.max_pages * cm.paged_page_bytes
    assert max(p[0] for p in peak) == 2 + 3 + 5  # ceil((prompt + 5) / 8) pages each, all running at once
    assert table.num_pages == 1 + 10  # pages that exist: the most held at once (and the sink)
    assert table.live == 0 and cm.used_bytes == 0 and sum(cm.pages_in_use().values()) == 0


def test_recovered_runner_keeps_the_pages_the_prefix_store_holds(ckpts):
    llm = LLM(ckpts["llama"])
    shared = [(3 * j) % 90 + 5 for j in range(20)]
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=64, page_tokens=8))
    first = _serve(sch, [shared + [7]], [sp])
    old = sch.runner.caches
    sch.runner.recover()  # (after a failed step: fresh caches on the same table and pools)
    assert all(c is not o and c.table is sch.cache.table and c.data is o.data for c, o in zip(sch.runner.caches, old))
    assert _serve(sch, [shared + [7]], [sp]) == first and sch.prefix.hit_tokens == 16


@torch.inference_mode()
def test_micro_batches_of_disjoint_rows_keep_their_own_staging_copies(monkeypatch):
    """A pipeline stage's micro-batches alternate between disjoint rows: each keeps its staging copy (one gather of
    its pages, not one per step), their entries reach the pages when a slot is released, and the other rows' copy
    stays in use."""
    t = BlockTable(4, page_tokens=4)
    c = TokenCache(4, 2, torch.float32, table=t)
    gathers = []
    real = c._gather
    monkeypatch.setattr(c, "_gather", lambda ids, B: gathers.append(B) or real(ids, B))

    def rows(slot, start, n):  # entry (slot, position)
        return torch.tensor([[float(slot), float(p)] for p in range(start, start + n)])[None]

    for s in range(4):
        c.update(rows(s, 0, 5), StepBatch.make([s], [0], 5))
    gathers.clear()
    for pos in (5, 6, 7, 8):
        for a, b in ((0, 1), (2, 3)):  # micro-batch A, then micro-batch B, at each step
            keys, _ = c.update(torch.cat([rows(a, pos, 1), rows(b, pos, 1)]), StepBatch.make([a, b], [pos, pos], 1))
            assert torch.equal(keys[0], rows(a, 0, pos + 1)[0]) and torch.equal(keys[1], rows(b, 0, pos + 1)[0])
    assert gathers == [2, 2]  # (one copy per micro-batch's rows, gathered once)
    assert sorted(st.slots for st in c._stages) == [(0, 1), (2, 3)] and c.stages(0) and c.stages(3)
    t.release(0)  # every copy's entries are in their pages; the copy of rows 2 and 3 goes on being used
    assert torch.equal(c.data[t.pages_of(0)].reshape(-1, 2)[:9], rows(0, 0, 9)[0])
    assert [st.slots for st in c._stages] == [(2, 3)] and not c.stages(None)
    keys, _ = c.update(torch.cat([rows(2, 9, 1), rows(3, 9, 1)]), StepBatch.make([2, 3], [9, 9], 1))
    assert torch.equal(keys[1], rows(3, 0, 10)[0]) and gathers == [2, 2]
    assert torch.equal(c.read(2, 10), rows(2, 0, 10)[0]) and torch.equal(c.read(1, 9), rows(1, 0, 9)[0])


@torch.inference_mode()
def test_staged_decode_entries_reach_their_pages_before_the_slot_is_released():
    t = BlockTable(3, page_tokens=4)
    c = TokenCache(3, 2, torch.float32, table=t)

    def rows(slot, start, n):  # entry (slot, position)
        return torch.tensor([[float(slot), float(p)] for p in range(start, start + n)])[None]

    for s in (0, 1):
        c.update(rows(s, 0, 6), StepBatch.make([s], [0], 6))
    for pos in (6, 7, 8):  # decode steps of rows 0 and 1: through one staging copy of their rows
        keys, _ = c.update(torch.cat([rows(0, pos, 1), rows(1, pos, 1)]), StepBatch.make([0, 1], [pos, pos], 1))
        assert torch.equal(keys[0], rows(0, 0, pos + 1)[0]) and torch.equal(keys[1], rows(1, 0, pos + 1)[0])
        if pos == 6:  # another slot's prompt in between: the copy stays (its entries written back first)
            c.update(rows(2, 0, 5), StepBatch.make([2], [0], 5))
            assert len(c._stages) == 1 and not c.stages(None)
    assert c.stages(0) and c in t.dirty
    t.release(0)  # the copy's entries of slot 0 are in its pages before they change hands
    assert torch.equal(c.data[t.pages_of(0)].reshape(-1, 2)[:9], rows(0, 0, 9)[0])
    assert torch.equal(c.read(1, 9), rows(1, 0, 9)[0]) and torch.equal(c.read(2, 5), rows(2, 0, 5)[0])


def test_a_prefix_store_beside_a_drafters_pages_keeps_within_the_budget(ckpts):
    """A draft model's pages and a prefix store: the target's pool was sized for the whole budget (the store's pages
    need no sequence) beside the drafter's own pool, 1.5x the budget held; the store now keeps pages within the pool
    the sequences would hold, evicting them when a sequence needs the page, and the output is plain greedy's."""
    llm = LLM(ckpts["llama"])
    cfg = dict(max_num_seqs=2, max_model_len=64, page_tokens=8, speculative=f"draft:{ckpts['llama']}",
               num_speculative_tokens=2, speculative_adaptive=False)
    sch = Scheduler(llm, SchedulerConfig(**cfg))
    cm = sch.cache
    assert sch.prefix is not None
    held = cm.table.max_pages * cm.paged_page_bytes + cm.draft_table.max_pages * cm.draft_page_bytes
    assert held <= cm.budget + cm.paged_page_bytes + cm.draft_page_bytes  # (each table's sink page)
    shared = [(7 * j) % 90 + 3 for j in range(24)]
    prompts = [shared + [40 + i] * (4 + 3 * i) for i in range(6)] + [[9 + i] * 30 for i in range(3)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert _serve_arriving(sch, prompts, [sp] * len(prompts), [0, 0, 3, 3, 6, 9, 9, 12, 12]) == want
    assert sch.prefix.hit_tokens > 0 and sch.prefix.evicted_pages > 0 and sch.stats["spec_drafted"] > 0
    assert cm.table.live == cm.draft_table.live == 0


def _held_bytes(caches) -> int:
    """Bytes of the cache tensors: paged pools and sliding-window rings (their rows), Mamba-2 states."""
    return sum(c.data.nbytes if isinstance(c, TokenCache) else c.nbytes() for c in caches if c is not None)


@pytest.mark.parametrize("arch", ["gpt_oss", "bamba"])
def test_paged_pools_hold_only_the_pages_sequences_can_hold_beside_their_other_caches(tmp_path, arch):
    """Sliding-window rings (gpt-oss) and Mamba-2 states (bamba) take their share of the budget too: the full-attention
    pool holds the pages sequences can hold beside them, and all the caches the budget and the sink page. The pool held
    the pages the whole budget pays for: 36 for 32 usable (gpt-oss), 73 (bamba), the caches 1.6x the budget."""
    from waferline.model.ssm import Mamba2Cache

    build(arch, tmp_path)
    llm = LLM(tmp_path)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    for seqs in (4, 2):  # (the default budget: 4 sequences of max_model_len; then 2 in 4 slots)
        cfg = SchedulerConfig(max_num_seqs=4, max_model_len=64, page_tokens=8, prefix_caching=False)
        cfg.cache_bytes = seqs * Scheduler(llm, cfg).cache.max_seq_bytes
        sch = Scheduler(llm, cfg)
        _serve(sch, [[3, 4, 5, 6, 7]], [sp])  # (the pool is made at the first page)
        caches, cm = sch.runner.caches, sch.cache
        assert any(isinstance(c, Mamba2Cache) for c in caches) == (arch == "bamba")
        assert cm.table.max_pages == 1 + seqs * 8  # a sequence of max_model_len: 8 pages
        assert sum(c.data.nbytes for c in caches if isinstance(c, TokenCache) and c.paged) == \
            cm.table.max_pages * cm.paged_page_bytes
        if seqs == 4:
            assert _held_bytes(caches) == cm.budget + cm.paged_page_bytes


def test_a_draft_models_pages_leave_the_targets_pool_its_share(ckpts):
    """A draft model's pages count in the same budget: without a prefix store, the target's pool holds the pages its
    sequences hold beside their draft pages (it held the pages the whole budget pays for, twice its share)."""
    llm = LLM(ckpts["llama"])
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=4, max_model_len=64, page_tokens=8, prefix_caching=False,
                                         speculative=f"draft:{ckpts['llama']}"))
    cm = sch.cache
    assert cm.budget == 4 * 8 * (cm.paged_page_bytes + cm.draft_page_bytes)  # 4 sequences of 8 pages in each table
    assert cm.table.max_pages == cm.draft_table.max_pages == 1 + 4 * 8
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i] * n for i, n in enumerate((9, 17, 30, 40))]
    want = _serve(Scheduler(llm, SchedulerConfig(max_num_seqs=4, max_model_len=64, page_tokens=8)), prompts, [sp] * 4)
    assert _serve(sch, prompts, [sp] * 4) == want


def test_a_sliding_window_counts_its_last_page_whole(tmp_path):
    """A sequence holds ModelSpec.cache_bytes_per_seq(n) at page-aligned lengths where the window is whole pages; a
    window of 8 in pages of 3 counts 9 tokens (docs/server.md, engine/paging.py say so)."""
    from waferline.engine.paging import CacheManager

    build("gpt_oss", tmp_path)  # layer 0: a window of 8
    spec = LLM(tmp_path).spec
    window = sum(layer.cache_bytes_per_token() for layer in spec.layers if layer.mixer.sliding_window)
    assert window > 0
    assert CacheManager(spec, 1, 32, page_tokens=4).bytes_for(16) == spec.cache_bytes_per_seq(16)
    assert CacheManager(spec, 1, 32, page_tokens=3).bytes_for(15) == spec.cache_bytes_per_seq(15) + window


def test_a_step_whose_rows_are_only_tensors_keeps_each_rows_entries():
    """A step made of tensors alone (StepBatch(slots, start, T), no host copy: train/sol_mini.py's loss) on an
    unmanaged paged cache took no pages for its rows: every row's every entry went to the sink page, so each query
    read the last entries written there (another row's, later positions) and sol-mini's MLA layers trained on them."""
    t = BlockTable(2, page_tokens=4)
    c = TokenCache(2, 2, torch.float32, table=t)

    def rows(slot, start, n):  # entry (slot, position)
        return torch.tensor([[float(slot), float(p)] for p in range(start, start + n)])[None]

    keys, blocked = c.update(torch.cat([rows(0, 0, 10), rows(1, 0, 10)]),
                             StepBatch(torch.arange(2), torch.zeros(2, dtype=torch.long), 10))
    assert torch.equal(keys, torch.cat([rows(0, 0, 10), rows(1, 0, 10)]))
    assert torch.equal(blocked[0], torch.ones(10, 10, dtype=torch.bool).triu(1))
    keys, _ = c.update(torch.cat([rows(0, 10, 1), rows(1, 10, 1)]),
                       StepBatch(torch.arange(2), torch.full((2,), 10), 1))
    assert torch.equal(keys, torch.cat([rows(0, 0, 11), rows(1, 0, 11)]))
    assert torch.equal(c.read(1, 11), rows(1, 0, 11)[0])


def test_the_cache_says_what_it_holds(ckpts):
    """The line `waferline serve` prints at start-up: the budget, how many whole sequences of max_model_len tokens it
    holds (the ModelSpec accounting), how many run at once, and whether more than fit can run (then: preemption)."""
    from waferline.engine.paging import CacheManager

    spec = LLM(ckpts["llama"]).spec
    one = spec.cache_bytes_per_token(32) * 64
    roomy = CacheManager(spec, 4, 64, page_tokens=16, kv_bits=32)
    assert roomy.describe() == (f"cache {4 * one / 2**20:,.1f} MiB: room for 4 sequences of 64 tokens "
                                f"({one / 2**20:,.2f} MiB each, pages of 16 tokens), 4 running at most")
    tight = CacheManager(spec, 4, 64, page_tokens=16, kv_bits=32, cache_bytes=2.5 * one)
    assert tight.describe().startswith(f"cache {2.5 * one / 2**20:,.1f} MiB: room for 2 sequences of 64 tokens")
    assert tight.describe().endswith("4 running at most; more run while their pages fit, the newest preempted when "
                                     "they run out")
