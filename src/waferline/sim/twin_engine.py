"""The twin's child process: run the engine for one Plan of the grid (``measure_point``, called in a fresh process by
sim/twin.py) and count the aten ops it runs per layer for the simulator (``count_ops``, counted, not timed)."""

from __future__ import annotations

import os
import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from waferline.engine.llm import LLM


def make_prompts(vocab: int, rows: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts: a random phrase said twice (so prompt-lookup has something to find)."""
    import random

    out = []
    for r in range(rows):
        g = random.Random(seed * 7919 + r)
        phrase = [g.randrange(2, vocab) for _ in range(max(1, prompt_len // 2))]
        out.append((phrase * 3)[:prompt_len])
    return out


def _engine_kwargs(point: dict[str, Any], plan_json: str | None) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if point["afd"]:
        kw.update(afd=True, attention_ranks=point["attention_ranks"], ffn_ranks=point["ffn_ranks"],
                  micro_batches=point["micro_batches"], threads_per_rank=1)
    elif point["stages"] != 1:
        from waferline.plan.plan import Plan

        kw.update(plan=Plan.from_json(plan_json) if plan_json else None, micro_batches=point["micro_batches"],
                  threads_per_stage=1)
    if point["speculative"] != "none":
        kw.update(speculative=point["speculative"], num_speculative_tokens=point["k"], speculative_adaptive=False)
    return kw


def _timed_run(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from waferline.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    n: dict[int, int] = {}
    outs: Any = None
    t0 = time.perf_counter()
    for ev in llm.stream(prompts, params):
        if isinstance(ev, list):
            outs = ev
            break
        now = time.perf_counter()
        row = int(ev[0])
        first.setdefault(row, now)
        last[row] = now
        n[row] = n.get(row, 0) + 1
    end = time.perf_counter()
    rows = sorted(n)
    rates = [(n[r] - 1) / (last[r] - first[r]) for r in rows if n[r] > 1 and last[r] > first[r]]
    ttft = max(first.values()) - t0 if first else float("nan")
    window = max(last.values()) - max(first.values()) if first else 0.0
    dec = sum(n[r] - 1 for r in rows)
    metrics = dict(outs[0].metrics) if outs else {}
    return {"ttft_s": ttft, "tokens_per_s_per_user": statistics.mean(rates) if rates else 0.0,
            "aggregate_tokens_per_s": dec / window if window > 0 else 0.0, "total_s": end - t0,
            "tokens": [n[r] for r in rows],
            "engine_metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}}


def _arrivals(llm: LLM, prompts: list[list[int]], output_len: int) -> list[float]:
    """Token arrival times of row 0 (s since the request), for the report's timeline."""
    from waferline.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    times = []
    for ev in llm.stream(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True)):
        if isinstance(ev, list):
            break
        if int(ev[0]) == 0:
            times.append(time.perf_counter() - t0)
    return times


