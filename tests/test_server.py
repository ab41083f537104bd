"""The scheduler (page accounting, chunked prefill, preemption) and the OpenAI-compatible server, tested with the
official `openai` client against a live server on 127.0.0.1."""

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tiny_models import build
from waferline import LLM, SamplingParams
from waferline.demo import DEMO_TEXT, SOL_DEMO_CONFIG, write_tokenizer
from waferline.engine.scheduler import CacheManager, Scheduler, SchedulerConfig, Sequence
from waferline.errors import ConfigError, RequestError
from waferline.model.init import write_random_checkpoint

KEY = "sk-test-key"
MAX_LEN = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until(cond, limit=30.0, every=0.05):
    """Poll ``cond`` until it is truthy (returns its value) or ``limit`` seconds pass (returns the last value)."""
    end = time.monotonic() + limit
    while True:
        v = cond()
        if v or time.monotonic() > end:
            return v
        time.sleep(every)


@pytest.fixture(scope="module")
def threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and the machine is shared
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def sol(tmp_path_factory):
    d = tmp_path_factory.mktemp("sol-serve")
    write_random_checkpoint(SOL_DEMO_CONFIG, d)
    write_tokenizer(d, DEMO_TEXT, SOL_DEMO_CONFIG["vocab_size"])
    return d


@pytest.fixture(scope="module")
def live(sol, threads):
    """A live server in this process (uvicorn in a thread) on a free loopback port."""
    import uvicorn

    from waferline.server.commands import build_server

    app = build_server(sol, max_num_seqs=16, max_model_len=MAX_LEN, api_key=KEY, served_model_name="sol-test",
                       max_body_bytes=64 * 1024, chunk_tokens=32)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    assert _wait_until(lambda: server.started, 30), "server did not start"
    app.state.base = f"http://127.0.0.1:{port}"
    yield app
    server.should_exit = True
    t.join(10)
    app.state.server.engine.shutdown()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.state.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _metrics(live) -> dict[str, float]:
    out = {}
    for line in httpx.get(live.state.base + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _pages_in_use(live) -> float:
    return sum(v for k, v in _metrics(live).items() if k.startswith("waferline_cache_pages_in_use"))


# ----------------------------------------------------------------------------- scheduler


def test_page_accounting_is_the_modelspec_accounting(sol, tmp_path):
    gpt = tmp_path / "gpt_oss"
    build("gpt_oss", gpt)  # one sliding-window (8) GQA layer, one full GQA layer
    for d in (sol, gpt):
        llm = LLM(d)
        cm = CacheManager(llm.spec, max_num_seqs=4, max_model_len=128, page_tokens=8, kv_bits=32, state_bits=32)
        kinds = {p.kind for p in cm.pools}
        assert kinds == ({"mamba2", "mla"} if d == sol else {"swa", "gqa"})
        for n in (8, 64, 128):  # page-aligned: the bytes a sequence holds are exactly the spec's
            assert cm.bytes_for(n) == pytest.approx(llm.spec.cache_bytes_per_seq(n, 32, 32))
        assert cm.budget == pytest.approx(4 * llm.spec.cache_bytes_per_seq(128, 32, 32))
        if d == gpt:
            swa = [p.kind for p in cm.pools].index("swa")
            assert cm.pages_for(100)[swa] == 1  # bounded by the window of 8 tokens
            assert cm.pages_for(100)[1 - swa] == 13
        else:
            assert cm.pages_for(100)[[p.kind for p in cm.pools].index("mamba2")] == 1  # one state slot
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        CacheManager(llm.spec, 4, 128, cache_bytes=100.0)
    with pytest.raises(ConfigError, match="max-num-seqs"):
        SchedulerConfig(max_num_seqs=0).validate()


def test_incremental_text_is_the_whole_decode(sol):
    """The scheduler decodes a sequence's text incrementally (Scheduler._text: the tokens since the last piece with
    that piece's tokens): after every token it is the whole output decoded at once, up to a last character still
    incomplete (U+FFFD), with the demo's byte-level tokenizer and sol-mini's: random token ids (bytes that do not
    form characters included), its own text's ids, and a tokenizer whose pieces do not add up (then the whole output
    again); the step's tokens each add a bounded window, not the whole output."""
    g = torch.Generator().manual_seed(5)
    for d in (sol, Path(__file__).resolve().parents[1] / "models" / "sol-mini"):
        llm = LLM(d)
        sch = Scheduler(llm, SchedulerConfig(max_num_seqs=1, max_model_len=128))
        V = llm.spec.vocab_size
        texts = llm.encode("To be, or not to be, that is the question: caf\u00e9 \u2014 \u00fcber ok")
        for ids in (torch.randint(0, V, (300,), generator=g).tolist(), texts * 3):
            seq = Sequence("r", [1], SamplingParams(max_tokens=400))
            lens = []
            orig = sch._decode
            sch._decode = lambda x: lens.append(len(x)) or orig(x)
            for t in ids:
                seq.output_ids.append(t)
                text, _ = sch._text(seq)
                whole = orig(seq.output_ids)
                assert whole.startswith(text), len(seq.output_ids)
                if not whole.endswith("\ufffd"):
                    assert text == whole, len(seq.output_ids)
            sch._decode = orig
            assert max(lens) < 40  # (windows of a few tokens, not the 300 of the output)
    llm = LLM(sol)
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=1, max_model_len=128))
    calls = []
    sch._decode = lambda x: calls.append(x) or "".join(f"<{t}>" for t in x[::-1])  # pieces that do not add up
    seq = Sequence("r", [1], SamplingParams(max_tokens=10))
    for t in (5, 6, 7):
        seq.output_ids.append(t)
        assert sch._text(seq)[0] == "".join(f"<{t}>" for t in seq.output_ids[::-1])


