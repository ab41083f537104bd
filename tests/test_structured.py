"""Structured outputs (engine/structured.py over llguidance): random walks through the masks of a real tokenizer end
only in texts of the language (JSON objects, a schema's instances, a regex's matches, one of the choices, a grammar's
sentences), the choice masks allow only prefixes, SentencePiece pieces keep their space, and LLM.generate holds its
output to them (a batch as lone requests, sampled and greedy); bad requests fail with the library's reason."""

import json
import random
import re

import pytest
import torch

from waferline.engine import schema_cost, structured
from waferline.engine.sampling import SamplingParams
from waferline.errors import RequestError

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
CHOICES = ["Denmark", "Norway", "England", "Den"]
REGEX = r"(Yes|No), my lord[.!]"
LARK = 'start: "To " WORD " or not"\nWORD: /[a-z]{1,8}/'
GBNF = 'root ::= "wafer " num\nnum ::= [0-9] | [0-9] [0-9]'


def _schema_ok(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) <= {"name", "age", "tags"} and {"name", "age"} <= set(obj)
            and isinstance(obj["name"], str) and len(obj["name"]) <= 6
            and type(obj["age"]) is int and 0 <= obj["age"] <= 120
            and all(t in ("a", "b") for t in obj.get("tags", [])) and len(obj.get("tags", [])) <= 3)


# whole texts: each kind's check of a finished output
WHOLE = {
    "json_object": lambda s: isinstance(json.loads(s), dict),
    "json_schema": lambda s: _schema_ok(json.loads(s)),
    "regex": lambda s: re.fullmatch(REGEX, s) is not None,
    "choice": lambda s: s in CHOICES,
    "grammar": lambda s: re.fullmatch(r"To [a-z]{1,8} or not", s) is not None,
}
KINDS = {"json_object": True, "json_schema": SCHEMA, "regex": REGEX, "choice": CHOICES, "grammar": LARK}


@pytest.fixture(scope="module")
def tok(sol):
    from waferline.model.load import load_tokenizer

    return load_tokenizer(sol)


def _walk(c, tok, rng: random.Random, limit: int, prefer_stop: float) -> tuple[str, bool]:
    """A random walk through the masks: (the text, whether it ended on a stop token)."""
    out: list[int] = []
    eos = tok.eos_token_id
    for _ in range(limit):
        allowed = c.allowed()
        ids = allowed.nonzero().flatten().tolist()
        assert ids, "a mask with no token"
        assert allowed[eos].item() == c.complete  # the end only where the text is whole
        t = eos if eos in ids and rng.random() < prefer_stop else rng.choice(ids)
        c.advance(t)
        if t == eos:
            return tok.decode(out), True
        out.append(t)
    return tok.decode(out), False


@pytest.mark.parametrize("kind", list(KINDS))
def test_random_walks_end_only_in_the_language(kind, tok):
    rng = random.Random(7)
    ended = 0
    for _ in range(25):
        c = structured.constraint(tok, len(tok), frozenset({tok.eos_token_id}), SamplingParams(**{kind: KINDS[kind]}))
        text, stopped = _walk(c, tok, rng, 120, prefer_stop=0.5)
        if stopped:
            ended += 1
            assert WHOLE[kind](text), (kind, text)
    assert ended >= 10, f"only {ended} of 25 walks ended"


def test_choice_masks_keep_a_prefix_of_a_choice(tok):
    """Every token the mask allows keeps the text a prefix of a choice, the end comes exactly where the text is one,
    and no walk is stuck. (llguidance may allow fewer: where the bytes ahead are forced, only the tokens that spell
    them as the tokenizer would, "D" "en" rather than "D" "e" "n".)"""
    vocab = [tok.decode([t]) for t in range(len(tok))]
    special = set(tok.all_special_ids)
    rng = random.Random(3)
    for _ in range(10):
        c = structured.constraint(tok, len(tok), frozenset({tok.eos_token_id}), SamplingParams(choice=CHOICES))
        text = ""
        while True:
            allowed = c.allowed()
            want = torch.tensor([t not in special and any(ch.startswith(text + vocab[t]) for ch in CHOICES)
                                 for t in range(len(tok))])
            want[tok.eos_token_id] = text in CHOICES
            assert not (allowed & ~want).any() and allowed[tok.eos_token_id] == want[tok.eos_token_id], text
            assert allowed.any()
            t = rng.choice(allowed.nonzero().flatten().tolist())
            c.advance(t)
            if t == tok.eos_token_id:
                break
            text += vocab[t]
        assert text in CHOICES


def test_thousands_of_choices_and_choices_with_regex_characters(tok):
    """Choices are one regular expression (not a parser row per choice, which llguidance caps at 2,000): 2,500
    choices, and choices spelled with the expression syntax's own characters, each walk to exactly itself."""
    many = [f"o{i}" for i in range(2500)] + ["a b", "x-y", "c++", "a\nb", "[x]", "#1", "&~", "back\\slash", "(q)"]
    stop = frozenset({tok.eos_token_id})
    for want in ("o2499", "c++", "a\nb", "back\\slash", "(q)", "[x]"):
        c = structured.constraint(tok, len(tok), stop, SamplingParams(choice=many))
        for t in tok.encode(want, add_special_tokens=False):
            assert c.allowed()[t], (want, t)
            c.advance(t)
        assert c.complete and c.allowed()[tok.eos_token_id]
    c = structured.constraint(tok, len(tok), stop, SamplingParams(choice=many))
    for t in tok.encode("c+", add_special_tokens=False):
        c.advance(t)
    assert not c.complete  # ("c+" is a prefix of a choice, not one)


