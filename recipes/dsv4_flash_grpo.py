"""GRPO on DeepSeek-V4-Flash (mHC, compressed sparse attention, hash-routed + noaux_tc MoE).

    python recipes/dsv4_flash_grpo.py                    # preset=tiny: CPU, a tiny DeepSeek-V4 learns, minutes
    python recipes/dsv4_flash_grpo.py preset=amd-3node   # the published disaggregated run
    python recipes/dsv4_flash_grpo.py preset=colocated   # the same model, colocated on 8 GPUs
"""

import sys
from pathlib import Path

from colocate_rl.cli import main, preset_config
from colocate_rl.config import Config

PRESETS = Path(__file__).with_suffix(".yaml")


def config(preset: str = "tiny") -> Config:
    return preset_config(PRESETS, preset, recipe="dsv4_flash_grpo")


if __name__ == "__main__":
    main(config, sys.argv[1:])
