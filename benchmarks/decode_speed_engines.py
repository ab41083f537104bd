"""decode_speed.py's engines, each run the same way (greedy, every sequence's tokens and the TTFT / decode split
timed): transformers `generate`, waferline.LLM and llama.cpp through llama-cpp-python's low-level API."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decode_speed_models import PAD, _llama_cpp


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a CUDA GPU runs it asynchronously); nothing on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)



@dataclass
class Run:
    ttft_s: float
    decode_s: float
    tokens: list[list[int]]  # generated ids per sequence (the first one included)

    @property
    def decode_tokens(self) -> int:
        return sum(max(len(t) - 1, 0) for t in self.tokens)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / max(self.decode_s, 1e-9)


class HFEngine:
    """transformers `generate`, greedy, bf16, SDPA attention (transformers' default), KV cache on."""

    name, bits, kv_bits = "transformers bf16", 16, 16

    def __init__(self, path: Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
        import transformers
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="sdpa"
            )
        except (ValueError, ImportError):  # an architecture without SDPA support: transformers' eager attention
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="eager"
            )
        self.model.to(device).eval()
        self.device = torch.device(device)
        self.attn_implementation = self.model.config._attn_implementation

    @torch.inference_mode()
    def logits(self, seq: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([seq], device=self.device)).logits[0].float().cpu()

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], n: int) -> Run:
        from transformers.generation.streamers import BaseStreamer

        class Clock(BaseStreamer):
            calls, first = 0, None

            def put(self, value: Any) -> None:
                self.calls += 1
                if self.calls == 2:  # the first call carries the prompt
                    self.first = time.perf_counter()

            def end(self) -> None:
                pass

        ids = torch.tensor(prompts, device=self.device)
        clock = Clock()
        sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, streamer=clock, pad_token_id=PAD)
        sync(self.device)
        t1 = time.perf_counter()
        first = clock.first if clock.first is not None else t1
        return Run(first - t0, t1 - first, out[:, ids.shape[1]:].tolist())


class WaferlineEngine:
    """waferline.LLM, greedy; timed from its token stream (first token = end of the prefill)."""

    def __init__(self, path: Path, variant: str, **kw: Any):
        from waferline import LLM

        dtype, bits = {"fp32": ("float32", 16), "bf16": ("bfloat16", 16), "int4": ("bfloat16", 4)}[variant]
        self.name = f"waferline {variant}"
        self.bits, self.kv_bits = {"fp32": 32, "bf16": 16, "int4": 4}[variant], 32 if variant == "fp32" else 16
        if variant == "int4" and kw.get("device", "cpu") == "cpu":
            # as llama.cpp's Q4_0 files do (their head is Q6_K), the LM head is not left 16-bit (on a GPU it is:
            # the int8 head has no GPU kernel of ours, it would be widened every step)
            kw.setdefault("head_bits", 8)
        self.llm = LLM(str(path), dtype=dtype, weight_bits=bits, **kw)

    def logits(self, seq: list[int]) -> torch.Tensor:
        return self.llm.prompt_logprobs(seq).float()  # log-softmax: the same argmax and KL as the logits

    def run(self, prompts: list[list[int]], n: int) -> Run:
        from waferline import SamplingParams

        t0 = time.perf_counter()
        first = None
        toks: list[list[int]] = [[] for _ in prompts]
        for ev in self.llm.stream(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)):
            if isinstance(ev, tuple):
                if first is None:
                    first = time.perf_counter()
            else:
                toks = [list(o.token_ids) for o in ev]
        t1 = time.perf_counter()
        first = first or t1
        return Run(first - t0, t1 - first, toks)


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python's low-level API: one context holding `batch` sequences; the prompts are
    prefilled together in one llama_decode, then each step decodes one token per sequence (greedy argmax on the
    returned logits). The same path serves batch 1 and batch 8."""

    def __init__(self, gguf: Path, quant: str, threads: int, max_batch: int, ctx_per_seq: int):
        lc = _llama_cpp()
        self.lc, self.name = lc, f"llama.cpp {quant}"
        self.bits, self.group, self.kv_bits = (16, 128, 16) if quant == "f16" else (4, 32, 16)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = lc.llama_context_default_params()
        cp.n_ctx = max_batch * (-(-ctx_per_seq // 256) * 256)
        cp.n_batch = cp.n_ubatch = max(512, max_batch * 64)
        cp.n_seq_max = max_batch
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(cp.n_batch, 0, max_batch)
        self.n_batch = cp.n_batch

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, rows: int) -> list[int]:
        import numpy as np

        ptr = self.lc.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab)).argmax(axis=1).tolist()

    def logits(self, seq: list[int]) -> torch.Tensor:
        import numpy as np

        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        self._decode([(t, i, 0, True) for i, t in enumerate(seq)])
        ptr = self.lc.llama_get_logits(self.ctx)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(len(seq), self.n_vocab)).copy())

    def run(self, prompts: list[list[int]], n: int) -> Run:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        B = len(prompts)
        t0 = time.perf_counter()
        items = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
        for c in range(0, len(items), self.n_batch):  # rows of logits come back in batch order
            self._decode(items[c: c + self.n_batch])
        last = self._argmax(B) if len(items) <= self.n_batch else None
        if last is None:
            raise RuntimeError("prompts larger than one llama.cpp batch")
        toks = [[t] for t in last]
        t1 = time.perf_counter()
        for step in range(1, n):
            self._decode([(toks[s][-1], len(prompts[s]) + step - 1, s, True) for s in range(B)])
            for s, t in enumerate(self._argmax(B)):
                toks[s].append(t)
        t2 = time.perf_counter()
        return Run(t1 - t0, t2 - t1, toks)

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)



if __name__ == "__main__":  # a part of decode_speed.py, with nothing to run on its own
    import sys

    print("decode_speed_engines.py: decode_speed.py's helpers, not a benchmark of its own; run "
          "python benchmarks/decode_speed.py (--help says what it does)", file=sys.stderr)
    raise SystemExit(0 if {"-h", "--help"} & set(sys.argv[1:]) else 2)
