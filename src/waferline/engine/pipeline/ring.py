"""The pipeline's decode ring: request state on the scheduler (stage 0), the micro-batches it launches down the chain,
the feedback it reads back from the last stage, and the speculative path's verify groups (engine/speculative/)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from waferline.engine.pipeline.supervise import StageError
from waferline.engine.sampling import SamplingParams
from waferline.engine.stage import (
    BEGIN,
    EMIT_LOGPROBS,
    EMIT_NONE,
    EMIT_TOKEN,
    EMIT_VERIFY,
    FEEDBACK,
    STEP,
    Group,
    MicroBatch,
    decode_feedback,
    json_meta,
)
from waferline.errors import ConfigError

if TYPE_CHECKING:
    from waferline.spec.model import ModelSpec

# ---------------------------------------------------------------- request state on the scheduler (stage 0)

PREFILL, DECODE, DONE = 0, 1, 2


@dataclass
class _Seq:
    idx: int
    prompt: list[int]
    out: list[int] = field(default_factory=list)
    next_pos: int = 0  # prompt tokens already launched into the pipeline
    phase: int = PREFILL
    inflight: bool = False
    reason: str = "length"
    ttft: float = 0.0
    token_times: list[float] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    # speculative: drafts for the next verify (MTP: from the last stage)
    drafts: list[int] = field(default_factory=list)
    verify_k: int = -1  # drafts in the verify now in flight (-1: none in flight)
    verify_T: int = 0  # that verify's T (the micro-batch's verify group width)


@dataclass
class _SpecRun:
    """Stage 0's per-run state of speculative decoding (see engine/speculative/stages.py)."""

    params: SamplingParams
    ctl: Any  # AdaptiveK, for every drafter (for MTP it picks each row's next K, drafted by the last stage)
    stats: Any  # SpecStats
    gens: list[torch.Generator | None]  # stage 0's drafting streams (a draft model sampling at T > 0)
    rewinds: list[tuple[int, int]] = field(default_factory=list)  # (slot, keep) not yet sent to the stages
    launched: dict[int, tuple] = field(default_factory=dict)  # verify-only mb -> (time, B, T, clean, stage-0 s)
    widths: dict[int, int] = field(default_factory=dict)  # mb in flight -> its verify width T (0: other work too)