def test_a_grammar_engine_limit_mid_output_ends_the_request_in_one_line(tok):
    """A right-recursive grammar grows the parser's rows by one per token; past llguidance's 2,000 items the engine
    cannot go on: the request ends with a short reason, not the parser's state dump."""
    c = structured.constraint(tok, len(tok), frozenset({tok.eos_token_id}),
                              SamplingParams(grammar='start: x\nx: "a" x | "b" x | "a"'))
    a = tok.encode("a", add_special_tokens=False)[0]
    with pytest.raises(RequestError, match=r"^structured output: the grammar engine cannot go on") as e:
        for _ in range(2100):
            assert c.allowed()[a]
            c.advance(a)
    assert "\n" not in str(e.value) and len(str(e.value)) < 320


def test_gbnf_grammars_are_read(tok):
    rng = random.Random(1)
    for _ in range(10):
        c = structured.constraint(tok, len(tok), frozenset({tok.eos_token_id}), SamplingParams(grammar=GBNF))
        text, stopped = _walk(c, tok, rng, 20, prefer_stop=0.7)
        assert stopped and re.fullmatch(r"wafer [0-9]{1,2}", text), text


def test_a_lark_grammar_that_writes_the_gbnf_rule_sign_stays_lark(tok):
    """A Lark grammar with "::=" in a string, a regular expression or a comment is Lark (it was taken for GBNF and
    refused: "neither Lark nor a GBNF grammar"); GBNF with strings, character classes and comments is still read."""
    for grammar, want in (('start: "x ::= " /[a-z]/', r"x ::= [a-z]"), ('start: /[a-z]::=[0-9]/', r"[a-z]::=[0-9]"),
                          ('// from root ::= "ok"\nstart: "ok"', "ok"),
                          ('# a "quoted" comment / with ::=\nroot ::= ["] "a/b" [#]', '"a/b#')):
        c = structured.constraint(tok, len(tok), frozenset({tok.eos_token_id}), SamplingParams(grammar=grammar))
        text, stopped = _walk(c, tok, random.Random(2), 20, prefer_stop=1.0)
        assert stopped and re.fullmatch(want, text), (grammar, text)


def test_stop_token_ids_wait_for_a_whole_text_and_ids_past_the_tokenizer_are_masked(tok):
    stop = tok.encode("x", add_special_tokens=False)[0]
    c = structured.constraint(tok, len(tok) + 64, frozenset({tok.eos_token_id, stop}), SamplingParams(regex="Na"))
    m = c.allowed()
    assert m.shape == (len(tok) + 64,) and not m[len(tok):].any()
    assert m.any() and not m[stop] and not m[tok.eos_token_id]
    for t in tok.encode("Na", add_special_tokens=False):
        c.advance(t)
    m = c.allowed()
    assert c.complete and m[stop] and m[tok.eos_token_id] and m.sum() == 2


def test_sentencepiece_pieces_keep_their_space():
    """A SentencePiece vocabulary (Llama / Mistral style: "▁" marks a space, byte-fallback pieces, a decoder that strips
    the first space): "1" then "▁2" is not one number, and byte pieces spell characters."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from waferline.engine.token_bytes import byte_level_alphabet, token_bytes_of

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3, "{": 4, "}": 5, '"': 6, "a": 7, ":": 8, "1": 9,
             "\u25812": 10, "2": 11}
    vocab |= {f"<0x{i:02X}>": len(vocab) + i for i in range(256)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert token_bytes_of(hf, 10, None, {0, 1, 2}) == b" 2" and token_bytes_of(hf, 2, None, {0, 1, 2}) is None
    assert token_bytes_of(hf, 12 + 0xE2, None, {0, 1, 2}) == b"\xe2" and byte_level_alphabet()["\u0120"] == 0x20
    c = structured.constraint(hf, len(hf), frozenset({2}), SamplingParams(json_object=True))
    for t in (4, 6, 7, 6, 8, 9):  # {"a":1
        c.advance(t)
    m = c.allowed()
    assert m[11] and not m[10] and not m[2]  # "2" continues the number; " 2" would be a second value; not whole yet
    c.advance(5)
    assert c.complete and c.allowed()[2]
    c = structured.constraint(hf, len(hf), frozenset({2}), SamplingParams(regex="é"))
    m = c.allowed()
    assert m[12 + 0xC3] and not m[12 + 0xC4]  # é is C3 A9


def _sentencepiece(added=()):
    """A Llama-2 style SentencePiece tokenizer (a normalizer that writes spaces "▁" and prepends one, byte-fallback
    pieces, a decoder that strips the first space), the pieces of "▁x" and "▁the", and ``added`` tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3, "x": 4, "\u2581x": 5, "t": 6, "h": 7, "e": 8, "\u2581t": 9,
             "\u2581th": 10, "\u2581the": 11}
    vocab |= {f"<0x{i:02X}>": len(vocab) + i for i in range(256)}
    merges = [("\u2581", "x"), ("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e")]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.add_tokens(list(added))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_a_normalized_added_token_of_a_sentencepiece_tokenizer_keeps_its_space():
    """An added token that is text and normalized (older Llama conversions: "normalized": true) is matched after the
    normalizer prepends "▁": the text " foo" is that token, which reads " foo" in the output. The vocabulary read it
    "foo": after " x" it was allowed where no space may follow (the output " x foo" off the grammar), refused where
    " foo" is the text, and where a grammar forced " foo" it was allowed, then refused (the request failed)."""
    from tokenizers import AddedToken

    hf = _sentencepiece([AddedToken("foo", normalized=True, special=False)])
    foo, x = hf.convert_tokens_to_ids(["foo", "\u2581x"])
    assert hf.encode("x foo", add_special_tokens=False) == [x, foo] and hf.decode([x, foo]) == "x foo"
    for rx, allowed in ((" x[a-z]+", False), (" x( [a-z]+)+", True), (" x foo", True)):
        c = structured.constraint(hf, len(hf), frozenset({2}), SamplingParams(regex=rx))
        c.advance(x)
        assert bool(c.allowed()[foo]) is allowed, rx
        if allowed:
            c.advance(foo)
            assert c.complete, rx


