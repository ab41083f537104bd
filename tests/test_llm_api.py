"""The Python API as a vLLM user drives it: calls from threads, a stream left open, seeds that do not depend on the
batch, min_tokens against stop strings, bad arguments and options named in the error, a dropped pipeline LLM."""

import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import waferline
from conftest import raised_in_thread, tiny_checkpoints
from waferline import LLM, SamplingParams
from waferline.engine.pipeline import StageError
from waferline.errors import ConfigError, RequestError


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, ("llama",))


@pytest.fixture(scope="module")
def llm(sol, one_thread):
    return LLM(sol)


def test_calls_from_two_threads_run_one_at_a_time(llm):
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = ("ROMEO.", "The king")
    alone = {p: llm.generate(p, sp)[0].token_ids for p in prompts}
    got: dict[str, list[int]] = {}
    ts = [threading.Thread(target=lambda p=p: got.__setitem__(p, llm.generate(p, sp)[0].token_ids), daemon=True)
          for p in prompts]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "two threads calling generate on one LLM hung"
    assert got == alone


def test_a_call_while_a_stream_is_open_in_the_same_thread_is_refused(llm):
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = llm.generate("ROMEO.", sp)[0].token_ids
    llm.generate(["a", "b"], sp)  # (a scheduler of 2 slots: the request ids of two calls must not collide)
    stream = llm.stream("The king", sp)
    next(stream)
    with pytest.raises(RequestError, match="already running a call in this thread"):
        llm.generate("ROMEO.", sp)
    with pytest.raises(RequestError, match="already running"):
        llm.prompt_logprobs([1, 2, 3])
    outs = list(stream)[-1]
    assert len(outs[0].token_ids) == 8
    assert llm.generate("ROMEO.", sp)[0].token_ids == ref  # usable again once the stream ended


