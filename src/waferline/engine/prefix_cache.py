"""The prefix cache (``PrefixCache``): full pages of finished sequences kept in the page table for later sequences
that start with the same tokens, in the byte budget of the scheduler's ``CacheManager`` (engine/paging.py, whose
docstring says how memory is managed)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from waferline.engine.paging import CacheManager


class PrefixCache:
    """Full pages of finished sequences, reusable by any later sequence whose tokens start the same way.

    A page is keyed by (the page before it, its tokens), so a hit is always an exact match of the whole prefix.
    Each stored page is a page of the runner's paged caches, held by the store (``BlockTable.store``); the bytes of
    those no sequence holds are ``CacheManager.prefix_bytes``.
    """

    def __init__(self, manager: CacheManager):
        self.cm = manager
        self.P = manager.page_tokens
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._blocks: dict[int, tuple[tuple[int, tuple[int, ...]], int, set[int]]] = {}  # key, page id, children
        self._used: dict[int, int] = {}  # block id -> last use (a tick; larger is more recent)
        self._tick = 0
        self._next = 0
        self.hit_tokens = 0
        self.evicted_pages = 0
        manager.reclaim = self.evict
        manager.keep_prefixes()

    @property
    def num_pages(self) -> int:
        return len(self._blocks)

    def page_of(self, block: int) -> int:
        """The page id a stored block is."""
        return self._blocks[block][1]

    def match(self, ids: list[int], part: int = 0, touch: bool = True) -> list[int]:
        """Stored pages that start ``ids``, leaving at least one token to compute (pages of ``part``, where the page
        table is split: a chain's first key names its part, so every page of a chain lives in one part). ``touch``:
        count it as a use (least-recently-used eviction)."""
        out: list[int] = []
        parent = -1 - part
        for i in range((len(ids) - 1) // self.P):
            b = self._by_key.get((parent, tuple(ids[i * self.P:(i + 1) * self.P])))
            if b is None:
                break
            out.append(b)
            parent = b
        if touch:
            self._touch(out)
        return out

    def load(self, blocks: list[int], slot: int, caches: list[Any] | None = None) -> None:
        """Put stored pages at ``slot``'s positions [0, len(blocks) * page_tokens): its block table points at them
        (pages it was given there, unwritten, go back). ``caches``: unused (the pages are shared by every layer)."""
        table = self.cm.table
        if table is None:
            raise RuntimeError("prefix pages need the runner's page table (CacheManager.attach)")
        table.share(slot, [self._blocks[b][1] for b in blocks])
        self.hit_tokens += len(blocks) * self.P

    def store(self, ids: list[int], n_computed: int, slot: int, pages: list[int],
              caches: list[Any] | None = None) -> None:
        """Keep the full pages of a sequence's first ``n_computed`` tokens: ``pages``, what ``slot`` held in order
        (``CacheManager.free``'s answer), right after the sequence is freed, before anything takes a page."""
        table = self.cm.table
        if table is None:
            return
        parent, chain = -1 - table.part_of(slot), []
        for i in range(min(n_computed // self.P, len(pages))):
            key = (parent, tuple(ids[i * self.P:(i + 1) * self.P]))
            b = self._by_key.get(key)
            if b is None:
                self._touch(chain)
                page = pages[i]
                cost = 0.0 if table.refs[page] > 0 else self.cm.paged_page_bytes
                if (cost and not self.cm._room(cost)) or (chain and chain[-1] not in self._blocks):
                    return
                table.store(page)
                b = self._next
                self._next += 1
                self._blocks[b] = (key, page, set())
                self._by_key[key] = b
                if parent >= 0:
                    self._blocks[parent][2].add(b)
            chain.append(b)
            parent = b
        self._touch(chain)

    def _touch(self, blocks: list[int]) -> None:
        self._tick += 1
        for b in blocks:
            self._used[b] = self._tick

    def evict(self, need: float, part: int | None = None, keep: Collection[int] = ()) -> None:
        """Drop least-recently-used pages (and the pages that extend them) until ``need`` bytes are freed (pages of
        ``part`` only, where given; not the blocks ``keep``, a prefix about to be used)."""
        freed = 0.0
        table = self.cm.table
        for b in sorted(self._used, key=self._used.__getitem__):
            if freed >= need:
                break
            if b in self._blocks and b not in keep and (part is None or table.owner(self._blocks[b][1]) == part):
                freed += self._drop(b)

    def _drop(self, b: int) -> float:
        key, page, children = self._blocks.pop(b)
        self._by_key.pop(key, None)
        self._used.pop(b, None)
        parent = key[0]
        if parent in self._blocks:
            self._blocks[parent][2].discard(b)
        self.evicted_pages += 1
        freed = self.cm.paged_page_bytes if self.cm.table.unstore(page) else 0.0
        return freed + sum(self._drop(c) for c in list(children) if c in self._blocks)
