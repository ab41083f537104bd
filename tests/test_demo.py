"""The end-to-end demo: the bundled sol-mini checkpoint, `waferline demo`, and its HTML report in a real browser."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from waferline import LLM, SamplingParams
from waferline.demo import BUNDLED, build_demo_checkpoint

needs_sol_mini = pytest.mark.skipif(not (BUNDLED / "model.safetensors").is_file() and not os.environ.get("CI"),
                                    reason="models/sol-mini not built (python train/sol_mini.py)")


@needs_sol_mini
def test_bundled_sol_mini_perplexity_matches_card():
    card = json.loads((BUNDLED / "training.json").read_text())
    llm = LLM(BUNDLED)
    assert llm.spec.model_type == "sol" and len(llm.model.mtp) == 1
    assert sum(p.numel() for p in llm.model.mtp.parameters()) == llm.spec.mtp_params() == card["mtp_params"]
    ids = llm.encode((BUNDLED / "heldout.txt").read_text())
    assert len(ids) == card["eval_tokens"]
    ppl = llm.perplexity(ids, window=256)  # the protocol train/sol_mini.py used for the card
    assert abs(ppl - card["heldout_ppl"]) / card["heldout_ppl"] < 0.01
    text = (BUNDLED / "heldout.txt").read_text()[:2000]  # (a text is encoded as encode() encodes it)
    assert llm.perplexity(text, window=64) == llm.perplexity(llm.encode(text), window=64)
    assert (BUNDLED / "model.safetensors").stat().st_size <= 40e6


@needs_sol_mini
def test_greedy_generation_is_deterministic():
    llm = LLM(BUNDLED)
    p = SamplingParams(max_tokens=24)
    a = llm.generate(["ROMEO.\n", "KING.\nMy lords,"], p)
    b = llm.generate(["ROMEO.\n", "KING.\nMy lords,"], p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) > 0 and o.text for o in a)


def test_demo_cli_runs_without_report(tmp_path):
    r = subprocess.run([sys.executable, "-m", "waferline.cli", "demo", "--max-tokens", "32", "--no-report", "--json",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 32 and out["decode_tokens_per_s"] > 0
    head = out["planner"]
    assert head["wafers_4bit"] > 0 and head["tok_s_per_user"] > 0
    for key in ("tok_s_per_user", "tok_s_per_user_mtp", "ttft_s", "nvl72_tok_s_per_user"):  # every prediction
        low, high = head[key + "_interval"]  # carries its 90% interval, which holds the point and has a spread
        assert low <= head[key] <= high and low < high, key
    assert not (tmp_path / "waferline-report.html").exists()


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_report_renders_in_headless_chromium(tmp_path):
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("chromium not installed (apt-get install chromium)")
    model = build_demo_checkpoint(tmp_path / "ckpt")  # a small random sol checkpoint keeps this test fast
    from waferline.demo import run_demo

    assert run_demo(out_dir=str(tmp_path / "out"), max_tokens=12, model=str(model)) == 0
    report = tmp_path / "out" / "waferline-report.html"
    html = report.read_text()
    from waferline.report.twin_section import DEFAULT_RESULT

    # the twin section, from the cached twin result when there is one
    twin_figures = 2 if DEFAULT_RESULT.is_file() else 0
    # timeline, memory, KV vs context, tok/s vs wafers (+ twin: predicted vs measured, one run's timeline)
    assert html.count("data:image/png;base64,") == 4 + twin_figures
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([browser, *flags, "--dump-dom", report.as_uri()], capture_output=True, text=True, timeout=120)
    assert "gpt-5.6-sol on WSE-3" in dom.stdout and "Per-stage timeline" in dom.stdout
    assert "Cerebras WSE-3" in dom.stdout and ("Measured by `waferline twin` on the machine named" in dom.stdout
                                               or not twin_figures)
    shot = tmp_path / "shot.png"
    subprocess.run([browser, *flags, "--window-size=1200,2400", f"--screenshot={shot}", report.as_uri()],
                   capture_output=True, text=True, timeout=120)
    import matplotlib.image as mpimg

    img = mpimg.imread(shot)
    assert img.shape[0] >= 2000 and img.shape[1] >= 1000
    assert img[..., :3].std() > 0.05  # not a blank page: text and plots drew pixels


def _report_figures() -> dict:
    """Every chart of the demo report, from the planner's numbers and, when there is one, the cached twin result."""
    from waferline.demo import _figures, planner_headline
    from waferline.report import twin_section

    head = planner_headline()
    figs = _figures([0.9, 0.8, 1.6, 0.85, 0.8, 1.5], ["mamba2", "mamba2", "mla", "mamba2", "mamba2", "mla"], head)
    many = _figures([0.1 + 0.05 * (i % 7) for i in range(40)], ["mla", "gqa", "mamba2", "mamba2"] * 10, head)
    figs["timeline, 40 layers"] = many.pop("timeline")
    result, _ = twin_section.load_result()
    if result is not None and twin_section._ok(result):
        figs["twin"] = twin_section.figure_pred_vs_meas(result)
        row = twin_section.pick_timeline_row(result)
        if row is not None:
            figs["twin timeline"] = twin_section.figure_timeline(result, row)
    return figs