def test_llms_made_in_several_threads_at_once_load_their_tokenizers(sol):
    """LLM(path) from several threads at once in a fresh process: all but one failed with "ImportError: cannot import
    name 'AutoTokenizer' from 'transformers'" (transformers' lazy import raced by the threads)."""
    code = f"""
import threading
from waferline import LLM
errors = []
def make():
    try:
        LLM({str(sol)!r}, huge_pages=False)
    except Exception as e:
        errors.append(repr(e))
ts = [threading.Thread(target=make) for _ in range(4)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(errors)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[]", r.stdout + r.stderr[-2000:]


def test_a_seeded_request_samples_the_same_whatever_its_batch(llm):
    sp = SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True)
    alone = llm.generate("ROMEO.", sp)[0].token_ids
    assert [o.token_ids for o in llm.generate(["ROMEO.", "ROMEO."], sp)] == [alone, alone]
    assert llm.generate(["The king", "ROMEO."], sp)[1].token_ids == alone
    assert llm.generate(["The king", "ROMEO."], [sp, sp])[1].token_ids == alone
    other = llm.generate("ROMEO.", SamplingParams(max_tokens=10, temperature=0.9, seed=4, ignore_eos=True))
    assert other[0].token_ids != alone  # (the seed does choose the stream)


def test_min_tokens_holds_back_stop_strings_in_its_text(llm):
    free = llm.generate("ROMEO.", SamplingParams(max_tokens=8, ignore_eos=True))[0]
    stop = llm.decode(free.token_ids[:1]).strip() or llm.decode(free.token_ids[:1])
    assert stop, "the first token decodes to no text"
    first = llm.generate("ROMEO.", SamplingParams(max_tokens=8, ignore_eos=True, stop=stop))[0]
    assert len(first.token_ids) == 1 and first.finish_reason == "stop"  # the stop string is in token 1's text
    held = llm.generate("ROMEO.", SamplingParams(max_tokens=8, min_tokens=3, ignore_eos=True, stop=stop))[0]
    assert len(held.token_ids) >= 3
    assert held.token_ids == free.token_ids[:len(held.token_ids)]
    assert stop in held.text  # the occurrence before min_tokens is not a stop: its text stays
    before = len(llm.decode(free.token_ids[:2]))  # the text of the first min_tokens - 1 tokens
    if held.finish_reason == "stop":  # cut where an occurrence ends past that text
        whole = llm.decode(held.token_ids)
        assert whole.startswith(held.text) and whole[len(held.text):].startswith(stop)
        assert len(held.text) + len(stop) > before
    else:
        assert held.finish_reason == "length" and len(held.token_ids) == 8


@pytest.fixture(scope="module")
def merged_bytes(tmp_path_factory):
    """A llama checkpoint whose byte-level vocabulary merges " " with the first byte of "é" (GPT-2's "ĠÃ"): "a é" is
    "a", " \xc3", "\xa9", and the middle token's text ends inside a character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tiny_models import build
    from waferline.engine.token_bytes import byte_level_alphabet

    d = tmp_path_factory.mktemp("merged-bytes")
    vocab = {"<s>": 0, "</s>": 1} | {c: 2 + b for c, b in byte_level_alphabet().items()}
    vocab["\u0120\u00c3"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[("\u0120", "\u00c3")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")
    build("llama", d, vocab_size=len(hf))
    hf.save_pretrained(d)
    return d


def test_a_stop_string_ending_in_a_token_held_back_cuts_the_text_as_the_server_does(merged_bytes, one_thread):
    """The stop string "a " ends inside " \xc3", whose text waits for "\xa9": the scheduler finds it there and stops
    with the text before it (as a server's stream sends it); generate's text was "a é", the stop string in it, where
    min_tokens is 0 or its first min_tokens - 1 tokens end with that token."""
    from waferline.engine.scheduler import Scheduler, SchedulerConfig
    from waferline.engine.sequence import Sequence

    llm = LLM(merged_bytes)
    forced = llm.tokenizer.encode("a \u00e9", add_special_tokens=False)
    assert len(forced) == 3
    for min_tokens in (0, 1, 3):
        params = SamplingParams(max_tokens=8, stop=["a "], min_tokens=min_tokens, choice=["a \u00e9b"],
                                logit_bias={forced[1]: 30})
        out = llm.generate([[5, 6]], params)[0]
        assert out.token_ids == forced and out.finish_reason == "stop"
        assert out.text == "", min_tokens
        events: list = []
        seq = Sequence("s", [5, 6], SamplingParams(max_tokens=8, stop=["a "], min_tokens=min_tokens), events.append)
        sch = Scheduler(llm, SchedulerConfig(max_num_seqs=1))
        for tok in forced:
            sch._sample(seq, None, tok)
        assert seq.finish_reason == "stop" and "".join(e.text for e in events) == out.text


def test_stop_strings_without_a_tokenizer_are_refused(ckpts):
    llm = LLM(ckpts["llama"])
    with pytest.raises(RequestError, match="stop strings need the model's tokenizer"):
        llm.generate([[1, 17, 42]], SamplingParams(max_tokens=4, stop="x"))
    assert len(llm.generate([[1, 17, 42]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_bad_arguments_are_request_errors_that_say_what_was_wrong(ckpts):
    llm = LLM(ckpts["llama"])
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    for prompts, params, says in [(None, sp, "prompts must be"), ([[1, 2]], {"max_tokens": 3}, "SamplingParams"),
                                  ([[1.7, 2.2]], sp, "integer token ids"), ([["12"]], sp, "integer token ids"),
                                  ([[True, 2]], sp, "integer token ids"),
                                  ({"prompt_token_ids": [1, 2]}, sp, "prompts must be")]:
        with pytest.raises(RequestError, match=says):
            llm.generate(prompts, params)
    # numpy integers are token ids: a 1-D array's ids are one prompt
    assert llm.generate(list(np.array([1, 17, 42])), sp)[0].token_ids == llm.generate([1, 17, 42], sp)[0].token_ids
    with pytest.raises(RequestError, match="window must be an integer >= 1"):
        llm.perplexity([1, 2, 3], window=0)
    # a text needs the tokenizer (it was a TypeError from inside the window loop)
    with pytest.raises(RequestError, match="has no tokenizer"):
        llm.perplexity("the quick brown fox")


def test_unknown_options_and_a_file_for_a_directory_are_named(ckpts):
    with pytest.raises(ConfigError, match="unknown LLM option: max_model_length"):
        LLM(ckpts["llama"], max_model_length=64)
    with pytest.raises(ConfigError, match="unknown LLM options: seed, tensor_parallel_size"):
        LLM(ckpts["llama"], seed=0, tensor_parallel_size=1)
    with pytest.raises(ConfigError, match="pass the directory that holds it"):
        LLM(ckpts["llama"] / "config.json")
    assert waferline.RequestError is RequestError and waferline.ConfigError is ConfigError
    with pytest.raises(ConfigError, match="time_split measures attention/FFN disaggregation"):
        LLM(ckpts["llama"]).time_split()


@pytest.mark.parametrize("option, value, says", [
    ("num_speculative_tokens", 2.5, "num_speculative_tokens must be an integer, got float 2.5"),
    ("num_speculative_tokens", "3", "num_speculative_tokens must be an integer, got str '3'"),
    ("max_model_len", 32.0, "max_model_len must be an integer, got float 32.0"),
    ("group_size", True, "group_size must be an integer, got bool True"),
    ("weight_bits", "4", "weight_bits must be an integer, got str '4'"),
    ("prefill_chunk", 1.5, "prefill_chunk must be an integer, got float 1.5"),
    ("start_method", "bogus", "start_method must be 'forkserver', 'spawn' or 'fork', got 'bogus'"),  # (ValueError)
])
def test_a_count_given_as_another_type_is_named(ckpts, option, value, says):
    options = {"speculative": "ngram"} if option == "num_speculative_tokens" else {}
    if option in ("prefill_chunk", "start_method"):
        options["stages"] = 2
    with pytest.raises(ConfigError, match=says):  # (no TypeError from a comparison deep in the engine)
        LLM(ckpts["llama"], **options, **{option: value})
    LLM(ckpts["llama"], num_speculative_tokens=np.int64(2), speculative="ngram")  # a numpy integer is an integer


def test_options_given_as_none_or_afd_false_are_not_given(ckpts, one_thread):
    """``LLM(path, afd=False, head_bits=8)``, ``plan=None`` or ``threads_per_stage=None`` (its documented "the cores
    divided") picked the single-process engine and then refused it ("head_bits=8 is for the single-process engine",
    "pipeline options need stages=S"); ``prefill_chunk=None`` with stages was a TypeError."""
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    want = LLM(ckpts["llama"]).generate([[1, 17, 42]], sp)[0].token_ids
    for options in ({"afd": False, "head_bits": 8}, {"plan": None}, {"threads_per_stage": None},
                    {"stages": None, "hang_timeout_s": None, "prefill_chunk": None}):
        llm = LLM(ckpts["llama"], **options)
        assert llm._pipeline is None, options
        assert llm.generate([[1, 17, 42]], sp)[0].token_ids == want, options
    with LLM(ckpts["llama"], stages=2, prefill_chunk=None, hang_timeout_s=None, threads_per_stage=None) as llm:
        assert llm._pipeline.prefill_chunk >= 1 and llm.generate([[1, 17, 42]], sp)[0].token_ids == want


def test_ignore_eos_must_be_a_bool():
    """ignore_eos="false" was kept, truthy: every request ran to max_tokens past its end-of-sequence token."""
    for bad in ("false", 0, 1, None):
        with pytest.raises(RequestError, match="ignore_eos must be true or false"):
            SamplingParams(ignore_eos=bad)
    assert SamplingParams(ignore_eos=True).ignore_eos is True


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        return True


def test_a_dropped_pipeline_llm_stops_its_stages(ckpts, one_thread):
    llm = LLM(ckpts["llama"], stages=2)
    llm.generate([[1, 17, 42]], SamplingParams(max_tokens=2))
    pids = llm._pipeline.pids
    assert pids and not any(_gone(p) for p in pids)
    del llm
    gc.collect()
    deadline = time.monotonic() + 15
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), f"stage processes {pids} outlived their LLM"
    assert os.getpid() not in pids


def _in_forked_child(held: list, then: str) -> dict:
    """What the parent's pipeline/AFD LLM (``held``: the one reference to it) does in a child forked after the parent
    used it: a call, then ``close()`` or dropping it (collected there)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        llm = held.pop()
        try:
            llm.generate([[1, 17, 42]], SamplingParams(max_tokens=2))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            q.put({"call": f"{type(e).__name__}: {e}"})
        if then == "close":
            llm.close()
        del llm
        gc.collect()
        q.put({then: True})

    p = ctx.Process(target=child)
    p.start()
    p.join(30)
    if p.is_alive():
        p.kill()
        p.join()
    got = {"exitcode": p.exitcode}
    while not q.empty():
        got.update(q.get(timeout=1))
    return got


@pytest.mark.parametrize("options", [{"stages": 2}, {"afd": True, "attention_ranks": 1, "ffn_ranks": 2}],
                         ids=["pipeline", "afd"])
def test_a_forked_child_is_refused_the_parents_processes_and_leaves_them_alone(ckpts, one_thread, options):
    """A child forked after the parent used a pipeline/AFD LLM drove the parent's workers through the inherited
    transport (it hung, and the parent's next call failed with a protocol error, or the parent aborted in gloo);
    its close() stopped them (AssertionError: can only join a child process), and collecting the LLM there killed
    them (and crashed the child, freeing the parent's process groups)."""
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    held = [LLM(ckpts["llama"], **options)]
    try:
        want = [o.token_ids for o in held[0].generate([[1, 17, 42], [5, 6]], sp)]
        for then in ("close", "drop"):
            got = _in_forked_child(held, then)
            assert got["exitcode"] == 0 and got.get(then), got
            assert "a forked process cannot use them" in got.get("call", ""), got
            assert [o.token_ids for o in held[0].generate([[1, 17, 42], [5, 6]], sp)] == want
    finally:
        held[0].close()


def test_close_lets_go_of_the_store_port_and_the_groups_threads(ckpts, one_thread):
    """A closed pipeline LLM still referenced (the name a ``with`` block binds) held its store's listening port and
    its process groups' threads and sockets until it was collected."""
    threads = len(os.listdir("/proc/self/task"))
    with LLM(ckpts["llama"], stages=2) as llm:
        llm.generate([[1, 17, 42]], SamplingParams(max_tokens=2))
        port = llm._pipeline.store.port
    assert len(os.listdir("/proc/self/task")) <= threads
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))  # (no listener left on it)
    llm.close()  # (again: a no-op)
    with pytest.raises(StageError, match="closed"):
        llm.generate([[1, 17, 42]], SamplingParams(max_tokens=2))


def test_a_call_waiting_while_close_runs_is_told_the_pipeline_is_closed(ckpts, one_thread):
    """A call that passed the closed check and waited for the pipeline's lock while close() took it ran on the
    transport close() let go: an AttributeError ('NoneType' object has no attribute 'send') instead of a StageError."""
    llm = LLM(ckpts["llama"], stages=2)
    llm.generate([[1, 17, 42]], SamplingParams(max_tokens=2))
    pipe, gate = llm._pipeline, threading.Event()

    class Gated:  # (a ``with`` waits for the gate: the call is held at the lock while close() runs)
        def __init__(self, lock):
            self.lock = lock

        def acquire(self, *a, **kw):
            return self.lock.acquire(*a, **kw)

        def release(self):
            self.lock.release()

        def __enter__(self):
            gate.wait()
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()

    pipe._lock = Gated(pipe._lock)
    closer = threading.Timer(0.5, lambda: (llm.close(), gate.set()))
    closer.start()
    e = raised_in_thread(lambda: llm.generate([[1, 17, 42]], SamplingParams(max_tokens=2)))
    closer.join()
    assert isinstance(e, StageError) and "closed" in str(e), e


def test_every_call_after_a_stage_died_raises_instead_of_hanging(ckpts, one_thread):
    """A call on a failed pipeline fails while its sequence is admitted; that sequence kept its slot, so with one slot
    the second call found none and stepped forever."""
    llm = LLM(ckpts["llama"], stages=2, hang_timeout_s=2.0)
    llm.generate([[1, 17, 42]], SamplingParams(max_tokens=2))  # (a scheduler of one slot)
    os.kill(llm._pipeline.pids[0], signal.SIGKILL)
    for _ in range(3):
        e = raised_in_thread(lambda: llm.generate([[1, 17, 42]], SamplingParams(max_tokens=2)))
        assert isinstance(e, StageError) and "stage 1" in str(e), e
    assert llm._scheduler.cache.free_slots == 1
    llm.close()


def test_a_config_without_eos_takes_the_tokenizers(tmp_path):
    """Neither config.json nor generation_config.json has an end-of-sequence field: the tokenizer's stops a request
    (as vLLM does), instead of none (a field set to null still names none: random demo models run to max_tokens)."""
    import json

    from waferline.demo import DEMO_TEXT, SOL_DEMO_CONFIG, write_tokenizer
    from waferline.model.init import write_random_checkpoint

    cfg = {k: v for k, v in SOL_DEMO_CONFIG.items() if k != "eos_token_id"}
    write_random_checkpoint(cfg, tmp_path)
    write_tokenizer(tmp_path, DEMO_TEXT, cfg["vocab_size"])
    for name in ("config.json", "generation_config.json"):
        f = tmp_path / name
        if f.is_file():
            d = json.loads(f.read_text())
            d.pop("eos_token_id", None)
            f.write_text(json.dumps(d))
    llm = LLM(tmp_path)
    assert llm.eos_token_ids == {llm.tokenizer.eos_token_id} and llm.tokenizer.eos_token_id is not None


def test_an_outputs_first_space_stays_with_a_sentencepiece_tokenizer(tmp_path):
    """A SentencePiece tokenizer (Llama-2 / Mistral style) strips the space of a text's first "▁" piece: an output's
    text is decoded after the prompt's last token, so it keeps its first space (as vLLM's does, and as the prompt and
    output read together), in LLM.generate and in a stream, whole or cut by max_tokens or a stop token."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from tiny_models import build

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3}
    vocab |= {f"<0x{i:02X}>": len(vocab) + i for i in range(256)}
    for w in ("\u2581Hello", "\u2581the", "\u2581x"):
        vocab[w] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    build("llama", tmp_path, vocab_size=len(vocab))
    hf.save_pretrained(tmp_path)
    llm = LLM(tmp_path)
    hello, prompt = vocab["\u2581Hello"], hf.encode("the x")
    assert hf.decode([hello, hello]) == "Hello Hello"  # (alone, the first space goes)
    want = hf.decode(prompt + [hello, hello])[len(hf.decode(prompt)):]
    assert want == " Hello Hello"
    for params in (SamplingParams(max_tokens=2, logit_bias={hello: 100}, ignore_eos=True),
                   SamplingParams(max_tokens=5, logit_bias={hello: 100}, ignore_eos=True, stop=[" Hello Hello"])):
        assert llm.generate(["the x"], params)[0].text == (want if params.max_tokens == 2 else ""), params
    from waferline.engine.scheduler import Scheduler, SchedulerConfig
    from waferline.engine.sequence import Sequence

    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=2))
    for n in (1, 2, 3):  # (streamed as the server streams: the pieces, and the whole at the max_tokens cut)
        events: list = []
        sch.add(Sequence(f"s{n}", list(prompt), SamplingParams(max_tokens=n, logit_bias={hello: 100}, ignore_eos=True),
                         events.append))
        while sch.has_work():
            sch.step()
        assert "".join(e.text for e in events) == " Hello" * n, (n, events)
    stopped = SamplingParams(max_tokens=4, logit_bias={hello: 50, 2: 100}, min_tokens=2, stop_token_ids=[2])
    assert llm.generate(["the x"], stopped)[0].text == want
