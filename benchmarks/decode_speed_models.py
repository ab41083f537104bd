"""decode_speed.py's checkpoints: the random-weight models it builds and caches (transformers configs + a
synthetic byte-level BPE tokenizer), and their GGUF files for llama.cpp (the llama-cpp-python sdist's converter, then
llama.cpp's own quantizer). See decode_speed.py's docstring for what each model is and why."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
CACHE = ROOT / ".cache"
SEED = 0
BOS, EOS, PAD = 1, 2, 0

# ----------------------------------------------------------------------------- checkpoints

COMMON = dict(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
              pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "dsv3": ("deepseek_v3", dict(
        COMMON, hidden_size=512, num_hidden_layers=8, first_k_dense_replace=1, intermediate_size=1536,
        q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, moe_intermediate_size=512,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, num_nextn_predict_layers=0,
        # not attributes of transformers' DeepseekV3Config (it always routes by sigmoid + correction bias), but the
        # keys DeepSeek-V3's hub config.json carries; without scoring_func the GGUF converter writes no gating
        # function and llama.cpp falls back to softmax routing (its DeepSeek-V2 default)
        scoring_func="sigmoid", topk_method="noaux_tc", rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "qwen3moe": ("qwen3_moe", dict(
        COMMON, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        intermediate_size=1536, num_experts=16, moe_intermediate_size=512, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    "llama": ("llama", dict(
        COMMON, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
        intermediate_size=2048, rope_parameters=dict(rope_type="default", rope_theta=500000.0))),
}
# --device cuda: checkpoints large enough to leave a GPU's L2 cache (tens of MB) far behind, so that a decode step
# streams its weights from HBM (the GPU roofline's premise): a Llama of ~0.85B parameters (1.7 GB in bf16) and a
# DeepSeek-V3-type MoE of ~2B (32 routed experts of FFN 768, top-4, 1 shared: ~0.5B active)
GPU_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gpu": ("llama", dict(
        COMMON, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=5632, rope_parameters=dict(rope_type="default", rope_theta=500000.0))),
    "dsv3-gpu": ("deepseek_v3", dict(
        MODELS["dsv3"][1], hidden_size=2048, num_hidden_layers=12, intermediate_size=5632, q_lora_rank=768,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_attention_heads=16,
        num_key_value_heads=16, n_routed_experts=32, moe_intermediate_size=768, num_experts_per_tok=4)),
}
MODELS.update(GPU_MODELS)
# --quick: the same architectures, tiny
QUICK = {
    "dsv3": dict(
        vocab_size=2048,
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        moe_intermediate_size=64,
    ),
    "qwen3moe": dict(
        vocab_size=2048,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        moe_intermediate_size=64,
    ),
    "llama": dict(
        vocab_size=2048,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
    ),
}
QUICK["llama-gpu"], QUICK["dsv3-gpu"] = QUICK["llama"], QUICK["dsv3"]


def model_config(name: str, quick: bool) -> tuple[str, dict[str, Any]]:
    model_type, kw = MODELS[name]
    return model_type, dict(kw, **QUICK[name]) if quick else dict(kw)


def build_tokenizer(vocab_size: int, directory: Path) -> None:
    """A byte-level BPE (GPT-2 pre-tokenizer and byte alphabet) of exactly ``vocab_size`` tokens, built without
    training: <pad> <s> </s>, the 256 byte symbols, then merges spelling every 2-, 3-, ... letter string over
    [space a-z] in a fixed order. It tokenizes English-ish text sensibly and is accepted by the GGUF converter's
    `gpt2` vocab path (tokenizer.json + tokenizer_config.json, loaded through transformers' AutoTokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(specials + alphabet)}
    letters = ["\u0120"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]  # "Ġ" is the byte-level space
    merges: list[tuple[str, str]] = []
    level = list(letters)
    while len(vocab) < vocab_size:
        nxt = []
        for left in level:
            for ch in letters:
                if len(vocab) >= vocab_size:
                    break
                tok = left + ch
                if tok in vocab:
                    continue
                vocab[tok] = len(vocab)
                merges.append((left, ch))
                nxt.append(tok)
        level = nxt
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "add_bos_token": False, "add_eos_token": False, "model_max_length": 4096, "clean_up_tokenization_spaces": False,
    }, indent=2))


def build_checkpoint(name: str, quick: bool, cache: Path) -> Path:
    """Random-weight checkpoint of ``name`` written by transformers' ``save_pretrained`` (bf16 safetensors) with its
    tokenizer; rebuilt only when the configuration (or this builder) changes."""
    import transformers

    model_type, kw = model_config(name, quick)
    stamp = hashlib.sha256(json.dumps([model_type, kw, SEED, "v2"], sort_keys=True).encode()).hexdigest()[:12]
    d = cache / f"{name}{'-quick' if quick else ''}"
    hf = d / "hf"
    if (d / "stamp").is_file() and (d / "stamp").read_text() == stamp and (hf / "model.safetensors").is_file():
        return d
    import shutil

    shutil.rmtree(d, ignore_errors=True)
    t = time.perf_counter()
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():  # the same recipe as tests/tiny_models.py: non-trivial values everywhere
        for pname, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.dim() == 1 and "norm" in pname:
                p.copy_(1.0 + 0.2 * r)
            elif p.dim() == 1:
                p.copy_(0.1 * r)
            else:
                p.copy_(r * (1.0 / p.shape[-1]) ** 0.5)
        for bname, b in model.named_buffers():
            if "e_score_correction_bias" in bname:
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    model.to(torch.bfloat16).save_pretrained(hf)
    model.generation_config.save_pretrained(hf)
    build_tokenizer(cfg.vocab_size, hf)
    n = sum(p.numel() for p in model.parameters())
    (d / "stamp").write_text(stamp)
    print(
        f"built {name}: {model_type}, {n / 1e6:.1f}M parameters in {time.perf_counter() - t:.0f}s -> {hf}", flush=True
    )
    del model
    gc.collect()
    return d


