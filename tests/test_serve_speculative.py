"""Speculative decoding inside the server's scheduler (engine/speculative/serving.py): greedy requests served with
speculation give exactly the tokens of plain ``LLM.generate`` for every cache kind (GQA, MLA with an MTP head, sliding
window, Mamba-2), with chunked prefill and preemption alongside; stops inside a burst; the live server through the
official ``openai`` client; the refusals."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from server_helpers import _metrics, serve_in_thread
from tiny_models import VOCAB, build
from waferline import LLM, SamplingParams
from waferline.engine.runner import WANT_ARGMAX, DecodeRow
from waferline.engine.scheduler import CacheManager, Scheduler, SchedulerConfig, Sequence
from waferline.engine.speculative import Proposal
from waferline.errors import ConfigError
from waferline.model.attention import TokenCache
from waferline.model.init import write_random_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=18, ignore_eos=True)
PROMPTS = [[7, 8, 9, 10] * 3, [5, 6, 5, 6, 5, 6, 11], [20, 21, 22, 23, 24, 20, 21, 22, 23], [3, 4], [9] * 6 + [4, 9]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for mt in ("llama", "deepseek_v3", "gpt_oss", "bamba"):
        out[mt] = tmp_path_factory.mktemp(mt)
        build(mt, out[mt])
    cfg = json.loads((out["deepseek_v3"] / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1  # MLA with an MTP head (random weights: transformers drops MTP ones)
    out["deepseek_v3:mtp"] = write_random_checkpoint(cfg, tmp_path_factory.mktemp("dsv3_mtp"), seed=3)
    return out


class Oracle:
    """A drafter that knows each prompt's reference continuation and corrupts one draft per proposal at a position
    cycling over 0..k (k: none corrupted), so rows see every accepted length and every rollback depth. Rows are
    slots: a row's reference is found from its tokens."""

    name = "oracle"
    uses_hidden = False

    def __init__(self, refs: list[list[int]]):
        self.refs, self.calls = refs, 0

    def begin(self, seqs, hidden):
        pass

    def reset(self, rows):
        pass

    def propose(self, rows, seqs, ks, params, gens):
        props = []
        for b, k in zip(rows, ks):
            self.calls += 1
            seq = seqs[b]
            ref = next((r for r in self.refs if r[:len(seq)] == seq), None)
            assert ref is not None, "the served output left every reference"
            d = ref[len(seq):len(seq) + k]
            bad = self.calls % (k + 1)
            if bad < len(d):
                d[bad] = (d[bad] + 1) % VOCAB
            props.append(Proposal(d))
        return props

    def accepted(self, rows, seqs, n_accepted, n_drafted, hidden):
        pass


def _serve(sch: Scheduler, prompts, params, max_steps: int = 3000):
    """Run requests to the end through ``sch``; returns (tokens per request, finish reason per request)."""
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    ends: dict[int, str] = {}
    for i, p in enumerate(prompts):
        def sink(ev, i=i):
            if ev.token_id is not None:
                got[i].append(ev.token_id)
            if ev.finished:
                ends[i] = ev.finish_reason
        sch.add(Sequence(f"r{i}", p, params[i] if isinstance(params, list) else params, sink))
    steps = 0
    while sch.has_work() and steps < max_steps:
        sch.step()
        steps += 1
    return [got[i] for i in range(len(prompts))], [ends.get(i) for i in range(len(prompts))]


def _config(method="ngram", k=4, adaptive=False, **kw) -> SchedulerConfig:
    kw = {"max_num_seqs": 4, "max_model_len": 96, "chunk_tokens": 5, "max_num_batched_tokens": 24, **kw}
    return SchedulerConfig(speculative=method, num_speculative_tokens=k, speculative_adaptive=adaptive, **kw)


@pytest.mark.parametrize("mt", ["llama", "deepseek_v3", "gpt_oss", "bamba"])
def test_greedy_served_with_speculation_equals_plain_generate(ckpts, mt):
    """GQA, MLA, a sliding window of 8 (K capped at 7) and a Mamba-2 hybrid: five requests on four slots with chunked
    prefill alongside the verifies give LLM.generate's tokens, with partial acceptance at every depth (the oracle
    drafter: rings and SSM states rolled back) and with the n-gram drafter under adaptive K."""
    llm = LLM(ckpts[mt])
    want = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    sch = Scheduler(llm, _config(k=7 if mt == "gpt_oss" else 5))
    sch.spec_dec.drafter = Oracle([p + w for p, w in zip(PROMPTS, want)])
    got, ends = _serve(sch, PROMPTS, GREEDY)
    assert got == want and ends == ["length"] * len(PROMPTS)
    st = sch.stats
    assert 0 < st["spec_accepted"] < st["spec_drafted"] and st["generated_tokens"] == sum(map(len, want))
    assert st["steps"] < sum(map(len, want))  # bursts: fewer steps than tokens
    assert sch.cache.used_bytes == 0 and sch.cache.free_slots == 4
    sch = Scheduler(llm, _config(adaptive=True))
    got, _ = _serve(sch, PROMPTS, GREEDY)
    assert got == want and sch.stats["spec_drafted"] > 0


