"""Chat rendering (server/chat.py): the plain template of a model without one, add_generation_prompt and
continue_final_message, chat_template_kwargs reaching the model's template, and `serve --chat-template` (a file or
the text, checked before the weights load)."""

import httpx
import pytest

from server_helpers import KEY
from waferline.errors import ConfigError
from waferline.server.chat import load_template, render, template_messages
from waferline.server.protocol import APIError, ChatRequest, parse

MSGS = [{"role": "user", "content": "Who is there?"}, {"role": "assistant", "content": "Nay, answer me"}]
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if not loop.last or not continue_final_message %}"
            "[/]{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]{% if think %}<think>{% endif %}"
            "{% endif %}")


def _req(**kw) -> ChatRequest:
    return parse(ChatRequest, {"model": "m", "messages": MSGS, **kw})


def _chat_ids(server, text):
    """A rendered chat prompt's ids: as its template writes it, no special tokens added."""
    return server.llm.tokenizer.encode(text, add_special_tokens=False)


def test_the_plain_template_and_its_options():
    assert render(None, None, _req()) == "<|user|>\nWho is there?\n<|assistant|>\nNay, answer me\n<|assistant|>\n"
    assert render(None, None, _req(add_generation_prompt=False)).endswith("Nay, answer me\n")
    assert render(None, None, _req(add_generation_prompt=False, continue_final_message=True)).endswith(
        "<|assistant|>\nNay, answer me")
    for kw, says in [(dict(continue_final_message=True), "add_generation_prompt: false"),
                     (dict(chat_template_kwargs={"tools": []}), "may not set tools")]:
        with pytest.raises(APIError, match=says):
            render(None, None, _req(**kw))
    with pytest.raises(APIError, match="the assistant's"):
        render(None, None, parse(ChatRequest, {"model": "m", "messages": MSGS[:1], "add_generation_prompt": False,
                                               "continue_final_message": True}))


def test_the_models_template_takes_the_options(sol):
    from waferline.model.load import load_tokenizer

    tok = load_tokenizer(sol)
    assert render(tok, TEMPLATE, _req()) == "[user]Who is there?[/][assistant]Nay, answer me[/][assistant]"
    assert render(tok, TEMPLATE, _req(chat_template_kwargs={"think": True})).endswith("[assistant]<think>")
    assert render(tok, TEMPLATE, _req(add_generation_prompt=False, continue_final_message=True)) == \
        "[user]Who is there?[/][assistant]Nay, answer me"
    with pytest.raises(APIError, match="rejected"):
        render(tok, "{{ raise_exception('no') }}", _req())


