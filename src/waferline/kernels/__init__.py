"""waferline's fused CPU operators (``torch.ops.waferline.*``), built from ``cpu_ops.cpp`` on first use.

The build (torch.utils.cpp_extension with ninja, ~15 s on 2 cores) happens once per machine and source version and
is cached under ``~/.cache/waferline/kernels/`` (``WAFERLINE_KERNELS_DIR`` overrides); stage processes that start
together share it (cpp_extension locks the build directory). Where no compiler or ninja is available the build
fails once, a warning says why, and every caller keeps its eager path. ``WAFERLINE_KERNELS=0`` turns the operators
off (the eager path everywhere); ``use(False)`` does the same inside a process (tests compare both paths).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

_SRC = Path(__file__).with_name("cpu_ops.cpp")
# -fno-trapping-math: no code relies on floating-point exception flags; it lets the compiler vectorise floor() and
# float -> int conversions (vexp in cpu_ops.cpp)
_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-march=native"]
_lock = threading.Lock()
_state: dict[str, object] = {"loaded": None, "enabled": os.environ.get("WAFERLINE_KERNELS", "1") != "0", "error": None}


def _cpu_flags() -> str:
    """This CPU's feature flags: the build uses -march=native, so a build is only reused on the same kind of CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


def build_dir() -> Path:
    root = os.environ.get("WAFERLINE_KERNELS_DIR") or (Path.home() / ".cache" / "waferline" / "kernels")
    import torch

    tag = hashlib.sha256(_SRC.read_bytes() + " ".join(_CFLAGS).encode() + torch.__version__.encode()
                         + _cpu_flags().encode()).hexdigest()[:12]
    return Path(root) / f"cpu_ops-{tag}"


def _load() -> bool:
    import torch

    if hasattr(torch.ops.waferline, "rms_norm") if hasattr(torch.ops, "waferline") else False:
        return True
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the `ninja` wheel's binary sits beside this interpreter, maybe not on PATH
        bin_dir = getattr(_ninja_module(), "BIN_DIR", None)
        for cand in [Path(sys.executable).parent] + ([Path(bin_dir)] if bin_dir else []):
            if (cand / "ninja").exists():
                os.environ["PATH"] = f"{cand}{os.pathsep}{os.environ.get('PATH', '')}"
                break
    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    _drop_stale_lock(d / "lock")
    with _watching_lock(d / "lock"):  # a build killed while this process waits on its lock must not hang it
        cpp_extension.load(name="waferline_cpu_ops", sources=[str(_SRC)], build_directory=str(d),
                           extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    return True


STALE_LOCK_S = 600.0  # a build takes ~15-60 s here; a lock this old was left by a process killed mid-build


def _drop_stale_lock(lock: Path) -> None:
    """Remove a build lock left behind by a process killed while it built: cpp_extension waits on an existing lock
    for as long as it exists, so every later process would hang at its first fused operator."""
    import time

    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass


class _watching_lock:
    """While a build runs (or waits on another process's build), drop ``lock`` once it goes stale: cpp_extension
    checks nothing but the lock's existence while it waits, so a process that began waiting on a live build whose
    owner was then killed waited forever (seen: a calibration killed mid-build left a benchmark's process asleep)."""

    def __init__(self, lock: Path, every_s: float = 5.0) -> None:
        self.lock, self.every_s, self.stop = lock, every_s, threading.Event()

    def __enter__(self) -> "_watching_lock":
        def watch() -> None:
            while not self.stop.wait(self.every_s):
                _drop_stale_lock(self.lock)

        threading.Thread(target=watch, name="waferline-kernel-lock", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()


def _ninja_module() -> object | None:
    try:
        import ninja  # type: ignore[import-not-found]

        return ninja
    except ImportError:
        return None


def available() -> bool:
    """True when the fused operators are on and loaded (builds them on the first call; False where that fails)."""
    if not _state["enabled"]:
        return False
    if _state["loaded"] is None:
        with _lock:
            if _state["loaded"] is None:
                try:
                    _state["loaded"] = _load()
                except Exception as e:  # noqa: BLE001 - no compiler, no ninja, ...: the eager path stays
                    _state["loaded"] = False
                    _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                    warnings.warn(f"waferline: fused CPU operators unavailable ({_state['error']}); using the eager path",
                                  RuntimeWarning, stacklevel=2)
    return bool(_state["loaded"])


def use(on: bool) -> bool:
    """Turn the fused operators on or off in this process; returns the previous setting."""
    prev = bool(_state["enabled"])
    _state["enabled"] = bool(on)
    return prev


def status() -> dict[str, object]:
    """What the operators' state is (for `waferline` diagnostics and benchmarks)."""
    return {"enabled": bool(_state["enabled"]), "loaded": _state["loaded"], "error": _state["error"],
            "build_dir": str(build_dir())}
