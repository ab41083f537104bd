"""`waferline serve` over worker processes: the server's continuous-batching scheduler drives two int4 pipeline stages
of one layer each (engine/pipeline/serving.py), or two attention ranks and an FFN rank (engine/afd/serving.py).
Concurrent requests give what each gives alone and what LLM.generate gives with the same flags; a process that dies
fails every request in flight or queued, and the processes are started again."""

import contextlib
import gc
import os
import re
import signal
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from server_helpers import KEY, _free_port, _wait_until, int4_with_tokenizer, start_serve
from waferline import LLM, SamplingParams
from waferline.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 128
HANG_TIMEOUT_S = 4.0
PROMPTS = ["To be, or not to be", "Once more unto the breach", "A horse! a horse!", "Now is the winter",
           "Friends, Romans, countrymen", "What light through yonder", "All the world", "If music be the food"]
ENGINES = {  # (hang_timeout_s: the watchdog's, for the tests of a hung process)
    "pipeline": {"layers_per_stage": 1, "micro_batches": 2, "weight_bits": 4, "hang_timeout_s": HANG_TIMEOUT_S},
    "afd": {"afd": True, "attention_ranks": 2, "ffn_ranks": 1, "hang_timeout_s": HANG_TIMEOUT_S},  # 16-bit weights
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """A 2-layer sol checkpoint (Mamba-2 + dense FFN, MLA + MoE) with a tokenizer: fp32 for AFD, int4 for the
    pipeline."""

    from waferline.demo import DEMO_TEXT, SOL_DEMO_CONFIG, write_tokenizer
    from waferline.model.init import write_random_checkpoint

    tmp = tmp_path_factory.mktemp("serve-pipeline")
    cfg = dict(SOL_DEMO_CONFIG, num_hidden_layers=2, mixer_types=["mamba2", "mla"], ffn_types=["dense", "moe"])
    write_random_checkpoint(cfg, tmp / "fp32")
    write_tokenizer(tmp / "fp32", DEMO_TEXT, cfg["vocab_size"])
    int4_with_tokenizer(tmp / "fp32", tmp / "int4")
    return {"pipeline": tmp / "int4", "afd": tmp / "fp32"}


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def ckpt(ckpts, engine) -> Path:
    return ckpts[engine]


class LiveServer:
    """A server in this process (uvicorn in a thread) on a free loopback port, with the engine ``flags``."""

    def __init__(self, ckpt: Path, flags: dict, **kw):
        import uvicorn

        from waferline.server.commands import build_server

        self.app = build_server(ckpt, max_model_len=MAX_LEN, api_key=KEY, served_model_name="sol-pipe",
                                chunk_tokens=16, **flags, **kw)
        self.engine = self.app.state.server.engine
        port = _free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        assert _wait_until(lambda: self.server.started, 30), "server did not start"
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key=KEY, max_retries=0, timeout=60)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()

    def health(self) -> httpx.Response:
        return httpx.get(self.base + "/health", timeout=5)

    def stream(self, prompt: str, **kw) -> tuple[str, list[int], str | None]:
        """One streamed completion: (text, token ids, finish reason)."""
        text, toks, reason = [], [], None
        for c in self.client.completions.create(model="sol-pipe", prompt=prompt, stream=True,
                                                extra_body={"ignore_eos": True, "return_token_ids": True, **kw.pop(
                                                    "extra_body", {})}, **kw):
            if c.choices:
                text.append(c.choices[0].text)
                toks += c.choices[0].model_extra.get("token_ids") or []
                reason = c.choices[0].finish_reason or reason
        return "".join(text), toks, reason


