"""`waferline serve`: the OpenAI-compatible server on a checkpoint, with continuous batching — in this process, or
over a pipeline of stage processes (--stages / --layers-per-stage)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from waferline.argtypes import nonnegative_int, positive_float, positive_int
from waferline.engine_flags import check_engine_flags, default_threads, stage_convert
from waferline.errors import ConfigError, UsageError, counted
from waferline.server.responses_store import DEFAULT_CAPACITY, DEFAULT_MAX_BYTES
from waferline.server.tools import PARSERS


def build_server(model: str | Path, *, dtype: str = "float32", weight_bits: int = 16, max_num_seqs: int = 16,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 512, chunk_tokens: int = 256,
                 page_tokens: int = 16, cache_mb: float | None = None, max_queue: int = 256,
                 api_key: str | None = None, served_model_name: str | None = None, max_body_bytes: int = 1 << 20,
                 torch_threads: int | None = None, prefix_caching: bool = True, speculative: str | None = None,
                 num_speculative_tokens: int = 4, speculative_adaptive: bool = True, body_timeout: float = 30.0,
                 allowed_hosts: tuple[str, ...] = (), stages: int | None = None,
                 layers_per_stage: int | None = None, micro_batches: int | None = None,
                 hang_timeout_s: float | None = None, threads_per_stage: int | None = None,
                 group_size: int | None = None, head_bits: int = 16, afd: bool = False,
                 attention_ranks: int | None = None, ffn_ranks: int | None = None,
                 tool_call_parser: str | None = None, chat_template: str | None = None,
                 device: str | None = None, on_fatal: Callable[[str], None] | None = None,
                 responses_store: int = DEFAULT_CAPACITY) -> Any:
    """Load the checkpoint, start the engine loop, and return the FastAPI app (``app.state.server`` holds the rest).

    With ``stages`` or ``layers_per_stage`` the model runs as a pipeline of stage processes (this process is stage 0
    and the scheduler), with ``afd`` as attention and FFN ranks (this process is attention rank 0); a process that
    dies or hangs fails the requests in flight, and the processes are started again. ``on_fatal`` is called (from
    the engine thread, with the reason) when they cannot be, or when the engine loop fails outside a step.
    ``responses_store``: how many responses /v1/responses keeps for ``previous_response_id`` and reading back (0:
    none)."""
    from waferline.engine.llm import LLM
    from waferline.engine.loop import EngineLoop
    from waferline.engine.scheduler import Scheduler, SchedulerConfig, runner_for
    from waferline.server.app import Server, create_app

    path = Path(model)
    if tool_call_parser not in (None, *PARSERS):
        raise ConfigError(f"--tool-call-parser {tool_call_parser}: not one of {', '.join(PARSERS)}")
    if not path.is_dir():
        raise ConfigError(f"--model {model}: not a checkpoint directory (config.json + *.safetensors)")
    if not body_timeout > 0:
        raise ConfigError(f"--body-timeout must be > 0 seconds, got {body_timeout}")
    if responses_store < 0:
        raise ConfigError(f"--responses-store must be 0 or more responses, got {responses_store}")
    if speculative:
        check_serve_speculative(speculative, num_speculative_tokens, path)
    if chat_template is not None:  # (checked before the weights load: a bad template fails fast)
        from waferline.model.load import load_tokenizer
        from waferline.server.chat import load_template

        chat_template = load_template(chat_template, load_tokenizer(path))
    kw: dict[str, Any] = {"weight_bits": weight_bits} if weight_bits != 16 else {}
    if group_size is not None:
        kw["group_size"] = group_size
    if head_bits != 16:
        kw["head_bits"] = head_bits
    pipeline = stages is not None or layers_per_stage is not None
    if afd or attention_ranks is not None or ffn_ranks is not None:
        if pipeline:
            raise ConfigError("afd and stages / layers_per_stage are two different engines: give one of them")
        pipeline = True
        kw.update(afd=True, attention_ranks=attention_ranks or 1, ffn_ranks=ffn_ranks or 1,
                  micro_batches=micro_batches)
    elif pipeline:
        kw.update(stages=stages, layers_per_stage=layers_per_stage, micro_batches=micro_batches)
    elif micro_batches is not None or hang_timeout_s is not None or threads_per_stage is not None:
        raise ConfigError("micro_batches, hang_timeout_s and threads_per_stage need stages, layers_per_stage or afd")
    if hang_timeout_s is not None:
        kw["hang_timeout_s"] = hang_timeout_s
    if torch_threads is None and not pipeline and device in (None, "cpu"):
        torch_threads = default_threads()  # (one core left to the server's own threads)
    if threads_per_stage is None and pipeline and torch_threads:
        threads_per_stage = torch_threads  # (every stage / rank process, as stage 0's engine loop takes)
    if threads_per_stage is not None:
        kw["threads_per_stage"] = threads_per_stage
    if device not in (None, "cpu"):
        kw["device"] = device
    llm = LLM(path, dtype=dtype, max_model_len=max_model_len, **kw)
    if page_tokens > llm.max_model_len:  # (a request holds whole pages: most of such a page would never be used)
        llm.close()
        raise ConfigError(f"--page-tokens {page_tokens} is longer than the context ({llm.max_model_len} tokens, "
                          "--max-model-len): use a page of at most that (default 16)")
    llm._scheduler = None  # (the server's scheduler drives the pipeline; the LLM's own would hold it after a rebuild)
    if chat_template is not None:
        llm.tokenizer.chat_template = chat_template  # (before the server copies the tokenizer)

    env = getattr(llm._pipeline, "_env", False)  # (an env:// launch: the other ranks' processes are not this one's)

    def rebuild() -> Any:
        """A new pipeline / AFD engine (new processes) with the same options, after one died or hung."""
        if env:  # (every rank stops after a fault; rank 0 cannot start them again)
            from waferline.engine.pipeline import StageError

            raise StageError("the stages of an env:// launch (torchrun, or RANK and WORLD_SIZE set by hand) run in "
                             "processes rank 0 cannot start again; restart every rank")
        fresh = LLM(path, dtype=dtype, max_model_len=max_model_len, **kw)
        # (the server's runner drives it; the fresh LLM's own scheduler, in a cycle with that LLM, would hold it
        # after it is replaced in turn)
        llm._pipeline, fresh._pipeline, fresh._scheduler = fresh._pipeline, None, None
        return llm._pipeline

    try:
        runner = runner_for(llm, max_num_seqs, rebuild if pipeline else None)
    except BaseException:
        llm.close()
        raise
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=llm.max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens, chunk_tokens=chunk_tokens,
                          page_tokens=page_tokens, cache_bytes=None if cache_mb is None else cache_mb * 2**20,
                          max_queue=max_queue, prefix_caching=prefix_caching, speculative=speculative,
                          num_speculative_tokens=num_speculative_tokens, speculative_adaptive=speculative_adaptive)
    try:
        scheduler = Scheduler(llm, cfg, runner)
    except BaseException:
        runner.close()
        raise
    engine = EngineLoop(scheduler, torch_threads=torch_threads, on_fatal=on_fatal).start()
    # (--model `.` or `dir/..`: the directory's own name, not a Path's empty or `..` one)
    name = served_model_name or Path(os.path.abspath(path)).name
    server = Server(engine, name, api_key, max_body_bytes, body_timeout=body_timeout, allowed_hosts=allowed_hosts,
                    tool_call_parser=tool_call_parser, responses_store=responses_store)
    return create_app(server)


def check_serve_speculative(method: str, k: int, path: str | Path) -> None:
    """``serve --speculative``: 'ngram', 'mtp' or 'draft:PATH' (in this process, over pipeline stages or over AFD
    ranks); anything else, or what the checkpoint at ``path`` cannot draft with (no MTP weights, a draft model of
    another tokenizer), is refused with the reason before the checkpoint loads."""
    from waferline.engine.speculative.serving import check_serve_method, check_speculative

    check_serve_method(method, k)
    check_speculative(path, method, k)


def _port(text: str) -> int:
    """An argparse type: a TCP port, 1-65535."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 1-65535, got {v}")
    return v


