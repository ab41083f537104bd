"""Load test of `waferline serve`: N concurrent streaming clients for a bounded duration; TTFT and inter-token
latency p50/p99, tokens/s, errors, and the server's RSS before and after. Prints a table, writes JSON.

    python benchmarks/serve_load.py --model demo_out/sol-demo-random --build-demo --clients 16 --duration 30
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --server-pid PID --model-name NAME   # a running server

With --model it starts the server itself on a free 127.0.0.1 port and stops it afterwards. Only loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

_LOADS = itertools.count()  # loads run by this process (each one's prompts its own)
PROMPT = ("Cerebras wafers keep the weights of a layer in on-chip SRAM and stream activations from wafer to wafer. "
          "A light cache lets many sequences live beside the weights")


def _rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def _client(i: int, http: httpx.AsyncClient, args: argparse.Namespace, model: str, deadline: float,
                  res: dict[str, Any], load: int) -> None:
    n = 0
    while time.perf_counter() < deadline:
        # (the load's number in the prompt: a later load, or the warm-up before it, never sends a prompt the server
        # has cached whole, which made a server's second point at the same client count 3-5x faster to first token)
        body = {"model": model, "prompt": f"[{load}.{i}.{n}] " + PROMPT[: args.prompt_chars],
                "max_tokens": args.max_tokens,
                "temperature": args.temperature, "seed": i * 1000 + n, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        n += 1
        t0 = time.perf_counter()
        last = None
        toks = 0
        failed = False
        try:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    res["errors"].append(f"HTTP {r.status_code}: {r.text[:120]}")
                    await asyncio.sleep(0.05)
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res["errors"].append(chunk["error"]["message"][:120])
                        failed = True  # (an error, not a request served: its tokens count, the request does not)
                        break
                    if not chunk["choices"] or chunk["choices"][0]["finish_reason"] is not None:
                        continue  # the finish chunk and the usage chunk carry no token
                    now = time.perf_counter()
                    if last is None:
                        res["ttft"].append(now - t0)
                    else:
                        res["itl"].append(now - last)
                    last = now
                    toks += 1
            res["tokens"] += toks
            if not failed:
                res["requests"] += 1
                res["e2e"].append(time.perf_counter() - t0)
        except httpx.HTTPError as e:
            res["errors"].append(f"{type(e).__name__}: {e}"[:120])


async def _load(args: argparse.Namespace, base: str, model: str) -> dict[str, Any]:
    load = next(_LOADS)
    res: dict[str, Any] = {"ttft": [], "itl": [], "e2e": [], "tokens": 0, "requests": 0, "errors": []}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=args.duration + 120, limits=limits) as http:
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        await asyncio.gather(*(_client(i, http, args, model, deadline, res, load) for i in range(args.clients)))
        res["wall_s"] = time.perf_counter() - t0
    return res


def summarize(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The load's numbers: request and token counts, aggregate tokens/s over the wall time, TTFT and inter-token
    latency p50/p99 in ms, end-to-end p50 in s, and the errors (count and a few samples)."""
    ms = lambda x: None if x is None else round(x * 1e3, 2)  # noqa: E731
    return {
        "clients": args.clients, "duration_s": args.duration, "wall_s": round(res["wall_s"], 2),
        "max_tokens": args.max_tokens, "requests": res["requests"], "tokens": res["tokens"],
        "tokens_per_s": round(res["tokens"] / res["wall_s"], 1),
        "ttft_p50_ms": ms(_pct(res["ttft"], 50)), "ttft_p99_ms": ms(_pct(res["ttft"], 99)),
        "itl_p50_ms": ms(_pct(res["itl"], 50)), "itl_p99_ms": ms(_pct(res["itl"], 99)),
        "e2e_p50_s": None if not res["e2e"] else round(_pct(res["e2e"], 50), 3),
        "errors": len(res["errors"]), "error_samples": res["errors"][:5],
    }