@pytest.fixture(scope="module")
def live(ckpt, engine):
    s = LiveServer(ckpt, ENGINES[engine], max_num_seqs=8)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(ckpt, engine):
    """LLM.generate with the server's flags (the pipeline / AFD), and the single-process engine, per prompt."""
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    with LLM(ckpt, **ENGINES[engine]) as llm:
        pipe = [o.text for o in llm.generate(PROMPTS, greedy)]
        pipe_sampled = llm.generate([PROMPTS[2]], sampled)[0].token_ids
    single = LLM(ckpt)  # (an int4 checkpoint loads as int4)
    return {"greedy": greedy, "sampled": sampled, "pipe": pipe, "pipe_sampled": pipe_sampled,
            "single": [o.text for o in single.generate(PROMPTS, greedy)],
            "single_sampled": single.generate([PROMPTS[2]], sampled)[0].token_ids}


def test_concurrent_streams_match_alone_and_generate(live, reference, engine):
    pipe, sch = live.engine.scheduler.runner.pipe, live.engine.scheduler
    assert pipe.num_stages == (2 if engine == "pipeline" else 3)  # (AFD: processes)
    mbs, steps = pipe._mb_ids, sch.stats["steps"]
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        together = list(ex.map(lambda p: live.stream(p, max_tokens=12, temperature=0), PROMPTS))
    # steps of several rows went as 2 micro-batches, or (a pipeline's engine loop) 2 steps were in flight at once
    assert pipe._mb_ids - mbs > sch.stats["steps"] - steps or getattr(sch.runner, "max_in_flight", 0) >= 2
    alone = [live.stream(p, max_tokens=12, temperature=0) for p in PROMPTS]
    assert [t[2] for t in together] == ["length"] * len(PROMPTS)
    assert [len(t[1]) for t in together] == [12] * len(PROMPTS)
    assert [t[0] for t in together] == [a[0] for a in alone]
    assert [t[1] for t in together] == [a[1] for a in alone]
    assert [t[0] for t in together] == reference["pipe"]
    assert reference["pipe"] == reference["single"]  # (the engine's own check: its processes are the model)


def test_steps_stay_in_flight_and_give_the_tokens_of_lone_requests(live, engine):
    """Over a pipeline the engine loop keeps up to M steps in flight over disjoint sequences (engine/overlap.py):
    8 concurrent greedy requests had two steps in flight at some point and give what each gives alone."""
    if engine != "pipeline":
        pytest.skip("only a pipeline's runner keeps steps in flight")
    runner = live.engine.scheduler.runner
    assert live.engine.stepper is not None and live.engine.stepper.depth == 2
    runner.max_in_flight = 0
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        together = list(ex.map(lambda p: live.stream(p, max_tokens=12, temperature=0), PROMPTS))
    assert runner.max_in_flight == 2
    alone = [live.stream(p, max_tokens=12, temperature=0) for p in PROMPTS]
    assert [t[1] for t in together] == [a[1] for a in alone]
    assert [len(t[1]) for t in together] == [12] * len(PROMPTS)
    assert not live.engine.scheduler.busy and not runner._submitted


def test_seeded_sampled_request_repeats(live, reference):
    kw = dict(max_tokens=12, temperature=0.8, top_p=0.9, seed=11)
    alone = live.stream(PROMPTS[2], **kw)[1]
    with ThreadPoolExecutor(4) as ex:  # alongside other requests (greedy and sampled with other seeds)
        futs = [ex.submit(live.stream, PROMPTS[0], max_tokens=20, temperature=0.7, seed=3),
                ex.submit(live.stream, PROMPTS[1], max_tokens=20, temperature=0),
                ex.submit(live.stream, PROMPTS[2], **kw)]
        busy = futs[2].result()[1]
        [f.result() for f in futs]
    assert alone == busy == reference["pipe_sampled"] == reference["single_sampled"]
    assert len(alone) == 12


