"""The planner/simulator CLI on bad or inconsistent input: one-line errors, never a traceback, a silent default or a
plan reported as fitting a workload it cannot hold."""

import json

import pytest

from waferline.cli import main as cli_main
from waferline.errors import ConfigError
from waferline.plan import commands
from waferline.plan.place import place
from waferline.sim.serving import simulate_serving
from waferline.spec.catalog import load_hardware, load_model
from waferline.spec.configs import parse_hf_config

QWEN3_MOE_TINY = dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096)
HEADER = "id,system,model,hardware,num_chips,weight_bits,spec_decoding,concurrency,input_len,output_len,metric,value\n"


@pytest.fixture
def plan_file(tmp_path, capsys):
    p = tmp_path / "p8b.json"
    assert commands.main(["plan", "llama-3.1-8b", "--hardware", "h100-sxm", "--out", str(p), "--json"]) == 0
    capsys.readouterr()
    return p


def _run(capsys, argv):
    rc = cli_main(argv)
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_simulate_refuses_a_workload_the_memory_was_not_sized_for(plan_file, capsys):
    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--context", "100",
                            "--prompt-len", "100000"])
    assert rc == 2 and "--context 100 is shorter than prompt + output (100,500)" in out
    rc, out = _run(capsys, ["simulate", "--plan", str(plan_file), "--concurrency", "1000", "--prompt-len", "100000"])
    assert rc == 2 and "the plan holds 1 sequence(s) of 4,096 tokens" in out and "1000 of 100,500" in out
    rc, out = _run(capsys, ["simulate", "--plan", str(plan_file), "--devices", "2", "--batch", "4"])
    assert rc == 2 and "drop --devices, --batch" in out
    rc, out = _run(capsys, ["simulate", "llama-3.1-70b", "--plan", str(plan_file)])
    assert rc == 2 and "the plan places llama-3.1-8b on h100-sxm; MODEL llama-3.1-70b" in out
    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "--hardware", "h200-sxm", "--plan", str(plan_file)])
    assert rc == 2 and "--hardware h200-sxm says otherwise" in out
    # the plan's own model and hardware named again, and a workload it holds: simulated
    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--plan", str(plan_file),
                            "--prompt-len", "3000", "--json", "--no-intervals"])
    assert rc == 0 and json.loads(out)["decode_tokens_per_s_per_user"] > 0


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["stages"][0].update(layers=[]), "layers must be a non-empty list"),
    (lambda d: d["stages"][0].update(layers=[500]), "layer 500 does not exist"),
    (lambda d: d["stages"][0].update(layers=["x"]), "layers must be a non-empty list of integers"),
    (lambda d: d.update(stages=[]), "a plan needs at least one stage"),
    (lambda d: d.update(stages=["a"]), "a stage must be an object"),
    (lambda d: d.update(kv_bits="x"), "kv_bits must be 4, 8, 16 or 32"),
    (lambda d: d.update(context_len=-1), "context_len must be an integer >= 1"),
    (lambda d: d["stages"][0].update(layers=[0, 1, 2]), "missing [3, 4"),
    (lambda d: d["stages"][0].update(layers=[0, 0, *range(2, 32)]), "[0] placed other than 1x"),
    (lambda d: d["stages"][0].update(device="nosuch"), "plan stages are on nosuch, not on h100-sxm"),
    (lambda d: d["stages"][0]["memory"].update(capacity="big"), "memory capacity must be a number >= 0"),
    # two stages on one device: each fitted alone (both halves of a model on one GPU were said to fit)
    (lambda d: d["stages"].append({**d["stages"][0], "index": 1, "layers": d["stages"][0]["layers"][16:]})
     or d["stages"][0].update(layers=d["stages"][0]["layers"][:16]), "plan stages 0 and 1 both use device 0"),
    (lambda d: d.update(speculative={"method": "mtp", "num_tokens": 1000}), "num speculative tokens must be 0-32"),
    # a hand-edited value of the wrong type: refused, not read as something else (a traceback, "no" as true, a
    # fractional draft count simulated, the sequential plan timed as attention/FFN ranks without their hops)
    (lambda d: d.update(notes=5), "plan notes must be a list of strings, got 5"),
    (lambda d: d.update(problems="none"), "plan problems must be a list of strings"),
    (lambda d: d.update(afd="no"), "plan afd must be true or false, got 'no'"),
    (lambda d: d.update(fits="yes"), "plan fits must be true or false"),
    (lambda d: d["stages"][0].update(has_lm_head="no"), "stage 0: has_lm_head must be true or false"),
    (lambda d: d["stages"][0].update(index="first"), "stage index must be an integer >= 0, got 'first'"),
    (lambda d: d["stages"][0].update(weight_bits=3), "stage 0: weight_bits must be 4, 8, 16 or 32, got 3"),
    (lambda d: d.update(weight_bits=8.0), "weight_bits must be 4, 8, 16 or 32, got 8.0"),
    (lambda d: d.update(speculative={"method": "mtp", "num_tokens": 2.5}),
     "num speculative tokens must be 0-32, got 2.5"),
    (lambda d: d.update(speculative={"method": "mtp", "num_tokens": 3, "accept_rate": "0.8"}),
     "accept rate must be in [0, 1), got '0.8'"),
    (lambda d: d.update(afd=True), "plan afd is true but stage(s) [0] are 'full' stages"),
    (lambda d: d["stages"][0].update(role="attention"), "plan afd is false but it has attention/FFN stages"),
    (lambda d: d.update(version="1"), "plan version '1' is not supported"),
])
def test_a_plan_file_that_does_not_place_the_model_is_refused(plan_file, capsys, edit, message):
    d = json.loads(plan_file.read_text())
    edit(d)
    plan_file.write_text(json.dumps(d))
    rc, out = _run(capsys, ["simulate", "--plan", str(plan_file)])
    assert rc == 2 and out.startswith("error: ") and message in out and "Traceback" not in out


