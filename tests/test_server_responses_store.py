"""Stored responses of the Responses API (server/responses_store.py): previous_response_id, GET / DELETE
/v1/responses/{id}, /input_items, the store's bound and `serve --responses-store 0`, tested with the official `openai`
client against the live server of the server tests (conftest.py: a tiny sol checkpoint, no chat template)."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai.types.responses import Response
from openai.types.responses.response_item import ResponseItem
from pydantic import TypeAdapter

from server_helpers import (
    KEY,
    MAX_LEN,
    _assert_error,
    _metrics,
    _wait_until,
    chat_template,
    fail_sampling,
    serve_in_thread,
)
from waferline.server.responses import REFUSED
from waferline.server.responses_store import ResponseStore, Stored

GREEDY = dict(model="sol-test", temperature=0, extra_body={"ignore_eos": True})
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture
def small_store(live, monkeypatch):
    """The live server's store swapped for one of 3 responses."""
    store = ResponseStore(3)
    monkeypatch.setattr(live.state.server, "responses", store)
    return store


@pytest.fixture
def template(live):
    """A chat template that shows an assistant's calls and a tool's answers (the test model has none)."""
    with chat_template(live.state.server, (
            "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}{% for c in m.tool_calls or [] %}[call "
            "{{ c.id }} {{ c.function.name }}]{% endfor %}{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}"
            "{% endfor %}<assistant>")):
        yield


def _url(live, path=""):
    return live.state.base + "/v1/responses" + path


def test_a_conversation_continued_by_id_is_the_conversation_sent_whole(live, client):
    """Three turns through previous_response_id give, token for token, the greedy answers of the same conversation
    sent whole in input; each turn's instructions apply to it alone (not carried over); the responses say store: true
    and the id they continue."""
    turns = [("What is a wafer?", "Be brief."), ("And a die?", None), ("Why both?", "Answer as a poet.")]
    whole: list = []
    prev = None
    for q, instructions in turns:
        kw = dict(max_output_tokens=6, **GREEDY) | ({} if instructions is None else {"instructions": instructions})
        r = client.responses.create(input=q, previous_response_id=prev, **kw) if prev else \
            client.responses.create(input=q, **kw)
        whole += [{"role": "user", "content": q}]
        sent = client.responses.create(input=whole, store=False, **kw)
        assert r.output_text == sent.output_text and r.output_text
        assert r.usage.input_tokens == sent.usage.input_tokens
        assert (r.store, sent.store, r.previous_response_id, r.instructions) == (True, False, prev, instructions)
        whole += [o.model_dump(exclude_none=True) for o in r.output]
        prev = r.id
    assert r.usage.input_tokens > 30  # (the third turn's prompt holds the first two)
    first = client.responses.retrieve(prev).model_dump()
    assert first == r.model_dump()


def test_streamed_responses_are_stored_when_they_finish(live, client, monkeypatch):
    """A streamed response is stored before its last event goes out: read back, it is that event's response, and a
    request continues it; one that fails in the engine is stored failed; one whose client leaves mid-stream (its
    sequence aborted, never finished) is not stored."""
    events = list(client.responses.create(input="What is a wafer?", max_output_tokens=5, stream=True, **GREEDY))
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.store is True
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    r = client.responses.create(input="More.", previous_response_id=final.id, max_output_tokens=3, **GREEDY)
    whole = [{"role": "user", "content": "What is a wafer?"}] + [o.model_dump(exclude_none=True) for o in final.output]
    sent = client.responses.create(input=whole + [{"role": "user", "content": "More."}], max_output_tokens=3,
                                   **GREEDY)
    assert r.usage.input_tokens == sent.usage.input_tokens and r.output_text == sent.output_text

    restore = fail_sampling(live, monkeypatch, lambda s: s.request_id.startswith("resp_"))
    body = {"model": "sol-test", "input": "The wafer", "max_output_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", _url(live), headers=AUTH, json=body, timeout=60) as s:
        sent_events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ")]
    restore()
    assert sent_events[-1]["type"] == "response.failed"
    failed = client.responses.retrieve(sent_events[-1]["response"]["id"])
    assert failed.status == "failed" and "injected" in failed.error.message and failed.output == []

    with httpx.stream("POST", _url(live), headers=AUTH, json=dict(body, max_output_tokens=200), timeout=60) as s:
        lines = s.iter_lines()
        rid = json.loads(next(ln for ln in lines if ln.startswith("data: "))[6:])["response"]["id"]
        next(ln for ln in lines if "output_text.delta" in ln)
    assert _wait_until(lambda: live.state.server.engine.num_running == 0)
    assert _wait_until(lambda: _metrics(live).get('waferline_requests_total{endpoint="responses",status="499"}'))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)


