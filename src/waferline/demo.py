"""`waferline demo`: build a small checkpoint of the Sol architecture and run a real generation from it.

Until the trained sol-mini model lands, the demo's weights are RANDOM (a fixed seed): the text it prints is
noise, but every mechanism is real — the hybrid Mamba-2 + MLA stack, the MoE with a shared expert, the
latent/SSM caches, the batch of prompts of different lengths, greedy and sampled decoding.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

DEMO_TEXT = (
    "Cerebras wafers keep the weights of a layer in on-chip SRAM and stream activations from wafer to wafer. "
    "A light cache lets many sequences live beside the weights: latent attention caches a compressed vector per "
    "token, and state-space layers keep a constant state per sequence. Experts hold most parameters; only a few "
    "are active for each token, and a shared expert sees every token. "
) * 8

SOL_DEMO_CONFIG: dict[str, Any] = {
    "model_type": "sol",
    "architectures": ["SolForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 6,
    "mixer_types": ["mamba2", "mamba2", "mla", "mamba2", "mamba2", "mla"],
    "ffn_types": ["dense", "moe", "moe", "moe", "moe", "moe"],
    "num_attention_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "softmax",
    "norm_topk_prob": True,
    "mamba_n_heads": 8,
    "mamba_d_head": 32,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_chunk_size": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def write_tokenizer(directory: Path, text: str, vocab_size: int) -> None:
    """Train a byte-level BPE tokenizer on ``text`` and save it so transformers.AutoTokenizer loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}, indent=2))


def build_demo_checkpoint(directory: Path, seed: int = 0) -> Path:
    from waferline.model.init import write_random_checkpoint

    write_random_checkpoint(SOL_DEMO_CONFIG, directory, seed=seed)
    write_tokenizer(directory, DEMO_TEXT, SOL_DEMO_CONFIG["vocab_size"])
    return directory


def run_demo(out_dir: str = "demo_out", max_tokens: int = 48, json_out: bool = False) -> int:
    from rich.console import Console
    from rich.table import Table

    from waferline.engine.llm import LLM
    from waferline.engine.sampling import SamplingParams

    console = Console(stderr=json_out)
    ckpt = Path(out_dir) / "sol-demo-random"
    with console.status("building a random Sol-architecture checkpoint (6 layers: Mamba-2 + MLA, MoE 8x top-2 + shared)"):
        build_demo_checkpoint(ckpt)
    llm = LLM(ckpt)
    spec = llm.spec
    table = Table(title=f"{ckpt} — the ModelSpec accounting the simulator also uses")
    for col in ("layer", "mixer", "ffn", "params", "cache B/token (bf16)", "state B/seq (bf16)"):
        table.add_column(col, justify="right")
    for layer in spec.layers:
        table.add_row(str(layer.index), layer.mixer.kind, layer.ffn.kind, f"{layer.params():,}",
                      f"{layer.cache_bytes_per_token(16):,.0f}", f"{layer.mixer.state_bytes_per_seq(16):,.0f}")
    console.print(table)
    prompts = ["Cerebras wafers keep the weights", "A light cache lets many sequences live beside the weights: latent"]
    results: dict[str, Any] = {"checkpoint": str(ckpt), "weights": "random (seed 0) — the text is noise until sol-mini is trained",
                               "params_total": spec.params_total(), "runs": []}
    for name, params in (("greedy", SamplingParams(max_tokens=max_tokens)),
                         ("sampled T=0.8 top-p 0.95 seed 1", SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=1))):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        for p, o in zip(prompts, outs):
            console.print(f"[bold]{name}[/bold] | [cyan]{p}[/cyan]{o.text!r}")
        m = outs[0].metrics
        console.print(f"  batch of {len(prompts)}: {sum(len(o.token_ids) for o in outs)} tokens in {wall:.2f} s, "
                      f"decode {m['decode_tokens_per_s']:.0f} tok/s aggregate, TTFT {m['ttft_s'] * 1e3:.0f} ms")
        results["runs"].append({"mode": name, "outputs": [o.text for o in outs], "token_ids": [o.token_ids for o in outs],
                                "decode_tokens_per_s": m["decode_tokens_per_s"], "ttft_s": m["ttft_s"]})
    console.print("[yellow]note:[/yellow] weights are random, so the text is noise; the trained sol-mini model replaces them.")
    (Path(out_dir) / "demo.json").write_text(json.dumps(results, indent=2))
    if json_out:
        print(json.dumps(results))
    return 0
