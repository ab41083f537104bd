"""Pipeline engine: stages as processes give the single-process engine's tokens and log-probs; faults are named."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import tiny_models
from conftest import raised_in_thread
from waferline import LLM, SamplingParams, kernels
from waferline.engine.pipeline import Pipeline, StageError, stage_ranges
from waferline.engine.transport import Control
from waferline.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
SOL_MINI = ROOT / "models" / "sol-mini"
CHUNK = 16  # prefill chunk: the longer prompts below are prefilled in several pipelined chunks
LENGTHS = [5, 23, 3, 40, 11]  # mixed prompt lengths
LOGPROB_TOL = 1e-5  # a prompt prefilled in one chunk: the same ops as the single-process engine
CHUNKED_LOGPROB_TOL = 1e-4  # a prompt prefilled in several chunks: fp32 reassociation only (seen: <= 9e-6)


def _build_variant(model_type: str, directory: Path, **overrides) -> None:
    """tiny_models.build with some config fields changed (e.g. more layers so that 4 stages fit)."""
    orig = tiny_models.configs
    tiny_models.configs = lambda: {**orig(), model_type: dict(orig()[model_type], **overrides)}
    try:
        tiny_models.build(model_type, directory)
    finally:
        tiny_models.configs = orig


def _sol_checkpoint(tmp: Path) -> Path:
    if (SOL_MINI / "config.json").is_file() and any(SOL_MINI.glob("*.safetensors")):
        return SOL_MINI
    from waferline.demo import SOL_DEMO_CONFIG
    from waferline.model.init import write_random_checkpoint

    d = tmp / "sol"
    write_random_checkpoint(SOL_DEMO_CONFIG, d)
    return d


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    out = {}
    out["deepseek_v3"] = tmp / "dsv3"
    _build_variant("deepseek_v3", out["deepseek_v3"], num_hidden_layers=4)  # MLA + MoE, 4 layers
    out["nemotron_h"] = tmp / "nemotron_h"
    tiny_models.build("nemotron_h", out["nemotron_h"])  # Mamba-2 / MoE / attention / MLP, 4 layers
    out["sol"] = _sol_checkpoint(tmp)
    return out


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    return [[(i * 7 + j * 3 + 1) % vocab for j in range(n)] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def references(ckpts):
    """The single-process engine's answers, per model."""
    refs = {}
    for name, d in ckpts.items():
        llm = LLM(d)
        V = llm.spec.vocab_size
        many, few = _prompts(V, LENGTHS), _prompts(V, [17, 4])
        greedy = SamplingParams(max_tokens=10, ignore_eos=True)
        sampled = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
        refs[name] = {
            "layers": llm.spec.num_layers,
            "many": many, "few": few, "greedy": greedy, "sampled": sampled,
            "many_out": [o.token_ids for o in llm.generate(many, greedy)],
            "few_out": [o.token_ids for o in llm.generate(few, greedy)],
            "sampled_out": [o.token_ids for o in llm.generate(many[:3], sampled)],
            "logprobs": llm.prompt_logprobs(many[3][:CHUNK]),
            "chunked_logprobs": llm.prompt_logprobs(many[3]),
        }
    return refs


def _stage_counts(layers: int) -> list[tuple[int | None, int | None, int | None]]:
    """(stages, layers_per_stage, micro_batches): 1, 2 and 4 stages, and one layer per stage."""
    if layers == 4:  # 4 stages is one layer per stage; run it with more micro-batches than stages
        return [(1, None, None), (2, None, None), (None, 1, 6)]
    cases = [(1, None, None), (2, None, None)] if layers >= 2 else [(1, None, None)]
    if layers > 4:
        cases.append((4, None, 6))
    return cases + [(None, 1, None)] if layers > 2 else cases  # one layer per stage (L stages)


@pytest.mark.parametrize("model", ["deepseek_v3", "nemotron_h", "sol"])
def test_pipeline_matches_single_process(model, ckpts, references):
    ref = references[model]
    for stages, k, M in _stage_counts(ref["layers"]):
        with LLM(ckpts[model], stages=stages, layers_per_stage=k, micro_batches=M, prefill_chunk=CHUNK,
                 threads_per_stage=1) as llm:
            S = llm._pipeline.num_stages
            where = f"{model} S={S} M={llm._pipeline.micro_batches}"
            # more sequences than stages (S <= 4), and fewer (2 sequences on 4+ stages)
            assert [o.token_ids for o in llm.generate(ref["many"], ref["greedy"])] == ref["many_out"], where
            assert [o.token_ids for o in llm.generate(ref["few"], ref["greedy"])] == ref["few_out"], where
            assert [o.token_ids for o in llm.generate(ref["many"][:3], ref["sampled"])] == ref["sampled_out"], where
            lp = llm.prompt_logprobs(ref["many"][3][:CHUNK])
            assert lp.shape == ref["logprobs"].shape
            diff = (lp - ref["logprobs"]).abs().max().item()
            assert diff < LOGPROB_TOL, f"{where}: prompt log-probs differ by {diff:.2e}"
            lp = llm.prompt_logprobs(ref["many"][3])  # 40 tokens: three chunks streamed through the stages
            diff = (lp - ref["chunked_logprobs"]).abs().max().item()
            assert lp.shape == ref["chunked_logprobs"].shape and diff < CHUNKED_LOGPROB_TOL, f"{where}: {diff:.2e}"


