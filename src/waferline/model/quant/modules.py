"""Which module weights of a model int4 replaces, the options of a quantization, and quantizing or moving a loaded
model in place."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from waferline.errors import ConfigError
from waferline.model.quant.formats import int4_group_size, quant_method
from waferline.model.quant.quantizers import gptq_quantize, rtn_quantize
from waferline.model.quant.tensor import DEFAULT_KEEP, Int4Tensor, group_for
from waferline.model.quant.weight import Int4Weight, QuantLinear, choose_backend
from waferline.spec.model import INT4_GROUP_SIZES


def matmul_weights(root: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(param path, owner module, leaf)`` for every matmul weight under ``root`` that int4 can replace:
    projections (``Linear``/``nn.Linear``: attention, MLA, Mamba-2 in/out) and FFN/expert weights (``w_*`` of
    DenseFFN, MoE and DeepSeek-V4's V4MoE). Embeddings, the LM head, routers, norms, convs and MTP heads are not
    listed."""
    from waferline.model.layers import Linear
    from waferline.model.moe import DenseFFN, MoE
    from waferline.model.v4_blocks import V4MoE

    out = []
    for name, mod in root.named_modules():
        if name == "mtp" or name.startswith("mtp."):
            continue
        if isinstance(mod, (Linear, nn.Linear)) and isinstance(getattr(mod, "weight", None), Tensor):
            out.append((f"{name}.weight" if name else "weight", mod, "weight"))
        elif isinstance(mod, (DenseFFN, MoE, V4MoE)):
            for leaf in ("w_gate_up", "w_up", "w_down"):
                if isinstance(getattr(mod, leaf, None), Tensor):
                    out.append((f"{name}.{leaf}" if name else leaf, mod, leaf))
    return out


def install(root: nn.Module, path: str, weight: Int4Weight) -> None:
    """Put ``weight`` in place of the fp weight at ``path`` (as returned by :func:`matmul_weights`)."""
    from waferline.model.moe import MoE

    owner_path, _, leaf = path.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    if leaf == "weight":
        parent_path, _, child = owner_path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        setattr(parent, child, QuantLinear(weight, owner.bias, owner.weight.dtype))
        return
    owner.register_module("q_" + leaf[2:], weight)
    setattr(owner, leaf, None)
    if isinstance(owner, MoE):
        owner.gather_max = 0  # int4 experts run per expert (the gather path would dequantize)


def is_int4(model: nn.Module) -> bool:
    return any(isinstance(m, Int4Weight) for m in model.modules())


def _kept(path: str, keep: Iterable[str]) -> bool:
    return any(re.search(p, path) for p in keep)


@dataclass
class QuantOptions:
    """How to quantize: bits (4 only), group size, symmetric or not, method, and what to keep 16-bit."""

    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    method: str = "rtn"
    keep: tuple[str, ...] = DEFAULT_KEEP
    scale_dtype: torch.dtype = torch.bfloat16

    def validate(self) -> None:
        if self.bits != 4:
            raise ConfigError(f"only 4-bit weights are supported, got --bits {self.bits}")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ConfigError(f"group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} (32, 64 or 128 are "
                              f"usual), got {self.group_size}")
        if self.method not in ("rtn", "gptq"):
            raise ConfigError(f"quantization method must be rtn or gptq, got {self.method!r}")
        for p in self.keep:
            try:
                re.compile(p)
            except re.error as e:
                raise ConfigError(f"--keep {p!r} is not a valid regular expression ({e})") from None


def _quantize_param(w: Tensor, opts: QuantOptions, H: Tensor | None) -> Int4Tensor | None:
    G = group_for(w.shape[-1], opts.group_size)
    if G is None:
        return None
    if opts.method == "gptq" and H is not None:
        if w.dim() == 2:
            return gptq_quantize(w, H, G, opts.symmetric, scale_dtype=opts.scale_dtype)
        parts = [gptq_quantize(w[e], H[e], G, opts.symmetric, scale_dtype=opts.scale_dtype) if H[e].any()
                 else rtn_quantize(w[e], G, opts.symmetric, opts.scale_dtype) for e in range(w.shape[0])]
        return Int4Tensor(torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts]),
                          None if opts.symmetric else torch.stack([p.zeros for p in parts]))
    return rtn_quantize(w, G, opts.symmetric, opts.scale_dtype)


