"""The server's scheduler over attention/FFN disaggregation: ``AFDRunner`` runs each scheduler step
(engine/runner.py) through the attention and FFN ranks of an ``AFD`` engine.

Scheduler slot i is global row i of the AFD engine: it lives in slot i // M of attention rank i % M, as in
``AFD.generate``. A step gives every attention rank its rows, split into the engine's K micro-batches that ping-pong
with the FFN ranks; the answers come back as in the pipeline (``PipelineRunner``, whose fault handling, recovery and
speculation this runner shares): the argmax of greedy rows, the fp32 logits of sampled ones. A speculative verify
runs its rows as verify groups; the attention ranks, which hold every per-sequence cache, roll them back when the
rows' accepted lengths arrive with the next step (the FFN ranks keep no per-sequence state). The attention ranks'
paged caches follow the scheduler's page table (``block_table``), split in one part per rank (a slot takes pages
from its rank's part; a new sequence goes to the rank that holds the longest cached prefix of its prompt:
``CacheManager.place``), so cached prefixes are shared by page.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from waferline.engine.pipeline.serving import _EMITS, _GREEDY, PipelineRunner, _padded, _plain_rows, _Row, pack_prefills
from waferline.engine.runner import WANT_NONE, DecodeRow, PrefillChunk, RowOutput, VerifyRow

if TYPE_CHECKING:
    from waferline.engine.afd.driver import AFD

# a row as AFD schedules it: (global row, tokens, start, emit)
_AFDRow = tuple[int, list[int], int, int]


class AFDRunner(PipelineRunner):
    """A ``Runner`` over the ranks of ``afd``; ``rebuild`` returns a new AFD engine after a fault."""

    pipe: AFD
    overlap = verify_in_flight = False  # (an AFD step runs through the ranks at once: steps go one at a time)

    def _begin(self) -> None:
        self._rewinds, self._verified, self._sent = [], [], {}
        pt = self._table.page_tokens if self._table is not None else None
        self._bound = bound = self._stage_pages()
        self._guard(lambda: self.pipe._begin_ranks(self.num_slots, _GREEDY, self._keep_hidden, pt, bound))

    def _stage_pages(self) -> int | None:
        """An attention rank's pools hold its part's pages (its own ids 1 .. part_pages) and the sink."""
        t = self._table
        return None if t is None or t.part_pages is None else t.part_pages + 1

    def step(self, decodes: list[DecodeRow], prefills: list[PrefillChunk]
             ) -> tuple[list[RowOutput | None], list[RowOutput | None]]:
        rows = _plain_rows(decodes, prefills)
        outs = self._rows(rows, len(decodes), ())
        return outs[:len(decodes)], outs[len(decodes):]

    def verify(self, rows: list[VerifyRow], decodes: list[DecodeRow] = (), prefills: list[PrefillChunk] = ()
               ) -> Any:
        """As ``PipelineRunner.verify``, through the attention and FFN ranks: the verify rows and the step's
        ``decodes`` / ``prefills`` in one AFD step (verify groups and plain groups side by side in the micro-batches;
        a long prompt's later pieces in the steps after it)."""
        n, nd = len(rows), len(decodes)
        self._verified = [r.slot for r in rows]
        items = [(r.slot, r.position, list(r.tokens), r.want, i) for i, r in enumerate(rows)]
        outs = self._rows(items + _plain_rows(decodes, prefills, n), n + nd, set(self._verified))
        mine = _padded(outs[:n], max(len(r.tokens) for r in rows)) if self._keep_hidden else outs[:n]
        if not (decodes or prefills):
            return mine
        return mine, outs[n:n + nd], outs[n + nd:]

    def _rows(self, rows: list[_Row], n_decodes: int, verify: set[int] | tuple) -> list[RowOutput | None]:
        """Run ``rows`` (slot, start, tokens, want, output index i = 0, 1, ...; the first ``n_decodes`` of them verify
        or decode rows, the rest prefill chunks; the slots in ``verify`` are verify rows) as AFD steps; their outputs in
        order. Each attention
        rank's prefill chunks are packed in order within the engine's prefill chunk per step (beside its decode rows:
        what is left of it), so a long prompt runs as several steps, piece after piece (``pack_prefills``)."""
        afd = self.pipe
        outs: list[RowOutput | None] = [None] * len(rows)
        rounds: list[list[list[_AFDRow]]] = []  # step -> attention rank -> rows
        wanted: list[dict[int, int]] = []  # step -> slot -> output index
        for m in range(afd.M):
            mine = [r for r in rows if afd._rank_of(r[0]) == m]
            dec = [r for r in mine if r[4] < n_decodes]
            chunks = [r for r in mine if r[4] >= n_decodes]
            bins = pack_prefills(chunks, [max(afd.prefill_chunk - len(dec), 1)], afd.prefill_chunk)
            bins[0] = dec + bins[0]
            for k, b in enumerate(bins):
                if k == len(rounds):
                    rounds.append([[] for _ in range(afd.M)])
                    wanted.append({})
                for slot, start, tokens, want, i in b:
                    rounds[k][m].append((slot, tokens, start, _EMITS[want]))
                    if want != WANT_NONE or self._keep_hidden:
                        wanted[k][slot] = i
        for per, want_k in zip(rounds, wanted):
            if not any(per):
                continue
            rewinds, self._rewinds = self._rewinds, []
            pages = self._page_changes([r for rows_m in per for r in rows_m])
            feedback, groups = self._guard(lambda: self._step(per, verify, rewinds, pages))
            for meta, tail in feedback:
                gs = groups[meta[0]]
                self._answers(meta, tail, gs, {s: want_k[s] for g in gs for s in g.seqs if s in want_k}, outs, verify)
        return outs

    def _step(self, per: list[list[_AFDRow]], verify: set[int] | tuple, rewinds: list[tuple[int, int]],
              pages: list[tuple[int, list[int]]]) -> tuple:
        out = self.pipe._step_raw(per, verify, rewinds, pages)
        self.pipe.link.flush()
        return out

    def _page_parts(self) -> int:
        """The scheduler's page table is split in one part per attention rank: slot i lives on rank i % M, whose
        paged caches hold its part's pages (``BlockTable.local`` ids), so each rank shares the prefixes it holds."""
        return self.pipe.M

    def reset_slots(self, slots: list[int]) -> None:
        self._check_bound()
        fresh = set(slots)
        self._rewinds = [(s, k) for s, k in self._rewinds if s not in fresh]
        self._guard(lambda: self.pipe._reset_rows(slots))

