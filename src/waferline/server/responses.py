"""OpenAI's Responses API (``POST /v1/responses``, as vLLM and SGLang serve it) on the chat path: a request becomes a
chat request (``instructions`` a system message first, ``input`` the messages, ``max_output_tokens`` its
``max_completion_tokens``, ``text.format`` its structured output), checked and run as one chat choice by the same
code (app.py's ``_respond``); its answer is a ``response`` object, or the Responses API's typed SSE events.

What this server cannot do is refused (400), not ignored: tools, stored state (``previous_response_id``,
``conversation``, ``store: true``), ``background``, reasoning options, image / file / audio inputs, items other than
messages, several answers (``n``)."""

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
from waferline.server.state import UNSUPPORTED_EXTENSIONS

# vLLM's sampling extensions a Responses request may send too (extra_body=), checked by the chat request's own fields
# (those this server does not do are passed on to be refused as chat refuses them)
PASSED_ON = ("top_k", "min_p", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "logit_bias", "skip_special_tokens", "chat_template_kwargs",
             *UNSUPPORTED_EXTENSIONS)
# (request field: what a value other than the accepted ones is refused with)
REFUSED = {
    "tools": "tools (function calling and built-in tools) are not supported by this server's Responses API; use "
             "/v1/chat/completions for function calling",
    "previous_response_id": "previous_response_id is not supported: responses are not stored; send the conversation "
                            "in input",
    "conversation": "conversation is not supported: responses are not stored; send the conversation in input",
    "store": "store: true is not supported: responses are not stored (send store: false, or leave it out)",
    "background": "background responses are not supported",
    "reasoning": "reasoning options are not supported",
    "include": "include is not supported (no extra output data)",
    "top_logprobs": "top_logprobs is not supported on /v1/responses (chat completions give log-probabilities)",
    "prompt": "prompt (stored prompt templates) is not supported: send instructions and input",
    "truncation": "truncation \"auto\" is not supported: a conversation longer than the context is a 400",
    "max_tool_calls": "max_tool_calls is not supported: this server's Responses API takes no tools",
    "context_management": "context_management is not supported",
    "n": "n is not supported: a response holds one answer (send several requests, or use n on /v1/chat/completions)",
    "max_tokens": "max_tokens is not a Responses API field: send max_output_tokens",
    "messages": "messages is not a Responses API field: send the conversation as input",
    "response_format": "response_format is not a Responses API field: send text.format",
}
# (a value of another type is refused too: 0 is not false, nor 1.0 or true a count of 1)
_ACCEPTED: dict[str, tuple[Any, ...]] = {"store": (None, False), "background": (None, False), "truncation":
                                         (None, "disabled"), "n": (None, 1), "tools": (None, []), "include": (None, []),
                                         "top_logprobs": (None, 0)}
_PART_KINDS = {"input_image": "image inputs", "input_file": "file inputs", "input_audio": "audio inputs",
               "refusal": "refusal parts"}
# the chat request's names -> the Responses API's (in error messages and their param)
_NAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"), ("messages", "input"))
_FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # (OpenAI's rule for text.format's name)


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
    tool_choice: Any = None  # ("none" or "auto" only: no tools)
    parallel_tool_calls: bool | None = None
    # parsed only to be refused where given (REFUSED)
    tools: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    store: Any = None
    background: Any = None
    reasoning: Any = None
    include: Any = None
    top_logprobs: Any = None
    prompt: Any = None
    truncation: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    n: Any = None
    max_tokens: Any = None
    messages: Any = None
    response_format: Any = None