@pytest.mark.parametrize("data, message", [
    (b"null", "malformed plan: expected a JSON object, got NoneType"),
    (b'"plan"', "malformed plan: expected a JSON object, got str"),
    (b"\xff\xfe\x00{}", "is not a JSON text file (not UTF-8)"),
    (b'{"batch": ' + b"9" * 5000 + b"}", "plan is not valid JSON: a number with too many digits"),
    (b"[" * 100_000 + b"]" * 100_000, "plan is not valid JSON: nested deeper than Python decodes"),
])
def test_a_plan_file_that_is_no_plan_object_is_refused_in_one_line(plan_file, capsys, data, message):
    plan_file.write_bytes(data)
    rc, out = _run(capsys, ["simulate", "--plan", str(plan_file)])
    assert rc == 2 and out.startswith("error: ") and message in out and "Traceback" not in out


def test_a_plan_file_is_judged_on_its_memory_as_recomputed_not_what_it_says(plan_file, capsys):
    d = json.loads(plan_file.read_text())
    d["stages"][0]["memory"]["capacity"] = 1.0  # (fits: true left as written; the device holds what the catalog says)
    plan_file.write_text(json.dumps(d))
    rc, out = _run(capsys, ["simulate", "--plan", str(plan_file), "--no-intervals"])
    assert rc == 0 and "does not fit" not in out
    # placed on too few devices (fits: false, and why), then edited to weights that fit: the stale reason was printed
    # under the recomputed memory that fits, and the JSON said fits: false
    assert cli_main(["plan", "llama-3.1-70b", "--hardware", "h100-sxm", "--devices", "1", "--out",
                     str(plan_file), "--json"]) == 2
    capsys.readouterr()
    d = json.loads(plan_file.read_text())
    assert not d["fits"] and d["problems"]
    d["weight_bits"] = 4
    plan_file.write_text(json.dumps(d))
    rc, out = _run(capsys, ["simulate", "--plan", str(plan_file), "--no-intervals", "--json"])
    assert rc == 0 and json.loads(out)["fits"] and json.loads(out)["problems"] == []
    d["stages"][0]["device_ids"] = [0]  # (and back to weights that do not fit: why, from the recomputed memory)
    d["weight_bits"] = 16
    d["fits"], d["problems"] = True, []
    plan_file.write_text(json.dumps(d))
    rc, out = _run(capsys, ["simulate", "--plan", str(plan_file), "--no-intervals", "--json"])
    r = json.loads(out)
    assert rc == 2 and not r["fits"] and r["problems"] == place("llama-3.1-70b", "h100-sxm", devices=1).problems


