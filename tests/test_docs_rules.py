"""Standing rules for the user documentation: the README stays short (at most 300 lines) and opens with the two
commands that must work on a fresh machine; code, docs and help speak of the project only (no numbered sessions,
issues or stops of the process that built it); benchmarks/results/ keeps the latest run per benchmark per machine (at
most 40 files), and every result file the docs cite is there, or in git history as `git show <commit>:<path>`."""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
PROCESS_WORDS = re.compile(r"\b(?:sessions?|issues?|stops?) #?\d+\b", re.IGNORECASE)
CHECKED = ("src", "docs", "benchmarks", "train", "README.md", "DESIGN.md", "Makefile", "CHANGELOG.md")
RESULTS = ROOT / "benchmarks" / "results"
RESULTS_MAX_FILES = 40
# a path into benchmarks/results/ as the docs write it, not the `git show <commit>:benchmarks/results/...` form (the
# path may wrap to the next line right after "results/")
CITED = re.compile(r"(?<![\w:/.-])benchmarks/results/\n?([\w.{},*<>-]*)")
GIT_SHOWN = re.compile(r"git show\s+([0-9a-f]{7,40}):(benchmarks/results/[\w.-]*[\w-])")


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
                    and f.parent != ROOT / "benchmarks" / "results" and ".cache" not in f.parts]
    return out


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def kept_results(directory: Path = RESULTS) -> list[str]:
    """The entries of ``directory`` that git keeps (those .gitignore names there, a local run's scratch, left out)."""
    ignored = [ln.strip().removeprefix("benchmarks/results/").rstrip("/")
               for ln in (ROOT / ".gitignore").read_text().splitlines()
               if ln.strip().startswith("benchmarks/results/")]
    return sorted(p.name for p in directory.iterdir() if not any(fnmatch.fnmatch(p.name, g) for g in ignored))


def expand_braces(name: str) -> list[str]:
    """``twin_avx512_{sol-mini,dsv3-100m}.json`` -> both names, as a shell expands them."""
    m = re.search(r"\{([^{}]*)\}", name)
    if m is None:
        return [name]
    return [x for alt in m.group(1).split(",") for x in expand_braces(name[:m.start()] + alt + name[m.end():])]


def dangling_results(paths: list[Path], directory: Path = RESULTS) -> list[str]:
    """``file:line: name`` for each ``benchmarks/results/<name>`` a doc cites (not in a `git show` form) that no file
    in ``directory`` is (a glob such as ``twin_*.json``: that no file matches); placeholders (``<N>``) are skipped."""
    have = kept_results(directory)
    out = []
    for p in paths:
        text = p.read_text()
        for m in CITED.finditer(text):
            name = m.group(1).rstrip(".,")
            if not name or "<" in name:
                continue
            for n in expand_braces(name):
                if not fnmatch.filter(have, n):
                    out.append(f"{p}:{text.count(chr(10), 0, m.start()) + 1}: benchmarks/results/{n}")
    return out


def test_results_keep_at_most_40_files():
    """benchmarks/results/ keeps the latest run per benchmark per machine; older runs live in git history."""
    kept = kept_results()
    assert len(kept) <= RESULTS_MAX_FILES, (len(kept), kept)


def test_every_result_file_the_docs_cite_is_there():
    assert dangling_results(_docs()) == []


def test_every_git_show_result_the_docs_cite_resolves():
    """A removed result is cited as `git show <commit>:benchmarks/results/<file>`: that commit has that file."""
    try:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("no git")
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a full git checkout")
    cited = sorted({f"{c}:{path}" for p in _docs() for c, path in GIT_SHOWN.findall(p.read_text())})
    assert cited
    r = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, input="\n".join(cited) + "\n",
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [ln for ln in r.stdout.splitlines() if ln.endswith(" missing")] == []


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


def test_the_results_checks_see_what_they_look_for(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    for name in ("a.json", "twin_x_sol.json", "twin_x_dsv3.json"):
        (res / name).write_text("{}")
    doc = tmp_path / "doc.md"
    doc.write_text("JSON: `benchmarks/results/a.json`, `benchmarks/results/twin_x_{sol,dsv3,gone}.json`.\n"
                   "`git show abc1234:benchmarks/results/old.json`; `benchmarks/results/serve_<N>c.json`; "
                   "`benchmarks/results/twin_*.json`, `benchmarks/results/\nb.json`; in `benchmarks/results/`.\n")
    assert [s.split(": ", 1)[1] for s in dangling_results([doc], res)] == [
        "benchmarks/results/twin_x_gone.json", "benchmarks/results/b.json"]
    assert expand_braces("t_{a,b}_{c,d}.json") == ["t_a_c.json", "t_a_d.json", "t_b_c.json", "t_b_d.json"]
    assert GIT_SHOWN.findall(doc.read_text()) == [("abc1234", "benchmarks/results/old.json")]
    wrapped = "`git show\n35f92e4:benchmarks/results/x.json`."
    assert GIT_SHOWN.findall(wrapped) == [("35f92e4", "benchmarks/results/x.json")]
