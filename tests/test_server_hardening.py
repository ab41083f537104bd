"""A bad request fails alone: sampling values, hostile bodies, slow and aborted uploads, content types, Host
names, disconnects and unsupported options, each against a live server whose other streams keep going."""

import asyncio
import json
import logging
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from server_helpers import KEY, MAX_LEN, _assert_error, _metrics, _wait_until
from waferline import LLM, SamplingParams
from waferline.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from waferline.errors import ConfigError, RequestError


def test_sampling_params_are_checked_when_made(sol, threads):
    """SamplingParams refuses what sampling cannot use when it is made (and again in validate, for fields changed
    since); a temperature too small to divide logits by is greedy, a top_k beyond any vocabulary is off."""
    for kw, field in [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
                      ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
                      ({"temperature": -0.5}, "temperature"), ({"temperature": "hot"}, "temperature"),
                      ({"top_p": float("nan")}, "top_p"), ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"),
                      ({"seed": 2**70}, "seed"), ({"seed": -2**63 - 1}, "seed"),
                      ({"stop_token_ids": [-1]}, "stop_token_ids"),
                      ({"stop": [""]}, "stop"), ({"stop": ["x", ""]}, "stop")]:  # ("" would match everywhere)
        with pytest.raises(RequestError, match=f"^{field} "):
            SamplingParams(**kw)
    assert SamplingParams(temperature=1e-40).temperature == SamplingParams(temperature=9e-6).temperature == 0.0
    assert SamplingParams(temperature=0.5).temperature == 0.5
    assert SamplingParams(top_k=2**70).top_k == 0 and SamplingParams(top_k=40).top_k == 40
    assert SamplingParams(top_k=-1).top_k == 0  # (vLLM's "off")
    # any 64-bit seed (as OpenAI and vLLM take them), reduced modulo 2**32, what torch's CPU generator keeps of it
    # (seeds 2**32 apart gave the same tokens while said to be taken below 2**44 as given); smaller seeds as given
    assert SamplingParams(seed=123).seed == 123 and SamplingParams(seed=-1).seed == 2**32 - 1
    assert SamplingParams(seed=2**63 - 1).seed == (2**63 - 1) % 2**32
    assert SamplingParams(seed=5 + 2**32).seed == 5
    assert SamplingParams(stop="x").stop == ["x"]
    p = SamplingParams()
    p.temperature = float("nan")
    with pytest.raises(RequestError, match="temperature"):
        p.validate()
    llm = LLM(sol)  # (what `waferline generate --temperature 1e-40` runs: the greedy tokens)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=1e-40))[0].token_ids == \
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6))[0].token_ids


