"""Shared test fixtures."""

import importlib.util
import sys
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
