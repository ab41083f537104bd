"""An output's text with a SentencePiece tokenizer (Llama-2 / Mistral style: "▁" marks a space, characters outside the
vocabulary as byte-fallback pieces "<0xNN>", a decoder that strips the text's first space), as vLLM returns it and as
Hugging Face decodes prompt + output: the first space kept after a prompt that ends in byte pieces or a special token,
min_tokens against a stop string a character's last byte completes, a max_tokens cut inside a character."""

import httpx
import pytest

from waferline import LLM, SamplingParams
from waferline.engine.scheduler import Scheduler, SchedulerConfig
from waferline.engine.sequence import Sequence

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def sp_ckpt(tmp_path_factory):
    """A tiny llama checkpoint with a SentencePiece-style tokenizer (BOS added, byte fallback, a ChatML template)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    from tiny_models import build

    d = tmp_path_factory.mktemp("sp")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3}
    vocab |= {f"<0x{i:02X}>": len(vocab) + i for i in range(256)}
    merges = []
    for w in ("\u2581Hello", "\u2581the", "\u2581x"):  # (each word merged from its characters)
        for ch in w:
            vocab.setdefault(ch, len(vocab))
        for i in range(2, len(w) + 1):
            merges.append((w[:i - 1], w[i - 1]))
            vocab.setdefault(w[:i], len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                 additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    hf.chat_template = CHATML
    build("llama", d, vocab_size=len(hf))
    hf.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def sp_llm(sp_ckpt, one_thread):
    return LLM(sp_ckpt)


def _ids(llm, *pieces: str) -> list[int]:
    return [llm.tokenizer.convert_tokens_to_ids(p) for p in pieces]


def _streamed(llm, prompt: list[int], toks: list[int], params: SamplingParams) -> str:
    """The text a stream sends for the output ``toks`` (fed to the scheduler as a decode step's tokens), joined."""
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=1))
    events: list = []
    seq = Sequence("s", list(prompt), params, events.append)
    for tok in toks:
        if seq.status == "finished":
            break
        sch._sample(seq, None, tok)
    assert seq.status == "finished"
    return "".join(e.text for e in events)


def test_the_first_space_stays_after_a_prompt_ending_in_byte_pieces_or_a_special_token(sp_llm):
    """The output's text is decoded after enough of the prompt to read: a last character in byte-fallback pieces
    (alone, the last piece is U+FFFD) or a special token skipped from the text (alone, nothing) is not enough."""
    llm, hf = sp_llm, sp_llm.tokenizer
    hello, start = _ids(llm, "\u2581Hello", "<|im_start|>")
    for prompt in (hf.encode("the x"), hf.encode("the \U0001f44d"), hf.encode("caf\u00e9"),
                   hf.encode("the x") + [start]):
        assert hf.decode(prompt[-1:], skip_special_tokens=True) in ("", "\ufffd", "x")
        want = hf.decode(prompt + [hello, hello], skip_special_tokens=True)[len(hf.decode(prompt,
                                                                                          skip_special_tokens=True)):]
        assert want == " Hello Hello"
        for params in (SamplingParams(max_tokens=2, logit_bias={hello: 100}, ignore_eos=True),
                       SamplingParams(max_tokens=3, logit_bias={hello: 50, 2: 100}, min_tokens=2,
                                      stop_token_ids=[2])):
            assert llm.generate([prompt], params)[0].text == want, (prompt, params)
            assert _streamed(llm, prompt, [hello, hello, 2], params) == want, (prompt, params)


def test_min_tokens_lets_a_stop_string_that_its_last_token_completes_end_the_output(sp_llm):
    """min_tokens 3 and the stop string "é" whose second byte is the third token: it ends the output (as the stream
    ends it, and vLLM, which looks for stop strings from the min_tokens-th token on), in LLM.generate too."""
    llm, hf = sp_llm, sp_llm.tokenizer
    out = _ids(llm, "\u2581", "<0xC3>", "<0xA9>", "\u2581Hello", "\u2581Hello")
    prompt = hf.encode("the x")
    for min_tokens, want, reason in ((0, " ", "stop"), (3, " ", "stop"), (4, " \u00e9 Hello Hello", "length")):
        params = SamplingParams(max_tokens=5, stop=["\u00e9"], min_tokens=min_tokens)
        stop_ids = {2}
        n = 3 if reason == "stop" else 5
        assert llm.make_output(prompt, out[:n], reason, stop_ids, params, {}).text == want, min_tokens
        assert _streamed(llm, prompt, out, params) == want, min_tokens


