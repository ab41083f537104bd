"""Speculative decoding inside the server's continuous-batching scheduler (engine/scheduler.py).

Rows are cache slots. Each step, every decoding sequence gets a number of drafts K (adaptive K over the greedy and
unseeded rows, the largest K for seeded sampled rows, whose tokens must not depend on timing or on the batch), capped
by what is left of its ``max_tokens`` and context. The drafter (n-gram lookup over the sequence's own prompt +
output, or the model's MTP head) proposes; sequences with drafts run one verify row of ``[last token] + drafts``
(``LocalRunner.verify``), the others a plain decode row. The verifier (verify.py) keeps each row's accepted prefix
with the request's own generator, the runner rolls the caches back to it (rollback.py's ``VerifyRollback``), and the
scheduler emits the tokens one by one, so a stop token, a stop string or ``max_tokens`` inside a burst ends it there.

A step in which no greedy sequence drafts (adaptive K chose k = 0, or no n-gram match) may run as plain steps in a
burst where the scheduler allows (``burst_steps``: 1, 2, 4, then ``GREEDY_BURST`` after such steps in a row), the
steps' hidden states handed to an MTP drafter: speculation that does not pay costs about what plain decoding does.

``LLM(speculative=...)`` speculates through the same class over its own scheduler. A draft model (``draft:PATH``, a
checkpoint sharing the target's tokenizer) drafts over its own caches in the scheduler's process, catching up on each
sequence's tokens as it proposes (so a prefix-cache hit or a preemption needs nothing of it); the scheduler's
CacheManager hands out their pages and counts them in the cache budget (``ServeSpeculation.draft``), as it does the
MTP head's cache.

A slot's drafter state (the n-gram index, the MTP head's cache and the target hidden states it still has to consume)
is released when a sequence leaves it (ends, is aborted or preempted) and reset when one is admitted to it — after a
preemption too: the recompute prefill gives the MTP head the hidden states again — so the prefix cache is off with an
MTP drafter (a prefix hit skips those hidden states).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from waferline.engine.runner import WANT_ARGMAX, WANT_LOGITS, VerifyRow
from waferline.engine.speculative.adaptive import AdaptiveK, reproducible_k
from waferline.engine.speculative.drafters import DraftModelDrafter, MTPDrafter, Proposal, make_drafter
from waferline.engine.speculative.rollback import _window
from waferline.engine.speculative.speculator import burst_len
from waferline.engine.speculative.verify import verify, verify_greedy
from waferline.errors import ConfigError, counted
from waferline.plan.plan import MAX_DRAFT_TOKENS

if TYPE_CHECKING:
    from waferline.engine.runner import LocalRunner, RowOutput
    from waferline.engine.scheduler import SchedulerConfig, Sequence

def check_serve_method(method: str, k: int) -> None:
    """Refuse a method or K the scheduler cannot speculate with, with the reason (before any checkpoint loads)."""
    from pathlib import Path

    if method.startswith("draft:"):
        path = Path(method[len("draft:"):])
        if not (path / "config.json").is_file():
            raise ConfigError(f"--speculative {method}: {path} is not a checkpoint directory (config.json + "
                              "*.safetensors of a model sharing the target's tokenizer)")
    elif not (method in ("ngram", "mtp") or method.startswith("ngram:")):
        raise ConfigError(f"--speculative {method}: unknown method; use 'ngram' (or 'ngram:MIN_N:MAX_N'), 'mtp' or "
                          "'draft:PATH' (a checkpoint sharing the target's tokenizer)")
    _check_k(k, "--num-speculative-tokens")


def _check_k(k: int, name: str = "num_speculative_tokens") -> None:
    """Drafts a step: at least 1, at most MAX_DRAFT_TOKENS (as the planner takes; a step of more is all verify, and
    10^12 had the engine allocate memory until the host ran out)."""
    if k < 1:
        raise ConfigError(f"{name} must be >= 1, got {k}")
    if k > MAX_DRAFT_TOKENS:
        raise ConfigError(f"{name} must be at most {MAX_DRAFT_TOKENS} (draft tokens verified per step), got {k:,}")


def check_speculative(path: Any, method: str | None, num_tokens: int, tokenizer: Any = None) -> None:
    """What ``ServeSpeculation`` would refuse for the checkpoint at ``path``, read from config files only, so that a
    pipeline or AFD engine refuses it before its processes start: K, the method, MTP layers for 'mtp', a draft
    model's directory, vocabulary and tokenizer (against ``tokenizer``, the target's where the caller has it loaded).
    Nothing to check without a method or a config.json (the engine then names the missing checkpoint)."""
    from pathlib import Path

    from waferline.engine.speculative.drafters import check_mtp
    from waferline.model.decoder import NAMING, Naming
    from waferline.model.hybrids import hf_source
    from waferline.model.load import open_weights
    from waferline.spec.configs import spec_from_pretrained

    if not method or not (Path(path) / "config.json").is_file():
        return
    _check_k(num_tokens)
    if method == "mtp":  # (MTP layers in the config whose weights the checkpoint lacks load as none: DecoderModel)
        spec = spec_from_pretrained(path)
        first = f"{NAMING.get(spec.model_type, Naming()).root}layers.{spec.num_layers}.eh_proj.weight"
        check_mtp(len(spec.mtp_layers) if hf_source(open_weights(Path(path)), spec.model_type).has(first) else 0, path,
                  spec.model_type)
    elif method.startswith("draft:") and len(method) > len("draft:"):
        draft = Path(method[len("draft:"):])
        if not draft.is_dir():
            raise ConfigError(f"model directory {draft} does not exist")
        n, vocab_size = spec_from_pretrained(draft).vocab_size, spec_from_pretrained(path).vocab_size
        if n != vocab_size:
            raise ConfigError(f"draft model {draft} has vocab_size {n} but the target has {vocab_size}; a draft model "
                              "must share the target's tokenizer")
        _check_same_tokens(Path(path), draft, tokenizer)
    else:
        make_drafter(method, None, torch.float32)  # (an n-gram drafter needs no model; anything else is refused)


def _check_same_tokens(target: Any, draft: Any, ours: Any = None) -> None:
    """Refuse a draft model whose tokenizer maps tokens to other ids than the target's (``ours``, where the caller
    has it loaded), where both ship one (sizes alike, its drafts would be another text's ids: output stays exact,
    but next to nothing is accepted)."""
    from waferline.model.load import load_tokenizer

    theirs, ours = load_tokenizer(draft), ours if ours is not None else load_tokenizer(target)
    if theirs is None or ours is None:
        return
    a, b = theirs.get_vocab(), ours.get_vocab()
    differ = sorted({t for t in a.keys() | b.keys() if a.get(t) != b.get(t)}, key=lambda t: (a.get(t, b.get(t)), t))
    if differ:
        t, n = differ[0], counted(len(differ), "token")
        raise ConfigError(f"draft model {draft} has another tokenizer than the target's ({n}"
                          f" with another id or none, e.g. {t!r}: id {a.get(t)} there, {b.get(t)} in the target's); a "
                          "draft model must share the target's tokenizer")


@dataclass
class ServeSpecStats:
    """What speculation did since the scheduler started (the scheduler's stats and /metrics report it)."""

    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    verify_rows: int = 0  # verify rows run (a sequence's verify in a step counts once)
    verify_steps: int = 0  # steps that ran a verify forward
    steps: int = 0  # decode steps (verify or plain forwards; a burst's steps each)
    plain_steps: int = 0  # of them, steps in which no sequence drafted
    row_steps: int = 0  # sequences' decode steps (a sequence in a step counts once)
    emitted: int = 0  # tokens those steps gave

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def since(self, before: ServeSpecStats) -> ServeSpecStats:
        """What was counted after ``before`` (a copy taken earlier: ``dataclasses.replace(stats)``)."""
        return ServeSpecStats(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})

    def generate_metrics(self) -> dict[str, float]:
        """What ``LLM.generate``'s outputs report (``spec_verify_steps`` there counts every decode step)."""
        return {"spec_acceptance_rate": self.acceptance,
                "spec_mean_accepted_length": self.emitted / self.row_steps if self.row_steps else 0.0,
                "spec_drafted": float(self.drafted), "spec_accepted": float(self.accepted),
                "spec_verify_steps": float(self.steps), "spec_plain_steps": float(self.plain_steps)}


