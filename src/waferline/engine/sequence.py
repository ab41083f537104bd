"""One request inside the scheduler (``Sequence``), what its stream receives (``Event``), its sampler
(``request_generator``), and what one scheduler step runs (``StepPlan``) and gets back (``StepResult``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from waferline.engine.sampling import SamplingParams, TokenLogprobs, make_generator, rows_logprobs
from waferline.errors import RequestError

if TYPE_CHECKING:
    from waferline.engine.runner import RowOutput
    from waferline.engine.speculative.drafters import Proposal

# an output's text is decoded after (at most) this many of the prompt's last tokens (LLM.decode's ``after``): enough
# to reach past a character in byte-fallback pieces or a run of special tokens, as vLLM's detokenizer does
CONTEXT_TOKENS = 24


@dataclass
class Event:
    """What a request's stream receives: one per generated token, then (possibly with the last token) the end."""

    token_id: int | None
    text: str  # new text since the previous event (held back while it may be part of a stop string)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    unavailable: bool = False  # the error was the engine's (a fault or a shutdown), not this request's (HTTP 503)
    invalid: bool = False  # the error was this request's own, found as it ran (e.g. its grammar's limit: HTTP 400)
    logprobs: TokenLogprobs | None = None  # the token's log-probabilities, where the request asked for them
    prompt_logprobs: list[TokenLogprobs] | None = None  # (the first token's event) the prompt's, where asked for
    cached_tokens: int = 0  # prompt tokens read from cached prefix pages at its admission (not computed)
    # where the token's text starts in the output's text: the characters decoded before it, whether or not they were
    # sent yet (``text`` holds back what may start a stop string); None where no text is decoded while it runs
    text_offset: int | None = None


