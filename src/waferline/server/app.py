"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, responses (responses.py: run as a chat
completion; stored ones read back and deleted: responses_store.py), SSE streaming, models, health, metrics.

Every request goes to one ``EngineLoop`` (continuous batching in a background thread) as one sequence per choice (``n``
per prompt; a completion may send a batch of prompts); tokens come back through a per-request asyncio queue and are
gathered per choice (choices.py). A client that disconnects has its sequences aborted, which frees their slots and
pages.

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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from waferline.engine.scheduler import Event
from waferline.server.chat import FALLBACK_CHAT_TEMPLATE, FALLBACK_GENERATION_PROMPT
from waferline.server.choices import Choices
from waferline.server.metrics import DISCONNECTED
from waferline.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from waferline.server.responses import LOGPROBS, ResponsesRequest, Shape, chat_request, in_responses_terms
from waferline.server.responses_store import Stored, check_query, input_items
from waferline.server.state import Server, counted_stream
from waferline.server.tools import plan_of

__all__ = ["Server", "create_app", "FALLBACK_CHAT_TEMPLATE", "FALLBACK_GENERATION_PROMPT"]


async def _until_disconnected(request: Request) -> None:
    """Return when the client goes away (the body has been read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
        name = getattr(request.scope.get("route"), "name", None)  # (the endpoint's function: its metrics label)
        if name not in (None, "health", "metrics"):
            m.requests.labels("models" if name == "model" else name, "500").inc()
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
        return JSONResponse({"object": "list", "data": [model_card()]})

    def model_card() -> dict[str, Any]:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "waferline",
                "max_model_len": server.engine.scheduler.max_model_len}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        try:
            server.check_host(request)
            server.check_auth(request)
            server.check_model(model_id)
        except APIError as e:
            return fail("models", e)
        m.requests.labels("models", "200").inc()
        return JSONResponse(model_card())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            req = await server.request(request, TokenizeRequest, model_optional=True)
            if (req.prompt is None) == (req.messages is None):
                raise APIError("give a prompt or messages (one of them)", param="prompt")
            special = req.add_special_tokens is not False  # (a prompt: as the completions encode it; chat: off)
            ids = await asyncio.to_thread(server.encode, req.prompt, special) if req.prompt \
                is not None else await asyncio.to_thread(server.chat_prompt, req)
        except APIError as e:
            return fail("tokenize", e)
        m.requests.labels("tokenize", "200").inc()
        return JSONResponse({"count": len(ids), "max_model_len": server.engine.scheduler.max_model_len,
                             "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            req = await server.request(request, DetokenizeRequest, model_optional=True)
            text = await asyncio.to_thread(server.decode, req.tokens)
        except APIError as e:
            return fail("detokenize", e)
        m.requests.labels("detokenize", "200").inc()
        return JSONResponse({"prompt": text})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        try:
            server.check_host(request)
            server.check_auth(request)
            info = server.tokenizer_info()
        except APIError as e:
            return fail("tokenizer_info", e)
        m.requests.labels("tokenizer_info", "200").inc()
        return JSONResponse(info)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            req = await server.request(request, CompletionRequest)
            server.check_options(req)
            prompts, sent = await _completion_prompts(server, req.prompt, req.add_special_tokens, req.n or 1)
            return await _respond(server, request, "completions", req, prompts, 16, sent)
        except APIError as e:
            return fail("completions", e)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        try:
            req = await server.request(request, ChatRequest)
            server.check_options(req)
            ids = await asyncio.to_thread(server.chat_prompt, req)  # off the event loop: it streams everyone's tokens
            return await _respond(server, request, "chat", req, [ids], None)
        except APIError as e:
            return fail("chat", e)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        store = server.responses
        try:  # (errors in the Responses API's terms as raised; the chat path's below, with its field names)
            req = await server.request(request, ResponsesRequest)
            # (off the event loop, as chat's parse; the store is read under its lock)
            chat_req, items = await asyncio.to_thread(chat_request, req, store)
        except APIError as e:
            return fail("responses", e)
        try:
            server.check_options(chat_req)
            ids = await asyncio.to_thread(server.chat_prompt, chat_req)
            return await _respond(server, request, "responses", chat_req, [ids], None,
                                  shape=Shape(req, server.model_name, items, store))
        except APIError as e:
            return fail("responses", in_responses_terms(e))

    def stored(request: Request, response_id: str, stream: bool = False) -> Stored:
        """The checks of a read or delete of a stored response (host, key, query), and the response, or an APIError."""
        server.check_host(request)
        server.check_auth(request)
        check_query(request.query_params, LOGPROBS, stream)
        return server.responses.stored(response_id)

    # (name=: the metrics label of a request that fails unexpectedly, as the routes' own)
    @app.get("/v1/responses/{response_id}", name="responses")
    async def response_get(request: Request, response_id: str) -> JSONResponse:
        try:
            entry = stored(request, response_id, stream=True)
        except APIError as e:
            return fail("responses", e)
        m.requests.labels("responses", "200").inc()
        return JSONResponse(entry.response)

    @app.delete("/v1/responses/{response_id}", name="responses")
    async def response_delete(request: Request, response_id: str) -> JSONResponse:
        try:
            stored(request, response_id)
            server.responses.delete(response_id)
        except APIError as e:
            return fail("responses", e)
        m.requests.labels("responses", "200").inc()
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items", name="responses")
    async def response_input_items(request: Request, response_id: str) -> JSONResponse:
        try:
            page = input_items(stored(request, response_id), request.query_params)
        except APIError as e:
            return fail("responses", e)
        m.requests.labels("responses", "200").inc()
        return JSONResponse(page)

    return app


async def _completion_prompts(server: Server, prompt: Any, special: bool = True, n: int = 1
                              ) -> tuple[list[list[int]], list[str]]:
    """The prompts of a completion request (one, or a batch: a list of strings or of token-id lists) as token ids,
    and each one's text as an echo shows it (as sent, or its token ids decoded)."""
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    server.check_choice_count(len(batch), n)  # (before tokenizing a batch too large to run)
    out = []
    for p in batch:
        # (tokenizing a long prompt takes a while: off the event loop, which streams everyone's tokens)
        ids = await asyncio.to_thread(server.encode, p, special) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError("the prompt is empty: give at least one token", param="prompt")
        vocab = server.engine.scheduler.spec.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}", param="prompt")
        out.append(ids)
    return out, [p if isinstance(p, str) else "" for p in batch]