@pytest.mark.parametrize("mt, kind", [("llama", "logprobs"), ("deepseek_v3:mtp", "logprobs"), ("llama", "penalty")])
def test_requests_with_logprobs_decode_plainly_beside_verifies(ckpts, mt, kind):
    """A request that asks for log-probabilities (or whose logits a penalty changes) is never drafted for (its rows
    need the logits), while the others in the same steps verify drafts: every request's tokens are LLM.generate's,
    and so are the log-probabilities."""
    llm = LLM(ckpts[mt])
    with_lp = SamplingParams(max_tokens=18, ignore_eos=True, logprobs=2, frequency_penalty=0.8 if kind == "penalty"
                             else 0.0)
    params = [with_lp if i % 2 == 0 else GREEDY for i in range(len(PROMPTS))]
    want = [llm.generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
    sch = Scheduler(llm, _config("mtp" if mt.endswith(":mtp") else "ngram", 3))
    drafted: set[int] = set()
    if not mt.endswith(":mtp"):
        oracle = Oracle([p + w.token_ids for p, w in zip(PROMPTS, want)])
        propose = oracle.propose

        def recording(rows, seqs, ks, params, gens):
            drafted.update(PROMPTS.index(next(p for p in PROMPTS if seqs[b][:len(p)] == p))
                           for b, k in zip(rows, ks) if k)
            return propose(rows, seqs, ks, params, gens)

        oracle.propose = recording
        sch.spec_dec.drafter = oracle
    got: dict[int, list] = {i: [] for i in range(len(PROMPTS))}
    for i, p in enumerate(PROMPTS):
        sch.add(Sequence(f"r{i}", p, params[i], lambda ev, i=i: ev.token_id is not None and got[i].append(ev)))
    while sch.has_work():
        sch.step()
    assert [[e.token_id for e in got[i]] for i in got] == [w.token_ids for w in want]
    assert sch.stats["spec_drafted"] > 0
    for i, w in enumerate(want):
        lps = [e.logprobs for e in got[i]]
        if i % 2:
            assert lps == [None] * 18
        else:
            assert [x.logprob for x in lps] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-5)
            if kind == "logprobs":  # (greedy: the most likely token; a penalty may pick another)
                assert [x.top[0][0] for x in lps] == w.token_ids
    if not mt.endswith(":mtp"):  # (the oracle drafter tells which requests it drafted for)
        assert drafted == {i for i in range(len(PROMPTS)) if i % 2}


@pytest.mark.parametrize("mt", ["deepseek_v32", "deepseek_v4", "qwen3_next", "kimi_linear"])
def test_every_other_cache_kind_rolls_back(mt, tmp_path):
    """Sparse attention (DSA), DeepSeek-V4's compressed caches and linear-attention states: verifies with every
    accepted length give plain greedy's tokens."""
    build(mt, tmp_path)
    llm = LLM(tmp_path)
    want = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    sch = Scheduler(llm, _config(k=4))
    sch.spec_dec.drafter = Oracle([p + w for p, w in zip(PROMPTS, want)])
    got, _ = _serve(sch, PROMPTS, GREEDY)
    assert got == want and 0 < sch.stats["spec_accepted"] < sch.stats["spec_drafted"]


def test_mtp_served_equals_plain_and_drafts_as_generate(ckpts):
    """MLA with an MTP head: the served tokens are plain greedy's, and the MTP head's drafts for a lone request are
    those ``LLM(speculative='mtp')`` proposes (the head is given the same hidden states: prefill chunks, plain decode
    rows and verify rows, in order)."""
    d = ckpts["deepseek_v3:mtp"]
    llm = LLM(d)
    want = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    sch = Scheduler(llm, _config("mtp", 3))
    assert sch.prefix is None and sch.runner.keep_hidden
    got, _ = _serve(sch, PROMPTS, GREEDY)
    assert got == want and sch.stats["spec_drafted"] > 0

    def logged(drafter, log):
        inner = drafter.propose

        def propose(rows, seqs, ks, params, gens):
            props = inner(rows, seqs, ks, params, gens)
            log.extend((len(seqs[b]), p.tokens) for b, p in zip(rows, props) if p.tokens)
            return props
        drafter.propose = propose

    ref_log: list = []
    spec_llm = LLM(d, speculative="mtp", num_speculative_tokens=3, speculative_adaptive=False)
    logged(spec_llm._spec.drafter, ref_log)
    assert spec_llm.generate([PROMPTS[0]], GREEDY)[0].token_ids == want[0]
    served_log: list = []
    sch = Scheduler(llm, _config("mtp", 3, chunk_tokens=64))
    logged(sch.spec_dec.drafter, served_log)
    assert _serve(sch, [PROMPTS[0]], GREEDY)[0] == [want[0]]
    assert served_log and served_log == ref_log