def test_report_charts_have_no_overlapping_text_and_no_legend_over_data():
    import matplotlib.pyplot as plt

    from waferline.report.layout import layout_problems

    figs = _report_figures()
    try:
        problems = {name: layout_problems(fig) for name, fig in figs.items()}
    finally:
        for fig in figs.values():
            plt.close(fig)
    assert problems == {name: [] for name in figs}


def test_layout_check_finds_overlaps_and_legends_on_data():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from waferline.report.layout import layout_problems, place_labels

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], label="a line")
    ax.legend(loc="center")
    ax.annotate("one label", (0.5, 0.2))
    ax.annotate("one label too", (0.5, 0.2))
    found = layout_problems(fig)
    assert any("legend sits on axes 0" in p for p in found) and any("overlaps" in p for p in found)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4, 3))  # labels of points that coincide are spread apart
    xs, ys = [1.0, 1.01, 1.02, 2.0, 3.0], [1.0, 1.0, 1.01, 2.0, 3.0]
    ax.scatter(xs, ys)
    ax.set_xlim(0, 4)
    ax.set_ylim(0, 4)
    place_labels(ax, xs, ys, [f"plan-{i}" for i in range(5)])
    assert layout_problems(fig) == []
    plt.close(fig)


def test_report_explains_the_750_line_and_names_the_twin_machine():
    import html

    import matplotlib.pyplot as plt

    from waferline.demo import REFERENCE_CAPTION, REFERENCE_LABEL, _figures, add_prediction_sections, planner_headline
    from waferline.report.html import Report
    from waferline.report.twin_section import add_twin_sections, load_result, machine_text

    head = planner_headline()
    figs = _figures([1.0, 2.0], ["mamba2", "mla"], head)
    legend = [t.get_text() for lg in figs["sweep"].legends for t in lg.get_texts()]
    assert REFERENCE_LABEL in legend and "GPT-5.6 Sol" in REFERENCE_LABEL and "Cerebras WSE-3" in REFERENCE_LABEL
    rep = Report("t")
    add_prediction_sections(rep, figs, head)
    for fig in figs.values():
        plt.close(fig)
    page = rep.to_html()
    assert html.escape(REFERENCE_CAPTION) in page and "750 tok/s per user" in page

    # the machine, from what a twin result records; the CPU model only when the file has one
    minimal = {"machine": "box-7", "cores": 4, "date": "2026-01-02T03:04:05+00:00", "host": {"torch": "2.0"},
               "load_average": [0.5, 0.4, 0.3]}
    text = machine_text(minimal)
    assert '"box-7"' in text and "4 logical cores" in text and "2026-01-02 03:04:05 UTC" in text
    assert "CPU model not recorded" in text
    assert "CPU Example 9000" in machine_text(dict(minimal, cpu_model="Example 9000"))
    from waferline.report.twin_section import RESULTS

    result, source = load_result()
    if result is not None:  # the cached twin result the demo reads: its section names that machine
        rep = Report("t")
        add_twin_sections(rep, result, source)
        for s in rep.sections:
            if s.figure is not None:
                plt.close(s.figure)
        page = rep.to_html()
        assert html.escape(machine_text(result)) in page
        assert html.escape(f'Measured by `waferline twin` on the machine named "{result["machine"]}"') in page
        assert "not in this run" in page and result["date"] == max(  # (the newest shipped run, said to be one)
            json.loads(f.read_text())["date"] for f in RESULTS.glob("twin*_sol-mini.json"))


