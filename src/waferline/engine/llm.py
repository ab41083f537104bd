"""The single-process engine and the stable Python API: LLM, SamplingParams, Output.

``LLM.generate`` / ``LLM.stream`` run the scheduler's step (engine/scheduler.py) over the runner the options choose
(``runner_for``): a ``LocalRunner`` (engine/runner.py) over the model in this process, a ``PipelineRunner`` over
stage processes (``stages=`` / ``layers_per_stage=`` / ``plan=``: engine/pipeline/) or an ``AFDRunner`` over attention
and FFN ranks (``afd=True``: engine/afd/). The LLM makes the scheduler at its first request and keeps it (a larger
one when a request brings more prompts than it has slots): one ``Sequence`` per prompt, all admitted and prefilled
(each prompt whole; a pipeline streams it through its stages in pieces) in the first step, then decoded together
until each stops — the server's loop, with no prefix cache; in one process with greedy bursts and, on a GPU, the
captured decode step (engine/graphs.py) as the runner's decode path; over a pipeline with up to M steps in flight
(engine/overlap.py). ``speculative=`` speculates through the scheduler's ``ServeSpeculation``
(engine/speculative/serving.py) under every runner, which the LLM keeps across requests (what steps cost is learnt
once)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from waferline.engine.sampling import (
    SamplingParams,
    TokenLogprobs,
    decode_metrics,
    make_generator,
    resolve_dtype,
    seeded_generator,
)
from waferline.errors import ConfigError, RequestError, counted
from waferline.model.arena import move_to_huge_pages
from waferline.model.context import StepBatch
from waferline.model.load import load_model, load_tokenizer


@dataclass
class Output:
    """One finished request: the generated tokens only (not the prompt), their text, and why it stopped."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (eos/stop string) or "length"
    metrics: dict[str, float] = field(default_factory=dict)
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, where SamplingParams.logprobs asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # one per prompt token after the first (.prompt_logprobs)


def _eos_ids(directory: Path, cfg: dict[str, Any]) -> set[int]:
    ids: set[int] = set()
    sources = [cfg]
    gen = directory / "generation_config.json"
    if gen.is_file():
        try:
            sources.append(json.loads(gen.read_text()))
        except json.JSONDecodeError:
            pass
    for src in sources:
        e = src.get("eos_token_id") if isinstance(src, dict) else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, list):
            ids.update(x for x in e if isinstance(x, int))
    return ids


