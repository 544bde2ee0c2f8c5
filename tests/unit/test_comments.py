"""Comments and docstrings in colocate_rl/ say what and why; the figures behind them live in the docs
(docs/performance.md, docs/lab/performance_log.md, ...). A comment or docstring that names a
results file (anything under benchmarks/results, or a ``*_h200.json`` / ``*_cpu.json`` style name)
or a machine (H200, MI300X, ...) fails here. Only the prose is read: a machine's name as code (the
accelerators ``placement.accelerator`` offers, in memory.ACCELERATORS) is a choice the code makes."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from colocate_rl.memory import ACCELERATORS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "colocate_rl"
RESULTS = ROOT / "benchmarks" / "results"
MACHINES = sorted(set(ACCELERATORS) | {"a100", "a800", "h800", "b300", "gb200", "gb300", "l40s", "v100", "mi250"},
                  key=len, reverse=True)
MACHINE = re.compile(r"\b(" + "|".join(MACHINES) + r")\b", re.IGNORECASE)
FILE_NAME = re.compile(r"[\w.{},*-]+\.(?:json|txt|log)\b")
RESULTS_STYLE = re.compile(r"_(cpu|cuda|gpu|" + "|".join(MACHINES) + r")\b", re.IGNORECASE)


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment (tokenize) and every string statement, docstrings among them
    (ast), of one source file."""
    src = path.read_text()
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out += [(node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
    return out


def results_files(text: str, results: set[str]) -> list[str]:
    """The results files ``text`` names: a path under benchmarks/results, a file found there, or a
    file name carrying a device or machine (``handoff_auto_h200_256.json``, ``export_cpu.json``)."""
    found = ["benchmarks/results"] if "benchmarks/results" in text else []
    return found + [name for name in FILE_NAME.findall(text)
                    if Path(name).name in results or RESULTS_STYLE.search(name)]


def offenders(check) -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in prose(path):
            if hits := check(text):
                out.append(f"{path.relative_to(ROOT)}:{line}: {', '.join(hits)}: {text.strip()}")
    return out


def test_comments_name_no_results_file():
    names = {p.name for p in RESULTS.rglob("*")}
    found = offenders(lambda text: results_files(text, names))
    assert not found, "say what and why, and link the doc that holds the figure:\n" + "\n".join(found)


def test_comments_name_no_machine():
    found = offenders(MACHINE.findall)
    assert not found, "say what and why, and link the doc that holds the figure:\n" + "\n".join(found)


def test_every_comment_and_docstring_is_read():
    config = dict((line, text) for line, text in prose(PACKAGE / "config.py"))
    assert any(text.startswith("# Sequences per forward/backward") for text in config.values())  # a comment
    assert any("A recipe is a function returning a ``Config``" in text for text in config.values())  # a docstring
    assert len([p for p in PACKAGE.rglob("*.py") if prose(p)]) > 100


def test_the_checks_tell_prose_from_code():
    names = {p.name for p in RESULTS.rglob("*")}
    assert results_files("on one GPU (benchmarks/results/handoff_h200.json)", names)
    assert results_files("(handoff_onload_overlap_{false,true}_h200.json)", names) == \
        ["handoff_onload_overlap_{false,true}_h200.json"]
    assert results_files("0.74x the operators (norm_kernel_ops_cpu.json)", names)
    assert results_files("its config.json, then metadata.json; benchmarks/gap/lp_gap_cpu.py measures it", names) == []
    assert MACHINE.findall("measured on an H200 and an MI300X") == ["H200", "MI300X"]
    assert MACHINE.findall("placement.accelerator names another; hidden 128") == []
    # memory.py offers the accelerators as code, and its prose names none of them.
    source = (PACKAGE / "memory.py").read_text()
    assert '"h200": 141' in source and not any(MACHINE.search(text) for _, text in prose(PACKAGE / "memory.py"))