def test_headline_cells_print_the_interval():
    from waferline.demo import headline_cell

    head = {"tok_s_per_user": 313.2, "tok_s_per_user_interval": [131.0, 398.4], "ttft_s": 0.186,
            "ttft_s_interval": [0.063, 0.189], "nvl72_tok_s_per_user": 118.0}
    assert headline_cell(head, "tok_s_per_user") == "313 (90%: 131-398)"
    assert headline_cell(head, "ttft_s", 1e3, " ms") == "186 (90%: 63-189) ms"
    assert headline_cell(head, "nvl72_tok_s_per_user") == "118"  # (no interval stored: the value alone)


def test_demo_refuses_a_missing_model_and_requantizes_a_stale_int4_copy(tmp_path):
    """--model that is not a checkpoint is an error (it used to fall back to random weights); an int4 copy in the
    output folder is reused only while it is the copy of these weights (a stale or foreign one is rebuilt)."""
    from waferline.demo import run_demo
    from waferline.errors import ConfigError

    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        run_demo(out_dir=str(tmp_path / "o"), model=str(tmp_path / "missing"), report=False)
    model = build_demo_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    stale = out / "ckpt-int4-g32"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"not the int4 copy of these weights")
    assert run_demo(out_dir=str(out), max_tokens=2, model=str(model), report=False, layers_per_stage=0) == 0
    assert (stale / ".waferline-source.json").is_file()
    assert json.loads((stale / "config.json").read_text())["quantization_config"]["group_size"] == 32


def test_demo_runs_a_given_int4_checkpoint_and_names_it(tmp_path, capsys):
    """A checkpoint given with --model is named as itself (it was called "trained sol-mini", random weights
    included); an int4 checkpoint runs as it is stored (it failed with quantize's "already quantized")."""
    from waferline.cli import main
    from waferline.model.quant import QuantOptions, quantize_checkpoint

    model = build_demo_checkpoint(tmp_path / "mine")
    int4 = tmp_path / "mine-int4"
    quantize_checkpoint(model, int4, QuantOptions(group_size=32))
    out = tmp_path / "out"
    assert main(["demo", "--model", str(int4), "--out", str(out), "--max-tokens", "2", "--no-report",
                 "--layers-per-stage", "0", "--weight-bits", "16", "--json"]) == 0
    printed = capsys.readouterr()
    d = json.loads((out / "demo.json").read_text())
    assert d["trained"] is False and d["weight_bits"] == 4 and "as the checkpoint stores them" in d["plan"]
    assert "(checkpoint mine-int4)" in printed.err and "trained sol-mini" not in printed.err
    # mistakes found before any work: no int4 copy, no processes
    assert main(["demo", "--out", str(tmp_path / "o2"), "--max-tokens", "0", "--no-report"]) == 2
    assert not (tmp_path / "o2").exists()
    (tmp_path / "afile").write_text("x")
    assert main(["demo", "--out", str(tmp_path / "afile"), "--no-report"]) == 2
    assert "is a file" in capsys.readouterr().err