def count_ops(path: str, dtype: str, speculative: str, k: int, decode_rows: int, prefill_rows: int, prompt_len: int,
              steps: int = 6) -> dict[str, Any]:
    """The engine's aten op counts (TorchDispatchMode, untimed) for one decode step of ``decode_rows`` sequences
    (per layer and outside the layers: embedding, head, sampling, drafting, the loop) and for one prefill forward of
    ``prefill_rows`` prompts of ``prompt_len`` tokens, on the single-process engine with the same weights."""
    import torch

    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams
    from waferline.model.context import StepBatch
    from waferline.sim.calibrate.opcount import OpCounter

    kw: dict[str, Any] = {}
    if speculative != "none":
        kw = {"speculative": speculative, "num_speculative_tokens": k, "speculative_adaptive": False}
    llm = LLM(path, dtype=dtype, **kw)
    # (the counted runs stay within the context the timed run fitted in: a prompt up to it and 3 new tokens leave
    # room for 2 decode steps, not 6)
    steps = max(1, min(steps, llm.max_model_len - prompt_len - 1))
    model = llm.model
    idx = list(model.layer_range)
    counter = OpCounter()
    hooks = label_layers(model, counter)
    prompts = make_prompts(llm.spec.vocab_size, max(decode_rows, prefill_rows), prompt_len)

    def run(rows: int, max_tokens: int) -> tuple[dict[Any, dict[str, float]], dict[str, float]]:
        counter.counts, counter.work = {}, {}
        with counter:
            out = llm.generate(prompts[:rows], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return _merged(counter), out[0].metrics

    def diff(a: dict[str, float] | None, b: dict[str, float] | None, n: float) -> dict[str, float]:
        a, b = a or {}, b or {}
        return {k: (b.get(k, 0.0) - a.get(k, 0.0)) / n for k in set(a) | set(b)}

    run(decode_rows, steps + 1)  # warm-up, not counted: one-time work (weights laid out for oneDNN, absorbed MLA
    # weights, caches sized) happens in whichever run comes first and must not be subtracted from the decode step
    c1, _ = run(decode_rows, 1)
    c2, m2 = run(decode_rows, steps + 1)
    n_steps = m2.get("spec_verify_steps", steps) if speculative != "none" else steps
    n_steps = max(float(n_steps), 1.0)
    decode = {"layers": {i: diff(_both(c1, i), _both(c2, i), n_steps) for i in idx},
              "ffn": {i: diff(c1.get(f"f{i}"), c2.get(f"f{i}"), n_steps) for i in idx},
              "other": diff(c1.get(None), c2.get(None), n_steps), "verify_steps": n_steps}
    # prefill: one forward of prefill_rows x prompt_len tokens, as a pipeline stage runs a prefill micro-batch
    counter.counts, counter.work = {}, {}
    with torch.inference_mode(), counter:
        caches = model.new_caches(prefill_rows)
        toks = torch.tensor([p[:prompt_len] for p in prompts[:prefill_rows]])
        h = model(toks, caches, StepBatch.make(list(range(prefill_rows)), [0] * prefill_rows, prompt_len))
        model.logits(h[:, -1]).argmax(-1)
    c3 = _merged(counter)
    pre = {
        "layers": {i: _both(c3, i) for i in idx},
        "ffn": {i: c3.get(f"f{i}", {}) for i in idx},
        "other": c3.get(None, {}),
    }
    for h_ in hooks:
        h_.remove()
    return {"decode": decode, "prefill": pre, "decode_rows": decode_rows, "prefill_rows": prefill_rows,
            "tokens_per_row": (k + 1) if speculative != "none" else 1}


def label_layers(model: Any, counter: Any) -> list[Any]:
    """Label ``counter``'s ops (an OpCounter) by the layer that runs them (``i``; outside the layers: None) and a
    layer's FFN part apart (``f{i}``: what AFD's FFN ranks run, its router excepted: the attention ranks route their
    tokens, engine/afd/); the fused layer ops' parts as OpCounter.ffn_label says. Returns the hooks (``.remove()``)."""
    counter.ffn_label = lambda i: f"f{i}"
    hooks: list[Any] = []
    for i, layer in zip(model.layer_range, model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "label", i)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: setattr(counter, "label", None)))
        ffn = getattr(layer, "ffn", None)
        if ffn is None:
            continue
        hooks.append(ffn.register_forward_pre_hook(_label_only(lambda m, a, i=i: setattr(counter, "label", f"f{i}"))))
        hooks.append(ffn.register_forward_hook(_label_only(lambda m, a, o, i=i: setattr(counter, "label", i))))
        if callable(getattr(ffn, "route", None)):  # (an MoE block's router: the layer's part, as AFD runs it)
            hooks.append(_RouteAsLayer(ffn, counter, i))
    return hooks


class _RouteAsLayer:
    """An MoE block's ``route`` counted under its layer's label, not its FFN's; ``remove()`` undoes it."""

    def __init__(self, ffn: Any, counter: Any, i: int):
        self.ffn, route = ffn, ffn.route

        def routed(x: Any) -> Any:
            was, counter.label = counter.label, i
            try:
                return route(x)
            finally:
                counter.label = was

        ffn.route = routed

    def remove(self) -> None:
        self.ffn.__dict__.pop("route", None)


def _label_only(fn: Any) -> Any:
    """A hook that only labels: the engine still runs a layer as one op (model/decoder.py LABEL_ONLY)."""
    from waferline.model.decoder import LABEL_ONLY

    setattr(fn, LABEL_ONLY, True)
    return fn