def test_serve_chat_template_from_a_file_or_text(sol, tmp_path, live):
    from waferline.model.load import load_tokenizer
    from waferline.server.commands import build_server

    tok = load_tokenizer(sol)
    f = tmp_path / "chat.jinja"
    f.write_text(TEMPLATE)
    assert load_template(str(f), tok) == TEMPLATE == load_template(TEMPLATE, tok)
    (tmp_path / "utf16.jinja").write_text(TEMPLATE, encoding="utf-16")  # (a traceback: UnicodeDecodeError)
    for bad, says in [("no/such/file.jinja", "no such file"), ("{% for %}", "does not render"),
                      (str(tmp_path / "utf16.jinja"), "cannot read it as UTF-8")]:
        with pytest.raises(ConfigError, match=says):
            load_template(bad, tok)
    with pytest.raises(ConfigError, match="does not render"):  # (before the model loads)
        build_server(sol, chat_template="{{ messages[0].content | nosuchfilter }}")
    server = live.state.server  # the live server's tokenizer given the template, as build_server gives it
    saved = server.llm.tokenizer.chat_template, server.encode_tokenizer.chat_template
    server.llm.tokenizer.chat_template = server.encode_tokenizer.chat_template = TEMPLATE
    try:
        r = httpx.post(live.state.base + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                       json={"messages": MSGS, "chat_template_kwargs": {"think": True}}).json()
        assert r["tokens"] == _chat_ids(server, "[user]Who is there?[/][assistant]Nay, answer me[/][assistant]<think>")
        r = httpx.post(live.state.base + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "sol-test", "messages": MSGS, "max_tokens": 2, "add_generation_prompt": False,
                             "continue_final_message": True})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
            _chat_ids(server, "[user]Who is there?[/][assistant]Nay, answer me"))
        r = httpx.post(live.state.base + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "sol-test", "messages": MSGS, "max_tokens": 2, "continue_final_message": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
        r = httpx.post(live.state.base + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                       json={"messages": [], "continue_final_message": True, "add_generation_prompt": False})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    finally:
        server.llm.tokenizer.chat_template, server.encode_tokenizer.chat_template = saved


def test_named_templates_of_tokenizer_config(sol, tmp_path):
    """A tokenizer_config.json that lists named chat templates (as Hermes 2 Pro's and Command R's do): "tool_use"
    renders a request with tools, "default" one without (they were refused: the template came as a dict)."""
    import json
    import shutil

    from waferline.model.load import load_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(sol / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": TEMPLATE},
                               {"name": "tool_use", "template": "[tools {{ tools | length }}]" + TEMPLATE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok.chat_template, dict)
    tool = {"type": "function", "function": {"name": "f"}}
    assert render(tok, tok.chat_template, _req()) == "[user]Who is there?[/][assistant]Nay, answer me[/][assistant]"
    assert render(tok, tok.chat_template, _req(tools=[tool])).startswith("[tools 1][user]Who is there?")
    with pytest.raises(APIError, match="default"):
        render(tok, {"tool_use": TEMPLATE}, _req())


def test_call_arguments_nested_too_deeply_reach_the_template_as_text():
    """An earlier call's arguments that nest deeper than Python decodes reach the template as the text sent, as ones
    that are not JSON do (they raised RecursionError: a 500)."""
    for args in ("[" * 100000, "[" * 5000 + "]" * 5000, "not json"):
        msgs = MSGS[:1] + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]}]
        assert template_messages(_req(messages=msgs))[1]["tool_calls"][0]["function"]["arguments"] == args
    msgs[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Oslo"}'
    assert template_messages(_req(messages=msgs))[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


# (Llama 4's and Gemma 3's way: a string content as it is, content parts one by one)
PARTS_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{% if m.content is string %}{{ m.content }}{% else %}"
                  "{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
                  "{% endfor %}{% endif %}[/]{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def test_a_template_that_reads_content_parts_gets_them(sol):
    """A template that loops over a message's content parts (as Llama 4's and Gemma 3's do) gets them as sent, as
    transformers' apply_chat_template and vLLM give them; a template that takes a string gets their texts as lines
    (the parts reached every template joined by newlines: Llama 4's prompt had a line break its own rendering does
    not, and a template that reads parts alone lost the message)."""
    from waferline.model.load import load_tokenizer

    tok = load_tokenizer(sol)
    parts = [{"type": "text", "text": "Who is "}, {"type": "text", "text": " there?"}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    want = tok.apply_chat_template(msgs, chat_template=PARTS_TEMPLATE, add_generation_prompt=True, tokenize=False)
    assert want == "[system]Be brief.[/][user]Who isthere?[/][assistant]"
    assert render(tok, PARTS_TEMPLATE, _req(messages=msgs)) == want
    only_parts = "{% for m in messages %}{% for p in m.content %}{{ p.text }}|{% endfor %}{% endfor %}"
    assert render(tok, only_parts, _req(messages=msgs[1:])) == "Who is | there?|"
    assert render(tok, TEMPLATE, _req(messages=msgs[1:])) == "[user]Who is \n there?[/][assistant]"  # (lines)
    # a loop over something made of the content (its lines) reads a string, not parts
    lines = "{% for m in messages %}{% for l in m['content'].split('\n') %}{{ l }}|{% endfor %}{% endfor %}"
    assert render(tok, lines, _req(messages=msgs[1:])) == "Who is | there?|"
