"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): MLA whose queries each attend to the top-k cached tokens only.

A lightning indexer scores every cached token for every query: with its own queries (``wq_b`` on the MLA query
LoRA latent, ``index_n_heads`` heads of ``index_head_dim``) and one key per token (``wk`` on the hidden state, then a
LayerNorm), both rotated on their first ``qk_rope_head_dim`` channels in the half-split RoPE layout (the MLA core
rotates interleaved pairs),

    score(t, s) = sum_h w_h(t) * relu(q_h(t) . k(s) / sqrt(index_head_dim)),   w(t) = weights_proj(x_t) / sqrt(heads)

and the MLA core attends to the ``index_topk`` best-scored tokens a query may see (all of them when it sees fewer).
Per token the cache holds the MLA latent and rotary key (as MLA) plus the indexer key, stored at the spec's
``index_bits``: 8 is fp8 (e4m3) with one fp32 scale per key, as DeepSeek's inference code keeps them; 16 and 32 are
bf16 and fp32. Decode reads every indexer key and then only the selected latents.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from waferline.errors import ConfigError
from waferline.model.attention import MLA_FUSED_MAX_ROWS, MLAttention, TokenCache
from waferline.model.context import StepBatch
from waferline.model.layers import Linear, Rotary
from waferline.model.weights import WeightSource, copy_into
from waferline.spec.model import DSASpec, MLASpec

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INDEX_DTYPES = {8: torch.float8_e4m3fn, 16: torch.bfloat16, 32: torch.float32}  # index_bits -> stored key dtype
K_NORM_EPS = 1e-6  # the indexer's key LayerNorm (a constant in the reference, not the model's rms_norm_eps)