def test_out_writes_the_plan_whole_or_says_why_not(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc, _ = _run(capsys, ["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--out", str(out), "--no-intervals"])
    assert rc == 0 and json.loads(out.read_text())["model"] == "llama-3.1-8b"
    # (under a file: named as such, before placing, not by the errno of making it a directory, 'File exists')
    for bad, why in ((out / "p.json", f"{out} is not a directory"), (tmp_path, "is a directory")):
        rc, text = _run(capsys, ["plan", "llama-3.1-8b", "--hardware", "h100-sxm", "--out", str(bad)])
        lines = text.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: --out {bad}: {why}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sim.json"]  # (no temporary file left behind)


def test_simulate_that_fails_leaves_its_out_file_as_it_was(tmp_path, capsys):
    hw = tmp_path / "nolink.yaml"  # (no link between devices: the simulation of a 2-device plan fails, not placing it)
    hw.write_text("name: nolink\nkind: asic\ndevice:\n  memory_bytes: 2.0e10\n  memory_bandwidth: 1.0e13\n"
                  "  flops: {bf16: 2.0e15}\n")
    out = tmp_path / "p.json"
    out.write_text("kept")
    rc, text = _run(capsys, ["simulate", "llama-3.1-70b", "--hardware", str(hw), "--out", str(out), "--no-intervals"])
    assert rc == 2 and "has no link" in text and out.read_text() == "kept"
    rc, text = _run(capsys, ["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--out", str(tmp_path),
                             "--arrival-rate", "1", "--num-requests", "5"])  # (refused before the simulation runs)
    assert rc == 2 and text.startswith(f"error: --out {tmp_path}: is a directory")


@pytest.mark.parametrize("argv, message", [
    (["plan", "llama-3.1-8b", "-H", "h100-sxm", "--batch", "0"], "--batch: expected an integer >= 1, got 0"),
    (["plan", "llama-3.1-8b", "-H", "h100-sxm", "--context", "0"], "--context: expected an integer >= 1, got 0"),
    (["plan", "llama-3.1-8b", "-H", "h100-sxm", "--micro-batches", "-2"], "expected an integer >= 1, got -2"),
    (["simulate", "llama-3.1-8b", "-H", "h100-sxm", "--prompt-len", "0"], "--prompt-len: expected an integer >= 1"),
    (["simulate", "llama-3.1-8b", "-H", "h100-sxm", "--speculative", "eagle", "--num-speculative-tokens", "0"],
     "--num-speculative-tokens: expected an integer from 1 to 32, got 0"),
    # bounded above: k = 100,000 predicted 0.6 tok/s; 10^8 requests ran for minutes
    (["simulate", "llama-3.1-8b", "-H", "h100-sxm", "--speculative", "ngram", "--num-speculative-tokens", "100000"],
     "--num-speculative-tokens: expected an integer from 1 to 32, got 100,000"),
    (["simulate", "llama-3.1-8b", "-H", "h100-sxm", "--closed-loop", "--num-requests", "100000000"],
     "--num-requests: expected an integer from 1 to 10,000,000, got 100,000,000: the serving simulation's time"),
    (["simulate", "llama-3.1-8b", "-H", "h100-sxm", "--reasoning-tokens", "-1"],
     "--reasoning-tokens: expected an integer >= 0, got -1"),
    # device counts bounded above: 10^12 wafers listed their ids until MemoryError; 10^12 attention ranks never ended
    (["plan", "qwen3-30b-a3b", "-H", "wse-3", "--devices", "1000000000000"],
     "--devices: expected an integer from 1 to 100,000, got 1,000,000,000,000"),
    (["simulate", "gpt-oss-120b", "-H", "h200-sxm", "--afd", "--attention-ranks", "1000000000000"],
     "--attention-ranks: expected an integer from 1 to 100,000"),
    (["simulate", "gpt-oss-120b", "-H", "h200-sxm", "--afd", "--ffn-ranks", "100001"],
     "--ffn-ranks: expected an integer from 1 to 100,000"),
    (["simulate", "qwen3-30b-a3b", "-H", "wse-3", "--arrival-rate", "5", "--prefill-devices", "1000000000000"],
     "--prefill-devices: expected an integer from 1 to 100,000"),
])
def test_counts_out_of_range_are_refused_not_replaced_by_defaults(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_micro_batches_and_idle_devices():
    with pytest.raises(ConfigError, match="--micro-batches must be >= 1"):
        place("llama-3.1-8b", "h100-sxm", batch=4, micro_batches=0)
    plan = place("llama-3.1-8b", "wse-3", devices=5, layers_per_stage=8)
    assert plan.num_devices == 4 and any("1 of 5 devices left idle" in n for n in plan.notes)
    for hw in ("wse-3", "h100-sxm"):  # (fewer devices than stages: refused on both layouts, not a plan of more)
        with pytest.raises(ConfigError, match="1 devices cannot hold 2 stages of at most 24 layers"):
            place("llama-3.1-8b", hw, devices=1, layers_per_stage=24)


def test_device_counts_past_the_planners_limit(tmp_path):
    from waferline.plan.place import MAX_DEVICES
    from waferline.sim.validate import validate

    for kw in ({"devices": 10**12}, {"afd": True, "attention_ranks": 10**12}, {"afd": True, "ffn_ranks": 10**12}):
        with pytest.raises(ConfigError, match="must be from 1 to 100,000, got 1,000,000,000,000"):
            place("qwen3-30b-a3b", "wse-3", **kw)
    p = tmp_path / "r.csv"  # (a CSV row's chip count: skipped with the reason, not a MemoryError)
    p.write_text(HEADER + "a,x,llama-3.1-8b,wse-3,1000000000000,16,none,1,,,decode_tokens_per_s_per_user,1800\n"
                 "b,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,150\n")
    results, _ = validate(p)
    assert results[0].predicted is None and "--devices must be from 1 to 100,000" in results[0].skipped
    # a cache no device count holds: each stage is given at most the limit, not its bytes over a device's (10^12
    # tokens of context on 0.23 GB chips listed ~10^9 device ids and ran out of memory)
    plan = place("llama-3.2-1b", "groq-lpu-v1", context=3 * 10**10)
    assert not plan.fits and max(s.num_devices for s in plan.stages) == MAX_DEVICES


def test_a_speculative_method_given_with_a_plan_replaces_the_plans_drafter_note(tmp_path, capsys):
    eagle, plain = tmp_path / "eagle.json", tmp_path / "plain.json"
    for p, extra in ((eagle, ["--speculative", "eagle"]), (plain, [])):
        rc, _ = _run(capsys, ["simulate", "llama-3.1-70b", "-H", "h100-sxm", *extra, "--out", str(p), "--json",
                              "--no-intervals"])
        assert rc == 0

    def drafter_notes(argv):
        rc, out = _run(capsys, ["simulate", *argv, "--json", "--no-intervals"])
        assert rc == 0
        return [n for n in json.loads(out)["notes"] if "sits with the LM head" in n]

    assert drafter_notes(["--plan", str(eagle)]) == ["the one-layer draft head and its cache (2.51 GB) sits with the "
                                                     "LM head"]
    assert drafter_notes(["--plan", str(eagle), "--speculative", "none"]) == []  # (no drafter simulated, none noted)
    assert drafter_notes(["--plan", str(eagle), "--speculative", "mtp"]) == ["the one-layer draft head and its cache "
                                                                             "(1.99 GB) sits with the LM head"]
    assert len(drafter_notes(["--plan", str(plain), "--speculative", "eagle"])) == 1


def test_the_micro_batches_default_is_the_one_help_states():
    from waferline.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["plan"]
    text = next(a.help for a in sub._actions if a.dest == "micro_batches")
    assert "default min(batch, stages); with --attention-ranks/--ffn-ranks: 2" in text
    assert place("llama-3.1-8b", "h100-sxm", batch=8, devices=16, layers_per_stage=8).micro_batches == 4
    assert place("qwen3-30b-a3b", "h100-sxm", batch=8, afd=True, attention_ranks=4, ffn_ranks=4).micro_batches == 2


def test_validate_refuses_values_that_are_not_results_and_skips_rows_that_do_not_fit(tmp_path):
    from waferline.sim.validate import read_published, validate

    p = tmp_path / "r.csv"
    for value, message in (("0", "finite number > 0"), ("-5", "finite number > 0"), ("nan", "finite number > 0"),
                           ("abc", "is not a number")):
        p.write_text(HEADER + f"a,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,{value}\n")
        with pytest.raises(ConfigError, match=message):
            read_published(p)
    p.write_text(HEADER + "a,x,llama-3.1-8b,h100-sxm,1\n")
    with pytest.raises(ConfigError, match="row 1 has no metric, value"):
        read_published(p)
    p.write_text(HEADER + "a,x,llama-3.1-405b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,5\n"
                 "b,x,llama-3.1-8b,h100-sxm,1,16,none,1,,,decode_tokens_per_s_per_user,150\n")
    results, summary = validate(p)
    assert results[0].predicted is None and results[0].skipped.startswith("does not fit on 1 x h100-sxm")
    assert summary["predicted"] == 1 and summary["beyond_ceiling"] == {}


def test_a_closed_loop_needs_more_requests_than_clients():
    plan = place("llama-3.1-8b", "h100-sxm", batch=4)
    with pytest.raises(ConfigError, match="needs more than 4 requests"):
        simulate_serving(plan, users=4, num_requests=3)


@pytest.mark.parametrize("text, message", [
    ("a: [1\n", "not valid YAML"),
    ("- 1\n", "not simulator parameters"),
    ("x: 1\n", "not simulator parameters"),
    ("ttft_overhead_s: -5\n", "outside [0, 2] s"),
    ("speculative:\n  accept_rate:\n    eagle: 1.5\n", "not a probability"),
    # (a negative or zero draft length was taken: k=-3 predicted 1 token a step at a negative drafting cost)
    ("speculative:\n  num_tokens:\n    mtp: -3\n", "not a whole number of drafted tokens in [1, 32]"),
    ("speculative:\n  num_tokens:\n    mtp: 0\n", "not a whole number of drafted tokens in [1, 32]"),
    ("speculative:\n  num_tokens:\n    mtp: 2.5\n", "not a whole number of drafted tokens in [1, 32]"),
    ("speculative:\n  num_tokens:\n    mtp: .inf\n", "not a whole number of drafted tokens in [1, 32]"),
])
def test_a_parameter_file_out_of_its_physical_range_is_refused(tmp_path, text, message):
    from waferline.sim.cost import load_params

    p = tmp_path / "params.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_params(p)


def test_a_parameter_file_that_is_not_text_is_one_line(tmp_path, capsys):
    """A --params file that is not UTF-8 (a binary given by mistake) is a one-line error, not a traceback."""
    p = tmp_path / "params.yaml"
    p.write_bytes(b"\xff\xfe\x00 not yaml")
    for argv in (["validate", "--params", str(p), "--json"],
                 ["simulate", "llama-3.1-8b", "-H", "h100-sxm", "--params", str(p), "--json"]):
        assert cli_main(argv) == 2
        cap = capsys.readouterr()
        assert cap.out == "" and cap.err.count("\n") == 1, cap.err
        assert cap.err.startswith(f"error: {p}: cannot read simulator parameters")


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1"),
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1"),
    ({"hidden_size": "big"}, "hidden_size must be an integer >= 1"),
    ({"hidden_size": -4096}, "hidden_size must be an integer >= 1"),
    ({"num_hidden_layers": None}, "num_hidden_layers must be an integer >= 1, got null"),
    ({"model_type": ["llama"]}, r"model_type must be a string such as 'llama', got \['llama'\]"),
    ({"model_type": {}}, "model_type must be a string such as 'llama', got {}"),
])
def test_a_config_that_describes_no_model_is_refused(change, message):
    base = {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 8, "intermediate_size": 1024, "vocab_size": 1000}
    assert parse_hf_config(base).params_total() > 0
    with pytest.raises(ConfigError, match=message):
        parse_hf_config({**base, **change})
    with pytest.raises(ConfigError, match="one JSON object, got a list"):
        parse_hf_config([1, 2])


