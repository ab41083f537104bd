"""Exact speculative decoding: drafters (prompt-lookup n-grams, a draft model, MTP heads), the verifier, cache
rollback and adaptive K — for the single-process engine (``Speculator``) and the pipeline's stages
(``LastStageSpec``, ``SlotRollback``).

One decode step, for the rows still running: the drafter proposes up to K tokens per row; the target model
verifies ``[last token] + drafts`` in ONE forward (``StepBatch`` with T = K_max + 1 from each row's position); the
verifier accepts a prefix of the drafts and adds one token of its own (a correction or a bonus), so every step
emits between 1 and K + 1 tokens per row; the caches are rolled back to the accepted prefix.

Exactness. Greedy (T = 0): a draft is accepted while it equals the argmax of the target's logits at its position,
and the extra token is that argmax — the output is the non-speculative greedy output, token for token.
Sampled: draft x ~ q is accepted with probability min(1, p(x) / q(x)); on rejection the token is drawn from the
normalised residual max(0, p − q); after K acceptances a bonus token is drawn from p. p and q both come from
``target_probs`` (temperature, top-k, top-p), and the n-gram drafter's q is one-hot. The emitted tokens then follow
exactly the distribution the non-speculative sampler draws from (Leviathan et al. 2023; Chen et al. 2023).

Rollback, per cache kind:

* full attention / MLA (``TokenCache`` without a window): nothing to do — entries are positional, those of rejected
  tokens lie past the sequence, are masked causally, and the next step overwrites them;
* sliding window (a ring): the ring rows a verify will touch are snapshotted first and the ones overwritten by
  rejected tokens are put back (``TokenCache.ring_snapshot`` / ``ring_rewind``); K is capped at window − 1;
* Mamba-2: an SSM state cannot be un-updated, and re-running the accepted prefix would cost a second forward of
  the whole model, so the verify forward records the (conv, ssm) state after each of its T tokens
  (``Mamba2Cache.keep_trail``) and ``rewind`` selects the one after the accepted prefix.

Draft models and MTP heads with non-positional caches snapshot their state after each drafted token instead.

Adaptive K. Each row keeps an estimate α of its per-token acceptance (exponential average of accepted / drafted).
The step's K maximises the expected speedup  E(k) · c(B, 0) / c(B, k)  where  E(k) = (1 − α^(k+1)) / (1 − α)  is the
expected number of tokens a step emits and  c(B, k) = (overhead + B·(k + 1)) + k·draft_cost·(overhead + B)  is the
cost of a step with B rows in tokens-equivalent: a forward costs t0 + t1·N for N tokens, ``overhead`` = t0 / t1
(measured by ``benchmarks/speculative.py``), and a drafted token costs ``draft_cost`` of a one-token target step
(0 for n-grams, about 1 / layers for an MTP head, the layer ratio for a draft model). That is the prior: the engines
time every step (B rows x T tokens) and every drafting pass, and measured costs replace the prior (``AdaptiveK.record``;
one plain step in 16 keeps the plain cost measured). When even k = 1 does not pay — a large batch, a low acceptance,
or a verify that costs much more than a plain step — the step is a plain decode step: speculation backs off by
itself as the batch grows. Greedy steps in which no row drafts (k = 0, or no n-gram match) run as plain greedy decode
does, in bursts of steps from one Python call (``burst_len``: 1, 2, 4, then 8 after such steps in a row), so a
speculative run whose drafts do not pay costs about what plain decoding does.

Under the pipeline (engine/pipeline.py, engine/stage.py; docs/pipeline.md). Stage 0 (the scheduler) puts each
ready decode row of a micro-batch into one *verify group*: input [last token] + drafts, padded to T = 1 + the
longest draft, emit code EMIT_VERIFY; the drafts ride in the micro-batch meta. The n-gram and draft-model drafters
run on stage 0 (they need only tokens; a draft model's probabilities q travel behind the hidden states when it
samples). The MTP drafter runs on the last stage, which has the final hidden states and the LM head and loads the
embedding table and the MTP head when MTP is on; prompt tokens travel with the prefill groups so it knows every
row's history. The last stage verifies (``LastStageSpec.verify`` -> ``verify``), then (MTP) drafts the row's next K
and sends [accepted..., bonus] and the new drafts back on the variable-width feedback channel; stage 0 launches them
as the row's next verify. Rollback: every stage snapshots, per row, what a verify group overwrites before running it
(``SlotRollback.before``: sliding-window rings; Mamba-2 caches record a per-token trail, keyed by slot so other
micro-batches in between do not disturb it); when stage 0 learns a row's accepted length it attaches (slot, keep)
to the next micro-batch it launches, and every stage applies it (``SlotRollback.apply``) before that micro-batch's
forward — necessarily before the row's own next forward, since stages process micro-batches in order. The draft
model's and the MTP head's own caches are rolled back by their drafters, per row (several micro-batches' drafts
are outstanding at once). Adaptive K runs on stage 0 for every drafter, with the micro-batch's rows as the batch;
a step's measured cost is S x stage 0's own compute for it plus the hop overhead (a step's round trip minus that
compute, learnt from micro-batches that waited behind no other kind of step); for MTP it picks each row's next K,
which travels to the last stage in the micro-batch meta.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch

from waferline.engine.sampling import SamplingParams, greedy, target_probs
from waferline.errors import ConfigError
from waferline.model.attention import TokenCache
from waferline.model.context import StepBatch
from waferline.model.ssm import Mamba2Cache

# ----------------------------------------------------------------------------------------------- the verifier


def verify_greedy(target_logits: torch.Tensor, draft: list[int], best: list[int] | None = None) -> list[int]:
    """Greedy verify of one row. ``target_logits`` [k+1, V]: the target's logits at the last accepted token and at each
    of the k drafts (``best``: their argmaxes, when the forward computed them). Returns the tokens to emit: the accepted
    drafts then the target's own next token (1..k+1 tokens)."""
    if best is None:
        best = greedy(target_logits[: len(draft) + 1])
    out: list[int] = []
    for i, d in enumerate(draft):
        if best[i] != d:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """The rejection distribution: max(0, p − q) normalised; ``q`` None means one-hot at ``x`` (an n-gram draft)."""
    if q is None:
        r = p.clone()
        r[x] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    s = r.sum()
    return r / s if s > 0 else p  # s == 0 only when p == q, where rejection has probability 0


