"""BlockTable: which physical pages of the paged token caches hold each slot's positions, and who holds each page.

The full-attention token caches of a model (GQA without a window, MLA's latents; ``TokenCache`` with a table) keep
their rows in a pool of pages per layer ([pages, page_tokens, width]); position p of slot s lives in page
``pages(s)[p // page_tokens]`` at offset ``p % page_tokens``. Every paged cache of a model shares one table, so a page
id names the same positions in every layer.

A page is held by the slots whose tables list it (a reference count) and, separately, by the prefix store
(``stored``); it goes back to the free list when neither holds it. A table either allocates its own pages when a
cache writes past a slot's pages (``managed`` False: ``LLM.generate``, pipeline stages, tests that call
``model.new_caches``), or gets them only from an allocator (``managed`` True: the scheduler's ``CacheManager``, which
holds the byte budget).

A table may be split into ``parts`` (attention/FFN disaggregation with M attention ranks: a slot lives on rank
``slot % parts``, whose caches hold only its own pages): page p >= 1 belongs to part ``(p - 1) % parts``, a slot takes
pages only from its part, each part holds at most its share of ``max_pages``, and rank m knows page p as its own
page ``1 + (p - 1) // parts`` (``local``). One part (the default) is a plain table.

Page 0 is the sink: no slot holds it, and a slot's ids past its own pages point at it, so a write to a position the
allocator gave no page (a speculative verify's padding) is dropped there and a ragged row's read of it is masked.

A released slot's pages stay parked (not free, not held) until the slot is used again or free pages run out, so what
a finished sequence computed can still be handed to the prefix store right after it is released.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

SINK = 0  # a page no slot holds: ``ids`` past a slot's pages point at it (writes there are dropped, reads masked)


def local_page(page: int, parts: int) -> int:
    """Page ``page`` of a table split in ``parts``, as the rank holding its part knows it (the sink stays 0)."""
    return SINK if page == SINK else 1 + (page - 1) // parts


class BlockTable:
    """Page ids per slot, reference counts per page, and the free pages (lowest id first, so a sequence that grows
    alone gets consecutive pages and its rows are one view of the pool)."""

    def __init__(self, num_slots: int, page_tokens: int = 16, managed: bool = False, max_pages: int | None = None,
                 parts: int = 1):
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        self.num_slots = num_slots
        self.page_tokens = page_tokens
        self.managed = managed
        self.max_pages = max_pages  # a bound on the pages that may exist, the sink included (None: none)
        self.parts = parts
        self._made = [0] * parts  # pages made so far per part
        self.slots: list[list[int]] = [[] for _ in range(num_slots)]
        self.run = [0] * num_slots  # pages at the start of each slot's list that are consecutive ids
        self.refs: list[int] = [0]  # per page: the slots that hold it
        self.stored: list[bool] = [False]  # per page: held by the prefix store
        self.live = 0  # pages held by at least one slot
        self.store_only = 0  # pages held by the prefix store alone
        self.store_only_in = [0] * parts  # ... per part
        self._free: list[list[int]] = [[] for _ in range(parts)]  # a heap per part
        self._is_free: list[bool] = [False]  # per page: in ``_free`` (page SINK never is)
        self._parked: dict[int, list[int]] = {}  # slot -> its released pages, until it is used again
        with torch.inference_mode(False):
            self.ids = torch.zeros(num_slots, 1, dtype=torch.long)  # slots x pages (SINK past a slot's pages)
        self.version = 0  # bumped whenever ``ids`` changes
        self._on_device: dict[Any, tuple[int, torch.Tensor]] = {}
        self._rows_back: tuple[Any, tuple[torch.Tensor, torch.Tensor]] | None = None  # (write_back_rows' last)
        self.dirty: list[Any] = []  # caches holding staging copies of slots' rows (flushed before pages change)
        self.layers: frozenset[int] = frozenset()  # the model's layers whose caches use these pages

    # -- pages
    @property
    def num_pages(self) -> int:
        """Pages that exist (ids 0 .. num_pages - 1, the sink included): the size of every pool in pages."""
        return len(self.refs)

    @property
    def held(self) -> int:
        """Pages held by a slot or by the prefix store."""
        return self.live + self.store_only

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_tokens)

    # -- parts
    def part_of(self, slot: int) -> int:
        """The part whose pages ``slot`` takes."""
        return slot % self.parts

    def owner(self, page: int) -> int:
        """The part page ``page`` (not the sink) belongs to."""
        return (page - 1) % self.parts

    def local(self, page: int) -> int:
        """Page ``page``'s id among its part's pages (the sink stays 0)."""
        return local_page(page, self.parts)

    @property
    def part_pages(self) -> int | None:
        """The most pages one part may hold (the sink not counted), or None without a bound."""
        return None if self.max_pages is None else (self.max_pages - 1) // self.parts

    def available(self, part: int = 0) -> int | None:
        """Pages ``part`` could still hand out (free, parked or not yet made), or None without a bound."""
        cap = self.part_pages
        if cap is None:
            return None
        # (a parked page the prefix store let go of is free already, and one a slot took and released is parked twice)
        parked = {p for pages in self._parked.values() for p in pages
                  if self.owner(p) == part and not self.stored[p] and self.refs[p] == 0 and not self._is_free[p]}
        return cap - self._made[part] + len(self._free[part]) + len(parked)

    def _store_only(self, p: int, d: int) -> None:
        self.store_only += d
        self.store_only_in[self.owner(p)] += d

    def _to_free(self, p: int) -> None:
        if self.refs[p] == 0 and not self.stored[p] and not self._is_free[p]:
            self._is_free[p] = True
            heapq.heappush(self._free[self.owner(p)], p)

    def _take(self, part: int = 0) -> int:
        free = self._free[part]
        if not free and self._parked:
            for pages in self._parked.values():
                for p in pages:
                    self._to_free(p)
            self._parked.clear()
        if free:
            p = heapq.heappop(free)
            self._is_free[p] = False
            return p
        if self.part_pages is not None and self._made[part] >= self.part_pages:
            raise RuntimeError(f"no free cache page (all {self.max_pages} held)" if self.parts == 1 else
                               f"no free cache page in part {part} (all {self.part_pages} held)")
        p = 1 + part + self.parts * self._made[part]
        self._made[part] += 1
        while len(self.refs) <= p:
            self.refs.append(0)
            self.stored.append(False)
            self._is_free.append(False)
        return p

    def _hold(self, p: int) -> None:
        self.refs[p] += 1
        if self.refs[p] == 1:
            self.live += 1
            if self.stored[p]:
                self._store_only(p, -1)

    def _drop(self, p: int, park: list[int] | None = None) -> None:
        self.refs[p] -= 1
        if self.refs[p] == 0:
            self.live -= 1
            if self.stored[p]:
                self._store_only(p, 1)
            elif park is not None:
                park.append(p)
            else:
                self._to_free(p)

    def _unpark(self, slot: int) -> None:
        for p in self._parked.pop(slot, ()):
            self._to_free(p)

    def columns(self, n: int) -> None:
        """Widen ``ids`` to at least ``n`` pages per slot (SINK past a slot's pages)."""
        if n > self.ids.shape[1]:
            with torch.inference_mode(False):  # (a normal tensor: the allocator updates it outside inference mode)
                wider = torch.zeros(self.num_slots, max(n, 2 * self.ids.shape[1]), dtype=torch.long)
                wider[:, : self.ids.shape[1]] = self.ids
            self.ids = wider
            self.version += 1

    def _set(self, slot: int, i: int, p: int) -> None:
        self.columns(i + 1)
        self.ids[slot, i] = p
        self.version += 1

    def _run_of(self, pages: list[int]) -> int:
        n = 1 if pages else 0
        while n < len(pages) and pages[n] == pages[0] + n:
            n += 1
        return n

    # -- slots
    def grow(self, slot: int, n_tokens: int) -> int:
        """Give ``slot`` pages for positions below ``n_tokens``; returns how many pages it took."""
        pages = self.slots[slot]
        need = self.pages_for(n_tokens) - len(pages)
        if need <= 0:
            return 0
        self._unpark(slot)
        for _ in range(need):
            p = self._take(self.part_of(slot))
            self._hold(p)
            if self.run[slot] == len(pages) and (not pages or p == pages[-1] + 1):
                self.run[slot] += 1
            self._set(slot, len(pages), p)
            pages.append(p)
        return need

    def ensure(self, slot: int, n_tokens: int) -> None:
        """A cache is about to write ``slot`` below ``n_tokens``: an unmanaged table takes the pages now; a managed
        one's come from its allocator, and a position it gave no page (a speculative verify's padding) is written to
        the sink page, i.e. not kept."""
        if not self.managed and len(self.slots[slot]) * self.page_tokens < n_tokens:
            self.grow(slot, n_tokens)

    def share(self, slot: int, pages: list[int]) -> None:
        """Make ``slot``'s first pages ``pages`` (a prefix cache hit): pages it held there go back (they must not
        have been written), the shared pages gain a holder. Nothing is copied."""
        self.flush(slot)
        self._unpark(slot)
        own = self.slots[slot]
        for i, p in enumerate(pages):
            if i < len(own):
                if own[i] == p:
                    continue
                old = own[i]
                self._hold(p)
                self._drop(old)
                own[i] = p
            else:
                self._hold(p)
                own.append(p)
            self._set(slot, i, p)
        self.run[slot] = self._run_of(own)

    def release(self, slot: int) -> list[int]:
        """``slot``'s sequence ended: drop its holds (its pages stay parked until the slot is used again). Returns every
        page it held, in order (shared ones too; the parked ones are only those no one else holds): the prefix store
        keys page i by the tokens at i, right away, before anything else takes a page."""
        self.flush(slot)
        held = self.slots[slot]
        park = self._parked.setdefault(slot, [])
        for p in held:
            self._drop(p, park)
        if held:
            self.ids[slot].zero_()
            self.version += 1
        self.slots[slot] = []
        self.run[slot] = 0
        return held

    def mirror(self, slot: int, pages: list[int]) -> None:
        """Make ``slot``'s pages exactly ``pages``, as another process's allocator gave them (a pipeline stage
        follows the scheduler's table: engine/pipeline/serving.py). A list that extends the slot's current one only
        adds pages (as ``grow``); any other change (a new sequence, a prefix hit, a release: ``[]``) first writes every
        pending entry to the pages it was meant for. Holds are not counted: the allocator counts them."""
        own = self.slots[slot]
        if pages[:len(own)] != own or not pages:
            self.flush()
            own = []
        for p in pages[len(own):]:
            while p >= len(self.refs):
                self.refs.append(0)
                self.stored.append(False)
                self._is_free.append(False)
        self.columns(len(pages))
        if not own:
            self.ids[slot].zero_()
        if len(pages) > len(own):
            self.ids[slot, len(own):len(pages)] = torch.tensor(pages[len(own):], dtype=torch.long)
        self.slots[slot] = list(pages)
        self.run[slot] = self._run_of(self.slots[slot])
        self.version += 1

    def pages_of(self, slot: int) -> list[int]:
        """The slot's pages, or, once released, its parked pages (until it is used again)."""
        return self.slots[slot] or self._parked.get(slot, [])

    # -- the prefix store's hold
    def store(self, p: int) -> None:
        if self.stored[p]:
            return
        self.stored[p] = True
        if self.refs[p] == 0:
            self._store_only(p, 1)

    def unstore(self, p: int) -> bool:
        """The prefix store lets go of page ``p``; True when that frees it."""
        if not self.stored[p]:
            return False
        self.stored[p] = False
        if self.refs[p] > 0:
            return False
        self._store_only(p, -1)
        self._to_free(p)
        return True

    # -- for the caches
    def flush(self, slot: int | None = None) -> None:
        """Write the caches' pending entries to their pages (those of copies holding ``slot``'s rows, or all):
        before pages change hands."""
        left = []
        for c in self.dirty:
            if slot is None or c.stages(slot):  # (a clean copy of the slot too: it would outlive the slot's pages)
                c.flush(None if slot is None else (slot,))  # (copies of other rows stay in use)
            if c._stages:  # (kept copies, clean or not: a later change of their slots must drop them)
                left.append(c)
        self.dirty = left

    def write_back_rows(self, slots: list[int], lo: list[int], counts: list[int], cap: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """For a staging copy of ``slots``' rows (``cap`` positions each) whose positions ``lo[b]`` .. ``lo[b] +
        counts[b] - 1`` go back to their pages: the copy's flat rows and the pool's flat rows they go to, on
        ``device``. Kept until the table or the arguments change: every layer's cache writes back the same entries,
        and one host-to-device copy for all of them (two per layer before) spares a GPU as many waits."""
        key = (tuple(slots), tuple(lo), tuple(counts), cap, device, self.version, id(self.ids))
        hit = self._rows_back
        if hit is not None and hit[0] == key:
            return hit[1]
        P = self.page_tokens
        with torch.inference_mode():
            pos = torch.cat([torch.arange(a, a + c) for a, c in zip(lo, counts)])
            row = torch.arange(len(counts)).repeat_interleave(torch.tensor(counts))
            page = self.ids[torch.tensor(slots)[row], torch.div(pos, P, rounding_mode="floor")]
            both = torch.stack([row * cap + pos, page * P + pos % P]).to(device)  # (a page the slot lacks: the sink)
        self._rows_back = (key, (both[0], both[1]))
        return both[0], both[1]

    def ids_on(self, device: torch.device) -> torch.Tensor:
        """``ids`` on ``device``: a copy kept until the table changes, then refreshed in place while its shape holds
        (so a captured CUDA graph that reads it reads the current pages; a wider table is a new tensor)."""
        if device.type == "cpu":
            return self.ids
        hit = self._on_device.get(device)  # (keyed as given: callers pass a tensor's device, cuda:N, never bare cuda)
        with torch.inference_mode(False):  # (a normal tensor, as ids is: refreshed in place in or out of inference)
            if hit is None or hit[1].shape != self.ids.shape:
                hit = self._on_device[device] = (self.version, self.ids.to(device))
            elif hit[0] != self.version:
                hit[1].copy_(self.ids)
                hit = self._on_device[device] = (self.version, hit[1])
        return hit[1]