def test_demo_refuses_bad_flags_before_any_work(tmp_path, capsys, monkeypatch):
    """A negative --layers-per-stage, --num-speculative-tokens 0, an unknown --speculative method and a --model without
    a tokenizer are refused before the int4 copy and the timing run (they failed only after them, or not at all)."""
    import waferline.demo as demo
    from waferline.cli import main

    def no_run(*a, **k):
        raise AssertionError("the demo ran before its flags were checked")

    monkeypatch.setattr(demo, "run_demo", no_run)
    out = tmp_path / "out"
    for flags, message in ((["--layers-per-stage", "-1"], "--layers-per-stage: expected an integer >= 0, got -1"),
                           (["--speculative", "ngram", "--num-speculative-tokens", "0"],
                            "--num-speculative-tokens: expected an integer >= 1, got 0")):
        with pytest.raises(SystemExit) as e:
            main(["demo", "--out", str(out), "--no-report", *flags])
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert main(["demo", "--out", str(out), "--no-report", "--speculative", "bogus"]) == 2
    assert "--speculative bogus: unknown method" in capsys.readouterr().err
    no_tok = tmp_path / "no-tok"
    no_tok.mkdir()
    (no_tok / "config.json").write_text("{}")
    assert main(["demo", "--out", str(out), "--no-report", "--model", str(no_tok)]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    assert main(["demo", "--out", str(out), "--no-report", "--prompt", " "]) == 2  # (was the default line, silently)
    assert "--prompt is empty" in capsys.readouterr().err
    # bytes that are not UTF-8 (a Latin-1 terminal): a traceback from the tokenizer, after the int4 copy
    for argv in (["demo", "--out", str(out), "--no-report", "--prompt", "caf\udce9"],
                 ["generate", "--model", str(no_tok), "--prompt", "caf\udce9"],
                 ["generate", "--model", str(no_tok), "--prompt-ids", "1", "--stop", "\udcff"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "not valid UTF-8 text" in capsys.readouterr().err
    assert not out.exists()


def test_demo_a_write_that_fails_is_one_line(tmp_path, capsys, monkeypatch):
    """A full disk when the demo writes its summary: one line and exit 2, not a traceback."""
    import errno

    import waferline.demo as demo
    from waferline.cli import main

    def full_disk(path, text, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    head = {"wafers_4bit": 1, "wafers_16bit": 2, "tok_s_per_user": 1.0, "tok_s_per_user_mtp": 1.0, "ttft_s": 1.0,
            "nvl72_gpus": 1, "nvl72_tok_s_per_user": 1.0}
    monkeypatch.setattr(demo, "planner_headline", lambda: head)
    monkeypatch.setattr(demo, "write_text_atomic", full_disk)
    model = build_demo_checkpoint(tmp_path / "ckpt")
    assert main(["demo", "--model", str(model), "--out", str(tmp_path / "out"), "--max-tokens", "2", "--no-report",
                 "--layers-per-stage", "0", "--weight-bits", "16"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert err == [f"error: --out {tmp_path / 'out'}: cannot write demo.json (No space left on device)"]


def test_report_names_the_checkpoint_that_ran(tmp_path, monkeypatch):
    """A checkpoint given with --model is what the report's subtitle and timeline name (both said sol-mini)."""
    import waferline.report.html as report_html
    from waferline.demo import run_demo

    titles = []

    def png(fig):
        titles.extend(ax.get_title() for ax in fig.axes)
        import matplotlib.pyplot as plt

        plt.close(fig)
        return ""

    monkeypatch.setattr(report_html, "_png", png)
    model = build_demo_checkpoint(tmp_path / "my-ckpt")
    assert run_demo(out_dir=str(tmp_path / "out"), max_tokens=2, model=str(model), weight_bits=16,
                    layers_per_stage=0) == 0
    page = (tmp_path / "out" / "waferline-report.html").read_text()
    assert "my-ckpt run and gpt-5.6-sol predictions" in page and "sol-mini run" not in page
    timeline = [t for t in titles if "timeline of one decode step" in t]
    assert timeline == ["my-ckpt: per-layer (per-stage) timeline of one decode step, measured"]


def test_memory_chart_bars_are_the_planned_memory_per_wafer():
    """Each wafer's bar reaches the planner's total memory for it (weights, cache, activations and reserve), the sum
    that is held against the SRAM line (it left the activations and the reserve out)."""
    import matplotlib.pyplot as plt

    from waferline.demo import _figures, planner_headline
    from waferline.plan.place import place

    head = planner_headline()
    figs = _figures([1.0, 2.0], ["mamba2", "mla"], head)
    ax = figs["memory"].axes[0]
    tops: dict[int, float] = {}
    for bar in ax.patches:
        i = round(bar.get_x() + bar.get_width() / 2)
        tops[i] = max(tops.get(i, 0.0), bar.get_y() + bar.get_height())
    for fig in figs.values():
        plt.close(fig)
    plan = place("gpt-5.6-sol", "wse-3", devices=80, weight_bits=4, context=131072, batch=16)
    assert sorted(tops) == [s.index for s in plan.stages]
    for s in plan.stages:
        assert abs(tops[s.index] - s.memory.total / 1e9) < 1e-6, s.index


def test_demo_runs_a_checkpoint_whose_layers_are_a_mixer_or_an_ffn(tmp_path, capsys):
    """--model a Nemotron-H checkpoint (a layer is a Mamba-2 or attention mixer, or an MLP or MoE, not both): the
    demo names each layer's kind and the experts (it failed with a traceback on the first FFN-only layer)."""
    import tiny_models
    from waferline.demo import DEMO_TEXT, run_demo, write_tokenizer

    ckpt = tmp_path / "nemotron"
    tiny_models.build("nemotron_h", ckpt, vocab_size=512)
    write_tokenizer(ckpt, DEMO_TEXT, 512)
    assert run_demo(out_dir=str(tmp_path / "out"), max_tokens=2, model=str(ckpt), weight_bits=16,
                    layers_per_stage=0, report=False) == 0
    out = capsys.readouterr().out
    assert "(mamba2 moe gqa dense)" in out and "MoE 8" in out


def _short_context_checkpoint(path, prompt: str, spare: int):
    """The demo's random sol checkpoint with a context of ``prompt``'s tokens + ``spare``."""
    from waferline.demo import SOL_DEMO_CONFIG, write_tokenizer
    from waferline.model.init import write_random_checkpoint

    write_random_checkpoint(dict(SOL_DEMO_CONFIG, max_position_embeddings=1024), path)
    write_tokenizer(path, prompt * 4, SOL_DEMO_CONFIG["vocab_size"])
    n = len(LLM(path).encode(prompt))
    write_random_checkpoint(dict(SOL_DEMO_CONFIG, max_position_embeddings=n + spare), path)
    return path


def test_demo_fits_its_timing_and_structured_runs_in_the_context(tmp_path, capsys):
    """A --prompt and --max-tokens that fit the model's context run whole: the timing run (16 tokens) and the structured
    output (96) take what is left (they failed after the stream, naming a max_tokens the command line never set); a
    --max-tokens that does not fit is one line naming --max-tokens, before the stage processes."""
    from waferline.demo import run_demo
    from waferline.errors import ConfigError

    prompt = "ROMEO. What light is this that breaks upon the wafer? " * 3
    model = _short_context_checkpoint(tmp_path / "short", prompt, spare=6)
    out = tmp_path / "out"
    assert run_demo(out_dir=str(out), max_tokens=6, prompt=prompt, model=str(model), weight_bits=16,
                    layers_per_stage=0, report=False) == 0
    d = json.loads((out / "demo.json").read_text())
    assert len(d["token_ids"]) == 6
    printed = " ".join(capsys.readouterr().out.split())  # (rich wraps its lines)
    assert d["structured_output"]["valid"] or "(cut at 6 tokens)" in printed
    with pytest.raises(ConfigError, match=r"--max-tokens 7 exceeds the model's context of \d+ tokens"):
        run_demo(out_dir=str(out), max_tokens=7, prompt=prompt, model=str(model), weight_bits=16,
                 layers_per_stage=0, report=False)


def test_demo_plan_names_the_layers_a_stage_holds(tmp_path):
    """--layers-per-stage above the model's layer count runs one stage of all its layers, and the plan says so (it said
    "1 stage process (100 layers per stage" of a 6-layer model)."""
    from waferline.demo import SOL_DEMO_CONFIG, run_demo

    model = build_demo_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    assert run_demo(out_dir=str(out), max_tokens=2, model=str(model), weight_bits=16, layers_per_stage=100,
                    report=False) == 0
    layers = SOL_DEMO_CONFIG["num_hidden_layers"]
    assert json.loads((out / "demo.json").read_text())["plan"].startswith(f"1 stage process ({layers} layers per stage")


def test_demo_refuses_mtp_for_a_checkpoint_without_mtp_before_any_work(tmp_path, capsys, monkeypatch):
    """--speculative mtp with a --model that has no MTP layers is one line naming that checkpoint, before the int4 copy
    and the timing run (the engine refused it only after them, naming the int4 copy)."""
    import waferline.demo as demo
    from waferline.cli import main

    def no_run(*a, **k):
        raise AssertionError("the demo ran before its flags were checked")

    monkeypatch.setattr(demo, "run_demo", no_run)
    model = build_demo_checkpoint(tmp_path / "no-mtp")
    out = tmp_path / "out"
    assert main(["demo", "--model", str(model), "--out", str(out), "--no-report", "--speculative", "mtp"]) == 2
    err = capsys.readouterr().err
    assert "needs a checkpoint with MTP weights" in err and str(model) in err
    assert not out.exists()


def test_demo_report_says_what_the_terminal_says_of_one_token_and_speculation(tmp_path, capsys, monkeypatch):
    """--max-tokens 1 --speculative ngram: the terminal and the report say there was no decode step (not "decode
    0 tok/s" of "1 tokens") and what speculation did (the report said nothing of it; with nothing drafted the terminal
    said "acceptance 0.00 (0 of 0 drafts)")."""
    import html

    import waferline.report.html as report_html
    from waferline.demo import run_demo

    def png(fig):
        import matplotlib.pyplot as plt

        plt.close(fig)
        return ""

    monkeypatch.setattr(report_html, "_png", png)
    model = build_demo_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    assert run_demo(out_dir=str(out), max_tokens=1, model=str(model), weight_bits=16, layers_per_stage=0,
                    speculative="ngram", json_out=True) == 0
    printed = " ".join(capsys.readouterr().err.split())  # (rich wraps its lines)
    page = html.unescape((out / "waferline-report.html").read_text())
    for said in (printed, page):
        assert "no decode step" in said and "decode 0 tok/s" not in said and "1 tokens" not in said
        assert "speculative ngram: nothing drafted (no decode step)" in said and "acceptance 0.00" not in said
    from waferline.demo import speculative_text

    d = json.loads((out / "demo.json").read_text())
    assert speculative_text("ngram", {k: v for k, v in d.items() if k.startswith("spec_")}) in page
    drafted = {"spec_acceptance_rate": 0.5, "spec_accepted": 2.0, "spec_drafted": 4.0,
               "spec_mean_accepted_length": 1.5, "spec_plain_steps": 1.0, "spec_verify_steps": 3.0}
    assert speculative_text("mtp", drafted).startswith("speculative mtp: acceptance 0.50 (2 of 4 drafts), mean "
                                                       "accepted length 1.50 tokens per decode step")


def test_demo_names_the_int4_copy_of_model_dot_after_the_checkpoint(tmp_path, monkeypatch):
    """`--model .` (run inside the checkpoint's directory): the int4 copy is named after that directory, as the report
    names the checkpoint (it was "-int4-g32")."""
    from waferline.demo import run_demo

    model = build_demo_checkpoint(tmp_path / "ckpt")
    monkeypatch.chdir(model)
    out = tmp_path / "out"
    assert run_demo(out_dir=str(out), max_tokens=1, model=".", layers_per_stage=0, report=False) == 0
    assert (out / "ckpt-int4-g32" / "model.safetensors").is_file() and not (out / "-int4-g32").exists()
    assert json.loads((out / "demo.json").read_text())["checkpoint"] == str(out / "ckpt-int4-g32")


def test_demo_requantizes_the_int4_copy_when_the_checkpoints_config_changes(tmp_path):
    """The int4 copy carries the source's config.json and tokenizer: an edit to them makes a new copy (the stamp held
    the weights' sizes and times only, and the demo ran the old config, the context it named included)."""
    from waferline.demo import run_demo

    model = build_demo_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    assert run_demo(out_dir=str(out), max_tokens=1, model=str(model), report=False, layers_per_stage=0) == 0
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_theta"] = 5000.0
    (model / "config.json").write_text(json.dumps(cfg, indent=2))
    assert run_demo(out_dir=str(out), max_tokens=1, model=str(model), report=False, layers_per_stage=0) == 0
    assert json.loads((out / "ckpt-int4-g32" / "config.json").read_text())["rope_theta"] == 5000.0


def test_demo_reuses_its_random_checkpoint_and_its_int4_copy(tmp_path, monkeypatch, capsys):
    """Without the bundled sol-mini, a second run reuses the random checkpoint and its int4 copy that the first made
    (both were made again on every run); a build stopped before its config.json is made again."""
    import waferline.demo as demo

    monkeypatch.setattr(demo, "BUNDLED", tmp_path / "no-sol-mini")
    out = tmp_path / "out"
    made = (out / "sol-demo-random" / "model.safetensors", out / "sol-demo-random-int4-g32" / "model.safetensors")
    assert demo.run_demo(out_dir=str(out), max_tokens=1, report=False, layers_per_stage=0) == 0
    first = [p.stat().st_mtime_ns for p in made]
    assert demo.run_demo(out_dir=str(out), max_tokens=1, report=False, layers_per_stage=0) == 0
    assert [p.stat().st_mtime_ns for p in made] == first
    assert "reusing the small RANDOM sol checkpoint" in " ".join(capsys.readouterr().out.split())
    assert demo.is_demo_checkpoint(out / "sol-demo-random")
    (out / "sol-demo-random" / "config.json").unlink()  # (as a build stopped midway leaves it)
    assert not demo.is_demo_checkpoint(out / "sol-demo-random")


def test_demo_a_config_json_that_is_not_a_json_object_is_one_line(tmp_path, capsys):
    """--model whose config.json is not valid JSON, or not an object: one line naming the file (a traceback from
    is_int4_checkpoint, as `generate --stages 2 --weight-bits 4` gave)."""
    from waferline.cli import main

    model = build_demo_checkpoint(tmp_path / "ckpt")
    for text in ("{bad", "[]"):
        (model / "config.json").write_text(text)
        for argv in (["demo", "--model", str(model), "--out", str(tmp_path / "out"), "--max-tokens", "1",
                      "--no-report", "--layers-per-stage", "0"],
                     ["generate", "--model", str(model), "--prompt-ids", "1 2", "--max-tokens", "1", "--stages", "2",
                      "--weight-bits", "4"]):
            assert main(argv) == 2, (text, argv[0])
            err = capsys.readouterr().err
            assert err.startswith("error: ") and err.count("\n") == 1 and "config.json" in err, err


def test_demo_refuses_mtp_for_its_random_checkpoint_before_any_work(tmp_path, capsys, monkeypatch):
    """Without the bundled sol-mini, --speculative mtp was refused only after the demo had built its random checkpoint
    (which has no MTP head), its int4 copy and the timing run, naming that copy: now one line before any of it."""
    import waferline.demo as demo
    from waferline.cli import main

    def no_run(*a, **k):
        raise AssertionError("the demo ran before its flags were checked")

    monkeypatch.setattr(demo, "run_demo", no_run)
    monkeypatch.setattr(demo, "BUNDLED", tmp_path / "models" / "sol-mini")
    out = tmp_path / "out"
    assert main(["demo", "--out", str(out), "--no-report", "--speculative", "mtp"]) == 2
    err = capsys.readouterr().err
    assert "--speculative mtp: sol-mini is not at" in err and "no MTP head" in err
    assert not out.exists()
    assert main(["demo", "--out", str(out), "--no-report", "--speculative", "nonsense"]) == 2  # (checked as before)
