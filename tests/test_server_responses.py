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

from server_helpers import (
    KEY,
    MAX_LEN,
    _assert_error,
    _metrics,
    _pages_in_use,
    _wait_until,
    chat_template,
    fail_sampling,
)
from waferline.server import responses
from waferline.server.responses import REFUSED

GREEDY = dict(model="sol-test", temperature=0, extra_body={"ignore_eos": True})


WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}
ASK = "Weather in Oslo?"


def _as_chat(tool):
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _calls(chat_choice):
    return [(t.function.name, t.function.arguments) for t in chat_choice.message.tool_calls or []]


def _raw_events(live, body) -> list[dict]:
    """The SSE events of a streamed request as sent, each checked against the openai client's event types; each
    "event: <type>" line names its data's type."""
    url, auth = live.state.base + "/v1/responses", {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", url, headers=auth, json=dict(body, stream=True), timeout=60) as s:
        assert s.status_code == 200
        lines = [ln for ln in s.iter_lines() if ln]
    events = [json.loads(ln[6:]) for ln in lines[1::2]]
    assert [ln.split(": ", 1)[1] for ln in lines[::2]] == [e["type"] for e in events]
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


@pytest.fixture
def parser(live):
    live.state.server.tool_call_parser = "hermes"
    yield
    live.state.server.tool_call_parser = None


@pytest.fixture
def template(live):
    """A chat template that renders the tools, an assistant's calls and a tool's answers (the test model has none)."""
    server = live.state.server
    with chat_template(server, (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}{% for m in messages %}"
        "<{{ m.role }}>{{ m.content or '' }}{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} "
        "{{ c.function.arguments | tojson }}]{% endfor %}{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}"
        "{% endfor %}<assistant>"
    )):
        yield server.llm.encode


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
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tool_choice"),  # ("auto": no parser)
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),  # (not stored: test_server_responses_store)
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"n": 2}, "n"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"verbosity": "low"}}, "text"),
        ({"input": img}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
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
    with pytest.raises(openai.BadRequestError, match="Previous response with id 'resp_1' not found"):
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


def test_named_and_required_calls_are_function_call_items(live, client):
    """A named or required tool_choice runs as chat's: each call the chat completion makes (same seed) is a
    function_call item (call_id: chat's call id) and no message comes before it; an answer the token limit cut stays
    the message's text; the tools and tool_choice are echoed in the Responses API's shape."""
    kw = dict(model="sol-test", input=ASK, max_output_tokens=60, temperature=1.0, tools=[WEATHER, TIME])
    chat_kw = dict(model="sol-test", messages=[{"role": "user", "content": ASK}], max_tokens=60, temperature=1.0,
                   tools=[_as_chat(WEATHER), _as_chat(TIME)])
    called = 0
    for seed in range(3):
        r = client.responses.create(tool_choice={"type": "function", "name": "get_weather"}, extra_body={"seed": seed},
                                    **kw)
        c = client.chat.completions.create(seed=seed, tool_choice={"type": "function", "function": {
            "name": "get_weather"}}, **chat_kw).choices[0]
        if c.message.tool_calls:
            called += 1
            assert r.status == "completed" and [o.type for o in r.output] == ["function_call"] and r.output_text == ""
            call = r.output[0]
            assert [(call.name, call.arguments)] == _calls(c) and call.status == "completed"
            assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.id != call.call_id
            assert set(json.loads(call.arguments)) <= {"city", "days"}
        else:
            assert r.status == "incomplete" and [o.type for o in r.output] == ["message"]
            assert r.output_text == c.message.content
    assert called >= 2
    assert [(t.type, t.name, t.parameters, t.description) for t in r.tools] == [
        ("function", "get_weather", WEATHER["parameters"], "the weather in a city"),
        ("function", "get_time", TIME["parameters"], None)]
    assert (r.tool_choice.type, r.tool_choice.name) == ("function", "get_weather") and r.parallel_tool_calls

    required = 0
    for seed in range(4):
        for parallel in (True, False):
            r = client.responses.create(tool_choice="required", parallel_tool_calls=parallel,
                                        extra_body={"seed": seed}, **(kw | {"max_output_tokens": 120}))
            c = client.chat.completions.create(seed=seed, tool_choice="required", parallel_tool_calls=parallel,
                                               **(chat_kw | {"max_tokens": 120})).choices[0]
            assert [(o.name, o.arguments) for o in r.output if o.type == "function_call"] == _calls(c)
            if c.message.tool_calls:
                required += 1
                assert {o.type for o in r.output} == {"function_call"} and r.status == "completed"
                assert r.tool_choice == "required" and r.parallel_tool_calls is parallel
                assert parallel or len(r.output) == 1
    assert required >= 1
    # every field is there, of the type the client's types give it
    body = {"model": "sol-test", "input": ASK, "max_output_tokens": 60, "temperature": 0, "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"}}
    raw = httpx.post(live.state.base + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, json=body,
                     timeout=60).json()
    assert Response.model_validate(raw).output[0].type == "function_call"


