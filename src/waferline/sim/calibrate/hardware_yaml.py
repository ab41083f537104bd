"""Measure this host for the twin and write its hardware YAML: every probe of the package run in turn (memory
bandwidth, fp32/bf16/int4 matmul and GEMV speed, the fused operators, the engine's per-op and per-step overhead, the
gloo link between two local processes, the pipeline), every figure marked measured (date, method); and the median of
several such calibrations of one host.

The device of the YAML is *one core* of this machine (the engine runs one torch thread per stage process), the
scale-up link is gloo over loopback as the pipeline engine uses it, and the ``host_engine`` section holds the numbers
the simulator's host-engine model (``sim/host.py``) needs. Probes take the best of several repeats: other work on a
shared machine only ever slows a probe down.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from waferline.errors import ConfigError
from waferline.files import write_text_atomic
from waferline.sim.calibrate.common import (
    BIG_CALIBRATION_MODEL,
    PREFILL_CALIBRATION_MODEL,
    Progress,
    _fig,
    machine_differences,
    machine_identity,
    not_measured,
    run_isolated,
)
from waferline.sim.calibrate.engine import BIG_PROBE_BATCHES, Canary, engine_overhead, speculative_overhead
from waferline.sim.calibrate.opcount import SMALL_OP_BYTES
from waferline.sim.calibrate.ops import (
    FUSED_PROBE_MLA,
    FUSED_PROBE_ROWS,
    FUSED_PROBE_SSM,
    FUSED_PROBE_WIDTHS,
    cuda_numbers,
    elementwise_bandwidth,
    fit_linear,
    fused_op_probe,
    hot_tables,
    last_level_cache_bytes,
    linear_sweep,
    linear_table,
    matmul_flops,
    memory_bandwidth,
    memory_bandwidth_small,
)
from waferline.sim.calibrate.pipeline import (
    OVERSUB_STAGES,
    measure_parallel_ceilings,
    oversubscribed_figures,
    oversubscribed_fit,
    stage_cpu_fit,
)


def measure_host(quick: bool = False, progress: Progress | None = None, engine: bool = True, link: bool = True,
                 pipeline: bool | None = None) -> dict[str, Any]:
    """A hardware mapping for this machine (one core = one device); every number says when and how it was measured.

    ``quick``: smaller, noisier probes (for tests). ``engine`` / ``link`` / ``pipeline``: include the engine's per-op
    overhead, the gloo link and the pipeline's per-hop overhead (each needs torch and the engine; the pipeline probe
    starts a stage process; default: on unless ``quick``)."""
    import torch

    from waferline.model.layers import few_rows

    phases: dict[str, float] = {}  # wall seconds per phase (each from its progress message to the next)
    last = [None, time.perf_counter()]

    def say(what: str, frac: float) -> None:
        now = time.perf_counter()
        if last[0] is not None:
            phases[last[0]] = phases.get(last[0], 0.0) + now - last[1]
        last[:] = [what, now]
        if progress is not None:
            progress(what, frac)

    if pipeline is None:
        pipeline = not quick  # the pipeline probe starts a stage process (~5 s): off in quick mode unless asked
    host = platform.node() or "host"
    when = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")
    tag = f"measured on {host} {when}"
    cores = os.cpu_count() or 1
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    load = os.getloadavg()
    say("memory bandwidth", 0.02)
    bw1 = memory_bandwidth(32 if quick else 256, 1)
    bwc = max(memory_bandwidth_small(256 * 1024), bw1)
    ew = {
        (d, size): elementwise_bandwidth(n, d, r)
        for d in ("fp32", "bf16")
        for size, n, r in (
            ("small", 64 * 1024 // (4 if d == "fp32" else 2), 200),
            ("large", (32 << 20) // (4 if d == "fp32" else 2), 2),
        )
    }
    bwn = memory_bandwidth(32 if quick else 256, cores) if not quick else bw1
    say("matmul FLOP/s", 0.08)
    n = 256 if quick else 1024
    fl = {d: matmul_flops(n, d, 1) for d in ("fp32", "bf16")}
    sweep_ms = [1, 8, 64] if quick else [1, 2, 4, 8, 16, 64, 256]
    sweep_sizes = [64, 256, 1024] if quick else [64, 128, 256, 512, 1024, 2048]
    pool = 8 if quick else 64
    llc = last_level_cache_bytes()
    hot_mb = llc / 2 / (1 << 20) if llc and not quick else 0.0
    lin: dict[str, Any] = {}
    for i, d in enumerate(("fp32", "bf16", "int4")):
        say(f"linear (GEMV/GEMM) sweep {d}", 0.12 + 0.12 * i)
        rows = linear_sweep(d, sweep_ms, sweep_sizes, pool)
        if rows:
            lin[d] = {"fit": fit_linear(rows), "points": rows,
                      "hot": linear_sweep(d, sweep_ms, sweep_sizes, hot_mb, hot=True) if hot_mb else []}
    ident = machine_identity()
    he: dict[str, Any] = {
        "measured": {
            "date": when,
            "host": host,
            "cpu_model": ident["cpu_model"],  # (a name is not a machine: combine and twin compare these)
            "cpu_capability": ident["cpu_capability"],
            "torch": str(torch.__version__),
            "load_average_1m": load[0],
            "clock": "process CPU time for single-threaded probes, wall time for the link and the pipeline",
            "threads_per_process": 1,
            "quick": quick,
        },
        "cores": _fig(cores, tag, "os.cpu_count()"),
        "engine_few_rows": _fig(
            few_rows(torch.bfloat16),
            tag,
            "waferline.model.layers.few_rows(bf16): the most rows of a "
            "bf16 product the engine's own kernel runs on this CPU (4 where oneDNN has bf16 GEMMs, "
            "else 8)",
        ),
        "memory_bandwidth_1_thread": _fig(
            bw1, tag, f"torch copy of {32 if quick else 256} MB, 1 thread, read+write bytes / best of 5"
        ),
        "cache_bandwidth_1_thread": _fig(
            bwc, tag, "torch copy of 256 KB x 200 (stays in cache), 1 thread, read+write bytes / best of 5"
        ),
        "small_op_bytes": {
            "value": SMALL_OP_BYTES,
            "assumed": "non-matmul ops moving at most this many bytes run from cache",
        },
        "elementwise": {
            f"{d}_{size}": _fig(
                v,
                tag,
                f"z = x * y in {d}, {'64 KB tensors x 200 (in cache)' if size == 'small' else '32 MB tensors'}, "
                "1 thread, (2 reads + 1 write) bytes / best of 5",
            )
            for (d, size), v in ew.items()
        },
        "linear": {},
    }
    for d, v in lin.items():
        f = v["fit"]
        meth = (
            f"{d} y = x W^T, M in {sweep_ms}, K = N in {sweep_sizes}, {pool} MB of distinct weights cycled, 1 thread; "
            f"fit t = t0 + bytes/bw + flops/F (median fit error x{f['median_fit_error_factor']:.2f})"
        )
        he["linear"][d] = {
            "t0_s": _fig(f["t0_s"], tag, meth),
            "bytes_per_s": _fig(min(f["bytes_per_s"], 1e15), tag, meth),
            "flops_per_s": _fig(min(f["flops_per_s"], 1e16), tag, meth),
            "table": dict(
                linear_table(v["points"]),
                measured={"date": when, "method": meth.split("; fit")[0] + "; seconds per call, best of 3"},
            ),
            "points": [[r["m"], r["k"], r["n"], r["seconds"]] for r in v["points"]],
        }
        if v["hot"]:
            he["linear"][d]["table_hot"] = dict(
                linear_table(v["hot"]),
                measured={
                    "date": when,
                    "method": f"{d} y = x W^T, M in {sweep_ms}, K = N in {sweep_sizes}, {hot_mb:.0f} MB of distinct "
                    "weights cycled (half the last-level cache: they stay in it), 1 thread; seconds "
                    "per call, best of 3",
                },
            )
    if llc:
        he["llc_bytes"] = _fig(llc, tag, "last-level cache size (sysfs /sys/devices/system/cpu/cpu0/cache)")
    say("fused operators (mla_decode, ssm_update, mamba2_mix, silu_mul, rms_norm)", 0.47)
    fo = fused_op_probe(quick)
    if fo:
        he["fused_ops"] = {}
        for name, f in fo.items():
            unit, shapes = {
                "mla_decode": ("FLOPs", f"rows x tokens 1-4, MLA heads {FUSED_PROBE_MLA}"),
                "ssm_update": ("state elements updated", f"rows x tokens 1-32, Mamba-2 states {FUSED_PROBE_SSM}"),
                "mamba2_mix": ("state elements updated", f"rows x tokens 1-32, Mamba-2 states {FUSED_PROBE_SSM}"),
            }.get(name, ("elements written", f"bf16, rows {FUSED_PROBE_ROWS} x widths {FUSED_PROBE_WIDTHS}"))
            meth = (f"torch.ops.waferline.{name} back to back, 1 thread, {shapes}: fit t = t0 + {unit} / rate, fit "
                    f"error x{f['fit_error_factor']:.2f}")
            he["fused_ops"][name] = {
                "t0_s": _fig(f["t0_s"], tag, meth),
                "units_per_s": _fig(f["units_per_s"], tag, meth),
                "points": f["points"],
            }
    fused_rates = {k: (v["t0_s"], v["units_per_s"]) for k, v in (fo or {}).items()}
    lk = None
    if link:
        say("gloo link between two processes", 0.85)
        lk = run_isolated(
            "waferline.sim.calibrate.pipeline:gloo_link",
            {
                "sizes": [0, 4096, 65536, 1 << 20] if quick else [0, 1024, 16384, 65536, 1 << 20, 4 << 20],
                "reps": 30 if quick else 120,
            },
            120,
        )
        meth = (
            "engine.stage.Link over gloo between two local processes, 1 thread each: 10th percentile of round trip / "
            "2 per "
            "size; latency = the smallest over messages <= 16 KB, bandwidth = slope between the two largest"
        )
        he["link"] = {
            "latency_s": _fig(lk["latency_s"], tag, meth),
            "bytes_per_s": _fig(lk["bytes_per_s"], tag, meth),
            "cpu_per_message_s": _fig(lk["cpu_per_message_s"], tag, "process CPU time per message (time.process_time)"),
            "points": [[r["bytes"], r["one_way_s"], r["cpu_per_message_s"]] for r in lk["points"]],
        }
    if not quick and cores > 1:
        say("parallel ceiling (one process per core)", 0.88)
        pcs = measure_parallel_ceilings(1.5, ("gemv", "gemm"))
        pc = [pcs[kind]["ceiling"] for kind in ("gemv", "gemm")]
        he["parallel_ceiling"] = _fig(
            min(float(cores), max(1.0, min(pc))),
            tag,
            f"{cores} single-thread processes at once vs one alone (aggregate rate / rate alone), "
            f"bf16 one-row GEMVs over 64 MB of weights {pc[0]:.2f}x and fp32 32-row GEMMs "
            f"{pc[1]:.2f}x; the smaller",
        )
    if engine:
        tmp = tempfile.TemporaryDirectory(prefix="waferline-calib-")
        work = Path(tmp.name)
        try:
            cal_models = [(64, 1), (64, 2), (384, 2)] if quick else [(64, 1), (64, 2), (64, 6), (384, 2), (384, 4)]
            # 2, 4 and 8: a multi-row call costs the same at each, a table lookup does not; bf16 products of up to 4
            # rows run the engine's own kernel (no oneDNN call), so only batch 8 shows bf16's multi-row cost
            batches = [1, 8] if quick else [1, 2, 4, 8]
            toks = 8 if quick else 16
            ew_rates = {f"{d}_{size}": v for (d, size), v in ew.items()}
            # matmuls without a weight (attention, scans) at the linear fit's roofline, as the host model prices them
            mm_fits = {
                k: (min(v["fit"]["bytes_per_s"], 1e15), min(v["fit"]["flops_per_s"], 1e16))
                for k, v in lin.items()
                if k != "int4"
            }
            he["other_matmuls_at_roofline"] = True
            canary = None if quick else Canary(work)
            canary_runs = [] if canary is None else [canary.seconds(), canary.seconds()]
            he["engine"] = {}
            for i, d in enumerate(("fp32", "bf16")):
                say(f"engine per-op overhead ({d}, tiny models)", 0.5 + 0.1 * i)
                eo = engine_overhead(d, cal_models, batches, toks, work, hot_tables(lin), ew_rates,
                                     # from memory: bf16 only (the twin's Plans and W4A16 compute in 16 bits; an fp32
                                     # Plan whose weights leave the cache takes the cache-resident scales; ~12 s saved)
                                     big=None if quick or d == "fp32" else BIG_CALIBRATION_MODEL,
                                     prefill_model=PREFILL_CALIBRATION_MODEL,
                                     fused=fused_rates, mm_fits=mm_fits,
                                     dram_bw=bw1,
                                     dram_tables={k: linear_table(v["points"]) for k, v in lin.items()},
                                     int4_models=[m for m in cal_models if m[0] % 128 == 0] if d == "bf16" else None)
                meth = (
                    f"single-process engine decode of random sol calibration models (hidden, layers) = {cal_models} "
                    f"(Mamba-2/MLA, dense/MoE) at batch {batches}, 1 thread: CPU seconds per step - other ops' bytes "
                    "at the elementwise bandwidths = step + op x non-linear aten ops + linear_scale x linear calls "
                    "priced "
                    "by the cache-resident linear table + row x sequences + multi_call x 16-bit linear calls of 2+ "
                    "rows (ops "
                    f"counted by TorchDispatchMode); relative least squares, fit error x{eo['fit_error_factor']:.2f}"
                )
                he["engine"][d] = {
                    "op_overhead_s": _fig(eo["op_overhead_s"], tag, meth),
                    "step_overhead_s": _fig(eo["step_overhead_s"], tag, meth),
                    "ops_per_layer": _fig(
                        eo["ops_per_layer"], tag, "aten ops per layer per decode step of the calibration models"
                    ),
                    "linear_scale": _fig(eo["linear_scale"], tag, meth),
                    "linear_scale_dram": _fig(
                        eo["linear_scale_dram"],
                        tag,
                        (
                            f"decode of a random sol model (hidden, layers, FFN) = {BIG_CALIBRATION_MODEL} whose "
                            f"weights exceed the last-level cache, at batch 1: (CPU s per step - the fitted "
                            f"other terms) / its linears priced by the from-memory table"
                        ),
                    )
                    if eo["big_points"]
                    else {
                        "value": float(eo["linear_scale_dram"]),
                        "assumed": "not measured (bf16 only, not in --quick): as linear_scale",
                    },
                    **(
                        {
                            "linear_scale_dram_multi": _fig(
                                eo["linear_scale_dram_multi"],
                                tag,
                                (
                                    f"the same model at batch {BIG_PROBE_BATCHES[-1]}: (CPU s per step - the fitted "
                                    "other "
                                    "terms - its one-row linears at linear_scale_dram) / its multi-row linears "
                                    "priced by "
                                    f"the from-memory table"
                                ),
                            )
                        }
                        if eo["linear_scale_dram_multi"] is not None
                        else {}
                    ),
                    "big_points": eo["big_points"],
                    "row_overhead_s": _fig(eo["row_overhead_s"], tag, meth),
                    "multi_call_overhead_s": _fig(eo["multi_call_overhead_s"], tag, meth),
                    **{
                        k: _fig(
                            eo[k],
                            tag,
                            f"prefill (generate with max_tokens=1) of 32- and 96-token prompts on the "
                            f"same calibration models: CPU seconds - bytes = overhead + op x non-linear ops"
                            f" + scale x table-priced linears; relative least squares, fit error "
                            f"x{eo['prefill_fit_error_factor']:.2f}",
                        )
                        for k in ("prefill_op_overhead_s", "prefill_linear_scale", "prefill_overhead_s")
                    },
                    "points": eo["points"],
                }
                for key, how in (
                    (
                        "prefill_linear_scale_dram",
                        f"prefill forward of one 32-token prompt on the random sol model {PREFILL_CALIBRATION_MODEL} "
                        "(weights beyond the last-level cache): the profiler's share of its ops' self time in "
                        "products "
                        f"with a weight x its CPU seconds / those products priced by the from-memory table",
                    ),
                    (
                        "prefill_linear_scale_int4",
                        "prefill of 32- and 96-token prompts on int4 copies (RTN, group 128) of the calibration "
                        "models "
                        f"{[m for m in cal_models if m[0] % 128 == 0]}: (CPU seconds - the fitted prefill terms) / "
                        "their "
                        f"int4 linears priced by the int4 table, median",
                    ),
                ):
                    if eo[key] is not None:
                        he["engine"][d][key] = _fig(eo[key], tag, how)
                if eo["prefill_linear_scale_int4"] is not None:
                    he["engine"][d]["int4_prefill_points"] = eo["int4_prefill_points"]
                if eo["prefill_rest_scale_dram"] is not None:
                    he["engine"][d]["prefill_rest_scale_dram"] = _fig(
                        eo["prefill_rest_scale_dram"],
                        tag,
                        (
                            "the same prefill forward: the profiler's share of its ops' self time outside matmuls x "
                            "its CPU "
                            "seconds / those ops priced as the host model does (per-op cost + bytes at the elementwise "
                            "bandwidths + the fused operators at their rates)"
                        ),
                    )
                if eo["prefill_linear_scale_dram_batch"] is not None:
                    b_ = eo["prefill_linear_scale_dram_batch"]
                    how = (f"the same model, one prefill forward of {b_['tokens'] // 32} such prompts at once (as a "
                           f"pipeline stage prefills a micro-batch): the same ratio; a forward of n tokens takes the "
                           f"two scales interpolated (log-log in n) between 32 and {b_['tokens']} tokens")
                    he["engine"][d]["prefill_linear_scale_dram_batch"] = dict(_fig(b_["scale"], tag, how),
                                                                              tokens=b_["tokens"])
                    he["engine"][d]["prefill_rest_scale_dram_batch"] = dict(_fig(b_["rest_scale"], tag, how),
                                                                            tokens=b_["tokens"])
            try:
                say("speculative engine per-step overhead (tiny model, n-gram)", 0.68)
                so = speculative_overhead("bf16", work, toks, he["engine"]["bf16"]["op_overhead_s"]["value"]
                                          + 0.0, row_s=he["engine"]["bf16"]["row_overhead_s"]["value"],
                                          multi_s=he["engine"]["bf16"]["multi_call_overhead_s"]["value"],
                                          fused=fused_rates, mm_fits=mm_fits,
                                          tables=hot_tables(lin),
                                          scale=he["engine"]["bf16"]["linear_scale"]["value"], ew=ew_rates)
                he["engine"]["bf16"]["spec_step_overhead_s"] = _fig(
                    so["spec_step_overhead_s"], tag, "single-process speculative decoding (n-gram, k=3) of the 2-layer "
                    "calibration model, bf16, 1 thread: CPU s per verify step - op overhead x ops per verify step")
            except Exception as e:  # noqa: BLE001 - speculative decoding may be unavailable; the rest stands
                he["engine"]["bf16"]["spec_step_overhead_s"] = {
                    "value": 0.0,
                    "assumed": not_measured(e),
                }
            if pipeline:
                say("pipeline hop vs idle time (2 stage processes, 3 model sizes)", 0.72)
                try:
                    po = run_isolated(
                        "waferline.sim.calibrate.pipeline:pipeline_overhead",
                        {"workdir": str(work), "tokens": toks, "link_s": lk["latency_s"] if lk else 0.0},
                        300,
                    )
                except Exception as e:  # noqa: BLE001 - the pipeline engine may be unavailable; the rest stands
                    po = None
                    he["pipeline"] = {
                        "hop_overhead_s": {"value": 0.0, "assumed": not_measured(e)}
                    }
                if po is not None:
                    meth = (
                        "2-stage pipeline of calibration models (hidden, layers) = "
                        f"{[(p['hidden'], p['layers']) for p in po['points']]}, 1 sequence, fp32, wall time: "
                        "(per-token time - single-process step) / 2 hops, against the receiving stage's wait per token "
                        "(per-token time - half the step)"
                    )
                    he["pipeline"] = {"hop_latency_s": _fig(po["hop_latency_s"], tag, meth + "; the smallest model"),
                                      "hop_overhead_s": _fig(po["hop_overhead_s"], tag, meth + "; the smallest model, "
                                                             "minus the link latency"),
                                      "hop_vs_idle": {"points": [[p["idle_s"], p["hop_s"]] for p in po["points"]],
                                                      "measured": {"date": when, "method": meth}},
                                      "stage_step_cpu_s": _fig(po["stage_step_cpu_s"], tag, (
                                          "the same pipelines: CPU seconds of both processes per token - the "
                                          "single-process CPU per token = 2 stage steps x this + stage_cpu_inflation x "
                                          "the single-process CPU, least squares over the models: what a stage process "
                                          "spends per micro-batch step besides computing (receive, send, unpack, "
                                          "wake-up)")),
                                      "stage_cpu_inflation": _fig(po["stage_cpu_inflation"], tag, (
                                          "the same fit: how much more CPU a stage's compute takes than in one "
                                          "process (caches cold after each wake-up)")),
                                      "per_token_s": po["per_token_s"], "probes": po["points"]}
                    ratios = [p["per_token_s"] / p["pipeline_cpu_s"] for p in po["points"] if p["pipeline_cpu_s"] > 0]
                    if ratios:
                        he["pipeline"]["chain_wall_per_cpu"] = _fig(float(np.median(ratios)), tag, (
                            "the same pipelines (one sequence: a serial chain of stage steps): per-token wall time / "
                            "CPU seconds of both processes per token, median over the models"))
                    if po.get("afd"):
                        a = po["afd"]
                        he["pipeline"]["afd_message_cpu_s"] = _fig(
                            a["message_cpu_s"],
                            tag,
                            (
                                "attention/FFN disaggregation of the calibration model (hidden, layers) = "
                                f"({a['hidden']}, "
                                f"{a['layers']}), 1 attention + 1 FFN rank, 1 sequence, bf16: (CPU seconds of all its "
                                f"processes per token - the single process's) / (4 messages x {a['ffn_layers']} FFN "
                                "layers)"
                            ),
                        )
                        if a.get("overlapped_hop_s") is not None:
                            he["pipeline"]["afd_overlapped_hop_s"] = _fig(
                                a["overlapped_hop_s"],
                                tag,
                                (
                                    f"the same model, {a['overlapped_rows']} sequences in "
                                    f"{a['overlapped_micro_batches']} "
                                    "micro-batches (both ranks working): link seconds per message in the engine's own "
                                    "time "
                                    "split (issuing sends + the part of each wait after the peer had sent), mean of "
                                    "the two "
                                    "ranks, best of 2"
                                ),
                            )
                            he["pipeline"]["afd_overlapped_message_cpu_s"] = _fig(a["overlapped_message_cpu_s"], tag, (
                                f"the same model, {a['overlapped_rows']} sequences in {a['overlapped_micro_batches']} "
                                "micro-batches: (CPU seconds of all its processes per token - the single process's at "
                                "the same sequences) / (4 message ends x FFN layers x micro-batches)"))
                        he["pipeline"]["afd_probe"] = a
                    elif po.get("afd_error"):
                        he["pipeline"]["afd_message_cpu_s"] = {
                            "value": None,
                            "assumed": "not measured: " + po["afd_error"],
                        }
                    if cores < OVERSUB_STAGES and not quick:  # Plans with more stage processes than cores can run here
                        say(f"pipeline with more stage processes than cores ({OVERSUB_STAGES} on {cores})", 0.85)
                        try:
                            ov = run_isolated("waferline.sim.calibrate.pipeline:oversubscribed_pipeline",
                                              {"workdir": str(work), "tokens": toks}, 300)
                            he["pipeline"]["oversubscribed"] = oversubscribed_figures(ov, tag)
                        except Exception as e:  # noqa: BLE001 - the 2-stage figures stand for such Plans
                            he["pipeline"]["oversubscribed"] = {"error": not_measured(e)}
            if canary is not None:
                canary_runs += [canary.seconds(), canary.seconds()]
                canary.close()
                he["canary_s"] = _fig(
                    statistics.median(canary_runs),
                    tag,
                    (
                        f"wall seconds per decode token of the random sol model {BIG_CALIBRATION_MODEL}, one 8-token "
                        f"sequence, bf16, 1 thread, fastest of 2; median of {len(canary_runs)} runs at the start and "
                        "the end "
                        "of the engine probes (twin runs the same before each Plan: the machine's speed then against "
                        "now)"
                    ),
                )
        finally:
            tmp.cleanup()
    say("CUDA (if present)", 0.95)
    cu = cuda_numbers()
    if cu:
        he["cuda"] = {
            "name": cu["name"],
            "bf16_flops": _fig(cu["bf16_flops"], tag, "8192^3 bf16 matmul, best of 5"),
            "memory_bandwidth": _fig(cu["memory_bandwidth"], tag, "256 MB device copy, read + write, best of 5"),
            "h2d_bytes_per_s": _fig(cu["h2d_bytes_per_s"], tag, "64 MB pinned host -> device copy"),
            "memory_bytes": _fig(cu["memory_bytes"], tag, "torch.cuda.get_device_properties"),
        }
    say("done", 1.0)
    he["measured"]["phase_seconds"] = {k: round(v, 2) for k, v in phases.items()}
    flops = {
        "bf16": _fig(
            fl["bf16"],
            tag,
            f"bf16 {n}^3 matmul through the engine's linear() (fp32 inside where oneDNN has no bf16 GEMM), 1 thread, "
            "best of 3",
        ),
        "fp32": _fig(fl["fp32"], tag, f"fp32 {n}^3 matmul through the engine's linear(), 1 thread, best of 3"),
    }
    links: dict[str, Any] = {"scale_out": "eth-100g"}
    if lk is not None:
        links["scale_up"] = {
            "name": "gloo-loopback",
            "bandwidth": he["link"]["bytes_per_s"],
            "latency": he["link"]["latency_s"],
        }
    else:
        links["scale_up"] = {
            "name": "gloo-loopback",
            "bandwidth": {"value": 1e9, "assumed": "link not measured (--no-link)"},
            "latency": {"value": 1e-4, "assumed": "link not measured (--no-link)"},
        }
    return {
        "name": f"cpu-{host}".lower().replace(" ", "-"),
        "kind": "cpu",
        "placement": "pipeline",
        "description": (
            f"One core of this host ({platform.processor() or platform.machine()}, {cores} logical CPUs, "
            f"load average {load[0]:.2f} when measured): engine stages are processes with one thread each."
        ),
        "device": {
            "memory_bytes": _fig(mem, tag, "physical memory (sysconf)"),
            "memory_bandwidth": _fig(
                bw1, tag, f"torch copy of {32 if quick else 256} MB, 1 thread, read + write bytes / best of 5"
            ),
            "memory_bandwidth_all_cores": _fig(bwn, tag, f"same with {cores} threads"),
            "flops": flops,
            "cores": _fig(cores, tag, "os.cpu_count()"),
            "reserve_fraction": {"value": 0.2, "assumed": "OS, Python and torch runtime"},
        },
        "system": {"devices_per_node": _fig(cores, tag, "os.cpu_count(): one device per core")},
        "links": links,
        "host_engine": he,
    }


def calibrated_machine(he: dict[str, Any]) -> dict[str, Any]:
    """The machine a ``host_engine`` section was measured on (common.machine_identity's keys that it records; older
    calibrations lack the CPU's), and whether it was a --quick calibration."""
    m = he.get("measured") or {}
    cores = he.get("cores")
    cores = cores.get("value") if isinstance(cores, dict) else cores
    return {"host": m.get("host"), "cores": int(cores) if isinstance(cores, (int, float)) else None,
            "cpu_model": m.get("cpu_model"), "cpu_capability": m.get("cpu_capability"), "quick": bool(m.get("quick"))}


def combine_host_yamls(paths: list[str | Path]) -> dict[str, Any]:
    """Several calibrations of one host as one hardware mapping: every number found at the same place in all files (a
    figure's ``value``, each number of the probe tables and points) is the median over the files; the rest (text,
    flags) is the first file's. Why: the
    fitted constants of one calibration move with the machine's slow phases (this 2-core VM: the per-op cost 2.8-4.3
    us, the prefill linear scale 1.3-2.0 between runs minutes apart), and the median of a few runs at different times
    is steadier than any one. The files must come from the same host and tree (the same probes); each combined figure
    says so in its ``source``."""
    import json

    if len(paths) < 2:
        raise ConfigError("--combine needs two or more calibrations (hardware YAMLs written by `waferline calibrate`)")
    docs = []
    for p in paths:
        try:
            d = yaml.safe_load(Path(p).read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise ConfigError(f"{p}: cannot read ({e})") from None
        if not isinstance(d, dict) or not isinstance(d.get("host_engine"), dict):
            raise ConfigError(f"{p}: no host_engine section (not written by `waferline calibrate`)")
        same = next((q for q, e in zip(paths, docs) if e == d), None)
        if same is not None:  # (the same calibration twice would count as two in every median)
            raise ConfigError(f"--combine: {same} and {p} are the same calibration: give each calibration once")
        docs.append(d)
    hosts = {str(d["host_engine"].get("measured", {}).get("host")) for d in docs}
    if len(hosts) > 1:
        raise ConfigError(f"--combine: calibrations of different hosts ({', '.join(sorted(hosts))})")
    ids = [calibrated_machine(d["host_engine"]) for d in docs]
    for i in range(len(ids)):  # (every pair: a file recorded before a key existed matches any value of it)
        for j in range(i + 1, len(ids)):
            diff = machine_differences(ids[i], ids[j])
            if diff:  # (one name, another machine: these VMs are all named `vm`, some with AVX-512 and some without)
                raise ConfigError(f"--combine: {paths[i]} and {paths[j]} are calibrations of different machines "
                                  f"({', '.join(diff)})")
    for p, m in zip(paths[1:], ids[1:]):
        if m["quick"] != ids[0]["quick"]:
            raise ConfigError(f"--combine: {paths[0]} and {p} mix a --quick calibration with a full one (other "
                              "probes, no pipeline probe): combine calibrations of one kind")
    n = len(docs)
    note = f" [median of {n} calibrations: {', '.join(str(p) for p in paths)}]"

    def num(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    def merge(dst: Any, srcs: list[Any]) -> None:  # every number that all files have at the same place -> median
        if isinstance(dst, dict):
            keys, subs = list(dst), [[s.get(k) if isinstance(s, dict) else None for s in srcs] for k in dst]
        elif isinstance(dst, list) and all(isinstance(s, list) and len(s) == len(dst) for s in srcs):
            keys, subs = list(range(len(dst))), [[s[i] for s in srcs] for i in range(len(dst))]
        else:
            return
        for k, vals in zip(keys, subs):
            if num(dst[k]) and all(num(v) for v in vals):
                dst[k] = float(statistics.median(vals))
                if k == "value" and isinstance(dst.get("source"), str):  # (a figure one file alone has stays its own)
                    dst["source"] += note
            else:
                merge(dst[k], vals)

    out = json.loads(json.dumps(docs[0]))
    merge(out, docs)
    _refit_pairs(out["host_engine"].get("pipeline") or {}, n)
    out["host_engine"]["measured"]["combined"] = [
        {"file": str(p), "date": str(d["host_engine"].get("measured", {}).get("date")),
         "load_average_1m": d["host_engine"].get("measured", {}).get("load_average_1m")} for p, d in zip(paths, docs)]
    out["description"] = f"{out.get('description', '')} Median of {n} calibrations.".strip()
    return out


def _refit_pairs(pipe: dict[str, Any], n: int) -> None:
    """Figures fitted in pairs (a stage step's fixed CPU and its compute's inflation) refitted from the combined
    (median) probe points: the median of each figure alone can pair one file's fixed cost with another's inflation
    (they trade off against each other from one noisy calibration to the next)."""
    why = f" [refitted on the median probe points of {n} calibrations]"
    pts = pipe.get("probes")
    if isinstance(pts, list) and len(pts) >= 2 and all("pipeline_cpu_s" in p for p in pts) \
            and isinstance(pipe.get("stage_step_cpu_s"), dict) and isinstance(pipe.get("stage_cpu_inflation"), dict):
        fixed, infl = stage_cpu_fit(pts)
        for key, val in (("stage_step_cpu_s", fixed), ("stage_cpu_inflation", infl)):
            pipe[key]["value"] = val
            pipe[key]["source"] = pipe[key].get("source", "").split(" [median of")[0] + why
    ov = pipe.get("oversubscribed")
    if isinstance(ov, dict) and isinstance(ov.get("probes"), list) and len(ov["probes"]) >= 2 and "stages" in ov:
        for key, val in oversubscribed_fit(ov["probes"], int(ov["stages"])).items():
            if isinstance(ov.get(key), dict):
                ov[key]["value"] = val
                ov[key]["source"] = ov[key].get("source", "").split(" [median of")[0] + why


def write_combined_yaml(path: str | Path, paths: list[str | Path]) -> dict[str, Any]:
    """``combine_host_yamls(paths)`` written to ``path`` (via a temporary file: nothing half-written on failure); a
    result that does not load as a host model is refused before ``path`` is replaced."""
    from waferline.sim.host_params import HostParams

    d = combine_host_yamls(paths)
    HostParams.from_dict(d, f"the median of {', '.join(map(str, paths))}")
    _write(path, "# written by `waferline calibrate --combine`: the median of several calibrations of this host.\n"
           + yaml.safe_dump(d, sort_keys=False, width=140))
    return d


def write_host_yaml(
    path: str | Path, quick: bool = False, progress: Progress | None = None, **kw: Any
) -> dict[str, Any]:
    """Measure this host and write the hardware YAML to ``path`` (whole or not at all: a run that fails or is killed
    leaves the file that was there, e.g. twin's cached calibration); returns the mapping."""
    import json

    d = json.loads(
        json.dumps(
            measure_host(quick, progress, **kw), default=lambda o: float(o) if hasattr(o, "__float__") else str(o)
        )
    )
    _write(path, "# written by `waferline calibrate`; re-run to refresh. Every figure is measured (see source).\n"
           + yaml.safe_dump(d, sort_keys=False, width=140))
    return d


def _write(path: str | Path, text: str) -> None:
    """A calibration written whole or not at all; a failed write (a full disk) is a ConfigError that names the file."""
    try:
        write_text_atomic(path, text, make_parents=True)
    except OSError as e:
        raise ConfigError(f"cannot write the calibration to {path}: {e.strerror or e}") from None
