"""A token's own bytes: what a token adds to the output, byte for byte (the server's log-probabilities show them).
Exact for byte-level BPE vocabularies (GPT-2 style), byte-fallback pieces (``<0xE2>``) and SentencePiece pieces
(``▁2`` is b" 2", which decoding the token alone would strip); for other vocabularies the UTF-8 of the token's text
where that is whole characters."""

from __future__ import annotations

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