def verify_sampled(p: torch.Tensor, q: torch.Tensor | None, draft: list[int], gen: torch.Generator | None) -> list[int]:
    """Ratio-test verify of one row. ``p`` [k+1, V]: target probabilities at the last token and each draft;
    ``q`` [k, V]: the drafter's probabilities for each draft, or None for a deterministic (one-hot) drafter.
    Draft i is accepted with probability min(1, p_i(x) / q_i(x)); the first rejection is replaced by a sample of
    the residual; if all k are accepted a bonus token is drawn from p_k. Returns 1..k+1 tokens."""
    out: list[int] = []
    if draft:
        u = torch.rand(len(draft), generator=gen, dtype=torch.float64).tolist()
        px = p[torch.arange(len(draft)), torch.tensor(draft)].double().tolist()
        qx = [1.0] * len(draft) if q is None else q[torch.arange(len(draft)), torch.tensor(draft)].double().tolist()
        for i, x in enumerate(draft):
            if qx[i] > 0 and u[i] * qx[i] < px[i]:  # u < p/q without dividing
                out.append(x)
                continue
            r = residual(p[i], None if q is None else q[i], x)
            out.append(int(torch.multinomial(r, 1, generator=gen)))
            return out
    out.append(int(torch.multinomial(p[len(draft)], 1, generator=gen)))
    return out


def verify(target_logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None, params: SamplingParams,
           gen: torch.Generator | None) -> list[int]:
    """Verify one row's drafts against the target's fp32 logits [k+1, V] under ``params``; returns the tokens to emit.

    The entry point for any engine (the pipeline's last stage included): it needs only the logits of the verify
    forward and the drafts (plus the drafter's probabilities when it samples)."""
    if params.temperature == 0:
        return verify_greedy(target_logits, draft)
    p = target_probs(target_logits[: len(draft) + 1], params)
    return verify_sampled(p, draft_probs, draft, gen)


def verify_rows(logits: torch.Tensor, drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
                params: SamplingParams, gens: list[torch.Generator | None],
                ids: torch.Tensor | None = None) -> list[list[int]]:
    """Verify a whole verify forward: ``logits`` [B, T, V] (T = 1 + the longest draft; shorter drafts padded at the
    end), row b's drafts and drafter probabilities (``ids``: the logits' argmaxes [B, T], when the forward computed
    them: greedy verifies use them). Returns, per row, the tokens to emit (the variable-width feedback a pipeline's
    last stage sends back; ``len(out[b])`` is also the ``keep`` its caches roll back to)."""
    if params.temperature == 0:
        best = ids.tolist() if ids is not None else None
        if not any(drafts):  # a plain greedy step: one argmax for the whole batch
            return [[row[0]] for row in best] if best is not None else [[t] for t in greedy(logits[:, 0])]
        if best is not None:
            return [verify_greedy(logits[b], d, best[b]) for b, d in enumerate(drafts)]
    return [verify(logits[b], d, q, params, g) for b, (d, q, g) in enumerate(zip(drafts, draft_probs, gens))]


# ----------------------------------------------------------------------------------------------- cache rollback


def _stateful(caches: list[Any]) -> bool:
    return any(isinstance(c, Mamba2Cache) or (isinstance(c, TokenCache) and c.window is not None) for c in caches)


def _window(caches: list[Any]) -> int | None:
    w = [c.window for c in caches if isinstance(c, TokenCache) and c.window is not None]
    return min(w) if w else None


class VerifyRollback:
    """Prepare the target's caches for a T-token verify of ``batch``, then keep each row's accepted prefix."""

    def __init__(self, caches: list[Any], batch: StepBatch):
        self.caches, self.batch = caches, batch
        self.rings = [c.ring_snapshot(batch.slots) if isinstance(c, TokenCache) and batch.T > 1 else None for c in caches]
        for c in caches:
            if isinstance(c, Mamba2Cache):
                c.keep_trail = batch.T > 1

    def done(self, keep: list[int]) -> None:
        """``keep[b]``: how many of row b's T input tokens were accepted (the last accepted token + accepted drafts)."""
        for c, snap in zip(self.caches, self.rings):
            if isinstance(c, TokenCache):
                c.ring_rewind(self.batch, keep, snap)
            elif isinstance(c, Mamba2Cache):
                c.keep_trail = False
                if self.batch.T > 1:
                    c.rewind(self.batch.slots, keep)


