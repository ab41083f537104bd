"""Continuous batching: a slot pool with page accounting of the cache per layer kind, chunked prefill,
admission and preemption (recompute), and a background engine loop that streams tokens per request.

How memory is managed
---------------------
The model's caches are the per-layer objects the engine already has (``DecoderModel.new_caches(max_num_seqs)``):
``TokenCache`` rows for GQA / MLA / sliding-window layers and ``Mamba2Cache`` state for Mamba-2 layers, indexed
by *slot*. A running sequence owns one slot (that is its SSM state slot) and a number of *pages* of token
capacity in every pool of token-cache layers:

=========  ==========================================  ===============================================
pool       layers                                      pages a sequence of n tokens holds
=========  ==========================================  ===============================================
``gqa``    full-attention GQA (K and V)                ceil(n / page_tokens)
``swa``    sliding-window GQA (one pool per window)    ceil(min(n, window) / page_tokens)
``mla``    MLA (normalised latent c_KV + rotary key)    ceil(n / page_tokens)
``mamba2`` Mamba-2 (conv + SSM state)                  1 state slot, whatever n
=========  ==========================================  ===============================================

The bytes of a page and of a state slot, and the tokens a layer keeps (``cached_tokens``), come from the
``ModelSpec`` accounting (``LayerSpec.cache_bytes_per_token``, ``mixer.state_bytes_per_seq``,
``mixer.cached_tokens``) — the same numbers the planner and simulator use. All pools draw on one byte budget
(``cache_bytes``, default: ``max_num_seqs`` sequences of ``max_model_len`` tokens, so nothing is ever
preempted); with page-aligned lengths, the bytes a sequence holds equal ``ModelSpec.cache_bytes_per_seq``.

The pages are an accounting of capacity, enforced by admission and preemption; the tensors themselves stay
slot-contiguous (``TokenCache`` rows), so physical memory is ``max_num_seqs`` x the longest live sequence.
A block-table layout of the tensors (and with it a copy-free prefix cache) is future work.

Scheduling, one step
--------------------
1. Every running sequence that is decoding gets its next token's page (oldest first). When the budget is
   exhausted, the newest running sequence is **preempted by recompute**: its pages and slot are freed and it
   goes back to the front of the waiting queue with its prompt *and the tokens generated so far*; when it is
   re-admitted, those are prefilled again (chunked) and decoding continues where it stopped — same sampler
   state, so the tokens it streams are unchanged and no token is sent twice.
2. Sequences still prefilling get chunks of up to ``chunk_tokens`` within the step's token budget
   (``max_num_batched_tokens``), so a long prompt never stalls the decodes of others for more than one chunk.
3. Waiting sequences are admitted in arrival order while a slot is free and the budget holds their current
   length + 1 token (no skipping ahead: FIFO fairness).

All decodes run as one batched forward call ([B, 1]); prefill chunks of equal length run together ([B, t]). A
sequence's tokens depend only on its own prompt, parameters and seeded sampler, never on what else is in the
batch (up to floating-point reassociation in batched matmuls).

Prefix caching (attention-only models whose layers all keep every token: GQA and MLA without a sliding
window) keeps full pages of finished sequences in a store keyed by the exact token chain (a page is reused
only when it *and every page before it* match). A new sequence whose prompt starts with stored pages gets them
copied into its slot and prefills only the rest; at least one prompt token is always computed (for the
logits). Stored pages count against the same byte budget and are evicted least-recently-used (with the pages
that extend them) whenever a live sequence needs the room — they never cause a preemption. Models with
Mamba-2 or sliding-window layers do not cache prefixes (their state is not a per-token prefix).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from waferline.engine.sampling import SamplingParams, make_generator, sample
from waferline.errors import ConfigError, RequestError, WaferlineError
from waferline.model.attention import TokenCache
from waferline.model.context import StepBatch
from waferline.spec.model import ModelSpec

if TYPE_CHECKING:
    from waferline.engine.llm import LLM

log = logging.getLogger("waferline.engine")


class QueueFullError(WaferlineError):
    """The server's waiting queue is full (HTTP 429): retry later, or raise --max-queue / --max-num-seqs."""


# ----------------------------------------------------------------------------- cache accounting