def test_a_grammar_that_forces_a_space_mark_writes_it_in_bytes_with_a_sentencepiece_tokenizer():
    """The text "▁" (U+2581) in a grammar: a SentencePiece tokenizer reads it as its space mark (the piece "▁", a
    space), which the grammar engine, asking it for the tokens of the text it forces, allowed, then refused: the
    request failed. It is written in byte-fallback pieces, as any character outside the vocabulary."""
    hf = _sentencepiece()
    for rx, text in (("x\u2581y", "x\u2581y"), ("\u2581", "\u2581"), (" the\u2581", " the\u2581")):
        c = structured.constraint(hf, len(hf), frozenset({2}), SamplingParams(regex=rx))
        out: list[int] = []
        while not c.complete:
            ids = c.allowed().nonzero().flatten().tolist()
            assert ids and 3 not in ids, (rx, out)
            c.advance(ids[0])
            out.append(ids[0])
        assert hf.decode(out) == text.removeprefix(" "), (rx, out)  # (the decoder strips the first space)


def test_an_added_token_of_a_byte_level_vocabulary_keeps_its_space_marks():
    """DeepSeek-V3's "<｜tool▁calls▁begin｜>": an added token that is text, in a byte-level vocabulary, with "▁" in
    its name that the decoder keeps. Its bytes were read as a SentencePiece piece's (" " for "▁"): a grammar that
    forces its text allowed the token, then refused it, and its log-probabilities showed "<｜tool calls begin｜>"."""
    from waferline.server.logprobs import TokenTexts

    name = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
    hf = _byte_level(special=["</s>"], added=[name])
    t = hf.convert_tokens_to_ids(name)
    assert hf.decode([t]) == name and TokenTexts(hf)(t) == (name, list(name.encode()))
    c = structured.constraint(hf, len(hf), frozenset({hf.eos_token_id}), SamplingParams(regex=re.escape(name) + "x"))
    assert c.allowed()[t]
    c.advance(t)
    _spell(c, hf, "x")
    assert c.complete


