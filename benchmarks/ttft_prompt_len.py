"""TTFT against prompt length: waferline's engine measured, beside the host simulator's prediction for the same Plan.

    python benchmarks/ttft_prompt_len.py                      # sol-mini, ~2-3 min on 2 cores
    python benchmarks/ttft_prompt_len.py --model DIR --lengths 32,128,512 --out FILE.json
    python benchmarks/ttft_prompt_len.py --json               # the result as JSON instead of the table

For each configuration (the single-process engine; a 2-stage pipeline, ``LLM(path, plan=Plan)`` with the planner's
stage split and 2 micro-batches in flight; and both with several prompts at once) and each prompt length, TTFT is the
time until every prompt of the request has its first token (one generated token asked for), the best of
``--repeats`` runs after a warm-up at that shape. Each configuration runs in a fresh process (one torch thread per
process), after the twin's canary (sim/calibrate/engine.py Canary): 'machine x' = how much slower (> 1) the machine ran
then than when the hardware YAML was calibrated.

The prediction is the twin's (sim/twin.py): the Plan from ``place()`` on the calibrated hardware YAML, priced by
``simulate(plan, host=HostParams)`` over the engine's op stream counted (TorchDispatchMode, untimed) on the
single-process engine -- here for every prefill forward the engine runs: the whole prompt (single process), or each
pipeline chunk at its own position in the prompt (``pred``). ``pred@0+term`` prices every chunk by its forward at
position 0 plus the host model's attention term for the keys before it (sim/host_work.py attention_context_work): what
the twin predicts from its one counted forward; ``pred first``: every chunk as its forward at position 0, nothing added
(the host model before that term). No time measured here enters a prediction.

'CPU ms' is the CPU time of the engine's processes over the fastest run (stage 0 with the driver first): for the single
process, the wall time a quiet machine would have taken ('err x CPU' compares with it). The slope rows fit TTFT = a +
slope x prompt length (least squares over the lengths) for the measurement and the prediction. Never part of the test
pass/fail.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from waferline.sim.host_work import ChunkOps, chunk_sweeps

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "ttft_prompt_len.json"
DEFAULT_LENGTHS = (32, 128, 512, 1024, 2032)
DEFAULT_BATCH_LENGTHS = (32, 128, 512)


# ----------------------------------------------------------------------------- child processes


def measure(path: str, stages: int, plan_json: str | None, cases: list[list[int]], repeats: int) -> dict[str, Any]:
    """Child process: TTFT of each (prompts, prompt length) case on one engine, best of ``repeats`` after a warm-up."""
    import torch

    from waferline.engine.llm import LLM
    from waferline.sim.calibrate.common import process_cpu_seconds
    from waferline.sim.twin_engine import _timed_run, make_prompts

    torch.set_num_threads(1)
    kw: dict[str, Any] = {}
    if stages > 1:
        from waferline.plan.plan import Plan

        plan = Plan.from_json(plan_json) if plan_json else None
        kw = {"plan": plan, "micro_batches": plan.micro_batches if plan else stages, "threads_per_stage": 1}
    out = []
    t_start = time.perf_counter()
    with LLM(path, dtype="bfloat16", **kw) as llm:
        start_s = time.perf_counter() - t_start
        pids = [os.getpid()] + list(getattr(getattr(llm, "_pipeline", None), "pids", []) or [])
        for B, P in cases:
            prompts = make_prompts(llm.spec.vocab_size, B, P)
            _timed_run(llm, prompts, 1)  # warm-up: one-time work at this shape (oneDNN kernels, cache sizes)
            runs, cpu = [], []
            for _ in range(repeats):
                c0 = [process_cpu_seconds(p) for p in pids]
                runs.append(_timed_run(llm, prompts, 1)["ttft_s"])
                cpu.append([process_cpu_seconds(p) - c for p, c in zip(pids, c0)])
            best = min(range(repeats), key=lambda i: runs[i])
            out.append({"batch": B, "prompt_len": P, "ttft_s": runs[best], "ttft_s_runs": runs,
                        "cpu_s_per_process": cpu[best], "cpu_s_min": [min(c[i] for c in cpu) for i in range(len(pids))],
                        "load_average_1m": os.getloadavg()[0]})
    return {"cases": out, "start_s": start_s}


def attend_probe(path: str, hardware: str, lengths: list[int], repeats: int = 3) -> list[dict[str, Any]]:
    """Child process: the engine's attention over its scores (model/attention.py attend(), what a prefill runs in each
    MLA layer: absorbed queries [1, T, H, r + rope] over T latents, causal mask, fp32 on CPU) for T = each length, in
    this process's CPU time (best of ``repeats``), beside the host model's price of the op stream the counter records
    for it; and its elementwise passes over the [1, T, H, T] fp32 scores alone (scale, mask, softmax) per element.
    Shapes from the model's first MLA layer; [] without one."""
    import torch

    from waferline.model.attention import attend
    from waferline.sim.calibrate.opcount import OpCounter
    from waferline.sim.host import HostParams, Work, _work_time
    from waferline.spec.configs import spec_from_pretrained
    from waferline.spec.model import MLASpec

    torch.set_num_threads(1)
    spec = spec_from_pretrained(Path(path))
    m = next((la.mixer for la in spec.layers if isinstance(la.mixer, MLASpec)), None)
    if m is None:
        return []
    host = HostParams.load(hardware)
    H, r, rope = m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim

    def best(fn: Any) -> float:
        out = float("inf")
        for _ in range(repeats):
            t = time.process_time()
            fn()
            out = min(out, time.process_time() - t)
        return out

    rows = []
    for T in lengths:
        q = torch.randn(1, T, H, r + rope)
        kv = torch.randn(1, T, 1, r + rope, dtype=torch.bfloat16)
        blocked = torch.arange(T)[None, None, :] > torch.arange(T)[None, :, None]

        def run() -> Any:
            return attend(q, kv, kv[..., :r], blocked, 0.1)

        cpu = best(run)
        with OpCounter() as c:
            run()
        w = Work()
        for lab, d in c.work.items():
            w.add(Work.from_counts(c.counts.get(lab, 0), d))
        ops_s, mm_s, other_s = _work_time(host, w, host.prefill["bf16"][0], "bf16", 1.0)
        rest = host.prefill_dram_scale("bf16", T, rest=True)
        sc = torch.randn(1, T, H, T)
        n = float(sc.numel())
        rows.append({"tokens": T, "heads": H, "score_elements": n, "cpu_s": cpu,
                     "priced_s": ops_s * rest + mm_s + other_s * rest, "priced_matmuls_s": mm_s,
                     "priced_other_s": (ops_s + other_s) * rest,
                     "ns_per_element": {"mul_": best(lambda: sc.mul_(1.0)) / n * 1e9,
                                        "masked_fill_": best(lambda: sc.masked_fill_(blocked[:, :, None, :], -1e9))
                                        / n * 1e9,
                                        "softmax": best(lambda: torch.softmax(sc, -1)) / n * 1e9},
                     "priced_ns_per_element_passes": 16.0 / host.elementwise.get("fp32_large", host.memory_bandwidth)
                     * rest * 1e9})
    return rows


