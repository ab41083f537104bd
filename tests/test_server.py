"""The scheduler (page accounting, chunked prefill, preemption) and the OpenAI-compatible server, tested with the
official `openai` client against a live server on 127.0.0.1."""

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from server_helpers import (
    KEY,
    MAX_LEN,
    _assert_error,
    _free_port,
    _metrics,
    _pages_in_use,
    _wait_until,
    fail_sampling,
    run_to_end,
    start_serve,
)
from tiny_models import build
from waferline import LLM, SamplingParams
from waferline.demo import DEMO_TEXT
from waferline.engine.scheduler import CacheManager, Scheduler, SchedulerConfig, Sequence
from waferline.errors import ConfigError

# ----------------------------------------------------------------------------- scheduler


def test_page_accounting_is_the_modelspec_accounting(sol, tmp_path):
    gpt = tmp_path / "gpt_oss"
    build("gpt_oss", gpt)  # one sliding-window (8) GQA layer, one full GQA layer
    for d in (sol, gpt):
        llm = LLM(d)
        cm = CacheManager(llm.spec, max_num_seqs=4, max_model_len=128, page_tokens=8, kv_bits=32, state_bits=32)
        kinds = {p.kind for p in cm.pools}
        assert kinds == ({"mamba2", "mla"} if d == sol else {"swa", "gqa"})
        for n in (8, 64, 128):  # page-aligned: the bytes a sequence holds are exactly the spec's
            assert cm.bytes_for(n) == pytest.approx(llm.spec.cache_bytes_per_seq(n, 32, 32))
        assert cm.budget == pytest.approx(4 * llm.spec.cache_bytes_per_seq(128, 32, 32))
        if d == gpt:
            swa = [p.kind for p in cm.pools].index("swa")
            assert cm.pages_for(100)[swa] == 1  # bounded by the window of 8 tokens
            assert cm.pages_for(100)[1 - swa] == 13
        else:
            assert cm.pages_for(100)[[p.kind for p in cm.pools].index("mamba2")] == 1  # one state slot
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        CacheManager(llm.spec, 4, 128, cache_bytes=100.0)
    with pytest.raises(ConfigError, match="max-num-seqs"):
        SchedulerConfig(max_num_seqs=0).validate()


def test_incremental_text_is_the_whole_decode(sol):
    """The scheduler decodes a sequence's text incrementally (Scheduler._text: the tokens since the last piece with
    that piece's tokens): after every token it is the whole output decoded at once, up to a last character still
    incomplete (U+FFFD), with the demo's byte-level tokenizer and sol-mini's: random token ids (bytes that do not
    form characters included), its own text's ids, and a tokenizer whose pieces do not add up (then the whole output
    again); the step's tokens each add a bounded window, not the whole output."""
    g = torch.Generator().manual_seed(5)
    for d in (sol, Path(__file__).resolve().parents[1] / "models" / "sol-mini"):
        llm = LLM(d)
        sch = Scheduler(llm, SchedulerConfig(max_num_seqs=1, max_model_len=128))
        V = llm.spec.vocab_size
        texts = llm.encode("To be, or not to be, that is the question: caf\u00e9 \u2014 \u00fcber ok")
        for ids in (torch.randint(0, V, (300,), generator=g).tolist(), texts * 3):
            seq = Sequence("r", [1], SamplingParams(max_tokens=400))
            lens = []
            orig = sch._decode
            sch._decode = lambda x, params=None, after=(): lens.append(len(x)) or orig(x, params, after)
            for t in ids:
                seq.output_ids.append(t)
                text, _ = sch._text(seq)
                whole = orig(seq.output_ids)
                assert whole.startswith(text), len(seq.output_ids)
                if not whole.endswith("\ufffd"):
                    assert text == whole, len(seq.output_ids)
            sch._decode = orig
            assert max(lens) < 40  # (windows of a few tokens, not the 300 of the output)
    llm = LLM(sol)
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=1, max_model_len=128))
    calls = []
    # pieces that do not add up
    sch._decode = lambda x, params=None, after=(): calls.append(x) or "".join(f"<{t}>" for t in x[::-1])
    seq = Sequence("r", [1], SamplingParams(max_tokens=10))
    for t in (5, 6, 7):
        seq.output_ids.append(t)
        assert sch._text(seq)[0] == "".join(f"<{t}>" for t in seq.output_ids[::-1])


@pytest.mark.parametrize("arch", ["sol", "gpt_oss", "deepseek_v32", "deepseek_v4", "qwen3_next", "kimi_linear"])
def test_chunked_prefill_and_preemption_keep_every_token(arch, sol, tmp_path, threads):
    """With a budget of ~2 sequences for 6 requests, chunked prefill and recompute preemption still produce
    exactly the tokens of LLM.generate for each prompt alone (greedy and seeded sampling): every cache scheme served
    (sparse and compressed attention, linear-attention state)."""
    d = sol
    if arch != "sol":
        d = tmp_path / arch
        build(arch, d)
    llm = LLM(d)
    prompts = [[(7 * i + 3 * j) % 100 + 3 for j in range(5 + 9 * i)] for i in range(6)]
    # (the last two also score their prompts: a sequence preempted while its prompt is scored keeps each score once)
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True,
                             prompt_logprobs=1 if i >= 4 else None) for i in range(6)]
    outs = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    want = [o.token_ids for o in outs]
    probe = CacheManager(llm.spec, 4, 80, page_tokens=4, kv_bits=32, state_bits=32)
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=4, max_model_len=80, page_tokens=4, chunk_tokens=7,
                                         max_num_batched_tokens=12, cache_bytes=probe.bytes_for(80) * 1.6))
    got: dict[int, list[int]] = {i: [] for i in range(6)}
    ends: dict[int, str] = {}
    scores: dict[int, list] = {}
    seqs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        def sink(ev, i=i):
            if ev.token_id is not None:
                got[i].append(ev.token_id)
            if ev.prompt_logprobs is not None:
                scores[i] = ev.prompt_logprobs
            if ev.finished:
                ends[i] = ev.finish_reason
        seqs.append(Sequence(f"r{i}", p, sp, sink))
        sch.add(seqs[-1])
    steps = 0
    while sch.has_work() and steps < 2000:
        sch.step()
        steps += 1
    assert ends == {i: "length" for i in range(6)}
    assert [got[i] for i in range(6)] == want
    assert sch.stats["preemptions"] > 0  # the budget really was too small for all of them at once
    assert seqs[0].preemptions == 0  # the newest running sequence gives way, never the oldest
    assert sorted(scores) == [4, 5]
    for i in (4, 5):
        lp = llm.prompt_logprobs(prompts[i])
        assert [x.token for x in scores[i]] == prompts[i][1:] == [x.token for x in outs[i].prompt_logprobs]
        assert [x.logprob for x in scores[i]] == pytest.approx(
            lp[torch.arange(len(prompts[i]) - 1), prompts[i][1:]].tolist(), abs=1e-4)
    assert sch.cache.used_bytes == 0 and sum(sch.cache.pages_in_use().values()) == 0 and sch.cache.free_slots == 4


