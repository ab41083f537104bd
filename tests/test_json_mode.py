"""JSON mode's byte automaton (engine/json_mode.py) against Python's own JSON parser: every prefix of a JSON object is
accepted and the whole object completes it; mutated texts complete exactly when `json.loads` reads them as an object;
the vocabulary masks allow exactly the tokens that continue the output."""

import json
import random

import pytest
import torch

from waferline.engine.json_mode import DONE, START, JsonConstraint, JsonVocab, walk


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "true", "false", "null"] + (["obj", "arr"] * 2 if depth < 3 else [])
    k = rng.choice(kinds)
    if k == "int":
        return rng.randint(-10**6, 10**6)
    if k == "float":
        return rng.choice([rng.uniform(-1e3, 1e3), rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30), 0.0, -0.5])
    if k == "str":
        return "".join(rng.choice('ab "\\/\n\tzé✓\u0001x') for _ in range(rng.randint(0, 8)))
    if k in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[k]
    if k == "arr":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {"".join(rng.choice("kéy\"\\") for _ in range(rng.randint(0, 4))): _random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 4))}


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        obj = {f"k{j}": _random_value(rng) for j in range(rng.randint(0, 4))}
        out.append(json.dumps(obj, ensure_ascii=i % 2 == 0, indent=None if i % 3 else 2,
                              separators=(", ", ": ") if i % 4 else (",", ":")))
    return out


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def test_every_prefix_of_an_object_is_accepted_and_the_whole_completes_it():
    for text in _texts(300):
        data = text.encode()
        assert walk(START, data)[1] == DONE, text
        for i in range(len(data)):
            assert walk(START, data[:i]) is not None, (text, i)
            assert walk(START, data[:i])[1] != DONE or data[i:].strip() == b"", (text, i)
        assert walk(START, data + b" \n")[1] == DONE  # trailing whitespace, and nothing else, may follow


def test_mutated_texts_complete_exactly_when_json_reads_an_object():
    rng = random.Random(1)
    alphabet = '{}[]",:.-+eE0123456789 tfnrulasx\\/u'
    checked = 0
    for text in _texts(400, seed=2):
        for _ in range(6):
            chars = list(text)
            for _ in range(rng.randint(1, 3)):
                op, i = rng.random(), rng.randrange(len(chars) + 1)
                if op < 0.4 and i < len(chars):
                    chars[i] = rng.choice(alphabet)
                elif op < 0.7:
                    chars.insert(i, rng.choice(alphabet))
                elif i < len(chars):
                    del chars[i]
            mutated = "".join(chars)
            end = walk(START, mutated.encode())
            assert (end is not None and end[1] == DONE) == _is_object(mutated), mutated
            checked += 1
    assert checked == 2400


@pytest.mark.parametrize("text", ['{"a":01}', '{"a":1.}', '{"a":-}', "{,}", '{"a" 1}', "[1]", '{"a":tru}', '{"a":1,}',
                                  '{"a":"\x01"}', '{"a":"\\x"}', '{"a":"\\u12g4"}', '{"a":1}}', '{"a":[1,]}', "{}x",
                                  '{"a":1e}', '{"a":+1}', '"s"', "1"])
def test_what_is_not_an_object_never_completes(text):
    end = walk(START, text.encode())
    assert end is None or end[1] != DONE
    assert not _is_object(text)


def test_vocabulary_masks_and_a_constraint():
    toks = [b"{", b" {", b" ", b"a", b'"', b'"a', b'":', b"1", b"}", b"}x", b"\n}", None, b'{"', b"tr", b"ue"]
    stop = 11  # a special token without bytes: allowed only once the object is closed
    vocab = JsonVocab(toks, len(toks) + 1)
    assert vocab.mask(START).nonzero().flatten().tolist() == [0, 1, 2, 12]
    c = JsonConstraint(vocab, toks, frozenset({stop}))
    for t in (12, 3, 6, 13, 14):  # {"a":true
        assert c.allowed()[t], t
        c.advance(t)
    allowed = c.allowed().nonzero().flatten().tolist()
    assert allowed == [2, 8, 10] and not c.complete  # whitespace, "}", "\n}" (not "}x", not the stop token yet)
    c.advance(8)
    assert c.complete and c.allowed().nonzero().flatten().tolist() == [2, stop]
    with pytest.raises(RuntimeError, match="JSON mode"):
        c.advance(3)
    assert torch.equal(vocab.mask(START), vocab.mask(START))  # (cached)


def test_a_stop_token_with_text_ends_only_a_closed_object():
    """A stop token whose bytes would continue the JSON (a client's stop_token_ids may name any token) is held back
    until the object is closed, and then ends the output without being walked."""
    toks = [b"{", b"}", b'"', b"a", b":", b"1"]
    vocab = JsonVocab(toks, len(toks))
    c = JsonConstraint(vocab, toks, frozenset({3}))  # "a" stops
    for t in (0, 2):  # {"
        c.advance(t)
    assert not c.allowed()[3] and c.allowed()[2]  # inside a string "a" would fit, but it would end the output
    for t in (2, 4, 5, 1):  # ":1}
        c.advance(t)
    assert c.complete and c.allowed()[3]
    c.advance(3)  # (the stop token: nothing to walk)
    assert c.complete


def test_sentencepiece_pieces_keep_their_space():
    """A SentencePiece vocabulary (Llama / Mistral style: "▁" marks a space, byte-fallback pieces, a decoder that strips
    the first space): a piece's bytes keep its space, so JSON mode does not take "1", "▁2" for one number."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from waferline.engine.json_mode import json_constraint
    from waferline.engine.token_bytes import vocabulary_bytes

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3, "{": 4, "}": 5, '"': 6, "a": 7, ":": 8, "1": 9,
             "\u25812": 10, "2": 11}
    vocab |= {f"<0x{i:02X}>": len(vocab) + i for i in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    data = vocabulary_bytes(hf, len(hf))
    assert (data[10], data[3], data[11], data[2], data[len(vocab) - 256 + 0xE2]) == (b" 2", b" ", b"2", None, b"\xe2")
    c = json_constraint(hf, len(hf), frozenset({2}))
    for t in (4, 6, 7, 6, 8, 9):  # {"a":1
        c.advance(t)
    assert c.allowed()[11] and not c.allowed()[10]  # "2" continues the number; " 2" would be a second value
