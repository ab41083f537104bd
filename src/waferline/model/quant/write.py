"""Writing an int4 checkpoint: a 16-bit checkpoint quantized tensor by tensor in its own names and layout, with the
``quantization_config`` record config.json carries."""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from waferline.errors import CheckpointError, ConfigError
from waferline.files import check_writable
from waferline.model.quant.calibration import SequentialCalibration, calibration_tokens
from waferline.model.quant.formats import _qconfig
from waferline.model.quant.mapping import (
    _group_ids,
    _groups_line_up,
    _stored_ids,
    _swapped,
    _used_tensors,
    trace_layer,
)
from waferline.model.quant.modules import QuantOptions, _kept, _quantize_param, install, matmul_weights
from waferline.model.quant.tensor import ALWAYS_16BIT, QUANT_METHOD, Int4Tensor
from waferline.model.quant.weight import Int4Weight
from waferline.spec.configs import ENGINE_MODEL_TYPES, read_config_json, spec_from_pretrained

# the 16-bit model's weights in other formats (PyTorch pickles, Flax, TensorFlow, GGUF), with their shard indexes:
# not copied into the int4 checkpoint (they would hold the whole 16-bit model again)
OTHER_WEIGHT_FILES = (".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf")


def quantization_config(opts: QuantOptions, kept: list[str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``quantization_config`` entry written to config.json."""
    d = {
        "quant_method": QUANT_METHOD,
        "format": "int4-grouped",
        "bits": opts.bits,
        "group_size": opts.group_size,
        "symmetric": opts.symmetric,
        "method": opts.method,
        "scale_dtype": str(opts.scale_dtype).removeprefix("torch."),
        "dequant": "w = (q - 8) * scale + zero",
        "always_16bit": list(ALWAYS_16BIT),
        "keep_patterns": list(opts.keep),
        "modules_not_quantized": kept,
    }
    d.update(extra or {})
    return d


def _scatter(t: Int4Tensor, ids: Tensor, selected: list[str], shapes: dict[str, tuple[int, ...]],
             outs: dict[str, dict[str, Tensor]], covered: dict[str, int]) -> bool:
    """Write module-layout ``t`` back into per-checkpoint-tensor codes/scales/zeros (``outs``); False (nothing
    written) when the module's groups do not map one-to-one onto groups along each checkpoint tensor's last dim."""
    G = t.group_size
    used = _used_tensors(ids)
    shp = [shapes[selected[j]] for j in used]
    if any(sh[-1] % G for sh in shp):
        return False
    elem, gid, _ = _group_ids(ids, used, shp, G)
    if not _groups_line_up(gid, G):
        return False
    numel = [math.prod(sh) for sh in shp]
    codes = torch.full((sum(numel),), 8, dtype=torch.uint8)
    codes[elem.flatten()] = t.codes.flatten()
    heads = gid[..., ::G].flatten()
    scales = torch.zeros(sum(numel) // G, dtype=t.scales.dtype)
    scales[heads] = t.scales.flatten()
    zeros = None
    if t.zeros is not None:
        zeros = torch.zeros(sum(numel) // G, dtype=t.zeros.dtype)
        zeros[heads] = t.zeros.flatten()
    counts = torch.bincount(ids.flatten() >> 32, minlength=max(used) + 1)
    e0 = g0 = 0
    for j, sh, n in zip(used, shp, numel):
        name = selected[j]
        if name in outs:
            raise CheckpointError(f"{name} feeds more than one weight; waferline cannot quantize it")
        grid = (*sh[:-1], sh[-1] // G)
        outs[name] = {"codes": codes[e0:e0 + n].view(sh), "scales": scales[g0:g0 + n // G].view(grid)}
        if zeros is not None:
            outs[name]["zeros"] = zeros[g0:g0 + n // G].view(grid)
        covered[name] = int(counts[j])
        e0, g0 = e0 + n, g0 + n // G
    return True


def _place(t: Int4Tensor, ids: Tensor, selected: list[str], shapes: dict[str, tuple[int, ...]],
           outs: dict[str, dict[str, Tensor]], covered: dict[str, int]) -> list[str] | None:
    """:func:`_scatter` ``t`` into the checkpoint tensors feeding it as they are (``X.weight`` names only: the file
    names those ``X.qweight``), else with their last two axes swapped (their groups along the tensor's axis -2, as
    gpt-oss's fused experts keep the input dimension). The names stored swapped ([] for none); None when neither
    lines up."""
    used = _used_tensors(ids)
    names = [selected[j] for j in used]
    if all(n.endswith(".weight") for n in names) and _scatter(t, ids, selected, shapes, outs, covered):
        return []
    flips = {j: shapes[selected[j]] for j in used}
    stored = {n: _swapped(shapes[n]) for n in names}
    if _scatter(t, _stored_ids(ids, flips), selected, stored, outs, covered):
        return names
    return None


def check_out_dir(model_dir: Any, out_dir: Any) -> None:
    """Refuse an ``out_dir`` that would destroy ``model_dir`` when it is replaced (the same directory, or one above
    it), one that names a file, and a symbolic link to nothing."""
    from pathlib import Path

    m, o = Path(model_dir).resolve(), Path(out_dir).resolve()
    if o == m:
        raise ConfigError("--out must differ from --model")
    if o in m.parents:
        raise ConfigError(f"--out {out_dir} contains --model {model_dir}: writing it would delete the checkpoint being "
                          "quantized; choose an --out outside it")
    if o.exists() and not o.is_dir():
        raise ConfigError(f"--out {out_dir} is a file, not a directory; choose a directory path")
    if Path(out_dir).is_symlink() and not Path(out_dir).exists():  # (the checkpoint cannot be renamed onto it)
        raise ConfigError(f"--out {out_dir} is a symbolic link to {os.readlink(out_dir)}, which does not exist; "
                          "remove the link or choose another --out")


def _calibration(model_dir: Path, calibration: str, max_tokens: int, spec: Any) -> list[int]:
    """GPTQ's calibration token ids from ``calibration`` (text through the checkpoint's tokenizer, or ids), checked
    against ``spec``'s vocabulary."""
    from waferline.model.load import load_tokenizer

    tokens = calibration_tokens(calibration, load_tokenizer(model_dir), max_tokens)
    if max(tokens) >= spec.vocab_size:
        raise ConfigError(f"calibration file {calibration} has token ids past the vocabulary ({spec.vocab_size}): "
                          f"e.g. {max(tokens)}")
    return tokens


def check_quantize(model_dir: Any, out_dir: Any, opts: QuantOptions, calibration: str | None = None,
                   force: bool = False, calibration_max_tokens: int = 4096) -> Any:
    """What ``quantize_checkpoint`` checks before any work (the source's config and weight files, the options, where
    it will write, an architecture the engine runs, GPTQ's calibration file): a ConfigError naming the first problem,
    else the source's ModelSpec."""
    from pathlib import Path

    from waferline.model.load import checkpoint_files

    opts.validate()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"{model_dir} has no config.json: pass a Hugging Face checkpoint directory to --model")
    cfg = read_config_json(model_dir / "config.json")
    if _qconfig(cfg):
        raise ConfigError(
            f"{model_dir} is already quantized ({_qconfig(cfg).get('quant_method')}); quantize a 16-bit checkpoint"
        )
    check_out_dir(model_dir, out_dir)
    if out_dir.name in ("", ".", ".."):  # (the checkpoint is renamed into place: it needs a name of its own)
        raise ConfigError(f"--out {out_dir}: give the output directory by its name (e.g. {out_dir.resolve()}), "
                          "not as '.' or '..'")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise ConfigError(f"{out_dir} exists and is not empty; choose another --out or pass --force to replace it")
    if opts.method == "gptq" and not calibration:
        raise ConfigError(
            "GPTQ needs calibration data: pass --calibration FILE (text, or whitespace-separated token ids)"
        )
    if calibration and not Path(calibration).is_file():  # (said before the model loads, not after)
        raise ConfigError(f"--calibration {calibration}: no such file")
    parent = out_dir.resolve().parent  # (where the checkpoint will be written: checked before the work, not after)
    while not parent.exists():
        parent = parent.parent
    try:  # (a file made and removed there: what permissions, a read-only file system or /proc allow, root included)
        check_writable(out_dir.resolve().parent / f".{out_dir.name}.new")
    except ConfigError:
        raise ConfigError(f"cannot write {out_dir}: {parent} is not a writable directory") from None
    spec = spec_from_pretrained(model_dir)
    if spec.model_type not in ENGINE_MODEL_TYPES:  # (the engine loads the model to quantize it)
        raise ConfigError(f"model_type {spec.model_type!r} is planner-only: waferline cannot load it to quantize it; "
                          f"the engine runs {', '.join(ENGINE_MODEL_TYPES)}")
    checkpoint_files(model_dir)  # (no weight files: said here, not after loading starts)
    if opts.method == "gptq":  # (a file of too few tokens, text without a tokenizer: said before the model loads)
        _calibration(model_dir, calibration, calibration_max_tokens, spec)
    return spec


def _temp_prefix(out_dir: Path) -> str:
    """How a writer's temporary directory beside ``out_dir`` is named: it says which host and process owns it."""
    return f".{out_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}-"


def _writer(d: Path, out_dir: Path) -> tuple[str, int] | None:
    """(host, process id) that ``d`` (a temporary directory beside ``out_dir``) names as its writer's
    (:func:`_temp_prefix`: HOST-PID-SUFFIX; mkdtemp's suffix has no "-"), or None where its name says none."""
    head = f".{out_dir.name}.tmp-"
    parts = d.name[len(head):].rsplit("-", 2) if d.name.startswith(head) else []
    return (parts[0], int(parts[1])) if len(parts) == 3 and parts[0] and parts[1].isdigit() else None


def _writer_alive(d: Path, out_dir: Path) -> bool | None:
    """Whether ``d`` (a temporary directory beside ``out_dir``) is a writer's on this host whose process still runs;
    None where its name does not say (another host's, or not named by :func:`_temp_prefix`)."""
    w = _writer(d, out_dir)
    if w is None or w[0] != socket.gethostname():
        return None
    try:
        os.kill(w[1], 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process: alive)
        pass
    return True


def _remove_dead_writers_temps(out_dir: Path) -> None:
    """Remove the temporary directories beside ``out_dir`` of writers on this host whose process is gone (killed
    part-way: nothing else ever removes them, as the next run finds ``out_dir`` in place); a live writer's stays."""
    mine = f".{out_dir.name}.tmp-{socket.gethostname()}-"
    for d in out_dir.parent.glob(glob.escape(mine) + "*"):
        if _writer_alive(d, out_dir) is False and d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)