def test_a_tokenizer_whose_decoder_the_grammar_engine_cannot_read_is_named_so():
    """A fast tokenizer (tokenizer.json) with a decoder llguidance does not read (WordPiece's): the request is refused
    with that reason, not told it needs the fast tokenizer it has."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "</s>": 1, "a": 2, "##b": 3}, unk_token="[UNK]"))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="[UNK]")
    with pytest.raises(RequestError, match=r"^structured output cannot use this tokenizer: the grammar engine cannot "
                                           r"read its vocabulary \(can't determine decoder type"):
        structured.constraint(hf, len(hf), frozenset({1}), SamplingParams(regex="ab"))


@pytest.mark.parametrize(("kw", "words"), [
    (dict(regex="("), "regex cannot be used"),
    (dict(json_schema={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "json_schema cannot be used"),
    (dict(json_schema="{not json"), "json_schema is not valid JSON"),
    (dict(grammar="start: undefined_rule"), "grammar cannot be used"),
    (dict(grammar="root ::= ("), "grammar cannot be used"),
    (dict(regex="[a&&b]"), "regex cannot be used: no text holds to it"),
    (dict(json_schema="false"), "json_schema must be a JSON Schema object"),
    (dict(grammar='start: /[0-9&&a-z]/ "x"'), "grammar cannot be used: no text holds to it"),
    (dict(grammar='start: "x" /[a&&b]/'), r"no text holds to it \(every text it starts comes to a dead end, as 'x'"),
    (dict(grammar='start: "x" y\ny: "a" y'), "grammar cannot be used: the grammar engine cannot go on after 'x'"),
    (dict(regex="a{99999999}"), r"regex cannot be used: the grammar engine cannot go on after 'a' \(lexer error"),
    (dict(json_schema={"type": "object", "patternProperties": {"^x[a&&b]$": {}}, "minProperties": 1,
                       "additionalProperties": False}), "json_schema cannot be used: no text holds to it"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(choice=["a", 3]), "choice must be a non-empty list"),
    (dict(regex="a", choice=["a"]), "at most one structured output"),
    (dict(regex="a", ignore_eos=True), "cannot be combined with ignore_eos"),
])
def test_bad_structured_outputs_are_refused(kw, words):
    from waferline.engine.sequence import check_request

    with pytest.raises(RequestError, match=words):  # (when made, or when checked for the engine)
        check_request([1, 2], SamplingParams(**kw), 100, 64)
    with pytest.raises(RequestError, match="json_schema cannot be used"):  # (the grammar step alone: no AttributeError)
        structured._checked_grammar("json_schema", "false")


def test_a_schema_of_too_many_pattern_properties_is_refused_before_the_grammar_engine_builds_it(monkeypatch):
    """The grammar engine's time to build a schema grows steeply with its patternProperties (400 in one object: ~11
    s, 3,000: minutes, holding a server thread): over MAX_PATTERN_PROPERTIES in all (allOf merges objects' into one),
    it is refused at once; at the limit it is built, and a definition counts once however many $refs use it (the
    engine builds it once), however each $ref spells it (the check walks it once: 2,000 spellings took 22 s)."""
    import llguidance

    def pattern_properties(n, tag="x"):
        return {f"^{tag}{i}[a-z]*$": {"type": "integer"} for i in range(n)}

    limit = schema_cost.MAX_PATTERN_PROPERTIES
    at_limit = {"type": "object", "patternProperties": pattern_properties(limit)}
    over = [{"type": "object", "patternProperties": pattern_properties(3000)},
            {"allOf": [{"type": "object", "patternProperties": pattern_properties(limit // 2 + 1, t)} for t in "ab"]},
            {"$defs": {"d": {"type": "object", "patternProperties": pattern_properties(limit // 2 + 1)},
                       "e": {"type": "object", "patternProperties": pattern_properties(limit // 2 + 1, "e")}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/d"}, "b": {"$ref": "#/$defs/%65"}}},
            # (a property named as a keyword whose value is data, "default" or "enum", is a schema: counted)
            {"type": "object", "properties": {"default": {"type": "object",
                                                          "patternProperties": pattern_properties(limit + 1)}}}]

    def unused(*a, **kw):
        raise AssertionError("the grammar engine was asked")

    with monkeypatch.context() as m:
        m.setattr(llguidance.LLMatcher, "validate_grammar", unused)
        m.setattr(llguidance.LLMatcher, "grammar_from_json_schema", unused)
        for schema in over:
            with pytest.raises(RequestError, match=rf"^json_schema cannot be used: over {limit} patternProperties, "):
                structured._checked_grammar("json_schema", json.dumps(schema))
    recursive = {"$defs": {"t": {"type": "object", "patternProperties": pattern_properties(limit),
                                 "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}},
                 "$ref": "#/$defs/t", "examples": [{"patternProperties": pattern_properties(limit)}]}
    class Walked(dict):  # (counts the walks through a definition's properties)
        walks = 0

        def values(self):
            Walked.walks += 1
            return super().values()

    spelled = [f"#/$defs/{''.join(c if (i >> j) & 1 else f'%{ord(c):02x}' for j, c in enumerate('abcdefghijk'))}"
               for i in range(2000)]  # (2,000 spellings of one definition)
    reused = {"$defs": {"abcdefghijk": {"type": "object", "patternProperties": pattern_properties(limit),
                                        "properties": Walked({f"p{i}": {"type": "string"} for i in range(50)})}},
              "anyOf": [{"$ref": r} for r in spelled]}
    schema_cost.refuse_costly_schema(reused)
    assert Walked.walks == 1  # (walked once, not once per spelling)
    schema_cost.refuse_costly_schema({"items": [{}], "$ref": "#/items/\u00b2"})  # (a digit int() does not read)
    for schema in (at_limit, recursive):
        assert structured.grammar_of(SamplingParams(json_schema=schema))


def test_a_refused_grammar_is_freed_when_its_error_is():
    """The error of a grammar refused on the grammar thread holds no cycle: the grammar engine's state its traceback
    keeps (~150 MB for the regex "(a{1000}){1000}") goes with it, not at the next full collection (a server held GBs
    of it after a few such requests)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        with pytest.raises(RequestError, match="regex cannot be used") as info:
            structured.grammar_of(SamplingParams(regex="[a&&b]"))
        ref = weakref.ref(info.value)
        del info
        assert ref() is None
    finally:
        gc.enable()


def test_the_engine_copies_the_matcher_the_server_built_when_it_checked_the_request(tok, monkeypatch):
    """The server checks a request on its own thread (check_tokens) and builds its matcher there; the engine's
    constraint copies it instead of building it again on the engine's thread, which every stream waits for (a schema of
    a few hundred patternProperties took seconds). The copy starts where a fresh matcher does and advances alone."""
    import llguidance

    real, built = llguidance.LLMatcher, []

    class Counting:
        def __new__(cls, ll, grammar, **kw):
            built.append(ll)
            return real(ll, grammar, **kw)

    for name in ("validate_grammar", "grammar_from_json_schema", "grammar_from_lark", "grammar_from_regex"):
        setattr(Counting, name, staticmethod(getattr(real, name)))

    params = SamplingParams(json_schema={"type": "object", "patternProperties": {
        f"^k{i}[a-z]*$": {"type": "integer"} for i in range(7)}, "additionalProperties": False})
    ll, _ = structured._ll_tokenizer(tok, None)
    monkeypatch.setattr(llguidance, "LLMatcher", Counting)
    structured.check_tokens(tok, params)
    assert built.count(ll) == 1  # (the server's)
    first = structured.constraint(tok, tok.vocab_size, frozenset({tok.eos_token_id}), params)
    second = structured.constraint(tok, tok.vocab_size, frozenset({tok.eos_token_id}), params)
    assert built.count(ll) == 1  # (each a copy: nothing built on the engine's thread)
    monkeypatch.setattr(llguidance, "LLMatcher", real)
    structured._PROTOTYPES.clear()
    fresh = structured.constraint(tok, tok.vocab_size, frozenset({tok.eos_token_id}), params)
    assert torch.equal(first.allowed(), fresh.allowed())
    for t in tok.encode('{"k3', add_special_tokens=False):  # (the first copy moves on; the second stays at the start)
        first.advance(t)
    assert not torch.equal(first.allowed(), second.allowed()) and torch.equal(second.allowed(), fresh.allowed())


def test_an_exclusive_bound_the_grammar_engine_lets_through_is_refused(tok):
    """llguidance lets an exclusive integer bound through where no integer lies inside the range and it is the bound
    nearer zero: {"exclusiveMinimum": 0, "maximum": 0.5} (pydantic's gt=0, le=0.5) allowed the output 0, and
    {"minimum": -1.5, "exclusiveMaximum": -1} -1, both outside the schema, with finish_reason "stop". Such a schema
    is refused before it queues; the bounds it holds to are not."""
    from waferline.engine.sequence import check_request

    for bounds, text in (({"exclusiveMinimum": 0, "maximum": 0.5}, "0"), ({"minimum": -1.5, "exclusiveMaximum": -1.0},
                                                                           "-1"),
                         ({"minimum": -0.5, "exclusiveMaximum": 0}, "-0"),
                         ({"minimum": 2, "exclusiveMinimum": True, "maximum": 2.5}, "2")):  # (draft 4's flag)
        schema = {"type": "object", "properties": {"p": dict(bounds, type="number")}, "required": ["p"]}
        with pytest.raises(RequestError, match=rf"^json_schema cannot be used: the grammar engine would let {text} "
                                               rf"through {re.escape(json.dumps(bounds))} \(an exclusive"):
            check_request([1, 2], SamplingParams(json_schema=schema), len(tok), 64)
    for bounds in ({"exclusiveMinimum": 0, "maximum": 1}, {"exclusiveMinimum": 0}, {"minimum": 0, "maximum": 0.5},
                   {"exclusiveMinimum": 0.5, "maximum": 0.75}, {"exclusiveMinimum": 1, "exclusiveMaximum": 3}):
        schema = dict(bounds, type="number")
        check_request([1, 2], SamplingParams(json_schema=schema), len(tok), 64)  # (no RequestError)
        for bound in set(bounds) & {"exclusiveMinimum", "exclusiveMaximum"}:  # (the bound itself is not whole)
            c = structured.constraint(tok, len(tok), frozenset({tok.eos_token_id}), SamplingParams(json_schema=schema))
            for t in tok.encode(str(bounds[bound]), add_special_tokens=False):
                if not c.allowed()[t]:
                    break
                c.advance(t)
            else:
                assert not c.allowed()[tok.eos_token_id], bounds


def test_numbers_that_would_crash_the_grammar_engine_are_refused_and_the_process_lives():
    """llguidance ends the whole process (SIGSEGV, no error) as it builds a JSON Schema that holds an integer at or
    below -2^63 in a const or an enum, or an integer range whose two ends lie there: one request with
    {"enum": ["x", -9223372036854775807]} (or the same in a tool's parameters, or a Lark grammar's %json) killed the
    server. Each is refused, in a child process (where the old code crashed it), with a reason."""
    import subprocess
    import sys

    m = -9223372036854775807
    cases = [("json_schema", {"const": m}), ("json_schema", {"enum": ["x", m]}),
             ("json_schema", {"type": "object", "properties": {"a": {"const": {"b": [m]}}}}),
             ("json_schema", {"type": "integer", "minimum": -1e19, "maximum": -9.3e18}),
             ("json_schema", {"type": "integer", "const": -1e30}),
             ("json_schema", {"allOf": [{"type": "integer"}, {"minimum": m, "maximum": m}]}),
             ("grammar", f'start: %json {{"const": {m}}}')]
    code = ("import json, sys\nfrom waferline.engine.sequence import check_request\n"
            "from waferline.engine.sampling import SamplingParams\nfrom waferline.errors import RequestError\n"
            "for kind, value in json.loads(sys.argv[1]):\n"
            "    try:\n        check_request([1], SamplingParams(**{kind: value}), 4096, 64)\n"
            "        print('let through')\n    except RequestError as e:\n        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == len(cases) and all(re.match(r"(json_schema|grammar) cannot be used: the number -\S+ "
                                                     r"\(in \"(const|enum|minimum)\"\) is at or below -2\^63", line)
                                            for line in lines), lines
    for fine in ({"default": m, "type": "integer"}, {"type": "integer", "minimum": -9e18, "maximum": 0},
                 {"type": "object", "properties": {"const": {"type": "integer"}}}):
        structured.grammar_of(SamplingParams(json_schema=fine))  # (no RequestError)


