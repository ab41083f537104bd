"""Attention/FFN disaggregation: M attention ranks and N expert ranks give the single-process engine's tokens and
log-probs; a rank that dies is named; each rank loads only its part of the checkpoint; planner and CLI surface."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import tiny_models
from waferline import LLM, SamplingParams
from waferline.engine.afd import AFD, AFDError, load_attention_side, load_ffn_side, make_layout
from waferline.errors import ConfigError, WaferlineError
from waferline.spec.configs import spec_from_pretrained

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
SOL_MINI = ROOT / "models" / "sol-mini"
CHUNK = 16
LENGTHS = [5, 23, 3, 16, 11]  # mixed prompt lengths (23 is prefilled in two chunks)
LOGPROB_TOL = 1e-5


def _build_variant(model_type: str, directory: Path, **overrides) -> None:
    orig = tiny_models.configs
    tiny_models.configs = lambda: {**orig(), model_type: dict(orig()[model_type], **overrides)}
    try:
        tiny_models.build(model_type, directory)
    finally:
        tiny_models.configs = orig


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("afd")
    out = {"deepseek_v3": tmp / "dsv3", "nemotron_h": tmp / "nemotron_h", "sol": SOL_MINI,
           "granitemoehybrid": tmp / "granite"}
    tiny_models.build("granitemoehybrid", out["granitemoehybrid"])  # Mamba-2 + GQA, fused [E, ...] expert tensors
    _build_variant("deepseek_v3", out["deepseek_v3"], num_hidden_layers=4)  # MLA; layer 0 dense, 1-3 MoE (8 experts)
    # Mamba-2 / MoE / attention / MLP; 6 experts so that 4 FFN ranks hold 2, 2, 1, 1
    _build_variant("nemotron_h", out["nemotron_h"], n_routed_experts=6, n_group=2, topk_group=1)
    if not (SOL_MINI / "config.json").is_file():
        from waferline.demo import SOL_DEMO_CONFIG
        from waferline.model.init import write_random_checkpoint

        out["sol"] = tmp / "sol"
        write_random_checkpoint(SOL_DEMO_CONFIG, out["sol"])
    return out


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    return [[(i * 7 + j * 3 + 1) % vocab for j in range(n)] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def references(ckpts):
    refs = {}
    for name, d in ckpts.items():
        llm = LLM(d)
        many = _prompts(llm.spec.vocab_size, LENGTHS)
        greedy = SamplingParams(max_tokens=8, ignore_eos=True)
        sampled = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
        refs[name] = {"many": many, "greedy": greedy, "sampled": sampled,
                      "many_out": [o.token_ids for o in llm.generate(many, greedy)],
                      "sampled_out": [o.token_ids for o in llm.generate(many[:3], sampled)],
                      "logprobs": llm.prompt_logprobs(many[3])}
    return refs


# (model, attention ranks M, FFN ranks N): every model with M = 1 and M = 2; N = 1, 2 and 4 (nemotron_h's 6 experts
# split 2/2/1/1 over 4 ranks, 3/3 over 2); granitemoehybrid's fused expert tensors are sliced per rank
CASES = [("deepseek_v3", 1, 1), ("deepseek_v3", 2, 4), ("nemotron_h", 1, 4), ("nemotron_h", 2, 2), ("sol", 2, 1),
         ("sol", 1, 2), ("granitemoehybrid", 2, 4)]


@pytest.mark.parametrize("model,M,N", CASES, ids=[f"{m}-M{a}-N{f}" for m, a, f in CASES])
def test_afd_matches_single_process(model, M, N, ckpts, references):
    ref = references[model]
    with LLM(ckpts[model], afd=True, attention_ranks=M, ffn_ranks=N, prefill_chunk=CHUNK, threads_per_rank=1) as llm:
        where = f"{model} M={M} N={N}"
        assert [o.token_ids for o in llm.generate(ref["many"], ref["greedy"])] == ref["many_out"], where
        assert [o.token_ids for o in llm.generate(ref["many"][:3], ref["sampled"])] == ref["sampled_out"], where
        lp = llm.prompt_logprobs(ref["many"][3])  # 16 tokens: one chunk, every layer through the FFN ranks
        assert lp.shape == ref["logprobs"].shape
        diff = (lp - ref["logprobs"]).abs().max().item()
        assert diff < LOGPROB_TOL, f"{where}: prompt log-probs differ by {diff:.2e}"
        if M == 2:  # a stream abandoned mid-way leaves the engine usable
            it = llm.stream(ref["many"], ref["greedy"])
            next(it)
            it.close()
            assert [o.token_ids for o in llm.generate(ref["many"], ref["greedy"])] == ref["many_out"], where
            assert llm.generate([], ref["greedy"]) == []
        split = llm.time_split()  # (the LLM's own: the docs' example)
        assert set(split["sides"]) == {"attention", "ffn"} and len(split["ranks"]) == M + N
        assert split["sides"]["ffn"]["compute"] > 0 and split["sides"]["attention"]["transfer"] > 0


def test_each_rank_loads_only_its_part(ckpts):
    from waferline.model.load import open_weights

    d = ckpts["nemotron_h"]
    spec = spec_from_pretrained(d)
    layout = make_layout(spec, 1, 4)
    moe = next(i for i, k in layout.kinds.items() if k == "moe")
    assert layout.splits[moe] == [(0, 2), (2, 4), (4, 5), (5, 6)]  # uneven: 6 experts over 4 ranks
    src = open_weights(d)
    load_attention_side(d, torch.float32, src=src)
    assert src.used and not [n for n in src.used if "experts" in n or "up_proj" in n or "down_proj" in n]
    src = open_weights(d)
    mods = load_ffn_side(d, torch.float32, 2, layout, src=src)
    experts = {int(n.split("experts.")[1].split(".")[0]) for n in src.used if "experts." in n and "shared" not in n}
    assert experts == {4}, f"FFN rank 2 read experts {experts}"
    assert mods[moe].num_experts == 1
    assert not [n for n in src.used if "mixer.in_proj" in n or "q_proj" in n or "embeddings" in n]


def test_bad_configurations_are_explained(ckpts, tmp_path):
    with pytest.raises(ConfigError, match="at least one expert"):
        AFD(ckpts["nemotron_h"], attention_ranks=1, ffn_ranks=7)
    with pytest.raises(ConfigError, match="at least one attention rank"):
        AFD(ckpts["sol"], attention_ranks=0, ffn_ranks=1)
    with pytest.raises(ConfigError, match="two different engines|drop those"):
        LLM(ckpts["sol"], afd=True, stages=2)
    dense = tmp_path / "llama"
    tiny_models.build("llama", dense)  # dense: 2 FFN layers go to FFN ranks whole
    with pytest.raises(ConfigError, match="dense"):
        AFD(dense, attention_ranks=1, ffn_ranks=3)
    v4 = tmp_path / "deepseek_v4"  # hyper-connection layers: refused as such, not as a layer without a MoE
    tiny_models.build("deepseek_v4", v4)
    with pytest.raises(ConfigError, match="deepseek_v4 checkpoint; the AFD engine does not run it"):
        LLM(v4, afd=True, attention_ranks=1, ffn_ranks=1)


def test_plan_from_the_planner_runs(ckpts, references):
    from waferline.plan.place import place
    from waferline.sim.pipeline import simulate

    d = ckpts["deepseek_v3"]
    plan = place(str(d), "h200-sxm", afd=True, attention_ranks=2, ffn_ranks=2, batch=5)
    assert [s.role for s in plan.stages] == ["attention", "attention", "ffn", "ffn"] and plan.micro_batches == 2
    r = simulate(plan, prompt_len=16, output_len=8)
    assert r.aggregate_tokens_per_s > 0 and r.bound.startswith("AFD")
    ref = references["deepseek_v3"]
    with LLM(d, plan=plan, prefill_chunk=CHUNK, threads_per_rank=1) as llm:
        assert (llm._pipeline.M, llm._pipeline.N) == (2, 2)
        assert [o.token_ids for o in llm.generate(ref["many"], ref["greedy"])] == ref["many_out"]
    with pytest.raises(ConfigError, match="data-parallel"):  # pool placement (layers split over stages): planner-only
        AFD(d, plan=place(str(d), "wse-3", afd=True, devices=4))
    # placed for another model: said so (not that its attention ranks do not each hold every layer)
    with pytest.raises(ConfigError, match=r"placed for qwen3-30b-a3b \(qwen3_moe, 48 layers\); .* is deepseek_v3"):
        AFD(d, plan=place("qwen3-30b-a3b", "h200-sxm", afd=True, attention_ranks=1, ffn_ranks=2))


def test_simulator_predicts_the_engine_layout():
    """The simulator's AFD model: with attention as busy as the experts, ping-pong (K = 2) beats alternating (K = 1);
    with weight-bound experts it does not (each micro-batch reads the experts again); one sequence pays the per-layer
    round trips; Step-3's catalog entry matches the report's cache size (1.02 GB per 32K tokens at FP8)."""
    from waferline.plan.place import place
    from waferline.sim.pipeline import is_afd_ranks, simulate
    from waferline.spec.catalog import load_model

    def k_gain(M: int, N: int, b: int) -> float:
        plan = place("step3", "h800", weight_bits=8, kv_bits=8, context=4096, batch=M * b, afd=True, attention_ranks=M,
                     ffn_ranks=N)
        assert plan.fits and is_afd_ranks(plan) and plan.micro_batches == 2
        assert [s.role for s in plan.stages].count("ffn") == N and all(len(s.layers) == 61 for s in plan.stages[:M])
        two = simulate(plan, prompt_len=3072, output_len=1024)
        plan.micro_batches = 1
        return two.aggregate_tokens_per_s / simulate(plan, prompt_len=3072, output_len=1024).aggregate_tokens_per_s

    assert k_gain(2, 16, 256) > 1.1  # experts spread thin, attention busy: the FFN hides behind the other micro-batch
    assert k_gain(4, 2, 64) < 1.0  # experts weight-bound, attention light: two micro-batches read the experts twice
    solo = simulate(place("deepseek-v3", "h800", weight_bits=8, afd=True, attention_ranks=1, ffn_ranks=8, batch=1),
                    prompt_len=64, output_len=64)
    plain = simulate(place("deepseek-v3", "h800", weight_bits=8, devices=16, batch=1), prompt_len=64, output_len=64)
    assert solo.decode_tokens_per_s_per_user < plain.decode_tokens_per_s_per_user
    assert abs(load_model("step3").cache_bytes_per_token(8) * 32768 - 1.02e9) < 0.01e9


def _gone(pids: list[int]) -> bool:
    for p in pids:
        try:
            if Path(f"/proc/{p}/stat").read_text().split()[2] != "Z":
                return False
        except (FileNotFoundError, ProcessLookupError):
            continue
    return True


@pytest.mark.parametrize(
    "victim,sig",
    [("ffn", signal.SIGKILL), ("attention", signal.SIGKILL), ("ffn", signal.SIGSTOP)],
    ids=["ffn-killed", "attention-killed", "ffn-hung"],
)
def test_dead_or_hung_rank_is_named_within_10s(ckpts, victim, sig):
    llm = LLM(ckpts["sol"], afd=True, attention_ranks=2, ffn_ranks=2, threads_per_rank=1, hang_timeout_s=3.0)
    afd = llm._pipeline
    pids = afd.pids  # ranks 1..M+N-1: attention rank 1, FFN ranks 0 and 1
    pid, name = (pids[2], "FFN rank 1") if victim == "ffn" else (pids[0], "attention rank 1")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # works before the fault
    box: dict = {}

    def run():
        try:
            llm.generate([[1, 2, 3], [4, 5], [6]], SamplingParams(max_tokens=1500, ignore_eos=True))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["e"], box["t"] = e, time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.5)
    killed = time.monotonic()
    os.kill(pid, sig)
    t.join(30)
    assert not t.is_alive(), "the caller hung instead of getting an error"
    err = box.get("e")
    assert isinstance(err, WaferlineError) and isinstance(err, AFDError), err
    assert name in str(err) and ("died" in str(err) if sig == signal.SIGKILL else "hung" in str(err)), str(err)
    assert box["t"] - killed < 10, f"named after {box['t'] - killed:.1f} s"
    assert _gone(pids), "rank processes left behind"
    with pytest.raises(AFDError, match=name):  # every later caller gets the same answer
        llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    llm.close()


def test_cli_generate_afd(ckpts, references, capsys):
    from waferline.cli import main

    ref = references["nemotron_h"]
    ids = " ".join(map(str, ref["many"][0]))
    assert main(["generate", "--model", str(ckpts["nemotron_h"]), "--prompt-ids", ids, "--max-tokens", "8", "--afd",
                 "--attention-ranks", "1", "--ffn-ranks", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["token_ids"] == ref["many_out"][0]
    assert main(["generate", "--model", str(ckpts["nemotron_h"]), "--prompt-ids", ids, "--afd", "--stages", "2"]) == 2
    assert "two different engines" in capsys.readouterr().err


CTRL_C_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from waferline import LLM, SamplingParams
llm = LLM(sys.argv[1], afd=True, attention_ranks=2, ffn_ranks=2, threads_per_rank=1)
print("ready", *llm._pipeline.pids, flush=True)
llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=1500, ignore_eos=True))
print("finished", flush=True)
"""