@dataclass(frozen=True)
class CachePool:
    """Cache layers of one kind that grow together: every sequence holds the same pages in each of them."""

    kind: str  # "gqa" | "swa" | "mla" | "mamba2"
    layers: tuple[int, ...]
    window: int | None
    page_bytes: float  # one page (page_tokens tokens) across all layers of the pool; mamba2: one sequence's state
    per_seq: bool  # True: a constant-size state per sequence (Mamba-2), not token pages


def _pools(spec: ModelSpec, page_tokens: int, kv_bits: int, state_bits: int) -> list[CachePool]:
    groups: dict[tuple[str, int | None], list[int]] = {}
    for layer in spec.layers:
        m = layer.mixer
        if m is None:
            continue
        if m.state_bytes_per_seq(state_bits) > 0 and m.cache_bytes_per_token(kv_bits) == 0:
            key: tuple[str, int | None] = (m.kind, None)
        elif m.cache_bytes_per_token(kv_bits) > 0:
            window = getattr(m, "sliding_window", None)
            key = ("swa" if window else m.kind, window)
        else:
            continue
        groups.setdefault(key, []).append(layer.index)
    pools = []
    for (kind, window), idx in groups.items():
        layers = [spec.layers[i] for i in idx]
        if any(l.mixer.cache_bytes_per_token(kv_bits) > 0 for l in layers):
            page = page_tokens * sum(l.cache_bytes_per_token(kv_bits) for l in layers)
            pools.append(CachePool(kind, tuple(idx), window, page, False))
        else:
            state = sum(l.mixer.state_bytes_per_seq(state_bits) for l in layers)
            pools.append(CachePool(kind, tuple(idx), None, state, True))
    return pools


class CacheManager:
    """Slots and pages: who holds how much of the cache budget. Touched only by the engine thread."""

    def __init__(self, spec: ModelSpec, max_num_seqs: int, max_model_len: int, page_tokens: int = 16,
                 cache_bytes: float | None = None, kv_bits: int = 16, state_bits: int = 16):
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if page_tokens < 1:
            raise ConfigError(f"page size must be >= 1 token, got {page_tokens}")
        self.spec = spec
        self.page_tokens = page_tokens
        self.max_num_seqs = max_num_seqs
        self.kv_bits, self.state_bits = kv_bits, state_bits
        self.pools = _pools(spec, page_tokens, kv_bits, state_bits)
        self.max_seq_bytes = self.bytes_for(max_model_len)
        self.budget = float(cache_bytes) if cache_bytes is not None else max_num_seqs * self.max_seq_bytes
        if self.budget < self.max_seq_bytes:
            raise ConfigError(
                f"cache budget of {self.budget / 2**20:.2f} MiB cannot hold one sequence of max_model_len="
                f"{max_model_len} tokens ({self.max_seq_bytes / 2**20:.2f} MiB); raise the cache budget "
                "or lower --max-model-len"
            )
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._held: dict[str, tuple[int, list[int]]] = {}  # request id -> (slot, pages per pool)
        self.used_bytes = 0.0  # held by live sequences
        self.prefix_bytes = 0.0  # held by the prefix store (evictable)
        self.reclaim: Callable[[float], None] | None = None  # evict prefix pages until this many bytes are free

    # -- accounting (pure)
    def pages_for(self, n_tokens: int) -> list[int]:
        """Pages (or state slots) per pool for a sequence of ``n_tokens`` cached tokens."""
        out = []
        for p in self.pools:
            if p.per_seq:
                out.append(1)
            else:
                cached = self.spec.layers[p.layers[0]].mixer.cached_tokens(n_tokens)
                out.append(math.ceil(cached / self.page_tokens))
        return out

    def _bytes(self, pages: list[int]) -> float:
        return sum(n * p.page_bytes for n, p in zip(pages, self.pools))

    def bytes_for(self, n_tokens: int) -> float:
        return self._bytes(self.pages_for(n_tokens))

    # -- state
    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def holds(self, rid: str) -> bool:
        return rid in self._held

    @property
    def page_bytes(self) -> float:
        """One page of every token pool together (what a prefix-store page costs)."""
        return sum(p.page_bytes for p in self.pools if not p.per_seq)

    def _room(self, extra: float) -> bool:
        if self.used_bytes + self.prefix_bytes + extra <= self.budget + 1e-6:
            return True
        if self.reclaim is not None and self.prefix_bytes > 0:
            self.reclaim(self.used_bytes + self.prefix_bytes + extra - self.budget)
        return self.used_bytes + self.prefix_bytes + extra <= self.budget + 1e-6

    def can_admit(self, n_tokens: int) -> bool:
        return bool(self._free_slots) and self._room(self.bytes_for(n_tokens))

    def admit(self, rid: str) -> int:
        """Give ``rid`` a slot (and its state slots); token pages come with ``grow``."""
        slot = self._free_slots.pop()
        pages = [1 if p.per_seq else 0 for p in self.pools]
        self._held[rid] = (slot, pages)
        self.used_bytes += self._bytes(pages)
        return slot

    def grow(self, rid: str, n_tokens: int) -> bool:
        """Hold enough pages for ``n_tokens``; False (holding what it held) when the budget does not allow it."""
        slot, held = self._held[rid]
        want = [max(a, b) for a, b in zip(held, self.pages_for(n_tokens))]
        extra = self._bytes(want) - self._bytes(held)
        if extra > 0 and not self._room(extra):
            return False
        self._held[rid] = (slot, want)
        self.used_bytes += extra
        return True

    def free(self, rid: str) -> None:
        slot, held = self._held.pop(rid)
        self.used_bytes -= self._bytes(held)
        if not self._held:
            self.used_bytes = 0.0  # no drift from float sums
        self._free_slots.append(slot)

    def pages_in_use(self) -> dict[str, int]:
        """Pages held per pool kind (state slots for Mamba-2)."""
        out: dict[str, int] = {}
        for _, held in list(self._held.values()):
            for n, p in zip(held, self.pools):
                out[p.kind] = out.get(p.kind, 0) + n
        for p in self.pools:
            out.setdefault(p.kind, 0)
        return out


