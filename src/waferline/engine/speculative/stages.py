"""Speculative decoding under the pipeline (engine/pipeline/, engine/stage.py; docs/pipeline.md).

Stage 0 (the scheduler) puts each ready decode row of a micro-batch into one *verify group*: input [last token] +
drafts, padded to T = 1 + the longest draft, emit code EMIT_VERIFY; the drafts ride in the micro-batch meta. The
n-gram and draft-model drafters run on stage 0 (they need only tokens; a draft model's probabilities q travel behind
the hidden states when it samples). The MTP drafter runs on the last stage, which has the final hidden states and the
LM head and loads the embedding table and the MTP head when MTP is on; prompt tokens travel with the prefill groups so
it knows every row's history. The last stage verifies (``LastStageSpec.verify`` -> ``verify``), then (MTP) drafts the
row's next K and sends [accepted..., bonus] and the new drafts back on the variable-width feedback channel; stage 0
launches them as the row's next verify. Rollback: every stage snapshots, per row, what a verify group overwrites before
running it (``SlotRollback.before``: sliding-window rings; Mamba-2 caches record a per-token trail, keyed by slot so
other micro-batches in between do not disturb it); when stage 0 learns a row's accepted length it attaches
(slot, keep) to the next micro-batch it launches, and every stage applies it (``SlotRollback.apply``) before that
micro-batch's forward — necessarily before the row's own next forward, since stages process micro-batches in order.
The draft model's and the MTP head's own caches are rolled back by their drafters, per row (several micro-batches'
drafts are outstanding at once). Adaptive K runs on stage 0 for every drafter, with the micro-batch's rows as the
batch; a step's measured cost is S x stage 0's own compute for it plus the hop overhead (a step's round trip minus that
compute, learnt from micro-batches that waited behind no other kind of step); for MTP it picks each row's next K,
which travels to the last stage in the micro-batch meta.

The server's scheduler speculates over the same stage machinery differently (engine/pipeline/serving.py): it drafts
and verifies in its own process, the last stage only answering every position of a verify group's rows.
"""

from __future__ import annotations

from typing import Any

import torch

from waferline.engine.sampling import SamplingParams
from waferline.engine.speculative.drafters import MTPDrafter
from waferline.engine.speculative.verify import verify
from waferline.errors import ConfigError


def pipeline_method(method: str) -> str:
    """Validate a speculative method for the pipeline engine; returns 'ngram', 'mtp' or 'draft'."""
    if method == "ngram" or method.startswith("ngram:"):
        return "ngram"
    if method == "mtp":
        return "mtp"
    if method.startswith("draft:") and len(method) > len("draft:"):
        return "draft"
    raise ConfigError(
        f"unknown speculative method {method!r}: use 'ngram', 'mtp' or 'draft:PATH' (a checkpoint sharing "
        "the target's tokenizer)"
    )


class LastStageSpec:
    """The last pipeline stage's part of speculative decoding.

    It verifies each row's drafts (sent by stage 0 in the micro-batch meta; a draft model's probabilities ride
    behind the hidden states) against the logits of the verify forward. With MTP it is also the drafter: it keeps
    each row's token history (prompt tokens arrive in the prefill meta) and the target's hidden states, and after
    every verify drafts the row's next K tokens, which travel back to stage 0 on the feedback channel beside the
    emitted tokens; stage 0 sends them back as the next verify's drafts."""

    def __init__(self, model: Any, cfg: dict[str, Any], params: SamplingParams, gens: list[torch.Generator | None]):
        sc = cfg["spec"]
        n = int(cfg["num_slots"])
        self.model, self.params, self.gens = model, params, gens
        self.max_tokens = int(sc["max_tokens"])
        self.n_out = [0] * n
        self.mtp: MTPDrafter | None = None
        if sc["method"] == "mtp":
            self.mtp = MTPDrafter(model)
            dev = model.norm.weight.device
            self.mtp.begin([[] for _ in range(n)],
                           [torch.empty(0, model.spec.hidden_size, dtype=model.dtype, device=dev) for _ in range(n)])
        self.seqs: list[list[int]] = [[] for _ in range(n)]  # MTP: every token of the row known here
        self.q: dict[int, torch.Tensor] = {}  # MTP, sampling: probabilities of the drafts sent for row b

    def prefill(self, row: int, tokens: list[int], h: torch.Tensor) -> None:
        """A prefill chunk of ``row`` reached the last stage: its tokens and final hidden states [T, D]."""
        if self.mtp is not None:
            self.seqs[row] += tokens
            self.mtp.pending[row] = torch.cat([self.mtp.pending[row], h])

    def first(self, row: int, token: int) -> None:
        """The row's first token, sampled after its prefill."""
        self.n_out[row] += 1
        if self.mtp is not None:
            self.seqs[row].append(token)

    def verify(self, rows: list[int], drafts: list[list[int]], qs: list[torch.Tensor | None], logits: torch.Tensor,
               hidden: torch.Tensor) -> list[list[int]]:
        """Verify rows of one verify group: ``logits`` / ``hidden`` [n, T, ...]; returns the tokens each emits."""
        out = []
        for i, (b, d, q) in enumerate(zip(rows, drafts, qs)):
            if self.mtp is not None:
                q = self.q.pop(b, None)
                q = None if q is None or self.params.temperature == 0 else q[: len(d)]
            out.append(verify(logits[i], d, q, self.params, self.gens[b]))
        if self.mtp is not None:
            self.mtp.accepted(rows, self.seqs, [len(t) - 1 for t in out], [len(d) for d in drafts], hidden)
            for b, t in zip(rows, out):
                self.seqs[b] += t
        for b, t in zip(rows, out):
            self.n_out[b] += len(t)
        return out

    def draft(self, rows: list[int], ks: list[int]) -> list[list[int]]:
        """MTP: the next drafts of rows that just emitted, ``ks[i]`` of them (stage 0's adaptive K chose them; none
        for other drafters, or when K backs off to 0)."""
        if self.mtp is None or not rows:
            return [[] for _ in rows]
        ks = [max(0, min(k, self.max_tokens - self.n_out[b] - 1)) for b, k in zip(rows, ks)]
        if max(ks) == 0:  # the hidden states wait in ``pending`` and are committed at the next draft
            return [[] for _ in rows]
        props = self.mtp.propose(rows, self.seqs, ks, self.params, self.gens)
        for b, p in zip(rows, props):
            if p.probs is not None:
                self.q[b] = p.probs
        return [p.tokens for p in props]
