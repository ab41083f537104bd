"""Load a Hugging Face checkpoint directory (config.json + safetensors, single file or sharded) into a DecoderModel."""

from __future__ import annotations

import json
import math
import re
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from waferline.errors import CheckpointError, ConfigError
from waferline.files import broken_link
from waferline.model.decoder import DecoderModel
from waferline.model.weights import WeightSource
from waferline.spec.configs import spec_from_pretrained
from waferline.spec.model import ModelSpec

# tokenizers load one at a time: transformers' first (lazy) import of AutoTokenizer fails with an ImportError in
# threads that race it, and the verbosity set around the load is process-wide
_TOKENIZER_LOAD = threading.Lock()
# tensors some checkpoints carry that no module needs
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.attention\.masked_bias|\.attn\.bias)$")


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint (sharded index or single file); never pickle files."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError("its weight_map is not an object of tensor name -> file name")
        except (ValueError, KeyError, TypeError) as e:  # (ValueError: invalid JSON, or bytes that are not UTF-8)
            raise CheckpointError(f"{index} is not a valid safetensors index ({e}); re-save the checkpoint") from None
        files = sorted({directory / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{directory}: shards listed in the index are missing: {', '.join(missing)}"
                                  + _broken_links_note(files))
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(directory.glob("*.safetensors"))
    broken = [f.name for f in others if not f.is_file()]
    if broken:
        raise CheckpointError(f"{directory}: {', '.join(broken)} cannot be read" + _broken_links_note(others))
    if others:
        return others
    if list(directory.glob("*.bin")) or list(directory.glob("*.pt")):
        raise CheckpointError(f"{directory} holds only pickle weights (*.bin/*.pt); waferline loads safetensors only "
                              "(convert with transformers: model.save_pretrained(dir, safe_serialization=True))")
    raise CheckpointError(f"{directory} has no model.safetensors or model.safetensors.index.json")


def _broken_links_note(files: list[Path]) -> str:
    """Why files that a directory lists are missing, where they are symbolic links to nothing."""
    notes = [n for n in map(broken_link, files) if n]
    return f" ({notes[0]})" if notes else ""


def open_weights(directory: Path) -> WeightSource:
    """A lazy WeightSource over all safetensors files of ``directory``; truncated or corrupt files are reported."""
    where: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for f in checkpoint_files(directory):
        size = f.stat().st_size
        try:
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    where[k] = f
                    sl = h.get_slice(k)
                    shapes[k] = tuple(sl.get_shape())
            end = _data_end(f)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(
                f"{f} is not a readable safetensors file ({e}); it may be truncated or corrupt: re-download or "
                "re-save it"
            ) from None
        if end and size < end:
            raise CheckpointError(
                f"{f} is truncated: {size} bytes but its header describes {end}; re-download or re-save it"
            )
    handles: dict[Path, object] = {}

    def load(name: str) -> torch.Tensor:
        f = where[name]
        if f not in handles:
            handles[f] = safe_open(str(f), "pt")
        try:
            t = handles[f].get_tensor(name)
        except (SafetensorError, RuntimeError) as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {f} ({e}); the file may be corrupt") from None
        check_finite(t, name, f)
        return t

    return WeightSource(where.keys(), load, shapes)


FINITE_CHUNK = 1 << 24  # elements widened at a time for a dtype aminmax does not take (float8): a small temporary


def check_finite(t: torch.Tensor, name: str, where: Path | str) -> None:
    """Raise a CheckpointError when a floating-point checkpoint tensor holds NaN or inf: such a model would run and
    produce nothing useful (a NaN logit row makes greedy decoding pick token 0 at every step) without any error.

    One aminmax pass (NaN propagates to both ends, inf is an end): it reads the tensor at memory speed and makes no
    tensor of its size, unlike ``isfinite(t).all()``, which costs several times as much."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    if _finite(t):
        return
    flat = t.reshape(-1)
    nan = inf = 0
    for j in range(0, flat.numel(), FINITE_CHUNK):
        v = flat[j:j + FINITE_CHUNK].float()
        nan, inf = nan + int(torch.isnan(v).sum()), inf + int(torch.isinf(v).sum())
    what = " and ".join(x for x in (f"{nan} NaN" if nan else "", f"{inf} inf" if inf else "") if x)
    raise CheckpointError(f"tensor {name!r} in {where} holds non-finite values ({what} of {flat.numel()}); "
                          "the checkpoint is corrupt or was saved from a diverged run: re-download or re-save it")


def _finite(t: torch.Tensor) -> bool:
    try:
        lo, hi = torch.aminmax(t)
        return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
    except (RuntimeError, NotImplementedError):  # a dtype without aminmax (float8): widen it a chunk at a time
        flat = t.reshape(-1)
        return all(bool(torch.isfinite(flat[i:i + FINITE_CHUNK].float()).all())
                   for i in range(0, flat.numel(), FINITE_CHUNK))


def _data_end(f: Path) -> int:
    """Byte offset where the tensor data described by the safetensors header ends."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return 8 + n + (max(ends) if ends else 0)


def load_model(directory: str | Path, dtype: torch.dtype = torch.float32, layer_range: range | None = None,
               has_embed: bool = True, has_head: bool = True) -> DecoderModel:
    """Build waferline's modules for a checkpoint and load its weights; every tensor must be used exactly once."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"model directory {directory} does not exist")
    spec = spec_from_pretrained(directory)
    from waferline.model.quant.formats import check_readable_quantization

    check_readable_quantization(spec.hf_config, directory / "config.json")
    src = open_weights(directory)
    model = DecoderModel(spec, dtype, layer_range, has_embed, has_head)
    int4 = _int4_source(directory, src)
    model.load_hf(int4 or src)
    if int4 is not None:  # int4 checkpoint (waferline, compressed-tensors or GPTQ): keep the stored codes
        from waferline.model.quant.mapping import attach_int4

        attach_int4(model, int4)
    # (an empty tensor holds nothing to use: transformers saves a shared expert of width 0, n_shared_experts 0, so)
    unused = [k for k in src.unused() if not _IGNORED.search(k) and math.prod(src.shape(k))]
    if layer_range is None and has_embed and has_head:
        extra = [k for k in unused if not _is_mtp(k, spec)]
    else:  # a pipeline stage: the tensors of its own layers, (the stage with the embedding) layers past the config,
        # and (the stage with the head) the tensors of no layer that no stage takes: not the embedding's
        extra = [k for k in unused if _stage_extra(k, spec, model, has_embed, has_head)]
    if extra:
        more = f" (and {len(extra) - 10} more)" if len(extra) > 10 else ""
        raise CheckpointError(
            f"{directory}: checkpoint has tensors the {spec.model_type} config does not account for: "
            f"{', '.join(extra[:10])}{more}; is config.json from the same model?"
        )
    if dtype == torch.float16:
        _check_fp16_range(model, directory)
    model.eval()
    return model


def _check_fp16_range(model: DecoderModel, directory: Path) -> None:
    """Raise a CheckpointError where a weight loaded as float16 became inf: a bf16 or fp32 checkpoint value past
    float16's range (65504) overflows when it is cast, and the model would produce NaN (``check_finite`` sees the
    checkpoint's own values, which are finite)."""
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.dtype == torch.float16 and t.numel() and not _finite(t):
            raise CheckpointError(f"{directory}: weight {name} has values past float16's range (+-65504) in the "
                                  "checkpoint, which load as inf; load it with dtype bfloat16 or float32")


def _int4_source(directory: Path, src: WeightSource) -> WeightSource | None:
    """The int4 view of ``src`` when config.json has a ``quantization_config`` (see model/quant/), else None."""
    from waferline.model.quant.formats import Int4Source, quant_method

    cfg = json.loads((directory / "config.json").read_text())
    return Int4Source(src, cfg) if quant_method(cfg) is not None else None


def _stage_extra(name: str, spec: ModelSpec, model: DecoderModel, first: bool, last: bool = False) -> bool:
    """Whether an unused tensor is one a pipeline stage answers for: of a decoder layer it loaded, (``first``: the
    stage with the embedding) of a layer past the config's ``num_hidden_layers`` that is no MTP module, or (``last``:
    the stage with the head) of no layer and not the embedding's (which the stage with the embedding takes)."""
    m = re.match(rf"{re.escape(model.naming.root)}layers\.(\d+)\.", name)
    if m is None:
        return last and name != f"{model.naming.root}{model.naming.embed}.weight"
    i = int(m.group(1))
    return i in model.layer_range or (first and i >= spec.num_layers and not _is_mtp(name, spec))


def _is_mtp(name: str, spec: ModelSpec) -> bool:
    """DeepSeek-style MTP modules are stored as extra layers after the last decoder layer."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m) and spec.num_layers <= int(m.group(1)) < spec.num_layers + len(spec.mtp_layers)


def load_tokenizer(directory: Path) -> Any:
    """The checkpoint's Hugging Face tokenizer, or None when it ships none; a corrupt one is a CheckpointError."""
    if not ((directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file()):
        return None
    with _TOKENIZER_LOAD:
        return _load_tokenizer(directory)


def _load_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # our own model_types (e.g. `sol`) are unknown to transformers' config registry
    try:
        tok = AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:  # a corrupt or unsupported tokenizer file: tokenizers, json and transformers raise their own
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise CheckpointError(f"{directory}: cannot load the tokenizer (tokenizer.json / tokenizer_config.json): "
                              f"{type(e).__name__}: {first}; re-download or re-save it (or remove it and pass "
                              "prompts as token ids)") from None
    finally:
        hf_logging.set_verbosity(level)
    # the engine checks lengths against its context itself: no "sequence length is longer than the specified maximum"
    # warning from transformers for a prompt it will refuse anyway (or that a longer --max-model-len allows)
    tok.model_max_length = int(1e30)
    return tok
