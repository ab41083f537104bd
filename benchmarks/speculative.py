"""Speculative decoding on sol-mini's held-out prompts: speedup, acceptance and mean accepted length per drafter at
T = 0 and T = 0.8, batch 1 and 8, beside the simulator's prediction for the measured acceptance; then where
speculation stops paying as the batch grows. Prints tables; writes benchmarks/results/speculative.json.

    python benchmarks/speculative.py                       # models/sol-mini, n-gram / MTP / a 2-layer draft model
    python benchmarks/speculative.py --quick               # fewer prompts and tokens
    python benchmarks/speculative.py --engines single,pipe8 --batches 1 --backoff-batches '' --out
    benchmarks/results/speculative_quiet.json

Engines: ``single`` (one process: the scheduler's speculation, engine/speculative/serving.py) and ``pipeN`` (N stage
processes over gloo, N micro-batches; every drafter runs in the scheduler's process, stage 0). Every row has
the simulator's prediction for the measured acceptance on this machine (one core per stage and the gloo hop, measured
here) and on ``--sim-hardware``. The back-off table compares plain decoding, a fixed K (no back-off) and adaptive K
at growing batch sizes.

The draft model is sol-mini cut to its first ``--draft-layers`` layers (same embeddings, final norm and LM head:
a real checkpoint sharing the tokenizer, written under $TMPDIR/waferline-spec/), since no smaller sol was trained.
Without models/sol-mini the script runs on a random-weight sol checkpoint with an MTP head (it says so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from waferline import LLM, SamplingParams
from waferline.engine.speculative.rollback import VerifyRollback
from waferline.engine.speculative.serving import ServeSpeculation
from waferline.model.context import StepBatch
from waferline.spec.configs import spec_from_pretrained


def make_draft(model_dir: Path, layers: int, out: Path) -> Path:
    """sol-mini's first ``layers`` layers + its embeddings, final norm and LM head, as a checkpoint of its own."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    if (out / "config.json").is_file() and json.loads((out / "config.json").read_text()).get(
        "num_hidden_layers"
    ) == layers:
        return out
    out.mkdir(parents=True, exist_ok=True)
    n = cfg["num_hidden_layers"]
    cfg.update(num_hidden_layers=layers, num_nextn_predict_layers=0)
    for key in ("mixer_types", "ffn_types"):
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:layers]
    keep = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for k, v in load_file(f).items():
            parts = k.split(".")
            if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= layers:
                continue  # deeper layers and the MTP module (layer n)
            keep[k] = v
    assert n > layers
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir / extra).is_file():
            (out / extra).write_text((model_dir / extra).read_text())
    return out


def set_gather(model: Any, gather_max: int | None) -> None:
    """Override the MoE execution switch (gathered-weights bmm for few tokens vs experts over sorted tokens)."""
    from waferline.model.moe import MoE

    if gather_max is not None:
        for mod in model.modules():
            if isinstance(mod, MoE):
                mod.gather_max = gather_max


def heldout_prompts(llm: LLM, path: Path | None, n: int, length: int) -> list[list[int]]:
    if path is not None and path.is_file() and llm.tokenizer is not None:
        ids = llm.encode(path.read_text())
        step = max(1, (len(ids) - length) // n)
        return [ids[i * step: i * step + length] for i in range(n)]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, llm.spec.vocab_size, (length,), generator=g).tolist() for _ in range(n)]


def forward_cost(llm: LLM, reps: int = 7) -> dict[str, Any]:
    """Time one forward of N new tokens (1 row x T, and B rows x 1) after a 64-token prefill; fit t = t0 + t1 * N.
    A T > 1 forward is timed as a verify (``VerifyRollback``: Mamba-2 layers run the decode recurrence and record
    their trail), not as a prompt chunk (the chunked scan, several times dearer for a few tokens)."""
    m = llm.model
    pts = []
    with torch.inference_mode():
        for B, T in ((1, 1), (1, 2), (1, 4), (1, 8), (4, 1), (8, 1), (16, 1), (32, 1)):
            caches = m.new_caches(B)
            for b in range(B):
                m(torch.arange(2, 66)[None] % llm.spec.vocab_size, caches, StepBatch.make([b], [0], 64))
            ts = []
            for _ in range(reps):
                batch = StepBatch.make(list(range(B)), [64] * B, T)
                rollback = VerifyRollback(caches, batch)
                t0 = time.perf_counter()
                m(torch.full((B, T), 5), caches, batch)
                ts.append(time.perf_counter() - t0)
                rollback.done([1] * B)  # (every row keeps its first token: the caches stay at 65 positions)
            pts.append((B * T, min(ts), B, T))
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    t1 = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    t0 = my - t1 * mx
    return {"points": [{"B": B, "T": T, "s": s} for _, s, B, T in pts], "t0_s": t0, "t1_s": t1,
            "overhead_tokens": max(t0 / t1, 1.0) if t1 > 0 else 64.0}