def test_stage_split_and_errors(ckpts):
    assert stage_ranges(6, stages=4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert stage_ranges(5, layers_per_stage=2) == [(0, 2), (2, 4), (4, 5)]
    assert stage_ranges(3) == [(0, 3)]
    with pytest.raises(ConfigError, match="at least one layer"):
        stage_ranges(3, stages=4)
    with pytest.raises(ConfigError, match="only one of"):
        stage_ranges(4, stages=2, layers_per_stage=2)
    with pytest.raises(ConfigError, match="micro_batches"):
        LLM(ckpts["sol"], stages=2, micro_batches=0)
    with pytest.raises(ConfigError, match="need stages"):
        LLM(ckpts["sol"], micro_batches=2)


@pytest.mark.parametrize("options", [dict(stages=2), dict(layers_per_stage=1), dict(afd=True)],
                         ids=["stages", "layers_per_stage", "afd"])
def test_a_speculative_option_the_engine_refuses_is_refused_before_its_processes_start(ckpts, monkeypatch, options):
    """A pipeline's or AFD's speculation was made over the runner, after every stage / rank process had started: `mtp`
    on a checkpoint without MTP weights (a transformers DeepSeek-V3: its config says 1 MTP layer, its file has none),
    an unknown method, K = 0 or a draft model of another vocabulary started the processes, then stopped them. A good
    option still gets as far as starting them."""
    import waferline.engine.afd as afd_mod
    import waferline.engine.pipeline as pipeline_mod

    def started(*a, **k):
        raise AssertionError("processes started")

    monkeypatch.setattr(pipeline_mod, "Pipeline", started)
    monkeypatch.setattr(afd_mod, "AFD", started)
    target, sol = ckpts["deepseek_v3"], ckpts["sol"]  # (vocabularies of 128 and 4096 tokens)
    for method, k, match in [("mtp", 4, "needs a checkpoint with MTP weights"), ("bogus", 4, "unknown speculative"),
                             ("ngram:2", 4, "ngram:MIN_N:MAX_N"), ("ngram", 0, "num_speculative_tokens must be >= 1"),
                             (f"draft:{sol}", 4, "must share the target's tokenizer"),
                             (f"draft:{target / 'missing'}", 4, "does not exist")]:
        with pytest.raises(ConfigError, match=match):
            LLM(target, speculative=method, num_speculative_tokens=k, **options)
    for path, method in [(target, "ngram"), (target, f"draft:{target}"), (sol, "mtp")]:
        with pytest.raises(AssertionError, match="processes started"):
            LLM(path, speculative=method, **options)


def test_the_other_engines_options_are_refused_by_name(ckpts):
    """LLM takes the pipeline's and AFD's options together; one that only the other engine takes was passed on and
    failed as a TypeError (`Pipeline.__init__() got an unexpected keyword argument 'threads_per_rank'`)."""
    with pytest.raises(ConfigError, match="a pipeline does not take threads_per_rank"):
        LLM(ckpts["sol"], stages=2, threads_per_rank=1)
    with pytest.raises(ConfigError, match="the AFD engine does not take launch, load_kwargs"):
        LLM(ckpts["sol"], afd=True, launch="local", load_kwargs={})


def test_stages_are_balanced_by_work_with_the_lm_head_on_the_last():
    """`stages=S` cuts where the largest stage's work (active weights, the LM head's product on the last stage) is
    least: a small model's head is worth several layers (on the 124.7M Llama an even 6 + 6 left the last stage the
    slowest; benchmarks/pipeline_split.py)."""
    import itertools
    import random

    from waferline.engine.pipeline.launch import balanced_ranges
    from waferline.spec.configs import parse_hf_config

    assert stage_ranges(4, stages=2, costs=[1.0] * 4, last_extra=2.0) == [(0, 3), (3, 4)]
    assert stage_ranges(4, stages=2, costs=[1.0] * 4) == [(0, 2), (2, 4)]
    assert stage_ranges(3, stages=3, costs=[5.0, 1.0, 1.0], last_extra=9.0) == [(0, 1), (1, 2), (2, 3)]
    rng = random.Random(0)
    for _ in range(200):  # the least largest stage, against every way to cut
        L, S = rng.randint(1, 9), rng.randint(1, 4)
        if S > L:
            continue
        costs, extra = [rng.uniform(0.1, 3.0) for _ in range(L)], rng.uniform(0.0, 5.0)
        got = stage_ranges(L, stages=S, costs=costs, last_extra=extra)
        assert [a for a, _ in got] == [0] + [b for _, b in got[:-1]] and got[-1][1] == L and all(b > a for a, b in got)

        def worst(bounds: list[int]) -> float:
            edges = [0, *bounds, L]
            return max(sum(costs[edges[i]:edges[i + 1]]) + (extra if i == S - 1 else 0.0) for i in range(S))

        best = min(worst(list(c)) for c in itertools.combinations(range(1, L), S - 1))
        assert worst([a for a, _ in got[1:]]) == pytest.approx(best)
    llama = parse_hf_config({"model_type": "llama", "vocab_size": 32000, "hidden_size": 768, "num_hidden_layers": 12,
                            "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 2048})
    assert balanced_ranges(llama, 2) == [(0, 8), (8, 12)]
    assert balanced_ranges(llama, layers_per_stage=1) == stage_ranges(12, layers_per_stage=1)  # (K per stage: as asked)


def test_a_pipeline_with_more_stages_than_gpus_is_refused_before_it_starts(ckpts, monkeypatch):
    # NCCL cannot put two ranks on one GPU (a 2-stage pipeline on one GPU failed inside the stages' start-up)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="one stage per GPU: 2 stages need 2 GPUs, torch sees 1"):
        LLM(ckpts["sol"], stages=2, device="cuda")
    # each stage on its own GPU, counted from stage 0's (cuda:1 put stage 1 on cuda:1 too: it took rank % GPUs)
    from waferline.engine.stage import stage_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert [str(stage_device("cuda:1", r)) for r in range(3)] == ["cuda:1", "cuda:2", "cuda:0"]
    assert [str(stage_device("cuda", r)) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert stage_device("cpu", 1) == torch.device("cpu")


def test_pipeline_from_plan(ckpts):
    from waferline.plan.plan import Plan, Stage

    def plan(layers: list[list[int]], mb: int = 2) -> Plan:
        return Plan(
            model="sol",
            hardware="cpu",
            micro_batches=mb,
            stages=[
                Stage(index=i, role="full", layers=ls, device="cpu", device_ids=[i]) for i, ls in enumerate(layers)
            ],
        )

    assert stage_ranges(4, plan=plan([[0], [1, 2], [3]])) == [(0, 1), (1, 3), (3, 4)]
    with pytest.raises(ConfigError, match="contiguous"):
        stage_ranges(4, plan=plan([[0, 2], [1, 3]]))
    with pytest.raises(ConfigError, match="do not cover"):
        stage_ranges(4, plan=plan([[0], [1]]))
    with LLM(ckpts["nemotron_h"], plan=plan([[0, 1, 2], [3]], mb=3), threads_per_stage=1) as llm:
        assert llm._pipeline.ranges == [(0, 3), (3, 4)] and llm._pipeline.micro_batches == 3
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3 and out.finish_reason == "length"



def test_pipeline_from_plan_file_takes_its_micro_batches(ckpts, tmp_path):
    """A plan given as a file path runs as the same Plan given as an object: its ranges and its micro_batches."""
    from waferline.plan.plan import Plan, Stage
    from waferline.spec.configs import spec_from_pretrained

    n = spec_from_pretrained(ckpts["sol"]).num_layers
    plan = Plan(model="sol", hardware="cpu", micro_batches=3,
                stages=[Stage(index=0, role="full", layers=list(range(n)), device="cpu", device_ids=[0])])
    plan.save(tmp_path / "plan.json")
    with Pipeline(ckpts["sol"], plan=str(tmp_path / "plan.json"), threads_per_stage=1) as pipe:
        assert pipe.ranges == [(0, n)] and pipe.micro_batches == 3


def test_a_plan_of_another_model_is_refused_naming_both(ckpts, tmp_path):
    """A plan placed for one model and given with another's checkpoint: refused naming the two, before a stage
    starts (a catalog plan was refused by which layers it left out; a plan of another 4-layer checkpoint ran)."""
    from waferline.plan.place import place

    with pytest.raises(ConfigError, match=r"placed for deepseek-v3 \(deepseek_v3, 61 layers\); .* is nemotron_h "
                                          r"with 4 layers"):
        LLM(ckpts["nemotron_h"], plan=place("deepseek-v3", "wse-3", weight_bits=4))
    plan = place(str(ckpts["deepseek_v3"]), "wse-3", layers_per_stage=2)
    plan.save(tmp_path / "plan.json")
    for given in (plan, str(tmp_path / "plan.json")):
        with pytest.raises(ConfigError, match=r"\(deepseek_v3, 4 layers\); .* is nemotron_h with 4 layers"):
            LLM(ckpts["nemotron_h"], plan=given)
    plan.model = "a-model-this-machine-does-not-have"  # (unresolved: its layers are checked)
    plan.stages[-1].layers = plan.stages[-1].layers[:-1]
    with pytest.raises(ConfigError, match="the plan places layers up to 2 of a-model-this-machine-does-not-have; "
                                          ".* has 4 layers"):
        LLM(ckpts["deepseek_v3"], plan=plan)

def test_a_plan_is_run_as_placed_its_weight_bits_and_speculation(ckpts, tmp_path):
    """A Plan describes its weights and speculation too: the run takes the plan's speculation where it names none, and
    is refused where it is another deployment (the plan's int4 weights on a 16-bit checkpoint ran 16-bit, its
    speculation was dropped: its memory and predictions were another run's)."""
    from waferline.engine.inputs import plan_run
    from waferline.model.quant import is_int4
    from waferline.plan.plan import Plan, SpeculativeConfig, Stage
    from waferline.spec.configs import spec_from_pretrained

    d = ckpts["sol"]
    n = spec_from_pretrained(d).num_layers

    def plan(**kw) -> Plan:
        return Plan(model="sol", hardware="cpu", stages=[Stage(index=0, role="full", layers=list(range(n)),
                                                               device="cpu", device_ids=[0])], **kw)

    with pytest.raises(ConfigError, match=r"the plan places 4-bit weights; .* runs unquantized weights: pass "
                                          r"weight_bits=4, group_size=64 \(int4 on load\), load an int4 checkpoint"):
        LLM(d, plan=plan(weight_bits=4, group_size=64))  # (a pipeline converts on load: the plan's group size)
    with LLM(d, plan=plan(weight_bits=4, group_size=64), weight_bits=4, group_size=64, threads_per_stage=1) as llm:
        assert is_int4(llm._pipeline.runner.model)  # (as the message says: the plan's int4 weights, RTN on load)
    with pytest.raises(ConfigError, match="the plan places 8-bit weights; .* the engine runs int4 or unquantized"):
        LLM(d, plan=plan(weight_bits=8))
    ngram = plan(speculative=SpeculativeConfig(method="ngram", num_tokens=2))
    with pytest.raises(ConfigError, match=r"speculative='mtp' but the plan places ngram"):
        LLM(d, plan=ngram, speculative="mtp")
    with pytest.raises(ConfigError, match="speculative='ngram' but the plan places no speculation"):
        LLM(d, plan=plan(), speculative="ngram")
    with pytest.raises(ConfigError, match=r"the plan's speculation \(eagle, no draft model\) is not one the engine"):
        LLM(d, plan=plan(speculative=SpeculativeConfig(method="eagle", num_tokens=2)))
    ngram.save(tmp_path / "plan.json")
    opts = {"plan": str(tmp_path / "plan.json")}
    assert plan_run(opts, d, 16, None, 4) == ("ngram", 2) and isinstance(opts["plan"], Plan)  # (the plan's, read)
    assert plan_run({"plan": ngram}, d, 16, "ngram", 3) == ("ngram", 3)  # (the run's own count of the same method)
    assert plan_run({"plan": plan()}, d, 16, None, 4) == (None, 4) and plan_run({}, d, 16, "mtp", 2) == ("mtp", 2)
    drafted = plan(speculative=SpeculativeConfig(method="draft", num_tokens=0, draft_model=str(tmp_path)))
    assert plan_run({"plan": drafted}, d, 16, None, 4) == (f"draft:{tmp_path}", 4)
    # a draft plan placed without its draft model runs with the one the run names (it was refused as not run)
    undrafted = plan(speculative=SpeculativeConfig(method="draft", num_tokens=3))
    assert plan_run({"plan": undrafted}, d, 16, f"draft:{tmp_path}", 4) == (f"draft:{tmp_path}", 4)
    with pytest.raises(ConfigError, match=r"\(draft, no draft model\) is not one .*speculative='draft:PATH'"):
        plan_run({"plan": undrafted}, d, 16, None, 4)
    with pytest.raises(ConfigError, match="speculative='ngram' but the plan places eagle"):
        plan_run({"plan": plan(speculative=SpeculativeConfig(method="eagle", num_tokens=2))}, d, 16, "ngram", 4)


def test_micro_batches_split_decodes_and_stream_long_prompts(ckpts):
    """A step's decode rows go to min(M, n) micro-batches; prefill chunks fill what is left of each micro-batch's
    prefill chunk, in order, a long prompt split into pieces sent back to back (pipelined), only its last piece asking
    for the next token; the twin's host model prices the very same micro-batches (sim prefill_micro_batches)."""
    from waferline.engine.pipeline.serving import PipelineRunner
    from waferline.engine.runner import WANT_ARGMAX, WANT_NONE
    from waferline.sim.host_work import prefill_micro_batches

    with Pipeline(ckpts["sol"], stages=1, micro_batches=2, prefill_chunk=8) as pipe:
        r = PipelineRunner(pipe, 8)
        dec = [(i, 3, [4], WANT_ARGMAX, i) for i in range(5)]
        assert [[row[0] for row in mb] for mb in r._split(dec, 5)] == [[0, 1, 2], [3, 4]]
        assert len(r._split(dec[:1], 1)) == 1  # one sequence: one micro-batch, nothing waits for others
        pre = [(0, 0, list(range(20)), WANT_ARGMAX, 0), (1, 0, list(range(5)), WANT_ARGMAX, 1)]
        assert [[(s, st, len(t), w) for s, st, t, w, _ in mb] for mb in r._split(pre, 0)] == [
            [(0, 0, 8, WANT_NONE)],
            [(0, 8, 8, WANT_NONE)],
            [(0, 16, 4, WANT_ARGMAX), (1, 0, 4, WANT_NONE)],
            [(1, 4, 1, WANT_ARGMAX)],
        ]
        mixed = r._split(dec[:2] + [(2, 0, list(range(20)), WANT_ARGMAX, 2)], 2)
        assert [[(s, len(t)) for s, _, t, _, _ in mb] for mb in mixed] == [[(0, 1), (2, 7)], [(1, 1), (2, 7)], [(2, 6)]]
        for B, P in ((3, 20), (1, 5), (4, 9), (2, 16)):
            got = []
            for mb in r._split([(b, 0, list(range(P)), WANT_ARGMAX, b) for b in range(B)], 0):
                groups: dict[int, list[int]] = {}
                for _, start, toks, _, _ in mb:
                    g = groups.setdefault(len(toks), [0, 0])
                    g[0] += 1
                    g[1] = max(g[1], start)
                got.append([(g[0], n, g[1]) for n, g in sorted(groups.items())])
            assert got == prefill_micro_batches(B, P, 8), (B, P)


def test_bf16_a_prompt_split_by_the_packing_gets_what_one_process_gets_split_there(tmp_path, monkeypatch):
    """bfloat16, a Mamba-2 hybrid: a prompt split where a micro-batch's room ends (behind prompts of 150 and 100
    tokens, its first 6 tokens in one piece, the other 94 in the next) gets the log-probs one process computes for that
    prompt prefilled in the same two pieces: the stages add no rounding of their own (the hidden states cross between
    them in the model's dtype, as one process keeps them; each stage keeps its own fp32 SSM states). Prefilled whole
    (as one process's LLM.generate does) the prompt's first token's log-probs differ here by up to 1.6e-2: the Mamba-2
    scan's chunks start elsewhere and one fp32 value of layer 0, 4e-8 from a bf16 rounding midpoint, rounds the other
    way (docs/pipeline.md)."""
    import torch

    from waferline.engine import stage
    from waferline.model.context import StepBatch
    from waferline.model.load import load_model

    d = tmp_path / "bamba"
    tiny_models.build("bamba", d)
    # two short prompts take the first step, the last two the next (a step takes at most ceil(n / M) of n rows): the
    # last prompt gets the 6 tokens of that micro-batch's 256 the 250-token prompt leaves, the next micro-batch the rest
    prompts = [[5, 6, 7], [8, 9, 10], [(j * 5 + 1) % 120 + 3 for j in range(250)],
               [(j * 31 + 18) % 125 + 3 for j in range(100)]]
    ran: list[tuple[int, int]] = []
    forward = stage.StageRunner.forward

    def logged(self, mb, inputs):
        ran.extend((g.slots[0], g.T) for g in mb.groups if self.is_first and g.slots[0] == 3)
        return forward(self, mb, inputs)

    monkeypatch.setattr(stage.StageRunner, "forward", logged)  # (stage 0 runs in this process)
    sp = SamplingParams(max_tokens=1, temperature=1.0, seed=0, logprobs=20, ignore_eos=True)
    with LLM(d, dtype="bfloat16", stages=2, threads_per_stage=1) as llm:
        got = llm.generate(prompts, sp)[3].logprobs[0].top
    assert ran == [(3, 6), (3, 94)]  # (the last prompt's pieces, as pack_prefills cut them)
    model = load_model(d, torch.bfloat16)
    with torch.inference_mode():
        caches = model.new_caches(1)
        model(torch.tensor([prompts[3][:6]]), caches, StepBatch.make([0], [0], 6))
        h = model(torch.tensor([prompts[3][6:]]), caches, StepBatch.make([0], [6], 94))
        want = torch.log_softmax(model.logits(h[0, -1]).float(), -1)
    diff = max(abs(v - want[t].item()) for t, v in got)
    assert diff < 1e-6, f"the pipeline's log-probs differ from one process's split the same way by {diff:.2e}"


def test_stream_stop_tokens_and_abandoned_stream(ckpts, references):
    ref = references["sol"]
    with LLM(ckpts["sol"], stages=2, prefill_chunk=CHUNK, threads_per_stage=1) as llm:
        events = list(llm.stream(ref["many"], ref["greedy"]))
        outs = events[-1]
        assert [o.token_ids for o in outs] == ref["many_out"]
        for b, o in enumerate(outs):  # (row, token) events arrive in order per row
            assert [t for r, t in events[:-1] if r == b] == o.token_ids
        first = ref["few_out"][0]
        out = llm.generate([ref["few"][0]], SamplingParams(max_tokens=10, stop_token_ids=[first[2]]))[0]
        assert out.token_ids == first[:first.index(first[2]) + 1] and out.finish_reason == "stop"
        it = llm.stream(ref["many"], ref["greedy"])
        next(it)
        it.close()  # micro-batches were in flight: they are collected, and the pipeline stays usable
        assert [o.token_ids for o in llm.generate(ref["few"], ref["greedy"])] == ref["few_out"]
        assert llm.generate([], ref["greedy"]) == []


def _expect_stage_error(fn) -> StageError:
    """Run fn in a thread (so a hang cannot block the test run) and return the StageError it raised."""
    e = raised_in_thread(fn)
    assert isinstance(e, StageError), e
    return e


def _gone(pids: list[int]) -> bool:
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().split()[2]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            return False
    return True


@pytest.mark.parametrize("sig,when", [(signal.SIGKILL, "idle"), (signal.SIGKILL, "during"), (signal.SIGSTOP, "during")],
                         ids=["killed-idle", "killed-during-decode", "hung-during-decode"])
def test_dead_or_hung_stage_is_named(ckpts, sig, when):
    llm = LLM(ckpts["sol"], stages=3, threads_per_stage=1, hang_timeout_s=2.0)
    pids = llm._pipeline.pids
    victim = pids[0] if sig == signal.SIGKILL else pids[1]  # stage 1 dies, or stage 2 hangs
    name = "stage 1" if sig == signal.SIGKILL else "stage 2"
    long = SamplingParams(max_tokens=500, ignore_eos=True)
    if when == "idle":
        os.kill(victim, sig)
    else:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # the pipeline works before the fault
        threading.Timer(0.2, os.kill, (victim, sig)).start()
    err = _expect_stage_error(lambda: llm.generate([[1, 2, 3], [4, 5]], long))
    assert name in str(err) and ("died" in str(err) or "hung" in str(err)), str(err)
    assert _gone(pids), "stage processes left behind"
    with pytest.raises(StageError, match=name):  # every later caller gets the same answer
        llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    llm.close()


ENV_DRIVER = """
import sys, time
from waferline import LLM, SamplingParams
llm = LLM(sys.argv[1], stages=3, threads_per_stage=1, hang_timeout_s=float(sys.argv[2]))
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
try:
    for n, _ in enumerate(llm.stream([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2000, ignore_eos=True))):
        if n == 20:
            print("decoding", flush=True)
    print("finished", flush=True)
except Exception as e:
    print(f"{type(e).__name__}: {e}", flush=True)
print(f"took {time.monotonic() - t0:.1f}", flush=True)
"""
ENV_WORKER = ("import sys\nfrom waferline.engine.pipeline import serve_from_env\n"
              "sys.exit(serve_from_env(sys.argv[1], stages=3, threads_per_stage=1))")


@pytest.mark.parametrize("when, hang", [("idle", 2.0), ("during", 8.0)], ids=["killed-idle", "killed-during-decode"])
def test_a_stage_killed_under_a_hand_set_env_launch_is_named(ckpts, when, hang):
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand, one process per rank, no torchrun agent: rank 0 cannot see
    another host's exit code, and a rank killed outright (SIGKILL) writes no status. Its heartbeat in the store stops:
    rank 0 names the stage (it said "a stage stopped answering" without its index, or took it for hung), while idle
    within the hang timeout, and about a second after a link to it breaks mid-decode (the default hang timeout). (A
    stage it fed last before it died owes work and was named "hung" when its clock, started before the kill, ran out
    first: about one run in five.)"""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for r in range(3):
            env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            cmd = ["-c", ENV_DRIVER, str(ckpts["sol"]), str(hang)] if r == 0 else ["-c", ENV_WORKER, str(ckpts["sol"])]
            procs.append(subprocess.Popen([sys.executable, *cmd], env=env, text=True, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE if r == 0 else None))
        driver = procs[0]
        assert driver.stdout.readline().strip() == "ready", driver.communicate(timeout=30)[1][-2000:]
        if when == "idle":
            procs[1].kill()
            time.sleep(hang + 1.0)  # the watchdog alone notices
            driver.stdin.write("go\n")
            driver.stdin.flush()
        else:
            driver.stdin.write("go\n")
            driver.stdin.flush()
            assert driver.stdout.readline().strip() == "decoding"
            procs[1].kill()
        out, err = driver.communicate(timeout=60)
        lines = out.strip().splitlines()
        assert re.match(r"StageError: pipeline failed: stage 1 \(layers \d+-\d+\) stopped answering: no heartbeat",
                        lines[0]), out + err[-2000:]
        assert float(lines[-1].split()[1]) < hang, out
        assert procs[2].wait(timeout=15) != 0  # the other stage is stopped too
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_close_after_a_fault_seen_while_idle_under_an_env_launch_is_prompt(ckpts, monkeypatch):
    """A stage of a hand-set env:// launch dies while the pipeline is idle: the watchdog names it and stops every
    stage; close() then returns at once (it sent the dead stages a SHUTDOWN and waited 5 s for them to say they
    stopped; the server's recovery waited as long before it could say the engine stopped)."""
    import time

    from server_helpers import env_launch_worker

    with env_launch_worker(ckpts["sol"], monkeypatch) as worker:
        llm = LLM(ckpts["sol"], stages=2, threads_per_stage=1, hang_timeout_s=2.0)
        try:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
            worker.kill()
            deadline = time.monotonic() + 20
            while llm._pipeline._fault is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "stage 1" in (llm._pipeline._fault or ""), llm._pipeline._fault
            t0 = time.monotonic()
            llm.close()
            assert time.monotonic() - t0 < 2.0, f"close() took {time.monotonic() - t0:.1f} s"
        finally:
            llm.close()


# a worker that says it is alive, then dies before it joins the process groups (fork: the patch reaches the workers)
_DIES_WHILE_CONNECTING = """
import os, sys, time
import {module} as worker
orig = worker.make_group
def make_group(store, name, rank, *args):
    if rank == 2:
        os._exit(9)
    return orig(store, name, rank, *args)
worker.make_group = make_group
from waferline import LLM
t0 = time.monotonic()
try:
    LLM(sys.argv[1], threads_per_stage=1, start_method="fork", **{options})
except Exception as e:
    print(f"{{type(e).__name__}}: {{e}}")
print(f"took {{time.monotonic() - t0:.1f}} s", flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("engine, options, name", [
    ("waferline.engine.stage", {"stages": 3}, "stage 2"),
    ("waferline.engine.afd.ranks", {"afd": True, "ffn_ranks": 2}, "FFN rank 1"),
], ids=["pipeline", "afd"])
def test_a_worker_that_dies_while_the_processes_connect_is_named_at_once(ckpts, engine, options, name):
    """The driver's process group rendezvous waits for the address of every worker on the rendezvous store; its
    start-up checks read the workers' errors through the same store connection, which answers one request at a time,
    so a worker that died before it joined was never noticed: start-up (and a server's rebuild after a fault) hung for
    good. It is named within seconds."""
    code = _DIES_WHILE_CONNECTING.format(module=engine, options=options)
    try:
        out = subprocess.run([sys.executable, "-c", code, str(ckpts["deepseek_v3"])], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    except subprocess.TimeoutExpired:
        pytest.fail("start-up hung on a worker that died while the processes connected")
    assert f"{name} " in out and "exited with exit code 9 before it could connect" in out, out
    assert float(out.rsplit("took ", 1)[1].split()[0]) < 10, out


class _Store:
    """The rendezvous store's keys, for a driver whose workers are stand-ins."""

    def __init__(self, keys=()):
        self.keys = dict(keys)

    def check(self, keys):
        return all(k in self.keys for k in keys)

    def get(self, k):
        return self.keys[k].encode()


class _Worker:
    pid, exitcode = 0, None


def _standing_in(stages: int, statuses: dict[int, str]) -> tuple[Pipeline, list[_Worker]]:
    """A driver of ``stages`` stages whose workers are stand-ins that exit when a test says so."""
    pipe = Pipeline.__new__(Pipeline)
    pipe.num_stages, pipe.ranges, pipe.run_id = stages, [(r, r + 1) for r in range(stages)], "run"
    pipe._procs = [_Worker() for _ in range(1, stages)]
    store = _Store({f"waferline/run/status/{r}": s for r, s in statuses.items()})
    pipe.ctl = Control(store, "run")
    pipe._store_client = lambda: store
    return pipe, pipe._procs


REFUSED = "RuntimeError: Gloo connectFullMesh failed with timed out connecting: SO_ERROR: Connection refused"


def test_a_worker_that_dies_while_the_processes_connect_is_named_not_the_one_it_refused():
    """A worker that dies in the middle of the process groups' rendezvous refuses the connections of the others: the
    driver's own build failed first and the error named stage 0, or a worker that reported its refused connection was
    named (stage 1 failed: ... Connection refused) while stage 2 had died. The one that died is named, also when its
    exit is seen a moment after the others' errors."""
    pipe, workers = _standing_in(2, {})
    box: dict = {}

    def build():
        box["error"] = RuntimeError(REFUSED.split(": ", 1)[1])
        threading.Timer(0.05, setattr, (workers[0], "exitcode", 9)).start()

    with pytest.raises(StageError, match=r"^stage 1 \(layer 1\) exited with exit code 9 before it could connect"):
        pipe._connect_watching(build, box)

    pipe, workers = _standing_in(3, {1: REFUSED})
    workers[0].exitcode = 1  # (it exits after it said why)
    threading.Timer(0.05, setattr, (workers[1], "exitcode", -9)).start()
    with pytest.raises(StageError, match=r"^stage 2 \(layer 2\) exited with signal SIGKILL before it could connect"):
        pipe._check_starting("connect to the other stages")
    pipe, workers = _standing_in(3, {2: "CheckpointError: no weights for layer 2"})  # (an error of its own: named)
    workers[1].exitcode = 1
    with pytest.raises(CheckpointError, match="^stage 2 \\(layer 2\\): no weights"):
        pipe._check_starting("load its layers")


def test_stage_load_error_is_reported_with_its_class(tmp_path):
    from waferline.demo import SOL_DEMO_CONFIG
    from waferline.model.init import write_random_checkpoint

    d = tmp_path / "broken"
    write_random_checkpoint(SOL_DEMO_CONFIG, d)
    f = d / "model.safetensors"
    tensors = load_file(f)
    last = SOL_DEMO_CONFIG["num_hidden_layers"] - 1
    victim = next(k for k in tensors if k.startswith(f"model.layers.{last}."))
    del tensors[victim]
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match="stage 2"):
        LLM(d, stages=3, threads_per_stage=1)


def test_cli_generate_with_stages(ckpts, references, capsys):
    from waferline.cli import main

    ref = references["sol"]
    ids = " ".join(map(str, ref["few"][0]))
    assert main(["generate", "--model", str(ckpts["sol"]), "--prompt-ids", ids, "--max-tokens", "10", "--stages", "2",
                 "--micro-batches", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["token_ids"] == ref["few_out"][0]
    assert (
        main(
            ["generate", "--model", str(ckpts["sol"]), "--prompt-ids", ids, "--stages", "2", "--layers-per-stage", "1"]
        )
        == 2
    )
    assert "not both" in capsys.readouterr().err


def test_torchrun_on_one_host_gives_the_same_tokens_and_exits_cleanly(ckpts, references):
    """docs/pipeline.md's one-host torchrun check: rank 0 prints the single-process engine's tokens, and every rank
    exits 0 (the driver's abort key once ended a worker that the SHUTDOWN had not reached yet: exit 5, and torchrun
    failed the run)."""
    ref = references["sol"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "-m",
           "waferline.cli", "generate", "--model", str(ckpts["sol"]), "--prompt-ids", " ".join(map(str, ref["few"][0])),
           "--max-tokens", "10", "--stages", "3", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"] == ref["few_out"][0]


def test_under_torchrun_each_rank_prepares_the_fused_operators_before_its_first_step(ckpts, tmp_path):
    """Under torchrun every rank builds (or loads) the fused CPU operators up front, announced, before the stages
    connect: none builds them inside its first step, where a build longer than the hang timeout failed a first run
    on a fresh machine as a hung stage. (Here the compiler fails at once, so each rank says so and runs eagerly.)"""
    cxx = tmp_path / "cxx"
    cxx.write_text("#!/bin/sh\nexit 1\n")
    cxx.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CXX=str(cxx), WAFERLINE_KERNELS="1",
               WAFERLINE_KERNELS_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "waferline.cli", "generate", "--model", str(ckpts["deepseek_v3"]), "--prompt-ids", "1 5 9 13",
           "--max-tokens", "8", "--stages", "2", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count(kernels.BUILDING) == 2 and proc.stderr.count("failed") >= 2, proc.stderr[-2000:]
    want = LLM(ckpts["deepseek_v3"]).generate([[1, 5, 9, 13]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"] == want[0].token_ids


@pytest.mark.parametrize("mode", [["--stages", "2"], ["--afd"]])
def test_the_fused_operators_are_built_once_by_the_driver_not_by_each_stage(ckpts, tmp_path, mode):
    """Where the fused CPU operators' build fails (here: a compiler that fails at once), the driver tries it once,
    before it starts the stage processes, and says so once; the stages keep the eager path without trying it again.
    (Each stage built them itself inside its first step: where a build takes longer than the hang timeout, a first
    run on a fresh machine failed as "stage 1 hung", and a build that failed was tried and warned about by every
    stage.)"""
    log = tmp_path / "cxx.log"
    cxx = tmp_path / "cxx"
    cxx.write_text(f"#!/bin/sh\necho $PPID >> {log}\nexit 1\n")
    cxx.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CXX=str(cxx), WAFERLINE_KERNELS="1",
               WAFERLINE_KERNELS_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "waferline.cli", "generate", "--model", str(ckpts["deepseek_v3"]), "--prompt-ids",
           "1 5 9 13", "--max-tokens", "8", "--json", *mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-2000:]
    assert set(log.read_text().split()) == {str(proc.pid)}  # the driver's build only
    assert err.count("fused CPU operators unavailable") == 1, err
    want = LLM(ckpts["deepseek_v3"]).generate([[1, 5, 9, 13]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == want[0].token_ids


CTRL_C_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from waferline import LLM, SamplingParams
llm = LLM(sys.argv[1], stages=3, threads_per_stage=1)
print("ready", *llm._pipeline.pids, flush=True)
llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=900, ignore_eos=True))
print("finished", flush=True)
"""


def test_ctrl_c_shuts_every_stage_down(ckpts):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_SCRIPT, str(ckpts["sol"])], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "ready", proc.stderr.read()
        pids = [int(p) for p in line[1:]]
        threading.Event().wait(0.5)  # let it get into the decode loop
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "finished" not in rest
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert _gone(pids)


def test_link_keeps_a_bounded_number_of_sends_in_flight():
    """gloo's send work says it is complete only once waited on, so a Link that waited only for completed sends kept
    every message's buffer for the process's life (a stage process grew ~12 MB per generation). A sender of many
    messages, small and larger than a slot, now keeps at most MAX_PENDING_SENDS in flight, and the receiver gets every
    one intact, in order."""
    import datetime
    import socket

    import torch
    import torch.distributed as dist

    from waferline.engine.stage import MAX_PENDING_SENDS, SLOT_BYTES, Link, make_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = 3 * MAX_PENDING_SENDS
    sizes = [(i * 37) % 97 + (SLOT_BYTES // 2 if i % 5 == 0 else 0) for i in range(n)]  # floats; every 5th > a slot
    got: list = []
    most: list = [0]
    errors: list = []

    def run(rank: int) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
            link = Link(make_group(store, "t", rank, 2, torch.device("cpu"), True), torch.device("cpu"))
            if rank == 0:
                for i, k in enumerate(sizes):
                    link.send(1, 7, [i, k], [torch.arange(k, dtype=torch.float32) + i])
                    most[0] = max(most[0], len(link._pending))
                link.flush()
            else:
                for _ in sizes:
                    got.append(link.recv(0))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(got) == n
    for i, (kind, meta, body) in enumerate(got):
        k = sizes[i]
        assert kind == 7 and meta == [i, k]
        assert torch.equal(body.view(torch.float32), torch.arange(k, dtype=torch.float32) + i)
    assert 0 < most[0] <= MAX_PENDING_SENDS


def test_a_worker_whose_driver_is_gone_exits_while_it_still_connects():
    """A Ctrl-C that ends the driver while a stage is still connecting (its store's timeout is 30 s) or loading leaves
    nothing behind: the worker watches the driver's pid from its first moment."""
    import socket
    import time

    from waferline.engine.stage import EXIT_PEER_LOST

    with socket.socket() as s:  # a loopback port nothing listens on: the connect retries until its timeout
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code = ("import datetime, sys\nimport torch.distributed as dist\nfrom waferline.engine.stage import worker_start\n"
            "worker_start(int(sys.argv[1]))\nprint('connecting', flush=True)\n"
            f"dist.TCPStore('127.0.0.1', {port}, is_master=False, timeout=datetime.timedelta(seconds=30))\n")
    worker = subprocess.Popen([sys.executable, "-c", code, str(driver.pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "connecting"
        time.sleep(0.5)
        assert worker.poll() is None  # (still connecting while its driver lives)
        driver.kill()
        driver.wait()
        t0 = time.monotonic()
        assert worker.wait(timeout=10) == EXIT_PEER_LOST
        assert time.monotonic() - t0 < 5
    finally:
        for p in (driver, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
