"""Speculative decoding under the pipeline engine: at T = 0 the pipelined speculative output equals the
non-speculative output token for token, for every drafter (n-gram, draft model and MTP, drafting in the scheduler's
process), with 2 stages and with one layer per stage, on mixed-length batches; rejected tokens are rolled back in
every stage's caches (MLA / GQA positions, sliding-window rings, Mamba-2 states); seeded T > 0 runs complete and
repeat."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from waferline import LLM, SamplingParams
from waferline.errors import ConfigError
from waferline.model.init import write_random_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
SOL_MINI = ROOT / "models" / "sol-mini"
LENGTHS = [5, 23, 3, 40, 11]  # mixed prompt lengths; 23 and 40 are prefilled in several chunks
CHUNK = 16
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
LAYOUTS = [dict(stages=2, micro_batches=2), dict(layers_per_stage=1)]  # 2 stages; one layer per stage


def _prompts(vocab: int) -> list[list[int]]:
    ps = [[(i * 7 + j * 3 + 1) % vocab for j in range(n)] for i, n in enumerate(LENGTHS)]
    ps[1] = [7, 8, 9, 10, 11, 12] * 4  # repetitive: the n-gram drafter finds matches
    return ps


def _truncated(src: Path, layers: int, dst: Path) -> Path:
    """A draft model: the checkpoint's first ``layers`` layers with its embeddings, final norm and LM head."""
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, num_nextn_predict_layers=0)
    for key in ("mixer_types", "ffn_types"):
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:layers]
    w = {k: v for k, v in load_file(src / "model.safetensors").items()
         if not (k.split(".")[1:2] == ["layers"] and int(k.split(".")[2]) >= layers)}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _perturbed(src: Path, dst: Path, noise: float = 0.05) -> Path:
    """A draft model: the checkpoint with its matrices perturbed (agrees with the target often, not always)."""
    g = torch.Generator().manual_seed(1)
    w = load_file(src / "model.safetensors")
    out = {k: (v + noise * v.float().std().nan_to_num(0.0) * torch.randn(v.shape, generator=g)).to(v.dtype)
           if v.is_floating_point() and v.dim() == 2 else v for k, v in w.items()}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (checkpoint, draft checkpoint or None, has MTP, greedy reference, prompts)."""
    tmp = tmp_path_factory.mktemp("specpipe")
    out = {}
    if (SOL_MINI / "model.safetensors").is_file():  # Mamba-2 + MLA, MoE, a trained MTP head
        sol = SOL_MINI
    else:
        from waferline.demo import SOL_DEMO_CONFIG

        sol = write_random_checkpoint(dict(SOL_DEMO_CONFIG, num_nextn_predict_layers=1), tmp / "sol")
    out["sol"] = (sol, _truncated(sol, 2, tmp / "sol_draft"), True)
    # DeepSeek-V3 (MLA + MoE) with an MTP module: transformers drops MTP weights, so random ones for the same config
    dsv3 = tmp / "dsv3_hf"
    tiny_models.build("deepseek_v3", dsv3)
    cfg = json.loads((dsv3 / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    d = write_random_checkpoint(cfg, tmp / "dsv3", seed=3)
    out["deepseek_v3"] = (d, _perturbed(d, tmp / "dsv3_draft"), True)
    nh = tmp / "nemotron_h"  # Mamba-2 / MoE / attention / MLP
    tiny_models.build("nemotron_h", nh)
    out["nemotron_h"] = (nh, _perturbed(nh, tmp / "nemotron_h_draft"), False)
    gpt_oss = tmp / "gpt_oss"  # a sliding window of 8 (a ring cache) and sinks
    tiny_models.build("gpt_oss", gpt_oss)
    out["gpt_oss"] = (gpt_oss, None, False)
    refs = {}
    for name, (ck, draft, mtp) in out.items():
        llm = LLM(ck)
        ps = _prompts(llm.spec.vocab_size)
        refs[name] = (ck, draft, mtp, [o.token_ids for o in llm.generate(ps, GREEDY)], ps)
    return refs


class Scripted:
    """A drafter that knows the reference continuation and corrupts one draft per step at a position that
    cycles over 0..k (k: none corrupted): every accepted length and rollback depth occurs in every stage."""

    name = "scripted"

    def __init__(self, ref: list[list[int]], vocab: int):
        self.ref, self.vocab, self.step = ref, vocab, 0

    def begin(self, seqs, hidden):
        pass

    def propose(self, rows, seqs, ks, params, gens):
        from waferline.engine.speculative import Proposal

        self.step += 1
        props = []
        for b, k in zip(rows, ks):
            n = len(seqs[b])
            assert seqs[b] == self.ref[b][:n], "speculative output left the reference"
            d = self.ref[b][n:n + k]
            bad = (self.step + b) % (k + 1)
            if bad < len(d):
                d[bad] = (d[bad] + 1) % self.vocab
            props.append(Proposal(d))
        return props

    def accepted(self, rows, seqs, n_accepted, n_drafted, hidden):
        pass


def _methods(draft, mtp) -> list[str]:
    return ["ngram"] + ([f"draft:{draft}"] if draft else []) + (["mtp"] if mtp else [])


@pytest.mark.parametrize("name", ["sol", "deepseek_v3", "nemotron_h"])
def test_pipelined_speculation_is_exact(models, name):
    ck, draft, mtp, ref, prompts = models[name]
    for layout in LAYOUTS:
        for method in _methods(draft, mtp):
            with LLM(ck, speculative=method, num_speculative_tokens=3, speculative_adaptive=method == "ngram",
                     prefill_chunk=CHUNK, threads_per_stage=1, **layout) as llm:
                where = f"{name} {method} S={llm._pipeline.num_stages}"
                outs = llm.generate(prompts, GREEDY)
                assert [o.token_ids for o in outs] == ref, where
                m = outs[0].metrics
                assert m["spec_verify_steps"] > 0 and m["spec_mean_accepted_length"] >= 1.0, where
                if method != "ngram" or name == "sol":
                    assert m["spec_drafted"] > 0, where


@pytest.mark.parametrize("name", ["sol", "nemotron_h", "gpt_oss"])
def test_every_rollback_depth_in_every_stage(models, name):
    """A scripted drafter makes every verify keep a different prefix (0..K drafts accepted): the Mamba-2 states, the
    sliding-window ring and the positional caches of every stage are rolled back to it, and the output stays exact."""
    ck, _, _, ref, prompts = models[name]
    for layout in LAYOUTS:
        with LLM(ck, speculative="ngram", num_speculative_tokens=4, speculative_adaptive=False, prefill_chunk=CHUNK,
                 threads_per_stage=1, **layout) as llm:
            pipe = llm._pipeline
            llm._spec.drafter = Scripted([p + r for p, r in zip(prompts, ref)], llm.spec.vocab_size)
            outs = llm.generate(prompts, GREEDY)
            assert [o.token_ids for o in outs] == ref, f"{name} S={pipe.num_stages}"
            m = outs[0].metrics
            assert 0.3 < m["spec_acceptance_rate"] < 0.9 and m["spec_mean_accepted_length"] > 1.5
            # the pipeline stays usable: a second run on the same stages is exact too
            assert [o.token_ids for o in llm.generate(prompts[:2], GREEDY)] == [r for r in ref[:2]]


def test_sampled_runs_complete_and_repeat(models):
    """T > 0: the scheduler verifies the last stage's logits with each request's generator (q one-hot for n-grams,
    the draft model's and MTP's q from their drafters); a seed gives the same tokens on every run."""
    ck, draft, _, _, prompts = models["sol"]
    for method in ("ngram", f"draft:{draft}", "mtp"):
        with LLM(ck, speculative=method, num_speculative_tokens=3, stages=2, prefill_chunk=CHUNK,
                 threads_per_stage=1) as llm:
            a = llm.generate(prompts[:3], SAMPLED)
            b = llm.generate(prompts[:3], SAMPLED)
            assert [o.token_ids for o in a] == [o.token_ids for o in b], method
            assert all(len(o.token_ids) == SAMPLED.max_tokens for o in a), method
            assert a[0].metrics["spec_drafted"] > 0, method


def test_stop_token_and_max_tokens_inside_accepted_drafts(models):
    ck, _, _, ref, prompts = models["sol"]
    stop = ref[0][5]
    sp = SamplingParams(max_tokens=12, stop_token_ids=[stop], ignore_eos=True)
    want = LLM(ck).generate(prompts, sp)
    with LLM(ck, speculative="mtp", num_speculative_tokens=4, speculative_adaptive=False, stages=2,
             prefill_chunk=CHUNK, threads_per_stage=1) as llm:
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in want]
        short = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
        assert [o.token_ids for o in short] == [r[:3] for r in ref]


def test_user_errors_under_the_pipeline(models):
    ck, _, _, _, _ = models["nemotron_h"]
    with pytest.raises(ConfigError, match="MTP"):
        LLM(ck, speculative="mtp", stages=2, threads_per_stage=1)
    with pytest.raises(ConfigError, match="unknown speculative"):
        LLM(ck, speculative="medusa", stages=2, threads_per_stage=1)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(ck, speculative="ngram", num_speculative_tokens=0, stages=2, threads_per_stage=1)


def test_serve_refuses_speculative_with_the_reason(models):
    from waferline.server.commands import build_server

    ck = models["sol"][0]
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        build_server(ck, speculative="draft:/x", stages=2)
    with pytest.raises(ConfigError, match="unknown method"):
        build_server(ck, speculative="medusa")


def test_demo_reports_acceptance(tmp_path, monkeypatch, capsys):
    """`waferline demo --speculative mtp` runs the pipeline with MTP drafting (a random sol with an MTP head) and
    reports acceptance and mean accepted length (the planner's part of the demo is stubbed: not under test here)."""
    import waferline.demo as demo
    from waferline.cli import build_parser

    cfg = dict(demo.SOL_DEMO_CONFIG, num_nextn_predict_layers=1, eos_token_id=None)  # random weights: never stop early
    ck = write_random_checkpoint(cfg, tmp_path / "sol_mtp")
    demo.write_tokenizer(ck, demo.DEMO_TEXT, demo.SOL_DEMO_CONFIG["vocab_size"])
    monkeypatch.setattr(demo, "planner_headline", lambda: {
        "wafers_4bit": 1, "wafers_16bit": 1, "tok_s_per_user": 1.0, "tok_s_per_user_mtp": 1.0, "ttft_s": 0.1,
        "nvl72_gpus": 1, "nvl72_tok_s_per_user": 1.0, "memory_per_wafer_gb": [], "sweep": []})
    args = build_parser().parse_args(["demo", "--model", str(ck), "--max-tokens", "16", "--layers-per-stage", "3",
                                      "--weight-bits", "16", "--speculative", "mtp", "--num-speculative-tokens", "2",
                                      "--no-report", "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    out = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert out["speculative"] == "mtp" and len(out["token_ids"]) == 16
    assert out["spec_verify_steps"] > 0 and 0.0 <= out["spec_acceptance_rate"] <= 1.0
    assert out["spec_mean_accepted_length"] >= 1.0
    assert "mean accepted length" in capsys.readouterr().out


def test_wire_format_round_trips():
    """A micro-batch with a verify group (drafts), a group carrying its token ids, and rewinds survives
    encode/decode; the feedback carries a variable number of tokens per row."""
    from waferline.engine.stage import EMIT_NONE, EMIT_TOKEN, Group, MicroBatch, decode_feedback

    pre = Group(3, [4], [4], [0], [EMIT_NONE], tokens=[7, 8, 9])
    ver = Group(4, [0, 2], [0, 2], [10, 5], [EMIT_TOKEN] * 2, drafts=[[5, 6, 7], []])
    mb = MicroBatch(9, [pre, ver], rewinds=[(0, 2), (3, 1)])
    back = MicroBatch.decode(mb.encode())
    assert back == mb and back.groups[1].verify and not back.groups[0].verify
    meta = [9, 2, 4, 0] + [0, 2] + [3, 1] + [5, 6, 1, 4]
    mb_id, toks, lps = decode_feedback(meta, torch.empty(0, dtype=torch.uint8), 16)
    assert (mb_id, toks, lps) == (9, {0: [5, 6, 1], 2: [4]}, {})


def _served_mtp(llm, prompts, sp):
    """The tokens the server's scheduler gives ``prompts`` over ``llm`` with MTP speculation (no prefix cache)."""
    from waferline.engine.scheduler import Scheduler, SchedulerConfig
    from waferline.engine.sequence import Sequence

    sch = Scheduler(llm, SchedulerConfig(max_num_seqs=len(prompts), speculative="mtp", prefix_caching=False))
    seqs = [Sequence(str(i), p, sp, stream_text=False) for i, p in enumerate(prompts)]
    for s in seqs:
        sch.add(s)
    while sch.has_work():
        sch.step()
    return [s.output_ids for s in seqs]


def test_int4_mtp_drafts_as_the_single_process_engine(tmp_path):
    """An int4 checkpoint keeps its MTP head 16-bit; ``LLM(path, speculative="mtp")`` drafts with it in int4, as its
    target is. A seeded sampled draft samples from the head's probabilities, so the pipeline's drafter and the
    served single-process engine's must be int4 too for the same tokens."""
    ck = tiny_models.int4_sol_with_mtp(tmp_path)
    prompts = [[7, 8, 9, 10, 11, 12] * 3, list(range(40, 60))]
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    with LLM(ck, speculative="mtp") as llm:
        ref = [o.token_ids for o in llm.generate(prompts, sp)]
    with LLM(ck, speculative="mtp", stages=2, threads_per_stage=1) as llm:
        assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
    served = LLM(ck, group_size=64)  # (the head at the checkpoint's 32, not the option's group size: a pipeline's
    assert _served_mtp(served, prompts, sp) == ref  # drafter takes the checkpoint's, and the two drafted apart)
    assert {m.group_size for m in served.model.mtp.modules() if hasattr(m, "group_size")} == {32}


def test_int4_group_size_is_read_from_every_int4_format():
    from waferline.model.quant import int4_group_size

    assert int4_group_size({"quantization_config": {"quant_method": "waferline", "bits": 4, "group_size": 64}}) == 64
    assert int4_group_size({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}) == 32
    assert int4_group_size({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1}}) == 128
    ct = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"group_size": 256}}}}
    assert int4_group_size({"text_config": {"quantization_config": ct}}) == 256
    assert int4_group_size({}) == 128


def test_a_served_int4_on_load_mtp_drafts_at_the_llms_group_size(tmp_path):
    """A 16-bit checkpoint quantized on load (weight_bits=4, group_size=32): the server's scheduler drafts with the MTP
    head at that group size, as ``LLM(..., speculative="mtp")`` does, so a seeded sampled request gets the same tokens
    (the scheduler quantized the head at the default 128 groups: `serve --weight-bits 4 --group-size 32` drafted
    otherwise than `generate` with the same flags)."""
    from waferline.demo import SOL_DEMO_CONFIG

    cfg = dict(SOL_DEMO_CONFIG, num_hidden_layers=2, mixer_types=["mla", "mla"], ffn_types=["dense", "moe"],
               num_nextn_predict_layers=1)
    ck = write_random_checkpoint(cfg, tmp_path / "fp32")
    prompts = [[7, 8, 9, 10, 11, 12] * 3, list(range(40, 60))]
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    with LLM(ck, speculative="mtp", weight_bits=4, group_size=32) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, sp)]
    served = LLM(ck, weight_bits=4, group_size=32)
    assert _served_mtp(served, prompts, sp) == ref
    assert {m.group_size for m in served.model.mtp.modules() if hasattr(m, "group_size")} == {32}
