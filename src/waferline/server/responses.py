"""OpenAI's Responses API (``POST /v1/responses``, as vLLM and SGLang serve it) on the chat path: a request becomes a
chat request (``instructions`` a system message first, ``input`` the messages, ``max_output_tokens`` its
``max_completion_tokens``, ``text.format`` its structured output), checked and run as one chat choice by the same
code (app.py's ``_respond``); its answer is a ``response`` object, or the Responses API's typed SSE events.

Function tools and ``tool_choice`` are chat's (responses_tools.py maps them): each call the chat path reads is a
``function_call`` output item after the message (no message where the answer is only calls), and ``function_call`` /
``function_call_output`` input items send a conversation's calls and their results back. Log-probabilities
(``include: ["message.output_text.logprobs"]``, or ``top_logprobs`` of 1 or more) are chat's: each token's on the
``output_text`` part (with calls, those of the text before them), streamed with the text deltas that carry it.

Responses are stored (responses_store.py; ``store`` left out means true, as OpenAI's API has it, where the server
stores any: ``serve --responses-store N``, default 1024, 0 none): the finished response object with the input items
the model saw. As OpenAI keeps a response that failed (status ``failed``, readable by its id), a stream is kept with
the status it ends with, before its last event (``response.completed``, ``response.incomplete`` or
``response.failed``) goes out, so a client that has read it can continue at once; a non-streamed response is kept as
answered. Not kept: a request refused or failed before an answer with an id (an HTTP error), and a stream whose client
left before its end (its sequence is aborted: it never finished, and there is no client to read it back).
``previous_response_id`` continues a stored response: the request runs on that response's input and output items,
then its own ``input``, under its own ``instructions`` only (a ``function_call_output`` may answer a call of any
response of the chain). The response says ``store`` and ``previous_response_id`` as they were taken.

What this server cannot do is refused (400), not ignored: built-in tools, conversations (``conversation``),
``store: true`` and ``previous_response_id`` where it stores no responses, ``background``, reasoning options, image /
file / audio inputs, items other than messages and function calls, other ``include`` data, several answers
(``n``)."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from waferline.engine.sequence import Event
from waferline.server.choices import Choices
from waferline.server.protocol import APIError, ChatRequest, _Strict, parse
from waferline.server.responses_store import ResponseStore, Stored, with_ids
from waferline.server.responses_tools import (
    call_item,
    call_message,
    chat_tool_choice,
    chat_tools,
    echoed_tools,
    output_message,
)
from waferline.server.state import UNSUPPORTED_EXTENSIONS

# vLLM's sampling extensions a Responses request may send too (extra_body=), checked by the chat request's own fields
# (those this server does not do are passed on to be refused as chat refuses them)
PASSED_ON = ("top_k", "min_p", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "logit_bias", "skip_special_tokens", "chat_template_kwargs",
             *UNSUPPORTED_EXTENSIONS)
# (request field: what a value other than the accepted ones is refused with)
REFUSED = {
    "previous_response_id": "previous_response_id is not supported: this server stores no responses (serve "
                            "--responses-store 0); send the conversation in input",
    "conversation": "conversation (the Conversations API) is not supported: send the conversation in input, or "
                    "continue a stored response with previous_response_id",
    "store": "store: true is not supported: this server stores no responses (serve --responses-store 0); send store: "
             "false, or leave it out",
    "background": "background responses are not supported",
    "reasoning": "reasoning options are not supported",
    "prompt": "prompt (stored prompt templates) is not supported: send instructions and input",
    "truncation": "truncation \"auto\" is not supported: a conversation longer than the context is a 400",
    "max_tool_calls": "max_tool_calls is not supported (it limits built-in tools' calls, which this server does not "
                      "run; parallel_tool_calls: false gives at most one function call)",
    "context_management": "context_management is not supported",
    "n": "n is not supported: a response holds one answer (send several requests, or use n on /v1/chat/completions)",
    "max_tokens": "max_tokens is not a Responses API field: send max_output_tokens",
    "messages": "messages is not a Responses API field: send the conversation as input",
    "response_format": "response_format is not a Responses API field: send text.format",
}
# (a value of another type is refused too: 0 is not false, nor 1.0 or true a count of 1)
_ACCEPTED: dict[str, tuple[Any, ...]] = {"store": (None, False), "background": (None, False), "truncation":
                                         (None, "disabled"), "n": (None, 1)}
_STORED = {"store": (None, False, True), "previous_response_id": None}  # (accepted where responses are stored: None,
# any value, checked below)
_PART_KINDS = {"input_image": "image inputs", "input_file": "file inputs", "input_audio": "audio inputs",
               "refusal": "refusal parts"}
# the chat request's names -> the Responses API's (in error messages and their param)
_NAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"), ("messages", "input"))
_FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # (OpenAI's rule for text.format's name)
LOGPROBS = "message.output_text.logprobs"  # (the one include value this server gives)


class TextConfig(_Strict):
    format: dict[str, Any] | None = None  # {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", ...}
    verbosity: Any = None  # (refused)


class ResponsesRequest(_Strict):
    """A ``POST /v1/responses`` body. Fields this class does not name are ignored, as chat ignores them, except the
    sampling extensions in ``PASSED_ON``, kept (``model_extra``) for the chat request."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    model: str
    input: str | Annotated[list[dict[str, Any]], Field(fail_fast=True)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    text: TextConfig | None = None
    seed: int | None = None  # (an extension, as the chat path takes it)
    metadata: dict[str, str] | None = None  # echoed
    user: str | None = None
    tools: Any = None  # function tools (responses_tools.py)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    include: Any = None  # ([LOGPROBS] only)
    top_logprobs: int | None = None
    # stored responses (responses_store.py), refused where the server stores none (REFUSED)
    previous_response_id: Any = None
    store: Any = None
    # parsed only to be refused where given (REFUSED)
    conversation: Any = None
    background: Any = None
    reasoning: Any = None
    prompt: Any = None
    truncation: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    n: Any = None
    max_tokens: Any = None
    messages: Any = None
    response_format: Any = None


def chat_request(req: ResponsesRequest, store: ResponseStore | None = None
                 ) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """The chat request a Responses request runs as (blocking for a long input: the route calls it in a thread), or a
    400 naming the field this server does not do; and the input items the model sees, each with an id (those of the
    response ``previous_response_id`` names, then ``input``'s: what its stored response keeps; none where ``store``
    is None or off)."""
    on = store is not None and store.on
    for name, why in REFUSED.items():
        v = getattr(req, name)
        accepted = _STORED[name] if on and name in _STORED else _ACCEPTED.get(name, (None,))
        if accepted is not None and not any(v is a or (type(v) is type(a) and v == a) for a in accepted):
            raise APIError(f"store: give true or false, got {str(v)[:40]!r}" if on and name in _STORED else why,
                           param=name)
    earlier: list[dict[str, Any]] = []
    if store is not None and on and req.previous_response_id is not None:
        earlier = store.previous(req.previous_response_id).conversation()
    tools = chat_tools(req.tools)
    tool_choice = chat_tool_choice(req.tool_choice, bool(tools))
    if req.text is not None and req.text.verbosity is not None:
        raise APIError("text.verbosity is not supported", param="text")
    if req.metadata is not None and (len(req.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in
                                                                   req.metadata.items())):
        raise APIError("metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512",
                       param="metadata")
    own = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) + \
        _messages(own, earlier)
    items = earlier + with_ids(own, earlier) if on else []
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream)}
    if tools:
        body["tools"] = tools
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if wants_logprobs(req):
        body |= {"logprobs": True} | ({} if req.top_logprobs is None else {"top_logprobs": req.top_logprobs})
    for ours, theirs in (("max_completion_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("seed", "seed"), ("user", "user"),
                         ("parallel_tool_calls", "parallel_tool_calls")):
        if getattr(req, theirs) is not None:
            body[ours] = getattr(req, theirs)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        body["response_format"] = _response_format(fmt)
    body.update({k: v for k, v in (req.model_extra or {}).items() if k in PASSED_ON})
    try:
        return parse(ChatRequest, body), items
    except APIError as e:  # (the chat request's field names, in the Responses API's; a flat tool's fields)
        e = in_responses_terms(e)
        raise APIError(re.sub(r"\btools\.(\d+)\.function\.", r"tools.\1.", str(e)), e.status, e.type, e.param,
                       e.code, e.headers) from None


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether the answer carries log-probabilities (``include`` asks for them, or ``top_logprobs`` of 1 or more),
    or a 400 naming an ``include`` value this server does not give."""
    include = req.include
    if include is not None and (not isinstance(include, list) or not all(isinstance(v, str) for v in include)):
        raise APIError(f"include: give a list of strings, got {str(include)[:40]!r}", param="include")
    for v in include or []:
        if v != LOGPROBS:
            raise APIError(f"include: {v[:60]!r} is not supported (only {LOGPROBS!r})", param="include")
    return LOGPROBS in (include or []) or bool(req.top_logprobs)


def _messages(value: list[dict[str, Any]], earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input``'s items as chat messages, after ``earlier``'s (a stored conversation, checked when it was sent):
    message items (as sent, or an earlier response's output sent back), whose content is a string or text parts, and
    function calls and their outputs."""
    if not value:
        raise APIError("input: give a string or at least one message", param="input")
    out: list[dict[str, Any]] = []
    called: set[str] = set()  # (the call ids of the function_call items so far: each output answers one)
    for i, item in enumerate([*earlier, *value], -len(earlier)):  # (input[i]: i from 0 at input's first)
        kind = item.get("type", "message")
        if kind == "function_call":
            call_message(item, i, out)
            called.add(item["call_id"])
            continue
        if kind == "function_call_output":
            out.append(output_message(item, i, _parts, called))
            continue
        if kind != "message":
            raise APIError(f"input[{i}]: items of type {str(kind)[:40]!r} are not supported (only messages, function "
                           "calls and their outputs: no built-in tools or stored items)", param="input")
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(f"input[{i}].role must be \"user\", \"assistant\", \"system\" or \"developer\", got "
                           f"{str(role)[:40]!r}", param="input")
        content = item.get("content")
        if isinstance(content, list):
            content = _parts(content, f"input[{i}].content")
        elif not isinstance(content, str):
            raise APIError(f"input[{i}].content: give a string or a list of input_text parts", param="input")
        out.append({"role": role, "content": content})
    return out


def _parts(content: list[Any], at: str) -> list[dict[str, Any]]:
    """Text parts (``input_text``, ``output_text``) as chat's; ``at``: where they are, in errors."""
    parts = []
    for j, p in enumerate(content):
        t = p.get("type") if isinstance(p, dict) else None
        if isinstance(t, str) and t in _PART_KINDS:
            raise APIError(f"{at}[{j}]: {_PART_KINDS[t]} are not supported (this server reads text)", param="input")
        if t not in ("input_text", "output_text") or not isinstance(p.get("text"), str):
            raise APIError(f"{at}[{j}]: give {{\"type\": \"input_text\", \"text\": ...}}", param="input")
        parts.append({"type": "text", "text": p["text"]})
    return parts


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """``text.format`` as chat's ``response_format``."""
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError("text.format json_schema: give {\"type\": \"json_schema\", \"name\": ..., \"schema\": "
                           "{...}}", param="text.format")
        # (as OpenAI's API checks them: the response echoes text.format, which its clients read as typed)
        name = fmt.get("name")
        if not isinstance(name, str) or not _FORMAT_NAME.fullmatch(name):
            raise APIError("text.format json_schema: name is required, 1 to 64 letters, digits, '_' or '-', got "
                           f"{str(name)[:80]!r}", param="text.format")
        for key, kinds, what in (("strict", bool, "a boolean"), ("description", str, "a string")):
            if fmt.get(key) is not None and not isinstance(fmt[key], kinds):
                raise APIError(f"text.format json_schema: {key} must be {what}, got {str(fmt[key])[:80]!r}",
                               param="text.format")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise APIError(f"text.format: the type is \"text\", \"json_object\" or \"json_schema\", got {str(fmt)[:80]}",
                   param="text.format")


def in_responses_terms(e: APIError) -> APIError:
    """A chat-path error with the Responses API's field names (``max_output_tokens``, ``text.format``, ``input``): only
    the chat request's (the Responses request's own errors, which may quote what the client sent, are as raised)."""
    message, param = str(e), e.param
    for ours, theirs in _NAMES:
        message = message.replace(ours, theirs)
        if param == ours:
            param = theirs
    if (message, param) == (str(e), e.param):
        return e
    return APIError(message, e.status, e.type, param, e.code, e.headers)


class Shape:
    """The answer of one Responses request: its ``response`` object (``body``) or SSE events (``stream``), from the
    chat choice's events."""

    def __init__(self, req: ResponsesRequest, model: str, items: list[dict[str, Any]] | None = None,
                 store: ResponseStore | None = None):
        """``items``: the input items the model sees, kept with the finished response in ``store`` (None or off: not
        kept; nor where the request says ``store: false``)."""
        self.req, self.model, self.items = req, model, items or []
        self.store = store if store is not None and store.on and req.store is not False else None
        self.id = "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]] | None = None, usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``response`` object; ``output``: its items (None: none yet)."""
        r = self.req
        fmt = r.text.format if r.text is not None and r.text.format is not None else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "model": self.model,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": output or [],
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p, "metadata": r.metadata or {}, "user": r.user,
            "text": {"format": fmt}, "tools": echoed_tools(r.tools), "tool_choice": r.tool_choice or "auto",
            "parallel_tool_calls": r.parallel_tool_calls is not False, "max_tool_calls": None,
            "top_logprobs": r.top_logprobs, "previous_response_id": r.previous_response_id, "reasoning": None,
            "store": self.store is not None,
            "background": False, "truncation": "disabled", "usage": None if usage is None else _usage(usage),
        }

    def message(self, status: str, text: str | None, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The assistant message item (``text`` None: its part not added yet)."""
        return {"type": "message", "id": self.item_id, "role": "assistant", "status": status,
                "content": [] if text is None else [_part(text, logprobs)]}

    def body(self, choices: Choices) -> dict[str, Any]:
        """The whole answer, once the choice has finished well: the message (none where the answer is only calls),
        then a ``function_call`` item per call."""
        out, usage = choices.body()
        choice = out[0]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        content, calls = choice["message"]["content"], choice["message"].get("tool_calls") or []
        lps = None
        if choice["logprobs"] is not None:
            lps = [_entry(e) for e in choice["logprobs"]["content"]]
            if calls:  # (the text's tokens: those that start before the first call)
                lps = [e for e, at in zip(lps, choices.items[0].starts) if at < len(content or "")]
        items = [self.message(status, content or "", lps)] if content or not calls else []
        return self.kept(self.response(status, items + [call_item(c) for c in calls], usage))

    def kept(self, response: dict[str, Any]) -> dict[str, Any]:
        """The finished ``response``, stored where the request is."""
        if self.store is not None:
            self.store.put(Stored(response, self.items))
        return response

    async def stream(self, events: AsyncIterator[tuple[int, Event, float]], choices: Choices) -> AsyncIterator[str]:
        """SSE: ``response.created``, ``response.in_progress``; at the first text the message and its text part
        added, then a ``response.output_text.delta`` per piece of text (with its tokens' log-probabilities where
        asked); at the end the text, part and message done (an empty message where there is no text and no call),
        each function call's item added, its arguments (one delta) and the item done; then ``response.completed``
        (``response.incomplete`` where the token limit stopped it). An error ends it with an ``error`` event and
        ``response.failed``."""
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            data = {"type": kind, **fields, "sequence_number": seq}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        def opening() -> list[str]:
            return [event("response.output_item.added", output_index=0, item=self.message("in_progress", None)),
                    event("response.content_part.added", **at, content_index=0, part=_part(""))]

        at = {"item_id": self.item_id, "output_index": 0}
        pieces: list[str] = []
        lps: list[dict[str, Any]] = []  # (the text's tokens': sent with their text)
        pending: list[dict[str, Any]] = []  # (tokens whose text has not gone out: held back, or a call's)
        calls: list[dict[str, Any]] = []
        opened, reason = False, None
        yield event("response.created", response=self.response("in_progress"))
        yield event("response.in_progress", response=self.response("in_progress"))
        async for i, ev, _ in events:
            if ev.finished and ev.finish_reason == "error":
                message = ev.error or "engine error"
                yield event("error", code="invalid_request_error" if ev.invalid else "server_error", message=message,
                            param=None)
                yield event("response.failed", response=self.kept(self.response(
                    "failed", error={"code": "invalid_prompt" if ev.invalid else "server_error", "message": message})))
                return
            for c in choices.chunks(i, ev):
                if c["logprobs"] is not None:
                    pending += [_entry(e) for e in c["logprobs"]["content"]]
                text = c["delta"].get("content")
                if text:
                    if not opened:
                        opened = True
                        for s in opening():
                            yield s
                    pieces.append(text)
                    lps += pending
                    yield event("response.output_text.delta", **at, content_index=0, delta=text,
                                logprobs=[_streamed(e) for e in pending])
                    pending = []
                calls += c["delta"].get("tool_calls") or []
                reason = c["finish_reason"] or reason
            await asyncio.sleep(0)  # (as chat's stream: lets the event loop see a client that went away)
        status = "incomplete" if reason == "length" else "completed"
        output: list[dict[str, Any]] = []
        if opened or not calls:
            if not opened:
                for s in opening():
                    yield s
            text = "".join(pieces)
            if calls:  # (the text's tokens, as the body's: those that start before the first call; a stop string
                # holds the text back, so the tokens of a call's opening tag may have come with it)
                lps = [e for e, start in zip(lps + pending, choices.items[0].starts) if start < len(text)]
            else:
                lps += pending  # (tokens of text held back and dropped, as a stop string's)
            yield event("response.output_text.done", **at, content_index=0, text=text,
                        logprobs=[_streamed(e) for e in lps])
            yield event("response.content_part.done", **at, content_index=0, part=_part(text, lps))
            output.append(self.message(status, text, lps))
            yield event("response.output_item.done", output_index=0, item=output[-1])
        for call in calls:
            item, k = call_item(call), len(output)
            yield event("response.output_item.added", output_index=k,
                        item=item | {"arguments": "", "status": "in_progress"})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                        arguments=item["arguments"])
            output.append(item)
            yield event("response.output_item.done", output_index=k, item=item)
        yield event(f"response.{status}", response=self.kept(self.response(status, output, choices.usage())))


def _part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _entry(e: dict[str, Any]) -> dict[str, Any]:
    """A chat logprobs entry as the output_text part's (its bytes a list: [] where chat's are null)."""
    return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"] or [],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"] or []}
                             for t in e["top_logprobs"]]}


def _streamed(e: dict[str, Any]) -> dict[str, Any]:
    """A part's logprobs entry as a text delta's (no bytes, as the Responses API's events give them)."""
    return {"token": e["token"], "logprob": e["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}


def _usage(u: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage in the Responses API's terms (no reasoning tokens; prompt caching is the prefix cache's, which
    writes no tokens of its own)."""
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}
