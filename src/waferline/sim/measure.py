"""Measure this host (memory bandwidth, matmul FLOP/s, local link latency/bandwidth) and write a hardware YAML for it."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml


def _best(fn: Any, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _memory_bandwidth(mb: int = 256) -> float:
    n = mb * (1 << 20) // 4
    a = np.ones(n, dtype=np.float32)
    b = np.empty_like(a)
    t = _best(lambda: np.copyto(b, a))
    return 2 * a.nbytes / t  # read + write


def _matmul_flops(n: int = 1024) -> float:
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.copy()
    a @ b  # warm the BLAS threads
    t = _best(lambda: a @ b)
    return 2.0 * n ** 3 / t


def _link(rounds: int = 2000, chunk: int = 1 << 20, total: int = 64 << 20) -> tuple[float, float]:
    """(one-way latency s, bandwidth bytes/s) over a local TCP connection, as gloo uses between processes."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def echo() -> None:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            for _ in range(rounds):
                conn.sendall(conn.recv(64))
            got = 0
            while got < total:
                got += len(conn.recv(1 << 20))
            conn.sendall(b"k")

    th = threading.Thread(target=echo, daemon=True)
    th.start()
    c = socket.create_connection(("127.0.0.1", port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"x" * 64
    t = time.perf_counter()
    for _ in range(rounds):
        c.sendall(msg)
        c.recv(64)
    lat = (time.perf_counter() - t) / rounds / 2
    buf = b"y" * chunk
    t = time.perf_counter()
    sent = 0
    while sent < total:
        c.sendall(buf)
        sent += chunk
    c.recv(1)
    bw = total / (time.perf_counter() - t)
    c.close()
    srv.close()
    th.join(timeout=5)
    return lat, bw


def measure_host(quick: bool = False) -> dict[str, Any]:
    """A hardware mapping for this machine; every number says how it was measured (quick: smaller, noisier probes)."""
    host = platform.node() or "host"
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    tag = f"measured on {host} {when}"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    bw = _memory_bandwidth(32 if quick else 256)
    fl = _matmul_flops(256 if quick else 1024)
    lat, lbw = _link(rounds=100 if quick else 1000, total=(4 << 20) if quick else (64 << 20))
    cores = os.cpu_count() or 1
    return {
        "name": f"cpu-{host}".lower().replace(" ", "-"),
        "kind": "cpu",
        "placement": "pipeline",
        "description": f"This host ({platform.processor() or platform.machine()}, {cores} logical CPUs): engine stages are processes.",
        "device": {
            "memory_bytes": {"value": float(mem), "source": f"{tag}: physical memory (sysconf)"},
            "memory_bandwidth": {"value": float(bw), "source": f"{tag}: numpy copy of 256 MB, read + write bytes / best of 5"},
            "flops": {"bf16": {"value": float(fl), "source": f"{tag}: numpy float32 1024^3 matmul (bf16 on CPU is rarely faster)"}},
            "reserve_fraction": {"value": 0.2, "assumed": "OS, Python and torch runtime"},
        },
        "system": {"devices_per_node": {"value": cores, "source": f"{tag}: os.cpu_count()"}},
        "links": {
            "scale_up": {"name": "localhost-tcp",
                         "bandwidth": {"value": float(lbw), "source": f"{tag}: 64 MB over local TCP"},
                         "latency": {"value": float(lat), "source": f"{tag}: 64-byte TCP ping-pong / 2 (gloo adds its own overhead)"}},
            "scale_out": "eth-100g",
        },
    }


def write_host_yaml(path: str | Path, quick: bool = False) -> dict[str, Any]:
    d = measure_host(quick)
    Path(path).write_text("# written by `waferline calibrate --measure`; re-run to refresh\n" + yaml.safe_dump(d, sort_keys=False))
    return d