def use(llm: LLM, spec: ServeSpeculation | None) -> None:
    """Make ``llm`` speculate with ``spec`` (None: plain decoding) from its next request on."""
    llm._spec, llm._scheduler = spec, None


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int, repeats: int = 1) -> dict[str, Any]:
    """Generate for every prompt, ``batch`` at a time; decode time = total − prefill (best of ``repeats`` per batch:
    the host is shared, and the best run is the least disturbed one)."""
    outs, decode_s = [], 0.0
    for i in range(0, len(prompts), batch):
        best = None
        for _ in range(repeats):
            o = llm.generate(prompts[i:i + batch], params)
            t = o[0].metrics["total_s"] - o[0].metrics["ttft_s"]
            best = (t, o) if best is None or t < best[0] else best
        decode_s += best[0]
        outs += best[1]
    toks = sum(len(o.token_ids) - 1 for o in outs)  # the first token of each row comes with the prefill
    return {"tokens": [o.token_ids for o in outs], "decode_s": decode_s, "tok_s": toks / decode_s}


def fit_alpha(E: float, k: float) -> float:
    """The per-token acceptance α with (1 − α^(k+1)) / (1 − α) = E (what the simulator's model means by α)."""
    if k <= 0 or E <= 1.0:
        return 0.0
    lo, hi = 0.0, 0.999999
    for _ in range(60):
        a = (lo + hi) / 2
        if (1 - a ** (k + 1)) / (1 - a) < E:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


class Totals:
    """The speculation's stats across the generate calls of one measurement (since ``reset``)."""

    def __init__(self, spec: ServeSpeculation):
        self.spec = spec
        self.reset()

    def reset(self) -> None:
        self.start = replace(self.spec.stats)

    def summary(self) -> dict[str, float]:
        st = self.spec.stats.since(self.start)
        d = {"drafted": st.drafted, "accepted": st.accepted, "emitted": st.emitted, "row_steps": st.row_steps,
             "steps": st.steps, "plain": st.plain_steps}
        E = d["emitted"] / max(d["row_steps"], 1)
        kbar = d["drafted"] / max(d["row_steps"], 1)
        return {"acceptance_rate": d["accepted"] / max(d["drafted"], 1), "mean_accepted_length": E,
                "mean_drafts_per_step": kbar, "alpha_fit": fit_alpha(E, kbar), "verify_steps": d["steps"],
                "plain_steps": d["plain"]}


def simulate_speedup(model_dir: Path, method: str, k: int, alpha: float, batch: int, prompt: int, output: int,
                     hardware: Any, draft_dir: Path | None, stages: int = 1) -> float | None:
    """The simulator's speedup for this drafter at the measured acceptance: on a catalog device (``hardware`` a name,
    its own placement) or on this machine (``hardware`` a HardwareSpec: one core per stage, gloo hops measured here)."""
    from waferline.plan.place import place
    from waferline.plan.plan import Plan, SpeculativeConfig, Stage
    from waferline.sim.pipeline import simulate

    sim_method = "draft" if method.startswith("draft:") else method
    try:
        sc = SpeculativeConfig(
            sim_method,
            num_tokens=max(k, 1),
            accept_rate=min(max(alpha, 0.0), 0.99),
            draft_model=str(draft_dir / "config.json") if draft_dir is not None and sim_method == "draft" else None,
        )
        if isinstance(hardware, str):
            plan = place(str(model_dir / "config.json"), hardware, context=prompt + output, batch=batch, speculative=sc)
            r = simulate(plan, prompt_len=prompt, output_len=output, concurrency=batch)
        else:
            from waferline.engine.pipeline.launch import balanced_ranges

            spec = spec_from_pretrained(model_dir)
            ranges = balanced_ranges(spec, stages)  # (the engine's own split)
            # fp32 like the engine here; the simulator places a draft model at 4/8/16 bits only, so a draft plan is
            # priced at 16-bit for target and draft alike (the ratio is what is compared)
            wb = 16 if sim_method == "draft" else 32
            st = [
                Stage(
                    index=i,
                    role="full",
                    layers=list(range(a, b)),
                    device=hardware.name,
                    device_ids=[i],
                    weight_bits=wb,
                    has_embedding=i == 0,
                    has_lm_head=i == stages - 1,
                )
                for i, (a, b) in enumerate(ranges)
            ]
            plan = Plan(model=spec.name, hardware=hardware.name, stages=st, weight_bits=wb, kv_bits=wb, embed_bits=wb,
                        batch=batch, micro_batches=min(stages, batch), context_len=prompt + output, speculative=sc)
            r = simulate(plan, prompt_len=prompt, output_len=output, concurrency=batch, spec=spec, hardware=hardware)
        return float(r.speculative.get("speedup", float("nan")))
    except Exception as e:  # the prediction is a side column: report why it is missing, keep measuring
        print(f"  (simulator: {type(e).__name__}: {e})")
        return None