def test_an_unfitted_acceptance_is_labelled_assumed(capsys):
    rc, out = _run(capsys, ["simulate", "deepseek-v3", "--hardware", "h200-sxm", "--weight-bits", "8",
                            "--speculative", "mtp", "--json", "--no-intervals"])
    assert rc == 0 and json.loads(out)["speculative"]["accept_rate_source"] == "assumed default"
    rc, out = _run(capsys, ["simulate", "llama-3.1-70b", "--hardware", "h200-sxm", "--devices", "8",
                            "--weight-bits", "8", "--speculative", "medusa", "--json", "--no-intervals"])
    assert rc == 0 and json.loads(out)["speculative"]["accept_rate_source"] == "assumed default"  # (rows: stated)
    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--speculative", "eagle", "--json",
                            "--no-intervals"])
    assert rc == 0 and json.loads(out)["speculative"]["accept_rate_source"] == "fitted"


def test_a_context_past_the_models_positions_is_noted(capsys):
    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--prompt-len", "200000",
                            "--no-intervals", "--json"])
    assert rc == 0 and "past the model's 131,072 positions" in json.loads(out)["notes"][0]
    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "--hardware", "h100-sxm", "--no-intervals", "--json"])
    assert rc == 0 and json.loads(out)["notes"] == []
    rc, out = _run(capsys, ["plan", "llama-3.1-8b", "--hardware", "h100-sxm"])
    assert rc == 0 and "the model itself takes at most 131,072 positions" in " ".join(out.split())


