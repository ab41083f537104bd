"""Cache rollback after a verify: the target's caches keep each row's accepted prefix. Per cache kind:

* full attention / MLA (``TokenCache`` without a window): nothing to do — entries are positional, those of rejected
  tokens lie past the sequence, are masked causally, and the next step overwrites them;
* sliding window (a ring): the ring rows a verify will touch are snapshotted first and the ones overwritten by
  rejected tokens are put back (``TokenCache.ring_snapshot`` / ``ring_rewind``); K is capped at window − 1;
* Mamba-2: an SSM state cannot be un-updated, and re-running the accepted prefix would cost a second forward of
  the whole model, so the verify forward records the (conv, ssm) state after each of its T tokens
  (``Mamba2Cache.keep_trail``) and ``rewind`` selects the one after the accepted prefix;
* DeepSeek-V4 (``V4Cache``: window rows, compressed entries, open compression windows, CSA overlap): a verify
  records the state it started from and its tokens' rows and compressor projections (``V4Cache.keep_trail``), and
  ``rewind`` rebuilds the state after the accepted prefix from them, reopening windows that rejected tokens closed.

Draft models and MTP heads with non-positional caches snapshot their state after each drafted token instead
(``_save`` / ``_load``, used by the drafters).
"""

from __future__ import annotations

from typing import Any

import torch

from waferline.model.attention import TokenCache
from waferline.model.context import StepBatch
from waferline.model.ssm import Mamba2Cache
from waferline.model.v4_attention import V4Cache

_TRAILED = (Mamba2Cache, V4Cache)  # caches that record a verify's trail (keep_trail) and rewind to a prefix


def _stateful(caches: list[Any]) -> bool:
    return any(isinstance(c, _TRAILED) or (isinstance(c, TokenCache) and c.window is not None) for c in caches)


def _window(caches: list[Any]) -> int | None:
    w = [c.window for c in caches if isinstance(c, TokenCache) and c.window is not None]
    return min(w) if w else None


class VerifyRollback:
    """Prepare the target's caches for a T-token verify of ``batch``, then keep each row's accepted prefix."""

    def __init__(self, caches: list[Any], batch: StepBatch):
        self.caches, self.batch = caches, batch
        self.rings = [
            c.ring_snapshot(batch.slots) if isinstance(c, TokenCache) and batch.T > 1 else None for c in caches
        ]
        for c in caches:
            if isinstance(c, _TRAILED):
                c.keep_trail = batch.T > 1

    def done(self, keep: list[int]) -> None:
        """``keep[b]``: how many of row b's T input tokens were accepted (the last accepted token + accepted drafts)."""
        for c, snap in zip(self.caches, self.rings):
            if isinstance(c, TokenCache):
                c.ring_rewind(self.batch, keep, snap)
            elif isinstance(c, _TRAILED):
                c.keep_trail = False
                if self.batch.T > 1:
                    c.rewind(self.batch.slots, keep)


class SlotRollback:
    """A pipeline stage's (or an AFD attention rank's) rollback of verify forwards, one row at a time.

    ``before`` (just ahead of a verify group's forward on this stage) snapshots the sliding-window rings the group
    will touch and switches Mamba-2 caches to recording a per-token trail; ``after`` switches that off. The accepted
    length of a row is known only once the last stage has verified it, so it comes back to every stage on a later
    micro-batch as a (slot, keep) pair, and ``apply`` then keeps that row's first ``keep`` tokens. Each row's state is
    kept by slot, so other micro-batches' forwards in between do not disturb it."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[int, int, list[Any]]] = {}  # slot -> (start, T, per-cache ring snapshot)

    def reset(self) -> None:
        self.rows.clear()

    def before(self, caches: list[Any], batch: StepBatch) -> None:
        if batch.T <= 1:
            return
        snaps = [c.ring_snapshot(batch.slots) if isinstance(c, TokenCache) else None for c in caches]
        for b, slot in enumerate(batch.slots.tolist()):
            self.rows[slot] = (int(batch.start[b]), batch.T,
                               [None if sn is None else (sn[0][b:b + 1], sn[1][b:b + 1]) for sn in snaps])
        for c in caches:
            if isinstance(c, _TRAILED):
                c.keep_trail = True

    @staticmethod
    def after(caches: list[Any]) -> None:
        for c in caches:
            if isinstance(c, _TRAILED):
                c.keep_trail = False

    def apply(self, caches: list[Any], rewinds: list[tuple[int, int]], device: Any = "cpu") -> None:
        """``rewinds``: (slot, keep) for rows whose verify this stage ran; a row without a recorded verify (T = 1,
        or a row this stage has not seen verify) is skipped."""
        for slot, keep in rewinds:
            st = self.rows.pop(slot, None)
            if st is None:
                continue
            start, T, snaps = st
            one = StepBatch.make([slot], [start], T, device)
            for c, sn in zip(caches, snaps):
                if isinstance(c, TokenCache):
                    c.ring_rewind(one, [keep], sn)
                elif isinstance(c, _TRAILED):
                    c.rewind(one.slots, [keep])


def _save(caches: list[Any], slot: int) -> list[Any]:
    """A copy of one slot's non-positional state (rings, Mamba-2, V4) in ``caches``."""
    s = torch.tensor([slot])
    out: list[Any] = []
    for c in caches:
        if isinstance(c, _TRAILED):
            out.append(c.snapshot(s))
        elif isinstance(c, TokenCache) and c.window is not None:
            out.append(c.ring_snapshot(s))
        else:
            out.append(None)
    return out


def _load(caches: list[Any], slot: int, saved: list[Any]) -> None:
    s = torch.tensor([slot])
    for c, st in zip(caches, saved):
        if st is None:
            continue
        if isinstance(c, _TRAILED):
            c.restore(s, st)
        else:
            c.data[slot], c.pos[slot] = st[0][0], st[1][0]
