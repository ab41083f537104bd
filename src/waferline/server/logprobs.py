"""Log-probabilities in the OpenAI shapes, from the engine's per-token ``TokenLogprobs``: chat's ``logprobs.content``
entries (token, logprob, bytes, top_logprobs) and completions' parallel lists (tokens, token_logprobs, top_logprobs,
text_offset).

A token is shown as its own text (the token decoded alone, special tokens included); a model served without a
tokenizer shows ``token_id:N``. ``bytes`` are the token's own bytes: exact for a byte-level BPE vocabulary (GPT-2
style) and for byte-fallback pieces (``<0xE2>``), so the bytes of tokens that split a character add up to it; for
other vocabularies the UTF-8 of the token's text, or null where that text alone is not whole characters. A
log-probability below -9999 (a logit of -inf) is shown as -9999.0: JSON has no infinity.
"""

from __future__ import annotations

import codecs
import copy
from typing import Any

from waferline.engine.sampling import TokenLogprobs
from waferline.engine.token_bytes import byte_level_alphabet, decode_text, token_bytes_of

FLOOR = -9999.0


class TokenTexts:
    """Token id -> its (text, bytes) in a logprobs entry. Called from the event loop's thread only, with a tokenizer
    copy of its own (made at the first call), so it never waits for the locks the engine and the prompt encoder
    hold."""

    def __init__(self, tokenizer: Any):
        self._source = tokenizer
        self._tok: Any = None
        self._byte_level: dict[str, int] | None = None
        self._special: set[int] = set()
        self._seen: dict[int, tuple[str, list[int] | None]] = {}

    def _tokenizer(self) -> Any:
        if self._tok is None:
            self._tok = copy.deepcopy(self._source)
            decoder = getattr(getattr(self._tok, "backend_tokenizer", None), "decoder", None)
            if type(decoder).__name__ == "ByteLevel":
                self._byte_level = byte_level_alphabet()
            self._special = set(getattr(self._tok, "all_special_ids", ()))
        return self._tok

    def text(self, ids: list[int]) -> str:
        """``ids`` decoded together (an echoed prompt given as token ids: a bad byte in byte pieces as one U+FFFD, as
        ``text_offsets`` counts it); "" without a tokenizer."""
        return "" if self._source is None else decode_text(self._tokenizer(), ids, skip_special_tokens=False)

    def __call__(self, token: int) -> tuple[str, list[int] | None]:
        hit = self._seen.get(token)
        if hit is None:
            hit = self._entry(token)
            if len(self._seen) < 1 << 20:
                self._seen[token] = hit
        return hit

    def _entry(self, token: int) -> tuple[str, list[int] | None]:
        if self._source is None:
            text = f"token_id:{token}"
            return text, list(text.encode())
        tok = self._tokenizer()
        text = tok.decode([token], skip_special_tokens=False)
        if token in self._special:  # (its text: "</s>")
            return text, list(text.encode("utf-8"))
        data = token_bytes_of(tok, token, self._byte_level, self._special)
        if data is None:
            return text, None
        return data.decode("utf-8", errors="replace"), list(data)  # (a SentencePiece piece keeps its space)


def _lp(x: float) -> float:
    return x if x >= FLOOR else FLOOR  # (NaN too: it fails every comparison)


def chat_entry(lp: TokenLogprobs, texts: TokenTexts) -> dict[str, Any]:
    """One ``choices[].logprobs.content`` entry of a chat completion."""
    t, b = texts(lp.token)
    top = [{"token": s, "logprob": _lp(v), "bytes": sb} for i, v in lp.top for s, sb in (texts(i),)]
    return {"token": t, "logprob": _lp(lp.logprob), "bytes": b, "top_logprobs": top}


def text_offsets(ids: list[int], texts: TokenTexts, text: str) -> list[int]:
    """The ``text_offset`` of each token of ``text`` (an echoed prompt, as sent or decoded): where in it the token's
    text starts. A character whose UTF-8 bytes are split over tokens (each token's own text shows a replacement
    character) counts once, with the token that completes it; a token whose text the prompt does not show (a BOS the
    tokenizer added, a SentencePiece piece's leading space at the start) takes no characters. The offsets never pass
    the text's end, so a generated token's (from ``len(text)``) come after them."""
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    out, at = [], 0
    for tok in ids:
        out.append(at)
        shown, data = texts(tok)
        piece = shown if data is None else utf8.decode(bytes(data))
        if text.startswith(piece, at):
            at += len(piece)
        elif piece[:1].isspace() and text.startswith(piece[1:], at):
            at += len(piece) - 1
    return out


def completion_logprobs(items: list[tuple[int, TokenLogprobs | None]], texts: TokenTexts,
                        offsets: list[int]) -> dict[str, Any]:
    """``choices[].logprobs`` of a completion for ``items`` (token, its log-probabilities; None for an echoed prompt's
    first token, which has none) whose texts start at ``offsets`` (characters of the choice's text before each).
    Each ``top_logprobs`` dict holds the N most likely tokens and the chosen one (as vLLM's do)."""
    tokens = [texts(tok)[0] for tok, _ in items]
    tops = [None if lp is None else {texts(i)[0]: _lp(v) for i, v in lp.top} | {t: _lp(lp.logprob)}
            for (_, lp), t in zip(items, tokens)]
    return {"tokens": tokens, "token_logprobs": [None if lp is None else _lp(lp.logprob) for _, lp in items],
            "top_logprobs": tops, "text_offset": list(offsets)}


def echoed(ids: list[int], prompt_lps: list[TokenLogprobs] | None) -> list[tuple[int, TokenLogprobs | None]]:
    """An echoed prompt's items for ``completion_logprobs``: its first token without log-probabilities, then each
    later token's (``prompt_lps``; none where the request did not ask for them)."""
    lps = prompt_lps or []
    return [(ids[0], None)] + [(t, lps[i] if i < len(lps) else None) for i, t in enumerate(ids[1:])]
