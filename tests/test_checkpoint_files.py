"""Checkpoint files as the hub has them: tied word embeddings, 16-bit stored weights, shard indexes, a config that
does not account for every tensor (in a pipeline stage too), and int4 checkpoints written from them."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tiny_models import build
from waferline import LLM
from waferline.errors import CheckpointError, ConfigError
from waferline.model.load import load_model
from waferline.model.quant import QuantOptions
from waferline.model.quant.write import quantize_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = [1] + [(7 * j + 3) % 120 + 3 for j in range(11)]


def _reference_logprobs(ref) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([IDS]), use_cache=False).logits[0].float(), dim=-1)


def _names(directory: Path) -> set[str]:
    out = set()
    for f in directory.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out |= set(h.keys())
    return out


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "deepseek_v3", "gpt_oss", "granitemoehybrid", "bamba"])
def test_tied_word_embeddings_match_the_reference(model_type, tmp_path):
    ref = build(model_type, tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in _names(tmp_path)  # (the head is the embedding: transformers saves it once)
    assert (LLM(tmp_path).prompt_logprobs(IDS) - _reference_logprobs(ref)).abs().max().item() < 1e-4


def _held_bytes(model) -> int:
    """Bytes of a model's parameters and buffers, a tensor two modules share counted once."""
    at: dict[int, int] = {}
    for _, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        at[t.data_ptr()] = max(at.get(t.data_ptr(), 0), t.nbytes)
    return sum(at.values())


def test_a_tied_head_is_the_embedding_table_held_once(tmp_path):
    """A tied model's LM head beside its embedding is the embedding's table (it was a copy of it: Qwen3-0.6B held
    ~620 MB more at fp32), through a move and the huge-page arena; a checkpoint that also stores the head ties it
    where it holds the same values and keeps it where it holds its own, as transformers loads them."""
    from waferline.model.arena import huge_pages_possible, move_to_huge_pages
    from waferline.model.quant import move_model

    ref = build("qwen3", tmp_path / "tied", tie_word_embeddings=True)
    want = _reference_logprobs(ref)
    llm = LLM(tmp_path / "tied")
    m = llm.model
    table = m.embed.weight.nbytes
    assert m.lm_head is m.embed.weight
    assert sum(p.numel() for p in m.parameters()) == llm.spec.params_total()  # (the accounting's: the table once)
    assert (llm.prompt_logprobs(IDS) - want).abs().max().item() < 1e-4
    held = _held_bytes(m)
    if huge_pages_possible():
        assert move_to_huge_pages(m, min_bytes=1).nbytes < held + 64 * 200  # (one table; 64-byte aligned tensors)
        assert m.lm_head is m.embed.weight and _held_bytes(m) == held
        assert (llm.prompt_logprobs(IDS) - want).abs().max().item() < 1e-4
    other = load_model(tmp_path / "tied")
    move_model(other, "meta")  # (.to() makes one parameter per module where it cannot move it in place)
    assert other.lm_head is other.embed.weight
    tensors = load_file(str(tmp_path / "tied" / "model.safetensors"))
    for name, head in (("same", tensors["model.embed_tokens.weight"].clone()),
                       ("own", torch.randn(tensors["model.embed_tokens.weight"].shape))):
        d = shutil.copytree(tmp_path / "tied", tmp_path / name)
        save_file(dict(tensors, **{"lm_head.weight": head}), str(d / "model.safetensors"), metadata={"format": "pt"})
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32)
        assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == (name == "same")
        llm = LLM(d)
        assert (llm.model.lm_head is llm.model.embed.weight) == (name == "same")
        assert _held_bytes(llm.model) == held + (table if name == "own" else 0)
        assert (llm.prompt_logprobs(IDS) - _reference_logprobs(hf.eval())).abs().max().item() < 1e-4


@pytest.mark.parametrize("model_type,dtype", [("deepseek_v3", torch.bfloat16), ("nemotron_h", torch.float16)])
def test_16bit_files_load_as_transformers_reads_them(model_type, dtype, tmp_path):
    build(model_type, tmp_path / "fp32").to(dtype).save_pretrained(tmp_path / "half", max_shard_size="40KB")
    assert (tmp_path / "half" / "model.safetensors.index.json").is_file()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "half", attn_implementation="eager",
                                                            dtype=torch.float32).float().eval()
    want = _reference_logprobs(ref)
    assert (LLM(tmp_path / "half").prompt_logprobs(IDS) - want).abs().max().item() < 1e-4
    b = LLM(tmp_path / "half", dtype="bfloat16").prompt_logprobs(IDS)
    assert (b.exp() - want.exp()).abs().max() < 0.05  # bf16 activations, not a different model


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("llama")
    build("llama", d)
    return d


@pytest.mark.parametrize("text", [b"[1, 2]", b'{"weight_map": null}', b'{"weight_map": {"a": 3}}', b"\xff\xfe{"])
def test_a_malformed_shard_index_is_a_checkpoint_error(llama, tmp_path, text):
    d = shutil.copytree(llama, tmp_path / "ckpt")
    (d / "model.safetensors.index.json").write_bytes(text)
    with pytest.raises(CheckpointError, match="is not a valid safetensors index"):
        LLM(d)


