"""waferline's fused CPU operators (``torch.ops.waferline.*``), compiled from ``cpu_ops.cpp`` and its parts ``cpu/*.h``.

They are built once per machine (torch.utils.cpp_extension with ninja, 1-2 min on 2 cores) into a directory of
``~/.cache/waferline/kernels/`` (``WAFERLINE_KERNELS_DIR`` overrides) named by a hash of every source file's bytes, the
compiler flags, torch's and waferline's versions and this CPU's features. A process that finds the library there
loads it directly (torch.ops.load_library), without cpp_extension, a compiler or ninja: nothing is rebuilt because
another ``ninja`` is first on PATH. A build runs in a temporary directory beside the cache entry and is renamed into
place once the library is complete, so a build killed part-way leaves nothing that a later process loads; a library
cut short in the cache (a copy or a disk write stopped part-way: loading it would kill the process with SIGBUS) is
built again. Processes that start together take turns on a lock file (flock: the system releases it when its holder
exits, killed or not); the first builds, the others then load its library.

``prepare()`` builds or loads them up front and, when it has to build, says so on stderr in one line (``waferline
serve`` calls it before it listens, so /health is not ok while they build; a local pipeline's or AFD's driver before
it starts its stage processes, which keep the eager path where it failed); otherwise the first fused operator builds
them, silently. Where no compiler or ninja is available the build fails once, a warning says why, and every caller
keeps its eager path. ``WAFERLINE_KERNELS=0`` turns the operators off (the eager path everywhere); ``use(False)`` does
the same inside a process (tests compare both paths).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from waferline._version import __version__

_PKG = Path(__file__).parent
_SRC = _PKG / "cpu_ops.cpp"
_NAME = "waferline_cpu_ops"
_LIB = f"{_NAME}.so"  # what cpp_extension.load names the library it builds (is_python_module=False)
# -fno-trapping-math: no code relies on floating-point exception flags; it lets the compiler vectorise floor() and
# float -> int conversions (vexp in cpu/common.h)
_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-march=native"]
BUILDING = "building waferline's CPU operators (first run, 1-2 min)..."
_lock = threading.Lock()
_state: dict[str, object] = {"loaded": None, "enabled": os.environ.get("WAFERLINE_KERNELS", "1") != "0", "error": None}


def sources() -> list[Path]:
    """Every file the operators are compiled from: cpu_ops.cpp and the parts it includes (cpu/*.h)."""
    return [_SRC, *sorted((_PKG / "cpu").glob("*.h"))]


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
    """The cache entry for these sources, flags, torch and waferline versions and CPU; the library is ``library()``."""
    import torch

    root = os.environ.get("WAFERLINE_KERNELS_DIR") or (Path.home() / ".cache" / "waferline" / "kernels")
    h = hashlib.sha256()
    for p in sources():
        h.update(p.relative_to(_PKG).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    h.update("\0".join([" ".join(_CFLAGS), torch.__version__, __version__, _cpu_flags()]).encode())
    return Path(root) / f"cpu_ops-{h.hexdigest()[:12]}"


def library() -> Path:
    """Where the built library is (or will be) for this process's key."""
    return build_dir() / _LIB


def _registered() -> bool:
    import torch

    return hasattr(torch.ops, "waferline") and hasattr(torch.ops.waferline, "rms_norm")


def _load(progress: bool) -> bool:
    import torch

    if _registered():
        return True
    lib = _built(progress)
    if not _registered():  # (the build itself loads the library it made, from where it made it)
        torch.ops.load_library(str(lib))
    return True


def _built(progress: bool) -> Path:
    """The library for this key, built first where the cache has none (a line on stderr about it with ``progress``)."""
    d = build_dir()
    lib = d / _LIB
    if _whole(lib):
        return lib
    t0 = time.monotonic()
    if progress:
        print(BUILDING, end="", file=sys.stderr, flush=True)
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        with _build_lock(d.parent / f"{d.name}.lock"):
            if not _whole(lib):  # (else another process built it while this one waited)
                _build_into(d)
    except BaseException as e:
        if progress:  # (Ctrl-C: the build stopped, nothing failed; the next run builds again)
            said = " stopped (interrupted; the next run builds again)" if isinstance(e, KeyboardInterrupt) \
                else f" failed ({_reason(e)})"
            print(said, file=sys.stderr, flush=True)
        raise
    if progress:
        print(f" done ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    return lib


def _build_into(d: Path) -> None:
    """Build the library into a fresh temporary directory and rename that to ``d`` once the library is there. Runs
    under the build lock: temporary directories of this key left by builds killed part-way are removed first."""
    for stale in d.parent.glob(f".{d.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.tmp-", dir=d.parent))
    tmp.chmod(0o755)  # (mkdtemp makes it private; the cache entry it becomes is read by every process)
    try:
        _compile(tmp)
        built = sorted(tmp.glob("*.so"))
        if not built:
            raise RuntimeError(f"the build in {tmp} made no library")
        if built[0].name != _LIB:
            built[0].rename(tmp / _LIB)
        for obj in tmp.glob("*.o"):  # (the library is all a later process loads)
            obj.unlink()
        if d.exists():  # a directory without a whole library (a build of another layout, stopped part-way): replaced
            shutil.rmtree(d)
        tmp.rename(d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _whole(lib: Path) -> bool:
    """Whether ``lib`` is there and as long as its ELF header says: its program headers, loaded segments and section
    table lie inside the file. dlopen maps a library cut short without complaint, and the first touch of a missing
    page kills the process with SIGBUS. (A file of another format, on another platform, is not checked.)"""
    try:
        with open(lib, "rb") as f:
            data = f.read()
    except OSError:
        return False
    if data[:4] != b"\x7fELF":
        return not sys.platform.startswith("linux") and bool(data)
    try:
        e = "<" if data[5] == 1 else ">"
        if data[4] == 2:  # ELF64: e_phoff, e_shoff; e_phentsize, e_phnum, e_shentsize, e_shnum; p_offset, p_filesz
            phoff, shoff = struct.unpack_from(e + "QQ", data, 32)
            phsz, phn, shsz, shn = struct.unpack_from(e + "HHHH", data, 54)
            segs = [struct.unpack_from(e + "I4xQ16xQ", data, phoff + i * phsz) for i in range(phn)]
        else:  # ELF32
            phoff, shoff = struct.unpack_from(e + "II", data, 28)
            phsz, phn, shsz, shn = struct.unpack_from(e + "HHHH", data, 42)
            segs = [struct.unpack_from(e + "II8xI", data, phoff + i * phsz) for i in range(phn)]
    except struct.error:  # (the headers themselves are cut off)
        return False
    ends = [shoff + shn * shsz] + [off + size for kind, off, size in segs if kind == 1]  # (PT_LOAD)
    return len(data) >= max(ends)


def _compile(out: Path) -> None:
    """Compile the operators into directory ``out`` (torch.utils.cpp_extension + ninja; it also loads the library)."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")  # the compiler cpp_extension runs
    if shutil.which(cxx.split()[0] if cxx.split() else cxx) is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (install g++, or name one in CXX)")
    if shutil.which("ninja") is None:  # the `ninja` wheel's binary sits beside this interpreter, maybe not on PATH
        bin_dir = getattr(_ninja_module(), "BIN_DIR", None)
        for cand in [Path(sys.executable).parent] + ([Path(bin_dir)] if bin_dir else []):
            if (cand / "ninja").exists():
                os.environ["PATH"] = f"{cand}{os.pathsep}{os.environ.get('PATH', '')}"
                break
    cpp_extension.load(name=_NAME, sources=[str(_SRC)], build_directory=str(out), extra_cflags=_CFLAGS,
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (waiting while another process holds it). flock: the system releases it when
    its holder exits, so a build killed part-way never leaves a lock that later processes wait on."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system (no fcntl), where the build (a .so) does not apply anyway
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ninja_module() -> object | None:
    try:
        import ninja  # type: ignore[import-not-found]

        return ninja
    except ImportError:
        return None


def _reason(e: BaseException) -> str:
    """An exception in one line: a failed build's first compiler error (its message ends with ninja's "build stopped"
    line), else the message's last line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    first_error = next((ln for ln in lines if "error:" in ln), None)
    return f"{type(e).__name__}: {first_error or (lines[-1] if lines else '')}"


def _ready(progress: bool) -> bool:
    if not _state["enabled"]:
        return False
    if _state["loaded"] is None:
        with _lock:
            if _state["loaded"] is None:
                try:
                    _state["loaded"] = _load(progress)
                except Exception as e:  # noqa: BLE001 - no compiler, no ninja, ...: the eager path stays
                    _state["loaded"] = False
                    _state["error"] = _reason(e)
                    warnings.warn(f"waferline: fused CPU operators unavailable ({_state['error']}); using the eager "
                                  "path", RuntimeWarning, stacklevel=3)
    return bool(_state["loaded"])


def available() -> bool:
    """True when the fused operators are on and loaded (builds them on the first call; False where that fails)."""
    return _ready(progress=False)


def prepare(progress: bool = True) -> bool:
    """Build (where this machine's cache has no build of them) and load the fused operators now, instead of at the
    first operator call; returns ``available()``. With ``progress``, a build is announced on stderr in one line
    (``BUILDING``, then ``done (N s)`` or ``failed``); loading a cached build prints nothing."""
    return _ready(progress)


def use(on: bool) -> bool:
    """Turn the fused operators on or off in this process; returns the previous setting."""
    prev = bool(_state["enabled"])
    _state["enabled"] = bool(on)
    return prev


def status() -> dict[str, object]:
    """What the operators' state is (for `waferline` diagnostics and benchmarks)."""
    return {"enabled": bool(_state["enabled"]), "loaded": _state["loaded"], "error": _state["error"],
            "build_dir": str(build_dir())}
