"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, SSE streaming, models, health, metrics.

Every request goes to one ``EngineLoop`` (continuous batching in a background thread); tokens come back through
a per-request asyncio queue. A client that disconnects has its sequence aborted, which frees its slot and pages.

A bad request fails alone: bodies are read under a deadline (408) and a size limit (413), parsed as strict JSON
(400), and tokenized in a worker thread, so neither a slow upload nor a huge prompt holds up the event loop that
streams everyone else's tokens. The request checks and the ``Server`` state are in state.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from waferline.engine.sampling import SamplingParams, TokenLogprobs
from waferline.engine.scheduler import Event
from waferline.server.logprobs import TokenTexts, chat_entry, completion_logprobs, echoed
from waferline.server.metrics import DISCONNECTED
from waferline.server.protocol import APIError, ChatRequest, CompletionRequest, error_body, parse
from waferline.server.state import FALLBACK_CHAT_TEMPLATE, FALLBACK_GENERATION_PROMPT, Server

__all__ = ["Server", "create_app", "FALLBACK_CHAT_TEMPLATE", "FALLBACK_GENERATION_PROMPT"]


async def _until_disconnected(request: Request) -> None:
    """Return when the client goes away (the body has been read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(ev: Event) -> dict[str, int]:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="waferline", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    m = server.metrics

    def fail(endpoint: str, e: APIError) -> JSONResponse:
        m.requests.labels(endpoint, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", kind), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # (the traceback goes to the server log; the client learns only that the server failed)
        return JSONResponse(error_body("internal server error (details are in the server log)", "server_error"), 500)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        try:
            server.check_host(request)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        engine = server.engine
        ok = engine.healthy
        body = {"status": "ok" if ok else "unhealthy", "model": server.model_name, "running": engine.num_running,
                "waiting": engine.num_waiting, "last_engine_error": engine.last_error,
                "recoveries": engine.recoveries}
        if not ok:
            body["reason"] = engine.unavailable_reason()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        try:
            server.check_host(request)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return PlainTextResponse(m.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            server.check_host(request)
            server.check_auth(request)
        except APIError as e:
            return fail("models", e)
        m.requests.labels("models", "200").inc()
        return JSONResponse({"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "waferline",
            "max_model_len": server.engine.scheduler.max_model_len}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            server.check_host(request)
            server.check_auth(request)
            server.check_json_type(request)
            req = parse(CompletionRequest, await server.json_body(request))
            server.check_model(req.model)
            server.check_options(req)
            ids = await _completion_prompt(server, req.prompt)
            params = server.sampling(req, len(ids), 16)
            return await _respond(server, request, "completions", req, ids, params)
        except APIError as e:
            return fail("completions", e)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        try:
            server.check_host(request)
            server.check_auth(request)
            server.check_json_type(request)
            req = parse(ChatRequest, await server.json_body(request))
            server.check_model(req.model)
            server.check_options(req)
            ids = await asyncio.to_thread(server.chat_prompt, req)  # off the event loop: it streams everyone's tokens
            params = server.sampling(req, len(ids), None)
            return await _respond(server, request, "chat", req, ids, params)
        except APIError as e:
            return fail("chat", e)

    return app


async def _completion_prompt(server: Server, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(
                f"batched prompts ({len(prompt)}) are not supported: send one prompt per request", param="prompt"
            )
        prompt = prompt[0]
    # (tokenizing a long prompt takes a while: off the event loop, which streams everyone's tokens)
    ids = await asyncio.to_thread(server.encode, prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise APIError("the prompt is empty: give at least one token", param="prompt")
    vocab = server.engine.scheduler.spec.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}", param="prompt")
    return ids


async def _respond(server: Server, request: Request, endpoint: str, req: Any, ids: list[int],
                   params: SamplingParams) -> Response:
    chat = endpoint == "chat"
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    m = server.metrics
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": server.model_name}
    echo = None if chat or not req.echo else _Echo(_echo_text(server, req.prompt, ids), ids, req.max_tokens == 0)
    events = server.start(ids, params, rid)  # a full queue or a bad request is an HTTP error, not a broken stream
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        m.requests.labels(endpoint, "200").inc()
        lp = server.token_texts if params.logprobs is not None else None
        return StreamingResponse(_stream(events, base, chat, include_usage, req.return_token_ids, lp, echo),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    text: list[str] = []
    toks: list[int] = []
    lps: list[TokenLogprobs] = []
    prompt_lps: list[TokenLogprobs] | None = None
    last: Event | None = None

    async def collect() -> None:
        nonlocal last, prompt_lps
        try:
            async for ev, _ in events:
                if ev.token_id is not None:
                    toks.append(ev.token_id)
                if ev.logprobs is not None:
                    lps.append(ev.logprobs)
                if ev.prompt_logprobs is not None:
                    prompt_lps = ev.prompt_logprobs
                text.append(ev.text)
                last = ev
        finally:
            await events.aclose()

    # wait for the result or the client's disconnect, whichever comes first (a client that gives up while its request
    # is queued is noticed at once, and its sequence is aborted before it takes a slot)
    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_until_disconnected(request))
    done: set[asyncio.Future] = set()
    try:
        done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collector, watcher):
            task.cancel()  # (a no-op for the one that finished; cancelling the collector aborts the request)
        await asyncio.gather(collector, watcher, return_exceptions=True)
    if collector not in done:
        raise APIError("the client disconnected before the response was ready", DISCONNECTED,
                       code="client_disconnected")
    if collector.exception() is not None:
        raise collector.exception()
    if last is None or not last.finished or last.finish_reason == "error":
        msg = last.error if last is not None and last.error else "the request did not finish"
        raise APIError(msg, 503 if last is not None and last.unavailable else 500, type="server_error")
    m.requests.labels(endpoint, "200").inc()
    usage, reason = _usage(last), last.finish_reason
    if echo is not None and echo.score_only:  # (the prompt scored alone: the one generated token is left out)
        text, toks, lps, reason = [], [], [], "length"
        usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": "".join(text)}
    else:
        choice["text"] = (echo.text if echo is not None else "") + "".join(text)
    if params.logprobs is not None:
        texts = server.token_texts
        choice["logprobs"] = ({"content": [chat_entry(lp, texts) for lp in lps]} if chat else completion_logprobs(
            (echoed(ids, prompt_lps) if echo is not None else []) + [(lp.token, lp) for lp in lps], texts))
    if req.return_token_ids:
        choice["token_ids"] = toks
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": server.model_name, "choices": [choice], "usage": usage}
    return JSONResponse(body)


@dataclass
class _Echo:
    """A completion that echoes its prompt: the prompt's text and tokens, and whether only the prompt is wanted
    (``max_tokens`` 0: scored, nothing generated)."""

    text: str
    ids: list[int]
    score_only: bool


def _echo_text(server: Server, prompt: Any, ids: list[int]) -> str:
    """The text an echoed prompt shows: as sent, or its token ids decoded."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else server.token_texts.text(ids)