class DSACache:
    """One DSA layer's cache for ``num_slots`` sequences: the MLA rows [c_KV | k_rope] and the indexer keys, as
    full-attention token caches (positional: entries past a sequence's end are masked and overwritten later), plus
    one fp32 scale per key when the keys are fp8."""

    def __init__(self, num_slots: int, latent_width: int, dtype: torch.dtype, index_dim: int, index_bits: int,
                 device: torch.device | str | None = None):
        if index_bits not in INDEX_DTYPES:
            raise ConfigError(f"index_bits {index_bits}: the engine stores indexer keys at {sorted(INDEX_DTYPES)} bits")
        self.latents = TokenCache(num_slots, latent_width, dtype, device)
        self.keys = TokenCache(num_slots, index_dim, INDEX_DTYPES[index_bits], device)
        self.scales = TokenCache(num_slots, 1, torch.float32, device) if index_bits == 8 else None

    def parts(self) -> list[TokenCache]:
        return [c for c in (self.latents, self.keys, self.scales) if c is not None]

    def reset(self, slots: torch.Tensor) -> None:
        for c in self.parts():
            c.reset(slots)

    def bytes_per_token(self) -> int:
        """Bytes each cached token takes (every part's row width times its element size)."""
        return sum(c.data.shape[2] * c.data.element_size() for c in self.parts())

    def update_keys(self, k: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Store this step's indexer keys k [B, T, D] (fp32) and return every visible row's keys [B, L, D] in fp32,
        read back from the cache (so a token scores the same stored keys in prefill and in decode)."""
        if self.scales is None:
            keys, _ = self.keys.update(k.to(self.keys.data.dtype), batch)
            return keys.float()
        scale = (k.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        keys, _ = self.keys.update((k / scale).to(self.keys.data.dtype), batch)
        scales, _ = self.scales.update(scale, batch)
        return keys.float() * scales


class Indexer(nn.Module):
    """The lightning indexer: scores cached tokens per query and picks the top ``index_topk`` (see the module doc)."""

    def __init__(self, spec: DSASpec, rotary: Rotary, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        q_in = spec.q_lora_rank or spec.hidden_size
        self.wq_b = Linear(q_in, spec.index_n_heads * spec.index_head_dim, False, dtype)
        self.wk = Linear(spec.hidden_size, spec.index_head_dim, False, dtype)
        self.k_norm = nn.LayerNorm(spec.index_head_dim, eps=K_NORM_EPS, dtype=dtype)
        self.k_norm.requires_grad_(False)
        # per-head weights of the scores: fp32, as the reference keeps this projection
        self.weights_proj = nn.Parameter(torch.empty(spec.index_n_heads, spec.hidden_size), requires_grad=False)
        self.rotary = rotary  # the MLA core's frequencies, applied here in the half-split layout
        self.scale = spec.index_head_dim ** -0.5

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        self.wq_b.load_hf(src, prefix + "wq_b")
        self.wk.load_hf(src, prefix + "wk")
        copy_into(self.k_norm.weight, src.get(prefix + "k_norm.weight", tuple(self.k_norm.weight.shape)))
        copy_into(self.k_norm.bias, src.get(prefix + "k_norm.bias", tuple(self.k_norm.bias.shape)))
        copy_into(self.weights_proj, src.get(prefix + "weights_proj.weight", tuple(self.weights_proj.shape)))

    def scores(self, x: torch.Tensor, q_in: torch.Tensor, cache: DSACache, batch: StepBatch,
               blocked: torch.Tensor | None) -> torch.Tensor:
        """Store this step's indexer keys and return every query's score of every cached token, fp32 [B, T, L]
        (-inf where ``blocked``, the causal mask [B, T, L] or None)."""
        s = self.spec
        B, T, _ = x.shape
        H, D = s.index_n_heads, s.index_head_dim
        q = self.wq_b(q_in).view(B, T, H, D)
        k = self.k_norm(self.wk(x)).view(B, T, 1, D)
        cos, sin = self.rotary.cos_sin(batch.positions(), batch)
        qk = self.rotary.apply(torch.cat([q, k], dim=2), cos, sin).float()  # queries and key rotated together
        keys = cache.update_keys(qk[:, :, H], batch)  # [B, L, D]
        per_head = F.relu(torch.matmul(qk[:, :, :H], keys.transpose(1, 2).unsqueeze(1)) * self.scale)  # [B, T, H, L]
        w = F.linear(x.float(), self.weights_proj.float()) * H ** -0.5  # [B, T, H]
        out = torch.matmul(w.unsqueeze(-2), per_head).squeeze(-2)
        return out.masked_fill_(blocked, float("-inf")) if blocked is not None else out


class DSAttention(MLAttention):
    """MLA over the top-k cached tokens the indexer picks per query (DeepSeek-V3.2). Runs as modules only: the
    fused int4 MLA block and the whole-layer op attend to every cached token (this forward does not take the first;
    DecoderLayer looks the second up by the mixer's exact type, so MLAttention's entry does not apply)."""

    def __init__(self, spec: DSASpec, cfg: dict[str, Any], dtype: torch.dtype = torch.float32,
                 interleaved_rope: bool = True, norm_eps: float = 1e-6):
        mla = MLASpec(spec.hidden_size, spec.num_heads, spec.q_lora_rank, spec.kv_lora_rank, spec.qk_nope_head_dim,
                      spec.qk_rope_head_dim, spec.v_head_dim)
        super().__init__(mla, cfg, dtype, interleaved_rope=interleaved_rope, norm_eps=norm_eps)
        self.dsa = spec
        self.indexer = Indexer(spec, Rotary(spec.qk_rope_head_dim, cfg, interleaved=False), dtype)

    def new_cache(self, num_slots: int, device: torch.device | str | None = None) -> DSACache:
        s = self.dsa
        return DSACache(num_slots, s.kv_lora_rank + s.qk_rope_head_dim, self.dtype, s.index_head_dim, s.index_bits,
                        device)

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        super().load_hf(src, prefix)
        self.indexer.load_hf(src, prefix + "indexer.")

    def forward(self, x: torch.Tensor, cache: DSACache, batch: StepBatch) -> torch.Tensor:
        B, T, _ = x.shape
        q_in, q_nope, q_rope, latents, blocked = self.queries_and_latents(x, cache.latents, batch)
        scores = self.indexer.scores(x, q_in, cache, batch, blocked)
        L, k = latents.shape[1], self.dsa.index_topk
        if L <= k:  # every token a query sees is among its top k
            return self.attend_latents(q_nope, q_rope, latents, blocked, x.dtype)
        chosen = top_k(scores, k)  # a query seeing fewer than k tokens also gets -inf (unseen) ones: masked
        if B * T <= MLA_FUSED_MAX_ROWS:  # decode / verify: each token as a row over its k latents only
            idx = chosen.nonzero()[:, 2].view(B, T, k)  # (exactly k per query, in position order)
            rows = latents[torch.arange(B, device=x.device)[:, None, None], idx]  # [B, T, k, r + rope]
            unseen = scores.gather(-1, idx).isneginf().view(B * T, 1, k)
            out = self.attend_latents(q_nope.reshape(B * T, 1, *q_nope.shape[2:]),
                                      q_rope.reshape(B * T, 1, *q_rope.shape[2:]),
                                      rows.view(B * T, k, -1), unseen, x.dtype)
            return out.view(B, T, -1)
        # prefill: every latent, with the unselected ones masked
        return self.attend_latents(q_nope, q_rope, latents, ~chosen | blocked if blocked is not None else ~chosen,
                                   x.dtype)


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best of each row of ``scores`` [..., L] as a bool mask, exactly k per row; among equal scores at the
    boundary the earliest positions. (Equal scores are common: a token no indexer head scores above 0 gets exactly
    0. torch.topk picks among equals by its internals, differently for rows of different lengths, which would make
    a decode step, a verify and a prefill choose different tokens for the same query.)"""
    kth = scores.topk(k, dim=-1).values[..., -1:]
    above = scores > kth
    tied = scores == kth
    return above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