def test_a_prompt_token_left_alone_by_a_cut_chunk_decodes_plainly(ckpts):
    """Chunked prefill that leaves one prompt token: that token decodes without drafts. With an MTP drafter the step
    raised (no hidden state for the token yet: every request in flight failed); a seeded sampled request's first
    token came from a verify, so its tokens changed with where the other requests' share of the budget cut it."""
    llm = LLM(ckpts["deepseek_v3:mtp"])
    prompt, sp = [5, 9, 17, 33], SamplingParams(max_tokens=6, ignore_eos=True)
    sch = Scheduler(llm, _config("mtp", k=2, max_num_seqs=2, max_model_len=64, chunk_tokens=3))
    assert _serve(sch, [prompt], sp) == ([llm.generate([prompt], sp)[0].token_ids], ["length"])

    llm = LLM(ckpts["llama"])
    s_prompt, seeded = [7, 8, 9, 10] * 2, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=5)
    cfg = _config("ngram", k=3, max_num_seqs=2, max_model_len=64, chunk_tokens=8, max_num_batched_tokens=8,
                  prefix_caching=False)
    alone, _ = _serve(Scheduler(llm, cfg), [s_prompt], seeded)
    sch = Scheduler(llm, cfg)  # beside a request that decodes plainly (log-probabilities): S's first chunk is 7
    got: list[int] = []
    sch.add(Sequence("g", [30, 31, 32], SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1), lambda ev: None))
    sch.step(), sch.step()
    sch.add(Sequence("s", s_prompt, seeded, lambda ev: got.append(ev.token_id) if ev.token_id is not None else None))
    while sch.has_work():
        sch.step()
    assert got == alone[0]


def test_a_seeded_request_preempted_mid_speculation_streams_the_same_tokens(ckpts):
    """Recompute preemption re-prefills all but the last token, which then verifies drafts as it would have: the
    re-prefill sampled it from the prefill's logits with one plain draw where the run without preemption verified k
    drafts, so a seeded request's stream changed after the preemption."""
    llm = LLM(ckpts["llama"])
    g, s_prompt = list(range(30, 45)), [7, 8, 9, 10] * 3
    params = [SamplingParams(max_tokens=29, ignore_eos=True, logprobs=1),  # (older, decodes plainly)
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=3)]
    cfg = dict(max_num_seqs=2, max_model_len=48, page_tokens=4, speculative=f"draft:{ckpts['llama']}",
               num_speculative_tokens=3, speculative_adaptive=False, prefix_caching=False)

    def run(sch):
        got: list[list[int]] = [[], []]
        for i, p in enumerate([g, s_prompt]):
            sch.add(Sequence(f"r{i}", p, params[i], lambda ev, i=i: got[i].append(ev.token_id)
                             if ev.token_id is not None else None))
            sch.step()  # (s arrives a step after g)
        while sch.has_work():
            sch.step()
        return got

    roomy = Scheduler(llm, SchedulerConfig(**cfg))
    want = run(roomy)
    small = Scheduler(llm, SchedulerConfig(**cfg, cache_bytes=roomy.cache.bytes_for(48)))
    assert run(small) == want and small.stats["preemptions"] > 0 and small.stats["spec_drafted"] > 0


# a drafter with caches of its own: (target checkpoint, method, its part of the budget message, its pages' kind)
DRAFTERS = {"draft": ("llama", "draft:{llama}", "draft model's caches", "draft_gqa"),
            "mtp": ("deepseek_v3:mtp", "mtp", "MTP head's cache", "mtp_mla")}


def _draft_config(ckpts, drafter="draft", **kw) -> SchedulerConfig:
    method = DRAFTERS[drafter][1].format(llama=ckpts["llama"])
    return SchedulerConfig(**{"max_num_seqs": 2, "max_model_len": 48, "page_tokens": 4, "prefix_caching": False,
                              "speculative": method, "num_speculative_tokens": 3, "speculative_adaptive": False, **kw})


def _draft_bytes(sch) -> int:
    """Bytes of every tensor of the drafter's caches."""
    return sum(t.untyped_storage().nbytes() for c in sch.spec_dec.drafter.caches if c is not None
               for t in vars(c).values() if isinstance(t, torch.Tensor))


def _draft_paged(sch) -> list[TokenCache]:
    return [c for c in sch.spec_dec.drafter.caches if isinstance(c, TokenCache) and c.paged]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_a_draft_models_caches_count_in_the_budget_check(ckpts, drafter):
    """A sequence holds the target's cache bytes and the drafter's (a draft model's caches, an MTP head's): a budget
    for one target sequence alone is refused, naming the drafter's; one for both is taken."""
    llm = LLM(ckpts[DRAFTERS[drafter][0]])
    target = Scheduler(llm, _draft_config(ckpts, drafter, speculative=None)).cache.max_seq_bytes
    both = Scheduler(llm, _draft_config(ckpts, drafter)).cache.max_seq_bytes
    assert both > target
    with pytest.raises(ConfigError, match=DRAFTERS[drafter][2]):
        Scheduler(llm, _draft_config(ckpts, drafter, cache_bytes=target))
    assert Scheduler(llm, _draft_config(ckpts, drafter, cache_bytes=both)).cache.budget == both


