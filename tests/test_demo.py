"""The main job: the bundled sol-mini checkpoint, `waferline demo`, and its HTML report in a real browser."""

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
    assert sum(p.numel() for p in llm.model.mtp.parameters()) == llm.spec.mtp_params()
    ids = llm.encode((BUNDLED / "heldout.txt").read_text())
    assert len(ids) == card["eval_tokens"]
    ppl = llm.perplexity(ids, window=256)  # the protocol train/sol_mini.py used for the card
    assert abs(ppl - card["heldout_ppl"]) / card["heldout_ppl"] < 0.01
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
    assert out["planner"]["wafers_4bit"] > 0 and out["planner"]["tok_s_per_user"] > 0
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

    twin_figures = 2 if DEFAULT_RESULT.is_file() else 0  # the twin section, from the cached twin result when there is one
    # timeline, memory, KV vs context, tok/s vs wafers (+ twin: predicted vs measured, one run's timeline)
    assert html.count("data:image/png;base64,") == 4 + twin_figures
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([browser, *flags, "--dump-dom", report.as_uri()], capture_output=True, text=True, timeout=120)
    assert "gpt-5.6-sol on WSE-3" in dom.stdout and "Per-stage timeline" in dom.stdout
    shot = tmp_path / "shot.png"
    subprocess.run([browser, *flags, "--window-size=1200,2400", f"--screenshot={shot}", report.as_uri()],
                   capture_output=True, text=True, timeout=120)
    import matplotlib.image as mpimg

    img = mpimg.imread(shot)
    assert img.shape[0] >= 2000 and img.shape[1] >= 1000
    assert img[..., :3].std() > 0.05  # not a blank page: text and plots drew pixels