def test_min_p_and_min_tokens(sol):
    """min_p keeps the tokens at least min_p times as likely as the likeliest (renormalised); min_tokens holds the stop
    token ids back until that many tokens are out."""
    from waferline.engine.sampling import target_probs

    logits = torch.tensor([[2.0, 1.0, 0.0, -3.0], [0.0, 0.0, 0.0, 0.0]])
    p = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))
    soft = torch.softmax(logits, -1)
    keep = soft >= 0.3 * soft.amax(-1, keepdim=True)
    assert torch.equal(p > 0, keep) and torch.allclose(p.sum(-1), torch.ones(2))
    assert torch.allclose(p[0, :2], soft[0, :2] / soft[0, :2].sum())
    llm = LLM(sol)
    first = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids[0]
    stop = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[first])
    assert llm.generate([[5, 6, 7]], stop)[0].token_ids == [first]
    held = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[first],
                                                    min_tokens=3))[0]
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:2]
    assert held.finish_reason == ("stop" if first in held.token_ids else "length")
    text = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))[0].text
    cut = SamplingParams(max_tokens=8, ignore_eos=True, stop=[text[:2]])  # a stop string at once
    assert llm.generate([[5, 6, 7]], cut)[0].text == ""
    cut.min_tokens = 5  # stop strings wait for min_tokens too (as vLLM's)
    assert len(llm.generate([[5, 6, 7]], cut)[0].token_ids) >= 5
    with pytest.raises(RequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(RequestError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_a_scored_prompt_samples_its_first_token_from_the_raw_logits(sol):
    """A prompt scored for its log-probabilities (echo) gets the same first token as without: the scored chunk's rows
    are raw logits, not log-softmax values, on which the repetition penalty (sign-dependent) would act otherwise. The
    logit bias is set between the two thresholds, so that the two readings pick different tokens."""
    from waferline.model.context import StepBatch

    llm = LLM(sol)
    ids = [5, 6, 7, 8, 9]
    with torch.no_grad():
        h = llm.model(torch.tensor([ids]), llm.model.new_caches(1, llm.device), StepBatch.make([0], [0], 5, llm.device))
        x = llm.model.logits(h[0, -1:]).float()[0]
    lp = torch.log_softmax(x, -1)
    tp = ids[0]  # a prompt token (penalised) and one that is not
    to = next(t for t in torch.argsort(x, descending=True).tolist() if t not in ids)

    def tie(v):  # the bias on the prompt token at which it ties with the other one: (v + bias) / 3 == v_to + 20
        return float(3.0 * (v[to] + 20.0) - v[tp])  # (the bias is added first, then the penalty divides: as vLLM)

    mid = (tie(x) + tie(lp)) / 2
    assert abs(tie(x) - tie(lp)) > 0.1  # (the two readings differ)
    sp = dict(max_tokens=1, repetition_penalty=3.0, logit_bias={tp: mid, to: 20.0})
    want = tp if mid > tie(x) else to
    assert llm.generate([ids], SamplingParams(**sp))[0].token_ids == [want]
    assert llm.generate([ids], SamplingParams(**sp, prompt_logprobs=0))[0].token_ids == [want]


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
                       (b'"top_p": 1e999}', "top_p"), (b'"top_k": -2}', "top_k"),
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


def test_a_batch_of_more_prompts_than_a_request_may_run_is_refused_before_tokenizing(live):
    """A completions batch of more prompts (x n) than one request may run was refused only after every prompt was
    tokenized (10^5 text prompts took 10 s to get their 400); now before the first."""
    server = live.state.server
    real, calls = server.encode_tokenizer, []

    class Counted:
        def encode(self, text, **kw):
            calls.append(text)
            return real.encode(text, **kw)

    server.encode_tokenizer = Counted()
    try:
        r = _post(live, {"model": "sol-test", "prompt": ["to be"] * 65, "max_tokens": 1})
        assert r.status_code == 400 and "65 prompt(s) x n=1 = 65 choices" in r.json()["error"]["message"], r.text
        r = _post(live, {"model": "sol-test", "prompt": ["to be"] * 8, "n": 9, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert calls == []
        assert _post(live, {"model": "sol-test", "prompt": ["to be"] * 2, "n": 2, "max_tokens": 1}).status_code == 200
        assert len(calls) == 2
    finally:
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
    for kw, param in [(dict(functions=[fn]), "functions"), (dict(function_call="auto"), "function_call"),
                      (dict(modalities=["text", "audio"]), "modalities")]:
        with pytest.raises(openai.BadRequestError, match="not supported|only") as e:
            client.chat.completions.create(model="sol-test", messages=msgs, max_tokens=2, **kw)
        assert e.value.param == param
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


def test_serve_body_timeout_must_be_positive(tmp_path, capsys):
    from waferline.cli import main
    from waferline.server.commands import build_server

    for bad in (0, float("nan")):
        with pytest.raises(ConfigError, match="--body-timeout must be > 0"):
            build_server(tmp_path, body_timeout=bad)
    for flag in ("--body-timeout", "--cache-mb"):  # (NaN: the server started without a body limit / a traceback)
        with pytest.raises(SystemExit) as e:
            main(["serve", "--model", str(tmp_path), flag, "nan"])
        assert e.value.code == 2 and "expected a finite number > 0, got nan" in capsys.readouterr().err


def test_serve_takes_the_model_as_vllm_does_and_checks_what_it_cannot_serve(sol, tmp_path, capsys):
    """`waferline serve MODEL` (or --model); a taken port, a context past the model's positions, or a body limit of
    0 are refused in one line before the server says it serves."""
    import socket

    from waferline.cli import main
    from waferline.engine.llm import LLM
    from waferline.server.commands import _check_port_free

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", str(sol), "--port", str(port)]) == 2
        out = capsys.readouterr()
        assert f"cannot listen on 127.0.0.1 port {port}" in out.err and "serving" not in out.out
        _check_port_free("", 0)  # ("" is every interface, as uvicorn takes it)
        if socket.has_ipv6:  # an IPv6 listener, as asyncio opens one (IPV6_V6ONLY), leaves the IPv4 port alone
            try:
                _check_port_free("::1", port)
            except ConfigError as e:
                assert "Cannot assign requested address" in str(e)  # (a host without IPv6 loopback)
    assert main(["serve", str(sol), "--model", str(tmp_path)]) == 2
    assert "two checkpoints" in capsys.readouterr().err
    with socket.socket() as taken:  # (the same directory spelled twice is one checkpoint: on to the port check)
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        assert main(["serve", str(sol), "--model", f"{sol}/", "--port", str(taken.getsockname()[1])]) == 2
        assert "cannot listen" in capsys.readouterr().err
    assert main(["serve"]) == 2
    assert "give the checkpoint directory" in capsys.readouterr().err
    for flag in ("--max-model-len", "--max-body-bytes", "--max-num-seqs"):
        with pytest.raises(SystemExit) as e:
            main(["serve", str(sol), flag, "0"])
        assert e.value.code == 2 and "expected an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"max_model_len 100000 is outside 1\.\.\d+"):
        LLM(sol, max_model_len=100000)


def test_a_grammar_that_fails_as_it_runs_is_the_requests_400(live, sol):
    """A grammar whose dead end the check before the request queues does not find (a branch past a whole text's,
    taken here through a logit_bias) is the request's error as its output reaches it: 400 invalid_request_error that
    names the dead end (streamed: an SSE error of that type), not a 500; requests running beside it go on."""
    from waferline.model.load import load_tokenizer

    x = load_tokenizer(sol).encode("x", add_special_tokens=False)[0]
    body = {"model": "sol-test", "prompt": "x", "max_tokens": 3, "logit_bias": {str(x): 100},
            "structured_outputs": {"grammar": 'start: "x" /[a&&b]/ | "y"'}}
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(_post, live, {"model": "sol-test", "prompt": "x", "max_tokens": 24, "temperature": 0})
                  for _ in range(2)]
        bad, streamed = pool.map(lambda b: _post(live, b), [body, dict(body, stream=True)])
        assert all(f.result().status_code == 200 and f.result().json()["choices"][0]["finish_reason"] != "error"
                   for f in others)
    err = _assert_error(bad, 400)
    assert err["type"] == "invalid_request_error" and "a dead end after 1 output token" in err["message"], err
    assert streamed.status_code == 200
    errors = [json.loads(line[6:])["error"] for line in streamed.text.splitlines()
              if line.startswith("data: {") and '"error"' in line]
    assert len(errors) == 1 and errors[0]["type"] == "invalid_request_error", streamed.text
    assert "a dead end after 1 output token" in errors[0]["message"], errors


def test_a_structured_output_no_text_holds_to_is_a_400_before_the_stream_starts(live):
    """A regex or grammar that is valid but matches nothing (or that the grammar engine cannot follow past its first
    bytes) is found before the request queues: 400, streamed too (not a 200 and then an SSE error), and the other
    requests go on."""
    for so, words in (({"regex": "[a&&b]"}, "no text holds to it"),
                      ({"grammar": 'start: /[0-9&&a-z]/ "x"'}, "no text holds to it"),
                      ({"grammar": 'start: "x" /[a&&b]/'}, "no text holds to it"),  # (a dead end past the first byte)
                      ({"regex": "a{99999999}"}, "the grammar engine cannot go on after 'a'")):  # (its lexer's limit)
        for stream in (False, True):
            err = _assert_error(_post(live, {"model": "sol-test", "prompt": "x", "max_tokens": 3, "stream": stream,
                                             "structured_outputs": so}), 400)
            assert words in err["message"] and err["param"] == "structured_outputs", err
    assert _post(live, {"model": "sol-test", "prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_grammar_naming_tokens_the_model_lacks_is_a_400_before_the_stream_starts(live):
    """A grammar that names a token by id or name is checked with the model's tokenizer: one it lacks is a 400 before
    the request queues, streamed too (it was a 200 and then an SSE error), and one it has still runs."""
    for g in ('start: <[999999]> "x"', "start: <|nosuchtoken|>"):
        for stream in (False, True):
            err = _assert_error(_post(live, {"model": "sol-test", "prompt": "x", "max_tokens": 3, "stream": stream,
                                             "structured_outputs": {"grammar": g}}), 400)
            assert "cannot be used with this tokenizer" in err["message"], err
            assert err["param"] == "structured_outputs", err
    r = _post(live, {"model": "sol-test", "prompt": "x", "max_tokens": 3, "structured_outputs":
                     {"grammar": "start: <[5]>"}})
    assert r.status_code == 200, r.text


def _health_while_held(live, body, entered, gate) -> tuple[int, httpx.Response]:
    """POST ``body`` from another thread; once the server is held inside it (``entered``, until ``gate`` is set),
    /health's status; then the POST's response."""
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_post, live, body)
        try:
            assert entered.wait(30)
            health = httpx.get(live.state.base + "/health", timeout=5)
        finally:
            gate.set()
        return health.status_code, fut.result()


def test_grammars_whose_rules_chain_deep_are_built_without_overflowing_the_stack(sol):
    """The grammar engine builds a grammar recursively: a chain of 3,000 Lark rules (or of 1,500 JSON Schema $refs)
    overflowed the stack of the thread that built it and killed the server (SIGSEGV). They are built on a thread with
    a larger stack, checked, constrained and used on the engine's; a Lark grammar longer than that stack holds is a
    400. (In a process of its own: a stack overflow kills the process.)"""
    import subprocess
    import sys

    code = f"""
import threading
from waferline import SamplingParams
from waferline.engine import structured
from waferline.errors import RequestError
from pathlib import Path
from waferline.model.load import load_tokenizer
tok = load_tokenizer(Path({str(sol)!r}))
lark = "start: r0\\n" + "\\n".join(f'r{{i}}: r{{i + 1}} "a"' for i in range(3000)) + '\\nr3000: "b"'
defs = {{f"d{{i}}": {{"type": "object", "properties": {{"x": {{"$ref": f"#/$defs/d{{i + 1}}"}}}}, "required": ["x"]}}
        for i in range(1500)}}
schema = {{"$defs": defs | {{"d1500": {{"type": "integer"}}}}, "$ref": "#/$defs/d0"}}
for p in (SamplingParams(grammar=lark), SamplingParams(json_schema=schema)):
    structured.grammar_of(p)
    structured.check_tokens(tok, p)
    def run():  # (as the engine thread does: a thread with the default stack)
        c = structured.constraint(tok, 512, frozenset({{1}}), p)
        for _ in range(3):
            c.advance(int(c.allowed().nonzero()[0]))
    t = threading.Thread(target=run)
    t.start()
    t.join()
try:
    structured.grammar_of(SamplingParams(grammar="start: a\\n" + "a: b\\n" * 30000))
except RequestError as e:
    print(e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "grammar cannot be used: 150009 characters (as Lark), at most 131072" in r.stdout, r.stdout


def test_a_structured_output_is_checked_off_the_event_loop(live, monkeypatch):
    """Checking a structured output builds its grammar (a second for some expressions): in a worker thread, so the
    event loop that streams everyone else's tokens (and answers /health) is not held up meanwhile."""
    from waferline.engine import structured

    entered, gate = threading.Event(), threading.Event()
    grammar_text = structured._grammar_text

    def slow(kind, value):
        entered.set()
        gate.wait(30)
        return grammar_text(kind, value)

    monkeypatch.setattr(structured, "_grammar_text", slow)
    body = {"model": "sol-test", "prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "(yes|no) off loop"}}
    health, r = _health_while_held(live, body, entered, gate)
    assert health == 200 and r.status_code == 200, r.text


@pytest.mark.parametrize("held", ["_check_strings", "parse"])
def test_a_body_is_decoded_and_validated_off_the_event_loop(live, monkeypatch, held):
    """A 1 MiB body of 200,000 small values took 0.5-2 s to decode, walk and validate, on the event loop: every stream
    stalled that long. Held here in either step, the server still answers /health."""
    from waferline.server import state

    entered, gate = threading.Event(), threading.Event()
    real = getattr(state, held)

    def slow(*args):
        entered.set()
        gate.wait(30)
        return real(*args)

    monkeypatch.setattr(state, held, slow)
    health, r = _health_while_held(live, {"model": "sol-test", "prompt": "x", "max_tokens": 2}, entered, gate)
    assert health == 200 and r.status_code == 200, r.text


@pytest.mark.parametrize("cls, body", [
    ("CompletionRequest", {"model": "m", "prompt": [1] + ["a"] * 20_000}),
    ("CompletionRequest", {"model": "m", "prompt": [[[1]]] * 20_000}),
    ("CompletionRequest", {"model": "m", "prompt": "x", "stop_token_ids": ["a"] * 20_000}),
    ("DetokenizeRequest", {"tokens": ["a"] * 20_000}),
    ("ChatRequest", {"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}] * 20_000}]}),
])
def test_a_long_list_of_bad_items_stops_at_the_first(cls, body):
    """Validation stops at a list's first bad item: every item's error, in every branch of a union (400,000 of them
    for a 1 MiB body), took seconds to build while holding the interpreter."""
    from pydantic import ValidationError

    from waferline.server import protocol

    with pytest.raises(ValidationError) as info:
        getattr(protocol, cls).model_validate(body)
    assert info.value.error_count() <= 4
    named = "invalid value for '(prompt|stop_token_ids.0|tokens.0|messages.0.content.0.type)'"
    with pytest.raises(protocol.APIError, match=named):  # (the message as before: the first bad item's)
        protocol.parse(getattr(protocol, cls), body)


def test_a_json_schema_nested_too_deeply_as_text_is_a_400(live):
    """A schema sent as JSON text nested thousands of levels deep (which the body's depth limit does not see) is the
    request's 400, not a 500."""
    r = _post(live, {"model": "sol-test", "prompt": "x", "guided_json": '{"a":' * 5000 + "1" + "}" * 5000})
    err = _assert_error(r, 400)
    assert "json_schema is nested too deeply" in err["message"], err


def test_a_misspelt_structured_output_key_is_refused(live):
    for so, key in [({"regexp": "[0-9]+"}, "regexp"), ({"json_schema": {"type": "object"}}, "json_schema")]:
        err = _assert_error(_post(live, {"model": "sol-test", "prompt": "x", "max_tokens": 3,
                                         "structured_outputs": so}), 400)
        assert key in err["message"], err
    ok = _post(live, {"model": "sol-test", "prompt": "x", "max_tokens": 3, "structured_outputs": {"regex": "[0-9]+"}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"].isdigit()


def test_a_chat_prompt_past_the_context_without_max_tokens_names_the_prompt(live):
    long = " ".join(["light"] * (MAX_LEN + 40))
    err = _assert_error(_post(live, {"model": "sol-test", "messages": [{"role": "user", "content": long}]},
                              path="/v1/chat/completions"), 400)
    assert err["param"] == "messages" and "the prompt has" in err["message"], err


def test_a_request_past_the_context_carries_openais_error_code(live, client):
    """A prompt (or prompt + max_tokens) past the context: OpenAI's code "context_length_exceeded" and its message's
    start, which clients read to trim a conversation or fall back to a longer model (it had no code)."""
    long = [{"role": "user", "content": " ".join(["light"] * (MAX_LEN + 40))}]
    short = [{"role": "user", "content": "hi"}]
    calls = [(lambda: client.chat.completions.create(model="sol-test", messages=long), "messages"),
             (lambda: client.chat.completions.create(model="sol-test", messages=short, max_tokens=MAX_LEN),
              "max_tokens"),
             (lambda: client.chat.completions.create(model="sol-test", messages=short, stream=True,
                                                     max_completion_tokens=MAX_LEN), "max_completion_tokens"),
             (lambda: client.completions.create(model="sol-test", prompt="hi", max_tokens=MAX_LEN), "max_tokens")]
    for call, param in calls:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.code == "context_length_exceeded" and e.value.param == param, e.value.body
        assert f"maximum context length is {MAX_LEN} tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # (another 400 keeps its own code)
        client.chat.completions.create(model="sol-test", messages=short, max_tokens=0)
    assert e.value.code is None


def test_a_stream_whose_client_leaves_is_counted_as_a_disconnect(live):
    """A stream is counted when it ends: 200 when it ran to [DONE] (an error event included), 499 when its client left
    mid-stream (it was counted 200 as it started)."""
    key = 'waferline_requests_total{endpoint="completions",status="%s"}'
    m0 = _metrics(live)
    body = {"model": "sol-test", "prompt": "leaving", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live.state.base + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # one chunk, then the client goes
    assert _wait_until(lambda: _metrics(live).get(key % "499", 0.0) == m0.get(key % "499", 0.0) + 1, 10)
    assert _metrics(live).get(key % "200", 0.0) == m0.get(key % "200", 0.0)
    done = _post(live, dict(body, max_tokens=3))
    assert done.text.rstrip().endswith("data: [DONE]")
    assert _wait_until(lambda: _metrics(live).get(key % "200", 0.0) == m0.get(key % "200", 0.0) + 1, 10)


def test_a_stream_whose_client_left_is_not_written_on(live, monkeypatch, caplog):
    """A client leaves mid-stream while its next tokens are queued already (the event loop was busy as they came): the
    stream stops there rather than writing them to the closed connection, each write past the fifth an asyncio warning
    'socket.send() raised exception.' in the server's log."""
    server = live.state.server
    loops: list[asyncio.AbstractEventLoop] = []
    start = server.start

    def start_here(*args, **kw):
        loops.append(asyncio.get_running_loop())
        return start(*args, **kw)

    monkeypatch.setattr(server, "start", start_here)
    key = 'waferline_requests_total{endpoint="completions",status="499"}'
    before = _metrics(live).get(key, 0.0)
    body = json.dumps({"model": "sol-test", "prompt": "leaving", "max_tokens": 200, "stream": True,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    blocked = threading.Event()

    def busy() -> None:
        blocked.set()
        time.sleep(0.5)  # (the engine's next tokens queue up meanwhile)

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        with socket.create_connection(("127.0.0.1", int(live.state.base.rsplit(":", 1)[1])), timeout=10) as s:
            s.sendall(head + body)
            got = b""
            while got.count(b"data: ") < 2:
                chunk = s.recv(65536)
                assert chunk, got
                got += chunk
            loops[0].call_soon_threadsafe(busy)
            assert blocked.wait(10)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # (closed with a reset)
        assert _wait_until(lambda: _metrics(live).get(key, 0.0) == before + 1, 10)
        assert _wait_until(lambda: live.state.server.engine.num_running == 0, 10)
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_a_stalled_stream_counts_what_the_engine_finished_when_its_client_leaves(live):
    """A client that stops reading leaves its stream behind the engine: the engine finishes its choices while their
    events wait to be written. When the client then goes, those choices count by their finish reason (not as aborts)
    and their tokens as generated; only the choices still running count as aborted."""
    from waferline.engine.scheduler import Event

    server = live.state.server
    key = "waferline_request_finished_total{reason=\"%s\"}"
    tokens = "waferline_generation_tokens_total"
    m0 = _metrics(live)

    async def stalled() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        t = time.perf_counter()
        for i in range(3):  # choices 0 and 1 finished in the engine; choice 2 still runs
            queue.put_nowait((i, Event(5, "a", prompt_tokens=2), t))
            if i < 2:
                queue.put_nowait((i, Event(6, "b", True, "length", 2, 2), t))
        events = server._events(queue, ["s-0", "s-1", "s-2"], t, n=3)
        await anext(events)  # (the first chunk was written; then the client stopped reading, and left)
        await events.aclose()

    asyncio.run(stalled())
    m1 = _metrics(live)
    assert m1.get(key % "length", 0.0) - m0.get(key % "length", 0.0) == 2
    assert m1.get(key % "abort", 0.0) - m0.get(key % "abort", 0.0) == 1
    assert m1[tokens] - m0.get(tokens, 0.0) == 5


def test_chat_messages_need_their_content_and_text_parts_are_lines(live):
    url = "/v1/chat/completions"
    for msg in ({"role": "user"}, {"role": "user", "content": None}, {"role": "system"}, {"role": "assistant"}):
        err = _assert_error(_post(live, {"model": "sol-test", "messages": [msg], "max_tokens": 2}, path=url), 400)
        assert "needs its content" in err["message"], err
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    ok = {"model": "sol-test", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "tool_calls": calls},
                                                            {"role": "tool", "tool_call_id": "c1", "content": "1"}]}
    assert _post(live, ok, path=url).status_code == 200  # (an assistant message that calls tools may have none)
    parts = [{"type": "text", "text": "Line one."}, {"type": "text", "text": "Line two."}]
    as_parts = _post(live, {"model": "sol-test", "messages": [{"role": "user", "content": parts}]}, path="/tokenize")
    as_lines = _post(live, {"model": "sol-test", "messages": [{"role": "user", "content": "Line one.\nLine two."}]},
                     path="/tokenize")
    assert as_parts.status_code == 200 and as_parts.json()["tokens"] == as_lines.json()["tokens"]


def test_a_content_part_that_is_not_text_is_named_in_the_400(live, client):
    """An image part (or a text part without its text) is refused naming the part, not with "should be a valid
    string" for content that may be a list of parts; a list where only a string may be says so as before."""
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    for part, says in ((image, "messages.0.content.1.type': Input should be 'text' (got 'image_url')"),
                       ({"type": "text"}, "messages.0.content.1.text': Field required")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="sol-test", max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}])
        assert says in e.value.message and e.value.param == "messages"
    with pytest.raises(openai.BadRequestError, match=r"'stop.1': Input should be a valid string"):
        client.chat.completions.create(model="sol-test", max_tokens=2, stop=["a", 1],
                                       messages=[{"role": "user", "content": "hi"}])
    err = _assert_error(_post(live, {"model": "sol-test", "prompt": [1, "a"]}), 400)
    assert "'prompt': Input should be a valid string" in err["message"]  # (several kinds of list: as before)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": False,
                              "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "hi", "stop": ["gh"], "include_stop_str_in_output": True}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": [5]}),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["x"]}),
])
def test_what_the_server_does_not_do_is_refused_not_ignored(live, path, body):
    """stream_options without stream (400, as OpenAI's), and vLLM's sampling extensions this server does not do:
    each was answered 200 as if it had not been asked for."""
    err = _assert_error(_post(live, {"model": "sol-test", "max_tokens": 2, **body}, path=path), 400)
    assert err["param"] == next(k for k in body if k not in ("prompt", "messages", "stop", "stream"))
    # their defaults, as a vLLM client may send them, are accepted
    ok = _post(live, {"model": "sol-test", "prompt": "hi", "max_tokens": 1, "include_stop_str_in_output": False,
                      "spaces_between_special_tokens": True, "priority": 0, "bad_words": [], "allowed_token_ids": [],
                      "stream_options": {}})
    assert ok.status_code == 200, ok.text


def test_a_text_prompt_gets_the_tokenizers_special_tokens(tmp_path, threads):
    """A Llama-style tokenizer prepends <s>: a completion's text prompt, /tokenize and LLM.generate encode it as
    transformers does (vLLM's default; add_special_tokens: false turns it off), a chat prompt as its template writes
    it."""
    from server_helpers import serve_in_thread
    from waferline.demo import DEMO_TEXT, SOL_DEMO_CONFIG, write_tokenizer
    from waferline.model.init import write_random_checkpoint
    from waferline.server.commands import build_server

    d = tmp_path / "bos"
    write_random_checkpoint(SOL_DEMO_CONFIG, d)
    write_tokenizer(d, DEMO_TEXT, SOL_DEMO_CONFIG["vocab_size"])
    t = json.loads((d / "tokenizer.json").read_text())
    seq, bos = {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<s>", "type_id": 0}}
    t["post_processor"] = {"type": "TemplateProcessing", "single": [bos, seq], "pair": [bos, seq, seq],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}}
    (d / "tokenizer.json").write_text(json.dumps(t))
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(d)("Hello there").input_ids
    assert want[0] == 0 and LLM(d).encode("Hello there") == want
    with serve_in_thread(build_server(d, max_num_seqs=2, max_model_len=128, served_model_name="m")) as base:
        def prompt_tokens(**extra):
            return httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "Hello there", "max_tokens": 1,
                                                              **extra}).json()["usage"]["prompt_tokens"]
        assert prompt_tokens() == len(want) and prompt_tokens(add_special_tokens=False) == len(want) - 1
        assert httpx.post(base + "/tokenize", json={"prompt": "Hello there"}).json()["tokens"] == want