class PrefixCache:
    """Full pages of finished sequences, reusable by any later sequence whose tokens start the same way.

    A page is keyed by (the page before it, its tokens), so a hit is always an exact match of the whole prefix.
    Its rows (one [page_tokens, width] tensor per layer) are copies; their bytes are ``CacheManager.prefix_bytes``.
    """

    def __init__(self, manager: CacheManager):
        self.cm = manager
        self.P = manager.page_tokens
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._blocks: dict[int, tuple[tuple[int, tuple[int, ...]], list[torch.Tensor | None], set[int]]] = {}
        self._used: dict[int, int] = {}  # block id -> last use (a tick; larger is more recent)
        self._tick = 0
        self._next = 0
        self.hit_tokens = 0
        self.evicted_pages = 0
        manager.reclaim = self.evict

    @staticmethod
    def eligible(caches: list[Any]) -> bool:
        """Every cache keeps every token (no sliding window, no recurrent state)."""
        return all(c is None or (isinstance(c, TokenCache) and c.window is None) for c in caches) and any(
            c is not None for c in caches)

    @property
    def num_pages(self) -> int:
        return len(self._blocks)

    def match(self, ids: list[int]) -> list[int]:
        """Stored pages that start ``ids``, leaving at least one token to compute."""
        out: list[int] = []
        parent = -1
        for i in range((len(ids) - 1) // self.P):
            b = self._by_key.get((parent, tuple(ids[i * self.P:(i + 1) * self.P])))
            if b is None:
                break
            out.append(b)
            parent = b
        self._touch(out)
        return out

    def load(self, blocks: list[int], slot: int, caches: list[Any]) -> None:
        """Copy stored pages into ``slot`` at positions [0, len(blocks) * page_tokens)."""
        batch = StepBatch.make([slot], [0], len(blocks) * self.P)
        for layer, c in enumerate(caches):
            if c is not None:
                c.update(torch.cat([self._blocks[b][1][layer] for b in blocks])[None], batch)
        self.hit_tokens += len(blocks) * self.P

    def store(self, ids: list[int], n_computed: int, slot: int, caches: list[Any]) -> None:
        """Keep the full pages of a sequence's first ``n_computed`` tokens (its rows in ``slot``)."""
        parent, chain = -1, []
        for i in range(n_computed // self.P):
            key = (parent, tuple(ids[i * self.P:(i + 1) * self.P]))
            b = self._by_key.get(key)
            if b is None:
                self._touch(chain)
                if not self.cm._room(self.cm.page_bytes) or (chain and chain[-1] not in self._blocks):
                    return
                lo, hi = i * self.P, (i + 1) * self.P
                rows = [None if c is None else c.data[slot, lo:hi].clone() for c in caches]
                b = self._next
                self._next += 1
                self._blocks[b] = (key, rows, set())
                self._by_key[key] = b
                if parent >= 0:
                    self._blocks[parent][2].add(b)
                self.cm.prefix_bytes += self.cm.page_bytes
            chain.append(b)
            parent = b
        self._touch(chain)

    def _touch(self, blocks: list[int]) -> None:
        self._tick += 1
        for b in blocks:
            self._used[b] = self._tick

    def evict(self, need: float) -> None:
        """Drop least-recently-used pages (and the pages that extend them) until ``need`` bytes are freed."""
        freed = 0.0
        for b in sorted(self._used, key=self._used.__getitem__):
            if freed >= need:
                break
            if b in self._blocks:
                freed += self._drop(b)
        if not self._blocks:
            self.cm.prefix_bytes = 0.0

    def _drop(self, b: int) -> float:
        key, _, children = self._blocks.pop(b)
        self._by_key.pop(key, None)
        self._used.pop(b, None)
        parent = key[0]
        if parent in self._blocks:
            self._blocks[parent][2].discard(b)
        self.cm.prefix_bytes -= self.cm.page_bytes
        self.evicted_pages += 1
        return self.cm.page_bytes + sum(self._drop(c) for c in list(children) if c in self._blocks)


# ----------------------------------------------------------------------------- requests


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


@dataclass
class Sequence:
    """One request inside the scheduler."""

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
    sent_chars: int = 0
    text: str = ""  # the output's text so far, decoded incrementally (Scheduler._text)
    text_from: int = 0  # output_ids[text_from:text_upto] decode to text's last piece (the window the next starts from)
    text_upto: int = 0
    stop_ids: frozenset[int] | None = None  # the token ids that end it, gathered once (Scheduler.add)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, lo: int, hi: int) -> list[int]:
        """Tokens [lo, hi) of prompt + output, without building the whole list."""
        n = len(self.prompt_ids)
        if hi <= n:
            return self.prompt_ids[lo:hi]
        return self.prompt_ids[lo:] + self.output_ids[max(lo - n, 0):hi - n]

    @property
    def remaining(self) -> int:
        """Tokens still to feed through the model before the next token can be sampled."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed


def request_generator(params: SamplingParams) -> torch.Generator | None:
    """The sampler of one request: with a seed, the same stream ``LLM.generate([prompt], params)`` uses."""
    if params.temperature == 0:
        return None
    if params.seed is None:
        return make_generator(params)
    g = torch.Generator()
    g.manual_seed(int(params.seed) * 1_000_003)  # LLM._seeded(params, row=0)
    return g


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

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_tokens", "page_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


class Scheduler:
    """Continuous batching over one single-process ``LLM``. Not thread-safe: ``EngineLoop`` drives it."""

    def __init__(self, llm: LLM, config: SchedulerConfig | None = None):
        self.config = config = config or SchedulerConfig()
        config.validate()
        if getattr(llm, "model", None) is None:
            raise ConfigError(
                "serving runs the single-process engine; a pipeline LLM (stages=...) cannot be served yet"
            )
        if getattr(llm, "device", torch.device("cpu")).type != "cpu":
            raise ConfigError(f"the server's scheduler runs on CPU so far; load the LLM with device='cpu' "
                              f"(got {llm.device})")
        self.llm = llm
        self.model = llm.model
        self.spec: ModelSpec = llm.spec
        mml = config.max_model_len or llm.max_model_len
        if mml > self.spec.max_position_embeddings:
            raise ConfigError(f"max_model_len {mml} exceeds the model's max_position_embeddings "
                              f"{self.spec.max_position_embeddings}")
        self.max_model_len = mml
        bits = torch.finfo(self.model.dtype).bits
        self.cache = CacheManager(self.spec, config.max_num_seqs, mml, config.page_tokens, config.cache_bytes,
                                  kv_bits=bits, state_bits=bits)
        self.caches = self.model.new_caches(config.max_num_seqs)
        self.prefix = PrefixCache(self.cache) if config.prefix_caching and PrefixCache.eligible(self.caches) else None
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order (the newest is preempted first)
        self.stop_ids_default = set(llm.eos_token_ids)
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        self.stats = {"preemptions": 0, "steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "prefill_tokens": 0,
                      "request_errors": 0}

    # -- requests
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request that can never run (the server turns it into HTTP 400)."""
        params.validate()
        if not prompt_ids:
            raise RequestError("empty prompt: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {self.spec.vocab_size}): {bad[:5]}")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids out of range [0, {self.spec.vocab_size}): {str(bad[:5])[:80]}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceeds the "
                               f"context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens")

    def add(self, seq: Sequence) -> None:
        self.check_request(seq.prompt_ids, seq.params)
        if seq.generator is None:
            seq.generator = request_generator(seq.params)
        seq.stop_ids = self._stop_ids(seq.params)
        seq.status = "waiting"
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        for seq in list(self.running) + list(self.waiting):
            if seq.request_id == request_id:
                self._finish(seq, "abort")
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- one step
    @torch.inference_mode()
    def step(self) -> int:
        """Schedule and run one step; returns the number of tokens fed through the model."""
        decodes, prefills = self._schedule()
        fed = 0
        if decodes:
            toks = torch.tensor([s.tokens(s.num_computed, s.num_computed + 1) for s in decodes])
            batch = StepBatch.make([s.slot for s in decodes], [s.num_computed for s in decodes], 1)
            # (step_logits: with an int8, bf16 or fp32 head on this CPU's operators the embedding, the layers, the head
            # and the argmax run as one program, as the engine's decode steps do; greedy rows take its argmax)
            greedy_rows = [s.params.temperature == 0 for s in decodes]
            logits, _, top = self.model.step_logits(toks, self.caches, batch, argmax=any(greedy_rows))
            top = top[:, 0].tolist() if top is not None else None
            for b, s in enumerate(decodes):
                s.num_computed += 1
                self._sample_or_fail(s, logits[b, 0], top[b] if greedy_rows[b] else None)
            fed += len(decodes)
        groups: dict[int, list[Sequence]] = {}  # chunks of equal length run as one [B, t] call
        for s, t in prefills:
            if s.status == "running":
                groups.setdefault(t, []).append(s)
        for t, seqs in groups.items():
            chunk = torch.tensor([s.tokens(s.num_computed, s.num_computed + t) for s in seqs])
            h = self.model(
                chunk, self.caches, StepBatch.make([s.slot for s in seqs], [s.num_computed for s in seqs], t)
            )
            for b, s in enumerate(seqs):
                s.num_computed += t
                self.stats["prefill_tokens"] += t
                fed += t
                if s.remaining == 0:
                    self._sample_or_fail(s, self.model.logits(h[b, -1]))
        self.stats["steps"] += 1
        return fed

    def _schedule(self) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        decodes: list[Sequence] = []
        prefills: list[tuple[Sequence, int]] = []
        preempted = False
        # decodes first (one token each, oldest first), then prefill chunks
        order = [s for s in self.running if s.remaining == 1] + [s for s in self.running if s.remaining > 1]
        for s in order:
            if s.status != "running" or budget <= 0:
                continue
            t = 1 if s.remaining == 1 else min(s.remaining, cfg.chunk_tokens, budget)
            while not self.cache.grow(s.request_id, s.num_computed + t):
                victim = next((v for v in reversed(self.running) if v is not s), None)
                if victim is None:  # cannot happen: the budget holds one max_model_len sequence
                    raise RuntimeError("cache budget exhausted by a single sequence")
                self._preempt(victim)
                preempted = True
                if victim in decodes:
                    decodes.remove(victim)
                prefills = [(v, n) for v, n in prefills if v is not victim]
            if s.remaining == 1:
                decodes.append(s)
            else:
                prefills.append((s, t))
            budget -= t
        while self.waiting and budget > 0 and not preempted:
            s = self.waiting[0]
            if not self.cache.can_admit(len(s.all_ids) + 1):
                break
            self.waiting.popleft()
            s.slot = self.cache.admit(s.request_id)
            slots = torch.tensor([s.slot])
            for c in self.caches:  # a fresh sequence in this slot: clear ring positions / SSM state
                if c is not None:
                    c.reset(slots)
            s.status, s.num_computed = "running", 0
            self.running.append(s)
            if self.prefix is not None:
                hit = self.prefix.match(s.all_ids)
                if hit and self.cache.grow(s.request_id, len(hit) * self.cache.page_tokens):
                    self.prefix.load(hit, s.slot, self.caches)
                    s.num_computed = len(hit) * self.cache.page_tokens
            t = min(s.remaining, cfg.chunk_tokens, budget)
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
    def _sample_or_fail(self, seq: Sequence, logits: torch.Tensor, greedy: int | None = None) -> None:
        """``_sample``, where an error (from this sequence's parameters, its sampler or its text) ends only this
        sequence, with finish reason "error": the batch's forward pass is shared, but what each row does with its
        logits is its own."""
        try:
            self._sample(seq, logits, greedy)
        except Exception as e:
            self.stats["request_errors"] += 1
            # the client gets one line; the log keeps the traceback (a fault here may be a bug, not the request)
            log.warning("request %s failed while sampling", seq.request_id, exc_info=not isinstance(e, WaferlineError))
            self._finish(seq, "error", f"request failed: {type(e).__name__}: {e}")

    def _sample(self, seq: Sequence, logits: torch.Tensor, greedy: int | None = None) -> None:
        """Emit seq's next token: ``greedy`` where the step already took the argmax of ``logits``, else sampled."""
        p = seq.params
        tok = sample(logits, p, seq.generator) if greedy is None else greedy
        now = time.perf_counter()
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.stats["prompt_tokens"] += len(seq.prompt_ids)
        seq.last_token_at = now
        seq.output_ids.append(tok)
        self.stats["generated_tokens"] += 1
        # (a request can list many stop ids: the set is built once per request, not at every token of every row)
        stop_ids = seq.stop_ids if seq.stop_ids is not None else self._stop_ids(p)
        reason = None
        text, cut = self._text(seq)
        if tok in stop_ids:
            reason = "stop"
        elif cut is not None:
            reason, text = "stop", text[:cut]
        elif len(seq.output_ids) >= p.max_tokens:
            reason, text = "length", self._decode(seq.output_ids)  # (all of it: an incomplete last character too)
        if reason is None:
            hold = max((len(s) for s in p.stop), default=1) - 1
            end = len(text) - hold
            while end > seq.sent_chars and text[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence: wait
                end -= 1
            delta = text[seq.sent_chars:end] if end > seq.sent_chars else ""
        else:
            if tok in stop_ids:  # the stop token's own text (e.g. "</s>") is not part of the output
                text = self._decode(seq.output_ids[:-1])
            delta = text[seq.sent_chars:]
        seq.sent_chars += len(delta)
        self._emit(seq, Event(tok, delta, completion_tokens=len(seq.output_ids), prompt_tokens=len(seq.prompt_ids)))
        if reason is not None:
            self._finish(seq, reason)

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.stop_ids_default)

    def _decode(self, ids: list[int]) -> str:
        if self.llm.tokenizer is None:
            return ""
        with self.tokenizer_lock:
            return self.llm.decode(ids)

    def _text(self, seq: Sequence) -> tuple[str, int | None]:
        """seq's output text (as far as it decodes to whole characters) and where a stop string starts in it, if one
        does. Incremental, as serving engines detokenize: the tokens since the last piece are decoded together with
        that piece's tokens (so a tokenizer that treats a sequence's first token apart, or merges bytes across tokens,
        sees their context) and the text past that piece's is appended, once it does not end inside a character
        (U+FFFD). Decoding the whole output every token cost ~0.7 ms a token at 2000 tokens (sol-mini's tokenizer),
        more than a decode step of sol-mini; this costs the same at any length. A finished sequence's text is the whole
        output decoded at once (_sample), as LLM.generate's is."""
        ids = seq.output_ids
        if self.llm.tokenizer is not None and len(ids) > seq.text_upto:
            done = self._decode(ids[seq.text_from:seq.text_upto]) if seq.text_upto > seq.text_from else ""
            now = self._decode(ids[seq.text_from:])
            if len(now) > len(done) and not now.endswith("\ufffd"):
                # (a tokenizer whose pieces do not add up: the whole output, decoded again)
                seq.text = seq.text + now[len(done):] if now.startswith(done) else self._decode(ids)
                seq.text_from, seq.text_upto = seq.text_upto, len(ids)
        text = seq.text
        if not seq.params.stop:
            return text, None
        hits = [text.find(s) for s in seq.params.stop if s and s in text]
        return text, (min(hits) if hits else None)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.status == "finished":
            return
        if self.cache.holds(seq.request_id):
            self.cache.free(seq.request_id)
            if self.prefix is not None and reason != "error":  # the slot's rows stay valid until it is reused
                self.prefix.store(seq.all_ids, seq.num_computed, seq.slot, self.caches)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = "finished", reason
        self._emit(seq, Event(None, "", True, reason, len(seq.prompt_ids), len(seq.output_ids), error))

    def fail_all(self, error: str) -> None:
        for seq in list(self.running) + list(self.waiting):
            self._finish(seq, "error", error)

    @staticmethod
    def _emit(seq: Sequence, ev: Event) -> None:
        if seq.sink is not None:
            seq.sink(ev)


# ----------------------------------------------------------------------------- the background loop


class EngineLoop:
    """Runs a Scheduler in a background thread. ``submit``/``abort`` are thread-safe; events reach each
    request's ``sink`` from the engine thread (the server forwards them into its event loop)."""

    def __init__(self, scheduler: Scheduler, torch_threads: int | None = None):
        self.scheduler = scheduler
        self.torch_threads = torch_threads
        self._lock = threading.Condition()
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._stop = False
        self._paused = False
        self._thread = threading.Thread(target=self._run, name="waferline-engine", daemon=True)
        self.last_error: str | None = None

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def pause(self) -> None:
        """Stop stepping (requests still queue up): for maintenance and for tests of the queue bound."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    # -- thread-safe API
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[Event], None],
               request_id: str | None = None) -> str:
        """Queue a request; raises RequestError (never runnable) or QueueFullError (try again later)."""
        seq = Sequence(request_id or uuid.uuid4().hex, list(prompt_ids), params, sink)
        self.scheduler.check_request(seq.prompt_ids, params)
        seq.generator = request_generator(params)
        with self._lock:
            if self.num_waiting >= self.scheduler.config.max_queue:
                raise QueueFullError(
                    f"the server's queue is full ({self.scheduler.config.max_queue} waiting requests); retry later"
                )
            self._inbox.append(seq)
            self._lock.notify_all()
        return seq.request_id

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify_all()

    # -- the thread
    def _run(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        sch = self.scheduler
        while True:
            with self._lock:
                while not self._stop and (self._paused or not (self._inbox or self._aborts or sch.has_work())):
                    self._lock.wait(0.5)
                if self._stop:
                    break
                incoming = list(self._inbox)
                self._inbox.clear()
                aborts = list(self._aborts)
                self._aborts.clear()
            for seq in incoming:
                try:
                    sch.add(seq)
                except Exception as e:  # this request cannot run; the others are untouched
                    if not isinstance(e, WaferlineError):
                        log.warning("request %s could not be admitted", seq.request_id, exc_info=True)
                    seq.status = "finished"
                    msg = str(e) if isinstance(e, WaferlineError) else f"request failed: {type(e).__name__}: {e}"
                    Scheduler._emit(seq, Event(None, "", True, "error", len(seq.prompt_ids), 0, msg))
            for rid in aborts:
                if not sch.abort(rid):  # not queued yet (still in the inbox of a later wakeup) or already done
                    pass
            if not sch.has_work():
                continue
            try:
                sch.step()
            except Exception as e:  # a bug or an out-of-memory: fail what is in flight, keep serving
                self.last_error = f"{type(e).__name__}: {e}"
                sch.fail_all(f"engine error: {self.last_error}")
                sch.caches = sch.model.new_caches(sch.config.max_num_seqs)
                if sch.prefix is not None:
                    sch.prefix.evict(float("inf"))
        sch.fail_all("server shutting down")