class ServeSpeculation:
    """The scheduler's drafter, K controller and statistics over the runner's ``num_slots`` slots."""

    def __init__(self, model: Any, caches: list[Any], num_slots: int, method: str, num_tokens: int,
                 adaptive: bool = True, step_tokens: int | None = None,
                 cost_table: list[tuple[int, float]] | None = None):
        _check_k(num_tokens)
        w = _window(caches)
        self.k_max = min(num_tokens, w - 1) if w is not None else num_tokens  # a verify must not wrap a ring
        if step_tokens is not None:  # a verify row fits in one step's token budget
            self.k_max = max(0, min(self.k_max, step_tokens - 1))
        self.drafter: Any = make_drafter(method, model, model.dtype)
        self.uses_hidden = isinstance(self.drafter, MTPDrafter)
        draft_cost = 1.0 / max(model.spec.num_layers, 1) if self.uses_hidden else 0.0
        if isinstance(self.drafter, DraftModelDrafter):
            draft_cost = self.drafter.model.spec.num_layers / max(model.spec.num_layers, 1)
        # (cost_table: measured (tokens, seconds) of one forward, see AdaptiveK; None: learnt as steps run)
        self.ctl = AdaptiveK(self.k_max, adaptive, 24.0, cost_table, draft_cost, measure=True)
        self.model = model
        self.bind(num_slots)
        self.stats = ServeSpecStats()
        self.idle = 0  # steps (or bursts) in a row in which no sequence drafted

    @classmethod
    def for_runner(cls, runner: Any, config: SchedulerConfig) -> ServeSpeculation:
        """The speculation a scheduler's ``config`` (SchedulerConfig) asks for over ``runner``."""
        from waferline.engine.runner import LocalRunner

        prepare = getattr(runner, "prepare_speculation", None)  # (a runner over processes: its own parts)
        if prepare is None and not isinstance(runner, LocalRunner):
            raise ConfigError(f"speculative={config.speculative!r}: this runner cannot verify drafts; "
                              "serve without speculative")
        # (a LocalRunner's model is an LLM's, whose MTP head is in int4 where the target is: LLM.__init__, quantize_mtp)
        model, caches = prepare(config.speculative) if prepare else (runner.model, runner.caches)
        return cls(model, caches, runner.num_slots, config.speculative, config.num_speculative_tokens,
                   config.speculative_adaptive, config.max_num_batched_tokens)

    @property
    def draft(self) -> DraftModelDrafter | MTPDrafter | None:
        """The drafter when it has caches of its own (a draft model, ``draft:PATH``, or an MTP head, ``mtp``): they
        hold every sequence too, and the scheduler's CacheManager counts them in its budget (``cache_spec``)."""
        return self.drafter if isinstance(self.drafter, (DraftModelDrafter, MTPDrafter)) else None

    def bind(self, num_slots: int) -> None:
        """Drafter state for ``num_slots`` empty slots (a scheduler with that many slots starts using it)."""
        device = next(iter(self.model.parameters()), torch.zeros(0)).device
        empty = torch.zeros(0, self.model.spec.hidden_size, dtype=self.model.dtype, device=device)
        self.drafter.begin([[] for _ in range(num_slots)], [empty] * num_slots)

    def reset(self, slot: int) -> None:
        """A new sequence in ``slot``: forget the drafter's state and the acceptance estimate of the previous one."""
        reset = getattr(self.drafter, "reset", None)
        if reset is not None:
            reset([slot])
        self.ctl.alpha.pop(slot, None)
        self.ctl.since_draft.pop(slot, None)

    def burst_steps(self) -> int:
        """How many plain greedy steps to run back to back when a step drafts nothing: 1, 2, 4, then GREEDY_BURST
        after such steps in a row; a sequence whose drafts pay again waits at most one burst for its next draft."""
        return burst_len(self.idle)

    def counted(self, row_steps: int, steps: int, emitted: int, verified: bool) -> None:
        """``steps`` decode steps, ``row_steps`` sequences' steps in all, that gave ``emitted`` tokens to the outputs
        (``verified``: one ran a verify)."""
        st = self.stats
        st.steps += steps
        st.plain_steps += 0 if verified else steps
        st.row_steps += row_steps
        st.emitted += emitted
        self.idle = 0 if verified else self.idle + 1

    def prefilled(self, seq: Sequence, hidden: torch.Tensor | None) -> None:
        """Target hidden states [t, D] of a prefill chunk of ``seq``: the MTP head runs the pairs whose next token is
        known now, with the prefill (MTPDrafter.commit_known); none for a sequence that never drafts."""
        if self.uses_hidden and hidden is not None and not seq.params.needs_logits:
            self.drafter.pending[seq.slot] = torch.cat([self.drafter.pending[seq.slot], hidden])
            self.drafter.commit_known(seq.slot, seq.all_ids)

    def choose(self, decodes: list[Sequence], max_model_len: int, batch: int | None = None) -> dict[int, int]:
        """Drafts per decoding sequence (by slot) for this step, before the cache budget and the step's token budget
        cut them; ``batch``: the most rows the step takes, where fewer than ``decodes`` (AdaptiveK.choose)."""
        free = [s.slot for s in decodes if not reproducible_k(s.params)]
        ks = dict(zip(free, self.ctl.choose(free, *([batch] if batch and batch < len(free) else [])))) if free else {}
        out: dict[int, int] = {}
        for s in decodes:
            room = min(s.params.max_tokens - len(s.output_ids) - 1, max_model_len - len(s.prompt_ids)
                       - len(s.output_ids))
            out[s.slot] = max(0, min(ks.get(s.slot, self.k_max), room, self.k_max))
        return out

    def exact(self, seq: Sequence) -> bool:
        """``seq``'s tokens depend on the K of each of its steps (seeded sampling, which must repeat exactly)."""
        return reproducible_k(seq.params)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """The drafter's proposals for ``seqs`` (a sequence with K = 0 gets none; in a step where some sequence
        drafts, an MTP drafter consumes the hidden states of every sequence's latest tokens, and a draft model its
        tokens; in a step where none drafts, the drafter is not called and they wait for the next draft). A sequence
        whose rows need the logits never drafts: the drafter never sees it (its state would grow with every token)."""
        if not seqs:
            return []
        if not any(ks):
            return [Proposal([]) for _ in seqs]
        if any(s.params.needs_logits for s in seqs):
            mine = [i for i, s in enumerate(seqs) if not s.params.needs_logits]
            props = [Proposal([]) for _ in seqs]
            for i, p in zip(mine, self.propose([seqs[i] for i in mine], [ks[i] for i in mine])):
                props[i] = p
            return props
        t0 = time.perf_counter()
        # one call for the greedy rows, one per sampled row (a model drafter samples with the row's own parameters)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            groups.setdefault(0 if s.params.temperature == 0 else id(s), []).append(i)
        props: list[Proposal] = [Proposal([]) for _ in seqs]
        for idx in groups.values():
            got = self.drafter.propose([seqs[i].slot for i in idx], {seqs[i].slot: seqs[i].all_ids for i in idx},
                                       [ks[i] for i in idx], seqs[idx[0]].params,
                                       {seqs[i].slot: seqs[i].generator for i in idx})
            for i, p in zip(idx, got):
                props[i] = p
        self.ctl.record_draft(len(seqs), max(len(p.tokens) for p in props), time.perf_counter() - t0)
        return props

    def judge(self, seq: Sequence, prop: Proposal, out: RowOutput) -> list[int]:
        """The tokens a verify row emits (accepted drafts, then the target's own token) under ``seq``'s parameters
        and generator; records the acceptance."""
        if seq.params.temperature == 0:
            toks = verify_greedy(out.logits, prop.tokens, out.argmaxes)
        else:
            toks = verify(out.logits, prop.tokens, prop.probs, seq.params, seq.generator)
        n = len(prop.tokens)
        self.ctl.observe(seq.slot, n, len(toks) - 1)
        self.stats.drafted += n
        self.stats.accepted += len(toks) - 1
        self.stats.verify_rows += 1
        return toks

    def verify_step(self, runner: LocalRunner, items: list[tuple[Sequence, Proposal]], decodes: list[Any] = (),
                    prefills: list[Any] = ()) -> tuple[list[list[int] | Exception], int, Any]:
        """One verify forward of the sequences with drafts: each row's tokens verified with its own parameters and
        generator (an error there is that row's alone: the scheduler fails it), the caches rolled back to the
        accepted prefixes, the drafter told what was kept. Returns per row the tokens to emit (or the error), the
        tokens fed through the model, and — where the step's ``decodes`` / ``prefills`` were given (a runner that
        takes them with the verify: ``verify_with_step``) — their (decode outputs, prefill outputs), else None."""
        rows = self.verify_rows(items)
        t0 = time.perf_counter()
        rest = None
        if decodes or prefills:
            outs, *rest = runner.verify(rows, decodes, prefills)  # type: ignore[call-arg]
        else:
            outs = runner.verify(rows)
            self.record(len(rows), max(len(r.tokens) for r in rows), time.perf_counter() - t0)
        return (*self.judged(runner, items, outs), rest)

    @staticmethod
    def verify_rows(items: list[tuple[Sequence, Proposal]]) -> list[VerifyRow]:
        """The runner's verify rows of ``items``: each sequence's last token, then its drafts."""
        return [VerifyRow(s.slot, s.num_computed, s.tokens(s.num_computed, s.num_computed + 1) + p.tokens,
                          WANT_ARGMAX if s.params.temperature == 0 else WANT_LOGITS) for s, p in items]

    def judged(self, runner: Any, items: list[tuple[Sequence, Proposal]], outs: list[Any]
               ) -> tuple[list[list[int] | Exception], int]:
        """A verify forward's outputs ``outs`` judged (``verify_step``'s second half, also for a verify a pipeline
        answers later: engine/overlap.py): per row the tokens to emit (or its error), the caches told to keep the
        accepted prefixes (``runner.keep``), the drafter what was kept; and the tokens fed through the model."""
        emitted: list[list[int] | Exception] = []
        for (s, p), out in zip(items, outs):
            try:
                emitted.append(self.judge(s, p, out))
            except Exception as e:
                emitted.append(e)
        keep = [len(t) if isinstance(t, list) else 1 for t in emitted]
        runner.keep(keep)
        self.consumed([s.slot for s, _ in items], [k - 1 for k in keep],
                      torch.stack([o.hidden for o in outs]) if self.uses_hidden else None)
        self.stats.verify_steps += 1
        return emitted, sum(1 + len(p.tokens) for _, p in items)

    def after_step(self, decodes: list[Sequence], prefills: list[tuple[Sequence, int]], decoded: list[Any],
                   prefilled: list[Any]) -> None:
        """After a step's plain decode rows and prefill chunks: the drafter sees their hidden states (not those of a
        sequence that never drafts)."""
        rows = [(s, o) for s, o in zip(decodes, decoded) if not s.params.needs_logits]
        decodes = [s for s, _ in rows]
        hidden = [o.hidden for _, o in rows] if self.uses_hidden else []
        self.consumed([s.slot for s in decodes], [0] * len(decodes),
                      torch.stack(hidden) if hidden and all(h is not None for h in hidden) else None)
        for (s, _), out in zip(prefills, prefilled):
            self.prefilled(s, None if out is None else out.hidden)

    def consumed(self, slots: list[int], n_accepted: list[int], hidden: torch.Tensor | None) -> None:
        """After a verify (or plain decode) forward of ``slots``: hand the drafter the target's hidden states at the
        tokens it kept ([B, T, D]; a plain decode row: T = 1, nothing accepted)."""
        if slots:
            self.drafter.accepted(slots, None, n_accepted, n_accepted, hidden if self.uses_hidden else None)

    def burst_done(self, slots: list[int], steps: int, seconds: float, hidden: torch.Tensor | None) -> None:
        """After a greedy burst of ``steps`` plain decode steps of ``slots`` in ``seconds``: one step's time for
        adaptive K, the drafter handed the tokens kept, and the steps after the first counted towards each row's probe
        (due after ``probe_every`` steps, not calls)."""
        self.record(len(slots), 1, seconds / steps)
        self.consumed(slots, [steps - 1] * len(slots), hidden)
        self.ctl.stepped(slots, steps - 1)

    def record(self, rows: int, width: int, seconds: float) -> None:
        """A measured forward of ``rows`` rows x ``width`` tokens (adaptive K learns what a verify costs)."""
        self.ctl.record(rows, width, seconds)

    def metrics(self) -> dict[str, float]:
        st = self.stats
        return {"spec_drafted": float(st.drafted), "spec_accepted": float(st.accepted),
                "spec_acceptance_rate": st.acceptance, "spec_verify_rows": float(st.verify_rows),
                "spec_verify_steps": float(st.verify_steps)}
