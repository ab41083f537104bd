"""Attention mixers and their caches: GQA (full, sliding-window, with sinks) and MLA over cached latents.

MLA caches only the normalised latent c_KV and the rotary key part; with W_UK absorbed into the query and
W_UV applied after attention, it is multi-query attention over the latent (one shared "head" of width
kv_lora_rank + rope_dim), so both mixers share one attention kernel and one cache type.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from waferline import kernels
from waferline.model.block_table import BlockTable
from waferline.model.context import StepBatch
from waferline.model.layers import (
    Linear,
    RMSNorm,
    Rotary,
    attention_softmax_scale,
    few_rows,
    kept_args,
    linear,
    place_side_by_side,
    side_by_side,
)
from waferline.model.weights import WeightSource, copy_into
from waferline.spec.model import AttentionSpec, MLASpec

_NO_MASK = torch.empty(0, dtype=torch.bool)  # mla_decode's "no mask"
_EMPTY = torch.empty(0, dtype=torch.uint8)  # mla_attend_int4's "no q LoRA" (its q_a weight and scales)
# Query rows (B x T) up to which MLA runs the fused absorbed decode: it multiplies W_UK and W_UV row by row, which
# beats the eager chain's batched GEMMs only for a few rows (dsv3-100m attention, 1 thread: 1 row 0.36 vs 0.52 ms,
# 1 x 4 0.57 vs 0.67; 8 x 1 0.95 vs 0.87, 8 x 4 3.1 vs 1.8, an 8 x 32 prefill 13.5 vs 11.0). 8 rather than 4 because
# its scores go 4 cache rows at a time and int4 blocks are one op (mla_attend_int4): the 135M dsv3's int4 decode step
# at batch 8 takes 23.5 ms against 25.0 ms with a bound of 4 (1 thread; 18.8 vs 20.1 ms on 2).
MLA_FUSED_MAX_ROWS = 8
# Query rows up to which grouped-query attention runs as one fused op (decode, a speculative verify); prefill keeps
# attend()'s batched matmuls.
GQA_FUSED_MAX_ROWS = 8
_NO_SINKS = torch.empty(0)  # gqa_decode's "no sinks"
_NO_ROT = torch.empty(0)  # gqa_moe_layer's rotary rows without rotary
MAX_STAGING_COPIES = 4  # staging copies a paged cache keeps (a pipeline stage's micro-batches hold disjoint rows)
PAGE_TOKENS = 16  # tokens per page of a paged cache that allocates its own pages (the scheduler sets its own)


def _looker(deps: list) -> Any:
    def look(d: dict, key: str) -> Any:  # a dict's value, recorded as a dependency of the kept arguments (kept_args)
        v = d.get(key)
        deps.append((d, key, v))
        return v

    return look


def _block_weights(mods: dict, names: tuple, dtype: torch.dtype, look: Any) -> tuple | None:
    """The projections ``names`` of an attention block as a layer op takes them (mla_attend_int4, gqa_moe_layer):
    (weights, group sizes, whether any is dense): per projection an int4 weight in waferline's CPU layout computing in
    ``dtype`` (its codes and scales, its group size), or a bf16 weight of a bf16 block (the weight and an empty
    tensor, group 0: multiplied by linear_rows, as waferline's Linear does for few bf16 rows); a None name: two empty
    tensors,
    group 0 (no q LoRA). None where a projection has a bias or is neither."""
    w: list[torch.Tensor] = []
    groups: list[int] = []
    dense = False
    for name in names:
        if name is None:
            w += [_EMPTY, _EMPTY]
            groups.append(0)
            continue
        lin = look(mods, name)
        if lin is None or look(lin._parameters, "bias") is not None:
            return None
        q = look(lin._modules, "int4")
        if q is None:
            if type(lin) is not Linear:  # (another module's forward may multiply otherwise, e.g. nn.Linear's F.linear)
                return None
            wt = look(lin._parameters, "weight")
            if wt is None or wt.dtype != torch.bfloat16 or dtype != torch.bfloat16 or wt.dim() != 2:
                return None
            w += [wt, _EMPTY]
            groups.append(0)
            dense = True
            continue
        if q.backend != "cpu_waferline" or q.compute_dtype != dtype or q.lead:
            return None
        w += [look(q._buffers, "packed"), look(q._buffers, "scales_zeros")]
        groups.append(q.group_size)
    return w, groups, dense


class TokenCache:
    """Per-token cache rows for ``num_slots`` sequences.

    Full attention keeps every position. Paged (``page_tokens`` given; GQA without a window and MLA's latents): the rows
    live in a pool ``data`` [pages, page_tokens, width] and a ``BlockTable`` (model/block_table.py, shared by a
    model's paged caches and, in the scheduler's runner, by its ``CacheManager``) says which pages hold each slot's
    positions (a page is written once per position; a prefix-cache hit's pages are shared, never written); a slot's
    keys are a view of the pool where its pages are consecutive and it is the step's only row, else a gather of its
    pages. Unpaged (DeepSeek's sparse-attention parts): one tensor [slots, capacity, width]
    whose capacity doubles on demand. A sliding-window cache is a ring of ``window`` entries per slot with the
    absolute position of each entry (-1 = empty), so it never exceeds the window.

    The fused CPU layer ops write and read a [slots, capacity, width] tensor (``step_rows``): a paged cache hands them
    a view of the pool (one row, consecutive pages) or a staging copy of the step's rows, whose new entries are
    written to their pages before anything else reads or writes those rows or their pages change hands (``flush``);
    the next decode step of the same rows reuses it while it has room (eager decode steps too), so a decode batch
    gathers its rows about once per page of tokens.
    """

    def __init__(self, num_slots: int, width: int, dtype: torch.dtype, device: torch.device | str | None = None,
                 window: int | None = None, capacity: int = 64, page_tokens: int | None = None,
                 table: BlockTable | None = None):
        self.window = window
        self.table: BlockTable | None = None
        self._stages: list[_Stage] = []  # staging copies of decode rows (most recently used last)
        self._rows_at: dict[tuple[int, int], torch.Tensor] = {}
        if window is None and (page_tokens is not None or table is not None):
            self.table = table if table is not None else BlockTable(num_slots, page_tokens or 16)
            with torch.inference_mode(False):  # (the sink page; the rest come with _fit)
                self.data = torch.zeros(1, self.table.page_tokens, width, dtype=dtype, device=device)
            self._zeroed = 1  # pages made finite so far (every page a slot was given: a masked read of one is finite)
            self.pos = None
            return
        cap = window if window is not None else capacity
        self.data = torch.zeros(num_slots, cap, width, dtype=dtype, device=device)
        self.pos = torch.full((num_slots, cap), -1, dtype=torch.long, device=device) if window is not None else None

    @property
    def paged(self) -> bool:
        return self.table is not None

    @property
    def capacity(self) -> int:
        """Positions every slot can hold without growing (paged: the most pages any slot holds, in tokens)."""
        if self.table is not None:
            return max(map(len, self.table.slots)) * self.table.page_tokens
        return int(self.data.shape[1])

    def bind(self, table: BlockTable, like: TokenCache | None = None) -> None:
        """Take ``table``'s pages (a fresh cache; ``like``: keep that cache's pool, e.g. after a failed step)."""
        self.flush()
        if like is not None:  # (its entries not yet in pages are a failed step's: dropped)
            like._stages = []
            if like in table.dirty:
                table.dirty.remove(like)
        self.table = table
        if like is not None and like.table is not None and like.data.shape[1] == table.page_tokens:
            self.data, self._zeroed = like.data, like._zeroed
        elif self.data.shape[1] != table.page_tokens:
            with torch.inference_mode(False):
                self.data = torch.zeros(1, table.page_tokens, self.data.shape[2], dtype=self.data.dtype,
                                        device=self.data.device)
            self._zeroed = 1
        self._fit()

    def page_bytes(self) -> int:
        """Bytes of one page of this cache (page_tokens entries)."""
        return int(self.data.shape[1] * self.data.shape[2] * self.data.element_size())

    def _fit(self) -> None:
        """Make the pool hold the table's pages: all ``max_pages`` at once where the table has that bound (an
        allocator's budget: the pool never moves again, and its memory stays untouched until a page is first used,
        when it is zeroed), else doubling (zeroed)."""
        n = self.table.num_pages
        have = self.data.shape[0]
        if n > have:
            mp = self.table.max_pages
            cap = mp if mp is not None and mp >= n else max(n, 2 * have)
            with torch.inference_mode(False):
                make = torch.empty if mp is not None and mp >= n else torch.zeros
                pool = make(cap, *self.data.shape[1:], dtype=self.data.dtype, device=self.data.device)
                pool[: self._zeroed].copy_(self.data[: self._zeroed])
            self.data = pool
        if n > self._zeroed:
            with torch.inference_mode():
                self.data[self._zeroed: n].zero_()
            self._zeroed = n

    def reset(self, slots: torch.Tensor) -> None:
        if self.pos is not None:
            self.pos[slots] = -1
        elif self.table is not None and not self.table.managed:  # (a managed table's slots are its allocator's)
            for s in slots.tolist():
                self.table.release(s)

    def _grow(self, needed: int) -> None:
        if self.table is not None:  # pages to ``needed`` for every slot (a static decode step's end; a managed
            t = self.table      # table: every slot that holds pages, beyond what its allocator gave them)
            for s in range(t.num_slots):
                if t.slots[s] or not t.managed:
                    t.grow(s, needed)
            self._fit()
            return
        cap = self.capacity
        while cap < needed:
            cap *= 2
        extra = torch.zeros(
            self.data.shape[0], cap - self.capacity, self.data.shape[2], dtype=self.data.dtype, device=self.data.device
        )
        self.data = torch.cat([self.data, extra], dim=1)

    # -- paged rows
    def _span(self, batch: StepBatch) -> int:
        """Pages to the step's end (the rows' pages taken first, for an unmanaged table); once per step for every
        cache on the same table."""
        t = self.table
        key = ("pages", id(t))
        n = batch.memo.get(key)
        if n is None:
            if batch.host_slots is not None:
                for s, st in zip(batch.host_slots, batch.host_start):
                    t.ensure(s, st + batch.T)
            elif not t.managed:  # (rows known only as tensors: every slot takes pages to the step's end, as _grow
                for s in range(t.num_slots):  # gives a static step's; without them every row went to the sink page)
                    t.ensure(s, batch.end)
            n = batch.memo[key] = t.pages_for(batch.end)
            t.columns(n)  # (a ragged row reads past its pages: the sink, masked)
        return n

    def _ids(self, batch: StepBatch, n: int) -> torch.Tensor:
        """The rows' first ``n`` page ids [B, n] (memo per step)."""
        key = ("page_ids", id(self.table), n)
        ids = batch.memo.get(key)
        if ids is None:
            self.table.columns(n)
            ids = batch.memo[key] = self.table.ids_on(batch.slots.device).index_select(0, batch.slots)[:, :n]
        return ids

    def _where(self, batch: StepBatch, n: int) -> torch.Tensor:
        """The flat pool row of each new token [B * T] (memo per step)."""
        key = ("page_rows", id(self.table))
        where = batch.memo.get(key)
        if where is None:
            P, pos = self.table.page_tokens, batch.positions()
            page = self._ids(batch, n).gather(1, torch.div(pos, P, rounding_mode="floor"))
            where = batch.memo[key] = (page * P + pos % P).reshape(-1)
        return where

    def _gather(self, ids: torch.Tensor, B: int) -> torch.Tensor:
        """The pages ``ids`` [B, n] as rows [B, n * page_tokens, width] (one copy; the pool as [pages, page bytes]:
        index_select over a 3-d bf16 tensor took ~500x longer)."""
        pages = self.data.view(self.data.shape[0], -1).index_select(0, ids.reshape(-1))
        return pages.view(B, -1, self.data.shape[2])

    def _run_start(self, batch: StepBatch, n: int) -> int | None:
        """The first page of the single row's pages when they are n consecutive pages (its rows are then a view)."""
        s = batch.host_slots
        if s is None or len(s) != 1 or self.table.run[s[0]] < n:
            return None
        return self.table.slots[s[0]][0]

    def stages(self, slot: int | None) -> bool:
        """Whether a staging copy holds ``slot``'s rows, clean or not (its pages are about to change hands: the copy
        must go); None: whether any copy has entries not yet in their pages."""
        if slot is None:
            return any(st.lo != st.hi for st in self._stages)
        return any(slot in st.slots for st in self._stages)

    def flush(self, keep_apart_from: Iterable[int] | None = None) -> None:
        """Write the staging copies' new entries (see ``step_rows``) to their pages. The copies are dropped, except,
        with ``keep_apart_from``, those holding none of these slots: they go on being used (no write to their rows'
        pages follows but through them)."""
        copies, self._stages = self._stages, []
        apart = None if keep_apart_from is None else set(keep_apart_from)
        for st in copies:
            if apart is not None and apart.isdisjoint(st.slots):
                self._stages.append(_Stage(st.slots, st.data, list(st.hi), list(st.hi)))
            self._write_back(st)

    def _write_back(self, st: _Stage) -> None:
        """A staging copy's entries at positions lo .. hi - 1 of each row into their pages."""
        counts = [max(0, h - lo) for lo, h in zip(st.lo, st.hi)]
        if not sum(counts):
            return
        t, W = self.table, self.data.shape[2]
        t.columns(t.pages_for(max(st.hi)))
        src, dst = t.write_back_rows(list(st.slots), list(st.lo), counts, st.data.shape[1], self.data.device)
        with torch.inference_mode():  # (also when the allocator releases a slot, outside the model's steps)
            rows = st.data.view(-1, W).index_select(0, src)
            self.data.view(-1, W).index_copy_(0, dst, rows)

    def _staged(self, batch: StepBatch, n: int, make: bool) -> _Stage | None:
        """The staging copy of the step's rows: one that holds these rows with room for the step (its pending range
        extended), else (``make``) a new gather of their pages with room for more steps, every copy written back
        first (copies of other rows are kept, up to ``MAX_STAGING_COPIES``: micro-batches in flight alternate
        between disjoint rows); None where none is reused and not ``make``."""
        hs, T = batch.host_slots, batch.T
        st = next((c for c in self._stages if c.slots == hs), None)
        if st is not None and st.data.shape[1] >= batch.end and st.data.device == self.data.device:
            st.lo = [min(a, b) for a, b in zip(st.lo, batch.host_start)]
            st.hi = [max(a, b + T) for a, b in zip(st.hi, batch.host_start)]
            if self not in self.table.dirty:  # (a copy kept clean left the list)
                self.table.dirty.append(self)
            return st
        if not make:
            return None
        self.flush(keep_apart_from=hs)
        if len(self._stages) >= MAX_STAGING_COPIES:  # (written back: dropping the oldest loses nothing)
            del self._stages[:len(self._stages) - MAX_STAGING_COPIES + 1]
        m = n + 2  # (room for a page or more of tokens: the next steps of these rows reuse the copy)
        st = _Stage(hs, self._gather(self._ids(batch, m), len(hs)), list(batch.host_start),
                    [s + T for s in batch.host_start])
        self._stages.append(st)
        if self not in self.table.dirty:
            self.table.dirty.append(self)
        return st

    def step_rows(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(a [slots, capacity, width] tensor, the slot of each of ``batch.rows()``) for a fused op that writes the
        step's entries and reads each row's positions below its end: the cache itself (unpaged), a view of the pool
        (paged, one row whose pages are consecutive), or a staging copy of the rows (paged, otherwise; written back
        by ``flush``)."""
        rows = batch.rows()
        if self.table is None:
            if rows.end > self.capacity:
                self._grow(rows.end)
            return self.data, rows.slots
        hs, T = batch.host_slots, batch.T
        if hs is None:
            raise RuntimeError("a fused step over paged caches needs the rows' slots on the host")
        n = self._span(batch)
        self._fit()
        # a copy of these rows with room for this step goes on being used (the steps of a burst are prepared last
        # first: the earlier ones must see what the later ones will read, the same tensor)
        st = self._staged(batch, n, make=False)
        if st is None:
            p0 = self._run_start(batch, n)
            if p0 is not None:
                self.flush(keep_apart_from=hs)
                return self.data[p0: p0 + n].view(1, n * self.table.page_tokens, -1), self._row_index(1, T)
            st = self._staged(batch, n, make=True)
        return st.data, self._row_index(len(hs), T)

    def _row_index(self, B: int, T: int) -> torch.Tensor:
        """Row b of a view or staging copy for each of a step's B x T token rows (kept per shape)."""
        idx = self._rows_at.get((B, T))
        if idx is None:
            idx = self._rows_at[B, T] = torch.arange(B, device=self.data.device).repeat_interleave(T)
        return idx

    def update(self, new: torch.Tensor, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store ``new`` [B, T, width] at the batch's positions; return the keys to attend to [B, L, width] and the
        mask of keys each query must NOT see (bool, broadcastable to [B, T, L]; None when every key is visible).
        Paged: in place for one row in consecutive pages; through the rows' staging copy for decode rows (kept for
        their next steps); else written to the pages and gathered."""
        B, T = new.shape[0], new.shape[1]
        if self.table is not None:
            end, W, P = batch.end, self.data.shape[2], self.table.page_tokens
            n = self._span(batch)
            self._fit()
            hs = batch.host_slots
            st = self._staged(batch, n, make=False) if hs is not None else None
            if st is None:
                self.flush(keep_apart_from=hs)
                p0 = self._run_start(batch, n)
                if p0 is not None:  # one row in consecutive pages: a slice of the pool, written and read in place
                    keys = self.data[p0: p0 + n].view(1, n * P, W)
                    s0 = batch.host_start[0]
                    keys[0, s0: s0 + T] = new[0]
                    return keys[:, :end], causal_mask(batch, end)
                if hs is None or T > 1:  # (a prompt chunk, or a static step: straight to the pages)
                    self.data.view(-1, W).index_copy_(0, self._where(batch, n), new.reshape(-1, W).to(self.data.dtype))
                    return self._gather(self._ids(batch, n), B)[:, :end], causal_mask(batch, end)
                st = self._staged(batch, n, make=True)
            if batch.uniform:
                s0 = batch.host_start[0]
                st.data[:, s0: s0 + T] = new
            else:
                st.data[self._row_index(B, 1)[:, None], batch.positions()] = new
            return st.data[:, :end], causal_mask(batch, end)
        if self.window is None:
            end = batch.end
            if end > self.capacity:
                self._grow(end)
            s0 = batch.slot0
            if s0 is not None and batch.uniform:  # one contiguous block: a slice copy, no scatter
                st = batch.host_start[0]
                self.data[s0: s0 + B, st: st + T] = new
            else:
                self.data[batch.slots[:, None], batch.positions()] = new
            keys = self.data[s0: s0 + B, :end] if s0 is not None else self.data[batch.slots, :end]
            return keys, causal_mask(batch, end)
        pos = batch.positions()
        old, old_pos = self.data[batch.slots], self.pos[batch.slots]
        keys = torch.cat([old, new], dim=1)
        key_pos = torch.cat([old_pos, pos], dim=1)
        keep = min(T, self.window)
        ring = pos[:, -keep:] % self.window
        self.data[batch.slots[:, None], ring] = new[:, -keep:]
        self.pos[batch.slots[:, None], ring] = pos[:, -keep:]
        qp, kp = pos[:, :, None], key_pos[:, None, :]
        return keys, (kp < 0) | (kp > qp) | (kp <= qp - self.window)

    def ring_snapshot(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Copies of a sliding-window ring's rows for ``slots`` before a speculative verify (None for full attention:
        entries of rejected tokens lie beyond the sequence, are masked causally and are overwritten later)."""
        if self.window is None:
            return None
        return self.data[slots].clone(), self.pos[slots].clone()

    def ring_rewind(self, batch: StepBatch, keep: list[int], snap: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """After a verify of ``batch`` (T <= window): put back the ring entries that rejected tokens (row b's tokens
        from ``keep[b]`` on) overwrote, so the window again holds the accepted sequence's last entries."""
        if snap is None:
            return
        for b, k in enumerate(keep):
            if k < batch.T:
                s, start = int(batch.slots[b]), int(batch.start[b])
                ring = torch.arange(start + k, start + batch.T) % self.window
                self.data[s, ring] = snap[0][b, ring]
                self.pos[s, ring] = snap[1][b, ring]

    def tokens_held(self, slot: int) -> int:
        """How many token entries this slot's row actually holds (for tests and accounting checks; paged: its pages'
        positions)."""
        if self.pos is not None:
            return int((self.pos[slot] >= 0).sum())
        if self.table is not None:
            return len(self.table.slots[slot]) * self.table.page_tokens
        return self.capacity

    def read(self, slot: int, end: int) -> torch.Tensor:
        """A copy of ``slot``'s entries at positions 0 .. end-1 [end, width] (full attention)."""
        if self.table is None:
            return self.data[slot, :end].clone()
        self.flush()
        self._fit()
        n = self.table.pages_for(end)
        return self.data[self.table.slots[slot][:n]].reshape(-1, self.data.shape[2])[:end].clone()

    def write(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Put ``rows`` [n, width] at ``slot``'s positions start .. start+n-1 (full attention; as a step would)."""
        self.update(rows[None], StepBatch.make([slot], [start], rows.shape[0], self.data.device))


def managed_table(caches: list[Any], num_slots: int, page_tokens: int) -> BlockTable | None:
    """One page table of ``page_tokens``-token pages for every paged TokenCache in ``caches`` (each bound to it: its
    pages come from the table from now on, before any sequence runs), managed by its caller (the scheduler's
    CacheManager); None where no cache is paged."""
    paged = [i for i, c in enumerate(caches) if isinstance(c, TokenCache) and c.paged]
    if not paged:
        return None
    table = BlockTable(num_slots, page_tokens, managed=True)
    table.layers = frozenset(paged)
    for i in paged:
        caches[i].bind(table)
    return table


@dataclass
class _Stage:
    """A paged cache's staging copy of some rows for the fused ops: row b is slot ``slots[b]``; positions
    ``lo[b]`` .. ``hi[b]`` - 1 may hold entries its pages do not have yet."""

    slots: tuple[int, ...]
    data: torch.Tensor
    lo: list[int]
    hi: list[int]


def share_pages(caches: list[Any]) -> list[Any]:
    """Give the paged caches among ``caches`` (fresh: one model's layers) one block table, the first one's, so a
    page id names the same positions in every layer and a step looks the rows' pages up once; returns ``caches``."""
    paged = [c for c in caches if isinstance(c, TokenCache) and c.paged]
    for c in paged[1:]:
        c.bind(paged[0].table)
    return caches


def causal_mask(batch: StepBatch, L: int) -> torch.Tensor | None:
    """Keys at positions 0..L-1 that each query of ``batch`` must not see (bool [B, T, L]), computed once per step and
    shared by the layers; None when nothing is hidden (one new token per row, all rows at the same position)."""
    key = ("causal", L)
    if key not in batch.memo:
        if batch.T == 1 and batch.uniform and L == batch.end:
            batch.memo[key] = None
        else:
            kp = torch.arange(L, device=batch.start.device)
            batch.memo[key] = kp[None, None, :] > batch.positions()[:, :, None]
    return batch.memo[key]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None, scale: float,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped attention with a precomputed mask.

    q [B, T, H, Dk]; k [B, L, Hkv, Dk]; v [B, L, Hkv, Dv]; ``blocked`` bool [B, T, L] (True = masked) or None.
    Scores and softmax in fp32. ``sinks`` [H]: a per-head logit that joins the softmax and is then dropped
    (GPT-OSS). Returns [B, T, H, Dv].
    """
    T, Dk, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    latents = Dv < Dk and v.data_ptr() == k.data_ptr() and v.stride() == k.stride()  # (MLA's: the keys' first Dv)
    if sinks is None and q.dtype == k.dtype == v.dtype and (q.device.type != "cpu" or not kernels.available()):
        if Dk == Dv:
            return attend_sdpa(q, k, v, blocked, scale)
        if latents:  # attend over the keys as values, keep Dv
            return attend_sdpa(q, k, k, blocked, scale)[..., :Dv]
    if sinks is None and T > 1 and q.device.type == "cpu" and (Dk == Dv or latents):
        return attend_prefill_cpu(q, k, k if latents else v, blocked, scale)[..., :Dv]
    return attend_chain(q, k, v, blocked, scale, sinks)


def attend_chain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None, scale: float,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`attend` as matmuls, a masked softmax and matmuls (what a CPU with the fused operators runs for a decode
    step's rows beyond the fused operator's, and with attention sinks)."""
    B, T, H, Dk = q.shape
    L, Hkv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    out_dtype = q.dtype
    if q.device.type == "cpu" and (q.dtype != torch.float32 or k.dtype != torch.float32):
        # 16-bit attention matmuls on CPU go through oneDNN, which builds a new kernel for every new key length
        # (measured ~0.7 ms per call in decode against ~16 us for fp32 with the casts): compute them in fp32
        q, k, v = q.float(), k.float(), v.float()
    if Hkv == 1:  # multi-query (MLA over its latent): one batched matmul for every head, queries ordered (t, h)
        scores = torch.matmul(q.reshape(B, T * H, Dk), k[:, :, 0].transpose(1, 2)).view(B, T, H, L)
        mask = None if blocked is None else blocked[:, :, None, :]
    else:  # [B, Hkv, T*G, Dk] x [B, Hkv, Dk, L], queries ordered (t, g) within each kv head
        qg = q.view(B, T, Hkv, G, Dk).permute(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, Dk)
        # the keys head-major with each key's Dk contiguous, then transposed as a view: the matmul folds (B, Hkv)
        # into one batch without another copy (k.permute(0, 2, 3, 1) copied them transposed: ~4x slower)
        kh = k.permute(0, 2, 1, 3).contiguous()
        scores = torch.matmul(qg, kh.transpose(2, 3)).view(B, Hkv, T, G, L)
        mask = None if blocked is None else blocked[:, None, :, None, :]
    scores = scores.float().mul_(scale) if scores.dtype != torch.float32 else scores.mul_(scale)
    if mask is not None:
        scores.masked_fill_(mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, Hkv, 1, G, 1).expand(B, Hkv, T, G, 1) if Hkv > 1 else \
            sinks.float().view(1, 1, H, 1).expand(B, T, H, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if probs.dtype != v.dtype:
        probs = probs.to(v.dtype)
    if Hkv == 1:
        out = torch.matmul(probs.view(B, T * H, L), v[:, :, 0]).view(B, T, H, Dv)
    else:
        out = torch.matmul(probs.reshape(B, Hkv, T * G, L), v.permute(0, 2, 1, 3))  # [B, Hkv, T*G, Dv]
        out = out.view(B, Hkv, T, G, Dv).permute(0, 2, 1, 3, 4).reshape(B, T, H, Dv)
    return out if out.dtype == out_dtype else out.to(out_dtype)


# attend_sdpa's last one-token mask as SDPA takes it, with the step's mask it came from (a step's layers share one
# mask, causal_mask's, which nothing writes to; the entry holds it, so no later mask can be that object). Only for
# one query per row (a decode step, the step a CUDA graph captures): small; a prefill's [B, 1, T*G, L] is not kept.
_KEEP: list[tuple[torch.Tensor, int, torch.Tensor] | None] = [None]


def attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None,
                scale: float) -> torch.Tensor:
    """:func:`attend` (without sinks, Dk == Dv: MLA passes its latents as keys and values) as torch's fused
    attention: one kernel on a GPU (flash or
    memory-efficient attention) where attend's chain is ~7, reading the keys in place where attend copies them
    head-major first. Each kv head's G query heads become rows of its queries (as attend folds them), so no key or
    value is repeated per query head. The device path (a GPU, or a CPU without waferline's fused operators); its
    scores and softmax are fp32 in those kernels, its probabilities rounded to q's dtype for the value product."""
    B, T, H, Dk = q.shape
    L, Hkv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    qg = q.view(B, T, Hkv, G, Dk).permute(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, Dk)
    keep = None
    if blocked is not None:  # bool [B, T, L], True = hidden; SDPA's boolean mask is True = attend
        last = _KEEP[0]
        if last is not None and last[0] is blocked and last[1] == G:  # (the step's other layers: the same mask)
            keep = last[2]
        else:
            keep = (~blocked)[:, None, :, None, :].expand(B, 1, T, G, L).reshape(B, 1, T * G, L)
            _KEEP[0] = (blocked, G, keep) if T == 1 else None
    out = nn.functional.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep,
                                                     scale=scale)  # [B, Hkv, T*G, Dv]
    return out.view(B, Hkv, T, G, Dv).permute(0, 2, 1, 3, 4).reshape(B, T, H, Dv)


def attend_prefill_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None,
                       scale: float) -> torch.Tensor:
    """:func:`attend` of a prefill chunk (T > 1, Dk == Dv, no sinks) on a CPU (one with waferline's fused operators, or
    one without them where q and the cache differ in dtype: MLA's fp32 queries over 16-bit latents): torch's fused
    attention (its CPU flash kernel: blocks of keys at a time, the scores never written out) in fp32, as attend
    computes them, the kv heads shared by their query heads without a copy (``enable_gqa``). ~2x faster than attend's
    chain over a long prompt, whose score passes (scale, mask, softmax) each read and write every score: measured in
    docs/results/ttft.md. Decode steps (T = 1) keep the chain or the fused operators the host model was calibrated on.
    A row whose every key is masked gives zeros (the chain: NaN); the engine never asks for one."""
    out_dtype = q.dtype

    def f32(t: torch.Tensor) -> torch.Tensor:  # (no op where it is fp32 already: none the twin's counter would price)
        return t if t.dtype == torch.float32 else t.float()

    qh, kh = f32(q).transpose(1, 2), f32(k).transpose(1, 2)  # [B, heads, tokens, D]
    vh = kh if v is k else f32(v).transpose(1, 2)  # (MLA: the latents are keys and values, cast once)
    keep = None if blocked is None else ~blocked[:, None]  # [B, 1, T, L]: True = attend
    out = nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep, scale=scale,
                                                     enable_gqa=kh.shape[1] != qh.shape[1])
    out = out.transpose(1, 2)  # [B, T, H, D]
    return out if out.dtype == out_dtype else out.to(out_dtype)


class GQAttention(nn.Module):
    """Grouped-query attention with optional q/k norms, biases, partial/no rotary, sliding window and sinks."""

    def __init__(self, spec: AttentionSpec, cfg: dict[str, Any], dtype: torch.dtype = torch.float32,
                 rotary: Rotary | None = None, scale: float | None = None, norm_eps: float = 1e-6):
        super().__init__()
        self.spec = spec
        h, kv, hd, d = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
        self.q_proj = Linear(d, h * hd, spec.qkv_bias, dtype)
        self.k_proj = Linear(d, kv * hd, spec.qkv_bias, dtype)
        self.v_proj = Linear(d, kv * hd, spec.qkv_bias, dtype)
        self.o_proj = Linear(h * hd, d, spec.o_bias, dtype)
        self.q_norm = RMSNorm(hd, norm_eps, dtype) if spec.qk_norm else None
        self.k_norm = RMSNorm(hd, norm_eps, dtype) if spec.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(h, dtype=dtype), requires_grad=False) if spec.sinks else None
        self.rotary = rotary
        self.scale = scale if scale is not None else hd ** -0.5
        self.dtype = dtype

    def new_cache(self, num_slots: int, device: torch.device | str | None = None) -> TokenCache:
        s = self.spec
        return TokenCache(num_slots, s.cache_elems_per_token(), self.dtype, device, window=s.sliding_window,
                          page_tokens=PAGE_TOKENS)

    def _block(self, x: torch.Tensor, cache: TokenCache) -> tuple | None:
        """The weight arguments ``waferline::gqa_moe_layer`` takes for this block when it can run as part of that op
        for ``x``: at most GQA_FUSED_MAX_ROWS new tokens on CPU (a decode step or a verify's tokens, as rows of one
        token), a full-attention cache, q/k/v/o int4 in waferline's CPU layout computing in x's dtype or bf16 for a bf16
        x of at most ``few_rows()`` rows (linear_rows: what Linear runs for them), no biases, q/k norms (if any) in x's
        dtype. None otherwise (the modules, which compute the same numbers). Kept between calls (kept_args)."""
        rows = x.shape[0] * x.shape[1]
        if rows > GQA_FUSED_MAX_ROWS or x.device.type != "cpu" or cache.window is not None or not kernels.available():
            return None
        args = kept_args(self, "_int4_cache", x.dtype, lambda deps: self._block_args(x.dtype, deps))
        if args is not None and args[-1] and rows > few_rows(x.dtype):
            return None
        return args

    def _block_args(self, dtype: torch.dtype, deps: list) -> tuple | None:
        look = _looker(deps)
        found = _block_weights(self._modules, ("q_proj", "k_proj", "v_proj", "o_proj"), dtype, look)
        if found is None:
            return None
        w, groups, dense = found
        qn, kn = look(self._modules, "q_norm"), look(self._modules, "k_norm")
        if (qn is None) != (kn is None):
            return None
        qw = kw = _EMPTY
        eps = 0.0
        if qn is not None:
            qw, kw = look(qn._parameters, "weight"), look(kn._parameters, "weight")
            if qw is None or kw is None or qw.dtype != dtype or kw.dtype != dtype or qn.eps != kn.eps:
                return None
            eps = qn.eps
        rot = look(self._modules, "rotary")
        sinks = look(self._parameters, "sinks")
        return (w, groups, qw, kw, eps, rot.dim if rot is not None else 0, bool(rot is not None and rot.interleaved),
                _NO_SINKS if sinks is None else sinks.float(), dense)

    def step_args(self, x: torch.Tensor, cache: TokenCache, batch: StepBatch) -> tuple | None:
        """``waferline::gqa_moe_layer``'s attention arguments (after x, the mixer norm's weight and epsilon) for this
        step when the block runs in that op (see :meth:`_block`; the cache grown to the step's end first), else None.
        The rows' slots and positions are ``batch.rows()``'s, as for MLAttention.step_args."""
        a = self._block(x, cache)
        if a is None:
            return None
        cos, sin, data, slots, start = self.step_dynamic(cache, batch)
        w, groups, qw, kw, eps, rot, interleaved, sinks, _ = a
        s = self.spec
        return (w, groups, qw, kw, eps, cos, sin, rot, interleaved, data, slots, start, sinks, self.scale, s.num_heads,
                s.num_kv_heads)

    STEP_DYNAMIC = (5, 6, 9, 10, 11)  # where step_args' per-step values (step_dynamic's, in order) sit

    def step_dynamic(self, cache: TokenCache, batch: StepBatch) -> tuple:
        """The arguments of :meth:`step_args` that change from step to step: the rotary rows (empty without rotary),
        the cache tensor (``TokenCache.step_rows``': grown to the step's end, or a paged cache's view or staging copy),
        the rows' slots in it and their positions."""
        rows = batch.rows()
        data, slots = cache.step_rows(batch)
        cos, sin = self.rotary.cos_sin(rows.positions(), rows) if self.rotary is not None else (_NO_ROT, _NO_ROT)
        return cos, sin, data, slots, rows.start

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(self, name).load_hf(src, prefix + name)
        self.colocate()
        if self.q_norm is not None:
            self.q_norm.load_hf(src, prefix + "q_norm.weight")
            self.k_norm.load_hf(src, prefix + "k_norm.weight")
        if self.sinks is not None:
            copy_into(self.sinks, src.get(prefix + "sinks", tuple(self.sinks.shape)))

    def colocate(self) -> None:
        """The q, k and v projections' weights side by side in one tensor (layers.place_side_by_side), for
        :meth:`_qkv`; after loading, and after a move to another device (which copies each weight on its own). Not
        on a CPU with waferline's fused operators: they take the projections one by one, and the huge-page arena
        (model/arena.py) moves whole tensors only, not views."""
        w = self.q_proj.weight if type(self.q_proj) is Linear else None
        if w is not None and not (w.device.type == "cpu" and kernels.available()):
            place_side_by_side([self.q_proj, self.k_proj, self.v_proj])

    def _qkv(self, x: torch.Tensor) -> torch.Tensor | None:
        """q, k and v of x as one product [B, T, (H + 2 Hkv) head_dim] on the device path (a GPU, or a CPU without
        waferline's fused operators, whose decode takes the projections apart), where their weights lie side by
        side (:meth:`colocate`): one kernel instead of three. None otherwise."""
        if x.device.type == "cpu" and kernels.available():
            return None
        mods = self._modules
        q, k, v = mods["q_proj"], mods["k_proj"], mods["v_proj"]
        if not (type(q) is Linear and type(k) is Linear and type(v) is Linear):
            return None
        # the stacked view, kept while the modules and their weights' addresses are those it was made from (looking
        # the storages up took ~25 us a layer; a kept view holds its storage, so no other can take its address)
        key = (q, k, v, *(t.data_ptr() for m in (q, k, v) for t in (m.weight, m.bias) if t is not None))
        kept = self.__dict__.get("_qkv_kept")
        if kept is None or any(a is not b for a, b in zip(kept[0], key[:3])) or kept[0][3:] != key[3:]:
            w = side_by_side([q.weight, k.weight, v.weight])
            b = None if q.bias is None else side_by_side([q.bias, k.bias, v.bias])
            kept = self.__dict__["_qkv_kept"] = (key, None if w is None or (q.bias is not None and b is None)
                                                 else (w, b))
        if kept[1] is None or kept[1][0].dtype != x.dtype:
            return None
        return linear(x, *kept[1])  # (on CPU: the one-row path that bypasses oneDNN, as Linear takes)

    def _qk_norm_weight(self) -> torch.Tensor | None:
        """The q and k norms' weights as one [H + Hkv, head_dim] (q's for each query head, then k's for each kv
        head), where the norms are RMSNorms of one epsilon and weight dtype; kept between calls (kept_args)."""
        def build(deps: list) -> torch.Tensor | None:
            look = _looker(deps)
            qn, kn = look(self._modules, "q_norm"), look(self._modules, "k_norm")
            if type(qn) is not RMSNorm or type(kn) is not RMSNorm or qn.eps != kn.eps:
                return None
            qw, kw = look(qn._parameters, "weight"), look(kn._parameters, "weight")
            if qw.dtype != kw.dtype or qw.device != kw.device:
                return None
            s = self.spec
            return torch.cat([qw.expand(s.num_heads, -1), kw.expand(s.num_kv_heads, -1)])

        return kept_args(self, "_qk_norm", torch.float32, build)

    def forward(self, x: torch.Tensor, cache: TokenCache, batch: StepBatch) -> torch.Tensor:
        s = self.spec
        B, T, _ = x.shape
        h, kvh, hd = s.num_heads, s.num_kv_heads, s.head_dim
        qkv = self._qkv(x)
        qk = None  # q and k side by side, [B, T, H + Hkv, head_dim], where they are
        if qkv is None:
            q = self.q_proj(x).view(B, T, h, hd)
            k = self.k_proj(x).view(B, T, kvh, hd)
            v = self.v_proj(x).view(B, T, kvh, hd)
        else:
            q, k, v = (t.view(B, T, -1, hd) for t in qkv.split([h * hd, kvh * hd, kvh * hd], dim=-1))
            qk = qkv[..., :(h + kvh) * hd].view(B, T, h + kvh, hd)
        if self.q_norm is not None:
            w = None if qk is None else self._qk_norm_weight()
            if w is not None:  # both norms as one over q and k together, each head times its own norm's weight
                qk = w * nn.functional.rms_norm(qk, (hd,), eps=self.q_norm.eps)
                q, k = qk.split([h, kvh], dim=2)
            else:
                q, k, qk = self.q_norm(q), self.k_norm(k), None
        if self.rotary is not None:  # q and k rotated together: one pass over [B, T, H + Hkv, head_dim]
            cos, sin = self.rotary.cos_sin(batch.positions(), batch)
            q, k = self.rotary.apply(torch.cat([q, k], dim=2) if qk is None else qk, cos, sin).split([h, kvh], dim=2)
        kv, blocked = cache.update(torch.cat([k, v], dim=2).view(B, T, -1), batch)
        kv = kv.view(B, kv.shape[1], 2 * kvh, s.head_dim)
        if x.device.type == "cpu" and B * T <= GQA_FUSED_MAX_ROWS and kernels.available():
            # attend() below as one fused op over the cache rows
            mask = _NO_MASK if blocked is None else blocked.expand(B, T, kv.shape[1])
            sinks = _NO_SINKS if self.sinks is None else self.sinks.float()
            out = torch.ops.waferline.gqa_decode(q, kv, mask, sinks, self.scale)
        else:
            out = attend(q, kv[:, :, :kvh], kv[:, :, kvh:], blocked, self.scale, self.sinks)
        return self.o_proj(out.reshape(B, T, -1))


