"""OpenAI's Responses API (POST /v1/responses) on the chat path, tested with the official `openai` client against the
live server of the server tests (conftest.py: a tiny sol checkpoint with a tokenizer, no chat template)."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from server_helpers import KEY, MAX_LEN, _assert_error, _metrics, _pages_in_use, _wait_until, fail_sampling
from waferline.server.responses import REFUSED

GREEDY = dict(model="sol-test", temperature=0, extra_body={"ignore_eos": True})


def _chat(client, messages, max_tokens, **kw):
    return client.chat.completions.create(model="sol-test", messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True}, **kw)


def _events(client, **kw) -> list:
    return list(client.responses.create(stream=True, **kw))


def test_a_response_is_the_chat_completion_streamed_or_not(live, client):
    """The same greedy request gives the chat completion's text and usage, as a response object and as the streamed
    events (one delta per piece of text, numbered in order); a response stopped by max_output_tokens is incomplete."""
    q = "What is a wafer?"
    chat = _chat(client, [{"role": "user", "content": q}], 8)
    r = client.responses.create(input=q, max_output_tokens=8, **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "sol-test"
    assert r.output_text == chat.choices[0].message.content and r.output_text
    msg = r.output[0]
    assert (msg.type, msg.role, msg.status, msg.id[:4]) == ("message", "assistant", "incomplete", "msg_")
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens, 8, chat.usage.prompt_tokens + 8)
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.usage.input_tokens_details.cached_tokens >= 0
    assert r.max_output_tokens == 8 and r.temperature == 0 and r.tools == [] and r.text.format.type == "text"

    events = _events(client, input=q, max_output_tokens=8, **GREEDY)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == events[-4].text == r.output_text and all(deltas)
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[2].item.status == "in_progress" and events[-2].item.status == "incomplete"
    assert {e.item_id for e in events if e.type.startswith("response.output_text")} == {events[2].item.id}
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == r.output_text
    assert final.usage.output_tokens == 8 and final.incomplete_details.reason == "max_output_tokens"

    # every field the client's types require is there, of its type (the client builds its objects unchecked)
    url, auth = live.state.base + "/v1/responses", {"Authorization": f"Bearer {KEY}"}
    body = {"model": "sol-test", "input": q, "max_output_tokens": 8, "temperature": 0, "ignore_eos": True}
    checked = Response.model_validate(httpx.post(url, headers=auth, json=body, timeout=60).json())
    assert checked.output_text == r.output_text
    with httpx.stream("POST", url, headers=auth, json=dict(body, stream=True), timeout=60) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert [ln.split(": ", 1)[1] for ln in lines[::2]] == kinds  # (each "event: <type>" line before its data)
    adapter = TypeAdapter(ResponseStreamEvent)
    assert [type(adapter.validate_python(json.loads(ln[6:]))).__name__ for ln in lines[1::2]][-1] == \
        "ResponseIncompleteEvent"

    # sampled with a seed (an extension, as the chat path takes it): the chat completion's tokens too
    kw = dict(model="sol-test", temperature=0.9, top_p=0.95, extra_body={"seed": 11, "ignore_eos": True})
    sampled = client.chat.completions.create(messages=[{"role": "user", "content": q}], max_tokens=6, **kw)
    assert client.responses.create(input=q, max_output_tokens=6, **kw).output_text == \
        sampled.choices[0].message.content
    m = _metrics(live)
    assert m['waferline_requests_total{endpoint="responses",status="200"}'] >= 3


def test_instructions_and_message_items_are_the_chat_messages(live, client):
    """instructions is a system message first; input items (text parts, an earlier response's output sent back) are
    the chat messages; metadata and user are echoed."""
    history = [{"role": "user", "content": "Name a wafer."},
               {"role": "assistant", "content": "WSE-3."},
               {"role": "user", "content": "How big is it?"}]
    chat = _chat(client, [{"role": "system", "content": "Be brief."}] + history, 6)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a wafer."}]},
             {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": "WSE-3.", "annotations": []}]},
             {"type": "message", "role": "user", "content": "How big is it?"}]
    r = client.responses.create(instructions="Be brief.", input=items, max_output_tokens=6,
                                metadata={"run": "a1"}, user="tester", **GREEDY)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.instructions == "Be brief." and r.metadata == {"run": "a1"} and r.user == "tester"
    alone = client.responses.create(input=history[-1]["content"], max_output_tokens=6, **GREEDY)
    assert alone.usage.input_tokens < r.usage.input_tokens


def test_text_format_json_schema_gives_the_schemas_json(live, client):
    """text.format json_schema holds the answer to the schema (the chat path's structured output); json_object to a
    JSON object; an answer that ends is completed and parses."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    q = "Describe a wafer as JSON."
    done = 0
    for seed in range(3):
        kw = dict(model="sol-test", input=q, max_output_tokens=40, temperature=1.0, extra_body={"seed": seed})
        r = client.responses.create(text={"format": {"type": "json_schema", "name": "wafer", "schema": schema,
                                                     "strict": True}}, **kw)
        chat = client.chat.completions.create(
            model="sol-test", messages=[{"role": "user", "content": q}], max_tokens=40, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "wafer", "schema": schema}})
        assert r.output_text == chat.choices[0].message.content
        assert r.text.format.type == "json_schema" and r.text.format.name == "wafer"
        if r.status == "completed":
            done += 1
            assert set(json.loads(r.output_text)) == {"name", "age"}
        obj = client.responses.create(text={"format": {"type": "json_object"}}, **kw)
        if obj.status == "completed":
            assert isinstance(json.loads(obj.output_text), dict)
    assert done >= 1