def quantize_model(model: nn.Module, opts: QuantOptions | None = None, hessians: dict[str, Tensor] | None = None,
                   progress: Callable[[str], None] | None = None, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Quantize the matmul weights of a loaded model in place (RTN, or GPTQ given ``hessians`` by param path).
    ``dtype``: the dtype it was loaded in, where it has no ``.dtype`` of its own (an FFN block): int4 products run in
    it where it is 16-bit, as the whole model's do. Returns what was done: counts and the paths kept 16-bit."""
    opts = opts or QuantOptions()
    opts.validate()
    kept, done = [], 0
    compute = _compute_dtype(model, dtype)
    for path, owner, leaf in matmul_weights(model):
        if _kept(path, opts.keep):
            kept.append(path)
            continue
        w = getattr(owner, leaf)
        t = _quantize_param(w.detach(), opts, None if hessians is None else hessians.get(path))
        if t is None:
            kept.append(path)
            continue
        install(model, path, Int4Weight(t, w.device, compute))
        done += 1
        if progress:
            progress(path)
    return {"quantized": done, "kept_16bit": kept}


def quantize_mtp(model: Any, target_int4: bool, group_size: int | None = None) -> None:
    """An MTP drafter's head in int4 where its target's layers are (a checkpoint keeps the head 16-bit), in place, at
    ``group_size`` (None: the group size of the int4 checkpoint the model was loaded from): each draft then runs its
    layer as one op. Every engine drafts so (``LLM``, the server, a pipeline's drafter): a seeded sampled draft
    samples from the head's probabilities, so the same tokens need the same head weights."""
    if target_int4 and len(model.mtp) and not is_int4(model.mtp):
        quantize_model(model.mtp, QuantOptions(group_size=group_size or int4_group_size(model.spec.hf_config)))


def convert_loaded(model: Any, weight_bits: int = 16, group_size: int = 128, head_bits: int = 16) -> None:
    """What every engine does to a loaded model, or to a pipeline stage's slice of one, once it sits on its device:
    RTN int4 at ``group_size`` where ``weight_bits`` is 4 and the checkpoint is 16-bit (an int4 checkpoint keeps its
    own codes), an MTP head in int4 where the layers are (``quantize_mtp``), and with ``head_bits`` 8 the LM head in
    int8 where the model holds it (a pipeline's last stage). The same weights in every engine: the same tokens. An int4
    checkpoint is told by its config, not by the weights loaded: a stage may hold only layers it kept 16-bit (--keep),
    which stay so, as in one process."""
    int4_checkpoint = quant_method(model.spec.hf_config) is not None or is_int4(model)
    if weight_bits == 4 and not int4_checkpoint:
        quantize_model(model, QuantOptions(group_size=group_size))
    quantize_mtp(model, int4_checkpoint or is_int4(model), None if int4_checkpoint else group_size)
    model.quantize_head(head_bits)


def move_model(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Move a loaded (and possibly quantized) model to ``device``: its int4 weights repacked for that device's kernel
    (``choose_backend``: tinygemm on a CUDA GPU of compute capability 8 or more, waferline's layout on CPU) from their
    exact codes and scales, everything else ``.to(device)``. Call before the first forward (modules keep per-weight
    views and tile copies from then on). A parameter two modules share (a tied LM head and its embedding) stays
    shared."""
    device = torch.device(device)
    for path, mod in list(model.named_modules()):
        if not isinstance(mod, Int4Weight):
            continue
        backend = choose_backend(device, mod.in_features, mod.group_size)
        if backend == mod.backend:
            continue
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        t = mod.int4_tensor()
        t = Int4Tensor(t.codes.cpu(), t.scales.cpu(), None if t.zeros is None else t.zeros.cpu())
        setattr(parent, child, Int4Weight(t, device, mod.compute_dtype, backend))
    slots: dict[int, list[tuple[nn.Module, str]]] = {}  # id(parameter) -> the (module, name) places that hold it
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((mod, name))
    model.to(device)
    for (first, name), *others in slots.values():  # (.to() makes a parameter per module where it cannot move one
        for mod, other in others:                  # in place, e.g. to the meta device: one of them then)
            mod._parameters[other] = first._parameters[name]
    for mod in model.modules():  # .to() copied each weight on its own: weights multiplied as one lie together again
        colocate = getattr(mod, "colocate", None)
        if callable(colocate):
            colocate()
    return model


def _compute_dtype(model: nn.Module | None, dtype: torch.dtype | None = None) -> torch.dtype:
    dt = dtype or getattr(model, "dtype", torch.float32)
    return dt if dt in (torch.bfloat16, torch.float16) else torch.bfloat16