def test_a_streamed_call_is_its_items_events(live, client):
    """Streamed, a named call is an output item added (arguments ""), its arguments in one delta, done, the item
    done, at output_index 0, numbered in order; response.completed holds the item the unstreamed response gives;
    every event parses as the client's type (through client.responses.create(stream=True) too)."""
    body = {"model": "sol-test", "input": ASK, "max_output_tokens": 60, "temperature": 1.0, "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"}}
    for seed in range(4):
        whole = client.responses.create(**body, extra_body={"seed": seed})
        if whole.status == "completed":
            break
    assert [o.type for o in whole.output] == ["function_call"]
    events = _raw_events(live, dict(body, seed=seed))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added, delta, done, item_done, completed = events[2:]
    args = whole.output[0].arguments
    assert added["item"]["type"] == "function_call" and added["item"]["arguments"] == ""
    assert added["item"]["status"] == "in_progress" and item_done["item"]["status"] == "completed"
    assert delta["delta"] == done["arguments"] == item_done["item"]["arguments"] == args
    assert {e["output_index"] for e in events[2:6]} == {0}
    assert {e.get("item_id", e.get("item", {}).get("id")) for e in events[2:6]} == {added["item"]["id"]}
    assert (added["item"]["name"], added["item"]["call_id"]) == ("get_weather", item_done["item"]["call_id"])
    assert completed["response"]["output"] == [item_done["item"]]
    assert completed["response"]["usage"]["output_tokens"] == whole.usage.output_tokens
    parsed = list(client.responses.create(stream=True, **body, extra_body={"seed": seed}))
    assert [type(e).__name__ for e in parsed[2:6]] == [
        "ResponseOutputItemAddedEvent", "ResponseFunctionCallArgumentsDeltaEvent",
        "ResponseFunctionCallArgumentsDoneEvent", "ResponseOutputItemDoneEvent"]
    assert parsed[-1].response.output[0].arguments == args


