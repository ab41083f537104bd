"""KV-cache schemes on one backbone: GQA, MLA, DSA, V4-style (csa / hca interleaved) and a Mamba-2 hybrid (3 mamba2 :
1 mla), each a random-init ``sol`` model with the same hidden size, layers, heads, FFN and vocabulary (only the mixer
differs). Per variant: cache bytes per token measured from the engine's caches beside the ModelSpec's accounting,
and batch-1 greedy decode tokens/s at each context on this CPU beside the simulator's prediction for the same config
(with ``--host``: the twin's path, sim.pipeline.simulate on a `waferline calibrate` host YAML, in tokens/s; without
it, the prediction for ``--hardware`` as a ratio to GQA next to the measured ratio).

How the cache is filled: the first ``--real-prefill`` tokens of the context (all of it when the context is shorter)
are prefilled by the engine in ``--chunk``-token chunks; the rest of the context is filled by repeating those cached
rows (token caches: latents, keys, values, index keys; V4 caches: compressed entries and index keys) up to the
context, which gives every cache exactly the size a real prefill of the context would (the same bytes held and read
per decode step) without prefilling 64k tokens on a 2-core CPU. The values repeat, so what the repeated part says
is not what a real prompt would put there (DSA's and CSA's choices among repeated rows are ties; their cost is the
same); Mamba-2 layers hold a fixed state whatever the context.

    python benchmarks/kv_schemes.py                                     # ~5 min: 1k / 4k / 16k / 64k
    python benchmarks/kv_schemes.py --host benchmarks/results/twin_host.yaml --contexts 1024,4096
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from waferline.model.attention import TokenCache
from waferline.model.context import StepBatch
from waferline.model.init import write_random_checkpoint
from waferline.model.load import load_model
from waferline.model.sparse_attention import DSACache
from waferline.model.ssm import Mamba2Cache
from waferline.model.v4_attention import V4Cache
from waferline.spec.configs import parse_hf_config
from waferline.spec.model import ModelSpec

LAYERS = 4
BACKBONE = dict(
    model_type="sol", vocab_size=4096, hidden_size=256, num_hidden_layers=LAYERS, num_attention_heads=4, head_dim=64,
    intermediate_size=768, ffn_types=["dense"] * LAYERS, max_position_embeddings=131072, rope_theta=10000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    # the mixers' own fields (each variant reads only its mixers')
    num_key_value_heads=2,  # GQA: 4 query heads over 2 KV heads of 64
    q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,  # MLA latent 128 + 32
    index_n_heads=4, index_head_dim=64, index_topk=512, index_bits=8,  # DSA / CSA indexer: fp8 keys + scale
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}, o_groups=2,
    o_lora_rank=64,  # V4: one shared K=V head of 64, grouped output projection
    mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=64,
)
VARIANTS = {
    "GQA": dict(mixer_types=["gqa"] * LAYERS),
    "MLA": dict(mixer_types=["mla"] * LAYERS),
    "DSA": dict(mixer_types=["dsa"] * LAYERS),
    "V4 (hca/csa)": dict(mixer_types=["hca", "csa", "hca", "csa"], sliding_window=128),
    "Mamba-2 hybrid": dict(mixer_types=["mamba2", "mamba2", "mamba2", "mla"]),
}
ALIGN = 128  # contexts and real prefills are multiples of the largest compression ratio: no window left open


def config(variant: str) -> dict[str, Any]:
    return dict(BACKBONE, **VARIANTS[variant])


def held_bytes(cache: Any, slot: int, length: int) -> int:
    """Bytes one slot of a layer's cache holds for a sequence of ``length`` tokens (token caches: the rows up to the
    length, not their grown capacity)."""
    if isinstance(cache, V4Cache):
        return cache.bytes_held(slot)
    if isinstance(cache, DSACache):
        return sum(held_bytes(p, slot, length) for p in cache.parts())
    if isinstance(cache, TokenCache):
        rows = min(length, cache.window) if cache.window is not None else length
        return rows * cache.data.shape[2] * cache.data.element_size()
    if isinstance(cache, Mamba2Cache):
        return cache.nbytes() // cache.num_slots
    raise TypeError(f"no byte count for {type(cache).__name__}")


def _repeat_rows(t: torch.Tensor, have: int, want: int) -> torch.Tensor:
    """Rows [0, have) of t repeated to ``want`` rows (the first dimension)."""
    reps = -(-want // have)
    return t[:have].repeat(reps, *([1] * (t.dim() - 1)))[:want]


def extend(cache: Any, slot: int, have: int, want: int, room: int) -> None:
    """Fill a layer's cache of a sequence of ``have`` prefilled tokens up to ``want`` tokens by repeating what it
    holds (token caches grown to ``room`` rows first, as a real prefill to ``want`` plus decoding would)."""
    if isinstance(cache, DSACache):
        for p in cache.parts():
            extend(p, slot, have, want, room)
    elif isinstance(cache, TokenCache) and cache.paged:  # (written as a step would: through its block table)
        cache.write(slot, have, _repeat_rows(cache.read(slot, have), have, want)[have:])
    elif isinstance(cache, TokenCache) and cache.window is None:
        if cache.capacity < room:
            cache._grow(room)
        cache.data[slot, have:want] = _repeat_rows(cache.data[slot], have, want)[have:]
    elif isinstance(cache, V4Cache):
        for series, ratio in ((cache.kv[slot], cache.attn.compressor), (cache.index[slot], cache.attn.indexer)):
            if series is None:
                continue
            n = want // ratio.ratio
            e = series.entries.shape[0]
            series.entries = _repeat_rows(series.entries, e, n)
            if series.scales is not None:
                series.scales = _repeat_rows(series.scales, e, n)
    elif not isinstance(cache, Mamba2Cache):
        raise TypeError(f"cannot fill {type(cache).__name__}")


def fill(model: Any, context: int, real: int, chunk: int, steps: int) -> tuple[list[Any], float]:
    """Caches of one sequence (slot 0) holding ``context`` tokens: ``real`` of them prefilled, the rest repeated;
    returns the caches and the prefill's seconds."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, model.spec.vocab_size, (1, real), generator=g)
    caches = model.new_caches(1)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, real, chunk):
            n = min(chunk, real - s)
            model(ids[:, s: s + n], caches, StepBatch.make([0], [s], n))
    took = time.perf_counter() - t0
    if context > real:
        for c in caches:
            extend(c, 0, real, context, context + steps + 1)
    return caches, took


