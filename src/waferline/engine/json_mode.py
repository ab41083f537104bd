"""JSON mode (`response_format: {"type": "json_object"}`): each token a request samples keeps its output a prefix of
one JSON object, and its end-of-sequence comes only once the object is closed.

``step`` is a byte-level JSON automaton (RFC 8259: objects, arrays, strings with escapes, numbers, true / false /
null, whitespace); its state is a small hashable tuple ``(stack, mode, aux)``. ``JsonVocab`` holds the vocabulary's
token bytes in a trie and gives, per automaton state, the tokens whose bytes all step from it (walking the trie once
per state, then cached; inside a string only the tokens that can end or escape it are walked). ``JsonConstraint``
is one request's state: ``allowed()`` before a token is drawn, ``advance(token)`` after.

Bytes at or above 0x80 are accepted inside strings only (UTF-8 is not checked further: a model that writes broken
UTF-8 gets U+FFFD in its text, still valid JSON). Special tokens never enter the output, except the stop tokens once
the object is closed (then whitespace too).
"""

from __future__ import annotations

import collections
from typing import Any

import torch

WS = frozenset(b" \t\n\r")
# modes
TOP, VALUE, KEY_OR_END, KEY, COLON, AFTER, ARR_OR_END, STR, KSTR, ESC, KESC, HEX, KHEX, NUM, LIT, DONE = range(16)
# number sub-states (aux of NUM): after "-", after a leading "0", integer digits, after ".", fraction digits,
# after "e", after the exponent's sign, exponent digits
MINUS, ZERO, INT, DOT, FRAC, E, ESIGN, EXP = range(8)
NUM_ENDS = frozenset((ZERO, INT, FRAC, EXP))
LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
ESCAPES = frozenset(b'"\\/bfnrt')
HEXDIGITS = frozenset(b"0123456789abcdefABCDEF")
DIGITS = frozenset(b"0123456789")

State = tuple[str, int, Any]
START: State = ("", TOP, None)


def _after(stack: str) -> State:
    return (stack, AFTER, None) if stack else (stack, DONE, None)


def _value(stack: str, b: int) -> State | None:
    """The state after byte ``b`` starts a value."""
    if b == ord("{"):
        return (stack + "{", KEY_OR_END, None)
    if b == ord("["):
        return (stack + "[", ARR_OR_END, None)
    if b == ord('"'):
        return (stack, STR, None)
    if b == ord("-"):
        return (stack, NUM, MINUS)
    if b == ord("0"):
        return (stack, NUM, ZERO)
    if b in DIGITS:
        return (stack, NUM, INT)
    if b in LITERALS:
        return (stack, LIT, LITERALS[b])
    return None


def _number(aux: int, b: int) -> int | None:
    """The number sub-state after byte ``b``, or None where ``b`` does not continue the number."""
    if b in DIGITS:
        return {MINUS: ZERO if b == ord("0") else INT, INT: INT, DOT: FRAC, FRAC: FRAC, E: EXP, ESIGN: EXP,
                EXP: EXP}.get(aux)
    if b == ord(".") and aux in (ZERO, INT):
        return DOT
    if b in b"eE" and aux in (ZERO, INT, FRAC):
        return E
    if b in b"+-" and aux == E:
        return ESIGN
    return None


def step(state: State, b: int) -> State | None:
    """The automaton's state after byte ``b``, or None where ``b`` cannot continue a JSON object."""
    stack, mode, aux = state
    if mode in (STR, KSTR):
        if b == ord('"'):
            return (stack, COLON, None) if mode == KSTR else _after(stack)
        if b == ord("\\"):
            return (stack, ESC if mode == STR else KESC, None)
        return state if b >= 0x20 else None
    if mode in (ESC, KESC):
        if b == ord("u"):
            return (stack, HEX if mode == ESC else KHEX, 4)
        return (stack, STR if mode == ESC else KSTR, None) if b in ESCAPES else None
    if mode in (HEX, KHEX):
        if b not in HEXDIGITS:
            return None
        done = STR if mode == HEX else KSTR
        return (stack, done, None) if aux == 1 else (stack, mode, aux - 1)
    if mode == NUM:
        nxt = _number(aux, b)
        if nxt is not None:
            return (stack, NUM, nxt)
        if aux not in NUM_ENDS:
            return None
        return step(_after(stack), b)  # the byte after the number, as after any value
    if mode == LIT:
        if b != aux[0]:
            return None
        return (stack, LIT, aux[1:]) if len(aux) > 1 else _after(stack)
    if b in WS:
        return state
    if mode == TOP:
        return (stack + "{", KEY_OR_END, None) if b == ord("{") else None
    if mode == VALUE:
        return _value(stack, b)
    if mode == ARR_OR_END:
        return _after(stack[:-1]) if b == ord("]") else _value(stack, b)
    if mode in (KEY_OR_END, KEY):
        if b == ord('"'):
            return (stack, KSTR, None)
        return _after(stack[:-1]) if b == ord("}") and mode == KEY_OR_END else None
    if mode == COLON:
        return (stack, VALUE, None) if b == ord(":") else None
    if mode == AFTER:
        top = stack[-1]
        if b == ord(","):
            return (stack, KEY if top == "{" else VALUE, None)
        if (b == ord("}") and top == "{") or (b == ord("]") and top == "["):
            return _after(stack[:-1])
        return None
    return None  # DONE: whitespace only


