"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, SSE streaming, models, health, metrics.

Every request goes to one ``EngineLoop`` (continuous batching in a background thread); tokens come back through
a per-request asyncio queue. A client that disconnects has its sequence aborted, which frees its slot and pages.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from waferline.engine.sampling import SamplingParams
from waferline.engine.scheduler import EngineLoop, Event, QueueFullError
from waferline.errors import RequestError
from waferline.server.metrics import Metrics
from waferline.server.protocol import APIError, ChatRequest, CompletionRequest, error_body, parse

MAX_SEED = 2**44  # seed * 1_000_003 must fit the 64-bit generator seed

# The chat prompt when the tokenizer config has no chat_template: one block per message, then the assistant's.
FALLBACK_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
FALLBACK_GENERATION_PROMPT = "<|assistant|>\n"


class Server:
    """State shared by the handlers: the engine loop, the tokenizer, the served model name, the API key."""

    def __init__(self, engine: EngineLoop, model_name: str, api_key: str | None = None, max_body_bytes: int = 1 << 20):
        self.engine = engine
        self.llm = engine.scheduler.llm
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = Metrics(engine)
        self.created = int(time.time())
        self.tokenizer_lock: threading.Lock = engine.scheduler.tokenizer_lock

    # -- request pieces
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if not auth:
            raise APIError("missing API key: send the header 'Authorization: Bearer <key>'", 401, code="invalid_api_key")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError("invalid API key", 401, code="invalid_api_key")

    async def json_body(self, request: Request) -> Any:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        too_big = APIError(f"request body larger than {limit} bytes", 413, code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise too_big
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise APIError(f"request body is not valid UTF-8 (byte {e.start}); send UTF-8 encoded JSON") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise APIError(f"malformed JSON body: {e.msg} at line {e.lineno} column {e.colno}") from None
        _check_strings(data)
        return data

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(f"the model '{name}' does not exist; this server serves '{self.model_name}' (see /v1/models)",
                           404, param="model", code="model_not_found")

    def encode(self, text: str) -> list[int]:
        if self.llm.tokenizer is None:
            raise APIError("this model has no tokenizer (tokenizer.json): send the prompt as a list of token ids",
                           param="prompt")
        with self.tokenizer_lock:
            return list(self.llm.tokenizer.encode(text, add_special_tokens=False))

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        tok = self.llm.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer (tokenizer.json), so chat is not available; use /v1/completions "
                           "with token ids", param="messages")
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        if getattr(tok, "chat_template", None):
            try:
                with self.tokenizer_lock:
                    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # a template that rejects this conversation (e.g. roles out of order)
                raise APIError(f"the model's chat template rejected the messages: {e}", param="messages") from None
        else:
            text = "".join(FALLBACK_CHAT_TEMPLATE.format(**m) for m in msgs) + FALLBACK_GENERATION_PROMPT
        return self.encode(text)

    def sampling(self, req: Any, prompt_len: int, default_max: int | None) -> SamplingParams:
        if req.n is not None and req.n != 1:
            raise APIError(f"n={req.n} is not supported: this server returns one choice per request (n=1)", param="n")
        if getattr(req, "best_of", None) not in (None, 1):
            raise APIError("best_of is not supported", param="best_of")
        if getattr(req, "echo", False):
            raise APIError("echo is not supported", param="echo")
        if getattr(req, "suffix", None):
            raise APIError("suffix is not supported", param="suffix")
        if req.logprobs not in (None, False):
            raise APIError("logprobs are not supported", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name) not in (None, 0, 0.0):
                raise APIError(f"{name} is not supported (only 0)", param=name)
        max_tokens = req.max_tokens
        if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        mml = self.engine.scheduler.max_model_len
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else mml - prompt_len
        param = "max_completion_tokens" if isinstance(req, ChatRequest) and req.max_completion_tokens is not None else "max_tokens"
        if max_tokens < 1:
            raise APIError(f"{param} must be >= 1, got {max_tokens}", param=param)
        if prompt_len >= mml:
            raise APIError(f"the prompt has {prompt_len} tokens; this server's context is {mml} tokens "
                           "(--max-model-len): shorten the prompt", param="messages" if isinstance(req, ChatRequest) else "prompt")
        if prompt_len + max_tokens > mml:
            raise APIError(f"prompt of {prompt_len} tokens + {param}={max_tokens} exceeds the context of {mml} tokens; "
                           f"lower {param} to at most {mml - prompt_len}", param=param)
        if req.seed is not None and not 0 <= req.seed < MAX_SEED:
            raise APIError(f"seed must be in [0, 2**44), got {req.seed}", param="seed")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 16 or any(not s for s in stop):
            raise APIError("stop: give at most 16 non-empty strings", param="stop")
        p = SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                           top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed, stop=stop,
                           stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos)
        try:
            p.validate()
        except RequestError as e:
            raise APIError(str(e), param=str(e).split(" ", 1)[0]) from None
        return p

    # -- running a request
    def start(self, ids: list[int], params: SamplingParams, rid: str) -> AsyncIterator[tuple[Event, float]]:
        """Submit now (a full queue or a bad request raises here, before any response is sent) and return the
        stream of (event, engine time) until the request finishes; closing it early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[Event, float]] = asyncio.Queue()

        def sink(ev: Event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (ev, time.perf_counter()))
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        arrival = time.perf_counter()
        try:
            self.engine.submit(ids, params, sink, rid)
        except QueueFullError as e:
            raise APIError(str(e), 429, type="rate_limit_error", code="queue_full") from None
        except RequestError as e:
            raise APIError(str(e)) from None
        events = self._events(queue, rid, arrival)
        # if the response is dropped before its body is ever iterated (an early disconnect), nothing would run the
        # generator's cleanup: abort when it is collected (a no-op for a request that already finished)
        weakref.finalize(events, self.engine.abort, rid)
        return events

    async def _events(self, queue: asyncio.Queue, rid: str, arrival: float) -> AsyncIterator[tuple[Event, float]]:
        finished = False
        last: float | None = None
        m = self.metrics
        try:
            while True:
                ev, t = await queue.get()
                if ev.token_id is not None:
                    m.generation_tokens.inc()
                    if last is None:
                        m.ttft.observe(t - arrival)
                    else:
                        m.itl.observe(t - last)
                    last = t
                if ev.finished:
                    finished = True
                    m.finished.labels(ev.finish_reason or "unknown").inc()
                    if ev.finish_reason in ("stop", "length"):
                        m.prompt_tokens.inc(ev.prompt_tokens)
                        m.e2e.observe(t - arrival)
                yield ev, t
                if finished:
                    return
        finally:
            if not finished:  # the client went away (or the handler failed): stop the sequence, free its pages
                self.engine.abort(rid)
                m.finished.labels("abort").inc()


def _check_strings(data: Any) -> None:
    """Reject JSON strings with lone surrogates (\\udXXX escapes): they are not valid Unicode text."""
    stack = [data]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError("a string in the request is not valid Unicode (a lone surrogate escape)") from None
        elif isinstance(x, dict):
            stack.extend(x.values())
            stack.extend(x.keys())
        elif isinstance(x, list):
            stack.extend(x)


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
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", kind), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500)

    @app.get("/health")
    async def health() -> JSONResponse:
        err = server.engine.last_error
        return JSONResponse({"status": "ok", "model": server.model_name, "running": server.engine.num_running,
                             "waiting": server.engine.num_waiting, "last_engine_error": err})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(m.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
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
            server.check_auth(request)
            req = parse(CompletionRequest, await server.json_body(request))
            server.check_model(req.model)
            ids = _completion_prompt(server, req.prompt)
            params = server.sampling(req, len(ids), 16)
            return await _respond(server, request, "completions", req, ids, params)
        except APIError as e:
            return fail("completions", e)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        try:
            server.check_auth(request)
            req = parse(ChatRequest, await server.json_body(request))
            server.check_model(req.model)
            ids = server.chat_prompt(req)
            params = server.sampling(req, len(ids), None)
            return await _respond(server, request, "chat", req, ids, params)
        except APIError as e:
            return fail("chat", e)

    return app


def _completion_prompt(server: Server, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(f"batched prompts ({len(prompt)}) are not supported: send one prompt per request", param="prompt")
        prompt = prompt[0]
    ids = server.encode(prompt) if isinstance(prompt, str) else list(prompt)
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
    events = server.start(ids, params, rid)  # a full queue or a bad request is an HTTP error, not a broken stream
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        m.requests.labels(endpoint, "200").inc()
        return StreamingResponse(_stream(events, base, chat, include_usage, req.return_token_ids),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    text, toks, last = [], [], None
    try:
        async for ev, _ in events:
            if ev.token_id is not None:
                toks.append(ev.token_id)
            text.append(ev.text)
            last = ev
            if await request.is_disconnected():
                break
    finally:
        await events.aclose()
    if last is None or not last.finished or last.finish_reason == "error":
        msg = last.error if last is not None and last.error else "the request did not finish"
        raise APIError(msg, 500, type="server_error")
    m.requests.labels(endpoint, "200").inc()
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": "".join(text)}
    else:
        choice["text"] = "".join(text)
    if req.return_token_ids:
        choice["token_ids"] = toks
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": server.model_name, "choices": [choice], "usage": _usage(last)}
    return JSONResponse(body)


async def _stream(events: AsyncIterator[tuple[Event, float]], base: dict[str, Any], chat: bool,
                  include_usage: bool, token_ids: bool) -> AsyncIterator[str]:
    def chunk(text: str | None, finish: str | None, tok: int | None = None, role: bool = False) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
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
            if ev.token_id is not None:
                yield _sse(chunk(ev.text, None, ev.token_id))
            if ev.finished:
                if ev.finish_reason == "error":
                    yield _sse(error_body(ev.error or "engine error", "server_error"))
                else:
                    yield _sse(chunk(None if chat else "", ev.finish_reason))
                    if include_usage:
                        yield _sse(dict(base, choices=[], usage=_usage(ev)))
                yield "data: [DONE]\n\n"
                return
    finally:
        await events.aclose()  # a disconnect cancels us here: closing the generator aborts the request
