"""Command line of the recipes: ``python recipes/X.py preset=NAME [file.yaml] [key=value ...]``."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from omegaconf import OmegaConf

from colocate_rl.config import Config, ConfigError, load, print_config, split_cli


def preset_config(yaml_path: Path, preset: str, recipe: str) -> Config:
    """The dataclass defaults merged with one preset section of the recipe's YAML."""
    presets = OmegaConf.load(yaml_path)
    if preset not in presets:
        raise ConfigError(f"preset={preset!r} is not one of {', '.join(presets.keys())} ({yaml_path.name})")
    node = OmegaConf.merge(OmegaConf.structured(Config), presets[preset], {"recipe": recipe, "preset": preset})
    return OmegaConf.to_object(node)  # type: ignore[return-value]


def check_hardware(cfg: Config) -> None:
    """Fail in one line, before anything heavy loads, when this machine cannot run the placement."""
    import torch

    from colocate_rl import platform

    need = cfg.placement.gpus_per_node
    have = torch.cuda.device_count() if platform.has_gpu() else 0
    if need > have:
        where = f"{cfg.placement.nnodes} node(s) x {need} GPUs" if cfg.placement.nnodes > 1 else f"{need} GPUs"
        raise SystemExit(
            f"error: preset {cfg.preset or '(custom)'} needs {where} per node; this machine has {have} "
            f"({platform.kind()}). Try preset=tiny, or set placement.gpus_per_node."
        )


def main(config_fn, argv: list[str]) -> dict:
    preset = next((a.split("=", 1)[1] for a in argv if a.startswith("preset=")), "tiny")
    rest = [a for a in argv if not a.startswith("preset=")]
    files, overrides = split_cli(rest)
    try:
        cfg = load(config_fn(preset), files=files, overrides=overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    check_hardware(cfg)
    print_config(cfg)
    # megatron-core warns once per missing optional kernel package (TE, apex); vLLM logs each engine
    # call at INFO and, on CPU, warns at every in-place reload that the rotary embedding has no
    # weights to load: keep the console to the run's own lines unless VLLM_LOGGING_LEVEL says otherwise.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from colocate_rl.loop import run  # heavy imports (vLLM, megatron-core) only after the checks

    return run(cfg)


if __name__ == "__main__":
    sys.exit("usage: python recipes/<recipe>.py preset=NAME [key=value ...]")