def _check_port_free(host: str, port: int) -> None:
    """ConfigError where ``host:port`` cannot be listened on (taken, or not this machine's), before the weights load
    and the server says it serves there."""
    import socket

    try:  # (every address the name gives, as asyncio binds them all; "" is every interface)
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise ConfigError(f"--host {host}: {e.strerror or e}") from None
    for family, kind, proto, _, addr in dict.fromkeys(infos):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds)
            if family == socket.AF_INET6:  # (an IPv6 listener leaves the IPv4 port alone, as asyncio's does)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                raise ConfigError(f"cannot listen on {addr[0]} port {port}: {e.strerror or e}") from None


def _not_cut_off(record: logging.LogRecord) -> bool:
    """A logging filter: drop the traceback uvicorn logs for each request it cancels at the shutdown timeout."""
    import asyncio

    return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def _cmd_serve(args: argparse.Namespace) -> int:
    import signal

    import uvicorn
    from uvicorn.main import STARTUP_FAILURE

    if args.model_dir is not None and args.model is not None and \
            Path(args.model_dir).resolve() != Path(args.model).resolve():
        raise UsageError(f"two checkpoints: MODEL {args.model_dir} and --model {args.model}; give one")
    args.model = args.model or args.model_dir
    if args.model is None:
        raise UsageError("give the checkpoint directory: waferline serve MODEL (or --model MODEL)")

    api_key = args.api_key or os.environ.get("WAFERLINE_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: binding {args.host}: the API is reachable from other machines"
              + ("" if api_key else " and has no --api-key"))
    if args.allowed_hosts and api_key:
        raise UsageError("--allowed-hosts applies to a server without --api-key"
                         + ("" if args.api_key else ", and WAFERLINE_API_KEY sets one")
                         + " (with a key, any Host is answered)")
    check_engine_flags(args)
    if args.stages is not None or args.layers_per_stage is not None:
        from waferline.engine.pipeline import serve_from_env, torchrun_rank

        if torchrun_rank() > 0:  # under torchrun, ranks >= 1 serve their stage until rank 0 (the server) stops
            return serve_from_env(args.model, args.dtype, stages=args.stages, layers_per_stage=args.layers_per_stage,
                                  device=args.device or "cpu", threads_per_stage=args.torch_threads,
                                  convert=stage_convert(args))
    if not Path(args.model).is_dir():  # (before a first kernel build makes the user wait for this error)
        raise ConfigError(f"{args.model}: not a checkpoint directory (config.json + *.safetensors)")
    _check_port_free(args.host, args.port)
    from waferline import kernels

    kernels.prepare()  # built (first run) or loaded before the server listens: /health is ok only once they are
    stopped: list[str] = []

    def fatal(reason: str) -> None:
        """The engine could not recover from a fault: stop serving (uvicorn shuts down on SIGTERM), exit non-zero."""
        stopped.append(reason)
        print(f"waferline: the engine stopped: {reason}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    app = build_server(args.model, dtype=args.dtype, weight_bits=args.weight_bits, max_num_seqs=args.max_num_seqs,
                       max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                       chunk_tokens=args.chunk_tokens, page_tokens=args.page_tokens, cache_mb=args.cache_mb,
                       max_queue=args.max_queue, api_key=api_key, served_model_name=args.served_model_name,
                       max_body_bytes=args.max_body_bytes, torch_threads=args.torch_threads,
                       prefix_caching=not args.no_prefix_caching, speculative=args.speculative,
                       num_speculative_tokens=4 if args.num_speculative_tokens is None else args.num_speculative_tokens,
                       body_timeout=args.body_timeout,
                       allowed_hosts=tuple(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip()),
                       stages=args.stages, layers_per_stage=args.layers_per_stage, micro_batches=args.micro_batches,
                       hang_timeout_s=args.hang_timeout, group_size=args.group_size, head_bits=args.head_bits,
                       afd=args.afd, attention_ranks=args.attention_ranks, ffn_ranks=args.ffn_ranks,
                       tool_call_parser=args.tool_call_parser, chat_template=args.chat_template,
                       device=args.device, on_fatal=fatal, responses_store=args.responses_store)
    engine = app.state.server.engine
    threads = f" (engine: {counted(engine.torch_threads, 'torch thread')})" if engine.torch_threads else ""
    print(f"waferline: serving {app.state.server.model_name} on http://{args.host}:{args.port}/v1{threads}\n"
          f"waferline: {engine.scheduler.cache.describe()}", flush=True)
    try:
        # (a stop waits for the requests in flight at most --shutdown-timeout seconds: a client that stops reading its
        # stream, or never sends its body, would hold it forever; uvicorn says in one line that it cut them off)
        logging.getLogger("uvicorn.error").addFilter(_not_cut_off)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                access_log=args.log_level == "debug",
                                timeout_graceful_shutdown=args.shutdown_timeout + CUT_OFF_AFTER_S)
        uvicorn_server = _stopping_server(uvicorn.Server, app.state.server.stop_requests, args.shutdown_timeout)(config)
        with contextlib.suppress(KeyboardInterrupt):  # (SIGTERM, raised again once uvicorn has stopped: as uvicorn.run)
            uvicorn_server.run()
        if not uvicorn_server.started:
            sys.exit(STARTUP_FAILURE)  # (as uvicorn.run exits where the server could not start)
    finally:
        engine.shutdown()
    return 1 if stopped else 0