def test_logprobs_over_processes_are_the_single_process_engines(live, ckpt):
    """A request with logprobs over the pipeline's stages (AFD's ranks), beside greedy requests without: its tokens and
    log-probabilities (the last stage's logits, sampled in the scheduler's process) are the single-process engine's."""
    want = LLM(ckpt).generate([PROMPTS[3]], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2))[0]
    with ThreadPoolExecutor(3) as ex:
        others = [ex.submit(live.stream, p, max_tokens=10, temperature=0) for p in PROMPTS[:2]]
        r = live.client.completions.create(model="sol-pipe", prompt=PROMPTS[3], max_tokens=10, temperature=0,
                                           logprobs=2, extra_body={"ignore_eos": True, "return_token_ids": True})
        [f.result() for f in others]
    c = r.choices[0]
    assert c.model_extra["token_ids"] == want.token_ids
    assert c.logprobs.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    assert [max(t, key=t.get) for t in c.logprobs.top_logprobs] == c.logprobs.tokens  # greedy: the top token
    # an echoed prompt scored over the processes, in prefill chunks of 16 tokens: one process's model run in the same
    # pieces (prefilled whole, int4's products round otherwise: docs/w4a16.md, up to 4e-4 here)
    single = LLM(ckpt)
    ids = single.encode(" ".join(PROMPTS))[:40]
    scored = live.client.completions.create(model="sol-pipe", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    got = scored.choices[0].logprobs.token_logprobs
    assert len(ids) == 40 and got[0] is None
    assert got[1:] == pytest.approx(_prefilled_in_pieces(single, ids, 16)[range(39), ids[1:]].tolist(), abs=1e-5)


def _prefilled_in_pieces(llm: LLM, ids: list[int], n: int):
    """log_softmax of ``llm``'s logits at every position of ``ids``, prefilled in pieces of ``n`` tokens."""
    import torch

    from waferline.model.context import StepBatch

    with torch.inference_mode():
        caches, out = llm.model.new_caches(1, llm.device), []
        for s in range(0, len(ids), n):
            piece = ids[s:s + n]
            h = llm.model(torch.tensor([piece], device=llm.device), caches,
                          StepBatch.make([0], [s], len(piece), llm.device))
            out.append(torch.log_softmax(llm.model.logits(h[0]).float(), dim=-1).cpu())
    return torch.cat(out)


def test_structured_output_over_processes_is_the_single_process_engines(live, ckpt):
    """A regex-held sampled request over the pipeline's stages (AFD's ranks), beside plain ones: the tokens the
    single-process engine samples under the same constraint, and a whole match where it stopped."""
    params = dict(max_tokens=24, temperature=0.9, seed=3)
    regex = "(the|a) [a-z]+ of [A-Z][a-z]+[.!]"
    want = LLM(ckpt).generate([PROMPTS[1]], SamplingParams(regex=regex, **params))[0]
    with ThreadPoolExecutor(3) as ex:
        others = [ex.submit(live.stream, p, max_tokens=10, temperature=0) for p in PROMPTS[:2]]
        c = live.client.completions.create(model="sol-pipe", prompt=PROMPTS[1], extra_body={"guided_regex": regex},
                                           **params).choices[0]
        [f.result() for f in others]
    assert c.text == want.text and c.finish_reason == want.finish_reason
    assert c.finish_reason == "length" or re.fullmatch(regex, c.text)


def test_a_bad_request_is_400_while_the_others_finish(live, reference):
    with ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(live.stream, p, max_tokens=12, temperature=0) for p in PROMPTS[:3]]
        time.sleep(0.05)
        for bad in ({"max_tokens": MAX_LEN + 1}, {"top_p": -1.0}, {"max_tokens": 4, "extra_body": {"top_k": -2}}):
            with pytest.raises(openai.BadRequestError):
                live.client.completions.create(model="sol-pipe", prompt="hello", **bad)
        got = [f.result() for f in futs]
    assert [g[0] for g in got] == reference["pipe"][:3]
    assert live.health().json()["status"] == "ok"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_dead_or_hung_process_fails_every_request_then_they_are_restarted(ckpt, engine, reference, sig):
    """A worker process killed (or stopped: a hang) while requests stream: every running and queued request ends with
    an error within the hang timeout (a dead one is noticed at once), /health and new requests answer 503 while new
    processes start, then the server answers as before."""
    s = LiveServer(ckpt, ENGINES[engine], max_num_seqs=2)
    try:
        runner = s.engine.scheduler.runner
        rebuilding, checked = threading.Event(), threading.Event()
        rebuild = runner.rebuild

        def held_rebuild():  # (the new processes start once the test has looked at the server meanwhile)
            rebuilding.set()
            assert checked.wait(60)
            return rebuild()

        runner.rebuild = held_rebuild

        def doomed_stream(prompt: str) -> BaseException | None:
            try:
                s.stream(prompt, max_tokens=MAX_LEN - 16, temperature=0)
            except openai.APIError as e:
                return e
            return None

        def doomed_call(prompt: str) -> BaseException | None:
            try:
                s.client.completions.create(model="sol-pipe", prompt=prompt, max_tokens=MAX_LEN - 16,
                                            extra_body={"ignore_eos": True})
            except openai.APIError as e:
                return e
            return None

        pids = s.engine.scheduler.runner.pipe.pids
        with ThreadPoolExecutor(4) as ex:
            streams = [ex.submit(doomed_stream, p) for p in PROMPTS[:3]]  # 2 running, 1 queued (2 slots)
            queued = ex.submit(doomed_call, PROMPTS[3])
            assert _wait_until(lambda: s.engine.scheduler.stats["generated_tokens"] >= 8, 30)
            assert len(s.engine.scheduler.waiting) + len(s.engine._inbox) >= 1
            t0 = time.monotonic()
            os.kill(pids[0], sig)
            errors = [f.result(timeout=60) for f in streams] + [queued.result(timeout=60)]
            took = time.monotonic() - t0
        assert all(isinstance(e, openai.APIError) for e in errors), errors
        victim = "stage 1" if engine == "pipeline" else "attention rank 1"
        assert victim in str(errors[0]) and ("died" if sig == signal.SIGKILL else "hung") in str(errors[0]), errors[0]
        assert isinstance(errors[-1], openai.InternalServerError) and errors[-1].status_code == 503
        limit = HANG_TIMEOUT_S if sig == signal.SIGKILL else HANG_TIMEOUT_S + 2.0  # (+ the watchdog's polling)
        assert took < limit, f"the requests took {took:.1f} s to fail"
        assert rebuilding.wait(30)
        health = s.health()
        assert health.status_code == 503 and health.json()["status"] == "unhealthy", health.text
        with pytest.raises(openai.InternalServerError) as refused:  # a request while the processes restart
            s.client.completions.create(model="sol-pipe", prompt="hello", max_tokens=2)
        assert refused.value.status_code == 503 and "recovering" in str(refused.value)
        checked.set()
        assert _wait_until(lambda: s.health().status_code == 200, 60, 0.1), s.health().json()
        assert s.health().json()["recoveries"] == 1
        assert s.engine.scheduler.runner.pipe.pids != pids
        out = s.client.completions.create(model="sol-pipe", prompt=PROMPTS[5], max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert out.choices[0].text == reference["pipe"][5]
    finally:
        s.close()


@pytest.mark.parametrize("flags, says", [
    (["--attention-ranks", "2"], "needs --afd"),
    (["--afd", "--stages", "2"], "two different engines"),
    (["--afd", "--device", "cuda"], "AFD's ranks run on CPU"),
    (["--micro-batches", "2"], "needs --stages S, --layers-per-stage K or --afd"),
    (["--hang-timeout", "3"], "needs --stages S, --layers-per-stage K or --afd"),
    (["--stages", "2", "--layers-per-stage", "1"], "not both"),
    (["--group-size", "64"], "needs --weight-bits 4"),
    (["--num-speculative-tokens", "2"], "--num-speculative-tokens needs --speculative METHOD"),
])
def test_serve_refuses_flags_it_cannot_honour(ckpts, capsys, flags, says):
    assert main(["serve", "--model", str(ckpts["afd"]), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1


def test_a_hang_timeout_that_turns_the_watchdog_off_is_refused(ckpts, capsys):
    """`--hang-timeout` / `hang_timeout_s` of inf, NaN, 0 or below: a stage that hung was never named (the watchdog
    waited forever or skipped its check), so each is refused before any process starts."""
    from waferline.errors import ConfigError

    for bad in ("inf", "nan", "0", "-1"):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--model", str(ckpts["afd"]), "--stages", "2", "--hang-timeout", bad])
        assert e.value.code == 2
        assert f"argument --hang-timeout: expected a finite number > 0, got {bad}" in capsys.readouterr().err
    for bad in (float("inf"), float("nan"), 0, -1.0):
        for engine in ({"stages": 2}, {"afd": True}):
            with pytest.raises(ConfigError, match="hang_timeout_s must be a finite number of seconds > 0"):
                LLM(ckpts["afd"], hang_timeout_s=bad, **engine)


def test_threads_that_are_not_a_whole_number_above_zero_are_refused(ckpts):
    """``threads_per_stage`` / ``threads_per_rank`` of 0 or below, a fraction or a string: one ConfigError naming the
    option before any process starts (-1 was torch's "set_num_threads expects a positive integer" RuntimeError; 2.5
    was taken as 2)."""
    from waferline.errors import ConfigError

    for bad in (0, -1, 2.5, "2", True):
        for engine in ({"stages": 2}, {"afd": True}):
            with pytest.raises(ConfigError, match="threads_per_stage must be a whole number >= 1"):
                LLM(ckpts["afd"], threads_per_stage=bad, **engine)
    with pytest.raises(ConfigError, match="threads_per_rank must be a whole number >= 1"):
        LLM(ckpts["afd"], afd=True, threads_per_rank=0)


@pytest.mark.parametrize("flags, want", [
    (["--stages", "2", "--torch-threads", "3"], {"threads_per_stage": 3, "stages": 2}),
    (["--afd", "--torch-threads", "2"], {"threads_per_stage": 2, "afd": True}),
    (["--torch-threads", "2"], {}),  # (one process: the engine loop's own threads, no stage processes)
    (["--device", "cuda"], {"device": "cuda"}),
])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_serve_hands_threads_and_device_to_the_engine(ckpts, monkeypatch, command, flags, want):
    """`--torch-threads` is every stage / rank process's thread count (only stage 0's was set; the others took the
    cores divided among them), and `--device` reaches the engine (it was refused); `generate` takes both as `serve`
    does (it had no `--torch-threads`)."""
    calls = _fake_llm(monkeypatch)
    argv = ["--port", str(_free_port())] if command == "serve" else ["--prompt-ids", "1 2"]
    with pytest.raises(_Stop):
        main([command, "--model", str(ckpts["afd"]), *argv, *flags])
    seen = calls[-1]
    assert {k: seen.get(k) for k in want} == want
    if not want:
        assert "threads_per_stage" not in seen and "device" not in seen
    if command == "generate" and "--torch-threads" in flags:  # (this process too: stage 0, or the only one)
        assert calls[:-1] == [int(flags[flags.index("--torch-threads") + 1])]


class _Stop(Exception):
    """What the fake LLM of ``_fake_llm`` raises: the command got as far as loading the model."""


def _fake_llm(monkeypatch) -> list:
    """LLM replaced by a fake that records its keyword arguments, and torch.set_num_threads its count, in the list
    returned (in call order), then raises _Stop."""
    import waferline.engine.llm as llm_module

    calls: list = []

    def fake(path, **kw):
        calls.append(kw)
        raise _Stop

    monkeypatch.setattr(llm_module, "LLM", fake)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    return calls


def test_a_single_process_server_leaves_a_core_to_its_own_threads(ckpts, monkeypatch):
    """Without --torch-threads the single-process server's engine takes the cores torch would take less one (the
    event loop, tokenizing and detokenizing share the cores with it; an intra-op team waits at every operator for a
    descheduled thread: 2 threads served 16 clients at less than half the tokens/s of 1 on 2 cores); OMP_NUM_THREADS
    or --torch-threads are taken as they are."""
    from waferline.server.commands import build_server

    def engine_threads(**kw):
        app = build_server(ckpts["afd"], max_num_seqs=1, max_model_len=MAX_LEN, **kw)
        try:
            return app.state.server.engine.torch_threads
        finally:
            app.state.server.engine.shutdown()

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert engine_threads() == 3
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert engine_threads() == 1
    assert engine_threads(torch_threads=2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert engine_threads() is None  # (torch's own: the environment's)


def test_generate_takes_the_servers_default_threads(ckpts, monkeypatch):
    """`waferline generate` in one process takes the cores less one by default, as serve's engine does (the same
    flags, the same output: an fp32 product may round differently on another thread count); OMP_NUM_THREADS is
    taken as it is; a pipeline's stages keep the cores divided among them (nothing set here)."""
    seen = _fake_llm(monkeypatch)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for flags, want in (([], [3]), (["--stages", "2"], [])):
        seen.clear()
        with pytest.raises(_Stop):
            main(["generate", "--model", str(ckpts["afd"]), "--prompt-ids", "1 2", *flags])
        assert seen[:-1] == want and "threads_per_stage" not in seen[-1]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    seen.clear()
    with pytest.raises(_Stop):
        main(["generate", "--model", str(ckpts["afd"]), "--prompt-ids", "1 2"])
    assert seen[:-1] == []


@pytest.mark.parametrize("which, dtype", [("pipeline", "bfloat16")])
def test_tokens_and_logprobs_do_not_depend_on_the_engines_threads(ckpts, which, dtype):
    """The server's engine takes a thread fewer than `waferline generate` by default: served output equals generate's
    only if no operator's result depends on how many threads split it: so with int4 weights and bf16 activations
    (prompt chunks and a 4-row decode; Mamba-2, MLA, MoE). Not so in fp32, whose products are ATen's MKL GEMM: a
    4-row product rounded its last bit differently on 1 and 2 threads (docs/server.md says so)."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [[(5 * i + 3 * j) % 50 + 3 for j in range(4 + 9 * i)] for i in range(4)]
    got = []
    before = torch.get_num_threads()
    try:
        with LLM(ckpts[which], dtype=dtype) as llm:
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                got.append([(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs])
                            for o in llm.generate(prompts, params)])
    finally:
        torch.set_num_threads(before)
    assert got[0] == got[1] == got[2]


@pytest.mark.parametrize("command, flags, want", [
    ("serve", ["--torch-threads", "3"], {"threads_per_stage": 3, "device": "cpu"}),
    ("serve", ["--device", "cuda"], {"device": "cuda"}),
    ("generate", ["--prompt-ids", "1 2", "--device", "cuda"], {"device": "cuda"}),
    ("generate", ["--prompt-ids", "1 2", "--torch-threads", "3"], {"threads_per_stage": 3}),
])
def test_under_torchrun_a_worker_rank_takes_the_device_and_threads(ckpts, monkeypatch, command, flags, want):
    """Under torchrun every rank runs the command and ranks >= 1 serve their stage (serve_from_env): they take the
    --device rank 0 takes (they ran on the CPU whatever it said) and serve's --torch-threads (they took torch's
    default)."""
    import waferline.engine.pipeline as pipeline

    seen: dict = {}
    monkeypatch.setattr(pipeline, "serve_from_env", lambda *a, **kw: seen.update(kw) or 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main([command, "--model", str(ckpts["afd"]), "--stages", "2", *flags]) == 0
    assert {k: seen.get(k) for k in want} == want


def _held() -> dict[str, int]:
    """What this process holds: open descriptors, threads (gloo's too) and live engine objects."""
    from waferline.engine.pipeline import Pipeline
    from waferline.engine.pipeline.serving import PipelineRunner
    from waferline.engine.scheduler import Scheduler

    out = {"pipelines": 0, "runners": 0, "schedulers": 0}
    for o in gc.get_objects():  # (no closure over the list: a cell in it would keep every object alive)
        for k, cls in (("pipelines", Pipeline), ("runners", PipelineRunner), ("schedulers", Scheduler)):
            out[k] += issubclass(type(o), cls)
    names: dict[str, int] = {}
    for t in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            name = open(f"/proc/self/task/{t}/comm").read().strip()
            names[name] = names.get(name, 0) + 1
    return dict(out, fds=len(os.listdir("/proc/self/fd")), threads=len(os.listdir("/proc/self/task")),
                names=names, py=sorted(t.name for t in threading.enumerate()))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors and threads in /proc")
def test_processes_restarted_again_and_again_leave_nothing_behind(ckpt, engine):
    """A server that survives faults must not grow: after each fault mid-stream and the rebuild, the old pipeline / AFD
    engine (its process groups' sockets and threads, its store's port, its runner) is let go at once, without waiting
    for a full garbage collection (a fault's traceback held the old engine in a cycle; the LLM's own scheduler held
    the first one for good)."""
    s = LiveServer(ckpt, ENGINES[engine], max_num_seqs=2)
    try:
        engines = [weakref.ref(s.engine.scheduler.runner.pipe)]  # (every pipeline / AFD engine the server had)

        def fault(n: int) -> None:
            sch = s.engine.scheduler
            start = sch.stats["generated_tokens"]
            with ThreadPoolExecutor(1) as ex:
                doomed = ex.submit(s.stream, PROMPTS[0], max_tokens=MAX_LEN - 16, temperature=0)
                assert _wait_until(lambda: sch.stats["generated_tokens"] >= start + 4, 30)
                os.kill(sch.runner.pipe.pids[0], signal.SIGKILL)  # mid-stream: the step fails with a traceback
                with pytest.raises(openai.APIError):
                    doomed.result(timeout=60)
            assert _wait_until(lambda: s.engine.recoveries == n and s.health().status_code == 200, 60, 0.1)
            engines.append(weakref.ref(sch.runner.pipe))
            s.stream(PROMPTS[1], max_tokens=4)

        s.stream(PROMPTS[1], max_tokens=4)
        fault(1)  # (one fault first: whatever a first fault sets up once is in the baseline)
        gc.collect()
        gc.disable()
        try:
            before = _held()
            for n in range(2, 5):
                fault(n)
            # (an old engine's threads and sockets end a moment after it is let go: a leak is what stays)
            _wait_until(lambda: (lambda h: h["fds"] <= before["fds"] + 2 and h["threads"] <= before["threads"] + 1)(
                _held()), 5, 0.1)
            after = _held()
            kept = [i for i, ref in enumerate(engines[:-1]) if ref() is not None]
        finally:
            gc.enable()
        assert kept == [], f"the engines before faults {[i + 1 for i in kept]} are still alive"
        assert {k: after[k] - before[k] for k in ("pipelines", "runners", "schedulers")} == \
            {"pipelines": 0, "runners": 0, "schedulers": 0}, (before, after)
        grown = {k: v - before["names"].get(k, 0) for k, v in after["names"].items() if v != before["names"].get(k, 0)}
        assert after["fds"] <= before["fds"] + 2 and after["threads"] <= before["threads"] + 1, \
            (before["fds"], after["fds"], grown, sorted(set(after["py"]) - set(before["py"])))
    finally:
        s.close()


def test_when_the_processes_cannot_be_restarted_the_engine_stops(ckpts):
    """The other outcome of a fault: new stages cannot be started, so the engine stops for good, /health and new
    requests answer 503, and the server is told (``on_fatal``: the CLI exits non-zero)."""
    told: list[str] = []
    s = LiveServer(ckpts["pipeline"], ENGINES["pipeline"], max_num_seqs=2, on_fatal=told.append)
    try:
        def no_rebuild():
            raise OSError("no room for new stage processes")

        s.engine.scheduler.runner.rebuild = no_rebuild
        os.kill(s.engine.scheduler.runner.pipe.pids[0], signal.SIGKILL)  # while idle: the watchdog notices
        assert _wait_until(lambda: told, 30), "the engine did not stop"
        assert "stage 1" in told[0] and "no room for new stage processes" in told[0]
        health = s.health()
        assert health.status_code == 503 and "could not recover" in health.json()["reason"]
        with pytest.raises(openai.InternalServerError) as refused:
            s.client.completions.create(model="sol-pipe", prompt="hello", max_tokens=2)
        assert refused.value.status_code == 503
    finally:
        s.close()


def test_under_an_env_launch_a_dead_stage_stops_the_server_at_once(ckpts, monkeypatch):
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand: rank 0 cannot start the stage processes of the other ranks
    again (every rank stops after a fault), so a fault stops the engine at once, saying why. It answered 503 "retry
    shortly" while it waited 120 s for ranks that never came, or failed to listen on MASTER_PORT again and told the
    user to pick a free one."""
    from server_helpers import env_launch_worker
    from waferline.server.commands import build_server

    with env_launch_worker(ckpts["afd"], monkeypatch) as worker:
        told: list[str] = []
        app = build_server(ckpts["afd"], max_model_len=MAX_LEN, stages=2, hang_timeout_s=2.0, threads_per_stage=1,
                           on_fatal=told.append)
        engine = app.state.server.engine
        try:
            assert engine.healthy
            worker.kill()
            assert _wait_until(lambda: told, 20), "the engine did not stop"
            assert "stage 1" in told[0] and "env:// launch" in told[0] and "MASTER_PORT" not in told[0], told[0]
            assert not engine.healthy and "could not recover" in engine.unavailable_reason()
        finally:
            engine.shutdown()


def test_engine_flags_reach_the_single_process_engine_and_the_pipeline(ckpts):
    """serve's int4-on-load and int8-head flags mean what they mean to LLM (and `waferline generate`): the served
    model is quantized the same way and answers the same text, in one process and as a pipeline of two stages (whose
    stages each convert their own layers; a pipeline refused both flags)."""
    from waferline.model.quant import is_int4

    flags = {"weight_bits": 4, "group_size": 32, "head_bits": 8}
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.text for o in LLM(ckpts["afd"], **flags).generate(PROMPTS[:3], greedy)]
    s = LiveServer(ckpts["afd"], flags)
    try:
        model = s.engine.scheduler.runner.model
        assert is_int4(model) and model.lm_head is None and model.lm_head_int8 is not None
        assert [s.stream(p, max_tokens=12, temperature=0)[0] for p in PROMPTS[:3]] == want
        assert want != [o.text for o in LLM(ckpts["afd"]).generate(PROMPTS[:3], greedy)]  # (the flags matter)
    finally:
        s.close()
    s = LiveServer(ckpts["afd"], dict(flags, stages=2, threads_per_stage=1))
    try:
        assert [s.stream(p, max_tokens=12, temperature=0)[0] for p in PROMPTS[:3]] == want
    finally:
        s.close()


def _descendants(pid: int) -> set[int]:
    """Process ids below ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, pending = set(), [pid]
    while pending:
        p = pending.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out.update(kids)
        pending += kids
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_serve_command_with_stages(ckpts):
    """`waferline serve --layers-per-stage 1 --micro-batches 2 --weight-bits 4` in its own process: it answers as
    the single-process engine does, and stopping it stops its stage processes."""
    want = LLM(ckpts["pipeline"]).generate([PROMPTS[0]], SamplingParams(max_tokens=12, ignore_eos=True))[0].text
    p, port = start_serve(ckpts["pipeline"], "--max-model-len", str(MAX_LEN), "--weight-bits", "4",
                          "--layers-per-stage", "1", "--micro-batches", "2", limit=90)
    try:
        workers = _descendants(p.pid)
        assert workers
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        r = c.completions.create(model="int4", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
    finally:
        p.terminate()
        p.wait(30)
    assert _wait_until(lambda: not any(_alive(w) for w in workers), 15), [w for w in workers if _alive(w)]