# ----------------------------------------------------------------------------- the parent: predictions, table


class FirstChunkOps(ChunkOps):
    """Every chunk priced as its forward at position 0 and nothing added: the host model before it priced a chunk at
    its position (every pipeline chunk as the first)."""

    def prefill_chunk(self, rows: int, tokens: int, start: int) -> Any:
        return self.prefill(rows, tokens)


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def _shown(path: Path) -> str:
    """A path as the result records it: relative to the repository where it lies inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def default_hardware() -> Path:
    """The repository's calibration of this kind of machine: AVX-512 or AVX2 (benchmarks/results/twin_host_*.yaml)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    name = "twin_host_avx512.yaml" if "avx512f" in flags else "twin_host_avx2.yaml"
    return ROOT / "benchmarks" / "results" / name


def run(model: Path, hardware: Path, lengths: list[int], batch: int, batch_lengths: list[int], stages: int,
        repeats: int, canary: bool, say: Any, attend: bool = True) -> dict[str, Any]:
    from waferline.sim.calibrate.common import run_isolated
    from waferline.sim.host import PIPELINE_PREFILL_CHUNK, HostParams, prefill_micro_batches
    from waferline.sim.pipeline import simulate
    from waferline.sim.twin import GridPoint, _plan_for, cache_dir, cpu_model, error_factor
    from waferline.spec.configs import spec_from_pretrained
    from waferline.spec.hardware import load_hardware_file

    spec = spec_from_pretrained(model)
    hw = load_hardware_file(hardware)
    host = HostParams.load(hardware)
    ctx = spec.max_position_embeddings
    lengths = [p for p in lengths if p + 16 <= ctx] or [min(32, ctx - 16)]
    batch_lengths = [p for p in batch_lengths if p + 16 <= ctx] if batch > 1 else []
    cases = [(1, p) for p in lengths] + [(batch, p) for p in batch_lengths]
    configs = [1] + ([stages] if stages > 1 else [])
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parent) + (os.pathsep + env_path if env_path else "")

    say("counting the engine's prefill forwards (untimed)")
    sweeps = sorted({(1, p, p) for p in lengths} | {(b, p, p) for b, p in cases if b > 1}
                    | (set(chunk_sweeps(cases, PIPELINE_PREFILL_CHUNK)) if stages > 1 else set()))
    counts = run_isolated("waferline.sim.twin:count_prefill_chunks",
                          {"path": str(model), "sweeps": [list(s) for s in sweeps]}, 900.0)
    can = None
    if canary and host.canary_s:
        from waferline.sim.calibrate.engine import Canary

        say("loading the canary workload")
        can = Canary(cache_dir() / "calibration-models")
    rows = []
    try:
        for S in configs:
            plans = {}
            for B in sorted({b for b, _ in cases}):
                pt = GridPoint(stages=S, micro_batches=S, batch=B)
                plans[B] = _plan_for(pt, spec, hw, max(lengths), 1)
            canary_s = [can.seconds()] if can is not None else []
            say(f"engine: {'single process' if S == 1 else f'{S}-stage pipeline'}")
            meas = run_isolated("ttft_prompt_len:measure", {
                "path": str(model), "stages": S, "plan_json": plans[1].to_json(indent=None) if S > 1 else None,
                "cases": [list(c) for c in cases], "repeats": repeats}, 900.0)
            if can is not None:
                canary_s.append(can.seconds())
            mf = min(canary_s) / host.canary_s if canary_s else None
            for m in meas["cases"]:
                B, P = m["batch"], m["prompt_len"]
                plan = plans[B]
                pred, cpus = {}, {}
                for label, prof in (("pred", ChunkOps(counts, spec, host)),
                                    ("pred_at_0", ChunkOps(counts, spec, host, at_position=False)),
                                    ("pred_first", FirstChunkOps(counts, spec, host))):
                    sim = simulate(plan, prompt_len=P, output_len=1, concurrency=B, spec=spec, hardware=hw, host=host,
                                   ops=prof)
                    pred[label] = sim.ttft_s
                    cpus[label] = sim.speculative["host"]["prefill_cpu_per_stage_s"]
                pred_cpu = cpus["pred"]
                rows.append({
                    "config": "single process" if S == 1 else f"{S}-stage pipeline, M={plan.micro_batches}",
                    "stages": S, "batch": B, "prompt_len": P,
                    "measured_ttft_s": m["ttft_s"], "measured_runs_s": m["ttft_s_runs"],
                    # CPU seconds of the engine's processes over the fastest run (stage 0 with the driver first)
                    "measured_cpu_s": m["cpu_s_per_process"], "measured_cpu_s_min": m["cpu_s_min"],
                    "run_spread": max(m["ttft_s_runs"]) / min(m["ttft_s_runs"]),
                    # chunks counted at their positions; counted at position 0 + the attention term (what the twin's
                    # one counted forward gives); every chunk as the first (the host model before the term)
                    "predicted_ttft_s": pred["pred"], "predicted_ttft_at_0_s": pred["pred_at_0"],
                    "predicted_ttft_first_s": pred["pred_first"],
                    "error_factor": error_factor(pred["pred"], m["ttft_s"]),
                    # the CPU seconds of each process (stage) until the first tokens, predicted and measured: what a
                    # busy machine's wall time does not show (one process: the wall time a quiet machine would take)
                    "predicted_cpu_s": pred_cpu, "predicted_cpu_first_s": cpus["pred_first"],
                    "error_factor_cpu": error_factor(sum(pred_cpu), sum(m["cpu_s_per_process"])),
                    "error_factor_cpu_first": error_factor(sum(cpus["pred_first"]), sum(m["cpu_s_per_process"])),
                    "error_factor_at_0": error_factor(pred["pred_at_0"], m["ttft_s"]),
                    "error_factor_first": error_factor(pred["pred_first"], m["ttft_s"]),
                    "machine_factor": mf,
                    "error_factor_at_canary": error_factor(pred["pred"] * mf, m["ttft_s"]) if mf else None,
                    "canary_s": canary_s, "load_average_1m": m["load_average_1m"],
                    "pipeline_micro_batches": len(prefill_micro_batches(B, P, PIPELINE_PREFILL_CHUNK)) if S > 1
                    else None,
                })
    finally:
        if can is not None:
            can.close()
    if attend:
        say("attention over its scores: measured vs priced (CPU time)")
    probe = run_isolated("ttft_prompt_len:attend_probe", {"path": str(model), "hardware": str(hardware),
                                                          "lengths": sorted({min(256, lengths[-1]), lengths[-1]}
                                                                            | {p for p in (1024,) if p < lengths[-1]})},
                         600.0) if attend else []
    slopes = []
    for S in configs:
        for B in sorted({b for b, _ in cases}):
            rs = [r for r in rows if r["stages"] == S and r["batch"] == B]
            if len(rs) < 2:
                continue
            xs = [r["prompt_len"] for r in rs]
            out = {"config": rs[0]["config"], "stages": S, "batch": B, "lengths": xs}
            for k, key in (("measured", "measured_ttft_s"), ("predicted", "predicted_ttft_s"),
                           ("predicted_at_0", "predicted_ttft_at_0_s"), ("predicted_first", "predicted_ttft_first_s"),
                           ("measured_cpu", "measured_cpu_s"), ("predicted_cpu", "predicted_cpu_s")):
                a, b = linear_fit(xs, [sum(r[key]) if key.endswith("cpu_s") else r[key] for r in rs])
                out[k] = {"intercept_s": a, "slope_s_per_token": b}
            out["slope_error_factor_cpu"] = error_factor(out["predicted_cpu"]["slope_s_per_token"],
                                                         out["measured_cpu"]["slope_s_per_token"])
            out["slope_error_factor"] = error_factor(out["predicted"]["slope_s_per_token"],
                                                     out["measured"]["slope_s_per_token"])
            slopes.append(out)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "model": _shown(model), "model_name": spec.name, "hardware": _shown(hardware),
        "calibrated": host.measured.get("date"), "machine": platform.node(), "cpu_model": cpu_model(),
        "cores": os.cpu_count(), "load_average": list(os.getloadavg()), "repeats": repeats,
        "threads_per_process": 1, "prefill_chunk": PIPELINE_PREFILL_CHUNK, "rows": rows, "slopes": slopes,
        "attend_probe": probe,
    }


