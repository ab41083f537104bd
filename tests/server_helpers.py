"""Helpers of the server tests (tests/test_server.py, tests/test_server_hardening.py); their fixtures (sol, live,
client) are in conftest.py."""

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx

KEY = "sk-test-key"
MAX_LEN = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until(cond, limit=30.0, every=0.05):
    """Poll ``cond`` until it is truthy (returns its value) or ``limit`` seconds pass (returns the last value)."""
    end = time.monotonic() + limit
    while True:
        v = cond()
        if v or time.monotonic() > end:
            return v
        time.sleep(every)


@contextlib.contextmanager
def env_launch_worker(model, monkeypatch) -> Iterator[subprocess.Popen]:
    """A hand-set env:// launch of a 2-stage pipeline on loopback: rank 1 (``serve_from_env``) in its own process,
    this process rank 0 (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set with ``monkeypatch``); yields the rank-1
    process, killed (if it still runs) and reaped at the end."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    code = ("import sys\nfrom waferline.engine.pipeline import serve_from_env\n"
            "sys.exit(serve_from_env(sys.argv[1], stages=2, threads_per_stage=1))")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    worker = subprocess.Popen([sys.executable, "-c", code, str(model)], env={**os.environ, "PYTHONPATH": src, **env})
    try:
        for k, v in dict(env, RANK="0").items():
            monkeypatch.setenv(k, v)
        yield worker
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait()


def start_serve(model, *flags: str, limit: float = 60.0) -> tuple[subprocess.Popen, int]:
    """``waferline serve --model model *flags`` in its own process on a free loopback port (one torch thread), once
    /health says ok: (the process, its port). Its stdout and stderr together are the process's stdout."""
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "waferline.cli", "serve", "--model", str(model), "--port", str(port),
                          *flags], env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)

    def healthy():
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return p.poll() is not None
    try:
        assert _wait_until(healthy, limit, 0.2) and p.poll() is None, p.stdout.read() if p.poll() is not None else ""
    except BaseException:
        p.kill()
        p.wait(20)
        raise
    return p, port


@contextlib.contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Run ``app`` (build_server's) under uvicorn in a thread on a free loopback port; yields its base URL, then stops
    the server and its engine."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        assert _wait_until(lambda: server.started, 30), "server did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(10)
        app.state.server.engine.shutdown()


def _metrics(live) -> dict[str, float]:
    out = {}
    for line in httpx.get(live.state.base + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _pages_in_use(live) -> float:
    return sum(v for k, v in _metrics(live).items() if k.startswith("waferline_cache_pages_in_use"))


def _assert_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"]
    return err


def fail_sampling(live, monkeypatch, which):
    """The live server's sampler raises for a sequence ``which(seq)`` selects, at its third token; returns what puts
    the sampler back."""
    sch = live.state.server.engine.scheduler
    sample = sch._sample

    def failing(seq, logits, greedy=None):
        if which(seq) and len(seq.output_ids) == 2:
            raise ValueError("injected")
        return sample(seq, logits, greedy)

    monkeypatch.setattr(sch, "_sample", failing)
    return lambda: monkeypatch.setattr(sch, "_sample", sample)


def run_to_end(sch, seqs, max_steps=2000) -> list[list[int]]:
    """Add ``seqs`` to the scheduler ``sch`` and step it until nothing is left: each sequence's token ids."""
    got = {s.request_id: [] for s in seqs}
    for s in seqs:
        s.sink = lambda ev, rid=s.request_id: got[rid].append(ev.token_id) if ev.token_id is not None else None
        sch.add(s)
    steps = 0
    while sch.has_work() and steps < max_steps:
        sch.step()
        steps += 1
    return [got[s.request_id] for s in seqs]


def int4_with_tokenizer(src, dst, group_size: int = 32):
    """``src`` quantized to int4 (RTN, ``group_size``) at ``dst``, with ``src``'s tokenizer files beside it (a served
    checkpoint needs them): ``dst``."""
    import shutil
    from pathlib import Path

    from waferline.model.quant import QuantOptions
    from waferline.model.quant.write import quantize_checkpoint

    src, dst = Path(src), Path(dst)
    quantize_checkpoint(src, dst, QuantOptions(group_size=group_size))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (src / f).exists() and not (dst / f).exists():
            shutil.copy(src / f, dst / f)
    return dst


@contextlib.contextmanager
def chat_template(server, template: str) -> Iterator[None]:
    """The live ``server`` renders chats with ``template`` (its tokenizer and its encoding copy) in the block."""
    tok = server.llm.tokenizer
    saved = tok.chat_template, server.encode_tokenizer.chat_template
    tok.chat_template = server.encode_tokenizer.chat_template = template
    try:
        yield
    finally:
        tok.chat_template, server.encode_tokenizer.chat_template = saved
