"""The CLI's text output prints the user's strings as they are: ids and systems of a results CSV, model and hardware
names, paths, grid point names, prompts and generated text are not rich markup (a '[/x]' was a closing tag that
crashed the command, a '[a100]' an unknown tag dropped from the line, a ':cat:' an emoji)."""

import shutil

from waferline.cli import main
from waferline.sim.validate import PUBLISHED_PATH


def _flat(text: str) -> str:
    """Text without its whitespace: what is printed, whatever rich's wrapping (a table cell, a title or a long line
    breaks across lines, a long path even within itself)."""
    return "".join(text.split())


def _printed(text: str, *wanted: str) -> bool:
    """Whether every one of ``wanted`` is in the printed ``text`` as it is."""
    return all(_flat(w) in _flat(text) for w in wanted)


def _csv(path, ids: list[str]) -> str:
    """The first published rows under these ids; the first row's system, the last row's model are the user's too."""
    lines = [line for line in PUBLISHED_PATH.read_text().splitlines() if not line.startswith("#")]
    rows = [",".join([i, *line.split(",")[1:]]) for i, line in zip(ids, lines[1:], strict=False)]
    rows[0] = rows[0].replace("Cerebras Inference", "[/v]endor", 1)
    cells = rows[-1].split(",")
    rows[-1] = ",".join([*cells[:2], "[/m]odel", *cells[3:]])  # (no such model: skipped, the reason naming it)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([lines[0], *rows]) + "\n")
    return str(path)


def test_validate_and_calibrate_print_the_csvs_text_as_it_is(tmp_path, capsys):
    data = _csv(tmp_path / "d[/c]" / "r.csv", ["[/x]cal:cat:", "[a100]cal", "[b]skip"])
    assert main(["validate", "--data", data]) == 0
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    assert _printed(cap.out, f"validation on {data}", "[/x]cal:cat:", "[a100]cal", "[b]skip", "[/m]odel",
                    "skipped: [b]skip:")
    assert main(["validate", "--data", data, "--cross-validate", "vendor"]) == 0
    assert _printed(capsys.readouterr().out, "fold [/v]endor:", "[/x]cal:cat:")
    fitted = tmp_path / "d[/c]" / "f.yaml"
    assert main(["calibrate", "--published", data, "--out", str(fitted), "--bootstrap", "0", "--iters", "5"]) == 0
    assert _printed(capsys.readouterr().out, f"fitted on {data}", "left out of the fit: [b]skip:",
                    f"written to {fitted}")


def _hardware(tmp_path) -> str:
    """A wafer of the user's whose name and file path hold brackets."""
    from waferline.spec.catalog import HARDWARE_DIR

    path = tmp_path / "hw[x]" / "w[" / "y].yaml"  # (a path that reads hw[x]/w[/y].yaml)
    path.parent.mkdir(parents=True)
    text = (HARDWARE_DIR / "wse-3.yaml").read_text()
    path.write_text("\n".join("name: wafer[x][/y]" if line.startswith("name:") else line
                              for line in text.splitlines()) + "\n")
    return str(path)


def test_plan_and_simulate_print_names_and_paths_as_they_are(tmp_path, capsys):
    from waferline.spec.catalog import MODELS_DIR

    hw = _hardware(tmp_path)
    model = tmp_path / "m[" / "z]"  # (a checkpoint directory at m[/z])
    model.mkdir(parents=True)
    shutil.copy(MODELS_DIR / "llama-3.1-8b.json", model / "config.json")
    out = tmp_path / "p[/o]" / "plan.json"
    out.parent.mkdir(parents=True)
    assert main(["plan", str(model), "--hardware", hw, "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    assert _printed(cap.out, f"{model} on wafer[x][/y] (y].yaml)", f"plan written to {out}")
    assert main(["simulate", str(model), "--hardware", hw, "--no-intervals", "--explain",
                 "--target-tokens-per-s", "5000"]) == 0
    assert _printed(capsys.readouterr().out, f"{model} on 1 x wafer[x][/y] (y].yaml)",
                    "note: wafer[x][/y] is extrapolated")  # (the caption: the hardware's name in a note)
    assert main(["simulate", "--plan", str(out), "--no-intervals"]) == 0
    assert _printed(capsys.readouterr().out, f"{model} on 1 x wafer[x][/y] (y].yaml)")


def test_twin_prints_names_and_messages_as_they_are(tmp_path, capsys, monkeypatch):
    from waferline.sim import twin

    def run_twin(*a, progress=None, **k):
        progress("[/g]rid point: engine", 0.5)  # (the progress bar: a grid point's name)
        none = {"n": 0}
        return {"model_name": "[/m]odel", "machine": "[b]ox", "cores": 2, "prompt_len": 8, "output_len": 8,
                "load_average": [0.5], "hardware": "hw[x]/w[/y].yaml", "host": {"date": "2025-01-01"},
                "inputs": {"measured": "m", "modelled": "p"},
                "rows": [{"plan": "[/g]rid point", "point": {"afd": False, "stages": 1, "micro_batches": 1,
                                                             "batch": 1},
                          "status": "not available: planner: [/e]rror"}],
                "drift": {"plan": "[/g]rid point", "factor": 1.1, "start_tokens_per_s_per_user": 10.0,
                          "end_tokens_per_s_per_user": 9.0},
                "summary": {"tokens_per_s_per_user": none, "aggregate_tokens_per_s": none, "ttft_s": none,
                            "all": none, "plans_compared": 1}}

    monkeypatch.setattr(twin, "run_twin", run_twin)
    out = tmp_path / "o[" / "u]" / "twin.json"
    assert main(["twin", "--model", "m", "--hardware", "h.yaml", "--passes", "1", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err and _printed(cap.err, "[/g]rid point: engine")
    assert _printed(cap.out, "twin: [/m]odel on [b]ox", "[/g]rid point", "planner: [/e]rror",
                    "machine drift: [/g]rid point measured again", "hardware: hw[x]/w[/y].yaml", f"written to {out}")


def test_demo_prints_the_checkpoints_name_and_the_prompt_as_they_are(tmp_path, capsys):
    from waferline.demo import build_demo_checkpoint

    model = build_demo_checkpoint(tmp_path / "m[b]x")
    prompt = "[bold]ROMEO[/x]. :cat: What light"
    assert main(["demo", "--model", str(model), "--out", str(tmp_path / "out"), "--max-tokens", "2", "--no-report",
                 "--layers-per-stage", "0", "--weight-bits", "16", "--prompt", prompt]) == 0
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    assert _printed(cap.out, "m[b]x:", "(checkpoint m[b]x)", prompt)


def test_generate_prints_an_output_a_stop_string_cut_to_nothing_as_no_text(sol, capsys):
    """--prompt-ids with a tokenizer: an output whose text the stop string cut to nothing prints no text, not its
    token ids (they stand for the text only for a checkpoint without a tokenizer)."""
    from waferline import LLM, SamplingParams

    first = LLM(sol).generate([[5, 6, 7]], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    assert first.text and "\ufffd" not in first.text
    assert main(["generate", "--model", str(sol), "--prompt-ids", "5 6 7", "--max-tokens", "4", "--stop",
                 first.text]) == 0
    cap = capsys.readouterr()
    assert cap.out == "\n" and "finish: stop" in cap.err