def test_refused_fields_are_400_and_the_server_keeps_serving(live, client):
    """What this server does not do is a 400 naming the field (OpenAI's error object), not ignored; the chat path's
    checks speak the Responses API's names; the server serves on."""
    url, auth = live.state.base + "/v1/responses", {"Authorization": f"Bearer {KEY}"}
    ok = {"model": "sol-test", "input": "hi", "max_output_tokens": 2}
    img = [{"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]
    cases = [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"n": 2}, "n"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"verbosity": "low"}}, "text"),
        ({"input": img}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": MAX_LEN}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),  # (a vLLM extension the chat path refuses too)
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ]
    for extra, param in cases:
        err = _assert_error(httpx.post(url, headers=auth, json={**ok, **extra}, timeout=60), 400)
        assert err["param"] == param, (extra, err)
        assert err["type"] == "invalid_request_error"
    err = _assert_error(httpx.post(url, headers=auth, json={**ok, "max_output_tokens": MAX_LEN}), 400)
    assert err["code"] == "context_length_exceeded" and "max_output_tokens" in err["message"]
    assert "max_completion_tokens" not in err["message"]
    err = _assert_error(httpx.post(url, headers=auth, json={**ok, "model": "gpt-9"}), 404)
    _assert_error(httpx.post(url, json=ok), 401)
    # what a request may leave at its default: accepted
    fine = {"store": False, "background": False, "tools": [], "tool_choice": "auto", "truncation": "disabled",
            "parallel_tool_calls": True, "text": {"format": {"type": "text"}}, "prompt_cache_key": "x"}
    assert httpx.post(url, headers=auth, json={**ok, **fine}, timeout=60).json()["status"] in ("completed",
                                                                                                "incomplete")
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="sol-test", input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="image inputs are not supported"):
        client.responses.create(model="sol-test", input=img)
    m = _metrics(live)
    assert m['waferline_requests_total{endpoint="responses",status="400"}'] >= len(cases) + 3
    r = client.responses.create(input="still here", max_output_tokens=3, **GREEDY)
    assert r.usage.output_tokens == 3 and httpx.get(live.state.base + "/health").json()["status"] == "ok"