def _both(c: dict[Any, dict[str, float]], i: int) -> dict[str, float]:
    """Layer ``i``'s whole work in counts labelled by ``_merged``: its FFN part (label f{i}) and the rest."""
    a, f = c.get(i, {}), c.get(f"f{i}", {})
    return {k: a.get(k, 0.0) + f.get(k, 0.0) for k in set(a) | set(f)}


def _merged(counter: Any) -> dict[Any, dict[str, float]]:
    """label -> {ops, matmul bytes/FLOPs by dtype, small/large bytes} from an OpCounter."""
    out: dict[Any, dict[str, float]] = {}
    for lab in set(counter.counts) | set(counter.work):
        d = dict(counter.work.get(lab, {}))
        d["ops"] = float(counter.counts.get(lab, 0))
        out[lab] = d
    return out


TTFT_REPEATS = 3  # short runs per Plan and pass that time only the first token, besides the timed repeats


def measure_point(path: str, point: dict[str, Any], plan_json: str | None, prompt_len: int, output_len: int,
                  repeats: int, decode_rows: int, prefill_rows: int, count: bool = True,
                  ttft_repeats: int = TTFT_REPEATS) -> dict[str, Any]:
    """Child process: run the engine for one grid point (best of ``repeats`` by per-user rate), then (``count``) count
    its ops and record row 0's token arrivals. TTFT is the best of the repeats and of ``ttft_repeats`` short runs of
    one token each (k + 2 for a speculative Plan: room for a full draft after the first token, as in the full run): a
    prefill takes 0.02-1 s and this machine runs it up to 1.5-2x slower now and then, so two samples
    per pass could both catch a slow phase. The warm-up
    generates for the whole batch first, so one-time work at the batch's shapes (oneDNN kernels made for the
    prefill's row count, weight layouts) is not timed."""
    import torch

    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams
    from waferline.sim.calibrate.common import process_cpu_seconds

    torch.set_num_threads(1)
    dtype = "bfloat16"
    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    with LLM(path, dtype=dtype, **_engine_kwargs(point, plan_json)) as llm:
        start_s = time.perf_counter() - t_start
        prompts = make_prompts(llm.spec.vocab_size, point["batch"], prompt_len)
        # warm-up at the timed shapes (no more tokens than the timed run: a prompt up to the context leaves no more)
        llm.generate(prompts, SamplingParams(max_tokens=min(4, output_len), ignore_eos=True))
        pipe = getattr(llm, "_pipeline", None)
        pids = [os.getpid()] + list(getattr(pipe, "pids", []) or [])
        best = None
        ttfts = []
        for _ in range(repeats):
            c0 = [process_cpu_seconds(p) for p in pids]
            r = _timed_run(llm, prompts, output_len)
            r["cpu_s_per_process"] = [process_cpu_seconds(p) - c for p, c in zip(pids, c0)]
            ttfts.append(r["ttft_s"])
            if best is None or r["tokens_per_s_per_user"] > best["tokens_per_s_per_user"]:
                best = r
        # (a speculative run: room for a full draft after the first token, as in the full run)
        short = min(output_len, 1 if point["speculative"] == "none" else point["k"] + 2)
        for _ in range(ttft_repeats):
            ttfts.append(_timed_run(llm, prompts, short)["ttft_s"])
        if count:
            best["arrivals_row0"] = _arrivals(llm, prompts, output_len)
    assert best is not None
    best["ttft_s_runs"], best["ttft_s"] = ttfts, min(ttfts)
    best["load_average_1m"] = [load0, os.getloadavg()[0]]
    best["start_s"] = start_s
    if not count:
        return best
    # speculative runs: counted over as many tokens as the timed run, so the mix of drafted and undrafted (n-gram
    # without a match) verify steps, and the drafts' lengths, are the ones that were timed
    best["ops"] = count_ops(path, dtype, point["speculative"], point["k"], decode_rows, prefill_rows, prompt_len,
                            steps=max(6, output_len - 1) if point["speculative"] != "none" else 6)
    return best
