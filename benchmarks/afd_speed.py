"""Attention/FFN disaggregation on this machine: decode tokens/s and the time split per side (attention compute,
FFN compute, transfer, idle) for AFD against the plain pipeline at equal process count, with the simulator's
prediction for the same Plan beside each measurement.

    python benchmarks/afd_speed.py   # a ~55M-parameter DeepSeek-V3-type model (MLA + 16 experts); a few minutes
    python benchmarks/afd_speed.py --quick   # smaller model, fewer cases (smoke run)

Every engine is started once; 4 rounds then run each engine once in a rotating order (so all see the machine's load at
about the same times) and the best round per engine is reported, every round listed. Every process gets one torch
thread, so P processes use P cores (this machine has os.cpu_count() of them, shared with
whatever else runs: the load average is printed next to the numbers). The simulator sees "one CPU core per rank,
gloo over loopback between" with core FLOP/s, copy bandwidth and hop latency measured here (benchmarks/pipeline_speed.py
measures them the same way). Writes benchmarks/results/afd_speed.json. Never part of the test pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "afd_speed.json"
sys.path.insert(0, str(ROOT / "benchmarks"))

from pipeline_speed import cpu_hardware, cpu_seconds, measure_core, measure_hop, predict  # noqa: E402
from waferline.spec.configs import spec_from_pretrained  # noqa: E402


def model_config(quick: bool) -> dict:
    """DeepSeek-V3 architecture in small: MLA attention, layer 0 dense, then MoE (sigmoid router, shared expert)."""
    return {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 4096,
        "hidden_size": 256 if quick else 512, "num_hidden_layers": 4, "first_k_dense_replace": 1,
        "intermediate_size": 768 if quick else 1536, "moe_intermediate_size": 256 if quick else 512,
        "n_routed_experts": 8 if quick else 16, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1,
        "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 256,
        "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 1, "hidden_act": "silu",
    }


def sim_afd(path: Path, M: int, N: int, K: int, B: int, P: int, O: int, hw) -> dict | None:
    """simulate() of the Plan the planner makes for this AFD layout (the same Plan the engine could run)."""
    try:
        from waferline.plan.place import place
        from waferline.sim.pipeline import simulate

        spec = spec_from_pretrained(path)
        plan = place(spec, hw, afd=True, attention_ranks=M, ffn_ranks=N, batch=B, context=P + O, micro_batches=K)
        plan.weight_bits = plan.kv_bits = plan.embed_bits = 32  # the engine runs fp32 here
        r = simulate(plan, prompt_len=P, output_len=O, concurrency=B, spec=spec, hardware=hw)
        att = next(s for s in r.stages if s.role == "attention")
        ffn = next(s for s in r.stages if s.role == "ffn")
        return {"aggregate_tokens_per_s": r.aggregate_tokens_per_s, "step_s": r.step_latency_s, "bound": r.bound,
                "attention_busy_s": att.total, "ffn_busy_s": ffn.total, "transfer_s": att.hop}
    except Exception as e:  # noqa: BLE001 - report, do not fail the benchmark
        print(f"  (simulator could not predict: {type(e).__name__}: {e})", file=sys.stderr)
        return None


def measure(llm, prompts: list[list[int]], params) -> dict:
    """One generate() call: decode tokens/s, CPU seconds per process, and (AFD) the time split of this call."""
    eng = llm._pipeline
    pids = [os.getpid()] + (eng.pids if eng is not None else [])
    afd = hasattr(eng, "time_split")
    if afd:
        eng.time_split(reset=True)
    c0 = [cpu_seconds(p) for p in pids]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    cpu = [cpu_seconds(p) - c for p, c in zip(pids, c0)]
    return {"decode_tokens_per_s": outs[0].metrics["decode_tokens_per_s"], "wall_s": wall,
            "ttft_s": max(o.metrics["ttft_s"] for o in outs), "cpu_s_per_process": cpu, "cores_used": sum(cpu) / wall,
            "split": eng.time_split(reset=True) if afd else None, "tokens": [o.token_ids for o in outs],
            "loadavg": os.getloadavg()[0]}


def run_all(path: Path, cases: list, B: int, P: int, O: int, rounds: int) -> list[dict]:
    """Every engine started once and kept; ``rounds`` rounds that run each engine once, in a rotating order, so every
    case sees the machine's load at about the same times; per case the best round (other work only slows a run)."""
    from waferline import LLM, SamplingParams

    V = 4096
    prompts = [[(7 * i + 3 * j + 5) % V for j in range(P)] for i in range(B)]
    params = SamplingParams(max_tokens=O, ignore_eos=True)
    llms = []
    try:
        for _, _, kw, _ in cases:
            llms.append(LLM(path, **kw))
            llms[-1].generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up
        best: list[dict | None] = [None] * len(cases)
        for r in range(rounds):
            for j in [(i + r) % len(cases) for i in range(len(cases))]:
                m = measure(llms[j], prompts, params)
                m["rounds"] = (best[j] or {}).get("rounds", []) + [round(m["decode_tokens_per_s"], 1)]
                if best[j] is None or m["decode_tokens_per_s"] > best[j]["decode_tokens_per_s"]:
                    best[j] = m
                else:
                    best[j]["rounds"] = m["rounds"]
        return best  # type: ignore[return-value]
    finally:
        for llm in llms:
            llm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--batch", type=int, default=None)
    args = ap.parse_args()
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(args.out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    from waferline.engine.pipeline.launch import balanced_ranges
    from waferline.model.init import write_random_checkpoint

    torch.set_num_threads(1)
    cores = os.cpu_count() or 1
    print(f"machine: {platform.machine()}, {cores} cores, torch {torch.__version__}, load average "
          f"{os.getloadavg()[0]:.2f} at start (other work on the machine skews every number)")
    flops, bw = measure_core()
    hops = measure_hop([8, 65536, 1 << 20])
    hop_lat, hop_bw = hops[0]["one_way_s"], hops[-1]["bandwidth_Bps"]
    print(f"one core: {flops / 1e9:.1f} GFLOP/s fp32, {bw / 1e9:.1f} GB/s copy; gloo hop {hop_lat * 1e6:.0f} us + "
          f"{hop_bw / 1e9:.2f} GB/s")
    B = args.batch or (8 if args.quick else 16)
    P, O = 16, (8 if args.quick else 24)
    repeats = 1 if args.quick else 4  # rounds
    results: dict = {"machine": {"cores": cores, "core_flops": flops, "core_bw": bw, "hop_latency_s": hop_lat,
                                 "hop_bandwidth_Bps": hop_bw, "loadavg_start": os.getloadavg()[0]},
                     "workload": {"batch": B, "prompt": P, "output": O}, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dsv3-bench"
        cfg = model_config(args.quick)
        write_random_checkpoint(cfg, path)
        spec = spec_from_pretrained(path)
        n_params = sum(layer.params() for layer in spec.layers) + 2 * spec.vocab_size * spec.hidden_size
        results["model"] = {"config": cfg, "params": n_params}
        print(f"model: DeepSeek-V3 type, {spec.num_layers} layers, hidden {cfg['hidden_size']}, "
              f"{cfg['n_routed_experts']} experts top-{cfg['num_experts_per_tok']} + 1 shared, {n_params / 1e6:.0f}M "
              f"parameters, fp32; {B} sequences, prompt {P}, {O} new tokens each\n")
        cases = [  # (name, processes, LLM kwargs, simulator)
            ("single process", 1, {}, None),
            ("pipeline S=2 M=2", 2, {"stages": 2, "micro_batches": 2, "threads_per_stage": 1}, ("pipe", 2, 2)),
            ("AFD M=1 N=1 K=1", 2, {"afd": True, "attention_ranks": 1, "ffn_ranks": 1, "micro_batches": 1,
                                    "threads_per_rank": 1}, ("afd", 1, 1, 1)),
            ("AFD M=1 N=1 K=2", 2, {"afd": True, "attention_ranks": 1, "ffn_ranks": 1, "micro_batches": 2,
                                    "threads_per_rank": 1}, ("afd", 1, 1, 2)),
        ]
        if not args.quick:
            cases += [
                ("pipeline S=3 M=3", 3, {"stages": 3, "micro_batches": 3, "threads_per_stage": 1}, ("pipe", 3, 3)),
                ("AFD M=1 N=2 K=2", 3, {"afd": True, "attention_ranks": 1, "ffn_ranks": 2, "micro_batches": 2,
                                        "threads_per_rank": 1}, ("afd", 1, 2, 2)),
            ]
        hdr = (f"{'engine':<18} {'procs':>5} {'tok/s':>7} {'cores':>5} {'load':>5} | {'att comp':>8} {'ffn comp':>8} "
               f"{'att xfer':>8} {'ffn xfer':>8} {'att idle':>8} {'ffn idle':>8} | {'sim tok/s':>9}")
        print(hdr)
        print("-" * len(hdr))
        ref_tokens = None
        for (name, procs, kw, sim), r in zip(cases, run_all(path, cases, B, P, O, repeats)):
            if ref_tokens is None:
                ref_tokens = r["tokens"]
            r["same_tokens_as_single_process"] = r.pop("tokens") == ref_tokens
            pred = None
            if sim is not None:
                hw = cpu_hardware(procs, flops, bw, hop_lat, hop_bw)
                if sim[0] == "pipe":
                    s = predict(spec, balanced_ranges(spec, sim[1]), sim[2], B, P, O, hw)  # (the engine's split)
                    pred = {"aggregate_tokens_per_s": s.aggregate_tokens_per_s, "bound": s.bound} if s else None
                else:
                    pred = sim_afd(path, sim[1], sim[2], sim[3], B, P, O, hw)
            r.update(name=name, processes=procs, options={k: v for k, v in kw.items()}, sim=pred)
            results["runs"].append(r)
            sp = r["split"]["sides"] if r["split"] else None
            cols = (
                " ".join(
                    f"{sp[side][k]:>8.2f}" for k in ("compute", "transfer", "idle") for side in ("attention", "ffn")
                )
                if sp
                else " ".join(f"{'-':>8}" for _ in range(6))
            )
            print(
                f"{name:<18} {procs:>5} {r['decode_tokens_per_s']:>7.1f} {r['cores_used']:>5.2f} {r['loadavg']:>5.2f} "
                "| "
                f"{cols} | {pred['aggregate_tokens_per_s'] if pred else float('nan'):>9.1f}"
                + ("" if r["same_tokens_as_single_process"] else "   (tokens differ!)")
            )
    print("\ntok/s of every round (the table shows each case's best round):")
    for r in results["runs"]:
        print(f"  {r['name']:<18} {r['rounds']}")
    print(
        "\ntime split columns: seconds summed over the ranks of a side during the best run. transfer = issuing sends + "
        "the part of each wait after the peer had sent (by the sender's timestamp); idle = the part of each wait "
        "before the peer had sent. cores = CPU seconds of all processes / wall time."
    )
    out = Path(args.out)
    write_text_atomic(out, json.dumps(results, indent=1), make_parents=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