def test_integer_bounds_past_2_53_the_grammar_engine_moves_are_refused(tok):
    """llguidance reads a schema's bounds as f64 and an integer's range as i64: {"type": "integer", "minimum": 1e19,
    "maximum": 2e19} gave the output 9223372036854775807 (i64's largest, under the minimum) with finish_reason "stop",
    and {"minimum": 9007199254740993} (2^53 + 1) allowed 9007199254740992. Such a schema is refused before it queues,
    naming the number; the bounds past 2^53 that it holds to (int64's and uint64's ranges) are not."""
    from waferline.engine.sequence import check_request

    for schema, text in (({"type": "integer", "minimum": 1e19, "maximum": 2e19}, "9223372036854775807"),
                         ({"type": "integer", "minimum": 9007199254740993}, "9007199254740992"),
                         ({"type": "number", "minimum": 9007199254740993, "maximum": 9007199254740993},
                          "9007199254740992"),
                         ({"type": "integer", "const": 10 ** 20}, "9223372036854775807"),
                         ({"type": "integer", "enum": [1e30, 5]}, "9223372036854775807")):
        with pytest.raises(RequestError, match=rf"^json_schema cannot be used: the grammar engine would let {text} "
                                               r"through .* \(it reads numbers as 64-bit floats"):
            check_request([1, 2], SamplingParams(json_schema={"type": "array", "items": schema}), len(tok), 64)
    for schema in ({"type": "integer", "minimum": 0, "maximum": 2 ** 63 - 1},
                   {"type": "integer", "maximum": 2 ** 64 - 1}, {"type": "integer", "maximum": 9007199254740993},
                   {"const": 1e30}, {"enum": [10 ** 20]},
                   {"type": "number", "minimum": 1e18, "maximum": 1e18}):
        check_request([1, 2], SamplingParams(json_schema=schema), len(tok), 64)  # (no RequestError)
    c = structured.constraint(tok, len(tok), frozenset({tok.eos_token_id}),
                              SamplingParams(json_schema={"type": "integer", "minimum": 0, "maximum": 2 ** 63 - 1}))
    for t in tok.encode(str(2 ** 63), add_special_tokens=False):  # (int64's bound held: one past it never whole)
        if not c.allowed()[t]:
            break
        c.advance(t)
    else:
        assert not c.allowed()[tok.eos_token_id]