def this_machine(stages: int) -> Any:
    """The simulator's HardwareSpec for this host (benchmarks/pipeline_speed.py: one core, gloo hop, measured)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pipeline_speed import cpu_hardware, measure_core, measure_hop

    flops, bw = measure_core()
    hops = measure_hop([8, 1 << 20])
    return cpu_hardware(stages, flops, bw, hops[0]["one_way_s"], hops[-1]["bandwidth_Bps"]), {
        "core_flops": flops, "core_bw": bw, "hop_latency_s": hops[0]["one_way_s"], "hop_bw": hops[-1]["bandwidth_Bps"]}


def run_pipe(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int, repeats: int = 1
) -> dict[str, Any]:
    """Like ``run`` for a pipelined LLM: decode time = total − the last row's TTFT; speculative stats summed."""
    outs, decode_s = [], 0.0
    d = {"drafted": 0, "accepted": 0, "emitted": 0, "row_steps": 0, "steps": 0, "plain": 0}
    for i in range(0, len(prompts), batch):
        best = None
        for _ in range(repeats):
            sp = llm._spec  # (the scheduler's speculation: its counters, before and after this run)
            before = replace(sp.stats) if sp is not None else None
            o = llm.generate(prompts[i:i + batch], params)
            t = o[0].metrics["total_s"] - max(x.metrics["ttft_s"] for x in o)
            st = sp.stats.since(before) if sp is not None else None
            best = (t, o, st) if best is None or t < best[0] else best
        decode_s += best[0]
        outs += best[1]
        if best[2] is not None:
            s = best[2]
            for key, v in (("drafted", s.drafted), ("accepted", s.accepted), ("emitted", s.emitted),
                           ("row_steps", s.row_steps), ("steps", s.steps), ("plain", s.plain_steps)):
                d[key] += v
    toks = sum(len(o.token_ids) - 1 for o in outs)
    return {"tokens": [o.token_ids for o in outs], "decode_s": decode_s, "tok_s": toks / decode_s, "stats": d}


def _summary(d: dict[str, int]) -> dict[str, float]:
    E = d["emitted"] / max(d["row_steps"], 1)
    kbar = d["drafted"] / max(d["row_steps"], 1)
    return {"acceptance_rate": d["accepted"] / max(d["drafted"], 1), "mean_accepted_length": E,
            "mean_drafts_per_step": kbar, "alpha_fit": fit_alpha(E, kbar), "verify_steps": d["steps"],
            "plain_steps": d["plain"]}


