"""Random checkpoints for any engine architecture (incl. our own `sol`), written in Hugging Face layout."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from waferline.files import write_text_atomic
from waferline.model.weights import WeightSource
from waferline.spec.configs import parse_hf_config


class _RecordingSource(WeightSource):
    """Answers every ``get`` with a fresh random tensor of the requested shape, and remembers it."""

    def __init__(self, seed: int):
        super().__init__([], lambda name: torch.empty(0))
        self.tensors: dict[str, torch.Tensor] = {}
        self.gen = torch.Generator().manual_seed(seed)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if shape is None:
            raise ValueError(f"random init needs a shape for {name}")
        if name not in self.tensors:
            self.tensors[name] = _init(name, shape, self.gen)
        return self.tensors[name]


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and len(shape) == 1 or leaf == "D":
        return torch.ones(shape)
    if leaf == "A_log":
        return torch.log(torch.empty(shape).uniform_(1, 16, generator=gen))
    if leaf == "dt_bias":
        dt = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        return dt + torch.log(-torch.expm1(-dt))
    if len(shape) == 1 or leaf.endswith("bias") or "correction_bias" in name:
        return torch.zeros(shape)
    fan_in = shape[-1]
    return torch.randn(shape, generator=gen) * (0.5 / math.sqrt(fan_in))


def write_random_checkpoint(cfg: dict[str, Any], directory: str | Path, seed: int = 0) -> Path:
    """Write ``config.json`` + ``model.safetensors`` with random weights for ``cfg`` (any engine model_type)."""
    from waferline.model.decoder import DecoderModel

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    spec = parse_hf_config(dict(cfg))
    src = _RecordingSource(seed)
    DecoderModel(spec, torch.float32, with_mtp=True).load_hf(src)
    tmp = directory / "model.safetensors.tmp"
    try:  # (a full disk, a Ctrl-C: no partial weights left behind)
        save_file({k: v.contiguous() for k, v in src.tensors.items()}, str(tmp), metadata={"format": "pt"})
        tmp.replace(directory / "model.safetensors")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    write_text_atomic(directory / "config.json", json.dumps(cfg, indent=2))  # (last, whole: the checkpoint is done)
    return directory


class _FillSource(_RecordingSource):
    """Answers ``get`` with a tensor whose values encode where each element lives in the checkpoint."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], mode: str):
        super().__init__(0)
        self.shapes, self.mode, self.order = shapes, mode, list(shapes)

    def has(self, name: str) -> bool:
        return name in self.shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        shape = self.shapes[name]
        if self.mode == "name":
            return torch.full(shape, float(self.order.index(name)))
        return torch.arange(math.prod(shape), dtype=torch.float32).view(shape)


def export_hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Invert ``load_hf``: the model's weights under their Hugging Face names and shapes.

    Runs the module's own loading code twice on a float32 probe — once with every checkpoint tensor filled
    with its name's index, once with each element's flat index — so every parameter element learns which
    checkpoint element it came from (slices, transposes and fused layouts included), then scatters back.
    """
    from waferline.model.decoder import DecoderModel

    spec = model.spec
    rec = _RecordingSource(0)
    DecoderModel(spec, torch.float32, with_mtp=len(model.mtp) > 0).load_hf(rec)
    shapes = {k: tuple(v.shape) for k, v in rec.tensors.items()}
    probes = {}
    for mode in ("name", "index"):
        probe = DecoderModel(spec, torch.float32, with_mtp=len(model.mtp) > 0)
        probe.load_hf(_FillSource(shapes, mode))
        probes[mode] = probe.state_dict()
    order = list(shapes)
    out = {k: torch.zeros(s, dtype=torch.float32) for k, s in shapes.items()}
    for key, value in model.state_dict().items():
        if key not in probes["name"]:
            continue
        names = probes["name"][key].flatten().long()
        idx = probes["index"][key].flatten().long()
        vals = value.detach().flatten().float()
        for n in names.unique().tolist():
            m = names == n
            out[order[n]].view(-1)[idx[m]] = vals[m]
    return out
