"""Layers import only downward (docs/architecture.md): a module may import its own layer or lower."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "colocate_rl"

# Top-level module or sub-package of colocate_rl -> layer.
LAYERS = {
    "types": 0, "config": 0, "resolved": 0, "errors": 0, "platform": 0, "faults": 0, "ports": 0, "private": 0,
    "console": 0,
    "algorithms": 1, "rewards": 1, "data": 1, "weight_sync": 1, "models": 1, "tools": 1,
    "trainer": 2, "rollout": 2,
    "memory": 3, "eval": 3, "metrics": 3, "workers": 3, "handoff": 3,
    "placement": 4, "plan": 4, "session": 4, "checkpoint": 4,
    "loop": 5, "cli": 5, "supervise": 5,
}
# Same-layer packages that must stay independent of each other.
FORBIDDEN = {("trainer", "rollout"), ("rollout", "trainer")}


def _unit(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _full_imports(path: Path) -> set[str]:
    """Every colocate_rl module path ``path`` imports (absolute form)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("colocate_rl.")}


def test_rollout_never_imports_model_family_code():
    """The rollout side asks the model family through the registry (models/registry.py); the
    families' own modules (qwen3, deepseek_v4, ...) are the trainer's and the registry's business."""
    def family_code(module: str) -> bool:
        return module.startswith("colocate_rl.models.") and not module.startswith("colocate_rl.models.registry")

    assert family_code("colocate_rl.models.deepseek_v4.synth") and not family_code("colocate_rl.models.registry")
    bad = [f"{p.relative_to(PKG.parent)} imports {m}" for p in sorted((PKG / "rollout").rglob("*.py"))
           for m in _full_imports(p) if family_code(m)]
    assert bad == []


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    pkg_parts = path.relative_to(PKG.parent).with_suffix("").parts
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = pkg_parts[: len(pkg_parts) - node.level]
                out.add(".".join(base + ((node.module,) if node.module else ())))
                if not node.module:
                    out |= {".".join(base + (a.name,)) for a in node.names}
            elif node.module:
                out.add(node.module)
                out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m.split(".")[1] for m in out if m.startswith("colocate_rl.") and len(m.split(".")) > 1}


def _violations(root: Path = PKG) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        unit = _unit(path)
        if unit == "__init__" or unit not in LAYERS:
            continue
        for dep in _imports(path):
            if dep not in LAYERS or dep == unit:
                continue
            if LAYERS[dep] > LAYERS[unit] or (unit, dep) in FORBIDDEN:
                bad.append(f"{path.relative_to(PKG.parent)} (layer {LAYERS[unit]}) imports colocate_rl.{dep} "
                           f"(layer {LAYERS[dep]})")
    return bad


def test_every_module_has_a_layer():
    units = {_unit(p) for p in PKG.rglob("*.py")} - {"__init__"}
    assert units <= set(LAYERS), f"modules without a layer: {sorted(units - set(LAYERS))}"


def test_layers_import_only_downward():
    assert _violations() == []


def test_checker_catches_an_upward_import(tmp_path):
    pkg = tmp_path / "colocate_rl"
    (pkg / "trainer").mkdir(parents=True)
    (pkg / "trainer" / "bad.py").write_text("from colocate_rl.rollout import engine\n")
    (pkg / "algorithms").mkdir()
    (pkg / "algorithms" / "bad.py").write_text("from ..loop import run\n")
    global PKG
    saved, PKG = PKG, pkg
    try:
        bad = _violations(pkg)
    finally:
        PKG = saved
    assert any("trainer/bad.py" in b and "rollout" in b for b in bad)
    assert any("algorithms/bad.py" in b and "loop" in b for b in bad)


def _back_imports(root: Path) -> list[tuple[str, str]]:
    """Pairs of modules that import each other (lazily too). A package's ``from pkg import sub`` is
    an import of its submodule, not of the package's ``__init__``."""
    names = {}
    for p in root.rglob("*.py"):
        name = ".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        names[name] = p
    graph = {}
    for name, path in names.items():
        deps = {m for m in _full_imports(path) if m in names and m != name}
        graph[name] = {d for d in deps if not any(x.startswith(f"{d}.") for x in deps)}
    return sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph.get(b, ())})


def test_no_two_modules_import_each_other():
    """A back-import (a module importing one that imports it, even inside a function) is a seam in the
    wrong place: what they share belongs to one of them, or to a module below both."""
    assert _back_imports(PKG) == []


def test_back_import_checker_catches_a_pair(tmp_path):
    pkg = tmp_path / "colocate_rl"
    (pkg / "weight_sync").mkdir(parents=True)
    (pkg / "weight_sync" / "fp8.py").write_text("def f():\n    from colocate_rl.weight_sync.quantize import plan\n")
    (pkg / "weight_sync" / "quantize.py").write_text("from colocate_rl.weight_sync import fp8\n")
    assert _back_imports(pkg) == [("colocate_rl.weight_sync.fp8", "colocate_rl.weight_sync.quantize")]
