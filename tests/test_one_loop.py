"""LLM.generate / LLM.stream of the single-process engine run the scheduler's step (schedule -> execute ->
postprocess) over a LocalRunner: the same tokens as a served scheduler, greedy bursts as a runner capability the
scheduler plans, the speculative drafters (a draft model too) through the scheduler's speculation, and a stream that
ends early or fails leaves the engine usable."""

import pytest

from conftest import tiny_checkpoints
from waferline import LLM, SamplingParams, kernels
from waferline.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from waferline.errors import RequestError

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [3, 4, 5, 6, 3, 4, 5, 6, 3]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, ("llama",))


def _serve(sch: Scheduler, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    seqs = [Sequence(f"r{i}", list(p), params) for i, p in enumerate(prompts)]
    for s in seqs:
        sch.add(s)
    while sch.has_work():
        sch.step()
    return [s.output_ids for s in seqs]


def test_generate_steps_the_scheduler_and_keeps_it(ckpts, monkeypatch):
    llm = LLM(ckpts["llama"])
    phases: list[str] = []
    for name in ("schedule", "execute", "postprocess"):
        real = getattr(Scheduler, name)
        monkeypatch.setattr(Scheduler, name, lambda self, *a, _n=name, _r=real: phases.append(_n) or _r(self, *a))
    outs = llm.generate(PROMPTS, GREEDY)
    assert phases[:3] == ["schedule", "execute", "postprocess"] and len(phases) % 3 == 0
    sch = llm._scheduler
    assert isinstance(sch, Scheduler) and sch.config.max_num_seqs == 3 and not sch.has_work()
    # the served loop gives the same tokens
    assert _serve(Scheduler(llm, SchedulerConfig(max_num_seqs=4)), PROMPTS, GREEDY) == [o.token_ids for o in outs]
    # kept for as many rows as it has slots, made again for more
    assert [o.token_ids for o in llm.generate(PROMPTS[:1], GREEDY)] == [outs[0].token_ids]
    assert llm._scheduler is sch
    llm.generate(PROMPTS + [[9, 9]], GREEDY)
    assert llm._scheduler is not sch and llm._scheduler.config.max_num_seqs == 4
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in outs]


def test_server_bursts_when_nothing_waits(ckpts, monkeypatch):
    """greedy_bursts: the same tokens as step by step; no burst is planned while a request waits; the runner bursts
    where the fused operators are built."""
    llm = LLM(ckpts["llama"], dtype="bfloat16")
    want = _serve(Scheduler(llm, SchedulerConfig(max_num_seqs=4)), PROMPTS, GREEDY)
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=4, greedy_bursts=True))
    ran: list = []
    real = type(sch.runner).burst
    monkeypatch.setattr(type(sch.runner), "burst", lambda self, *a: ran.append(real(self, *a)) or ran[-1])
    assert _serve(sch, PROMPTS, GREEDY) == want
    if kernels.available():
        assert sum(r is not None for r in ran) >= 1
    # one slot, two requests: the second waits, so the first decodes step by step
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=1, greedy_bursts=True))
    for i, p in enumerate(PROMPTS[:2]):
        sch.add(Sequence(f"w{i}", list(p), GREEDY))
    sch.step()  # (the first request's prefill)
    plan = sch.schedule()
    assert sch.waiting and plan.decodes and plan.burst == 1
    sch.postprocess(plan, sch.execute(plan))
    while sch.has_work():
        sch.step()
    assert sch.cache.used_bytes == 0


def test_abandoned_or_failed_stream_leaves_the_engine_usable(ckpts, monkeypatch):
    import waferline.engine.scheduler as scheduler_mod

    llm = LLM(ckpts["llama"])
    want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    stream = llm.stream(PROMPTS, GREEDY)
    assert [next(stream) for _ in range(4)][0] == (0, want[0][0])
    stream.close()
    assert not llm._scheduler.has_work() and llm._scheduler.cache.used_bytes == 0
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=4, ignore_eos=True)
    seeded = [o.token_ids for o in LLM(ckpts["llama"]).generate(PROMPTS, sp)]

    def broken(*a, **k):
        raise ValueError("no sampler")

    monkeypatch.setattr(scheduler_mod, "sample", broken)
    with pytest.raises(RequestError, match="no sampler"):
        llm.generate(PROMPTS, sp)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == seeded


def test_draft_model_through_the_scheduler(ckpts):
    """draft:PATH: exact greedy output, and a slot reused by a later request starts with empty draft caches (the
    target as its own draft accepts every draft, on the second request too)."""
    d = ckpts["llama"]
    plain = LLM(d)
    llm = LLM(d, speculative=f"draft:{d}", num_speculative_tokens=3, speculative_adaptive=False)
    for prompts in (PROMPTS, [[20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [31]]):
        want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == want
        m = outs[0].metrics
        assert m["spec_drafted"] > 0 and m["spec_acceptance_rate"] >= 0.9
        assert m["spec_mean_accepted_length"] > 2 and m["spec_verify_steps"] >= 1 and "spec_plain_steps" in m


def test_seeded_rows_sample_as_lone_requests_of_the_scheduler(ckpts):
    """Each row of a seeded batch samples its request's own stream (request_generator): the tokens a lone request with
    the same params gets from the scheduler (the server's), whatever the row's place in the batch."""
    llm = LLM(ckpts["llama"])
    sp = SamplingParams(max_tokens=7, temperature=0.9, top_k=20, seed=9, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp)
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=1))
    for i, p in enumerate(PROMPTS):
        seq = Sequence(f"s{i}", list(p), sp)  # (no generator: add gives it the request's)
        sch.add(seq)
        while sch.has_work():
            sch.step()
        assert seq.output_ids == outs[i].token_ids


def test_a_loop_that_fails_outside_a_step_ends_every_request_and_says_so(ckpts, monkeypatch):
    """An exception in the loop's own bookkeeping (here an abort's) killed the engine thread: requests in flight and
    queued waited for events that never came, and ``on_fatal`` (the server's exit) was never called."""
    import threading

    from waferline.engine.loop import EngineLoop

    llm = LLM(ckpts["llama"])
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=2))
    told: list[str] = []
    loop = EngineLoop(sch, on_fatal=told.append)
    loop.stepper = None  # (the plain step loop; an overlap stepper aborts the same way)
    done, events = threading.Event(), []

    def sink(e):
        events.append(e)
        if e.finished:
            done.set()

    monkeypatch.setattr(Scheduler, "abort", lambda self, rid: 1 / 0)
    loop.start()
    loop.pause()  # (both reach the loop at its next wakeup)
    loop.submit([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), sink)
    loop.abort("another request")
    loop.resume()
    assert done.wait(30), "the request was left waiting on a dead engine loop"
    assert events[-1].finish_reason == "error" and "ZeroDivisionError" in events[-1].error
    assert len(told) == 1 and "the engine loop failed" in told[0] and not loop.healthy
    loop.shutdown()
