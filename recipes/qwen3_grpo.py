"""GRPO on Qwen3 dense models.

    python recipes/qwen3_grpo.py preset=tiny                 # CPU, minutes
    python recipes/qwen3_grpo.py preset=qwen3-8b actor.lr=2e-6
"""

import sys
from pathlib import Path

from colocate_rl.cli import main, preset_config
from colocate_rl.config import Config

PRESETS = Path(__file__).with_suffix(".yaml")


def config(preset: str = "tiny") -> Config:
    return preset_config(PRESETS, preset, recipe="qwen3_grpo")


if __name__ == "__main__":
    main(config, sys.argv[1:])