class SlotRollback:
    """A pipeline stage's rollback of verify forwards, one row at a time.

    ``before`` (just ahead of a verify group's forward on this stage) snapshots the sliding-window rings the group
    will touch and switches Mamba-2 caches to recording a per-token trail; ``after`` switches that off. The accepted
    length of a row is known only once the last stage has verified it, so it comes back to every stage on a later
    micro-batch as a (slot, keep) pair, and ``apply`` then keeps that row's first ``keep`` tokens. Each row's state is
    kept by slot, so other micro-batches' forwards in between do not disturb it."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[int, int, list[Any]]] = {}  # slot -> (start, T, per-cache ring snapshot)

    def reset(self) -> None:
        self.rows.clear()

    def before(self, caches: list[Any], batch: StepBatch) -> None:
        if batch.T <= 1:
            return
        snaps = [c.ring_snapshot(batch.slots) if isinstance(c, TokenCache) else None for c in caches]
        for b, slot in enumerate(batch.slots.tolist()):
            self.rows[slot] = (int(batch.start[b]), batch.T,
                               [None if sn is None else (sn[0][b:b + 1], sn[1][b:b + 1]) for sn in snaps])
        for c in caches:
            if isinstance(c, Mamba2Cache):
                c.keep_trail = True

    @staticmethod
    def after(caches: list[Any]) -> None:
        for c in caches:
            if isinstance(c, Mamba2Cache):
                c.keep_trail = False

    def apply(self, caches: list[Any], rewinds: list[tuple[int, int]], device: Any = "cpu") -> None:
        """``rewinds``: (slot, keep) for rows whose verify this stage ran; a row without a recorded verify (T = 1,
        or a row this stage has not seen verify) is skipped."""
        for slot, keep in rewinds:
            st = self.rows.pop(slot, None)
            if st is None:
                continue
            start, T, snaps = st
            one = StepBatch.make([slot], [start], T, device)
            for c, sn in zip(caches, snaps):
                if isinstance(c, TokenCache):
                    c.ring_rewind(one, [keep], sn)
                elif isinstance(c, Mamba2Cache):
                    c.rewind(one.slots, [keep])


def _save(caches: list[Any], slot: int) -> list[Any]:
    """A copy of one slot's non-positional state (rings, Mamba-2) in ``caches``."""
    s = torch.tensor([slot])
    out: list[Any] = []
    for c in caches:
        if isinstance(c, Mamba2Cache):
            out.append(c.snapshot(s))
        elif isinstance(c, TokenCache) and c.window is not None:
            out.append(c.ring_snapshot(s))
        else:
            out.append(None)
    return out


def _load(caches: list[Any], slot: int, saved: list[Any]) -> None:
    s = torch.tensor([slot])
    for c, st in zip(caches, saved):
        if st is None:
            continue
        if isinstance(c, Mamba2Cache):
            c.restore(s, st)
        else:
            c.data[slot], c.pos[slot] = st[0][0], st[1][0]


# ----------------------------------------------------------------------------------------------- drafters


@dataclass
class Proposal:
    """One row's drafts: tokens, and the drafter's probabilities [k, V] when it sampled them (None: one-hot)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """What the engine needs from a drafter. Rows are cache slots; ``seqs[b]`` is row b's prompt + output so far."""

    name: str

    def begin(self, seqs: list[list[int]], prompt_hidden: list[torch.Tensor]) -> None: ...

    def propose(self, rows: list[int], seqs: list[list[int]], ks: list[int], params: SamplingParams,
                gens: list[torch.Generator | None]) -> list[Proposal]: ...

    def accepted(self, rows: list[int], seqs: list[list[int]], n_accepted: list[int], n_drafted: list[int],
                 hidden: torch.Tensor | None) -> None: ...


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from ``max_n`` down to
    ``min_n``) in the prompt + output, and propose the tokens that followed it. Needs no model; q is one-hot."""

    name = "ngram"
    uses_hidden = False

    def __init__(self, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"n-gram drafter needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.index: dict[int, dict[int, dict[tuple[int, ...], int]]] = {}  # row -> n -> n-gram -> end of latest
        self.indexed: dict[int, int] = {}  # row -> n-grams ending before this index are in the index

    def begin(self, seqs: list[list[int]], prompt_hidden: list[torch.Tensor]) -> None:
        self.index = {b: {n: {} for n in range(self.min_n, self.max_n + 1)} for b in range(len(seqs))}
        self.indexed = {b: 0 for b in range(len(seqs))}

    def _update(self, b: int, seq: list[int], upto: int) -> None:
        idx = self.index[b]
        for end in range(max(self.indexed[b], 1), upto):  # n-grams seq[end-n:end] with end < upto
            for n in range(self.min_n, min(self.max_n, end) + 1):
                idx[n][tuple(seq[end - n:end])] = end
        self.indexed[b] = max(self.indexed[b], upto)

    def lookup(self, b: int, seq: list[int], k: int) -> list[int]:
        L = len(seq)
        self._update(b, seq, L)  # every n-gram ending strictly before the last token's end
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            end = self.index[b][n].get(tuple(seq[L - n:]))
            if end is not None:
                return seq[end:end + k]
        return []

    def propose(self, rows: list[int], seqs: list[list[int]], ks: list[int], params: SamplingParams,
                gens: list[torch.Generator | None]) -> list[Proposal]:
        return [Proposal(self.lookup(b, seqs[b], k) if k > 0 else []) for b, k in zip(rows, ks)]

    def accepted(self, rows: list[int], seqs: list[list[int]], n_accepted: list[int], n_drafted: list[int],
                 hidden: torch.Tensor | None) -> None:
        pass


def _pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """The drafter's token from its logits [V] and, when sampling, the distribution it came from."""
    if params.temperature == 0:
        return greedy(logits.reshape(-1)), None
    q = target_probs(logits, params)
    return int(torch.multinomial(q, 1, generator=gen)), q


