"""Function calling (server/tools.py): tool plans from requests (and their 400s), calls read from finished texts
(named, required, Hermes tags for "auto"), the streamed hold-back of a call's tags, and through the official openai
client: named and required calls held to their schemas, "auto" read from the model's text, streamed as not, a
conversation's calls and tool answers reaching the chat template."""

import json

import httpx
import openai
import pytest

from server_helpers import KEY
from waferline.server.protocol import APIError, ChatRequest, parse
from waferline.server.tools import ToolPlan, ToolStream, plan_of

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "Weather in Oslo?"}]


def _req(**kw) -> ChatRequest:
    return parse(ChatRequest, {"model": "m", "messages": MSGS, **kw})


def test_plans_and_their_refusals():
    assert plan_of(_req(), None) is None and plan_of(_req(tools=[WEATHER], tool_choice="none"), None) is None
    named = plan_of(_req(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}),
                    None)
    assert named.mode == "named" and named.structured() == {"json_schema": TIME["function"]["parameters"]}
    req = plan_of(_req(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), None)
    schema = req.structured()["json_schema"]
    assert req.mode == "required" and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert plan_of(_req(tools=[WEATHER]), "hermes").mode == "auto"
    for kw, parser, says in [(dict(tools=[WEATHER]), None, "--tool-call-parser"),
                             (dict(tool_choice="required"), None, "needs tools"),
                             (dict(tool_choice="auto"), "hermes", "needs tools"),
                             (dict(tools=[WEATHER], tool_choice="sometimes"), None, "must be"),
                             (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
                              None, "not among the tools"),
                             (dict(tools=[WEATHER, WEATHER], tool_choice="required"), None, "name of its own")]:
        with pytest.raises(APIError, match=says) as e:
            plan_of(_req(**kw), parser)
        assert e.value.param in ("tool_choice", "tools")
    with pytest.raises(APIError, match="tools"):  # a malformed tool: the request's shape is refused
        _req(tools=[{"type": "function", "function": {"name": "has space"}}])


def test_calls_read_from_finished_texts():
    tools = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
    content, calls = ToolPlan("named", tools, "get_weather").calls('{"city": "Oslo"}')
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Oslo"})] and calls[0]["id"].startswith("call_")
    _, calls = ToolPlan("required", tools).calls('[{"name": "get_time", "parameters": {"zone": "UTC"}}, '
                                                 '{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    auto = ToolPlan("auto", tools)
    text = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}')  # (the last one unclosed)
    content, calls = auto.calls(text)
    assert content == "Let me look. " and [json.loads(c["function"]["arguments"]) for c in calls] == \
        [{"city": "Oslo"}, {"zone": "CET"}]
    assert len(ToolPlan("auto", tools, parallel=False).calls(text)[1]) == 1
    for bad in ('{"city": "Os', "no call here", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
                "<tool_call>not json</tool_call>", '<tool_call>{"name": ["get"], "arguments": {}}</tool_call>',
                "<tool_call>[1]</tool_call>", '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>'):
        plan = ToolPlan("named", tools, "get_weather") if bad.startswith("{") else auto
        assert plan.calls(bad) == (bad, [])  # (cut by max_tokens, or no call it can read: the text is the content)
    assert auto.finish_reason(calls, "stop") == "tool_calls" and auto.finish_reason([], "length") == "length"
    assert ToolPlan("named", tools, "get_time").finish_reason(calls, "stop") == "stop"  # (as OpenAI's)