def chat_request(req: ResponsesRequest) -> ChatRequest:
    """The chat request a Responses request runs as (blocking for a long input: the route calls it in a thread), or a
    400 naming the field this server does not do."""
    for name, why in REFUSED.items():
        v = getattr(req, name)
        if not any(v is a or (type(v) is type(a) and v == a) for a in _ACCEPTED.get(name, (None,))):
            raise APIError(why, param=name)
    if req.tool_choice not in (None, "none", "auto"):
        raise APIError("tool_choice: this server's Responses API takes no tools (\"none\" or \"auto\" only)",
                       param="tool_choice")
    if req.text is not None and req.text.verbosity is not None:
        raise APIError("text.verbosity is not supported", param="text")
    if req.metadata is not None and (len(req.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in
                                                                   req.metadata.items())):
        raise APIError("metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512",
                       param="metadata")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) + \
        _messages(req.input)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream)}
    for ours, theirs in (("max_completion_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("seed", "seed"), ("user", "user")):
        if getattr(req, theirs) is not None:
            body[ours] = getattr(req, theirs)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        body["response_format"] = _response_format(fmt)
    body.update({k: v for k, v in (req.model_extra or {}).items() if k in PASSED_ON})
    try:
        return parse(ChatRequest, body)
    except APIError as e:  # (the chat request's field names, in the Responses API's)
        raise in_responses_terms(e) from None


def _messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message; a list holds message items (as sent, or an earlier
    response's output sent back), whose content is a string or text parts."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise APIError("input: give a string or at least one message", param="input")
    out = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind != "message":
            raise APIError(f"input[{i}]: items of type {str(kind)[:40]!r} are not supported (only messages: no tools "
                           "or stored items)", param="input")
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(f"input[{i}].role must be \"user\", \"assistant\", \"system\" or \"developer\", got "
                           f"{str(role)[:40]!r}", param="input")
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                t = p.get("type") if isinstance(p, dict) else None
                if isinstance(t, str) and t in _PART_KINDS:
                    raise APIError(f"input[{i}].content[{j}]: {_PART_KINDS[t]} are not supported (this server reads "
                                   "text)", param="input")
                if t not in ("input_text", "output_text") or not isinstance(p.get("text"), str):
                    raise APIError(f"input[{i}].content[{j}]: give {{\"type\": \"input_text\", \"text\": ...}}",
                                   param="input")
                parts.append({"type": "text", "text": p["text"]})
            content = parts
        elif not isinstance(content, str):
            raise APIError(f"input[{i}].content: give a string or a list of input_text parts", param="input")
        out.append({"role": role, "content": content})
    return out


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

    def __init__(self, req: ResponsesRequest, model: str):
        self.req, self.model = req, model
        self.id = "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())

    def response(self, status: str, text: str | None = None, usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``response`` object; ``text``: the message (None: no output yet)."""
        r, done = self.req, status in ("completed", "incomplete")
        fmt = r.text.format if r.text is not None and r.text.format is not None else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "model": self.model,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": [] if text is None else [self.item(status if done else "in_progress", text)],
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p, "metadata": r.metadata or {}, "user": r.user,
            "text": {"format": fmt}, "tools": [], "tool_choice": r.tool_choice or "auto",
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "store": False, "background": False, "truncation": "disabled",
            "usage": None if usage is None else _usage(usage),
        }

    def item(self, status: str, text: str | None) -> dict[str, Any]:
        return {"type": "message", "id": self.item_id, "role": "assistant", "status": status,
                "content": [] if text is None else [_part(text)]}

    def body(self, choices: Choices) -> dict[str, Any]:
        """The whole answer, once the choice has finished well."""
        out, usage = choices.body()
        status = "incomplete" if out[0]["finish_reason"] == "length" else "completed"
        return self.response(status, out[0]["message"]["content"], usage)

    async def stream(self, events: AsyncIterator[tuple[int, Event, float]], choices: Choices) -> AsyncIterator[str]:
        """SSE: ``response.created``, ``response.in_progress``, the message and its text part added, a
        ``response.output_text.delta`` per piece of text, the text, part and message done, then
        ``response.completed`` (``response.incomplete`` where the token limit stopped it); an error ends it with an
        ``error`` event and ``response.failed``."""
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            data = {"type": kind, **fields, "sequence_number": seq}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        at = {"item_id": self.item_id, "output_index": 0}
        pieces: list[str] = []
        reason = None
        yield event("response.created", response=self.response("in_progress"))
        yield event("response.in_progress", response=self.response("in_progress"))
        yield event("response.output_item.added", output_index=0, item=self.item("in_progress", None))
        yield event("response.content_part.added", **at, content_index=0, part=_part(""))
        async for i, ev, _ in events:
            if ev.finished and ev.finish_reason == "error":
                message = ev.error or "engine error"
                yield event("error", code="invalid_request_error" if ev.invalid else "server_error", message=message,
                            param=None)
                yield event("response.failed", response=self.response(
                    "failed", error={"code": "invalid_prompt" if ev.invalid else "server_error", "message": message}))
                return
            for c in choices.chunks(i, ev):
                if c["delta"].get("content"):
                    pieces.append(c["delta"]["content"])
                    yield event("response.output_text.delta", **at, content_index=0, delta=pieces[-1], logprobs=[])
                reason = c["finish_reason"] or reason
            await asyncio.sleep(0)  # (as chat's stream: lets the event loop see a client that went away)
        text = "".join(pieces)
        status = "incomplete" if reason == "length" else "completed"
        yield event("response.output_text.done", **at, content_index=0, text=text, logprobs=[])
        yield event("response.content_part.done", **at, content_index=0, part=_part(text))
        yield event("response.output_item.done", output_index=0, item=self.item(status, text))
        yield event(f"response.{status}", response=self.response(status, text, choices.usage()))


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(u: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage in the Responses API's terms (no reasoning tokens; prompt caching is the prefix cache's, which
    writes no tokens of its own)."""
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}
