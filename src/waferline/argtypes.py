"""argparse types shared by the command lines: counts and amounts that must be positive are refused when they are not,
rather than quietly replaced by a default."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _int_at_least(text: str, low: int, high: int | None = None, why: str = "") -> int:
    want = f"an integer >= {low}" if high is None else f"an integer from {low} to {high:,}"
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}{why}") from None
    if v < low or (high is not None and v > high):
        raise argparse.ArgumentTypeError(f"expected {want}, got {v:,}{why}")
    return v


def int_range(low: int, high: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high`` (``why``: the reason for the bound, shown when refused)."""
    return lambda text: _int_at_least(text, low, high, why)


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return v


MAX_TIMEOUT_S = 7 * 24 * 3600  # (a week: the OS's waits refuse timeouts past ~1e9 s, with a traceback)


def timeout_seconds(text: str) -> float:
    """A timeout: a finite number of seconds > 0, at most a week."""
    v = positive_float(text)
    if v > MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"expected seconds > 0 and at most {MAX_TIMEOUT_S:,} (a week), got {text}")
    return v


def out_path(text: str) -> str:
    """A file or directory to write: not empty (an empty --out wrote nothing, silently)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path to write, got an empty one")
    return text


def utf8_text(text: str) -> str:
    """Text that is UTF-8 (argv bytes that are not arrive as lone surrogates, which the tokenizer refuses with a
    traceback)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text: give it in UTF-8") from None
    return text