def test_a_weight_past_float16s_range_is_an_error_when_loaded_as_float16(llama, tmp_path):
    """A 16-bit checkpoint value past float16's range (bf16 holds it) loaded with dtype float16 became inf, without a
    word: the model produced NaN log-probs and greedy decoding token 0 at every step."""
    tensors = load_file(str(llama / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e5
    d = shutil.copytree(llama, tmp_path / "big")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.w_down has values past float16's range"):
        LLM(d, dtype="float16")
    assert torch.isfinite(LLM(d, dtype="bfloat16").prompt_logprobs(IDS)).all()
    assert torch.isfinite(LLM(llama, dtype="float16").prompt_logprobs(IDS)).all()


def test_a_pipeline_stage_refuses_tensors_the_config_does_not_account_for(llama, tmp_path):
    """A config.json with fewer layers than the checkpoint holds: refused in a pipeline as in one process (the
    stages ran the first layers alone, without a word)."""
    d = shutil.copytree(llama, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=1)))
    for kwargs in ({}, {"stages": 1}):
        with pytest.raises(CheckpointError, match=r"does not account for: model\.layers\.1\."):
            LLM(d, **kwargs)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\."):  # (the stage with the embedding says it)
        load_model(d, torch.float32, range(0, 1), has_embed=True, has_head=False)
    load_model(d, torch.float32, range(0, 1), has_embed=False, has_head=True)  # (the other stages: not theirs)
    # a stray tensor in a stage's own layer
    tensors = load_file(str(llama / "model.safetensors"))
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    d = shutil.copytree(llama, tmp_path / "stray")
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.extra\.weight"):
        load_model(d, torch.float32, range(1, 2), has_embed=False, has_head=True)
    load_model(d, torch.float32, range(0, 1), has_embed=True, has_head=False)


def test_a_pipeline_refuses_a_tensor_of_no_layer_the_config_does_not_account_for(llama, tmp_path):
    """A tensor outside the decoder layers that no module takes: refused in a pipeline as in one process (each stage
    let it pass: the stage with the embedding and the stage with the head each took it for the other's)."""
    tensors = load_file(str(llama / "model.safetensors"))
    tensors["model.extra.weight"] = torch.ones(2, 2)
    d = shutil.copytree(llama, tmp_path / "ckpt")
    save_file(tensors, str(d / "model.safetensors"))
    for kwargs in ({}, {"stages": 1}):
        with pytest.raises(CheckpointError, match=r"does not account for: model\.extra\.weight;"):
            LLM(d, **kwargs)
    with pytest.raises(CheckpointError, match=r"model\.extra\.weight"):  # (the stage with the head says it)
        load_model(d, torch.float32, range(1, 2), has_embed=False, has_head=True)
    load_model(d, torch.float32, range(0, 1), has_embed=True, has_head=False)  # (the embedding's stage: not its own)
    load_model(llama, torch.float32, range(1, 2), has_embed=False, has_head=True)  # (the embedding: not the head's)


def test_int4_of_a_sharded_tied_checkpoint_with_pickles_beside_it(tmp_path):
    """`waferline quantize` of a sharded checkpoint with tied embeddings that also ships its weights as a PyTorch
    pickle: the int4 directory holds none of the 16-bit weight files, and loads as int4 in one process and in two
    stages alike."""
    ref = build("llama", tmp_path / "single", tie_word_embeddings=True)
    src = tmp_path / "src"
    ref.save_pretrained(src, max_shard_size="40KB")
    state = load_file(str(tmp_path / "single" / "model.safetensors"))
    torch.save(state, src / "pytorch_model.bin")
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {k: "pytorch_model.bin"
                                                                                 for k in state}}))
    out = tmp_path / "int4"
    quantize_checkpoint(src, out, QuantOptions(group_size=32))
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert "lm_head.weight" not in _names(out)
    single = LLM(out)
    assert single.model.layers[0].mixer.q_proj.int4.group_size == 32
    a = single.prompt_logprobs(IDS)
    with LLM(out, layers_per_stage=1, threads_per_stage=1) as two:
        assert torch.equal(two.prompt_logprobs(IDS), a)
    f = LLM(src).prompt_logprobs(IDS)
    assert (f.exp() * (f - a)).sum(-1).mean() < 0.1  # KL(fp32 || int4): g32 RTN, not another model


