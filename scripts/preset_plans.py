"""Prints the memory plan of every recipe preset (dry runs, nothing loads) as Markdown: the block
docs/recipes.md shows. Usage: .venv/bin/python scripts/preset_plans.py [placement.accelerator=NAME ...]"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from omegaconf import OmegaConf

from colocate_rl.config import ConfigError, load
from colocate_rl.plan import resolve

ROOT = Path(__file__).resolve().parents[1]
# A preset planned for hardware it names (GPU presets without an accelerator get the default).
ACCELERATOR = {("dsv4_flash_grpo", "amd-3node"): "mi308x", ("dsv4_flash_grpo", "mini"): "h200",
               ("dsv4_flash_grpo", "mini-1gpu"): "h200", ("dsv4_flash_grpo", "learn-mini"): "h200",
               ("dsv4_flash_grpo", "colocated"): "mi355x",
               ("qwen3_grpo", "qwen3-4b-1gpu"): "h100", ("qwen3_grpo", "qwen3-8b-2gpu"): "h200",
               ("qwen3_grpo", "learn-4b"): "h200", ("qwen3_moe_grpo", "learn-30b-a3b"): "h200"}


def recipe(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def blocks(extra: list[str]) -> list[str]:
    """Each preset's plan as the Markdown block docs/recipes.md shows."""
    out = []
    for name in ("qwen3_grpo", "qwen3_moe_grpo", "dsv4_flash_grpo"):
        mod = recipe(name)
        for preset in OmegaConf.load(mod.PRESETS):
            over = ["dry_run=true", *extra]
            acc = ACCELERATOR.get((name, preset))
            if acc and not any(o.startswith("placement.accelerator=") for o in extra):
                over.append(f"placement.accelerator={acc}")
            try:
                text = resolve(load(mod.config(preset), overrides=over), strict=False).describe()
            except ConfigError as e:
                text = f"error: {e}"
            lines = [ln for ln in text.splitlines() if not ln.startswith("  parts:")]
            out.append(f"`recipes/{name}.py preset={preset}`\n```\n" + "\n".join(lines) + "\n```\n")
    return out


def main(extra: list[str]) -> None:
    for block in blocks(extra):
        print(block)


if __name__ == "__main__":
    main(sys.argv[1:])
