"""pytest imports test modules by their file name (rootdir-based, no packages): two test files of
the same name in different tiers stop the whole suite at collection."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_names_are_unique_across_tiers():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert len(names) > 40, "the scan sees the test tree"
    assert [n for n, c in names.items() if c > 1] == []
