"""The package's layers import downwards only: the accounting (spec), the torch modules (model) and the fused
operators (kernels) never import the engine, the server or the simulator; the simulator's cost code never imports the
engine. Imports inside functions count too (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# module prefix -> prefixes it must not import
RULES = {
    "waferline.spec": ("waferline.engine", "waferline.server", "waferline.sim", "waferline.plan", "waferline.model"),
    "waferline.model": ("waferline.engine", "waferline.server", "waferline.sim", "waferline.plan"),
    "waferline.kernels": ("waferline.engine", "waferline.server", "waferline.sim", "waferline.plan",
                          "waferline.model"),
    "waferline.sim.cost": ("waferline.engine", "waferline.server", "waferline.sim.calibrate"),
    "waferline.sim.serving": ("waferline.engine", "waferline.server", "waferline.sim.calibrate"),
    "waferline.sim.fit": ("waferline.engine", "waferline.server", "waferline.sim.calibrate"),
    "waferline.sim.validate": ("waferline.engine", "waferline.server", "waferline.sim.calibrate"),
    "waferline.sim.intervals": ("waferline.engine", "waferline.server", "waferline.sim.calibrate"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "waferline").rglob("*.py"):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(path: Path, module: str, typing_too: bool = True) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every import statement in ``path`` at any depth, relative imports resolved (a plain
    ``import x`` gives (x, [])); ``typing_too=False`` leaves out those under ``if TYPE_CHECKING:``."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip = set() if typing_too else {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                                     and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out.append((base, [a.name for a in node.names]))
    return out


def imported(path: Path, module: str) -> set[str]:
    """Every waferline module name ``path`` imports, at any depth (relative imports resolved)."""
    names = set()
    for base, items in _imports(path, module):
        names.add(base)
        names.update(f"{base}.{n}" for n in items)
    return {n for n in names if n.startswith("waferline")}


def _violations(modules: dict[str, Path]) -> list[str]:
    bad = []
    for module, path in sorted(modules.items()):
        for prefix, banned in RULES.items():
            if module == prefix or module.startswith(prefix + "."):
                for name in sorted(imported(path, module)):
                    if any(name == b or name.startswith(b + ".") for b in banned):
                        bad.append(f"{module} imports {name}")
    return bad


def test_lower_layers_never_import_higher_ones():
    assert _violations(_modules()) == []


def test_the_check_sees_a_lazy_import_from_below(tmp_path):
    """The negative control: a function-level import of the engine from model/ is reported."""
    p = tmp_path / "bad.py"
    p.write_text("def f():\n    from waferline.engine.llm import LLM\n    return LLM\n")
    assert _violations({"waferline.model.bad": p}) == ["waferline.model.bad imports waferline.engine.llm",
                                                       "waferline.model.bad imports waferline.engine.llm.LLM"]


@pytest.mark.parametrize("module, source, want", [
    ("waferline.model.quant.write", "from ..load import load_tokenizer\n", "waferline.model.load"),
    ("waferline.sim.cost", "from .pipeline import simulate\n", "waferline.sim.pipeline"),
])
def test_relative_imports_are_resolved(tmp_path, module, source, want):
    p = tmp_path / "m.py"
    p.write_text(source)
    assert want in imported(p, module)


def runtime_imports(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The waferline modules ``path`` imports at run time (lazy imports included, ``if TYPE_CHECKING:`` blocks not);
    ``from pkg import sub`` of a submodule depends on the submodule, not on the package's own code."""
    out = set()
    for base, items in _imports(path, module, typing_too=False):
        subs = {f"{base}.{n}" for n in items}
        out.update(subs & modules.keys())
        if not subs or not subs <= modules.keys():
            out.add(base)
    return {m for m in out if m in modules and m != module}


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Every set of modules that import each other, directly or through others (strongly connected components)."""
    graph = {m: runtime_imports(p, m, modules) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert import_cycles(_modules()) == []


def test_the_cycle_check_sees_a_lazy_circle(tmp_path):
    """The negative control: two modules that import each other, one of them inside a function, are a cycle; an
    import under ``if TYPE_CHECKING:`` is not."""
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("from waferline.x.b import f\n")
    b.write_text("def f():\n    from waferline.x.a import g\n    return g\n")
    c.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from waferline.x.a import g\n")
    mods = {"waferline.x.a": a, "waferline.x.b": b, "waferline.x.c": c}
    assert import_cycles(mods) == [["waferline.x.a", "waferline.x.b"]]
    c.write_text("from waferline.x.a import g\n")
    assert import_cycles(mods) == [["waferline.x.a", "waferline.x.b"]]  # c imports into the circle, not part of it


ENGINE_MAX_LINES = 500


def long_files(root: Path, limit: int) -> list[str]:
    """The Python files under ``root`` with more than ``limit`` lines, with their line counts."""
    return [f"{p.relative_to(root)}: {n} lines" for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > limit]


def test_no_engine_file_is_over_500_lines():
    """The engine stays in files one can read whole: none over 500 lines."""
    assert long_files(SRC / "waferline" / "engine", ENGINE_MAX_LINES) == []


def test_the_length_check_sees_a_long_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * 501)
    (tmp_path / "short.py").write_text("x = 1\n" * 500)
    assert long_files(tmp_path, ENGINE_MAX_LINES) == ["sub/long.py: 501 lines"]