def wait_ready(base: str, proc: subprocess.Popen[str] | None, path: str = "/health", timeout: float = 120) -> None:
    """Poll ``base + path`` until it answers 200; exit with the server's stderr tail if ``proc`` dies first."""
    end = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(base + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and proc.poll() is not None:
            sys.exit(f"server exited: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        if time.monotonic() > end:
            sys.exit(f"server did not become healthy within {timeout:g} s")
        time.sleep(0.3)


def _ok(r: httpx.Response, what: str) -> httpx.Response:
    """``r`` where it is a 200; otherwise exit with one line (a wrong --api-key or --model-name: no load of errors)."""
    if r.status_code != 200:
        sys.exit(f"{what}: HTTP {r.status_code}: {r.text[:200]}")
    return r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory: start `waferline serve` on it")
    ap.add_argument("--build-demo", action="store_true",
                    help="if --model does not exist, build the random Sol demo checkpoint there (as `make demo` does)")
    ap.add_argument("--url", help="an already running server (http://127.0.0.1:PORT)")
    ap.add_argument("--model-name", help="model id to send (default: from /v1/models)")
    ap.add_argument("--server-pid", type=int, help="pid of the running server (for RSS with --url)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds during which clients start new requests")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=float, default=5.0,
                    help="seconds of the same load before the measured one, not recorded (default 5; 0: one request)")
    ap.add_argument("--prompt-chars", type=int, default=120)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-num-seqs", type=int, default=16, help="server flag (with --model)")
    ap.add_argument("--torch-threads", type=int, default=None, help="server flag (with --model)")
    ap.add_argument("--extra-server-args", default="", help="more `waferline serve` flags (with --model)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve_load_<clients>c.json)")
    args = ap.parse_args()
    if not (args.model or args.url):
        ap.error("give --model DIR (start a server) or --url URL (use a running one)")
    args.out = args.out or f"benchmarks/results/serve_load_{args.clients}c.json"
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(args.out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    proc = None
    pid = args.server_pid
    if args.model and args.build_demo and not Path(args.model).exists():
        from waferline.demo import build_demo_checkpoint

        Path(args.model).mkdir(parents=True)
        build_demo_checkpoint(Path(args.model))
    if args.model:
        port = _free_port()
        cmd = [sys.executable, "-m", "waferline.cli", "serve", "--model", args.model, "--port", str(port),
               "--max-num-seqs", str(args.max_num_seqs)] + args.extra_server_args.split()
        if args.torch_threads:
            cmd += ["--torch-threads", str(args.torch_threads)]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        pid = proc.pid
        base = f"http://127.0.0.1:{port}"
    else:
        base = args.url.rstrip("/")
        if not base.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
            ap.error("--url must be a loopback address")
    try:
        wait_ready(base, proc)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.model_name or _ok(httpx.get(base + "/v1/models", headers=headers), "GET /v1/models").json()[
            "data"][0]["id"]
        _ok(httpx.post(base + "/v1/completions", headers=headers, timeout=120,  # warm-up, outside the measurement
                       json={"model": model, "prompt": PROMPT, "max_tokens": 4}), "the warm-up request")
        if args.warmup > 0:  # a fresh server's first load ran slower (TTFT p50 3-5x): run here, not counted
            asyncio.run(_load(argparse.Namespace(**dict(vars(args), duration=args.warmup)), base, model))
        rss_before = _rss_mib(pid)
        res = asyncio.run(_load(args, base, model))
        rss_after = _rss_mib(pid)
        metrics = httpx.get(base + "/metrics").text
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    preempt = next((float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("waferline_preemptions_total ")), None)
    summary = {
        **summarize(res, args),
        "server_rss_mib_before": None if rss_before is None else round(rss_before, 1),
        "server_rss_mib_after": None if rss_after is None else round(rss_after, 1),
        "preemptions": preempt,
    }
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"waferline serve: {args.clients} streaming clients for {args.duration:g} s, max_tokens {args.max_tokens}"
    )
    for c in ("requests", "tokens/s", "TTFT p50/p99 ms", "ITL p50/p99 ms", "errors", "RSS MiB before→after"):
        t.add_column(c, justify="right")
    t.add_row(
        str(summary["requests"]),
        f"{summary['tokens_per_s']:,}",
        f"{summary['ttft_p50_ms']} / {summary['ttft_p99_ms']}",
        f"{summary['itl_p50_ms']} / {summary['itl_p99_ms']}",
        str(summary["errors"]),
        f"{summary['server_rss_mib_before']} → {summary['server_rss_mib_after']}",
    )
    Console(width=140).print(t)
    out = Path(args.out)
    summary["args"] = vars(args)
    summary["machine"] = {"cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    write_text_atomic(out, json.dumps(summary, indent=1), make_parents=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
