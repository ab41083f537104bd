"""DeepSeek-V4 decoder blocks: manifold-constrained hyper-connections (the residual stream kept as ``hc_mult``
copies, collapsed into each sub-block's input and mixed back with a Sinkhorn-normalised matrix), the routed MoE with
hash routing in its first layers and clamped SwiGLU experts, and the layer that ties them to V4 attention."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from waferline.errors import ConfigError
from waferline.model.context import StepBatch
from waferline.model.layers import Linear, RMSNorm
from waferline.model.moe import activation
from waferline.model.v4_attention import V4Attention, V4Cache, unit_rms
from waferline.model.weights import WeightSource, copy_into
from waferline.spec.model import CompressedAttentionSpec, LayerSpec, MoESpec


def hc_mult(cfg: dict[str, Any]) -> int:
    """Copies of the residual stream (``hc_mult``, 4 by default as in transformers' DeepseekV4Config)."""
    return int(cfg.get("hc_mult") or 4)


def _eps(cfg: dict[str, Any]) -> float:
    return float(cfg.get("rms_norm_eps") or 1e-6)


class HyperConnection(nn.Module):
    """The weights around one sub-block: from the RMS-normalised, flattened streams x [B, T, n, D] a linear map
    gives ``pre`` (sigmoid: how the streams collapse into the block's input), ``post`` (2 sigmoid: how the block's
    output spreads back over the streams) and ``comb`` (softmax rows, then Sinkhorn iterations towards a doubly
    stochastic matrix: how the streams mix into the new ones)."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        n, d = hc_mult(cfg), int(cfg["hidden_size"])
        self.n, self.iters = n, int(cfg.get("hc_sinkhorn_iters") or 20)
        self.hc_eps, self.norm_eps = float(cfg.get("hc_eps") or 1e-6), _eps(cfg)
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * d), requires_grad=False)
        self.base = nn.Parameter(torch.zeros((2 + n) * n), requires_grad=False)
        self.scale = nn.Parameter(torch.zeros(3), requires_grad=False)

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        """``{prefix}fn``, ``{prefix}base``, ``{prefix}scale`` (prefix ``model.layers.{i}.hc_attn_`` / ``hc_ffn_``)."""
        for name in ("fn", "base", "scale"):
            p = getattr(self, name)
            copy_into(p, src.get(prefix + name, tuple(p.shape)))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, n, D] -> (post [B, T, n], comb [B, T, n, n], the block's input [B, T, D]); all fp32 but the
        input, in x's dtype."""
        n = self.n
        mixes = F.linear(unit_rms(x.flatten(2).float(), self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return post, comb, (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)

    @staticmethod
    def merge(x: Tensor, out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """New streams: ``post_k * out + sum_j comb[j, k] * x_j`` for the block's output ``out`` [B, T, D]."""
        dt = x.dtype
        return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), x)


class HyperHead(nn.Module):
    """The final collapse of the streams [..., n, D] -> [..., D] before the model's norm (sigmoid weights from the
    normalised streams, as a HyperConnection's ``pre``)."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        n, d = hc_mult(cfg), int(cfg["hidden_size"])
        self.hc_eps, self.norm_eps = float(cfg.get("hc_eps") or 1e-6), _eps(cfg)
        self.hc_fn = nn.Parameter(torch.zeros(n, n * d), requires_grad=False)
        self.hc_base = nn.Parameter(torch.zeros(n), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.zeros(1), requires_grad=False)

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        for name in ("hc_fn", "hc_base", "hc_scale"):
            p = getattr(self, name)
            copy_into(p, src.get(prefix + name, tuple(p.shape)))

    def forward(self, x: Tensor) -> Tensor:
        mixes = F.linear(unit_rms(x.flatten(-2).float(), self.norm_eps), self.hc_fn)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)


_SCORES = {"sqrtsoftplus": lambda z: F.softplus(z).sqrt(), "sigmoid": torch.sigmoid,
           "softmax": lambda z: z.softmax(dim=-1)}


class V4MoE(nn.Module):
    """Routed experts (top-k of E by router score + correction bias, or by a fixed token -> experts table in the
    hash-routed layers) and one shared expert, all SwiGLU with the gate clamped above at ``swiglu_limit`` and the
    up projection clamped to +-``swiglu_limit``. The chosen experts' scores are renormalised to sum 1 and scaled by
    ``routed_scaling``."""

    def __init__(self, spec: MoESpec, cfg: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        E, D, I, k = spec.num_experts, spec.hidden_size, spec.expert_intermediate, spec.top_k
        if spec.scoring not in _SCORES:
            raise ConfigError(f"deepseek_v4 scoring_func {spec.scoring!r}; supported: {', '.join(_SCORES)}")
        self.spec, self.top_k, self.limit = spec, k, float(cfg.get("swiglu_limit") or 10.0)
        self.hashed = not spec.correction_bias  # (the parser marks the hash-routed layers by their missing bias)
        self.gate_weight = nn.Parameter(torch.zeros(E, D), requires_grad=False)
        if self.hashed:
            self.register_buffer("tid2eid", torch.zeros(int(cfg["vocab_size"]), k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.w_gate_up = nn.Parameter(torch.zeros(E, 2 * I, D, dtype=dtype), requires_grad=False)
        self.w_down = nn.Parameter(torch.zeros(E, D, I, dtype=dtype), requires_grad=False)
        S, b = spec.shared_intermediate, spec.shared_bias
        self.shared = nn.ModuleDict({"gate_proj": Linear(D, S, b, dtype), "up_proj": Linear(D, S, b, dtype),
                                     "down_proj": Linear(S, D, b, dtype)}) if S else None
        self.act = activation(cfg.get("hidden_act") or "silu")

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        """Weights under ``prefix`` (``model.layers.{i}.ffn.``) in DeepSeek's names: gate.weight, gate.bias (the
        correction bias) or gate.tid2eid, experts.{e}.w1 / w3 / w2 (gate / up / down), shared_experts.w1 / w3 / w2."""
        copy_into(self.gate_weight, src.get(prefix + "gate.weight", tuple(self.gate_weight.shape)))
        if self.hashed:
            copy_into(self.tid2eid, src.get(prefix + "gate.tid2eid", tuple(self.tid2eid.shape)))
        else:
            copy_into(self.e_score_correction_bias, src.get(prefix + "gate.bias",
                                                            tuple(self.e_score_correction_bias.shape)))
        E, two_i, D = self.w_gate_up.shape
        I = two_i // 2
        for e in range(E):
            copy_into(self.w_gate_up[e, :I], src.get(f"{prefix}experts.{e}.w1.weight", (I, D)))
            copy_into(self.w_gate_up[e, I:], src.get(f"{prefix}experts.{e}.w3.weight", (I, D)))
            copy_into(self.w_down[e], src.get(f"{prefix}experts.{e}.w2.weight", (D, I)))
        if self.shared is not None:
            for name, stored in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                self.shared[name].load_hf(src, prefix + "shared_experts." + stored)

    def _swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.act(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)

    def route(self, x: Tensor, tokens: Tensor | None) -> tuple[Tensor, Tensor]:
        """(weights fp32, expert ids) [N, k] for tokens x [N, D] with ids ``tokens`` [N] (hash routing only)."""
        scores = _SCORES[self.spec.scoring](F.linear(x.float(), self.gate_weight))
        if self.hashed:
            idx = self.tid2eid[tokens]
        else:
            idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.spec.routed_scaling, idx

    def expert_linear(self, x: Tensor, which: str, e: int) -> Tensor:
        """Expert ``e``'s weight ``which`` (gate_up | down) applied to x [n, in]: the one place the experts multiply
        (int4 weights, model/quant/, replace ``w_which`` by ``q_which``; GPTQ's calibration watches this call)."""
        q = getattr(self, "q_" + which, None)
        return q.expert_linear(x, e) if q is not None else F.linear(x, getattr(self, "w_" + which)[e])

    def forward(self, x: Tensor, tokens: Tensor | None) -> Tensor:
        """x [N, D], token ids [N] (hash routing only) -> [N, D]."""
        weights, idx = self.route(x, tokens)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():  # (ascending: each token sums its experts in expert order)
            rows, which = torch.where(idx == e)
            gate, up = self.expert_linear(x[rows], "gate_up", e).chunk(2, dim=-1)
            y = self.expert_linear(self._swiglu(gate, up), "down", e) * weights[rows, which, None]
            out.index_add_(0, rows, y.to(x.dtype))
        if self.shared is not None:
            s = self.shared
            out = out + s["down_proj"](self._swiglu(s["gate_proj"](x), s["up_proj"](x)))
        return out


class V4Layer(nn.Module):
    """A DeepSeek-V4 decoder layer on the streams x [B, T, hc_mult, D]: attention and then the MoE, each fed by
    its hyper-connection's collapse of the streams (after an RMSNorm) and merged back into them. The step's token
    ids (hash routing) come from ``batch.memo["tokens"]`` (DecoderModel.forward, or a pipeline stage's runner)."""

    def __init__(self, spec: LayerSpec, model_type: str, cfg: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        if not isinstance(spec.mixer, CompressedAttentionSpec) or not isinstance(spec.ffn, MoESpec):
            raise ConfigError(f"layer {spec.index}: a {model_type} layer needs V4 attention and a MoE")
        self.spec = spec
        eps, d = _eps(cfg), spec.hidden_size
        self.mixer_norm = RMSNorm(d, eps, dtype)
        self.ffn_norm = RMSNorm(d, eps, dtype)
        self.mixer = V4Attention(spec.mixer, cfg, dtype, eps)
        self.ffn = V4MoE(spec.ffn, cfg, dtype)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def new_cache(self, num_slots: int, device: torch.device | str | None = None) -> V4Cache:
        return self.mixer.new_cache(num_slots, device)

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        """Weights under ``prefix`` (``model.layers.{i}.``) in DeepSeek's checkpoint names (transformers renames
        them on loading and back on saving)."""
        self.mixer_norm.load_hf(src, prefix + "attn_norm.weight")
        self.ffn_norm.load_hf(src, prefix + "ffn_norm.weight")
        self.mixer.load_hf(src, prefix + "attn.")
        self.ffn.load_hf(src, prefix + "ffn.")
        self.attn_hc.load_hf(src, prefix + "hc_attn_")
        self.ffn_hc.load_hf(src, prefix + "hc_ffn_")

    def forward(self, x: Tensor, cache: V4Cache, batch: StepBatch) -> Tensor:
        post, comb, h = self.attn_hc(x)
        x = HyperConnection.merge(x, self.mixer(self.mixer_norm(h), cache, batch), post, comb)
        tokens = batch.memo.get("tokens")
        if tokens is None and self.ffn.hashed:
            raise ConfigError("a hash-routed deepseek_v4 layer needs the step's token ids in batch.memo['tokens'] "
                              "(DecoderModel.forward and the pipeline's stages put them there)")
        post, comb, h = self.ffn_hc(x)
        B, T, D = h.shape
        f = self.ffn(self.ffn_norm(h).reshape(B * T, D), None if tokens is None else tokens.reshape(B * T))
        f = f.view(B, T, D)
        return HyperConnection.merge(x, f, post, comb)
