"""Decode speed, side by side in one run: transformers `generate` (bf16), waferline (fp32 / bf16 / int4) and
llama.cpp through `llama-cpp-python` (GGUF f16 and Q4_0), at batch 1 and 8, beside the memory-bandwidth roofline.

The checkpoints are built here with fixed seeds (transformers config classes + `save_pretrained`, random weights)
and cached under benchmarks/.cache/:

  dsv3      DeepSeek-V3-type MoE with MLA, ~135M parameters: hidden 512, 8 layers (the first dense, FFN 1536),
            q_lora 256 / kv_lora 128, nope 64 + rope 32, v 64, 8 heads, 16 routed experts of FFN 512, top-2,
            1 shared expert, vocab 32000
  qwen3moe  Qwen3-MoE of similar size: hidden 512, 8 layers, 8 heads (4 KV, head 64, q/k norm), 16 experts of
            FFN 512, top-2, vocab 32000 (~140M)
  llama     Llama, hidden 768, 12 layers, 12 heads (4 KV), FFN 2048, vocab 32000 (~125M)

plus a tokenizer the GGUF converter accepts: a byte-level BPE (GPT-2 pre-tokenizer) of 32000 tokens built
deterministically with the `tokenizers` library (see decode_speed_models.build_tokenizer). Every engine is fed the
same token ids, so the tokenizer only has to exist; the converter cannot know its pre-tokenizer hash, so it is told
"gpt-2" (which is what the tokenizer uses) — the only change made to the converter's behaviour, done at run time.

The GGUF files are converted from the same checkpoints with `convert_hf_to_gguf.py` from the llama-cpp-python
sdist (vendor/llama.cpp, run with its own vendored gguf-py) at f16, then quantized to Q4_0 with
`llama_cpp.llama_model_quantize`. The converter is looked up in --llama-cpp-src, $LLAMA_CPP_SRC, or extracted
from the sdist (--llama-cpp-sdist, or `pip download llama-cpp-python==<installed> --no-binary :all:`).
Before timing, every engine is checked against transformers fp32 on the same checkpoint: teacher-forced top-1
agreement and KL over prompt + 16 reference tokens, and its free-running greedy tokens. For llama.cpp f16 this is
the conversion check: OK when it agrees as well as transformers' own bf16 run (or on >= 95% of positions).
The DeepSeek-V3 config also carries the hub's `scoring_func: sigmoid`: transformers 5 does not save it, and
without it the converter writes no gating function and llama.cpp routes by softmax (found by this check).
The rooflines use the better of two bandwidth measurements (start and end of the run).

Timing, the same for every engine: greedy, random prompt token ids (fixed seed) of --prompt-len tokens,
--new-tokens generated per sequence (EOS ignored). TTFT = start of the request until the first generated token
of every sequence exists (the prefill). Decode tok/s = tokens generated after the first one, over all sequences,
divided by the time after TTFT (aggregate; per user = / batch). Each measurement is repeated (--repeats,
interleaved across engines and batch sizes: each repeat runs every batch size of every engine in turn, so a batch-8
row and the batch-1 row it is compared with come from the same minutes) and the best is kept: the machine may be
shared.

Roofline (tok/s) = batch x measured copy bandwidth / bytes one decode step reads: the active weights (ModelSpec
accounting, embeddings excluded; of each MoE layer's experts the expected number a step of `batch` tokens touches
under uniform routing, E(1-(1-k/E)^B)) plus the KV cache of every sequence at the mean context. Random weights give
near-uniform expert routing; trained models route less evenly, so at batch 8 fewer experts may be touched. The copy
bandwidth is the better of 4 KiB and transparent huge pages (waferline keeps its weights in huge pages). The read
roofline puts the same bytes over the read bandwidth (a torch amax over 256 MiB in huge pages: a decode step only reads
its weights, and this machine reads faster than it copies); a target that is not met and needs more than that is
flagged "not reachable here". Waferline's rows also get a compute ceiling: the tok/s at which a step's multiply-adds
(ModelSpec FLOPs / 2 at the mean context) run at the speed of waferline's own product of that format and row count
with its weight in cache (product_rate: a ceiling of these kernels on this machine, not of the CPU); a target above
it is flagged "not with these kernels here". A batch-8 target not met that needs batch 8 to run at a larger share of
its read roofline than batch 1 ran at of its own says so, with the ratio of the two steps' bytes (a MoE's batch-8 step
reads the experts its 8 rows touch, so 4x batch 1 may need batch 8 to be the more efficient of the two).

    python benchmarks/decode_speed.py                      # everything (batch 1 alone: 23 min at load average 6-7)
    python benchmarks/decode_speed.py --quick              # tiny models, a few tokens: a smoke test
    python benchmarks/decode_speed.py --models dsv3 --engines hf,waferline,llamacpp --batch 1
    python benchmarks/decode_speed.py --device cuda        # on a CUDA GPU

On a GPU (--device cuda) the run is the same but for: the checkpoints are llama-gpu (~0.85B parameters) and
dsv3-gpu (~2B, ~0.5B active), large enough that a decode step streams its weights from HBM rather than from the
GPU's L2 cache; the engines are transformers bf16 and waferline bf16, bf16 without CUDA graphs (wl_bf16_eager: what
they buy) and int4 (torch's tinygemm int4 kernel, a 16-bit LM head); the rooflines are over the GPU's measured copy and
read bandwidths (a torch copy and an amax over 1 GiB on
the device); and each waferline row at batch 1 has one more target: >= 60% of that copy roofline. waferline's GPU
path runs PyTorch's ops, greedy decode as a CUDA graph of the step where the model allows one (engine/graphs.py; the
capture counted in TTFT); not yet run on a GPU: what it reaches is what this run measures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from waferline.sim.twin import cpu_model
from waferline.spec.configs import spec_from_pretrained

# the helper modules beside this script (checkpoints, engines, rooflines), also when it is loaded by path (the tests)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_speed_engines import HFEngine, LlamaCppEngine, Run, WaferlineEngine  # noqa: E402
from decode_speed_models import (  # noqa: E402
    CACHE,
    MODELS,
    REPO,
    ROOT,
    _llama_cpp,
    build_checkpoint,
    build_gguf,
    find_converter,
    llama_cpp_version,
)
from decode_speed_roofline import (  # noqa: E402
    RATE_FORMATS,
    compute_ceiling,
    copy_bandwidth,
    device_bandwidths,
    product_rate,
    product_rates,
    read_bandwidth,
    step_bytes,
    step_macs_per_token,
)

__all__ = ["compute_ceiling", "device_bandwidths", "product_rate", "targets"]  # what tests/test_decode_speed.py uses

# ----------------------------------------------------------------------------- the run


@dataclass
class Result:
    model: str
    engine: str
    batch: int
    best: Run | None = None
    runs: list[float] = field(default_factory=list)
    na: str | None = None
    roofline_tok_s: float | None = None
    step_MB: float | None = None
    macs_per_token: float | None = None
    head_macs: float | None = None
    first_tokens: list[int] | None = None
    quality: dict | None = None


def prompts_for(vocab: int, batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def reference(hf_dir: Path, prompt: list[int], n: int, device: str = "cpu") -> dict[str, Any]:
    """transformers fp32 on the checkpoint: its greedy continuation of ``prompt`` and its logits over prompt +
    continuation, the yardstick every engine's numerics are compared against."""
    ref = HFEngine(hf_dir, torch.float32, device)
    toks = ref.run([prompt], n).tokens[0]
    seq = prompt + toks
    logp = ref.logits(seq).log_softmax(-1)
    del ref
    gc.collect()
    return {"greedy": toks, "seq": seq, "logp": logp}


