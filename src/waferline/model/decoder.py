"""One generic decoder for every architecture: layers built from the ModelSpec, weights named per model_type."""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from waferline import kernels
from waferline.errors import ConfigError
from waferline.model.attention import GQAttention, MLAttention, share_pages
from waferline.model.context import StepBatch
from waferline.model.hybrids import LINEAR_HYBRIDS, hf_source
from waferline.model.hybrids import build_mixer as build_hybrid_mixer
from waferline.model.layers import Linear, RMSNorm, Rotary, few_rows, packed_linear
from waferline.model.linear_attention import DeltaRuleMixer
from waferline.model.moe import DenseFFN, MoE, dense_names, hf_act, moe_kwargs
from waferline.model.sparse_attention import DSAttention
from waferline.model.ssm import Mamba2Mixer, hf_mixer_kwargs
from waferline.model.v4_attention import V4Attention
from waferline.model.v4_blocks import HyperHead, V4Layer, hc_mult
from waferline.model.weights import WeightSource, copy_into
from waferline.spec.configs import ENGINE_MODEL_TYPES, partial_rotary
from waferline.spec.model import (
    AttentionSpec,
    CompressedAttentionSpec,
    DenseFFNSpec,
    DSASpec,
    LayerSpec,
    Mamba2Spec,
    MLASpec,
    ModelSpec,
    MoESpec,
)


@dataclass(frozen=True)
class Naming:
    """Where an architecture keeps its tensors in a Hugging Face checkpoint."""

    root: str = "model."
    embed: str = "embed_tokens"
    final_norm: str = "norm"
    norm_mixer: str = "input_layernorm"
    norm_ffn: str = "post_attention_layernorm"
    attn: str = "self_attn"
    ssm: str = "mamba"
    ffn: str = "mlp"
    dense: str | None = None  # a dense FFN's sub-prefix where it is not ``ffn``'s (its tensor names: moe.dense_names)


NAMING = {
    "mixtral": Naming(ffn="block_sparse_moe"),
    "bamba": Naming(final_norm="final_layernorm", norm_ffn="pre_ff_layernorm", ffn="feed_forward"),
    # the MoE loader finds block_sparse_moe.* and shared_mlp.* itself; a dense layer (no experts) is shared_mlp alone
    "granitemoehybrid": Naming(ffn="", dense="shared_mlp"),
    "nemotron_h": Naming(root="backbone.", embed="embeddings", final_norm="norm_f", norm_mixer="norm", norm_ffn="norm",
                         attn="mixer", ssm="mixer", ffn="mixer"),
    "qwen3_next": Naming(ssm="linear_attn"),
    "kimi_linear": Naming(ssm="self_attn", ffn="block_sparse_moe"),
}


