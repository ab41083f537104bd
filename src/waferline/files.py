"""Output files: checked before the work that produces them, and written whole or not at all; and why an input file
that a directory lists cannot be opened (a symbolic link to nothing)."""

from __future__ import annotations

import os
import stat
import tempfile
import threading
from pathlib import Path

from waferline.errors import ConfigError


def check_writable(path: str | Path, what: str = "--out", file_only: bool = False) -> Path:
    """Raise ConfigError unless a file can be written at ``path``: it is not a directory, and the nearest of its
    parents that exists is a directory this process can make a file in (tried: a file made and removed; missing
    directories below it are made by ``write_text_atomic(..., make_parents=True)``); or it is a device or FIFO this
    process may write to (/dev/null, /dev/stdout), unless ``file_only`` (an output that is read back). Meant to run
    before a long job, not after it."""
    p = Path(path)
    if str(path).endswith(("/", os.sep)) or p.name in ("", ".", ".."):
        raise ConfigError(f"{what} {path}: names a directory; give a file name (e.g. {Path(path) / 'result.json'})")
    if p.is_dir():
        raise ConfigError(f"{what} {path}: is a directory; give a file name (e.g. {p / 'result.json'})")
    if _special(p):  # (/dev/null, /dev/stdout, a FIFO: written into as it is, not replaced)
        if file_only:
            raise ConfigError(f"{what} {path}: is not a regular file, and what is written there is read back; give a "
                              "file name")
        if not os.access(p, os.W_OK):
            raise ConfigError(f"{what} {path}: cannot write to it (permission denied)")
        return p
    parent = p.absolute().parent
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{what} {path}: {parent} is not a directory")
    try:  # a file made and removed there: what permissions, a read-only file system or /proc allow (root included)
        fd, probe = tempfile.mkstemp(prefix=".waferline-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot write in {parent} ({e.strerror or e})") from None
    return p


def write_text_atomic(path: str | Path, text: str, *, make_parents: bool = False, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` whole or not at all: into a temporary file beside it (same directory, so the same
    file system), flushed to disk, then renamed over ``path`` (os.replace). A failure leaves ``path`` as it was and
    removes the temporary file; a kill mid-write can leave that file (``.NAME.PID-THREAD.tmp``), never a half-written
    ``path``. ``make_parents``: create missing parent directories first. A ``path`` that is no regular file (a device
    such as /dev/null, /dev/stdout, a FIFO) is written into, never replaced by a file."""
    p = Path(path)
    if _special(p):  # (appended: a redirection's regular file behind /dev/stdout is not cut to what was printed)
        with open(p, "a", encoding=encoding) as f:
            f.write(text)
        return p
    if make_parents:
        p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w", encoding=encoding) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return p


def _special(p: Path) -> bool:
    """Whether ``p`` exists (its link followed) as neither a regular file nor a directory (a device, a FIFO, a
    socket), or names an open file of this process (/dev/stdout, /dev/fd/N: links into /proc/self/fd)."""
    try:
        mode = p.stat().st_mode
    except (OSError, ValueError):
        return False
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return True
    a = p.absolute()
    if str(a).startswith(("/proc/", "/dev/fd/")):
        return True
    return p.is_symlink() and os.path.join(a.parent, os.readlink(p)).startswith(("/proc/", "/dev/fd/"))


def broken_link(path: Path) -> str:
    """Why ``path`` cannot be opened where it is a symbolic link to nothing (a Hugging Face cache snapshot copied
    without its blobs/, or a download cut short), else ""."""
    if not path.is_symlink() or path.exists():
        return ""
    return (f"{path.name} is a symbolic link to {os.readlink(path)}, which does not exist: a Hugging Face cache "
            "snapshot copied without its blobs, or an unfinished download; re-download it, or copy the snapshot "
            "with its links followed (cp -rL)")
