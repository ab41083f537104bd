"""The single-process engine's own costs, fitted on calibration models: per op, per step, per sequence and per
multi-row product in decode and prefill, how much slower a linear runs inside the engine than in the sweep (weights in
the last-level cache and from memory, bf16 and int4), the speculative engine's Python work per verify step, and the
canary: a fixed workload that says how fast this machine runs right now."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from waferline.sim.calibrate.common import (
    BIG_CALIBRATION_MODEL,
    _nnls_rel,
    _per_token,
    _timed_cpu,
    big_calibration_checkpoint,
    calibration_checkpoint,
)
from waferline.sim.calibrate.opcount import (
    OpCounter,
    _forward_work,
    _generate_work,
    _known_seconds,
    _profiled_shares,
    fused_calls,
    multi_row_calls,
    table_seconds,
)

if TYPE_CHECKING:
    from waferline.engine.llm import LLM

BIG_PREFILL_ROWS = (1, 8)  # prompts of 32 tokens in one prefill forward of the big calibration model


def _prefill_forward(llm: LLM, prompts: list[list[int]]) -> Callable[[], Any]:
    """One prefill forward of ``prompts`` (equal lengths) through the single-process engine's model, fresh caches,
    the last position's logits and argmax: what a pipeline of one stage runs for a prefill micro-batch."""
    import torch

    from waferline.model.context import StepBatch

    model = llm.model
    toks = torch.tensor(prompts)
    n, P = toks.shape

    def run() -> Any:
        with torch.inference_mode():
            caches = model.new_caches(n)
            h = model(toks, caches, StepBatch.make(list(range(n)), [0] * n, P))
            return model.logits(h[:, -1]).argmax(-1)
    return run


BIG_PROBE_BATCHES = (1, 8)  # its decode batches: one-row products at 1, multi-row ones at 8
def _decode_step_probe(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[dict[str, float], float]:
    """One decode step of ``prompts`` on the single-process engine: its counted work (ops, linear calls, bytes: the
    difference between generating ``tokens + 1`` and 1 token, per token) and its CPU seconds (the same difference,
    fastest of 3, after a warm-up; CPU time of this single-threaded process, see _best). The warm-up comes first:
    one-time work (weights laid out for oneDNN, absorbed MLA weights) must not land in either counted run. The CPU
    seconds are 0.0 where no positive time per token could be measured (a disturbed probe, which its callers leave
    out)."""
    from waferline.engine.sampling import SamplingParams
    from waferline.errors import WaferlineError

    llm.generate(prompts, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))  # warm-up
    w2, w1 = _generate_work(llm, prompts, tokens + 1), _generate_work(llm, prompts, 1)
    step = {k: (w2.get(k, 0.0) - w1.get(k, 0.0)) / tokens for k in set(w1) | set(w2)}
    try:
        return step, _per_token(llm, prompts, tokens, time.process_time, 3)
    except WaferlineError:  # (one point of many: the calibration goes on without it)
        return step, 0.0