class _ModelDrafter:
    """Shared machinery of the drafters that run a network autoregressively over their own cache."""

    name = "model"

    def _drafts(self, rows: list[int], ks: list[int], first: list[torch.Tensor], step: Any, params: SamplingParams,
                gens: list[torch.Generator | None], caches: list[Any]) -> list[Proposal]:
        """``first[i]``: logits of row i's first draft; ``step(rows, tokens, j)`` runs one more drafted token per
        row and returns the logits of the next. Saves non-positional state per step so ``_rewind`` can restore it."""
        toks: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        stateful = _stateful(caches)
        if stateful:  # per row: a pipeline proposes for one micro-batch while another's verify is in flight
            self._saved.update({b: [_save(caches, b)] for b in rows})
        logits = first
        live = [i for i in range(len(rows)) if ks[i] > 0]
        for j in range(max(ks)):
            for i in live:
                t, q = _pick(logits[i], params, gens[rows[i]])
                toks[i].append(t)
                if q is not None:
                    probs[i].append(q)
            live = [i for i in live if len(toks[i]) < ks[i]]
            if not live:
                break
            logits_live = step([rows[i] for i in live], [toks[i][-1] for i in live], j)
            for n, i in enumerate(live):
                logits[i] = logits_live[n]
                if stateful:
                    self._saved[rows[i]].append(_save(caches, rows[i]))
        return [Proposal(t, torch.stack(p) if p else None) for t, p in zip(toks, probs)]

    def _rewind(self, rows: list[int], n_accepted: list[int], caches: list[Any]) -> None:
        """Restore non-positional state to the one after the accepted drafts the drafter itself consumed."""
        if not self._saved:
            return
        for b, a in zip(rows, n_accepted):
            saved = self._saved.pop(b, None)
            if saved:
                _load(caches, b, saved[min(a, len(saved) - 1)])


def _ragged(seqs: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, list[int]]:
    T = max(len(s) for s in seqs)
    return torch.tensor([s + [pad] * (T - len(s)) for s in seqs]), [len(s) - 1 for s in seqs]