def test_auto_calls_follow_the_message(live, client, parser, monkeypatch):
    """tool_choice "auto" with the Hermes parser (the model's text forced by a regex, as in the chat tests): the text
    before the call is the message, the call a function_call item after it, as the chat completion reads them;
    streamed, the message's events at output_index 0, then the call's at 1. Without a call the answer is the
    message alone."""
    monkeypatch.setattr(responses, "PASSED_ON", responses.PASSED_ON + ("guided_regex",))  # (to force the text)
    regex = r'I will check\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}"\}\}</tool_call>'
    body = {"model": "sol-test", "input": ASK, "max_output_tokens": 150, "temperature": 0.7, "seed": 1,
            "tools": [WEATHER], "guided_regex": regex}
    r = Response.model_validate(httpx.post(live.state.base + "/v1/responses", headers={
        "Authorization": f"Bearer {KEY}"}, json=body, timeout=60).json())
    chat = client.chat.completions.create(model="sol-test", messages=[{"role": "user", "content": ASK}],
                                          max_tokens=150, temperature=0.7, seed=1, tools=[_as_chat(WEATHER)],
                                          extra_body={"guided_regex": regex}).choices[0]
    assert [o.type for o in r.output] == ["message", "function_call"] and r.status == "completed"
    assert r.output_text == chat.message.content == "I will check. " and r.tool_choice == "auto"
    assert [(r.output[1].name, r.output[1].arguments)] == _calls(chat)
    events = _raw_events(live, body)
    kinds = [e["type"] for e in events]
    at = kinds.index("response.output_item.done")
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[at - 2:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.output_item.added", "response.function_call_arguments.delta",
                              "response.function_call_arguments.done", "response.output_item.done",
                              "response.completed"]
    assert set(kinds[4:at - 2]) == {"response.output_text.delta"}
    assert [e["output_index"] for e in events[2:-1]] == [0] * (at + 1 - 2) + [1] * 4
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "I will check. "
    final = events[-1]["response"]["output"]
    assert [o["type"] for o in final] == ["message", "function_call"] and final[1]["arguments"] == r.output[1].arguments
    plain = client.responses.create(model="sol-test", input=ASK, max_output_tokens=8, tools=[WEATHER])
    assert [o.type for o in plain.output] == ["message"] and plain.output_text


def test_calls_and_their_outputs_sent_back_are_the_conversation(live, client, template):
    """An answer's output (its message and calls) sent back in input with a function_call_output, as the openai
    client's docs show, reaches the chat template as chat's assistant tool_calls (one message for the turn) and tool
    message: the prompt and the answer are the chat completion's for those messages."""
    r = client.responses.create(model="sol-test", input=ASK, max_output_tokens=60, temperature=1.0, tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"}, extra_body={"seed": 0})
    call = r.output[0]
    assert call.type == "function_call"
    items = [{"role": "user", "content": ASK}] + r.output + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}]
    back = client.responses.create(model="sol-test", input=items, max_output_tokens=5, tools=[WEATHER],
                                   tool_choice="none", **{k: v for k, v in GREEDY.items() if k != "model"})
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                                       "function": {"name": "get_weather",
                                                                                    "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "rain"}]
    rendered = httpx.post(live.state.base + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                          json={"messages": messages, "tools": [_as_chat(WEATHER)]}).json()
    assert back.usage.input_tokens == rendered["count"]
    assert f"[call {call.call_id} get_weather" in live.state.server.llm.tokenizer.decode(rendered["tokens"])
    chat = _chat(client, messages, 5, tools=[_as_chat(WEATHER)], tool_choice="none")
    assert back.output_text == chat.choices[0].message.content and back.tools[0].name == "get_weather"

    # a turn's text and its calls (two, in parallel) are one assistant message; outputs as text parts
    items = [{"role": "user", "content": ASK},
             {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
             {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather",
              "arguments": '{"city": "Oslo"}', "status": "completed"},
             {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "rain"}]},
             {"type": "function_call_output", "call_id": "c2", "output": "sun"}]
    back = client.responses.create(model="sol-test", input=items, max_output_tokens=2, tools=[WEATHER],
                                   tool_choice="none")
    want = (f'[tool get_weather]<user>{ASK}<assistant>Checking.[call c1 get_weather {{"city": "Oslo"}}]'
            '[call c2 get_weather {"city": "Rome"}]<tool>rain[for c1]<tool>sun[for c2]<assistant>')
    assert back.usage.input_tokens == len(template(want))


