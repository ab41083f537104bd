"""FFN modules: the dense MLP and the mixture-of-experts block (router + stacked experts + shared experts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from waferline import kernels
from waferline.errors import CheckpointError, ConfigError
from waferline.model.layers import few_rows, kept_args, packed_linear
from waferline.model.weights import WeightSource, copy_into
from waferline.spec.model import DenseFFNSpec, MoESpec

_NONE = torch.empty(0)  # moe_route's "no bias"

# ----------------------------------------------------------------------------- activations


def _relu2(x: Tensor) -> Tensor:
    return torch.square(F.relu(x))


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "relu2": _relu2,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


def gated_act(h: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    """``act(gate) * up`` for ``h = [gate | up]`` (the gated FFN's middle); SiLU on CPU runs fused
    (waferline.kernels)."""
    if act is F.silu and h.device.type == "cpu" and kernels.available():
        return torch.ops.waferline.silu_mul(h)
    gate, up = h.chunk(2, dim=-1)
    return act(gate) * up


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """The activation function called ``name`` (Hugging Face ``hidden_act`` spelling)."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ConfigError(
            f"unsupported FFN activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}"
        ) from None


# ----------------------------------------------------------------------------- checkpoint naming per model_type

# Where the FFN of layer ``i`` lives in a Hugging Face checkpoint (what ``save_pretrained`` writes in
# transformers 5.24), i.e. the ``prefix`` to pass to ``MoE.load_hf`` / ``DenseFFN.load_hf``. Alternatives are
# tried in order by :func:`moe_prefix` / :func:`dense_prefix` (the first one with tensors in the checkpoint wins).
#
#   qwen3_moe         model.layers.{i}.mlp.               gate.weight [E,D]; experts.{e}.{gate,up,down}_proj.weight
#   mixtral           model.layers.{i}.block_sparse_moe.  gate.weight; experts.{e}.w1 (gate) / w3 (up) / w2
# (down).weight
#                     (5.24's in-memory module is ``mlp.``, its loader renames; a fused save has
#                     ``mlp.experts.gate_up_proj [E,2I,D]`` / ``mlp.experts.down_proj [E,D,I]``)
#   deepseek_v2/_v3   model.layers.{i}.mlp.               gate.weight, gate.e_score_correction_bias [E] (V3);
#   sol, glm4_moe                                         experts.{e}.{gate,up,down}_proj.weight;
# shared_experts.{gate,up,down}_proj.weight
#   gpt_oss           model.layers.{i}.mlp.               router.weight [E,D], router.bias [E]; FUSED
# experts.gate_up_proj [E,D,2I]
#                                                         (transposed, gate/up INTERLEAVED on the last dim),
# gate_up_proj_bias [E,2I]
#                                                         (interleaved), down_proj [E,I,D] (transposed), down_proj_bias
# [E,D]
#   granitemoehybrid  model.layers.{i}.                   (the LAYER prefix: the shared MLP sits beside the MoE block)
#                                                         block_sparse_moe.router.layer.weight [E,D];
#                                                         block_sparse_moe.input_linear.weight [E,2I,D] (gate first,
# then up);
#                                                         block_sparse_moe.output_linear.weight [E,D,I];
#                                                         shared_mlp.input_linear.weight [2S,D],
# shared_mlp.output_linear.weight [D,S]
#   nemotron_h        backbone.layers.{i}.mixer.          gate.weight, gate.e_score_correction_bias;
# experts.{e}.{up,down}_proj.weight
#                                                         (non-gated relu2); shared_experts.{up,down}_proj.weight
#   qwen2_moe,        model.layers.{i}.mlp.               gate.weight; experts.{e}.*;
# shared_expert.{gate,up,down}_proj.weight;
#   qwen3_next                                            shared_expert_gate.weight [1,D]
#
# Every flavor also accepts the fused in-memory layout of 5.24 (``experts.gate_up_proj [E,2I,D]`` or, non-gated,
# ``experts.up_proj [E,I,D]``, and ``experts.down_proj [E,D,I]``) in place of per-expert keys.
MOE_PREFIXES: dict[str, tuple[str, ...]] = {
    "qwen3_moe": ("model.layers.{i}.mlp.",),
    "qwen2_moe": ("model.layers.{i}.mlp.",),
    "qwen3_next": ("model.layers.{i}.mlp.",),
    "kimi_linear": ("model.layers.{i}.block_sparse_moe.", "model.layers.{i}.mlp."),
    "mixtral": ("model.layers.{i}.block_sparse_moe.", "model.layers.{i}.mlp."),
    "deepseek_v2": ("model.layers.{i}.mlp.",),
    "deepseek_v3": ("model.layers.{i}.mlp.",),
    "deepseek_v32": ("model.layers.{i}.mlp.",),
    "sol": ("model.layers.{i}.mlp.",),
    "glm4_moe": ("model.layers.{i}.mlp.",),
    "gpt_oss": ("model.layers.{i}.mlp.",),
    "granitemoehybrid": ("model.layers.{i}.",),
    "nemotron_h": ("backbone.layers.{i}.mixer.", "model.layers.{i}.mixer."),
}

