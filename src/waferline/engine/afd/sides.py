"""What each side of AFD holds and loads: the attention side's FFN norms and MoE routers (``FFNFront``) beside a
DecoderModel without FFNs; an FFN rank's own experts (``ExpertSlice`` renumbers them) and the layers it owns."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from waferline.engine.afd.layout import Layout
from waferline.errors import ConfigError
from waferline.model.moe import MoE
from waferline.plan.place import ffn_owner
from waferline.spec.configs import spec_from_pretrained

if TYPE_CHECKING:
    from waferline.spec.model import MoESpec


class Router(nn.Module):
    """The routing half of an MoE block (router weight, bias, correction bias), kept on the attention side."""

    route = MoE.route  # the single-process engine's routing and router loading, not copies of them
    _load_router = MoE._load_router

    def __init__(self, spec: MoESpec):
        super().__init__()
        E, D = spec.num_experts, spec.hidden_size
        self.spec, self.num_experts, self.hidden_size, self.top_k = spec, E, D, spec.top_k
        self.group_top2 = spec.correction_bias or spec.scoring == "sigmoid"  # as MoE.__init__
        self.gate_weight = nn.Parameter(torch.zeros(E, D), requires_grad=False)
        self.gate_bias = nn.Parameter(torch.zeros(E), requires_grad=False) if spec.router_bias else None
        if spec.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(E))
        else:
            self.e_score_correction_bias = None

    def load_hf(self, src: Any, prefix: str, flavor: str) -> None:
        from waferline.model.weights import copy_into

        if flavor == "granitemoehybrid":
            self._load_router(src, prefix + "block_sparse_moe.", ["router.layer.weight", "router.weight"])
            return
        self._load_router(src, prefix, ["router.weight"] if flavor == "gpt_oss" else ["gate.weight"])
        if self.e_score_correction_bias is not None:
            name = prefix + "gate.e_score_correction_bias"
            if not src.has(name) and src.has(prefix + "e_score_correction_bias"):
                name = prefix + "e_score_correction_bias"
            copy_into(self.e_score_correction_bias, src.get(name, (self.num_experts,)))


class FFNFront(nn.Module):
    """What the attention side keeps of a layer's FFN: its pre-norm, and the router for an MoE layer."""

    def __init__(self, norm: nn.Module, router: Router | None):
        super().__init__()
        self.norm = norm
        self.router = router


class ExpertSlice:
    """A view of a WeightSource in which MoE layer ``prefix`` has only experts [e0, e1), renumbered from 0:
    per-expert keys are renamed, [E, ...] tensors under the prefix (fused experts, router rows) are sliced. On an int4
    checkpoint it views the stored tensors (an ``Int4Source`` over it sees a checkpoint of those experts alone: the
    codes, scales and zeros of fused experts are [E, ...] too; a compressed-tensors ``weight_shape`` [E, N, K] reads
    as the slice's). ``scope``: a prefix the listing (``names_with_prefix``) keeps to (the layer's); reads are not
    kept to it."""

    _EXPERT = re.compile(r"^(.*experts\.)(\d+)\.(.*)$")

    def __init__(self, src: Any, prefix: str, e0: int, e1: int, num_experts: int, scope: str = ""):
        self.src, self.prefix, self.e0, self.e1, self.E, self.scope = src, prefix, e0, e1, num_experts, scope

    def _map(self, name: str) -> tuple[str | None, bool]:
        if not name.startswith(self.prefix) or "shared" in name[len(self.prefix):]:
            return name, False
        m = self._EXPERT.match(name)
        if m:
            j = int(m.group(2))
            return (f"{m.group(1)}{self.e0 + j}.{m.group(3)}" if j < self.e1 - self.e0 else None), False
        return name, True

    def _sliced(self, base: str, sliced: bool) -> bool:
        return sliced and self.src.shape(base)[:1] == (self.E,) and not base.endswith(".weight_shape")

    def has(self, name: str) -> bool:
        base, _ = self._map(name)
        return base is not None and self.src.has(base)

    def names_with_prefix(self, prefix: str) -> list[str]:
        """The view's names under ``prefix`` (and ``scope``): other experts' keys left out, these renumbered."""
        if not (prefix.startswith(self.scope) or self.scope.startswith(prefix)):
            return []
        out = []
        for n in self.src.names_with_prefix(max(prefix, self.scope, key=len)):
            m = self._EXPERT.match(n) if n.startswith(self.prefix) and "shared" not in n[len(self.prefix):] else None
            if m and self.e0 <= int(m.group(2)) < self.e1:
                n = f"{m.group(1)}{int(m.group(2)) - self.e0}.{m.group(3)}"
            elif m:
                continue
            if n.startswith(prefix):
                out.append(n)
        return sorted(out)

    def shape(self, name: str) -> tuple[int, ...]:
        from waferline.errors import CheckpointError

        base, sliced = self._map(name)
        if base is None:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        shape = self.src.shape(base)
        return (self.e1 - self.e0, *shape[1:]) if self._sliced(base, sliced) else shape

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        from waferline.errors import CheckpointError

        base, sliced = self._map(name)
        if base is None:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        if self._sliced(base, sliced):
            t = self.src.get(base)[self.e0:self.e1].clone()
        else:
            t = self.src.get(base)
        if sliced and base.endswith(".weight_shape") and t.dim() == 1 and len(t) > 2 and int(t[0]) == self.E:
            t = torch.cat([t.new_tensor([self.e1 - self.e0]), t[1:]])  # (fused compressed-tensors experts: [E, N, K])
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {base!r} gives shape {list(t.shape)} for experts {self.e0}-{self.e1 - 1} but "
                f"the config implies {list(shape)}"
            )
        return t