def test_malformed_fields_are_400_naming_them_not_500_or_accepted(live):
    """Odd shapes a hostile client sends: a content part whose type is a list or an object (was a 500), a refused
    value of another type (0 for store: false, true for n: 1), a json_schema format without a valid name or with a
    strict that is not a boolean (was accepted, and echoed into a response the client's types reject); the refusals of
    chat's field names and a model name quoting one keep their words."""
    url, auth = live.state.base + "/v1/responses", {"Authorization": f"Bearer {KEY}"}
    ok = {"model": "sol-test", "input": "hi", "max_output_tokens": 2}
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    cases = [
        ({"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}]}, "input"),
        ({"store": 0}, "store"), ({"background": 0}, "background"), ({"n": True}, "n"), ({"n": 1.0}, "n"),
        ({"top_logprobs": False}, "top_logprobs"),
        ({"text": {"format": {"type": "json_schema", "schema": schema}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": 5, "schema": schema}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "a b!", "schema": schema}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": "yes"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": schema, "description": 5}}},
         "text.format"),
    ]
    for extra, param in cases:
        err = _assert_error(httpx.post(url, headers=auth, json={**ok, **extra}, timeout=60), 400)
        assert (err["param"], err["type"]) == (param, "invalid_request_error"), (extra, err)
    err = _assert_error(httpx.post(url, headers=auth, json={**ok, "messages": [{"role": "user", "content": "x"}]}), 400)
    assert (err["param"], err["message"]) == ("messages", REFUSED["messages"])
    err = _assert_error(httpx.post(url, headers=auth, json={**ok, "response_format": {"type": "json_object"}}), 400)
    assert (err["param"], err["message"]) == ("response_format", REFUSED["response_format"])
    err = _assert_error(httpx.post(url, headers=auth, json={**ok, "model": "messages-7b"}), 404)
    assert "'messages-7b'" in err["message"]
    fmt = {"type": "json_schema", "name": "x-1", "schema": schema, "strict": False, "description": "d"}
    r = httpx.post(url, headers=auth, json={**ok, "text": {"format": fmt}}, timeout=60)
    assert Response.model_validate(r.json()).text.format.name == "x-1"
    assert _metrics(live).get('waferline_requests_total{endpoint="responses",status="500"}', 0.0) == 0

def test_a_bad_request_beside_a_good_one_fails_alone(live, client):
    """A streamed response runs while bad requests (refused fields, a prompt past the context, malformed JSON) come
    and go: they fail, and it gets the tokens it gets alone."""
    kw = dict(input="A light cache lets many sequences live", max_output_tokens=40, **GREEDY)
    alone = client.responses.create(**kw).output_text
    url, auth = live.state.base + "/v1/responses", {"Authorization": f"Bearer {KEY}"}
    bad = [{"model": "sol-test", "input": "x", "tools": [{"type": "web_search"}]},
           {"model": "sol-test", "input": "wafer " * 400},
           {"model": "sol-test", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}]
    started = threading.Event()

    def good():
        text = ""
        for e in client.responses.create(stream=True, **kw):
            if e.type == "response.output_text.delta":
                text += e.delta
                started.set()
        return text

    with ThreadPoolExecutor(2) as pool:
        fut = pool.submit(good)
        assert started.wait(60)
        for body in bad * 2:
            _assert_error(httpx.post(url, headers=auth, json=body, timeout=60), 400)
        _assert_error(httpx.post(url, headers={**auth, "Content-Type": "application/json"},
                                 content=b'{"model": "sol-test", "input": '), 400)
        assert fut.result(60) == alone


def test_an_engine_error_ends_the_response_and_frees_its_pages(live, monkeypatch):
    """A response whose sampling fails: 500 in OpenAI's error shape; streamed, an error event then response.failed
    end the stream; its pages come back and the next request is served."""
    restore = fail_sampling(live, monkeypatch, lambda s: s.request_id.startswith("resp_"))
    url, auth = live.state.base + "/v1/responses", {"Authorization": f"Bearer {KEY}"}
    body = {"model": "sol-test", "input": "The wafer", "max_output_tokens": 40, "ignore_eos": True}
    err = _assert_error(httpx.post(url, headers=auth, json=body, timeout=60), 500)
    assert "injected" in err["message"] and err["type"] == "server_error"
    with httpx.stream("POST", url, headers=auth, json=dict(body, stream=True), timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert "injected" in events[-2]["message"] and events[-2]["code"] == "server_error"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "injected" in failed["error"]["message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert _wait_until(lambda: live.state.server.engine.num_running == 0 and _pages_in_use(live) == 0)
    restore()
    assert httpx.post(url, headers=auth, json=dict(body, max_output_tokens=3), timeout=60).json()["status"] == \
        "incomplete"


def test_a_client_that_leaves_a_stream_aborts_its_response(live):
    """A client that goes away mid-stream: its sequence is aborted, its pages freed, the stream counted as 499."""
    body = {"model": "sol-test", "input": "A light cache lets many sequences live", "max_output_tokens": 200,
            "temperature": 0.9, "ignore_eos": True, "stream": True}
    m = _metrics(live)
    aborted = m.get('waferline_request_finished_total{reason="abort"}', 0.0)
    gone = m.get('waferline_requests_total{endpoint="responses",status="499"}', 0.0)
    with httpx.stream("POST", live.state.base + "/v1/responses", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        assert r.status_code == 200
        deltas, lines = 0, r.iter_lines()  # (held: a generator dropped at the break closes the connection)
        for line in lines:
            deltas += "response.output_text.delta" in line and line.startswith("data: ")
            if deltas == 3:
                break
        assert _pages_in_use(live) > 0
    assert _wait_until(lambda: _pages_in_use(live) == 0 and _metrics(live)["waferline_num_requests_running"] == 0)
    assert _wait_until(lambda: _metrics(live)['waferline_request_finished_total{reason="abort"}'] == aborted + 1)
    assert _wait_until(lambda: _metrics(live).get(
        'waferline_requests_total{endpoint="responses",status="499"}', 0.0) == gone + 1)

    engine = live.state.server.engine  # not streamed: a client that gives up while queued is dropped before compute
    engine.pause()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.state.base + "/v1/responses", json=dict(body, stream=False),
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=httpx.Timeout(30, read=1))
        assert _wait_until(lambda: _metrics(live)['waferline_request_finished_total{reason="abort"}'] == aborted + 2)
    finally:
        engine.resume()
    assert _wait_until(lambda: engine.num_waiting == 0 and engine.num_running == 0 and _pages_in_use(live) == 0)
    assert _wait_until(lambda: _metrics(live).get(
        'waferline_requests_total{endpoint="responses",status="499"}', 0.0) == gone + 2)