class LLM:
    """Load a checkpoint directory and generate from it in this process.

    >>> llm = LLM("path/to/checkpoint", dtype="bfloat16")
    >>> llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))[0].text
    """

    def __init__(self, path: str | Path, dtype: str = "float32", max_model_len: int | None = None, *,
                 stages: int | None = None, layers_per_stage: int | None = None, micro_batches: int | None = None,
                 weight_bits: int = 16, group_size: int = 128, head_bits: int = 16, speculative: str | None = None,
                 num_speculative_tokens: int = 4, speculative_adaptive: bool = True, huge_pages: bool = True,
                 device: str | None = None, cuda_graphs: bool = True, **pipeline_options: Any):
        torch_dtype = resolve_dtype(dtype)
        if weight_bits not in (16, 4):
            raise ConfigError(f"weight_bits must be 16 or 4, got {weight_bits}")
        if head_bits not in (16, 8):
            raise ConfigError(f"head_bits must be 16 or 8, got {head_bits}")
        if head_bits != 16 and (stages is not None or layers_per_stage is not None or pipeline_options):
            raise ConfigError("head_bits=8 is for the single-process engine; drop it or the pipeline/AFD options")
        self.path = Path(path)
        self.dtype = torch_dtype
        self.tokenizer = load_tokenizer(self.path)  # before any process starts: a bad tokenizer fails fast
        if max_model_len is not None:  # (and a context the model cannot take)
            from waferline.spec.configs import spec_from_pretrained

            mpe = spec_from_pretrained(self.path).max_position_embeddings
            if not 1 <= max_model_len <= mpe:
                raise ConfigError(f"max_model_len {max_model_len} is outside 1..{mpe} (the model's "
                                  "max_position_embeddings: positions past it were never trained)")
        self.device = _check_device(device)  # the single-process engine's (a pipeline's / AFD's: their processes')
        dev_kw = {} if device is None else {"device": str(self.device)}
        # greedy decode on a GPU replays a captured step (engine/graphs.py) where the model allows one
        self.cuda_graphs = cuda_graphs
        self.graph_note: str | None = None  # why the last request decoded without a graph, if it did
        self._graphs_on_cpu = False  # tests run the static step (uncaptured) on CPU
        self._pipeline = None  # stages / layers_per_stage: run as a pipeline of processes (engine/pipeline/)
        self.arena = None  # where the single-process engine's weights went (model/arena.py), if they moved
        if _wants_afd(pipeline_options):  # attention/FFN disaggregation: attention and FFN ranks (engine/afd/)
            from waferline.engine.afd import AFD

            if stages is not None or layers_per_stage is not None or weight_bits != 16:
                raise ConfigError("afd runs 16-bit weights without stages or layers_per_stage; drop those options "
                                  "(or drop afd / attention_ranks / ffn_ranks)")
            self._pipeline = AFD(self.path, self.dtype, micro_batches=micro_batches, **dev_kw, **pipeline_options)
            self.model = None  # the layers live in the attention and FFN ranks
            self.spec = self._pipeline.spec
        elif stages is not None or layers_per_stage is not None or pipeline_options.get("plan") is not None:
            from waferline.engine.pipeline import Pipeline

            if weight_bits == 4 and not _is_int4_checkpoint(self.path):
                raise ConfigError("weight_bits=4 with a pipeline needs an int4 checkpoint: run `waferline quantize "
                                  f"--model {self.path} --out DIR` and load DIR (int4 checkpoints load as int4 anyway)")

            self._pipeline = Pipeline(self.path, self.dtype, stages=stages, layers_per_stage=layers_per_stage,
                                      micro_batches=micro_batches, **dev_kw, **pipeline_options)
            self.model = None  # the layers live in the stages; stage 0's slice is self._pipeline.runner.model
            self.spec = self._pipeline.spec
        else:
            if micro_batches is not None or pipeline_options:
                raise ConfigError("micro_batches and pipeline options need stages=S or layers_per_stage=K")
            if speculative and self.device.type != "cpu":
                raise ConfigError(f"speculative decoding runs on CPU so far; drop speculative or use device='cpu' "
                                  f"(got device={str(self.device)!r})")
            from waferline.model.quant import QuantOptions, is_int4, loading_for, move_model, quantize_model

            with loading_for(self.device):  # (an int4 checkpoint bound for a GPU keeps codes move_model can read)
                self.model = load_model(self.path, self.dtype)
            self.spec = self.model.spec

            if self.device.type != "cpu":  # before quantizing: int4 weights are packed for the device they sit on
                move_model(self.model, self.device)

            if weight_bits == 4 and not is_int4(self.model):  # a 16-bit checkpoint: RTN int4 on load
                quantize_model(self.model, QuantOptions(group_size=group_size))
            if speculative == "mtp" and is_int4(self.model) and len(self.model.mtp):
                # the MTP drafter in int4 as the target is (a checkpoint keeps it 16-bit): a draft only proposes, the
                # target's verify decides, so the output is unchanged; each draft then runs its layer as one op
                quantize_model(self.model.mtp, QuantOptions(group_size=group_size))
            self.model.quantize_head(head_bits)  # 8: int8 LM head (fewer bytes per token); 16: as loaded
            # the weights in transparent huge pages (model/arena.py: a decode step streams them; 1.02-1.11x measured)
            self.arena = move_to_huge_pages(self.model) if huge_pages and self.device.type == "cpu" else None
        self.eos_token_ids = _eos_ids(self.path, self.spec.hf_config)
        self.max_model_len = max_model_len or self.spec.max_position_embeddings
        self._speculative = (speculative, num_speculative_tokens, speculative_adaptive) if speculative else None
        self._spec: Any = None  # speculative decoding (engine/speculative/serving.py): "ngram" | "mtp" | "draft:PATH"
        self._scheduler: Any = None  # the Scheduler requests run through (made at the first request)
        if speculative and self._pipeline is None:
            from waferline.engine.speculative.serving import ServeSpeculation

            self._spec = ServeSpeculation(self.model, self.model.new_caches(1), 1, speculative, num_speculative_tokens,
                                          speculative_adaptive)
        if self._pipeline is not None:
            try:
                self._engine(1)  # the runner over the processes, and its speculation: a bad option fails here
            except BaseException:
                self._pipeline.close()
                raise

    # -- tokens
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(f"{self.path} has no tokenizer (tokenizer.json); pass prompts as lists of token ids")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise RequestError("empty prompt: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {self.spec.vocab_size}): {bad[:5]}")
        return ids

    # -- engine
    @torch.inference_mode()
    def prompt_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """log_softmax of the logits at every prompt position: a [len, vocab] fp32 tensor."""
        ids = self._prompt_ids(token_ids)
        self._check_len(len(ids), 0)
        if self._pipeline is not None:  # (a slot and pages from the scheduler's cache, for as long as it runs)
            sch = self._engine(1)
            slot = sch.cache.admit("prompt_logprobs")
            try:
                if not sch.cache.grow("prompt_logprobs", len(ids)):
                    raise RequestError(f"a prompt of {counted(len(ids), 'token')} does not fit the cache")
                return sch.runner.prompt_logprobs(ids, slot)
            finally:
                sch.cache.free("prompt_logprobs")
        caches = self.model.new_caches(1, self.device)
        h = self.model(torch.tensor([ids], device=self.device), caches, StepBatch.make([0], [0], len(ids), self.device))
        return torch.log_softmax(self.model.logits(h[0]), dim=-1).cpu()

    def perplexity(self, token_ids: list[int], window: int = 256) -> float:
        """exp(mean NLL) over consecutive windows of ``window`` predicted tokens, each window scored from scratch."""
        nll, n = 0.0, 0
        for s in range(0, len(token_ids) - 1, window):
            chunk = token_ids[s: s + window + 1]
            if len(chunk) < 2:
                break
            lp = self.prompt_logprobs(chunk)
            nll -= float(lp[:-1].gather(1, torch.tensor(chunk[1:])[:, None]).sum())
            n += len(chunk) - 1
        if n == 0:
            raise RequestError("perplexity needs at least 2 tokens")
        return math.exp(nll / n)

    def _check_len(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise RequestError(f"prompt of {counted(prompt_len, 'token')} + max_tokens {max_tokens} exceeds the "
                               f"model's context of {self.max_model_len} tokens; shorten the prompt or lower "
                               "max_tokens")

    def generate(
        self, prompts: list[str] | list[list[int]] | str, params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Output]:
        """Prefill every prompt, then decode them together as one batch until each stops. ``params``: one for every
        prompt (seeded: row b samples with its own stream, seed and row), or a list, one per prompt (each seeded row
        samples as it would alone)."""
        results: list[Output] = []
        for event in self.stream(prompts, params):
            if isinstance(event, list):
                results = event
        return results

    def stream(self, prompts: list[str] | list[list[int]] | str,
               params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[Any]:
        """Like ``generate`` but yields ``(row, token_id)`` as each token is sampled, then the list of Outputs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [self._prompt_ids(p) for p in prompts]
        if isinstance(params, (list, tuple)):
            if len(params) != len(ids):
                raise RequestError(f"{len(params)} SamplingParams for {counted(len(ids), 'prompt')}: give one, or one "
                                   "per prompt")
            per, alone = list(params), True
        else:
            per, alone = [params or SamplingParams()] * len(ids), False
        for p, prm in zip(ids, per):
            prm.validate()
            self._check_len(len(p), prm.max_tokens)
        return self._stream(ids, per, alone) if ids else iter([[]])

    def _engine(self, rows: int) -> Any:
        """The Scheduler and runner requests run through (the model in this process, a pipeline's stages or AFD's
        ranks: ``runner_for``): kept, and made again only for more rows than it has slots. Each prompt is prefilled
        whole in the first step (the step's token budget holds every row at its longest; a pipeline streams a long
        prompt through its stages in pieces of its prefill chunk), so a row's numbers do not depend on the others'
        prompts."""
        from waferline.engine.runner import LocalRunner
        from waferline.engine.scheduler import Scheduler, SchedulerConfig, runner_for

        sch = self._scheduler
        if sch is None or sch.config.max_num_seqs < rows:
            local = self._pipeline is None
            runner = runner_for(self, rows)
            if isinstance(runner, LocalRunner):
                runner.batch_prefills = False
            if self._speculative is not None and self._spec is None:  # (a pipeline's: its runner has the parts)
                from waferline.engine.speculative.serving import ServeSpeculation

                model, caches = runner.prepare_speculation(self._speculative[0])
                self._spec = ServeSpeculation(model, caches, rows, *self._speculative)
            k = self._spec.k_max if self._spec is not None else 0
            cfg = SchedulerConfig(max_num_seqs=rows, max_model_len=self.max_model_len, chunk_tokens=self.max_model_len,
                                  max_num_batched_tokens=rows * (self.max_model_len + k + 1), max_queue=rows,
                                  prefix_caching=False, greedy_bursts=local)
            sch = self._scheduler = Scheduler(self, cfg, runner, speculation=self._spec)
        sch.cache.lowest_slots_first()  # (idle: row b is admitted to slot b, as on a fresh scheduler)
        return sch

    @torch.inference_mode()
    def _stream(self, ids: list[list[int]], per: list[SamplingParams], alone: bool) -> Iterator[Any]:
        from waferline.engine.overlap import OverlapStepper, can_overlap
        from waferline.engine.sequence import Sequence

        sch = self._engine(len(ids))
        runner = sch.runner
        stepper = OverlapStepper(sch) if can_overlap(sch) else None  # a pipeline: up to M steps in flight
        self.graph_note = None
        if self._pipeline is None:
            runner.static, runner.static_factory = None, None
            end = max(len(p) + prm.max_tokens for p, prm in zip(ids, per))
            if ((self.device.type == "cuda" and self.cuda_graphs) or self._graphs_on_cpu) \
                    and all(prm.temperature == 0 for prm in per) and max(prm.max_tokens for prm in per) > 1:
                # (greedy rows; one token each: no step to replay)
                runner.static_factory = lambda slots: self._static_decode(runner.caches, slots, end)
        spec_before = dataclasses.replace(self._spec.stats) if self._spec is not None else None
        events: list[tuple[int, Any]] = []
        lps: list[list[TokenLogprobs]] = [[] for _ in ids]
        prompt_lps: list[list[TokenLogprobs] | None] = [None] * len(ids)
        seqs = []
        last_at: list[float] = [0.0] * len(ids)
        t0 = time.perf_counter()
        try:
            for b, (p, params) in enumerate(zip(ids, per)):
                seq = Sequence(str(b), p, params, lambda ev, b=b: events.append((b, ev)), stream_text=False)
                seq.generator = make_generator(params) if params.seed is None else \
                    seeded_generator(params, 0 if alone else b)
                seqs.append(seq)
                sch.add(seq)
            drive = stepper or sch
            while drive.has_work():
                drive.step()
                now = time.perf_counter()
                for b, ev in events:
                    if ev.error is not None:
                        raise RequestError(ev.error)
                    if ev.logprobs is not None:
                        lps[b].append(ev.logprobs)
                    if ev.prompt_logprobs is not None:
                        prompt_lps[b] = ev.prompt_logprobs
                    if ev.token_id is not None:
                        last_at[b] = now
                        yield b, ev.token_id
                events.clear()
        except BaseException:  # (an error, or a caller that stopped reading: what is left ends here)
            with contextlib.suppress(Exception):  # (the error that got here is the one to see)
                if stepper is not None:
                    stepper.drop()
                for s in seqs:
                    sch.abort(s.request_id)
                if runner.fault() is None:
                    runner.recover()
            raise
        finally:
            if self._pipeline is None:
                runner.static, runner.static_factory = None, None
        ttft = max(s.first_token_at or t0 for s in seqs) - t0
        metrics = decode_metrics(t0, ttft, sum(len(s.output_ids) for s in seqs), len(seqs))
        if self._pipeline is not None:
            metrics.update(stages=float(self._pipeline.num_stages), micro_batches=float(self._pipeline.micro_batches))
        if self._spec is not None:
            metrics.update(self._spec.stats.since(spec_before).generate_metrics())
        outs = []
        for b, s in enumerate(seqs):
            params = per[b]
            stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            span = last_at[b] - (s.first_token_at or t0)
            m = dict(metrics, tokens_per_s_per_user=(len(s.output_ids) - 1) / span if span > 0 else 0.0)
            out = self.make_output(ids[b], s.output_ids, s.finish_reason or "length", stop_ids, params, m)
            out.logprobs = lps[b] if params.logprobs is not None else None
            out.prompt_logprobs = prompt_lps[b]
            outs.append(out)
        yield outs

    def _static_decode(self, caches: list[Any], slots: list[int], end: int) -> Any:
        """The captured decode step of greedy rows in ``slots`` on a GPU (engine/graphs.py), or None: a model whose
        step cannot be captured (``graph_note`` says why)."""
        from waferline.engine.graphs import StaticDecode, graphable

        if not graphable(caches):
            self.graph_note = "caches other than full-attention token caches (Mamba-2 state, sliding window)"
            return None
        try:
            static = StaticDecode(self.model, caches, slots, end, self.device,
                                  capture=self.device.type == "cuda" and self.cuda_graphs)
        except RuntimeError as e:  # (a host read inside the step, found by the warm-up; or the capture failing)
            self.graph_note = f"not captured: {e}"
            return None
        return static

    def make_output(self, prompt_ids: list[int], toks: list[int], reason: str, stop_ids: set[int],
                    params: SamplingParams, metrics: dict[str, float]) -> Output:
        """The Output of one finished row: decoded text, cut at a stop string when one ended it."""
        text = self.decode(toks[:-1] if reason == "stop" and toks and toks[-1] in stop_ids else toks,
                           params.skip_special_tokens)
        if params.stop and reason == "stop" and toks and toks[-1] not in stop_ids:
            text = _cut_at_stop(text, params.stop)
        return Output(prompt_ids, toks, text, reason, dict(metrics))

    def close(self) -> None:
        """Stop the pipeline's stage processes (no-op for the single-process engine)."""
        if self._pipeline is not None:
            self._pipeline.close()
        self._scheduler = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _hit_stop(self, toks: list[int], stops: list[str]) -> bool:
        if self.tokenizer is None:
            return False
        tail = self.decode(toks[-16:])
        return any(s in tail for s in stops)


def _check_device(device: str | None) -> torch.device:
    """The engine's device (default CPU), checked: a known device type, and CUDA only where torch sees a GPU."""
    try:
        dev = torch.device(device or "cpu")
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device must be like 'cpu', 'cuda' or 'cuda:1', got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but torch sees no CUDA GPU here; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be a CPU or a CUDA GPU, got {device!r}")
    return dev


def _wants_afd(options: dict[str, Any]) -> bool:
    """afd=True, attention_ranks / ffn_ranks, or a Plan with attention and FFN stages (removes the ``afd`` flag)."""
    if options.pop("afd", False) or options.get("attention_ranks") is not None or options.get("ffn_ranks") is not None:
        return True
    if options.get("plan") is None:
        return False
    from waferline.engine.afd import is_afd_plan

    return is_afd_plan(options["plan"])


def _is_int4_checkpoint(directory: Path) -> bool:
    from waferline.model.quant import quant_method

    cfg = directory / "config.json"
    return cfg.is_file() and quant_method(json.loads(cfg.read_text())) is not None


def _cut_at_stop(text: str, stops: list[str]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text[:cut] if cut >= 0 else text