def _check_checkpoint(path: Path, device: str) -> None:
    from waferline.model.quant.formats import check_readable_quantization
    from waferline.spec.configs import read_config_json

    cfg = read_config_json(path / "config.json")
    check_readable_quantization(cfg, path / "config.json")  # (16-bit and the int4 formats load; fp8, MXFP4, ...: not)
    if device != "cpu":
        raise ConfigError(f"the AFD engine runs on CPU processes (gloo) so far; got device={device!r}")
    if cfg.get("model_type") == "deepseek_v4":
        raise ConfigError(f"{path} is a deepseek_v4 checkpoint; the AFD engine does not run it so far (its layers "
                          "mix hyper-connection streams around attention and MoE): run it in one process or with the "
                          "pipeline engine")


def _int4_view(src: Any, cfg: dict[str, Any]) -> Any:
    """``src`` as the one-process loader reads it: an ``Int4Source`` (int4 weights under their logical names,
    ``canonical`` their codes) for an int4 checkpoint, else ``src`` itself."""
    from waferline.model.quant import Int4Source, quant_method

    return Int4Source(src, cfg) if quant_method(cfg) is not None else src


def load_attention_side(path: str | Path, dtype: torch.dtype, src: Any = None) -> tuple[Any, dict[int, FFNFront]]:
    """The attention side of a checkpoint: a DecoderModel without FFNs (embedding, mixers, head) and, per FFN layer,
    its FFNFront. Expert, shared-expert and dense-FFN tensors are never read. An int4 checkpoint's mixers load as
    its own codes (those it keeps 16-bit stay so), as the one-process loader does."""
    from waferline.model.decoder import NAMING, DecoderModel, Naming, _norm_eps
    from waferline.model.hybrids import hf_source
    from waferline.model.layers import RMSNorm
    from waferline.model.load import open_weights
    from waferline.model.quant import attach_int4, quant_method
    from waferline.spec.model import MoESpec

    path = Path(path)
    spec = spec_from_pretrained(path)
    bare = dataclasses.replace(spec, layers=[dataclasses.replace(layer, ffn=None) for layer in spec.layers])
    src = _int4_view(src if src is not None else open_weights(path), spec.hf_config)
    model = DecoderModel(bare, dtype, with_mtp=False)
    model.load_hf(src)
    if quant_method(spec.hf_config) is not None:
        attach_int4(model, src)  # (traced on the bare layers: their mixers)
    model.spec = spec  # the full accounting (the engine reads vocab/hidden/layers from it)
    n: Naming = NAMING.get(spec.model_type, Naming())
    eps = _norm_eps(spec.hf_config)
    fronts: dict[int, FFNFront] = {}
    for i, layer in enumerate(spec.layers):
        if layer.ffn is None:
            continue
        p = f"{n.root}layers.{i}."
        norm = RMSNorm(spec.hidden_size, eps, dtype)
        norm.load_hf(hf_source(src, spec.model_type), p + n.norm_ffn + ".weight")  # (as the model's own norms)
        router = None
        if isinstance(layer.ffn, MoESpec):
            router = Router(layer.ffn)
            router.load_hf(src, p + n.ffn + "." if n.ffn else p, spec.model_type)
        fronts[i] = FFNFront(norm, router).eval()
    model.eval()
    return model, fronts