def test_a_draft_models_pages_are_counted_by_its_own_layers(ckpts):
    """The draft model's pools count the tokens its own layers keep: a full-attention draft beside a target whose first
    layer has a sliding window of 8 was counted 8 tokens, so a budget the check took could not hold one sequence and
    the scheduler stopped with 'cache budget exhausted by a single sequence'."""
    llm = LLM(ckpts["gpt_oss"])
    one = Scheduler(llm, _draft_config(ckpts)).cache
    bits = one.kv_bits
    alone = [CacheManager(s, 2, 48, 4, kv_bits=bits, state_bits=bits).max_seq_bytes
             for s in (llm.spec, LLM(ckpts["llama"]).spec)]
    assert one.max_seq_bytes == sum(alone)
    sch = Scheduler(llm, _draft_config(ckpts, cache_bytes=one.max_seq_bytes))
    _, ends = _serve(sch, [[7, 8, 9, 10] * 3], SamplingParams(max_tokens=36, ignore_eos=True))
    assert ends == ["length"] and sch.cache.used_bytes == 0


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_a_draft_model_preempts_at_the_budget_with_its_caches(ckpts, drafter):
    """A budget of two target sequences is less than two of target + drafter: two long requests preempt, the bytes
    held never pass the budget, and every request streams the tokens of a roomy scheduler."""
    llm = LLM(ckpts[DRAFTERS[drafter][0]])
    prompts = [[(5 * i + 3 * j) % 11 + 3 for j in range(14 + 3 * i)] for i in range(3)]
    params = [SamplingParams(max_tokens=26 - 3 * i, temperature=0.9 if i == 1 else 0.0, seed=i, ignore_eos=True)
              for i in range(3)]
    want, _ = _serve(Scheduler(llm, _draft_config(ckpts, drafter, max_num_seqs=3)), prompts, params)
    budget = 2 * Scheduler(llm, _draft_config(ckpts, drafter, speculative=None)).cache.max_seq_bytes
    sch = Scheduler(llm, _draft_config(ckpts, drafter, cache_bytes=budget))
    held = []
    sch_step = sch.step

    def step():
        n = sch_step()
        held.append(sch.cache.used_bytes)
        return n

    sch.step = step
    got, ends = _serve(sch, prompts, params)
    assert got == want and ends == ["length"] * 3
    assert sch.stats["preemptions"] > 0 and sch.stats["spec_drafted"] > 0
    assert max(held) <= budget and sch.cache.used_bytes == 0 and _draft_paged(sch)[0].table.live == 0


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_a_draft_models_caches_do_not_grow_with_requests(ckpts, drafter):
    """The drafter's pages come from the scheduler and go back when a request ends: none held after, and its caches'
    storage after 50 requests is what it was after 5."""
    llm = LLM(ckpts[DRAFTERS[drafter][0]])
    sch = Scheduler(llm, _draft_config(ckpts, drafter))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    _serve(sch, [[7, 8, 9, 10, 3 + i] for i in range(5)], params)
    after5 = _draft_bytes(sch)
    table = _draft_paged(sch)[0].table
    assert table is sch.cache.draft_table and table.live == 0 and sch.cache.used_bytes == 0
    for n in range(9):
        _serve(sch, [[7, 8, 9, 10, 3 + i, n] for i in range(5)], params)
    assert _draft_bytes(sch) == after5 and table.live == 0 and sch.cache.used_bytes == 0
    assert sch.stats["spec_drafted"] > 0


@pytest.mark.parametrize("mt, method", [("llama", "ngram"), ("deepseek_v3:mtp", "mtp")])
def test_an_ended_sequence_leaves_no_drafter_state_behind(ckpts, mt, method):
    """The drafter's state of a sequence (the n-gram index of all its tokens; the MTP head's pending hidden states;
    its acceptance estimate) goes when the sequence ends, is aborted or is preempted: an idle scheduler held it for
    every slot (until the slot's next sequence), outside the cache budget."""
    sch = Scheduler(LLM(ckpts[mt]), _config(method, 3, adaptive=True, cache_bytes=None))
    sch = Scheduler(sch.llm, _config(method, 3, adaptive=True, cache_bytes=sch.cache.max_seq_bytes))
    lengths = [1, 60, 5, 60, 9]
    _serve(sch, PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    sch.add(Sequence("gone", PROMPTS[0] * 3, GREEDY, lambda ev: None))
    for _ in range(4):
        sch.step()
    assert sch.abort("gone") and not sch.has_work()
    sd = sch.spec_dec
    assert sd.stats.drafted > 0 and sch.stats["preemptions"] > 0 and not sd.ctl.alpha and not sd.ctl.since_draft
    if method == "ngram":
        assert not any(sd.drafter.index[b][n] for b in sd.drafter.index for n in sd.drafter.index[b])
    else:  # (nor an empty view of them: it holds their storage)
        assert [p.untyped_storage().nbytes() for p in sd.drafter.pending] == [0] * 4


def test_a_sequence_that_never_drafts_leaves_the_mtp_head_nothing_to_hold(ckpts):
    """A request whose rows need the logits (log-probabilities, a penalty) never drafts; the MTP drafter kept the
    hidden state of each of its tokens until some other sequence drafted (a lone one's whole output, outside the cache
    budget, copied whole at every token). Beside a greedy request that drafts, the tokens stay plain decoding's."""
    llm = LLM(ckpts["deepseek_v3:mtp"])
    params = [SamplingParams(max_tokens=40, logprobs=1, ignore_eos=True),
              SamplingParams(max_tokens=40, presence_penalty=1.0, ignore_eos=True)]
    sch = Scheduler(llm, _config("mtp", 3))
    sch.add(Sequence("alone", PROMPTS[0], params[0], lambda ev: None))
    held = []
    while sch.has_work():
        sch.step()
        held.append(max(p.shape[0] for p in sch.spec_dec.drafter.pending))
    assert max(held) <= 1 and sch.stats["spec_drafted"] == 0
    sch = Scheduler(llm, _config("mtp", 3))
    got, _ = _serve(sch, PROMPTS[:3], [*params, GREEDY])
    assert got == [llm.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS[:3], [*params, GREEDY])]
    assert sch.stats["spec_drafted"] > 0


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_the_cache_metrics_count_a_draft_models_pages(ckpts, drafter):
    """``waferline_cache_bytes_in_use`` is the target's pages and the drafter's (the bytes of its caches' pages); the
    drafter's are their own kind."""
    from types import SimpleNamespace

    from waferline.server.metrics import Metrics

    llm = LLM(ckpts[DRAFTERS[drafter][0]])
    sch = Scheduler(llm, _draft_config(ckpts, drafter))
    sch.add(Sequence("r", [7, 8, 9, 10] * 3, SamplingParams(max_tokens=20, ignore_eos=True), lambda ev: None))
    for _ in range(4):
        sch.step()
    metrics = Metrics(SimpleNamespace(scheduler=sch, num_waiting=0, num_running=1))
    m = dict(line.rsplit(" ", 1) for line in metrics.render().decode().splitlines() if not line.startswith("#"))
    cm, paged = sch.cache, _draft_paged(sch)
    target, draft = cm.table.live, paged[0].table.live
    assert target > 0 and draft > 0
    assert float(m["waferline_cache_bytes_in_use"]) == (target * cm.paged_page_bytes
                                                         + draft * sum(c.page_bytes() for c in paged))
    kind = DRAFTERS[drafter][3]
    assert float(m[f'waferline_cache_pages_in_use{{kind="{kind}"}}']) == draft
    assert float(m[f'waferline_cache_pages_in_use{{kind="{kind.split("_")[1]}"}}']) == target