def render(res: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title=f"TTFT vs prompt length: {res['model_name']} on {res['machine']} ({res['cores']} cores, 1 thread "
              f"per process; best of {res['repeats']}); hardware {Path(res['hardware']).name}")
    for c in ("config", "prompts", "prompt len", "TTFT ms meas", "runs x", "CPU ms", "pred", "err x", "CPU ms pred",
              "err x CPU",
              "pred@0+term", "pred first", "err x first", "machine x", "err x at canary"):
        t.add_column(c, justify="left" if c == "config" else "right")

    def f(x: float | None, d: int = 2) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    for r in res["rows"]:
        t.add_row(r["config"], str(r["batch"]), str(r["prompt_len"]), f(r["measured_ttft_s"] * 1e3, 1),
                  f(r["run_spread"]), "+".join(f(c * 1e3, 0) for c in r["measured_cpu_s"]),
                  f(r["predicted_ttft_s"] * 1e3, 1), f(r["error_factor"]),
                  "+".join(f(c * 1e3, 0) for c in r["predicted_cpu_s"]), f(r.get("error_factor_cpu")),
                  f(r["predicted_ttft_at_0_s"] * 1e3, 1), f(r["predicted_ttft_first_s"] * 1e3, 1),
                  f(r["error_factor_first"]), f(r["machine_factor"]),
                  f(r["error_factor_at_canary"]))
    console.print(t)
    s = Table(title="TTFT = a + slope x prompt length (least squares over the lengths); CPU: of all the engine's "
              "processes")
    for c in ("config", "prompts", "slope ms/token meas", "pred", "err x", "pred first", "CPU meas", "CPU pred",
              "err x CPU", "a ms meas", "pred"):
        s.add_column(c, justify="left" if c == "config" else "right")
    for r in res["slopes"]:
        s.add_row(r["config"], str(r["batch"]), f(r["measured"]["slope_s_per_token"] * 1e3, 3),
                  f(r["predicted"]["slope_s_per_token"] * 1e3, 3), f(r["slope_error_factor"]),
                  f(r["predicted_first"]["slope_s_per_token"] * 1e3, 3),
                  f(r["measured_cpu"]["slope_s_per_token"] * 1e3, 3),
                  f(r["predicted_cpu"]["slope_s_per_token"] * 1e3, 3),
                  f(r.get("slope_error_factor_cpu")), f(r["measured"]["intercept_s"] * 1e3, 1),
                  f(r["predicted"]["intercept_s"] * 1e3, 1))
    console.print(s)
    if res.get("attend_probe"):
        a = Table(title="one MLA layer's attention over its scores (attend(), fp32), CPU time vs the host model's "
                  "price of its counted ops; its elementwise passes per score element")
        for c in ("tokens", "heads", "CPU ms", "priced ms", "x", "matmuls priced", "rest priced", "mul_ ns/el",
                  "masked_fill_ ns/el", "softmax ns/el", "passes priced ns/el"):
            a.add_column(c, justify="right")
        for r in res["attend_probe"]:
            ns = r["ns_per_element"]
            a.add_row(str(r["tokens"]), str(r["heads"]), f(r["cpu_s"] * 1e3, 1), f(r["priced_s"] * 1e3, 1),
                      f(r["cpu_s"] / r["priced_s"]), f(r["priced_matmuls_s"] * 1e3, 1), f(r["priced_other_s"] * 1e3, 1),
                      f(ns["mul_"]), f(ns["masked_fill_"]), f(ns["softmax"]), f(r["priced_ns_per_element_passes"]))
        console.print(a)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Measure the engine's time to first token at several prompt lengths (single process, a 2-stage "
                    "pipeline, several prompts at once) and print the host simulator's prediction for the same Plan "
                    "and prompt length beside each, with the error factor exp(|ln(pred/meas)|) and the per-token "
                    "prefill slope of both (a linear fit over the lengths).")
    ap.add_argument("--model", default=str(ROOT / "models" / "sol-mini"), help="checkpoint directory (default "
                    "models/sol-mini), or dsv3-100m: the twin's ~100M DeepSeek-V3-type random checkpoint (made once)")
    ap.add_argument("--hardware", default=None, help="calibrated hardware YAML (`waferline calibrate`); default the "
                    "repository's for this CPU kind: benchmarks/results/twin_host_avx2.yaml or _avx512.yaml")
    ap.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                    help="prompt lengths of one prompt, comma-separated; those within 16 tokens of the model's "
                    "context are dropped (default %(default)s)")
    ap.add_argument("--batch", type=int, default=4, help="prompts at once for the batched cases; 1: none (default 4)")
    ap.add_argument("--batch-lengths", default=",".join(map(str, DEFAULT_BATCH_LENGTHS)),
                    help="prompt lengths of the batched cases (default %(default)s)")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages for the pipeline cases; 1: none (default 2)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per case after a warm-up; the best counts")
    ap.add_argument("--no-canary", action="store_true", help="skip the canary (the machine's speed vs the calibration)")
    ap.add_argument("--no-attend-probe", action="store_true", help="skip timing the MLA attention over its scores "
                    "alone against its price (~10 s)")
    ap.add_argument("--out", default=None, help=f"write the JSON here (e.g. {RESULTS.relative_to(ROOT)})")
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of the tables")
    a = ap.parse_args(argv)
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    if a.out:
        try:  # (before the run: a path that cannot be written fails here, not after the run)
            check_writable(a.out, "--out")
        except ConfigError as e:
            ap.error(str(e))
    lengths = {}
    for flag, text in (("--lengths", a.lengths), ("--batch-lengths", a.batch_lengths)):
        try:
            lengths[flag] = [int(x) for x in text.split(",") if x]
        except ValueError:
            ap.error(f"{flag} {text}: expected comma-separated integers")
    from rich.console import Console

    err = Console(stderr=True)
    if a.model == "dsv3-100m":  # the twin's DeepSeek-V3-type random checkpoint (written once into the cache)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from twin_grid import dsv3_checkpoint

        a.model = str(dsv3_checkpoint())
    model = Path(a.model)
    if not (model / "config.json").is_file():
        ap.error(f"--model {model}: not a checkpoint directory (no config.json)")
    hardware = Path(a.hardware) if a.hardware else default_hardware()
    if not hardware.is_file():
        ap.error(f"--hardware {hardware}: no such file; run `waferline calibrate --out host.yaml`")
    t0 = time.perf_counter()
    res = run(model, hardware, lengths["--lengths"], a.batch, lengths["--batch-lengths"], a.stages, a.repeats,
              not a.no_canary,
              lambda what: err.print(f"[dim]{time.perf_counter() - t0:6.1f} s[/dim] {what}"), not a.no_attend_probe)
    res["wall_s"] = time.perf_counter() - t0
    if a.out:
        write_text_atomic(a.out, json.dumps(res, indent=1) + "\n", make_parents=True)
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        render(res, Console(width=max(Console().width, 170)))
        print(f"{res['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
