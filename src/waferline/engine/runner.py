"""What one scheduler step asks of the model, whichever engine holds it: the ``Runner`` interface and ``LocalRunner``,
the single-process engine's implementation (the pipeline's is ``engine/pipeline/serving.py``).

The scheduler (engine/scheduler.py) owns requests, slots, page accounting and sampling; a runner owns the layers and
their per-slot caches. One step hands the runner the decode rows (slot, position, token) and the prefill chunks (slot,
start, tokens) of a batch; it returns, for every row that needs its next token, either the greedy argmax (rows of
greedy requests, where the runner can take it cheaply) or the fp32 logits (the scheduler samples them with the
request's own generator, so a seeded request gives the same tokens whichever runner ran it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from waferline.engine.padding import padded_calls, pads_safely
from waferline.engine.speculative.rollback import VerifyRollback
from waferline.model.attention import TokenCache, managed_table
from waferline.model.block_table import BlockTable
from waferline.model.context import StepBatch
from waferline.spec.model import ModelSpec

# what a row of a step asks for (WANT_LOGPROBS: a prefill chunk's logits at every position, for scoring)
WANT_NONE, WANT_ARGMAX, WANT_LOGITS, WANT_LOGPROBS = 0, 1, 2, 3


@dataclass
class DecodeRow:
    """One token of a decoding sequence: ``token`` at absolute ``position`` in cache slot ``slot``."""

    slot: int
    position: int
    token: int
    want: int = WANT_LOGITS  # WANT_ARGMAX or WANT_LOGITS (a decode row always needs its next token)


@dataclass
class PrefillChunk:
    """Prompt (or recomputed) tokens of one sequence, written to ``slot`` from position ``start`` on."""

    slot: int
    start: int
    tokens: list[int]
    want: int = WANT_NONE  # WANT_LOGITS where it ends the prompt; WANT_LOGPROBS: every position's (a scored prompt)


@dataclass
class VerifyRow:
    """A speculative verify of one decoding sequence: ``tokens`` (its last token, then its drafts) at absolute
    positions ``position``, ``position + 1``, ... in cache slot ``slot``; the answer has every position's logits."""

    slot: int
    position: int
    tokens: list[int]
    want: int = WANT_LOGITS  # WANT_ARGMAX (greedy: the argmaxes are enough) or WANT_LOGITS


@dataclass
class RowOutput:
    """The answer for a row that wanted its next token: ``argmax`` (greedy) or ``logits`` [V] (fp32, on the CPU).
    A runner may return logits where argmax was asked (the scheduler then takes the argmax itself). A verify row's
    answer has ``logits`` [T, V] and, for greedy rows, ``argmaxes`` (T ints); ``hidden`` holds the row's hidden states
    [T, D] where the runner was asked to keep them (an MTP drafter consumes them). A WANT_LOGPROBS chunk's answer has
    ``logits`` [T, V]: the fp32 logits at each of its positions (raw: the last one is sampled from as any row's)."""

    logits: torch.Tensor | None = None
    argmax: int | None = None
    argmaxes: list[int] | None = None
    hidden: torch.Tensor | None = None


