"""Prefill rows of different lengths in one padded model call (the single-process runner's prefill chunks, a pipeline
stage's groups).

Where every cache of the layers is a full-attention token cache (GQA without a window, MLA latents), rows of different
lengths can run as one [B, T] call, the shorter ones padded at the end: a padded position writes past its row's tokens,
where the row's next tokens overwrite it before any query of the row reads that far (a managed page table sends a
position its row has no page for to the sink page), and causal attention keeps the row's own queries from seeing it.
A sliding window (a ring: the padding would overwrite keys still in the window), a recurrent state or a compressed
cache would take the padding in, so those keep one call per length.
"""

from __future__ import annotations

from typing import Any

from waferline.model.attention import TokenCache

# rows of different lengths share a call while its tokens stay within this factor of the rows' own (a separate call of
# a ~65-token chunk cost ~40% more than its share of a joint one: 124M Llama, int4, 2-core CPU)
PAD_SLACK = 1.25


def pads_safely(caches: list[Any]) -> bool:
    """Every cache in ``caches`` (None: a layer without one) takes padded rows: full-attention token caches only."""
    return all(c is None or (isinstance(c, TokenCache) and c.window is None) for c in caches)


def padded_calls(sizes: list[tuple[int, int]], pad: bool) -> list[tuple[list[int], int]]:
    """The calls that run items of ``sizes`` ((rows, T) each): (item indices, the call's T) per call. Items of equal T
    share a call; with ``pad`` shorter ones join a longer call (longest first) while its padded tokens stay within
    PAD_SLACK of the items' own."""
    by_T: dict[int, list[int]] = {}
    for i, (_, T) in enumerate(sizes):
        by_T.setdefault(T, []).append(i)
    if not pad:
        return [(idx, T) for T, idx in by_T.items()]
    calls: list[tuple[list[int], int]] = []
    rows = real = 0
    for T in sorted(by_T, reverse=True):
        n = sum(sizes[i][0] for i in by_T[T])
        if calls and (rows + n) * calls[-1][1] <= PAD_SLACK * (real + n * T):
            calls[-1][0].extend(by_T[T])
            rows, real = rows + n, real + n * T
        else:
            calls.append((list(by_T[T]), T))
            rows, real = n, n * T
    return calls