def test_a_dead_end_past_the_first_bytes_ends_the_request_with_its_reason(sol, tok):
    """A grammar with texts whose dead end the check before the request queues does not find (a branch past a whole
    text's, a tokenizer that cannot write what comes next) ends the request, where its output reaches it, with a reason
    that says so: not the grammar engine's internal name for it (NoExtensionBias)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from waferline.engine.llm import LLM
    from waferline.engine.sequence import check_request

    dead = r"structured output: a dead end after 1 output token: no token of the model's vocabulary continues"
    params = SamplingParams(max_tokens=8, grammar='start: "x" /[a&&b]/ | "y"')
    check_request([1, 2], params, len(tok), 64)  # ("y" is whole: no RequestError before it queues)
    c = structured.constraint(tok, len(tok), frozenset({tok.eos_token_id}), params)
    x = tok.encode("x", add_special_tokens=False)[0]
    assert c.allowed()[x]
    c.advance(x)
    with pytest.raises(RequestError, match=re.escape(dead)):
        c.allowed()
    tk = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "x": 2}, merges=[]))  # (no "y": the text "xy" cannot be written)
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>")
    c = structured.constraint(hf, len(hf), frozenset({hf.eos_token_id}), SamplingParams(regex="xy|b"))
    c.advance(2)
    with pytest.raises(RequestError, match=re.escape(dead)):
        c.allowed()
    llm = LLM(sol)
    try:
        with pytest.raises(RequestError, match=re.escape(dead)):
            llm.generate([llm.encode("The wafer")], SamplingParams(max_tokens=8, logit_bias={x: 100.0},
                                                                  grammar='start: "x" /[a&&b]/ | "y"'))
    finally:
        llm.close()


def test_generate_holds_every_kind(sol):
    """LLM.generate: sampled rows that stopped are whole texts of their kind, greedy ones too, and a row's tokens are
    the ones it gets alone (each row its own constraint)."""
    from waferline.engine.llm import LLM

    llm = LLM(sol)
    try:
        prompts = [llm.encode(p) for p in ("The wafer holds", "Experts route tokens", "KING. Speak")]
        stopped = 0
        for kind, value in KINDS.items():
            for temperature in (1.0, 0.0):
                params = SamplingParams(max_tokens=48, temperature=temperature, seed=5, **{kind: value})
                outs = llm.generate(prompts, params)
                for out in outs:
                    if out.finish_reason == "stop":
                        stopped += 1
                        assert WHOLE[kind](out.text), (kind, out.text)
                assert outs[0].token_ids == llm.generate(prompts[:1], params)[0].token_ids
        assert stopped >= 15
    finally:
        llm.close()


def test_a_batch_with_params_per_prompt_gives_each_row_its_lone_tokens(sol):
    """LLM.generate with one SamplingParams per prompt (every structured kind, greedy, sampled with logprobs): each row
    is what it gives alone; a list of the wrong length is refused."""
    from waferline.engine.llm import LLM

    llm = LLM(sol)
    try:
        ids = llm.encode("The wafer holds")
        params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, **{k: v})
                  for s, (k, v) in enumerate(KINDS.items())]
        params += [SamplingParams(max_tokens=12), SamplingParams(max_tokens=20, temperature=0.8, seed=9, logprobs=1)]
        batch = llm.generate([ids] * len(params), params)
        for p, out in zip(params, batch):
            alone = llm.generate([ids], p)[0]
            assert out.token_ids == alone.token_ids and out.text == alone.text
        assert batch[-1].logprobs is not None and batch[-2].logprobs is None and len(batch[-2].token_ids) <= 12
        with pytest.raises(RequestError, match="one per prompt"):
            llm.generate([ids, ids], params[:1])
    finally:
        llm.close()


def test_a_stop_token_the_grammar_needs_and_min_tokens_give_way(sol):
    """A stop token id that is also text the grammar allows may be drawn there (and ends the output); min_tokens gives
    way where the text is whole and can only end; special tokens stay in the text with skip_special_tokens False."""
    from waferline.engine.llm import LLM

    llm = LLM(sol)
    try:
        tok = llm.tokenizer
        dot = tok.encode(".", add_special_tokens=False)
        ids = llm.encode("The wafer holds")
        out = llm.generate([ids], SamplingParams(max_tokens=30, regex=r"N\.a", stop_token_ids=dot))[0]
        assert out.finish_reason == "stop" and out.text == "N"  # (the stop token ended it; no request error)
        for seed in range(3):
            out = llm.generate([ids], SamplingParams(max_tokens=20, temperature=1.0, seed=seed, choice=["yes", "no"],
                                                     min_tokens=8))[0]
            assert out.finish_reason == "stop" and out.text in ("yes", "no")
        bos = tok.bos_token_id
        kw = dict(max_tokens=3, logit_bias={bos: 100.0})
        assert "<s>" not in llm.generate([ids], SamplingParams(**kw))[0].text
        assert llm.generate([ids], SamplingParams(skip_special_tokens=False, **kw))[0].text == "<s><s><s>"
    finally:
        llm.close()


def test_generate_flags_take_a_file_or_the_text(tmp_path):
    from waferline.cli import _file_or_text

    long = json.dumps({"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(40)}})
    assert len(long) > 300 and _file_or_text(long) == long  # (longer than a file name may be: the text itself)
    f = tmp_path / "schema.json"
    f.write_text(long)
    assert _file_or_text(str(f)) == long and _file_or_text("[a-z]+") == "[a-z]+" and _file_or_text(None) is None


def test_json_is_compact_unless_the_schema_says_otherwise(tok):
    """Between JSON tokens at most one space by default; a schema's x-guidance whitespace options are its own."""
    nl, sp = tok.encode("\n", add_special_tokens=False)[-1], tok.encode(" ", add_special_tokens=False)[-1]
    brace = tok.encode("{", add_special_tokens=False)[0]
    for schema, newline in (({"type": "object"}, False),
                            ({"type": "object", "x-guidance": {"whitespace_flexible": True}}, True)):
        for kw in ({"json_schema": schema},) + (({"json_object": True},) if not newline else ()):
            c = structured.constraint(tok, len(tok), frozenset({tok.eos_token_id}), SamplingParams(**kw))
            c.advance(brace)
            assert bool(c.allowed()[nl]) == newline and c.allowed()[sp]