def test_required_calls_keep_each_tools_definitions():
    """Tools whose parameters use "$defs" (as pydantic writes nested models), refer to their own root ("#": a tree)
    or to a part of themselves ("#/properties/a"): under "required" each tool's schema sits under the array schema's
    "$defs", named after the tool, its local references re-rooted there, so two tools' definitions never collide
    (tool "a" defining "b.c" and tool "a.b" defining "c" did) and "#" still means the tool's own parameters."""
    import json as _json

    import jsonschema

    from waferline.engine.sampling import SamplingParams
    from waferline.engine.structured import grammar_of

    loc = {"$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
           "type": "object", "properties": {"at": {"$ref": "#/$defs/Loc"}}, "required": ["at"]}
    other = {"definitions": {"Loc": {"type": "integer"}}, "type": "object",
             "properties": {"n": {"$ref": "#/definitions/Loc"}}, "required": ["n"]}
    tree = {"type": "object", "properties": {"label": {"type": "string"}, "kids": {"type": "array",
                                                                                  "items": {"$ref": "#"}}},
            "required": ["label"]}
    alias = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}}}
    schema = ToolPlan("required", {"where": loc, "count": other, "tree": tree, "alias": alias}).structured()[
        "json_schema"]
    assert set(schema["$defs"]) == {"where", "count", "tree", "alias"}
    assert schema["$defs"]["where"]["properties"]["at"] == {"$ref": "#/$defs/where/$defs/Loc"}
    assert schema["$defs"]["count"]["properties"]["n"] == {"$ref": "#/$defs/count/definitions/Loc"}
    assert schema["$defs"]["tree"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/tree"}
    assert [a["properties"]["parameters"] for a in schema["items"]["anyOf"]] == [
        {"$ref": f"#/$defs/{n}"} for n in ("where", "count", "tree", "alias")]
    assert grammar_of(SamplingParams(json_schema=schema))
    # the re-rooted schema holds what each tool's own schema holds, and nothing else
    calls = [{"name": "tree", "parameters": {"label": "x", "kids": [{"label": "y", "kids": []}]}},
             {"name": "alias", "parameters": {"a": 1, "b": 2}}, {"name": "count", "parameters": {"n": 3}}]
    jsonschema.validate(calls, schema)
    for bad in ({"name": "tree", "parameters": {"label": "x", "kids": [[{"name": "tree"}]]}},
                {"name": "count", "parameters": {"n": "3"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], schema)
    assert _json.loads(_json.dumps(schema)) == schema
    collide = ToolPlan("required", {"a": {"$defs": {"b.c": {"type": "integer"}}, "type": "object",
                                          "properties": {"x": {"$ref": "#/$defs/b.c"}}},
                                    "a.b": {"$defs": {"c": {"type": "string"}}, "type": "object",
                                            "properties": {"y": {"$ref": "#/$defs/c"}}}}).structured()["json_schema"]
    jsonschema.validate([{"name": "a", "parameters": {"x": 8}}, {"name": "a.b", "parameters": {"y": "z"}}], collide)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "a", "parameters": {"x": "8et"}}], collide)


def test_required_calls_keep_anchors_and_resources_of_their_own():
    """A tool's reference to an anchor ("#Loc") or within a part with an "$id" of its own (a resource, as the tool's
    whole schema may be) points into that part wherever it sits: under "required" they are left as they are (they were
    re-rooted as pointers, "#/$defs/whereLoc", and the request refused: "Pointer ... does not exist")."""
    import jsonschema

    from waferline.engine.sampling import SamplingParams
    from waferline.engine.structured import grammar_of

    anchored = {"$defs": {"Loc": {"$anchor": "Loc", "type": "integer"}}, "type": "object",
                "properties": {"at": {"$ref": "#Loc"}}, "required": ["at"], "additionalProperties": False}
    resource = {"$id": "https://example.com/count.json", "$defs": {"N": {"type": "string"}}, "type": "object",
                "properties": {"n": {"$ref": "#/$defs/N"}}, "required": ["n"], "additionalProperties": False}
    inner = {"type": "object", "properties": {"m": {"$id": "https://example.com/m.json", "$defs": {"M": {"const": 1}},
                                                    "$ref": "#/$defs/M"}, "k": {"$ref": "#/properties/m"}}}
    schema = ToolPlan("required", {"where": anchored, "count": resource, "inner": inner}).structured()["json_schema"]
    assert schema["$defs"]["where"]["properties"]["at"] == {"$ref": "#Loc"}
    assert schema["$defs"]["count"] == resource
    assert schema["$defs"]["inner"]["properties"] == {"m": inner["properties"]["m"],
                                                      "k": {"$ref": "#/$defs/inner/properties/m"}}
    assert grammar_of(SamplingParams(json_schema=schema))
    jsonschema.validate([{"name": "where", "parameters": {"at": 3}}, {"name": "count", "parameters": {"n": "x"}},
                         {"name": "inner", "parameters": {"m": 1, "k": 1}}], schema)
    for bad in ({"name": "where", "parameters": {"at": "3"}}, {"name": "count", "parameters": {"n": 3}},
                {"name": "inner", "parameters": {"k": 2}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], schema)


