"""The server's state and request handling pieces: ``Server`` (the engine loop, the tokenizer, the served model
name, the API key) with its checks of a request's host, key, content type and body, prompt encoding and sampling
parameters. The routes that use them are in app.py."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from waferline.engine.loop import EngineLoop, EngineUnavailableError, QueueFullError
from waferline.engine.sampling import MAX_LOGPROBS, MAX_SEED, SamplingParams
from waferline.engine.scheduler import Event
from waferline.engine.structured import check_tokens, grammar_of
from waferline.engine.token_bytes import decode_text
from waferline.errors import RequestError
from waferline.server.chat import render
from waferline.server.logprobs import TokenTexts
from waferline.server.metrics import DISCONNECTED, Metrics
from waferline.server.protocol import APIError, ChatRequest, TokenizeRequest, parse
from waferline.server.responses_store import DEFAULT_CAPACITY, ResponseStore
from waferline.server.tools import ToolPlan, plan_of

log = logging.getLogger("waferline.server")

MAX_JSON_DEPTH = 64  # nesting levels of a request body (an OpenAI request needs a handful)
MAX_CHOICES = 64  # choices one request may ask for (prompts x n): each is a sequence of its own
RETRY_AFTER_S = 1  # what a 429 tells the client to wait before retrying
LOCAL_HOST_NAMES = ("localhost",)  # (and *.localhost, RFC 6761) names that always mean this machine
# OpenAI's error code for a prompt (+ max_tokens) past the context, which clients read to trim a conversation or fall
# back to a longer model (its message starts as OpenAI's and vLLM's do, "This model's maximum context length is")
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


# vLLM sampling extensions this server does not do (protocol._Sampling declares them; their defaults are accepted)
UNSUPPORTED_EXTENSIONS = ("include_stop_str_in_output", "prompt_logprobs", "allowed_token_ids", "bad_words",
                          "truncate_prompt_tokens", "spaces_between_special_tokens", "priority", "use_beam_search")
UNSUPPORTED_HINTS = {"prompt_logprobs": " (completions: echo with logprobs scores the prompt)",
                     "allowed_token_ids": " (logit_bias can restrict the tokens)"}


class Server:
    """State shared by the handlers: the engine loop, the tokenizer, the served model name, the API key, the stored
    responses."""

    def __init__(self, engine: EngineLoop, model_name: str, api_key: str | None = None, max_body_bytes: int = 1 << 20,
                 body_timeout: float = 30.0, allowed_hosts: tuple[str, ...] = (), tool_call_parser: str | None = None,
                 responses_store: int = DEFAULT_CAPACITY):
        self.engine = engine
        self.tool_call_parser = tool_call_parser  # (reads the model's own tool calls: tool_choice "auto")
        self.llm = engine.scheduler.llm
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout  # seconds for a request's whole body to arrive (408 beyond)
        # Host names a key-less server answers besides localhost, IP literals and the address the request came in on
        # (as a Host header's name is compared: without a port or brackets, lowercased, no trailing dot)
        self.allowed_hosts = {_host_name(h) for h in (*allowed_hosts, socket.gethostname()) if h.strip()}
        self.metrics = Metrics(engine)
        self.responses = ResponseStore(responses_store)  # (the Responses API's stored responses; 0: none)
        # set by ``stop_requests`` (the server's shutdown): why the requests in flight end, and later ones are refused
        self.stopping: str | None = None
        self._in_flight: weakref.WeakSet[asyncio.Queue] = weakref.WeakSet()  # each running request's event queue
        self.created = int(time.time())
        self.token_texts = TokenTexts(self.llm.tokenizer)  # (logprobs entries' token texts)
        self.tokenizer_lock: threading.Lock = engine.scheduler.tokenizer_lock  # shared with the engine's decoding
        # Prompts are encoded by a copy of the tokenizer under a lock of their own: a long encode in a worker thread
        # must not hold the lock the engine thread takes to detokenize every stream's next token.
        self.encode_tokenizer, self.encode_lock = self.llm.tokenizer, self.tokenizer_lock
        if self.llm.tokenizer is not None:
            try:
                self.encode_tokenizer, self.encode_lock = copy.deepcopy(self.llm.tokenizer), threading.Lock()
            except Exception:  # a tokenizer that cannot be copied: share the engine's, under its lock
                pass

    # -- request pieces
    def check_host(self, request: Request) -> None:
        """Without an API key, answer only requests addressed to this machine by a local name or an IP address: a web
        page cannot then reach the server through a DNS name it controls (DNS rebinding)."""
        if self.api_key is not None:
            return
        host = request.headers.get("host")
        if host is None:
            return  # (HTTP/1.0 without Host: not a browser)
        name = _host_name(host)
        local = request.scope.get("server")
        if (name in self.allowed_hosts or name in LOCAL_HOST_NAMES or name.endswith(".localhost") or _is_ip(name)
                or (local and name == str(local[0]).lower())):
            return
        raise APIError(f"the Host header '{host[:100]}' is not accepted: without --api-key this server answers only "
                       "requests addressed to localhost, an IP address or this machine's name", 403,
                       code="invalid_host")

    def check_json_type(self, request: Request) -> None:
        """Bodies must be declared JSON: a browser cannot send that cross-origin without a CORS preflight (which this
        server does not grant), unlike text/plain or form bodies."""
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json" and not (ctype.startswith("application/") and ctype.endswith("+json")):
            raise APIError(f"unsupported content type '{ctype[:100] or '(none)'}': send the body as JSON with the "
                           "header 'Content-Type: application/json'", 415, code="unsupported_media_type")

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if not auth:
            raise APIError(
                "missing API key: send the header 'Authorization: Bearer <key>'", 401, code="invalid_api_key"
            )
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError("invalid API key", 401, code="invalid_api_key")

    async def json_body(self, request: Request) -> Any:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        # (the connection is closed after the answer: else the server would go on reading the rest of the body)
        too_big = APIError(f"request body larger than {limit} bytes", 413, code="request_too_large",
                           headers={"Connection": "close"})
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, n = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in request.stream():
                    n += len(chunk)
                    if n > limit:
                        raise too_big
                    chunks.append(chunk)
        except TimeoutError:
            log.warning("%s %s: the request body did not arrive within %g s (%d of %s bytes); answered 408",
                        _client(request), request.url.path, self.body_timeout, n, declared or "?")
            # (close the connection: the rest of this body may still be on its way)
            raise APIError(f"the request body did not arrive within {self.body_timeout:g} s", 408,
                           code="request_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            log.warning("%s %s: the client disconnected during the upload (%d of %s bytes)", _client(request),
                        request.url.path, n, declared or "?")
            raise APIError("the client disconnected during the upload", DISCONNECTED,
                           code="client_disconnected") from None
        # (decoded and checked off the event loop, which streams everyone's tokens: a body of a million small values
        # takes a second)
        return await asyncio.to_thread(_decoded, b"".join(chunks))

    async def request(self, request: Request, cls: type, model_optional: bool = False) -> Any:
        """The checks every POST route makes, in order (each failure an ``APIError``): the Host header, the API key,
        the content type, the body (read under the deadline and size limit, strict JSON, parsed as ``cls``) and the
        model name (``model_optional``: only where one is given)."""
        self.check_host(request)
        self.check_auth(request)
        self.check_json_type(request)
        req = await asyncio.to_thread(parse, cls, await self.json_body(request))  # (off the event loop, as above)
        if req.model is not None or not model_optional:
            self.check_model(req.model)
        return req

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                f"the model '{name}' does not exist; this server serves '{self.model_name}' (see /v1/models)",
                404,
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Tokenize a prompt (blocking: the handlers call it through ``asyncio.to_thread``); ``special``: with the
        tokenizer's special tokens (BOS, ...), as a completion's text prompt gets them by default (a rendered chat
        prompt does not: its template writes them)."""
        if self.encode_tokenizer is None:
            raise APIError("this model has no tokenizer (tokenizer.json): send the prompt as a list of token ids",
                           param="prompt")
        with self.encode_lock:
            return list(self.encode_tokenizer.encode(text, add_special_tokens=special))

    def decode(self, ids: list[int]) -> str:
        """Token ids to text, special tokens included (blocking, like ``encode``)."""
        if self.encode_tokenizer is None:
            raise APIError("this model has no tokenizer (tokenizer.json)", param="tokens")
        vocab = self.engine.scheduler.spec.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
        with self.encode_lock:
            return decode_text(self.encode_tokenizer, ids, skip_special_tokens=False)  # (as an output's text reads)

    def tokenizer_info(self) -> dict[str, Any]:
        """What a client needs to tokenize as this server does (``GET /tokenizer_info``, as vLLM's)."""
        tok = self.llm.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer (tokenizer.json)", 404, code="no_tokenizer")
        info: dict[str, Any] = {"tokenizer_class": type(tok).__name__,
                                "model_max_length": self.engine.scheduler.max_model_len,
                                "vocab_size": self.engine.scheduler.spec.vocab_size,
                                "chat_template": getattr(tok, "chat_template", None) or None}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = getattr(tok, name, None)
            info[name] = v if isinstance(v, str) else None
        return info

    def chat_prompt(self, req: ChatRequest | TokenizeRequest) -> list[int]:
        """Render and tokenize a chat prompt (blocking, like ``encode``): the model's template (the engine tokenizer's)
        rendered by the encoding copy, so a long conversation does not hold the lock the engine detokenizes under."""
        tok = self.llm.tokenizer
        if tok is None:
            raise APIError(
                "this model has no tokenizer (tokenizer.json), so chat is not available; use /v1/completions "
                "with token ids",
                param="messages",
            )
        with self.encode_lock:
            text = render(self.encode_tokenizer, getattr(tok, "chat_template", None), req)
        return self.encode(text, bool(req.add_special_tokens))

    @staticmethod
    def check_options(req: Any) -> None:
        """Refuse (400) what this server does not do, rather than silently answering something else."""
        if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
            raise APIError(f"n must be in [1, {MAX_CHOICES}], got {req.n}", param="n")
        if getattr(req, "best_of", None) not in (None, 1, req.n or 1):  # (best_of == n returns every choice: n's)
            raise APIError("best_of is not supported (other than equal to n)", param="best_of")
        if getattr(req, "suffix", None):
            raise APIError("suffix is not supported", param="suffix")
        if req.stream_options is not None and req.stream_options.model_fields_set and not req.stream:
            raise APIError("stream_options can only be given with stream: true", param="stream_options")
        for name in UNSUPPORTED_EXTENSIONS:  # (a default, or an empty list, vLLM's default, asks for nothing)
            if getattr(req, name) not in (type(req).model_fields[name].default, []):
                raise APIError(f"{name} is not supported by this server" + UNSUPPORTED_HINTS.get(name, ""), param=name)
        if not isinstance(req, ChatRequest):
            return
        if req.functions:
            raise APIError("functions (the deprecated function calling) is not supported: send them as tools",
                           param="functions")
        if req.function_call not in (None, "none"):
            raise APIError("function_call (the deprecated function calling) is not supported: use tool_choice",
                           param="function_call")
        if req.modalities is not None and list(req.modalities) != ["text"]:
            raise APIError("modalities: only [\"text\"] is supported", param="modalities")
        if req.audio is not None:
            raise APIError("audio output is not supported", param="audio")

    def check_choice_count(self, prompts: int, n: int) -> None:
        """Refuse a request of more choices (``prompts`` x ``n``) than one request may ask for."""
        most = min(MAX_CHOICES, self.engine.scheduler.config.max_queue)
        if prompts * n > most:
            raise APIError(f"{prompts} prompt(s) x n={n} = {prompts * n} choices; at most {most} per request",
                           param="n" if n > 1 else "prompt")

    def choices(self, req: Any, prompts: list[list[int]], default_max: int | None
                ) -> list[tuple[list[int], SamplingParams]]:
        """One (prompt ids, params) per choice: each prompt ``n`` times, choice ``p * n + j`` being prompt p's j-th (the
        OpenAI order); with a seed, choice j samples with seed + j (so the n choices differ, and each repeats)."""
        n = req.n or 1
        self.check_choice_count(len(prompts), n)
        out = []
        for ids in prompts:
            params = self.sampling(req, len(ids), default_max)
            for j in range(n):
                out.append((ids, params if j == 0 or params.seed is None else
                            dataclasses.replace(params, seed=(params.seed + j) % MAX_SEED)))
        return out

    def sampling(self, req: Any, prompt_len: int, default_max: int | None) -> SamplingParams:
        max_tokens = req.max_tokens
        if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        mml = self.engine.scheduler.max_model_len
        if prompt_len >= mml:  # (first: the default max_tokens below would be 0 or less)
            raise APIError(
                f"This model's maximum context length is {mml} tokens (--max-model-len); the prompt has "
                f"{prompt_len} tokens: shorten the prompt",
                param="messages" if isinstance(req, ChatRequest) else "prompt", code=CONTEXT_LENGTH_EXCEEDED,
            )
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else mml - prompt_len
        echo = bool(getattr(req, "echo", False))
        if echo and max_tokens == 0:  # (the prompt scored alone: one token is generated and left out of the answer)
            if req.min_tokens:
                raise APIError(f"min_tokens must be 0 with max_tokens 0, got {req.min_tokens}", param="min_tokens")
            max_tokens = 1
        param = (
            "max_completion_tokens"
            if isinstance(req, ChatRequest) and req.max_completion_tokens is not None
            else "max_tokens"
        )
        if max_tokens < 1:
            hint = "" if isinstance(req, ChatRequest) else " (0 only with echo)"
            raise APIError(f"{param} must be >= 1{hint}, got {max_tokens}", param=param)
        if prompt_len + max_tokens > mml:
            raise APIError(f"This model's maximum context length is {mml} tokens; the prompt of {prompt_len} tokens + "
                           f"{param}={max_tokens} exceeds it: lower {param} to at most {mml - prompt_len}",
                           param=param, code=CONTEXT_LENGTH_EXCEEDED)
        logprobs = req.logprobs
        if isinstance(req, ChatRequest):
            if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                               param="top_logprobs")
            if req.top_logprobs and not req.logprobs:
                raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        plan = plan_of(req, self.tool_call_parser) if isinstance(req, ChatRequest) else None
        structured, source = structured_of(req, plan)
        if structured and self.llm.tokenizer is None:
            raise APIError("structured output needs the model's tokenizer (tokenizer.json)", param=source)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 16 or any(not s for s in stop):
            raise APIError("stop: give at most 16 non-empty strings", param="stop")
        try:
            params = SamplingParams(max_tokens=max_tokens,
                                  temperature=1.0 if req.temperature is None else req.temperature,
                                  top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed,
                                  stop=stop, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                                  logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
                                  presence_penalty=req.presence_penalty or 0.0,
                                  frequency_penalty=req.frequency_penalty or 0.0,
                                  repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                                  logit_bias=_token_keys(req.logit_bias or {}), min_p=req.min_p or 0.0,
                                  min_tokens=req.min_tokens or 0, skip_special_tokens=req.skip_special_tokens
                                  # (a tool-call parser reads tags that some tokenizers mark special: kept)
                                  and not (plan is not None and plan.mode == "auto"), **structured)
            grammar_of(params)  # (a schema, expression or grammar that cannot be used: 400 before it queues)
            check_tokens(self.llm.tokenizer, params, self.tokenizer_lock)  # (one naming tokens the model lacks too)
        except RequestError as e:
            raise APIError(str(e), param=source if structured and str(e).startswith(tuple(structured)) else
                           _param_of(str(e))) from None
        return params

    # -- running a request
    def start(self, prompts: list[tuple[list[int], SamplingParams]], rid: str, score_only: bool = False, n: int = 1
              ) -> AsyncIterator[tuple[int, Event, float]]:
        """Submit one sequence per choice (prompt ids, params), all or none: a full queue or a bad request raises
        here, before any response is sent. Returns the stream of (choice index, event, engine time) until every
        choice has finished; closing it early aborts those still running. ``score_only``: completions ``echo`` with
        ``max_tokens`` 0, whose one generated token the answer leaves out (nor do the metrics count it); ``n``: the
        choices of each prompt (in a row), whose prompt tokens the metrics count once, as ``usage`` does."""
        if self.stopping is not None:
            raise APIError(self.stopping, 503, type="server_error")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Event, float] | None] = asyncio.Queue()

        def sink_of(i: int) -> Callable[[Event], None]:
            def sink(ev: Event) -> None:
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, (i, ev, time.perf_counter()))
                except RuntimeError:  # the event loop is gone (shutdown)
                    pass
            return sink

        rids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        arrival = time.perf_counter()
        try:
            self.engine.submit_many([(ids, params, sink_of(i), r) for i, ((ids, params), r) in
                                     enumerate(zip(prompts, rids))])
        except QueueFullError as e:
            raise APIError(str(e), 429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineUnavailableError as e:
            raise APIError(str(e), 503, type="server_error", code="engine_unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except RequestError as e:
            raise APIError(str(e), param=_param_of(str(e))) from None
        events = self._events(queue, rids, arrival, score_only, n)
        self._in_flight.add(queue)
        # if the response is dropped before its body is ever iterated (an early disconnect), nothing would run the
        # generator's cleanup: abort when it is collected (a no-op for requests that already finished)
        weakref.finalize(events, _abort_all, self.engine, rids)
        return events

    def stop_requests(self, reason: str = "the server is shutting down: the request did not finish within its "
                      "shutdown timeout") -> None:
        """End every request in flight with the error ``reason`` (an engine error, HTTP 503: the JSON error object of
        a response not sent yet, a stream's error event) and refuse those that reach the engine after it. Called on the
        event loop, by the server's shutdown at its timeout: answered here, the requests still running are not cut off
        with no answer (the connections closed, or uvicorn's plain-text 500) when uvicorn cancels them."""
        self.stopping = reason
        for queue in list(self._in_flight):
            queue.put_nowait(None)  # (the stream turns it into its error; the engine's sequences are then aborted)

    async def _events(self, queue: asyncio.Queue, rids: list[str], arrival: float, score_only: bool = False,
                      n: int = 1) -> AsyncIterator[tuple[int, Event, float]]:
        running = set(range(len(rids)))
        last: dict[int, float] = {}
        m = self.metrics

        def count(i: int, ev: Event, t: float) -> None:
            if ev.token_id is not None and not score_only:  # (a scored prompt's token is not sent: no TTFT)
                m.generation_tokens.inc()
                if i not in last:
                    m.ttft.observe(t - arrival)
                else:
                    m.itl.observe(t - last[i])
                last[i] = t
            if ev.finished:
                running.discard(i)
                ok = ev.finish_reason in ("stop", "length")
                m.finished.labels("length" if ok and score_only else ev.finish_reason or "unknown").inc()
                if ok:
                    if i % n == 0:  # (a prompt's first choice: its tokens count once, whatever n)
                        m.prompt_tokens.inc(ev.prompt_tokens)
                    m.e2e.observe(t - arrival)

        try:
            while running:
                item = await queue.get()
                if item is None:  # (``stop_requests``) the request ends with the server's error, as a fault ends it
                    item = (min(running), Event(None, "", True, "error", error=self.stopping, unavailable=True),
                            time.perf_counter())
                count(*item)
                yield item
        finally:
            # what the engine did while the client was not reading (a stalled stream) is counted as it happened: the
            # choices it finished are not aborts
            while running and not queue.empty():
                item = queue.get_nowait()
                if item is not None:
                    count(*item)
            for i in running:  # the client went away (or the handler failed): stop the sequence, free its pages
                self.engine.abort(rids[i])
                m.finished.labels("abort").inc()


async def counted_stream(sse: AsyncGenerator[str, None], events: AsyncGenerator, count: Callable[[int], None]
                         ) -> AsyncIterator[str]:
    """An SSE answer ``sse`` (made from ``events``, ``Server.start``'s) as sent: ``count(status)`` at its end, 200 (its
    HTTP status, an error event included) or 499 where the client left first (a fault that ends it is counted by the
    app's handler of unexpected faults: 500); then both generators are closed, which aborts what still runs (a
    disconnect cancels the stream here)."""
    ended = failed = False
    try:
        async for chunk in sse:
            yield chunk
        ended = True
    except Exception:
        failed = True
        raise
    finally:
        if not failed:
            count(200 if ended else DISCONNECTED)
        await sse.aclose()
        await events.aclose()


def _abort_all(engine: EngineLoop, rids: list[str]) -> None:
    for r in rids:
        engine.abort(r)


def _decoded(raw: bytes) -> Any:
    """A request body as strict JSON (else an ``APIError``: 400), its strings checked (``_check_strings``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"request body is not valid UTF-8 (byte {e.start}); send UTF-8 encoded JSON") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise APIError(f"malformed JSON body: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise APIError(f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError:  # an integer beyond the interpreter's digit limit (sys.get_int_max_str_digits)
        raise APIError("malformed JSON body: a number with too many digits") from None
    _check_strings(data)
    return data


def _check_strings(data: Any) -> None:
    """Reject JSON strings with lone surrogates (\\udXXX escapes): they are not valid Unicode text; and bodies nested
    deeper than MAX_JSON_DEPTH (what validates them, reports on them or copies them may recurse)."""
    stack = [(data, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError("a string in the request is not valid Unicode (a lone surrogate escape)") from None
        elif isinstance(x, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise APIError(f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
            if isinstance(x, dict):
                stack.extend((k, depth) for k in x.keys())
                stack.extend((v, depth + 1) for v in x.values())
            else:
                stack.extend((v, depth + 1) for v in x)


def _no_constant(name: str) -> Any:
    raise APIError(f"malformed JSON body: {name} is not a JSON number")


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    """logit_bias as JSON sends it (token ids as strings) -> token id: bias."""
    out = {}
    for k, v in bias.items():
        if not k.strip().isdecimal() or len(k.strip()) > 12:
            raise APIError(f"logit_bias keys are token ids, got {k[:40]!r}", param="logit_bias")
        out[int(k)] = v
    return out


def structured_of(req: Any, plan: ToolPlan | None = None) -> tuple[dict[str, Any], str | None]:
    """The structured output a request asks for, as SamplingParams fields, and the request field it came from:
    ``response_format`` (OpenAI's: json_object, or json_schema with its ``schema``), vLLM's ``structured_outputs``,
    or its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, or a chat request's
    named or required ``tool_choice`` (server/tools.py); at most one."""
    asked: list[tuple[dict[str, Any], str]] = []
    if plan is not None and plan.structured():
        asked.append((plan.structured(), "tool_choice"))
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            asked.append(({"json_object": True}, "response_format"))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):
                raise APIError("response_format json_schema: give {\"type\": \"json_schema\", \"json_schema\": "
                               "{\"name\": ..., \"schema\": {...}}}", param="response_format")
            asked.append(({"json_schema": spec["schema"]}, "response_format"))
        elif kind != "text":
            raise APIError("response_format: the type is \"text\", \"json_object\" or \"json_schema\", got "
                           f"{str(fmt)[:80]}", param="response_format")
    so = req.structured_outputs
    if so is not None:
        for field, name in (("json_", "json_schema"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar"),
                            ("json_object", "json_object")):
            v = getattr(so, field)  # (json_object false asks for nothing; a json of false is a schema: refused)
            if v is not None and not (field == "json_object" and v is False):
                asked.append(({name: v}, "structured_outputs"))
    for field, name in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        if getattr(req, field) is not None:
            asked.append(({name: getattr(req, field)}, field))
    if len(asked) > 1:
        raise APIError("at most one structured output per request, got " + " and ".join(
            f"{s} ({next(iter(k))})" for k, s in asked), param=asked[1][1])
    return asked[0] if asked else ({}, None)


def _param_of(message: str) -> str | None:
    """The request field an engine-side message is about (its first word, when that names a sampling field)."""
    word = message.split(" ", 1)[0]
    return word if word in SamplingParams.__dataclass_fields__ else None


def _host_name(host: str) -> str:
    """The name in a Host header, without port, brackets or a trailing dot, lowercased."""
    h = host.strip().lower()
    if h.startswith("["):
        h = h[1:].split("]", 1)[0]
    elif h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _client(request: Request) -> str:
    c = request.client
    return f"{c.host}:{c.port}" if c else "client"