def test_a_model_without_an_end_token_ends_a_whole_text_at_the_tokenizers(tmp_path):
    """A config that names no end-of-sequence token (random demo models do that to run to max_tokens): a structured
    output still ends where its text is whole, at the tokenizer's end token, instead of finding no token to draw."""
    from waferline.demo import DEMO_TEXT, SOL_DEMO_CONFIG, write_tokenizer
    from waferline.engine.llm import LLM
    from waferline.model.init import write_random_checkpoint

    ck = write_random_checkpoint(dict(SOL_DEMO_CONFIG, eos_token_id=None), tmp_path / "no_eos")
    write_tokenizer(ck, DEMO_TEXT, SOL_DEMO_CONFIG["vocab_size"])
    llm = LLM(ck)
    try:
        assert not llm.eos_token_ids
        ids = llm.encode("The wafer")
        for seed in range(3):
            out = llm.generate([ids], SamplingParams(max_tokens=20, temperature=1.0, seed=seed, choice=CHOICES))[0]
            assert out.finish_reason == "stop" and out.text in CHOICES
            # (the end token is not text: with skip_special_tokens False the text read "yes</s>")
            kept = llm.generate([ids], SamplingParams(max_tokens=20, temperature=1.0, seed=seed, choice=CHOICES,
                                                      skip_special_tokens=False))[0]
            assert kept.token_ids == out.token_ids and kept.text == out.text
        assert len(llm.generate([ids], SamplingParams(max_tokens=6))[0].token_ids) == 6  # (plain: to max_tokens)
        # a stop token id of the request's own is one more way to end: the tokenizer's end token still ends a whole
        # text (that id had been the only one it could end at: a regex that could go on ran to max_tokens)
        tok, eos = llm.tokenizer, llm.tokenizer.eos_token_id
        hash_id = tok.encode("#", add_special_tokens=False)[0]
        p = SamplingParams(max_tokens=20, choice=["Norway"], stop_token_ids=[hash_id])
        c = structured.constraint(tok, SOL_DEMO_CONFIG["vocab_size"], frozenset({hash_id}), p)
        for t in tok.encode("Norway", add_special_tokens=False):
            c.advance(t)
        assert c.allowed().nonzero().flatten().tolist() == sorted([eos, hash_id])
        out = llm.generate([ids], p)[0]
        assert out.token_ids[-1] in (eos, hash_id) and out.finish_reason == "stop" and out.text == "Norway"
    finally:
        llm.close()


def test_a_grammar_naming_token_ids_is_checked_with_the_models_tokenizer(tok):
    """A Lark grammar may name tokens by id ("<[300]>"): the check that some text starts a grammar, made over single
    bytes, has no such token and refused these grammars (400 "no text holds to it") that the model's tokenizer holds."""
    from waferline.engine.sequence import check_request

    tid = len(tok) - 1
    assert tid > 256
    for g in (f'start: <[{tid}]> "x"', f'start: "a" | <[{tid}]>'):
        check_request([1, 2], SamplingParams(grammar=g), len(tok), 64)  # (no RequestError)
    c = structured.constraint(tok, len(tok), frozenset({tok.eos_token_id}), SamplingParams(grammar=f"start: <[{tid}]>"))
    assert c.allowed().nonzero().flatten().tolist() == [tid]


def _byte_level(vocab_extra: dict[str, int] | None = None, merges=(), special=(), added=(), eos="</s>"):
    """A byte-level BPE tokenizer (GPT-2 / Llama-3 / Qwen style): the 256 byte characters, ``vocab_extra`` pieces,
    ``special`` added tokens that are special and ``added`` ones that are text (Qwen's "<tool_call>")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))} | (vocab_extra or {})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tk.add_special_tokens(list(special))
    tk.add_tokens(list(added))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos)


def _spell(c, tok, text: str) -> None:
    for t in tok.encode(text, add_special_tokens=False):
        assert c.allowed()[t], (text, tok.convert_ids_to_tokens(t))
        c.advance(t)


def test_added_tokens_that_are_not_special_are_text(tmp_path):
    """Qwen 2.5 / 3: "<tool_call>", "</tool_call>", "<think>" are added tokens, not special ones. llguidance alone took
    every added "<...>" token for a special one, while its tokenizer spells the text "<tool_call>" as that token: a
    grammar that forces the text allowed only the token, then refused it. They are text: written as the token or its
    bytes, allowed only where their text is, still named as tokens by a Lark grammar, and in the output's text."""
    from tiny_models import build
    from waferline.engine.llm import LLM

    hf = _byte_level(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                     added=["<tool_call>", "</tool_call>", "<think>", "</think>"], eos="<|im_end|>")
    tc, end_tc, think = hf.convert_tokens_to_ids(["<tool_call>", "</tool_call>", "<think>"])
    build("qwen3", tmp_path, vocab_size=len(hf) + 37)  # (padded embedding rows: never allowed)
    hf.save_pretrained(tmp_path)
    llm = LLM(tmp_path)
    try:
        tok = llm.tokenizer
        stop = frozenset({tok.eos_token_id})
        regex = SamplingParams(regex="<tool_call>[a-z]{1,3}</tool_call>")
        c = structured.constraint(tok, len(tok) + 37, stop, regex)
        assert c.allowed().nonzero().flatten().tolist() == [tc]  # (the bytes ahead are forced: the token spells them)
        c.advance(tc)
        _spell(c, tok, "ab")
        c.advance(end_tc)
        assert c.complete
        c = structured.constraint(tok, len(tok), stop, regex)  # (the text in its bytes holds to it too)
        for ch in "<tool_call>ab</tool_call>":
            c.advance(tok.convert_tokens_to_ids(ch))
        assert c.complete
        for rx, allowed in (("[a-z<>_]+", {tc, think}), ("<[a-z]+>", {think}), ("[a-z]+", set())):
            m = structured.constraint(tok, len(tok) + 37, stop, SamplingParams(regex=rx)).allowed()
            assert {t for t in (tc, end_tc, think) if m[t]} == allowed, rx
            assert not m[len(tok):].any()
        g = SamplingParams(grammar='start: <tool_call> "x" | "<think>" // <think>')
        c = structured.constraint(tok, len(tok), stop, g)  # (the token by name; the quoted text stays text)
        assert set(c.allowed().nonzero().flatten().tolist()) == {tc, think, tok.convert_tokens_to_ids("<")}
        c.advance(tc)
        _spell(c, tok, "x")
        assert c.complete
        out = llm.generate([llm.encode("The wafer")], SamplingParams(max_tokens=12, logit_bias={tc: 100.0},
                                                                     regex="<tool_call>[a-z]{1,3}</tool_call>"))[0]
        assert out.finish_reason == "stop" and re.fullmatch("<tool_call>[a-z]{1,3}</tool_call>", out.text), out.text
        assert out.token_ids[0] == tc
    finally:
        llm.close()