async def _stream(events: AsyncIterator[tuple[Event, float]], base: dict[str, Any], chat: bool,
                  include_usage: bool, token_ids: bool, texts: TokenTexts | None,
                  echo: _Echo | None = None) -> AsyncIterator[str]:
    offset = 0  # (completions' text_offset of the next token)
    echo_sent = False

    def chunk(text: str | None, finish: str | None, tok: int | None = None, role: bool = False,
              lp: TokenLogprobs | None = None) -> dict[str, Any]:
        nonlocal offset
        c: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if lp is not None and texts is not None:
            if chat:
                c["logprobs"] = {"content": [chat_entry(lp, texts)]}
            else:
                c["logprobs"] = completion_logprobs([(lp.token, lp)], texts, offset)
                offset += len(c["logprobs"]["tokens"][0])
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            c["delta"] = delta
        else:
            c["text"] = text or ""
        if token_ids and tok is not None:
            c["token_ids"] = [tok]
        out = dict(base, choices=[c])
        if include_usage:
            out["usage"] = None
        return out

    try:
        if chat:
            yield _sse(chunk("", None, role=True))
        async for ev, _ in events:
            if ev.token_id is not None and echo is not None and not echo_sent:  # the prompt first, with the 1st token
                c = chunk(echo.text, None)
                if texts is not None:
                    c["choices"][0]["logprobs"] = completion_logprobs(echoed(echo.ids, ev.prompt_logprobs), texts)
                    offset = sum(len(t) for t in c["choices"][0]["logprobs"]["tokens"])
                yield _sse(c)
                echo_sent = True
            if ev.token_id is not None and not (echo is not None and echo.score_only):
                yield _sse(chunk(ev.text, None, ev.token_id, lp=ev.logprobs))
            if ev.finished:
                if ev.finish_reason == "error":
                    yield _sse(error_body(ev.error or "engine error", "server_error"))
                else:
                    usage, reason = _usage(ev), ev.finish_reason
                    if echo is not None and echo.score_only:
                        usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
                        reason = "length"
                    yield _sse(chunk(None if chat else "", reason))
                    if include_usage:
                        yield _sse(dict(base, choices=[], usage=usage))
                yield "data: [DONE]\n\n"
                return
    finally:
        await events.aclose()  # a disconnect cancels us here: closing the generator aborts the request
