"""serve_load.py's load, side by side: `waferline serve` (int4 and 16/32-bit weights) and llama.cpp's
OpenAI-compatible server (`python -m llama_cpp.server`, Q4_0 and f16 GGUF) on the same random-weight Llama
checkpoint, each at 1 / 4 / 16 / 64 streaming clients. Prints one table (engine x clients) and writes JSON.

    python benchmarks/serve_load_llamacpp.py --threads 2 --duration 10 --max-tokens 32
    python benchmarks/serve_load_llamacpp.py --engines waferline:fp32 --pipelines 2x2 --threads 1 --clients 16

(the second: one process with one thread, two stage processes with two micro-batches in flight and one thread each,
and one process with two threads, on a host with the cores to spare)

The checkpoint is decode_speed.py's "llama" (124.7M parameters: hidden 768, 12 layers, 12 heads / 4 KV heads, FFN
2048, vocab 32000 with a synthetic byte-level BPE; random weights: speed only, the text is noise), built and cached
under benchmarks/.cache/llama, converted to GGUF f16 by llama.cpp's convert_hf_to_gguf.py and to Q4_0 by llama.cpp's
quantizer (both from llama-cpp-python). waferline's int4 server runs an int8 LM head (--head-bits; the Q4_0 file keeps
its output projection as Q6_K) and bf16 activations (--int4-dtype: W4A16). Every server gets the same thread count,
runs on its own free 127.0.0.1 port and takes one warm-up request and --warmup seconds of the largest load, not
counted (a fresh server's first load ran 1.2-1.5x slower); then, for each client count, each server in turn
(the others idle; the order reversed at every other count, so a host whose speed drifts shifts all engines alike) gets
the load for --duration seconds (clients start new requests until then; requests in flight finish, so a queueing
server runs longer than --duration). Each point also records the host's CPU split over its window (busy / idle /
stolen by the hypervisor, from /proc/stat): on a shared VM the figure to read a window's speed against.

llama-cpp-python with its server extra is an optional benchmark dependency; it builds llama.cpp from source (the
`bench` extra adds sentencepiece, which the GGUF converter imports):

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install -e '.[bench]' "llama-cpp-python[server]"

Without it the llama.cpp rows are skipped with a message and waferline runs alone.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import httpx

from decode_speed_models import CACHE, build_checkpoint, build_gguf, find_converter
from serve_load import _free_port, _load, _rss_mib, summarize, wait_ready

SERVER_MODULES = ("llama_cpp", "llama_cpp.server", "fastapi", "uvicorn", "sse_starlette", "starlette_context",
                  "pydantic_settings")


@dataclass
class Engine:
    """One server configuration: its table name, weight format, and the command that starts it on ``{port}``."""

    name: str
    weights: str
    cmd: list[str]
    ready_path: str
    points: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    startup_s: float | None = None
    stop_s: float | None = None


def _pkg_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def llama_cpp_missing() -> str | None:
    """None when llama_cpp.server can run here; otherwise which modules are missing and how to install them."""
    missing = []
    for m in SERVER_MODULES:
        try:
            if importlib.util.find_spec(m) is None:
                missing.append(m)
        except ModuleNotFoundError:
            missing.append(m)
    if not missing:
        return None
    return (f"llama.cpp rows skipped: missing {', '.join(missing)}. Install with "
            f'CMAKE_ARGS="-DGGML_NATIVE=ON" {sys.executable} -m pip install -e ".[bench]" "llama-cpp-python[server]"')


def machine() -> dict[str, Any]:
    """CPU model, core count, the SIMD flags that decide the kernels both engines pick, memory and load."""
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")),
                           None)
        flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), [])
        info["simd"] = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
        mem = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        info["mem_gib"] = round(int(mem.split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    return info


def engines(args: argparse.Namespace, hf: Path, gguf: dict[str, Path] | None) -> list[Engine]:
    """The four servers (two without llama.cpp), all with ``args.threads`` threads and one context length."""
    wl = [sys.executable, "-m", "waferline.cli", "serve", "--model", str(hf), "--port", "{port}",
          "--torch-threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs),
          "--max-model-len", str(args.context)]
    head = f", int{args.head_bits} head" if args.head_bits != 16 else ""
    short = {"float32": "fp32", "bfloat16": "bf16"}
    int4 = (f"int4 g{args.group_size}{head}, {short[args.int4_dtype]} act.",
            ["--dtype", args.int4_dtype, "--weight-bits", "4", "--group-size", str(args.group_size),
             "--head-bits", str(args.head_bits)])
    dense = (short[args.dtype], ["--dtype", args.dtype])
    out = [Engine("waferline", int4[0], wl + int4[1], "/health"),
           Engine("waferline", dense[0], wl + dense[1], "/health")]
    label, flags = int4 if args.pipeline_weights == "int4" else dense
    for S, M in args.pipelines:  # the int4 or 16/32-bit server as S stage processes, M micro-batches in flight ...
        out.append(Engine("waferline", f"{label}, {S} stages x {M} micro-batches, {args.threads} "
                          f"thread{'s' if args.threads > 1 else ''} each", wl + flags + [
                              "--stages", str(S), "--micro-batches", str(M)], "/health"))
        # ... and as one process given the same cores as threads
        one = wl[:wl.index("--torch-threads") + 1] + [str(S * args.threads)] + wl[wl.index("--torch-threads") + 2:]
        out.append(Engine("waferline", f"{label}, one process, {S * args.threads} threads", one + flags, "/health"))
    if gguf is not None:
        for fmt, label in (("q4_0", "Q4_0"), ("f16", "f16")):
            out.append(Engine("llama.cpp", label, [
                sys.executable, "-m", "llama_cpp.server", "--model", str(gguf[fmt]), "--host", "127.0.0.1",
                "--port", "{port}", "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                "--n_ctx", str(args.context), "--interrupt_requests", "False", "--model_alias", f"llama-{fmt}",
            ], "/v1/models"))
    return [e for e in out if args.engines is None or any(
        sel == e.name or (sel.startswith(f"{e.name}:") and e.weights.startswith(sel.split(":", 1)[1]))
        for sel in args.engines)]


@dataclass
class Live:
    """A started server: its process, base URL and model id."""

    proc: subprocess.Popen
    base: str
    model: str


def start_engine(e: Engine, logdir: Path) -> Live | None:
    """Start ``e`` on a free loopback port and warm it up (one request); None (``e.error`` says why) if it failed."""
    port = _free_port()
    cmd = [c.replace("{port}", str(port)) for c in e.cmd]
    base = f"http://127.0.0.1:{port}"
    log = logdir / f"{e.name}-{e.weights.replace(' ', '_').replace(',', '')}.log"
    print(f"== {e.name} {e.weights}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(base, proc, e.ready_path, timeout=180)
    except SystemExit as ex:
        e.error = f"{ex}; log tail: {log.read_text()[-600:]}"
        print(f"   failed to start: {e.error}", flush=True)
        stop_engine(e, proc)
        return None
    e.startup_s = round(time.perf_counter() - t0, 1)
    print(f"   ready in {e.startup_s} s", flush=True)
    model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    httpx.post(base + "/v1/completions", timeout=120,  # warm-up, outside the measurement
               json={"model": model, "prompt": "Hello", "max_tokens": 4})
    return Live(proc, base, model)


def measure(e: Engine, live: Live, clients: int, args: argparse.Namespace) -> None:
    """One client count against ``live`` (the other servers idle meanwhile); appends the point to ``e.points``."""
    la = argparse.Namespace(clients=clients, duration=args.duration, max_tokens=args.max_tokens,
                            prompt_chars=args.prompt_chars, temperature=args.temperature, api_key=None)
    rss_before = _rss_mib(live.proc.pid)
    load_before = round(os.getloadavg()[0], 2)
    cpu_before = _cpu_times()
    res = asyncio.run(_load(la, live.base, live.model))
    point = summarize(res, la)
    rss_after = _rss_mib(live.proc.pid)
    point["server_rss_mib_before"] = None if rss_before is None else round(rss_before, 1)
    point["server_rss_mib_after"] = None if rss_after is None else round(rss_after, 1)
    point["load_avg_before"] = load_before
    point["host_cpu_pct"] = _cpu_split(cpu_before, _cpu_times())  # busy / idle / steal over the window
    e.points.append(point)
    host = point["host_cpu_pct"]
    where = f"  host busy {host['busy']}% steal {host['steal']}%" if host else ""
    print(f"   {e.name} {e.weights}, {clients:>3} clients: {point['tokens_per_s']:>7} tok/s  "
          f"TTFT p50 {point['ttft_p50_ms']} ms  ITL p50 {point['itl_p50_ms']} ms  errors {point['errors']}{where}",
          flush=True)


def warm(live: Live, clients: int, args: argparse.Namespace) -> None:
    """``clients`` streaming clients against ``live`` for --warmup seconds, not recorded (a server's first load of
    many sequences pays for its first steps of those shapes)."""
    la = argparse.Namespace(clients=clients, duration=args.warmup, max_tokens=args.max_tokens,
                            prompt_chars=args.prompt_chars, temperature=args.temperature, api_key=None)
    asyncio.run(_load(la, live.base, live.model))


def _cpu_times() -> list[int] | None:
    """The host's aggregate CPU jiffies from /proc/stat (user nice system idle iowait irq softirq steal), or None."""
    try:
        return [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None


def _cpu_split(a: list[int] | None, b: list[int] | None) -> dict[str, float] | None:
    """Percent of the host's CPU time between two ``_cpu_times`` readings that was busy, idle and stolen by the
    hypervisor (a drifting shared host: the numbers to read a window's speed against)."""
    if a is None or b is None:
        return None
    d = [y - x for x, y in zip(a, b)]
    total = sum(d) or 1
    idle, steal = d[3] + d[4], d[7]
    return {"busy": round(100 * (total - idle - steal) / total, 1), "idle": round(100 * idle / total, 1),
            "steal": round(100 * steal / total, 1)}


def stop_engine(e: Engine, proc: subprocess.Popen) -> None:
    t1 = time.perf_counter()
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    e.stop_s = round(time.perf_counter() - t1, 1)


def run_all(runs: list[Engine], args: argparse.Namespace, logdir: Path) -> None:
    """Start every server, then for each client count load each server in turn (the order reversed at every other
    count), so a host whose speed drifts during the run shifts every engine alike; stop them all."""
    live: dict[int, Live] = {}
    try:
        for i, e in enumerate(runs):
            got = start_engine(e, logdir)
            if got is not None:
                live[i] = got
        if args.warmup > 0:  # each server's first load ran slower (TTFT p50 3-5x): it is run here, not counted
            for i in sorted(live):
                warm(live[i], max(args.clients), args)
        for n, clients in enumerate(args.clients):
            order = sorted(live) if n % 2 == 0 else sorted(live, reverse=True)
            for i in order:
                measure(runs[i], live[i], clients, args)
    finally:
        for i, got in live.items():
            stop_engine(runs[i], got.proc)


def print_table(runs: list[Engine], args: argparse.Namespace) -> None:
    """One row per engine x client count (a server that did not start gets one row saying so)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"streaming clients for {args.duration:g} s each, max_tokens {args.max_tokens}, "
                    f"{args.threads} threads per server")
    for c in ("engine", "weights", "clients", "requests", "tok/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "errors",
              "RSS MiB"):
        t.add_column(c, justify="left" if c in ("engine", "weights") else "right")
    for e in runs:
        if e.error:
            t.add_row(e.name, e.weights, "-", "-", "-", "-", "-", "failed to start", "-")
        for p in e.points:
            t.add_row(e.name, e.weights, str(p["clients"]), str(p["requests"]), f"{p['tokens_per_s']:,}",
                      f"{p['ttft_p50_ms']} / {p['ttft_p99_ms']}", f"{p['itl_p50_ms']} / {p['itl_p99_ms']}",
                      str(p["errors"]), str(p["server_rss_mib_after"]))
    Console(width=160).print(t)


def _pipelines(text: str) -> list[tuple[int, int]]:
    """'2x2,4x4' -> [(2, 2), (4, 4)] (an argparse type)."""
    out = []
    for part in text.split(","):
        try:
            S, M = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected SxM like 2x2, got {part!r}") from None
        if S < 2 or M < 1:
            raise argparse.ArgumentTypeError(f"{part}: S >= 2 stages and M >= 1 micro-batches")
        out.append((S, M))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64],
                    help="comma-separated client counts (default 1,4,16,64)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per client count during which clients "
                    "start new requests")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=float, default=5.0,
                    help="seconds of the largest client count's load each server gets once before the measured points, "
                         "not recorded (default 5; 0: only the one warm-up request)")
    ap.add_argument("--prompt-chars", type=int, default=120)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads of every server (waferline --torch-threads, llama.cpp --n_threads[_batch])")
    ap.add_argument("--context", type=int, default=256,
                    help="context per sequence (waferline --max-model-len, llama.cpp --n_ctx)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="waferline sequences decoded together")
    ap.add_argument("--int4-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="waferline int4's activation dtype (default bfloat16: W4A16, with the fused layer "
                         "operators; under float32 the int4 products still take bf16 inputs, converted around each, "
                         "and the fused layer operators are off)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the dtype of waferline's 16/32-bit row (bfloat16 weights are fast only with AVX-512 BF16)")
    ap.add_argument("--group-size", type=int, default=128, help="waferline int4 group size (Q4_0 uses 32)")
    ap.add_argument("--head-bits", type=int, default=8, choices=[8, 16],
                    help="waferline int4's LM head bits (default 8: llama.cpp's Q4_0 file stores its output "
                         "projection as Q6_K)")
    ap.add_argument("--pipelines", type=_pipelines, default=[], metavar="SxM[,SxM...]",
                    help="also serve the 16/32-bit row (or int4: --pipeline-weights) as a pipeline of S stage "
                         "processes with M micro-batches, "
                         "--threads threads in each (e.g. 2x2: beside the one-process row, what a second core "
                         "buys as a stage)")
    ap.add_argument("--pipeline-weights", default="dense", choices=["dense", "int4"],
                    help="which row --pipelines serves as stages: the 16/32-bit one (dense, default) or int4")
    ap.add_argument("--engines", type=lambda s: s.split(","), default=None,
                    help="subset: engine or engine:weights prefix, e.g. 'waferline:int4,llama.cpp' (default: all)")
    ap.add_argument("--llama-cpp-src", default=None, help="vendor/llama.cpp of the llama-cpp-python sdist "
                    "(for convert_hf_to_gguf.py; default: extracted from --llama-cpp-sdist or a pip download)")
    ap.add_argument("--llama-cpp-sdist", default=None, help="llama_cpp_python-<version>.tar.gz")
    ap.add_argument("--out", default="benchmarks/results/serve_load_vs_llamacpp.json")
    args = ap.parse_args()
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(args.out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    bad = [s for s in args.engines or [] if s.split(":")[0] not in ("waferline", "llama.cpp")]
    if bad:
        ap.error(f"--engines {','.join(args.engines)}: unknown engine {', '.join(bad)}; give waferline or llama.cpp, "
                 "optionally with a weights prefix (e.g. waferline:int4,llama.cpp:Q4_0)")

    t_start = time.perf_counter()
    missing = llama_cpp_missing()
    if not engines(args, Path("hf"), None if missing else {"q4_0": Path(), "f16": Path()}):  # (before the builds)
        print(f"no server left to run for --engines {','.join(args.engines)}", file=sys.stderr)
        if missing:
            print(missing, file=sys.stderr)
        raise SystemExit(1)
    d = build_checkpoint("llama", False, CACHE)
    gguf = None
    if missing:
        print(missing, flush=True)
    else:
        # the converter is looked up (and possibly fetched) only while the f16 GGUF is not cached yet
        f16_cached = (d / "model-f16.gguf").is_file()
        converter = d if f16_cached else find_converter(args.llama_cpp_src, args.llama_cpp_sdist, CACHE)
        gguf = build_gguf(d, converter, args.threads)
    runs = engines(args, d / "hf", gguf)
    mach = machine()
    with tempfile.TemporaryDirectory(prefix="serve_load_") as logdir:
        run_all(runs, args, Path(logdir))
    print_table(runs, args)
    if missing:
        print(missing)
    import torch
    import transformers

    result = {
        "machine": mach, "load_avg_after": os.getloadavg(), "threads": args.threads,
        "versions": {"python": platform.python_version(), "waferline": _pkg_version("waferline"),
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "llama_cpp_python": _pkg_version("llama_cpp_python")},
        "checkpoint": {"name": "llama", "path": str(d / "hf"), "gguf": {k: str(v) for k, v in (gguf or {}).items()},
                       "weights": "random (speed only)"},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "llama_cpp_skipped": missing,
        "total_s": round(time.perf_counter() - t_start, 1),
        "runs": [{"engine": e.name, "weights": e.weights, "command": e.cmd, "error": e.error,
                  "startup_s": e.startup_s, "stop_s": e.stop_s, "points": e.points}
                 for e in runs],
    }
    out = Path(args.out)
    write_text_atomic(out, json.dumps(result, indent=1), make_parents=True)
    print(f"wrote {out} ({result['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
