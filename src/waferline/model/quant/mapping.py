"""Which checkpoint tensor feeds which module weight (fused gate/up, stacked experts), found by running the modules'
own ``load_hf`` on element ids, and the module-layout int4 weights assembled from the checkpoint's."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from waferline.errors import CheckpointError
from waferline.model.quant.formats import Int4Source
from waferline.model.quant.modules import _compute_dtype, install, matmul_weights
from waferline.model.quant.tensor import Int4Tensor
from waferline.model.quant.weight import Int4Weight
from waferline.model.weights import WeightSource

if TYPE_CHECKING:
    from waferline.spec.model import ModelSpec


def trace_layer(spec: ModelSpec, i: int, shapes: dict[str, tuple[int, ...]], selected: list[str]) -> dict[str, Tensor]:
    """Which checkpoint elements feed each matmul weight of decoder layer ``i`` (:func:`trace_module` of the layer)."""
    return trace_module(_layer_probe(spec, i), shapes, selected, f"layer {i}")


def _layer_probe(spec: ModelSpec, i: int) -> Callable[[WeightSource], nn.Module]:
    def probe(src: WeightSource) -> nn.Module:
        from waferline.model.decoder import DecoderModel

        model = DecoderModel(spec, torch.float64, range(i, i + 1), has_embed=False, has_head=False)
        model.load_hf(src)
        return model.layers[0]

    return probe


def trace_module(probe: Callable[[WeightSource], nn.Module], shapes: dict[str, tuple[int, ...]], selected: list[str],
                 where: str) -> dict[str, Tensor]:
    """Which checkpoint elements feed each matmul weight of a module.

    ``probe`` builds the module in float64 and loads it (its own ``load_hf``) from the source it is given, whose
    checkpoint tensors hold element ids (``(tensor number << 32) + flat index`` for the ``selected`` names, -1 for
    the others). Returns, for each weight fed only by selected tensors, an int64 tensor of those ids in the module's
    layout. ``where`` names the module in an error.
    """
    number = {n: j for j, n in enumerate(selected)}

    def load(name: str) -> Tensor:
        shape = shapes[name]
        if name in number:
            return (torch.arange(math.prod(shape), dtype=torch.int64) + (number[name] << 32)).double().view(shape)
        return torch.full((), -1.0, dtype=torch.float64).expand(shape)

    root = probe(WeightSource(list(shapes), load, dict(shapes)))
    out = {}
    for path, owner, leaf in matmul_weights(root):
        ids = getattr(owner, leaf).detach()
        if ids.dtype != torch.float64:
            continue
        fed = ids >= 0
        if bool(fed.all()):
            out[path] = ids.long()
        elif bool(fed.any()):
            raise CheckpointError(f"{where}: {path} is fed partly by int4 and partly by 16-bit tensors; quantize "
                                  "all of its parts or none")
    return out


def _used_tensors(ids: Tensor) -> list[int]:
    """The selected-tensor numbers that occur in ``ids``."""
    return torch.bincount((ids >> 32).flatten()).nonzero().flatten().tolist()


def _stored_ids(ids: Tensor, flips: dict[int, tuple[int, ...]]) -> Tensor:
    """``ids`` with the elements of each tensor number in ``flips`` (mapped to its checkpoint shape ``[..., A, B]``)
    renumbered as in that tensor with its last two axes swapped (``[..., B, A]``), the layout it is stored in."""
    if not flips:
        return ids
    out = ids.clone()
    num = ids >> 32
    for j, (*_, A, B) in flips.items():
        sel = num == j
        f = ids[sel] & 0xFFFFFFFF
        lead, a, b = f // (A * B), f // B % A, f % B
        out[sel] = (j << 32) + (lead * B + b) * A + a
    return out


def _swapped(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2])


def _group_ids(ids: Tensor, tensors: list[int], shapes: list[tuple[int, ...]], G: int) -> tuple[Tensor, Tensor, Tensor]:
    """For every element of ``ids``: its index in the concatenation of ``tensors`` (flattened, in that order) and
    its group's index in the concatenation of their ``[..., N_t, K_t/G]`` scale grids. Also each tensor's K_t."""
    n = int(ids.max() >> 32) + 1
    lut = torch.full((n,), -1, dtype=torch.int64)
    lut[torch.tensor(tensors)] = torch.arange(len(tensors))
    numel = torch.tensor([math.prod(sh) for sh in shapes])
    Ks = torch.tensor([sh[-1] for sh in shapes])
    base = torch.cumsum(numel, 0) - numel
    gbase = torch.cumsum(numel // G, 0) - numel // G
    flat = ids & 0xFFFFFFFF
    if len(tensors) == 1:  # the common case: plain scalar arithmetic
        K = int(Ks[0])
        row = flat // K
        return flat, row * (K // G) + (flat - row * K) // G, Ks
    local = lut[ids >> 32]
    K = Ks[local]
    row = flat // K
    return base[local] + flat, gbase[local] + row * (K // G) + (flat - row * K) // G, Ks


def _groups_line_up(gid: Tensor, G: int) -> bool:
    """True when every module group of G inputs is exactly one checkpoint group (so scales map one-to-one)."""
    *lead, N, K = gid.shape
    if K % G:
        return False
    heads = gid.view(*lead, N, K // G, G)
    if not bool((heads == heads[..., :1]).all()):
        return False
    return int(torch.bincount(heads[..., 0].flatten()).max()) <= 1


def gather_int4(ids: Tensor, selected: list[str], get: Callable[[str], Int4Tensor],
                transposed: Collection[str] = ()) -> Int4Tensor:
    """Assemble the module-layout int4 weight for ``ids`` (from :func:`trace_layer`) out of checkpoint tensors
    (``get`` gives each in its stored layout: the names in ``transposed`` with their last two axes swapped)."""
    used = _used_tensors(ids)
    parts = [get(selected[j]) for j in used]
    ids = _stored_ids(ids, {j: _swapped(p.shape) for j, p in zip(used, parts) if selected[j] in transposed})
    G = parts[0].group_size
    if any(p.group_size != G for p in parts) or any((p.zeros is None) != (parts[0].zeros is None) for p in parts):
        raise CheckpointError(f"{', '.join(selected[j] for j in used)} feed one weight but differ in group size or "
                              "symmetry; waferline needs them alike")
    elem, gid, _ = _group_ids(ids, used, [p.shape for p in parts], G)
    if not _groups_line_up(gid, G):
        raise CheckpointError(f"the int4 groups of {selected[used[0]]} do not run along the module's input dimension; "
                              "keep those weights 16-bit")
    codes = torch.cat([p.codes.flatten() for p in parts])[elem]
    heads = gid[..., ::G]
    scales = torch.cat([p.scales.flatten() for p in parts])[heads]
    zeros = None if parts[0].zeros is None else torch.cat([p.zeros.flatten() for p in parts])[heads]
    return Int4Tensor(codes, scales, zeros)


def attach_int4(model: nn.Module, src: Int4Source) -> int:
    """Replace the fp weights of ``model`` (already loaded from ``src``) that the checkpoint stores in int4
    with :class:`Int4Weight` modules built from the stored codes. Returns how many were replaced."""
    spec = model.spec
    parts = [(layer, _layer_probe(spec, i), f"layer {i}") for layer, i in zip(model.layers, model.layer_range)]
    return attach_int4_parts(parts, src, getattr(model, "dtype", torch.float32))


def attach_int4_parts(parts: list[tuple[nn.Module, Callable[[WeightSource], nn.Module], str]], src: Int4Source,
                      dtype: torch.dtype) -> int:
    """:func:`attach_int4` for modules other than a model's decoder layers (an AFD FFN rank's slice of an MoE
    block): each part is (module loaded from ``src``, its probe for :func:`trace_module`, its name in errors);
    ``dtype`` the dtype the modules were loaded in (int4 products run in it where it is 16-bit, else in bf16)."""
    selected = sorted(src.entries)
    shapes = dict(src._shapes)
    compute = _compute_dtype(None, dtype)
    transposed = {name for name, e in src.entries.items() if e.transposed}
    cache: dict[str, Int4Tensor] = {}

    def get(name: str) -> Int4Tensor:
        if name not in cache:
            cache[name] = src.canonical(name)
        return cache[name]

    n = 0
    for module, probe, where in parts:
        for path, ids in trace_module(probe, shapes, selected, where).items():
            t = gather_int4(ids, selected, get, transposed)
            w = module.get_parameter(path)
            install(module, path, Int4Weight(t, w.device, compute))
            n += 1
        cache.clear()
    return n
