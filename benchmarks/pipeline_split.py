"""Where the pipeline cuts the layers: one process against 2 stage processes x 2 micro-batches with the layers split
evenly by count and with the default split (balanced by each layer's decode FLOPs, the LM head counted on the last
stage), one torch thread per process, in one run. Greedy decode of N sequences through `LLM.generate`; prints a table,
writes JSON.

    python benchmarks/pipeline_split.py                    # decode_speed.py's 124.7M Llama (built and cached)
    python benchmarks/pipeline_split.py --model DIR --sequences 16,64

Best of --repeats per row (the rows interleaved per repeat, so a drifting host shifts all alike).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from waferline import LLM, SamplingParams  # noqa: E402
from waferline.engine.pipeline.launch import balanced_ranges, stage_ranges  # noqa: E402
from waferline.plan.plan import Plan, Stage  # noqa: E402
from waferline.spec.configs import spec_from_pretrained  # noqa: E402


def _plan(ranges: list[tuple[int, int]], micro_batches: int, weight_bits: int = 16) -> Plan:
    return Plan(model="bench", hardware="cpu", micro_batches=micro_batches, weight_bits=weight_bits,
                stages=[Stage(index=i, role="full", layers=list(range(a, b)), device="cpu", device_ids=[i])
                        for i, (a, b) in enumerate(ranges)])


def int4_dir(path: Path, cached: bool) -> Path:
    """Where the int4 checkpoint of ``path`` is kept: decode_speed.py's cache layout (``<model>/int4-g128`` beside
    ``<model>/hf``) for the default model, ``<DIR>-int4-g128`` beside a --model DIR (named by it: two models in one
    folder must not share one)."""
    return path.parent / ("int4-g128" if cached else f"{path.name}-int4-g128")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: decode_speed.py's llama, built once)")
    ap.add_argument("--sequences", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64],
                    help="batch sizes (comma-separated, default 16,64)")
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--weight-bits", type=int, choices=(16, 4), default=16,
                    help="4: every engine of the run loads an int4 checkpoint (RTN, group 128, quantized once "
                    "next to the model: DIR-int4-g128)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "pipeline_split.json"))
    args = ap.parse_args()
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(args.out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    if args.model is None:
        from decode_speed_models import CACHE, build_checkpoint

        path = build_checkpoint("llama", False, CACHE) / "hf"
    else:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            ap.error(f"--model {args.model}: no config.json there")
    if args.weight_bits == 4:  # an int4 checkpoint (RTN, group 128) next to the bf16 one, built once
        from waferline.model.quant import QuantOptions, quantize_checkpoint

        qdir = int4_dir(path, args.model is None)
        if not (qdir / "model.safetensors").is_file():
            quantize_checkpoint(path, qdir, QuantOptions(group_size=128), force=True)
        path = qdir
    spec = spec_from_pretrained(path)
    even, balanced = stage_ranges(spec.num_layers, 2), balanced_ranges(spec, 2)
    torch.set_num_threads(1)
    engines = {"one process": LLM(path),
               f"2 stages x 2, even {even}": LLM(path, plan=_plan(even, 2, args.weight_bits), threads_per_stage=1),
               f"2 stages x 2, balanced {balanced}": LLM(path, stages=2, micro_batches=2, threads_per_stage=1)}
    V = spec.vocab_size
    best: dict[tuple[str, int], float] = {}
    try:
        for llm in engines.values():  # warm-up
            llm.generate([[5] * 8], SamplingParams(max_tokens=4, ignore_eos=True))
        for _ in range(args.repeats):
            for n in args.sequences:
                prompts = [[(7 * i + 13 * j) % (V - 10) + 5 for j in range(args.prompt_len)] for i in range(n)]
                sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
                for name, llm in engines.items():
                    t0 = time.perf_counter()
                    out = llm.generate(prompts, sp)
                    rate = sum(len(o.token_ids) for o in out) / (time.perf_counter() - t0)
                    best[name, n] = max(best.get((name, n), 0.0), rate)
    finally:
        for llm in engines.values():
            llm.close()
    rows = []
    print(f"{'engine':<44} {'sequences':>9} {'tok/s':>8} {'vs one process':>15}")
    for n in args.sequences:
        base = best["one process", n]
        for name in engines:
            r = best[name, n]
            rows.append({"engine": name, "sequences": n, "tokens_per_s": round(r, 1), "vs_one_process": round(r / base,
                                                                                                             3)})
            print(f"{name:<44} {n:>9} {r:>8.1f} {r / base:>14.2f}x")
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
              "torch": torch.__version__, "model": str(path), "settings": vars(args), "ranges": {
                  "even": even, "balanced": balanced}, "rows": rows}
    write_text_atomic(args.out, json.dumps(result, indent=1), make_parents=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