class MLAttention(nn.Module):
    """DeepSeek multi-head latent attention; caches [c_KV (normalised) | k_rope] per token, decodes absorbed.
    ``norm_eps``: the epsilon of the latent norms (q_a_layernorm, kv_a_layernorm), a constant 1e-6 in the reference
    implementations, whatever the model's rms_norm_eps (Kimi K2's is 1e-5)."""

    def __init__(
        self,
        spec: MLASpec,
        cfg: dict[str, Any],
        dtype: torch.dtype = torch.float32,
        interleaved_rope: bool = True,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        self.spec = spec
        h, d = spec.num_heads, spec.hidden_size
        bias = bool(cfg.get("attention_bias", False))
        if spec.q_lora_rank:
            self.q_a_proj = Linear(d, spec.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, norm_eps, dtype)
            self.q_b_proj = Linear(spec.q_lora_rank, h * spec.qk_head_dim, False, dtype)
        else:
            self.q_proj = Linear(d, h * spec.qk_head_dim, False, dtype)
        self.kv_a_proj_with_mqa = Linear(d, spec.kv_lora_rank + spec.qk_rope_head_dim, bias, dtype)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, norm_eps, dtype)
        self.kv_b_proj = Linear(spec.kv_lora_rank, h * (spec.qk_nope_head_dim + spec.v_head_dim), False, dtype)
        self.o_proj = Linear(h * spec.v_head_dim, d, bias, dtype)
        self.rotary = Rotary(spec.qk_rope_head_dim, cfg, interleaved=interleaved_rope)
        self.scale = attention_softmax_scale(cfg, spec.qk_head_dim)
        self.dtype = dtype
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def new_cache(self, num_slots: int, device: torch.device | str | None = None) -> TokenCache:
        return TokenCache(num_slots, self.spec.cache_elems_per_token(), self.dtype, device,  # [c_KV | k_rope]
                          page_tokens=PAGE_TOKENS)

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        names = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
        names += ["q_a_proj", "q_b_proj"] if self.spec.q_lora_rank else ["q_proj"]
        for name in names:
            getattr(self, name).load_hf(src, prefix + name)
        self.kv_a_layernorm.load_hf(src, prefix + "kv_a_layernorm.weight")
        if self.spec.q_lora_rank:
            self.q_a_layernorm.load_hf(src, prefix + "q_a_layernorm.weight")
        self._absorbed = None

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, r] (absorbed into the query) and W_UV [H, v, r] (applied after attention). On CPU, fp32, or
        bf16 as a bf16 model holds them where the fused kernels run (they widen them to fp32 as they read them: the
        same numbers from half the bytes a decode step reads). Kept between calls, and made again when kv_b_proj's
        weight is replaced or changed in place (its version: a training step) or is to get gradients through them where
        the kept ones were made without (under no_grad)."""
        held = self.kv_b_proj._parameters.get("weight")
        # (weights loaded under torch.inference_mode are inference tensors, which keep no version: only their
        # replacement is seen; an int4 kv_b_proj makes its weight from its codes at each read: those are the stamp)
        stamp = ((getattr(self.kv_b_proj, "int4", None), -1, False) if held is None else
                 (held, -1 if held.is_inference() else held._version, torch.is_grad_enabled() and held.requires_grad))
        kept = self.__dict__.get("_absorbed_from")
        if self._absorbed is None or kept is None or kept[0] is not stamp[0] or kept[1:] != stamp[1:]:
            s = self.spec
            w = self.kv_b_proj.weight.view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
            if w.device.type == "cpu" and not (w.dtype == torch.bfloat16 and kernels.available()):
                w = w.float()  # small per-head matmuls: fp32 on CPU (16-bit ones go through slow oneDNN paths)
            self._absorbed = (w[:, : s.qk_nope_head_dim].contiguous(), w[:, s.qk_nope_head_dim:].contiguous())
            self._absorbed_from = stamp
        return self._absorbed

    def _int4_block(self, x: torch.Tensor, cache: TokenCache) -> tuple | None:
        """``waferline::mla_attend_int4``'s weight arguments (weights and scales, group sizes, the two norms' weights
        and
        epsilons) when this block can run as that one op for ``x``: at most MLA_FUSED_MAX_ROWS new tokens (a decode
        step, or a verify's few tokens per row, which go in as rows of one token) on CPU, a full-attention cache, every
        projection an int4 weight in waferline's CPU layout computing in x's dtype or a bf16 weight of a bf16 x (for
        at most ``few_rows()`` rows: what Linear multiplies with ``linear_rows``, as the op then does), none with a
        bias, norms in x's dtype. None
        otherwise (the eager chain below, which computes the same numbers). Built once per dtype and reused while every
        module and tensor it was built from is still the one the block holds (checked by identity, as MoE's are):
        looking them up through the modules took ~30 us a layer."""
        rows = x.shape[0] * x.shape[1]
        if rows > MLA_FUSED_MAX_ROWS or x.device.type != "cpu" or cache.window is not None or not kernels.available():
            return None
        args = kept_args(self, "_int4_cache", x.dtype, lambda deps: self._int4_args(x.dtype, deps))
        if args is not None and args[6] and rows > few_rows(x.dtype):
            return None
        return args

    def _int4_args(self, dtype: torch.dtype, deps: list) -> tuple | None:
        look = _looker(deps)
        names = ("q_a_proj", "q_b_proj") if self.spec.q_lora_rank else (None, "q_proj")
        found = _block_weights(self._modules, (*names, "kv_a_proj_with_mqa", "o_proj"), dtype, look)
        if found is None:
            return None
        w, groups, dense = found
        kv = look(self._modules, "kv_a_layernorm")
        qn = look(self._modules, "q_a_layernorm") if self.spec.q_lora_rank else kv
        norms = [look(kv._parameters, "weight"), look(qn._parameters, "weight")]
        if any(nw is None or nw.dtype != dtype for nw in norms):
            return None
        return w, groups, norms[1], norms[0], qn.eps, kv.eps, dense

    def step_args(self, x: torch.Tensor, cache: TokenCache, batch: StepBatch) -> tuple | None:
        """``waferline::mla_attend_int4``'s arguments after ``x`` (as rows of one token: ``x.view(-1, 1, D)``) for this
        step when the block runs as that op (see :meth:`_int4_block`; the cache grown to the step's end first), else
        None. The rows' slots and positions are those of ``batch.rows()``: each of a verify's tokens sees the cache
        entries the earlier ones write, as one-token steps would (the same numbers, token by token)."""
        fused = self._int4_block(x, cache)
        if fused is None:
            return None
        cos, sin, data, slots, start = self.step_dynamic(cache, batch)
        w_uk, w_uv = self.absorbed()
        w, groups, qn_w, kv_w, qn_eps, kv_eps, _ = fused
        return (w, groups, qn_w, kv_w, qn_eps, kv_eps, cos, sin, self.rotary.interleaved, data, slots, start, w_uk,
                w_uv, self.scale)

    STEP_DYNAMIC = (6, 7, 9, 10, 11)  # where step_args' per-step values (step_dynamic's, in order) sit

    def step_dynamic(self, cache: TokenCache, batch: StepBatch) -> tuple:
        """The arguments of :meth:`step_args` that change from step to step (the rest are the weights): the rotary
        rows, the cache tensor (``TokenCache.step_rows``': grown to the step's end, or a paged cache's view or staging
        copy), the rows' slots in it and their positions."""
        rows = batch.rows()
        data, slots = cache.step_rows(batch)
        cos, sin = self.rotary.cos_sin(rows.positions(), rows)
        return cos, sin, data, slots, rows.start

    def forward(self, x: torch.Tensor, cache: TokenCache, batch: StepBatch) -> torch.Tensor:
        B, T, _ = x.shape
        fused = self.step_args(x, cache, batch)
        if fused is not None:  # the chain below as one op (tokens as decode rows, int4 projections)
            return torch.ops.waferline.mla_attend_int4(x.reshape(B * T, 1, -1), *fused).view(B, T, -1)
        _, q_nope, q_rope, latents, blocked = self.queries_and_latents(x, cache, batch)
        return self.attend_latents(q_nope, q_rope, latents, blocked, x.dtype)

    def queries_and_latents(self, x: torch.Tensor, cache: TokenCache, batch: StepBatch) -> tuple:
        """The step's queries and the latents they attend to: (the query's input to q_b_proj — q_a_layernorm's output,
        or x without q LoRA — which DeepSeek's sparse-attention indexer also reads, q_nope [B, T, H, nope], q_rope
        [B, T, H, rope] rotated, the cache's latents [B, L, r + rope] with this step's written, the causal mask
        (TokenCache.update's))."""
        s = self.spec
        B, T, _ = x.shape
        H, n, r = s.num_heads, s.qk_nope_head_dim, s.kv_lora_rank
        if s.q_lora_rank:
            q_in = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_in)
        else:
            q_in = x
            q = self.q_proj(x)
        q = q.view(B, T, H, s.qk_head_dim)
        ckv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(ckv[..., :r])
        cos, sin = self.rotary.cos_sin(batch.positions(), batch)
        # the query's rope part and the single rope key rotated together: [B, T, H + 1, rope]
        rope = self.rotary.apply(torch.cat([q[..., n:], ckv[:, :, None, r:]], dim=2), cos, sin)
        latents, blocked = cache.update(torch.cat([c, rope[:, :, H]], dim=-1), batch)  # [B, L, r + rope]
        return q_in, q[..., :n], rope[:, :, :H], latents, blocked

    def attend_latents(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor,
                       blocked: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Absorbed attention of queries [B, T, H, *] over ``latents`` [B, L, r + rope] (``blocked`` bool [B, T, L],
        True = not seen, or None), then o_proj: [B, T, hidden] in ``dtype``."""
        s = self.spec
        B, T, H, n = q_nope.shape
        r = s.kv_lora_rank
        w_uk, w_uv = self.absorbed()
        if q_nope.device.type == "cpu" and B * T <= MLA_FUSED_MAX_ROWS and kernels.available():
            # the absorbed decode below (W_UK into the query, scores, softmax, latents, W_UV) as one fused op
            out = torch.ops.waferline.mla_decode(q_nope, q_rope, latents, blocked if blocked is not None else _NO_MASK,
                                                 w_uk, w_uv, self.scale, dtype)
            return self.o_proj(out)
        if q_nope.device.type == "cpu":  # in fp32 on CPU (see absorbed())
            q_nope, q_rope, w_uk, w_uv = q_nope.float(), q_rope.float(), w_uk.float(), w_uv.float()
        # absorb W_UK into the query: per head [B*T, n] @ [n, r]
        q_lat = torch.bmm(q_nope.reshape(B * T, H, n).transpose(0, 1), w_uk).transpose(0, 1).view(B, T, H, r)
        kv = latents[:, :, None, :]
        o_lat = attend(torch.cat([q_lat, q_rope], dim=-1), kv, kv[..., :r], blocked, self.scale)  # [B, T, H, r]
        out = torch.bmm(o_lat.reshape(B * T, H, r).transpose(0, 1), w_uv.transpose(1, 2))  # [H, B*T, v]
        out = out.transpose(0, 1).reshape(B, T, -1)
        return self.o_proj(out if out.dtype == dtype else out.to(dtype))
