"""The scheduler's cache accounting: slots and pages per layer kind (``CacheManager``) and the prefix cache
(``PrefixCache``). Used by engine/scheduler.py, which owns the requests.

How memory is managed
---------------------
The model's caches are the per-layer objects the engine already has (``DecoderModel.new_caches(max_num_seqs)``, in
this process or, under a pipeline, in the stage processes):
``TokenCache`` rows for GQA / MLA / sliding-window layers and ``Mamba2Cache`` state for Mamba-2 layers, indexed
by *slot*. A running sequence owns one slot (that is its SSM state slot) and a number of *pages* of token
capacity in every pool of token-cache layers:

=========  ==========================================  ===============================================
pool       layers                                      pages a sequence of n tokens holds
=========  ==========================================  ===============================================
``gqa``    full-attention GQA (K and V)                ceil(n / page_tokens)
``swa``    sliding-window GQA (one pool per window)    ceil(min(n, window) / page_tokens)
``mla``    MLA (normalised latent c_KV + rotary key)    ceil(n / page_tokens)
``mamba2`` Mamba-2 (conv + SSM state)                  1 state slot, whatever n
=========  ==========================================  ===============================================

The bytes of a page and of a state slot, and the tokens a layer keeps (``cached_tokens``), come from the
``ModelSpec`` accounting (``LayerSpec.cache_bytes_per_token``, ``mixer.state_bytes_per_seq``,
``mixer.cached_tokens``) — the same numbers the planner and simulator use. All pools draw on one byte budget
(``cache_bytes``, default: ``max_num_seqs`` sequences of ``max_model_len`` tokens, so nothing is ever
preempted); with page-aligned lengths, the bytes a sequence holds equal ``ModelSpec.cache_bytes_per_seq``.

The pages are an accounting of capacity, enforced by admission and preemption; the tensors themselves stay
slot-contiguous (``TokenCache`` rows), so physical memory is ``max_num_seqs`` x the longest live sequence.
A block-table layout of the tensors (and with it a copy-free prefix cache) is future work.

Prefix caching (attention-only models whose layers all keep every token: GQA and MLA without a sliding
window) keeps full pages of finished sequences in a store keyed by the exact token chain (a page is reused
only when it *and every page before it* match). A new sequence whose prompt starts with stored pages gets them
copied into its slot and prefills only the rest; at least one prompt token is always computed (for the
logits). Stored pages count against the same byte budget and are evicted least-recently-used (with the pages
that extend them) whenever a live sequence needs the room — they never cause a preemption. Models with
Mamba-2 or sliding-window layers do not cache prefixes (their state is not a per-token prefix).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from waferline.errors import ConfigError
from waferline.model.context import StepBatch
from waferline.spec.model import ModelSpec


@dataclass(frozen=True)
class CachePool:
    """Cache layers of one kind that grow together: every sequence holds the same pages in each of them."""

    kind: str  # "gqa" | "swa" | "mla" | "mamba2"
    layers: tuple[int, ...]
    window: int | None
    page_bytes: float  # one page (page_tokens tokens) across all layers of the pool; mamba2: one sequence's state
    per_seq: bool  # True: a constant-size state per sequence (Mamba-2), not token pages


def _pools(spec: ModelSpec, page_tokens: int, kv_bits: int, state_bits: int) -> list[CachePool]:
    groups: dict[tuple[str, int | None], list[int]] = {}
    for layer in spec.layers:
        m = layer.mixer
        if m is None:
            continue
        if m.state_bytes_per_seq(state_bits) > 0 and m.cache_bytes_per_token(kv_bits) == 0:
            key: tuple[str, int | None] = (m.kind, None)
        elif m.cache_bytes_per_token(kv_bits) > 0:
            window = getattr(m, "sliding_window", None)
            key = ("swa" if window else m.kind, window)
        else:
            continue
        groups.setdefault(key, []).append(layer.index)
    pools = []
    for (kind, window), idx in groups.items():
        layers = [spec.layers[i] for i in idx]
        if any(l.mixer.cache_bytes_per_token(kv_bits) > 0 for l in layers):
            page = page_tokens * sum(l.cache_bytes_per_token(kv_bits) for l in layers)
            pools.append(CachePool(kind, tuple(idx), window, page, False))
        else:
            state = sum(l.mixer.state_bytes_per_seq(state_bits) for l in layers)
            pools.append(CachePool(kind, tuple(idx), None, state, True))
    return pools


class CacheManager:
    """Slots and pages: who holds how much of the cache budget. Touched only by the engine thread."""

    def __init__(self, spec: ModelSpec, max_num_seqs: int, max_model_len: int, page_tokens: int = 16,
                 cache_bytes: float | None = None, kv_bits: int = 16, state_bits: int = 16):
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if page_tokens < 1:
            raise ConfigError(f"page size must be >= 1 token, got {page_tokens}")
        self.spec = spec
        self.page_tokens = page_tokens
        self.max_num_seqs = max_num_seqs
        self.kv_bits, self.state_bits = kv_bits, state_bits
        self.pools = _pools(spec, page_tokens, kv_bits, state_bits)
        self.max_seq_bytes = self.bytes_for(max_model_len)
        self.budget = float(cache_bytes) if cache_bytes is not None else max_num_seqs * self.max_seq_bytes
        if self.budget < self.max_seq_bytes:
            raise ConfigError(
                f"cache budget of {self.budget / 2**20:.2f} MiB cannot hold one sequence of max_model_len="
                f"{max_model_len} tokens ({self.max_seq_bytes / 2**20:.2f} MiB); raise the cache budget "
                "or lower --max-model-len"
            )
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._held: dict[str, tuple[int, list[int]]] = {}  # request id -> (slot, pages per pool)
        self.used_bytes = 0.0  # held by live sequences
        self.prefix_bytes = 0.0  # held by the prefix store (evictable)
        self.reclaim: Callable[[float], None] | None = None  # evict prefix pages until this many bytes are free

    # -- accounting (pure)
    def pages_for(self, n_tokens: int) -> list[int]:
        """Pages (or state slots) per pool for a sequence of ``n_tokens`` cached tokens."""
        out = []
        for p in self.pools:
            if p.per_seq:
                out.append(1)
            else:
                cached = self.spec.layers[p.layers[0]].mixer.cached_tokens(n_tokens)
                out.append(math.ceil(cached / self.page_tokens))
        return out

    def _bytes(self, pages: list[int]) -> float:
        return sum(n * p.page_bytes for n, p in zip(pages, self.pools))

    def bytes_for(self, n_tokens: int) -> float:
        return self._bytes(self.pages_for(n_tokens))

    # -- state
    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def holds(self, rid: str) -> bool:
        return rid in self._held

    @property
    def page_bytes(self) -> float:
        """One page of every token pool together (what a prefix-store page costs)."""
        return sum(p.page_bytes for p in self.pools if not p.per_seq)

    def _room(self, extra: float) -> bool:
        if self.used_bytes + self.prefix_bytes + extra <= self.budget + 1e-6:
            return True
        if self.reclaim is not None and self.prefix_bytes > 0:
            self.reclaim(self.used_bytes + self.prefix_bytes + extra - self.budget)
        return self.used_bytes + self.prefix_bytes + extra <= self.budget + 1e-6

    def can_admit(self, n_tokens: int) -> bool:
        return bool(self._free_slots) and self._room(self.bytes_for(n_tokens))

    def admit(self, rid: str) -> int:
        """Give ``rid`` a slot (and its state slots); token pages come with ``grow``."""
        slot = self._free_slots.pop()
        pages = [1 if p.per_seq else 0 for p in self.pools]
        self._held[rid] = (slot, pages)
        self.used_bytes += self._bytes(pages)
        return slot

    def grow(self, rid: str, n_tokens: int) -> bool:
        """Hold enough pages for ``n_tokens``; False (holding what it held) when the budget does not allow it."""
        slot, held = self._held[rid]
        want = [max(a, b) for a, b in zip(held, self.pages_for(n_tokens))]
        extra = self._bytes(want) - self._bytes(held)
        if extra > 0 and not self._room(extra):
            return False
        self._held[rid] = (slot, want)
        self.used_bytes += extra
        return True

    def free(self, rid: str) -> None:
        slot, held = self._held.pop(rid)
        self.used_bytes -= self._bytes(held)
        if not self._held:
            self.used_bytes = 0.0  # no drift from float sums
        self._free_slots.append(slot)

    def pages_in_use(self) -> dict[str, int]:
        """Pages held per pool kind (state slots for Mamba-2)."""
        out: dict[str, int] = {}
        for _, held in list(self._held.values()):
            for n, p in zip(held, self.pools):
                out[p.kind] = out.get(p.kind, 0) + n
        for p in self.pools:
            out.setdefault(p.kind, 0)
        return out


class PrefixCache:
    """Full pages of finished sequences, reusable by any later sequence whose tokens start the same way.

    A page is keyed by (the page before it, its tokens), so a hit is always an exact match of the whole prefix.
    Its rows (one [page_tokens, width] tensor per layer) are copies; their bytes are ``CacheManager.prefix_bytes``.
    """

    def __init__(self, manager: CacheManager):
        self.cm = manager
        self.P = manager.page_tokens
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._blocks: dict[int, tuple[tuple[int, tuple[int, ...]], list[torch.Tensor | None], set[int]]] = {}
        self._used: dict[int, int] = {}  # block id -> last use (a tick; larger is more recent)
        self._tick = 0
        self._next = 0
        self.hit_tokens = 0
        self.evicted_pages = 0
        manager.reclaim = self.evict

    @property
    def num_pages(self) -> int:
        return len(self._blocks)

    def match(self, ids: list[int]) -> list[int]:
        """Stored pages that start ``ids``, leaving at least one token to compute."""
        out: list[int] = []
        parent = -1
        for i in range((len(ids) - 1) // self.P):
            b = self._by_key.get((parent, tuple(ids[i * self.P:(i + 1) * self.P])))
            if b is None:
                break
            out.append(b)
            parent = b
        self._touch(out)
        return out

    def load(self, blocks: list[int], slot: int, caches: list[Any]) -> None:
        """Copy stored pages into ``slot`` at positions [0, len(blocks) * page_tokens)."""
        batch = StepBatch.make([slot], [0], len(blocks) * self.P)
        for layer, c in enumerate(caches):
            if c is not None:
                c.update(torch.cat([self._blocks[b][1][layer] for b in blocks])[None], batch)
        self.hit_tokens += len(blocks) * self.P

    def store(self, ids: list[int], n_computed: int, slot: int, caches: list[Any]) -> None:
        """Keep the full pages of a sequence's first ``n_computed`` tokens (its rows in ``slot``)."""
        parent, chain = -1, []
        for i in range(n_computed // self.P):
            key = (parent, tuple(ids[i * self.P:(i + 1) * self.P]))
            b = self._by_key.get(key)
            if b is None:
                self._touch(chain)
                if not self.cm._room(self.cm.page_bytes) or (chain and chain[-1] not in self._blocks):
                    return
                lo, hi = i * self.P, (i + 1) * self.P
                rows = [None if c is None else c.data[slot, lo:hi].clone() for c in caches]
                b = self._next
                self._next += 1
                self._blocks[b] = (key, rows, set())
                self._by_key[key] = b
                if parent >= 0:
                    self._blocks[parent][2].add(b)
                self.cm.prefix_bytes += self.cm.page_bytes
            chain.append(b)
            parent = b
        self._touch(chain)

    def _touch(self, blocks: list[int]) -> None:
        self._tick += 1
        for b in blocks:
            self._used[b] = self._tick

    def evict(self, need: float) -> None:
        """Drop least-recently-used pages (and the pages that extend them) until ``need`` bytes are freed."""
        freed = 0.0
        for b in sorted(self._used, key=self._used.__getitem__):
            if freed >= need:
                break
            if b in self._blocks:
                freed += self._drop(b)
        if not self._blocks:
            self.cm.prefix_bytes = 0.0

    def _drop(self, b: int) -> float:
        key, _, children = self._blocks.pop(b)
        self._by_key.pop(key, None)
        self._used.pop(b, None)
        parent = key[0]
        if parent in self._blocks:
            self._blocks[parent][2].discard(b)
        self.cm.prefix_bytes -= self.cm.page_bytes
        self.evicted_pages += 1
        return self.cm.page_bytes + sum(self._drop(c) for c in list(children) if c in self._blocks)