@pytest.mark.parametrize("arch", ["sol", "gpt_oss"])
def test_chunked_prefill_and_preemption_keep_every_token(arch, sol, tmp_path, threads):
    """With a budget of ~2 sequences for 6 requests, chunked prefill and recompute preemption still produce
    exactly the tokens of LLM.generate for each prompt alone (greedy and seeded sampling)."""
    d = sol
    if arch == "gpt_oss":
        d = tmp_path / "gpt_oss"
        build("gpt_oss", d)
    llm = LLM(d)
    prompts = [[(7 * i + 3 * j) % 100 + 3 for j in range(5 + 9 * i)] for i in range(6)]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True) for i in range(6)
    ]
    want = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    probe = CacheManager(llm.spec, 4, 80, page_tokens=4, kv_bits=32, state_bits=32)
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=4, max_model_len=80, page_tokens=4, chunk_tokens=7,
                                         max_num_batched_tokens=12, cache_bytes=probe.bytes_for(80) * 1.6))
    got: dict[int, list[int]] = {i: [] for i in range(6)}
    ends: dict[int, str] = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        def sink(ev, i=i):
            if ev.token_id is not None:
                got[i].append(ev.token_id)
            if ev.finished:
                ends[i] = ev.finish_reason
        sch.add(Sequence(f"r{i}", p, sp, sink))
    steps = 0
    while sch.has_work() and steps < 2000:
        sch.step()
        steps += 1
    assert ends == {i: "length" for i in range(6)}
    assert [got[i] for i in range(6)] == want
    assert sch.stats["preemptions"] > 0  # the budget really was too small for all of them at once
    assert sch.cache.used_bytes == 0 and sum(sch.cache.pages_in_use().values()) == 0 and sch.cache.free_slots == 4