def agreement(ref: dict[str, Any], engine: Any) -> dict[str, Any]:
    """Teacher-forced on the reference sequence: per position top-1 agreement and KL(ref || engine); plus how many
    of the free-running greedy tokens equal the reference's before the first difference. Random weights make
    near-ties (in the logits and in the expert routing) common, so one flipped token is not by itself a bug; a
    wrong conversion shows as low agreement at most positions."""
    logp = engine.logits(ref["seq"]).float().log_softmax(-1)
    r = ref["logp"]
    top1 = (logp.argmax(-1) == r.argmax(-1)).float().mean().item()
    kl = (r.exp() * (r - logp)).sum(-1)
    greedy = engine.run([ref["seq"][: len(ref["seq"]) - len(ref["greedy"])]], len(ref["greedy"])).tokens[0]
    same = next((i for i, (a, b) in enumerate(zip(ref["greedy"], greedy)) if a != b), len(ref["greedy"]))
    return {"top1_agree": round(top1, 4), "kl_mean": round(kl.mean().item(), 5), "kl_max": round(kl.max().item(), 4),
            "positions": len(ref["seq"]), "greedy_same_prefix": same, "greedy_of": len(ref["greedy"])}


ENGINE_GROUPS = {"hf": ["hf"], "transformers": ["hf"], "waferline": ["wl_fp32", "wl_bf16", "wl_int4"],
                 "llamacpp": ["lcpp_f16", "lcpp_q4_0"], "wl_fp32": ["wl_fp32"], "wl_bf16": ["wl_bf16"],
                 "wl_int4": ["wl_int4"], "lcpp_f16": ["lcpp_f16"], "lcpp_q4_0": ["lcpp_q4_0"], "sol": ["sol"],
                 "wl_bf16_eager": ["wl_bf16_eager"]}
LABELS = {"hf": "transformers bf16", "wl_fp32": "waferline fp32", "wl_bf16": "waferline bf16",
          "wl_int4": "waferline int4", "lcpp_f16": "llama.cpp f16", "lcpp_q4_0": "llama.cpp Q4_0",
          "wl_bf16_eager": "waferline bf16 eager"}  # (on a GPU: no CUDA graph, what the graphs buy in the same run)
BITS = {"hf": (16, 128, 16), "wl_fp32": (32, 128, 32), "wl_bf16": (16, 128, 16), "wl_int4": (4, 128, 16),
        "wl_bf16_eager": (16, 128, 16),
        "lcpp_f16": (16, 128, 16), "lcpp_q4_0": (4, 32, 16)}
# the LM head's bits where they differ from the embedding's: llama.cpp's Q4_0 files keep output.weight at Q6_K
# (6.5625 bits; read from the GGUFs this script makes), waferline int4 runs its int8 head (LLM(head_bits=8))
HEAD_BITS = {"wl_int4": 8, "lcpp_q4_0": 6.5625}
ENGINE_KEYS = {v: k for k, v in LABELS.items()}