@dataclass
class Sequence:
    """One request inside the scheduler. ``generator``: its sampler (None: ``request_generator`` gives one when the
    scheduler adds it); ``stream_text``: events carry the new text (off: no text is decoded while it runs, unless it
    has stop strings; the caller decodes the output at the end, as ``LLM.generate`` does)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Event], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens of prompt + output already in the cache
    slot: int = -1
    status: str = "waiting"  # waiting | running | finished
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    preemptions: int = 0
    cached_tokens: int = 0  # (its first admission's prefix hit, in prompt tokens)
    sent_chars: int = 0
    text: str = ""  # the output's text so far, decoded incrementally (Scheduler._text)
    text_from: int = 0  # output_ids[text_from:text_upto] decode to text's last piece (the window the next starts from)
    text_upto: int = 0
    token_start: int = 0  # where the last token's text starts in text (update_text; its text_offset)
    stop_ids: frozenset[int] | None = None  # the token ids that end it, gathered once (Scheduler.add)
    stop_after: int = 0  # a stop string ends it only where it ends past this many characters (min_tokens' text)
    stream_text: bool = True
    prompt_lps: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.. (params.prompt_logprobs)
    constraint: Any = None  # its structured output's state (engine/structured.py), where the params ask

    def emit(self, ev: Event) -> None:
        if self.sink is not None:
            ev.cached_tokens = self.cached_tokens
            self.sink(ev)

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's log-probabilities are asked for and not all known yet: its prefill chunks want them all."""
        return self.params.prompt_logprobs is not None and len(self.prompt_lps) < len(self.prompt_ids) - 1

    def take_prompt_logprobs(self, start: int, out: RowOutput | None) -> None:
        """Keep the prompt log-probabilities a WANT_LOGPROBS chunk from position ``start`` gave (``out.logits`` [T, V]:
        row j scores the token at start + j + 1); positions known already (a recomputed chunk) are skipped."""
        if out is None or out.logits is None or out.logits.dim() != 2 or not self.scores_prompt:
            return
        lo = len(self.prompt_lps) - start  # the first row not known yet (token len(prompt_lps) + 1)
        hi = min(out.logits.shape[0], len(self.prompt_ids) - 1 - start)
        if 0 <= lo < hi:
            self.prompt_lps += rows_logprobs(out.logits[lo:hi], self.prompt_ids[start + lo + 1:start + hi + 1],
                                             self.params.prompt_logprobs or 0)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, lo: int, hi: int) -> list[int]:
        """Tokens [lo, hi) of prompt + output, without building the whole list."""
        n = len(self.prompt_ids)
        if hi <= n:
            return self.prompt_ids[lo:hi]
        return self.prompt_ids[lo:] + self.output_ids[max(lo - n, 0):hi - n]

    def update_text(self, decode: Callable[[list[int]], str] | None) -> tuple[str, int | None]:
        """The output's text (as far as it decodes to whole characters; ``decode``: token ids to text, None without a
        tokenizer) and where a stop string starts in it, if one does. Incremental, as serving engines detokenize: the
        tokens since the last piece are decoded together with that piece's tokens (so a tokenizer that treats a
        sequence's first token apart, or merges bytes across tokens, sees their context) and the text past that
        piece's is appended, once it does not end inside a character (U+FFFD). Decoding the whole output every token
        cost ~0.7 ms a token at 2000 tokens (sol-mini's tokenizer), more than a decode step of sol-mini; this costs
        the same at any length. A finished sequence's text is the whole output decoded at once (Scheduler._sample),
        as LLM.generate's is. ``token_start``: where the last token's text starts (past the U+FFFD of tokens held
        back before it that it did not complete: the character itself, or a byte no character takes)."""
        ids, first = self.output_ids, self.prompt_ids[-CONTEXT_TOKENS:]  # (the first piece reads after the prompt)
        self.token_start = len(self.text)
        if decode is not None and len(ids) > self.text_upto:
            after = first if self.text_from == 0 else ()
            done = decode(ids[self.text_from:self.text_upto], after=after) if self.text_upto > self.text_from else ""
            now = decode(ids[self.text_from:], after=after)
            if len(now) > len(done) and not now.endswith("\ufffd"):
                if now.startswith(done) and self.text_upto < len(ids) - 1:  # (tokens held back before this one)
                    held = decode(ids[self.text_from:-1], after=after)
                    self.token_start += max(0, len(os.path.commonprefix([held, now])) - len(done))
                # (a tokenizer whose pieces do not add up: the whole output, decoded again)
                self.text = self.text + now[len(done):] if now.startswith(done) else decode(ids, after=first)
                self.text_from, self.text_upto = self.text_upto, len(ids)
        if len(ids) < self.params.min_tokens:  # (a stop string in the text so far never ends it, as in vLLM)
            self.stop_after = len(self.text)
            return self.text, None
        return self.text, stop_cut(self.text, self.params.stop, self.stop_after)

    @property
    def remaining(self) -> int:
        """Tokens still to feed through the model before the next token can be sampled."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed

    @property
    def redo_left(self) -> int:
        """Of ``remaining``, those to prefill: all of a prompt, all but the last token of a sequence recomputed after
        a preemption (that token then decodes, with drafts, as it would have without the preemption: a seeded
        sampled request's generator is consumed the same way). A prompt's last token left alone by a chunk the step's
        budget cut decodes plainly: the scheduler drafts only after an output token, so where the other requests
        make the cut changes nothing."""
        return max(0, self.remaining - (1 if self.output_ids else 0))


def stop_cut(text: str, stops: list[str], after: int = 0) -> int | None:
    """Where the first stop string starts in ``text``, counting only those that end past ``after`` characters (the
    text of the first min_tokens - 1 tokens, where a stop string does not end the output), or None."""
    hits = [i for s in stops if s and (i := text.find(s, max(0, after - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def check_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  tokenizer: Any = True) -> None:
    """Raise RequestError for a request that can never run (the server turns it into HTTP 400); ``tokenizer``: the
    model's (None: it has none)."""
    params.validate()
    if params.stop and tokenizer is None:  # (no text to find them in)
        raise RequestError("stop strings need the model's tokenizer (tokenizer.json); stop on token ids with "
                           "stop_token_ids")
    if not prompt_ids:
        raise RequestError("empty prompt: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"stop_token_ids out of range [0, {vocab_size}): {str(bad[:5])[:80]}")
    bad = [t for t in params.logit_bias if t >= vocab_size]
    if bad:
        raise RequestError(f"logit_bias token ids out of range [0, {vocab_size}): {str(bad[:5])[:80]}")
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise RequestError(f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceeds the "
                           f"context of {max_model_len} tokens; shorten the prompt or lower max_tokens")
    if params.structured is not None:
        from waferline.engine.structured import grammar_of

        grammar_of(params)  # (a schema, expression or grammar llguidance cannot use)


def request_generator(params: SamplingParams) -> torch.Generator | None:
    """The sampler of one request: with a seed, the same stream ``LLM.generate([prompt], params)`` uses."""
    if params.temperature == 0:
        return None
    if params.seed is None:
        return make_generator(params)
    g = torch.Generator()
    g.manual_seed(int(params.seed) * 1_000_003)  # sampling.seeded_generator(params, row=0)
    return g


@dataclass
class StepPlan:
    """What one step runs (``Scheduler.schedule``): plain decode rows, prefill chunks (sequence, tokens), verify rows
    (sequence, its drafts), and how many greedy steps the decodes run back to back (1: one step)."""

    decodes: list[Sequence]
    prefills: list[tuple[Sequence, int]]
    verifies: list[tuple[Sequence, Proposal]] = field(default_factory=list)
    burst: int = 1


@dataclass
class StepResult:
    """What the runner gave for a plan (``Scheduler.execute``): per verify row its tokens (or its error); per decode
    row and prefill chunk its output; for a burst, per decode row its tokens."""

    verified: list[list[int] | Exception] = field(default_factory=list)
    decoded: list[RowOutput | None] = field(default_factory=list)
    prefilled: list[RowOutput | None] = field(default_factory=list)
    burst: list[list[int]] | None = None
    fed: int = 0  # tokens the verify forward fed
