"""The verifier of exact speculative decoding: which drafts a row keeps and which token it adds.

Greedy (T = 0): a draft is accepted while it equals the argmax of the target's logits at its position, and the extra
token is that argmax — the output is the non-speculative greedy output, token for token.
Sampled: draft x ~ q is accepted with probability min(1, p(x) / q(x)); on rejection the token is drawn from the
normalised residual max(0, p − q); after K acceptances a bonus token is drawn from p. p and q both come from
``target_probs`` (temperature, top-k, min-p, top-p), and the n-gram drafter's q is one-hot. The emitted tokens then
follow exactly the distribution the non-speculative sampler draws from (Leviathan et al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

import torch

from waferline.engine.sampling import SamplingParams, draw, greedy, target_probs


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
            out.append(draw(r, gen))
            return out
    out.append(draw(p[len(draft)], gen))
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