async def _respond(server: Server, request: Request, endpoint: str, req: Any, prompts: list[list[int]],
                   default_max: int | None, sent: list[str] | None = None, shape: Shape | None = None) -> Response:
    """Run the request's choices (each prompt ``n`` times) and answer: one JSON body, or an SSE stream; ``shape``: a
    Responses request's (``req`` its chat request), whose answer it writes."""
    chat = endpoint != "completions"
    rid = shape.id if shape is not None else ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    m = server.metrics
    # (off the event loop, which streams everyone's tokens: checking a structured output builds its grammar, which
    # can take a second)
    runs = await asyncio.to_thread(server.choices, req, prompts, default_max)
    n = req.n or 1
    echo = None
    if not chat and req.echo:  # (what each choice echoes: its prompt as sent, or decoded from its token ids)
        echo = [(sent or [""] * len(prompts))[i // n] or server.token_texts.text(ids) for i, (ids, _) in
                enumerate(runs)]
    score_only = bool(echo) and req.max_tokens == 0
    choices = Choices(chat, [ids for ids, _ in runs], n, echo, score_only,
                      server.token_texts if runs[0][1].logprobs is not None else None, req.return_token_ids,
                      plan_of(req, server.tool_call_parser) if chat else None)
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": server.model_name}
    events = server.start(runs, rid, score_only, n)  # a full queue, a bad request: an HTTP error, not a broken stream
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        counted = m.requests.labels  # (at the stream's end: 200, or 499 for a client gone mid-stream)

        sse = shape.stream(events, choices) if shape is not None else _stream(events, base, choices, include_usage)
        return StreamingResponse(counted_stream(sse, events, lambda status: counted(endpoint, str(status)).inc()),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def collect() -> None:
        try:
            async for i, ev, _ in events:
                choices.add(i, ev)
                if ev.finished and ev.finish_reason == "error":
                    break  # (the answer is an error: closing the stream aborts the other choices now)
        finally:
            await events.aclose()

    # wait for the result or the client's disconnect, whichever comes first (a client that gives up while its request
    # is queued is noticed at once, and its sequences are aborted before they take a slot)
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
    bad = choices.failure()
    if bad is not None:
        if bad.invalid:  # (this request's own: e.g. a grammar past the engine's limits, found as it ran)
            raise APIError(bad.error or "the request cannot run", 400)
        raise APIError(bad.error or "the request did not finish", 503 if bad.unavailable else 500,
                       type="server_error")
    m.requests.labels(endpoint, "200").inc()
    if shape is not None:
        return JSONResponse(shape.body(choices))
    body, usage = choices.body()
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                         "model": server.model_name, "choices": body, "usage": usage})


async def _stream(events: AsyncIterator[tuple[int, Event, float]], base: dict[str, Any], choices: Choices,
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE: a chunk per token of each choice (chat: the role first), each choice's finish, then (``include_usage``) the
    usage, then ``[DONE]``; an error in any choice ends the stream with an error object (the others are aborted)."""

    def sse(c: dict[str, Any]) -> str:
        return _sse(dict(base, choices=[c]) | ({"usage": None} if include_usage else {}))

    for c in choices.opening():
        yield sse(c)
    async for i, ev, _ in events:
        if ev.finished and ev.finish_reason == "error":
            yield _sse(error_body(ev.error or "engine error",
                                  "invalid_request_error" if ev.invalid else "server_error"))
            break
        for c in choices.chunks(i, ev):
            yield sse(c)
        # (with the next events queued already nothing above waits: a turn of the event loop lets it see a client
        # that went away, which stops the stream, rather than writing the rest to the closed connection)
        await asyncio.sleep(0)
    else:
        if include_usage:
            yield _sse(dict(base, choices=[], usage=choices.usage()))
    yield "data: [DONE]\n\n"
