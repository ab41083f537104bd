"""The twin's measured tables: `waferline twin` on sol-mini and on a ~100M-parameter DeepSeek-V3-type random
checkpoint, each against this host's calibration; writes benchmarks/results/twin_<model>.json and prints the tables.

    python benchmarks/twin_grid.py                    # calibrate (cached for a day), then both models (~10-15 min)
    python benchmarks/twin_grid.py --models sol-mini  # one model
    python benchmarks/twin_grid.py --recalibrate      # re-measure the host first

Run it on a quiet machine: every engine run and every calibration probe counts wall time, and other work on the
machine slows the engine runs down (the table prints the load average; the JSON records it per run). Never part of the
test pass/fail.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from waferline.argtypes import positive_int
from waferline.errors import WaferlineError
from waferline.files import write_text_atomic
from waferline.spec.configs import spec_from_pretrained

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# DeepSeek-V3 architecture (MLA with q/kv LoRA, first layer dense, sigmoid-routed MoE with a shared expert and group
# routing, one MTP module) at ~100M parameters.
DSV3_100M = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 8192, "hidden_size": 768,
    "num_hidden_layers": 10, "num_attention_heads": 12, "num_key_value_heads": 12, "q_lora_rank": 384,
    "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "intermediate_size": 2048,
    "moe_intermediate_size": 384, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": 0,
    "eos_token_id": 1, "torch_dtype": "bfloat16",
}


def dsv3_checkpoint() -> Path:
    """The ~100M DeepSeek-V3-type random checkpoint (seed 0), written once into the cache (whole: its config.json is
    written last, so a build that failed or was stopped before it is built again)."""
    from waferline.model.init import write_random_checkpoint
    from waferline.sim.twin import cache_dir

    d = cache_dir() / "models" / "dsv3-100m"
    if not (d / "config.json").is_file():
        write_random_checkpoint(DSV3_100M, d, seed=0)
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["sol-mini", "dsv3-100m"], choices=["sol-mini", "dsv3-100m"])
    ap.add_argument(
        "--hardware", default=None, help="hardware YAML from `waferline calibrate` (default: cached calibration)"
    )
    ap.add_argument("--recalibrate", action="store_true")
    ap.add_argument("--grid", default="default")
    ap.add_argument("--repeats", type=positive_int, default=2, help="timed runs per Plan and pass; the fastest counts")
    ap.add_argument("--passes", type=positive_int, default=2,
                    help="passes over the grid; each Plan's fastest pass counts")
    args = ap.parse_args()
    try:
        return _run(args)
    except WaferlineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from waferline.sim.host import HostParams
    from waferline.sim.twin import cached_hardware, load_grid, render, run_twin

    con = Console(width=200)
    src = Path(args.hardware or cached_hardware(recalibrate=args.recalibrate))
    HostParams.load(src)  # a calibration, and the grid, before anything is run or replaced
    load_grid(args.grid)
    RESULTS.mkdir(parents=True, exist_ok=True)
    hw = RESULTS / "twin_host.yaml"  # the calibration these tables were predicted with, kept beside them
    # (replaced with the first table, not before: a run that fails or is interrupted leaves the results as they were,
    # each table beside the calibration it was predicted with)
    hw_text = None if src.resolve() == hw.resolve() else src.read_text()
    for name in args.models:
        path = ROOT / "models" / "sol-mini" if name == "sol-mini" else dsv3_checkpoint()
        spec = spec_from_pretrained(path)
        con.print(
            f"\n[bold]{name}[/]: {spec.params_total() / 1e6:.0f}M parameters, {spec.params_active() / 1e6:.0f}M "
            "active per token"
        )
        t = time.perf_counter()
        res = run_twin(path, str(src if hw_text is not None else hw), args.grid, repeats=args.repeats,
                       passes=args.passes,
                       progress=lambda what, frac: print(f"  [{frac * 100:3.0f}%] {what}", file=sys.stderr, flush=True))
        res["wall_s"] = time.perf_counter() - t
        res["hardware"] = str(hw)
        if hw_text is not None:
            write_text_atomic(hw, hw_text)
            hw_text = None
        out = RESULTS / f"twin_{name}.json"
        write_text_atomic(out, json.dumps(res, indent=1))
        render(res, con)
        con.print(f"wrote {out} ({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
