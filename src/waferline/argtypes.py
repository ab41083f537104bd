"""argparse types shared by the command lines: counts and amounts that must be positive are refused when they are not,
rather than quietly replaced by a default."""

from __future__ import annotations

import argparse
import math


def _int_at_least(text: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {v}")
    return v


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