# Dense FFN of layer ``i``: prefix alternatives and the tensor names under it (see DenseFFN.load_hf).
DENSE_PREFIXES: dict[str, tuple[str, ...]] = {
    "granitemoehybrid": ("model.layers.{i}.shared_mlp.",),
    "nemotron_h": ("backbone.layers.{i}.mixer.", "model.layers.{i}.mixer."),
    "kimi_linear": ("model.layers.{i}.block_sparse_moe.", "model.layers.{i}.mlp."),
}
DEFAULT_DENSE_PREFIXES: tuple[str, ...] = ("model.layers.{i}.mlp.",)
DENSE_NAMES: dict[str, dict[str, str]] = {
    "granitemoehybrid": {"gate_up": "input_linear.weight", "down": "output_linear.weight"},
}

FLAVORS = tuple(MOE_PREFIXES)

GATHER_BYTES = 64 << 20  # decode gather path: most bytes of expert weights copied per forward
MOE_FUSED_MAX_ROWS = 32  # tokens up to which a CPU MoE block runs as one fused op (decode and verify, not prefill)


class Groups:
    """Rows sorted by expert for one grouped product: ``offs`` int32 [E], one past each expert's last row; ``ids``
    int64 [M], each row's expert (for the biases)."""

    __slots__ = ("offs", "ids")

    def __init__(self, offs: Tensor, ids: Tensor):
        self.offs, self.ids = offs, ids


def hf_act(model_type: str, cfg: dict) -> str:
    """The FFN activation named by a Hugging Face config (``mlp_hidden_act`` for nemotron_h, else ``hidden_act``)."""
    if model_type == "nemotron_h":
        return cfg.get("mlp_hidden_act") or "relu2"
    return cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"


def moe_kwargs(model_type: str, cfg: dict) -> dict:
    """Keyword arguments for ``MoE(spec, dtype, **moe_kwargs(model_type, cfg))`` from a Hugging Face config dict."""
    kw: dict = {"act": hf_act(model_type, cfg), "flavor": model_type}
    if model_type == "gpt_oss":
        kw.update(swiglu_alpha=_number(cfg, "swiglu_alpha", 1.702), swiglu_limit=_number(cfg, "swiglu_limit", 7.0))
    return kw


def _number(cfg: dict, key: str, default: float) -> float:
    """``cfg[key]`` as a float (``default`` when absent); anything else, null included, refused by name."""
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"config.json: {key} must be a number, got {v!r}")
    return float(v)


def _pick_prefix(candidates: tuple[str, ...], i: int, src: WeightSource | None) -> str:
    prefixes = [c.format(i=i) for c in candidates]
    if src is not None:
        for p in prefixes:
            if src.names_with_prefix(p):
                return p
    return prefixes[0]


def moe_prefix(flavor: str, i: int, src: WeightSource | None = None) -> str:
    """The checkpoint prefix of layer ``i``'s MoE block for ``flavor`` (the first alternative present in ``src``)."""
    if flavor not in MOE_PREFIXES:
        raise ConfigError(f"no MoE weight naming for model_type {flavor!r}; known: {', '.join(FLAVORS)}")
    return _pick_prefix(MOE_PREFIXES[flavor], i, src)


def dense_prefix(flavor: str, i: int, src: WeightSource | None = None) -> str:
    """The checkpoint prefix of layer ``i``'s dense FFN for ``flavor``."""
    return _pick_prefix(DENSE_PREFIXES.get(flavor, DEFAULT_DENSE_PREFIXES), i, src)


def dense_names(flavor: str) -> dict[str, str] | None:
    """The ``names`` argument for ``DenseFFN.load_hf`` for ``flavor`` (None: the default gate/up/down_proj names)."""
    return DENSE_NAMES.get(flavor)


# ----------------------------------------------------------------------------- dense FFN


