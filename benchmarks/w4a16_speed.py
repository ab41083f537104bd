"""Decode tokens/s at batch 1 and 8 for fp32, bf16 and int4 (W4A16) weights, beside the bandwidth roofline.

Models: a ~100M-parameter Llama-type checkpoint with random weights (built once, cached) where reading weights
dominates, and the demo `sol` checkpoint (or sol-mini when `models/sol-mini` exists). The roofline is the weight
bytes read per decode step (ModelSpec accounting, embeddings excluded; of an MoE layer's experts only those a step
can touch) divided by this machine's measured copy bandwidth; at batch 8 one read of the weights serves 8 tokens. Prints
a table, writes benchmarks/results/w4a16_speed.json.

    python benchmarks/w4a16_speed.py                 # ~3-6 minutes on a 2-core CPU
    python benchmarks/w4a16_speed.py --tokens 16 --models llama100m
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from waferline import LLM, SamplingParams
from waferline.model.quant import Int4Weight
from waferline.spec.configs import spec_from_pretrained
from waferline.spec.model import ModelSpec, MoESpec

ROOT = Path(__file__).resolve().parent
LLAMA_100M = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8192, "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}
VARIANTS = (("fp32", "float32", 16), ("bf16", "bfloat16", 16), ("int4", "bfloat16", 4))


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Bytes/s moved by a large tensor copy (read + write), best of ``reps``."""
    src = torch.empty(mib << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best


def checkpoint(name: str, cache: Path) -> Path:
    from waferline.model.init import write_random_checkpoint

    if name == "llama100m":
        d = cache / "llama100m"
        if not (d / "model.safetensors").is_file():
            write_random_checkpoint(LLAMA_100M, d, seed=0)
        return d
    mini = ROOT.parent / "models" / "sol-mini"
    if (mini / "config.json").is_file():
        return mini  # the trained sol-mini
    from waferline.demo import SOL_DEMO_CONFIG

    d = cache / "sol-demo"
    if not (d / "model.safetensors").is_file():
        write_random_checkpoint(SOL_DEMO_CONFIG, d, seed=0)
    return d


def bytes_per_step(spec: ModelSpec, variant: str, group: int, batch: int) -> float:
    """Weight bytes one decode step of ``batch`` sequences reads (ModelSpec accounting): every layer and the LM head,
    not the embedding table (only indexed); of each MoE layer's experts at most ``batch * top_k`` are touched."""
    bits = {"fp32": 32, "bf16": 16, "int4": 4}[variant]
    embed_bits = 32 if bits == 32 else 16
    total = spec.weight_bytes(bits, group, embed_bits=embed_bits) - spec.embed_bytes(embed_bits)
    for layer in spec.layers:
        ffn = layer.ffn
        if isinstance(ffn, MoESpec):
            idle = ffn.num_experts - min(ffn.num_experts, batch * ffn.top_k)
            total -= idle * ffn.expert_bytes(bits, group)  # (as weight_bytes counts it)
    return total


def decode_rate(llm: LLM, batch: int, tokens: int, vocab: int, prompt_len: int = 16) -> float:
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    p = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))  # warm-up
    return llm.generate(prompts, p)[0].metrics["decode_tokens_per_s"]


def run(models: list[str], tokens: int, group: int, cache: Path, repeats: int) -> dict:
    bw = copy_bandwidth()
    rows = []
    for name in models:
        path = checkpoint(name, cache)
        spec = spec_from_pretrained(path)
        name = path.name if name == "sol" else name  # sol-mini, or sol-demo (random weights) until it exists
        llms, info = {}, {}
        for variant, dtype, bits in VARIANTS:
            t = time.perf_counter()
            llms[variant] = llm = LLM(str(path), dtype=dtype, weight_bits=bits, group_size=group)
            resident = sum(b.numel() * b.element_size() for b in llm.model.buffers()) + \
                sum(p.numel() * p.element_size() for p in llm.model.parameters())
            backends = sorted({m.backend for m in llm.model.modules() if isinstance(m, Int4Weight)})
            info[variant] = {"load_s": round(time.perf_counter() - t, 2), "resident_MB": round(resident / 1e6, 1),
                             "int4_backends": backends}
        for batch in (1, 8):
            best = {v: 0.0 for v in llms}
            for _ in range(repeats):  # interleaved, best of: the machine is shared, load comes and goes
                for variant, llm in llms.items():
                    best[variant] = max(best[variant], decode_rate(llm, batch, tokens, spec.vocab_size))
            for variant, rate in best.items():
                step_bytes = bytes_per_step(spec, variant, group, batch)
                roof = batch * bw / step_bytes
                rows.append({"model": name, "params_M": round(spec.params_total() / 1e6, 1), "variant": variant,
                             "batch": batch, "decode_tok_s": round(rate, 2), "roofline_tok_s": round(roof, 1),
                             "of_roofline": round(rate / roof, 3), "bytes_per_step_MB": round(step_bytes / 1e6, 2),
                             **info[variant]})
                print(f"{name:>10} {variant:>5} b={batch}: {rate:8.2f} tok/s  (roofline {roof:8.1f}, "
                      f"{step_bytes / 1e6:7.1f} MB/step)", flush=True)
        del llms
        gc.collect()
    for r in rows:  # speed-ups vs fp32 at the same model and batch
        base = next(x for x in rows if x["model"] == r["model"] and x["batch"] == r["batch"] and x["variant"] == "fp32")
        r["vs_fp32"] = round(r["decode_tok_s"] / base["decode_tok_s"], 2)
    return {"copy_bandwidth_GBps": round(bw / 1e9, 2), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "machine": platform.machine(), "processor": platform.processor(), "tokens": tokens, "group_size": group,
            "repeats": repeats, "rows": rows}


def print_table(res: dict) -> None:
    print(f"\ncopy bandwidth {res['copy_bandwidth_GBps']} GB/s, {res['threads']} threads, torch {res['torch']}, "
          f"int4 group {res['group_size']}")
    print("| model | variant | batch | decode tok/s | vs fp32 | roofline tok/s | % of roofline | MB read/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(
            f"| {r['model']} ({r['params_M']}M) | {r['variant']} | {r['batch']} | {r['decode_tok_s']:.1f} | "
            f"{r['vs_fp32']:.2f}x | {r['roofline_tok_s']:.0f} | {100 * r['of_roofline']:.0f}% | "
            f"{r['bytes_per_step_MB']:.1f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama100m", "sol"], choices=["llama100m", "sol"])
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per measurement (default 32)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per variant; the best is kept (3)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "waferline-bench"),
                    help="where the random checkpoints are kept (outside the repository)")
    ap.add_argument("--out", default=str(ROOT / "results" / "w4a16_speed.json"))
    a = ap.parse_args()
    from waferline.errors import ConfigError
    from waferline.files import check_writable, write_text_atomic

    try:  # (before the run: a path that cannot be written fails here, not after the run)
        check_writable(a.out, "--out")
    except ConfigError as e:
        ap.error(str(e))
    from waferline.model.quant import QuantOptions

    try:  # (before the run too: the int4 engine loads after the fp32 and bf16 ones)
        QuantOptions(group_size=a.group_size).validate()
    except ConfigError as e:
        ap.error(f"--group-size {a.group_size}: {e}")
    if a.threads:
        torch.set_num_threads(a.threads)
    res = run(a.models, a.tokens, a.group_size, Path(a.cache), a.repeats)
    print_table(res)
    write_text_atomic(a.out, json.dumps(res, indent=2), make_parents=True)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
