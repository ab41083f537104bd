"""Structured outputs: a request's output held to a JSON object (JSON mode), a JSON Schema, a regular expression, one
of a list of strings, or a context-free grammar (Lark, or GBNF as llama.cpp writes it).

The grammar engine is llguidance (the library vLLM's and llama.cpp's structured outputs use): ``grammar_of`` turns a
request's ``SamplingParams`` into an llguidance grammar and checks it (``RequestError`` with the library's reason:
the server answers 400 before the request queues); ``constraint`` makes one request's ``GrammarConstraint`` over the
model's tokenizer: ``allowed()`` (bool [V]) before a token is drawn, ``advance(token)`` after. The tokenizer's
vocabulary is read into llguidance once per tokenizer (22 ms for sol-mini's 4,096 tokens; ~1 s for a large
vocabulary, by llguidance's own estimate) and kept.

The output's end: the stop tokens (end-of-sequence and ``stop_token_ids``) may be drawn where the grammar is complete
(or where one is text the grammar allows), and once nothing else can follow they are all that may be; special tokens
never enter the output. ``min_tokens`` gives way where the text is whole and nothing else can follow. JSON is compact
(``JSON_OPTIONS``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import math
import re
import threading
import time
from typing import Any

import numpy as np
import torch

from waferline.engine.schema_cost import refuse_costly_schema, refuse_crashing_lark, refuse_crashing_numbers
from waferline.errors import RequestError, counted

# between JSON tokens at most one space: compact JSON, not the runs of whitespace and line breaks that models which
# have seen little JSON fall into when any whitespace is allowed. A schema whose "x-guidance" (llguidance's JSON
# options) says how it wants whitespace keeps its own way: {"whitespace_flexible": true} allows any, as RFC 8259 does.
JSON_OPTIONS = {"whitespace_pattern": r"[ ]?"}
_LOCK = threading.Lock()
_TOKENIZERS: dict[int, tuple[Any, Any, dict[str, int]]] = {}  # id(HF tokenizer) -> (it, ``_ll_tokenizer``'s)
# (id(LLTokenizer), grammar text) -> (the LLTokenizer, a matcher not yet advanced): the server builds a request's
# matcher while it checks the request, off the engine's thread, and the engine takes a copy (``_matcher``); building
# one can take seconds (a schema of a few hundred patternProperties), which every stream would wait for
_PROTOTYPES: collections.OrderedDict[tuple[int, str], tuple[Any, Any]] = collections.OrderedDict()
_MAX_PROTOTYPES = 16
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
# a Lark grammar's comments, strings and regular expressions (llguidance's lexer's), and the tokens it names ("<x>")
_LARK_NAMES = re.compile(r'(?:#|//)[^\n]*|"(?:\\.|[^"\\])*"|/(?:\\.|[^/\\])+/|(?P<name><[^<>\s]+>)')
# The grammar engine builds a grammar recursively, a few KB of stack for each rule a chain of rule references passes
# and each bracket it opens (a chain of 3,000 Lark rules, or of 900 JSON Schema $refs, overflowed a thread's 8 MiB and
# killed the process): grammars are built on a thread with this much stack (reserved, not used unless needed), and a
# Lark grammar (or GBNF, as Lark) longer than MAX_LARK_CHARS, whose rules could chain deeper than it holds, is refused.
# (A JSON Schema's size is bounded by the grammar engine's own limit, "schema too large", well within it.)
GRAMMAR_STACK_BYTES = 256 << 20
MAX_LARK_CHARS = 128 * 1024
_STACK_LOCK = threading.Lock()


def _literal(text: str) -> str:
    """``text`` as a regular expression that matches it alone (llguidance reads Rust's regex syntax)."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def _deep(fn: Any, *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)`` (what builds a grammar) on a thread of its own with ``GRAMMAR_STACK_BYTES`` of stack: its
    result, or what it raised."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            box["err"] = e

    with _STACK_LOCK:  # (the stack size is the process's setting for the threads started next)
        before = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            t = threading.Thread(target=run, name="waferline-grammar", daemon=True)
            t.start()
        finally:
            threading.stack_size(before)
    t.join()
    if "err" in box:  # (taken out of the box: kept there, the error's traceback, through the thread's frame, would hold
        # the box and so itself, a cycle that keeps the grammar engine's state, hundreds of MB, until a full collection)
        raise box.pop("err")
    return box["out"]


def _engine_error(matcher: Any) -> str:
    """The grammar engine's reason, its first line (not the parser state it dumps after it)."""
    return (matcher.get_error() or "unknown error").strip().splitlines()[0][:200]


def _grammar_text(kind: str, value: str) -> str:
    """``value``: the regex or grammar text, or the JSON of the schema or choices."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        schema = json.loads(value)  # (a schema that says how it wants whitespace keeps its own way)
        own = schema.get("x-guidance") if isinstance(schema, dict) else None
        spaced = isinstance(own, dict) and ("whitespace_flexible" in own or "whitespace_pattern" in own)
        return LLMatcher.grammar_from_json_schema(value, defaults=None if spaced else JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":  # (one regular expression: a lexer, not a parser, so thousands of choices cost no more)
        return LLMatcher.grammar_from_regex("(" + "|".join(_literal(c) for c in json.loads(value)) + ")")
    try:  # (GBNF, llama.cpp's grammar format, its rules written "::=", is translated to Lark; Lark is kept as it is,
        # whatever its start rule's modifier: "?start:" and "!start:" are Lark too, and a "::=" in its strings,
        # regular expressions or comments is their text)
        text = gbnf_to_lark(value) if "::=" in _LARK_NAMES.sub("", value) else value
    except Exception as e:
        raise RequestError(f"grammar cannot be used: neither Lark nor a GBNF grammar llguidance reads "
                           f"({str(e)[:300]})") from None
    if len(text) > MAX_LARK_CHARS:
        raise RequestError(f"grammar cannot be used: {len(text)} characters (as Lark), at most {MAX_LARK_CHARS}")
    refuse_crashing_lark(text)
    return LLMatcher.grammar_from_lark(text)


def grammar_of(params: Any) -> str | None:
    """The llguidance grammar of the structured output ``params`` asks for (None where none); RequestError where the
    schema, expression or grammar cannot be used. Kept for the last 64 asked (a request's is checked when it arrives
    and again when the engine takes it)."""
    return None if params.structured is None else _checked(params)[0]


def _checked(params: Any) -> tuple[str, bool]:
    """``_checked_grammar`` of what ``params`` asks for (a value as JSON text in key order: a schema's properties come
    in its order)."""
    value = getattr(params, params.structured)
    return _checked_grammar(params.structured, value if isinstance(value, str) else json.dumps(value))


def check_tokens(tokenizer: Any, params: Any, lock: Any = None) -> None:
    """RequestError where ``params``' grammar names tokens (which ``grammar_of`` leaves to the model's tokenizer) that
    ``tokenizer`` lacks: the server asks before the request queues, so that a stream starts with a 400, not an
    error event. It builds the request's matcher here, on the server's thread, and keeps it for the engine to copy
    (``constraint``)."""
    if params.structured is None or tokenizer is None:
        return
    _matcher(tokenizer, params, lock)


def _matcher(tokenizer: Any, params: Any, lock: Any) -> tuple[Any, Any]:
    """(``tokenizer``'s LLTokenizer, a fresh matcher of ``params``' grammar over it): a copy of the one built for the
    same grammar before (kept for the last ``_MAX_PROTOTYPES``), else built and kept."""
    grammar, names_tokens = _checked(params)
    ll, names = _ll_tokenizer(tokenizer, lock)
    text = _named_by_id(grammar, names) if names_tokens else grammar
    key = (id(ll), text)
    with _LOCK:
        hit = _PROTOTYPES.get(key)
        if hit is not None and hit[0] is ll:
            _PROTOTYPES.move_to_end(key)
            return ll, hit[1].deep_copy()
    from llguidance import LLMatcher

    proto = _matcher_or_error(params.structured, _deep(LLMatcher, ll, text, log_level=0))
    with _LOCK:
        _PROTOTYPES[key] = (ll, proto)
        while len(_PROTOTYPES) > _MAX_PROTOTYPES:
            _PROTOTYPES.popitem(last=False)
        return ll, proto.deep_copy()


def _named_by_id(grammar: str, names: dict[str, int]) -> str:
    """A Lark ``grammar`` with the tokens it names that are text in this tokenizer (``names``: Qwen's "<tool_call>")
    named by id ("<[151657]>"): llguidance finds a token by its name among special tokens alone. Strings, regular
    expressions and comments stay as they are."""
    if not names:
        return grammar
    return _LARK_NAMES.sub(lambda m: f"<[{names[m[0]]}]>" if m["name"] in names else m[0], grammar)


def _matcher_or_error(kind: str, matcher: Any) -> Any:
    if matcher.is_error():
        raise RequestError(f"{kind} cannot be used with this tokenizer: {matcher.get_error()[:400]}")
    return matcher


@functools.lru_cache(maxsize=64)
def _checked_grammar(kind: str, value: str) -> tuple[str, bool]:
    return _deep(_check_grammar, kind, value)


def _check_grammar(kind: str, value: str) -> tuple[str, bool]:
    from llguidance import LLMatcher

    schema = None
    try:
        if kind == "json_schema":
            schema = json.loads(value)
            refuse_crashing_numbers(schema)
            refuse_costly_schema(schema)
        grammar = _grammar_text(kind, value)
    except (ValueError, TypeError) as e:
        raise RequestError(f"{kind} cannot be used: {str(e)[:300]}") from None
    err = LLMatcher.validate_grammar(grammar)
    if err and not err.startswith("WARNING"):
        raise RequestError(f"{kind} cannot be used: {err.strip()[:400]}")
    held = _bound_let_through(schema) if schema is not None else None
    if held is not None:
        raise RequestError(f"{kind} cannot be used: the grammar engine would let {held[0]} through {held[1]} "
                           f"({held[2]})")
    # a grammar no text starts (e.g. the regex "[a&&b]") is valid, and found only by a matcher: one over single bytes
    # (~1 ms) finds it here, before the request queues, whatever the model's tokenizer; and one whose every text comes
    # to a dead end within a few bytes (as in 'start: "x" /[a&&b]/', or a rule that never ends), by ``_dead_end``. A
    # grammar that names tokens ("<[300]>", "<|python_tag|>") is left to the model's tokenizer (``check_tokens``):
    # they are its tokens, not the byte vocabulary's (whose "<[256]>" and "<end>" are its end token, no text)
    if kind == "grammar" and any(m["name"] for m in _LARK_NAMES.finditer(grammar)):
        return grammar, True
    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        return grammar, True
    mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    if matcher.is_error() or not (mask.any() or matcher.is_accepting()):
        raise RequestError(f"{kind} cannot be used: no text holds to it (the grammar engine finds no first byte)")
    dead = _dead_end(matcher, mask)
    if dead is not None:
        text, why = dead
        raise RequestError(f"{kind} cannot be used: " + (
            f"the grammar engine cannot go on after {text!r} ({why})" if why else
            f"no text holds to it (every text it starts comes to a dead end, as {text!r} does)"))
    return grammar, False


def _bound_let_through(schema: Any) -> tuple[str, str, str] | None:
    """A number the grammar engine would let through ``schema`` that the part of it it is in refuses: its text, that
    part's bounds (and const or enum) as JSON, and why; else None. Each candidate is asked about over single bytes
    (~1 ms), so an engine that holds to the schema refuses nothing. llguidance lets an exclusive integer bound through
    where no integer lies inside the range and it is the bound nearer zero ({"exclusiveMinimum": 0, "maximum": 0.5}
    allowed 0, {"minimum": -1.5, "exclusiveMaximum": -1} -1); and it reads bounds as f64 and an integer's range as i64,
    so past 2^53 an integer bound or const moves ({"minimum": 9007199254740993} allowed 9007199254740992) and past
    2^63 it stops at the i64 ({"type": "integer", "minimum": 1e19, "maximum": 2e19} allowed 9223372036854775807)."""
    from llguidance import LLMatcher

    keys, asked, nodes = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"), set(), [schema]
    while nodes:
        node = nodes.pop()
        if isinstance(node, list):
            nodes += node
            continue
        if not isinstance(node, dict):
            continue
        nodes += node.values()
        lo = {k: v for k in ("minimum", "exclusiveMinimum") if _finite(v := node.get(k))}
        hi = {k: v for k in ("maximum", "exclusiveMaximum") if _finite(v := node.get(k))}
        for key, alone, ends in (("exclusiveMinimum", "minimum", lo), ("exclusiveMaximum", "maximum", hi)):
            if node.get(key) is True and alone in ends:  # (draft 4: a flag on the bound)
                ends[key] = ends.pop(alone)
        typed = [t for t in ([node["type"]] if isinstance(node.get("type"), str) else node.get("type", ["number"]))
                 if t in ("number", "integer")] if "type" in node else []
        values = [v for v in [node.get("const"), *(node.get("enum") if isinstance(node.get("enum"), list) else [])]
                  if _finite(v)] if typed else []
        probe = {k: node[k] for k in keys if k in node} | ({"const": node["const"]} if typed and _finite(
            node.get("const")) else {}) | ({"enum": values[:16]} if values and "enum" in node else {})
        texts = [str(math.floor(v)) for k, v in (lo | hi).items() if k.startswith("excl") and v == int(v)]
        texts += ["-0" for k, v in (lo | hi).items() if k.startswith("excl") and v == 0]
        kinds = ["number"]
        if any(abs(v) >= 2 ** 53 for v in [*lo.values(), *hi.values(), *values[:16]]):
            kinds = typed or ["number", "integer"]
            texts += [str(math.ceil(v) - 1 if k == "minimum" else math.floor(v)) for k, v in lo.items()]
            texts += [str(math.floor(v) + 1 if k == "maximum" else math.ceil(v)) for k, v in hi.items()]
            texts += [str(int(v) + d) for v in values[:16] if v == int(v) for d in (-1, 1)]
            texts += [str(int(float(v))) for v in [*lo.values(), *hi.values(), *values[:16]] if abs(v) < 2 ** 1000]
            texts += [str(2 ** 63 - 1), str(-(2 ** 63))]
        texts = [t for t in dict.fromkeys(texts) if _outside(int(t), lo, hi, values)]
        if not texts or (seen := json.dumps(probe, sort_keys=True)) in asked:
            continue
        asked.add(seen)
        for kind in kinds:
            try:  # (as JSON text: a dict's integer past 64 bits is "not JSON serializable" to llguidance)
                grammar = LLMatcher.grammar_from_json_schema(json.dumps(probe | {"type": kind}), defaults=JSON_OPTIONS)
            except (ValueError, TypeError):  # (bounds no number holds to: the whole schema's check says so)
                continue
            for text in texts:
                m = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
                if not m.is_error() and all(m.consume_token(b) for b in text.encode()) and m.is_accepting():
                    exact = kinds == ["number"] and abs(int(text)) < 2 ** 53
                    return text, json.dumps(probe), (
                        "an exclusive integer bound with no integer inside the range, which it does not hold to; an "
                        "inclusive bound it holds to" if exact else "it reads numbers as 64-bit floats and an "
                        "integer's range as 64-bit integers: exact to 2^53 (9007199254740992)")
    return None


def _finite(v: Any) -> bool:
    """``v`` is a JSON number (not a bool) other than an infinity or NaN; an integer of any size is one."""
    return type(v) is int or type(v) is float and math.isfinite(v)


def _outside(n: int, lo: dict[str, Any], hi: dict[str, Any], values: list[Any]) -> bool:
    """The integer ``n`` lies outside the bounds ``lo`` and ``hi`` (keyword -> number), or is none of ``values``."""
    return (any(n < v if k == "minimum" else n <= v for k, v in lo.items())
            or any(n > v if k == "maximum" else n >= v for k, v in hi.items()) or bool(values) and n not in values)


def _dead_end(matcher: Any, mask: np.ndarray, budget: int = 256, seconds: float = 0.05
              ) -> tuple[str, str | None] | None:
    """Where every text that ``matcher`` (over single bytes; ``mask``: its bitmask) starts comes to a dead end within
    ``budget`` bytes tried (~1 ms), shortest first: the longest of them, and the grammar engine's reason where it failed
    there (a limit, as in the regex "a{99999999}") rather than finding that nothing can follow; else (a whole text
    found, or the budget or ``seconds`` spent: most grammars, whose texts branch widely) None. The grammar engine has
    no check of its own that a grammar's rules end (Lark's 'y: "a" y') or that its patterns match something
    (/[a&&b]/) past the first byte."""
    frontier, dead = collections.deque([(matcher, ())]), ((), None)  # (texts as the byte vocabulary's token ids)
    until = time.perf_counter() + seconds
    while frontier:
        m, text = frontier.popleft()
        if m.is_accepting():
            return None
        if m is not matcher:
            mask = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(mask, count=256, bitorder="little")
        why = _engine_error(m) if m.is_error() else ""
        dead = max(dead, (text, None if why.startswith("NoExtension") else why), key=lambda d: len(d[0]))
        for b in [] if m.is_error() else np.flatnonzero(bits).tolist():
            budget -= 1
            if budget < 0 or time.perf_counter() > until:
                return None
            c = m.deep_copy()
            if c.consume_token(b):
                frontier.append((c, text + (b,)))
            else:  # (the grammar engine fails as it takes the byte)
                dead = max(dead, (text + (b,), _engine_error(c)), key=lambda d: len(d[0]))
    return _byte_tokenizer().decode_bytes(list(dead[0])).decode("utf-8", "replace"), dead[1]


@functools.cache
def _byte_tokenizer() -> Any:
    """An llguidance tokenizer of the 256 bytes (token b is the byte b) and an end token (256): every text is a
    sequence of its tokens, the text "<end>" too (not the end token, as a tokenizer that finds its added tokens in
    text would spell it)."""
    from llguidance import LLTokenizer

    return LLTokenizer(_Bytes(), eos_token=256)


class _Bytes:
    """The byte vocabulary (llguidance's TokenizerWrapper protocol): a text's tokens are its bytes."""

    is_tokenizer_wrapper = True
    tokens = [bytes([b]) for b in range(256)] + [b"<end>"]
    special_token_ids, eos_token_id, bos_token_id = [256], 256, None

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


class _Vocabulary:
    """``tokenizer``'s vocabulary as llguidance takes one from Python (its TokenizerWrapper protocol): each token's
    bytes as llguidance reads them from tokenizer.json (``read``), but only the tokenizer's special tokens special.
    llguidance alone takes every added token written "<...>" for a special one (not text), while its tokenizer splits
    the text "<tool_call>" into the added token: Qwen's non-special "<tool_call>" and "<think>" were allowed where the
    grammar forces that text, then refused. Here they are text (a grammar names them by id: ``names``), and the name
    of a special token ("<|eot_id|>") is text spelled in other tokens where a grammar forces it. Ids past the count
    of tokens (a vocabulary with holes), which llguidance does not read, keep their bytes."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer: Any, read: Any):
        from waferline.engine.token_bytes import byte_level_alphabet, token_bytes_of

        added = tokenizer.added_tokens_decoder
        special = set(tokenizer.all_special_ids) | {t for t, a in added.items() if a.special}
        ids = tokenizer.get_vocab().values()
        self.tokens = [read.decode_bytes([t]) for t in range(read.vocab_size)]
        self.tokens += [b""] * (max(ids, default=-1) + 1 - len(self.tokens))
        decoder = type(tokenizer.backend_tokenizer.decoder).__name__
        byte_level = byte_level_alphabet() if decoder == "ByteLevel" else None
        for t in [*added, *(t for t in ids if t >= read.vocab_size)]:  # (added text, and ids past the count of tokens)
            if t in special:
                self.tokens[t] = tokenizer.convert_ids_to_tokens(t).encode()
            else:  # (as the output's text has it: "▁<x>" is " <x>", and an added "x" the normalizer wrote "▁x" is " x")
                self.tokens[t] = token_bytes_of(tokenizer, t, byte_level, special) or (
                    b"" if t >= read.vocab_size or read.is_special_token(t) else self.tokens[t])
        self.special_token_ids = sorted(t for t in special if t < len(self.tokens))
        self.names = {a.content: t for t, a in added.items() if t not in special}
        self.eos_token_id, self.bos_token_id = read.eos_token, tokenizer.bos_token_id
        self._read, self._special = read, frozenset(self.special_token_ids)

    def __call__(self, text: str) -> list[int]:
        """``text``'s tokens, for the stretches a grammar forces: a special token's name is text there."""
        out: list[int] = []
        for t in self._read.tokenize_str(text):
            out += self._read.greedy_tokenize(self._read.decode_str([t])) if t in self._special else [t]
        if b"".join(self.tokens[t] for t in out) != text.encode("utf-8", "surrogatepass"):
            # (tokens whose bytes are not the text: a SentencePiece tokenizer reads the text's "▁" as its space mark,
            # and its piece "▁" is a space; the text's bytes, then)
            return self._read.greedy_tokenize(text)
        return out


def _ll_tokenizer(tokenizer: Any, lock: Any) -> tuple[Any, dict[str, int]]:
    """``tokenizer``'s llguidance LLTokenizer, and its added tokens that are text by name (``_Vocabulary``)."""
    with _LOCK, lock or contextlib.nullcontext():
        hit = _TOKENIZERS.get(id(tokenizer))
        if hit is None or hit[0] is not tokenizer:
            import llguidance.hf
            from llguidance import LLTokenizer

            try:
                read = llguidance.hf.from_tokenizer(tokenizer)
            except ValueError as e:  # (a slow, Python-only tokenizer; or a decoder llguidance does not read)
                if getattr(tokenizer, "backend_tokenizer", None) is None:
                    raise RequestError(f"structured output needs a fast (tokenizer.json) tokenizer: {e}") from None
                raise RequestError("structured output cannot use this tokenizer: the grammar engine cannot read its "
                                   f"vocabulary ({str(e)[:200]})") from None
            vocabulary = _Vocabulary(tokenizer, read)
            ll = LLTokenizer(vocabulary, eos_token=list(read.eos_tokens))
            if len(_TOKENIZERS) >= 4:
                _TOKENIZERS.clear()
            hit = _TOKENIZERS[id(tokenizer)] = (tokenizer, ll, vocabulary.names)
        return hit[1], hit[2]


class GrammarConstraint:
    """One request's structured output: ``allowed()`` (bool [V]) before a token is drawn, ``advance(token)`` after;
    ``complete`` once the output is a whole sentence of the grammar."""

    def __init__(self, matcher: Any, vocab_size: int, stop_ids: frozenset[int], grammar_eos: list[int]):
        self.matcher, self.vocab_size, self.stop_ids = matcher, vocab_size, stop_ids
        self.consumed = 0  # output tokens taken
        self._grammar_eos = [t for t in grammar_eos if t not in stop_ids and t < vocab_size]
        self._stops = torch.tensor(sorted(t for t in stop_ids if t < vocab_size), dtype=torch.long)

    def allowed(self) -> torch.Tensor:
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if self.matcher.is_error():
            if _engine_error(self.matcher) in ("NoExtension", "NoExtensionBias"):  # (not whole; no token can follow)
                raise self._dead_end()
            # (a limit of the parser reached mid-output, e.g. a row of over 2,000 items)
            raise RequestError(f"structured output: the grammar engine cannot go on ({_engine_error(self.matcher)})")
        bits = np.unpackbits(packed, count=min(self.vocab_size, packed.size * 8), bitorder="little")
        if bits.size < self.vocab_size:  # (ids past the tokenizer's vocabulary: never allowed)
            bits = np.concatenate([bits, np.zeros(self.vocab_size - bits.size, dtype=np.uint8)])
        m = torch.from_numpy(bits.view(np.bool_))  # (a fresh array: the mask may be changed in place)
        if self._grammar_eos:  # (the tokenizer's end-of-sequence where it is not a stop token of this request)
            m[torch.tensor(self._grammar_eos, dtype=torch.long)] = False
        if self._stops.numel():  # (a stop token that is also text the grammar allows here: drawing it ends the output)
            m[self._stops] |= self.matcher.is_accepting()
        if not m.any():  # (the tokens that continue it all past the model's vocabulary: a tokenizer larger than it)
            raise self._dead_end()
        return m

    def _dead_end(self) -> RequestError:
        return RequestError(f"structured output: a dead end after {counted(self.consumed, 'output token')}: no token "
                            "of the model's vocabulary continues the text there (the grammar asks for what no text "
                            "matches, or what this tokenizer cannot write)")

    def advance(self, token: int) -> None:
        if token in self.stop_ids:  # (a stop token ends the output: it adds nothing)
            return
        self.consumed += 1
        if not self.matcher.consume_token(token):
            raise RequestError(f"structured output: the grammar engine cannot go on after token {token} "
                               f"({_engine_error(self.matcher)})")

    @property
    def complete(self) -> bool:
        return self.matcher.is_accepting()


def constraint(tokenizer: Any, vocab_size: int, stop_ids: frozenset[int] | None, params: Any,
               lock: Any = None) -> GrammarConstraint | None:
    """A fresh constraint for one request over ``tokenizer``'s vocabulary (None where ``params`` asks for none);
    ``lock``: held while the tokenizer is read (the first time), not while the grammar is built."""
    if params.structured is None:
        return None
    _checked(params)
    if tokenizer is None:
        raise RequestError("structured output needs the model's tokenizer (tokenizer.json)")
    ll, matcher = _matcher(tokenizer, params, lock)  # (a copy of the server's where it checked the request)
    stop_ids = frozenset(stop_ids or ())
    if not stop_ids - frozenset(params.stop_token_ids):  # (a model whose config names no end-of-sequence token: the
        # tokenizer's ends a whole text, as well as the request's stop_token_ids where it lists some)
        stop_ids |= frozenset(t for t in ll.eos_tokens if t < vocab_size)
    return GrammarConstraint(matcher, vocab_size, stop_ids, list(ll.eos_tokens))