def _norm_eps(cfg: dict[str, Any]) -> float:
    for k in ("rms_norm_eps", "layer_norm_epsilon", "norm_eps"):
        if cfg.get(k) is not None:
            return float(cfg[k])
    return 1e-6


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + m·mixer(norm(x)), then x + m·ffn(norm(x)); either part may be absent."""

    def __init__(self, spec: LayerSpec, model_type: str, cfg: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        self.spec, self.flavor = spec, model_type
        eps = _norm_eps(cfg)
        d = spec.hidden_size
        self.residual_multiplier = (
            float(cfg.get("residual_multiplier") or 1.0) if model_type == "granitemoehybrid" else 1.0
        )
        self.mixer_norm = RMSNorm(d, eps, dtype) if spec.mixer is not None else None
        self.ffn_norm = RMSNorm(d, eps, dtype) if spec.ffn is not None else None
        self.mixer = _build_mixer(spec, model_type, cfg, dtype, eps)
        self.ffn = _build_ffn(spec, model_type, cfg, dtype)

    def new_cache(self, num_slots: int, device: torch.device | str | None = None) -> Any:
        return self.mixer.new_cache(num_slots, device) if self.mixer is not None else None

    def forward(self, x: torch.Tensor, cache: Any, batch: StepBatch) -> torch.Tensor:
        return self._run(x, cache, batch, self._fused_step(x, cache, batch))

    def _run(self, x: torch.Tensor, cache: Any, batch: StepBatch, fused: tuple[str, tuple] | None) -> torch.Tensor:
        """The layer's step, given what :meth:`_fused_step` returned for it."""
        if fused is not None:
            whole, args = fused
            if whole:  # the whole layer as one op (waferline::mla_moe_layer or mamba_ffn_layer)
                out = getattr(torch.ops.waferline, whole)(x, *args)
                if len(out) > 2:  # a Mamba-2 verify's record, kept for the rewind
                    self.mixer.keep_record(cache, batch.slots, out[2:])
                return out[0]
            if self.mixer is not None:  # the mixer by its modules, then the FFN half as one op
                x = x + self.mixer(self.mixer_norm(x), cache, batch)
            return torch.ops.waferline.ffn_residual(x, self.ffn_norm.weight, self.ffn_norm.eps, *args)[0]
        m = self.residual_multiplier
        if self.mixer is not None:
            h = self.mixer(self.mixer_norm(x), cache, batch)
            x = x + h * m if m != 1.0 else x + h
        if self.ffn is not None:
            B, T, D = x.shape
            h = self.ffn(self.ffn_norm(x).view(B * T, D)).view(B, T, D)
            x = x + h * m if m != 1.0 else x + h
        return x

    def _fused_step(self, x: torch.Tensor, cache: Any, batch: StepBatch) -> tuple[str, tuple] | None:
        """How much of this layer's step runs as one op: ``(op name, its arguments after x)`` for the whole layer
        (``mla_moe_layer``, ``mamba_ffn_layer``, ``gqa_moe_layer``), ``("", waferline::ffn_residual's arguments after
        (h, norm, eps))`` for its FFN half, None for neither (the modules below, which compute the same numbers).

        The FFN half: a MoE block that runs as moe_route + moe_ffn (MoE.residual_args) or a SwiGLU FFN, int4 or bf16
        (DenseFFN.residual_args), the norm in x's dtype. The whole layer: that, and for a decode step or a speculative
        verify (a few tokens per row) an MLA mixer that runs as ``mla_attend_int4`` (MLAttention.step_args: the tokens
        as rows), a GQA mixer that runs as gqa_moe_layer's attention half (GQAttention.step_args, likewise) or a
        Mamba-2 mixer that runs as int4 in_proj, ``mamba2_mix`` and int4 out_proj (Mamba2Mixer.step_args:
        recording the verify's trail). Either needs no residual multiplier
        and no forward hook on the parts the op replaces (it does not call them, so a hook there keeps the modules'
        path; hooks marked LABEL_ONLY excepted). Their measured effect: docs/results/decode-speed.md."""
        m = self._modules  # (this runs per layer and token: the dicts, not nn.Module's __getattr__)
        mix, ffn, n1, n2 = m.get("mixer"), m.get("ffn"), m.get("mixer_norm"), m.get("ffn_norm")
        if type(ffn) not in (MoE, DenseFFN) or self.residual_multiplier != 1.0 or not x.is_contiguous():
            return None
        w2 = n2._parameters["weight"]
        if w2.dtype != x.dtype or _hooked(ffn, n2):
            return None
        ffn_args = ffn.residual_args(x)
        if ffn_args is None:
            return None
        whole = _WHOLE_LAYER_OPS.get(type(mix))
        if whole:
            w1 = n1._parameters["weight"]
            if w1.dtype == x.dtype and not _hooked(mix, n1):
                mixer_args = mix.step_args(x, cache, batch)
                if mixer_args is not None:
                    return whole, (w1, n1.eps, *mixer_args, w2, n2.eps, *ffn_args)
        return "", ffn_args


_WHOLE_LAYER_OPS = {MLAttention: "mla_moe_layer", Mamba2Mixer: "mamba_ffn_layer",  # the mixers a layer op takes
                    GQAttention: "gqa_moe_layer"}
_PLAN_MAX_ROWS = 8  # steps of at most this many token rows (decode steps, verifies) replay a _StepPlan
_USE_PROGRAM = True  # a _StepPlan replays through its StepProgram (False: op by op from Python; tests compare both)


