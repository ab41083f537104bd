"""Drafters of speculative decoding: prompt-lookup n-grams, a draft model, an MTP head; ``make_drafter`` picks one."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from waferline.engine.sampling import SamplingParams, draw, greedy, target_probs
from waferline.engine.speculative.rollback import _load, _save, _stateful
from waferline.errors import ConfigError
from waferline.model.attention import managed_table
from waferline.model.block_table import BlockTable
from waferline.model.context import StepBatch
from waferline.spec.model import ModelSpec


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

    def reset(self, rows: list[int]) -> None:
        """Rows that start a new sequence: an empty index."""
        for b in rows:
            self.index[b] = {n: {} for n in range(self.min_n, self.max_n + 1)}
            self.indexed[b] = 0

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
    q = target_probs(logits.cpu(), params)  # (sampled on the host, with the request's CPU generator)
    return draw(q, gen), q


class _ModelDrafter:
    """Shared machinery of the drafters that run a network autoregressively over their own cache."""

    name = "model"
    caches: list[Any]
    num_slots: int

    def block_table(self, page_tokens: int) -> BlockTable | None:
        """One page table for the drafter's paged caches (as ``LocalRunner.block_table``; after ``begin``), managed by
        the scheduler's CacheManager, which counts the drafter's caches in its budget (``cache_spec``, kinds
        ``{cache_kind}_...``); None without paged caches."""
        return managed_table(self.caches, self.num_slots, page_tokens)

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


def _ragged(seqs: list[list[int]], device: torch.device, pad: int = 0) -> tuple[torch.Tensor, list[int]]:
    T = max(len(s) for s in seqs)
    return torch.tensor([s + [pad] * (T - len(s)) for s in seqs], device=device), [len(s) - 1 for s in seqs]


class DraftModelDrafter(_ModelDrafter):
    """A smaller checkpoint sharing the target's vocabulary drafts autoregressively over its own caches."""

    cache_kind = "draft"

    def __init__(self, path: str | Path, dtype: torch.dtype, vocab_size: int, device: torch.device | None = None):
        from waferline.model.arena import move_to_huge_pages
        from waferline.model.load import load_model
        from waferline.model.quant import loading_for, move_model

        self.device = torch.device(device or "cpu")
        with loading_for(self.device):
            self.model = load_model(Path(path), dtype)
        if self.model.spec.vocab_size != vocab_size:
            raise ConfigError(f"draft model {path} has vocab_size {self.model.spec.vocab_size} but the target has "
                              f"{vocab_size}; a draft model must share the target's tokenizer")
        if self.device.type == "cpu":
            move_to_huge_pages(self.model)  # as the target's (model/arena.py)
        else:
            move_model(self.model, self.device)  # on the target's device (int4 weights repacked for its kernel)
        self.name = f"draft:{path}"
        self.caches: list[Any] = []
        self.num_slots = 0
        self.cached: list[int] = []  # tokens of each row held in the draft caches
        self._saved: dict[int, list[Any]] = {}
        self._base: dict[int, int] = {}

    def begin(self, seqs: list[list[int]], prompt_hidden: list[torch.Tensor]) -> None:
        self.caches = self.model.new_caches(len(seqs), self.device)
        self.num_slots, self.cached = len(seqs), [0] * len(seqs)
        self._saved, self._base = {}, {}

    @property
    def cache_spec(self) -> ModelSpec:
        """What the draft model's caches hold per sequence (the scheduler's CacheManager counts them)."""
        return self.model.spec

    def reset(self, rows: list[int]) -> None:
        """Rows that start a new sequence: nothing of them in the draft caches (a managed table's pages are its
        allocator's)."""
        index = torch.tensor(rows, device=self.device)
        for c in self.caches:
            if c is not None:
                c.reset(index)
        for b in rows:
            self.cached[b] = 0
            self._saved.pop(b, None)
            self._base.pop(b, None)

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
            toks, last = _ragged([chunks[i] for i in idx], self.device)
            batch = StepBatch.make([rows[i] for i in idx], [self.cached[rows[i]] for i in idx], toks.shape[1],
                                   self.device)
            h = self.model(toks, self.caches, batch)
            at = torch.tensor(last, device=self.device)
            lg = self.model.logits(h[torch.arange(len(idx), device=self.device), at])
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


def check_mtp(layers: int, path: Any, model_type: str = "") -> None:
    """Speculative 'mtp' needs MTP weights in the checkpoint (the scheduler's drafter loads them): ``layers`` MTP
    layers, the model's or its config's."""
    if model_type == "deepseek_v4":
        raise ConfigError("speculative='mtp': waferline's engine does not run DeepSeek-V4's MTP module (its "
                          "hyper-connected mtp.* block); use 'ngram' or 'draft:PATH' instead")
    if not layers:
        raise ConfigError(
            f"speculative='mtp' needs a checkpoint with MTP weights (num_nextn_predict_layers >= 1 and "
            f"model.layers.{{N}}.eh_proj.weight ...); {path} has none: use 'ngram' or 'draft:PATH' instead"
        )