def test_a_max_tokens_cut_inside_a_character_keeps_the_whole_characters_before_it(sp_llm):
    """A byte-fallback decoder turns every byte of a run of byte pieces that is not whole UTF-8 into U+FFFD: an output
    cut by max_tokens after the first byte of "中" must not lose the "é" and "中" before it (sent already when
    streamed); the incomplete character reads U+FFFD, streamed or not."""
    llm, hf = sp_llm, sp_llm.tokenizer
    prompt = hf.encode("the x")
    out = [hf.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "\u00e9\u4e2d\u4e2d".encode()][:-2]
    assert hf.decode(out) == "\ufffd" * 6  # (the whole run, decoded together)
    want = "\u00e9\u4e2d\ufffd"
    for params in (SamplingParams(max_tokens=len(out)), SamplingParams(max_tokens=len(out), stop=["zz"])):
        assert llm.make_output(prompt, out, "length", {2}, params, {}).text == want
        assert _streamed(llm, prompt, out, params) == want
    # (stopped by the end-of-sequence token right after the incomplete character: the same)
    assert llm.make_output(prompt, out + [2], "stop", {2}, SamplingParams(max_tokens=9), {}).text == want
    assert _streamed(llm, prompt, out + [2], SamplingParams(max_tokens=9)) == want


def test_served_text_keeps_the_first_space_after_a_character_in_byte_pieces(sp_ckpt, one_thread):
    """Completions (streamed or not, echoed) and chat after a prompt whose last character is byte-fallback pieces."""
    from server_helpers import serve_in_thread
    from waferline.server.commands import build_server

    app = build_server(sp_ckpt, max_num_seqs=4, max_model_len=128, served_model_name="sp")
    hf = app.state.server.llm.tokenizer
    hello = hf.convert_tokens_to_ids("\u2581Hello")
    with serve_in_thread(app) as base:
        body = {"model": "sp", "prompt": "the \U0001f44d", "max_tokens": 2, "temperature": 0,
                "logit_bias": {str(hello): 100}}
        r = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        assert r["choices"][0]["text"] == " Hello Hello"
        r = httpx.post(base + "/v1/completions", json=body | {"echo": True}, timeout=60).json()
        assert r["choices"][0]["text"] == "the \U0001f44d Hello Hello"
        with httpx.stream("POST", base + "/v1/completions", json=body | {"stream": True}, timeout=60) as resp:
            chunks = [line[6:] for line in resp.iter_lines() if line.startswith("data: {")]
        assert "".join(httpx.Response(200, content=c).json()["choices"][0]["text"] for c in chunks) == " Hello Hello"
        chat = {"model": "sp", "max_tokens": 2, "temperature": 0, "logit_bias": {str(hello): 100},
                "messages": [{"role": "user", "content": "the x"}, {"role": "assistant", "content": "caf\u00e9"}],
                "continue_final_message": True, "add_generation_prompt": False}
        r = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60).json()
        assert r["choices"][0]["message"]["content"] == " Hello Hello"  # (continues "café": "café Hello Hello")


def test_a_bad_byte_after_whole_characters_in_byte_pieces_keeps_them(sp_llm):
    """Hugging Face's ByteFallback decoder turns every byte of a run of byte pieces that is not whole UTF-8 into
    U+FFFD: "Q" (<0x51>) followed by two bad bytes read "\\ufffd" * 3 decoded together, though the stream sent "Q"
    when it came. The text reads as UTF-8 with replacement reads it (one U+FFFD a bad byte sequence), streamed, in
    LLM.generate's output and decoded."""
    llm, hf = sp_llm, sp_llm.tokenizer
    prompt = hf.encode("the x")
    out = _ids(llm, "<0x51>", "<0xAB>", "<0xF0>", "\u2581Hello", "<0xC3>", "<0xA9>", "<0xFF>", "<0x41>")
    want = "Q\ufffd\ufffd Hello\u00e9\ufffdA"
    assert b"Q\xab\xf0 Hello\xc3\xa9\xffA".decode("utf-8", "replace") == want
    assert llm.decode(out) == want and llm.decode(out, after=prompt) == want
    for params in (SamplingParams(max_tokens=len(out)), SamplingParams(max_tokens=len(out), stop=["zz"])):
        assert llm.make_output(prompt, out, "length", {2}, params, {}).text == want
        assert _streamed(llm, prompt, out, params) == want
    params = SamplingParams(max_tokens=9, stop=["\u00e9"])  # (a stop string after them: the text before it)
    assert llm.make_output(prompt, out[:6], "stop", {2}, params, {}).text == "Q\ufffd\ufffd Hello"
    assert _streamed(llm, prompt, out, params) == "Q\ufffd\ufffd Hello"


