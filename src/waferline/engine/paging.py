"""The scheduler's cache accounting: slots and pages per layer kind (``CacheManager``; the prefix cache over its
pages: engine/prefix_cache.py). Used by engine/scheduler.py, which owns the requests.

How memory is managed
---------------------
The model's caches are the per-layer objects the engine already has (``DecoderModel.new_caches(max_num_seqs)``, in
this process or, under a pipeline, in the stage processes):
``TokenCache`` rows for GQA / MLA / sliding-window layers and ``Mamba2Cache`` state for Mamba-2 layers, indexed
by *slot*. A running sequence owns one slot (that is its SSM state slot) and a number of *pages* of token
capacity in every pool of token-cache layers:

====================  ==========================================  ===============================================
pool                  layers                                      pages a sequence of n tokens holds
====================  ==========================================  ===============================================
``gqa``               full-attention GQA (K and V)                ceil(n / page_tokens)
``swa``               sliding-window GQA (one pool per window)    ceil(min(n, window) / page_tokens)
``mla``               MLA (normalised latent c_KV + rotary key)    ceil(n / page_tokens)
``mamba2``            Mamba-2 (conv + SSM state; Gated DeltaNet,  1 state slot, whatever n (speculating k drafts:
                      KDA likewise: ``gdn``, ``kda``)             and the k + 1 states a verify keeps)
``compressed``        DeepSeek-V4-style CSA / HCA: the entries    ceil(n / page_tokens), each the bytes
                      (and their indexer keys)                    page_tokens tokens add
``compressed_state``  every V4-style layer: the window rows and   1 per sequence, whatever n (a full window and the
                      the compressor's state                      compressor's largest state)
====================  ==========================================  ===============================================

The bytes of a page and of a state slot, and the tokens a layer keeps (``cached_tokens``), come from the
``ModelSpec`` accounting (``LayerSpec.cache_bytes_per_token``, ``mixer.state_bytes_per_seq``,
``mixer.cached_tokens``) — the same numbers the planner and simulator use. All pools draw on one byte budget
(``cache_bytes``, default: ``max_num_seqs`` sequences of ``max_model_len`` tokens, so nothing is ever
preempted); with page-aligned lengths, the bytes a sequence holds equal ``ModelSpec.cache_bytes_per_seq`` (with
compressed layers, at least that: their windows and compressor states are counted at their largest; so is a sliding
window that is not a whole number of pages: its last page counts whole), plus
``ModelSpec.rollback_bytes_per_seq`` under speculation: the state after each token of a verify, which recurrent
layers keep until the rewind (Gated DeltaNet, KDA and Mamba-2 on GPU record them; Mamba-2's fused CPU update keeps
the state before the verify instead, one state per slot, and replays the kept tokens).

Full-attention pools (``gqa`` and ``mla`` layers whose caches are paged, model/block_table.py) are real pages where the
runner shares its caches' ``BlockTable`` (``attach``; the single-process runner does): ``grow`` takes pages from that
table, ``free`` releases them, and the bytes these pools hold are the pages held (by live sequences or the prefix store)
x the page's bytes. Each paged layer's pool is made once with the most pages the budget lets the table hold (plus the
table's sink page): a sequence holding pages also holds its states, window pages and drafter pages, so j sequences hold
at most the pages the budget less j such remainders pays for, and at most j x the pages of max_model_len tokens (the
prefix store's pages need no sequence: where there is a store, the budget less one sequence's remainder; but beside a
drafter's pages, which the budget pays for too, the store keeps pages within the pool its sequences would hold, evicting
them when a sequence needs the page); a page is zeroed, and its memory first touched, when it is first handed out. Other
pools (sliding-window rings, Mamba-2 states, and every cache in stage processes, whose paged caches take their own
pages) are an accounting of capacity, enforced by admission and preemption, over tensors indexed by slot.

A draft model (speculative ``draft:PATH``) caches every sequence too, and so does an MTP head (``mtp``, its layer's
cache): their pools (kinds ``draft_gqa`` ..., ``mtp_mla`` ...) join the target's in the same budget, so a sequence's
bytes are the target's and the drafter's, and their full-attention pools are pages of a second table (the
drafter's, ``attach(drafter, draft=True)``), held by one sequence each.

Prefix caching (attention-only models whose layers all keep every token in pages: GQA and MLA without a sliding
window) keeps full pages of finished sequences in a store keyed by the exact token chain (a page is reused
only when it *and every page before it* match). A new sequence whose prompt starts with stored pages gets those
very pages in its block table (a second holder; nothing is copied) and prefills only the rest, its first page of
its own included; at least one prompt token is always computed (for the logits). A page goes back to the free list
when no sequence and not the store holds it. Pages held only by the store count against the same byte budget
(``prefix_bytes``) and are evicted least-recently-used (with the pages that extend them) whenever a live sequence
needs the room — they never cause a preemption. Models with Mamba-2 or sliding-window layers do not cache
prefixes (their state is not a per-token prefix).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from waferline.errors import ConfigError
from waferline.model.block_table import BlockTable
from waferline.spec.model import CompressedAttentionSpec, ModelSpec


@dataclass(frozen=True)
class CachePool:
    """Cache layers of one kind that grow together: every sequence holds the same pages in each of them."""

    kind: str  # "gqa" | "swa" | "mla" | "mamba2" | "compressed" | "compressed_state" ...
    layers: tuple[int, ...]
    window: int | None
    page_bytes: float  # one page (page_tokens tokens) across all layers of the pool; mamba2: one sequence's state
    per_seq: bool  # True: a constant-size state per sequence (Mamba-2), not token pages
    draft: bool = False  # layers of the drafter (a draft model or an MTP head: CacheManager's draft), not the target's
    context: bool = False  # pages count every token of context, not the layers' cached_tokens (compressed entries)


_DRAFTS = {"draft": "the draft model's caches", "mtp": "the MTP head's cache"}  # a drafter's pools: kind prefix


def _pools(spec: ModelSpec, page_tokens: int, kv_bits: int, state_bits: int, draft: str = "",
           spec_tokens: int = 0) -> list[CachePool]:
    groups: dict[tuple[str, int | None], list[int]] = {}
    for layer in spec.layers:
        m = layer.mixer
        if m is None:
            continue
        if isinstance(m, CompressedAttentionSpec):  # entries grow with the context; window and state are bounded
            if m.compress_ratio:
                groups.setdefault(("compressed", None), []).append(layer.index)
            groups.setdefault(("compressed_state", None), []).append(layer.index)
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
        name = f"{draft}_{kind}" if draft else kind  # (its own pages_in_use kind: another model's page size)
        if kind == "compressed_state":
            state = sum(l.mixer.most_bytes_beyond_entries(kv_bits) for l in layers)
            pools.append(CachePool(name, tuple(idx), None, state, True, bool(draft)))
        elif any(l.mixer.cache_bytes_per_token(kv_bits) > 0 for l in layers):
            page = page_tokens * sum(l.cache_bytes_per_token(kv_bits) for l in layers)
            pools.append(CachePool(name, tuple(idx), window, page, False, bool(draft), kind == "compressed"))
        else:
            state = sum(l.mixer.state_bytes_per_seq(state_bits) for l in layers)
            # speculating, a sequence keeps more state: the target the state after each of a verify's k + 1 tokens
            # until the rewind, a drafter a copy of its own before each drafted token but the last (k)
            state += spec_tokens * state if draft else sum(l.rollback_bytes_per_seq(spec_tokens, state_bits)
                                                          for l in layers)
            pools.append(CachePool(name, tuple(idx), None, state, True, bool(draft)))
    return pools


class CacheManager:
    """Slots and pages: who holds how much of the cache budget. Touched only by the engine thread.

    ``draft``: the ModelSpec of a drafter's cached layers (in the target's dtype) that hold every sequence too: a draft
    model's (speculative 'draft:PATH', ``draft_kind`` "draft") or an MTP head's layer (``mtp``, "mtp"). Its pools join
    the target's (kinds ``draft_gqa`` ..., ``mtp_mla`` ...), a sequence's bytes are the target's and the drafter's, and
    its paged caches take their pages from a second table (``attach(drafter, draft=True)``), never shared (the prefix
    store keeps the target's pages only; the draft model catches up on a prefix hit's tokens, and speculation with an
    MTP head caches no prefixes).

    ``spec_tokens``: the most drafts a verify checks (speculation); a recurrent-state layer's pool then holds, per
    sequence, the states a verify keeps for its rollback too (``LayerSpec.rollback_bytes_per_seq``), and a drafter's
    the copies of its state it keeps to rewind its drafts."""

    def __init__(self, spec: ModelSpec, max_num_seqs: int, max_model_len: int, page_tokens: int = 16,
                 cache_bytes: float | None = None, kv_bits: int = 16, state_bits: int = 16,
                 draft: ModelSpec | None = None, draft_kind: str = "draft", spec_tokens: int = 0):
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if page_tokens < 1:
            raise ConfigError(f"page size must be >= 1 token, got {page_tokens}")
        self.spec, self.draft = spec, draft
        self.page_tokens = page_tokens
        self.max_num_seqs = max_num_seqs
        self.kv_bits, self.state_bits = kv_bits, state_bits
        self.pools = _pools(spec, page_tokens, kv_bits, state_bits, spec_tokens=spec_tokens)
        if draft is not None:
            self.pools += _pools(draft, page_tokens, kv_bits, state_bits, draft=draft_kind, spec_tokens=spec_tokens)
        self.max_model_len = max_model_len
        self.max_seq_bytes = self.bytes_for(max_model_len)
        self._default_budget = cache_bytes is None
        self.budget = float(cache_bytes) if cache_bytes is not None else max_num_seqs * self.max_seq_bytes
        if not self.budget >= self.max_seq_bytes:  # (NaN too)
            drafts = self._bytes([n if p.draft else 0 for n, p in zip(self.pages_for(max_model_len), self.pools)])
            raise ConfigError(
                f"cache budget of {self.budget / 2**20:.2f} MiB cannot hold one sequence of max_model_len="
                f"{max_model_len} tokens ({self.max_seq_bytes / 2**20:.2f} MiB"
                + (f", of which {drafts / 2**20:.2f} MiB {_DRAFTS[draft_kind]}" if draft is not None else "")
                + "); raise the cache budget or lower --max-model-len"
            )
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._held: dict[str, tuple[int, list[int]]] = {}  # request id -> (slot, pages per pool)
        self.table: BlockTable | None = None  # the pages of the paged pools (attach)
        self.draft_table: BlockTable | None = None  # the pages of the drafter's paged pools (attach)
        self._paged = [False] * len(self.pools)
        self._counted = 0.0  # bytes live sequences hold in pools without pages (counted per sequence)
        # evict prefix pages until this many bytes are free (in one part of a split page table, where given)
        self.reclaim: Callable[..., None] | None = None
        self.released: Callable[[int], None] | None = None  # told the slot of each sequence that leaves (``free``)

    def attach(self, runner: Any, draft: bool = False) -> None:
        """Take the runner's page table (``runner.block_table(page_tokens)``, where it has one): the full-attention
        pools of the layers it covers become its pages. Before any sequence is admitted. ``draft``: the drafter's
        table (a draft model's or an MTP head's), for the drafter's pools (after the runner's)."""
        make = getattr(runner, "block_table", None)
        table = make(self.page_tokens) if make is not None else None
        if table is None:
            return
        paged = [p.draft == draft and not p.per_seq and p.window is None and set(p.layers) <= table.layers
                 for p in self.pools]
        self._paged = [a or b for a, b in zip(self._paged, paged)]
        if draft:  # (its pages are never shared: its pools hold what the budget lets its sequences hold)
            self.draft_table = table
            if any(paged):
                table.max_pages = 1 + self._most_pages(table, self.draft_page_bytes)
            return
        self.table = table
        if table.parts > 1 and self._default_budget:  # (each part holds its slots' sequences at full length)
            self.budget = table.parts * -(-self.max_num_seqs // table.parts) * self.max_seq_bytes
        if any(self._paged):  # the pools hold the pages the budget lets sequences hold (and the sink)
            table.max_pages = 1 + (self._most_pages(table, self.paged_page_bytes) if table.parts == 1
                                   else int(self.budget // self.paged_page_bytes))
            # (one page id covers a position in every paged layer: the pools' counts for a sequence are one count)
            need = max((n for n, paged in zip(self.pages_for(self.max_model_len), self._paged) if paged), default=0)
            if table.part_pages < need:
                raise ConfigError(
                    f"the cache budget of {self.budget / 2**20:.2f} MiB is split over {table.parts} attention ranks, "
                    f"and one rank's share ({table.part_pages} pages) cannot hold one sequence of max_model_len="
                    f"{self.max_model_len} tokens ({need} pages); raise the cache budget or lower --max-model-len"
                )

    def _most_pages(self, table: BlockTable, page_bytes: float) -> int:
        """The most pages of ``table`` (the target's or the drafter's, ``page_bytes`` each) held at once within the
        budget. A sequence holding any of them holds at least a page or a state of every other pool too (``rest``:
        what one token costs beyond this table's page), so j sequences hold at most j x the pages of max_model_len
        tokens, and at most the pages the budget less j x ``rest`` pays for; pages the prefix store keeps (the
        target's, where a store reclaims them) need no sequence: the budget less one ``rest`` (not beside a drafter's
        pool: the two pools would together hold up to the drafter's pool more than the budget; ``_store_in_pool``)."""
        rest = self.bytes_for(1) - table.pages_for(1) * page_bytes

        def room(j: int) -> int:
            return max(0, int((self.budget - j * rest) / page_bytes + 1e-6))

        if table is self.table and self.reclaim is not None and not self._store_in_pool:
            return room(1)
        most = table.pages_for(self.max_model_len)
        return max(min(j * most, room(j)) for j in range(1, self.max_num_seqs + 1))

    @property
    def _store_in_pool(self) -> bool:
        """The prefix store keeps the target's pages within the pool its sequences would hold (beside a drafter's
        pages): a page it keeps may be wanted by a sequence the budget admits, and is evicted for it."""
        return self.reclaim is not None and self.draft_table is not None and self.draft_table.max_pages is not None

    def keep_prefixes(self) -> None:
        """A prefix store keeps pages of the target's table (``reclaim`` set): its pool may hold the pages the budget
        pays for beside one sequence, not only those sequences hold. Before any sequence is admitted."""
        t = self.table
        if t is not None and t.parts == 1 and t.max_pages is not None:
            t.max_pages = 1 + self._most_pages(t, self.paged_page_bytes)

    # -- accounting (pure)
    def describe(self) -> str:
        """One line on what the cache holds, as a server says it at start-up: its budget, how many whole sequences of
        ``max_model_len`` tokens fit in it, and how many run at once."""
        fit = int(self.budget // self.max_seq_bytes + 1e-9)
        return (f"cache {self.budget / 2**20:,.1f} MiB: room for {fit:,} sequences of {self.max_model_len:,} tokens "
                f"({self.max_seq_bytes / 2**20:,.2f} MiB each, pages of {self.page_tokens} tokens), "
                f"{self.max_num_seqs:,} running at most" + ("; more run while their pages fit, the newest preempted "
                                                              "when they run out" if fit < self.max_num_seqs else ""))

    def pages_for(self, n_tokens: int) -> list[int]:
        """Pages (or state slots) per pool for a sequence of ``n_tokens`` cached tokens."""
        out = []
        for p in self.pools:
            if p.per_seq:
                out.append(1)
            else:
                spec = self.draft if p.draft else self.spec  # (the pool's layers are its model's)
                cached = n_tokens if p.context else spec.layers[p.layers[0]].mixer.cached_tokens(n_tokens)
                out.append(math.ceil(cached / self.page_tokens))
        return out

    def _bytes(self, pages: list[int]) -> float:
        return sum(n * p.page_bytes for n, p in zip(pages, self.pools))

    def _counted_bytes(self, pages: list[int]) -> float:
        return sum(n * p.page_bytes for n, p, paged in zip(pages, self.pools, self._paged) if not paged)

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
        """One page of every token pool of the target together (what a prefix-store page costs)."""
        return sum(p.page_bytes for p in self.pools if not p.per_seq and not p.draft)

    @property
    def paged_page_bytes(self) -> float:
        """One page of the pools backed by the page table (one page id in every layer it covers)."""
        return sum(p.page_bytes for p, paged in zip(self.pools, self._paged) if paged and not p.draft)

    @property
    def draft_page_bytes(self) -> float:
        """One page of the drafter's pools backed by its page table."""
        return sum(p.page_bytes for p, paged in zip(self.pools, self._paged) if paged and p.draft)

    @property
    def used_bytes(self) -> float:
        """Bytes held by live sequences (a page shared with the prefix store or another sequence counted once)."""
        live = self.table.live * self.paged_page_bytes if self.table is not None else 0.0
        if self.draft_table is not None:
            live += self.draft_table.live * self.draft_page_bytes
        return self._counted + live

    @property
    def prefix_bytes(self) -> float:
        """Bytes of pages only the prefix store holds (evictable)."""
        return self.table.store_only * self.paged_page_bytes if self.table is not None else 0.0

    def _room(self, extra: float, keep: Collection[int] = ()) -> bool:
        if self.used_bytes + self.prefix_bytes + extra <= self.budget + 1e-6:
            return True
        if self.reclaim is not None and self.prefix_bytes > 0:
            self.reclaim(self.used_bytes + self.prefix_bytes + extra - self.budget, keep=keep)
        return self.used_bytes + self.prefix_bytes + extra <= self.budget + 1e-6

    @property
    def parts(self) -> int:
        """The parts of a split page table (one per attention rank under AFD; 1: not split)."""
        return self.table.parts if self.table is not None else 1

    def part_of(self, slot: int) -> int:
        return slot % self.parts

    def _part_room(self, part: int, pages: int, keep: Collection[int] = ()) -> bool:
        """A split page table, or a store kept within the pool: ``part`` can hand out ``pages`` more pages (evicting
        its prefix pages if need be)."""
        if pages <= 0 or self.table is None or (self.parts == 1 and not self._store_in_pool):
            return True
        short = pages - self.table.available(part)
        if short > 0 and self.reclaim is not None:
            self.reclaim(short * self.paged_page_bytes, part, keep=keep)
        return self.table.available(part) >= pages

    def can_admit(self, n_tokens: int, part: int = 0, hit: Collection[int] = ()) -> bool:
        """A free slot (in ``part``, where the page table is split) and room for ``n_tokens`` (evicting prefix pages
        if need be, ``part``'s first: another part's pages give it no room). ``hit``: the prefix store's blocks the
        sequence will start with (its first pages, held already: they need no room, and are not evicted for it)."""
        shared = len(hit) * self.paged_page_bytes
        if self.parts == 1 and not self._store_in_pool:
            return bool(self._free_slots) and self._room(self.bytes_for(n_tokens) - shared, hit)
        if not any(self.part_of(s) == part for s in self._free_slots):
            return False
        pages = self.table.pages_for(n_tokens) - len(hit) if any(self._paged) else 0
        return self._part_room(part, pages, hit) and self._room(self.bytes_for(n_tokens) - shared, hit)

    def place(self, n_tokens: int, match: Callable[..., list[int]] | None = None) -> int:
        """The part a new sequence of ``n_tokens`` goes to (0 when the table is not split): of the parts with a free
        slot and room (counting their evictable prefix pages), the one where ``match(part, touch=False)`` (the
        prefix store's pages of the sequence there) is longest, then the one with the most free slots. Admit it
        only if ``can_admit`` says so."""
        if self.parts == 1:
            return 0
        t = self.table
        pages = t.pages_for(n_tokens) if any(self._paged) else 0
        free = [sum(1 for s in self._free_slots if self.part_of(s) == q) for q in range(self.parts)]
        ok = [q for q in range(self.parts) if free[q] and (pages == 0 or t.available(q) + t.store_only_in[q] >= pages)]

        def rank(q: int) -> tuple[int, int, int]:
            hit = len(match(q, touch=False)) if match is not None and q in ok else 0
            return (q in ok, hit, free[q])

        return max(range(self.parts), key=lambda q: (*rank(q), -q))

    def lowest_slots_first(self) -> None:
        """The next admissions take the free slots in increasing order (``admit`` pops from the end)."""
        self._free_slots.sort(reverse=True)

    def admit(self, rid: str, part: int = 0) -> int:
        """Give ``rid`` a slot (in ``part`` of a split page table) and its state slots; token pages come with
        ``grow``."""
        if self.parts == 1:
            slot = self._free_slots.pop()
        else:
            i = max(i for i, s in enumerate(self._free_slots) if self.part_of(s) == part)
            slot = self._free_slots.pop(i)
        pages = [1 if p.per_seq else 0 for p in self.pools]
        self._held[rid] = (slot, pages)
        self._counted += self._counted_bytes(pages)
        return slot

    def grow(self, rid: str, n_tokens: int) -> bool:
        """Hold enough pages for ``n_tokens``; False (holding what it held) when the budget does not allow it."""
        slot, held = self._held[rid]
        want = [max(a, b) for a, b in zip(held, self.pages_for(n_tokens))]
        counted = self._counted_bytes(want) - self._counted_bytes(held)
        new_pages = 0
        if self.table is not None and any(self._paged):
            new_pages = max(0, self.table.pages_for(n_tokens) - len(self.table.slots[slot]))
        extra = counted + new_pages * self.paged_page_bytes
        dt = self.draft_table
        new_drafts = max(0, dt.pages_for(n_tokens) - len(dt.slots[slot])) if dt is not None else 0
        extra += new_drafts * self.draft_page_bytes
        if extra > 0 and not (self._part_room(self.part_of(slot), new_pages) and self._room(extra)):
            return False
        if new_pages:
            self.table.grow(slot, n_tokens)
        if new_drafts:
            dt.grow(slot, n_tokens)
        self._held[rid] = (slot, want)
        self._counted += counted
        return True

    def free(self, rid: str) -> list[int]:
        """``rid``'s slot and pages go back; returns the pages its slot held, in order (for the prefix store)."""
        slot, held = self._held.pop(rid)
        self._counted -= self._counted_bytes(held)
        if not self._held:
            self._counted = 0.0  # no drift from float sums
        pages = self.table.release(slot) if self.table is not None else []
        if self.draft_table is not None:
            self.draft_table.release(slot)
        self._free_slots.append(slot)
        if self.released is not None:
            self.released(slot)
        return pages

    def pages_in_use(self) -> dict[str, int]:
        """Pages held by live sequences per pool kind (state slots for Mamba-2; a shared page counted once)."""
        out: dict[str, int] = {}
        for _, held in list(self._held.values()):
            for n, p, paged in zip(held, self.pools, self._paged):
                if not paged:
                    out[p.kind] = out.get(p.kind, 0) + n
        for p, paged in zip(self.pools, self._paged):
            if paged:
                out[p.kind] = (self.draft_table if p.draft else self.table).live
            out.setdefault(p.kind, 0)
        return out