class MTPDrafter(_ModelDrafter):
    """DeepSeek-style MTP head: from the target's hidden state at t and the embedding of token t+1 it predicts t+2.
    The first draft is exact MTP; further drafts reuse the head on its own output (as vLLM / SGLang do)."""

    name = "mtp"
    uses_hidden = True
    cache_kind = "mtp"

    def __init__(self, model: Any):
        if not len(model.mtp):
            check_mtp(0, "the checkpoint", model.spec.model_type)  # (DeepSeek-V4's: said as such)
            raise ConfigError("speculative='mtp' needs a checkpoint with MTP weights (num_nextn_predict_layers >= 1 "
                              "and model.layers.{N}.eh_proj.weight ...); use 'ngram' or 'draft:PATH' instead")
        self.model = model
        self.head = model.mtp[0]
        self.device = model.norm.weight.device
        self.caches: list[Any] = []
        self.num_slots = 0
        self.committed: list[int] = []  # MTP positions holding true (h_t, token t+1) pairs
        self.pending: list[torch.Tensor] = []  # target hidden states from position committed[b] on
        self._saved: dict[int, list[Any]] = {}

    def begin(self, seqs: list[list[int]], prompt_hidden: list[torch.Tensor]) -> None:
        self.caches = [self.head.layer.new_cache(len(seqs), self.device)]
        self.num_slots, self.committed = len(seqs), [0] * len(seqs)
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

    @property
    def cache_spec(self) -> ModelSpec:
        """What the MTP head's cache holds per sequence: its layer (the checkpoint's first MTP layer, as layer 0 of
        its one cache) as a model of one layer, which the scheduler's CacheManager counts."""
        spec = self.model.spec
        return replace(spec, layers=[replace(spec.mtp_layers[0], index=0)], mtp_layers=[])

    def commit_known(self, b: int, seq: list[int]) -> None:
        """Row b's pending pairs (h_t, token t+1) whose next token ``seq`` (its prompt + output) already holds go
        through the MTP layer now, the last hidden state staying pending: run with a prefill (as ``begin`` does), a
        draft then commits only the pairs of the tokens emitted since."""
        c = self.committed[b]
        n = min(self.pending[b].shape[0] - 1, len(seq) - 1 - c)  # (the last stays: a draft starts from it)
        if n > 0:
            self._run([b], [self.pending[b][:n]], [seq[c + 1:c + 1 + n]], [c])
            self.committed[b], self.pending[b] = c + n, self.pending[b][n:]

    def reset(self, rows: list[int]) -> None:
        """Rows that start a new sequence: nothing committed or pending, an empty MTP cache row (a managed table's
        pages are its allocator's)."""
        for b in rows:
            self.committed[b] = 0
            self.pending[b] = self.pending[b].new_empty((0, *self.pending[b].shape[1:]))  # (a view would keep them)
            self._saved.pop(b, None)
        self.caches[0].reset(torch.tensor(rows, device=self.device))

    def _run(
        self, rows: list[int], h: list[torch.Tensor], toks: list[list[int]], start: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer over ragged rows; returns (last output hidden [n, D], logits [n, V]) for each row's last pair."""
        outs_h: list[torch.Tensor | None] = [None] * len(rows)
        groups: dict[int, list[int]] = {}
        if _stateful(self.caches):
            for i, t in enumerate(toks):
                groups.setdefault(len(t), []).append(i)
        else:
            groups[0] = list(range(len(rows)))
        for idx in groups.values():
            tt, last = _ragged([toks[i] for i in idx], self.device)
            T = tt.shape[1]
            hh = torch.stack([torch.nn.functional.pad(h[i], (0, 0, 0, T - h[i].shape[0])) for i in idx])
            batch = StepBatch.make([rows[i] for i in idx], [start[i] for i in idx], T, self.device)
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
    """'ngram' | 'ngram:MIN:MAX' | 'mtp' | 'draft:PATH' -> a drafter for the target ``model`` (a draft model on the
    target's device)."""
    if spec == "ngram" or spec.startswith("ngram:"):
        parts = spec.split(":")[1:]
        try:
            mn, mx = map(int, parts) if parts else (1, 3)  # (one number or three: refused, not read as 1:3)
        except ValueError:
            raise ConfigError(f"speculative={spec!r}: use 'ngram' or 'ngram:MIN_N:MAX_N' (e.g. ngram:1:3)") from None
        return NgramDrafter(mn, mx)
    if spec == "mtp":
        return MTPDrafter(model)
    if spec.startswith("draft:") and len(spec) > len("draft:"):
        device = next(iter(model.parameters()), torch.zeros(0)).device
        return DraftModelDrafter(spec[len("draft:"):], dtype, model.spec.vocab_size, device)
    raise ConfigError(f"unknown speculative method {spec!r}: use 'ngram', 'mtp' or 'draft:PATH' (a checkpoint sharing "
                      "the target's tokenizer)")
