"""WeightSource: named checkpoint tensors that modules pull their weights from (and that notices what is left over)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from waferline.errors import CheckpointError


class WeightSource:
    """Tensors by Hugging Face name. ``get`` checks shapes and records which names were used.

    Backed by a callable that loads one tensor by name (lazily, e.g. from safetensors files), so a module
    only materialises the tensors it asks for.
    """

    def __init__(
        self,
        names: Iterable[str],
        load: Callable[[str], torch.Tensor],
        shapes: dict[str, tuple[int, ...]] | None = None,
    ):
        self._names = set(names)
        self._load = load
        self._shapes = shapes or {}
        self.used: set[str] = set()

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor]) -> WeightSource:
        return cls(tensors.keys(), tensors.__getitem__, {k: tuple(v.shape) for k, v in tensors.items()})

    def has(self, name: str) -> bool:
        return name in self._names

    def names_with_prefix(self, prefix: str) -> list[str]:
        return sorted(n for n in self._names if n.startswith(prefix))

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._names:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        if name not in self._shapes:
            self._shapes[name] = tuple(self._load(name).shape)
        return self._shapes[name]

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor called ``name``; if ``shape`` is given it must match exactly (the error names both shapes)."""
        if name not in self._names:
            raise CheckpointError(
                f"checkpoint is missing tensor {name!r}" + (f" (expected shape {list(shape)})" if shape else "")
            )
        if shape is not None and name in self._shapes and tuple(self._shapes[name]) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {list(self._shapes[name])} but the config implies {list(shape)}"
            )
        t = self._load(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {list(t.shape)} but the config implies {list(shape)}")
        self.used.add(name)
        return t

    def unused(self) -> list[str]:
        return sorted(self._names - self.used)


def copy_into(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a module parameter/buffer (dtype converted, no autograd)."""
    with torch.no_grad():
        param.copy_(value.to(param.dtype))