class _StepPlan:
    """A decode step's (or verify's) layer calls, kept from one step to the next when every layer ran as one
    whole-layer op: each layer's op and its arguments, of which only the mixer's per-step values (``step_dynamic``:
    rotary rows, cache tensors, slots, positions) are looked up again. A step then runs the ops back to back instead
    of each layer's module call and ``_fused_step`` (~35-45 us a layer in a decode step on a 2-core CPU, where the
    Python runs with cold caches between ~200 us ops). The plan holds for steps of the same shape, dtype and caches
    while every tensor and module the arguments were built from is still the one its owner holds (checked by
    identity, as kept_args does: quantizing, ``.to()`` or loading rebuild it), no forward hook is set anywhere on the
    path (a hook needs the module calls) and the Mamba-2 caches keep (or not) their verify trail as when it was
    recorded. Anything else runs the layers as modules. The same ops on the same arguments: the same numbers."""

    def __init__(self, key: tuple, caches: list[Any]):
        self.key = key
        self.caches = [weakref.ref(c) for c in caches]
        self.trails = tuple(getattr(c, "keep_trail", None) for c in caches)
        self.layers: list[tuple] = []  # (op name, argument list, dynamic positions, mixer)
        self.hooks: list[dict] = [_global_hooks.forward, _global_hooks.pre]
        self.dicts: list[dict] = []
        self.keys: list[str] = []
        self.values: list[Any] = []
        self.consts: list[tuple] = []  # (Mamba-2 mixer, its derived constants)

    def _dep(self, d: dict, key: str) -> None:
        self.dicts.append(d), self.keys.append(key), self.values.append(d.get(key))

    @staticmethod
    def key_of(x: torch.Tensor, dtype: torch.dtype | None = None, width: int | None = None) -> tuple:
        """A plan's key: the step's hidden states x [B, T, D] (or, given their dtype and width D, its tokens [B, T])."""
        if dtype is None:
            return x.dtype, x.device, tuple(x.shape), kernels.available()
        return dtype, x.device, (*x.shape, width), kernels.available()

    @classmethod
    def record(cls, model: DecoderModel, x: torch.Tensor, caches: list[Any], batch: StepBatch):
        """Run the layers as modules (what forward_layers does) and return (output, a plan of this step or None)."""
        plan: _StepPlan | None = None
        ok = (x.is_contiguous() and not (_global_hooks.forward or _global_hooks.pre)
              and all(c is not None for c in caches))
        for layer, cache in zip(model.layers, caches):
            if not ok or type(layer) is not DecoderLayer or layer._forward_hooks or layer._forward_pre_hooks:
                ok, plan = False, None
                x = layer(x, cache, batch)
                continue
            fused = layer._fused_step(x, cache, batch)
            if fused is not None and fused[0]:
                if plan is None:  # (built at the first layer op: a model whose layers are not ops builds none)
                    plan = cls(cls.key_of(x), caches)
                plan.add(layer, *fused)
            else:
                ok, plan = False, None
            x = layer._run(x, cache, batch, fused)  # (what layer(x, cache, batch) runs: it has no hooks)
        return x, plan

    def add(self, layer: DecoderLayer, whole: str, args: tuple) -> None:
        mods = layer._modules
        mix, ffn = mods["mixer"], mods["ffn"]
        for name in ("mixer", "ffn", "mixer_norm", "ffn_norm"):
            self._dep(mods, name)
        for norm in (mods["mixer_norm"], mods["ffn_norm"]):
            self._dep(norm._parameters, "weight")
        for owner, slot in ((ffn, "_residual_cache"), (mix, "_int4_cache")):
            c = owner.__dict__[slot]  # kept_args' (dtype, dicts, keys, values, args): its deps, and itself
            self.dicts += c[1]
            self.keys += c[2]
            self.values += c[3]
            self._dep(owner.__dict__, slot)
        for key in ("gather_on_cpu", "expert_linear"):
            self._dep(ffn.__dict__, key)
        if isinstance(mix, MLAttention):
            self._dep(mix.__dict__, "_absorbed")
        elif isinstance(mix, Mamba2Mixer):
            for key in ("conv_weight", "conv_bias"):
                self._dep(mix._parameters, key)
            self.consts.append((mix, mix._consts()))
        for m in (layer, mix, ffn, mods["mixer_norm"], mods["ffn_norm"]):
            self.hooks += m._forward_hooks, m._forward_pre_hooks
        self._dep(torch.ops.waferline.__dict__, whole)  # (an op wrapped in Python since: record again, and call it)
        dyn = tuple(2 + i for i in mix.STEP_DYNAMIC)  # (after the mixer norm's weight and epsilon)
        self.layers.append((whole, [None if i in dyn else a for i, a in enumerate(args)], dyn, mix))

    def valid(self, x: torch.Tensor, caches: list[Any]) -> bool:
        return (len(caches) == len(self.caches) and x.is_contiguous()
                and all(map(operator.is_, (r() for r in self.caches), caches))
                and self.trails == tuple(getattr(c, "keep_trail", None) for c in caches)
                and not any(map(len, self.hooks))
                and all(map(operator.is_, map(dict.get, self.dicts, self.keys), self.values))
                and all(m._consts() is c for m, c in self.consts))

    def program(self, tail: tuple = ()) -> Any:
        """The layers as a ``waferline.StepProgram`` (kernels/cpu/program.h), built at the first replay: it keeps the
        ops'
        arguments on the C++ side and runs the ops back to back through the dispatcher, so a step crosses from Python
        once instead of once per layer. With ``tail`` (DecoderModel.step_logits': the embedding's weight, the final
        norm's weight and epsilon, the head's weight and its int8 scales or None) the program also embeds the tokens
        first and ends with the norm, the head and the argmax; one is kept per tail, rebuilt when a tail tensor is
        replaced. None where the ops are not torch's own (wrapped in Python: they are called from Python) or the program
        cannot
        take an argument (the replay op by op then runs)."""
        progs = self.__dict__.setdefault("_programs", {})
        key = tuple(map(id, tail))
        hit = progs.get(key)
        if hit is not None and all(map(operator.is_, hit[0], tail)):
            return hit[1]
        prog = None
        if all(type(getattr(torch.ops.waferline, whole)) is torch._ops.OpOverloadPacket for whole, *_ in self.layers):
            try:
                prog = torch.classes.waferline.StepProgram()
                if tail:  # (the same op nn.Embedding calls, with its defaults: no padding index)
                    prog.add("aten::embedding", [tail[0], None, -1, False, False], [], 1, 1, False)
                for whole, args, dyn, _ in self.layers:
                    prog.add("waferline::" + whole, [None] + [list(a) if isinstance(a, tuple) else a for a in args],
                             [1 + i for i in dyn], 0, 2, False)
                if tail:
                    prog.add("waferline::rms_norm", [None, tail[1], tail[2]], [], 0, 1, True)  # (h kept)
                    if tail[4] is not None:  # the int8 head (project's op)
                        prog.add("waferline::int8_linear", [None, tail[3], tail[4]], [], 0, 1, False)
                    elif tail[3].dtype == torch.bfloat16:  # a bf16 head at few rows: linear's op, then .float()
                        prog.add("waferline::linear_rows", [None, tail[3]], [], 0, 1, False)
                        prog.add("aten::_to_copy", [None, torch.float32, None, None, None, False, None], [], 0, 1,
                                 False)
                    else:  # an fp32 head: F.linear's op (.float() returns its result)
                        prog.add("aten::linear", [None, tail[3], None], [], 0, 1, False)
                    prog.add("waferline::argmax_rows", [None], [], 0, 1, True)  # (the logits kept)
            except (RuntimeError, TypeError, AttributeError):
                prog = None
        if len(progs) >= 2:  # (the layers' own and a decode step's; a replaced tensor's program goes)
            del progs[next(iter(progs))]
        progs[key] = (tail, prog)
        return prog

    def run(self, x: torch.Tensor, caches: list[Any], batch: StepBatch, prog: Any = None) -> Any:
        """The layers' step on x (or, with a tail ``prog``, on the tokens x: then (greedy tokens, hidden states,
        logits))."""
        tail = prog is not None
        if not tail and _USE_PROGRAM:
            prog = self.program()
        if prog is not None:
            dyn: list[torch.Tensor] = []
            for (_, _, _, mix), cache in zip(self.layers, caches):
                dyn += mix.step_dynamic(cache, batch)
            out = prog.run(x, dyn)
            if len(out) > 1:  # per op, a Mamba-2 verify's record (empty for the others; a tail's embedding first)
                for (_, _, _, mix), cache, rec in zip(self.layers, caches, out[2 if tail else 1:]):
                    if rec:
                        mix.keep_record(cache, batch.slots, rec)
            return out[0] if tail else out[0][0]
        ops = torch.ops.waferline
        for (whole, args, dyn, mix), cache in zip(self.layers, caches):
            for i, v in zip(dyn, mix.step_dynamic(cache, batch)):
                args[i] = v
            out = getattr(ops, whole)(x, *args)  # (looked up each step, as DecoderLayer does: it can be wrapped)
            for i in dyn:  # (the plan holds no cache tensor between steps: a finished request's caches can go)
                args[i] = None
            if len(out) > 2:
                mix.keep_record(cache, batch.slots, out[2:])
            x = out[0]
        return x


