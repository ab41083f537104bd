"""Engine behaviour: cache shapes per layer kind, stop conditions, errors a user can cause, the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_checkpoints
from tiny_models import build, configs
from waferline import LLM, SamplingParams
from waferline.errors import CheckpointError, ConfigError, RequestError
from waferline.model.attention import TokenCache
from waferline.model.context import StepBatch
from waferline.model.ssm import Mamba2Cache


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, ("deepseek_v3", "gpt_oss", "bamba", "llama"))


def _prefill(llm, n):
    caches = llm.model.new_caches(1)
    llm.model(torch.arange(3, 3 + n)[None] % 100, caches, StepBatch.make([0], [0], n))
    return caches


def test_mla_caches_only_latent_and_rope(ckpts):
    llm = LLM(ckpts["deepseek_v3"])
    c = configs()["deepseek_v3"]
    caches = _prefill(llm, 20)
    for cache in caches:
        assert isinstance(cache, TokenCache)
        assert cache.data.shape[-1] == c["kv_lora_rank"] + c["qk_rope_head_dim"]  # not heads * (k + v)


def test_mamba_state_does_not_grow(ckpts):
    llm = LLM(ckpts["bamba"])
    short, long = _prefill(llm, 5), _prefill(llm, 60)
    ssm = [(a, b) for a, b in zip(short, long) if isinstance(a, Mamba2Cache)]
    assert len(ssm) == 2
    for a, b in ssm:
        assert a.conv.shape == b.conv.shape and a.ssm.shape == b.ssm.shape


def test_sliding_window_cache_stays_in_window(ckpts):
    llm = LLM(ckpts["gpt_oss"])
    caches = _prefill(llm, 30)
    window = configs()["gpt_oss"]["sliding_window"]
    sliding = caches[0]  # layer_types = [sliding, full]
    assert sliding.capacity == window and sliding.tokens_held(0) == window
    assert caches[1].capacity >= 30


def test_prompt_too_long_and_bad_params(ckpts):
    llm = LLM(ckpts["llama"])
    with pytest.raises(RequestError, match="exceeds the model's context"):
        llm.generate([[1] * 250], SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="max_tokens"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=0))
    with pytest.raises(RequestError, match="empty prompt"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="at least 2 tokens"):
        llm.perplexity([5])
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate(["hello"], SamplingParams(max_tokens=2))


def test_stop_token(ckpts):
    llm = LLM(ckpts["llama"])
    first = llm.generate([[1, 5, 9]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    out = llm.generate([[1, 5, 9]], SamplingParams(max_tokens=6, stop_token_ids=[first[2]]))[0]
    assert out.token_ids == first[:3] and out.finish_reason == "stop"
    # each Output carries its own prompt (rows finishing at different steps; greedy and sampled)
    prompts = [[1, 5, 9], [7, 7], [2, 4, 6, 8]]
    for params in (
        SamplingParams(max_tokens=5, stop_token_ids=[first[2]]),
        SamplingParams(max_tokens=4, temperature=0.8, seed=1),
    ):
        outs = llm.generate(prompts, params)
        assert [o.prompt_token_ids for o in outs] == prompts


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_checkpoint_errors(ckpts, tmp_path):
    src = ckpts["llama"]
    with pytest.raises(ConfigError, match="no config.json"):
        LLM(tmp_path)
    bad = _copy(src, tmp_path / "unsupported")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="bert")))
    with pytest.raises(ConfigError, match="unsupported model_type 'bert'; the engine runs .*llama.*; the planner also "
                                          "places .*jamba"):  # (jamba was listed as supported, then refused)
        LLM(bad)
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    for case, mutate, pattern in [
        ("missing", lambda t: t.pop(name), f"missing tensor '{name}'"),
        ("extra", lambda t: t.__setitem__("model.layers.7.foo.weight", torch.zeros(2)), "model.layers.7.foo.weight"),
        (
            "shape",
            lambda t: t.__setitem__(name, torch.zeros(3, 64)),
            r"has shape \[3, 64\] but the config implies \[32, 64\]",
        ),
    ]:
        d = _copy(src, tmp_path / case)
        t = dict(tensors)
        mutate(t)
        save_file(t, str(d / "model.safetensors"))
        with pytest.raises(CheckpointError, match=pattern):
            LLM(d)
    d = _copy(src, tmp_path / "truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated|corrupt"):
        LLM(d)
    d = _copy(src, tmp_path / "pickle")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="safetensors only"):
        LLM(d)


def test_cli_generate_json_and_errors(ckpts, tmp_path):
    cmd = [sys.executable, "-m", "waferline.cli", "generate", "--model", str(ckpts["llama"]), "--prompt-ids", "1 5 9",
           "--max-tokens", "4", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 4 and out["tokens_per_s"] >= 0 and "text" in out
    r = subprocess.run(
        [sys.executable, "-m", "waferline.cli", "generate", "--model", str(tmp_path), "--prompt-ids", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "error:" in r.stderr and "config.json" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(cmd + ["--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["token_ids"] == out["token_ids"], r.stderr
    r = subprocess.run(cmd + ["--device", "tpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "error:" in r.stderr and "device" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["generate", "--prompt-ids", "1", "--afd"], ["generate", "--prompt-ids", "1"],
                                  ["quantize", "--out", "OUT"]])
def test_a_malformed_config_is_a_one_line_error_on_every_path(ckpts, tmp_path, args):
    # (--afd and quantize read config.json themselves and raised a JSONDecodeError traceback, exit 1)
    bad = _copy(ckpts["llama"], tmp_path / "bad")
    (bad / "config.json").write_text('{"model_type": "llama", ')
    args = [str(tmp_path / "q") if a == "OUT" else a for a in args]
    r = subprocess.run([sys.executable, "-m", "waferline.cli", args[0], "--model", str(bad), *args[1:]],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{bad / 'config.json'} is not valid JSON" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_sharded_checkpoint_loads_like_single(ckpts, tmp_path):
    from tiny_models import build as build_ref

    ref = build_ref("deepseek_v3", tmp_path / "single")
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = [1, 5, 9, 33, 70]
    a = LLM(tmp_path / "single").prompt_logprobs(ids)
    b = LLM(tmp_path / "sharded").prompt_logprobs(ids)
    assert torch.equal(a, b)


def test_bfloat16_close_to_float32(ckpts):
    ids = [1, 5, 9, 33, 70, 12, 90, 4]
    for mt in ("deepseek_v3", "bamba", "gpt_oss"):
        a = LLM(ckpts[mt], dtype="float32").prompt_logprobs(ids)
        b = LLM(ckpts[mt], dtype="bfloat16").prompt_logprobs(ids)
        assert b.dtype == torch.float32 and torch.isfinite(b).all()
        assert (a.exp() - b.exp()).abs().max() < 0.05, mt  # bf16 rounding, not a different model
    with pytest.raises(ConfigError, match="dtype must be one of"):
        LLM(ckpts["llama"], dtype="int3")


_INT4 = {"dtype": "bfloat16", "weight_bits": 4, "head_bits": 8, "group_size": 32}


@pytest.mark.parametrize("model_type,overrides,opts", [
    ("llama", {}, {"dtype": "bfloat16"}),  # (its bf16 head)
    ("deepseek_v3", {"q_lora_rank": 64}, _INT4),  # (MLA layers are one op with a q LoRA)
    ("bamba", {}, _INT4),  # (Mamba-2 layers: states updated in place)
], ids=["llama-bf16", "deepseek_v3-int4", "bamba-int4"])
def test_greedy_bursts_are_the_step_by_step_tokens(tmp_path, monkeypatch, model_type, overrides, opts):
    """Greedy decode in bursts of steps run back to back (DecoderModel.greedy_steps, LLM's GREEDY_BURST) streams the
    same (row, token) events and ends with the same outputs as step by step: 2 rows of different prompt lengths (the
    caches grow past their first 64 positions inside a burst), 19 tokens (bursts of 8, 8, then the 2 left), and a
    stop token that ends row 0 inside a burst while row 1 goes on (the burst's later tokens of row 0 are dropped; row
    1's do not depend on row 0 being in the step). Bursts run where the fused operators are built."""
    import waferline.engine.sampling as sampling_mod
    from waferline import kernels

    build(model_type, tmp_path, **overrides)
    llm = LLM(tmp_path, **opts)
    V = llm.spec.vocab_size
    prompts = [[(3 + 5 * i) % V for i in range(60)], [(11 + 3 * i) % V for i in range(4)]]  # (row 0 past 64 in a burst)
    ran, orig = [], type(llm.model).greedy_steps
    monkeypatch.setattr(type(llm.model), "greedy_steps", lambda self, *a: ran.append(orig(self, *a)) or ran[-1])

    def gen(burst: int, params: SamplingParams) -> list:
        monkeypatch.setattr(sampling_mod, "GREEDY_BURST", burst)
        return list(llm.stream(prompts, params))

    base = SamplingParams(max_tokens=19, temperature=0, ignore_eos=True)
    first = gen(1, base)[-1]
    assert not ran  # (bursts of 1: step by step)
    row0 = first[0].token_ids
    stop = next(t for t in row0[3:] if t not in row0[:3] and t not in first[1].token_ids)  # (row 1 never emits it)
    for params in (base, SamplingParams(max_tokens=19, temperature=0, ignore_eos=True, stop_token_ids=[stop])):
        a, b = gen(1, params), gen(8, params)
        assert a[:-1] == b[:-1]
        assert [(o.token_ids, o.finish_reason) for o in a[-1]] == [(o.token_ids, o.finish_reason) for o in b[-1]]
    assert b[-1][0].finish_reason == "stop" and 3 < len(b[-1][0].token_ids) < 19 and len(b[-1][1].token_ids) == 19
    if kernels.available():
        assert sum(r is not None for r in ran) >= 4  # (two bursts of each generate with bursts of 8, at least)


def test_device_option_and_its_errors(ckpts):
    # device="cpu" given explicitly runs the device-aware path (caches, step batches and prompts made on the device,
    # logits brought to the host for sampling): the same tokens as the default, greedy and sampled
    p = SamplingParams(max_tokens=6, temperature=0.0)
    for mt in ("deepseek_v3", "bamba"):
        want = LLM(ckpts[mt], dtype="bfloat16").generate([[5, 6, 7], [8, 9]], p)
        got = LLM(ckpts[mt], dtype="bfloat16", device="cpu").generate([[5, 6, 7], [8, 9]], p)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    s = SamplingParams(max_tokens=6, temperature=0.8, seed=3)
    llm = LLM(ckpts["llama"], device="cpu")
    assert llm.generate([[5, 6, 7]], s)[0].token_ids == LLM(ckpts["llama"]).generate([[5, 6, 7]], s)[0].token_ids
    assert torch.equal(llm.prompt_logprobs([5, 6, 7]), LLM(ckpts["llama"]).prompt_logprobs([5, 6, 7]))
    with pytest.raises(ConfigError, match="CPU or a CUDA GPU"):
        LLM(ckpts["llama"], device="meta")
    with pytest.raises(ConfigError, match="device must be like"):
        LLM(ckpts["llama"], device="no such device")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            LLM(ckpts["llama"], device="cuda")
        for device in (0, ""):  # (a GPU's index, as 1 is, or nothing: was a silent CPU run)
            with pytest.raises(ConfigError, match="device must be like|no CUDA GPU"):
                LLM(ckpts["llama"], device=device)
