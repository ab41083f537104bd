"""Recompute preemption, speculative decoding and shared prefix pages together over worker processes: the scheduler
over a pipeline (two stages, steps kept in flight, engine/overlap.py) and over AFD (one attention rank, two FFN ranks),
with a cache budget that holds about two of the eight requests, so sequences are preempted while verifies of others
are in flight; prompts that share prefixes (their pages are shared, then evicted); greedy and seeded sampled requests,
a stop token, requests aborted midway. Every request gets the single-process engine's tokens (greedy: LLM.generate;
seeded: the same scheduler with room for all; an aborted one a prefix of them), and afterwards nothing is left: no
page held, no step in flight, no drafter state, no verify on the first process waiting for a rollback that is not
queued. The live server with a small --cache-mb does the same for eight concurrent streams, some dropped."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

import tiny_models
from server_helpers import _metrics, _wait_until, int4_with_tokenizer, serve_in_thread
from test_serve_speculative_runners import _looping_sol
from waferline import LLM, SamplingParams
from waferline.engine.overlap import OverlapStepper, can_overlap
from waferline.engine.scheduler import Scheduler, SchedulerConfig, runner_for
from waferline.engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_thread")

NS, ML, K, PAGE = 4, 96, 3, 8
PIPELINE = {"layers_per_stage": 1, "micro_batches": 2}
AFD = {"afd": True, "attention_ranks": 1, "ffn_ranks": 2}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """sol: 2 layers (Mamba-2 + dense FFN, MLA + MoE) with an MTP head whose drafts are often accepted (fp32 and int4;
    its tokens hardly depend on the Mamba-2 state); mla: a 3-layer DeepSeek-V3 (MLA only, so prefixes are cached)
    with an MTP head; bamba: Mamba-2, attention, Mamba-2 (a stale state changes its tokens)."""
    from waferline.model.init import write_random_checkpoint

    tmp = tmp_path_factory.mktemp("spec-preempt")
    _looping_sol(tmp / "sol")
    int4_with_tokenizer(tmp / "sol", tmp / "sol4")
    tiny_models.build("deepseek_v3", tmp / "dsv3")
    cfg = json.loads((tmp / "dsv3" / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    write_random_checkpoint(cfg, tmp / "mla", seed=3)
    tiny_models.build("bamba", tmp / "bamba")
    return {"sol": tmp / "sol", "sol4": tmp / "sol4", "mla": tmp / "mla", "bamba": tmp / "bamba"}


def _config(method: str, **kw) -> SchedulerConfig:
    return SchedulerConfig(**{"max_num_seqs": NS, "max_model_len": ML, "chunk_tokens": 16, "page_tokens": PAGE,
                              "max_num_batched_tokens": 32, "speculative": method, "num_speculative_tokens": K,
                              "speculative_adaptive": False, **kw})


def _requests(single: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    """Eight prompts (the first four start with the same 16 to 19 tokens; each holds a seed, the model's greedy
    continuation of it and the seed again, for the n-gram drafter) and their parameters: greedy, seeded sampled
    (1, 4, 7), a stop token well inside the output (5), a short one (6)."""
    seeds = [[(7 * i + 3 * j) % 11 + 3 for j in range(3 + i)] for i in range(8)]
    conts = [o.token_ids for o in single.generate(seeds, SamplingParams(max_tokens=6, ignore_eos=True))]
    base = [s + c + s for s, c in zip(seeds, conts)]
    prompts = [(base[7] * 2)[:16 + i] + b for i, b in enumerate(base[:4])] + base[4:]
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True) if i % 3 == 1 else
              SamplingParams(max_tokens=20, ignore_eos=True) for i in range(8)]
    out = single.generate([prompts[5]], params[5])[0].token_ids
    j = next(j for j in range(6, len(out)) if out[j] not in out[:j])
    params[5] = SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[out[j]])
    params[6] = SamplingParams(max_tokens=7, ignore_eos=True)
    return prompts, params


def _drive(sch: Scheduler, prompts, params, aborts: dict[int, int]):
    """Run the requests through ``sch`` as the server's engine loop does (steps in flight where the runner keeps
    them); request i is aborted once it has ``aborts[i]`` tokens (with steps in flight: once it is in one, as a client
    that leaves mid-step). Returns (tokens, finish reasons, the stepper); no request gets an event after its last
    (checked here: the scheduler takes an error raised in a sink for the request's own)."""
    stepper = OverlapStepper(sch) if can_overlap(sch) else None
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    ends: dict[int, str] = {}
    late: list[int] = []
    for i, p in enumerate(prompts):
        def sink(ev, i=i):
            if i in ends:
                late.append(i)
            if ev.token_id is not None:
                got[i].append(ev.token_id)
            if ev.finished:
                ends[i] = ev.finish_reason
        sch.add(Sequence(f"r{i}", p, params[i], sink))
    pending = dict(aborts)
    for _ in range(3000):
        if not (stepper.has_work() if stepper else sch.has_work()):
            break
        (stepper or sch).step()
        for i, n in list(pending.items()):
            if len(got[i]) >= n and (stepper is None or f"r{i}" in sch.busy or i in ends):
                del pending[i]
                (stepper or sch).abort(f"r{i}")
    assert not late, f"events after the end of requests {late}"
    return [got[i] for i in range(len(prompts))], [ends.get(i) for i in range(len(prompts))], stepper


def _nothing_left(sch: Scheduler, stepper) -> None:
    """No page held (the prefix store emptied first), no step in flight, no drafter state; every verify the first
    process recorded and has not rolled back has its rollback queued (the next step takes it)."""
    c, r = sch.cache, sch.runner
    if sch.prefix is not None:
        sch.prefix.evict(float("inf"))
        assert sch.prefix.num_pages == 0
    assert c.used_bytes == 0 and sum(c.pages_in_use().values()) == 0 and c.free_slots == NS
    assert c.table.live == 0 and c.table.store_only == 0 and not any(c.table.slots)
    assert not sch.running and not sch.waiting and not sch.busy
    assert not r._submitted and not r._in_chain and not r._early and not r._verified
    if stepper is not None:
        assert not stepper.in_flight and not stepper._aborts
    d = sch.spec_dec.drafter
    if sch.spec_dec.uses_hidden:
        assert c.draft_table.live == 0 and not any(c.draft_table.slots)
        assert not any(d.committed) and all(p.shape[0] == 0 for p in d.pending) and not d._saved
    else:
        assert not any(d.indexed.values()) and not any(any(g.values()) for g in d.index.values())
    first = getattr(r.pipe.runner, "rt", r.pipe.runner)  # (stage 0 / attention rank 0: this process)
    assert set(first.rollback.rows) <= {s for s, _ in r._rewinds}


CASES = {  # checkpoint, engine, method, the budget (sequences of so many tokens): what each adds
    "pipeline-int4-mtp": ("sol4", dict(PIPELINE, weight_bits=4), "mtp", (40, 40, 16)),  # Mamba-2 rollbacks
    "pipeline-mtp": ("mla", PIPELINE, "mtp", (64, 40)),  # a preemption passes over a newer sequence in flight
    "pipeline-prefix-ngram": ("mla", PIPELINE, "ngram", (48, 48, 40)),  # prefix pages shared and evicted
    "pipeline-mamba-ngram": ("bamba", PIPELINE, "ngram", (48, 48, 40)),  # three stages, Mamba-2 on the last
    "afd-mtp": ("sol", AFD, "mtp", (40, 40, 40)),
    "afd-prefix-ngram": ("mla", AFD, "ngram", (48, 48, 40)),
    "afd-mamba-ngram": ("bamba", AFD, "ngram", (48, 48, 40)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_preemption_speculation_and_prefixes_over_processes_keep_every_token(ckpts, case):
    """Eight requests on four slots with a cache budget of about two: sequences are preempted (over a pipeline while
    other steps, verifies among them, are in flight), prefix pages shared and evicted, three requests aborted midway
    (over a pipeline while in a step in flight), one ended by a stop token inside the output. Every request gets the
    single-process engine's tokens and nothing is left afterwards (checked: preempting a sequence in flight, aborting
    one in flight at once, keeping an MTP head's hidden states past a sequence, not storing finished prefixes or not
    clearing a new sequence's slot on an attention rank each fail this test)."""
    ck, engine, method, budget = CASES[case]
    single = LLM(ckpts[ck])
    prompts, params = _requests(single)
    roomy, roomy_ends, _ = _drive(Scheduler(single, _config(method, max_num_seqs=8)), prompts, params, {})
    for i, p in enumerate(params):
        if p.temperature == 0:
            assert roomy[i] == single.generate([prompts[i]], p)[0].token_ids
    aborts = {2: 3, 4: 1, 7: 6}
    with LLM(ckpts[ck], **engine) as llm:
        probe = Scheduler(llm, _config(method), runner_for(llm, NS)).cache
        small = _config(method, cache_bytes=sum(probe.bytes_for(n) for n in budget))
        sch = Scheduler(llm, small, runner_for(llm, NS))
        got, ends, stepper = _drive(sch, prompts, params, aborts)
        assert (stepper is not None) == ("afd" not in case)
        for i in range(8):
            if i in aborts:
                assert got[i] == roomy[i][:len(got[i])] and len(got[i]) >= aborts[i] and ends[i] == "abort", i
            else:
                assert got[i] == roomy[i] and ends[i] == roomy_ends[i], i
        assert ends[5] == "stop" and len(got[5]) < 20
        st = sch.stats
        assert st["preemptions"] > 0 and 0 < st["spec_accepted"] < st["spec_drafted"]
        if stepper is not None:
            assert sch.runner.max_in_flight >= 2
        if "prefix" in case:
            assert sch.prefix is not None and sch.prefix.hit_tokens > 0 and sch.prefix.evicted_pages > 0
        _nothing_left(sch, stepper)


def test_live_server_with_a_small_cache_serves_dropped_and_kept_streams_over_a_pipeline(ckpts):
    """`serve --layers-per-stage 1 --speculative mtp --cache-mb` (about two of the requests) through the official
    openai client: eight concurrent streams, three closed midway; the others get the single-process engine's
    tokens (a seeded one the tokens of a scheduler with room for all), the closed ones a prefix of them, while
    sequences were preempted and drafts verified; once idle nothing is held and /metrics says 0 pages."""
    from waferline.server.commands import build_server

    single = LLM(ckpts["sol4"])
    prompts, params = _requests(single)
    want, want_ends, _ = _drive(Scheduler(single, _config("mtp", max_num_seqs=8)), prompts, params, {})
    probe = Scheduler(single, _config("mtp")).cache
    cfg = _config("mtp")
    app = build_server(ckpts["sol4"], max_num_seqs=NS, max_model_len=ML, chunk_tokens=cfg.chunk_tokens,
                       page_tokens=PAGE, max_num_batched_tokens=cfg.max_num_batched_tokens, speculative="mtp",
                       num_speculative_tokens=K, speculative_adaptive=False, weight_bits=4, **PIPELINE,
                       cache_mb=sum(probe.bytes_for(n) for n in (40, 40, 16)) / 2**20)
    engine = app.state.server.engine
    sch = engine.scheduler
    drops = {0: 4, 3: 2, 7: 9}
    with serve_in_thread(app) as base:
        app.state.base = base  # (for _metrics)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        name = client.models.list().data[0].id

        def stream(i: int) -> tuple[list[int], str | None]:
            p = params[i]
            out = client.completions.create(
                model=name, prompt=prompts[i], stream=True, max_tokens=p.max_tokens, temperature=p.temperature,
                seed=p.seed, extra_body={"ignore_eos": True, "return_token_ids": True,
                                         "stop_token_ids": list(p.stop_token_ids)})
            toks, reason = [], None
            for c in out:
                if c.choices:
                    toks += c.choices[0].model_extra.get("token_ids") or []
                    reason = c.choices[0].finish_reason or reason
                if i in drops and len(toks) >= drops[i]:
                    out.close()  # (the server sees the client go and aborts the request)
                    return toks, "dropped"
            return toks, reason

        with ThreadPoolExecutor(8) as ex:
            got = list(ex.map(stream, range(8)))
        assert _wait_until(lambda: not (sch.running or sch.waiting or sch.busy or engine.stepper.in_flight), 30)
        m = _metrics(app)
    for i, (toks, reason) in enumerate(got):
        if i in drops:
            assert reason == "dropped" and toks == want[i][:len(toks)], i
        else:
            assert toks == want[i] and reason == want_ends[i], i
    assert want_ends[5] == "stop" and want[1] != want[4]  # (a stop token; seeded requests of their own)
    assert sch.stats["preemptions"] > 0 and 0 < sch.stats["spec_accepted"] < sch.stats["spec_drafted"]
    assert sch.runner.max_in_flight >= 2
    assert m['waferline_cache_pages_in_use{kind="mla"}'] == 0 and m['waferline_cache_pages_in_use{kind="mtp_mla"}'] == 0
    _nothing_left(sch, engine.stepper)