LABEL_ONLY = "_waferline_label_only"  # set on a hook that only marks which part runs (e.g. the twin's op counter)


def _hooked(a: nn.Module, b: nn.Module) -> bool:
    """Whether a forward hook (the modules' own, or a global one) would run around these two modules, other than hooks
    marked ``LABEL_ONLY``: those only tell an op counter which part of the layer runs, and the counter attributes a
    fused layer's parts itself (OpCounter.ffn_label)."""
    g = _global_hooks
    if not (g.forward or g.pre or a._forward_hooks or a._forward_pre_hooks or b._forward_hooks or b._forward_pre_hooks):
        return False  # (the decode step's case, per layer and token: no lists built)
    dicts = (g.forward, g.pre, a._forward_hooks, a._forward_pre_hooks, b._forward_hooks, b._forward_pre_hooks)
    return any(not getattr(h, LABEL_ONLY, False) for d in dicts for h in d.values())


class _global_hooks:  # torch's registries of hooks on every module (dicts, mutated in place by torch)
    from torch.nn.modules.module import _global_forward_hooks as forward
    from torch.nn.modules.module import _global_forward_pre_hooks as pre


def _build_mixer(spec: LayerSpec, mt: str, cfg: dict[str, Any], dtype: torch.dtype, eps: float) -> nn.Module | None:
    mix = spec.mixer
    if mix is None:
        return None
    if mt in LINEAR_HYBRIDS:
        return build_hybrid_mixer(spec, mt, cfg, dtype, eps)
    if isinstance(mix, (MLASpec, DSASpec)):
        interleaved = mt in ("deepseek_v2", "deepseek_v32") or (
            mt == "deepseek_v3" and cfg.get("rope_interleave", True)) or (
            mt == "sol" and cfg.get("rope_interleave", False))
        kind = DSAttention if isinstance(mix, DSASpec) else MLAttention
        return kind(mix, cfg, dtype, interleaved_rope=bool(interleaved))  # (latent norms: the reference's 1e-6)
    if isinstance(mix, AttentionSpec):
        rotary = None
        use_rope = mt != "nemotron_h" and not (
            mt == "granitemoehybrid" and cfg.get("position_embedding_type") != "rope"
        )
        if use_rope:
            rotary = Rotary(int(mix.head_dim * partial_rotary(cfg, mt)), cfg)
        scale = (
            float(cfg["attention_multiplier"]) if mt == "granitemoehybrid" and cfg.get("attention_multiplier") else None
        )
        return GQAttention(mix, cfg, dtype, rotary=rotary, scale=scale, norm_eps=eps)
    if isinstance(mix, Mamba2Spec):
        return Mamba2Mixer(mix, dtype=dtype, **_mamba_flags(mt, cfg))
    if isinstance(mix, CompressedAttentionSpec):  # a sol csa / hca layer: V4 attention on a plain residual
        return V4Attention(mix, cfg, dtype, eps, position_ties=True)  # (no reference to match tie for tie)
    raise ConfigError(f"layer {spec.index}: the engine cannot run a {mix.kind!r} mixer (planner-only architecture)")