def test_the_name_of_a_special_token_is_text_where_a_grammar_spells_it():
    """Llama-3 style specials ("<|eot_id|>", "<|python_tag|>"): a grammar that forces their names as text gets the text,
    spelled in other tokens. The tokenizer spells it as the special token, which the mask then allowed: an end
    token there ended the output at once with nothing of the text ("stop"), another one the grammar refused."""
    hf = _byte_level(special=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|python_tag|>"], eos="<|eot_id|>")
    specials = set(hf.all_special_ids)
    eot = hf.eos_token_id
    for rx in (r"<\|eot_id\|>", r"x<\|python_tag\|>y"):
        c = structured.constraint(hf, len(hf), frozenset({eot}), SamplingParams(regex=rx))
        text = ""
        while not c.complete:
            ids = c.allowed().nonzero().flatten().tolist()
            assert ids and not specials & set(ids), (rx, text)
            c.advance(ids[0])
            text += hf.decode([ids[0]])
        assert re.fullmatch(rx, text) and c.allowed().nonzero().flatten().tolist() == [eot]


def test_a_vocabulary_with_holes_keeps_the_tokens_past_its_count():
    """A vocabulary whose ids skip some (258 tokens, the last id 300): llguidance read only the ids below the count,
    and its tokenizer's "ab" (id 300) then failed the request (a panic of the grammar engine). Past the last id
    nothing is allowed."""
    hf = _byte_level({"ab": 300}, merges=[("a", "b")], special=["</s>"])
    assert len(hf) == 258 and hf.encode("ab") == [300]
    c = structured.constraint(hf, 320, frozenset({hf.eos_token_id}), SamplingParams(regex="[ab]+c"))
    m = c.allowed()
    assert m[300] and m[hf.convert_tokens_to_ids("a")] and not m[301:].any()
    c.advance(300)
    _spell(c, hf, "abc")
    assert c.complete and c.allowed()[hf.eos_token_id]


def test_the_byte_vocabularys_end_token_is_neither_text_nor_a_grammars_token(tok):
    """The check over single bytes before a request queues has an end token, "<end>" (id 256): the text "<end>" was
    spelled as it (regex "<start>[a-z]+<end>", the choice "<end>", a schema's "<end>" refused: 400 "no text holds to
    it", whatever the model), and a grammar naming the model's "<end>" or its token 256 meant it. Both are held to."""
    from waferline.engine.sequence import check_request

    stop = frozenset({tok.eos_token_id})
    schema = {"type": "object", "properties": {"<end>": {"const": 1}}, "required": ["<end>"]}
    for kw, text in ((dict(regex="<start>[a-z]{1,3}<end>"), "<start>ab<end>"), (dict(choice=["<end>", "x"]), "<end>"),
                     (dict(json_schema=schema), '{"<end>":1}')):
        check_request([1, 2], SamplingParams(**kw), len(tok), 64)  # (no RequestError)
        c = structured.constraint(tok, len(tok), stop, SamplingParams(**kw))
        _spell(c, tok, text)
        assert c.complete, kw
    hf = _byte_level({"ab": 256}, merges=[("a", "b")], special=["</s>", "<end>"])
    end = hf.convert_tokens_to_ids("<end>")
    assert hf.encode("ab") == [256] and end == 258
    for g, ids in (('start: "x" <end>', [hf.convert_tokens_to_ids("x"), end]), ("start: <[256]>", [256])):
        check_request([1, 2], SamplingParams(grammar=g), len(hf), 64)  # (no RequestError)
        c = structured.constraint(hf, len(hf), frozenset({hf.eos_token_id}), SamplingParams(grammar=g))
        for t in ids:
            assert c.allowed().nonzero().flatten().tolist() == [t], g
            c.advance(t)
        assert c.complete


def test_a_token_past_the_models_vocabulary_that_the_grammar_needs_is_a_dead_end():
    """A tokenizer larger than the model's vocabulary (an added "<tool_call>" past its embedding rows) and a grammar
    whose text ahead is that token: the mask allowed nothing, and sampling failed on NaN probabilities ("cannot
    sample"), greedy drew token 0 and the grammar engine refused it. The request ends with the dead end's reason."""
    hf = _byte_level(special=["</s>"], added=["<tool_call>"])
    tc = hf.convert_tokens_to_ids("<tool_call>")
    c = structured.constraint(hf, tc, frozenset({hf.eos_token_id}), SamplingParams(regex="<tool_call>x"))
    with pytest.raises(RequestError, match=r"^structured output: a dead end after 0 output tokens: no token"):
        c.allowed()
    c = structured.constraint(hf, tc + 1, frozenset({hf.eos_token_id}), SamplingParams(regex="<tool_call>x"))
    assert c.allowed().nonzero().flatten().tolist() == [tc]