class DecodeRing:
    """Stage 0's scheduling (a part of ``Pipeline``): keep up to M micro-batches in flight, chunked prefill within a
    token budget, decode rows fed back by the last stage; when speculating, verify groups and rollbacks."""

    def _setup_speculative(self, method: str | None, k: int, adaptive: bool, load: dict[str, Any]) -> None:
        """Speculative decoding under the pipeline: n-gram / draft-model drafting here on stage 0, MTP drafting on the
        last stage (which then loads the embeddings and the MTP head too); the last stage verifies."""
        from waferline.engine.speculative import make_drafter, pipeline_method

        self.speculative = method
        self.spec_method = pipeline_method(method) if method else None
        self.drafter: Any = None
        self._sr: _SpecRun | None = None
        self._costs: Any = None  # AdaptiveK with the step costs measured so far (kept across runs)
        self._hop_s = 0.0  # measured: a step's round trip minus S x stage 0's compute (hops, last-stage extras)
        if not method:
            return
        if k < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {k}")
        windows = [w for w in (getattr(layer.mixer, "sliding_window", None) for layer in self.spec.layers) if w]
        if windows and k >= min(windows):
            k = min(windows) - 1  # a verify must not wrap a sliding-window ring onto itself
        self.k_max, self.spec_adaptive = k, adaptive
        L = max(self.spec.num_layers, 1)
        self.draft_cost = 0.0
        if self.spec_method == "mtp":
            if not self.spec.mtp_layers:
                raise ConfigError(
                    f"speculative='mtp' needs a checkpoint with MTP weights (num_nextn_predict_layers >= 1); "
                    f"{self.path} has none: use 'ngram' or 'draft:PATH' instead"
                )
            load["mtp"] = True
            self.draft_cost = 1.0 / L
        else:
            self.drafter = make_drafter(method, _VocabOnly(self.spec), self.dtype)
            if self.spec_method == "draft":
                self.draft_cost = self.drafter.model.spec.num_layers / L

    # ------------------------------------------------------------ the chain
    def _send_chain(self, kind: int, meta: list[int], tensors: list[torch.Tensor] = ()) -> None:
        self.act.send(1, kind, meta, list(tensors))
        self._chain_sent += 1

    def _launch(self, mb: MicroBatch, tokens: list[torch.Tensor], extra: list[torch.Tensor] = ()) -> None:
        """Run stage 0's layers on ``mb`` and send it down the chain; ``extra`` (a draft model's probabilities) rides
        behind the hidden states to the last stage."""
        t = time.perf_counter()
        hs = self.runner.forward(mb, tokens)
        if self.num_stages == 1:
            raw = torch.cat([t.reshape(-1).view(torch.uint8) for t in extra]) if extra else None
            self._local_fb.append(self.runner.feedback(mb, hs, raw))
        sent = self._sr.launched.get(mb.mb_id) if self._sr is not None else None
        if sent is not None:  # a verify-only step: its cost ~ S x stage 0's compute + the measured hop overhead
            t_fwd = time.perf_counter() - t
            self._sr.launched[mb.mb_id] = sent[:3] + (sent[3], t_fwd)  # type: ignore[assignment]
            self._sr.ctl.record(sent[1], sent[2], self.num_stages * t_fwd + self._hop_s)
        if self.num_stages > 1:
            self._send_chain(STEP, mb.encode(), list(hs) + list(extra))

    def _next_feedback(self) -> tuple[int, dict[int, list[int]], dict[int, torch.Tensor], dict[int, list[int]]]:
        meta, tail = self._recv_feedback()
        return decode_feedback(meta, tail, self.spec.vocab_size)

    def _recv_feedback(self) -> tuple[list[int], torch.Tensor]:
        """The next FEEDBACK message from the last stage: its meta and its raw bytes (on the host)."""
        if self.num_stages == 1:
            meta, ts = self._local_fb.popleft()
            tail = ts[0].reshape(-1).view(torch.uint8) if ts else torch.empty(0, dtype=torch.uint8)
        else:
            kind, meta, tail = self.fb.recv(self.num_stages - 1)
            if kind != FEEDBACK:
                raise StageError(f"protocol error: expected feedback from stage {self.num_stages - 1}, got kind {kind}")
        return meta, tail.cpu()

    def _begin(self, num_slots: int, params: SamplingParams, hidden: bool = False) -> None:
        """Fresh caches of ``num_slots`` rows on every stage; the last stage samples with ``params`` (and with
        ``hidden`` sends back every row's final hidden states)."""
        cfg: dict[str, Any] = {
            "num_slots": num_slots,
            "params": {
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
                "seed": params.seed,
            },
        }
        if hidden:
            cfg["hidden"] = True
        if self._sr is not None:
            cfg["spec"] = {"method": self.spec_method, "k_max": self.k_max, "adaptive": self.spec_adaptive,
                           "max_tokens": params.max_tokens}
            if self.drafter is not None:
                self.drafter.begin([[] for _ in range(num_slots)], [])
        self.runner.begin(cfg)
        if self.num_stages > 1:
            self._send_chain(BEGIN, json_meta(cfg))

    def _carry_ids(self, groups: list[Group], toks: list[torch.Tensor]) -> None:
        """Give each group its input ids [B*T] when a later stage holds a hash-routed layer (``ids_downstream``)."""
        if self.ids_downstream:
            for g, t in zip(groups, toks):
                if g.tokens is None:
                    g.tokens = t.reshape(-1).tolist()

    # ------------------------------------------------------------ scheduling
    def _schedule(
        self, seqs: list[_Seq], logprobs: bool
    ) -> tuple[MicroBatch, list[torch.Tensor], list[torch.Tensor]] | None:
        """The next micro-batch: ready decode rows (capped so the ring keeps min(M, n) micro-batches busy: no
        collapse into one after a drain), then prefill chunks within the token budget. When speculating, the decode
        rows form one verify group ([last token] + drafts, padded to the longest) and the rows whose earlier verify
        came back ride along as rewinds."""
        rows: dict[int, tuple[Group, list[list[int]]]] = {}
        verify: tuple[Group, list[list[int]], list[torch.Tensor]] | None = None

        def add(s: _Seq, toks: list[int], start: int, emit: int) -> None:
            g, tl = rows.setdefault(len(toks), (Group(len(toks)), []))
            g.seqs.append(s.idx)
            g.slots.append(s.idx)
            g.starts.append(start)
            g.emits.append(emit)
            tl.append(toks)

        decoding = [s for s in seqs if s.phase == DECODE]
        n_dec = 0
        if decoding:
            cap = math.ceil(len(decoding) / min(self.micro_batches, len(decoding)))
            ready = [s for s in decoding if not s.inflight][:cap]
            if self._sr is not None and ready:
                verify = self._verify_group(ready)
                n_dec = verify[0].B * verify[0].T
            for s in ready:
                if verify is None:
                    add(s, [s.out[-1]], len(s.prompt) + len(s.out) - 1, EMIT_TOKEN)
                    n_dec += 1
                s.inflight = True
        budget = max(self.prefill_chunk - n_dec, 1)
        for s in seqs:
            if budget <= 0:
                break
            if s.phase != PREFILL or s.next_pos >= len(s.prompt):
                continue
            n = min(len(s.prompt) - s.next_pos, budget)
            last_chunk = s.next_pos + n == len(s.prompt)
            emit = EMIT_LOGPROBS if logprobs else (EMIT_TOKEN if last_chunk else EMIT_NONE)
            add(s, s.prompt[s.next_pos:s.next_pos + n], s.next_pos, emit)
            s.next_pos += n
            budget -= n
        if not rows and verify is None:
            return None
        self._mb_ids += 1
        groups = [rows[T][0] for T in sorted(rows)]
        toks = [torch.tensor(rows[T][1], dtype=torch.long) for T in sorted(rows)]
        if self.spec_method == "mtp" and self._sr is not None:  # the last stage keeps the token history MTP needs
            for g, T in zip(groups, sorted(rows)):
                g.tokens = [t for row in rows[T][1] for t in row]
                # after a prompt's first token, the last stage drafts K_max (the row's acceptance is not known yet)
                g.ks = [min(self.k_max, max(0, self._sr.params.max_tokens - 2)) for _ in g.seqs]
        extra: list[torch.Tensor] = []
        rewinds: list[tuple[int, int]] = []
        if verify is not None:
            groups.append(verify[0])
            toks.append(torch.tensor(verify[1], dtype=torch.long))
            extra = verify[2]
        self._carry_ids(groups, toks)
        if self._sr is not None:
            rewinds, self._sr.rewinds = self._sr.rewinds, []
            # a verify-only micro-batch's round trip is the step's cost — a clean measurement when the micro-batches
            # ahead of it (which it may wait behind at some stage) are steps of the same width
            T = verify[0].T if verify is not None and not rows else 0
            clean = T > 0 and all(w == T for w in self._sr.widths.values())
            self._sr.widths[self._mb_ids] = T
            if T:
                self._sr.launched[self._mb_ids] = (time.perf_counter(), verify[0].B, T, clean)
        return MicroBatch(self._mb_ids, groups, rewinds), toks, extra

    def _verify_group(self, ready: list[_Seq]) -> tuple[Group, list[list[int]], list[torch.Tensor]]:
        """Draft for the ready decode rows (n-gram / draft model here; MTP drafts came back with the feedback) and
        build their verify group: row b's input is [last token] + its drafts, padded to T = 1 + the longest draft."""
        sr = self._sr
        assert sr is not None
        params = sr.params
        idx = [s.idx for s in ready]
        room = [max(0, params.max_tokens - len(s.out) - 1) for s in ready]  # never draft past max_tokens
        probs: list[torch.Tensor | None] = [None] * len(ready)
        ks = sr.ctl.choose(idx)
        next_ks = None
        if self.spec_method == "mtp":  # drafted by the last stage after the previous verify; ks: after this one
            drafts = [s.drafts[:r] for s, r in zip(ready, room)]
            next_ks = [min(k, max(0, r - 1)) for k, r in zip(ks, room)]
        else:
            ks = [min(k, r) for k, r in zip(ks, room)]
            drafts = [[] for _ in ready]
            if max(ks) > 0:
                t = time.perf_counter()
                props = self.drafter.propose(idx, {s.idx: s.prompt + s.out for s in ready}, ks, params, sr.gens)
                sr.ctl.record_draft(len(idx), max(ks), time.perf_counter() - t)
                drafts = [p.tokens for p in props]
                probs = [p.probs for p in props]
        T = 1 + max(len(d) for d in drafts)
        g = Group(T, drafts=drafts, ks=next_ks)
        tl = []
        for s, d in zip(ready, drafts):
            g.seqs.append(s.idx)
            g.slots.append(s.idx)
            g.starts.append(len(s.prompt) + len(s.out) - 1)
            g.emits.append(EMIT_VERIFY)
            tl.append([s.out[-1]] + d + [0] * (T - 1 - len(d)))
            s.verify_k, s.verify_T, s.drafts = len(d), T, []
        extra: list[torch.Tensor] = []
        with_q = [p for p, d in zip(probs, drafts) if d]
        if with_q and all(p is not None for p in with_q):  # a draft model sampling: the verifier needs q
            g.has_q = True
            extra = [torch.cat([p.float().cpu() for p in with_q])]  # type: ignore[union-attr]
        sr.stats.steps += 1
        sr.stats.plain_steps += T == 1
        return g, tl, extra

    def _spec_feedback(self, seqs: list[_Seq], tokens: dict[int, list[int]], drafts: dict[int, list[int]]) -> None:
        """A verify came back: count it, let the drafter (and AdaptiveK) learn the accepted length, queue the rows'
        rollbacks for the stages, and keep MTP's next drafts."""
        sr = self._sr
        assert sr is not None
        for i, toks in tokens.items():
            s = seqs[i]
            s.drafts = drafts.get(i, [])
            if s.verify_k < 0:
                continue
            k, a = s.verify_k, len(toks) - 1
            sr.stats.row_steps += 1
            sr.stats.drafted += k
            sr.stats.accepted += a
            sr.stats.emitted += len(toks)
            sr.ctl.observe(i, k, a)
            if self.drafter is not None:
                self.drafter.accepted([i], None, [a], [k], None)
            if s.verify_T > 1:
                sr.rewinds.append((i, len(toks)))
            s.verify_k = -1

    def _run(
        self, seqs: list[_Seq], params: SamplingParams, logprobs: bool, on_tokens: Any
    ) -> Iterator[list[tuple[int, int]]]:
        """Keep up to M micro-batches in flight until every sequence is done; yield the (row, token) events of
        each answer from the last stage."""
        self._begin(len(seqs), params)
        inflight: set[int] = set()
        try:
            yield from self._ring(seqs, logprobs, on_tokens, inflight)
        except GeneratorExit:  # the caller stopped reading a stream: collect what is in flight, stay usable
            while inflight:
                inflight.discard(self._next_feedback()[0])
            if self.num_stages > 1:
                self.act.flush()
            raise
        if self.num_stages > 1:
            self.act.flush()

    def _ring(
        self, seqs: list[_Seq], logprobs: bool, on_tokens: Any, inflight: set[int]
    ) -> Iterator[list[tuple[int, int]]]:
        while True:
            while len(inflight) < self.micro_batches:
                nxt = self._schedule(seqs, logprobs)
                if nxt is None:
                    break
                mb, toks, extra = nxt
                self._launch(mb, toks, extra)
                inflight.add(mb.mb_id)
            if not inflight:
                break
            mb_id, tokens, lps, drafts = self._next_feedback()
            inflight.discard(mb_id)
            if self._sr is not None:
                self._sr.widths.pop(mb_id, None)
                sent = self._sr.launched.pop(mb_id, None)
                if sent is not None and sent[3] and self.num_stages > 1:  # clean: learn the hops' share of a step
                    extra_s = max(0.0, time.perf_counter() - sent[0] - self.num_stages * sent[4])
                    self._hop_s = 0.7 * self._hop_s + 0.3 * extra_s if self._hop_s else extra_s
                self._spec_feedback(seqs, tokens, drafts)
            now = time.perf_counter()
            for i, lp in lps.items():
                seqs[i].logprobs.append(lp.clone())
                if seqs[i].next_pos >= len(seqs[i].prompt) and sum(x.shape[0] for x in seqs[i].logprobs) == len(
                    seqs[i].prompt
                ):
                    seqs[i].phase = DONE
            events: list[tuple[int, int]] = []
            for i, toks in tokens.items():
                events += [(i, t) for t in on_tokens(seqs[i], toks, now)]
            if events:
                yield events


class _VocabOnly:
    """What make_drafter needs of the target for n-gram / draft-model drafters: its ModelSpec (vocab size)."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
