"""Components take their own config sections and the plan's record (resolved.py), never the whole
``Config``: only the run's top (loop, session, plan, cli, supervise) and config.py itself take it. A
public function, a constructor or a dataclass field below them whose annotation names ``Config``,
or a parameter ``cfg`` without an annotation, fails here; so does a ``Resolved`` built anywhere but
in plan.resolve."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "colocate_rl"
TOP = {"loop", "session", "plan", "cli", "supervise", "config"}
WHOLE = re.compile(r"(?<![A-Za-z0-9_])Config\b")  # Config, C.Config, Optional[Config]; not RolloutConfig


def _whole_config(annotation) -> bool:
    return annotation is not None and bool(WHOLE.search(ast.unparse(annotation)))


def _params(fn) -> list[ast.arg]:
    a = fn.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]


def _takes_config(fn) -> list[str]:
    return [p.arg for p in _params(fn) if _whole_config(p.annotation) or (p.arg == "cfg" and p.annotation is None)]


def _public(name: str) -> bool:
    return not name.startswith("_") or name == "__init__"


def violations(root: Path = PKG) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0].removesuffix(".py") in TOP:
            continue
        where = path.relative_to(root.parent)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(node.name):
                bad += [f"{where}: {node.name}({p})" for p in _takes_config(node)]
            elif isinstance(node, ast.ClassDef) and _public(node.name):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(item.name):
                        bad += [f"{where}: {node.name}.{item.name}({p})" for p in _takes_config(item)]
                    elif isinstance(item, ast.AnnAssign) and _whole_config(item.annotation):
                        bad.append(f"{where}: {node.name}.{ast.unparse(item.target)}: {ast.unparse(item.annotation)}")
    return bad


def test_no_component_takes_the_whole_config():
    assert violations() == []


def test_the_check_catches_a_component_that_does(tmp_path):
    pkg = tmp_path / "colocate_rl"
    (pkg / "trainer").mkdir(parents=True)
    (pkg / "trainer" / "bad.py").write_text(
        "from colocate_rl import config as C\n"
        "class Actor:\n    def __init__(self, cfg: 'C.Config'): ...\n"
        "class Held:\n    cfg: Config\n"
        "def build(model: ModelConfig, cfg): ...\n"
        "def fine(model: ModelConfig, rollout: RolloutConfig): ...\n")
    (pkg / "plan.py").write_text("def resolve(cfg: Config): ...\n")  # the top may
    assert violations(pkg) == ["colocate_rl/trainer/bad.py: Actor.__init__(cfg)",
                               "colocate_rl/trainer/bad.py: Held.cfg: Config",
                               "colocate_rl/trainer/bad.py: build(cfg)"]


def _record_builders(root: Path) -> list[str]:
    """Where the package constructs a ``Resolved`` (by name or as ``module.Resolved``)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and "Resolved" in (getattr(node.func, "id", None),
                                                              getattr(node.func, "attr", None)):
                out.append(str(path.relative_to(root.parent)))
    return out


def test_only_the_plan_fills_the_record(tmp_path):
    assert _record_builders(PKG) == ["colocate_rl/plan.py"]
    (tmp_path / "colocate_rl").mkdir()
    (tmp_path / "colocate_rl" / "trainer.py").write_text("from colocate_rl import resolved\nr = resolved.Resolved()\n")
    assert _record_builders(tmp_path / "colocate_rl") == ["colocate_rl/trainer.py"]
