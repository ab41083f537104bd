"""Sampling parameters and token selection: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import json
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from waferline import kernels
from waferline.errors import ConfigError, RequestError

# greedy decode runs this many steps back to back (one program) when nothing else needs the host in between
GREEDY_BURST = 8
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from its name in DTYPES (ConfigError naming the choices otherwise) or as given."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def seeded_generator(params: SamplingParams, row: int) -> torch.Generator | None:
    """Row ``row``'s generator of a seeded sampled batch (None when greedy): every engine seeds rows this way, so a
    seeded request gives the same tokens whichever engine runs it."""
    if params.temperature == 0:
        return None
    g = torch.Generator()
    g.manual_seed(int(params.seed) * 1_000_003 + row)
    return g


def decode_metrics(t0: float, ttft: float, n_generated: int, rows: int) -> dict[str, float]:
    """TTFT, total time and decode tokens/s (the first token of each row belongs to the prefill)."""
    total = time.perf_counter() - t0
    decode_time = max(total - ttft, 1e-9)
    rate = (n_generated - rows) / decode_time if n_generated > rows else 0.0
    return {"ttft_s": ttft, "total_s": total, "decode_tokens_per_s": rate}

# Below this temperature, logits / T overflows to inf for ordinary logits (and the softmax becomes NaN); sampling that
# cold is the argmax anyway, so such temperatures are greedy.
MIN_TEMPERATURE = 1e-5
# seeds are taken modulo 2**32: torch's CPU generator keeps the low 32 bits of its seed (seed * 1_000_003 + row: an odd
# multiplier, so distinct seeds below 2**32 give distinct streams), and seeds 2**32 apart would give the same tokens
MAX_SEED = 2**32
_TOP_K_OFF = 2**31  # no vocabulary is this large: a top_k at or beyond it keeps every token, as top_k = 0 does
MAX_LOGPROBS = 20  # most alternatives a token's log-probabilities list (OpenAI's top_logprobs bound)
MAX_LOGIT_BIAS = 300  # most entries of a logit_bias (OpenAI's bound)


def _show(value: object) -> str:
    """A value for an error message, cut short (a request can carry a 4000-digit number)."""
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise RequestError(f"{name} must be an integer, got {_show(value)}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise RequestError(f"{name} must be an integer, got {_show(value)}") from None


def _number(name: str, value: object) -> float:
    if isinstance(value, (bool, str, bytes)):  # (float() would take "1.5" or True)
        raise RequestError(f"{name} must be a number, got {_show(value)}")
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # (OverflowError: an int beyond the float range)
        raise RequestError(f"{name} must be a finite number, got {_show(value)}") from None
    if not math.isfinite(x):
        raise RequestError(f"{name} must be a finite number, got {_show(value)}")
    return x


STRUCTURED = ("json_object", "json_schema", "regex", "choice", "grammar")  # SamplingParams' structured outputs


@dataclass
class SamplingParams:
    """How to continue a prompt. ``temperature == 0`` is greedy (as is any temperature below ``MIN_TEMPERATURE``);
    ``seed`` makes sampling reproducible per request. ``logprobs``: None (off) or N in 0..20: every generated token
    comes with its log-probability under the model (log-softmax of the raw logits, before temperature, top-k and
    top-p) and the N most likely tokens' (``token_logprobs``); ``prompt_logprobs`` likewise for every prompt token
    after the first (the prompt is then computed whole: no cached prefix). ``presence_penalty`` /
    ``frequency_penalty`` (OpenAI's, on the generated tokens), ``repetition_penalty`` (on prompt and generated tokens)
    and ``logit_bias`` (token id -> added to its logit) change the logits before sampling (``adjust_logits``), as does
    ``min_tokens`` (the stop token ids cannot be drawn before that many tokens, and a stop string in their text
    does not end it); ``min_p`` (0-1) drops the tokens less likely than min_p times the likeliest
    (``target_probs``). Structured output (engine/structured.py; at most one):
    ``json_object`` (JSON mode: one JSON object), ``json_schema`` (a JSON Schema, as a dict or its JSON text),
    ``regex``, ``choice`` (one of these strings), ``grammar`` (Lark, or GBNF): only tokens that keep the output a
    prefix of such a text are drawn, and the end-of-sequence token only where the text is whole (a stop token id
    that is also text the grammar allows may end it sooner, as any stop token does; ``min_tokens`` gives way where
    only stop tokens may follow). ``skip_special_tokens`` False: the output's text keeps special tokens other than
    its stop token (a tool-call parser reads tags that are special).
    Checked when constructed (``RequestError``) and again by ``validate`` when used, since the fields can be changed in
    between."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    min_tokens: int = 0
    json_object: bool = False
    json_schema: dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit_bias change the logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.structured is not None)

    @property
    def structured(self) -> str | None:
        """The structured output asked for: "json_object", "json_schema", "regex", "choice" or "grammar" (or None)."""
        return next((name for name in STRUCTURED if getattr(self, name) not in (None, False)), None)

    @property
    def needs_logits(self) -> bool:
        """Its rows need the logits, not an argmax alone (log-probabilities, or logits changed before sampling): they
        decode plainly, without drafts or greedy bursts."""
        return self.logprobs is not None or self.adjusts_logits

    def validate(self) -> None:
        """Raise RequestError for a value sampling cannot use; normalise the rest (a stop string to a list, a tiny
        temperature to 0, a top_k beyond any vocabulary to 0)."""
        self.max_tokens = _integer("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {_show(self.max_tokens)}")
        t = _number("temperature", self.temperature)
        if t < 0:
            raise RequestError(f"temperature must be >= 0, got {_show(self.temperature)}")
        self.temperature = 0.0 if t < MIN_TEMPERATURE else t
        p = _number("top_p", self.top_p)
        if not 0 < p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {_show(self.top_p)}")
        self.top_p = p
        self.top_k = _integer("top_k", self.top_k)
        if self.top_k < -1:
            raise RequestError(f"top_k must be >= 0 (0 or -1 = off), got {_show(self.top_k)}")
        if self.top_k >= _TOP_K_OFF or self.top_k == -1:  # (-1: vLLM's and transformers' "off")
            self.top_k = 0
        if self.seed is not None:
            self.seed = _integer("seed", self.seed)
            if not -2**63 <= self.seed < 2**64:
                raise RequestError(f"seed must be a 64-bit integer, got {_show(self.seed)}")
            self.seed %= MAX_SEED  # (what the generator keeps of it; seeds below 2**32 are kept as given)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop or [], (list, tuple)) or not all(isinstance(s, str) for s in self.stop or []):
            raise RequestError(f"stop must be a string or a list of strings, got {_show(self.stop)}")
        self.stop = list(self.stop or [])
        if any(not s for s in self.stop):  # (an empty string would match before every character)
            raise RequestError("stop strings must not be empty")
        if not isinstance(self.stop_token_ids or [], (list, tuple)):
            raise RequestError(f"stop_token_ids must be a list of integers, got {_show(self.stop_token_ids)}")
        self.stop_token_ids = [_integer("stop_token_ids", t) for t in self.stop_token_ids or []]
        if any(t < 0 for t in self.stop_token_ids):
            bad = [t for t in self.stop_token_ids if t < 0]
            raise RequestError(f"stop_token_ids must be >= 0, got {_show(bad[:5])}")
        if not isinstance(self.ignore_eos, bool):  # (a truthy "false" would run every request to max_tokens)
            raise RequestError(f"ignore_eos must be true or false, got {_show(self.ignore_eos)}")
        self._validate_structured()
        if not isinstance(self.skip_special_tokens, bool):
            raise RequestError(f"skip_special_tokens must be true or false, got {_show(self.skip_special_tokens)}")
        self.min_p = _number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {_show(self.min_p)}")
        self.min_tokens = _integer("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {_show(self.min_tokens)}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _number(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {_show(v)}")
            setattr(self, name, v)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty)
        if not 0.01 <= self.repetition_penalty <= 100.0:  # (below 0.01 a logit divided by it can pass fp32's range)
            raise RequestError(f"repetition_penalty must be in [0.01, 100], got {_show(self.repetition_penalty)}")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers, got "
                               f"{_show(self.logit_bias)}")
        bias = {}
        for t, v in self.logit_bias.items():
            t, v = _integer("logit_bias", t), _number("logit_bias", v)
            if t < 0 or not -100.0 <= v <= 100.0:
                raise RequestError(f"logit_bias maps token ids >= 0 to values in [-100, 100], got {t}: {_show(v)}")
            bias[t] = v
        self.logit_bias = bias
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                n = _integer(name, getattr(self, name))
                if not 0 <= n <= MAX_LOGPROBS:
                    raise RequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {_show(n)}")
                setattr(self, name, n)

    def _validate_structured(self) -> None:
        if not isinstance(self.json_object, bool):
            raise RequestError(f"json_object must be true or false, got {_show(self.json_object)}")
        if isinstance(self.json_schema, str):
            try:
                self.json_schema = json.loads(self.json_schema)
            except ValueError as e:
                raise RequestError(f"json_schema is not valid JSON: {e}") from None
            except RecursionError:  # (JSON text nested thousands of levels deep)
                raise RequestError("json_schema is nested too deeply") from None
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise RequestError(f"json_schema must be a JSON Schema object, got {_show(self.json_schema)}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v):
                raise RequestError(f"{name} must be a non-empty string, got {_show(v)}")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not (isinstance(self.choice, list) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise RequestError(f"choice must be a non-empty list of non-empty strings, got {_show(self.choice)}")
        asked = [n for n in STRUCTURED if getattr(self, n) not in (None, False)]
        if len(asked) > 1:
            raise RequestError(f"at most one structured output per request; got {' and '.join(asked)}")
        if asked and self.ignore_eos:
            raise RequestError(f"{asked[0]} cannot be combined with ignore_eos: the output ends where the "
                               f"{asked[0].replace('_', ' ')} is whole")


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the model and the ``top`` most likely tokens' (id, log-probability),
    most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token: int, n: int) -> TokenLogprobs:
    """The log-softmax of ``logits`` [V] (fp32) at ``token``, and its ``n`` largest entries."""
    return rows_logprobs(logits.reshape(1, -1), [token], n)[0]


def rows_logprobs(logits: torch.Tensor, tokens: list[int], n: int) -> list[TokenLogprobs]:
    """``token_logprobs`` of each row of ``logits`` [T, V] at ``tokens[t]`` (log-softmax rows stay as they are)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).reshape(-1, 1))[:, 0].tolist()
    if n <= 0:
        return [TokenLogprobs(t, c) for t, c in zip(tokens, chosen)]
    vals, idx = torch.topk(lp, min(n, lp.shape[-1]), dim=-1)
    return [TokenLogprobs(t, c, tuple(zip(i, v))) for t, c, i, v in zip(tokens, chosen, idx.tolist(), vals.tolist())]


def adjust_logits(logits: torch.Tensor, params: SamplingParams, seq: Any) -> torch.Tensor:
    """The logits sampling draws from, fp32 [V], for the request ``seq`` (its ``prompt_ids``, ``output_ids``,
    ``stop_ids`` and structured-output ``constraint``): ``logit_bias`` added, then the repetition penalty on every
    token of the prompt and the output (a positive logit divided by it, a negative one multiplied, as transformers and
    vLLM do), then OpenAI's penalties on the output's tokens (logit - frequency x count - presence x [count > 0]);
    before ``min_tokens`` output tokens, the stop ids at -inf; with a structured output, every token that would not
    continue it."""
    prompt_ids, output_ids, stop_ids = seq.prompt_ids, seq.output_ids, seq.stop_ids
    x = logits.reshape(-1).float().clone()
    constraint = getattr(seq, "constraint", None)
    allowed = constraint.allowed().to(x.device) if constraint is not None else None
    if len(output_ids) < params.min_tokens and stop_ids:
        stops = torch.tensor(sorted(t for t in stop_ids if t < x.numel()), device=x.device, dtype=torch.long)
        if allowed is None or allowed.index_fill(0, stops, False).any():  # (a whole text that can only end: it ends)
            x[stops] = float("-inf")
    if params.logit_bias:  # (first, as vLLM and transformers add it: the repetition penalty then scales the sum)
        x[torch.tensor(list(params.logit_bias), device=x.device)] += torch.tensor(
            list(params.logit_bias.values()), device=x.device)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), device=x.device)
        v = x[seen]
        x[seen] = torch.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, device=x.device), minlength=x.numel())[:x.numel()].float()
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if allowed is not None:
        x = x.masked_fill(~allowed, float("-inf"))
    return x


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g


def greedy(logits: torch.Tensor) -> list[int]:
    """The argmax over the last dimension of logits [..., V], as (nested) Python ints: torch.argmax's indices (the
    first largest; a NaN first), by waferline::argmax_rows for fp32 CPU logits (one vector pass instead of ATen's
    reduction, ~35 us a step for a 32000-token vocabulary), else by torch.argmax."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() >= 1 and kernels.available():
        return torch.ops.waferline.argmax_rows(logits).tolist()
    return logits.argmax(-1).tolist()


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None, seq: Any = None) -> int:
    """Pick one token from fp32 logits [V] for the request ``seq`` (what ``adjust_logits`` reads of it, where the
    params change the logits; its structured-output constraint then takes the token)."""
    if params.adjusts_logits:
        logits = adjust_logits(logits, params, seq)
    tok = greedy(logits.reshape(-1)) if params.temperature == 0 else draw(target_probs(logits, params), gen)
    constraint = getattr(seq, "constraint", None)
    if constraint is not None:
        constraint.advance(tok)
    return tok


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One index drawn from the weights ``probs`` [V] (non-negative, any positive sum) with one uniform u from ``gen``:
    the first index whose cumulative weight (fp64) exceeds u times the total. Exact up to fp64 rounding, and ~13x
    cheaper than ``torch.multinomial`` for one draw from 32000 weights on a CPU (0.06 against 0.8 ms)."""
    c = probs.reshape(-1).cumsum(0, dtype=torch.float64)
    total = float(c[-1])
    if not 0.0 < total < math.inf:  # (NaN too: logits of a broken row, or a temperature gone bad)
        raise RuntimeError(f"cannot sample: the probabilities sum to {total} (NaN, inf or no mass)")
    u = float(torch.rand(1, generator=gen, dtype=torch.float64, device=c.device))
    return min(int(torch.searchsorted(c, u * total, right=True)), c.numel() - 1)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T) restricted by top-k, then min-p (tokens below min_p
    times the likeliest's probability dropped), then top-p, renormalised."""
    # (a temperature beyond fp32's range would make it inf, and a masked -inf logit over it NaN)
    x = logits.float() / min(params.temperature, torch.finfo(torch.float32).max)
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    # min-p and top-p read the tokens' order off the scaled logits, not the probabilities: at a hot temperature
    # (1e8) every probability rounds to the same fp32 value while the scaled logits still differ
    if params.min_p > 0.0:  # (p < min_p x the likeliest's p, as x - max(x) < log(min_p))
        probs = probs.masked_fill(x - x.amax(-1, keepdim=True) < math.log(params.min_p), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.top_p < 1.0:
        idx = torch.argsort(x, dim=-1, descending=True)
        sp = probs.gather(-1, idx)
        cum = sp.cumsum(-1)
        drop = cum - sp >= params.top_p  # keep the smallest prefix whose mass reaches top_p (not a token more)
        drop[..., 0] = False  # (the likeliest always: a top_p below fp32's least positive value compares as 0)
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