def _run_all(sch, seqs):
    got = {s.request_id: [] for s in seqs}
    for s in seqs:
        s.sink = lambda ev, rid=s.request_id: got[rid].append(ev.token_id) if ev.token_id is not None else None
        sch.add(s)
    steps = 0
    while sch.has_work() and steps < 2000:
        sch.step()
        steps += 1
    return [got[s.request_id] for s in seqs]


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_prefix_cache_reuses_pages_and_keeps_tokens(arch, tmp_path, threads, sol):
    d = tmp_path / arch
    build(arch, d)
    llm = LLM(d)
    shared = [(5 * j) % 90 + 3 for j in range(37)]
    prompts = [shared + [10 + i, 20 + i, 30 + i] for i in range(4)] + [shared[:9], shared[:8] + [99, 98]]
    params = [SamplingParams(max_tokens=12, temperature=0.9 if i % 2 else 0.0, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    want = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=64, page_tokens=8, chunk_tokens=16))
    assert sch.prefix is not None
    first = _run_all(sch, [Sequence("a", prompts[0], params[0])])
    assert first == want[:1] and sch.prefix.hit_tokens == 0 and sch.prefix.num_pages == (40 + 11) // 8
    rest = _run_all(sch, [Sequence(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params)) if i])
    assert rest == want[1:]
    # prompts 1-3 reuse the 4 full pages of the shared 37 tokens; 9 tokens reuse 1 page; [8 shared + 2] reuse 1
    assert sch.prefix.hit_tokens == 8 * (3 * 4 + 1 + 1)
    assert sch.cache.used_bytes == 0 and sch.cache.prefix_bytes == sch.prefix.num_pages * sch.cache.page_bytes
    # a budget of one sequence: stored pages are evicted for live ones, never the reverse
    tight = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=64, page_tokens=8, chunk_tokens=16,
                                           cache_bytes=CacheManager(llm.spec, 1, 64, 8, kv_bits=32).budget))
    assert _run_all(tight, [Sequence(f"t{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]) == want
    assert tight.prefix.evicted_pages > 0 and tight.cache.prefix_bytes + tight.cache.used_bytes <= tight.cache.budget
    assert Scheduler(LLM(sol), SchedulerConfig(max_model_len=64)).prefix is None  # Mamba-2 state is not a prefix


# ----------------------------------------------------------------------------- the API


def test_completion_matches_the_engine(live, client):
    llm = live.state.server.llm
    prompt = "Cerebras wafers keep the weights"
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    want = llm.generate([prompt], sp)[0]
    r = client.completions.create(model="sol-test", prompt=prompt, max_tokens=12, temperature=0.8, top_p=0.95, seed=7,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.object == "text_completion" and r.model == "sol-test" and r.id.startswith("cmpl-")
    c = r.choices[0]
    assert c.model_extra["token_ids"] == want.token_ids and c.text == want.text and c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(llm.encode(prompt)), 12, len(llm.encode(prompt)) + 12)
    ids = client.completions.create(model="sol-test", prompt=llm.encode(prompt), max_tokens=12, temperature=0.8,
                                    top_p=0.95, seed=7, extra_body={"ignore_eos": True})
    assert ids.choices[0].text == want.text  # a prompt of token ids is the same prompt


def test_models_and_chat(live, client):
    assert [m.id for m in client.models.list().data] == ["sol-test"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a wafer?"}]
    r = client.chat.completions.create(model="sol-test", messages=msgs, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str) and c.finish_reason == "length"
    # no chat_template in this tokenizer config: the documented fallback template is used
    from waferline.server.app import FALLBACK_CHAT_TEMPLATE, FALLBACK_GENERATION_PROMPT

    text = "".join(FALLBACK_CHAT_TEMPLATE.format(**m) for m in msgs) + FALLBACK_GENERATION_PROMPT
    llm = live.state.server.llm
    assert r.usage.prompt_tokens == len(llm.encode(text))
    want = llm.generate([text], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert c.message.content == want.text
    # with a chat_template in the tokenizer config, that template renders the prompt
    tok = llm.tokenizer
    tok.chat_template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}")
    try:
        r = client.chat.completions.create(model="sol-test", messages=msgs, max_tokens=2)
    finally:
        tok.chat_template = None
    assert r.usage.prompt_tokens == len(llm.encode("[system] Be brief.\n[user] What is a wafer?\n[assistant] "))


def test_streaming_with_usage(live, client):
    kw = dict(model="sol-test", prompt="A light cache lets many sequences", max_tokens=10, temperature=0.7, seed=3,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    no_usage = list(client.completions.create(stream=True, **kw))
    assert all(c.usage is None for c in no_usage) and len(no_usage) == 11  # 10 tokens + the finish chunk

    chat = list(client.chat.completions.create(model="sol-test", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, seed=1, stream=True,
                                               stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-2].choices[0].finish_reason == "length" and chat[-1].usage.completion_tokens == 5


def test_stop_strings_cut_the_text(live, client):
    free = client.completions.create(model="sol-test", prompt="Experts hold most parameters", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    assert len(stop) == 3
    r = client.completions.create(model="sol-test", prompt="Experts hold most parameters", max_tokens=24, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == free[:free.find(stop)]
    s = list(client.completions.create(model="sol-test", prompt="Experts hold most parameters", max_tokens=24,
                                       temperature=0, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in s) == free[:free.find(stop)]  # the stop string is never streamed


def test_16_concurrent_streams_get_the_tokens_of_a_lone_request(live, client):
    def run(i):
        toks = []
        stream = client.completions.create(
            model="sol-test", prompt=f"request {i}: " + DEMO_TEXT[i * 7:i * 7 + 20 + 3 * i], max_tokens=20,
            temperature=0.0 if i % 4 == 0 else 0.9, top_p=0.95, seed=100 + i, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        for c in stream:
            if c.choices and c.choices[0].model_extra.get("token_ids"):
                toks += c.choices[0].model_extra["token_ids"]
        return toks

    alone = [run(i) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, range(16)))
    assert all(len(t) == 20 for t in alone)
    assert together == alone
    assert len({tuple(t) for t in alone}) == 16


def _assert_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"]
    return err


def test_bad_requests_are_4xx_and_the_server_keeps_serving(live, client):
    ok = {"model": "sol-test", "prompt": "hello", "max_tokens": 2}
    url = live.state.base + "/v1/completions"
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(body, headers=None, **kw):
        return httpx.post(url, headers={**auth, "Content-Type": "application/json", **(headers or {})},
                          **({"json": body} if body is not None else kw))

    cases = [
        ({**ok, "model": "gpt-9"}, 404, "model"),
        ({**ok, "max_tokens": 0}, 400, "max_tokens"),
        ({**ok, "max_tokens": -3}, 400, "max_tokens"),
        ({**ok, "max_tokens": MAX_LEN}, 400, "max_tokens"),  # prompt + max_tokens beyond the context
        ({**ok, "max_tokens": "ten"}, 400, "max_tokens"),
        ({**ok, "temperature": "hot"}, 400, "temperature"),
        ({**ok, "temperature": -1}, 400, "temperature"),
        ({**ok, "stream": "yes"}, 400, "stream"),
        ({**ok, "n": 2}, 400, "n"),
        ({**ok, "prompt": ""}, 400, "prompt"),
        ({**ok, "prompt": []}, 400, "prompt"),
        ({**ok, "prompt": [1, 99999]}, 400, "prompt"),
        ({**ok, "prompt": ["a", "b"]}, 400, "prompt"),
        ({**ok, "prompt": "wafer " * 400}, 400, "prompt"),  # longer than the context
        ({**ok, "prompt": 5}, 400, "prompt"),
        ({**ok, "seed": -1}, 400, "seed"),
        ({"prompt": "hi"}, 400, "model"),
        ({**ok, "logprobs": 3}, 400, "logprobs"),
        ([1, 2], 400, None),
    ]
    for body, status, param in cases:
        err = _assert_error(post(body), status)
        assert err["param"] == param, (body, err)
    _assert_error(post(None, content=b'{"model": "sol-test", "prompt": '), 400)  # malformed JSON
    _assert_error(post(None, content=b'{"model": "sol-test", "prompt": "\xff\xfe"}'), 400)  # invalid UTF-8
    _assert_error(post(None, content=b'{"model": "sol-test", "prompt": "\\udc80"}'), 400)  # lone surrogate
    _assert_error(post(None, content=json.dumps({**ok, "prompt": "x" * 70_000}).encode()), 413)  # body > 64 KiB
    _assert_error(post(ok, headers={"Authorization": ""}), 401)
    _assert_error(post(ok, headers={"Authorization": "Bearer wrong"}), 401)
    chat = live.state.base + "/v1/chat/completions"
    _assert_error(httpx.post(chat, headers=auth, json={"model": "sol-test", "messages": []}), 400)
    _assert_error(
        httpx.post(chat, headers=auth, json={"model": "sol-test", "messages": [{"role": "wizard", "content": "x"}]}),
        400,
    )
    _assert_error(httpx.post(chat, headers=auth, json={"model": "sol-test", "messages": "hi"}), 400)
    _assert_error(httpx.get(live.state.base + "/v1/nothing-here", headers=auth), 404)

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.state.base + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.completions.create(model="sol-test", prompt="x", max_tokens=2, n=3)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="sol-test", messages=[{"role": "user", "content": "x"}], max_tokens=10**6)

    r = client.completions.create(model="sol-test", prompt="still here", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert httpx.get(live.state.base + "/health").json()["status"] == "ok"
    m = _metrics(live)
    assert m['waferline_requests_total{endpoint="completions",status="400"}'] >= 17


def test_client_disconnect_frees_its_pages(live):
    body = {"model": "sol-test", "prompt": "A light cache lets many sequences live", "max_tokens": 200,
            "temperature": 0.9, "ignore_eos": True, "stream": True}
    aborted = _metrics(live).get('waferline_request_finished_total{reason="abort"}', 0.0)
    with httpx.stream("POST", live.state.base + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
            if got == 3:
                break
        assert _pages_in_use(live) > 0  # the live sequence holds pages
    assert _wait_until(lambda: _pages_in_use(live) == 0 and _metrics(live)["waferline_num_requests_running"] == 0), \
        "pages were not freed after the client went away"
    m = _metrics(live)
    assert m['waferline_request_finished_total{reason="abort"}'] == aborted + 1
    assert m["waferline_cache_bytes_in_use"] == 0

    engine = live.state.server.engine  # a client that gives up while still queued is dropped before any compute
    generated = m["waferline_generation_tokens_total"]
    engine.pause()
    try:
        with httpx.stream("POST", live.state.base + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
            assert r.status_code == 200 and _wait_until(lambda: engine.num_waiting == 1)
        assert _wait_until(lambda: _metrics(live)['waferline_request_finished_total{reason="abort"}'] == aborted + 2)
    finally:
        engine.resume()
    assert _wait_until(lambda: engine.num_waiting == 0 and engine.num_running == 0)
    assert _metrics(live)["waferline_generation_tokens_total"] == generated and _pages_in_use(live) == 0


def test_overload_queues_then_429(live, client):
    engine = live.state.server.engine
    cfg = engine.scheduler.config
    old = cfg.max_queue
    cfg.max_queue = 2
    engine.pause()  # nothing is admitted while paused: requests wait in the queue
    try:
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(client.completions.create, model="sol-test", prompt="queued", max_tokens=3,
                                   extra_body={"ignore_eos": True}) for _ in range(2)]
            assert _wait_until(lambda: engine.num_waiting == 2)
            assert _metrics(live)["waferline_num_requests_waiting"] == 2
            with pytest.raises(openai.RateLimitError, match="queue is full") as e:
                client.completions.create(model="sol-test", prompt="one too many", max_tokens=3)
            assert e.value.response.headers["retry-after"] == "1"  # when to try again
            engine.resume()
            assert [f.result(timeout=60).usage.completion_tokens for f in waiting] == [3, 3]
    finally:
        engine.resume()
        cfg.max_queue = old
    assert client.completions.create(model="sol-test", prompt="after", max_tokens=2).usage.completion_tokens >= 1


def test_serve_command(sol):
    """`waferline serve` in its own process, on loopback: one request, then a clean error for a bad --model."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "waferline.cli", "serve", "--model", str(sol), "--port", str(port),
                          "--max-model-len", "128", "--torch-threads", "1"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def healthy():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return p.poll() is not None  # stop waiting if it died
        assert _wait_until(healthy, 60, 0.2) and p.poll() is None, p.stdout.read() if p.poll() is not None else ""
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        r = c.completions.create(model=sol.name, prompt="Cerebras", max_tokens=4, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4 and r.model == sol.name
    finally:
        p.terminate()
        p.wait(20)
    bad = subprocess.run([sys.executable, "-m", "waferline.cli", "serve", "--model", str(Path(sol) / "missing")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "not a checkpoint directory" in bad.stderr


def test_scheduler_refuses_an_engine_off_the_cpu(tmp_path):
    build("llama", tmp_path)
    llm = LLM(tmp_path)
    llm.device = torch.device("cuda")  # (as LLM(device="cuda") sets it; no GPU is needed to be refused)
    with pytest.raises(ConfigError, match="runs on CPU"):
        Scheduler(llm)


# ----------------------------------------------------------------------------- a bad request fails alone


def test_sampling_params_are_checked_when_made(sol, threads):
    """SamplingParams refuses what sampling cannot use when it is made (and again in validate, for fields changed
    since); a temperature too small to divide logits by is greedy, a top_k beyond any vocabulary is off."""
    for kw, field in [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
                      ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
                      ({"temperature": -0.5}, "temperature"), ({"temperature": "hot"}, "temperature"),
                      ({"top_p": float("nan")}, "top_p"), ({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k"),
                      ({"seed": 2**70}, "seed"), ({"seed": -1}, "seed"), ({"stop_token_ids": [-1]}, "stop_token_ids")]:
        with pytest.raises(RequestError, match=f"^{field} "):
            SamplingParams(**kw)
    assert SamplingParams(temperature=1e-40).temperature == SamplingParams(temperature=9e-6).temperature == 0.0
    assert SamplingParams(temperature=0.5).temperature == 0.5
    assert SamplingParams(top_k=2**70).top_k == 0 and SamplingParams(top_k=40).top_k == 40
    assert SamplingParams(stop="x").stop == ["x"]
    p = SamplingParams()
    p.temperature = float("nan")
    with pytest.raises(RequestError, match="temperature"):
        p.validate()
    llm = LLM(sol)  # (what `waferline generate --temperature 1e-40` runs: the greedy tokens)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=1e-40))[0].token_ids == \
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6))[0].token_ids


def test_an_error_in_one_sequence_fails_only_that_sequence(sol, threads, caplog):
    """A sequence whose sampling raises inside a step ends with finish reason "error"; the batch it ran in goes on
    and its other sequences get exactly their tokens; the server log keeps the fault's traceback."""
    caplog.set_level(logging.WARNING, logger="waferline.engine")
    llm = LLM(sol)
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=4, max_model_len=64))
    good_params = SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True)
    want = llm.generate([[5, 6, 7]], good_params)[0].token_ids
    events: dict[str, list] = {"good": [], "bad": []}
    bad = Sequence("bad", [8, 9], SamplingParams(max_tokens=12, temperature=0.9, seed=4, ignore_eos=True),
                   events["bad"].append)
    sch.add(bad)
    sch.add(Sequence("good", [5, 6, 7], good_params, events["good"].append))
    bad.params.temperature = float("nan")  # (past validation: the sampler raises for this row alone)
    steps = 0
    while sch.has_work() and steps < 200:
        sch.step()
        steps += 1
    assert [e.token_id for e in events["good"] if e.token_id is not None] == want
    assert events["good"][-1].finish_reason == "length"
    assert events["bad"][-1].finish_reason == "error" and "request failed" in events["bad"][-1].error
    assert sch.stats["request_errors"] == 1
    assert sch.cache.used_bytes == 0 and sch.cache.free_slots == 4
    logged = [r for r in caplog.records if r.name == "waferline.engine" and "bad" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None


def test_stop_token_ids_are_gathered_once_per_request(sol, threads):
    """A request's stop ids (a client may list thousands) become a set once, when it is added, not at every token of
    the step loop that every other request's tokens wait on; the stop still ends the sequence."""
    llm = LLM(sol)
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=64))
    want = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    reads = []

    class Counted(list):
        def __iter__(self):
            reads.append(1)
            return super().__iter__()

    events: list = []
    seq = Sequence("s", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[want[5]] * 5000),
                   events.append)
    sch.add(seq)
    seq.params.stop_token_ids = Counted(seq.params.stop_token_ids)  # (what each token would read, if it did)
    while sch.has_work():
        sch.step()
    got = [e.token_id for e in events if e.token_id is not None]
    assert got == want[:want.index(want[5]) + 1] and events[-1].finish_reason == "stop"
    assert reads == []


def _post(live, body, headers=None, path="/v1/completions", **kw) -> httpx.Response:
    """POST to the live server with its key; ``body`` is a dict (JSON) or raw bytes sent as application/json."""
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    data = {"json": body} if isinstance(body, dict) else {"content": body}
    return httpx.post(live.state.base + path, headers=h, **{"timeout": 30, **data, **kw})


def test_bad_sampling_values_are_400_and_a_running_stream_keeps_going(live, client):
    err0 = httpx.get(live.state.base + "/health").json()["last_engine_error"]
    stream = iter(client.completions.create(model="sol-test", prompt="A light cache lets", max_tokens=40,
                                            temperature=0.9, seed=5, stream=True,
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    chunks = [next(stream)]  # it is running
    ok = b'{"model": "sol-test", "prompt": "hello", "max_tokens": 2, '
    for raw, param in [(b'"temperature": NaN}', None), (b'"temperature": Infinity}', None),
                       (b'"top_p": -Infinity}', None), (b'"temperature": 1e999}', "temperature"),
                       (b'"top_p": 1e999}', "top_p"), (b'"top_k": -1}', "top_k"),
                       (b'"stop_token_ids": [1000000000]}', "stop_token_ids"),
                       (b'"stop_token_ids": [1180591620717411303424]}', "stop_token_ids")]:
        err = _assert_error(_post(live, ok + raw), 400)
        assert err["param"] == param, (raw, err)
    greedy = dict(model="sol-test", prompt="hello there", max_tokens=8, extra_body={"ignore_eos": True})
    want = client.completions.create(temperature=0, **greedy).choices[0].text
    assert client.completions.create(temperature=1e-40, **greedy).choices[0].text == want  # too cold: greedy
    assert client.completions.create(model="sol-test", prompt="hi", max_tokens=2,
                                     extra_body={"top_k": 2**70}).usage.completion_tokens >= 1  # top_k beyond V: off
    chunks += list(stream)
    toks = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    assert len(toks) == 40 and chunks[-1].choices[0].finish_reason == "length"
    assert httpx.get(live.state.base + "/health").json()["last_engine_error"] == err0


def test_hostile_json_is_a_clean_400(live):
    for raw, says in [(b"[" * 30_000 + b"]" * 30_000, "nested too deeply"),  # beyond the parser's recursion limit
                      (b'{"model": "sol-test", "prompt": "x", "user": ' + b"[" * 100 + b"]" * 100 + b"}",
                       "nested too deeply"),
                      (b'{"model": "sol-test", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "too many digits")]:
        msg = _assert_error(_post(live, raw), 400)["message"]
        assert says in msg and "Error" not in msg and "sys." not in msg, msg
    assert _post(live, {"model": "sol-test", "prompt": "still here", "max_tokens": 2}).status_code == 200


def test_a_slow_upload_gets_408_and_its_connection_is_closed(live):
    server = live.state.server
    old, server.body_timeout = server.body_timeout, 0.5
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    try:
        t = time.monotonic()
        with socket.create_connection(("127.0.0.1", int(live.state.base.rsplit(":", 1)[1])), timeout=10) as s:
            s.sendall(head + b'{"model": "sol-')  # ... and the remaining 85 bytes never come
            reply = b""
            while chunk := s.recv(65536):  # the server answers, then closes (recv returns b"")
                reply += chunk
        assert time.monotonic() - t < 5
    finally:
        server.body_timeout = old
    assert reply.startswith(b"HTTP/1.1 408") and b"connection: close" in reply.lower()
    err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["message"] == "the request body did not arrive within 0.5 s" and err["code"] == "request_timeout"


@pytest.mark.parametrize("framing", ["declared", "chunked"])
def test_a_body_over_the_limit_gets_413_and_its_connection_is_closed(live, framing):
    """A body over --max-body-bytes (declared so, or found so while reading it) is answered 413 and the connection is
    closed, rather than kept open while the server reads and drops the rest of the upload."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\n").encode()
    limit = live.state.server.max_body_bytes
    if framing == "declared":
        head += b"Content-Length: 100000000\r\n\r\n" + b"x" * 1000
    else:
        head += b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % (limit + 1) + b"x" * (limit + 1) + b"\r\n"
    t = time.monotonic()
    with socket.create_connection(("127.0.0.1", int(live.state.base.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(head)  # (and the rest never comes)
        reply = b""
        while chunk := s.recv(65536):  # the server answers, then closes (recv returns b"")
            reply += chunk
    assert time.monotonic() - t < 3  # (not after the keep-alive timeout)
    assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply.lower()
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"


def test_an_aborted_upload_logs_one_line(live):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger("uvicorn.error"), logging.getLogger("waferline.server")]
    for lg in loggers:
        lg.addHandler(handler)
    key = 'waferline_requests_total{endpoint="completions",status="499"}'
    before = _metrics(live).get(key, 0.0)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    try:
        with socket.create_connection(("127.0.0.1", int(live.state.base.rsplit(":", 1)[1])), timeout=10) as s:
            s.sendall(head + b'{"model": "sol-')
            time.sleep(0.2)  # (the handler is reading the body when the client goes)
        assert _wait_until(lambda: _metrics(live).get(key, 0.0) == before + 1, 10)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "disconnected during the upload (15 of 100 bytes)" in records[0].getMessage() and not records[0].exc_info


def test_a_client_that_gives_up_is_counted_as_a_disconnect(live):
    """A non-streaming request whose client leaves (here while it is queued) is counted as 499, not as a server
    error, and its sequence is dropped before any compute."""
    engine = live.state.server.engine
    key = 'waferline_requests_total{endpoint="completions",status="%s"}'
    m0 = _metrics(live)
    engine.pause()
    try:
        with pytest.raises(httpx.ReadTimeout):
            _post(live, {"model": "sol-test", "prompt": "queued", "max_tokens": 5},
                  timeout=httpx.Timeout(10, read=0.5))
        assert _wait_until(lambda: _metrics(live).get(key % "499", 0.0) == m0.get(key % "499", 0.0) + 1, 10)
    finally:
        engine.resume()
    assert _wait_until(lambda: engine.num_waiting == 0 and engine.num_running == 0)
    m = _metrics(live)
    assert m.get(key % "500", 0.0) == m0.get(key % "500", 0.0)
    assert m["waferline_generation_tokens_total"] == m0["waferline_generation_tokens_total"]


def test_tokenizing_runs_off_the_event_loop(live):
    """While one request's prompt is being tokenized (held here until released), another request streams to the
    end: tokenizing does not block the event loop, nor the tokenizer lock the engine detokenizes under."""
    server = live.state.server
    assert server.encode_lock is not server.tokenizer_lock
    started, release = threading.Event(), threading.Event()
    real = server.encode_tokenizer

    class Held:
        def encode(self, text, **kw):
            started.set()
            release.wait(10)
            return real.encode(text, **kw)

    server.encode_tokenizer = Held()
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(_post, live, {"model": "sol-test", "prompt": "a long prompt", "max_tokens": 2})
            assert started.wait(10)
            body = {"model": "sol-test", "prompt": [5, 6, 7], "max_tokens": 8, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", live.state.base + "/v1/completions", json=body,
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=5) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert not held.done() and lines[-1] == "data: [DONE]" and len(lines) == 10  # 8 tokens, finish, DONE
            release.set()
            assert held.result(30).status_code == 200
    finally:
        release.set()
        server.encode_tokenizer = real


def test_a_chat_template_renders_off_the_engine_lock(live):
    """A chat prompt is rendered (chat template) and tokenized by the server's own copy of the tokenizer, under its
    own lock: while one conversation renders, another request streams to the end."""
    server = live.state.server
    started, release = threading.Event(), threading.Event()
    real = server.encode_tokenizer

    class Held:
        def apply_chat_template(self, msgs, chat_template=None, **kw):
            assert chat_template == "(the model's)"
            started.set()
            release.wait(10)
            return "".join(m["content"] for m in msgs)

        def encode(self, text, **kw):
            return real.encode(text, **kw)

    server.encode_tokenizer = Held()
    server.llm.tokenizer.chat_template = "(the model's)"
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(_post, live, {"model": "sol-test", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 2}, path="/v1/chat/completions")
            assert started.wait(10)
            body = {"model": "sol-test", "prompt": [5, 6, 7], "max_tokens": 8, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", live.state.base + "/v1/completions", json=body,
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=5) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert not held.done() and lines[-1] == "data: [DONE]" and len(lines) == 10
            release.set()
            assert held.result(30).status_code == 200
    finally:
        release.set()
        server.encode_tokenizer = real
        server.llm.tokenizer.chat_template = None


def test_json_content_type_and_local_host_names(live):
    url = live.state.base + "/v1/completions"
    ok = {"model": "sol-test", "prompt": "hi", "max_tokens": 2}
    auth = {"Authorization": f"Bearer {KEY}"}
    raw = json.dumps(ok).encode()
    for headers in ({"Content-Type": "text/plain"}, {}, {"Content-Type": "application/x-www-form-urlencoded"}):
        assert _assert_error(httpx.post(url, headers={**auth, **headers}, content=raw), 415)["code"] == \
            "unsupported_media_type"
    assert httpx.post(url, headers={**auth, "Content-Type": "application/json; charset=utf-8"}, content=raw).is_success
    assert httpx.post(url, headers={**auth, "Host": "api.example.com"}, json=ok).is_success  # a key: any Host
    server = live.state.server
    server.api_key = None  # without a key: local names and IP addresses only (no DNS rebinding)
    try:
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil.example"):
            assert _assert_error(httpx.post(url, headers={"Host": host}, json=ok), 403)["code"] == "invalid_host"
        _assert_error(httpx.get(live.state.base + "/metrics", headers={"Host": "evil.example"}), 403)
        for host in ("localhost", "localhost:8000", "LOCALHOST.", "127.0.0.1:8000", "[::1]:8000", socket.gethostname()):
            assert httpx.post(url, headers={"Host": host}, json=ok).is_success, host
        _assert_error(httpx.post(url, headers={"Content-Type": "text/plain"}, content=raw), 415)
    finally:
        server.api_key = KEY


def test_allowed_hosts_are_compared_as_host_names(live):
    """--allowed-hosts names are taken as the Host header's name is: a port, brackets, case and a trailing dot do not
    matter ("box.lan:8000" allows Host "box.lan:8000")."""
    from types import SimpleNamespace

    from waferline.server.app import Server
    from waferline.server.protocol import APIError

    server = Server(live.state.server.engine, "sol-test", allowed_hosts=("Box.Lan:8000", "gpu-1.lan."))

    def request(host):
        return SimpleNamespace(headers={"host": host}, scope={"server": ("127.0.0.1", 8000)})

    for host in ("box.lan:8000", "box.lan", "BOX.LAN.:80", "gpu-1.lan:8000"):
        server.check_host(request(host))
    with pytest.raises(APIError, match="not accepted"):
        server.check_host(request("box.lan.evil.example"))


def test_unsupported_options_are_refused(live, client):
    msgs = [{"role": "user", "content": "x"}]
    fn = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    for kw, param in [(dict(tools=[{"type": "function", "function": fn}]), "tools"),
                      (dict(tool_choice="auto"), "tool_choice"), (dict(functions=[fn]), "functions"),
                      (dict(function_call="auto"), "function_call"),
                      (dict(response_format={"type": "json_object"}), "response_format"),
                      (dict(top_logprobs=2), "top_logprobs"), (dict(logit_bias={"5": 10}), "logit_bias"),
                      (dict(n=2), "n"), (dict(modalities=["text", "audio"]), "modalities")]:
        with pytest.raises(openai.BadRequestError, match="not supported|only") as e:
            client.chat.completions.create(model="sol-test", messages=msgs, max_tokens=2, **kw)
        assert e.value.param == param
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="sol-test", prompt="x", max_tokens=2, logit_bias={"5": 10})
    r = client.chat.completions.create(model="sol-test", messages=msgs, max_tokens=2, tool_choice="none",
                                       response_format={"type": "text"})  # what these mean without tools: accepted
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("argv, says", [
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens needs --speculative"),
    (["--api-key", "k", "--allowed-hosts", "box.lan"], "--allowed-hosts applies to a server without --api-key"),
])
def test_serve_refuses_flags_that_would_be_ignored(argv, says, tmp_path, capsys):
    from waferline.cli import main

    assert main(["serve", "--model", str(tmp_path), *argv]) == 2
    assert says in capsys.readouterr().err


def test_serve_body_timeout_must_be_positive(tmp_path):
    from waferline.errors import ConfigError
    from waferline.server.commands import build_server

    with pytest.raises(ConfigError, match="--body-timeout must be > 0"):
        build_server(tmp_path, body_timeout=0)