# (after --shutdown-timeout, when the server has answered the requests still in flight with its error) how long uvicorn
# still waits before it cancels what is left: the connections of clients that do not take their answer
CUT_OFF_AFTER_S = 0.5


def _stopping_server(base: type, stop_requests: Callable[[], None], timeout: float) -> type:
    """A ``uvicorn.Server`` class whose shutdown ends the requests still in flight ``timeout`` seconds after it
    starts, with the server's JSON error (503; a stream's error event): uvicorn's own timeout, which cancels the
    handlers, would answer them with a plain-text 500 or close the connection with no answer at all, and it comes
    ``CUT_OFF_AFTER_S`` later, for the clients that do not read their answer."""
    import asyncio

    class StoppingServer(base):  # type: ignore[misc,valid-type]
        async def shutdown(self, sockets: Any = None) -> None:
            timer = asyncio.get_running_loop().call_later(timeout, stop_requests)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return StoppingServer


def register(sub: Any) -> None:
    """Add ``serve`` to the CLI's subparsers."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                       description="Serve a checkpoint over /v1/completions, /v1/chat/completions and "
                                   "/v1/responses (SSE streaming), /v1/models, /health and /metrics. See "
                                   "docs/server.md.")
    s.add_argument("model_dir", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory (config.json + *.safetensors [+ tokenizer.json]); or --model")
    s.add_argument("--model", default=None, help="the checkpoint directory, as MODEL")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=_port, default=8000, help="TCP port to listen on (default 8000)")
    s.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and "
        "/tokenizer_info (or set WAFERLINE_API_KEY); /health and /metrics stay open"
    )
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory name)")
    s.add_argument("--max-num-seqs", type=positive_int, default=16,
                   help="sequences decoded together (cache slots, default 16)")
    s.add_argument("--max-model-len", type=positive_int, default=None, help="context per sequence: prompt + "
                   "max_tokens (default, and at most: the model's max_position_embeddings)")
    s.add_argument(
        "--max-num-batched-tokens", type=int, default=512,
        help="tokens per engine step (decodes + prefill chunks; default 512)"
    )
    s.add_argument(
        "--chunk-tokens", type=int, default=256,
        help="largest prefill chunk of one sequence (chunked prefill; default 256)"
    )
    s.add_argument("--page-tokens", type=int, default=16,
                   help="tokens per cache page (default 16; at most the context, --max-model-len)")
    s.add_argument(
        "--cache-mb",
        type=positive_float,
        default=None,
        help="cache budget in MiB (default: max-num-seqs sequences of "
        "max-model-len tokens, by the ModelSpec accounting; with --afd and M attention ranks, M x ceil(max-num-seqs / "
        "M) of them, each rank's share holding its slots' sequences); smaller budgets preempt",
    )
    s.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes (they are "
                   "reused only on attention-only models without sliding windows)")
    s.add_argument("--max-queue", type=positive_int, default=256,
                   help="requests that may wait for a slot (beyond what free slots take) before the server answers 429 "
                        "(default 256)")
    s.add_argument(
        "--max-body-bytes", type=positive_int, default=1 << 20, help="largest request body (default 1 MiB; 413 beyond)"
    )
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype (default float32; with int4 weights, bfloat16 is W4A16 and runs the fused CPU "
                        "layer operators: one stream decoded 2x faster on an AVX2 CPU)")
    s.add_argument("--weight-bits", type=int, default=16, choices=[16, 4],
                   help="4: int4 weights (W4A16; RTN on load for a 16-bit checkpoint, each pipeline stage its own "
                        "layers, each AFD rank its part); an int4 checkpoint loads as int4 either way")
    s.add_argument("--group-size", type=int, default=None,
                   help="int4 group size for --weight-bits 4 on a 16-bit checkpoint (default 128)")
    s.add_argument("--head-bits", type=int, default=16, choices=[16, 8],
                   help="8 = int8 LM head, 16 = as loaded (default)")
    s.add_argument("--device", default=None,
                   help="cpu (default) or cuda[:N]: where the weights, caches and steps live (a pipeline's stages "
                        "each take a GPU of their own; AFD runs on CPU)")
    s.add_argument("--torch-threads", type=positive_int, default=None,
                   help="torch intra-op threads of the engine (default: the cores less one, left to the server's "
                        "own threads, or OMP_NUM_THREADS where set; with --stages / --afd: of every stage or rank "
                        "process, default the cores divided among them)")
    s.add_argument("--stages", type=int, default=None,
                   help="serve a pipeline of S stage processes (layers split by work, the LM head on the last; this "
                        "process is stage 0 and the "
                        "scheduler). A stage that dies or hangs ends every running and queued request with an error "
                        "(SSE error event / 503), /health answers 503 while new stage processes are started, then "
                        "the server serves again; if they cannot be started the server exits non-zero")
    s.add_argument("--layers-per-stage", type=int, default=None,
                   help="pipeline with K layers per stage (1 = one wafer, one layer); faults as for --stages")
    s.add_argument("--micro-batches", type=int, default=None,
                   help="with a pipeline: split each engine step's sequences into M micro-batches kept in flight "
                        "together, so the stages overlap (default: stages); with --afd, micro-batches ping-ponging "
                        "between attention and FFN ranks (default 2)")
    s.add_argument("--hang-timeout", type=positive_float, default=None, metavar="S",
                   help="with a pipeline or --afd: a process that owes work and makes no progress for S seconds is a "
                        "fault (default 8)")
    s.add_argument("--afd", action="store_true",
                   help="attention/FFN disaggregation: attention ranks (mixers, caches; this process is rank 0 and "
                        "the scheduler) and FFN ranks as processes (see docs/afd.md); faults as for --stages")
    s.add_argument("--attention-ranks", type=positive_int, default=None, metavar="M",
                   help="with --afd: attention ranks, each holding the caches of its share of the slots (default 1)")
    s.add_argument("--ffn-ranks", type=positive_int, default=None, metavar="N",
                   help="with --afd: FFN ranks; MoE experts are split across them (default 1)")
    s.add_argument("--speculative", default=None, metavar="METHOD",
                   help="ngram | mtp | draft:PATH: speculative decoding in the scheduler (n-gram prompt lookup over "
                        "each request's prompt and output, the checkpoint's MTP head, or a draft checkpoint sharing "
                        "the tokenizer), exact: greedy requests get plain decoding's tokens, sampled ones its "
                        "distribution; in this process, over --stages or over --afd ranks alike")
    s.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="most drafts per step (with --speculative; default 4)")
    s.add_argument(
        "--body-timeout",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="seconds for a request's whole body to arrive (default 30; 408 and the connection closed beyond)",
    )
    s.add_argument("--shutdown-timeout", type=positive_float, default=30.0, metavar="S",
                   help="on SIGTERM or Ctrl-C, seconds the requests in flight may take to finish (default 30); those "
                        "still running then end with a 503 error (a stream: its error event), and the server exits")
    s.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="without --api-key the server answers only requests whose Host is localhost, an IP address or "
                        "this machine's name; add comma-separated host names here (e.g. a name in /etc/hosts)")
    s.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="the chat template (a Jinja file, or the template itself) instead of the tokenizer's; without "
                        "either, chat renders each message as <|role|>\\ncontent\\n")
    s.add_argument("--tool-call-parser", default=None, choices=list(PARSERS),
                   help="read the model's own tool calls (tool_choice \"auto\"): hermes = "
                        "<tool_call>{...}</tool_call>, as Hermes and Qwen 2.5/3 write them. Without it, chat with "
                        "tools takes tool_choice \"required\", a named function or \"none\"")
    s.add_argument("--responses-store", type=nonnegative_int, default=DEFAULT_CAPACITY, metavar="N",
                   help=f"/v1/responses keeps the last N responses in memory (default {DEFAULT_CAPACITY}, within "
                        f"{DEFAULT_MAX_BYTES >> 20} MiB; the least "
                        "recently used go first) for previous_response_id and GET / DELETE /v1/responses/{id}; "
                        "store: false leaves one out; 0 keeps none, and store: true and previous_response_id are "
                        "refused")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning; debug also logs each request)")
    s.set_defaults(func=_cmd_serve)