class Runner(Protocol):
    """The model side of continuous batching. Called from one thread (the engine loop's); a runner that fails raises,
    and ``recover`` then brings it back to a usable, empty state (or raises if it cannot)."""

    spec: ModelSpec
    num_slots: int
    cache_bits: int  # bits of a cached value (the page accounting's)

    def step(self, decodes: list[DecodeRow], prefills: list[PrefillChunk]
             ) -> tuple[list[RowOutput | None], list[RowOutput | None]]:
        """Run one step; the outputs line up with ``decodes`` and ``prefills`` (None where nothing was wanted)."""
        ...

    # A runner that speculates also has ``keep_hidden`` (give prefill chunks' and decode rows' hidden states back),
    # ``verify(rows) -> list[RowOutput]`` and ``keep(counts)`` (after a verify: each row keeps its first counts[b]
    # tokens in the caches); LocalRunner has them.

    def reset_slots(self, slots: list[int]) -> None:
        """A fresh sequence starts in each of ``slots``: clear their ring positions and recurrent state."""
        ...

    def prefix_caches(self) -> list[Any] | None:
        """The per-layer caches whose pages the prefix cache shares, or None where prefixes cannot be kept (caches in
        other processes, or layers whose state is not a per-token prefix)."""
        ...

    # A runner whose paged caches live in this process also has ``block_table(page_tokens) -> BlockTable | None``:
    # one table for all of them, whose pages the scheduler's CacheManager then allocates (LocalRunner has it).

    def fault(self) -> str | None:
        """Why the runner cannot run a step now (a pipeline stage died and it is not rebuilt yet), or None."""
        ...

    def recover(self) -> None:
        """After a failed step: fresh, empty caches (and, where processes died, new processes)."""
        ...

    def close(self) -> None:
        """Release what the runner holds (processes, threads)."""
        ...


def prefix_eligible(caches: list[Any]) -> bool:
    """Every cache keeps every token in pages (no sliding window, no recurrent state), and there is at least one."""
    return all(c is None or (isinstance(c, TokenCache) and c.paged) for c in caches) and any(
        c is not None for c in caches)