def decode(model: Any, caches: list[Any], context: int, warmup: int, steps: int, repeats: int) -> float:
    """Greedy batch-1 decode from position ``context``: tokens/s of the fastest of ``repeats`` runs of ``steps``
    steps, after ``warmup`` untimed ones (this machine's speed moves with what else runs on its cores)."""
    tok, pos, best = torch.tensor([[5]]), context, 0.0
    with torch.inference_mode():
        for run in range(repeats + 1):
            t0 = time.perf_counter()
            for _ in range(steps if run else warmup):
                _, _, tok = model.step_logits(tok, caches, StepBatch.make([0], [pos], 1), argmax=True)
                pos += 1
            if run:
                best = max(best, steps / (time.perf_counter() - t0))
    return best


def predict(spec: ModelSpec, context: int, steps: int, host: str | None, hardware: str) -> float:
    """The simulator's decode tokens/s for batch 1 at ``context`` (16-bit weights and cache): on the calibrated host
    (the twin's path) or on ``hardware``."""
    from waferline.plan.place import place
    from waferline.sim.pipeline import simulate

    if host:
        from waferline.sim.host import HostParams
        from waferline.spec.hardware import load_hardware_file

        hw = load_hardware_file(host)
        plan = place(spec, hw, devices=1, weight_bits=16, context=context + steps, batch=1)
        r = simulate(plan, prompt_len=context, output_len=steps, concurrency=1, spec=spec, hardware=hw,
                     host=HostParams.load(host))
    else:
        plan = place(spec, hardware, devices=1, weight_bits=16, context=context + steps, batch=1)
        r = simulate(plan, prompt_len=context, output_len=steps, concurrency=1, spec=spec)
    return r.decode_tokens_per_s_per_user


