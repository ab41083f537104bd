"""The user documentation names code that exists and quotes what its commands print: every package path
(`engine/loop.py`, `sim/host_work.prefill_micro_batches`) and dotted Python name (`waferline.plan.plan.Plan`,
`engine.transport.Link`) it gives in backticks resolves, and a figure quoted beside a cheap simulator command is what
that command prints now."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "waferline"
USER_DOCS = ("README.md", "DESIGN.md", "docs/pipeline.md", "docs/afd.md", "docs/planner.md", "docs/server.md",
             "docs/twin.md", "docs/w4a16.md")
SUBPACKAGES = ("engine", "sim", "spec", "plan", "server", "kernels")  # (not model/: `model.safetensors` is a file)
DOTTED = re.compile(r"`((?:waferline|" + "|".join(SUBPACKAGES) + r")(?:\.[A-Za-z_]\w*)+)")
MODULE_ATTR = re.compile(r"`((?:[a-z_0-9]+/)*[a-z_0-9]+)\.([A-Za-z_]\w*)`")
OWN_DIRS = {"src", "tests", "benchmarks", "train", "model", "report", *SUBPACKAGES}
FILE_SUFFIXES = {"py", "md", "json", "yaml", "csv", "txt", "h", "cpp", "html", "safetensors"}


def _docs() -> dict[str, str]:
    return {name: (ROOT / name).read_text() for name in USER_DOCS}


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` (``waferline.``-prefixed or relative to the package) names a module or an attribute of one."""
    parts = dotted.split(".")
    if parts[0] != "waferline":
        parts = ["waferline", *parts]
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def unresolved_names(text: str) -> list[str]:
    """The dotted Python names and `path/module.attr` names of ``text`` that name nothing in the package."""
    bad = [d for d in sorted(set(DOTTED.findall(text))) if not resolves(d)]
    for path, attr in sorted(set(MODULE_ATTR.findall(text))):
        if attr in FILE_SUFFIXES:
            continue
        module = path.removeprefix("src/waferline/")
        if (PKG / f"{module}.py").is_file() and not resolves(f"{module.replace('/', '.')}.{attr}"):
            bad.append(f"{path}.{attr}")
    return bad


def missing_files(text: str) -> list[str]:
    """The `*.py` files of the repository (or of the package, relative to src/waferline) that ``text`` names in
    backticks and that do not exist."""
    out = []
    for p in sorted(set(re.findall(r"`((?:[\w.-]+/)+[\w.-]+\.py)`", text))):
        if p.split("/")[0] not in OWN_DIRS:  # (another repository's file, quoted as a source)
            continue
        if not any((base / p).is_file() for base in (ROOT, PKG)):
            out.append(p)
    return out


@pytest.mark.parametrize("doc", USER_DOCS)
def test_the_names_and_files_a_document_gives_exist(doc):
    text = _docs()[doc]
    assert unresolved_names(text) == []
    assert missing_files(text) == []


def test_the_checks_see_what_they_look_for():
    text = ("`waferline.plan.Nope`, `waferline.plan.Plan`, `engine.transport.Link`, `engine.stage.Nope`, "
            "`sim/host_work.prefill_micro_batches`, `sim/host_work.nothing_here`, `model.safetensors`, "
            "`engine/loop.py`, `engine/no_such_module.py`, `Decode/WSE-2/launch_wse2.py`")
    assert unresolved_names(text) == ["engine.stage.Nope", "waferline.plan.Nope", "sim/host_work.nothing_here"]
    assert missing_files(text) == ["engine/no_such_module.py"]


def _simulate(argv: list[str], capsys) -> dict:
    from waferline.cli import main

    assert main(["simulate", *argv, "--json", "--no-intervals"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_planner_doc_quotes_what_the_longer_context_wafer_run_prints(capsys):
    """docs/planner.md: a longer context can make decode on unlike layers sharing a wafer slightly faster, with the
    command's two per-user rates quoted; they are what `simulate` prints for the two prompt lengths."""
    text = " ".join((ROOT / "docs" / "planner.md").read_text().split())
    m = re.search(r"(\d+) -> (\d+) tok/s per user from 4k- to 16k-token prompts, each placed for its own: "
                  r"`waferline simulate ([^`]+)`", text)
    assert m, "the sentence moved: update this test with it"
    command = m.group(3).split()
    lengths = command[command.index("--prompt-len") + 1].split("|")
    assert lengths == ["4096", "16384"]
    rates = []
    for n in lengths:
        argv = list(command)
        argv[argv.index("--prompt-len") + 1] = n
        rates.append(round(_simulate(argv, capsys)["decode_tokens_per_s_per_user"]))
    assert rates == [int(m.group(1)), int(m.group(2))]
    assert rates[1] > rates[0]  # (what the sentence says: slightly faster at the longer context)
