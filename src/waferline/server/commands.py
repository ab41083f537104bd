"""`waferline serve`: the OpenAI-compatible server on a checkpoint, with continuous batching."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from waferline.errors import ConfigError, UsageError


def build_server(model: str | Path, *, dtype: str = "float32", weight_bits: int = 16, max_num_seqs: int = 16,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 512, chunk_tokens: int = 256,
                 page_tokens: int = 16, cache_mb: float | None = None, max_queue: int = 256,
                 api_key: str | None = None, served_model_name: str | None = None, max_body_bytes: int = 1 << 20,
                 torch_threads: int | None = None, prefix_caching: bool = True, speculative: str | None = None,
                 num_speculative_tokens: int = 4, body_timeout: float = 30.0,
                 allowed_hosts: tuple[str, ...] = ()) -> Any:
    """Load the checkpoint, start the engine loop, and return the FastAPI app (``app.state.server`` holds the rest)."""
    from waferline.engine.llm import LLM
    from waferline.engine.scheduler import EngineLoop, Scheduler, SchedulerConfig
    from waferline.server.app import Server, create_app

    path = Path(model)
    if not path.is_dir():
        raise ConfigError(f"--model {model}: not a checkpoint directory (config.json + *.safetensors)")
    if body_timeout <= 0:
        raise ConfigError(f"--body-timeout must be > 0 seconds, got {body_timeout}")
    if speculative:
        check_serve_speculative(speculative, num_speculative_tokens)
    kw: dict[str, Any] = {"weight_bits": weight_bits} if weight_bits != 16 else {}
    llm = LLM(path, dtype=dtype, max_model_len=max_model_len, **kw)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=llm.max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens, chunk_tokens=chunk_tokens,
                          page_tokens=page_tokens, cache_bytes=None if cache_mb is None else cache_mb * 2**20,
                          max_queue=max_queue, prefix_caching=prefix_caching)
    engine = EngineLoop(Scheduler(llm, cfg), torch_threads=torch_threads).start()
    server = Server(engine, served_model_name or path.name, api_key, max_body_bytes, body_timeout=body_timeout,
                    allowed_hosts=allowed_hosts)
    return create_app(server)


def check_serve_speculative(method: str, k: int) -> None:
    """``serve --speculative``: the method is checked, then refused with the reason — the server's continuous-batching
    scheduler (engine/scheduler.py: paged slots, preemption, prefix cache) has no verify step or cache rollback yet.
    Speculation runs in ``LLM`` (single process and pipeline), ``waferline generate`` and ``waferline demo``."""
    from waferline.engine.speculative import pipeline_method

    pipeline_method(method)  # an unknown method gets that error first
    if k < 1:
        raise ConfigError(f"--num-speculative-tokens must be >= 1, got {k}")
    raise ConfigError(f"--speculative {method}: the server's continuous-batching scheduler does not speculate yet (it "
                      "has no verify step or cache rollback); serve without --speculative, or use speculative decoding "
                      "through `waferline generate --speculative ...`, `waferline demo --speculative ...` or "
                      "waferline.LLM(path, speculative=...)")


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: binding {args.host}: the API is reachable from other machines"
              + ("" if args.api_key else " and has no --api-key"))
    api_key = args.api_key or os.environ.get("WAFERLINE_API_KEY") or None
    if args.num_speculative_tokens is not None and not args.speculative:
        raise UsageError("--num-speculative-tokens needs --speculative METHOD")
    if args.allowed_hosts and api_key:
        raise UsageError("--allowed-hosts applies to a server without --api-key (with a key, any Host is answered)")
    if not Path(args.model).is_dir():  # (before a first kernel build makes the user wait for this error)
        raise ConfigError(f"--model {args.model}: not a checkpoint directory (config.json + *.safetensors)")
    from waferline import kernels

    kernels.prepare()  # built (first run) or loaded before the server listens: /health is ok only once they are
    app = build_server(args.model, dtype=args.dtype, weight_bits=args.weight_bits, max_num_seqs=args.max_num_seqs,
                       max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                       chunk_tokens=args.chunk_tokens, page_tokens=args.page_tokens, cache_mb=args.cache_mb,
                       max_queue=args.max_queue, api_key=api_key, served_model_name=args.served_model_name,
                       max_body_bytes=args.max_body_bytes, torch_threads=args.torch_threads,
                       prefix_caching=not args.no_prefix_caching, speculative=args.speculative,
                       num_speculative_tokens=4 if args.num_speculative_tokens is None else args.num_speculative_tokens,
                       body_timeout=args.body_timeout,
                       allowed_hosts=tuple(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip()))
    print(f"waferline: serving {app.state.server.model_name} on http://{args.host}:{args.port}/v1", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.log_level == "debug")
    finally:
        app.state.server.engine.shutdown()
    return 0


def register(sub: Any) -> None:
    """Add ``serve`` to the CLI's subparsers."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                       description="Serve a checkpoint over /v1/completions and /v1/chat/completions (SSE streaming), "
                                   "/v1/models, /health and /metrics. See docs/server.md.")
    s.add_argument(
        "--model", required=True, help="checkpoint directory (config.json + *.safetensors [+ tokenizer.json])"
    )
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (or set WAFERLINE_API_KEY)"
    )
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory name)")
    s.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together (cache slots, default 16)")
    s.add_argument("--max-model-len", type=int, default=None, help="context per sequence: prompt + max_tokens "
                   "(default: the model's max_position_embeddings)")
    s.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="tokens per engine step (decodes + prefill chunks)"
    )
    s.add_argument(
        "--chunk-tokens", type=int, default=256, help="largest prefill chunk of one sequence (chunked prefill)"
    )
    s.add_argument("--page-tokens", type=int, default=16, help="tokens per cache page")
    s.add_argument(
        "--cache-mb",
        type=float,
        default=None,
        help="cache budget in MiB (default: max-num-seqs sequences of "
        "max-model-len tokens, by the ModelSpec accounting); smaller budgets preempt",
    )
    s.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes (they are "
                   "reused only on attention-only models without sliding windows)")
    s.add_argument("--max-queue", type=int, default=256, help="waiting requests before the server answers 429")
    s.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB; 413 beyond)"
    )
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    s.add_argument("--weight-bits", type=int, default=16, choices=[16, 4], help="4: int4 weights (W4A16)")
    s.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads of the engine")
    s.add_argument("--speculative", default=None, metavar="METHOD",
                   help="ngram | mtp | draft:PATH. NOT SUPPORTED by the server yet: the continuous-batching scheduler "
                        "has no verify step, so serve refuses it with an error (speculation works in `waferline "
                        "generate`, `waferline demo` and waferline.LLM, single process and pipelined)")
    s.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="most drafts per step (with --speculative; default 4)")
    s.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds for a request's whole body to arrive (default 30; 408 and the connection closed beyond)",
    )
    s.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="without --api-key the server answers only requests whose Host is localhost, an IP address or "
                        "this machine's name; add comma-separated host names here (e.g. a name in /etc/hosts)")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=_cmd_serve)