def bench_variant(name: str, a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    cfg = config(name)
    spec = parse_hf_config(dict(cfg))
    model = load_model(write_random_checkpoint(cfg, workdir / name.split()[0].lower(), seed=0), a.dtype)
    kv_bits = torch.finfo(a.dtype).bits
    # bytes per token: growth of what the engine holds between two real prefills (whole compression windows apart)
    lo, hi = ALIGN * 2, ALIGN * 4
    held = {}
    for n in (lo, hi):
        caches, _ = fill(model, n, n, a.chunk, 0)
        held[n] = sum(held_bytes(c, 0, n) for c in caches)
    row: dict[str, Any] = {
        "variant": name, "mixers": cfg["mixer_types"], "params": spec.params_total(),
        "engine_bytes_per_token": (held[hi] - held[lo]) / (hi - lo),
        "spec_bytes_per_token": spec.cache_bytes_per_token(kv_bits), "contexts": [],
    }
    for ctx in a.contexts:
        real = min(ctx, a.real_prefill)
        caches, prefill_s = fill(model, ctx, real, a.chunk, a.warmup + a.steps * a.repeats)
        at = {"context": ctx, "real_prefill": real, "prefill_s": round(prefill_s, 2),
              "engine_bytes_per_seq": sum(held_bytes(c, 0, ctx) for c in caches),
              "spec_bytes_per_seq": spec.cache_bytes_per_seq(ctx, kv_bits, kv_bits),
              "spec_read_bytes_per_token": spec.cache_read_bytes_per_seq(ctx, kv_bits),
              "decode_tok_s": round(decode(model, caches, ctx, a.warmup, a.steps, a.repeats), 2),
              "predicted_tok_s": round(predict(spec, ctx, a.steps, a.host, a.hardware), 2)}
        del caches
        row["contexts"].append(at)
        print(f"  {name} @ {ctx}: {at['decode_tok_s']} tok/s (prefill {real} tokens in {prefill_s:.1f} s)",
              file=sys.stderr)
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each context's measured and predicted tokens/s as ratios to GQA's at the same context (where GQA ran)."""
    gqa = next((r for r in rows if r["variant"] == "GQA"), None)
    base = {c["context"]: c for c in gqa["contexts"]} if gqa else {}
    for r in rows:
        for c in r["contexts"]:
            b = base.get(c["context"])
            if b:
                c["measured_vs_gqa"] = round(c["decode_tok_s"] / b["decode_tok_s"], 3)
                c["predicted_vs_gqa"] = round(c["predicted_tok_s"] / b["predicted_tok_s"], 3)


def print_tables(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=170)
    t = Table(title=f"KV-cache schemes — cache bytes per token ({res['dtype']}, {LAYERS} layers)")
    for col in ("variant", "mixers", "engine B/token", "ModelSpec B/token", "vs GQA"):
        t.add_column(col, justify="left" if col in ("variant", "mixers") else "right")
    g = next((r["spec_bytes_per_token"] for r in res["rows"] if r["variant"] == "GQA"), float("nan"))
    for r in res["rows"]:
        t.add_row(r["variant"], " ".join(r["mixers"]), f"{r['engine_bytes_per_token']:.1f}",
                  f"{r['spec_bytes_per_token']:.1f}", f"{r['spec_bytes_per_token'] / g:.3f}")
    con.print(t)
    pred = "predicted tok/s (twin)" if res["host"] else f"predicted vs GQA ({res['hardware']})"
    load = res["machine"]
    t = Table(title=f"decode tok/s, batch 1, greedy, {res['threads']} thread(s), best of {res['repeats']} x "
                    f"{res['steps']} steps; cache: first {res['real_prefill']} tokens prefilled in "
                    f"{res['chunk']}-token chunks, the rest repeated rows; load avg "
                    f"{load['loadavg_start'][0]:.2f} → {load['loadavg_end'][0]:.2f}")
    for col in ("variant", "context", "engine KB/seq", "ModelSpec KB/seq", "read KB/token", "measured tok/s",
                "measured vs GQA", pred, "predicted vs GQA" if res["host"] else ""):
        if col:
            t.add_column(col, justify="left" if col == "variant" else "right")
    for r in res["rows"]:
        for c in r["contexts"]:
            cells = [r["variant"], str(c["context"]), f"{c['engine_bytes_per_seq'] / 1e3:.1f}",
                     f"{c['spec_bytes_per_seq'] / 1e3:.1f}", f"{c['spec_read_bytes_per_token'] / 1e3:.1f}",
                     f"{c['decode_tok_s']:.1f}", f"{c.get('measured_vs_gqa', float('nan')):.2f}"]
            if res["host"]:
                cells += [f"{c['predicted_tok_s']:.1f}", f"{c.get('predicted_vs_gqa', float('nan')):.2f}"]
            else:
                cells.append(f"{c.get('predicted_vs_gqa', float('nan')):.2f}")
            t.add_row(*cells)
    con.print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096,16384,65536",
                    help="comma-separated, multiples of 128 from 256")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--real-prefill", type=int, default=1024,
                    help="tokens of each context prefilled by the engine (a multiple of 128); the rest is repeated")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per context")
    ap.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of --steps per context; the fastest counts")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the twin's calibration: one per process)")
    ap.add_argument("--host", help="a `waferline calibrate` host YAML: predict tokens/s as the twin does")
    ap.add_argument("--hardware", default="h100-sxm", help="without --host: the hardware of the relative prediction")
    ap.add_argument("--json", default="benchmarks/results/kv_schemes.json")
    a = ap.parse_args()
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(a.json, "--json")
    except ConfigError as e:
        ap.error(str(e))
    try:
        a.contexts = [int(x) for x in a.contexts.split(",")]
    except ValueError:
        ap.error(f"--contexts {a.contexts}: expected comma-separated integers")
    names = [v.strip() for v in a.variants.split(",")]
    if any(c % ALIGN or c < 2 * ALIGN for c in a.contexts) or a.real_prefill % ALIGN or a.real_prefill < ALIGN:
        ap.error(f"contexts (>= {2 * ALIGN}) and --real-prefill must be multiples of {ALIGN}")
    if unknown := [v for v in names if v not in VARIANTS]:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    try:  # (before the run too: the first prediction comes after the first measurement)
        if a.host:
            from waferline.sim.host import HostParams
            from waferline.spec.hardware import load_hardware_file

            load_hardware_file(a.host)
            HostParams.load(a.host)
        else:
            from waferline.spec.catalog import load_hardware

            load_hardware(a.hardware)
    except ConfigError as e:
        ap.error(f"--host {a.host}: {e}" if a.host else f"--hardware {a.hardware}: {e}")
    a.dtype = getattr(torch, a.dtype)
    torch.set_num_threads(a.threads)
    t0, load0 = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench_variant(v, a, Path(tmp)) for v in names]
    add_ratios(rows)
    from waferline.sim.twin import cpu_model

    res = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpu": cpu_model() or platform.processor(),
                    "cpus": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load0],
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "dtype": str(a.dtype).removeprefix("torch."), "threads": a.threads, "real_prefill": a.real_prefill,
        "chunk": a.chunk, "steps": a.steps, "warmup": a.warmup, "repeats": a.repeats, "host": a.host,
        "hardware": a.hardware,
        "backbone": {k: v for k, v in BACKBONE.items() if k != "ffn_types"},
        "cache_fill": (f"the first min(context, {a.real_prefill}) tokens prefilled by the engine in {a.chunk}-token "
                       "chunks; the rest of the context filled by repeating the cached rows (token caches) and "
                       "compressed entries (V4 caches): exact sizes, repeated values"),
        "seconds": round(time.time() - t0, 1), "rows": rows,
    }
    print_tables(res)
    write_text_atomic(a.json, json.dumps(res, indent=2) + "\n", make_parents=True)
    print(f"wrote {a.json} ({res['seconds']} s)")


if __name__ == "__main__":
    main()