def test_simulate_reports_the_plans_notes_and_a_link_latency_the_fit_replaces(capsys, tmp_path):
    # the plan's notes (devices left idle) were dropped by simulate, text and --json
    rc, out = _run(capsys, ["simulate", "gpt-5.6-sol", "-H", "wse-3", "--weight-bits", "4", "--devices", "200",
                            "--no-intervals", "--json"])
    assert rc == 0 and json.loads(out)["notes"] == ["40 of 200 devices left idle: 80 layers cannot use them evenly"]
    rc, out = _run(capsys, ["simulate", "gpt-5.6-sol", "-H", "wse-3", "--weight-bits", "4", "--devices", "200",
                            "--no-intervals"])
    assert rc == 0 and "note: 40 of 200 devices left idle" in out
    # a user's wafer: its scale_out latency is not what a hop costs (the class's fitted hop latency is): said so
    hw = tmp_path / "mine.yaml"
    hw.write_text("name: mine\nkind: wafer\ndevice: {memory_bytes: 44e9, memory_bandwidth: 21e15, flops: {bf16: "
                  "125e15}, cores: 900000}\nlinks: {scale_out: {bandwidth: 150e9, latency: 5e-6}, on_chip: "
                  "wse3-mesh}\n")
    rc, out = _run(capsys, ["simulate", "gpt-5.6-sol", "-H", str(hw), "--weight-bits", "4", "--devices", "80",
                            "--no-intervals", "--json"])
    notes = json.loads(out)["notes"]
    assert rc == 0 and len(notes) == 2 and "not mine.yaml's scale_out latency of 5 us" in notes[0]
    assert "classes.wafer.hop_latency_s" in notes[0] and notes[1].startswith("mine is extrapolated")
    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "-H", str(hw), "--no-intervals", "--json"])
    assert rc == 0 and json.loads(out)["notes"] == [notes[1]]  # (one wafer: no hop)


def test_a_partial_parameter_file_says_what_it_leaves_to_the_priors(capsys, tmp_path):
    # (a file with only ttft_overhead_s moved llama-3.1-8b on an H100 from 194 to 157 tok/s without a word, an unknown
    # class name was taken silently, and the intervals vanished)
    p = tmp_path / "p.yaml"
    p.write_text("classes:\n  gpux: {bw_eff: 0.5}\n  gpu: {bw_eff: 0.6}\n")
    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "-H", "h100-sxm", "--params", str(p), "--json"])
    notes = json.loads(out)["notes"]
    assert rc == 0 and len(notes) == 3
    assert notes[0].startswith("p.yaml leaves 2 of the shipped fit's fitted parameters for this hardware at their "
                               "priors: gpu.layer_latency_s, ttft_overhead_s")
    assert notes[1].startswith("p.yaml: class(es) gpux name no device kind") and notes[2].startswith("no intervals")
    rc, out = _run(capsys, ["simulate", "gpt-5.6-sol", "-H", "wse-3", "--weight-bits", "4", "--params", str(p),
                            "--no-intervals", "--json"])
    notes = json.loads(out)["notes"]
    assert notes[0] == "p.yaml has no parameters for wafer devices: wse-3 is simulated with the gpu class's parameters"
    assert not any(n.startswith("no intervals") for n in notes)  # (none were asked for)
    from waferline.sim.cost import FITTED_PATH

    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "-H", "h100-sxm", "--params", str(FITTED_PATH), "--json"])
    assert rc == 0 and json.loads(out)["notes"] == []  # (the shipped fit itself: nothing left out)


@pytest.mark.parametrize("model, kw", [
    ("deepseek-v3", {}), ("deepseek-v3", {"afd": True}),
    ("deepseek-v3", {"afd": True, "attention_ranks": 2, "ffn_ranks": 3, "batch": 4}),
    ("qwen3-next-80b-a3b", {"afd": True, "attention_ranks": 2, "ffn_ranks": 2, "batch": 4}),
    ("gpt-5.6-sol", {"devices": 80}),
])
def test_every_placement_passes_its_own_plan_check(model, kw):
    """What the planner writes, read back, is a plan of its model: data-parallel attention ranks hold every layer's
    mixer once each and FFN ranks every layer's expert shard, so a layer appears once per rank."""
    from waferline.plan.plan import Plan
    from waferline.spec.catalog import load_hardware, load_model

    for hw in ("h200-sxm", "wse-3"):
        plan = place(model, hw, weight_bits=4, **kw)
        back = Plan.from_json(plan.to_json())
        back.check(load_model(back.model), load_hardware(back.hardware))
        assert back.fits == plan.fits