def test_read_delete_and_input_items(live, client):
    """GET gives the stored response; input_items lists the items the model saw (the chain's inputs and outputs, then
    the request's own; not instructions), newest first by default, paged by limit and after as the openai client
    pages, each of the client's item types; DELETE gives OpenAI's deleted object, after which the id is unknown to
    every route (404; a 400 naming previous_response_id) while a response that continued it still runs; bad paging
    values and options this server does not give are 400s naming them; the routes need the API key."""
    r1 = client.responses.create(input="Hello.", instructions="Be kind.", max_output_tokens=3, **GREEDY)
    items = [{"role": "user", "content": "Hi again."},
             {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]}]
    r2 = client.responses.create(input=items, previous_response_id=r1.id, max_output_tokens=3, **GREEDY)
    assert client.responses.retrieve(r2.id).model_dump() == r2.model_dump()

    raw = httpx.get(_url(live, f"/{r2.id}/input_items"), headers=AUTH, params={"order": "asc"}).json()
    assert raw["object"] == "list" and raw["has_more"] is False
    data = raw["data"]
    assert [(d["type"], d.get("role")) for d in data] == [("message", "user"), ("message", "assistant"),
                                                         ("message", "user"), ("message", "developer")]
    assert [d["content"][0]["text"] for d in data] == ["Hello.", r1.output_text, "Hi again.", "Be brief."]
    assert data[1]["id"] == r1.output[0].id and (raw["first_id"], raw["last_id"]) == (data[0]["id"], data[-1]["id"])
    assert len({d["id"] for d in data}) == 4
    adapter = TypeAdapter(ResponseItem)
    for d in data:
        adapter.validate_python(d)
    ids = [d["id"] for d in data]
    page = client.responses.input_items.list(r2.id)  # (desc, the default)
    assert [d.id for d in page.data] == ids[::-1] and page.has_more is False
    page = client.responses.input_items.list(r2.id, order="asc", limit=3)
    assert [d.id for d in page.data] == ids[:3] and page.has_more is True
    assert [d.id for d in client.responses.input_items.list(r2.id, order="asc", limit=1)] == ids  # (every page)
    assert [d.id for d in client.responses.input_items.list(r2.id, limit=3, after=ids[2])] == ids[:2][::-1]

    for query, param in (({"order": "sideways"}, "order"), ({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"),
                         ({"limit": "x"}, "limit"), ({"limit": "1" * 5000}, "limit"), ({"after": "msg_nope"}, "after"),
                         ({"before": ids[1]}, "before"), ({"include[]": "file_search_call.results"}, "include")):
        err = _assert_error(httpx.get(_url(live, f"/{r2.id}/input_items"), headers=AUTH, params=query), 400)
        assert err["param"] == param, (query, err)
    err = _assert_error(httpx.get(_url(live, f"/{r2.id}"), headers=AUTH, params={"stream": "true"}), 400)
    assert err["param"] == "stream"
    assert client.responses.retrieve(r2.id, include=["message.output_text.logprobs"]).id == r2.id
    for method, path in (("GET", f"/{r2.id}"), ("DELETE", f"/{r2.id}"), ("GET", f"/{r2.id}/input_items")):
        err = _assert_error(httpx.request(method, _url(live, path)), 401)
        assert err["code"] == "invalid_api_key"

    deleted = httpx.delete(_url(live, f"/{r1.id}"), headers=AUTH)
    assert deleted.status_code == 200 and deleted.json() == {"id": r1.id, "object": "response.deleted",
                                                             "deleted": True}
    assert client.responses.delete(r2.id) is None  # (the client's own call: no content read)
    for rid in (r1.id, r2.id):
        with pytest.raises(openai.NotFoundError, match=f"Response with id '{rid}' not found"):
            client.responses.retrieve(rid)
        for method, path in (("DELETE", f"/{rid}"), ("GET", f"/{rid}/input_items")):
            err = _assert_error(httpx.request(method, _url(live, path), headers=AUTH), 404)
            assert err["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(input="x", previous_response_id=rid, max_output_tokens=2, **GREEDY)
        assert (e.value.code, e.value.param) == ("previous_response_not_found", "previous_response_id")
        assert e.value.body["message"] == f"Previous response with id '{rid}' not found."


def test_the_chain_survives_its_ancestors_deletion(live, client):
    """A response keeps the conversation it continued: deleting the first response of a chain leaves the second one
    continuable, with the whole conversation (the third turn sees the first). Input items get ids of their own; one
    that repeats an id of the chain is a 400."""
    r1 = client.responses.create(input="One.", max_output_tokens=3, **GREEDY)
    r2 = client.responses.create(input="Two.", previous_response_id=r1.id, max_output_tokens=3, **GREEDY)
    client.responses.delete(r1.id)
    r3 = client.responses.create(input="Three.", previous_response_id=r2.id, max_output_tokens=3, **GREEDY)
    whole = [{"role": "user", "content": "One."}, *r1.output, {"role": "user", "content": "Two."}, *r2.output,
             {"role": "user", "content": "Three."}]
    sent = client.responses.create(input=[o if isinstance(o, dict) else o.model_dump(exclude_none=True)
                                          for o in whole], max_output_tokens=3, **GREEDY)
    assert (r3.usage.input_tokens, r3.output_text) == (sent.usage.input_tokens, sent.output_text)
    # items of one request with the same id (or none) are each listed with an id of their own
    same = {"type": "message", "id": "msg_same", "role": "user", "content": "Hi."}
    r = client.responses.create(input=[same, dict(same, content="Ho."), {"role": "user", "content": "Hu."}],
                                max_output_tokens=2, **GREEDY)
    listed = [d.id for d in client.responses.input_items.list(r.id, order="asc")]
    assert listed[0] == "msg_same" and len(set(listed)) == 3
    # the previous response's items sent again with its id: a duplicate, as OpenAI's API refuses it
    err = _assert_error(httpx.post(_url(live), headers=AUTH, json={
        "model": "sol-test", "previous_response_id": r3.id, "input": [r3.output[0].model_dump(exclude_none=True)]}),
        400)
    assert err["param"] == "input" and "duplicate item id" in err["message"]


def test_store_false_and_a_bad_store_or_id(live, client):
    """store: false answers as before and keeps nothing (the response says store: false; its id is unknown); store
    left out is true; a store or previous_response_id of another type, and conversation, are 400s naming them."""
    r = client.responses.create(input="Hi.", store=False, max_output_tokens=2, **GREEDY)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError, match="Previous response with id"):
        client.responses.create(input="x", previous_response_id=r.id, max_output_tokens=2, **GREEDY)
    assert client.responses.create(input="Hi.", max_output_tokens=2, **GREEDY).store is True
    ok = {"model": "sol-test", "input": "hi", "max_output_tokens": 2}
    for extra, param in (({"store": 1}, "store"), ({"store": "yes"}, "store"), ({"previous_response_id": 5},
                         "previous_response_id"), ({"previous_response_id": ""}, "previous_response_id"),
                         ({"conversation": "conv_1"}, "conversation")):
        err = _assert_error(httpx.post(_url(live), headers=AUTH, json={**ok, **extra}), 400)
        assert err["param"] == param, (extra, err)


def test_a_function_call_answered_through_previous_response_id(live, client, template):
    """A stored response that is a function call, continued with a function_call_output of its call_id: the model
    sees the call and its answer (chat's assistant tool_calls and tool message), as when the conversation is sent
    whole; an output of a call no response of the chain made is still the 400 naming input."""
    kw = dict(model="sol-test", tools=[WEATHER], extra_body={"seed": 0})
    r = client.responses.create(input="Weather in Oslo?", max_output_tokens=60, temperature=1.0,
                                tool_choice={"type": "function", "name": "get_weather"}, **kw)
    call = r.output[0]
    assert call.type == "function_call"
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}
    back = client.responses.create(input=[answer], previous_response_id=r.id, max_output_tokens=4, temperature=0,
                                   tool_choice="none", **kw)
    whole = [{"role": "user", "content": "Weather in Oslo?"}, call.model_dump(exclude_none=True), answer]
    sent = client.responses.create(input=whole, max_output_tokens=4, temperature=0, tool_choice="none", **kw)
    assert (back.usage.input_tokens, back.output_text) == (sent.usage.input_tokens, sent.output_text)
    prompt = httpx.post(live.state.base + "/tokenize", headers=AUTH, json={"messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "rain"}]}).json()
    assert back.usage.input_tokens == prompt["count"]
    two = client.responses.create(input=[{"role": "user", "content": "Thanks."}], previous_response_id=back.id,
                                  max_output_tokens=2, tool_choice="none", **kw)
    assert two.usage.input_tokens > back.usage.input_tokens  # (the call and its answer stay in the chain)
    err = _assert_error(httpx.post(_url(live), headers=AUTH, json={
        "model": "sol-test", "previous_response_id": back.id, "max_output_tokens": 2,
        "input": [dict(answer, call_id="call_nope")]}), 400)
    assert err["param"] == "input" and "input[0]" in err["message"] and "'call_nope'" in err["message"]


def test_the_store_keeps_at_most_its_bound(live, client, small_store):
    """A store of 3 holds at most 3 responses, whatever the requests running together: the least recently used go
    first (reading one keeps it), an evicted id is unknown (404; previous_response_not_found)."""
    made = [client.responses.create(input=f"Turn {i}.", max_output_tokens=2, **GREEDY).id for i in range(3)]
    client.responses.retrieve(made[0])  # (now the most recently used)
    made.append(client.responses.create(input="Turn 3.", max_output_tokens=2, **GREEDY).id)
    assert len(small_store) == 3
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[1])
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input="x", previous_response_id=made[1], max_output_tokens=2, **GREEDY)
    assert e.value.code == "previous_response_not_found"
    for rid in (made[0], made[2], made[3]):
        assert client.responses.retrieve(rid).id == rid

    sizes = []
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            sizes.append(len(small_store))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda i: client.responses.create(
                input=f"Many {i}.", max_output_tokens=3, stream=i % 2 == 1, **GREEDY), range(12)))
    finally:
        watching.set()
        watcher.join()
    assert len(got) == 12 and max(sizes) <= 3 and len(small_store) == 3