def test_a_recomputed_prompt_is_scored_once():
    """Sequence.take_prompt_logprobs: row j of a scored chunk from position s scores prompt token s + j + 1; a chunk
    computed again after a preemption adds nothing known already, and the scores stop at the prompt's last token."""
    prompt = list(range(3, 23))  # 20 tokens: 19 scores
    seq = Sequence("r", prompt, SamplingParams(max_tokens=4, prompt_logprobs=0))
    rows = torch.log_softmax(torch.randn(40, 64), -1)  # the "model": row p scores position p + 1
    from waferline.engine.runner import RowOutput

    for start, end in ((0, 7), (7, 14), (0, 7), (7, 14), (14, 21)):  # preempted after 14, then the prompt + 1 token
        assert seq.scores_prompt == (len(seq.prompt_lps) < 19)
        seq.take_prompt_logprobs(start, RowOutput(logits=rows[start:end]))
    assert [lp.token for lp in seq.prompt_lps] == prompt[1:] and not seq.scores_prompt
    assert [lp.logprob for lp in seq.prompt_lps] == pytest.approx(rows[torch.arange(19), prompt[1:]].tolist())


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_prefix_cache_reuses_pages_and_keeps_tokens(arch, tmp_path, threads, sol):
    d = tmp_path / arch
    build(arch, d)
    llm = LLM(d)
    shared = [(5 * j) % 90 + 3 for j in range(37)]
    prompts = [shared + [10 + i, 20 + i, 30 + i] for i in range(4)] + [shared[:9], shared[:8] + [99, 98]]
    params = [SamplingParams(max_tokens=12, temperature=0.9 if i % 2 else 0.0, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    want = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=64, page_tokens=8, chunk_tokens=16))
    assert sch.prefix is not None
    first = run_to_end(sch, [Sequence("a", prompts[0], params[0])])
    assert first == want[:1] and sch.prefix.hit_tokens == 0 and sch.prefix.num_pages == (40 + 11) // 8
    seqs = [Sequence(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params)) if i]
    rest = run_to_end(sch, seqs)
    assert rest == want[1:]
    # prompts 1-3 reuse the 4 full pages of the shared 37 tokens; 9 tokens reuse 1 page; [8 shared + 2] reuse 1
    assert sch.prefix.hit_tokens == 8 * (3 * 4 + 1 + 1)
    assert [s.cached_tokens for s in seqs] == [32, 32, 32, 8, 8]  # (the server's usage.prompt_tokens_details)
    assert sch.cache.used_bytes == 0 and sch.cache.prefix_bytes == sch.prefix.num_pages * sch.cache.page_bytes
    # a prompt whose log-probabilities are asked for is computed whole, cached prefix or not
    hits, scored = sch.prefix.hit_tokens, []
    sch.add(Sequence("s", prompts[1], SamplingParams(max_tokens=2, prompt_logprobs=0),
                     lambda ev: ev.prompt_logprobs is not None and scored.extend(ev.prompt_logprobs)))
    while sch.has_work():
        sch.step()
    assert sch.prefix.hit_tokens == hits and len(scored) == len(prompts[1]) - 1
    assert [x.logprob for x in scored] == pytest.approx(
        llm.prompt_logprobs(prompts[1])[torch.arange(len(scored)), prompts[1][1:]].tolist(), abs=1e-4)
    # a budget of one sequence: stored pages are evicted for live ones, never the reverse
    tight = Scheduler(llm, SchedulerConfig(max_num_seqs=2, max_model_len=64, page_tokens=8, chunk_tokens=16,
                                           cache_bytes=CacheManager(llm.spec, 1, 64, 8, kv_bits=32).budget))
    assert run_to_end(tight, [Sequence(f"t{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]) == want
    assert tight.prefix.evicted_pages > 0 and tight.cache.prefix_bytes + tight.cache.used_bytes <= tight.cache.budget
    assert Scheduler(LLM(sol), SchedulerConfig(max_model_len=64)).prefix is None  # Mamba-2 state is not a prefix


# ----------------------------------------------------------------------------- the API


def test_completion_matches_the_engine(live, client):
    llm = live.state.server.llm
    prompt = "Cerebras wafers keep the weights"
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    want = llm.generate([prompt], sp)[0]
    r = client.completions.create(model="sol-test", prompt=prompt, max_tokens=12, temperature=0.8, top_p=0.95, seed=7,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.object == "text_completion" and r.model == "sol-test" and r.id.startswith("cmpl-")
    c = r.choices[0]
    assert c.model_extra["token_ids"] == want.token_ids and c.text == want.text and c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(llm.encode(prompt)), 12, len(llm.encode(prompt)) + 12)
    ids = client.completions.create(model="sol-test", prompt=llm.encode(prompt), max_tokens=12, temperature=0.8,
                                    top_p=0.95, seed=7, extra_body={"ignore_eos": True})
    assert ids.choices[0].text == want.text  # a prompt of token ids is the same prompt


def test_models_and_chat(live, client):
    import openai

    assert [m.id for m in client.models.list().data] == ["sol-test"]
    one = client.models.retrieve("sol-test")  # (GET /v1/models/{id}, as the openai client asks)
    assert one.id == "sol-test" and one.model_extra["max_model_len"] == live.state.server.engine.scheduler.max_model_len
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a wafer?"}]
    r = client.chat.completions.create(model="sol-test", messages=msgs, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str) and c.finish_reason == "length"
    # no chat_template in this tokenizer config: the documented fallback template is used
    from waferline.server.app import FALLBACK_CHAT_TEMPLATE, FALLBACK_GENERATION_PROMPT

    text = "".join(FALLBACK_CHAT_TEMPLATE.format(**m) for m in msgs) + FALLBACK_GENERATION_PROMPT
    llm = live.state.server.llm
    assert r.usage.prompt_tokens == len(llm.encode(text))
    want = llm.generate([text], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert c.message.content == want.text
    # with a chat_template in the tokenizer config, that template renders the prompt
    tok = llm.tokenizer
    tok.chat_template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}")
    try:
        r = client.chat.completions.create(model="sol-test", messages=msgs, max_tokens=2)
    finally:
        tok.chat_template = None
    assert r.usage.prompt_tokens == len(  # (a chat prompt: as its template writes it, no special tokens added)
        llm.tokenizer.encode("[system] Be brief.\n[user] What is a wafer?\n[assistant] ", add_special_tokens=False))


def test_a_developer_message_reaches_a_template_that_knows_only_system(live, client):
    """OpenAI's "developer" role (system instructions, as newer clients send them) renders as a "system" message
    through a template that does not name the role (as Qwen's, which would drop it silently and write its default
    system prompt instead); a template that names it gets it as it is."""
    llm = live.state.server.llm
    tok = llm.tokenizer
    qwen_like = ("{% if messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
                 "{% else %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
                 "{% for m in messages %}{% if m.role == 'user' or m.role == 'assistant' %}<|im_start|>{{ m.role }}\n"
                 "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{{ '<|im_start|>assistant\n' }}")
    kw = dict(model="sol-test", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    saved = tok.chat_template
    try:
        tok.chat_template = qwen_like
        got = [client.chat.completions.create(messages=[{"role": role, "content": "Answer in French."},
                                                        {"role": "user", "content": "hi"}], **kw)
               for role in ("system", "developer")]
        want = ("<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                "<|im_start|>assistant\n")
        assert [r.usage.prompt_tokens for r in got] == [len(tok.encode(want, add_special_tokens=False))] * 2
        assert got[0].choices[0].message.content == got[1].choices[0].message.content
        tok.chat_template = ("{% for m in messages %}{% if m.role == 'developer' %}[dev]{% endif %}{{ m.content }}"
                             "{% endfor %}")
        r = client.chat.completions.create(messages=[{"role": "developer", "content": "Be brief."}], **kw)
        assert r.usage.prompt_tokens == len(tok.encode("[dev]Be brief.", add_special_tokens=False))
    finally:
        tok.chat_template = saved


def test_streaming_with_usage(live, client):
    kw = dict(model="sol-test", prompt="A light cache lets many sequences", max_tokens=10, temperature=0.7, seed=3,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    no_usage = list(client.completions.create(stream=True, **kw))
    assert all(c.usage is None for c in no_usage) and len(no_usage) == 11  # 10 tokens + the finish chunk

    chat = list(client.chat.completions.create(model="sol-test", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, seed=1, stream=True,
                                               stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-2].choices[0].finish_reason == "length" and chat[-1].usage.completion_tokens == 5


def test_stop_strings_cut_the_text(live, client):
    free = client.completions.create(model="sol-test", prompt="Experts hold most parameters", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    assert len(stop) == 3
    r = client.completions.create(model="sol-test", prompt="Experts hold most parameters", max_tokens=24, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == free[:free.find(stop)]
    s = list(client.completions.create(model="sol-test", prompt="Experts hold most parameters", max_tokens=24,
                                       temperature=0, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in s) == free[:free.find(stop)]  # the stop string is never streamed


def test_offsets_do_not_lag_behind_text_held_for_a_stop_string(live, client):
    """A stop string longer than one character holds back the text that may start it; each token's text_offset is
    still where its text starts (it was taken from the text sent so far: [0, 0, 0, 0, 4, ...] with an 8-character
    stop), streamed and not, after an echoed prompt too."""
    kw = dict(model="sol-test", prompt="Experts hold most parameters", max_tokens=10, temperature=0, logprobs=0,
              extra_body={"ignore_eos": True})
    free = client.completions.create(**kw).choices[0]
    stop = "~" * 8
    assert stop not in free.text and len(set(free.logprobs.text_offset)) > 3
    held = client.completions.create(stop=stop, **kw).choices[0]
    assert held.text == free.text and held.logprobs.text_offset == free.logprobs.text_offset
    streamed = [ch.choices[0].logprobs.text_offset[0] for ch in client.completions.create(stop=stop, stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs is not None]
    assert streamed == free.logprobs.text_offset
    echo = client.completions.create(stop=stop, echo=True, **kw).choices[0]
    _assert_offsets_fit(echo.text, echo.logprobs.tokens, echo.logprobs.text_offset)
    n = len(free.logprobs.text_offset)
    assert echo.logprobs.text_offset[-n:] == [len(echo.text) - len(free.text) + o for o in free.logprobs.text_offset]


def test_logprobs_are_the_engines_streamed_or_not(live, client):
    """completions `logprobs=N` and chat `logprobs` + `top_logprobs`: each generated token's log-probability and the N
    most likely tokens', equal to LLM.generate's (greedy and seeded sampling), the same streamed, and the tokens are the
    ones a request without logprobs gets."""
    llm = live.state.server.llm
    ids = llm.encode("Speculative decoding drafts tokens")
    for temp in (0.0, 0.8):
        sp = SamplingParams(max_tokens=8, temperature=temp, seed=5, ignore_eos=True, logprobs=2)
        want = llm.generate([ids], sp)[0]
        kw = dict(model="sol-test", prompt=ids, max_tokens=8, temperature=temp, seed=5,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
        plain = client.completions.create(**kw).choices[0]
        c = client.completions.create(logprobs=2, **kw).choices[0]
        assert c.model_extra["token_ids"] == plain.model_extra["token_ids"] == want.token_ids
        texts = [llm.tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids]
        assert c.logprobs.tokens == texts and "".join(texts) == c.text
        assert c.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
        _assert_offsets_fit(c.text, c.logprobs.tokens, c.logprobs.text_offset)
        for top, lp, t in zip(c.logprobs.top_logprobs, want.logprobs, texts):
            alts = {llm.tokenizer.decode([i], skip_special_tokens=False): v for i, v in lp.top}
            assert len(lp.top) == 2 and top == pytest.approx(alts | {t: lp.logprob}, abs=1e-5)
        streamed = [ch.choices[0].logprobs for ch in client.completions.create(logprobs=2, stream=True, **kw)
                    if ch.choices and ch.choices[0].logprobs is not None]
        assert [x.tokens[0] for x in streamed] == texts
        assert [x.text_offset[0] for x in streamed] == c.logprobs.text_offset
        assert [x.token_logprobs[0] for x in streamed] == pytest.approx(c.logprobs.token_logprobs, abs=1e-6)
        assert plain.logprobs is None

    msgs = [{"role": "user", "content": "What is a wafer?"}]
    kw = dict(model="sol-test", messages=msgs, max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw).choices[0]
    content, toks = r.logprobs.content, r.model_extra["token_ids"]
    assert [e.token for e in content] == [llm.tokenizer.decode([t], skip_special_tokens=False) for t in toks]
    # byte-level BPE: each token's own bytes, which add up to the output's even where a token splits a character
    # (a random model's output need not be valid UTF-8: the text has U+FFFD where its bytes do not decode)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == llm.tokenizer.decode(
        toks, skip_special_tokens=False)
    assert any(e.bytes != list(e.token.encode()) for e in content)  # (the case the exact bytes are for)
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy: the most likely token
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.logprob <= 0
        assert [t.logprob for t in e.top_logprobs] == sorted([t.logprob for t in e.top_logprobs], reverse=True)
    only = client.chat.completions.create(logprobs=True, **kw).choices[0].logprobs.content
    assert [e.logprob for e in only] == pytest.approx([e.logprob for e in content], abs=1e-6)
    assert all(e.top_logprobs == [] for e in only)
    streamed = [e for ch in client.chat.completions.create(logprobs=True, top_logprobs=3, stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
    assert client.chat.completions.create(**kw).choices[0].logprobs is None

    url, auth = live.state.base + "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    for bad, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                       ({"logprobs": "yes"}, "logprobs")):
        err = _assert_error(httpx.post(url, headers=auth, json=dict(kw, **bad)), 400)
        assert err["param"] == param
    err = _assert_error(httpx.post(live.state.base + "/v1/completions", headers=auth,
                                   json={"model": "sol-test", "prompt": "hi", "logprobs": 21}), 400)
    assert err["param"] == "logprobs" and "[0, 20]" in err["message"]


def test_echo_scores_the_prompt(live, client):
    """completions `echo` with `logprobs`, as evaluation harnesses score a continuation: the prompt's tokens come first
    (the first without a log-probability), each scored as the engine scores the prompt, over several prefill chunks;
    `max_tokens` 0 scores the prompt alone. Streamed: the prompt in the first chunk."""
    llm = live.state.server.llm
    ids = llm.encode(DEMO_TEXT[:1000])[:70]  # longer than the server's prefill chunk (32 tokens)
    assert len(ids) == 70
    want = llm.prompt_logprobs(ids)
    kw = dict(model="sol-test", prompt=ids, echo=True, logprobs=1, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(max_tokens=0, **kw)
    c = r.choices[0]
    texts = [llm.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert c.text == llm.tokenizer.decode(ids, skip_special_tokens=False) and c.finish_reason == "length"
    assert c.logprobs.tokens == texts and c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx(want[torch.arange(69), ids[1:]].tolist(), abs=1e-5)
    best = want.argmax(-1).tolist()
    for i, top in enumerate(c.logprobs.top_logprobs[1:]):  # the most likely token and the prompt's own
        assert top == pytest.approx({texts[i + 1]: want[i, ids[i + 1]].item(),
                                     llm.tokenizer.decode([best[i]], skip_special_tokens=False): want[i].max().item()},
                                    abs=1e-5)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (70, 0)
    streamed = [ch.choices[0] for ch in client.completions.create(max_tokens=0, stream=True, **kw) if ch.choices]
    assert streamed[0].text == c.text and streamed[0].logprobs.token_logprobs == pytest.approx(
        c.logprobs.token_logprobs, abs=1e-6) and [s.finish_reason for s in streamed[1:]] == ["length"]

    more = client.completions.create(max_tokens=4, **kw).choices[0]  # the prompt, then 4 generated tokens
    gen = llm.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1))[0]
    assert more.text == c.text + gen.text and more.logprobs.tokens[:70] == texts
    assert more.logprobs.token_logprobs[70:] == pytest.approx([lp.logprob for lp in gen.logprobs], abs=1e-5)
    _assert_offsets_fit(more.text, more.logprobs.tokens, more.logprobs.text_offset)
    assert more.logprobs.text_offset[:70] == [sum(map(len, texts[:i])) for i in range(70)]  # (an ASCII prompt)
    streamed = [ch.choices[0] for ch in client.completions.create(max_tokens=4, stream=True, **kw) if ch.choices]
    assert "".join(s.text for s in streamed) == more.text
    assert [t for s in streamed if s.logprobs for t in s.logprobs.text_offset] == more.logprobs.text_offset
    # as an evaluation harness asks for a continuation's log-likelihood (one prompt of context + continuation ids,
    # one generated token): the sum over the continuation's positions and whether each was the most likely token
    ctx, cont = ids[:50], ids[50:]
    body = {"model": "sol-test", "prompt": [ctx + cont], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    lp = httpx.post(live.state.base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                    timeout=60).json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 71 and lp["token_logprobs"][0] is None
    scored = lp["token_logprobs"][50:70]
    assert sum(scored) == pytest.approx(want[torch.arange(49, 69), cont].sum().item(), abs=1e-3)
    greedy = [v == max(top.values()) for v, top in zip(scored, lp["top_logprobs"][50:70])]
    assert greedy == [best[i] == ids[i + 1] for i in range(49, 69)]
    plain = client.completions.create(model="sol-test", prompt="To be, or not", echo=True, max_tokens=2).choices[0]
    assert plain.text.startswith("To be, or not") and plain.logprobs is None
    with pytest.raises(openai.BadRequestError, match="0 only with echo"):
        client.completions.create(model="sol-test", prompt="x", max_tokens=0)



def test_scoring_a_prompt_counts_no_generated_token(live):
    """echo with max_tokens 0 generates one token the answer leaves out: /metrics does not count it either (no
    generation token, no time to first token) and counts the finish the answer shows ("length"), streamed or not,
    even where that token is the end of sequence."""
    eos = min(live.state.server.llm.eos_token_ids)
    assert _wait_until(lambda: live.state.server.engine.num_running == 0)
    before = _metrics(live)
    body = {"model": "sol-test", "prompt": "To be scored", "max_tokens": 0, "echo": True, "logprobs": 1,
            "logit_bias": {str(eos): 100}}
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(live.state.base + "/v1/completions", json=body, headers=headers, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0
    with httpx.stream("POST", live.state.base + "/v1/completions", json=dict(body, stream=True), headers=headers,
                      timeout=60) as s:
        assert s.status_code == 200 and "data: [DONE]" in list(s.iter_lines())
    m = _metrics(live)
    for name in ("waferline_generation_tokens_total", "waferline_time_to_first_token_seconds_count",
                 'waferline_request_finished_total{reason="stop"}'):
        assert m.get(name, 0.0) == before.get(name, 0.0), name
    assert m['waferline_request_finished_total{reason="length"}'] == \
        before.get('waferline_request_finished_total{reason="length"}', 0.0) + 2
    assert m["waferline_e2e_request_latency_seconds_count"] == before["waferline_e2e_request_latency_seconds_count"] + 2
    # a whole request's latency has buckets past a minute (a long reply on a CPU; they topped out at 60 s)
    assert 'waferline_e2e_request_latency_seconds_bucket{le="3600.0"}' in m
    bad = httpx.post(live.state.base + "/v1/completions", json=dict(body, min_tokens=7), headers=headers, timeout=60)
    assert bad.status_code == 400 and "min_tokens must be 0 with max_tokens 0, got 7" in bad.json()["error"]["message"]


def test_the_token_counters_add_up_to_the_usage(live, client):
    """/metrics counts the prompt and generated tokens the usage blocks report: with n > 1 and a batch of prompts
    (each prompt once, as usage counts it), streamed or not."""
    assert _wait_until(lambda: live.state.server.engine.num_running == 0)
    before = _metrics(live)
    sent = [client.completions.create(model="sol-test", prompt=["A light cache", "lets many sequences live"],
                                      max_tokens=3, n=3, extra_body={"ignore_eos": True}).usage,
            client.chat.completions.create(model="sol-test", messages=[{"role": "user", "content": "light"}],
                                           max_tokens=2, n=2, extra_body={"ignore_eos": True}).usage,
            list(client.completions.create(model="sol-test", prompt="A light cache", max_tokens=4, n=2, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}))[-1].usage]
    m = _metrics(live)
    assert m["waferline_prompt_tokens_total"] - before["waferline_prompt_tokens_total"] == \
        sum(u.prompt_tokens for u in sent)
    assert m["waferline_generation_tokens_total"] - before["waferline_generation_tokens_total"] == \
        sum(u.completion_tokens for u in sent) == 6 * 3 + 2 * 2 + 2 * 4


def test_an_unexpected_fault_is_counted_as_a_500(live, monkeypatch):
    """A request that fails on a fault the handlers do not expect is answered 500 and /metrics counts it so, under
    its endpoint."""
    server = live.state.server

    def broken(req):
        raise RuntimeError("a fault nobody expected")

    monkeypatch.setattr(server, "chat_prompt", broken)
    key = 'waferline_requests_total{endpoint="chat",status="500"}'
    before = _metrics(live).get(key, 0.0)
    err = _assert_error(httpx.post(live.state.base + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                                   json={"model": "sol-test", "messages": [{"role": "user", "content": "x"}]}), 500)
    assert "a fault nobody expected" not in err["message"]
    assert _metrics(live).get(key, 0.0) == before + 1


def test_a_stream_that_fails_on_an_unexpected_fault_is_counted_once_as_a_500(live, monkeypatch):
    """A fault the handlers do not expect ends a stream that has started: /metrics counts the request once, as a 500
    (not also as a client that went away, 499)."""
    from waferline.server.choices import Choices

    chunks = Choices.chunks

    def broken(self, i, ev):
        if ev.completion_tokens == 3:
            raise RuntimeError("a fault nobody expected")
        return chunks(self, i, ev)

    monkeypatch.setattr(Choices, "chunks", broken)
    key = 'waferline_requests_total{endpoint="completions",status="%s"}'
    m0 = _metrics(live)
    body = {"model": "sol-test", "prompt": "faulty", "max_tokens": 20, "ignore_eos": True, "stream": True}
    with pytest.raises(httpx.RemoteProtocolError):  # (the stream is cut: its status was sent already)
        with httpx.stream("POST", live.state.base + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            list(r.iter_lines())
    assert _wait_until(lambda: _metrics(live).get(key % "500", 0.0) == m0.get(key % "500", 0.0) + 1, 10)
    assert _wait_until(lambda: live.state.server.engine.num_running == 0)
    m = _metrics(live)
    assert {s: m.get(key % s, 0.0) - m0.get(key % s, 0.0) for s in ("200", "499", "500")} == \
        {"200": 0.0, "499": 0.0, "500": 1.0}


def _assert_offsets_fit(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Each offset lies within ``text``, in order, and a token that is a whole text (no part of a split character, nor
    after one) is found there."""
    assert len(offsets) == len(tokens) and offsets == sorted(offsets) and offsets[-1] <= len(text)
    for off, tok, before in zip(offsets, tokens, [""] + tokens):
        if "\ufffd" not in tok + before:  # (a replacement character is shown by the token that completes it)
            assert text[off:off + len(tok)] == tok, (off, tok)


def test_echoed_offsets_skip_what_the_prompt_does_not_show():
    """A BOS the tokenizer added and a SentencePiece piece's leading space at the start take no characters of the
    echoed prompt as sent: the offsets stay in order up to the first generated token's (it starts at the echo's end;
    with the token texts summed, a BOS put the prompt's offsets 3 past the text and the first generated token's
    offset went backwards)."""
    from waferline.server.logprobs import text_offsets

    table = {0: "<s>", 1: "Hi", 2: " there", 3: " Hi", 4: "\ufffd", 5: "\ufffd"}
    data = {0: b"<s>", 1: b"Hi", 2: b" there", 3: b" Hi", 4: b"\xc3", 5: b"\xa9"}

    def texts(tok: int) -> tuple[str, list[int]]:
        return table[tok], list(data[tok])

    assert text_offsets([0, 1, 2], texts, "Hi there") == [0, 0, 2]  # (BOS: nothing of the text)
    assert text_offsets([3, 2], texts, "Hi there") == [0, 2]  # (a leading space the sent text does not have)
    assert text_offsets([1, 4, 5, 2], texts, "Hi\u00e9 there") == [0, 2, 2, 3]  # (é split over two tokens)
    assert text_offsets([0, 1, 2], texts, "<s>Hi there") == [0, 3, 5]  # (a BOS the echo shows: it counts)


def test_text_offsets_stay_in_the_text_when_tokens_split_a_character(live, client):
    """A character whose UTF-8 bytes are split over tokens (each shown as a replacement character) counts once in
    `text_offset`: every offset lies within the text, and a whole token's text is found at its offset (the offsets
    counted one character per part, and ran past the text)."""
    llm = live.state.server.llm
    prompt = "Café naïve — ☃ Ω and 猫: ROMEO é"
    ids = llm.encode(prompt)
    parts = [llm.tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in parts)  # (the tokenizer splits some of these characters: the case checked)
    kw = dict(model="sol-test", prompt=prompt, echo=True, logprobs=1, max_tokens=3, temperature=0,
              extra_body={"ignore_eos": True})
    c = client.completions.create(**kw).choices[0]
    offs = c.logprobs.text_offset
    assert c.text.startswith(prompt)
    _assert_offsets_fit(c.text, c.logprobs.tokens, offs)
    streamed = [ch.choices[0].logprobs for ch in client.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs is not None]
    assert [o for s in streamed for o in s.text_offset] == offs


def test_offsets_after_a_replacement_character_in_the_output(live, client):
    """A U+FFFD character in the generated text (its three bytes one token each here) is text like any other: the
    token after it starts past it, streamed or not (its text was held back as if a character were still open, and
    the next token's text_offset was the U+FFFD's)."""
    want = "ok\ufffdyz \u00e9!"
    kw = dict(model="sol-test", prompt="x", max_tokens=24, temperature=0, logprobs=0,
              extra_body={"structured_outputs": {"choice": [want]}})
    c = client.completions.create(**kw).choices[0]
    assert c.text == want
    toks, offs = c.logprobs.tokens, c.logprobs.text_offset
    assert sum(t == "\ufffd" for t in toks) >= 4  # (the U+FFFD and the é: split over tokens, the case checked)
    for off, tok in zip(offs, toks):
        if "\ufffd" not in tok and tok != "</s>":
            assert want[off:off + len(tok)] == tok, (off, tok)
    streamed = [ch.choices[0].logprobs for ch in client.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs is not None]
    assert [o for s in streamed for o in s.text_offset] == offs


def test_penalties_and_logit_bias_are_the_engines(live, client):
    """frequency / presence penalties, logit_bias and (an extension) repetition_penalty, served: the tokens
    LLM.generate gives with the same parameters, greedy and seeded; bad values are a 400 naming the field."""
    llm = live.state.server.llm
    ids = llm.encode("Friends, Romans, countrymen")
    greedy = []
    for extra, sp in (({"frequency_penalty": 1.1, "presence_penalty": 0.5},
                       dict(frequency_penalty=1.1, presence_penalty=0.5)),
                      ({"logit_bias": {"7": 100, "12": -100}}, dict(logit_bias={7: 100.0, 12: -100.0})),
                      ({"extra_body": {"repetition_penalty": 1.4, "ignore_eos": True, "return_token_ids": True}},
                       dict(repetition_penalty=1.4)),
                      ({"extra_body": {"min_p": 0.3, "min_tokens": 4, "ignore_eos": True, "return_token_ids": True}},
                       dict(min_p=0.3, min_tokens=4))):
        for temp in (0.0, 0.9):
            want = llm.generate([ids], SamplingParams(max_tokens=10, temperature=temp, seed=2, ignore_eos=True,
                                                      **sp))[0].token_ids
            kw = {"extra_body": {"ignore_eos": True, "return_token_ids": True}} | extra
            r = client.completions.create(model="sol-test", prompt=ids, max_tokens=10, temperature=temp, seed=2, **kw)
            assert r.choices[0].model_extra["token_ids"] == want, (extra, temp)
            if temp == 0:
                greedy.append(want)
    assert greedy[1] == [7] * 10  # (the bias took effect; the penalties' effect: tests/test_reference.py)
    url, auth = live.state.base + "/v1/completions", {"Authorization": f"Bearer {KEY}"}
    for bad, param in (({"presence_penalty": 2.5}, "presence_penalty"),
                       ({"frequency_penalty": -3}, "frequency_penalty"),
                       ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
                       ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"99999": 1}}, "logit_bias"),
                       ({"logit_bias": {"9" * 40: 1}}, "logit_bias"), ({"min_p": 1.5}, "min_p"),
                       ({"min_tokens": 20, "max_tokens": 10}, "min_tokens")):
        err = _assert_error(httpx.post(url, headers=auth, json={"model": "sol-test", "prompt": "hi", **bad}), 400)
        assert err["param"] == param, bad


def test_tokenize_detokenize_and_tokenizer_info(live):
    """vLLM's tokenizer endpoints (evaluation harnesses use them as a remote tokenizer): /tokenize encodes a prompt as
    the completion endpoints do (with the special tokens unless add_special_tokens is false) and chat messages as chat
    does; /detokenize decodes; /tokenizer_info names the special tokens."""
    llm = live.state.server.llm
    base, auth = live.state.base, {"Authorization": f"Bearer {KEY}"}
    text = "Friends, Romans, countrymen"
    r = httpx.post(base + "/tokenize", headers=auth, json={"model": "sol-test", "prompt": text}).json()
    assert r["tokens"] == llm.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_LEN
    plain = httpx.post(base + "/tokenize", headers=auth, json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == llm.tokenizer.encode(text, add_special_tokens=False)
    msgs = [{"role": "user", "content": "What is a wafer?"}]
    chat = httpx.post(base + "/tokenize", headers=auth, json={"messages": msgs}).json()
    from waferline.server.app import FALLBACK_CHAT_TEMPLATE, FALLBACK_GENERATION_PROMPT

    rendered = "".join(FALLBACK_CHAT_TEMPLATE.format(**m) for m in msgs) + FALLBACK_GENERATION_PROMPT
    assert chat["tokens"] == llm.tokenizer.encode(rendered, add_special_tokens=False)
    ids = r["tokens"] + [llm.tokenizer.eos_token_id]
    back = httpx.post(base + "/detokenize", headers=auth, json={"tokens": ids}).json()
    assert back["prompt"] == text + "</s>"
    info = httpx.get(base + "/tokenizer_info", headers=auth).json()
    assert (info["eos_token"], info["bos_token"], info["model_max_length"]) == ("</s>", "<s>", MAX_LEN)
    for path, body, status in (("/tokenize", {"prompt": "x", "messages": msgs}, 400), ("/tokenize", {}, 400),
                               ("/tokenize", {"model": "other", "prompt": "x"}, 404),
                               ("/detokenize", {"tokens": [10**6]}, 400), ("/detokenize", {"tokens": "x"}, 400)):
        _assert_error(httpx.post(base + path, headers=auth, json=body), status)
    _assert_error(httpx.post(base + "/tokenize", json={"prompt": "x"}), 401)


def test_structured_outputs(live, client):
    """response_format json_object / json_schema, vLLM's structured_outputs and guided_* fields: every answer that
    stopped is a whole text of its kind (one JSON object, the schema's instance, the regex's match, a choice), in chat
    and completions, streamed or not; each is what LLM.generate gives with the same params. Two at once, a bad
    schema or regex, a json_schema without its schema: 400 naming the field, and the server serves on."""
    from waferline.server.app import FALLBACK_CHAT_TEMPLATE, FALLBACK_GENERATION_PROMPT

    llm = live.state.server.llm
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Describe a wafer as JSON."}]
    ids = llm.tokenizer.encode("".join(FALLBACK_CHAT_TEMPLATE.format(**m) for m in msgs) + FALLBACK_GENERATION_PROMPT,
                               add_special_tokens=False)
    chat_kinds = [({"response_format": {"type": "json_object"}}, {"json_object": True},
                   lambda t: isinstance(json.loads(t), dict)),
                  ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}},
                   {"json_schema": schema}, lambda t: set(json.loads(t)) == {"name", "age"}),
                  ({"extra_body": {"structured_outputs": {"regex": "[0-9]{1,3} wafers"}}},
                   {"regex": "[0-9]{1,3} wafers"}, lambda t: re.fullmatch("[0-9]{1,3} wafers", t) is not None),
                  ({"extra_body": {"guided_choice": ["yes", "no"]}}, {"choice": ["yes", "no"]},
                   lambda t: t in ("yes", "no"))]
    stopped = 0
    for body, fields, whole in chat_kinds:
        for seed in range(3):
            c = client.chat.completions.create(model="sol-test", messages=msgs, max_tokens=40, temperature=1.0,
                                               seed=seed, **body).choices[0]
            if c.finish_reason == "stop":
                stopped += 1
                assert whole(c.message.content), (fields, c.message.content)
            want = llm.generate([ids], SamplingParams(max_tokens=40, temperature=1.0, seed=seed, **fields))[0]
            assert c.message.content == want.text
        streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
            model="sol-test", messages=msgs, max_tokens=40, temperature=1.0, seed=0, stream=True, **body)
            if ch.choices)
        assert streamed == llm.generate([ids], SamplingParams(max_tokens=40, temperature=1.0, seed=0,
                                                              **fields))[0].text
    assert stopped >= 6
    r = client.completions.create(model="sol-test", prompt="A wafer:", max_tokens=40, temperature=0.8, seed=1,
                                  extra_body={"structured_outputs": {"json": schema}}).choices[0]
    assert r.text == llm.generate([llm.encode("A wafer:")], SamplingParams(max_tokens=40, temperature=0.8, seed=1,
                                                                           json_schema=schema))[0].text
    assert r.finish_reason == "length" or set(json.loads(r.text)) == {"name", "age"}
    r = client.completions.create(model="sol-test", prompt="{", max_tokens=30, temperature=0,
                                  extra_body={"guided_regex": "(ab)+c", "stop_token_ids": [0]})
    assert r.choices[0].finish_reason == "length" or re.fullmatch("(ab)+c", r.choices[0].text)
    base, auth = live.state.base, {"Authorization": f"Bearer {KEY}"}
    for extra, param in (({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
                         ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
                         ({"guided_regex": "("}, "guided_regex"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                          "response_format"),
                         ({"response_format": {"type": "json_schema", "json_schema": {
                             "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
                          "response_format"),
                         ({"response_format": {"type": "yaml"}}, "response_format"),
                         ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs"),
                         ({"guided_choice": []}, "guided_choice"),
                         ({"structured_outputs": {"json": False}}, "structured_outputs"),  # (no text holds to it)
                         ({"guided_regex": "a", "ignore_eos": True}, "guided_regex")):
        r = httpx.post(base + "/v1/completions", headers=auth,
                       json={"model": "sol-test", "prompt": "x", "max_tokens": 4, **extra})
        _assert_error(r, 400)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    assert client.completions.create(model="sol-test", prompt="x", max_tokens=2).choices[0].text is not None


def test_several_choices_per_request(live, client):
    """A completion with a batch of prompts and n choices each, and a chat completion with n: choice p * n + j is
    prompt p's j-th, sampled with seed + j (so each repeats and they differ), as LLM.generate gives; streamed, each
    choice's chunks carry its index; usage counts each prompt once."""
    llm = live.state.server.llm
    prompts = ["The wafer holds", "Experts route tokens"]
    kw = dict(model="sol-test", max_tokens=6, temperature=0.9, seed=40, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=prompts, n=2, **kw)
    want = [llm.generate([p], SamplingParams(max_tokens=6, temperature=0.9, seed=40 + j, ignore_eos=True))[0].text
            for p in prompts for j in range(2)]
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and [c.text for c in r.choices] == want
    assert want[0] != want[1] and r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == sum(len(llm.encode(p)) for p in prompts)
    ids = [llm.encode(p) for p in prompts]
    assert [c.text for c in client.completions.create(prompt=ids, n=2, **kw).choices] == want  # token-id prompts
    texts: dict[int, str] = {}
    ends: dict[int, str] = {}
    chunks = list(client.completions.create(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True},
                                            **kw))
    for ch in chunks[:-1]:
        c = ch.choices[0]
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason:
            ends[c.index] = c.finish_reason
    assert [texts[i] for i in range(4)] == want and ends == dict.fromkeys(range(4), "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    echo = client.completions.create(prompt=prompts, echo=True, **kw).choices
    assert [c.text for c in echo] == [prompts[0] + want[0], prompts[1] + want[2]]
    echo = client.completions.create(prompt=ids, echo=True, **kw).choices  # (token ids: echoed decoded)
    assert [c.text for c in echo] == [llm.decode(ids[0]) + want[0], llm.decode(ids[1]) + want[2]]

    msgs = [{"role": "user", "content": "What is a wafer?"}]
    chat = client.chat.completions.create(model="sol-test", messages=msgs, n=3, max_tokens=5, temperature=0.9, seed=7,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 15
    again = client.chat.completions.create(model="sol-test", messages=msgs, n=3, max_tokens=5, temperature=0.9,
                                           seed=7, stream=True, extra_body={"ignore_eos": True})
    got = ["", "", ""]
    for ch in again:
        got[ch.choices[0].index] += ch.choices[0].delta.content or ""
    assert got == [c.message.content for c in chat.choices] and len(set(got)) == 3


def test_a_failing_choice_fails_its_request_and_frees_the_others(live, monkeypatch):
    """One choice of a request fails while sampling: the answer is a 500 (streamed: an error object, then [DONE]), the
    request's other choices are aborted and every page comes back; the next request is served."""
    restore = fail_sampling(live, monkeypatch, lambda s: s.request_id.endswith("-1"))
    body = {"model": "sol-test", "prompt": "The wafer", "max_tokens": 40, "n": 3, "ignore_eos": True}
    url, auth = live.state.base + "/v1/completions", {"Authorization": f"Bearer {KEY}"}
    aborted = _metrics(live).get('waferline_request_finished_total{reason="abort"}', 0.0)
    err = _assert_error(httpx.post(url, headers=auth, json=body, timeout=60), 500)
    assert "injected" in err["message"]  # ... and the other two choices stop then, not after their 40 tokens
    assert _wait_until(lambda: _metrics(live)['waferline_request_finished_total{reason="abort"}'] == aborted + 2)
    with httpx.stream("POST", url, headers=auth, json=dict(body, stream=True), timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert "injected" in json.loads(lines[-2][6:])["error"]["message"] and lines[-1] == "data: [DONE]"
    assert _wait_until(lambda: live.state.server.engine.num_running == 0 and _pages_in_use(live) == 0)
    restore()
    ok = httpx.post(url, headers=auth, json=dict(body, max_tokens=3), timeout=60).json()
    assert [c["finish_reason"] for c in ok["choices"]] == ["length"] * 3


def test_16_concurrent_streams_get_the_tokens_of_a_lone_request(live, client):
    def run(i):
        toks = []
        stream = client.completions.create(
            model="sol-test", prompt=f"request {i}: " + DEMO_TEXT[i * 7:i * 7 + 20 + 3 * i], max_tokens=20,
            temperature=0.0 if i % 4 == 0 else 0.9, top_p=0.95, seed=100 + i, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        for c in stream:
            if c.choices and c.choices[0].model_extra.get("token_ids"):
                toks += c.choices[0].model_extra["token_ids"]
        return toks

    alone = [run(i) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, range(16)))
    assert all(len(t) == 20 for t in alone)
    assert together == alone
    assert len({tuple(t) for t in alone}) == 16


def test_bad_requests_are_4xx_and_the_server_keeps_serving(live, client):
    ok = {"model": "sol-test", "prompt": "hello", "max_tokens": 2}
    url = live.state.base + "/v1/completions"
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(body, headers=None, **kw):
        return httpx.post(url, headers={**auth, "Content-Type": "application/json", **(headers or {})},
                          **({"json": body} if body is not None else kw))

    cases = [
        ({**ok, "model": "gpt-9"}, 404, "model"),
        ({**ok, "max_tokens": 0}, 400, "max_tokens"),
        ({**ok, "max_tokens": -3}, 400, "max_tokens"),
        ({**ok, "max_tokens": MAX_LEN}, 400, "max_tokens"),  # prompt + max_tokens beyond the context
        ({**ok, "max_tokens": "ten"}, 400, "max_tokens"),
        ({**ok, "temperature": "hot"}, 400, "temperature"),
        ({**ok, "temperature": -1}, 400, "temperature"),
        ({**ok, "stream": "yes"}, 400, "stream"),
        ({**ok, "n": 0}, 400, "n"),
        ({**ok, "n": 65}, 400, "n"),
        ({**ok, "prompt": ["a"] * 9, "n": 8}, 400, "n"),  # 72 choices: more than one request may ask for
        ({**ok, "prompt": ""}, 400, "prompt"),
        ({**ok, "prompt": []}, 400, "prompt"),
        ({**ok, "prompt": [1, 99999]}, 400, "prompt"),
        ({**ok, "prompt": ["a", ""]}, 400, "prompt"),  # (one empty prompt of a batch fails it all)
        ({**ok, "prompt": "wafer " * 400}, 400, "prompt"),  # longer than the context
        ({**ok, "prompt": 5}, 400, "prompt"),
        ({**ok, "seed": 2**64}, 400, "seed"),
        ({"prompt": "hi"}, 400, "model"),
        ({**ok, "logprobs": 21}, 400, "logprobs"),
        ({**ok, "logprobs": True}, 400, "logprobs"),  # (completions: an integer; no coercion)
        ([1, 2], 400, None),
    ]
    for body, status, param in cases:
        err = _assert_error(post(body), status)
        assert err["param"] == param, (body, err)
    _assert_error(post(None, content=b'{"model": "sol-test", "prompt": '), 400)  # malformed JSON
    _assert_error(post(None, content=b'{"model": "sol-test", "prompt": "\xff\xfe"}'), 400)  # invalid UTF-8
    _assert_error(post(None, content=b'{"model": "sol-test", "prompt": "\\udc80"}'), 400)  # lone surrogate
    _assert_error(post(None, content=json.dumps({**ok, "prompt": "x" * 70_000}).encode()), 413)  # body > 64 KiB
    _assert_error(post(ok, headers={"Authorization": ""}), 401)
    _assert_error(post(ok, headers={"Authorization": "Bearer wrong"}), 401)
    chat = live.state.base + "/v1/chat/completions"
    _assert_error(httpx.post(chat, headers=auth, json={"model": "sol-test", "messages": []}), 400)
    _assert_error(
        httpx.post(chat, headers=auth, json={"model": "sol-test", "messages": [{"role": "wizard", "content": "x"}]}),
        400,
    )
    _assert_error(httpx.post(chat, headers=auth, json={"model": "sol-test", "messages": "hi"}), 400)
    _assert_error(httpx.get(live.state.base + "/v1/nothing-here", headers=auth), 404)

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.state.base + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="best_of is not supported"):
        client.completions.create(model="sol-test", prompt="x", max_tokens=2, best_of=3)
    # best_of equal to n returns every choice it draws: n's answer (OpenAI and vLLM take it)
    assert len(client.completions.create(model="sol-test", prompt="x", max_tokens=2, n=2, best_of=2).choices) == 2
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="sol-test", messages=[{"role": "user", "content": "x"}], max_tokens=10**6)

    r = client.completions.create(model="sol-test", prompt="still here", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert httpx.get(live.state.base + "/health").json()["status"] == "ok"
    m = _metrics(live)
    assert m['waferline_requests_total{endpoint="completions",status="400"}'] >= 17
    assert not any(k.startswith("waferline_spec_") for k in m)  # (no --speculative: no speculation series at all)
    # totals since start are counters (rate() works on them; they were gauges), levels are gauges
    types = dict(ln.split()[2:4] for ln in httpx.get(live.state.base + "/metrics").text.splitlines()
                 if ln.startswith("# TYPE"))
    assert types["waferline_preemptions_total"] == "counter" and m["waferline_preemptions_total"] >= 0
    # (this model's Mamba-2 state cannot be shared by prefix: test_pipeline_pages.py reads the prefix-hit counter)
    assert "waferline_prefix_cache_hit_tokens_total" not in types
    assert types["waferline_num_requests_waiting"] == types["waferline_cache_pages_in_use"] == "gauge"


def test_client_disconnect_frees_its_pages(live):
    body = {"model": "sol-test", "prompt": "A light cache lets many sequences live", "max_tokens": 200,
            "temperature": 0.9, "ignore_eos": True, "stream": True}
    aborted = _metrics(live).get('waferline_request_finished_total{reason="abort"}', 0.0)
    with httpx.stream("POST", live.state.base + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
            if got == 3:
                break
        assert _pages_in_use(live) > 0  # the live sequence holds pages
    assert _wait_until(lambda: _pages_in_use(live) == 0 and _metrics(live)["waferline_num_requests_running"] == 0), \
        "pages were not freed after the client went away"
    m = _metrics(live)
    assert m['waferline_request_finished_total{reason="abort"}'] == aborted + 1
    assert m["waferline_cache_bytes_in_use"] == 0

    engine = live.state.server.engine  # a client that gives up while still queued is dropped before any compute
    generated = m["waferline_generation_tokens_total"]
    engine.pause()
    try:
        with httpx.stream("POST", live.state.base + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
            assert r.status_code == 200 and _wait_until(lambda: engine.num_waiting == 1)
        assert _wait_until(lambda: _metrics(live)['waferline_request_finished_total{reason="abort"}'] == aborted + 2)
    finally:
        engine.resume()
    assert _wait_until(lambda: engine.num_waiting == 0 and engine.num_running == 0)
    assert _metrics(live)["waferline_generation_tokens_total"] == generated and _pages_in_use(live) == 0

    with httpx.stream("POST", live.state.base + "/v1/completions", json=dict(body, n=3),  # every choice is aborted
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        assert r.status_code == 200 and next(line for line in r.iter_lines() if line.startswith("data: "))
        assert _wait_until(lambda: engine.num_running == 3)
    assert _wait_until(lambda: _metrics(live)['waferline_request_finished_total{reason="abort"}'] == aborted + 5)
    assert _wait_until(lambda: engine.num_running == 0 and _pages_in_use(live) == 0)


def test_overload_queues_then_429(live, client):
    engine = live.state.server.engine
    cfg = engine.scheduler.config
    old = cfg.max_queue
    cfg.max_queue = 3
    engine.pause()  # nothing is admitted while paused: requests wait in the queue
    try:
        with ThreadPoolExecutor(3) as pool:
            waiting = [pool.submit(client.completions.create, model="sol-test", prompt="queued", max_tokens=3,
                                   extra_body={"ignore_eos": True}) for _ in range(2)]
            assert _wait_until(lambda: engine.num_waiting == 2)
            assert _metrics(live)["waferline_num_requests_waiting"] == 2
            with pytest.raises(openai.RateLimitError, match="queue is full"):  # 2 choices: all of them or none
                client.completions.create(model="sol-test", prompt="two too many", max_tokens=3, n=2)
            assert engine.num_waiting == 2
            waiting.append(pool.submit(client.completions.create, model="sol-test", prompt="queued", max_tokens=3,
                                       extra_body={"ignore_eos": True}))
            assert _wait_until(lambda: engine.num_waiting == 3)
            with pytest.raises(openai.RateLimitError, match="queue is full") as e:
                client.completions.create(model="sol-test", prompt="one too many", max_tokens=3)
            assert e.value.response.headers["retry-after"] == "1"  # when to try again
            engine.resume()
            assert [f.result(timeout=60).usage.completion_tokens for f in waiting] == [3, 3, 3]
    finally:
        engine.resume()
        cfg.max_queue = old
    assert client.completions.create(model="sol-test", prompt="after", max_tokens=2).usage.completion_tokens >= 1


def test_a_burst_that_free_slots_take_is_not_refused_as_a_full_queue(live):
    """Requests that arrive together while slots are free do not all count as waiting: the queue refuses only what
    would wait beyond ``max_queue`` once the free slots take theirs (a burst of 20 on 4 free slots and a queue of 4
    got 16 refusals). All or none, as before."""
    from waferline.engine.loop import QueueFullError

    engine = live.state.server.engine
    cfg = engine.scheduler.config
    old = cfg.max_queue
    cfg.max_queue = 2
    assert _wait_until(lambda: engine.num_running == 0 and engine.num_waiting == 0)
    ended = []
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    burst = [([3 + i, 5, 7], sp, lambda ev: ev.finished and ended.append(ev.finish_reason), None)
             for i in range(cfg.max_num_seqs + 3)]
    try:
        with pytest.raises(QueueFullError, match="queue is full"):
            engine.submit_many(burst)  # 16 slots + 2 waiting: one too many
        assert engine.num_waiting == 0
        engine.submit_many(burst[:-1])
        assert _wait_until(lambda: len(ended) == cfg.max_num_seqs + 2)
        assert ended == ["length"] * (cfg.max_num_seqs + 2)
    finally:
        cfg.max_queue = old


def test_serve_command(sol):
    """`waferline serve` in its own process, on loopback: one request, then a clean error for a bad --model."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "waferline.cli", "serve", "--model", str(sol), "--port", str(port),
                          "--max-model-len", "128", "--torch-threads", "1"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def healthy():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return p.poll() is not None  # stop waiting if it died
        assert _wait_until(healthy, 60, 0.2) and p.poll() is None, p.stdout.read() if p.poll() is not None else ""
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        r = c.completions.create(model=sol.name, prompt="Cerebras", max_tokens=4, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4 and r.model == sol.name
    finally:
        p.terminate()
        p.wait(20)
    bad = subprocess.run([sys.executable, "-m", "waferline.cli", "serve", "--model", str(Path(sol) / "missing")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "not a checkpoint directory" in bad.stderr


def test_a_page_longer_than_the_context_is_refused(sol):
    """A request holds whole pages: a page over the context wasted most of each (10^8 tokens: a traceback allocating
    32 GB); refused with the context to fit, before any request."""
    from waferline.errors import ConfigError
    from waferline.server.commands import build_server

    with pytest.raises(ConfigError, match=r"--page-tokens 129 is longer than the context \(128 tokens"):
        build_server(sol, max_num_seqs=1, max_model_len=128, page_tokens=129)
    build_server(sol, max_num_seqs=1, max_model_len=128, page_tokens=128).state.server.engine.shutdown()  # (taken)


def test_serve_stops_within_the_shutdown_timeout(sol):
    """SIGTERM with a request that never completes (here a body that never arrives, within a long --body-timeout; a
    client that stops reading a stream is the same) still stops `waferline serve` once --shutdown-timeout has
    passed, rather than waiting for that connection forever."""
    import signal
    import socket
    import time

    p, port = start_serve(sol, "--max-model-len", "128", "--torch-threads", "1", "--body-timeout", "600",
                          "--shutdown-timeout", "1")
    stalled = None
    try:
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"model\": ")
        time.sleep(0.5)  # (the handler is reading the body)
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            rc = p.wait(20)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0 and time.monotonic() - t0 < 15, (rc, time.monotonic() - t0)
        out = p.stdout.read()
        assert "Traceback" not in out and "timeout graceful shutdown exceeded" in out, out
    finally:
        if stalled is not None:
            stalled.close()
        if p.poll() is None:
            p.kill()
            p.wait(20)


def test_requests_still_running_at_the_shutdown_timeout_get_the_json_error(sol):
    """SIGTERM with requests still generating at --shutdown-timeout: each is answered with the server's error before
    it exits (a response: the 503 JSON error object, not uvicorn's plain-text 500 of a cancelled handler; a stream:
    its error event, not a connection closed mid-body), and the server still exits at about that timeout."""
    import signal
    import time

    p, port = start_serve(sol, "--max-model-len", "1024", "--torch-threads", "1", "--shutdown-timeout", "0.5")
    base = f"http://127.0.0.1:{port}"
    long = {"model": sol.name, "max_tokens": 1000, "ignore_eos": True}  # (seconds of tokens on one thread)

    def stream() -> list[str]:
        body = dict(long, messages=[{"role": "user", "content": "hi"}], stream=True)
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as r:
            return [line for line in r.iter_lines() if line]

    try:
        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(httpx.post, base + "/v1/completions", json=dict(long, prompt="Cerebras"), timeout=30)
            streamed = pool.submit(stream)
            assert _wait_until(lambda: httpx.get(base + "/health").json()["running"] == 2, 20, 0.02)
            p.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            rc = p.wait(20)
            took = time.monotonic() - t0
            r, lines = plain.result(), streamed.result()
        assert rc == 0 and took < 10, (rc, took)
        err = _assert_error(r, 503)
        assert err["type"] == "server_error" and "shutting down" in err["message"], err
        assert lines[-1] == "data: [DONE]" and "shutting down" in json.loads(lines[-2][6:])["error"]["message"], lines
        assert "Traceback" not in p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(20)


def test_scheduler_runs_on_the_engines_device(tmp_path):
    """The single-process runner is made on the LLM's device (its caches there; logits come back to the host)."""
    build("llama", tmp_path)
    llm = LLM(tmp_path, device="cpu")
    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=2))
    assert sch.runner.device == llm.device
    cached = [c.data for c in sch.runner.caches if hasattr(c, "data")]
    assert cached and all(t.device == llm.device for t in cached)
    seq = Sequence("d", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.5, seed=2))
    sch.add(seq)
    while sch.has_work():
        sch.step()
    assert seq.output_ids == LLM(tmp_path).generate([[5, 6, 7]], seq.params)[0].token_ids


# ----------------------------------------------------------------------------- a bad request fails alone