def test_top_p_and_the_order_of_bias_and_penalties_are_vllms():
    """top_p keeps the smallest prefix whose mass reaches it, not a token more (transformers' TopPLogitsWarper), and
    logit_bias is added before the repetition penalty scales the logits (vLLM's and transformers' order)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TopPLogitsWarper

    from waferline.engine.sampling import adjust_logits, target_probs

    for probs, p in (([0.25] * 4, 0.5), ([0.5, 0.25, 0.25], 0.5), ([0.25] * 4, 0.75), ([0.4, 0.3, 0.2, 0.1], 0.6)):
        logits = torch.tensor(probs).log()
        got = int((target_probs(logits, SamplingParams(temperature=1.0, top_p=p)) > 0).sum())
        want = int((TopPLogitsWarper(p)(None, logits[None].clone())[0] > float("-inf")).sum())
        assert got == want, (probs, p, got, want)  # (how many are kept: which of equal ones is a tie's order)

    class Seq:
        prompt_ids, output_ids, stop_ids = [0, 2], [], set()

    logits = torch.tensor([1.0, 0.5, -0.5, 0.0])
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0, logit_bias={0: 3.0, 2: 1.0})
    biased = logits + torch.tensor([3.0, 0.0, 1.0, 0.0])
    want = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[0, 2]]), biased[None])[0]
    assert torch.allclose(adjust_logits(logits, params, Seq()), want)  # [2.0, 0.5, 0.25, 0.0]


def test_a_top_p_too_small_for_fp32_keeps_the_likeliest_token():
    """A top_p in (0, 1] below fp32's least positive value (1e-50: it compares as 0 against the fp32 sums) keeps the
    likeliest token, as any tiny top_p does, rather than dropping every one (a NaN distribution: a 500)."""
    from waferline.engine.sampling import target_probs

    logits = torch.tensor([[0.5, 2.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    for p in (1e-50, 5e-324, 1e-30):
        probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=p))
        assert not probs.isnan().any() and torch.equal((probs > 0).sum(-1), torch.tensor([1, 1])), (p, probs)
        assert probs[0, 1] == 1.0


def test_a_temperature_beyond_fp32_samples_uniformly_among_the_tokens_left():
    """A temperature beyond fp32's range (1e39) with tokens masked to -inf (min_tokens' stop ids, a structured output)
    is a uniform draw among the others, not a NaN distribution (a 500)."""
    from waferline.engine.sampling import target_probs

    logits = torch.tensor([0.5, float("-inf"), 2.0, -1.0])
    for t in (1e39, 1e308):
        probs = target_probs(logits, SamplingParams(temperature=t))
        assert torch.allclose(probs, torch.tensor([1 / 3, 0.0, 1 / 3, 1 / 3])), (t, probs)


def test_a_repetition_penalty_that_would_overflow_the_logits_is_a_400():
    """A repetition_penalty of 1e-300 passed the (0, 100] check, then a seen token's logit divided by it was inf and
    the request failed in sampling with a NaN distribution (a 500); the range is [0.01, 100], whose ends keep ordinary
    logits finite, and the smallest one samples."""
    from waferline.engine.sampling import adjust_logits, sample
    from waferline.errors import RequestError

    for bad in (1e-300, 0.0099, 0.0, -1.0, 100.5):
        with pytest.raises(RequestError, match="repetition_penalty must be in"):
            SamplingParams(temperature=1.0, repetition_penalty=bad)

    class Seq:
        prompt_ids, output_ids, stop_ids = [0, 2], [], set()

    params = SamplingParams(temperature=1.0, repetition_penalty=0.01, seed=1)
    logits = torch.tensor([30.0, 0.5, -40.0, 0.0])
    assert torch.isfinite(adjust_logits(logits, params, Seq())).all()
    assert sample(logits, params, torch.Generator().manual_seed(1), Seq()) == 0
