"""Held-out perplexity and weight bytes of bf16 vs int4 (RTN g128, RTN g32, GPTQ g32) for a checkpoint.

Default: the trained sol-mini (`models/sol-mini`, its `heldout.txt`), GPTQ calibrated on the first tokens of the
training text (`train/work/data/train.txt`, never the held-out plays). That file does not ship: the data step of
`python train/sol_mini.py` writes it (the error message without it shows that step alone), or pass `--calibration
FILE`. Perplexity is `LLM.perplexity`, as sol-mini's model card scores it: consecutive non-overlapping windows of 256
tokens, each from scratch. int4 variants run W4A16 (bf16 activations). Weight bytes are the safetensors tensor bytes
of each checkpoint (bf16: the source's tensors at 2 bytes), in all and for the decoder layers alone (embeddings, LM
head and MTP head stay 16-bit). Prints a table, writes benchmarks/results/w4a16_quality.json.

    python benchmarks/w4a16_quality.py
    python benchmarks/w4a16_quality.py --model DIR --heldout FILE --calibration FILE
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import tempfile
import time
from pathlib import Path

from safetensors import safe_open

from waferline import LLM
from waferline.model.load import checkpoint_files
from waferline.model.quant import QuantOptions, calibration_tokens, quantize_checkpoint

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = (("int4 RTN g128", "rtn", 128), ("int4 RTN g32", "rtn", 32), ("int4 GPTQ g32", "gptq", 32))


_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "I32": 4, "I64": 8, "F64": 8}


def tensor_bytes(directory: Path, num_layers: int, as_bf16: bool = False) -> tuple[int, int, int]:
    """Bytes of tensor data in a checkpoint (headers excluded): all tensors, the decoder layers only (no
    embeddings, LM head or MTP head), and the MTP head. ``as_bf16``: floating-point tensors at 2 bytes (bf16)."""
    total = layers = mtp = 0
    for f in checkpoint_files(directory):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_slice(k)
                size = 2 if as_bf16 and t.get_dtype() in ("F32", "F16", "BF16", "F64") else _SIZES[t.get_dtype()]
                n = math.prod(t.get_shape()) * size
                total += n
                m = re.match(r"(model|backbone)\.layers\.(\d+)\.", k)
                if m and int(m.group(2)) < num_layers:
                    layers += n
                elif m:
                    mtp += n
    return total, layers, mtp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "sol-mini"))
    ap.add_argument("--heldout", default=None, help="held-out text or token ids (default: MODEL/heldout.txt)")
    ap.add_argument("--calibration", default=str(ROOT / "train" / "work" / "data" / "train.txt"),
                    help="GPTQ calibration text or token ids (default: sol-mini's training text, which "
                         "train/sol_mini.py writes; not in a fresh clone)")
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--max-eval-tokens", type=int, default=8192)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "w4a16_quality.json"))
    a = ap.parse_args()
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(a.out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    model = Path(a.model)
    if not (model / "config.json").is_file():
        raise SystemExit(f"{model} is not a checkpoint directory (the trained sol-mini appears at models/sol-mini); "
                         "pass --model DIR --heldout FILE")
    heldout = Path(a.heldout) if a.heldout else model / "heldout.txt"
    if not heldout.is_file():
        raise SystemExit(f"no held-out text at {heldout}: pass --heldout FILE")
    if not Path(a.calibration).is_file():
        raise SystemExit(f"no GPTQ calibration text at {a.calibration}: pass --calibration FILE, or write sol-mini's "
                         "training text there (the data step of python train/sol_mini.py, without training: python -c "
                         "\"import sys, pathlib; sys.path.insert(0, 'train'); import sol_mini; "
                         "sol_mini.prepare_data(pathlib.Path('train/work'))\")")
    base = LLM(str(model), dtype="bfloat16")
    ids = calibration_tokens(str(heldout), base.tokenizer, a.max_eval_tokens)
    rows = []
    L = base.spec.num_layers
    bf16_total, bf16_layers, _ = tensor_bytes(model, L, as_bf16=True)
    work = Path(tempfile.mkdtemp(prefix="w4a16-quality-"))
    try:
        for name, method, group in (("bf16", None, None), *VARIANTS):
            t = time.perf_counter()
            if method is None:
                llm, nbytes, nlayers = base, bf16_total, bf16_layers
            else:
                path = work / f"{method}-g{group}"
                quantize_checkpoint(model, path, QuantOptions(group_size=group, method=method),
                                    calibration=a.calibration if method == "gptq" else None,
                                    calibration_max_tokens=a.calibration_tokens)
                llm = LLM(str(path), dtype="bfloat16")
                nbytes, nlayers, nmtp = tensor_bytes(path, L)
                acct = llm.spec.weight_bytes(4, group)  # the planner's accounting (no MTP head)
                print(
                    f"{name:>14}: file bytes without the MTP head {nbytes - nmtp:,} vs ModelSpec.weight_bytes(4, "
                    f"{group}) "
                    f"{acct:,.0f} ({100 * ((nbytes - nmtp) / acct - 1):+.2f}%)",
                    flush=True,
                )
            ppl = llm.perplexity(ids)
            rows.append(
                {
                    "variant": name,
                    "perplexity": round(ppl, 3),
                    "weight_bytes": nbytes,
                    "vs_bf16_bytes": round(nbytes / bf16_total, 3),
                    "layer_bytes": nlayers,
                    "layers_vs_bf16": round(nlayers / bf16_layers, 3),
                    "seconds": round(time.perf_counter() - t, 1),
                }
            )
            print(f"{name:>14}: ppl {ppl:8.3f}  {nbytes / 1e6:7.2f} MB  ({time.perf_counter() - t:.0f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ref = rows[0]["perplexity"]
    for r in rows:
        r["ppl_vs_bf16"] = round(r["perplexity"] / ref - 1, 4)
    res = {"model": str(model), "heldout": str(heldout), "eval_tokens": len(ids), "calibration": a.calibration,
           "calibration_tokens": a.calibration_tokens, "rows": rows}
    print(f"\n{model.name}: {len(ids)} held-out tokens ({heldout.name}); GPTQ calibrated on "
          f"{a.calibration_tokens} tokens of {Path(a.calibration).name}")
    print("| weights | held-out perplexity | vs bf16 | weight bytes (all) | vs bf16 | decoder layers only | vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['perplexity']:.2f} | {100 * r['ppl_vs_bf16']:+.1f}% | "
              f"{r['weight_bytes'] / 1e6:.2f} MB | {r['vs_bf16_bytes']:.2f}x | {r['layer_bytes'] / 1e6:.2f} MB | "
              f"{r['layers_vs_bf16']:.2f}x |")
    write_text_atomic(a.out, json.dumps(res, indent=2), make_parents=True)
    print(f"wrote {a.out}")



if __name__ == "__main__":
    main()
