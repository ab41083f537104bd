"""The single-process engine and the stable Python API: LLM, SamplingParams, Output.

``LLM.generate`` / ``LLM.stream`` run the scheduler's step (engine/scheduler.py) over the runner the options choose
(``runner_for``): a ``LocalRunner`` (engine/runner.py) over the model in this process, a ``PipelineRunner`` over stage
processes (``stages=`` / ``layers_per_stage=`` / ``plan=``: engine/pipeline/) or an ``AFDRunner`` over attention and FFN
ranks (``afd=True``: engine/afd/). The LLM makes the scheduler at its first request and keeps it (a larger one when a
request brings more prompts than it has slots): one ``Sequence`` per prompt, all admitted and prefilled (each prompt
whole; a pipeline streams it through its stages in pieces) in the first step, then decoded together until each stops —
the server's loop, with no prefix cache; in one process with greedy bursts and, on a GPU, the captured decode step
(engine/graphs.py) as the runner's decode path; over a pipeline with up to M steps in flight (engine/overlap.py).
``speculative=`` speculates through the scheduler's ``ServeSpeculation`` (engine/speculative/serving.py) under every
runner, which the LLM keeps across requests (what steps cost is learnt once)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from waferline.engine.inputs import (
    AFD_OPTIONS,
    PIPELINE_OPTIONS,
    PROCESS_OPTIONS,
    check_device,
    check_engine_options,
    check_numbers,
    eos_ids,
    is_token_id,
    plan_group_size,
    plan_run,
    shown,
    wants_afd,
)
from waferline.engine.sampling import SamplingParams, TokenLogprobs, decode_metrics, resolve_dtype
from waferline.engine.sequence import CONTEXT_TOKENS, Sequence, request_generator, stop_cut
from waferline.engine.speculative.serving import ServeSpeculation, check_speculative
from waferline.engine.token_bytes import decode_text
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


class LLM:
    """Load a checkpoint directory and generate from it: in this process, over a pipeline of stage processes
    (``stages=`` / ``layers_per_stage=``) or over attention and FFN ranks (``afd=True``).

    >>> llm = LLM("path/to/checkpoint", dtype="bfloat16")
    >>> llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))[0].text

    Options: ``dtype`` (float32 | bfloat16 | float16), ``max_model_len`` (the context; default the model's),
    ``weight_bits`` 4 (int4 weights: RTN on load of a 16-bit checkpoint, each pipeline stage its own layers) with
    ``group_size`` (default a 4-bit plan's, else 128), ``head_bits`` 8 (int8 LM head), ``speculative`` ("ngram" |
    "mtp" | "draft:PATH") with ``num_speculative_tokens`` and ``speculative_adaptive``, ``device`` ("cpu" |
    "cuda[:i]"), ``cuda_graphs``, ``huge_pages``. A pipeline: ``stages`` or ``layers_per_stage``, ``micro_batches``,
    ``plan``, ``prefill_chunk``, ``threads_per_stage``, ``hang_timeout_s``, ``start_method``, ``launch``. AFD:
    ``afd``, ``attention_ranks``, ``ffn_ranks``, ``micro_batches``, ``plan``, ``prefill_chunk``, ``threads_per_rank``,
    ``hang_timeout_s``, ``start_method``. Calls from several threads run one at a time; ``close()`` (or ``with
    LLM(...)``) stops a pipeline's processes, as collecting a dropped LLM does. In a process forked from the one that
    made it, a pipeline's or AFD's LLM refuses calls (``StageError``) and its close() or collection there leaves the
    processes to that one.
    """

    def __init__(self, path: str | Path, dtype: str = "float32", max_model_len: int | None = None, *,
                 stages: int | None = None, layers_per_stage: int | None = None, micro_batches: int | None = None,
                 weight_bits: int = 16, group_size: int | None = None, head_bits: int = 16,
                 speculative: str | None = None, num_speculative_tokens: int = 4, speculative_adaptive: bool = True,
                 huge_pages: bool = True, device: str | None = None, cuda_graphs: bool = True, **pipeline_options: Any):
        unknown = sorted(set(pipeline_options) - PROCESS_OPTIONS)
        if unknown:
            raise ConfigError(f"unknown LLM option{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
                              "(help(waferline.LLM) lists them)")
        # (an option given as None is not given: its engine's default, as micro_batches=None is; afd=False: no AFD)
        pipeline_options = {k: v for k, v in pipeline_options.items() if v is not None and (k, v) != ("afd", False)}
        torch_dtype = resolve_dtype(dtype)
        check_numbers(dict(pipeline_options, max_model_len=max_model_len, stages=stages,
                           layers_per_stage=layers_per_stage, micro_batches=micro_batches, weight_bits=weight_bits,
                           group_size=group_size, head_bits=head_bits, num_speculative_tokens=num_speculative_tokens))
        self.path = Path(path)
        if self.path.is_file():
            raise ConfigError(f"{path} is a file, not a checkpoint directory (config.json + *.safetensors); pass the "
                              "directory that holds it")
        self.dtype = torch_dtype
        self.tokenizer = load_tokenizer(self.path)  # before any process starts: a bad tokenizer fails fast
        if max_model_len is not None:  # (and a context the model cannot take)
            from waferline.spec.configs import spec_from_pretrained

            mpe = spec_from_pretrained(self.path).max_position_embeddings
            if not 1 <= max_model_len <= mpe:
                raise ConfigError(f"max_model_len {max_model_len} is outside 1..{mpe} (the model's "
                                  "max_position_embeddings: positions past it were never trained)")
        self.device = check_device(device)  # the single-process engine's (a pipeline's / AFD's: their processes')
        speculative, num_speculative_tokens = plan_run(pipeline_options, self.path, weight_bits, speculative,
                                                       num_speculative_tokens)  # (a Plan: its speculation, or refused)
        group_size = plan_group_size(pipeline_options.get("plan"), weight_bits, group_size)  # (given, plan's, 128)
        convert = {"weight_bits": weight_bits, "group_size": group_size, "head_bits": head_bits}  # (convert_loaded)
        check_speculative(self.path, speculative, num_speculative_tokens, self.tokenizer)  # (before any weights)
        dev_kw = {} if device is None else {"device": str(self.device)}
        # greedy decode on a GPU replays a captured step (engine/graphs.py) where the model allows one
        self.cuda_graphs = cuda_graphs
        self.graph_note: str | None = None  # why the last request decoded without a graph, if it did
        self._graphs_on_cpu = False  # tests run the static step (uncaptured) on CPU
        self._pipeline = None  # stages / layers_per_stage: run as a pipeline of processes (engine/pipeline/)
        self.arena = None  # where the single-process engine's weights went (model/arena.py), if they moved
        if wants_afd(pipeline_options):  # attention/FFN disaggregation: attention and FFN ranks (engine/afd/)
            from waferline.engine.afd import AFD

            if stages is not None or layers_per_stage is not None:
                raise ConfigError("afd runs without stages or layers_per_stage; drop those options (or drop afd / "
                                  "attention_ranks / ffn_ranks)")
            check_engine_options(pipeline_options, AFD_OPTIONS, "the AFD engine")
            self._pipeline = AFD(self.path, self.dtype, micro_batches=micro_batches, **dev_kw, **pipeline_options,
                                 convert=convert)  # (each rank converts its part of the model)
            self.model = None  # the layers live in the attention and FFN ranks
            self.spec = self._pipeline.spec
        elif stages is not None or layers_per_stage is not None or pipeline_options.get("plan") is not None:
            from waferline.engine.pipeline import Pipeline

            check_engine_options(pipeline_options, PIPELINE_OPTIONS, "a pipeline")
            self._pipeline = Pipeline(self.path, self.dtype, stages=stages, layers_per_stage=layers_per_stage,
                                      micro_batches=micro_batches, **dev_kw, **pipeline_options,
                                      convert=convert)  # (each stage converts its own layers)
            self.model = None  # the layers live in the stages; stage 0's slice is self._pipeline.runner.model
            self.spec = self._pipeline.spec
        else:
            if micro_batches is not None or pipeline_options:
                raise ConfigError("micro_batches and pipeline options need stages=S or layers_per_stage=K")
            from waferline.model.quant import convert_loaded, loading_for, move_model

            with loading_for(self.device):  # (an int4 checkpoint bound for a GPU keeps codes move_model can read)
                self.model = load_model(self.path, self.dtype)
            self.spec = self.model.spec
            if self.device.type != "cpu":  # before quantizing: int4 weights are packed for the device they sit on
                move_model(self.model, self.device)
            # RTN int4 on load (a 16-bit checkpoint), the MTP drafter's head in int4 where the layers are, int8 head
            convert_loaded(self.model, **convert)
            # the weights in transparent huge pages (model/arena.py: a decode step streams them; 1.02-1.11x measured)
            self.arena = move_to_huge_pages(self.model) if huge_pages and self.device.type == "cpu" else None
        self.eos_token_ids = eos_ids(self.path, self.spec.hf_config, self.tokenizer)
        self.max_model_len = max_model_len or self.spec.max_position_embeddings
        self._speculative = (speculative, num_speculative_tokens, speculative_adaptive) if speculative else None
        self._spec: Any = None  # speculative decoding (engine/speculative/serving.py): "ngram" | "mtp" | "draft:PATH"
        self._scheduler: Any = None  # the Scheduler requests run through (made at the first request)
        self._calls = threading.Lock()  # one call at a time: calls from other threads wait their turn (_one_call)
        self._caller: int | None = None  # the thread whose call holds it
        self._request_ids = itertools.count()  # (a request id is never reused while its pages may be held)
        if speculative and self._pipeline is None:
            self._spec = ServeSpeculation(self.model, self.model.new_caches(1, self.device), 1, speculative,
                                          num_speculative_tokens, speculative_adaptive)
        if self._pipeline is not None:
            try:
                self._engine(1)  # the runner over the processes, and its speculation: a bad option fails here
            except BaseException:
                self._pipeline.close()
                raise

    # -- tokens
    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``, with the tokenizer's special tokens (a BOS where it adds one), as transformers
        and the server's completions encode a text prompt."""
        if self.tokenizer is None:
            raise RequestError(f"{self.path} has no tokenizer (tokenizer.json); pass prompts as lists of token ids")
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int], skip_special_tokens: bool = True, after: list[int] | tuple = ()) -> str:
        """The text of token ids ("" for a checkpoint without a tokenizer); ``after``: the tokens they follow (an
        output's: its prompt), whose text is decoded with them and taken off, so a tokenizer that strips the space of a
        text's first token (SentencePiece's "▁Hello") keeps an output's first space, as vLLM does. Of the last
        ``CONTEXT_TOKENS`` of ``after``, the shortest tail whose text is not empty (a special token skipped, a lone
        "▁") and does not end inside a character (the prompt's last character in byte-fallback pieces) is taken. No
        clean-up of spaces (as vLLM): it takes back a space a stream sent ("it '" then "s" reads "it's")."""
        if self.tokenizer is None:
            return ""
        after = after[-CONTEXT_TOKENS:]
        if after and ids:
            for k in range(1, len(after) + 1):
                pre = decode_text(self.tokenizer, list(after[-k:]), skip_special_tokens)
                if pre and not pre.endswith("\ufffd"):
                    full = decode_text(self.tokenizer, list(after[-k:]) + list(ids), skip_special_tokens)
                    if full.startswith(pre):  # (else: a character split across them)
                        return full[len(pre):]
                    break
        return decode_text(self.tokenizer, list(ids), skip_special_tokens)

    def output_text(self, ids: list[int], skip_special_tokens: bool = True, context: list[int] | tuple = ()) -> str:
        """A finished output's text: ``ids`` decoded after the prompt's last tokens ``context`` (``decode``'s
        ``after``). Where it ends inside a character (cut by max_tokens), the characters before that one are decoded
        apart from its bytes: a byte-fallback decoder (SentencePiece's "<0xE4>" pieces) turns every byte of a run of
        such pieces that is not whole UTF-8 into U+FFFD, so decoded together the whole characters before it would read
        U+FFFD too, unlike the text streamed as it came."""
        text = self.decode(ids, skip_special_tokens, context)
        if not text.endswith("\ufffd"):
            return text
        for j in range(len(ids) - 1, max(len(ids) - 4, 1) - 1, -1):  # (a character's bytes: at most 4 tokens)
            head = self.decode(ids[:j], skip_special_tokens, context)
            if not head.endswith("\ufffd"):
                split = head + self.decode(ids[j:], skip_special_tokens)
                return split if split.count("\ufffd") < text.count("\ufffd") else text
        return text

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(is_token_id(t) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise RequestError(f"a prompt is a string or a list of integer token ids, got {shown(prompt)}")
        if not ids:
            raise RequestError("empty prompt: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {self.spec.vocab_size}): {bad[:5]}")
        return ids

    # -- engine
    @contextlib.contextmanager
    def _one_call(self) -> Iterator[None]:
        """Hold the LLM for one call. A call from another thread waits for it; a call from the thread that holds it
        (a ``stream`` still open there) is refused: it would wait for itself."""
        me = threading.get_ident()
        if self._caller == me:
            raise RequestError("this LLM is already running a call in this thread (a stream() not read to the end?): "
                               "finish or close() that stream first; for requests that interleave, use `waferline "
                               "serve`")
        with self._calls:
            self._caller = me
            try:
                yield
            finally:
                self._caller = None

    def prompt_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """log_softmax of the logits at every prompt position: a [len, vocab] fp32 tensor."""
        ids = self._prompt_ids(token_ids)
        self._check_len(len(ids), 0)
        with self._one_call():
            return self._prompt_logprobs(ids)

    @torch.inference_mode()
    def _prompt_logprobs(self, ids: list[int]) -> torch.Tensor:
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

    def perplexity(self, token_ids: list[int] | str, window: int = 256) -> float:
        """exp(mean NLL) over consecutive windows of ``window`` predicted tokens, each window scored from scratch;
        ``token_ids``: token ids, or a text (encoded as ``encode`` encodes it)."""
        if isinstance(token_ids, str):
            token_ids = self.encode(token_ids)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise RequestError(f"perplexity window must be an integer >= 1, got {window!r}")
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
            n = counted(prompt_len, "token")
            raise RequestError(f"prompt of {n} + max_tokens {max_tokens} exceeds the model's context of "
                               f"{self.max_model_len} tokens; shorten the prompt or lower max_tokens")

    def generate(self, prompts: list[str] | list[list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Output]:
        """Prefill every prompt, then decode them together as one batch until each stops. ``params``: one for every
        prompt, or a list, one per prompt. A seeded request samples its own stream: its tokens do not depend on the
        other prompts in the batch or on its place among them (as ``waferline serve`` samples it)."""
        results: list[Output] = []
        for event in self.stream(prompts, params):
            if isinstance(event, list):
                results = event
        return results

    def stream(self, prompts: list[str] | list[list[int]] | str,
               params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[Any]:
        """Like ``generate`` but yields ``(row, token_id)`` as each token is sampled, then the list of Outputs."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_token_id(prompts[0])):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(f"prompts must be a string, list of token ids or a list of those, got {shown(prompts)}")
        ids = [self._prompt_ids(p) for p in prompts]
        if isinstance(params, (list, tuple)):
            if len(params) != len(ids):
                raise RequestError(f"{len(params)} SamplingParams for {counted(len(ids), 'prompt')}: give one, or one "
                                   "per prompt")
            per = list(params)
        else:
            per = [params or SamplingParams()] * len(ids)
        if not all(isinstance(p, SamplingParams) for p in per):
            raise RequestError(f"params must be a SamplingParams or a list of them, got {shown(params)}")
        for p, prm in zip(ids, per):
            prm.validate()
            self._check_len(len(p), prm.max_tokens)
        return self._stream(ids, per) if ids else iter([[]])

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
                model, caches = runner.prepare_speculation(self._speculative[0])
                self._spec = ServeSpeculation(model, caches, rows, *self._speculative)
            k = self._spec.k_max if self._spec is not None else 0
            cfg = SchedulerConfig(max_num_seqs=rows, max_model_len=self.max_model_len, chunk_tokens=self.max_model_len,
                                  max_num_batched_tokens=rows * (self.max_model_len + k + 1), max_queue=rows,
                                  prefix_caching=False, greedy_bursts=local)
            sch = self._scheduler = Scheduler(self, cfg, runner, speculation=self._spec)
        sch.cache.lowest_slots_first()  # (idle: row b is admitted to slot b, as on a fresh scheduler)
        return sch

    def _stream(self, ids: list[list[int]], per: list[SamplingParams]) -> Iterator[Any]:
        with self._one_call():
            yield from self._run(ids, per)

    @torch.inference_mode()
    def _run(self, ids: list[list[int]], per: list[SamplingParams]) -> Iterator[Any]:
        from waferline.engine.overlap import OverlapStepper, can_overlap

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
                seq = Sequence(str(next(self._request_ids)), p, params, lambda ev, b=b: events.append((b, ev)),
                               stream_text=False)
                seq.generator = request_generator(params)
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
                if getattr(runner.static, "dropped", None):
                    self.graph_note = f"captured, then run eagerly: {runner.static.dropped}"
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
            # (the ids that ended it: a structured output on a model whose config names no end-of-sequence token ends
            # at the tokenizer's, which the scheduler added to its own)
            stop_ids = set(s.stop_ids) if s.stop_ids is not None else set(params.stop_token_ids) | (
                set() if params.ignore_eos else self.eos_token_ids)
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
        text = self.output_text(toks[:-1] if reason == "stop" and toks and toks[-1] in stop_ids else toks,
                                params.skip_special_tokens, prompt_ids)
        if params.stop and reason == "stop" and toks and toks[-1] not in stop_ids:  # (as the scheduler cut it)
            # (the text of the first min_tokens - 1 tokens as the scheduler had it: the tokens whose text ends inside a
            # character, U+FFFD in this decode, were held back there, all of their text: " \xc3" of " é" too)
            head = toks[:max(params.min_tokens - 1, 0)]
            while head and (shown := self.decode(head, params.skip_special_tokens, prompt_ids)).endswith("\ufffd"):
                head = head[:-1]
            after = len(shown) if head else 0
            cut = stop_cut(text, params.stop, after)
            text = text if cut is None else text[:cut]
        return Output(prompt_ids, toks, text, reason, dict(metrics))

    def time_split(self, reset: bool = True) -> dict[str, Any]:
        """AFD (``afd=True``): seconds of compute / transfer / idle per rank since the last reset, and per side."""
        split = getattr(self._pipeline, "time_split", None)
        if split is None:
            raise ConfigError("time_split measures attention/FFN disaggregation: build the LLM with afd=True")
        return split(reset)

    def close(self) -> None:
        """Stop the pipeline's stage processes (no-op for the single-process engine)."""
        if self._pipeline is not None:
            self._pipeline.close()
        self._scheduler = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
