"""GPTQ's calibration: token ids from a file, the input Hessians of every matmul weight (per expert for MoE), and the
layer-by-layer pass that lets each layer see the quantization error of the ones before it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from waferline.errors import ConfigError
from waferline.model.quant.modules import matmul_weights

MIN_CALIBRATION_TOKENS = 16


def calibration_tokens(path: str, tokenizer: Any, max_tokens: int) -> list[int]:
    """Token ids from a calibration file: text (needs the checkpoint's tokenizer) or whitespace-separated ids."""
    from pathlib import Path

    p = Path(path)
    if max_tokens < MIN_CALIBRATION_TOKENS:  # (the file is read only this far: not the file's fault below)
        raise ConfigError(f"calibration tokens must be >= {MIN_CALIBRATION_TOKENS} (GPTQ needs at least a few "
                          f"hundred), got {max_tokens}")
    if not p.is_file():
        raise ConfigError(f"calibration file {p} does not exist")
    text = p.read_text(errors="replace")[: max_tokens * 16]  # more characters than max_tokens tokens need
    if "\0" in text or text.count("\ufffd") > len(text) // 10:  # (a few bad bytes are still text; this is not)
        raise ConfigError(f"calibration file {p} is binary data, not text: give text (UTF-8) or whitespace-separated "
                          "token ids")
    parts = text.split()
    if parts and all(s.isdigit() for s in parts[:1000]):
        bad = next((s for s in parts if not s.isdecimal()), None)
        if bad is not None:
            raise ConfigError(f"calibration file {p} starts as whitespace-separated token ids but holds {bad[:40]!r}; "
                              "give only token ids (or text)")
        ids = [int(s) for s in parts]
    elif tokenizer is None:
        raise ConfigError(
            f"{p} is text but the checkpoint has no tokenizer: give token ids (whitespace-separated) instead"
        )
    else:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) < MIN_CALIBRATION_TOKENS:
        raise ConfigError(f"calibration file {p} gives only {len(ids)} tokens; GPTQ needs at least a few hundred")
    return ids[:max_tokens]


def _chunks(tokens: list[int], seq_len: int) -> list[list[int]]:
    return [tokens[s:s + seq_len] for s in range(0, len(tokens), seq_len) if len(tokens[s:s + seq_len]) >= 2]


@torch.inference_mode()
def collect_hessians(model: nn.Module, tokens: list[int], seq_len: int = 256) -> dict[str, Tensor]:
    """``H = sum x x^T`` of the inputs of every matmul weight (per expert for MoE) of the whole model, from one
    pass over the calibration tokens (keys: paths as in :func:`matmul_weights`)."""
    from waferline.model.context import StepBatch

    def run() -> None:
        for chunk in _chunks(tokens, seq_len):
            model(torch.tensor([chunk]), model.new_caches(1), StepBatch.make([0], [0], len(chunk)))

    return hessians(model, run)


def hessians(root: nn.Module, run: Callable[[], None]) -> dict[str, Tensor]:
    """``H = sum x x^T`` of the inputs of every matmul weight under ``root`` (per expert for MoE) while ``run()``
    drives data through it. Keys are the paths of :func:`matmul_weights` relative to ``root``."""
    from waferline.model.moe import DenseFFN, MoE
    from waferline.model.v4_blocks import V4MoE

    H: dict[str, Tensor] = {}

    def acc(key: str, x: Tensor, K: int, expert: int | None = None, E: int = 0) -> None:
        x = x.reshape(-1, K).double()
        if key not in H:
            H[key] = torch.zeros((E, K, K) if E else (K, K), dtype=torch.float64)
        (H[key][expert] if expert is not None else H[key]).add_(x.t() @ x)

    hooks, patched = [], []
    for path, owner, leaf in matmul_weights(root):
        K = getattr(owner, leaf).shape[-1]
        if leaf == "weight":
            hooks.append(owner.register_forward_pre_hook(
                lambda m, args, key=path, K=K: acc(key, args[0], K)))
    for name, mod in root.named_modules():
        pre = name + "." if name else ""
        if isinstance(mod, (MoE, V4MoE)) and isinstance(getattr(mod, "w_down", None), Tensor):
            orig, E = mod.expert_linear, mod.w_down.shape[0]

            def ex(
                x: Tensor, which: str, experts: Any, orig: Any = orig, pre: str = pre, mod: nn.Module = mod, E: int = E
            ) -> Tensor:
                K = getattr(mod, "w_" + which).shape[-1]
                if isinstance(experts, int):
                    acc(f"{pre}w_{which}", x, K, experts, E)
                else:
                    for e in experts.unique().tolist():
                        acc(f"{pre}w_{which}", x[experts == e], K, int(e), E)
                return orig(x, which, experts)

            mod.expert_linear = ex
            patched.append((mod, getattr(mod, "gather_max", None)))
            if isinstance(mod, MoE):
                mod.gather_max = 0
        elif isinstance(mod, DenseFFN) and isinstance(getattr(mod, "w_down", None), Tensor):
            orig = mod.linear

            def lin(x: Tensor, which: str, orig: Any = orig, pre: str = pre, mod: DenseFFN = mod) -> Tensor:
                acc(f"{pre}w_{which}", x, getattr(mod, "w_" + which).shape[-1])
                return orig(x, which)

            mod.linear = lin
            patched.append((mod, None))
    try:
        with torch.inference_mode():
            run()
    finally:
        for h in hooks:
            h.remove()
        for mod, gm in patched:
            for attr in ("expert_linear", "linear"):
                mod.__dict__.pop(attr, None)
            if gm is not None:
                mod.gather_max = gm
    return {k: v.float() for k, v in H.items()}


class SequentialCalibration:
    """GPTQ's layer-by-layer calibration: the inputs of layer i come from layers < i *after* they were quantized,
    so each layer's quantization sees (and corrects for) the error of the ones before it."""

    def __init__(self, model: nn.Module, tokens: list[int], seq_len: int = 256):
        from waferline.model.context import StepBatch

        self.chunks = _chunks(tokens, seq_len)
        self.batches = [StepBatch.make([0], [0], len(c)) for c in self.chunks]
        if getattr(model, "hc_mult", 0):  # DeepSeek-V4's hash-routed layers pick experts by token id
            for c, b in zip(self.chunks, self.batches):
                b.memo["tokens"] = torch.tensor([c])
        with torch.inference_mode():
            self.xs = [model.embed_tokens(torch.tensor([c])) for c in self.chunks]

    def _run(self, layer: nn.Module) -> list[Tensor]:
        return [layer(x, layer.new_cache(1), b) for x, b in zip(self.xs, self.batches)]

    def hessians(self, layer: nn.Module) -> dict[str, Tensor]:
        """Hessians of ``layer``'s matmul weights (keys relative to the layer) on its current inputs."""
        return hessians(layer, lambda: self._run(layer))

    @torch.inference_mode()
    def advance(self, layer: nn.Module) -> None:
        """Feed the (now quantized) ``layer``: its outputs become the next layer's inputs."""
        self.xs = self._run(layer)
