"""The gated delta rule, the recurrence under Gated DeltaNet (Qwen3-Next) and Kimi Delta Attention (Kimi Linear).

Per head, with a state S [K, V], a query q and key k [K] (L2-normalised, q also scaled by 1/sqrt(K)), a value v [V],
a log-decay g (one per head for Gated DeltaNet, one per key channel for KDA; always <= 0) and a write strength beta:

    S <- diag(exp(g)) S                      (forget)
    delta = beta * (v - S^T k)               (what the state mispredicts for k)
    S <- S + k delta^T                       (correct it)
    o = S^T q

``delta_rule_steps`` runs it token by token (decode, and a speculative verify that records the state after each
token); ``delta_rule_chunked`` gives the same outputs and final state for a long prompt with a few matrix products
per chunk of ``chunk`` tokens. Within a chunk starting from S0, with G_t the cumulative log-decay up to token t:

    S_t = exp(G_t) S0 + sum_{s<=t} (exp(G_t - G_s) k_s) delta_s^T
    delta = (I + diag(beta) A)^-1 (beta v - beta (exp(G) k) S0),   A_ts = sum_c k_tc k_sc exp(G_tc - G_sc), s < t

a unit lower-triangular solve; then o = (exp(G) q) S0 + P delta with P_ts = sum_c q_tc k_sc exp(G_tc - G_sc), s <= t,
and the state at the chunk's end follows from the first line. Every exponent is <= 0 (no overflow). All arithmetic is
float32; the callers pass float32 tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_CHUNK = 64  # tokens per chunk of the chunked form (the reference implementations' size)


def delta_rule_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """One token: q, k [B, H, K], v [B, H, V], g [B, H, Kg] (Kg = 1 or K), beta [B, H]; ``state`` [B, H, K, V] is
    updated in place. Returns the output [B, H, V]."""
    state.mul_(g.exp().unsqueeze(-1))
    mem = torch.matmul(k.unsqueeze(-2), state).squeeze(-2)  # S^T k, [B, H, V]
    delta = (v - mem) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return torch.matmul(q.unsqueeze(-2), state).squeeze(-2)


def delta_rule_steps(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     record: bool = False) -> tuple[Tensor, Tensor | None]:
    """T tokens one after another (the decode recurrence): q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, Kg], beta
    [B, T, H]; ``state`` [B, H, K, V] updated in place. Returns the outputs [B, T, H, V] and, with ``record``, the
    state after each token [B, T, H, K, V] (what a speculative rollback keeps)."""
    outs, states = [], []
    for t in range(q.shape[1]):
        outs.append(delta_rule_step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t]))
        if record:
            states.append(state.clone())
    return torch.stack(outs, dim=1), (torch.stack(states, dim=1) if record else None)


def _pairwise(a: Tensor, b: Tensor, G: Tensor, inclusive: bool) -> Tensor:
    """[..., Q, Q] of sum_c a_tc b_sc exp(G_tc - G_sc) for s < t (s <= t when ``inclusive``), 0 elsewhere; a, b
    [..., Q, K], G [..., Q, Kg]."""
    Q = a.shape[-2]
    hidden = torch.ones(Q, Q, dtype=torch.bool, device=a.device).triu(0 if not inclusive else 1)
    diff = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(hidden.unsqueeze(-1), float("-inf"))  # [..., t, s, Kg]
    decay = diff.exp()
    if G.shape[-1] == 1:  # one decay per head: a plain product, decayed
        return torch.matmul(a, b.transpose(-1, -2)) * decay.squeeze(-1)
    return (a.unsqueeze(-2) * b.unsqueeze(-3) * decay).sum(-1)


def delta_rule_chunked(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       chunk: int = DEFAULT_CHUNK) -> Tensor:
    """``delta_rule_steps`` (without a record) for a long run of tokens, ``chunk`` at a time (see the module's
    docstring); ``state`` [B, H, K, V] is replaced in place by the final state. Returns the outputs [B, T, H, V]."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    pad = (-T) % chunk
    # [B, H, T, *], padded with tokens that change nothing (beta 0: no write; g 0: no decay)
    q, k, v, g = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta.transpose(1, 2), (0, pad))
    n = (T + pad) // chunk
    q, k, v, g = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(B, H, n, chunk, 1)
    G = g.cumsum(dim=-2)  # cumulative log-decay within each chunk
    eye = torch.eye(chunk, dtype=k.dtype, device=k.device)
    S = state.clone()
    out = torch.empty(B, H, n, chunk, V, dtype=v.dtype, device=v.device)
    for i in range(n):
        qi, ki, vi, Gi, bi = q[:, :, i], k[:, :, i], v[:, :, i], G[:, :, i], beta[:, :, i]
        L = bi * _pairwise(ki, ki, Gi, inclusive=False)  # strictly lower; the system is I + L
        rhs = torch.cat([bi * vi, bi * ki * Gi.exp()], dim=-1)
        sol = torch.linalg.solve_triangular(L + eye, rhs, upper=False, unitriangular=True)
        u, w = sol.split([V, K], dim=-1)
        delta = u - torch.matmul(w, S)  # [B, H, Q, V]
        P = _pairwise(qi, ki, Gi, inclusive=True)
        out[:, :, i] = torch.matmul(qi * Gi.exp(), S) + torch.matmul(P, delta)
        last = Gi[..., -1:, :]  # [B, H, 1, Kg]
        S = S * last.exp().transpose(-1, -2) + torch.matmul((ki * (last - Gi).exp()).transpose(-1, -2), delta)
    state.copy_(S)
    return out.reshape(B, H, n * chunk, V)[:, :, :T].transpose(1, 2)


def l2_normalize(x: Tensor, eps: float = 1e-6, divide: bool = False) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension: as ``x * rsqrt(...)`` (Qwen3-Next's form) or, with
    ``divide``, as a division by the square root (Kimi Linear's form); the two round differently."""
    ss = (x * x).sum(dim=-1, keepdim=True) + eps
    return x / torch.sqrt(ss) if divide else x * torch.rsqrt(ss)
