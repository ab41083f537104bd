"""The single-process engine's speculative decode loop (``Speculator``): draft, verify in one forward, roll back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from waferline.engine import sampling
from waferline.engine.sampling import SamplingParams, decode_metrics, seeded_generator
from waferline.engine.speculative.adaptive import AdaptiveK, reproducible_k
from waferline.engine.speculative.drafters import DraftModelDrafter, MTPDrafter, Proposal, make_drafter
from waferline.engine.speculative.rollback import VerifyRollback, _window
from waferline.engine.speculative.verify import verify_rows
from waferline.errors import ConfigError
from waferline.model.context import StepBatch

if TYPE_CHECKING:
    from waferline.engine.llm import LLM


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
    return max(1, min(sampling.GREEDY_BURST, 1 << idle))


class Speculator:
    """Speculative decoding for ``LLM``: ``LLM(path, speculative="ngram" | "mtp" | "draft:PATH",
    num_speculative_tokens=K)``."""

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
            self.ctl = AdaptiveK(
                self.k_max, self.adaptive, self.overhead, self.cost_table, self.draft_cost, measure=True
            )
        self.ctl.alpha = {}
        return self.ctl

    def stream(self, llm: LLM, ids: list[list[int]], params: SamplingParams) -> Iterator[Any]:
        from waferline.engine.sampling import make_generator, sample

        model = self.model
        B = len(ids)
        ctl = self.controller(params)
        stats = SpecStats()
        with torch.inference_mode():
            caches = model.new_caches(B)
            gens = [make_generator(params) if params.seed is None else seeded_generator(params, i) for i in range(B)]
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