def test_the_store_alone_is_bounded_and_thread_safe():
    """ResponseStore: puts from many threads never leave more than its capacity; 0 stores nothing."""
    store = ResponseStore(5)

    def put(i):
        store.put(Stored({"id": f"resp_{i}", "output": []}, []))
        assert len(store) <= 5
        store.get(f"resp_{i - 1}")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, range(2000)))
    assert len(store) == 5
    off = ResponseStore(0)
    off.put(Stored({"id": "resp_x", "output": []}, []))
    assert len(off) == 0 and off.get("resp_x") is None
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_the_store_is_bounded_in_bytes_too():
    """ResponseStore's byte budget: entries counted at their conversation's JSON size (shared items included) evict the
    least recently used past it, an entry larger than the budget is not kept, and deletes give their bytes back (a
    count bound alone let 1024 responses of ~1 MiB bodies hold a GiB)."""
    def entry(i, text, earlier=()):
        items = [*earlier, {"id": f"msg_{i}", "type": "message", "role": "user", "content": text}]
        return Stored({"id": f"resp_{i}", "output": []}, items)

    one = len(json.dumps(entry(0, "x" * 1000).conversation()))
    store = ResponseStore(100, max_bytes=3 * one + 10)
    for i in range(3):
        store.put(entry(i, "x" * 1000))
    assert len(store) == 3 and store.bytes == 3 * one
    store.get("resp_0")  # (a use: resp_1 is now the least recently used)
    store.put(entry(3, "x" * 1000))
    assert store.get("resp_1") is None and store.get("resp_0") is not None and store.bytes <= store.max_bytes
    chain = entry(4, "y" * 10, earlier=entry(5, "x" * 1000).items)  # (counted with the item it shares)
    store.put(chain)
    held = list(store._entries)
    assert held == ["resp_0", "resp_4"]  # (resp_2, then resp_3 evicted: the chain counts its shared item)
    assert store.bytes == sum(len(json.dumps(store._entries[k].conversation())) for k in held) <= store.max_bytes
    store.put(entry(6, "z" * (4 * one)))  # (larger than the whole budget: not kept, nothing else evicted for it)
    assert store.get("resp_6") is None and store.bytes <= store.max_bytes
    before = store.bytes
    assert store.delete("resp_4") and store.bytes < before and not store.delete("resp_4")
    store.put(entry(7, "x" * 1000))
    store.put(entry(7, "x" * 1000))  # (the same id again: counted once)
    assert store.bytes == sum(len(json.dumps(store._entries[k].conversation())) for k in store._entries)