class DraftModelDrafter(_ModelDrafter):
    """A smaller checkpoint sharing the target's vocabulary drafts autoregressively over its own caches."""

    def __init__(self, path: str | Path, dtype: torch.dtype, vocab_size: int):
        from waferline.model.arena import move_to_huge_pages
        from waferline.model.load import load_model

        self.model = load_model(Path(path), dtype)
        if self.model.spec.vocab_size != vocab_size:
            raise ConfigError(f"draft model {path} has vocab_size {self.model.spec.vocab_size} but the target has "
                              f"{vocab_size}; a draft model must share the target's tokenizer")
        move_to_huge_pages(self.model)  # as the target's (model/arena.py)
        self.name = f"draft:{path}"
        self.caches: list[Any] = []
        self.cached: list[int] = []  # tokens of each row held in the draft caches
        self._saved: dict[int, list[Any]] = {}
        self._base: dict[int, int] = {}

    def begin(self, seqs: list[list[int]], prompt_hidden: list[torch.Tensor]) -> None:
        self.caches = self.model.new_caches(len(seqs))
        self.cached = [0] * len(seqs)
        self._saved, self._base = {}, {}

    def _forward(self, rows: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """Feed each row its chunk (ragged lengths padded at the end where caches are positional, else grouped);
        return the logits after each row's last real token, [len(rows), V]."""
        out: list[torch.Tensor | None] = [None] * len(rows)
        groups: dict[int, list[int]] = {}
        if _stateful(self.caches):
            for i, c in enumerate(chunks):
                groups.setdefault(len(c), []).append(i)
        else:
            groups[0] = list(range(len(rows)))
        for idx in groups.values():
            toks, last = _ragged([chunks[i] for i in idx])
            batch = StepBatch.make([rows[i] for i in idx], [self.cached[rows[i]] for i in idx], toks.shape[1])
            h = self.model(toks, self.caches, batch)
            lg = self.model.logits(h[torch.arange(len(idx)), torch.tensor(last)])
            for n, i in enumerate(idx):
                out[i] = lg[n]
                self.cached[rows[i]] += len(chunks[i])
        return torch.stack(out)  # type: ignore[arg-type]

    def propose(self, rows: list[int], seqs: list[list[int]], ks: list[int], params: SamplingParams,
                gens: list[torch.Generator | None]) -> list[Proposal]:
        first = list(self._forward(rows, [seqs[b][self.cached[b]:] for b in rows]))
        self._base.update({b: self.cached[b] for b in rows})  # rows proposed for in this step

        def step(srows: list[int], toks: list[int], j: int) -> torch.Tensor:
            return self._forward(srows, [[t] for t in toks])

        return self._drafts(rows, ks, first, step, params, gens, self.caches)

    def accepted(self, rows: list[int], seqs: list[list[int]], n_accepted: list[int], n_drafted: list[int],
                 hidden: torch.Tensor | None) -> None:
        for b, a in zip(rows, n_accepted):
            base = self._base.pop(b, None)
            if base is not None:
                fed = self.cached[b] - base  # drafted tokens the draft model consumed (k - 1)
                self.cached[b] = base + min(a, fed)
        self._rewind(rows, n_accepted, self.caches)


class MTPDrafter(_ModelDrafter):
    """DeepSeek-style MTP head: from the target's hidden state at t and the embedding of token t+1 it predicts t+2.
    The first draft is exact MTP; further drafts reuse the head on its own output (as vLLM / SGLang do)."""

    name = "mtp"
    uses_hidden = True

    def __init__(self, model: Any):
        if not len(model.mtp):
            raise ConfigError("speculative='mtp' needs a checkpoint with MTP weights (num_nextn_predict_layers >= 1 "
                              "and model.layers.{N}.eh_proj.weight ...); use 'ngram' or 'draft:PATH' instead")
        self.model = model
        self.head = model.mtp[0]
        self.caches: list[Any] = []
        self.committed: list[int] = []  # MTP positions holding true (h_t, token t+1) pairs
        self.pending: list[torch.Tensor] = []  # target hidden states from position committed[b] on
        self._saved: dict[int, list[Any]] = {}

    def begin(self, seqs: list[list[int]], prompt_hidden: list[torch.Tensor]) -> None:
        self.caches = [self.head.layer.new_cache(len(seqs), self.model.norm.weight.device)]
        self.committed = [0] * len(seqs)
        self.pending = list(prompt_hidden)
        self._saved = {}
        # the prompt's pairs (h_t, x_t+1) but the last go through the MTP layer now, with the prefill (its prefill, as
        # serving engines run it): a draft then commits only the pairs of the tokens emitted since the last one, and
        # what drafting costs per step (adaptive K measures it) is not inflated by the prompt
        rows = [b for b, h in enumerate(self.pending) if 1 < h.shape[0] <= len(seqs[b])]
        if rows:
            n = [self.pending[b].shape[0] - 1 for b in rows]
            self._run(rows, [self.pending[b][:k] for b, k in zip(rows, n)], [seqs[b][1:k + 1] for b, k in zip(rows, n)],
                      [0] * len(rows))
            for b, k in zip(rows, n):
                self.committed[b], self.pending[b] = k, self.pending[b][k:]

    def _run(self, rows: list[int], h: list[torch.Tensor], toks: list[list[int]], start: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer over ragged rows; returns (last output hidden [n, D], logits [n, V]) for each row's last pair."""
        outs_h: list[torch.Tensor | None] = [None] * len(rows)
        groups: dict[int, list[int]] = {}
        if _stateful(self.caches):
            for i, t in enumerate(toks):
                groups.setdefault(len(t), []).append(i)
        else:
            groups[0] = list(range(len(rows)))
        for idx in groups.values():
            tt, last = _ragged([toks[i] for i in idx])
            T = tt.shape[1]
            hh = torch.stack([torch.nn.functional.pad(h[i], (0, 0, 0, T - h[i].shape[0])) for i in idx])
            batch = StepBatch.make([rows[i] for i in idx], [start[i] for i in idx], T)
            out = self.head(hh, self.model.embed_tokens(tt), self.caches[0], batch)
            for n, i in enumerate(idx):
                outs_h[i] = out[n, last[n]]
        hs = torch.stack(outs_h)  # type: ignore[arg-type]
        return hs, self.model.project(self.head.norm(hs))

    def propose(self, rows: list[int], seqs: list[list[int]], ks: list[int], params: SamplingParams,
                gens: list[torch.Generator | None]) -> list[Proposal]:
        # commit the pairs (h_t, x_{t+1}) for t = committed .. len-2; the last one predicts the first draft
        hs = [self.pending[b] for b in rows]
        toks = [seqs[b][self.committed[b] + 1: self.committed[b] + 1 + hs[i].shape[0]] for i, b in enumerate(rows)]
        h_last, first = self._run(rows, hs, toks, [self.committed[b] for b in rows])
        for i, b in enumerate(rows):
            self.committed[b] += hs[i].shape[0]
            self.pending[b] = hs[i][:0]
        state = {b: h_last[i] for i, b in enumerate(rows)}
        pos = {b: self.committed[b] for b in rows}

        def step(srows: list[int], stoks: list[int], j: int) -> torch.Tensor:
            h, lg = self._run(srows, [state[b][None] for b in srows], [[t] for t in stoks], [pos[b] for b in srows])
            for i, b in enumerate(srows):
                state[b], pos[b] = h[i], pos[b] + 1
            return lg

        return self._drafts(rows, ks, list(first), step, params, gens, self.caches)

    def accepted(self, rows: list[int], seqs: list[list[int]], n_accepted: list[int], n_drafted: list[int],
                 hidden: torch.Tensor | None) -> None:
        assert hidden is not None
        for i, (b, a) in enumerate(zip(rows, n_accepted)):
            # the target's hidden states at the last token and at each accepted draft (position committed[b] on)
            self.pending[b] = torch.cat([self.pending[b], hidden[i, : a + 1]])
        self._rewind(rows, [0] * len(rows), self.caches)  # drafted pairs were guesses: back to the committed state


def make_drafter(spec: str, model: Any, dtype: torch.dtype) -> Any:
    """'ngram' | 'ngram:MIN:MAX' | 'mtp' | 'draft:PATH' -> a drafter for the target ``model``."""
    if spec == "ngram" or spec.startswith("ngram:"):
        parts = spec.split(":")[1:]
        try:
            mn, mx = (int(parts[0]), int(parts[1])) if len(parts) == 2 else (1, 3)
        except ValueError:
            raise ConfigError(f"speculative={spec!r}: use 'ngram' or 'ngram:MIN_N:MAX_N' (e.g. ngram:1:3)") from None
        return NgramDrafter(mn, mx)
    if spec == "mtp":
        return MTPDrafter(model)
    if spec.startswith("draft:") and len(spec) > len("draft:"):
        return DraftModelDrafter(spec[len("draft:"):], dtype, model.spec.vocab_size)
    raise ConfigError(f"unknown speculative method {spec!r}: use 'ngram', 'mtp' or 'draft:PATH' (a checkpoint sharing "
                      "the target's tokenizer)")


# ----------------------------------------------------------------------------------------------- adaptive K


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens one verify step emits with k drafts of per-token acceptance alpha: (1 − α^(k+1)) / (1 − α)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class AdaptiveK:
    """Chooses each step's number of drafts from the observed acceptance and the batch size (see the module doc).

    ``overhead``: a forward's fixed cost in per-token units (t(N tokens) ≈ t0 + t1·N, overhead = t0 / t1);
    ``cost_table``: measured (N tokens, seconds) points of one forward, used instead of that line when given
    (piecewise linear; on CPUs the step from 1 token (gemv) to 2 (gemm) is far from linear);
    ``draft_cost``: a drafted token's cost relative to a one-token target step. ``enabled`` False: always k_max.

    ``measure``: learn what steps really cost while decoding. The engine calls ``record(B, T, seconds)`` after
    each step of B rows x T tokens (and ``record_draft`` for drafting time); a measured (B, T) replaces the prior
    (the line or table above, scaled to the measured seconds). A verify of T tokens may cost far more than T/1 of a
    plain step (different kernels, a Mamba-2 trail) — or hardly more (a pipeline's hops): either way K follows the
    measurement. So that a plain step's cost is known too, a row set that has not taken one for
    ``explore_every`` steps takes one. (Off for seeded sampling: see ``reproducible_k``.)"""

    k_max: int
    enabled: bool = True
    overhead: float = 24.0
    cost_table: list[tuple[int, float]] | None = None
    draft_cost: float = 0.0
    prior: float = 0.6
    decay: float = 0.7
    alpha: dict[int, float] = field(default_factory=dict)
    measure: bool = False
    explore_every: int = 16
    explore_run: int = 1  # plain steps in a row when exploring (a pipeline: its micro-batches, so they run alike)
    observed: dict[tuple[int, int], float] = field(default_factory=dict)  # (B, T) -> seconds (EMA)
    draft_s: dict[int, float] = field(default_factory=dict)  # B -> seconds per drafted token step (EMA)
    since_plain: dict[int, int] = field(default_factory=dict)  # B -> steps since the last plain step
    warm: set[tuple[int, Any]] = field(default_factory=set)  # (table, key) measured at least once

    def observe(self, row: int, drafted: int, accepted: int) -> None:
        if drafted > 0:
            a = self.alpha.get(row, self.prior)
            self.alpha[row] = self.decay * a + (1 - self.decay) * accepted / drafted

    def record(self, B: int, T: int, seconds: float) -> None:
        """A measured step of B rows x T tokens (T = 1: a plain step); ignored unless ``measure``. The first step of a
        shape is not kept (it pays one-time costs: buffers, caches growing); then a faster step replaces the estimate
        and a slower one moves it a quarter of the way: on a shared machine noise only slows steps down, and one slow
        step must not price a verify width out for good (a width the controller stops choosing is not measured
        again)."""
        if self.measure:
            self._estimate(self.observed, (B, T), seconds)

    def record_draft(self, B: int, k: int, seconds: float) -> None:
        """Measured drafting time of B rows x k drafted tokens (a drafter that runs apart from the target's step),
        estimated as steps are (``record``)."""
        if k > 0 and self.measure:
            self._estimate(self.draft_s, B, seconds / k)

    def _estimate(self, table: dict, key: Any, seconds: float) -> None:
        if (id(table), key) not in self.warm:
            self.warm.add((id(table), key))
            return
        old = table.get(key)
        table[key] = seconds if old is None or seconds < old else old + 0.25 * (seconds - old)

    def cost(self, n: int) -> float:
        """Prior cost of one forward over n tokens (tokens-equivalent, or seconds with a cost table)."""
        pts = sorted({n: t for n, t in sorted(self.cost_table or [], key=lambda p: -p[1])}.items())  # min per n
        if not pts:
            return self.overhead + n
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2:] if len(pts) > 1 else (pts[0], (pts[0][0] + 1, pts[0][1]))
        return t1 + (t1 - t0) / max(n1 - n0, 1) * (n - n1)

    def step_cost(self, B: int, T: int) -> float:
        """Cost of a step of B rows x T tokens: measured when it was, else the prior scaled to the measurements."""
        got = self.observed.get((B, T))
        if got is not None:
            return got
        prior = self.cost(B * T)
        if self.observed:
            ratios = sorted(v / self.cost(b * t) for (b, t), v in self.observed.items())
            return prior * ratios[len(ratios) // 2]
        return prior

    def gain(self, alpha: float, k: int, batch: int) -> float:
        base = self.step_cost(batch, 1)
        if batch in self.draft_s and self.observed:
            draft = k * self.draft_s[batch]
        else:
            draft = k * self.draft_cost * base
        return expected_tokens(alpha, k) * base / (self.step_cost(batch, k + 1) + draft)

    def choose(self, rows: list[int]) -> list[int]:
        if not self.enabled:
            return [self.k_max] * len(rows)
        B = len(rows)
        if self.measure:
            n = self.since_plain.get(B, self.explore_every - 4)  # a new batch size: a plain step soon, to measure it
            if n < 0 or n >= self.explore_every:  # exploring: explore_run plain steps
                self.since_plain[B] = n + 1 if n < 0 else 1 - self.explore_run
                return [0] * B
        ks = []
        for b in rows:
            a = min(self.alpha.get(b, self.prior), 0.99)
            gains = [self.gain(a, k, B) for k in range(self.k_max + 1)]
            ks.append(max(range(self.k_max + 1), key=lambda k: gains[k]))
        # the step's cost is set by the largest k: rows with a smaller k still pay for the padded width
        if self.measure:
            self.since_plain[B] = 0 if max(ks) == 0 else max(self.since_plain.get(B, self.explore_every - 4), 0) + 1
        return ks


def reproducible_k(params: SamplingParams) -> bool:
    """A seeded sampled run must repeat exactly, and which tokens it samples depends on the K of every step: K then
    follows the acceptance and the prior cost model only, not wall-clock measurements (greedy output does not
    depend on K, so greedy and unseeded runs measure)."""
    return params.temperature > 0 and params.seed is not None


# ----------------------------------------------------------------------------------------------- the engine loop


@dataclass
class SpecStats:
    steps: int = 0          # verify forwards (of the rows' steps: a row's step counts once)
    row_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    plain_steps: int = 0    # steps where no row drafted (plain decode)

    def metrics(self) -> dict[str, float]:
        return {"spec_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "spec_mean_accepted_length": self.emitted / self.row_steps if self.row_steps else 0.0,
                "spec_drafted": float(self.drafted), "spec_accepted": float(self.accepted),
                "spec_verify_steps": float(self.steps), "spec_plain_steps": float(self.plain_steps)}


def burst_len(idle: int) -> int:
    """How many plain greedy steps run back to back (``DecoderModel.greedy_steps``) when a step drafts nothing, after
    ``idle`` steps or bursts in a row that drafted nothing: 1, 2, 4, then LLM's GREEDY_BURST. Where adaptive K has
    found that speculation does not pay, or the n-gram lookup keeps finding no match, the plain steps cost what plain
    greedy decode's do; a row whose drafts pay again waits at most one burst for its next draft."""
    from waferline.engine import llm

    return max(1, min(llm.GREEDY_BURST, 1 << idle))


class Speculator:
    """Speculative decoding for ``LLM``: ``LLM(path, speculative="ngram" | "mtp" | "draft:PATH", num_speculative_tokens=K)``."""

    def __init__(self, model: Any, method: str, num_tokens: int, dtype: torch.dtype, adaptive: bool = True,
                 overhead: float | None = None, cost_table: list[tuple[int, float]] | None = None):
        if num_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {num_tokens}")
        self.model = model
        self.method = method
        w = _window(model.new_caches(1))
        if w is not None and num_tokens >= w:
            num_tokens = w - 1  # a verify must not wrap a sliding-window ring onto itself
        self.k_max = num_tokens
        self.drafter = make_drafter(method, model, dtype)
        self.adaptive = adaptive
        draft_cost = 0.0
        if isinstance(self.drafter, DraftModelDrafter):
            draft_cost = self.drafter.model.spec.num_layers / max(model.spec.num_layers, 1)
        elif isinstance(self.drafter, MTPDrafter):
            draft_cost = 1.0 / max(model.spec.num_layers, 1)
        self.draft_cost = draft_cost
        self.overhead = 24.0 if overhead is None else overhead
        self.cost_table = cost_table  # measured (tokens, seconds) of one forward: see AdaptiveK
        self.ctl: AdaptiveK | None = None  # kept across requests: what steps cost is learnt once

    def controller(self, params: SamplingParams) -> AdaptiveK:
        """This request's AdaptiveK: the measured step costs carry over from earlier requests (a fresh prior-only
        one for a seeded sampled request, which must repeat exactly); the per-row acceptance starts afresh."""
        if reproducible_k(params):
            return AdaptiveK(self.k_max, self.adaptive, self.overhead, self.cost_table, self.draft_cost)
        if self.ctl is None:
            self.ctl = AdaptiveK(self.k_max, self.adaptive, self.overhead, self.cost_table, self.draft_cost, measure=True)
        self.ctl.alpha = {}
        return self.ctl

    def stream(self, llm: Any, ids: list[list[int]], params: SamplingParams) -> Iterator[Any]:
        from waferline.engine.llm import _seeded, decode_metrics
        from waferline.engine.sampling import make_generator, sample

        model = self.model
        B = len(ids)
        ctl = self.controller(params)
        stats = SpecStats()
        with torch.inference_mode():
            caches = model.new_caches(B)
            gens = [make_generator(params) if params.seed is None else _seeded(params, i) for i in range(B)]
            seqs = [list(p) for p in ids]
            out: list[list[int]] = [[] for _ in range(B)]
            done = [False] * B
            reason = ["length"] * B
            stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else llm.eos_token_ids)
            t0 = time.perf_counter()
            hidden: list[torch.Tensor] = []
            first: list[int] = []
            for b, p in enumerate(ids):
                h = model(torch.tensor([p]), caches, StepBatch.make([b], [0], len(p)))
                first.append(sample(model.logits(h[0, -1]), params, gens[b]))
                hidden.append(h[0])
            ttft = time.perf_counter() - t0
            self.drafter.begin(seqs, hidden)
            del hidden

            def emit(b: int, toks: list[int]) -> Iterator[tuple[int, int]]:
                for tok in toks:
                    out[b].append(tok)
                    seqs[b].append(tok)
                    yield b, tok
                    if tok in stop_ids or (params.stop and llm._hit_stop(out[b], params.stop)):
                        done[b], reason[b] = True, "stop"
                    elif len(out[b]) >= params.max_tokens:
                        done[b] = True
                    if done[b]:
                        return

            for b in range(B):
                yield from emit(b, [first[b]])
            idle = 0  # steps (or bursts) in a row in which no row drafted
            while True:
                active = [b for b in range(B) if not done[b]]
                if not active:
                    break
                ks = ctl.choose(active)
                for i, b in enumerate(active):  # never draft past max_tokens or the context
                    room = min(params.max_tokens - len(out[b]) - 1, llm.max_model_len - len(seqs[b]))
                    ks[i] = max(0, min(ks[i], room))
                t_draft = time.perf_counter()
                props = self.drafter.propose(active, seqs, ks, params, gens) if max(ks) > 0 else \
                    [Proposal([]) for _ in active]
                width = max(len(p.tokens) for p in props)
                t_step = time.perf_counter()
                ctl.record_draft(len(active), width, t_step - t_draft)
                n = min(burst_len(idle), min(params.max_tokens - len(out[b]) for b in active)) if width == 0 else 1
                if n > 1 and params.temperature == 0:
                    steps = model.greedy_steps(torch.tensor([[seqs[b][-1]] for b in active]), caches, [
                        StepBatch.make(active, [len(seqs[b]) - 1 + j for b in active], 1) for j in range(n)])
                    if steps is not None:  # nothing drafted: plain steps in a burst, as LLM's greedy decode runs them
                        ctl.record(len(active), 1, (time.perf_counter() - t_step) / n)
                        idle += 1
                        stats.steps += n
                        stats.plain_steps += n
                        stats.row_steps += n * len(active)
                        stats.emitted += n * len(active)
                        toks = torch.cat([ids for ids, _ in steps], 1).tolist()
                        for i, b in enumerate(active):
                            yield from emit(b, toks[i])
                        self.drafter.accepted(active, seqs, [n - 1] * len(active), [0] * len(active),
                                              torch.cat([h for _, h in steps], 1)
                                              if getattr(self.drafter, "uses_hidden", False) else None)
                        continue
                idle = idle + 1 if width == 0 else 0
                rows = [[seqs[b][-1]] + p.tokens + [0] * (width - len(p.tokens)) for b, p in zip(active, props)]
                batch = StepBatch.make(active, [len(seqs[b]) - 1 for b in active], width + 1)
                rb = VerifyRollback(caches, batch)
                logits, h, top = model.step_logits(torch.tensor(rows), caches, batch, argmax=params.temperature == 0)
                ctl.record(len(active), width + 1, time.perf_counter() - t_step)  # what this step really cost
                emitted = verify_rows(logits, [p.tokens for p in props], [p.probs for p in props], params,
                                      [gens[b] for b in active], top)
                keep, n_acc = [], []
                for b, p, toks in zip(active, props, emitted):
                    n_acc.append(len(toks) - 1)
                    keep.append(len(toks))
                    ctl.observe(b, len(p.tokens), len(toks) - 1)
                    stats.drafted += len(p.tokens)
                    stats.accepted += len(toks) - 1
                    stats.emitted += len(toks)
                    stats.row_steps += 1
                stats.steps += 1
                stats.plain_steps += width == 0
                rb.done(keep)
                for i, b in enumerate(active):
                    yield from emit(b, emitted[i])
                self.drafter.accepted(active, seqs, n_acc, [len(p.tokens) for p in props],
                                      h if getattr(self.drafter, "uses_hidden", False) else None)
        metrics = decode_metrics(t0, ttft, sum(len(o) for o in out), B)
        metrics.update(stats.metrics())
        self.last_stats = stats
        yield [llm.make_output(ids[b], out[b], reason[b], stop_ids, params, metrics) for b in range(B)]



# ----------------------------------------------------------------------------------------------- under the pipeline


def pipeline_method(method: str) -> str:
    """Validate a speculative method for the pipeline engine; returns 'ngram', 'mtp' or 'draft'."""
    if method == "ngram" or method.startswith("ngram:"):
        return "ngram"
    if method == "mtp":
        return "mtp"
    if method.startswith("draft:") and len(method) > len("draft:"):
        return "draft"
    raise ConfigError(f"unknown speculative method {method!r}: use 'ngram', 'mtp' or 'draft:PATH' (a checkpoint sharing "
                      "the target's tokenizer)")


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