def test_logprobs_are_the_chat_completions(live, client):
    """include message.output_text.logprobs with top_logprobs: the output_text part's logprobs are the chat
    completion's for the same greedy request (token, logprob, bytes, top tokens); streamed, each text delta carries
    its tokens', the text's done event all of them; top_logprobs alone gives them too, neither gives none."""
    q = "What is a wafer?"
    chat = _chat(client, [{"role": "user", "content": q}], 6, logprobs=True, top_logprobs=3)
    want = [(e.token, e.logprob, e.bytes, [(t.token, t.logprob, t.bytes) for t in e.top_logprobs])
            for e in chat.choices[0].logprobs.content]
    assert len(want) == 6 and all(len(w[3]) == 3 for w in want)
    body = {"model": "sol-test", "input": q, "max_output_tokens": 6, "temperature": 0, "ignore_eos": True,
            "top_logprobs": 3, "include": ["message.output_text.logprobs"]}
    raw = httpx.post(live.state.base + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, json=body,
                     timeout=60).json()
    r = Response.model_validate(raw)
    got = [(e.token, e.logprob, e.bytes, [(t.token, t.logprob, t.bytes) for t in e.top_logprobs])
           for e in r.output[0].content[0].logprobs]
    assert got == want and r.top_logprobs == 3 and r.output_text == chat.choices[0].message.content
    events = _raw_events(live, body)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    streamed = [(x["token"], x["logprob"], [(t["token"], t["logprob"]) for t in x["top_logprobs"]])
                for e in deltas for x in e["logprobs"]]
    assert streamed == [(w[0], w[1], [t[:2] for t in w[3]]) for w in want] and all(e["logprobs"] for e in deltas)
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert [(x["token"], x["logprob"]) for x in done["logprobs"]] == [w[:2] for w in want]
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == raw["output"][0]["content"][0]["logprobs"]

    alone = client.responses.create(input=q, max_output_tokens=6, top_logprobs=2, **GREEDY)
    assert [(e.token, e.logprob, len(e.top_logprobs)) for e in alone.output[0].content[0].logprobs] == \
        [(w[0], w[1], 2) for w in want]
    included = client.responses.create(input=q, max_output_tokens=6, include=["message.output_text.logprobs"],
                                       **GREEDY)
    assert [(e.token, e.top_logprobs) for e in included.output[0].content[0].logprobs] == [(w[0], []) for w in want]
    plain = client.responses.create(input=q, max_output_tokens=6, **GREEDY)
    assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs is None


def test_tool_and_logprob_requests_refused_name_their_field(live):
    """Built-in tools, tool_choice values this server does not do, malformed function tools and call items, other
    include values, top_logprobs past 20 and max_tool_calls: a 400 naming the field (and the value)."""
    url, auth = live.state.base + "/v1/responses", {"Authorization": f"Bearer {KEY}"}
    ok = {"model": "sol-test", "input": "hi", "max_output_tokens": 2}
    image = [{"type": "input_image", "image_url": "https://example.com/a.png"}]
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
        ({"tools": [WEATHER, {"type": "mcp", "server_label": "x"}]}, "tools", "tools[1]: tools of type 'mcp'"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools", "'code_interpreter'"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools", "'file_search'"),
        ({"tools": ["get_weather"]}, "tools", "tools[0]"),
        ({"tools": {"type": "function", "name": "f"}}, "tools", "a list"),
        ({"tools": [{"type": "function", "name": "a b"}], "tool_choice": "none"}, "tools", "'tools.0.name'"),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools", "'tools.0.name'"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "name of its own"),
        ({"tools": [{"type": "function", "name": "arr", "parameters": {"type": "array"}}], "tool_choice": "required"},
         "tools", "not an object"),
        ({"tools": [WEATHER]}, "tool_choice", "--tool-call-parser"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "\"name\""),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
         "tool_choice", "\"name\""),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice",
         "'allowed_tools'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "'web_search_preview'"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
          "text": {"format": {"type": "json_object"}}}, "text.format", None),
        ({"max_tool_calls": 2}, "max_tool_calls", "max_tool_calls"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "'reasoning.encrypted_content'"),
        ({"include": ["message.output_text.logprobs", "web_search_call.action.sources"]}, "include",
         "'web_search_call.action.sources'"),
        ({"include": "message.output_text.logprobs"}, "include", "a list"),
        ({"top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        ({"top_logprobs": -1, "include": ["message.output_text.logprobs"]}, "top_logprobs", "[0, 20]"),
        ({"top_logprobs": 2.0}, "top_logprobs", None),
        ({"input": [{"type": "function_call", "name": "get_weather", "arguments": "{}"}]}, "input", "call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]}, "input",
         "arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": image}]}, "input", "image inputs"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input", "input[0].output"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input", "'reasoning'"),
        ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input", "'web_search_call'"),
    ]
    failed = _metrics(live).get('waferline_requests_total{endpoint="responses",status="500"}', 0.0)
    for extra, param, words in cases:
        err = _assert_error(httpx.post(url, headers=auth, json={**ok, **extra}, timeout=60), 400)
        assert (err["param"], err["type"]) == (param, "invalid_request_error"), (extra, err)
        assert words is None or words in err["message"], (extra, err)
    assert _metrics(live).get('waferline_requests_total{endpoint="responses",status="500"}', 0.0) == failed
    fine = {"tools": [WEATHER], "tool_choice": "none", "top_logprobs": 0, "include": [], "parallel_tool_calls": False}
    r = httpx.post(url, headers=auth, json={**ok, **fine}, timeout=60).json()
    assert r["status"] in ("completed", "incomplete") and r["output"][0]["content"][0]["logprobs"] == []
    assert Response.model_validate(r).tools[0].name == "get_weather" and r["tool_choice"] == "none"


