"""The parts of Qwen3-Next and Kimi Linear other than their linear attention: Qwen3-Next's gated full attention and
zero-centred norms, Kimi Linear's MLA without rotary, and which mixer each of their layers gets."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from waferline.errors import ConfigError
from waferline.model.attention import GQAttention, MLAttention, TokenCache, attend
from waferline.model.context import StepBatch
from waferline.model.layers import Linear, Rotary
from waferline.model.linear_attention import GatedDeltaNet, KimiDeltaAttention
from waferline.model.weights import WeightSource
from waferline.spec.configs import partial_rotary
from waferline.spec.model import AttentionSpec, GatedDeltaNetSpec, KimiDeltaSpec, LayerSpec, MLASpec

LINEAR_HYBRIDS = ("qwen3_next", "kimi_linear")  # the model types whose mixers build_mixer makes


class GatedAttention(GQAttention):
    """Qwen3-Next's full attention: GQA with q/k norms and partial rotary whose query projection also yields, per
    head, a gate: the attention output is multiplied by its sigmoid before o_proj. (The checkpoint's q_proj rows
    alternate per head: head_dim query rows, then head_dim gate rows.)"""

    def __init__(self, spec: AttentionSpec, cfg: dict[str, Any], dtype: torch.dtype = torch.float32,
                 rotary: Rotary | None = None, norm_eps: float = 1e-6):
        super().__init__(spec, cfg, dtype, rotary=rotary, norm_eps=norm_eps)
        self.q_proj = Linear(spec.hidden_size, 2 * spec.num_heads * spec.head_dim, spec.qkv_bias, dtype)

    def forward(self, x: Tensor, cache: TokenCache, batch: StepBatch) -> Tensor:
        s = self.spec
        B, T, _ = x.shape
        h, kvh, hd = s.num_heads, s.num_kv_heads, s.head_dim
        q, gate = self.q_proj(x).view(B, T, h, 2 * hd).split([hd, hd], dim=-1)
        k = self.k_proj(x).view(B, T, kvh, hd)
        v = self.v_proj(x).view(B, T, kvh, hd)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k)
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(batch.positions(), batch)
            q, k = self.rotary.apply(torch.cat([q, k], dim=2), cos, sin).split([h, kvh], dim=2)
        kv, blocked = cache.update(torch.cat([k, v], dim=2).view(B, T, -1), batch)
        kv = kv.view(B, kv.shape[1], 2 * kvh, hd)
        out = attend(q, kv[:, :, :kvh], kv[:, :, kvh:], blocked, self.scale)
        out = out.reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(out)


class NoRotary(Rotary):
    """A rotary of ``dim`` channels that turns by zero at every position (cos 1, sin 0): the channels pass through
    unchanged (x * 1 + y * 0), in every path that takes rotation tables, the fused MLA ops included. Kimi Linear's
    MLA has no positional encoding (its "rope" key part is shared but never rotated)."""

    def __init__(self, dim: int):
        super().__init__(dim, {})
        self.inv_freq.zero_()
        self.key = (dim, 0.0, 0.0, 0.0, 1.0)


def build_mixer(spec: LayerSpec, mt: str, cfg: dict[str, Any], dtype: torch.dtype, eps: float) -> nn.Module:
    """The mixer of a ``qwen3_next`` or ``kimi_linear`` layer."""
    mix = spec.mixer
    if isinstance(mix, GatedDeltaNetSpec):
        return GatedDeltaNet(mix, dtype, norm_eps=eps, act=cfg.get("hidden_act") or "silu")
    if isinstance(mix, KimiDeltaSpec):  # (both convs: the config's hidden_act, as transformers applies it)
        return KimiDeltaAttention(mix, dtype, norm_eps=eps, act=cfg.get("hidden_act") or "silu")
    if isinstance(mix, AttentionSpec) and mix.output_gate:
        rotary = Rotary(int(mix.head_dim * partial_rotary(cfg, mt)), cfg)
        return GatedAttention(mix, cfg, dtype, rotary=rotary, norm_eps=eps)
    if isinstance(mix, MLASpec) and mt == "kimi_linear":
        # (latent norms: the reference's 1e-6; no rope settings read: no rotary, no YaRN mscale in the softmax scale)
        norope = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters")}
        mla = MLAttention(mix, norope, dtype, interleaved_rope=False)
        mla.rotary = NoRotary(mix.qk_rope_head_dim)
        return mla
    kind = mix.kind if mix is not None else None
    raise ConfigError(f"layer {spec.index}: {mt} has no {kind!r} mixer")


class ZeroCentredNorms(WeightSource):
    """``src`` with 1 added to the weight of every RMSNorm that Qwen3-Next applies as ``x * (1 + w)`` (the layer,
    final and q/k norms; not the linear attention's gated norm, which multiplies by w): the engine's RMSNorm then
    computes the same ``x * (1 + w)``, its fused ops included. Reads, names and use are ``src``'s own."""

    def __init__(self, src: WeightSource):  # (no state of its own: every call goes to src)
        self.src = src
        self.used = src.used

    @staticmethod
    def centred(name: str) -> bool:
        return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")

    def has(self, name: str) -> bool:
        return self.src.has(name)

    def names_with_prefix(self, prefix: str) -> list[str]:
        return self.src.names_with_prefix(prefix)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.src.shape(name)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> Tensor:
        t = self.src.get(name, shape)
        return t.float() + 1.0 if self.centred(name) else t

    def unused(self) -> list[str]:
        return self.src.unused()


def hf_source(src: WeightSource, mt: str) -> WeightSource:
    """The source the modules of ``mt`` load from: Qwen3-Next's zero-centred norms shifted, else ``src`` itself."""
    return ZeroCentredNorms(src) if mt == "qwen3_next" else src