def test_responses_store_0_keeps_the_old_refusals(sol, threads):
    """`serve --responses-store 0`: store: true and previous_response_id are the 400s they were, responses say
    store: false, and nothing is read back (404); the flag takes 0 or more."""
    from waferline.cli import build_parser
    from waferline.errors import ConfigError
    from waferline.server.commands import build_server

    args = build_parser().parse_args(["serve", "m", "--responses-store", "0"])
    assert args.responses_store == 0
    assert build_parser().parse_args(["serve", "m"]).responses_store == 1024
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--responses-store", "-1"])
    with pytest.raises(ConfigError, match="responses-store"):
        build_server(sol, responses_store=-1)
    app = build_server(sol, max_num_seqs=2, max_model_len=MAX_LEN, served_model_name="sol-test", responses_store=0)
    with serve_in_thread(app) as base:
        ok = {"model": "sol-test", "input": "hi", "max_output_tokens": 2}
        for extra, param in (({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id")):
            err = _assert_error(httpx.post(base + "/v1/responses", json={**ok, **extra}, timeout=60), 400)
            assert (err["param"], err["message"]) == (param, REFUSED[param])
        r = Response.model_validate(httpx.post(base + "/v1/responses", json=ok, timeout=60).json())
        assert r.store is False and r.previous_response_id is None
        err = _assert_error(httpx.get(base + f"/v1/responses/{r.id}"), 404)
        assert "--responses-store" in err["message"]
        assert len(app.state.server.responses) == 0
