"""How waferline.kernels builds, caches and loads the fused CPU operators."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from waferline import kernels
from waferline.errors import ConfigError

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"fused CPU operators not built: {kernels.status()['error']}")


# ---------------------------------------------------------------- the build: cached, loaded without ninja, announced

def _fake_compile(monkeypatch, calls: list, fail: bool = False) -> None:
    """Stand in for the C++ build (a minute): _compile "builds" by copying the library this test run already loaded."""
    real = kernels.library()
    assert real.is_file()

    def compile_(out):
        calls.append(out)
        if fail:
            raise RuntimeError("no compiler here")
        (out / "half-written.o").write_bytes(b"\0")
        shutil.copyfile(real, out / "waferline_cpu_ops.so")

    monkeypatch.setattr(kernels, "_compile", compile_)


def _as_if_unloaded(monkeypatch) -> list:
    """This process as one that has not loaded the operators yet: load_library records its path instead (the library
    is loaded here already; a second copy would register the operators twice)."""
    loaded: list = []
    monkeypatch.setattr(kernels, "_registered", lambda: False)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(Path(path)))
    monkeypatch.setitem(kernels._state, "loaded", None)
    monkeypatch.setitem(kernels._state, "error", None)
    return loaded


def test_a_cached_build_loads_without_ninja_or_cpp_extension(tmp_path):
    """A process that finds this key's library in the cache loads it directly: a `ninja` first on PATH (here one that
    fails and leaves a mark) is never run, cpp_extension is not imported, and nothing is announced."""
    lib = kernels.library()
    assert lib.is_file()
    bogus = tmp_path / "bin"
    bogus.mkdir()
    mark = tmp_path / "ninja-ran"
    (bogus / "ninja").write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    (bogus / "ninja").chmod(0o755)
    code = ("import sys, torch\nfrom waferline import kernels\nassert kernels.prepare(), kernels.status()\n"
            "y = torch.ops.waferline.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)\nassert y.shape == (2, 8)\n"
            "assert 'torch.utils.cpp_extension' not in sys.modules\nprint(kernels.library())\n")
    env = {**os.environ, "PATH": f"{bogus}{os.pathsep}{os.environ.get('PATH', '')}",
           "WAFERLINE_KERNELS_DIR": str(lib.parent.parent), "WAFERLINE_KERNELS": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(lib)
    assert not mark.exists() and kernels.BUILDING not in r.stderr


def test_prepare_announces_a_build_and_only_a_build(tmp_path, monkeypatch, capsys):
    """prepare() builds where the cache lacks this key's library, with one line on stderr (the build, then done); a
    directory of this key without the library (a build stopped part-way) is rebuilt and replaced, and leftovers of
    a killed build are removed. Once built, prepare() loads that library and prints nothing; available() builds
    without a word."""
    calls: list = []
    _fake_compile(monkeypatch, calls)
    monkeypatch.setenv("WAFERLINE_KERNELS_DIR", str(tmp_path / "cache"))
    d = kernels.build_dir()
    d.mkdir(parents=True)
    (d / "build.ninja").write_text("")  # half-built: no library
    dead = d.parent / f".{d.name}.tmp-killed"
    dead.mkdir()
    (dead / "waferline_cpu_ops.so").write_bytes(b"\x7fELF truncated")
    loaded = _as_if_unloaded(monkeypatch)

    assert kernels.prepare()
    err = capsys.readouterr().err
    assert err.startswith(kernels.BUILDING) and err.rstrip().endswith("s)") and " done (" in err
    assert err.count("\n") == 1
    assert len(calls) == 1 and loaded == [d / "waferline_cpu_ops.so"]
    assert (d / "waferline_cpu_ops.so").read_bytes() == kernels.library().read_bytes()
    assert not (d / "build.ninja").exists()  # the half-built directory was replaced by the build's
    assert not list(d.parent.glob(".*.tmp-*"))  # the killed build's directory and this build's are gone

    monkeypatch.setitem(kernels._state, "loaded", None)
    assert kernels.prepare()
    assert capsys.readouterr().err == "" and len(calls) == 1 and len(loaded) == 2  # cached: loaded, not built

    shutil.rmtree(d)
    monkeypatch.setitem(kernels._state, "loaded", None)
    assert kernels.available()
    assert capsys.readouterr().err == "" and len(calls) == 2  # built again, silently


def test_a_failed_build_leaves_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    """A build that fails: prepare() finishes its line with "failed", returns False with a warning (the eager path
    stays), and leaves no cache entry and no build directory behind for a later process to load."""
    _fake_compile(monkeypatch, [], fail=True)
    monkeypatch.setenv("WAFERLINE_KERNELS_DIR", str(tmp_path / "cache"))
    _as_if_unloaded(monkeypatch)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        assert not kernels.prepare()
    err = capsys.readouterr().err
    assert err.startswith(kernels.BUILDING) and "failed" in err
    assert not kernels.build_dir().exists() and not list((tmp_path / "cache").glob(".*.tmp-*"))
    assert "no compiler here" in str(kernels.status()["error"])


def test_a_library_cut_short_in_the_cache_is_built_again(tmp_path, monkeypatch):
    """A cached library cut short (a copy or a disk write stopped part-way) is built again, not loaded: dlopen maps
    it and the process died of SIGBUS. Where the build fails too (here no compiler), the eager path runs."""
    real = kernels.library()
    calls: list = []
    _fake_compile(monkeypatch, calls)  # (copies `real`)
    monkeypatch.setenv("WAFERLINE_KERNELS_DIR", str(tmp_path / "cache"))
    lib = kernels.library()
    lib.parent.mkdir(parents=True)
    lib.write_bytes(real.read_bytes()[: real.stat().st_size // 2])
    code = ("import torch\nfrom waferline import kernels\nprint(kernels.prepare())\n"
            "print(torch.nn.functional.rms_norm(torch.ones(2, 8), (8,)).shape)\n")
    env = {**os.environ, "CXX": "/bin/false", "WAFERLINE_KERNELS": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["False", "torch.Size([2,", "8])"], (r.returncode, r.stderr)
    assert "using the eager path" in r.stderr and "Traceback" not in r.stderr

    assert kernels._built(False) == lib
    assert len(calls) == 1 and lib.read_bytes() == real.read_bytes()


def test_a_missing_compiler_is_named_in_the_one_line_reason(tmp_path, monkeypatch):
    """No C++ compiler on PATH: the build fails with a reason that says so (it read "ninja: build stopped: subcommand
    failed.", after torch's many-line banner calling the missing compiler "not compatible")."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CXX", raising=False)
    (tmp_path / "out").mkdir()
    with pytest.raises(Exception) as e:
        kernels._compile(tmp_path / "out")
    assert "no C++ compiler" in kernels._reason(e.value) and "c++" in kernels._reason(e.value)


def test_an_interrupted_build_says_it_stopped_not_failed(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the first build: the line ends "stopped" (it read "failed (KeyboardInterrupt: )"), the interrupt
    goes on to the caller, and no half-built entry is left."""
    monkeypatch.setattr(kernels, "_compile", lambda out: (_ for _ in ()).throw(KeyboardInterrupt()))
    monkeypatch.setenv("WAFERLINE_KERNELS_DIR", str(tmp_path / "cache"))
    with pytest.raises(KeyboardInterrupt):
        kernels._built(True)
    err = capsys.readouterr().err
    assert err.startswith(kernels.BUILDING) and "stopped (interrupted" in err and "failed" not in err
    assert not kernels.build_dir().exists() and not list((tmp_path / "cache").glob(".*.tmp-*"))


def test_a_build_waits_for_another_process_and_loads_its_library(tmp_path, monkeypatch):
    """Processes that start together take turns on the key's lock: one that finds another building waits, then loads
    the library that one made instead of building again; a lock whose holder was killed does not hold anyone up."""
    calls: list = []
    real = kernels.library()
    _fake_compile(monkeypatch, calls)
    monkeypatch.setenv("WAFERLINE_KERNELS_DIR", str(tmp_path / "cache"))
    d = kernels.build_dir()
    d.parent.mkdir(parents=True)
    lock = d.parent / f"{d.name}.lock"
    holder = subprocess.Popen([sys.executable, "-c", f"import fcntl, time\nf = open({str(lock)!r}, 'a')\n"
                               "fcntl.flock(f, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(120)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        got: list = []
        t = threading.Thread(target=lambda: got.append(kernels._built(False)), daemon=True)
        t.start()
        t.join(0.5)
        assert t.is_alive() and not calls  # waiting on the other process's build
        staged = d.parent / "staged"
        staged.mkdir()
        shutil.copyfile(real, staged / "waferline_cpu_ops.so")
        staged.rename(d)  # the other process's build, renamed into place
        holder.kill()  # killed while holding the lock: the system releases it
        t.join(30)
        assert got == [d / "waferline_cpu_ops.so"] and not calls
    finally:
        holder.kill()
        holder.wait()


def test_the_cache_key_covers_every_source_file_and_the_version(tmp_path, monkeypatch):
    """The cache entry's name changes with any byte of cpu_ops.cpp or of a part it includes (cpu/*.h) and with
    waferline's version, so a changed source or an upgrade never loads an older build."""
    pkg = tmp_path / "kernels"
    shutil.copytree(Path(kernels.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    monkeypatch.setattr(kernels, "_PKG", pkg)
    monkeypatch.setattr(kernels, "_SRC", pkg / "cpu_ops.cpp")
    assert {p.name for p in kernels.sources()} >= {"cpu_ops.cpp", "common.h", "gqa.h", "mla.h", "mamba.h"}
    seen = {kernels.build_dir()}
    for p in kernels.sources():
        p.write_bytes(p.read_bytes() + b"\n")
        seen.add(kernels.build_dir())
    monkeypatch.setattr(kernels, "__version__", "0.0.0-other")
    seen.add(kernels.build_dir())
    assert len(seen) == len(kernels.sources()) + 2


def test_the_package_ships_every_source_file():
    """pyproject's package data takes cpu_ops.cpp and every part it includes: an installed waferline can build them."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["waferline"]
    pkg = root / "src" / "waferline"
    def ships(rel: str, pattern: str) -> bool:  # as setuptools globs them: `*` within one path component
        a, b = rel.split("/"), pattern.split("/")
        return len(a) == len(b) and all(fnmatch.fnmatch(x, y) for x, y in zip(a, b))

    for p in kernels.sources():
        rel = p.resolve().relative_to(pkg).as_posix()
        assert any(ships(rel, pat) for pat in patterns), rel


def test_serve_prepares_the_operators_before_it_listens(monkeypatch, tmp_path, capsys):
    """`waferline serve` builds or loads the fused operators before it loads the model and listens: /health answers
    only once they are ready, and no request waits on their build; a --model that is no directory is refused before
    the build (a first build takes minutes)."""
    import argparse
    import types

    import uvicorn

    from waferline.server import commands

    order: list = []
    monkeypatch.setattr(kernels, "prepare", lambda progress=True: order.append("prepare") or True)
    cache = types.SimpleNamespace(describe=lambda: "cache 1.0 MiB: ...")
    engine = types.SimpleNamespace(shutdown=lambda: order.append("shutdown"), torch_threads=1,
                                   scheduler=types.SimpleNamespace(cache=cache))
    server = types.SimpleNamespace(model_name="m", engine=engine, stop_requests=lambda *a: None)
    app = types.SimpleNamespace(state=types.SimpleNamespace(server=server))
    monkeypatch.setattr(commands, "build_server", lambda *a, **k: order.append("build_server") or app)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: order.append("listen") or setattr(
        self, "started", True))
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", str(tmp_path)])
    assert args.func(args) == 0
    assert order == ["prepare", "build_server", "listen", "shutdown"]
    out = capsys.readouterr().out  # (what the engine's threads and its cache are, said at start)
    assert "/v1 (engine: 1 torch thread)\nwaferline: cache 1.0 MiB: ..." in out
    order.clear()
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        args.func(parser.parse_args(["serve", "--model", str(tmp_path / "missing")]))
    assert order == []