def test_catalog_lists_the_ids_plan_takes_and_info_reads_them(capsys):
    from waferline.spec.catalog import list_hardware, list_models

    rc, out = _run(capsys, ["catalog", "--json"])
    d = json.loads(out)
    assert rc == 0 and [m["id"] for m in d["models"]] == list_models() and len(d["models"]) >= 30
    assert [h["id"] for h in d["hardware"]] == list_hardware()
    sol = next(m for m in d["models"] if m["id"] == "gpt-5.6-sol")
    assert 2.8e12 < sol["params_total"] < 3.1e12 and 1.4e11 < sol["params_active"] < 1.6e11
    hw = {h["id"]: h for h in d["hardware"]}
    assert "flops.bf16" in hw["h800"]["assumed"]  # (not published: the catalog says so)
    assert "memory_bandwidth" not in hw["sn40l"]["assumed"]  # (published: 1.6 TB/s per socket, its source beside it)
    rc, out = _run(capsys, ["catalog", "hardware"])
    assert rc == 0 and "wse-3" in out and "gpt-5.6-sol" not in out
    rc, out = _run(capsys, ["info", "kimi-k2.6", "--json"])
    assert rc == 0 and json.loads(out)["layers"] == 61


def test_a_checkpoint_path_is_never_read_as_a_catalog_id(tmp_path, capsys):
    """An absolute checkpoint path with a <path>.json beside it (say, a saved --json output) is the checkpoint, not
    the catalog model of that name: pathlib's join used to drop the catalog directory and read the neighbour."""
    from waferline.spec.catalog import MODELS_DIR, load_model

    ckpt = tmp_path / "mine"
    ckpt.mkdir()
    base = {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 8, "intermediate_size": 1024, "vocab_size": 1000}
    (ckpt / "config.json").write_text(json.dumps(base))
    (tmp_path / "mine.json").write_text((MODELS_DIR / "deepseek-v3.json").read_text())
    assert load_model(str(ckpt)).num_layers == 2 and load_model(ckpt).model_type == "llama"
    rc, out = _run(capsys, ["info", str(ckpt), "--json"])
    assert rc == 0 and json.loads(out)["layers"] == 2
    assert load_model("deepseek-v3").num_layers == 61  # (a bare id still reads the catalog)


def test_reasoning_tokens_are_decoded_before_the_answer(capsys):
    """--reasoning-tokens: hidden tokens decoded like any output before the answer; the end-to-end time is that of
    reasoning + answer tokens generated, the first answer token comes that many decode steps after TTFT, and the
    memory is sized for prompt + reasoning + output."""
    from waferline.sim.pipeline import simulate

    plan = place(load_model("llama-3.1-8b"), load_hardware("h100-sxm"), context=1000 + 3000 + 500)
    r = simulate(plan, prompt_len=1000, output_len=500, reasoning_tokens=3000)
    whole = simulate(plan, prompt_len=1000, output_len=3500)
    assert r.output_len == 500 and r.reasoning_tokens == 3000
    assert r.end_to_end_s == pytest.approx(whole.end_to_end_s) and r.ttft_s == pytest.approx(whole.ttft_s)
    assert r.first_answer_s == pytest.approx(r.ttft_s + 3000 / r.decode_tokens_per_s_per_user)
    assert simulate(plan, prompt_len=1000, output_len=500).first_answer_s == pytest.approx(r.ttft_s)
    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "-H", "h100-sxm", "--prompt-len", "1000", "--output-len", "500",
                            "--reasoning-tokens", "3000", "--json"])
    d = json.loads(out)
    assert rc == 0 and d["plan"]["context_len"] == 4500 and d["reasoning_tokens"] == 3000
    lo, hi = d["first_answer_s_interval"]
    assert lo <= d["first_answer_s"] <= hi and d["first_answer_s"] < d["end_to_end_s"]
    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "-H", "h100-sxm", "--reasoning-tokens", "3000",
                            "--no-intervals"])
    assert rc == 0 and "first answer token, after 3,000 reasoning tokens" in " ".join(out.split())
    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "-H", "h100-sxm", "--prompt-len", "1000", "--output-len",
                            "500", "--reasoning-tokens", "3000", "--context", "2000"])
    assert rc == 2 and "shorter than prompt + reasoning + output (4,500)" in out


def test_a_path_that_is_not_there_is_said_to_be_missing(capsys):
    """A path given for a model or hardware that does not exist is named as missing (it got the catalog's ids)."""
    from waferline.cli import main

    assert main(["plan", "gpt-5.6-sol", "--hardware", "nosuch.yaml"]) == 2
    assert "no such hardware YAML file: nosuch.yaml" in capsys.readouterr().err
    assert main(["info", "models/sol-mni"]) == 2
    err = capsys.readouterr().err
    assert "no such checkpoint directory or config.json: models/sol-mni" in err and "deepseek-v3" not in err
    assert main(["plan", "no-such-model", "--hardware", "wse-3"]) == 2
    assert "unknown model 'no-such-model': use a catalog id" in capsys.readouterr().err


