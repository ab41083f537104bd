"""Simulator side of attention/FFN disaggregation: Step-3 against DeepSeek-V3 on H800s (the comparison of the Step-3
system report, arXiv 2507.19427: 4,039 vs 2,324 decode tokens/s per GPU at a 50 ms/token SLA, 4K context, FP8), and
the cases where AFD loses.

    python benchmarks/afd_sim.py          # seconds; writes benchmarks/results/afd_sim.json

For each model it searches, under the SLA (time per output token <= 50 ms), the best decode tokens/s per GPU of
  * AFD as the engine runs it: M data-parallel attention ranks x N expert-parallel FFN ranks (an attention rank the
    narrowest tensor-parallel group in a node that holds it, an FFN rank as many GPUs as its memory needs), b
    sequences per attention rank, K = 1 or 2 micro-batches (2: ping-pong; it costs a second
    read of the expert weights per step, so it pays only when attention is busy enough to hide the FFN behind);
  * the plain placement (tensor/expert parallel in a node, pipeline across nodes) on D GPUs with B sequences.
The shape to reproduce: Step-3 gains more from AFD than DeepSeek-V3 and ends up ahead per GPU, because its attention
is cheap per cached token (one 256-wide K/V head) so attention ranks hold many sequences, and its 48 experts (top-3)
see many tokens each once M attention ranks feed them, while DeepSeek-V3's 256 experts (top-8) stay weight-bound.
Then where AFD loses: one sequence (the per-layer round trip is pure latency), a dense model (no experts to batch),
and a slow link between the pools. Numbers are the cost model's (fitted per hardware class, see sim/fitted.yaml),
not measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "afd_sim.json"
SLA_S = 0.050
CONTEXT = 4096
PROMPT, OUTPUT = 3072, 1024  # decode at ~3.5K tokens of context on average, within the 4K window
REPORTED = {"step3": 4039.0, "deepseek-v3": 2324.0}  # decode tok/s per GPU, Step-3 report (its own DSv3 figure)


def afd_point(model: str, hw: str, M: int, N: int, b: int, bits: int = 8, hw_spec=None, K: int = 2) -> dict | None:
    from waferline.errors import ConfigError
    from waferline.plan.place import place
    from waferline.sim.pipeline import simulate

    try:
        plan = place(model, hw_spec or hw, weight_bits=bits, kv_bits=8, context=CONTEXT, batch=M * b, afd=True,
                     attention_ranks=M, ffn_ranks=N, micro_batches=K)
    except ConfigError:
        return None
    if not plan.fits:
        return None
    r = simulate(plan, prompt_len=PROMPT, output_len=OUTPUT, concurrency=M * b, hardware=hw_spec)
    att = next(s for s in r.stages if s.role == "attention")
    ffn = next(s for s in r.stages if s.role == "ffn")
    return {
        "layout": f"{M}A{N}F K={K}",
        "gpus": plan.num_devices,
        "gpus_per_attention_rank": plan.stages[0].num_devices,
        "gpus_per_ffn_rank": plan.stages[-1].num_devices,
        "batch": M * b,
        "tpot_ms": 1e3 / r.decode_tokens_per_s_per_user,
        "tok_s": r.aggregate_tokens_per_s,
        "tok_s_per_gpu": r.aggregate_tokens_per_s / plan.num_devices,
        "attention_busy": att.total / r.step_latency_s,
        "ffn_busy": ffn.total / r.step_latency_s,
        "bound": r.bound,
    }


def plain_point(model: str, hw: str, D: int, B: int, bits: int = 8) -> dict | None:
    from waferline.errors import ConfigError
    from waferline.plan.place import place
    from waferline.sim.pipeline import simulate

    try:
        plan = place(model, hw, devices=D, weight_bits=bits, kv_bits=8, context=CONTEXT, batch=B)
    except ConfigError:
        return None
    if not plan.fits:
        return None
    r = simulate(plan, prompt_len=PROMPT, output_len=OUTPUT, concurrency=B)
    return {"layout": f"{plan.num_stages} stage(s) x {plan.stages[0].num_devices} GPU", "gpus": plan.num_devices,
            "batch": B, "tpot_ms": 1e3 / r.decode_tokens_per_s_per_user, "tok_s": r.aggregate_tokens_per_s,
            "tok_s_per_gpu": r.aggregate_tokens_per_s / plan.num_devices, "bound": r.bound}


def best(points: list[dict | None], sla: float = SLA_S) -> dict | None:
    ok = [p for p in points if p is not None and p["tpot_ms"] <= sla * 1e3]
    return max(ok, key=lambda p: p["tok_s_per_gpu"]) if ok else None


def search_afd(model: str, hw: str, bits: int = 8, hw_spec=None) -> dict | None:
    pts = [afd_point(model, hw, M, N, b, bits, hw_spec, K) for M in (1, 2, 4, 8) for N in (1, 2, 4, 8)
           for b in (16, 32, 64, 128, 256, 512) for K in (1, 2)]
    return best(pts)


def search_plain(model: str, hw: str, bits: int = 8) -> dict | None:
    pts = [plain_point(model, hw, D, B, bits) for D in (8, 16, 32, 64) for B in (16, 32, 64, 128, 256, 512, 1024, 2048)]
    return best(pts)


def _row(label: str, p: dict | None) -> str:
    if p is None:
        return f"  {label:<34} (nothing meets the SLA)"
    extra = f" att busy {p['attention_busy']:.0%} ffn busy {p['ffn_busy']:.0%}" if "ffn_busy" in p else ""
    return (f"  {label:<34} {p['layout']:>22} {p['gpus']:>4} GPUs  batch {p['batch']:>5}  TPOT {p['tpot_ms']:5.1f} ms  "
            f"{p['tok_s_per_gpu']:7.0f} tok/s/GPU{extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="h800")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(args.out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    hw = args.hardware
    from waferline.errors import WaferlineError
    from waferline.spec.catalog import load_hardware

    try:  # (an unknown id is said here: below, a placement's ConfigError reads as "does not fit")
        load_hardware(hw)
    except WaferlineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out: dict = {"hardware": hw, "sla_ms": SLA_S * 1e3, "context": CONTEXT, "weight_bits": 8, "kv_bits": 8,
                 "reported_tok_s_per_gpu": REPORTED, "models": {}, "afd_loses": {}}
    print(f"Decode tokens/s per GPU on {hw}, FP8 weights and KV, 4K context, TPOT <= {SLA_S * 1e3:.0f} ms "
          "(simulator; best over layouts and batch sizes)\n")
    for model in ("step3", "deepseek-v3"):
        a, p = search_afd(model, hw), search_plain(model, hw)
        out["models"][model] = {"afd": a, "plain": p}
        print(f"{model}  (reported with AFD / EP: {REPORTED[model]:,.0f} tok/s/GPU)")
        print(_row("AFD (attention ranks x FFN ranks)", a))
        print(_row("plain (TP/EP in a node, PP across)", p))
        if a and p:
            print(f"  AFD / plain: {a['tok_s_per_gpu'] / p['tok_s_per_gpu']:.2f}x")
        print()
    s3, ds = out["models"]["step3"]["afd"], out["models"]["deepseek-v3"]["afd"]
    if s3 and ds:
        print(f"Step-3 / DeepSeek-V3 with AFD: simulated {s3['tok_s_per_gpu'] / ds['tok_s_per_gpu']:.2f}x, "
              f"reported {REPORTED['step3'] / REPORTED['deepseek-v3']:.2f}x\n")
        out["step3_over_dsv3"] = {"simulated": s3["tok_s_per_gpu"] / ds["tok_s_per_gpu"],
                                  "reported": REPORTED["step3"] / REPORTED["deepseek-v3"]}

    print("Where AFD loses:")
    # 1. one sequence: nothing to overlap, every layer pays two hops
    a1 = afd_point("deepseek-v3", hw, 1, 8, 1, K=1)
    p1 = min((x for x in (plain_point("deepseek-v3", hw, D, 1) for D in (8, 16)) if x), key=lambda x: x["tpot_ms"],
             default=None)
    out["afd_loses"]["one_sequence"] = {"afd": a1, "plain": p1}
    if a1 and p1:
        print(f"  deepseek-v3, 1 sequence: AFD 1A8F TPOT {a1['tpot_ms']:.1f} ms vs plain {p1['layout']} "
              f"{p1['tpot_ms']:.1f} ms")
    else:  # (a device of less memory: the weights need more of them than these layouts have)
        missing = [n for n, x in (("AFD 1A8F", a1), ("plain on 8 or 16 devices", p1)) if x is None]
        print(f"  deepseek-v3, 1 sequence: {' and '.join(missing)} {'do' if len(missing) > 1 else 'does'} not fit "
              f"on {hw}")
    # 2. a dense model: the FFN is as heavy per token as the weights it reads; batching across ranks buys nothing
    da, dp = search_afd("llama-3.1-70b", hw), search_plain("llama-3.1-70b", hw)
    out["afd_loses"]["dense_model"] = {"afd": da, "plain": dp}
    print(_row("llama-3.1-70b AFD", da))
    print(_row("llama-3.1-70b plain", dp))
    if da and dp:
        print(f"  dense: AFD / plain {da['tok_s_per_gpu'] / dp['tok_s_per_gpu']:.2f}x (no experts to batch up, and "
              "each layer's FFN runs whole on one FFN rank)")
    # 3. slower links between the pools (every hop over a scale-out link of this bandwidth, 20 us): the round trip
    #    stops hiding behind the other micro-batch, and the FFN's batch no longer pays for the hops
    from dataclasses import replace

    from waferline.spec.catalog import load_hardware

    h = load_hardware(hw)
    plain3 = out["models"]["step3"]["plain"]
    out["afd_loses"]["slow_link"] = []
    print(f"  step3 AFD over slower links (plain placement on {hw}'s own links: "
          f"{plain3['tok_s_per_gpu'] if plain3 else float('nan'):.0f} tok/s/GPU):")
    for gbps in (50.0, 12.5, 3.0, 1.0, 0.3):
        slow = replace(h, name=f"{h.name}-{gbps:g}GBps", devices_per_node=1,
                       scale_out=replace(h.scale_out, bandwidth=gbps * 1e9, latency=20e-6))
        sa = search_afd("step3", hw, hw_spec=slow)
        out["afd_loses"]["slow_link"].append({"link_GBps": gbps, "link_latency_s": 20e-6, "afd": sa})
        print(_row(f"{gbps:g} GB/s, 20 us", sa))
    path = Path(args.out)
    write_text_atomic(path, json.dumps(out, indent=1), make_parents=True)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