def main() -> None:
    import os

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/sol-mini")
    ap.add_argument("--prompts", default=None, help="held-out text (default MODEL/heldout.txt)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=3, help="most draft tokens per step")
    ap.add_argument("--methods", default="ngram,mtp,draft")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--temps", default="0,0.8")
    ap.add_argument("--engines", default="single,pipe2", help="single = one process; pipeN = N stage processes")
    ap.add_argument("--backoff-batches", default="1,8,32", help="batch sizes for the back-off measurement ('' = skip)")
    ap.add_argument("--backoff-method", default="mtp")
    ap.add_argument("--backoff-engines", default="single,pipe2", help="engines for the back-off measurement")
    ap.add_argument("--sim-hardware", default="wse-3", help="catalog hardware for a side prediction ('' = none); the "
                    "prediction for this machine (measured core + gloo hop) is always made")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype (default float32)"
    )
    ap.add_argument("--weight-bits", type=int, default=16, choices=[4, 16],
                    help="4: the model (and the draft) quantized to int4 (RTN, group 32) like `waferline demo`")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (and per stage; default 1)")
    ap.add_argument(
        "--moe-gather-max",
        type=int,
        default=None,
        help="set MoE.gather_max on target and draft (0 = always the sorted-experts path; default: model's)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="best of N per measurement (default 1)")
    ap.add_argument("--no-adaptive", action="store_true", help="main table at a fixed K (the drafters' raw acceptance)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/speculative.json")
    a = ap.parse_args()
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(a.out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    for flag, value in (("--engines", a.engines), ("--backoff-engines", a.backoff_engines)):
        if bad := [e for e in value.split(",") if e and e != "single" and not (e[:4] == "pipe" and e[4:].isdigit())]:
            ap.error(f"{flag} {value}: {bad[0]!r} is neither single nor pipeN (N stage processes)")
    if bad := [m for m in a.methods.split(",") if m not in ("ngram", "mtp", "draft") and not m.startswith("draft:")]:
        ap.error(f"--methods {a.methods}: {bad[0]!r} is none of ngram, mtp, draft, draft:PATH")
    for flag, value, kind in (("--batches", a.batches, int), ("--temps", a.temps, float),
                              ("--backoff-batches", a.backoff_batches, int)):
        try:
            [kind(x) for x in value.split(",") if x or flag != "--backoff-batches"]
        except ValueError:
            ap.error(f"{flag} {value}: expected comma-separated numbers")
    torch.set_num_threads(a.threads)
    if a.quick:
        a.num_prompts, a.max_tokens, a.prompt_tokens = 4, 24, 48
    model_dir = Path(a.model)
    random_weights = not (model_dir / "config.json").is_file()
    if random_weights:
        from waferline.demo import SOL_DEMO_CONFIG
        from waferline.model.init import write_random_checkpoint

        model_dir = Path(tempfile.mkdtemp()) / "sol-random"
        write_random_checkpoint(dict(SOL_DEMO_CONFIG, num_nextn_predict_layers=1), model_dir)
        print(f"!! {a.model} not found: RANDOM-weight sol checkpoint with an MTP head ({model_dir})")
    heldout = Path(a.prompts) if a.prompts else model_dir / "heldout.txt"
    if a.weight_bits == 4:  # what `waferline demo` runs: int4 weights (a build product, kept out of the repository)
        from waferline.model.quant import QuantOptions, quantize_checkpoint

        qdir = Path(tempfile.gettempdir()) / "waferline-spec" / f"{model_dir.name}-int4-g32"
        if not (qdir / "model.safetensors").is_file():
            quantize_checkpoint(model_dir, qdir, QuantOptions(group_size=32), force=True)
        model_dir = qdir
    # the derived draft checkpoint is a build product, not a result: keep it out of the repository
    draft_dir = make_draft(model_dir, a.draft_layers,
                           Path(tempfile.gettempdir()) / "waferline-spec" / f"{model_dir.name}-draft-L{a.draft_layers}")
    load0 = os.getloadavg()
    print(f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} ({os.cpu_count()} cores; other work on "
          "the machine slows every run, spec and plain alike)")

    llm = LLM(model_dir, dtype=a.dtype)
    set_gather(llm.model, a.moe_gather_max)
    prompts = heldout_prompts(llm, heldout, a.num_prompts, a.prompt_tokens)
    cost = forward_cost(llm)
    print(
        "forward cost on this host (ms per forward, rows x tokens): "
        + ", ".join(f"{p['B']}x{p['T']}: {p['s'] * 1e3:.1f}" for p in cost["points"])
        + "  (single-process adaptive K uses these)"
    )
    table = [(p["B"] * p["T"], p["s"]) for p in cost["points"]]
    methods = [m if m != "draft" else f"draft:{draft_dir}" for m in a.methods.split(",")]
    engines = [e for e in a.engines.split(",") if e]
    machines = {}
    for e in engines:
        S = 1 if e == "single" else int(e[4:])
        machines[e] = this_machine(S)
    if engines:
        print(
            "this machine for the simulator: " + ", ".join(f"{k} {v:.3g}" for k, v in machines[engines[0]][1].items())
        )
    hw = [h for h in a.sim_hardware.split(",") if h]
    rows: list[dict[str, Any]] = []
    temps = [float(t) for t in a.temps.split(",")]
    batches = [int(b) for b in a.batches.split(",")]
    for engine in engines:
        S = 1 if engine == "single" else int(engine[4:])
        print(f"\n== {engine}: {'one process' if S == 1 else f'{S} stage processes (gloo), {S} micro-batches'}, "
              f"K <= {a.k}, {'adaptive' if not a.no_adaptive else 'fixed'} K ==")
        if S == 1:
            specs = {}
            for m in methods:
                sp = ServeSpeculation(llm.model, llm.model.new_caches(1), 1, m, a.k, not a.no_adaptive,
                                      cost_table=table)
                if hasattr(sp.drafter, "model") and sp.drafter.model is not llm.model:
                    set_gather(sp.drafter.model, a.moe_gather_max)
                specs[m] = (sp, Totals(sp))
        for temp in temps:
            params = SamplingParams(
                max_tokens=a.max_tokens, temperature=temp, seed=0 if temp > 0 else None, ignore_eos=True
            )
            for batch in batches:
                if S == 1:
                    use(llm, None)
                    base = run(llm, prompts, params, batch, a.repeats)
                else:
                    with LLM(model_dir, dtype=a.dtype, stages=S, micro_batches=S, threads_per_stage=a.threads) as pl:
                        base = run_pipe(pl, prompts, params, batch, a.repeats)
                for m in methods:
                    if S == 1:
                        sp, tot = specs[m]
                        tot.reset()
                        use(llm, sp)
                        r = run(llm, prompts, params, batch, a.repeats)
                        use(llm, None)
                        s = tot.summary()
                    else:
                        with LLM(
                            model_dir,
                            dtype=a.dtype,
                            stages=S,
                            micro_batches=S,
                            threads_per_stage=a.threads,
                            speculative=m,
                            num_speculative_tokens=a.k,
                            speculative_adaptive=not a.no_adaptive,
                        ) as pl:
                            r = run_pipe(pl, prompts, params, batch, a.repeats)
                        s = _summary(r["stats"])
                    row = {"engine": engine, "stages": S, "method": m.split(":")[0] if m.startswith("draft:") else m,
                           "temperature": temp, "batch": batch, "base_tok_s": base["tok_s"], "spec_tok_s": r["tok_s"],
                           "speedup": r["tok_s"] / base["tok_s"],
                           "identical": (r["tokens"] == base["tokens"]) if temp == 0 else None,
                           "loadavg": os.getloadavg()[0], **s}
                    kk = round(s["mean_drafts_per_step"]) or a.k
                    row["sim_speedup_this_machine"] = simulate_speedup(
                        model_dir,
                        m,
                        kk,
                        s["alpha_fit"],
                        batch,
                        a.prompt_tokens,
                        a.max_tokens,
                        machines[engine][0],
                        draft_dir,
                        S,
                    )
                    for h in hw:
                        row[f"sim_speedup_{h}"] = simulate_speedup(
                            model_dir, m, kk, s["alpha_fit"], batch, a.prompt_tokens, a.max_tokens, h, draft_dir
                        )
                    rows.append(row)
                    print(_fmt(row, hw), flush=True)
    backoff: list[dict[str, Any]] = []
    bb = [int(b) for b in a.backoff_batches.split(",") if b]
    if bb:
        m = next((x for x in methods if x.startswith(a.backoff_method)), methods[0])
        params = SamplingParams(max_tokens=min(a.max_tokens, 24), ignore_eos=True)
        for engine in [e for e in a.backoff_engines.split(",") if e]:
            S = 1 if engine == "single" else int(engine[4:])
            print(
                f"\nback-off with batch size ({engine}, {m.split(':')[0]}, T=0, K <= {a.k}, {params.max_tokens} "
                "tokens per "
                "row): tok/s of plain decoding, of speculation at a fixed K (no back-off) and with adaptive K (backs "
                "off)"
            )
            print(f"{'batch':>5} {'plain':>9} {'fixed K':>9} {'x':>5} {'adaptive':>9} {'x':>5} {'mean K':>6} "
                  f"{'plain steps':>11} {'load':>5}")
            for B in bb:
                ps = (prompts * (B // len(prompts) + 1))[:B]
                if S == 1:
                    use(llm, None)
                    base = run(llm, ps, params, B, a.repeats)
                else:
                    with LLM(model_dir, dtype=a.dtype, stages=S, micro_batches=S, threads_per_stage=a.threads) as pl:
                        base = run_pipe(pl, ps, params, B, a.repeats)
                row = {"engine": engine, "batch": B, "base_tok_s": base["tok_s"]}
                for label, adaptive in (("fixed_k", False), ("adaptive", True)):
                    if S == 1:
                        sp = ServeSpeculation(llm.model, llm.model.new_caches(1), 1, m, a.k, adaptive,
                                              cost_table=table)
                        tot = Totals(sp)
                        use(llm, sp)
                        r = run(llm, ps, params, B, a.repeats)
                        use(llm, None)
                        s = tot.summary()
                    else:
                        with LLM(
                            model_dir,
                            dtype=a.dtype,
                            stages=S,
                            micro_batches=S,
                            threads_per_stage=a.threads,
                            speculative=m,
                            num_speculative_tokens=a.k,
                            speculative_adaptive=adaptive,
                        ) as pl:
                            r = run_pipe(pl, ps, params, B, a.repeats)
                        s = _summary(r["stats"])
                    row[f"{label}_tok_s"] = r["tok_s"]
                    row[f"{label}_speedup"] = r["tok_s"] / base["tok_s"]
                    row[f"{label}_identical"] = r["tokens"] == base["tokens"]
                    row[f"{label}_mean_k"] = s["mean_drafts_per_step"]
                    row[f"{label}_acceptance"] = s["acceptance_rate"]
                    row[f"{label}_plain_steps"] = s["plain_steps"]
                    row[f"{label}_steps"] = s["verify_steps"]
                row["loadavg"] = os.getloadavg()[0]
                backoff.append(row)
                print(f"{B:>5} {row['base_tok_s']:>9.1f} {row['fixed_k_tok_s']:>9.1f} {row['fixed_k_speedup']:>5.2f} "
                      f"{row['adaptive_tok_s']:>9.1f} {row['adaptive_speedup']:>5.2f} {row['adaptive_mean_k']:>6.2f} "
                      f"{row['adaptive_plain_steps']:>5}/{row['adaptive_steps']:<5} {row['loadavg']:>5.2f}", flush=True)
    out = {
        "model": str(a.model),
        "random_weights": random_weights,
        "dtype": a.dtype,
        "weight_bits": a.weight_bits,
        "draft_model": str(draft_dir),
        "draft_layers": a.draft_layers,
        "k_max": a.k,
        "adaptive": not a.no_adaptive,
        "num_prompts": a.num_prompts,
        "prompt_tokens": a.prompt_tokens,
        "max_tokens": a.max_tokens,
        "threads": a.threads,
        "moe_gather_max": a.moe_gather_max,
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "this_machine": {e: v[1] for e, v in machines.items()},
        "forward_cost": cost,
        "rows": rows,
        "backoff": backoff,
    }
    write_text_atomic(a.out, json.dumps(out, indent=2), make_parents=True)
    print(f"\nwrote {a.out}")


def _fmt(r: dict[str, Any], hw: list[str]) -> str:
    sim = " ".join(f"sim[{h}] x{r[f'sim_speedup_{h}']:.2f}" if r.get(f"sim_speedup_{h}") else f"sim[{h}] -"
                   for h in ["this_machine"] + hw)
    ident = "" if r["identical"] is None else (" identical" if r["identical"] else " DIFFERENT")
    return (
        f"{r['engine']:6s} {r['method']:6s} T={r['temperature']:.1f} B={r['batch']:2d}: {r['base_tok_s']:7.1f} -> "
        f"{r['spec_tok_s']:7.1f} tok/s "
        f"x{r['speedup']:.2f} | accept {r['acceptance_rate']:.2f} len {r['mean_accepted_length']:.2f} "
        f"K {r['mean_drafts_per_step']:.2f} alpha {r['alpha_fit']:.2f} | {sim}{ident} | load {r['loadavg']:.1f}"
    )


if __name__ == "__main__":
    main()