def _mamba_flags(mt: str, cfg: dict[str, Any]) -> dict[str, Any]:
    if mt == "sol":
        return {"act": "silu"}
    return hf_mixer_kwargs(mt, cfg)


def _build_ffn(spec: LayerSpec, mt: str, cfg: dict[str, Any], dtype: torch.dtype) -> nn.Module | None:
    ffn = spec.ffn
    if ffn is None:
        return None
    if isinstance(ffn, DenseFFNSpec):
        return DenseFFN(ffn, dtype=dtype, act=hf_act(mt, cfg))
    if isinstance(ffn, MoESpec):  # (gpt_oss: its swiglu_alpha / swiglu_limit from the config)
        return MoE(ffn, dtype=dtype, **moe_kwargs(mt, cfg))
    raise ConfigError(f"layer {spec.index}: unknown FFN kind {ffn.kind!r}")


class MTPHead(nn.Module):
    """DeepSeek-style multi-token-prediction module: from the main model's hidden state at t and the
    embedding of token t+1 it predicts token t+2 (embeddings and LM head are shared with the main model)."""

    def __init__(self, spec: LayerSpec, model_type: str, cfg: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        d, eps = spec.hidden_size, _norm_eps(cfg)
        self.enorm = RMSNorm(d, eps, dtype)
        self.hnorm = RMSNorm(d, eps, dtype)
        self.eh_proj = Linear(2 * d, d, False, dtype)
        self.layer = DecoderLayer(spec, model_type, cfg, dtype)
        self.norm = RMSNorm(d, eps, dtype)

    def load_hf(self, src: WeightSource, prefix: str, naming: Naming) -> None:
        self.enorm.load_hf(src, prefix + "enorm.weight")
        self.hnorm.load_hf(src, prefix + "hnorm.weight")
        self.eh_proj.load_hf(src, prefix + "eh_proj")
        self.norm.load_hf(src, prefix + "shared_head.norm.weight")
        _load_layer(self.layer, src, prefix, naming)

    def forward(self, h: torch.Tensor, next_embeds: torch.Tensor, cache: Any, batch: StepBatch) -> torch.Tensor:
        """h: main-model hidden states at positions t [B, T, D]; next_embeds: embeddings of tokens t+1."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(h)], dim=-1))
        return self.layer(x, cache, batch)


def _load_layer(layer: DecoderLayer, src: WeightSource, p: str, n: Naming) -> None:
    if layer.mixer is not None:
        layer.mixer_norm.load_hf(src, p + n.norm_mixer + ".weight")
        sub = n.ssm if isinstance(layer.mixer, (Mamba2Mixer, DeltaRuleMixer)) else n.attn
        layer.mixer.load_hf(src, p + sub + ".")
    if layer.ffn is not None:
        layer.ffn_norm.load_hf(src, p + n.norm_ffn + ".weight")
        load_ffn(layer.ffn, src, p, n, layer.flavor)


def load_ffn(ffn: nn.Module, src: WeightSource, p: str, n: Naming, flavor: str) -> None:
    """Load a layer's FFN (an MoE block or a dense FFN) from under the layer's prefix ``p``."""
    if isinstance(ffn, DenseFFN) and n.dense is not None:
        ffn.load_hf(src, p + n.dense + ".", dense_names(flavor))
    else:
        ffn.load_hf(src, p + n.ffn + "." if n.ffn else p)


def _head_param(vocab: int, d: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(vocab, d, dtype=dtype), requires_grad=False)


class DecoderModel(nn.Module):
    """Embeddings, the decoder layers ``layer_range`` of the model, final norm and LM head.

    A pipeline stage holds a slice of layers; ``has_embed`` / ``has_head`` say whether it also embeds
    tokens or computes logits. The single-process engine holds all of them.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32, layer_range: range | None = None,
                 has_embed: bool = True, has_head: bool = True, with_mtp: bool | None = None):
        super().__init__()
        if spec.model_type not in ENGINE_MODEL_TYPES:
            raise ConfigError(
                f"model_type {spec.model_type!r} is planner-only; the engine runs: {', '.join(ENGINE_MODEL_TYPES)}"
            )
        self.spec = spec
        self.cfg = spec.hf_config
        self.naming = NAMING.get(spec.model_type, Naming())
        self.dtype = dtype
        self.layer_range = layer_range if layer_range is not None else range(spec.num_layers)
        d = spec.hidden_size
        self.embed = nn.Embedding(spec.vocab_size, d, dtype=dtype) if has_embed else None
        if self.embed is not None:
            self.embed.weight.requires_grad_(False)
        v4 = spec.model_type == "deepseek_v4"  # hyper-connected streams [B, T, hc_mult, D] between the layers
        layer_cls = V4Layer if v4 else DecoderLayer
        self.layers = nn.ModuleList(
            [layer_cls(spec.layers[i], spec.model_type, self.cfg, dtype) for i in self.layer_range]
        )
        self.hc_mult = hc_mult(self.cfg) if v4 else 0
        self.hc_head = HyperHead(self.cfg) if v4 and has_head else None
        self.norm = RMSNorm(d, _norm_eps(self.cfg), dtype) if has_head else None
        # a tied head (tie_word_embeddings) beside its embedding is the embedding's table itself, held once (as
        # transformers ties them); a stage without the embedding holds a copy
        tied = self._tied_head()
        self.lm_head = None if not has_head else tied if tied is not None else _head_param(spec.vocab_size, d, dtype)
        # MTP heads: None = load them when the checkpoint has them, True = required, False = never
        self.with_mtp = with_mtp
        self.mtp = nn.ModuleList([MTPHead(l, spec.model_type, self.cfg, dtype) for l in spec.mtp_layers]  # (not
                                 # DeepSeek-V4's hyper-connected MTP block, which the engine does not run)
                                 if has_head and has_embed and with_mtp is not False and not v4 else [])
        granite = spec.model_type == "granitemoehybrid"
        self.embedding_multiplier = float(self.cfg.get("embedding_multiplier") or 1.0) if granite else 1.0
        self.logits_scaling = float(self.cfg.get("logits_scaling") or 1.0) if granite else 1.0

    # -- weights
    def load_hf(self, src: WeightSource) -> None:
        src = hf_source(src, self.spec.model_type)
        n = self.naming
        r = n.root
        if self.embed is not None:
            copy_into(self.embed.weight, src.get(r + n.embed + ".weight", tuple(self.embed.weight.shape)))
        for layer, i in zip(self.layers, self.layer_range):
            if isinstance(layer, V4Layer):
                layer.load_hf(src, f"{r}layers.{i}.")
            else:
                _load_layer(layer, src, f"{r}layers.{i}.", n)
        if self.hc_head is not None:
            self.hc_head.load_hf(src, r + "hc_head.")
        if len(self.mtp):
            first = f"{r}layers.{self.spec.num_layers}."
            if self.with_mtp or src.has(first + "eh_proj.weight"):
                for j, head in enumerate(self.mtp):
                    head.load_hf(src, f"{r}layers.{self.spec.num_layers + j}.", n)
            else:
                self.mtp = nn.ModuleList()  # the checkpoint carries no MTP weights (e.g. transformers drops them)
        if self.norm is not None:
            self.norm.load_hf(src, r + n.final_norm + ".weight")
            tied = self._tied_head()
            if tied is not None:
                self.lm_head = tied
                if src.has("lm_head.weight"):  # (tied in the config, and a head in the checkpoint too)
                    w = src.get("lm_head.weight", tuple(tied.shape))
                    if not torch.equal(w.to(tied.dtype), tied):  # its own values: transformers does not tie them
                        self.lm_head = _head_param(*tied.shape, tied.dtype)
                        copy_into(self.lm_head, w)
            elif self.spec.tie_word_embeddings and not src.has("lm_head.weight"):
                copy_into(self.lm_head, src.get(r + n.embed + ".weight", tuple(self.lm_head.shape)))
            else:
                head = "head.weight" if self.hc_mult and src.has("head.weight") else "lm_head.weight"  # (V4's name)
                copy_into(self.lm_head, src.get(head, tuple(self.lm_head.shape)))

    def _tied_head(self) -> nn.Parameter | None:
        """The embedding's weight where this model holds the embedding and a head that the config ties to it."""
        return self.embed.weight if self.embed is not None and self.spec.tie_word_embeddings else None

    def new_caches(self, num_slots: int, device: torch.device | str | None = None) -> list[Any]:
        return share_pages([layer.new_cache(num_slots, device) for layer in self.layers])

    # -- compute
    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.hc_mult:  # every stream starts as the embedding
            return x.unsqueeze(-2).expand(*x.shape[:-1], self.hc_mult, x.shape[-1]).contiguous()
        return x * self.embedding_multiplier if self.embedding_multiplier != 1.0 else x

    def forward_layers(self, x: torch.Tensor, caches: list[Any], batch: StepBatch) -> torch.Tensor:
        if len(self.layers) and x.shape[0] * x.shape[1] <= _PLAN_MAX_ROWS:  # a decode step or a verify
            plans = self.__dict__.setdefault("_step_plans", {})  # one per step shape (a verify's width varies)
            key = _StepPlan.key_of(x)
            plan = plans.get(key)
            if plan is not None and plan.valid(x, caches):
                return plan.run(x, caches, batch)
            x, plans[key] = _StepPlan.record(self, x, caches, batch)
            return x
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache, batch)
        return x

    def step_logits(self, tokens: torch.Tensor, caches: list[Any], batch: StepBatch,
                    argmax: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A step of tokens [B, T] -> (fp32 logits [B, T, V], the hidden states [B, T, D] they came from, and with
        ``argmax`` the greedy tokens [B, T] (greedy()'s: torch.argmax's indices)): ``self.logits(self(tokens, caches,
        batch))``. When the step (a decode step or a verify) replays a plan through its StepProgram on this CPU's
        operators and the LM head is int8, bf16 (up to ``few_rows()`` rows: linear_rows) or fp32, the embedding, the
        layers, the final norm, the head and the argmax run as one program (one call from Python; the ops project()
        would call, on the same tensors). Not with a forward hook on the model, its embedding or its norm (they need
        the module calls)."""
        found = self._tail_program(tokens, caches)
        if found is not None:
            ids, h, logits = found[0].run(tokens, caches, batch, found[1])
            return logits, h, ids if argmax else None
        h = self(tokens, caches, batch)
        logits = self.logits(h)
        if not argmax:
            return logits, h, None
        ids = (torch.ops.waferline.argmax_rows(logits) if logits.device.type == "cpu" and kernels.available()
               else logits.argmax(-1))
        return logits, h, ids

    @staticmethod
    def runs_step_programs(device: torch.device) -> bool:
        """Whether steps on ``device`` can run as whole-step programs (step_logits' and greedy_steps'): on CPU, with
        waferline's fused operators loaded. Elsewhere every step runs op by op."""
        return _USE_PROGRAM and device.type == "cpu" and kernels.available()

    def greedy_steps(self, tokens: torch.Tensor, caches: list[Any],
                     batches: list[StepBatch]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Greedy decode steps back to back, each step's greedy tokens the next one's input: tokens [B, 1] at
        ``batches[0]``, then ``batches[1:]`` (one-token steps of the same rows) -> per step, its greedy tokens [B, 1]
        and the hidden states [B, 1, D] they came from (step_logits'); None where step_logits would not run the step
        as one whole-step program (then step by step). Every step's
        per-step tensors (rotary rows, caches grown to the last step's end first, slots, positions) are made before
        the first runs, so the Python of the steps runs once, warm, instead of between steps that leave the caches
        cold (a multi-step decode, as vLLM's multi-step scheduling). The same ops on the same tensors as
        ``len(batches)`` calls of ``step_logits(..., argmax=True)``: the same tokens."""
        found = self._tail_program(tokens, caches) if tokens.shape[1] == 1 and all(b.T == 1 for b in batches) else None
        if found is None:
            return None
        plan, prog = found
        dyns: list[list[torch.Tensor]] = [[] for _ in batches]
        for i in reversed(range(len(batches))):  # (the last first: a cache grown later would leave a stale tensor)
            for (_, _, _, mix), cache in zip(plan.layers, caches):
                dyns[i] += mix.step_dynamic(cache, batches[i])
        out = []
        for dyn in dyns:
            tokens, h = prog.run(tokens, dyn)[0][:2]  # (a one-token step returns no Mamba-2 record)
            out.append((tokens, h))
        return out

    def _tail_program(self, tokens: torch.Tensor, caches: list[Any]) -> tuple[_StepPlan, Any] | None:
        """(the step's plan, its whole-step program with the embedding, norm, head and argmax) where a step of
        ``tokens`` on ``caches`` can run as one program, else None."""
        tail = self._step_tail(tokens)
        if tail is None:
            return None
        plan = self.__dict__.get("_step_plans", {}).get(_StepPlan.key_of(tokens, tail[0].dtype, tail[5]))
        if plan is None or not plan.valid(tokens, caches):
            return None
        prog = plan.program(tail[:5])
        return None if prog is None else (plan, prog)

    def _step_tail(self, tokens: torch.Tensor) -> tuple | None:
        """(embedding weight, norm weight, its epsilon, the head's weight: int8 values or the bf16 / fp32 matrix, the
        int8 scales or None, hidden size) where step_logits may run a program, else None. (Per step: the modules'
        dicts, not nn.Module's attribute lookups.)"""
        d = self.__dict__
        mods, bufs = d["_modules"], d["_buffers"]
        e, n, q, w = mods.get("embed"), mods.get("norm"), bufs.get("lm_head_int8"), d["_parameters"].get("lm_head")
        if w is not None:  # a bf16 head where project() runs linear_rows (few rows), or an fp32 one
            if q is not None or not (w.dtype == torch.float32 or (
                    w.dtype == torch.bfloat16 and tokens.numel() <= few_rows(torch.bfloat16))):
                return None
            q = w
        if (not self.runs_step_programs(tokens.device) or e is None or n is None or q is None or self._forward_hooks
                or self._forward_pre_hooks
                or e._forward_hooks or e._forward_pre_hooks
                or n._forward_hooks or n._forward_pre_hooks or d["embedding_multiplier"] != 1.0
                or d["logits_scaling"] != 1.0 or tokens.dim() != 2 or tokens.numel() > _PLAN_MAX_ROWS):
            return None
        ew, nw = e._parameters["weight"], n._parameters["weight"]
        if nw.dtype != ew.dtype or (w is not None and w.dtype != ew.dtype):
            return None
        return ew, nw, n.eps, q, None if w is not None else bufs["lm_head_scale"], ew.shape[1]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits for hidden states h [..., D] (DeepSeek-V4: its streams [..., hc_mult, D])."""
        if self.hc_head is not None:
            h = self.hc_head(h)
        out = self.project(self.norm(h))
        return out / self.logits_scaling if self.logits_scaling != 1.0 else out

    def project(self, hn: torch.Tensor) -> torch.Tensor:
        """fp32 ``hn @ lm_head.T`` for already-normalised states (no logits scaling): the one place the head
        multiplies."""
        if self.lm_head is not None:
            return packed_linear(hn, self.lm_head, None, self.__dict__.setdefault("_packs", {}), "lm_head").float()
        q, scale = self.lm_head_int8, self.lm_head_scale
        if hn.device.type == "cpu" and kernels.available():  # fp32 out; see waferline::int8_linear
            return torch.ops.waferline.int8_linear(hn, q, scale)
        x = hn.reshape(-1, hn.shape[-1]).to(scale.dtype).contiguous()
        if x.device.type == "cpu" and q.shape[1] % 16 == 0:  # (ATen's kernel reads garbage when K % 16 != 0)
            y = torch.ops.aten._weight_int8pack_mm(x, q, scale)
        else:
            y = torch.nn.functional.linear(x, q.to(x.dtype)) * scale
        return y.float().reshape(*hn.shape[:-1], q.shape[0])

    def quantize_head(self, bits: int = 8) -> None:
        """Store the LM head as int8 with one scale per vocabulary row (symmetric absmax, bf16 scales). On CPU it
        multiplies through ``waferline::int8_linear`` (activations as 16-bit fixed point per 64 inputs, exact integer
        sums, fp32 logits); elsewhere, or without the fused operators, activations go to bf16 for ATen's int8 product.
        The head is the largest single matrix a small model reads per token (e.g. 32000 x 512); int8 halves those
        bytes at ~0.4% relative logit error. ``bits=16`` keeps it as loaded."""
        if bits == 16 or self.lm_head is None:
            return
        if bits != 8:
            raise ConfigError(f"the LM head can be 16-bit or int8 (head_bits 16 or 8), got {bits}")
        w = self.lm_head.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("lm_head_int8", q)
        self.register_buffer("lm_head_scale", scale.to(torch.bfloat16 if self.dtype == torch.float32 else self.dtype))
        self.lm_head = None

    def forward(self, tokens: torch.Tensor, caches: list[Any], batch: StepBatch) -> torch.Tensor:
        """Tokens [B, T] -> hidden states [B, T, D] after this model's layers (no final norm)."""
        if self.hc_mult:
            batch.memo["tokens"] = tokens  # (DeepSeek-V4's hash-routed MoE layers pick experts by token id)
        return self.forward_layers(self.embed_tokens(tokens), caches, batch)
