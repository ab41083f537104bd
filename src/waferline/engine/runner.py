"""What one scheduler step asks of the model, whichever engine holds it: the ``Runner`` interface and ``LocalRunner``,
the single-process engine's implementation (the pipeline's is ``engine/pipeline/serving.py``).

The scheduler (engine/scheduler.py) owns requests, slots, page accounting and sampling; a runner owns the layers and
their per-slot caches. One step hands the runner the decode rows (slot, position, token) and the prefill chunks (slot,
start, tokens) of a batch; it returns, for every row that needs its next token, either the greedy argmax (rows of
greedy requests, where the runner can take it cheaply) or the fp32 logits (the scheduler samples them with the
request's own generator, so a seeded request gives the same tokens whichever runner ran it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from waferline.engine.speculative.rollback import VerifyRollback
from waferline.model.attention import TokenCache
from waferline.model.context import StepBatch
from waferline.spec.model import ModelSpec

# what a row of a step asks for
WANT_NONE, WANT_ARGMAX, WANT_LOGITS = 0, 1, 2


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
    want: int = WANT_NONE  # WANT_NONE unless this chunk ends the prompt


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
    [T, D] where the runner was asked to keep them (an MTP drafter consumes them)."""

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
        """The per-layer caches the prefix cache copies pages from and into, or None where prefixes cannot be kept
        (caches in other processes, or layers whose state is not a per-token prefix)."""
        ...

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
    """Every cache keeps every token (no sliding window, no recurrent state), and there is at least one."""
    return all(c is None or (isinstance(c, TokenCache) and c.window is None) for c in caches) and any(
        c is not None for c in caches)


class LocalRunner:
    """The single-process engine's model and caches, in this process. Decode rows run as one [B, 1] call through
    ``model.step_logits`` (embedding, layers, head and argmax as one program where the CPU's operators allow it);
    prefill chunks of equal length run together as one [B, t] call."""

    def __init__(self, model: Any, num_slots: int):
        self.model = model
        self.spec: ModelSpec = model.spec
        self.num_slots = num_slots
        self.cache_bits = torch.finfo(model.dtype).bits
        self.caches = model.new_caches(num_slots)
        self.keep_hidden = False  # return the hidden states of every row (speculation with an MTP head)
        self._rollback: VerifyRollback | None = None

    @torch.inference_mode()
    def step(self, decodes: list[DecodeRow], prefills: list[PrefillChunk]
             ) -> tuple[list[RowOutput | None], list[RowOutput | None]]:
        dec_out: list[RowOutput | None] = []
        if decodes:
            toks = torch.tensor([[r.token] for r in decodes])
            batch = StepBatch.make([r.slot for r in decodes], [r.position for r in decodes], 1)
            greedy = [r.want == WANT_ARGMAX for r in decodes]
            logits, hidden, top = self.model.step_logits(toks, self.caches, batch, argmax=any(greedy))
            tops = top[:, 0].tolist() if top is not None else None
            dec_out = [RowOutput(argmax=tops[b]) if greedy[b] and tops is not None else RowOutput(logits=logits[b, 0])
                       for b in range(len(decodes))]
            if self.keep_hidden:
                for b, o in enumerate(dec_out):
                    o.hidden = hidden[b]
        pre_out: list[RowOutput | None] = [None] * len(prefills)
        groups: dict[int, list[int]] = {}  # chunks of equal length run as one [B, t] call
        for i, c in enumerate(prefills):
            groups.setdefault(len(c.tokens), []).append(i)
        for t, idx in groups.items():
            rows = [prefills[i] for i in idx]
            h = self.model(torch.tensor([r.tokens for r in rows]), self.caches,
                           StepBatch.make([r.slot for r in rows], [r.start for r in rows], t))
            for b, i in enumerate(idx):
                if prefills[i].want != WANT_NONE:
                    pre_out[i] = RowOutput(logits=self.model.logits(h[b, -1]))
                if self.keep_hidden:
                    pre_out[i] = pre_out[i] or RowOutput()
                    pre_out[i].hidden = h[b]
        return dec_out, pre_out

    @torch.inference_mode()
    def verify(self, rows: list[VerifyRow]) -> list[RowOutput]:
        """One forward over every row's tokens (shorter rows padded at the end) with the caches prepared for a
        rollback; ``keep`` must follow before the next step."""
        width = max(len(r.tokens) for r in rows)
        toks = torch.tensor([r.tokens + [0] * (width - len(r.tokens)) for r in rows])
        batch = StepBatch.make([r.slot for r in rows], [r.position for r in rows], width)
        self._rollback = VerifyRollback(self.caches, batch)
        greedy = [r.want == WANT_ARGMAX for r in rows]
        logits, hidden, top = self.model.step_logits(toks, self.caches, batch, argmax=any(greedy))
        tops = top.tolist() if top is not None else None
        return [RowOutput(logits=logits[b], argmaxes=tops[b] if greedy[b] and tops is not None else None,
                          hidden=hidden[b] if self.keep_hidden else None) for b in range(len(rows))]

    def keep(self, counts: list[int]) -> None:
        """After ``verify``: row b keeps its first ``counts[b]`` tokens (the last token and its accepted drafts)."""
        rb, self._rollback = self._rollback, None
        if rb is not None:
            rb.done(counts)

    def reset_slots(self, slots: list[int]) -> None:
        index = torch.tensor(slots)
        for c in self.caches:
            if c is not None:
                c.reset(index)

    def prefix_caches(self) -> list[Any] | None:
        return self.caches if prefix_eligible(self.caches) else None

    def fault(self) -> str | None:
        return None

    def recover(self) -> None:
        self.caches = self.model.new_caches(self.num_slots)
        self._rollback = None

    def close(self) -> None:
        """Nothing to release: the model lives as long as its LLM."""