def test_a_random_checkpoint_that_runs_out_of_disk_leaves_no_partial_weights(tmp_path, monkeypatch):
    """write_random_checkpoint (the caches of twin's canary, the benchmarks' models) left model.safetensors.tmp, a
    partial file the size the disk had left, after a full disk; and the config.json that says "done" comes last."""
    import errno

    import waferline.model.init as init
    from waferline.demo import SOL_DEMO_CONFIG

    def full_disk(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(init, "save_file", full_disk)
    with pytest.raises(OSError):
        init.write_random_checkpoint(SOL_DEMO_CONFIG, tmp_path / "ck")
    assert list((tmp_path / "ck").iterdir()) == []


@pytest.mark.parametrize("method", ["fp8", "awq", "mxfp4", "bitsandbytes"])
def test_a_quantization_waferline_does_not_read_is_refused_by_name(llama, tmp_path, method):
    """An fp8 / AWQ / MXFP4 / bitsandbytes checkpoint: refused before a model is allocated, naming the
    quant_method (an fp8 one was 'tensors the config does not account for ... is config.json from the same model?',
    an AWQ one a missing weight)."""
    from waferline.engine.afd.sides import _check_checkpoint

    d = shutil.copytree(llama, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, quantization_config={"quant_method": method})))
    if method == "fp8":  # (DeepSeek-V3's layout: e4m3 weights, a scale per 128x128 block)
        tensors = load_file(str(llama / "model.safetensors"))
        for k in [k for k in tensors if k.endswith("proj.weight")]:
            tensors[k] = tensors[k].to(torch.float8_e4m3fn)
            tensors[k + "_scale_inv"] = torch.ones(1, 1)
        save_file(tensors, str(d / "model.safetensors"))
    want = rf"{d / 'config.json'}: quantization_config names quant_method '{method}', which waferline does not read"
    for kwargs in ({}, {"stages": 1}):
        with pytest.raises(CheckpointError, match=want):
            LLM(d, **kwargs)
    with pytest.raises(CheckpointError, match=want):
        _check_checkpoint(d, "cpu")


@pytest.mark.parametrize("qc", ["fp8", ["int4"]])
def test_a_quantization_config_that_is_not_an_object_is_one_line(llama, tmp_path, qc):
    """A config.json whose quantization_config is not a JSON object: a ConfigError naming it, loaded and quantized
    alike (it was an AttributeError traceback)."""
    d = shutil.copytree(llama, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc)))
    want = f"quantization_config is a {type(qc).__name__}, not a JSON object"
    with pytest.raises(ConfigError, match=want):
        LLM(d)
    with pytest.raises(ConfigError, match=want):
        quantize_checkpoint(d, tmp_path / "int4", QuantOptions(group_size=32))
    assert not (tmp_path / "int4").exists()


def test_a_snapshot_copied_without_its_blobs_names_the_broken_link(llama, tmp_path):
    """A Hugging Face cache snapshot (files as links into ../../blobs/) copied without the blobs, single file or
    sharded: a CheckpointError naming the link (the single file was a FileNotFoundError traceback)."""
    snap = tmp_path / "snapshots" / "abc"
    snap.mkdir(parents=True)
    for f in llama.iterdir():
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    with pytest.raises(ConfigError, match=r"config\.json is a symbolic link to \.\./\.\./blobs/config\.json, "
                                          "which does not exist"):
        LLM(snap)
    (tmp_path / "blobs").mkdir()
    shutil.copy(llama / "config.json", tmp_path / "blobs" / "config.json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is a symbolic link to \.\./\.\./blobs/model\."
                                              r"safetensors, which does not exist"):
        LLM(snap)
    for f in llama.iterdir():
        shutil.copy(f, tmp_path / "blobs" / f.name)
    assert torch.equal(LLM(snap).prompt_logprobs(IDS), LLM(llama).prompt_logprobs(IDS))  # (links followed)
    sharded = tmp_path / "sharded"
    build("llama", tmp_path / "ref").save_pretrained(sharded, max_shard_size="40KB")
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    shard.symlink_to("/nonexistent/blob")
    with pytest.raises(CheckpointError, match=rf"missing: {shard.name} \({shard.name} is a symbolic link to "
                                              "/nonexistent/blob, which does not exist"):
        LLM(sharded)


def test_a_generation_config_that_is_not_utf8_is_read_as_absent(llama, tmp_path):
    """generation_config.json of bytes that are not UTF-8 is ignored as one that is not JSON is (config.json's
    end-of-sequence id stays the stop rule); it was a UnicodeDecodeError traceback."""
    d = shutil.copytree(llama, tmp_path / "ckpt")
    for text in (b'{"eos_token_id": [2, ', b"\xff\xfe{"):
        (d / "generation_config.json").write_bytes(text)
        assert LLM(d).eos_token_ids == {2}


def test_serve_names_the_model_after_the_directory_given_as_dot(llama, tmp_path, monkeypatch):
    """`waferline serve --model .` (in the checkpoint directory) serves the directory's name, as documented; it
    served the model id '' (Path('.').name), so a request naming the model was a 404."""
    import httpx

    from server_helpers import serve_in_thread
    from waferline.server.commands import build_server

    d = shutil.copytree(llama, tmp_path / "my ckpt")
    monkeypatch.chdir(d)
    with serve_in_thread(build_server(".", max_num_seqs=1, max_model_len=32)) as base:
        assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]] == ["my ckpt"]
        r = httpx.post(base + "/v1/completions", json={"model": "my ckpt", "prompt": [1, 5], "max_tokens": 1})
        assert r.status_code == 200, r.text
