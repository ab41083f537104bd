"""Linear-attention mixers over a constant-size per-sequence state: Gated DeltaNet (``qwen3_next``) and Kimi Delta
Attention (``kimi_linear``), with their state cache.

Both mixers project the layer input to q, k, v, run them through a causal depthwise convolution (then the config's
``hidden_act``, SiLU by default, as transformers applies it) whose last
``conv_kernel - 1`` inputs are cached per sequence, L2-normalise q and k and run the gated delta rule
(model/delta_rule.py) from the sequence's cached recurrent state; a gated RMSNorm and an output projection follow.
Prefill runs the chunked form (``chunk_size`` tokens at a time: the spec's, from the config's ``linear_chunk_size``,
waferline's own field, default 64), a decode step the recurrence reading only the state, and a speculative verify the
recurrence token by token, recording the state after each token so a rejected suffix can be dropped.

Checkpoint layout (what transformers 5.24's ``save_pretrained`` writes; the mixer under ``model.layers.{i}.``):

=================  ==================  ==============================================================================
model_type         mixer prefix        tensors
=================  ==================  ==============================================================================
qwen3_next         ``linear_attn.``    in_proj_qkvz (grouped per key head: q, k, then the group's v and z),
                                       in_proj_ba (per key head: the group's b, then a), conv1d [C, 1, K], dt_bias,
                                       A_log, norm (gated by SiLU(z)), out_proj
kimi_linear        ``self_attn.``      q/k/v_proj, q/k/v_conv1d [C, 1, K] (or one stacked conv1d), f_a/f_b_proj,
                                       dt_bias [C], A_log [1, 1, H, 1] (also under ``forget_gate.``), b_proj,
                                       g_a/g_b_proj, o_norm (gated by sigmoid), o_proj
=================  ==================  ==============================================================================
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from waferline.errors import ConfigError
from waferline.model.context import StepBatch
from waferline.model.delta_rule import delta_rule_chunked, delta_rule_steps, l2_normalize
from waferline.model.layers import Linear
from waferline.model.ssm import _ACTS, Mamba2Cache, causal_depthwise_conv
from waferline.model.weights import WeightSource, copy_into
from waferline.spec.model import GatedDeltaNetSpec, KimiDeltaSpec


class LinearAttentionCache(Mamba2Cache):
    """Per-layer state of a linear-attention mixer for up to ``num_slots`` sequences; its size does not depend on
    sequence length.

    conv: the last ``conv_kernel - 1`` inputs of the causal conv, ``[num_slots, conv_dim, conv_kernel - 1]``, model
    dtype. ssm: the recurrent state, ``[num_slots, heads, key_dim, value_dim]``, always float32.

    The same layout and interface as a Mamba-2 layer's cache (reset, snapshot / restore, ``keep_trail`` and
    ``rewind`` over a trail of per-token states, nbytes), so the scheduler and the speculative rollback treat both
    alike; the trail it keeps holds the states themselves ([T, ...] per slot)."""


class DeltaRuleMixer(nn.Module):
    """What Gated DeltaNet and KDA share: the conv over [q | k | v] with its cached window, the delta rule over the
    cached state, and the cache. Subclasses project the input and finish the output."""

    def __init__(self, conv_dim: int, conv_kernel: int, heads: int, key_dim: int, value_dim: int, chunk_size: int,
                 dtype: torch.dtype, act: str = "silu"):
        super().__init__()
        if conv_kernel < 2:
            raise ConfigError(f"linear attention: the conv kernel must be >= 2, got {conv_kernel}")
        if act not in _ACTS:
            raise ConfigError(f"linear attention: unsupported conv activation (hidden_act) {act!r}; use one of "
                              f"{sorted(_ACTS)}")
        self.act = _ACTS[act]
        self.conv_dim, self.K = conv_dim, conv_kernel
        self.heads, self.key_dim, self.value_dim = heads, key_dim, value_dim
        self.conv_weight = nn.Parameter(torch.zeros(conv_dim, conv_kernel, dtype=dtype), requires_grad=False)
        self.chunk_size = chunk_size

    def new_cache(self, num_slots: int, device: torch.device | str | None = None) -> LinearAttentionCache:
        device = device if device is not None else self.conv_weight.device
        return LinearAttentionCache(
            conv=torch.zeros(num_slots, self.conv_dim, self.K - 1, dtype=self.conv_weight.dtype, device=device),
            ssm=torch.zeros(num_slots, self.heads, self.key_dim, self.value_dim, dtype=torch.float32, device=device),
        )

    def _conv(self, mixed: Tensor, cache: LinearAttentionCache, slots: Tensor, record: bool) -> tuple[Tensor, Tensor]:
        """act(causal depthwise conv) of ``mixed`` [B, T, C] continuing each row's cached window, which is advanced.
        Returns the output [B, T, C] and, with ``record``, the window after each token [B, T, C, K - 1] (else an
        empty tensor). One arithmetic for every T (causal_depthwise_conv), so a verify's tokens see what decode steps
        would."""
        T = mixed.shape[1]
        full = torch.cat([cache.conv.index_select(0, slots), mixed.transpose(1, 2).to(cache.conv.dtype)], dim=-1)
        cache.conv.index_copy_(0, slots, full[:, :, -(self.K - 1):])
        out = self.act(causal_depthwise_conv(full, self.conv_weight, None, T)).transpose(1, 2)
        trail = full.unfold(-1, self.K - 1, 1)[:, :, 1:].transpose(1, 2) if record else full.new_empty(0)
        return out, trail

    def _delta(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cache: LinearAttentionCache,
               slots: Tensor, conv_trail: Tensor) -> Tensor:
        """The delta rule (float32 inputs: q, k [B, T, H, Dk], v [B, T, H, Dv], g [B, T, H, 1 or Dk], beta
        [B, T, H]) from each row's cached state, which is advanced: the recurrence for one token, or for a verify
        (``cache.keep_trail``: the states after each token go to ``cache.trail`` with the conv windows), else the
        chunked form. Returns [B, T, H, Dv] float32."""
        T = q.shape[1]
        state = cache.ssm.index_select(0, slots)
        record = cache.keep_trail and T > 1
        if T == 1 or record:
            out, states = delta_rule_steps(state, q, k, v, g, beta, record=record)
            if states is not None:
                for b, s in enumerate(slots.tolist()):
                    cache.trail[s] = (conv_trail[b], states[b])
        else:
            out = delta_rule_chunked(state, q, k, v, g, beta, self.chunk_size)
        cache.ssm.index_copy_(0, slots, state)
        return out


def _gated_rms(o: Tensor, weight: Tensor, gate: Tensor, eps: float, act: str, dtype: torch.dtype) -> Tensor:
    """RMS-normalise ``o`` over its last dimension, scale by ``weight`` and multiply by act(gate) (SiLU for Qwen3-Next,
    sigmoid for Kimi), back in ``dtype``. Qwen3-Next scales after rounding to the model dtype, Kimi in float32."""
    x = o.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = weight * x.to(dtype) if act == "silu" else weight.float() * x
    g = gate.float()
    return (x * (F.silu(g) if act == "silu" else torch.sigmoid(g))).to(dtype)


class GatedDeltaNet(DeltaRuleMixer):
    """Qwen3-Next's linear attention: grouped-value delta rule (each key head serves ``num_v_heads / num_k_heads``
    value heads), one decay per value head, output normalised and gated by SiLU(z)."""

    def __init__(self, spec: GatedDeltaNetSpec, dtype: torch.dtype = torch.float32, norm_eps: float = 1e-6,
                 act: str = "silu"):
        nk, nv, dk, dv = spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
        if nv % nk:
            raise ConfigError(f"gated deltanet: {nv} value heads are not a multiple of {nk} key heads")
        super().__init__(2 * spec.key_dim + spec.value_dim, spec.conv_kernel, nv, dk, dv, spec.chunk_size, dtype, act)
        self.spec, self.eps = spec, norm_eps
        self.ratio = nv // nk
        d = spec.hidden_size
        self.in_proj_qkvz = Linear(d, 2 * spec.key_dim + 2 * spec.value_dim, False, dtype)
        self.in_proj_ba = Linear(d, 2 * nv, False, dtype)
        self.dt_bias = nn.Parameter(torch.zeros(nv, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(nv, dtype=torch.float32), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.ones(dv, dtype=dtype), requires_grad=False)
        self.out_proj = Linear(spec.value_dim, d, False, dtype)

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        """Load the tensors under ``prefix`` (e.g. ``model.layers.0.linear_attn.``)."""
        for name in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
            getattr(self, name).load_hf(src, prefix + name)
        copy_into(self.conv_weight, src.get(prefix + "conv1d.weight", (self.conv_dim, 1, self.K)).flatten(1))
        copy_into(self.dt_bias, src.get(prefix + "dt_bias", (self.heads,)))
        copy_into(self.A_log, src.get(prefix + "A_log", (self.heads,)))
        copy_into(self.norm_weight, src.get(prefix + "norm.weight", (self.value_dim,)))

    def forward(self, x: Tensor, cache: LinearAttentionCache, batch: StepBatch) -> Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; row b continues the sequence in cache slot ``batch.slots[b]``."""
        s = self.spec
        B, T, _ = x.shape
        nk, r, dk, dv = s.num_k_heads, self.ratio, s.head_k_dim, s.head_v_dim
        q, k, v, z = self.in_proj_qkvz(x).view(B, T, nk, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, nk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        record = cache.keep_trail and T > 1
        mixed, conv_trail = self._conv(mixed, cache, batch.slots, record)
        q, k, v = mixed.float().split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = l2_normalize(q.reshape(B, T, nk, dk)) * dk ** -0.5
        k = l2_normalize(k.reshape(B, T, nk, dk))
        if r > 1:  # each key head serves r consecutive value heads
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        beta = b.reshape(B, T, -1).float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(B, T, -1).float() + self.dt_bias)
        o = self._delta(q, k, v.reshape(B, T, -1, dv), g.unsqueeze(-1), beta, cache, batch.slots, conv_trail)
        y = _gated_rms(o.to(x.dtype), self.norm_weight, z.reshape(B, T, -1, dv), self.eps, "silu", x.dtype)
        return self.out_proj(y.reshape(B, T, -1))