def test_a_seeded_row_beside_wider_drafts_keeps_its_own_on_a_tight_cache(ckpts):
    """A verify row asks for the pages of its own drafts, not the step's widest row's (the padding goes to the sink
    page): on a cache of one max_model_len sequence a seeded row lost its drafts beside a row drafting more, and its
    tokens changed, without any preemption."""
    llm = LLM(ckpts["llama"])
    pa, pb = [4, 9, 9, 8, 17, 5], [19, 12, 18, 16, 13, 15, 4, 6, 4, 13]
    ga = SamplingParams(max_tokens=8, ignore_eos=True)
    gb = SamplingParams(max_tokens=7, temperature=0.9, seed=78, ignore_eos=True)
    cfg = dict(max_num_seqs=2, max_model_len=32, page_tokens=4, prefix_caching=False, speculative="ngram",
               num_speculative_tokens=3, speculative_adaptive=False)
    alone, _ = _serve(Scheduler(llm, SchedulerConfig(**cfg)), [pb], gb)
    probe = CacheManager(llm.spec, 2, 32, page_tokens=4, kv_bits=32, state_bits=32)
    sch = Scheduler(llm, SchedulerConfig(**cfg, cache_bytes=probe.bytes_for(32)))
    got, _ = _serve(sch, [pa, pb], [ga, gb])
    assert got[1] == alone[0] and sch.stats["preemptions"] == 0
    assert got[0] == llm.generate([pa], ga)[0].token_ids