def test_streamed_text_adds_up_to_the_output_text_for_random_tokens(sp_llm):
    """Random outputs (byte pieces, words, special tokens; ended by max_tokens, the end-of-sequence token or stop
    strings, one a prefix of another): the text streamed piece by piece is the output's text, with no U+FFFD sent
    for a character a later token completes, and each token's text_offset within the text, in order."""
    import random

    llm, hf = sp_llm, sp_llm.tokenizer
    rng = random.Random(0)
    pool = [*range(len(hf))] + _ids(llm, *(f"<0x{b:02X}>" for b in "\u00e9\u4e2d\U0001f44d".encode())) * 8
    for _ in range(200):
        prompt, toks = [rng.choice(pool) for _ in range(3)], [rng.choice(pool) for _ in range(12)]
        whole = llm.decode(toks)
        stops = [whole[i:i + rng.randint(1, 3)] for i in rng.sample(range(len(whole)), min(2, len(whole)))]
        stops += [s[:-1] for s in stops[:1] if len(s) > 1]
        params = SamplingParams(max_tokens=rng.randint(1, 12), stop=stops if rng.random() < 0.5 else [],
                                skip_special_tokens=rng.random() < 0.7)
        sch = Scheduler(llm, SchedulerConfig(max_num_seqs=1))
        events: list = []
        seq = Sequence("s", prompt, params, events.append)
        for tok in toks:
            if seq.status != "finished":
                sch._sample(seq, None, tok)
        out = llm.make_output(prompt, seq.output_ids, seq.finish_reason, {2}, params, {}).text
        sent = [e.text for e in events]
        assert "".join(sent) == out, (prompt, seq.output_ids, params, sent, out)
        offsets = [e.text_offset for e in events if e.token_id is not None]
        assert offsets[-1] <= len(out), (offsets, out)
        assert offsets == sorted(offsets) or params.stop, offsets  # (sent before a stop string cut the text)


def test_served_logprobs_text_offsets_stay_inside_a_text_a_stop_string_cut(sp_ckpt, one_thread):
    """The stop string "o Hello H" starts inside the first "▁Hello" and ends in the third: the text is " Hell" and the
    second and third tokens' text_offset is its end (not 6 and 12, past it), streamed (the token that ends it) or not;
    the streamed text is the text, through the openai client."""
    import openai

    from server_helpers import serve_in_thread
    from waferline.server.commands import build_server

    app = build_server(sp_ckpt, max_num_seqs=4, max_model_len=128, served_model_name="sp")
    hello = app.state.server.llm.tokenizer.convert_tokens_to_ids("\u2581Hello")
    with serve_in_thread(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        kw = dict(model="sp", prompt="the x", max_tokens=5, temperature=0, logit_bias={str(hello): 100},
                  stop=["o Hello H"], logprobs=0)
        r = client.completions.create(**kw).choices[0]
        assert (r.text, r.finish_reason, r.logprobs.text_offset) == (" Hell", "stop", [0, 5, 5])
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
        assert "".join(c.text for c in chunks) == " Hell"
        assert [c.logprobs.text_offset[0] for c in chunks if c.logprobs][-1] == 5


def test_served_echo_and_detokenize_read_a_bad_byte_as_an_output_does(sp_ckpt, one_thread):
    """A prompt of token ids "Q" <0xAB> <0xF0> "▁Hello" echoed with log-probabilities: the echo reads
    "Q\\ufffd\\ufffd Hello" (not "\\ufffd" * 3 " Hello", which the text_offsets [0, 1, 2, 2] did not index), as
    /detokenize and a generated output with those tokens read it."""
    import openai

    from server_helpers import serve_in_thread
    from waferline.server.commands import build_server

    app = build_server(sp_ckpt, max_num_seqs=4, max_model_len=128, served_model_name="sp")
    ids = app.state.server.llm.tokenizer.convert_tokens_to_ids(["<0x51>", "<0xAB>", "<0xF0>", "\u2581Hello"])
    with serve_in_thread(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        r = client.completions.create(model="sp", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=0,
                                      logit_bias={str(ids[-1]): 100}).choices[0]
        assert (r.text, r.logprobs.text_offset) == ("Q\ufffd\ufffd Hello Hello", [0, 1, 2, 2, 9])
        assert httpx.post(base + "/detokenize", json={"model": "sp", "tokens": ids}).json()["prompt"] == \
            "Q\ufffd\ufffd Hello"