def test_ctrl_c_stops_every_rank(ckpts):
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_SCRIPT, str(ckpts["sol"])], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "ready", proc.stderr.read()
        pids = [int(p) for p in line[1:]]
        time.sleep(0.5)  # into the decode loop
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "finished" not in rest and "KeyboardInterrupt" in err
    time.sleep(0.5)
    assert _gone(pids), "rank processes left behind"


def test_a_hang_is_timed_from_the_steps_start_not_the_idle_time_before(ckpts):
    """The hang message counts the seconds without progress within the step: ranks that last progressed long before
    the step began (idle between requests) were said to have made none for all that time."""
    class Store:
        def multi_get(self, keys):
            return [b"5"] * len(keys)  # (no rank moves)

    class Ctl:
        store = Store()

    class Proc:
        pid = os.getpid()  # (running, not stopped)

    afd = AFD.__new__(AFD)
    afd.layout = make_layout(spec_from_pretrained(ckpts["sol"]), 1, 2)
    afd.hang_timeout_s, afd._closed, afd._env, afd._procs = 2.0, False, True, [Proc(), Proc()]
    afd._diagnose = lambda ctl: None
    faults = []
    afd._watch_fault = lambda fault: faults.append(fault) is None and fault is None
    now = time.monotonic()
    afd._busy_since = now - 3.0  # the step began 3 s ago; the ranks last progressed 60 s ago, before it
    last = {r: (5, now - 60.0) for r in range(1, afd.layout.world)}
    afd._watch_tick((Ctl(), ["k1", "k2"], last))
    assert len(faults) == 1 and "hung" in faults[0], faults
    stalled = float(faults[0].split("progress for ")[1].split(" s")[0])
    assert 3.0 <= stalled < 10.0, faults[0]


