"""Standing rules for the user documentation: the README stays short (at most 300 lines) and opens with the two
commands that must work on a fresh machine; code, docs and help speak of the project only (no numbered sessions,
issues or stops of the process that built it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
PROCESS_WORDS = re.compile(r"\b(?:sessions?|issues?|stops?) #?\d+\b", re.IGNORECASE)
CHECKED = ("src", "docs", "benchmarks", "train", "README.md", "DESIGN.md", "Makefile", "CHANGELOG.md")


def first_commands(readme: str) -> list[str]:
    """The commands of the first fenced shell block, without their comments."""
    block = re.search(r"```sh\n(.*?)```", readme, re.DOTALL)
    return [] if block is None else [ln.split("#")[0].strip() for ln in block.group(1).splitlines() if ln.strip()]


def process_words(paths: list[Path]) -> list[str]:
    """``file:line: text`` for each line that numbers a session, issue or stop."""
    out = []
    for p in paths:
        try:
            lines = p.read_text().splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        out += [f"{p}:{i}: {ln.strip()}" for i, ln in enumerate(lines, 1) if PROCESS_WORDS.search(ln)]
    return out


def _files() -> list[Path]:
    out = []
    for name in CHECKED:
        p = ROOT / name
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += [f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in (".py", ".md", ".yaml", ".sh", "")
                    and "results" not in f.parts and ".cache" not in f.parts]
    return out


def test_readme_is_short_and_opens_with_demo_and_test():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert first_commands(readme)[:2] == ["make demo", "make test"]


def test_no_process_words_in_code_docs_or_help():
    assert process_words(_files()) == []


def test_the_checks_see_what_they_look_for(tmp_path):
    bad = tmp_path / "bad.md"
    bad.write_text("fine line\nas decided in Session 12\nsee issue #48\n")
    good = tmp_path / "good.md"
    good.write_text("the session's cookies; an issue with 4 stages\n")
    assert [s.split(": ", 1)[1] for s in process_words([bad, good])] == ["as decided in Session 12", "see issue #48"]
    assert first_commands("x\n```sh\nmake demo    # a\nmake test\n```\n") == ["make demo", "make test"]
    assert first_commands("no block") == []