class KimiDeltaAttention(DeltaRuleMixer):
    """Kimi Linear's KDA: the delta rule with one decay per key channel from a low-rank forget gate, q/k/v convs,
    output normalised and gated by the sigmoid of a low-rank gate."""

    def __init__(self, spec: KimiDeltaSpec, dtype: torch.dtype = torch.float32, norm_eps: float = 1e-5,
                 act: str = "silu"):
        H, hd, C = spec.num_heads, spec.head_dim, spec.qkv_dim
        super().__init__(3 * C, spec.conv_kernel, H, hd, hd, spec.chunk_size, dtype, act)
        self.spec, self.eps = spec, norm_eps
        d = spec.hidden_size
        self.q_proj, self.k_proj, self.v_proj = (Linear(d, C, False, dtype) for _ in range(3))
        self.f_a_proj, self.f_b_proj = Linear(d, hd, False, dtype), Linear(hd, C, False, dtype)
        self.g_a_proj, self.g_b_proj = Linear(d, hd, False, dtype), Linear(hd, C, False, dtype)
        self.b_proj = Linear(d, H, False, dtype)
        self.dt_bias = nn.Parameter(torch.zeros(C, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32), requires_grad=False)
        self.o_norm_weight = nn.Parameter(torch.ones(hd, dtype=dtype), requires_grad=False)
        self.o_proj = Linear(C, d, False, dtype)

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        """Load the tensors under ``prefix`` (e.g. ``model.layers.0.self_attn.``): the hub's layout (three convs, the
        forget gate beside the projections) or transformers' in-memory one (one stacked conv, ``forget_gate.``)."""
        C, K, H = self.spec.qkv_dim, self.K, self.heads
        for name in ("q_proj", "k_proj", "v_proj", "g_a_proj", "g_b_proj", "b_proj", "o_proj"):
            getattr(self, name).load_hf(src, prefix + name)
        fg = prefix if src.has(prefix + "f_a_proj.weight") else prefix + "forget_gate."
        self.f_a_proj.load_hf(src, fg + "f_a_proj")
        self.f_b_proj.load_hf(src, fg + "f_b_proj")
        copy_into(self.dt_bias, src.get(fg + "dt_bias", (C,)))
        copy_into(self.A_log, src.get(fg + "A_log", (1, 1, H, 1)).flatten())
        if src.has(prefix + "conv1d.weight"):
            w = src.get(prefix + "conv1d.weight", (3 * C, 1, K))
        else:
            w = torch.cat([src.get(prefix + f"{p}_conv1d.weight", (C, 1, K)) for p in "qkv"])
        copy_into(self.conv_weight, w.flatten(1))
        copy_into(self.o_norm_weight, src.get(prefix + "o_norm.weight", (self.key_dim,)))

    def forward(self, x: Tensor, cache: LinearAttentionCache, batch: StepBatch) -> Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; row b continues the sequence in cache slot ``batch.slots[b]``."""
        B, T, _ = x.shape
        H, hd = self.heads, self.key_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        record = cache.keep_trail and T > 1
        mixed, conv_trail = self._conv(mixed, cache, batch.slots, record)
        q, k, v = (t.reshape(B, T, H, hd) for t in mixed.float().chunk(3, dim=-1))
        q = l2_normalize(q, divide=True) * hd ** -0.5
        k = l2_normalize(k, divide=True)
        f = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias).view(B, T, H, hd)
        softplus = torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))  # (Kimi's own spelling of softplus)
        g = -self.A_log.float().exp().view(H, 1) * softplus
        beta = self.b_proj(x).float().sigmoid()
        o = self._delta(q, k, v, g, beta, cache, batch.slots, conv_trail)
        gate = self.g_b_proj(self.g_a_proj(x)).view(B, T, H, hd)
        y = _gated_rms(o.to(x.dtype), self.o_norm_weight, gate, self.eps, "sigmoid", x.dtype)
        return self.o_proj(y.reshape(B, T, -1))