# ----------------------------------------------------------------------------- llama.cpp: converter + quantizer

CONVERTER_RUNNER = r"""
import sys, runpy
src, model, out, outtype = sys.argv[1:5]
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
import conversion.base as base
_orig = base.TextModel.get_vocab_base_pre
def _pre(self, tokenizer):
    # our synthetic byte-level BPE is not in the converter's table of known pre-tokenizer hashes; it uses the
    # GPT-2 regex, so it is "gpt-2" (only ever reached for a tokenizer the table does not know)
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = _pre
sys.argv = [src + "/convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", outtype]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def _llama_cpp() -> Any:
    """The llama_cpp module with llama.cpp's own log (load / quantize chatter) cut down to errors."""
    import llama_cpp
    from llama_cpp import _logger

    _logger.set_verbose(False)
    return llama_cpp


def llama_cpp_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("llama_cpp_python")
    except Exception:
        return None


def find_converter(src: str | None, sdist: str | None, cache: Path) -> Path:
    """A directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/ (llama.cpp's, as shipped in the
    llama-cpp-python sdist). Raises RuntimeError with what to do when there is none."""
    cands = [Path(p) for p in (src, os.environ.get("LLAMA_CPP_SRC")) if p]
    ver = llama_cpp_version()
    extracted = cache / f"llama.cpp-src-{ver}"
    cands.append(extracted)
    for c in cands:
        if (c / "convert_hf_to_gguf.py").is_file():
            return c
    if ver is None:
        raise RuntimeError("llama-cpp-python is not installed")
    tarball = Path(sdist) if sdist else None
    if tarball is None:
        found = sorted(cache.glob(f"llama_cpp_python-{ver}.tar.gz"))
        if found:
            tarball = found[0]
        else:  # the ordinary pip client, only when nothing local exists
            print(f"fetching the llama-cpp-python {ver} sdist for its GGUF converter (pip download) ...", flush=True)
            r = subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={ver}", "--no-deps",
                                "--no-binary", ":all:", "-d", str(cache)], capture_output=True, text=True)
            found = sorted(cache.glob(f"llama_cpp_python-{ver}.tar.gz"))
            if r.returncode != 0 or not found:
                raise RuntimeError(f"no GGUF converter: pass --llama-cpp-src DIR (vendor/llama.cpp of the "
                                   f"llama-cpp-python sdist) or --llama-cpp-sdist PATH ({r.stderr.strip()[-200:]})")
            tarball = found[0]
    prefix = None
    with tarfile.open(tarball) as tf:
        members = []
        for m in tf.getmembers():
            parts = Path(m.name).parts
            if len(parts) > 3 and parts[1:3] == ("vendor", "llama.cpp") and (
                    parts[3] in ("convert_hf_to_gguf.py", "conversion", "gguf-py")):
                prefix = Path(*parts[:3])
                members.append(m)
        if prefix is None:
            raise RuntimeError(f"{tarball} has no vendor/llama.cpp/convert_hf_to_gguf.py")
        tmp = cache / "llama.cpp-src.tmp"
        tf.extractall(tmp, members=members, filter="data")
    import shutil

    shutil.rmtree(extracted, ignore_errors=True)
    (tmp / prefix).rename(extracted)
    shutil.rmtree(tmp, ignore_errors=True)
    return extracted


def build_gguf(d: Path, converter: Path, threads: int) -> dict[str, Path]:
    """f16 GGUF by the converter, Q4_0 by llama.cpp's quantizer; cached next to the checkpoint."""
    out = {"f16": d / "model-f16.gguf", "q4_0": d / "model-q4_0.gguf"}
    if not out["f16"].is_file():
        t = time.perf_counter()
        tmp = out["f16"].with_suffix(".tmp")
        r = subprocess.run([sys.executable, "-c", CONVERTER_RUNNER, str(converter), str(d / "hf"), str(tmp), "f16"],
                           capture_output=True, text=True)
        (d / "convert.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0 or not tmp.is_file():
            tail = [ln for ln in (r.stdout + r.stderr).strip().splitlines() if ln.strip()][-3:]
            raise RuntimeError(f"convert_hf_to_gguf.py failed (see {d / 'convert.log'}): {' | '.join(tail)}")
        tmp.replace(out["f16"])
        print(f"converted {d.name} -> {out['f16'].name} in {time.perf_counter() - t:.0f}s", flush=True)
    if not out["q4_0"].is_file():
        llama_cpp = _llama_cpp()

        t = time.perf_counter()
        tmp = out["q4_0"].with_suffix(".tmp")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
        params.nthread = threads
        rc = llama_cpp.llama_model_quantize(str(out["f16"]).encode(), str(tmp).encode(), params)
        if rc != 0 or not tmp.is_file():
            raise RuntimeError(f"llama_model_quantize to Q4_0 failed (rc={rc})")
        tmp.replace(out["q4_0"])
        print(f"quantized {d.name} -> {out['q4_0'].name} in {time.perf_counter() - t:.0f}s", flush=True)
    return out


if __name__ == "__main__":  # a part of decode_speed.py, with nothing to run on its own
    import sys

    print("decode_speed_models.py: decode_speed.py's helpers, not a benchmark of its own; run "
          "python benchmarks/decode_speed.py (--help says what it does)", file=sys.stderr)
    raise SystemExit(0 if {"-h", "--help"} & set(sys.argv[1:]) else 2)
