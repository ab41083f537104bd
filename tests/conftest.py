"""Shared test fixtures."""

import importlib.util
import sys
import threading
from pathlib import Path

import pytest
import torch


def script_module(name: str):
    """Yield benchmarks/<name>.py loaded as a module (registered in sys.modules while in use: its dataclasses look
    their module up there), for a module-scoped fixture of a test of that script."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test",
                                                  Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def tiny_checkpoints(tmp_path_factory, model_types) -> dict:
    """model_type -> a directory holding a tiny random checkpoint of it (tests/tiny_models.py), for a module-scoped
    fixture."""
    from tiny_models import build

    out = {}
    for mt in model_types:
        d = tmp_path_factory.mktemp(mt)
        build(mt, d)
        out[mt] = d
    return out


@pytest.fixture(scope="module")
def one_thread():
    """Many tiny ops (and several processes) on a 2-core machine: one intra-op thread avoids OpenMP oversubscription."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ---------------------------------------------------------------- the server tests' live server

@pytest.fixture(scope="module")
def threads(one_thread):
    """The server tests' name for one_thread."""


@pytest.fixture(scope="module")
def sol(tmp_path_factory):
    """A random sol demo checkpoint with a tokenizer (the server tests')."""
    from waferline.demo import DEMO_TEXT, SOL_DEMO_CONFIG, write_tokenizer
    from waferline.model.init import write_random_checkpoint

    d = tmp_path_factory.mktemp("sol-serve")
    write_random_checkpoint(SOL_DEMO_CONFIG, d)
    write_tokenizer(d, DEMO_TEXT, SOL_DEMO_CONFIG["vocab_size"])
    return d


@pytest.fixture(scope="module")
def live(sol, threads):
    """A live server in this process (uvicorn in a thread) on a free loopback port."""
    from server_helpers import KEY, MAX_LEN, serve_in_thread
    from waferline.server.commands import build_server

    app = build_server(sol, max_num_seqs=16, max_model_len=MAX_LEN, api_key=KEY, served_model_name="sol-test",
                       max_body_bytes=64 * 1024, chunk_tokens=32)
    with serve_in_thread(app) as base:
        app.state.base = base
        yield app


@pytest.fixture(scope="module")
def client(live):
    import openai

    from server_helpers import KEY

    return openai.OpenAI(base_url=live.state.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def raised_in_thread(fn) -> BaseException | None:
    """Run fn in a thread (a hang must not block the test run: it fails the test after 60 s) and return what it
    raised."""
    box: dict = {}

    def target():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["e"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the call hung instead of raising"
    return box.get("e")