class DenseFFN(nn.Module):
    """A dense MLP. Gated: ``down(act(gate(x)) * up(x))`` with gate and up stored fused as ``w_gate_up [2I, D]``
    (gate rows first). Plain: ``down(act(up(x)))`` (``act="relu2"`` for Nemotron-H). Weights are ``[out, in]``."""

    def __init__(self, spec: DenseFFNSpec, dtype: torch.dtype = torch.float32, act: str = "silu"):
        super().__init__()
        self.spec = spec
        self.gated = spec.gated
        self.act_name = act
        self.act = activation(act)
        D, I = spec.hidden_size, spec.intermediate_size
        self.hidden_size, self.intermediate_size = D, I
        if self.gated:
            self.w_gate_up = nn.Parameter(torch.zeros(2 * I, D, dtype=dtype), requires_grad=False)
            self.b_gate_up = nn.Parameter(torch.zeros(2 * I, dtype=dtype), requires_grad=False) if spec.bias else None
        else:
            self.w_up = nn.Parameter(torch.zeros(I, D, dtype=dtype), requires_grad=False)
            self.b_up = nn.Parameter(torch.zeros(I, dtype=dtype), requires_grad=False) if spec.bias else None
        self.w_down = nn.Parameter(torch.zeros(D, I, dtype=dtype), requires_grad=False)
        self.b_down = nn.Parameter(torch.zeros(D, dtype=dtype), requires_grad=False) if spec.bias else None

    def linear(self, x: Tensor, which: str) -> Tensor:
        """``x @ W_which.T (+ b_which)`` for which in gate_up | up | down: the one place this module multiplies."""
        q = getattr(self, "q_" + which, None)  # an int4 weight (model/quant/) replaces w_which when quantized
        if q is not None:
            return q.linear(x, getattr(self, "b_" + which))
        return packed_linear(x, getattr(self, "w_" + which), getattr(self, "b_" + which),
                             self.__dict__.setdefault("_packs", {}), which)

    def residual_args(self, x: Tensor) -> tuple | None:
        """``waferline::ffn_residual``'s arguments after ``(h, norm, eps)`` when this FFN runs in that op for the rows
        of ``x`` (a dense FFN: no gate, its weights where a MoE block's shared expert's go): CPU, SwiGLU without
        biases, both weights int4 in waferline's CPU layout computing in x's dtype, one group size, or both bf16 for a
        bf16 x of at most ``few_rows()`` rows (the op's products then run linear_rows' kernel, as ``linear`` does for
        such rows); else None."""
        rows = x.numel() // x.shape[-1]
        if not (self.gated and self.act is F.silu and x.device.type == "cpu" and "linear" not in self.__dict__
                and rows <= MOE_FUSED_MAX_ROWS and kernels.available()):
            return None
        args = kept_args(self, "_residual_cache", x.dtype, lambda deps: self._residual_args(x.dtype, deps))
        if args is not None and args[-3] == 0 and rows > few_rows(x.dtype):  # (group 0: dense weights)
            return None
        return args

    def _residual_args(self, dtype: torch.dtype, deps: list) -> tuple | None:
        if "q_gate_up" not in self._modules and "q_down" not in self._modules:  # dense: bf16 only
            ws = []
            for which in ("gate_up", "down"):
                for key in ("w_" + which, "b_" + which):
                    deps.append((self._parameters, key, self._parameters.get(key)))
                w, bias = deps[-2][2], deps[-1][2]
                if w is None or bias is not None or w.dtype != torch.bfloat16 or dtype != torch.bfloat16:
                    return None
                ws += [w, _NONE]
            return (_NONE, _NONE, _NONE, 0, False, False, 1, 1, False, False, 1.0, [_NONE] * 4 + ws, 0, 0,
                    self.intermediate_size)
        parts = []
        for which in ("gate_up", "down"):
            for d, key in ((self._modules, "q_" + which), (self._parameters, "b_" + which)):
                deps.append((d, key, d.get(key)))
            q, bias = deps[-2][2], deps[-1][2]
            if q is None or bias is not None or q.backend != "cpu_waferline" or q.compute_dtype != dtype or q.lead:
                return None
            for key in ("packed", "scales_zeros"):
                deps.append((q._buffers, key, q._buffers.get(key)))
            parts.append(q)
        if parts[0].group_size != parts[1].group_size:
            return None
        return (_NONE, _NONE, _NONE, 0, False, False, 1, 1, False, False, 1.0,
                [_NONE] * 4 + [parts[0].packed, parts[0].scales_zeros, parts[1].packed, parts[1].scales_zeros],
                parts[0].group_size, 0, self.intermediate_size)

    def forward(self, x: Tensor) -> Tensor:
        if self.gated:
            h = gated_act(self.linear(x, "gate_up"), self.act)
        else:
            h = self.act(self.linear(x, "up"))
        return self.linear(h, "down")

    def load_hf(self, src: WeightSource, prefix: str, names: dict[str, str] | None = None) -> None:
        """Load from ``{prefix}{name}``. ``names`` maps roles to tensor names relative to ``prefix``:
        ``gate``/``up``/``down`` (defaults ``gate_proj.weight``/``up_proj.weight``/``down_proj.weight``) or a fused
        ``gate_up`` ``[2I, D]`` (gate rows first); biases default to the weight name with ``.weight`` -> ``.bias``
        and can be given as ``gate_bias``/``up_bias``/``down_bias``/``gate_up_bias``. With no ``names`` a fused
        ``gate_up_proj.weight`` is used when the separate gate/up tensors are absent."""
        D, I = self.hidden_size, self.intermediate_size
        n = {"gate": "gate_proj.weight", "up": "up_proj.weight", "down": "down_proj.weight"}
        if names:
            if "gate_up" in names:
                n.pop("gate"), n.pop("up")
            n.update(names)
        elif self.gated and not src.has(prefix + n["gate"]) and src.has(prefix + "gate_up_proj.weight"):
            n.pop("gate"), n.pop("up")
            n["gate_up"] = "gate_up_proj.weight"

        def bias_name(role: str) -> str:
            return n.get(role + "_bias") or n[role].removesuffix(".weight") + ".bias"

        bias = self.spec.bias
        if self.gated:
            if "gate_up" in n:
                copy_into(self.w_gate_up, src.get(prefix + n["gate_up"], (2 * I, D)))
                if bias:
                    copy_into(self.b_gate_up, src.get(prefix + bias_name("gate_up"), (2 * I,)))
            else:
                copy_into(self.w_gate_up[:I], src.get(prefix + n["gate"], (I, D)))
                copy_into(self.w_gate_up[I:], src.get(prefix + n["up"], (I, D)))
                if bias:
                    copy_into(self.b_gate_up[:I], src.get(prefix + bias_name("gate"), (I,)))
                    copy_into(self.b_gate_up[I:], src.get(prefix + bias_name("up"), (I,)))
        else:
            copy_into(self.w_up, src.get(prefix + n["up"], (I, D)))
            if bias:
                copy_into(self.b_up, src.get(prefix + bias_name("up"), (I,)))
        copy_into(self.w_down, src.get(prefix + n["down"], (D, I)))
        if bias:
            copy_into(self.b_down, src.get(prefix + bias_name("down"), (D,)))


