"""Every results file under benchmarks/results/ (archive/ aside) is cited by README.md,
benchmarks/README.md or a page under docs/, and every results file those cite exists: in results/,
or in results/archive/ for a run a later one replaced. A citation is a file name that names a
machine kind (h200, h100, cpu, cuda) or a path under benchmarks/results/; ``{a,b}`` and ``*`` in a cited
name stand for each name they match, as in the shell."""

from __future__ import annotations

import fnmatch
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

_NAME = re.compile(r"[\w.\-{},*/]+?\.(?:json|txt|log)\b|[\w.\-/]+_(?:raw|logs)\b")
_MACHINE = ("h200", "h100", "cpu", "cuda")


def _docs(root: Path) -> list[Path]:
    return [root / "README.md", root / "benchmarks" / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _expand(name: str) -> list[str]:
    """'a_{x,y}_b.json' -> ['a_x_b.json', 'a_y_b.json']."""
    parts = re.split(r"\{([^{}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def citations(texts: list[str]) -> set[str]:
    """Results files the texts cite, relative to benchmarks/results/ where a path says so, else by name."""
    out = set()
    for text in texts:
        for m in _NAME.finditer(text):
            token = m.group(0)
            rel = token.split("benchmarks/results/", 1)[1] if "benchmarks/results/" in token else token
            base = rel.rsplit("/", 1)[-1]
            if "benchmarks/results/" in token or rel.startswith("archive/") or any(k in base for k in _MACHINE):
                out.update(_expand(rel))
    return out


def check(results: Path, texts: list[str]) -> tuple[list[str], list[str]]:
    """(results entries no text cites, cited names that match no entry of results/ or results/archive/)."""
    current = sorted(p.name for p in results.iterdir() if p.name != "archive")
    archived = sorted(p.name for p in (results / "archive").iterdir()) if (results / "archive").is_dir() else []
    cited = citations(texts)
    by_name = {c.rsplit("/", 1)[-1] for c in cited if not c.startswith("archive/")}
    uncited = [n for n in current if not any(fnmatch.fnmatchcase(n, c) for c in by_name)]
    missing = []
    for c in sorted(cited):
        pool = archived if c.startswith("archive/") else current + archived
        if not any(fnmatch.fnmatchcase(n, c.rsplit("/", 1)[-1]) for n in pool):
            missing.append(c)
    return uncited, missing


def test_every_results_file_is_cited_and_every_citation_exists():
    texts = [p.read_text() for p in _docs(ROOT)]
    assert len(citations(texts)) > 50  # the docs were read and their citations found
    uncited, missing = check(RESULTS, texts)
    assert not uncited, f"results files cited nowhere in README.md, benchmarks/README.md or docs/: {uncited}"
    assert not missing, f"cited results files that do not exist: {missing}"


def test_the_check_finds_an_uncited_file_and_a_citation_of_nothing(tmp_path):
    (tmp_path / "archive").mkdir()
    for name in ("step_h200.json", "loop_false_h200.json", "loop_true_h200.json", "archive/old_h200.json",
                 "alone_cpu.json"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "pairs_h200_logs").mkdir()
    prefix = "benchmarks/results/"  # a path as the docs write one
    text = ("`step_h200.json`, `loop_{false,true}_h200.json`, `archive/old_h200.json`, "
            f"[logs]({prefix}pairs_h200_logs), `gone_h200.json`, `archive/step_h200.json`, "
            "config.json and metrics.jsonl are no results")
    uncited, missing = check(tmp_path, [text])
    assert uncited == ["alone_cpu.json"]
    assert missing == ["archive/step_h200.json", "gone_h200.json"]