def test_hardware_without_rows_of_its_own_is_said_to_be_extrapolated(capsys, tmp_path):
    """A user's ASIC (kind asic: the gpu class's values, no rows of its own) was printed with a narrow 90% range
    and a 'fitted' basis as if it were calibrated; the range is the gpu fit's, not how far it carries over."""
    hw = tmp_path / "my_asic.yaml"
    hw.write_text("name: jalapeno\nkind: asic\ndevice: {memory_bytes: 2.0e+11, memory_bandwidth: 1.0e+13, flops: "
                  "{bf16: 2.0e+15}}\nsystem: {devices_per_node: 8}\nlinks: {scale_up: nvlink4, scale_out: ib-400g}\n")
    for hardware, whose in ((str(hw), "the gpu class's fitted parameters (no published rows for asic devices)"),
                            ("tpu-v5p", "the gpu class's fitted parameters (no published rows for tpu devices)")):
        rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "-H", hardware, "--no-intervals", "--json"])
        notes = json.loads(out)["notes"]
        assert rc == 0 and len(notes) == 1 and "is extrapolated: simulated with " + whose in notes[0]
        assert "the 90% ranges are their uncertainty only" in notes[0]
    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "-H", str(hw)])
    assert rc == 0 and "note: jalapeno is extrapolated" in " ".join(out.split())
    rc, out = _run(capsys, ["simulate", "llama-3.1-8b", "-H", "h100-sxm", "--no-intervals", "--json"])
    assert rc == 0 and json.loads(out)["notes"] == []  # (a device with rows in the fit)


def test_a_hardware_file_is_titled_by_the_name_it_gives_whatever_its_suffix(capsys, tmp_path):
    """plan and simulate print a user's hardware file's name beside the device's (docs/planner.md); a file whose name
    does not end in .yaml was titled by its path alone."""
    text = ("name: jalapeno\nkind: asic\ndevice: {memory_bytes: 2.0e+11, memory_bandwidth: 1.0e+13, flops: "
            "{bf16: 2.0e+15}}\nsystem: {devices_per_node: 8}\nlinks: {scale_up: nvlink4, scale_out: ib-400g}\n")
    for name in ("my_asic.yaml", "my_asic.hw", "my_asic"):
        (tmp_path / name).write_text(text)
        for argv in (["plan"], ["simulate", "--no-intervals"]):
            rc, out = _run(capsys, [*argv, "llama-3.1-8b", "-H", str(tmp_path / name)])
            assert rc == 0 and f"jalapeno ({name})" in out and str(tmp_path) not in out.split("\n")[0]
    rc, out = _run(capsys, ["plan", "llama-3.1-8b", "-H", "h100-sxm"])
    assert rc == 0 and "llama-3.1-8b on h100-sxm:" in out


def test_a_plan_is_not_simulated_on_another_file_of_the_same_name(capsys, tmp_path):
    """With --plan, a --hardware YAML or a MODEL config that names the plan's device or model but describes another
    one (a copy with other numbers) was checked by name only, and the plan's own file simulated without a word."""
    hw = "name: jalapeno\ndevice: {memory_bytes: 2.0e+11, memory_bandwidth: %s, flops: {bf16: 2.0e+15}}\n"
    (tmp_path / "v1.yaml").write_text(hw % "1.0e+13")
    (tmp_path / "v2.yaml").write_text(hw % "2.0e+13")
    cfg = dict(QWEN3_MOE_TINY)
    for d, k in (("a", 2), ("b", 4)):
        (tmp_path / d / "tiny").mkdir(parents=True)
        (tmp_path / d / "tiny" / "config.json").write_text(json.dumps(dict(cfg, num_experts_per_tok=k)))
    plan = tmp_path / "p.json"
    rc, _ = _run(capsys, ["plan", str(tmp_path / "a" / "tiny"), "-H", str(tmp_path / "v1.yaml"), "--out", str(plan)])
    assert rc == 0
    rc, out = _run(capsys, ["simulate", "--plan", str(plan), "-H", str(tmp_path / "v2.yaml")])
    assert rc == 2 and "v2.yaml describes another jalapeno" in out
    rc, out = _run(capsys, ["simulate", str(tmp_path / "b" / "tiny"), "--plan", str(plan)])
    assert rc == 2 and "describes another tiny" in out
    rc, out = _run(capsys, ["simulate", str(tmp_path / "a" / "tiny"), "--plan", str(plan), "-H",
                            str(tmp_path / "v1.yaml"), "--no-intervals", "--json"])
    assert rc == 0 and json.loads(out)["decode_tokens_per_s_per_user"] > 0


