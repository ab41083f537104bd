"""Continuous batching: requests in cache slots with page accounting per layer kind, chunked prefill, admission and
preemption (recompute), sampling and stop handling per request.

The cache accounting (slots, pages) is engine/paging.py, the prefix cache engine/prefix_cache.py; the loop that drives
a Scheduler is engine/loop.py; what a step asks of the model (one process or a pipeline) is the Runner of
engine/runner.py; a request (``Sequence``, ``Event``) and a step's plan and result are engine/sequence.py.

Scheduling, one step
--------------------
1. Every running sequence that is decoding gets its next token's page (oldest first; drafts leave each later decode
   its token, a seeded sampled one its drafts too). When the budget is exhausted, the newest running sequence is
   **preempted by recompute**: its pages and slot are freed and it goes back to the front of the waiting queue with
   its prompt *and the tokens generated so far*; re-admitted, those are prefilled again (chunked) and decoding goes
   on with the same sampler state, so the tokens it streams are unchanged and no token is sent twice.
2. Sequences still prefilling get chunks of up to ``chunk_tokens`` within the step's token budget
   (``max_num_batched_tokens``), so a long prompt never stalls the decodes of others for more than one chunk.
3. Waiting sequences are admitted in arrival order (FIFO) while a slot is free and the budget holds them + 1 token.

A step hands its decode rows and prefill chunks to the runner at once (one process: all decodes as one [B, 1] call
and prefill chunks as [B, t] calls, padded where the caches allow it, engine/padding.py; a pipeline: micro-batches).
A sequence's tokens depend only on its own prompt, parameters and seeded sampler, never on the batch (up to rounding).
With ``speculative``, decoding sequences may draft and verify several tokens a step (engine/speculative/serving.py).

``step`` runs in three phases: ``schedule`` (the plan: decode rows, prefill chunks, verify rows with their drafts,
and whether the decodes run as a burst), ``execute`` (the runner runs it) and ``postprocess`` (each row's tokens
sampled and emitted; the stop rules end sequences here and nowhere else). With ``greedy_bursts``, a step where every
running sequence is a greedy decode and nothing waits runs up to ``GREEDY_BURST`` greedy steps at once through the
runner's ``burst`` (tokens after a stop are dropped). ``LLM.generate``/``stream`` run this loop too (engine/llm.py).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from waferline.engine import sampling, structured
from waferline.engine.paging import CacheManager
from waferline.engine.prefix_cache import PrefixCache
from waferline.engine.runner import (
    WANT_ARGMAX,
    WANT_LOGITS,
    WANT_LOGPROBS,
    WANT_NONE,
    DecodeRow,
    LocalRunner,
    PrefillChunk,
    RowOutput,
    Runner,
)
from waferline.engine.sampling import SamplingParams, sample, token_logprobs
from waferline.engine.sequence import Event, Sequence, StepPlan, StepResult, check_request, request_generator
from waferline.engine.speculative.serving import ServeSpeculation
from waferline.errors import ConfigError, RequestError, WaferlineError
from waferline.spec.model import ModelSpec

if TYPE_CHECKING:
    from waferline.engine.llm import LLM

__all__ = ["CacheManager", "PrefixCache", "Event", "Sequence", "SchedulerConfig", "Scheduler", "StepPlan",
           "request_generator"]

log = logging.getLogger("waferline.engine")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16
    max_model_len: int | None = None  # None: the model's (LLM.max_model_len)
    max_num_batched_tokens: int = 512  # tokens per step: decodes + prefill chunks
    chunk_tokens: int = 256  # largest prefill chunk of one sequence
    page_tokens: int = 16
    cache_bytes: float | None = None  # None: max_num_seqs sequences of max_model_len
    max_queue: int = 256  # waiting requests beyond this are refused (HTTP 429)
    prefix_caching: bool = True  # where the model allows it (attention-only, no sliding window)
    speculative: str | None = None  # "ngram" | "mtp": speculative decoding (engine/speculative/serving.py)
    num_speculative_tokens: int = 4  # most drafts per sequence and step
    speculative_adaptive: bool = True  # adaptive K (engine/speculative/adaptive.py)
    greedy_bursts: bool = False  # greedy decodes in bursts when nothing waits (a request arriving meanwhile waits)

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_tokens", "page_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


class Scheduler:
    """Continuous batching over an ``LLM``'s model, through a ``Runner`` (engine/runner.py: the single-process
    engine's model in this process, or a pipeline's stage processes). Not thread-safe: ``EngineLoop`` drives it."""

    def __init__(self, llm: LLM, config: SchedulerConfig | None = None, runner: Runner | None = None,
                 speculation: ServeSpeculation | None = None):
        (config := config or SchedulerConfig()).validate()
        self.config, self.llm = config, llm
        self.runner: Runner = runner if runner is not None else runner_for(llm, config.max_num_seqs)
        self.spec: ModelSpec = llm.spec
        mml = config.max_model_len or llm.max_model_len
        if mml > self.spec.max_position_embeddings:
            raise ConfigError(f"max_model_len {mml} exceeds the model's max_position_embeddings "
                              f"{self.spec.max_position_embeddings}")
        self.max_model_len = mml
        if self.runner.num_slots < config.max_num_seqs:
            raise ConfigError(f"the runner has {self.runner.num_slots} slots < max_num_seqs={config.max_num_seqs}")
        self.spec_dec: ServeSpeculation | None = speculation  # (given: the LLM's own, across its schedulers)
        if speculation is not None:
            speculation.bind(self.runner.num_slots)
        elif config.speculative:
            self.spec_dec = ServeSpeculation.for_runner(self.runner, config)
        draft = self.spec_dec.draft if self.spec_dec is not None else None  # (a draft model, an MTP head: they count)
        bits, k = self.runner.cache_bits, self.spec_dec.k_max if self.spec_dec is not None else 0
        self.cache = CacheManager(self.spec, config.max_num_seqs, mml, config.page_tokens, config.cache_bytes,
                                  kv_bits=bits, state_bits=bits, draft=draft.cache_spec if draft else None,
                                  draft_kind=draft.cache_kind if draft else "draft", spec_tokens=k)
        self.cache.attach(self.runner)  # (the runner's paged caches take their pages from it)
        if draft is not None:
            self.cache.attach(draft, draft=True)
        prefixable = self.runner.prefix_caches() is not None
        if self.spec_dec is not None:  # (a slot's drafter state goes when its sequence leaves: an idle server kept it)
            self.cache.released = self.spec_dec.reset
            self.runner.keep_hidden = self.spec_dec.uses_hidden
            prefixable = prefixable and not self.spec_dec.uses_hidden  # a prefix hit skips the MTP head's states
        self.prefix = PrefixCache(self.cache) if config.prefix_caching and prefixable else None
        self._ks: dict[int, int] = {}  # slot -> drafts this step (speculation)
        self.busy: set[str] = set()  # request ids in a plan not yet postprocessed (engine/overlap.py): not scheduled
        self.plan_cap = config.max_num_seqs  # most sequences one plan takes
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order (the newest is preempted first)
        self.stop_ids_default = set(llm.eos_token_ids)
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        self.stats = {"preemptions": 0, "steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "prefill_tokens": 0,
                      "request_errors": 0} | (self.spec_dec.metrics() if self.spec_dec is not None else {})

    # -- requests
    def add(self, seq: Sequence) -> None:
        check_request(seq.prompt_ids, seq.params, self.spec.vocab_size, self.max_model_len, self.llm.tokenizer)
        if seq.generator is None:
            seq.generator = request_generator(seq.params)
        seq.stop_ids = self._stop_ids(seq.params)
        if seq.params.structured is not None:
            seq.constraint = structured.constraint(self.llm.tokenizer, self.spec.vocab_size, seq.stop_ids,
                                                   seq.params, self.tokenizer_lock)
            seq.stop_ids = seq.constraint.stop_ids  # (the tokenizer's end-of-sequence where the model names none)
        seq.status = "waiting"
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        seq = next((q for q in list(self.running) + list(self.waiting) if q.request_id == request_id), None)
        if seq is not None:
            self._finish(seq, "abort")
        return seq is not None

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- one step
    @torch.inference_mode()
    def step(self) -> int:
        """Schedule, execute and postprocess one step; returns the number of tokens fed through the model."""
        return self.postprocess(plan := self.schedule(), self.execute(plan))

    def schedule(self) -> StepPlan:
        """This step's decode rows (oldest first), prefill chunks, verify rows with their drafts, and burst length."""
        decodes, prefills = self._schedule()
        plan = StepPlan(decodes, [(s, t) for s, t in prefills if s.status == "running"])
        if self.spec_dec is not None and decodes:
            props = self.spec_dec.propose(decodes, [self._ks.get(s.slot, 0) for s in decodes])
            # a verify row needs its drafts' pages (its padding to the step's widest row goes to the sink page); a row
            # the cache cannot give them (a cache_bytes below max_num_seqs x max_model_len) runs as a plain decode
            fits = [bool(p.tokens) and self.cache.grow(s.request_id, s.num_computed + 1 + len(p.tokens))
                    for s, p in zip(decodes, props)]
            plan.verifies = [(s, p) for s, p, f in zip(decodes, props, fits) if f]
            plan.decodes = [s for s, f in zip(decodes, fits) if not f]
        plan.burst = self._burst_len(plan)
        return plan

    def _burst_len(self, plan: StepPlan) -> int:
        """Greedy steps the decodes run back to back: > 1 only where bursts are on, the runner has them, every running
        sequence is a greedy decode of this step, nothing waits, and each has the pages for them."""
        seqs = plan.decodes
        if not (self.config.greedy_bursts and seqs and len(seqs) == len(self.running)) or plan.prefills \
                or plan.verifies or self.waiting or not hasattr(self.runner, "burst") \
                or any(s.params.temperature != 0 or s.params.needs_logits for s in seqs):
            return 1
        cap = self.spec_dec.burst_steps() if self.spec_dec is not None else sampling.GREEDY_BURST
        n = min([cap] + [s.params.max_tokens - len(s.output_ids) for s in seqs])
        return n if n > 1 and all(self.cache.grow(s.request_id, s.num_computed + n) for s in seqs) else 1

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan through the runner: the verify forward (its tokens judged with each row's generator), then the
        decodes (as a burst where planned and the runner can) and prefill chunks in one step."""
        res, spec = StepResult(), self.spec_dec
        dec_rows, chunks = self.rows(plan)
        if plan.verifies:
            assert spec is not None and hasattr(self.runner, "verify")
            together = getattr(self.runner, "verify_with_step", False) and plan.burst <= 1
            res.verified, res.fed, rest = spec.verify_step(self.runner, plan.verifies, *(
                (dec_rows, chunks) if together else ()))
            if rest is not None:  # (the decode rows and prefill chunks went through in the verify's trip)
                res.decoded, res.prefilled = rest
                spec.after_step(plan.decodes, plan.prefills, res.decoded, res.prefilled)
                return res
        t0 = time.perf_counter()
        if plan.burst > 1:
            got = self.runner.burst(dec_rows, plan.burst)  # type: ignore[attr-defined]
            if got is not None:
                res.burst, hidden = got
                if spec is not None:
                    spec.burst_done([r.slot for r in dec_rows], plan.burst, time.perf_counter() - t0, hidden)
                return res
            plan.burst = 1
        if not (dec_rows or chunks):
            return res
        res.decoded, res.prefilled = self.runner.step(dec_rows, chunks)
        if spec is not None:
            if dec_rows and not chunks:  # a plain step's cost, for adaptive K
                spec.record(len(dec_rows), 1, time.perf_counter() - t0)
            spec.after_step(plan.decodes, plan.prefills, res.decoded, res.prefilled)
        return res

    @staticmethod
    def rows(plan: StepPlan) -> tuple[list[DecodeRow], list[PrefillChunk]]:
        """What the runner is asked for ``plan``'s decodes and prefill chunks."""
        return ([DecodeRow(s.slot, s.num_computed, s.tokens(s.num_computed, s.num_computed + 1)[0],
                           WANT_ARGMAX if s.params.temperature == 0 and not s.params.needs_logits else WANT_LOGITS)
                 for s in plan.decodes],
                [PrefillChunk(s.slot, s.num_computed, s.tokens(s.num_computed, s.num_computed + t), WANT_LOGPROBS
                              if s.scores_prompt else WANT_NONE if s.remaining > t else WANT_LOGITS)
                 for s, t in plan.prefills])

    def postprocess(self, plan: StepPlan, res: StepResult) -> int:
        """Emit the step's tokens (verify rows', then the decodes', then the tokens that end prefills), each through
        the stop rules; returns the tokens fed through the model."""
        fed, spec = res.fed, self.spec_dec is not None and (plan.decodes or plan.verifies)
        rows = ([s for s, _ in plan.verifies], plan.decodes)
        had = [sum(len(s.output_ids) for s in r) for r in rows] if spec else []
        for (s, _), toks in zip(plan.verifies, res.verified):
            if isinstance(toks, Exception):
                self.stats["request_errors"] += 1
                self._finish(s, "error", f"request failed: {type(toks).__name__}: {toks}")
                continue
            base = s.num_computed
            for i, tok in enumerate(toks):  # one at a time: a stop inside the burst ends it there
                s.num_computed = base + i + 1
                self._sample_or_fail(s, None, tok)
                if s.status != "running":
                    break
        if res.burst is not None:  # step after step; a sequence that stops drops its later tokens
            for j in range(plan.burst):
                for s, toks in zip(plan.decodes, res.burst):
                    if s.status == "running":
                        s.num_computed += 1
                        self._sample_or_fail(s, None, toks[j])
        else:
            for s, out in zip(plan.decodes, res.decoded):
                s.num_computed += 1
                self._take(s, out)
        fed += plan.burst * len(plan.decodes)
        for (s, t), out in zip(plan.prefills, res.prefilled):
            s.take_prompt_logprobs(s.num_computed, out)
            s.num_computed += t
            self.stats["prefill_tokens"] += t
            fed += t
            if s.remaining == 0:
                self._take(s, out)
        if spec:  # (the tokens the outputs got: a stop drops the verified or burst tokens after it)
            verified, decoded = (sum(len(s.output_ids) for s in r) - h for r, h in zip(rows, had))
            row_steps = len(plan.verifies) + (decoded if res.burst is not None else len(plan.decodes))
            self.spec_dec.counted(row_steps, plan.burst, verified + decoded, bool(plan.verifies))
            self.stats.update(self.spec_dec.metrics())
        self.stats["steps"] += 1
        return fed

    def _take(self, seq: Sequence, out: RowOutput | None) -> None:
        """Emit ``seq``'s next token from what the runner returned for its row."""
        if out is None:  # (a runner that answered nothing for a row that wanted a token: a bug, this row's alone)
            self._finish(seq, "error", "request failed: the engine returned no logits for this sequence")
            return
        logits = out.logits if out.logits is None or out.logits.dim() == 1 else out.logits[-1]  # (a scored chunk's)
        self._sample_or_fail(seq, logits, out.argmax)

    def _schedule(self) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        decodes: list[Sequence] = []
        prefills: list[tuple[Sequence, int]] = []
        preempted = False
        # decodes first (one token, or one plus drafts after an output token: never a prompt's), then prefill chunks
        order = [s for s in self.running if s.remaining == 1] + [s for s in self.running if s.remaining > 1]
        if self.spec_dec is not None:  # (the sequences in flight are not this step's: engine/overlap.py)
            self._ks = self.spec_dec.choose([s for s in order if s.remaining == 1 and s.request_id not in self.busy
                                             and s.num_computed >= len(s.prompt_ids)], self.max_model_len,
                                            self.plan_cap)
        dec = [s for s in order if s.remaining == 1 and s.request_id not in self.busy]  # (what each keeps: below)
        at = {s.request_id: j + 1 for j, s in enumerate(dec)}  # (cum: running sums, one pass a step)
        cum = list(accumulate((1 + (0 if s.params.needs_logits or not (self.spec_dec and self.spec_dec.exact(s)) else
                                    self._ks.get(s.slot, 0)) for s in dec), initial=0))
        for s in order:
            if s.status != "running" or budget <= 0 or s.request_id in self.busy \
                    or len(decodes) + len(prefills) >= self.plan_cap:
                continue
            t = 1 if s.remaining == 1 else min(s.redo_left, cfg.chunk_tokens, budget)
            # (a request whose rows need the logits decodes plainly). A seeded sampled row's tokens depend on its K: it
            # waits for room for all of it; else K is cut to the budget less what the decodes after it keep (a token
            # each, a seeded one its K too), and to 0 where no page is free
            k = self._ks.get(s.slot, 0) if s.remaining == 1 and not s.params.needs_logits else 0
            exact = k > 0 and self.spec_dec is not None and self.spec_dec.exact(s)
            if k > budget - 1 and exact:
                continue
            if k > 0 and not exact:
                i = at[s.request_id]
                k = max(0, min(k, budget - 1 - (cum[min(i + self.plan_cap - len(decodes) - 1, len(dec))] - cum[i])))
                k = k if k == 0 or self.cache.grow(s.request_id, s.num_computed + 1 + k) else 0
            self._ks[s.slot], t = k, t + k
            while not self.cache.grow(s.request_id, s.num_computed + t):
                # the latest admitted not in flight; in s's part of a split page table first (its pages come from it)
                others = [v for v in reversed(self.running) if v is not s and v.request_id not in self.busy]
                victim = min(others, key=lambda v: (v.slot - s.slot) % self.cache.parts != 0, default=None)
                if victim is None and not self.busy:  # cannot happen: the budget holds one max_model_len sequence
                    raise RuntimeError("cache budget exhausted by a single sequence")
                i = self.running.index(s)
                if victim is None or self.running.index(victim) < i:  # s is the newest not in flight: it gives way,
                    if any(v.request_id in self.busy for v in self.running[i + 1:]):  # or waits for a newer one's
                        break
                    victim = s
                self._preempt(victim)
                preempted = True
                if victim is s:
                    break
                if victim in decodes:
                    decodes.remove(victim)
                prefills = [(v, n) for v, n in prefills if v is not victim]
            else:
                if s.remaining == 1:
                    decodes.append(s)
                else:
                    prefills.append((s, t))
                budget -= t
        while self.waiting and budget > 0 and not preempted and len(decodes) + len(prefills) < self.plan_cap:
            s = self.waiting[0]
            part = self.cache.place(len(s.all_ids) + 1, self.prefix and partial(self.prefix.match, s.all_ids))
            caches = self.runner.prefix_caches() if self.prefix is not None else None
            # the stored pages it starts with (a scored prompt is computed whole): they need no room of their own
            hit = self.prefix.match(s.all_ids, part) if caches is not None and s.params.prompt_logprobs is None else []
            if not self.cache.can_admit(len(s.all_ids) + 1, part, hit):
                break
            self.waiting.popleft()
            s.slot = self.cache.admit(s.request_id, part)
            s.status, s.num_computed = "running", 0
            self.running.append(s)  # (before the reset: a runner that fails there leaves s for abort to free)
            self.runner.reset_slots([s.slot])  # a fresh sequence in this slot: clear ring positions / SSM state
            if self.spec_dec is not None:
                self.spec_dec.reset(s.slot)
            if hit:  # (its slot holds the stored pages first: grow then counts them, and takes a drafter's pages)
                self.prefix.load(hit, s.slot, caches)
                s.num_computed = len(hit) * self.cache.page_tokens
                self.cache.grow(s.request_id, s.num_computed)
                s.cached_tokens = s.cached_tokens if s.preemptions else min(s.num_computed, len(s.prompt_ids))
            t = min(s.redo_left, cfg.chunk_tokens, budget)
            if t:  # (else a recomputed sequence's last token, which decodes next step)
                self.cache.grow(s.request_id, s.num_computed + t)
                prefills.append((s, t))
                budget -= t
        return decodes, prefills

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the pages and slot; later re-prefill prompt + generated tokens."""
        self.cache.free(seq.request_id)
        self.running.remove(seq)
        seq.status, seq.num_computed, seq.slot = "waiting", 0, -1
        seq.preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(seq)

    # -- tokens and stopping
    def _sample_or_fail(self, seq: Sequence, logits: torch.Tensor | None, greedy: int | None = None) -> None:
        """``_sample``, where an error (from this sequence's parameters, its sampler or its text) ends only this
        sequence, with finish reason "error": the batch's forward pass is shared, but what each row does with its
        logits is its own."""
        try:
            self._sample(seq, logits, greedy)
        except Exception as e:
            self.stats["request_errors"] += 1
            # the client gets one line; the log keeps the traceback (a fault here may be a bug, not the request)
            log.warning("request %s failed while sampling", seq.request_id, exc_info=not isinstance(e, WaferlineError))
            self._finish(seq, "error", f"request failed: {type(e).__name__}: {e}", invalid=isinstance(e, RequestError))

    def _sample(self, seq: Sequence, logits: torch.Tensor | None, greedy: int | None = None) -> None:
        """Emit seq's next token: ``greedy`` where the step already took the argmax of ``logits``, else sampled."""
        p = seq.params
        if greedy is None and logits is None:
            raise RuntimeError("the engine returned neither logits nor a token")
        tok = sample(logits, p, seq.generator, seq) if greedy is None else greedy
        lps = None
        if p.logprobs is not None:
            if logits is None:
                raise RuntimeError("the engine returned a token without the logits its log-probabilities need")
            lps = token_logprobs(logits, tok, p.logprobs)
        now = time.perf_counter()
        prompt_lps = seq.prompt_lps if seq.first_token_at is None and p.prompt_logprobs is not None else None
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.stats["prompt_tokens"] += len(seq.prompt_ids)
        seq.last_token_at = now
        seq.output_ids.append(tok)
        self.stats["generated_tokens"] += 1
        # (a request can list many stop ids: the set is built once per request, not at every token of every row)
        stop_ids = seq.stop_ids if seq.stop_ids is not None else self._stop_ids(p)
        reason = None
        if not (seq.stream_text or p.stop):  # (no text while it runs: the caller decodes the output at the end)
            reason = "stop" if tok in stop_ids else "length" if len(seq.output_ids) >= p.max_tokens else None
            seq.emit(Event(tok, "", completion_tokens=len(seq.output_ids), prompt_tokens=len(seq.prompt_ids),
                           logprobs=lps, prompt_logprobs=prompt_lps))
            if reason is not None:
                self._finish(seq, reason)
            return
        (text, cut), offset = self._text(seq), seq.token_start  # (_text first: where the token's text starts)
        if tok in stop_ids:
            reason = "stop"
        elif cut is not None:  # (a token whose text starts past the cut starts at the output's end)
            reason, text, offset = "stop", text[:cut], min(offset, cut)
        elif len(seq.output_ids) >= p.max_tokens:
            reason, text = "length", self._decode(seq.output_ids, p, seq.prompt_ids, True)  # (a cut character too)
        if reason is None:
            hold = max((len(s) for s in p.stop), default=1) - 1
            end = len(text) - hold
            while end > seq.sent_chars and text[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence: wait
                end -= 1
            delta = text[seq.sent_chars:end] if end > seq.sent_chars else ""
        else:
            if tok in stop_ids:  # the stop token's own text (e.g. "</s>") is not part of the output
                text = self._decode(seq.output_ids[:-1], p, seq.prompt_ids, True)
            delta = text[seq.sent_chars:]
        seq.sent_chars += len(delta)
        seq.emit(Event(tok, delta, completion_tokens=len(seq.output_ids), prompt_tokens=len(seq.prompt_ids),
                       logprobs=lps, prompt_logprobs=prompt_lps, text_offset=offset))
        if reason is not None:
            self._finish(seq, reason)

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.stop_ids_default)

    def _decode(self, ids: list[int], params: SamplingParams | None = None, after: list[int] | tuple = (),
                whole: bool = False) -> str:  # (after: the prompt; whole: a finished output's text, LLM.output_text)
        if self.llm.tokenizer is None:
            return ""
        with self.tokenizer_lock:
            skip = params is None or params.skip_special_tokens
            return self.llm.output_text(ids, skip, after) if whole else self.llm.decode(ids, skip, after)

    def _text(self, seq: Sequence) -> tuple[str, int | None]:
        return seq.update_text(partial(self._decode, params=seq.params) if self.llm.tokenizer is not None else None)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, unavailable: bool = False,
                invalid: bool = False) -> None:
        if seq.status == "finished":
            return
        if self.cache.holds(seq.request_id):
            pages = self.cache.free(seq.request_id)
            caches = self.runner.prefix_caches() if self.prefix is not None and reason != "error" else None
            if self.prefix is not None and caches is not None:  # the slot's rows stay valid until it is reused
                self.prefix.store(seq.all_ids, seq.num_computed, seq.slot, pages, caches)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = "finished", reason
        seq.emit(Event(None, "", True, reason, len(seq.prompt_ids), len(seq.output_ids), error, unavailable, invalid))

    def fail_all(self, error: str) -> None:
        """End every running and waiting sequence with ``error``: the engine failed or stops (HTTP 503)."""
        for seq in list(self.running) + list(self.waiting):
            self._finish(seq, "error", error, unavailable=True)


def runner_for(llm: LLM, num_slots: int, rebuild: Callable[[], object] | None = None) -> Runner:
    """The runner of an ``LLM``: its model in this process, its pipeline's stages or its AFD ranks (``rebuild``: a
    callable that returns a fresh Pipeline / AFD, used to recover from a dead process; without one, such a fault
    stops the engine)."""
    if getattr(llm, "model", None) is not None:
        return LocalRunner(llm.model, num_slots, getattr(llm, "device", None))
    pipe = getattr(llm, "_pipeline", None)
    if pipe is None:
        raise ConfigError("this LLM has neither a model in this process nor a pipeline to serve")
    from waferline.engine.afd import AFD

    if isinstance(pipe, AFD):
        from waferline.engine.afd.serving import AFDRunner

        return AFDRunner(pipe, num_slots, rebuild)
    from waferline.engine.pipeline.serving import PipelineRunner

    return PipelineRunner(pipe, num_slots, rebuild)
