"""A token's own bytes: what a token adds to the output, byte for byte (the server's log-probabilities show them).
Exact for byte-level BPE vocabularies (GPT-2 style), byte-fallback pieces (``<0xE2>``) and SentencePiece pieces
(``▁2`` is b" 2", which decoding the token alone would strip); for other vocabularies the UTF-8 of the token's text
where that is whole characters."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

SPACE_MARK = "\u2581"  # SentencePiece's "▁": a space in the piece


def byte_level_alphabet() -> dict[str, int]:
    """The character a byte-level BPE vocabulary writes for each byte -> that byte: printable Latin-1 bytes stand for
    themselves, the other 68 (controls, space, NBSP, soft hyphen) for U+0100 onwards, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def token_bytes_of(tokenizer: Any, token: int, byte_level: dict[str, int] | None, special: set[int]) -> bytes | None:
    """A token's own bytes: exact for byte-level BPE pieces, byte-fallback pieces (``<0xE2>``) and SentencePiece pieces
    (``▁`` a space), else the UTF-8 of its text where that is whole characters; None for special tokens and pieces that
    are part of a character."""
    if token in special:
        return None
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str) and byte_level is not None and piece and all(c in byte_level for c in piece):
        return bytes(byte_level[c] for c in piece)
    if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    text = tokenizer.decode([token], skip_special_tokens=False)
    if isinstance(piece, str) and SPACE_MARK in piece:  # a SentencePiece piece: decoded alone it loses its space
        spaced = piece.replace(SPACE_MARK, " ")
        if text == spaced or (spaced.startswith(" ") and text == spaced[1:]):  # (not a "▁" the decoder keeps, as in
            return spaced.encode("utf-8")  # a byte-level vocabulary's added "<｜tool▁calls▁begin｜>")
    return None if "\ufffd" in text else text.encode("utf-8")


_PIECES: weakref.WeakKeyDictionary[Any, tuple[dict[int, int], list[int], frozenset[int]] | None] = \
    weakref.WeakKeyDictionary()


def _byte_pieces(tokenizer: Any) -> tuple[dict[int, int], list[int], frozenset[int]] | None:
    """A byte-fallback vocabulary's pieces: id -> byte, byte -> id, and the ids ``skip_special_tokens`` drops (which do
    not end a run of byte pieces); None for a vocabulary without all 256 that decode to their byte."""
    try:
        return _PIECES[tokenizer]
    except (KeyError, TypeError):  # (not seen yet; a tokenizer no weak reference can name: looked up each time)
        pass
    ids = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)]
    found = None
    if all(isinstance(i, int) and i != tokenizer.unk_token_id for i in ids) and len(set(ids)) == 256 and \
            tokenizer.decode([ids[0x41]], skip_special_tokens=False) == "A":
        backend = getattr(tokenizer, "backend_tokenizer", None)  # (a fast tokenizer: its backend skips these)
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special} if backend is not None \
            else set(tokenizer.all_special_ids)
        found = ({i: b for b, i in enumerate(ids)}, ids, frozenset(special))
    with contextlib.suppress(TypeError):
        _PIECES[tokenizer] = found
    return found


def decode_text(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    """``tokenizer.decode`` (no clean-up of spaces), where a byte-fallback vocabulary's run of byte pieces
    (``<0xC3>``) that is not whole UTF-8 reads as Python's ``bytes.decode(errors="replace")`` reads it: a U+FFFD for
    each bad byte sequence, the whole characters around them kept. Hugging Face's ByteFallback decoder turns every
    byte of such a run into U+FFFD, so a character sent already when streamed ("Q" of "<0x51><0xAB>") would turn into
    one once a bad byte follows it, and the text of an output would not start with the text of its first tokens."""
    kw = {"skip_special_tokens": skip_special_tokens, "clean_up_tokenization_spaces": False}
    text = tokenizer.decode(ids, **kw)
    pieces = _byte_pieces(tokenizer) if "\ufffd" in text else None
    if pieces is None:
        return text
    byte_of, id_of, special = pieces
    out: list[int] = []
    run = bytearray()
    for t in [*ids, -1]:
        if t in byte_of:
            run.append(byte_of[t])
        elif not (skip_special_tokens and t in special):  # (a skipped special token: the run goes on past it)
            out += [id_of[b] for b in bytes(run).decode("utf-8", "replace").encode("utf-8")]  # (U+FFFD: 3 pieces)
            run.clear()
            out.append(t)
    return tokenizer.decode(out[:-1], **kw)