def test_streamed_logprobs_before_a_call_are_the_texts_when_a_stop_string_holds_it_back(live, parser, monkeypatch):
    """A stop string holds the text back a few tokens, so the tokens of a call's opening tag come with the text
    before it: the streamed message's logprobs are still those of its text alone, as the unstreamed response's (they
    held the call's tokens too: the final output differed between the two)."""
    monkeypatch.setattr(responses, "PASSED_ON", responses.PASSED_ON + ("guided_regex",))  # (to force the text)
    regex = r'Hm\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,4}"\}\}</tool_call>'
    body = {"model": "sol-test", "input": ASK, "max_output_tokens": 150, "temperature": 0.7, "seed": 1,
            "tools": [WEATHER], "guided_regex": regex, "stop": ["</tool_call>"], "top_logprobs": 1}
    raw = httpx.post(live.state.base + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, json=body,
                     timeout=60).json()
    r = Response.model_validate(raw)
    assert [o.type for o in r.output] == ["message", "function_call"] and r.output_text == "Hm. "
    want = [e.token for e in r.output[0].content[0].logprobs]
    assert "".join(want) == "Hm. "
    events = _raw_events(live, body)
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["text"] == "Hm. " and [x["token"] for x in done["logprobs"]] == want
    final = events[-1]["response"]["output"]
    assert [o["type"] for o in final] == ["message", "function_call"]
    assert final[0]["content"][0]["logprobs"] == raw["output"][0]["content"][0]["logprobs"]


def test_a_function_call_output_of_no_call_is_refused(live):
    """A function_call_output whose call_id no function_call item before it has (the calls not sent back, a mistyped
    id, the output first) is a 400 naming input, as OpenAI's API refuses it: it was a tool message the model read
    without its call; an output of a call sent before it still runs, streamed or not."""
    url, auth = live.state.base + "/v1/responses", {"Authorization": f"Bearer {KEY}"}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    out = {"type": "function_call_output", "call_id": "c1", "output": "rain"}
    ok = {"model": "sol-test", "max_output_tokens": 2, "temperature": 0, "ignore_eos": True, "tools": [WEATHER],
          "tool_choice": "none"}
    for items, at in (([{"role": "user", "content": ASK}, out], 1),
                      ([{"role": "user", "content": ASK}, dict(call, call_id="c2"), out], 2),
                      ([{"role": "user", "content": ASK}, out, call], 1)):
        for stream in (False, True):
            err = _assert_error(httpx.post(url, headers=auth, json={**ok, "input": items, "stream": stream},
                                           timeout=60), 400)
            assert err["param"] == "input" and f"input[{at}]" in err["message"] and "'c1'" in err["message"], err
    good = [{"role": "user", "content": ASK}, call, out]
    assert Response.model_validate(httpx.post(url, headers=auth, json={**ok, "input": good}, timeout=60).json())
    assert _raw_events(live, {**ok, "input": good})[-1]["type"] == "response.incomplete"