def test_info_and_catalog_give_a_long_sequences_cache_growth_past_the_sliding_windows(capsys):
    """gpt-oss alternates full layers with 128-token sliding windows: a long sequence grows by the full layers' bytes
    per token only, and holds the windows besides. info and catalog said 73,728 B per token (every layer's), twice
    what a sequence of 100k tokens grows by."""
    from waferline.spec.catalog import load_model

    spec = load_model("gpt-oss-120b")
    full = [la for la in spec.layers if la.mixer.sliding_window is None]
    windowed = [la for la in spec.layers if la.mixer.sliding_window is not None]
    assert full and windowed
    per_token = sum(la.cache_bytes_per_token(16) for la in full)
    fixed = sum(la.cache_bytes_per_token(16) * la.mixer.sliding_window for la in windowed)
    assert spec.cache_growth(16) == (per_token, fixed)
    grows = spec.cache_bytes_per_seq(100_001) - spec.cache_bytes_per_seq(100_000)
    assert grows == per_token < spec.cache_bytes_per_token(16)
    rc, out = _run(capsys, ["info", "gpt-oss-120b", "--json"])
    d = json.loads(out)
    assert rc == 0 and d["cache_bytes_per_context_token"]["16"] == per_token
    assert d["cache_bytes_fixed_per_seq"]["16"] == fixed
    rc, out = _run(capsys, ["catalog", "models", "--json"])
    row = next(m for m in json.loads(out)["models"] if m["id"] == "gpt-oss-120b")
    assert row["cache_bytes_per_context_token_bf16"] == per_token
    hybrid = load_model("gpt-5.6-sol-hybrid")  # (the Mamba layers' states: held, not grown)
    assert hybrid.cache_growth(16)[1] == sum(la.mixer.state_bytes_per_seq(16) for la in hybrid.layers
                                             if la.mixer.kind == "mamba2")


def _four_stages(d):
    """Split the fixture's one stage over four devices: layers 0-7, 8-15, 16-23, 24-31, in order (the layout the
    engine runs)."""
    one = d["stages"][0]
    d["stages"] = [{**one, "index": i, "layers": list(range(8 * i, 8 * i + 8)), "device_ids": [i],
                    "has_embedding": i == 0, "has_lm_head": i == 3} for i in range(4)]
    return d["stages"]


@pytest.mark.parametrize("edit, message", [
    # (each was simulated as if it were the plan placed: layers out of order, a stage holding layers that are not
    # its predecessor's next, no LM head (a faster step), two embeddings, a stage index repeated)
    (lambda s: s.__setitem__(slice(0, 2), [{**s[1], "index": 0}, {**s[0], "index": 1}]),
     "do not hold the layers in order"),
    (lambda s: (s[0]["layers"].__setitem__(-1, 8), s[1]["layers"].__setitem__(0, 7)),
     "do not hold the layers in order"),
    (lambda s: s[3].update(has_lm_head=False), "plan stage(s) [3]: the embedding belongs to the first full stage"),
    (lambda s: s[2].update(has_embedding=True), "plan stage(s) [2]: the embedding belongs to the first full stage"),
    (lambda s: s[1].update(index=0), "plan stage indices are [0, 0, 2, 3]"),
])
def test_a_plan_file_with_its_stages_out_of_order_is_refused(plan_file, capsys, edit, message):
    d = json.loads(plan_file.read_text())
    edit(_four_stages(d))
    plan_file.write_text(json.dumps(d))
    rc, out = _run(capsys, ["simulate", "--plan", str(plan_file)])
    assert rc == 2 and out.startswith("error: ") and message in out and "Traceback" not in out, out


def test_a_plan_file_of_stages_in_order_is_simulated(plan_file, capsys):
    d = json.loads(plan_file.read_text())
    _four_stages(d)
    plan_file.write_text(json.dumps(d))
    rc, out = _run(capsys, ["simulate", "--plan", str(plan_file), "--json", "--no-intervals"])
    assert rc == 0 and json.loads(out)["num_stages"] == 4


def test_an_afd_plan_file_without_its_lm_head_is_refused(tmp_path, capsys):
    """An attention/FFN plan with no LM head was simulated faster than the plan placed (132 vs 125 tok/s)."""
    p = tmp_path / "afd.json"
    assert commands.main(["plan", "deepseek-v3", "--hardware", "h200-sxm", "--weight-bits", "8", "--afd", "--out",
                          str(p), "--json"]) == 0
    capsys.readouterr()
    d = json.loads(p.read_text())
    for st in d["stages"]:
        st["has_lm_head"] = False
    p.write_text(json.dumps(d))
    rc, out = _run(capsys, ["simulate", "--plan", str(p)])
    assert rc == 2 and "the embedding belongs to the first attention stage and the LM head to the last" in out


def test_info_shows_the_mtp_modules_beside_the_671b(capsys):
    """DeepSeek's MTP module is not in params_total (671B) or weight_bytes: info showed neither it nor that it was
    left out, so its figures did not add up to the checkpoint's. Text and --json give the same figures."""
    spec = load_model("deepseek-v3")
    rc, out = _run(capsys, ["info", "deepseek-v3", "--json"])
    d = json.loads(out)
    assert rc == 0 and d["params_total"] == spec.params_total() and d["mtp_layers"] == 1
    assert d["mtp_params"] == spec.mtp_params() > 10e9
    assert d["mtp_weight_bytes"] == {str(b): spec.mtp_weight_bytes(b) for b in (16, 8, 4)}
    rc, text = _run(capsys, ["info", "deepseek-v3"])
    assert rc == 0 and f"mtp_params: {spec.mtp_params()}" in text and "mtp_layers: 1" in text
    rc, out = _run(capsys, ["info", "llama-3.1-8b", "--json"])
    assert rc == 0 and "mtp_params" not in json.loads(out)  # (no MTP modules: nothing to show)