def test_required_calls_keep_a_ref_that_is_data():
    """A "$ref" inside an instance (a "const", an "enum"'s value, a "default") is data the call must hold, not a
    reference: under "required" it stays as written (it was re-rooted, "#/$defs/link/components/Pet", and every call
    was held to that, which the tool's own schema refuses); a property named "const" is still a schema."""
    import jsonschema

    params = {"type": "object", "properties": {"kind": {"const": {"$ref": "#/components/Pet"}},
                                               "alt": {"enum": [{"$ref": "#"}], "default": {"$ref": "#"}},
                                               "const": {"$ref": "#/properties/kind"}},
              "required": ["kind"], "additionalProperties": False}
    schema = ToolPlan("required", {"link": params}).structured()["json_schema"]
    props = schema["$defs"]["link"]["properties"]
    assert props["kind"] == params["properties"]["kind"] and props["alt"] == params["properties"]["alt"]
    assert props["const"] == {"$ref": "#/$defs/link/properties/kind"}
    call = {"kind": {"$ref": "#/components/Pet"}, "alt": {"$ref": "#"}, "const": {"$ref": "#/components/Pet"}}
    jsonschema.validate(call, params)
    jsonschema.validate([{"name": "link", "parameters": call}], schema)


def test_call_arguments_keep_the_numbers_as_written():
    """A call's arguments go back out as the model wrote its numbers: 1e999 stays 1e999 (it came back as Infinity,
    which is not JSON) and no digit of 0.1000000000000000000001 is lost."""
    plan = ToolPlan("named", {"f": {"type": "object", "properties": {"x": {"type": "number"}}}}, "f")
    for text in ('{"x":1e999}', '{"x": 0.1000000000000000000001}', '{"x": -2.5E-3}'):
        content, calls = plan.calls(text)
        assert json.loads(calls[0]["function"]["arguments"], parse_float=str) == json.loads(text, parse_float=str)
        assert "Infinity" not in calls[0]["function"]["arguments"]


def test_calls_nested_too_deeply_stay_content():
    """A call whose JSON nests deeper than Python decodes (or writes back) is no call it can read: its text is the
    content, as a malformed one's (it raised RecursionError: a 500, or a stream cut off)."""
    tools = {"f": {"type": "object"}}
    deep = '{"a": ' + "[" * 600 + "1" + "]" * 600 + "}"  # (decodes; writing it back recursed too deep)
    for plan, text in [(ToolPlan("auto", tools), "<tool_call>" + "[" * 5000),
                       (ToolPlan("auto", tools), '<tool_call>{"name": "f", "arguments": ' + deep + "}</tool_call>"),
                       (ToolPlan("named", tools, "f"), deep), (ToolPlan("named", tools, "f"), "{" * 5000),
                       (ToolPlan("required", tools), '[{"name": "f", "parameters": ' + deep + "}]")]:
        assert plan.calls(text) == (text, [])
        s = ToolStream(plan)
        sent = s.feed(text)
        assert sent + s.finish() == text and not s.calls
    assert ToolPlan("named", tools, "f").calls('{"a": [[1]]}')[1]  # (nested, not too deeply: a call)


def test_streamed_content_holds_back_a_call():
    tools = {"get_weather": WEATHER["function"]["parameters"]}
    s = ToolStream(ToolPlan("auto", tools))
    sent = [s.feed(p) for p in ("Sure", ", <", "tool", "_call>", '{"name": "get_weather", ', '"arguments": {}}',
                                "</tool_call>")]
    assert "".join(sent) == "Sure, " and sent[1] == ", "  # ("<" might open a call: held until it does not)
    assert s.finish() == "" and s.calls[0]["function"]["name"] == "get_weather"
    s = ToolStream(ToolPlan("auto", tools))
    assert s.feed("a < b") == "a < b" and s.feed(" <t") == " " and s.finish() == "<t" and not s.calls
    s = ToolStream(ToolPlan("named", tools, "get_weather"))
    assert s.feed('{"city": "Oslo"}') == "" and s.finish() == "" and len(s.calls) == 1


@pytest.fixture
def parser(live):
    live.state.server.tool_call_parser = "hermes"
    yield
    live.state.server.tool_call_parser = None


def _prompt_ids(llm, msgs):
    from waferline.server.app import FALLBACK_CHAT_TEMPLATE, FALLBACK_GENERATION_PROMPT

    return llm.encode("".join(FALLBACK_CHAT_TEMPLATE.format(**m) for m in msgs) + FALLBACK_GENERATION_PROMPT)