def engine_overhead(dtype: str, models: list[tuple[int, int]], batches: list[int], tokens: int, workdir: Path,
                    tables: dict[str, Any] | None = None, ew: dict[str, float] | None = None,
                    big: tuple[int, int, int] | None = None, dram_tables: dict[str, Any] | None = None,
                    prefill_model: tuple[int, int, int] | None = None,
                    int4_models: list[tuple[int, int]] | None = None,
                    fused: dict[str, tuple[float, float]] | None = None,
                    mm_fits: dict[str, tuple[float, float]] | None = None,
                    dram_bw: float | None = None) -> dict[str, Any]:
    """The single-process engine's decode step on calibration models of its own architecture (random `sol` models of
    (hidden, layers) in ``models``, at each batch in ``batches``): CPU seconds per step - other ops' bytes at the
    elementwise bandwidths = step_overhead + op_overhead x non-linear aten ops + linear_scale x the step's linear calls
    priced by the (cache-resident) linear ``tables`` + row_overhead x sequences in the step (the loop's Python work per
    sequence: sampling, stop checks) + multi_call_overhead x 16-bit linear calls of two or more rows (oneDNN products:
    each costs ~20 us more inside the engine than back to back in the sweep, whatever its size; a step at batch 2,
    flat beyond) -- relative least squares, non-negative. ``linear_scale`` is how much slower a linear runs inside the
    engine (other ops between them, cold caches) than in the isolated sweep.
    ``big`` = (hidden, layers, FFN) of a model whose weights do not fit in the last-level cache: its measured step
    minus the fitted other terms, over its linears priced by ``dram_tables``, is ``linear_scale_dram`` (a linear
    reading its weight from memory inside the engine vs in the sweep). The from-memory prefill scales are measured on
    ``prefill_model`` (same tuple; ``big`` when None): a model as large, whose products are the size of the twin's
    models' (0.5-5 MB), since a product's in-engine scale depends on its shape. Ops are counted (TorchDispatchMode) on
    separate, untimed runs. The fused operators (``fused``: name -> (t0, units/s) from fused_op_probe) are priced
    apart, like the other ops' bytes."""
    import torch

    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    pts: list[dict[str, Any]] = []
    pre: list[dict[str, Any]] = []
    try:
        for h, L in models:
            d = calibration_checkpoint(workdir, h, L)
            llm = LLM(d, dtype="bfloat16" if dtype == "bf16" else "float32")
            for P in (32, 96):  # prefill: one prompt of P tokens (generate with max_tokens=1)
                prompt = [[(5 * j + 3) % 200 + 2 for j in range(P)]]
                llm.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))  # warm-up (one-time work) first
                wp = _generate_work(llm, prompt, 1)
                n_lin, t_lin = table_seconds(wp, tables or {})
                best = min(
                    _timed_cpu(lambda: llm.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
                    for _ in range(3)
                )
                pre.append({"hidden": h, "layers": L, "prompt": P, "ops": wp["ops"], "linear_calls": n_lin,
                            "fused_calls": fused_calls(wp, fused), "multi_row_calls": multi_row_calls(wp),
                            "linear_table_s": t_lin,
                            "bytes_s": _known_seconds(wp, ew, fused, mm_fits), "seconds": best})
            for B in batches:
                prompt = [[(3 * j + 5 + 7 * r) % 200 + 2 for j in range(8)] for r in range(B)]
                step, best = _decode_step_probe(llm, prompt, tokens)
                n_lin, t_lin = table_seconds(step, tables or {})
                t_bytes = _known_seconds(step, ew, fused, mm_fits)
                if best <= 0:
                    continue  # a disturbed probe: leave the point out
                pts.append({"hidden": h, "layers": L, "batch": B, "ops_per_step": step["ops"], "linear_calls": n_lin,
                            "multi_row_calls": multi_row_calls(step), "fused_calls": fused_calls(step, fused),
                            "linear_table_s": t_lin, "bytes_s": t_bytes,
                            "seconds_per_step": best})
    finally:
        torch.set_num_threads(old)
    if not pts:
        from waferline.errors import WaferlineError

        raise WaferlineError("could not measure the engine's decode step: every probe's time per token came out at or "
                             "below zero (other work on this machine); measure again when it is idle")
    X = np.array([[1.0, p["ops_per_step"] - p["linear_calls"] - p["fused_calls"], p["linear_table_s"], p["batch"],
                   p["multi_row_calls"]] for p in pts])
    y = np.array([max(p["seconds_per_step"] - p["bytes_s"], 1e-7) for p in pts])
    a, c, g, r, dm = (float(v) for v in _nnls_rel(X, y))
    if c <= 0:  # noise: the mean time per op
        c = float(np.mean(y / np.maximum(X[:, 1], 1.0)))
    if g <= 0:
        g = 1.0
    pred = X @ np.array([a, c, g, r, dm])
    one = [p for p in pts if p["hidden"] == models[0][0] and p["batch"] == batches[0]]
    # prefill: its own per-op cost and linear scale (longer tensors per op than decode)
    Xp = np.array([[1.0, p["ops"] - p["linear_calls"] - p["fused_calls"], p["linear_table_s"]] for p in pre])
    # the decode fit's in-engine cost per 16-bit product of 2+ rows (every prefill linear is one) is taken as known:
    # a scale fitted on the calibration models' tiny GEMMs would otherwise carry it to large ones
    yp = np.array([max(p["seconds"] - p["bytes_s"] - dm * p["multi_row_calls"], 1e-7) for p in pre])
    ap, cp, gp = (float(v) for v in _nnls_rel(Xp, yp)) if len(pre) >= 3 else (0.0, c, g)
    predp = Xp @ np.array([ap, cp, gp]) if len(pre) >= 3 else yp
    # int4 prefill: the same models quantized (RTN, group 128); their int4 GEMMs against the int4 table, the other terms
    # from the bf16 fit above (the scale fitted there is a bf16 figure: int4 kernels are compute-bound at 32+ rows)
    g_int4, int4_pts = None, []
    if int4_models and tables and "int4" in tables:
        from waferline.model.quant import QuantOptions, quantize_checkpoint

        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for h, L in int4_models:
                src = calibration_checkpoint(workdir, h, L)
                d = src.with_name(src.name + "-int4")
                if not (d / "config.json").is_file():
                    quantize_checkpoint(str(src), str(d), QuantOptions())
                llm = LLM(d, dtype="bfloat16")
                for P in (32, 96):
                    prompt = [[(5 * j + 3) % 200 + 2 for j in range(P)]]
                    llm.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))  # warm-up (one-time work) first
                    wp = _generate_work(llm, prompt, 1)
                    _, t4 = table_seconds({k: v for k, v in wp.items() if k.startswith("call|int4|")}, tables)
                    n_lin, t_lin = table_seconds(wp, tables)
                    sec = min(_timed_cpu(lambda: llm.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
                              for _ in range(3))
                    rest = (ap + (cp if cp > 0 else c) * (wp["ops"] - n_lin - fused_calls(wp, fused))
                            + (gp if gp > 0 else g) * (t_lin - t4) + _known_seconds(wp, ew, fused, mm_fits)
                            + dm * multi_row_calls(wp))
                    if t4 > 0 and sec > rest:
                        int4_pts.append({"hidden": h, "layers": L, "prompt": P, "seconds": sec, "int4_table_s": t4,
                                         "rest_s": rest, "scale": (sec - rest) / t4})
        finally:
            torch.set_num_threads(old)
        if int4_pts:
            g_int4 = float(np.median([p["scale"] for p in int4_pts]))
    # a model whose weights do not fit in the last-level cache: its linears against the from-memory table, with the
    # other terms from the fit above (its step is mostly linears, so this is well determined)
    g_dram, g_dram_multi, g_pre_dram, g_pre_dram_batch, r_pre_dram, big_pts = g, None, None, None, None, []
    cp_ = cp if cp > 0 else c
    if big is not None and dram_tables:
        h, L, ffn = big
        d = big_calibration_checkpoint(workdir, big)
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            llm = LLM(d, dtype="bfloat16" if dtype == "bf16" else "float32")
            for B in BIG_PROBE_BATCHES:  # 1: one-row products (ATen's GEMV); 8: multi-row ones (oneDNN), apart
                prompt = [[(3 * j + 5 + 7 * r_) % 200 + 2 for j in range(8)] for r_ in range(B)]
                step, sec = _decode_step_probe(llm, prompt, tokens)
                n_lin, t_lin = table_seconds(step, dram_tables)
                _, t_one = table_seconds(
                    {k: v for k, v in step.items() if k.startswith("call|") and k.split("|")[2] == "1"}, dram_tables
                )
                rest = (a + c * (step["ops"] - n_lin - fused_calls(step, fused)) + r * B + dm * multi_row_calls(step)
                        + _known_seconds(step, ew, fused, mm_fits, dram_bw))
                if sec > rest and t_lin > 0:
                    big_pts.append(
                        {
                            "hidden": h,
                            "layers": L,
                            "batch": B,
                            "seconds_per_step": sec,
                            "linear_table_s": t_lin,
                            "one_row_table_s": t_one,
                            "rest_s": rest,
                            "scale": (sec - rest) / t_lin,
                        }
                    )
            # its prefill: GEMMs the size of a real model's, where the tiny models' prefill scale, fitted on GEMMs
            # dominated by their fixed cost, does not carry. One 32-token prompt (as the single-process engine
            # prefills) and 8 of them in one forward (as a pipeline stage prefills a micro-batch: 256-row GEMMs), each
            # split by the profiler: its products' share of the CPU seconds over their from-memory table price, and
            # the other ops' share over their price (one prompt's products ran ~1.3-1.7x their table price here, a
            # batch's ~0.95-1.1x, so neither scale carries to the other). On the prefill model: the big model's
            # 8-17 MB products ran one prompt at 1.35-1.48x their price where a model of 2-5 MB products, and
            # dsv3-100m, ran at 1.03-1.22x (interleaved in one process)
            from waferline.sim.host import PREFILL_PROBE_TOKENS as P32

            if prefill_model is not None and prefill_model != big:
                llm.close()
                h, L, _ = prefill_model
                llm = LLM(big_calibration_checkpoint(workdir, prefill_model),
                          dtype="bfloat16" if dtype == "bf16" else "float32")
            for rows in BIG_PREFILL_ROWS:
                prompts = [[(5 * j + 3 + 11 * r_) % 200 + 2 for j in range(P32)] for r_ in range(rows)]
                fwd = _prefill_forward(llm, prompts)
                fwd()  # warm-up (one-time work) first
                wp = _forward_work(fwd)
                n_lin, t_lin = table_seconds(wp, dram_tables)
                sec = min(_timed_cpu(fwd) for _ in range(3))
                # where its time goes (the profiler's self time per op, as shares of the timed seconds): products
                # with a weight, matmuls without one (priced at their roofline, not scaled), everything else
                lin_share, _, rest_share = _profiled_shares(fwd)
                rest = cp_ * (wp["ops"] - n_lin - fused_calls(wp, fused)) + _known_seconds(wp, ew, fused, None, dram_bw)
                lin_s = lin_share * sec - dm * multi_row_calls(wp)
                if lin_s > 0 and t_lin > 0 and rest > 0:
                    pt = {"hidden": h, "layers": L, "prompt": P32, "rows": rows, "tokens": P32 * rows, "seconds": sec,
                          "linear_table_s": t_lin, "linear_share": lin_share, "scale": lin_s / t_lin,
                          "rest_priced_s": rest, "rest_share": rest_share, "rest_scale": rest_share * sec / rest}
                    big_pts.append(pt)
                    if rows == 1:
                        g_pre_dram, r_pre_dram = pt["scale"], pt["rest_scale"]
                    else:
                        g_pre_dram_batch = {"tokens": P32 * rows, "scale": pt["scale"], "rest_scale": pt["rest_scale"]}
        finally:
            torch.set_num_threads(old)
        at1 = [p for p in big_pts if p.get("batch") == 1]
        if at1:
            g_dram = at1[0]["scale"]
        for p in big_pts:  # multi-row calls: what is left after the one-row ones at the batch-1 scale
            if "batch" not in p:
                continue
            multi = p["linear_table_s"] - p["one_row_table_s"]
            if p["batch"] > 1 and multi > 0 and p["seconds_per_step"] - p["rest_s"] > g_dram * p["one_row_table_s"]:
                g_dram_multi = (p["seconds_per_step"] - p["rest_s"] - g_dram * p["one_row_table_s"]) / multi
        if big_pts and not at1:
            g_dram = float(np.median([p["scale"] for p in big_pts if "batch" in p] or [g]))
    return {
        "prefill_linear_scale_int4": g_int4,
        "int4_prefill_points": int4_pts,
        "linear_scale_dram": g_dram,
        "linear_scale_dram_multi": g_dram_multi,
        "big_points": big_pts,
        "op_overhead_s": c,
        "step_overhead_s": a,
        "linear_scale": g,
        "row_overhead_s": r,
        "multi_call_overhead_s": dm,
        "prefill_op_overhead_s": cp if cp > 0 else c,
        "prefill_linear_scale": gp if gp > 0 else g,
        "prefill_linear_scale_dram": g_pre_dram,
        "prefill_linear_scale_dram_batch": g_pre_dram_batch,
        "prefill_rest_scale_dram": r_pre_dram,
        "prefill_overhead_s": ap,
        "prefill_points": pre,
        "prefill_fit_error_factor": float(np.exp(np.median(np.abs(np.log(np.maximum(predp, 1e-9) / yp))))),
        "points": pts,
        "fit_error_factor": float(np.exp(np.median(np.abs(np.log(pred / y))))),
        "ops_per_layer": float(
            (one[-1]["ops_per_step"] - one[0]["ops_per_step"]) / max(one[-1]["layers"] - one[0]["layers"], 1)
        ),
    }


def speculative_overhead(dtype: str, workdir: str | Path, tokens: int, op_s: float, k: int = 3,
                         tables: dict[str, Any] | None = None, scale: float = 1.0,
                         ew: dict[str, float] | None = None, row_s: float = 0.0, multi_s: float = 0.0,
                         fused: dict[str, tuple[float, float]] | None = None,
                         mm_fits: dict[str, tuple[float, float]] | None = None) -> dict[str, float]:
    """Per verify step, the speculative engine's Python work that dispatches no aten op (drafting, verification,
    rollback bookkeeping): CPU seconds per verify step of the 2-layer calibration model with prompt-lookup drafting
    minus per-op overhead x ops per verify step (ops counted on a separate run)."""
    import torch

    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(Path(workdir) / "tiny-2", dtype="bfloat16" if dtype == "bf16" else "float32", speculative="ngram",
                  num_speculative_tokens=k, speculative_adaptive=False)
        prompt = [[(3 * j + 5) % 200 + 2 for j in range(8)] * 2]

        def steps(max_tokens: int) -> float:
            out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
            return float(out.metrics.get("spec_verify_steps", 0.0))

        steps(tokens + 1)  # warm-up: one-time work (weight layouts) must not land in a counted run
        w1, w2 = {}, {}
        for store, mt in ((w1, 1), (w2, tokens + 1)):
            with OpCounter() as c:
                n = steps(mt)
            store["ops"] = float(c.total)
            for wk in c.work.values():
                for kk, vv in wk.items():
                    store[kk] = store.get(kk, 0.0) + vv
        per = {kk: (w2.get(kk, 0.0) - w1.get(kk, 0.0)) / max(n, 1.0) for kk in set(w1) | set(w2)}
        n_lin, t_lin = table_seconds(per, tables or {})
        # one sequence (row_s); multi_s per 16-bit product of 2+ rows (a verify step's tokens)
        t_lin = (t_lin * scale + _known_seconds(per, ew, fused, mm_fits) + row_s + multi_s * multi_row_calls(per))
        ops = per["ops"] - n_lin - fused_calls(per, fused)
        b1 = bn = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            steps(1)
            t1 = time.process_time()
            n = steps(tokens + 1)
            t2 = time.process_time()
            b1, bn = min(b1, t1 - t0), min(bn, t2 - t1)
        best = max(0.0, (bn - b1) / max(n, 1.0))
    finally:
        torch.set_num_threads(old)
    return {"seconds_per_verify_step": best, "ops_per_verify_step": ops,
            "spec_step_overhead_s": max(0.0, best - t_lin - op_s * ops)}


CANARY_TOKENS = 6  # decode tokens per canary run


class Canary:
    """A fixed engine workload that says how fast this machine runs right now: wall seconds per decode token of the big
    calibration model (weights beyond the last-level cache, so it moves both with the CPU time this process gets and
    with memory bandwidth), one 8-token sequence, bf16, one thread, fastest of 2 (~0.2 s). calibrate records it with
    its figures; twin runs it before every Plan it measures, so each Plan's error can be read against how much faster
    or slower the machine ran then than during the calibration (this VM: 1.3-2.4x slower for minutes at a time)."""

    def __init__(self, workdir: str | Path):
        from waferline.engine.llm import LLM
        from waferline.engine.sampling import SamplingParams

        self.llm = LLM(big_calibration_checkpoint(workdir, BIG_CALIBRATION_MODEL), dtype="bfloat16")
        self.prompt = [[(3 * j + 5) % 200 + 2 for j in range(8)]]
        self.llm.generate(self.prompt, SamplingParams(max_tokens=2, ignore_eos=True))  # one-time work off the clock

    def seconds(self, repeats: int = 2) -> float:
        """(generating CANARY_TOKENS + 1 tokens - generating 1) / CANARY_TOKENS, each the fastest of ``repeats``."""
        import torch

        from waferline.engine.sampling import SamplingParams

        def best(n: int) -> float:
            out = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                self.llm.generate(self.prompt, SamplingParams(max_tokens=n, ignore_eos=True))
                out = min(out, time.perf_counter() - t)
            return out

        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return max(best(CANARY_TOKENS + 1) - best(1), 1e-9) / CANARY_TOKENS
        finally:
            torch.set_num_threads(old)

    def close(self) -> None:
        self.llm.close()