def test_a_prefill_beside_a_verify_runs_as_a_plain_prefill(ckpts):
    """A verify and a plain prefill chunk in one AFD step (speculation): only the verify records the per-token trail
    its rollback needs. The Mamba-2 caches recorded it for every row of the step, so the prefill ran token by token,
    its log-probs differed from the same prompt's alone, and its trail (T states per Mamba-2 layer) stayed behind."""
    from waferline.engine.runner import WANT_ARGMAX, WANT_LOGPROBS, PrefillChunk, VerifyRow

    with LLM(ckpts["nemotron_h"], speculative="ngram", afd=True, attention_ranks=1, ffn_ranks=1,
             threads_per_rank=1) as llm:
        sch = llm._engine(3)
        runner = sch.runner
        first, prompt = [5, 6, 7, 8] * 4, list(range(10, 50))
        for rid, n in (("a", len(first) + 3), ("b", len(prompt)), ("c", len(prompt))):
            sch.cache.admit(rid)
            assert sch.cache.grow(rid, n)
        runner.reset_slots([0, 1, 2])
        runner.step([], [PrefillChunk(0, 0, first, WANT_LOGPROBS)])
        _, _, beside = runner.verify([VerifyRow(0, len(first), [5, 6, 7], WANT_ARGMAX)], [],
                                     [PrefillChunk(1, 0, prompt, WANT_LOGPROBS)])
        trails = [set(c.trail) for c in runner.pipe.runner.rt.caches if hasattr(c, "trail")]
        assert trails and all(t <= {0} for t in trails), trails  # (slot 0's verify: its keep comes next step)
        alone = runner.step([], [PrefillChunk(2, 0, prompt, WANT_LOGPROBS)])[1][0]
        assert torch.equal(beside[0].logits, alone.logits)