def walk(state: State | None, data: bytes) -> State | None:
    for b in data:
        if state is None:
            return None
        state = step(state, b)
    return state


class JsonVocab:
    """The vocabulary's token bytes in a trie, and per automaton state the tokens allowed from it (cached, LRU).

    Inside a string (the state that repeats most, and whose walk would reach almost every token) a token without a
    quote, a backslash or a control byte keeps the string going whatever the state: those are one precomputed mask,
    and only the others are walked (a trie of their own)."""

    CACHE = 256  # states whose masks are kept (each a bool per token)

    def __init__(self, token_bytes: list[bytes | None], vocab_size: int):
        self.vocab_size = vocab_size
        self.trie: dict = {}
        self.string_trie: dict = {}  # tokens that can end or escape a string
        plain: list[int] = []
        for tok, data in enumerate(token_bytes):
            if not data:  # (special tokens and those without bytes never enter the output)
                continue
            _insert(self.trie, data, tok)
            if any(b in b'"\\' or b < 0x20 for b in data):
                _insert(self.string_trie, data, tok)
            else:
                plain.append(tok)
        self.plain_in_string = torch.zeros(vocab_size, dtype=torch.bool)
        self.plain_in_string[torch.tensor(plain, dtype=torch.long)] = True
        self._masks: collections.OrderedDict[State, torch.Tensor] = collections.OrderedDict()

    def mask(self, state: State) -> torch.Tensor:
        """Bool [vocab_size]: the tokens whose bytes all step from ``state``."""
        hit = self._masks.get(state)
        if hit is not None:
            self._masks.move_to_end(state)
            return hit
        in_string = state[1] in (STR, KSTR)
        hit = self.plain_in_string.clone() if in_string else torch.zeros(self.vocab_size, dtype=torch.bool)
        ok: list[int] = []
        todo = [(self.string_trie if in_string else self.trie, state)]
        while todo:
            node, st = todo.pop()
            for b, child in node.items():
                if b is None:
                    ok.extend(child)
                    continue
                nxt = step(st, b)
                if nxt is not None:
                    todo.append((child, nxt))
        hit[torch.tensor(ok, dtype=torch.long)] = True
        self._masks[state] = hit
        if len(self._masks) > self.CACHE:
            self._masks.popitem(last=False)
        return hit


def _insert(trie: dict, data: bytes, tok: int) -> None:
    node = trie
    for b in data:
        node = node.setdefault(b, {})
    node.setdefault(None, []).append(tok)


class JsonConstraint:
    """One request's JSON mode: ``allowed()`` (bool [V]) before a token is drawn, ``advance(token)`` after."""

    def __init__(self, vocab: JsonVocab, token_bytes: list[bytes | None], stop_ids: frozenset[int]):
        self.vocab, self.token_bytes, self.stop_ids = vocab, token_bytes, stop_ids
        self.state: State = START

    def allowed(self) -> torch.Tensor:
        """The tokens that may come next: those that continue the JSON; the stop tokens (whatever their text) only
        once the object is closed, and then only they and whitespace."""
        m = self.vocab.mask(self.state)
        stops = [t for t in self.stop_ids if t < m.numel()]
        if stops:
            m = m.clone()
            m[torch.tensor(stops, dtype=torch.long)] = self.state[1] == DONE
        return m

    def advance(self, token: int) -> None:
        data = self.token_bytes[token] if token < len(self.token_bytes) else None
        if data and token not in self.stop_ids:  # (a stop token ends the output: it adds nothing)
            nxt = walk(self.state, data)
            if nxt is None:
                raise RuntimeError(f"JSON mode: token {token} does not continue the output as JSON")
            self.state = nxt

    @property
    def complete(self) -> bool:
        return self.state[1] == DONE


_VOCABS: dict[int, tuple[Any, JsonVocab, list[bytes | None]]] = {}


def json_constraint(tokenizer: Any, vocab_size: int, stop_ids: frozenset[int] | None) -> JsonConstraint:
    """A fresh JSON-mode state for one request over ``tokenizer``'s vocabulary (its token bytes read once per
    tokenizer: ~20 us a token, then kept)."""
    if tokenizer is None:
        from waferline.errors import RequestError

        raise RequestError("JSON mode needs the model's tokenizer (tokenizer.json)")
    hit = _VOCABS.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer or hit[1].vocab_size != vocab_size:
        from waferline.engine.token_bytes import vocabulary_bytes

        data = vocabulary_bytes(tokenizer, vocab_size)
        if len(_VOCABS) >= 4:
            _VOCABS.clear()
        hit = _VOCABS[id(tokenizer)] = (tokenizer, JsonVocab(data, vocab_size), data)
    return JsonConstraint(hit[1], hit[2], stop_ids or frozenset())
