"""Exact speculative decoding: drafters (prompt-lookup n-grams, a draft model, MTP heads), the verifier, cache
rollback and adaptive K — for the scheduler (``serving.ServeSpeculation``: the server's and ``LLM(speculative=...)``
under every runner) and the caches of pipeline stages and AFD attention ranks (``SlotRollback``).

One decode step, for the rows still running: the drafter proposes up to K tokens per row; the target model
verifies ``[last token] + drafts`` in ONE forward (``StepBatch`` with T = K_max + 1 from each row's position); the
verifier accepts a prefix of the drafts and adds one token of its own (a correction or a bonus), so every step
emits between 1 and K + 1 tokens per row; the caches are rolled back to the accepted prefix.

Modules: ``verify`` (the verifier and why it is exact), ``rollback`` (the target's caches back to the accepted
prefix), ``drafters`` (n-gram, draft model, MTP; ``make_drafter``), ``adaptive`` (adaptive K), ``serving`` (the
scheduler's part), ``speculator`` (burst length). The names below
are the public ones; import them from here.
"""

from waferline.engine.speculative.adaptive import AdaptiveK, expected_tokens, reproducible_k
from waferline.engine.speculative.drafters import (
    Drafter,
    DraftModelDrafter,
    MTPDrafter,
    NgramDrafter,
    Proposal,
    make_drafter,
)
from waferline.engine.speculative.rollback import SlotRollback, VerifyRollback
from waferline.engine.speculative.speculator import burst_len
from waferline.engine.speculative.verify import residual, verify, verify_greedy, verify_rows, verify_sampled

__all__ = ["burst_len", "AdaptiveK", "expected_tokens", "reproducible_k", "Drafter",
           "Proposal", "NgramDrafter", "DraftModelDrafter", "MTPDrafter", "make_drafter", "VerifyRollback",
           "SlotRollback", "verify", "verify_greedy", "verify_sampled",
           "verify_rows", "residual"]