def load_ffn_side(
    path: str | Path, dtype: torch.dtype, rank: int, layout: Layout, src: Any = None
) -> dict[int, nn.Module]:
    """FFN rank ``rank``'s modules per layer: an MoE holding only its experts (renumbered from 0; plus the shared
    experts where it is the owner), or the dense FFN of the layers it owns. An int4 checkpoint's experts load as its
    own codes, the rank's slice of each stored tensor (``ExpertSlice``; shared experts and dense FFNs whole)."""
    from waferline.model.decoder import NAMING, Naming, _build_ffn, load_ffn
    from waferline.model.load import open_weights
    from waferline.model.quant import attach_int4_parts, quant_method

    path = Path(path)
    spec = spec_from_pretrained(path)
    src = src if src is not None else open_weights(path)
    int4 = quant_method(spec.hf_config) is not None
    n: Naming = NAMING.get(spec.model_type, Naming())
    N = layout.ffn_ranks
    mods: dict[int, nn.Module] = {}
    for i, kind in layout.kinds.items():
        layer = spec.layers[i]
        lp = f"{n.root}layers.{i}."
        prefix = lp + (n.ffn + "." if n.ffn else "")
        owner = ffn_owner(i, N) == rank
        if kind == "dense" and not owner:
            continue
        if kind == "dense":
            e0 = e1 = E = 0

            def load(mod: nn.Module, s: Any) -> nn.Module:
                load_ffn(mod, s, lp, n, spec.model_type)
                return mod
        else:
            f = layer.ffn
            (e0, e1), E = layout.splits[i][rank], f.num_experts
            layer = dataclasses.replace(layer, ffn=dataclasses.replace(
                f, num_experts=e1 - e0, top_k=1, n_group=1, topk_group=1, num_shared=f.num_shared if owner else 0,
                shared_intermediate=f.shared_intermediate if owner else 0, shared_gate=f.shared_gate and owner))

            def load(mod: nn.Module, s: Any) -> nn.Module:
                mod.load_hf(s, prefix)
                return mod
        view = ExpertSlice(src, prefix, e0, e1, E, scope=lp) if kind == "moe" or int4 else src
        view = _int4_view(view, spec.hf_config)  # (an int4 one: of this layer's tensors, this rank's experts)
        mods[i] = load(_build_ffn(layer, spec.model_type, spec.hf_config, dtype), view).eval()
        if int4:
            def probe(s: Any, layer: Any = layer, load: Any = load) -> nn.Module:
                return load(_build_ffn(layer, spec.model_type, spec.hf_config, torch.float64), s)

            attach_int4_parts([(mods[i], probe, f"layer {i}")], view, dtype)
    return mods


def convert_ffn(mods: dict[int, nn.Module], weight_bits: int = 16, group_size: int = 128, head_bits: int = 16,
                int4_checkpoint: bool = False, dtype: torch.dtype | None = None) -> None:
    """An FFN rank's modules with ``weight_bits`` 4: in int4, RTN at ``group_size`` (each expert's rows in groups of
    its own inputs, so a slice of the experts quantizes as the whole layer does in one process; the products in
    ``dtype``, the modules' load dtype, as there), unless they come from an int4 checkpoint (its own codes; the
    layers it keeps 16-bit stay so, as ``convert_loaded`` does); ``head_bits`` is the attention side's."""
    from waferline.model.quant import QuantOptions, quantize_model

    if weight_bits == 4 and not int4_checkpoint:
        for mod in mods.values():
            quantize_model(mod, QuantOptions(group_size=group_size), dtype=dtype)