def bench_model(name: str, engines: list[str], batches: list[int], a: argparse.Namespace, bw: float,
                converter: Path | str) -> tuple[list[Result], list[dict], dict]:

    d = build_checkpoint(name, a.quick, Path(a.cache))
    hf_dir = d / "hf"
    spec = spec_from_pretrained(hf_dir)
    info = {
        "model": name,
        "model_type": spec.hf_config.get("model_type"),
        "params_M": round(spec.params_total() / 1e6, 1),
        "active_params_M": round(spec.params_active() / 1e6, 1),
        "checkpoint": str(hf_dir.relative_to(REPO)) if hf_dir.is_relative_to(REPO) else str(hf_dir),
    }
    B = max(batches)
    prompts = prompts_for(spec.vocab_size, B, a.prompt_len)
    ctx = a.prompt_len + a.new_tokens
    loaded: dict[str, Any] = {}
    na: dict[str, str] = {}
    checks: list[dict] = []
    quality: dict[str, dict] = {}
    ref = reference(hf_dir, prompts[0], a.check_tokens, a.device) if a.check_tokens else None
    ggufs: dict[str, Path] = {}
    if any(e.startswith("lcpp") for e in engines):
        try:
            if isinstance(converter, str):
                raise RuntimeError(converter)
            ggufs = build_gguf(d, converter, a.threads)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            for e_ in engines:
                if e_.startswith("lcpp"):
                    na[e_] = str(e)
    for e in engines:
        if e in na:
            continue
        t = time.perf_counter()
        try:
            if e == "hf":
                loaded[e] = HFEngine(hf_dir, device=a.device)
                info["transformers_attn_implementation"] = loaded[e].attn_implementation
            elif e.startswith("wl_"):
                kw = {} if a.device == "cpu" else {"device": a.device}
                if e.endswith("_eager"):  # (no CUDA graphs: what they buy, in the same run)
                    kw["cuda_graphs"] = False
                loaded[e] = WaferlineEngine(hf_dir, e[3:].removesuffix("_eager"), **kw)
            else:
                q = e[5:]
                loaded[e] = LlamaCppEngine(ggufs[q], q, a.threads, B, max(ctx, a.prompt_len + a.check_tokens) + 16)
        except Exception as ex:  # noqa: BLE001
            na[e] = f"{type(ex).__name__}: {ex}"
            print(f"  {name} {e}: n/a ({na[e]})", flush=True)
            continue
        msg = f"  loaded {name} {LABELS[e]} in {time.perf_counter() - t:.1f}s"
        if ref is not None:
            try:
                quality[e] = c = agreement(ref, loaded[e])
            except Exception as ex:  # noqa: BLE001
                na[e] = f"{type(ex).__name__}: {ex}"
                print(f"  {name} {e}: n/a ({na[e]})", flush=True)
                del loaded[e]
                continue
            msg += (f"; vs transformers fp32: top-1 {100 * c['top1_agree']:.0f}% of {c['positions']} positions, "
                    f"KL {c['kl_mean']:.4f}, greedy {c['greedy_same_prefix']}/{c['greedy_of']} tokens equal")
            if e == "lcpp_f16":
                # the yardstick: transformers' own bf16 run of the same checkpoint (random weights make routing and
                # logits near-ties common, so 16-bit rounding alone moves some tokens); a wrong conversion (e.g. the
                # wrong routing function) is far worse than that at most positions
                own = quality.get("hf", {}).get("kl_mean")
                ok = c["top1_agree"] >= 0.95 or (own is not None and c["kl_mean"] <= own)
                checks.append(dict(c, engine=LABELS[e], conversion_ok=ok, transformers_bf16_kl_mean=own))
                msg += f" -> conversion {'OK' if ok else 'SUSPECT'}"
        print(msg, flush=True)
    results: list[Result] = []
    cells = {batch: {e: Result(name, LABELS[e], batch, na=na.get(e)) for e in engines} for batch in batches}
    live = {batch: dict(loaded) for batch in batches}
    # a warm-up (allocations, lazy init), then repeats, best of; each repeat runs every batch size and engine in turn,
    # so that a batch-8 row and the batch-1 row it is compared with are measured minutes apart at most, not a whole
    # sweep of engines apart (this machine's speed drifts by 20-50% over minutes)
    for rep in range(1 + a.repeats):
        for batch in batches:
            rows, ps = cells[batch], prompts[:batch]
            for e, eng in list(live[batch].items()):
                try:
                    r = eng.run(ps, a.new_tokens if rep else min(4, a.new_tokens))
                except Exception as ex:  # noqa: BLE001 - one engine failing must not end the run
                    rows[e].na = f"{type(ex).__name__}: {ex}"
                    print(f"  {name} b={batch} {LABELS[e]}: failed ({rows[e].na})", flush=True)
                    del live[batch][e]
                    continue
                if not rep:
                    continue
                rows[e].runs.append(round(r.decode_tok_s, 2))
                best = rows[e].best
                if best is None or r.decode_tok_s > best.decode_tok_s:
                    rows[e].best = Run(min(r.ttft_s, best.ttft_s) if best else r.ttft_s, r.decode_s, r.tokens)
                elif r.ttft_s < best.ttft_s:
                    best.ttft_s = r.ttft_s
        print(
            f"  {name}: {'warm-up' if not rep else f'repeat {rep}/{a.repeats}'} of batch "
            f"{', '.join(map(str, batches))} "
            f"done",
            flush=True,
        )
        if not rep and a.device != "cpu":  # whether waferline's greedy decode ran as CUDA graphs (engine/graphs.py)
            for e, eng in loaded.items():
                if isinstance(eng, WaferlineEngine):
                    g = "off" if not eng.llm.cuda_graphs else (eng.llm.graph_note or "captured")
                    info.setdefault("cuda_graphs", {})[LABELS[e]] = g
                    print(f"  {name} {LABELS[e]}: CUDA graphs {g}", flush=True)
    for batch in batches:
        rows = cells[batch]
        for e in engines:
            bits, group, kv_bits = BITS[e]
            head = HEAD_BITS.get(e) if a.device == "cpu" else None  # (on a GPU waferline int4 keeps a 16-bit head)
            sb = step_bytes(spec, bits, group, kv_bits, batch, a.prompt_len + a.new_tokens // 2, head)
            rows[e].roofline_tok_s = batch * bw / sb
            rows[e].step_MB = sb / 1e6
            rows[e].macs_per_token = step_macs_per_token(spec, a.prompt_len + a.new_tokens // 2)
            rows[e].head_macs = float(spec.lm_head_params())
            if rows[e].na:
                rows[e].best = None
            if rows[e].best is not None:
                rows[e].first_tokens = rows[e].best.tokens[0][:8]
            rows[e].quality = quality.get(e)
            r = rows[e]
            print(f"  {name:>8} b={batch} {LABELS[e]:<18} " + (
                f"decode {r.best.decode_tok_s:8.1f} tok/s  TTFT {1e3 * r.best.ttft_s:7.1f} ms  "
                f"(roofline {r.roofline_tok_s:7.0f})" if r.best else f"n/a: {r.na}"), flush=True)
            results.append(r)
    for eng in loaded.values():
        if isinstance(eng, LlamaCppEngine):
            eng.close()
    loaded.clear()
    gc.collect()
    return results, checks, info


def bench_sol(a: argparse.Namespace) -> list[dict]:
    """sol-mini, waferline int4 (bf16 compute, int8 LM head), batch 1: speculation (MTP / n-gram, k=3) against none, on
    a
    held-out Shakespeare prompt (speculation depends on the text; random ids would be meaningless)."""
    path = REPO / "models" / "sol-mini"
    if not (path / "config.json").is_file():
        return [{"variant": "sol-mini", "na": f"{path} not found"}]
    from waferline import LLM

    text = (path / "heldout.txt").read_text() if (path / "heldout.txt").is_file() else "To be, or not to be: " * 40
    rows, engines = [], {}
    for variant, kw in (("int4", {}), ("int4 + MTP k=3", dict(speculative="mtp", num_speculative_tokens=3)),
                        ("int4 + n-gram k=3", dict(speculative="ngram", num_speculative_tokens=3))):
        try:
            llm = LLM(str(path), dtype="bfloat16", weight_bits=4, head_bits=8, **kw)  # as the int4 rows above run
            eng = WaferlineEngine.__new__(WaferlineEngine)
            eng.llm, eng.name = llm, f"sol-mini {variant}"
            engines[variant] = eng
        except Exception as ex:  # noqa: BLE001
            rows.append({"variant": variant, "na": f"{type(ex).__name__}: {ex}"})
    if not engines:
        return rows
    prompt = next(iter(engines.values())).llm.encode(text)[: a.prompt_len]
    best: dict[str, Run] = {}
    for eng in engines.values():
        eng.run([prompt], min(4, a.new_tokens))
    for _ in range(a.repeats):
        for variant, eng in engines.items():
            r = eng.run([prompt], a.new_tokens)
            if variant not in best or r.decode_tok_s > best[variant].decode_tok_s:
                best[variant] = r
    base = best.get("int4")
    for variant, r in best.items():
        same = base is not None and r.tokens == base.tokens
        rows.append({"variant": variant, "batch": 1, "decode_tok_s": round(r.decode_tok_s, 1),
                     "ttft_ms": round(1e3 * r.ttft_s, 1), "same_tokens_as_int4": same,
                     "target_750": r.decode_tok_s >= 750})
        print(f"  sol-mini {variant:<18} decode {r.decode_tok_s:8.1f} tok/s per user  TTFT {1e3 * r.ttft_s:6.1f} ms"
              f"{'' if same else '  (tokens differ from plain int4)'}", flush=True)
    return rows


def targets(rows: list[dict], sol: list[dict], hbm: bool = False) -> list[dict]:
    """The decode-speed targets (README "Decode speed") on this run's rows; ``hbm``: a GPU run, whose waferline rows
    at batch 1 must also reach 60% of the roofline over the GPU's measured copy bandwidth (``roofline_tok_s``)."""
    def get(model: str, engine: str, batch: int, key: str = "decode_tok_s") -> float | None:
        return next((r[key] for r in rows if r["model"] == model and r["engine"] == engine
                     and r["batch"] == batch and r.get("decode_tok_s") and r.get(key)), None)

    def ceiling(t: dict, need: float, model: str, engine: str, batch: int) -> dict:
        """A target not met whose rate is above the engine's read-bandwidth roofline says so: no kernel reaches it
        on this machine (at that many bytes a step). One above the compute ceiling of waferline's kernels says that
        too: not with these kernels (a faster kernel could raise that ceiling, not the read roofline)."""
        top = get(model, engine, batch, "read_roofline_tok_s")
        if not t["met"] and top and need > top:
            t["above_roofline"] = f"needs {need:.0f} tok/s, above the read-bandwidth roofline {top:.0f}"
        cc = get(model, engine, batch, "compute_ceiling_tok_s")
        if not t["met"] and cc and need > cc:
            t["above_compute_ceiling"] = (f"needs {need:.0f} tok/s, above the compute ceiling of waferline's kernels "
                                          f"{cc:.0f}")
        elif not t["met"] and cc and batch > 1 and (not top or cc < top):
            # a compute-bound step (its kernels' ceiling below its read roofline): how close to that ceiling it would
            # have to run, and ran
            now = get(model, engine, batch)
            t["needs_compute_share"] = (f"needs batch {batch} at {100 * need / cc:.0f}% of the compute ceiling of "
                                        f"waferline's kernels ({cc:.0f} tok/s); it ran at {100 * now / cc:.0f}%")
        return t

    def share(t: dict, model: str, engine: str, b1: float) -> dict:
        """A batch-8 target not met that needs batch 8 to run at a larger share of its read roofline than batch 1 ran
        at of its own says so: a batch-8 step of a MoE reads the experts its rows touch (under uniform routing most of
        them) and 8 rows' KV cache, so its roofline is less than 8x batch 1's, and 4x batch 1 may need batch 8 to be
        the more efficient of the two."""
        r1, r8 = get(model, engine, 1, "read_roofline_tok_s"), get(model, engine, 8, "read_roofline_tok_s")
        if not t["met"] and r1 and r8 and 4 * b1 / r8 > b1 / r1:
            t["needs_higher_share"] = (
                f"needs batch 8 at {100 * 4 * b1 / r8:.0f}% of its read roofline, batch 1 ran at "
                f"{100 * b1 / r1:.0f}% of its own: a batch-8 step reads {8 * r1 / r8:.2f}x the "
                f"bytes of a batch-1 step"
            )
        return t

    out = []
    for m in sorted({r["model"] for r in rows}):
        wl, hf = get(m, "waferline bf16", 1), get(m, "transformers bf16", 1)
        if wl and hf:
            out.append(ceiling({"target": f"{m}: waferline bf16 >= 5x transformers bf16 (batch 1)",
                                "value": round(wl / hf, 2), "met": wl / hf >= 5}, 5 * hf, m, "waferline bf16", 1))
        if m == "dsv3":
            w4, q4 = get(m, "waferline int4", 1), get(m, "llama.cpp Q4_0", 1)
            if w4 and q4:
                out.append({"target": "dsv3: waferline int4 >= llama.cpp Q4_0 (batch 1)", "value": round(w4 / q4, 2),
                            "met": w4 >= q4})
        for e in ("waferline fp32", "waferline bf16", "waferline int4"):
            b1, b8, roof = get(m, e, 1), get(m, e, 8), get(m, e, 1, "roofline_tok_s")
            if hbm and b1 and roof:
                out.append({"target": f"{m}: {e} >= 60% of the HBM roofline (batch 1)", "value": round(b1 / roof, 3),
                            "met": b1 >= 0.6 * roof})
            if b1 and b8:
                out.append(share(ceiling({"target": f"{m}: {e} batch 8 aggregate >= 4x batch 1",
                                          "value": round(b8 / b1, 2), "met": b8 / b1 >= 4}, 4 * b1, m, e, 8),
                                 m, e, b1))
    spec = [r for r in sol if "+" in r.get("variant", "") and r.get("decode_tok_s")]
    if spec:
        bestspec = max(spec, key=lambda r: r["decode_tok_s"])
        out.append({"target": f"sol-mini int4 + speculation >= 750 tok/s per user ({bestspec['variant']})",
                    "value": bestspec["decode_tok_s"], "met": bestspec["decode_tok_s"] >= 750})
    return out


def print_tables(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=160)
    t = Table(title=f"decode speed — {res.get('device', 'cpu')}, {res['threads']} threads, prompt {res['prompt_len']}, "
                    f"{res['new_tokens']} new "
                    f"tokens, greedy, best of {res['repeats']}; copy / read bandwidth {res['copy_bandwidth_GBps']} / "
                    f"{res.get('read_bandwidth_GBps', '?')} GB/s; "
                    f"load avg {res['loadavg_start'][0]:.2f} → {res['loadavg_end'][0]:.2f}")
    for col in ("model", "engine", "batch", "decode tok/s", "per user", "TTFT ms", "vs transformers",
                "roofline tok/s", "% roofline", "read roofline", "compute ceiling", "top-1 vs fp32"):
        t.add_column(col, justify="left" if col in ("model", "engine") else "right")
    for r in res["rows"]:
        if r.get("na"):
            t.add_row(r["model"], r["engine"], str(r["batch"]), "n/a", "", "", "", f"{r['roofline_tok_s']:.0f}", "",
                      _read_roof(r), _compute(r), "")
            continue
        t.add_row(r["model"], r["engine"], str(r["batch"]), f"{r['decode_tok_s']:.1f}", f"{r['per_user_tok_s']:.1f}",
                  f"{r['ttft_ms']:.0f}", f"{r['vs_transformers']:.2f}x" if r.get("vs_transformers") else "",
                  f"{r['roofline_tok_s']:.0f}", f"{100 * r['of_roofline']:.0f}%", _read_roof(r), _compute(r),
                  _agree(r))
    con.print(t)
    if res["sol_mini"]:
        s = Table(title="sol-mini (trained), waferline int4 + int8 head, batch 1, held-out prompt")
        for col in ("variant", "decode tok/s per user", "TTFT ms", "same tokens", "≥ 750"):
            s.add_column(col)
        for r in res["sol_mini"]:
            if r.get("na"):
                s.add_row(r["variant"], "n/a", r["na"][:60], "", "")
            else:
                s.add_row(r["variant"], f"{r['decode_tok_s']:.1f}", f"{r['ttft_ms']:.0f}",
                          str(r["same_tokens_as_int4"]), "yes" if r["target_750"] else "no")
        con.print(s)
    for why in sorted({f"{r['engine']}: {r['na']}" for r in res["rows"] if r.get("na")}):
        con.print(f"n/a — {why}", markup=False)  # (plain text: a reason such as "pip install -e '.[bench]'")
    for c in res["conversion_checks"]:
        con.print(
            f"conversion check {c['model']} {c['engine']} vs transformers fp32: top-1 {100 * c['top1_agree']:.0f}% of "
            f"{c['positions']} teacher-forced positions, mean KL {c['kl_mean']:.4f}, greedy "
            f"{c['greedy_same_prefix']}/{c['greedy_of']} first tokens equal -> "
            f"{'OK' if c['conversion_ok'] else 'SUSPECT'}"
        )
    for g in res["targets"]:
        why = f" ({g['above_roofline']}: not reachable here)" if g.get("above_roofline") else ""
        if g.get("above_compute_ceiling"):
            why += f" ({g['above_compute_ceiling']}: not with these kernels here)"
        for key in ("needs_higher_share", "needs_compute_share"):
            if g.get(key):
                why += f" ({g[key]})"
        con.print(
            f"[{'green' if g['met'] else 'red'}]{'MET ' if g['met'] else 'NOT '}[/] {g['target']}: {g['value']}{why}"
        )


def _agree(r: dict) -> str:
    q = r.get("vs_fp32_reference")
    return f"{100 * q['top1_agree']:.0f}%" if q else ""


def _read_roof(r: dict) -> str:
    return f"{r['read_roofline_tok_s']:.0f}" if r.get("read_roofline_tok_s") else ""


def _compute(r: dict) -> str:
    return f"{r['compute_ceiling_tok_s']:.0f}" if r.get("compute_ceiling_tok_s") else ""


def markdown(res: dict) -> str:
    lines = ["| model | engine | batch | decode tok/s | per user | TTFT ms | vs transformers | roofline tok/s | "
             "% of roofline | read roofline | compute ceiling | top-1 vs fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if r.get("na"):
            lines.append(f"| {r['model']} | {r['engine']} | {r['batch']} | n/a | | | | {r['roofline_tok_s']:.0f} | | "
                         f"{_read_roof(r)} | {_compute(r)} | |")
        else:
            vs = f"{r['vs_transformers']:.2f}x" if r.get("vs_transformers") else ""
            lines.append(f"| {r['model']} | {r['engine']} | {r['batch']} | {r['decode_tok_s']:.1f} | "
                         f"{r['per_user_tok_s']:.1f} | {r['ttft_ms']:.0f} | {vs} | {r['roofline_tok_s']:.0f} | "
                         f"{100 * r['of_roofline']:.0f}% | {_read_roof(r)} | {_compute(r)} | {_agree(r)} |")
    if res["sol_mini"]:
        lines += [
            "",
            "| sol-mini (trained), waferline int4 + int8 head, batch 1 | decode tok/s per user | TTFT ms | same "
            "tokens as int4 |",
            "|---|---|---|---|",
        ]
        for r in res["sol_mini"]:
            lines.append(
                f"| {r['variant']} | n/a: {r['na']} | | |"
                if r.get("na")
                else f"| {r['variant']} | {r['decode_tok_s']:.1f} | {r['ttft_ms']:.0f} | {r['same_tokens_as_int4']} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help="comma list of dsv3,qwen3moe,llama,llama-gpu,dsv3-gpu (or 'none'; "
                    "default dsv3,qwen3moe,llama on CPU, llama-gpu,dsv3-gpu on a GPU)")
    ap.add_argument("--engines", default=None,
                    help="comma list of hf, waferline (= wl_fp32,wl_bf16,wl_int4), llamacpp (= lcpp_f16,lcpp_q4_0), "
                         "sol (the sol-mini speculation rows), or single names (default hf,waferline,llamacpp,sol on "
                         "CPU; hf,wl_bf16,wl_bf16_eager,wl_int4 on a GPU: wl_bf16_eager decodes without CUDA "
                         "graphs)")
    ap.add_argument("--device", default="cpu", help="cpu (default), or cuda: transformers and waferline on the GPU "
                    "against its measured HBM bandwidth (llama.cpp and sol-mini rows are CPU-only)")
    ap.add_argument("--batch", default="1,8", help="batch sizes (default 1,8)")
    ap.add_argument(
        "--new-tokens", type=int, default=None, help="tokens generated per sequence (default 128; 8 with --quick)"
    )
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64; 16 with --quick)")
    ap.add_argument(
        "--repeats", type=int, default=None, help="interleaved repeats, best kept (default 2; 1 with --quick)"
    )
    ap.add_argument("--check-tokens", type=int, default=16, help="greedy tokens of the transformers fp32 reference "
                    "each engine is checked against (teacher-forced top-1 / KL and free-running greedy); 0 = no check")
    ap.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    ap.add_argument("--quick", action="store_true", help="tiny models and a few tokens: a smoke test")
    ap.add_argument("--cache", default=str(CACHE), help="where checkpoints and GGUF files are kept (benchmarks/.cache)")
    ap.add_argument("--llama-cpp-src", default=None, help="llama.cpp source dir with convert_hf_to_gguf.py "
                    "(default: $LLAMA_CPP_SRC, else extracted from the llama-cpp-python sdist)")
    ap.add_argument("--llama-cpp-sdist", default=None, help="path of the llama-cpp-python sdist (.tar.gz)")
    ap.add_argument("--json", default=None, help="output (default benchmarks/results/decode_speed.json; "
                    "decode_speed_quick.json with --quick)")
    a = ap.parse_args()
    gpu = a.device != "cpu"
    if gpu:
        try:
            torch.zeros(1, device=a.device)
        except (RuntimeError, AssertionError) as ex:
            ap.error(f"--device {a.device}: {ex}")
    a.models = a.models or ("llama-gpu,dsv3-gpu" if gpu else "dsv3,qwen3moe,llama")
    a.engines = a.engines or ("hf,wl_bf16,wl_bf16_eager,wl_int4" if gpu else "hf,waferline,llamacpp,sol")
    a.new_tokens = a.new_tokens or (8 if a.quick else 128)
    a.prompt_len = a.prompt_len or (16 if a.quick else 64)
    a.repeats = a.repeats or (1 if a.quick else 2)
    a.json = a.json or str(ROOT / "results" / (f"decode_speed{'' if not gpu else '_' + a.device.split(':')[0]}"
                                               f"{'_quick' if a.quick else ''}.json"))
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(a.json, "--json")
    except ConfigError as e:
        ap.error(str(e))
    models = [m for m in a.models.split(",") if m and m != "none"]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}: choose from {', '.join(MODELS)}")
    engines: list[str] = []
    for e in a.engines.split(","):
        if e not in ENGINE_GROUPS:
            ap.error(f"unknown engine {e!r}: choose from {', '.join(ENGINE_GROUPS)}")
        engines += [x for x in ENGINE_GROUPS[e] if x not in engines]
    if gpu and any(e.startswith("lcpp") or e == "sol" for e in engines):
        ap.error("llama.cpp (a CPU build here) and the sol-mini rows run on CPU only; drop them with --device "
                 f"{a.device}")
    try:
        batches = [int(b) for b in a.batch.split(",")]
    except ValueError:
        ap.error(f"--batch {a.batch}: expected comma-separated integers")
    torch.set_num_threads(a.threads)
    Path(a.cache).mkdir(parents=True, exist_ok=True)

    t_start = time.perf_counter()
    load0 = os.getloadavg()
    bw, rbw = device_bandwidths(a.device) if gpu else (copy_bandwidth(), read_bandwidth())
    # (the compute ceiling prices waferline's CPU kernels: none on a GPU)
    rates = product_rates(batches, a.threads) if any(e in RATE_FORMATS for e in engines) and not gpu else {}
    print(
        f"{a.device} copy bandwidth {bw / 1e9:.1f} GB/s, read bandwidth {rbw / 1e9:.1f} GB/s, load average "
        f"{load0[0]:.2f} "
        f"{load0[1]:.2f} {load0[2]:.2f}",
        flush=True,
    )
    if rates:
        print("waferline's products with the weight in cache (G multiply-adds/s): "
              + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rates.items()), flush=True)
    converter: Path | str = "not needed"
    if any(e.startswith("lcpp") for e in engines):
        try:
            _llama_cpp()
            converter = find_converter(a.llama_cpp_src, a.llama_cpp_sdist, Path(a.cache))
        except ImportError as ex:
            converter = f"llama-cpp-python is not installed (pip install -e '.[bench]'): {ex}"
        except Exception as ex:  # noqa: BLE001
            converter = str(ex)
    all_rows: list[Result] = []
    checks: list[dict] = []
    infos: list[dict] = []
    model_engines = [e for e in engines if e != "sol"]
    for m in models:
        if not model_engines:
            break
        print(f"== {m}", flush=True)
        rows, ch, info = bench_model(m, model_engines, batches, a, bw, converter)
        all_rows += rows
        checks += [dict(c, model=m) for c in ch]
        infos.append(info)
    sol: list[dict] = []
    if "sol" in engines:
        print("== sol-mini", flush=True)
        sol = bench_sol(a)
    load1 = os.getloadavg()
    bw2, rbw2 = device_bandwidths(a.device) if gpu else (copy_bandwidth(), read_bandwidth())
    bw, rbw = max(bw, bw2), max(rbw, rbw2)  # the better of the two measurements: the machine may be shared
    if rates:  # the better of the two measurements, as for the bandwidths
        rates = {k: max(v, product_rates([int(k.split("@")[1])], a.threads).get(k, 0.0)) for k, v in rates.items()}
    for r in all_rows:
        r.roofline_tok_s = r.batch * bw / (r.step_MB * 1e6)

    rows = []
    for r in all_rows:
        row: dict[str, Any] = {"model": r.model, "engine": r.engine, "batch": r.batch,
                               "roofline_tok_s": round(r.roofline_tok_s, 1),
                               "read_roofline_tok_s": round(r.batch * rbw / (r.step_MB * 1e6), 1),
                               "bytes_per_step_MB": round(r.step_MB, 2),
                               "macs_per_token_M": round(r.macs_per_token / 1e6, 2)}
        cc = compute_ceiling(ENGINE_KEYS[r.engine], r.batch, r.macs_per_token, r.head_macs, rates)
        if cc:
            row["compute_ceiling_tok_s"] = round(cc, 1)
        if r.best is None:
            row["na"] = r.na or "not measured"
        else:
            row.update(
                decode_tok_s=round(r.best.decode_tok_s, 2),
                per_user_tok_s=round(r.best.decode_tok_s / r.batch, 2),
                ttft_ms=round(1e3 * r.best.ttft_s, 1),
                of_roofline=round(r.best.decode_tok_s / r.roofline_tok_s, 3),
                repeats_tok_s=r.runs,
                first_tokens=r.first_tokens,
            )
        if r.quality:
            row["vs_fp32_reference"] = r.quality
        rows.append(row)
    for row in rows:
        base = next((x for x in rows if x["model"] == row["model"] and x["batch"] == row["batch"]
                     and x["engine"] == "transformers bf16" and x.get("decode_tok_s")), None)
        if base and row.get("decode_tok_s"):
            row["vs_transformers"] = round(row["decode_tok_s"] / base["decode_tok_s"], 2)
    import transformers

    res = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu": cpu_model() or "", "cpus": os.cpu_count()},
        "device": f"{a.device}: {torch.cuda.get_device_name(a.device)}" if a.device.startswith("cuda") else a.device,
        "loadavg_start": [round(x, 2) for x in load0], "loadavg_end": [round(x, 2) for x in load1],
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "llama_cpp_python": llama_cpp_version(),
                     "waferline": _waferline_version()},
        "threads": a.threads, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "repeats": a.repeats,
        "quick": a.quick, "copy_bandwidth_GBps": round(bw / 1e9, 2),
        "read_bandwidth_GBps": round(rbw / 1e9, 2), "models": infos,
        "product_rates_GMACps": {k: round(v / 1e9, 2) for k, v in rates.items()},
        "llama_cpp_converter": str(converter),
        "notes": [
            "Random weights give near-uniform expert routing: at batch > 1 a step touches more distinct experts than a "
            "trained model usually would, and the roofline assumes the uniform-routing expectation E(1-(1-k/E)^B).",
            "decode tok/s = generated tokens after the first of each sequence / time after TTFT, aggregate over the "
            "batch; TTFT includes the prefill of every prompt of the batch. Best of the repeats (each repeat runs "
            "every batch size of every engine in turn); the machine may be shared.",
            "transformers: generate(), bf16, attn_implementation='sdpa', greedy, min_new_tokens = max_new_tokens.",
            "llama.cpp: llama-cpp-python low-level API, one context with n_seq_max = batch, prompts prefilled in one "
            "llama_decode, greedy argmax in numpy; GGUF f16 from convert_hf_to_gguf.py (pre-tokenizer set to 'gpt-2' "
            "for our synthetic tokenizer), Q4_0 from llama_model_quantize with default params (llama.cpp's choice "
            "of types for the output/embedding tensors).",
            "roofline: ModelSpec weight accounting (embedding table excluded; Q4_0 approximated as 4 bits + one 16-bit "
            "scale per 32 weights, waferline int4 as group 128; the LM head 16-bit, except llama.cpp Q4_0's Q6_K "
            "(6.5625 bits, its default) and waferline int4's int8 head with per-row scales) + KV cache at the mean "
            "context, over the measured torch copy bandwidth (read + write bytes; the better of 4 KiB and huge pages). "
            "read_roofline_tok_s: the same bytes over the read bandwidth (a torch amax over 256 MiB in huge pages), "
            "which on these machines is higher than the copy bandwidth: the ceiling the targets are checked against.",
            "compute_ceiling_tok_s (waferline rows): the tok/s at which a step's multiply-adds (ModelSpec forward "
            "FLOPs / 2 at the mean context: active weights, router, LM head, attention) run at the in-cache rate of "
            "waferline's own product of that format and batch (product_rates_GMACps: a 1024 x 1024 weight a thread, "
            "called as the engine calls it; the int4 engine's head at its int8 rate). A ceiling of these kernels on "
            "this machine, not the CPU's peak. A decode step is bound by the lower of it and the read roofline.",
        ],
        "rows": rows, "sol_mini": sol, "conversion_checks": checks, "targets": targets(rows, sol, hbm=gpu),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print_tables(res)
    print("\n" + markdown(res))
    write_text_atomic(a.json, json.dumps(res, indent=2), make_parents=True)
    print(f"wrote {a.json} ({res['wall_s']:.0f}s)")




def _waferline_version() -> str:
    try:
        from importlib.metadata import version

        v = version("waferline")
    except Exception:  # noqa: BLE001
        v = "?"
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "src"], capture_output=True,
                               text=True).stdout.strip()
        return f"{v} ({sha}{' + uncommitted src changes' if dirty else ''})"
    except OSError:
        return v


if __name__ == "__main__":
    main()
