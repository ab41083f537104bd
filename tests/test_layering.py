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


def imported(path: Path, module: str) -> set[str]:
    """Every waferline module name ``path`` imports, at any depth (relative imports resolved)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
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