def test_named_and_required_calls(live, client):
    """A named call's arguments are an instance of its schema (where the answer stopped), the tokens LLM.generate
    samples under that schema; required calls name the tools; streamed, the calls come in the last chunks."""
    from waferline.engine.sampling import SamplingParams

    llm = live.state.server.llm
    kw = dict(model="sol-test", messages=MSGS, max_tokens=40, temperature=1.0, tools=[WEATHER, TIME])
    called = 0
    for seed in range(4):
        r = client.chat.completions.create(seed=seed, tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}}, **kw)
        c = r.choices[0]
        want = llm.generate([_prompt_ids(llm, MSGS)], SamplingParams(
            max_tokens=40, temperature=1.0, seed=seed, json_schema=WEATHER["function"]["parameters"]))[0]
        if c.message.tool_calls:
            called += 1
            call = c.message.tool_calls[0]
            args = json.loads(call.function.arguments)
            assert call.function.name == "get_weather" and c.finish_reason == "stop" and c.message.content is None
            assert args == json.loads(want.text) and set(args) <= {"city", "days"} and len(args["city"]) <= 10
        else:
            assert c.finish_reason == "length" and c.message.content == want.text
    assert called >= 2
    required = 0
    for seed in range(4):
        c = client.chat.completions.create(seed=seed, tool_choice="required", **(kw | {"max_tokens": 120})).choices[0]
        if c.message.tool_calls:
            required += 1
            assert c.finish_reason == "tool_calls"
            assert {t.function.name for t in c.message.tool_calls} <= {"get_weather", "get_time"}
    assert required >= 1
    named = dict(kw, seed=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**named).choices[0]
    chunks = [ch for ch in client.chat.completions.create(stream=True, **named) if ch.choices]
    streamed = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == (whole.message.content or "")
    assert [(t.function.name, t.function.arguments) for t in streamed] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    # the call's text is held back until it parses: no chunk for a token that adds nothing (it sent one per token)
    empty = [ch for ch in chunks if ch.choices[0].delta.content is None and not ch.choices[0].delta.tool_calls
             and ch.choices[0].finish_reason is None and ch.choices[0].delta.role is None]
    assert empty == []


def test_auto_reads_the_models_own_calls(live, client, parser):
    """tool_choice "auto" with the Hermes parser: a text holding <tool_call> tags (here forced by a regex, as a model
    trained to call would write it) is read into tool_calls, the text before it the content; streamed the same."""
    regex = r'I will check\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}"\}\}</tool_call>'
    kw = dict(model="sol-test", messages=MSGS, max_tokens=150, temperature=0.7, seed=1, tools=[WEATHER],
              extra_body={"guided_regex": regex})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "I will check. "
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    chunks = [ch for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "I will check. "
    streamed = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    assert [t.function.arguments for t in streamed] == [call.function.arguments]
    plain = client.chat.completions.create(model="sol-test", messages=MSGS, max_tokens=8, tools=[WEATHER]).choices[0]
    assert not plain.message.tool_calls and plain.finish_reason in ("stop", "length")  # (no tags: content)


def test_tools_and_calls_reach_the_chat_template(live, client):
    """The tools, an assistant's calls (arguments as objects) and a tool's answer render through the model's chat
    template; without --tool-call-parser, tools with the default tool_choice are a 400; functions stay refused."""
    tok = live.state.server.llm.tokenizer
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}[call {{ c.function.name }} "
                "{{ c.function.arguments.city }}]{% endfor %}{% if m.tool_call_id %}[for {{ m.tool_call_id }}]"
                "{% endif %}{% endfor %}<assistant>")
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    base, auth = live.state.base, {"Authorization": f"Bearer {KEY}"}
    saved = tok.chat_template, live.state.server.encode_tokenizer.chat_template
    tok.chat_template = live.state.server.encode_tokenizer.chat_template = template
    try:
        r = httpx.post(base + "/tokenize", headers=auth, json={"messages": msgs, "tools": [WEATHER]}).json()
        want = "[tool get_weather]<user>Weather in Oslo?<assistant>[call get_weather Oslo]<tool>rain[for call_1]" \
               "<assistant>"
        assert r["tokens"] == live.state.server.llm.encode(want)
        c = client.chat.completions.create(model="sol-test", messages=msgs, max_tokens=4, tools=[WEATHER],
                                           tool_choice="none").choices[0]
        assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
    finally:
        tok.chat_template, live.state.server.encode_tokenizer.chat_template = saved
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser") as e:
        client.chat.completions.create(model="sol-test", messages=MSGS, max_tokens=4, tools=[WEATHER])
    assert e.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="deprecated") as e:
        client.chat.completions.create(model="sol-test", messages=MSGS, max_tokens=4,
                                       functions=[WEATHER["function"]])
    assert e.value.param == "functions"


