"""docs/recipes.md shows every preset's memory plan as scripts/preset_plans.py prints it today: a
preset or a planner change that moves a plan fails here until the page is regenerated."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_recipes_page_shows_current_plans():
    spec = importlib.util.spec_from_file_location("preset_plans", ROOT / "scripts" / "preset_plans.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    page = (ROOT / "docs" / "recipes.md").read_text()
    blocks = mod.blocks([])
    assert len(blocks) >= 10
    stale = [b.splitlines()[0] for b in blocks if b not in page]
    assert not stale, f"docs/recipes.md: plans differ from scripts/preset_plans.py for {stale}; paste its output"