# ----------------------------------------------------------------------------- mixture of experts


class MoE(nn.Module):
    """Router + E routed experts (top-k per token) + optional always-on shared experts.

    Parameters (``[out, in]`` orientation throughout):
      ``gate_weight [E, D]`` (fp32), ``gate_bias [E]`` (router_bias), buffer ``e_score_correction_bias [E]`` (fp32);
      ``w_gate_up [E, 2I, D]`` (gated; gate rows first, up rows second) or ``w_up [E, I, D]`` (plain),
      ``w_down [E, D, I]``, and with expert_bias ``b_gate_up [E, 2I]`` / ``b_up [E, I]``, ``b_down [E, D]``;
      ``shared``: a DenseFFN (width ``shared_intermediate``), ``shared_gate_weight [1, D]`` (shared_gate).

    All expert matmuls go through :meth:`expert_linear`, so a quantised backend only overrides that method.

    Routing (``route``): scores = softmax or sigmoid of the router logits; the correction bias is added for
    *selection only*; with n_group > 1 only experts in the ``topk_group`` best groups are eligible (groups ranked
    by the sum of their top-2 biased scores for sigmoid / noaux_tc routers (DeepSeek-V3, Nemotron-H), by their max
    score for softmax routers (DeepSeek-V2 group_limited_greedy)); the chosen experts' unbiased scores are
    renormalised (norm_topk_prob) and multiplied by routed_scaling. GPT-OSS (softmax_after_topk): top-k of the
    logits, softmax over the chosen.

    Execution: on an accelerator with bf16 experts, grouped products (``_grouped_forward``: no host read, fixed
    shapes); otherwise for few (token, expert) pairs (``N * top_k <= gather_max``, i.e. decode of small models) the
    chosen
    experts' weights are gathered and applied with one ``bmm`` (no host sync); otherwise tokens are sorted by expert
    and each expert that was hit runs once on its contiguous slice (one ``.tolist()`` of the per-expert counts).
    ``gather_max`` defaults to what keeps the gathered copy under ``GATHER_BYTES`` (at most 16 pairs); 0 disables it.
    The gather path is used on accelerators only: on CPU the sorted path measured faster at every size.

    ``act`` defaults to the flavor's expert activation (silu; relu2 for nemotron_h); GPT-OSS ignores it and uses
    the clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=l)``.
    """

    def __init__(
        self,
        spec: MoESpec,
        dtype: torch.dtype = torch.float32,
        act: str | None = None,
        flavor: str = "deepseek_v3",
        *,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        gather_max: int | None = None,
    ):
        super().__init__()
        if flavor not in MOE_PREFIXES:
            raise ConfigError(f"no MoE implementation for model_type {flavor!r}; known: {', '.join(FLAVORS)}")
        if spec.scoring not in ("softmax", "sigmoid"):
            raise ConfigError(f"MoE scoring {spec.scoring!r} is not supported; use softmax or sigmoid")
        E, D, I, k = spec.num_experts, spec.hidden_size, spec.expert_intermediate, spec.top_k
        if not 1 <= k <= E:
            raise ConfigError(f"MoE top_k={k} must be between 1 and num_experts={E}")
        if spec.n_group > 1:
            if E % spec.n_group:
                raise ConfigError(f"MoE num_experts={E} is not divisible by n_group={spec.n_group}")
            if not 1 <= spec.topk_group <= spec.n_group:
                raise ConfigError(f"MoE topk_group={spec.topk_group} must be between 1 and n_group={spec.n_group}")
            if k > spec.topk_group * (E // spec.n_group):
                raise ConfigError(f"MoE top_k={k} exceeds the {spec.topk_group} groups x {E // spec.n_group} experts "
                                  "that group-limited routing leaves eligible")
        self.spec = spec
        self.flavor = flavor
        self.num_experts, self.hidden_size, self.intermediate_size, self.top_k = E, D, I, k
        self.gated = spec.gated
        self.act_name = act or ("relu2" if flavor == "nemotron_h" else "silu")
        self.act = activation(self.act_name)
        self.clamped_swiglu = flavor == "gpt_oss"
        self.swiglu_alpha, self.swiglu_limit = float(swiglu_alpha), float(swiglu_limit)
        if self.clamped_swiglu and not self.gated:
            raise ConfigError("gpt_oss experts are gated (clamped SwiGLU); the MoESpec says gated=False")
        # group ranking rule: sum of top-2 (DeepSeek-V3 noaux_tc, sigmoid routers) or max (DeepSeek-V2)
        self.group_top2 = spec.correction_bias or spec.scoring == "sigmoid"
        if gather_max is None:
            # the gather path copies the chosen experts' weights: use it only while that copy stays small
            expert_bytes = (3 if self.gated else 2) * D * I * torch.empty(0, dtype=dtype).element_size()
            gather_max = max(0, min(16, GATHER_BYTES // max(expert_bytes, 1)))
        self.gather_max = gather_max
        self.gather_on_cpu = False  # tests force the gather path on CPU to check it against the reference
        self.grouped_on_cpu = False  # ... and the grouped one (_grouped_forward)

        def p(*shape: int, dt: torch.dtype = dtype) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dt), requires_grad=False)

        self.gate_weight = p(E, D, dt=torch.float32)
        self.gate_bias = p(E, dt=torch.float32) if spec.router_bias else None
        if spec.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        if self.gated:
            self.w_gate_up = p(E, 2 * I, D)
            self.b_gate_up = p(E, 2 * I) if spec.expert_bias else None
        else:
            self.w_up = p(E, I, D)
            self.b_up = p(E, I) if spec.expert_bias else None
        self.w_down = p(E, D, I)
        self.b_down = p(E, D) if spec.expert_bias else None
        if spec.shared_intermediate:
            self.shared = DenseFFN(
                DenseFFNSpec(D, spec.shared_intermediate, gated=spec.gated, bias=spec.shared_bias), dtype, self.act_name
            )
        else:
            self.shared = None
        self.shared_gate_weight = p(1, D) if (spec.shared_gate and self.shared is not None) else None

    # ------------------------------------------------------------------ routing

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Routing weights (fp32) and expert indices (int64), both ``[N, top_k]``, for tokens ``x [N, D]``."""
        s = self.spec
        if x.device.type == "cpu" and self.gate_weight.dtype == torch.float32 and kernels.available():
            # the chain below as one fused op (waferline.kernels)
            return torch.ops.waferline.moe_route(
                x, self.gate_weight, _NONE if self.gate_bias is None else self.gate_bias,
                _NONE if self.e_score_correction_bias is None else self.e_score_correction_bias, self.top_k,
                s.scoring == "softmax", s.softmax_after_topk, s.n_group, s.topk_group, self.group_top2,
                s.norm_topk_prob, s.routed_scaling)
        g = self.gate_weight if self.gate_weight.dtype == torch.float32 else self.gate_weight.float()
        b = (
            None
            if self.gate_bias is None
            else (self.gate_bias if self.gate_bias.dtype == torch.float32 else self.gate_bias.float())
        )
        logits = F.linear(x if x.dtype == torch.float32 else x.float(), g, b)
        if s.softmax_after_topk:
            top, idx = logits.topk(self.top_k, dim=-1)
            return top.softmax(dim=-1), idx
        scores = logits.softmax(dim=-1) if s.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if s.n_group > 1 and s.topk_group < s.n_group:
            N = x.shape[0]
            grouped = choice.view(N, s.n_group, self.num_experts // s.n_group)
            if self.group_top2:
                group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.amax(dim=-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(s.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.num_experts // s.n_group, dim=1), float("-inf"))
        top, idx = choice.topk(self.top_k, dim=-1)
        w = top if choice is scores else scores.gather(1, idx)  # (chosen by the scores themselves: their top values)
        if s.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        if s.routed_scaling != 1.0:
            w = w * s.routed_scaling
        return w, idx

    # ------------------------------------------------------------------ experts

    def expert_linear(self, x: Tensor, which: str, experts: int | Tensor) -> Tensor:
        """Apply expert weight ``which`` (gate_up | up | down) to ``x``: the ONE place experts multiply.

        ``experts`` an int: ``x [n, in]`` all go through that expert -> ``[n, out]``.
        ``experts`` a LongTensor ``[M]``: row m of ``x [M, in]`` goes through expert ``experts[m]`` -> ``[M, out]``.
        ``experts`` a :class:`Groups`: ``x``'s rows sorted by expert, one grouped product (16-bit weights only).
        """
        b = getattr(self, "b_" + which)
        q = getattr(self, "q_" + which, None)  # an int4 weight (model/quant/) replaces w_which when quantized
        if q is not None:
            return q.expert_linear(x, experts, b)
        w = getattr(self, "w_" + which)
        if isinstance(experts, Groups):  # (each expert's weight read once; the groups' sizes stay on the device)
            y = torch._grouped_mm(x, w.transpose(1, 2), offs=experts.offs)
            return y if b is None else y + b.index_select(0, experts.ids)
        if isinstance(experts, int):
            return packed_linear(
                x,
                w[experts],
                None if b is None else b[experts],
                self.__dict__.setdefault("_packs", {}),
                (which, experts),
            )
        y = torch.bmm(w.index_select(0, experts), x.unsqueeze(-1)).squeeze(-1)
        return y if b is None else y + b.index_select(0, experts)

    def _expert_ffn(self, x: Tensor, experts: int | Tensor) -> Tensor:
        if not self.gated:
            return self.expert_linear(self.act(self.expert_linear(x, "up", experts)), "down", experts)
        h = self.expert_linear(x, "gate_up", experts)
        if self.clamped_swiglu:
            gate, up = h.chunk(2, dim=-1)
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))
        else:
            h = gated_act(h, self.act)
        return self.expert_linear(h, "down", experts)

    def experts_forward(self, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
        """Sum over the chosen experts of weight * expert(x): ``x [N, D]``, ``weights``/``idx [N, k]`` -> ``[N, D]``."""
        N, k = idx.shape
        if self._grouped(x):
            return self._grouped_forward(x, weights, idx)
        # the gather path saves a host sync, which only pays on an accelerator: on CPU the sorted path is faster
        # (sol-mini decode, 1 thread: 115 vs 97 tok/s at batch 1, 525 vs 198 at batch 8)
        if N * k <= self.gather_max and (x.device.type != "cpu" or self.gather_on_cpu):
            flat = idx.reshape(-1)
            y = self._expert_ffn(x.repeat_interleave(k, dim=0), flat).float()
            return (y.view(N, k, -1) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        if N == 1 and x.device.type == "cpu":
            # one token (batch-1 decode): its k experts one after another, weights read back once — the fewest ops
            acc = None
            for e, w in zip(idx[0].tolist(), weights[0].tolist()):
                h = self._expert_ffn(x, e)
                h = h.float().mul_(w) if h.dtype != torch.float32 else h.mul_(w)
                acc = h if acc is None else acc.add_(h)
            return acc.to(x.dtype) if acc.dtype != x.dtype else acc
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x.index_select(0, token)
        out = torch.empty(N * k, self.hidden_size, dtype=torch.float32, device=x.device)
        start = 0
        for e, c in enumerate(counts):
            if c:
                out[start:start + c] = self._expert_ffn(xs[start:start + c], e).float()
                start += c
        out.mul_(weights.reshape(-1)[order].unsqueeze(-1))
        y = torch.zeros(N, self.hidden_size, dtype=torch.float32, device=x.device).index_add_(0, token, out)
        return y.to(x.dtype)

    def _grouped(self, x: Tensor) -> bool:
        """Whether the routed experts run as grouped products (``torch._grouped_mm``): on an accelerator (or on CPU
        where a test asks, ``grouped_on_cpu``), bf16, experts not int4, no multiply hook (``expert_linear`` patched)."""
        return ((x.device.type != "cpu" or self.grouped_on_cpu) and x.dtype == torch.bfloat16
                and hasattr(torch, "_grouped_mm") and "expert_linear" not in self.__dict__
                and not any(n in self._modules for n in ("q_gate_up", "q_up", "q_down")))

    def _grouped_forward(self, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
        """experts_forward without a host read: the (token, slot) pairs sorted by expert on the device, each
        expert's rows through its weights in one grouped product per projection (an expert no row chose is not
        read), the outputs put back in pair order and summed per token in fp32. Fixed shapes for a fixed number of
        tokens, so a decode step that holds it can be captured (a CUDA graph; engine/graphs.py)."""
        N, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        ids = flat.index_select(0, order)
        # one past each expert's last row: how many sorted ids are <= e (one search, where counting them per expert
        # and summing took four operations)
        experts = torch.arange(self.num_experts, dtype=ids.dtype, device=x.device)
        offs = torch.searchsorted(ids, experts, right=True, out_int32=True)
        y = self._expert_ffn(x.index_select(0, order // k), Groups(offs, ids)).float()
        y.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(-1))
        out = torch.empty_like(y).index_copy_(0, order, y)
        return out.view(N, k, -1).sum(dim=1).to(x.dtype)

    def _fused_weights(self, x: Tensor, deps: list | None = None) -> tuple | None:
        """The arguments of ``waferline::moe_ffn`` after ``(x, weights, idx)`` when this block can run as that one op
        on ``x`` (CPU, SwiGLU experts without biases, weights of x's dtype or in waferline's CPU int4 layout, no matmul
        hooks installed), else None. ``deps``: where each tensor was looked up is appended to it, ``(dict, key,
        value)``, so that a cached copy can be checked against the module as it is now (:meth:`_fused_args`)."""
        if not (self.gated and self.act is F.silu and not self.clamped_swiglu and not self.spec.expert_bias
                and self.shared_gate_weight is None and not (self.gather_on_cpu or self.grouped_on_cpu)
                and "expert_linear" not in self.__dict__ and x.device.type == "cpu"
                and x.shape[0] <= MOE_FUSED_MAX_ROWS and kernels.available()):
            return None
        sh = self.shared
        if sh is not None and not (sh.gated and sh.act is F.silu and sh.b_down is None and "linear" not in sh.__dict__):
            return None
        groups: set[int] = set()
        seen = deps if deps is not None else []

        def look(d: dict, key: str) -> Any:
            v = d.get(key)
            seen.append((d, key, v))
            return v

        def weight(owner: nn.Module, which: str) -> tuple[Tensor, Tensor] | None:
            q = look(owner._modules, "q_" + which)
            if q is None:
                w = look(owner._parameters, "w_" + which)
                return (w, _NONE) if w is not None and w.dtype == x.dtype and w.is_contiguous() else None
            if q.backend != "cpu_waferline" or q.compute_dtype != x.dtype:
                return None
            groups.add(q.group_size)
            return look(q._buffers, "packed"), look(q._buffers, "scales_zeros")

        parts = [weight(self, "gate_up"), weight(self, "down")]
        if sh is not None:
            look(self._modules, "shared")
            look(sh.__dict__, "linear")
            parts += [weight(sh, "gate_up"), weight(sh, "down")]
        else:
            parts += [(_NONE, _NONE)] * 2
        if any(p is None for p in parts) or len(groups) > 1:
            return None
        return (*(t for p in parts for t in p), groups.pop() if groups else 0, self.intermediate_size,
                sh.intermediate_size if sh is not None else 0)

    def _fused_args(self, x: Tensor) -> tuple[tuple, tuple] | None:
        """``waferline::moe_route``'s and ``waferline::moe_ffn``'s arguments after ``x`` (and the routing), when both
        ops apply to ``x`` (see :meth:`route` and :meth:`_fused_weights`), else None. Built once per dtype and reused
        while every tensor they hold is still the one the module holds (checked by identity at each call: quantizing,
        a hook, ``.to()`` rebuild them), so the decode step does not rebuild them per token."""
        if not self._fusable(x, x.shape[0]):
            return None
        return kept_args(self, "_fused_cache", x.dtype, lambda deps: self._build_fused_args(x, deps))

    def _fusable(self, x: Tensor, rows: int) -> bool:
        """The per-call conditions of moe_route + moe_ffn for ``rows`` tokens of ``x`` (the rest are checked when the
        arguments are built)."""
        return (x.device.type == "cpu" and rows <= MOE_FUSED_MAX_ROWS
                and not (self.gather_on_cpu or self.grouped_on_cpu) and "expert_linear" not in self.__dict__
                and kernels.available())

    def _build_fused_args(self, x: Tensor, deps: list) -> tuple[tuple, tuple] | None:
        deps += [(d, k, d.get(k)) for d, k in ((self._parameters, "gate_weight"), (self._parameters, "gate_bias"),
                                                (self._buffers, "e_score_correction_bias"))]
        gw, gb, cb = (v for _, _, v in deps)
        ffn = self._fused_weights(x, deps)
        if ffn is None or gw is None or gw.dtype != torch.float32:
            return None
        s = self.spec
        route = (gw, _NONE if gb is None else gb, _NONE if cb is None else cb, self.top_k, s.scoring == "softmax",
                 s.softmax_after_topk, s.n_group, s.topk_group, self.group_top2, s.norm_topk_prob, s.routed_scaling)
        return route, ffn

    def residual_args(self, x: Tensor) -> tuple | None:
        """``waferline::ffn_residual``'s arguments after ``(h, norm, eps)`` when this block runs as moe_route +
        moe_ffn for the rows of ``x`` (see :meth:`_fused_args`), else None; kept whole between calls (kept_args)."""
        if not self._fusable(x, x.numel() // self.hidden_size):
            return None

        def build(deps: list) -> tuple | None:
            args = self._build_fused_args(x.reshape(-1, self.hidden_size), deps)
            return None if args is None else (*args[0], list(args[1][:8]), *args[1][8:])

        return kept_args(self, "_residual_cache", x.dtype, build)

    def forward(self, x: Tensor) -> Tensor:
        """``x [N, D]`` (N tokens, any batch flattened) -> ``[N, D]``."""
        shape = x.shape
        x = x.reshape(-1, self.hidden_size)
        args = self._fused_args(x)
        if args is not None:  # routing, routed experts, their weighted sum and the shared expert: two fused ops
            weights, idx = torch.ops.waferline.moe_route(x, *args[0])
            return torch.ops.waferline.moe_ffn(x.contiguous(), weights, idx, *args[1]).reshape(shape)
        weights, idx = self.route(x)
        fused = self._fused_weights(x)
        if fused is not None:  # routed experts, their weighted sum and the shared expert as one op (waferline.kernels)
            return torch.ops.waferline.moe_ffn(x.contiguous(), weights, idx, *fused).reshape(shape)
        y = self.experts_forward(x, weights, idx)
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate_weight is not None:
                s = torch.sigmoid(F.linear(x, self.shared_gate_weight)) * s
            y = y + s
        return y.reshape(shape)

    # ------------------------------------------------------------------ loading

    def load_hf(self, src: WeightSource, prefix: str) -> None:
        """Load this block from a Hugging Face checkpoint; ``prefix`` as in :data:`MOE_PREFIXES` (e.g.
        ``model.layers.3.mlp.``). Accepts per-expert keys and the fused ``[E, ...]`` layouts."""
        f = self.flavor
        if f == "granitemoehybrid":
            moe = prefix + "block_sparse_moe."
            self._load_router(src, moe, ["router.layer.weight", "router.weight"])
            self._load_granite_experts(src, moe)
            if self.shared is not None:
                self.shared.load_hf(
                    src, prefix + "shared_mlp.", {"gate_up": "input_linear.weight", "down": "output_linear.weight"}
                )
            return
        if f == "gpt_oss":
            self._load_router(src, prefix, ["router.weight"])
            self._load_gpt_oss_experts(src, prefix)
            return
        self._load_router(src, prefix, ["gate.weight"])
        if self.e_score_correction_bias is not None:
            name = prefix + "gate.e_score_correction_bias"
            if not src.has(name) and src.has(prefix + "e_score_correction_bias"):
                name = prefix + "e_score_correction_bias"
            copy_into(self.e_score_correction_bias, src.get(name, (self.num_experts,)))
        if f in ("mixtral", "kimi_linear") and src.has(prefix + "experts.0.w1.weight"):
            roles = {"gate": "w1.weight", "up": "w3.weight", "down": "w2.weight"}
        else:
            roles = {"gate": "gate_proj.weight", "up": "up_proj.weight", "down": "down_proj.weight"}
        self._load_experts(src, prefix + "experts.", roles)
        if self.shared is not None:
            self.shared.load_hf(
                src, prefix + ("shared_expert." if f in ("qwen2_moe", "qwen3_next") else "shared_experts.")
            )
        if self.shared_gate_weight is not None:
            copy_into(self.shared_gate_weight, src.get(prefix + "shared_expert_gate.weight", (1, self.hidden_size)))
        elif self.spec.shared_gate and src.has(prefix + "shared_expert_gate.weight"):  # (it gates a shared expert of
            src.get(prefix + "shared_expert_gate.weight", (1, self.hidden_size))  # width 0: a sum of nothing)

    def _load_router(self, src: WeightSource, prefix: str, candidates: list[str]) -> None:
        name = next((prefix + c for c in candidates if src.has(prefix + c)), prefix + candidates[0])
        copy_into(self.gate_weight, src.get(name, (self.num_experts, self.hidden_size)))
        if self.gate_bias is not None:
            copy_into(self.gate_bias, src.get(name.removesuffix(".weight") + ".bias", (self.num_experts,)))

    def _load_experts(self, src: WeightSource, ep: str, roles: dict[str, str]) -> None:
        """Experts under ``ep`` (``...experts.``): per-expert ``{e}.{role}`` keys or fused
        ``gate_up_proj``/``up_proj``/``down_proj``."""
        E, D, I = self.num_experts, self.hidden_size, self.intermediate_size
        bias = self.spec.expert_bias
        first = roles["gate"] if self.gated else roles["up"]
        if src.has(f"{ep}0.{first}") or not (
            src.has(ep + "down_proj") or src.has(ep + "gate_up_proj") or src.has(ep + "up_proj")
        ):
            for e in range(E):
                if self.gated:
                    copy_into(self.w_gate_up[e, :I], src.get(f"{ep}{e}.{roles['gate']}", (I, D)))
                    copy_into(self.w_gate_up[e, I:], src.get(f"{ep}{e}.{roles['up']}", (I, D)))
                else:
                    copy_into(self.w_up[e], src.get(f"{ep}{e}.{roles['up']}", (I, D)))
                copy_into(self.w_down[e], src.get(f"{ep}{e}.{roles['down']}", (D, I)))
                if bias:
                    b = {r: f"{ep}{e}.{n.removesuffix('.weight')}.bias" for r, n in roles.items()}
                    if self.gated:
                        copy_into(self.b_gate_up[e, :I], src.get(b["gate"], (I,)))
                        copy_into(self.b_gate_up[e, I:], src.get(b["up"], (I,)))
                    else:
                        copy_into(self.b_up[e], src.get(b["up"], (I,)))
                    copy_into(self.b_down[e], src.get(b["down"], (D,)))
            return
        if self.gated:
            copy_into(self.w_gate_up, src.get(ep + "gate_up_proj", (E, 2 * I, D)))
        else:
            copy_into(self.w_up, src.get(ep + "up_proj", (E, I, D)))
        copy_into(self.w_down, src.get(ep + "down_proj", (E, D, I)))
        if bias:
            if self.gated:
                copy_into(self.b_gate_up, src.get(ep + "gate_up_proj_bias", (E, 2 * I)))
            else:
                copy_into(self.b_up, src.get(ep + "up_proj_bias", (E, I)))
            copy_into(self.b_down, src.get(ep + "down_proj_bias", (E, D)))

    def _load_granite_experts(self, src: WeightSource, moe: str) -> None:
        E, D, I = self.num_experts, self.hidden_size, self.intermediate_size
        if not self.gated:
            raise ConfigError("granitemoehybrid experts are gated; the MoESpec says gated=False")
        up = (
            moe + "input_linear.weight"
            if src.has(moe + "input_linear.weight") or not src.has(moe + "experts.gate_up_proj")
            else moe + "experts.gate_up_proj"
        )
        down = (
            moe + "output_linear.weight"
            if src.has(moe + "output_linear.weight") or not src.has(moe + "experts.down_proj")
            else moe + "experts.down_proj"
        )
        copy_into(self.w_gate_up, src.get(up, (E, 2 * I, D)))
        copy_into(self.w_down, src.get(down, (E, D, I)))

    def _load_gpt_oss_experts(self, src: WeightSource, prefix: str) -> None:
        """GPT-OSS fused experts: ``gate_up_proj [E, D, 2I]`` with gate/up interleaved on the last dim (even = gate,
        odd = up), ``down_proj [E, I, D]``; both transposed relative to ``[out, in]``."""
        E, D, I = self.num_experts, self.hidden_size, self.intermediate_size
        ep = prefix + "experts."
        if src.has(ep + "gate_up_proj_blocks"):
            raise CheckpointError(f"{ep}gate_up_proj is stored as MXFP4 blocks/scales; dequantise the checkpoint to "
                                  "bf16 first (e.g. load it with transformers and save_pretrained it)")
        gu = src.get(ep + "gate_up_proj", (E, D, 2 * I))
        copy_into(self.w_gate_up[:, :I], gu[..., 0::2].transpose(1, 2))
        copy_into(self.w_gate_up[:, I:], gu[..., 1::2].transpose(1, 2))
        copy_into(self.w_down, src.get(ep + "down_proj", (E, I, D)).transpose(1, 2))
        if self.spec.expert_bias:
            gb = src.get(ep + "gate_up_proj_bias", (E, 2 * I))
            copy_into(self.b_gate_up[:, :I], gb[:, 0::2])
            copy_into(self.b_gate_up[:, I:], gb[:, 1::2])
            copy_into(self.b_down, src.get(ep + "down_proj_bias", (E, D)))


__all__ = ["DenseFFN", "MoE", "activation", "hf_act", "moe_kwargs", "moe_prefix", "dense_prefix", "dense_names",
           "MOE_PREFIXES", "DENSE_PREFIXES", "DENSE_NAMES", "FLAVORS", "GATHER_BYTES"]