@pytest.mark.parametrize("mt", ["gpt_oss", "bamba"])
def test_preemption_with_speculation_keeps_every_token(ckpts, mt):
    """A cache budget of ~2 sequences for 6 requests: recompute preemption, chunked prefill and verifies together
    still give every greedy request LLM.generate's tokens, and every seeded sampled request the tokens it gets from
    a scheduler with room for all (its drafts and K depend on its own tokens only)."""
    llm = LLM(ckpts[mt])
    prompts = [[(7 * i + 3 * j) % 9 + 3 for j in range(5 + 9 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
              for i in range(6)]
    probe = CacheManager(llm.spec, 4, 80, page_tokens=4, kv_bits=32, state_bits=32, spec_tokens=4)  # (_config's k)
    small = _config(max_model_len=80, page_tokens=4, chunk_tokens=7, max_num_batched_tokens=14,
                    cache_bytes=probe.bytes_for(80) + probe.bytes_for(48))
    sch = Scheduler(llm, small)
    got, ends = _serve(sch, prompts, params)
    assert ends == ["length"] * 6
    assert sch.stats["preemptions"] > 0 and sch.stats["spec_drafted"] > 0
    for i in range(1, 6, 2):
        assert got[i] == llm.generate([prompts[i]], params[i])[0].token_ids
    roomy, _ = _serve(Scheduler(llm, _config(max_num_seqs=6, max_model_len=80)), prompts, params)
    assert got == roomy
    assert sch.cache.used_bytes == 0 and sum(sch.cache.pages_in_use().values()) == 0 and sch.cache.free_slots == 4


def test_stop_and_max_tokens_inside_a_burst(ckpts):
    """A stop token or max_tokens reached inside an accepted burst ends the request there: no token past it."""
    llm = LLM(ckpts["llama"])
    p = PROMPTS[2]
    ref = llm.generate([p], GREEDY)[0].token_ids

    class Whole(Oracle):  # proposes the reference itself: every draft accepted
        def propose(self, rows, seqs, ks, params, gens):
            return [Proposal(self.refs[0][len(seqs[b]):len(seqs[b]) + k]) for b, k in zip(rows, ks)]

    # bursts of 6 tokens (all 5 drafts accepted) after the prefill's: tokens 1-6, 7-12, ...; stop inside one
    stop_at = next(i for i in range(2, len(ref)) if i % 6 in (2, 3, 4) and ref[i] not in ref[:i])
    for params, n, reason in ((SamplingParams(max_tokens=18, stop_token_ids=[ref[stop_at]], ignore_eos=True),
                               stop_at + 1, "stop"), (SamplingParams(max_tokens=6, ignore_eos=True), 6, "length")):
        sch = Scheduler(llm, _config(k=5))
        sch.spec_dec.drafter = Whole([p + ref])
        got, ends = _serve(sch, [p], params)
        assert got == [ref[:n]] and ends == [reason]
        assert sch.stats["spec_accepted"] == sch.stats["spec_drafted"] > 0


def test_tokens_per_decode_step_count_only_what_the_output_got(ckpts):
    """A stop inside a verify's tokens (every draft accepted) or inside a burst of plain greedy steps (nothing drafted)
    drops the tokens after it: the statistics behind ``spec_mean_accepted_length`` count the tokens the output got
    and the steps the sequence took, not the ones dropped (they said 5 tokens a step of a verify that gave 3)."""
    llm = LLM(ckpts["llama"])
    p = PROMPTS[3]
    ref = llm.generate([p], GREEDY)[0].token_ids

    class Whole(Oracle):
        def propose(self, rows, seqs, ks, params, gens):
            return [Proposal(self.refs[0][len(seqs[b]):len(seqs[b]) + k]) for b, k in zip(rows, ks)]

    class Never(Oracle):
        def propose(self, rows, seqs, ks, params, gens):
            return [Proposal([]) for _ in rows]

    # a verify gives tokens 1-6, plain bursts 1, then 2, 4 tokens (1, 2-3, 4-7): a stop at 4 drops the rest
    stop_at = 4
    assert ref[stop_at] not in ref[:stop_at]
    params = SamplingParams(max_tokens=18, stop_token_ids=[ref[stop_at]], ignore_eos=True)
    for drafter, bursts in ((Whole, False), (Never, True)):
        sch = Scheduler(llm, _config(k=5, greedy_bursts=bursts))
        sch.spec_dec.drafter = drafter([p + ref])
        sch.runner.burst = stepwise_burst(sch)
        got, ends = _serve(sch, [p], params)
        assert got == [ref[:stop_at + 1]] and ends == ["stop"]
        st = sch.spec_dec.stats
        assert st.emitted == stop_at  # (the first token is the prefill's)
        assert (st.steps, st.row_steps) == ((1, 1) if drafter is Whole else (7, stop_at))


class Late(Oracle):
    """Drafts a sequence's reference once it has 20 generated tokens, every draft wrong before (a phase change)."""

    def __init__(self, refs: list[list[int]], prompt_len: int):
        super().__init__(refs)
        self.prompt_len = prompt_len

    def propose(self, rows, seqs, ks, params, gens):
        out = []
        for b, k in zip(rows, ks):
            d = self.refs[0][len(seqs[b]):len(seqs[b]) + k]
            out.append(Proposal(d if len(seqs[b]) - self.prompt_len >= 20 else [(t + 1) % VOCAB for t in d]))
        return out


def stepwise_burst(sch):
    """The runner's greedy burst run step by step (where no fused operators run one, the runner runs none)."""

    def burst(rows, n):
        out = [[r.token] for r in rows]
        for j in range(n):
            dec, _ = sch.runner.step([DecodeRow(r.slot, r.position + j, o[-1], WANT_ARGMAX)
                                      for r, o in zip(rows, out)], [])
            for o, d in zip(out, dec):
                o.append(d.argmax)
        return [o[1:] for o in out], None

    return burst


def test_a_sequence_that_backed_off_drafts_again_when_its_drafts_pay(ckpts):
    """Adaptive K stops drafting for a sequence whose drafts are rejected; when they would be accepted later in the
    same sequence (the oracle turns right after 20 tokens), a one-token probe finds that out and it drafts again."""
    llm = LLM(ckpts["llama"])
    p, params = PROMPTS[2], SamplingParams(max_tokens=100, ignore_eos=True)
    ref = llm.generate([p], params)[0].token_ids

    sch = Scheduler(llm, _config(k=4, adaptive=True, max_model_len=128))
    sch.spec_dec.drafter = Late([p + ref], len(p))
    sch.spec_dec.ctl.measure = False  # (K from the acceptance and the prior cost model: no timings)
    got, _ = _serve(sch, [p], params)
    assert got == [ref] and sch.stats["spec_accepted"] > 0
    assert sch.stats["steps"] < len(ref) - 10


def test_a_backed_off_sequence_probes_after_probe_every_steps_in_greedy_bursts(ckpts):
    """A sequence that stopped drafting decodes in bursts of plain greedy steps (8 a call); its probe is due after
    ``probe_every`` steps, a burst's steps each, not after that many bursts (which made it 8x as many tokens)."""
    llm = LLM(ckpts["llama"])
    p, params = PROMPTS[2], SamplingParams(max_tokens=110, ignore_eos=True)
    ref = llm.generate([p], params)[0].token_ids

    sch = Scheduler(llm, _config(k=4, adaptive=True, max_model_len=128, greedy_bursts=True))
    sch.spec_dec.drafter = Late([p + ref], len(p))
    sch.runner.burst = stepwise_burst(sch)
    sch.spec_dec.ctl.measure = False  # (K from the acceptance and the prior cost model: no timings)
    drafted_at = []
    choose = sch.spec_dec.ctl.choose

    def logged(rows):
        ks = choose(rows)
        if any(ks):
            drafted_at.append(len(sch.running[0].output_ids))
        return ks

    sch.spec_dec.ctl.choose = logged
    got, _ = _serve(sch, [p], params)
    assert got == [ref] and sch.stats["spec_accepted"] > 0
    backed_off = max(t for t in drafted_at if t < 20)  # (its last draft while they were rejected)
    probe = min(t for t in drafted_at if t >= 20)
    assert probe - backed_off <= sch.spec_dec.ctl.probe_every + 8  # (+ at most one burst)


def test_drafts_leave_every_decode_its_token_in_a_tight_step_budget(ckpts):
    """Four decoding sequences, K = 4 and 10 tokens a step: the first rows' drafts are cut so that every later decode
    still gets its next token (none waits while others verify drafts, here all rejected)."""
    llm = LLM(ckpts["llama"])
    prompts, params = [[3, 4], [5, 6], [7, 8], [9, 10]], SamplingParams(max_tokens=12, ignore_eos=True)
    want = [llm.generate([p], params)[0].token_ids for p in prompts]

    class Wrong(Oracle):
        def propose(self, rows, seqs, ks, params, gens):
            return [Proposal([(t + 1) % VOCAB for t in next(r for r in self.refs if r[:len(seqs[b])] == seqs[b])[
                len(seqs[b]):len(seqs[b]) + k]]) for b, k in zip(rows, ks)]

    sch = Scheduler(llm, _config(k=4, max_num_batched_tokens=10))
    sch.spec_dec.drafter = Wrong([p + w for p, w in zip(prompts, want)])
    got, _ = _serve(sch, prompts, params)
    assert got == want and sch.stats["spec_drafted"] > 0
    assert sch.stats["steps"] == 12  # the prefill's step, then one token for each sequence a step


def test_a_greedy_rows_drafts_leave_a_later_seeded_row_its_whole_k(ckpts):
    """A seeded sampled row waits for a step with room for its whole K; a greedy row before it took all but one token
    of a tight step budget for its drafts (here all rejected), so the seeded one waited until the greedy one ended
    (27 of 30 steps). Now the greedy row's drafts leave it its K: both stream a token every step."""
    llm = LLM(ckpts["llama"])
    prompts = [[3, 4], [5, 6]]
    params = [SamplingParams(max_tokens=30, ignore_eos=True),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.9, seed=1)]

    class Wrong(Oracle):
        def propose(self, rows, seqs, ks, params, gens):
            return [Proposal([(seqs[b][-1] + 1 + i) % VOCAB for i in range(k)]) for b, k in zip(rows, ks)]

    alone = Scheduler(llm, _config(k=4, max_num_batched_tokens=8))
    alone.spec_dec.drafter = Wrong([])
    seeded, _ = _serve(alone, prompts[1:], params[1])
    sch = Scheduler(llm, _config(k=4, max_num_batched_tokens=8))
    sch.spec_dec.drafter = Wrong([])
    got, _ = _serve(sch, prompts, params)
    assert got == [llm.generate([prompts[0]], params[0])[0].token_ids, seeded[0]] and sch.stats["spec_drafted"] > 0
    assert sch.stats["steps"] == 30  # (the prefill's step gives each its first token; then a token each a step)


def test_mtp_on_a_trained_hybrid(one_thread):
    """sol-mini (Mamba-2 + MLA, a trained MTP head): drafts are accepted, the Mamba-2 states are rolled back after
    every partial acceptance, and the tokens are plain greedy's."""
    llm = LLM(SOL_MINI)
    prompts = [llm.encode(t) for t in ("To be, or not to be", "Once upon a time", "The king said", "My lord")]
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    want = [llm.generate([p], sp)[0].token_ids for p in prompts]
    sch = Scheduler(llm, _config("mtp", 3, max_model_len=128, chunk_tokens=4))
    got, _ = _serve(sch, prompts, sp)
    assert got == want
    assert 0 < sch.stats["spec_accepted"] < sch.stats["spec_drafted"]


def test_a_draft_model_served_equals_plain_generate(ckpts, tmp_path):
    """``--speculative draft:PATH``: another checkpoint with the target's vocabulary drafts over its own caches in the
    scheduler's process (five requests on four slots, chunked prefill alongside); the tokens are plain greedy's."""
    draft = tmp_path / "draft"
    build("llama", draft, seed=1)  # (a different random llama: drafts accepted sometimes, not always)
    llm = LLM(ckpts["llama"])
    want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    sch = Scheduler(llm, _config(f"draft:{draft}", 3))
    got, _ = _serve(sch, PROMPTS, GREEDY)
    assert got == want
    assert sch.stats["spec_drafted"] > 0


def test_refusals(ckpts, sol):
    from waferline.server.commands import build_server

    for kw, says in (({"speculative": "draft:/x"}, "not a checkpoint directory"),
                     ({"speculative": "medusa"}, "unknown method"),
                     ({"speculative": "ngram", "num_speculative_tokens": 0}, "num-speculative-tokens must be >= 1"),
                     ({"speculative": "ngram", "num_speculative_tokens": 10**12}, "must be at most 32")):
        with pytest.raises(ConfigError, match=says):
            build_server(sol, **kw)
    with pytest.raises(ConfigError, match="MTP"):
        Scheduler(LLM(ckpts["llama"]), _config("mtp"))


def test_a_draft_model_with_another_tokenizer_of_the_same_size_is_refused(sol, tmp_path):
    """A draft checkpoint whose vocabulary has the target's size but whose tokenizer maps text to other ids drafted
    another text's tokens (output exact, next to nothing accepted): refused by every engine's front, before weights
    load; the same tokenizer (a copy) is taken."""
    import shutil

    from waferline.demo import DEMO_TEXT, SOL_DEMO_CONFIG, write_tokenizer
    from waferline.server.commands import build_server

    other, same = tmp_path / "other", tmp_path / "same"
    for d in (other, same):
        write_random_checkpoint(SOL_DEMO_CONFIG, d)
    write_tokenizer(other, DEMO_TEXT[::-1], SOL_DEMO_CONFIG["vocab_size"])  # (the same size, other merges)
    shutil.copy(sol / "tokenizer.json", same / "tokenizer.json")
    says = "has another tokenizer than the target's .* must share the target's tokenizer"
    with pytest.raises(ConfigError, match=says):
        LLM(sol, speculative=f"draft:{other}")
    with pytest.raises(ConfigError, match=says):
        LLM(sol, speculative=f"draft:{other}", stages=2)  # (before the stage processes start)
    with pytest.raises(ConfigError, match=says):
        build_server(sol, speculative=f"draft:{other}")
    assert LLM(sol, speculative=f"draft:{same}", num_speculative_tokens=2).generate("ROMEO.", GREEDY)[0].token_ids


# ----------------------------------------------------------------------------- the live server


SOL_MINI = Path(__file__).resolve().parents[1] / "models" / "sol-mini"  # trained: its drafts are often accepted


@pytest.fixture(scope="module")
def spec_live(one_thread):


    from waferline.server.commands import build_server

    app = build_server(SOL_MINI, max_num_seqs=8, max_model_len=256, speculative="ngram", num_speculative_tokens=4,
                       speculative_adaptive=False, chunk_tokens=32)
    with serve_in_thread(app) as base:
        app.state.base = base
        yield app


def test_live_server_concurrent_streams_equal_lone_requests(spec_live):
    """Through the official openai client: 8 concurrent streams equal the same requests sent alone, which are
    plain LLM.generate's tokens; a seeded sampled request repeats exactly; /metrics counts drafts and acceptances."""
    import openai

    client = openai.OpenAI(base_url=spec_live.state.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    name = spec_live.state.server.model_name
    llm = spec_live.state.server.llm
    prompts = ["To be, or not to be", "Once upon a time", "The king said", "[Enter CAESAR.]\n\nCAESAR.",
               "I'll tell thee what", "My lord, my lord", "Exeunt.", "What say you, sir?"]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    extra = {"ignore_eos": True, "return_token_ids": True}
    for p in prompts[:3]:
        r = client.completions.create(model=name, prompt=p, max_tokens=24, temperature=0.0, extra_body=extra)
        want = llm.generate([p], sp)[0]
        assert r.choices[0].model_extra["token_ids"] == want.token_ids and r.choices[0].text == want.text

    def stream(prompt: str) -> str:
        out = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0.0, stream=True,
                                        extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in out if c.choices)

    lone = [stream(p) for p in prompts]
    with ThreadPoolExecutor(8) as ex:
        together = list(ex.map(stream, prompts))
    assert together == lone and all(lone)
    assert lone == [llm.generate([p], sp)[0].text for p in prompts]
    # stop strings taken from the plain answer (a line break, a word of its second half): the text ends before the
    # first, wherever it falls in a burst
    plain = llm.generate([prompts[0]], SamplingParams(max_tokens=24))[0].text
    words = plain.split()
    assert "\n" in plain.strip() and len(words) >= 4, plain
    for stop in (["\n"], [words[len(words) * 2 // 3]]):
        r = client.completions.create(model=name, prompt=prompts[0], max_tokens=24, temperature=0.0, stop=stop)
        want = llm.generate([prompts[0]], SamplingParams(max_tokens=24, stop=stop))[0]
        assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop" and stop[0] not in want.text
    seeded = [client.completions.create(model=name, prompt=prompts[0], max_tokens=24, temperature=0.9, seed=7,
                                        extra_body=extra).choices[0].model_extra["token_ids"] for _ in range(2)]
    assert seeded[0] == seeded[1] and len(seeded[0]) == 24
    m = _metrics(spec_live)
    assert m["waferline_spec_draft_tokens_total"] > 0 and m["waferline_spec_accepted_tokens_total"] > 0
    assert 0 < m["waferline_spec_acceptance_rate"] <= 1
    assert httpx.get(spec_live.state.base + "/health").status_code == 200