def test_calls_with_a_lone_surrogate_escape(live, client, parser):
    """A call whose arguments hold a lone surrogate escape ("\\ud800", as a model may write one) goes back out with it
    escaped: the answer's UTF-8 cannot hold the character itself (it was a 500, and a stream cut off)."""
    plan = ToolPlan("auto", {"get_weather": WEATHER["function"]["parameters"]})
    _, calls = plan.calls('<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800 \\u00e9\\ud83d\\ude00"}}'
                          "</tool_call>")
    args = calls[0]["function"]["arguments"]
    assert args.encode("utf-8") and json.loads(args) == {"city": "\ud800 \u00e9\U0001F600"}
    regex = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "a\\ud800"\}\}</tool_call>'
    kw = dict(model="sol-test", messages=MSGS, max_tokens=150, temperature=0, tools=[WEATHER],
              extra_body={"guided_regex": regex})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and json.loads(c.message.tool_calls[0].function.arguments) == \
        {"city": "a\ud800"}
    streamed = [tc for ch in client.chat.completions.create(stream=True, **kw) if ch.choices
                for tc in ch.choices[0].delta.tool_calls or []]
    assert [t.function.arguments for t in streamed] == [c.message.tool_calls[0].function.arguments]


def test_earlier_call_arguments_with_a_lone_surrogate_escape(live, client):
    """An earlier call's arguments (JSON text) holding a lone surrogate escape are a 400, as such a string anywhere in
    the body is (it was a 500: the chat template's text could not be encoded)."""
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "\\ud800"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    tok = live.state.server.llm.tokenizer
    saved = tok.chat_template, live.state.server.encode_tokenizer.chat_template
    tok.chat_template = live.state.server.encode_tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}<assistant>")
    try:
        with pytest.raises(openai.BadRequestError, match="surrogate") as e:
            client.chat.completions.create(model="sol-test", messages=msgs, max_tokens=4, tools=[WEATHER],
                                           tool_choice="none")
        assert e.value.param == "messages"
        ok = [dict(msgs[1], tool_calls=[{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "\\ud83d\\ude00"}'}}]), msgs[2]]  # (a pair: one character)
        c = client.chat.completions.create(model="sol-test", messages=MSGS + ok, max_tokens=4, tools=[WEATHER],
                                           tool_choice="none").choices[0]
        assert c.finish_reason in ("stop", "length")
    finally:
        tok.chat_template, live.state.server.encode_tokenizer.chat_template = saved


def test_named_and_required_calls_are_objects(live, client):
    """A tool whose parameters schema leaves out "type" (or allows "null" too) is held to an object of it under a
    named or required tool_choice: the answer is a call (it could be an array, or 24, which stayed content); a schema
    of anything but an object is a 400."""
    import jsonschema

    loose = {"properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    tools = {"loose": loose, "nullable": dict(loose, type=["object", "null"])}
    for name in tools:
        for plan in (ToolPlan("named", tools, name), ToolPlan("required", tools)):
            schema = plan.structured()["json_schema"]
            wrap = (lambda v: v) if plan.mode == "named" else (lambda v: [{"name": name, "parameters": v}])
            jsonschema.validate(wrap({"a": 1}), schema)
            for bad in ([False, 9], 24, None):
                with pytest.raises(jsonschema.ValidationError):
                    jsonschema.validate(wrap(bad), schema)
    arr = {"type": "function", "function": {"name": "arr", "parameters": {"type": "array"}}}
    for choice in ({"type": "function", "function": {"name": "arr"}}, "required"):
        with pytest.raises(openai.BadRequestError, match="object") as e:
            client.chat.completions.create(model="sol-test", messages=MSGS, max_tokens=4, tools=[arr],
                                           tool_choice=choice)
        assert e.value.param == "tools"
    tool = {"type": "function", "function": {"name": "loose", "parameters": loose}}
    for seed in range(6):
        c = client.chat.completions.create(model="sol-test", messages=MSGS, max_tokens=40, temperature=1.0, seed=seed,
                                           tools=[tool], tool_choice={"type": "function", "function": {"name": "loose"}}
                                           ).choices[0]
        assert c.finish_reason == "length" or json.loads(c.message.tool_calls[0].function.arguments)["a"] in (1, 2)
