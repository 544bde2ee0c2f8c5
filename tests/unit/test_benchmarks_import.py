"""Every benchmark script imports as a module (its main not run), and what it takes from the package
is still there: each name a script imports from colocate_rl (at the top or inside a function), each
attribute it reads off a colocate_rl module, each call of those with the arguments it passes, and
each name it imports from the project's own helper modules (benchmarks/common, tests/batches.py, a
sibling script). Most benchmarks run on GPUs only, so a renamed or moved API fails here first."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").rglob("*.py"))
# Scripts that run in another venv: only their names are checked here.
OTHER_VENV = {"benchmarks/peers/trl_runner.py": "trl"}  # TRL's side of the peers/ comparison
LOADED_BY_PEER = {"benchmarks/peers/verl_reward.py": "compute_score"}  # verl calls this, not a main
# Where a script's own imports resolve, besides the package: its folder (as `python script.py`
# puts it on sys.path) and the folders the scripts add themselves.
LOCAL_ROOTS = (ROOT / "benchmarks", ROOT / "tests", ROOT / "tests" / "gpu")


@pytest.fixture(autouse=True)
def environment_kept():
    """A script may set variables for its own process as it imports (exact_ops_gpu.py turns on
    vLLM's batch-invariant mode): the tests after it, in this process, must not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def rel(script: Path) -> str:
    return script.relative_to(ROOT).as_posix()


def test_the_benchmarks_are_found():
    assert {"benchmarks/step/handoff.py", "benchmarks/sync/weight_sync.py", "benchmarks/peers/cpu_vs_trl.py",
            "benchmarks/gap/dsv4_parity_gpu.py"} <= {rel(s) for s in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=rel)
def test_imports_as_a_module(script: Path):
    if rel(script) in OTHER_VENV and importlib.util.find_spec(OTHER_VENV[rel(script)]) is None:
        pytest.skip(f"runs in {OTHER_VENV[rel(script)]}'s own venv")
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    sys.path.insert(0, str(script.parent))
    try:
        spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:  # the scripts' helpers: not left for other tests
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(ROOT / "benchmarks")):
                del sys.modules[name]
    entry = LOADED_BY_PEER.get(rel(script), "main")
    assert callable(getattr(module, entry, None)) or rel(script).startswith("benchmarks/common/")


@pytest.mark.parametrize("script", SCRIPTS, ids=rel)
def test_what_it_takes_from_the_project_exists(script: Path):
    problems = project_names(script)
    assert not problems, f"{rel(script)}:\n" + "\n".join(problems)


# ---------------------------------------------------------------- the checks


def project_names(script: Path) -> list[str]:
    """One line per name the script reads from the project that is not there."""
    tree = ast.parse(script.read_text())
    problems = []
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        bound = {}  # name -> object, for what this scope imports from colocate_rl
        for node in direct_imports(scope):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                where = f"line {node.lineno}"
                if isinstance(node, ast.Import):
                    missing = importable(alias.name, where) if alias.name.startswith("colocate_rl.") else []
                    problems += missing
                    if alias.asname and alias.name.startswith("colocate_rl.") and not missing:
                        bound[name] = importlib.import_module(alias.name)
                elif node.level == 0 and node.module and node.module.split(".")[0] == "colocate_rl":
                    obj, problem = package_name(node.module, alias.name)
                    problems += [f"{where}: {problem}"] if problem else []
                    if obj is not None:
                        bound[name] = obj
                elif node.level == 0 and node.module:
                    problems += local_name(script, node.module, alias.name, where)
        problems += uses(scope, bound)
    return problems


def direct_imports(scope: ast.AST):
    """The imports of ``scope`` itself (a module's or a function's, not its nested functions')."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def importable(module: str, where: str) -> list[str]:
    try:
        importlib.import_module(module)
    except ImportError as e:
        return [f"{where}: import {module}: {e}"]
    return []


def package_name(module: str, name: str):
    """(the object ``from module import name`` gives, or None; what is wrong, or '')."""
    problems = importable(module, "")
    if problems:
        return None, problems[0].lstrip(": ")
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        try:  # a submodule not yet imported
            return importlib.import_module(f"{module}.{name}"), ""
        except ImportError:
            return None, f"{module} has no {name}"
    return getattr(mod, name), ""


def local_name(script: Path, module: str, name: str, where: str) -> list[str]:
    """A project helper module's top-level name (read, not imported: tests/gpu modules skip on CPU)."""
    parts = module.split(".")
    for root in (script.parent, *LOCAL_ROOTS):
        path = root.joinpath(*parts).with_suffix(".py")
        if path.is_file():
            return [] if name in top_level_names(path) else [f"{where}: {module} ({rel(path)}) has no {name}"]
    return []  # not the project's: a library


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
    return names


def uses(scope: ast.AST, bound: dict) -> list[str]:
    """Attributes read off the modules in ``bound``, and calls of what ``bound`` holds, checked: the
    attribute exists, the call's arguments bind to the signature."""
    problems = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            owner = bound[node.value.id]
            if inspect.ismodule(owner) and not hasattr(owner, node.attr):
                problems.append(f"line {node.lineno}: {owner.__name__} has no {node.attr}")
        if isinstance(node, ast.Call):
            target = called(node.func, bound)
            if target is not None and (problem := unbindable(target, node)):
                problems.append(f"line {node.lineno}: {ast.unparse(node.func)}(...): {problem}")
    return problems


def called(func: ast.expr, bound: dict):
    if isinstance(func, ast.Name):
        return bound.get(func.id)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in bound:
        owner = bound[func.value.id]
        return getattr(owner, func.attr, None) if inspect.ismodule(owner) else None
    return None


def unbindable(target, call: ast.Call) -> str:
    """Why the call's arguments do not fit ``target``'s signature ('' when they do, or when the call
    passes *args / **kwargs, which only the run can count)."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return ""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without one
        return ""
    try:
        sig.bind(*call.args, **{k.arg: k.value for k in call.keywords})
    except TypeError as e:
        return str(e)
    return ""