class LocalRunner:
    """The single-process engine's model and caches, in this process, on the model's ``device`` (logits come back to
    the host: sampling runs there). Decode rows run as one [B, 1] call through ``model.step_logits`` (embedding,
    layers, head and argmax as one program where the CPU's operators allow it); prefill chunks run together as [B, T]
    calls, padded to a common length where the caches allow it (``_prefill_calls``; ``batch_prefills`` off: each
    chunk alone).

    Two decode paths beyond the step, both for greedy rows: ``burst`` runs several greedy steps back to back
    (``model.greedy_steps``: one program, the steps' Python once) where the CPU's operators allow it; and where
    ``static_factory`` is set (a GPU: engine/graphs.py) a decode-only greedy step replays a fixed-shape step over the
    slots it was made for (rows of those slots that are not in the step repeat their last token and position; their
    answers are dropped), and a burst of every one of those slots replays it back to back."""

    def __init__(self, model: Any, num_slots: int, device: torch.device | str | None = None):
        self.model = model
        self.spec: ModelSpec = model.spec
        self.num_slots = num_slots
        self.device = torch.device(device or "cpu")
        self.cache_bits = torch.finfo(model.dtype).bits
        self.caches = model.new_caches(num_slots, self.device)
        self.keep_hidden = False  # return the hidden states of every row (speculation with an MTP head)
        self.batch_prefills = True
        # slots -> a StaticDecode (or None where none can run); called once, at the first decode-only greedy step
        self.static_factory: Callable[[list[int]], Any] | None = None
        self.static: Any = None
        self._static_rows: dict[int, tuple[int, int]] = {}  # slot -> (token, position) of its last static step
        self._rollback: VerifyRollback | None = None
        self._pad_ok: bool | None = None  # every cache takes padded prefill rows (_prefill_calls), once known

    @torch.inference_mode()
    def step(self, decodes: list[DecodeRow], prefills: list[PrefillChunk]
             ) -> tuple[list[RowOutput | None], list[RowOutput | None]]:
        dev = self.device
        dec_out: list[RowOutput | None] = []
        greedy = [r.want == WANT_ARGMAX for r in decodes]
        if decodes and not prefills and all(greedy) and not self.keep_hidden:
            static = self._static_for([r.slot for r in decodes])
            if static is not None:
                return self._static_step(static, decodes), []
        if decodes:
            toks, batch = StepBatch.decode([r.token for r in decodes], [r.slot for r in decodes],
                                           [r.position for r in decodes], dev)
            logits, hidden, top = self.model.step_logits(toks, self.caches, batch, argmax=any(greedy))
            tops = top[:, 0].tolist() if top is not None else None
            host = logits[:, 0].cpu() if not all(greedy) or tops is None else None
            dec_out = [RowOutput(argmax=tops[b]) if greedy[b] and tops is not None else RowOutput(logits=host[b])
                       for b in range(len(decodes))]
            if self.keep_hidden:
                for b, o in enumerate(dec_out):
                    o.hidden = hidden[b]
        pre_out: list[RowOutput | None] = [None] * len(prefills)
        for idx, T in self._prefill_calls(prefills):
            rows = [prefills[i] for i in idx]
            want = [b for b, r in enumerate(rows) if r.want in (WANT_ARGMAX, WANT_LOGITS)]
            # (the tokens, slots, starts and the rows and positions the head reads: one tensor, one copy to a GPU)
            toks, batch, at = StepBatch.chunks([r.tokens + [0] * (T - len(r.tokens)) for r in rows],
                                               [r.slot for r in rows], [r.start for r in rows], dev,
                                               want + [len(rows[b].tokens) - 1 for b in want])
            h = self.model(toks, self.caches, batch)
            for b, r in enumerate(rows):  # (scored chunks: the head at every position)
                if r.want == WANT_LOGPROBS:
                    pre_out[idx[b]] = RowOutput(logits=self.model.logits(h[b, :len(r.tokens)]).float().cpu())
            if want:  # (the head once for the call's rows, at each row's last token)
                logits = self.model.logits(h[at[:len(want)], at[len(want):]]).cpu()
                for j, b in enumerate(want):
                    pre_out[idx[b]] = RowOutput(logits=logits[j])
            if self.keep_hidden:
                for b, i in enumerate(idx):
                    pre_out[i] = pre_out[i] or RowOutput()
                    pre_out[i].hidden = h[b, :len(rows[b].tokens)]
        return dec_out, pre_out

    def _prefill_calls(self, prefills: list[PrefillChunk]) -> list[tuple[list[int], int]]:
        """The model calls a step's prefill chunks run as: (chunk indices, T) each; chunks of different lengths share
        a padded call where every cache allows it (engine/padding.py). ``batch_prefills`` off: each chunk alone."""
        if not self.batch_prefills:
            return [([i], len(c.tokens)) for i, c in enumerate(prefills)]
        if self._pad_ok is None:
            self._pad_ok = pads_safely(self.caches)
        return padded_calls([(1, len(c.tokens)) for c in prefills], self._pad_ok)

    def _static_for(self, slots: list[int]) -> Any:
        """The static step for these slots: made at the first such step (``static_factory``), then reused while the
        slots are among its own."""
        if self.static is None and self.static_factory is not None:
            factory, self.static_factory = self.static_factory, None
            self.static = factory(sorted(slots))
            self._static_rows = {}
        if self.static is None or not set(slots) <= set(self.static.slot_list):
            return None
        return self.static

    def _static_step(self, static: Any, decodes: list[DecodeRow]) -> list[RowOutput | None]:
        for r in decodes:
            self._static_rows[r.slot] = (r.token, r.position)
        rows = [self._static_rows[s] for s in static.slot_list]
        top = static.run([t for t, _ in rows], [p for _, p in rows])[1].tolist()
        where = {s: i for i, s in enumerate(static.slot_list)}
        return [RowOutput(argmax=top[where[r.slot]]) for r in decodes]

    def _static_burst(self, decodes: list[DecodeRow], n: int) -> tuple[list[list[int]], None] | None:
        """A burst as replays of the static step, where every one of its slots is a row of ``decodes`` and no
        hidden states are asked for; None (step instead) otherwise."""
        if self.keep_hidden:
            return None
        static = self._static_for([r.slot for r in decodes])
        if static is None or sorted(r.slot for r in decodes) != sorted(static.slot_list) or \
                max(r.position for r in decodes) + n > static.end:
            return None
        row = {r.slot: r for r in decodes}
        first = [row[s] for s in static.slot_list]
        ids = static.burst([r.token for r in first], [r.position for r in first], n).tolist()
        for r, got in zip(first, ids):  # (each slot's last step: the token it was fed and its position)
            self._static_rows[r.slot] = (got[-2] if n > 1 else r.token, r.position + n - 1)
        where = {s: i for i, s in enumerate(static.slot_list)}
        return [ids[where[r.slot]] for r in decodes], None

    @torch.inference_mode()
    def burst(self, decodes: list[DecodeRow], n: int) -> tuple[list[list[int]], torch.Tensor | None] | None:
        """``n`` greedy one-token steps of the rows ``decodes`` back to back, each step's argmax the next one's token
        (``model.greedy_steps``; with a static step: its replays, fed on the device): per row its n tokens, and
        (``keep_hidden``) the hidden states [B, n, D]. None where neither can run them: nothing ran, step instead."""
        dev = self.device
        if self.static is not None or self.static_factory is not None:  # (a fixed-shape step: its replays fed on
            return self._static_burst(decodes, n)                        # the device, where it can run them)
        if not self.model.runs_step_programs(dev):
            return None  # (before any per-step tensor is made: on a GPU each is a synchronous host-to-device copy)
        slots = [r.slot for r in decodes]
        batches = [StepBatch.make(slots, [r.position + j for r in decodes], 1, dev) for j in range(n)]
        steps = self.model.greedy_steps(torch.tensor([[r.token] for r in decodes], device=dev), self.caches, batches)
        if steps is None:
            return None
        toks = torch.cat([ids for ids, _ in steps], 1).tolist()
        return toks, (torch.cat([h for _, h in steps], 1) if self.keep_hidden else None)

    @torch.inference_mode()
    def verify(self, rows: list[VerifyRow]) -> list[RowOutput]:
        """One forward over every row's tokens (shorter rows padded at the end) with the caches prepared for a
        rollback; ``keep`` must follow before the next step."""
        width = max(len(r.tokens) for r in rows)
        dev = self.device
        toks, batch, _ = StepBatch.chunks([r.tokens + [0] * (width - len(r.tokens)) for r in rows],
                                          [r.slot for r in rows], [r.position for r in rows], dev)
        self._rollback = VerifyRollback(self.caches, batch)
        greedy = [r.want == WANT_ARGMAX for r in rows]
        logits, hidden, top = self.model.step_logits(toks, self.caches, batch, argmax=any(greedy))
        if top is None or not all(greedy):  # (sampled rows are verified on the host, with their CPU generators;
            logits = logits.cpu()           # greedy rows need only the argmaxes, already computed on the device)
        tops = top.tolist() if top is not None else None
        return [RowOutput(logits=logits[b], argmaxes=tops[b] if greedy[b] and tops is not None else None,
                          hidden=hidden[b] if self.keep_hidden else None) for b in range(len(rows))]

    def keep(self, counts: list[int]) -> None:
        """After ``verify``: row b keeps its first ``counts[b]`` tokens (the last token and its accepted drafts)."""
        rb, self._rollback = self._rollback, None
        if rb is not None:
            rb.done(counts)

    def reset_slots(self, slots: list[int]) -> None:
        index = torch.tensor(slots, device=self.device)
        for c in self.caches:
            if c is not None:
                c.reset(index)

    def prefix_caches(self) -> list[Any] | None:
        return self.caches if prefix_eligible(self.caches) else None

    def block_table(self, page_tokens: int) -> BlockTable | None:
        """One page table of ``page_tokens``-token pages for every paged cache (each given the table's pages from
        now on: before any sequence runs), managed by its caller (CacheManager); None without paged caches."""
        self._table = managed_table(self.caches, self.num_slots, page_tokens)
        return self._table

    def fault(self) -> str | None:
        return None

    def recover(self) -> None:
        old, self.caches = self.caches, self.model.new_caches(self.num_slots, self.device)
        table = self.__dict__.get("_table")
        if table is not None:  # the same pages (the allocator's, and what the prefix store holds) in fresh caches
            for i in table.layers:
                self.caches[i].bind(table, like=old[i])
        self._rollback = None
        self.static, self.static_factory = None, None

    def close(self) -> None:
        """Nothing to release: the model lives as long as its LLM."""
