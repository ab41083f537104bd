"""What travels between pipeline stages: the message kinds, a micro-batch's groups and their wire format (metadata
ints + one byte tail), and the feedback the last stage sends back to the first."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch


class Kind(IntEnum):
    """A message on the activation chain (rank r -> r+1) or the feedback channel (last -> first). RESET (the server's
    scheduler) clears the cache slots named in its metadata, for the new sequences they are given to."""

    BEGIN = 1
    STEP = 2
    SHUTDOWN = 3
    FEEDBACK = 4
    RESET = 5


class Emit(IntEnum):
    """What the last stage returns for a row: nothing, a sampled token, the fp32 logits of every position (LOGPROBS:
    a scored prompt, whose log-probs the consumer takes), or the fp32 logits of the row's last position (for the
    scheduler to sample with the request's own generator). In a verify group TOKEN and LOGITS answer every position up
    to the row's last draft (the scheduler verifies them itself)."""

    NONE = 0
    TOKEN = 1
    LOGPROBS = 2
    LOGITS = 4


# (the short names the pipeline, AFD and their tests use)
BEGIN, STEP, SHUTDOWN, FEEDBACK, RESET = Kind.BEGIN, Kind.STEP, Kind.SHUTDOWN, Kind.FEEDBACK, Kind.RESET
EMIT_NONE, EMIT_TOKEN, EMIT_LOGPROBS, EMIT_LOGITS = Emit.NONE, Emit.TOKEN, Emit.LOGPROBS, Emit.LOGITS


@dataclass
class Group:
    """Rows of a micro-batch that append the same number of tokens T (one forward call per stage).

    Speculative decoding: a verify group's rows carry ``drafts`` (row b's input is its last token, its drafts, then
    padding up to T; every stage keeps what the group overwrites until the rows' accepted lengths arrive);
    ``tokens`` (B*T input ids) travel with every group when a stage after the first holds a hash-routed layer
    (DeepSeek-V4 picks those experts by token id: engine.pipeline's ``ids_downstream``)."""

    T: int
    seqs: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    emits: list[int] = field(default_factory=list)
    drafts: list[list[int]] | None = None
    tokens: list[int] | None = None

    @property
    def B(self) -> int:
        return len(self.seqs)

    @property
    def verify(self) -> bool:
        return self.drafts is not None


@dataclass
class MicroBatch:
    """A set of disjoint sequences travelling the pipeline together; ``groups`` split it by tokens per row.

    ``rewinds``: (slot, keep) pairs — rows whose earlier verify kept only its first ``keep`` tokens; every stage
    rolls those rows' caches back before running this micro-batch. ``pages``: (slot, page ids) — slots whose pages
    in the scheduler's page table changed since the stages last heard (an empty list: released); every stage's paged
    caches follow it before running this micro-batch (``BlockTable.mirror``)."""

    mb_id: int
    groups: list[Group]
    rewinds: list[tuple[int, int]] = field(default_factory=list)
    pages: list[tuple[int, list[int]]] = field(default_factory=list)

    def encode(self) -> list[int]:
        meta = [self.mb_id, len(self.groups)]
        for g in self.groups:
            meta += [g.B, g.T]
            meta += g.seqs + g.slots + g.starts + g.emits
            meta.append((g.drafts is not None) | (g.tokens is not None) << 1)
            if g.drafts is not None:
                meta += [len(d) for d in g.drafts] + [t for d in g.drafts for t in d]
            if g.tokens is not None:
                meta += g.tokens
        meta.append(len(self.rewinds))
        for slot, keep in self.rewinds:
            meta += [slot, keep]
        meta.append(len(self.pages))
        for slot, ids in self.pages:
            meta += [slot, len(ids)] + ids
        return meta

    @classmethod
    def decode(cls, meta: list[int]) -> MicroBatch:
        mb_id, n = meta[0], meta[1]
        i, groups = 2, []
        for _ in range(n):
            B, T = meta[i], meta[i + 1]
            i += 2
            cols = [meta[i + k * B: i + (k + 1) * B] for k in range(4)]
            i += 4 * B
            g = Group(T, *cols)
            flags = meta[i]
            i += 1
            if flags & 1:
                lens = meta[i:i + B]
                i += B
                g.drafts = []
                for n_d in lens:
                    g.drafts.append(meta[i:i + n_d])
                    i += n_d
            if flags & 2:
                g.tokens = meta[i:i + B * T]
                i += B * T
            groups.append(g)
        n_rw = meta[i]
        rewinds = [(meta[i + 1 + 2 * k], meta[i + 2 + 2 * k]) for k in range(n_rw)]
        i += 1 + 2 * n_rw
        n_pg, i = meta[i], i + 1
        pages = []
        for _ in range(n_pg):
            slot, n = meta[i], meta[i + 1]
            pages.append((slot, meta[i + 2:i + 2 + n]))
            i += 2 + n
        return cls(mb_id, groups, rewinds, pages)

    @property
    def num_tokens(self) -> int:
        return sum(g.B * g.T for g in self.groups)


# ---------------------------------------------------------------- compute


def decode_feedback(meta: list[int], tail: torch.Tensor, vocab: int
                    ) -> tuple[int, dict[int, list[int]], dict[int, torch.Tensor]]:
    """(mb_id, tokens per sequence, log-probs / logits per sequence) from a FEEDBACK message (see
    StageRunner.feedback)."""
    mb_id, R, n_tok, n_lp = meta[:4]
    i = 4
    seqs, counts = meta[i:i + R], meta[i + R:i + 2 * R]
    i += 2 * R
    flat = meta[i:i + n_tok]
    i += n_tok
    lp_seqs, lp_T = meta[i:i + n_lp], meta[i + n_lp:i + 2 * n_lp]
    tokens, j = {}, 0
    for s, c in zip(seqs, counts):
        tokens[s] = flat[j:j + c]
        j += c
    lps, k = {}, 0
    if n_lp:
        allp = tail[:sum(lp_T) * vocab * 4].view(torch.float32).view(-1, vocab)  # (hidden states may follow)
        for s, T in zip(lp_seqs, lp_T):
            lps[s] = allp[k:k + T]
            k += T
    return mb_id, tokens, lps