def quantize_checkpoint(model_dir: Any, out_dir: Any, opts: QuantOptions, calibration: str | None = None,
                        calibration_max_tokens: int = 4096, force: bool = False,
                        progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Quantize a 16-bit checkpoint directory to the canonical int4 format in ``out_dir`` (written to a temporary
    directory beside it, then renamed into place). Returns a summary (tensors, bytes, the accounting's bytes)."""
    import tempfile
    import time

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from waferline.model.load import checkpoint_files, load_model, open_weights

    t0 = time.perf_counter()
    spec = check_quantize(model_dir, out_dir, opts, calibration, force, calibration_max_tokens)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    cfg = read_config_json(model_dir / "config.json")
    tokens = _calibration(model_dir, calibration, calibration_max_tokens, spec) if opts.method == "gptq" else []
    model = load_model(model_dir, torch.float32)
    calib = None
    n_calib = 0
    if opts.method == "gptq":
        n_calib = len(tokens)
        calib = SequentialCalibration(model, tokens)
    raw = open_weights(model_dir)
    names = raw.names_with_prefix("")
    shapes = {n: tuple(raw.shape(n)) for n in names}
    selected = [n for n in names if len(shapes[n]) >= 2]
    outs: dict[str, dict[str, Tensor]] = {}
    covered: dict[str, int] = {}
    kept: list[str] = []
    off_layout: list[str] = []  # kept because the file's layout cannot hold them (not asked for with --keep)
    transposed: list[str] = []  # stored with their last two axes swapped
    total = len(model.layers)
    for pos, (layer, i) in enumerate(zip(model.layers, model.layer_range)):
        traced = trace_layer(spec, i, shapes, selected)
        hess = calib.hessians(layer) if calib is not None else {}
        for path, owner, leaf in matmul_weights(layer):
            mpath = f"layers.{pos}.{path}"
            ids = traced.get(path)
            feeds = [] if ids is None else [selected[j] for j in _used_tensors(ids)]
            if ids is None or _kept(mpath, opts.keep) or any(_kept(f, opts.keep) for f in feeds):
                kept += feeds or [mpath]
                if ids is None:
                    off_layout.append(mpath)
                continue
            w = getattr(owner, leaf).detach()
            t = _quantize_param(w, opts, hess.get(path))
            swapped = None if t is None else _place(t, ids, selected, shapes, outs, covered)
            if swapped is None:
                kept += feeds
                if t is not None:
                    off_layout.append(mpath)
                continue
            transposed += swapped
            if calib is not None:  # later layers calibrate on this layer's int4 outputs
                install(layer, path, Int4Weight(t, w.device, torch.bfloat16))
        if calib is not None:
            calib.advance(layer)
        if progress:
            progress(pos + 1, total, f"layer {i}")
    tensors: dict[str, Tensor] = {}
    n_q = 0
    int4_bytes = 0
    for name in names:
        c = covered.get(name, 0)
        if c and c != math.prod(shapes[name]):
            raise CheckpointError(f"{name} would be only partly int4 ({c} of {math.prod(shapes[name])} elements); "
                                  "keep the weights it feeds all 16-bit or all int4 (--keep)")
        if c:
            o = outs[name]
            t = Int4Tensor(o["codes"], o["scales"], o.get("zeros"))
            tensors.update(t.to_safetensors(name.removesuffix(".weight")))
            int4_bytes += t.nbytes()
            n_q += 1
        else:
            v = raw.get(name)  # (a 16-bit tensor keeps its dtype: an fp16 checkpoint's norms are not rounded to bf16)
            wide = v.is_floating_point() and v.dtype not in (torch.bfloat16, torch.float16)
            tensors[name] = (v.to(torch.bfloat16) if wide else v).contiguous()
    if n_q == 0:
        raise ConfigError(f"no weight was quantized: group size {opts.group_size} fits none of {spec.name}'s matmul "
                          "widths, or --keep kept them all; nothing written")
    extra: dict[str, Any] = {"transposed": sorted(transposed)} if transposed else {}
    if n_calib:
        extra["calibration_tokens"] = n_calib
    qcfg = quantization_config(opts, sorted(set(kept)), extra)
    cfg["quantization_config"] = qcfg
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_writers_temps(out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(out_dir), dir=out_dir.parent))
    except OSError as e:
        raise ConfigError(f"cannot write {out_dir}: {e.strerror or e}") from None
    umask = os.umask(0)
    os.umask(umask)
    try:
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the checkpoint should not be
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "quantization": QUANT_METHOD})
        (tmp / "model.safetensors").chmod(0o666 & ~umask)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        skip = {f.name for f in checkpoint_files(model_dir)} | {"config.json", "model.safetensors.index.json"}
        for f in model_dir.iterdir():
            if f.is_file() and f.name not in skip and not f.name.endswith(".safetensors") \
                    and not f.name.removesuffix(".index.json").endswith(OTHER_WEIGHT_FILES):
                shutil.copy2(f, tmp / f.name)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{int(time.time())}")
            out_dir.rename(old)
            try:
                tmp.rename(out_dir)
            except BaseException:  # (the old output goes back where it was)
                old.rename(out_dir)
                raise
            if old.is_symlink():  # (an --out that was a link: the link goes, the directory it named stays as it was)
                old.unlink()
            else:
                shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    except (OSError, SafetensorError) as e:  # (a full disk, a quota: one line, not a traceback)
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"cannot write {out_dir}: {getattr(e, 'strerror', None) or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    bytes_in = sum(f.stat().st_size for f in checkpoint_files(model_dir))
    bytes_out = (out_dir / "model.safetensors").stat().st_size
    return {"out": str(out_dir), "method": opts.method, "bits": opts.bits, "group_size": opts.group_size,
            "symmetric": opts.symmetric, "tensors_int4": n_q, "tensors_16bit": len(names) - n_q,
            "modules_not_quantized": qcfg["modules_not_quantized"], "not_in_file_layout": off_layout,
            "calibration_tokens": n_calib,
            "bytes_in": bytes_in, "bytes_out": bytes_out,
            "accounting_bytes": spec.weight_bytes(4, opts.group_size, zeros=not opts.symmetric),
            "accounting_bytes_16bit": spec.weight_bytes(16), "seconds": round(time.perf_counter() - t0, 2)}
