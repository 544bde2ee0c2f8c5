"""Command line of the recipes: ``python recipes/X.py preset=NAME [file.yaml] [key=value ...]``.

Before anything heavy loads: the config is merged and validated, the device chosen, the plan
(layout, memory per GPU and phase) printed with the resolved config. ``dry_run=true`` stops there.
Every mistake a user can make in the config ends the run in one line, not a traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from colocate_rl.config import Config, ConfigError, load, print_config, split_cli
from colocate_rl.console import Quiet
from colocate_rl.private import private_dir
from colocate_rl.supervise import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_NONFINITE, supervise


def preset_config(yaml_path: Path, preset: str, recipe: str) -> Config:
    """The dataclass defaults merged with one preset section of the recipe's YAML."""
    presets = OmegaConf.load(yaml_path)
    if preset not in presets:
        raise ConfigError(f"preset={preset!r} is not one of {', '.join(presets.keys())} ({yaml_path.name})")
    node = OmegaConf.merge(OmegaConf.structured(Config), presets[preset], {"recipe": recipe, "preset": preset})
    return OmegaConf.to_object(node)  # type: ignore[return-value]


def check_hardware(cfg: Config) -> None:
    """Fail in one line, before anything heavy loads, when this machine cannot run the placement."""
    from colocate_rl import platform

    need = cfg.placement.gpus_per_node
    have = platform.machine_gpus() if need else 0
    if need > have and not cfg.dry_run:
        where = f"{cfg.placement.nnodes} node(s) x {need} GPUs" if cfg.placement.nnodes > 1 else f"{need} GPUs"
        raise SystemExit(
            f"error: preset {cfg.preset or '(custom)'} needs {where} per node; this machine has {have} "
            f"({platform.kind()}). Try preset=tiny, or dry_run=true to see its plan.")


def _fail(e: BaseException | str, code: int) -> SystemExit:
    """``error: <message>`` on stderr, as one line whatever the message holds, and the exit code."""
    line = " ".join(str(e).split("\n"))
    print(f"error: {line}", file=sys.stderr, flush=True)
    return SystemExit(code)


def main(config_fn, argv: list[str]) -> dict:
    """The run of ``argv`` (a recipe's command line), with a quiet console (console.py) unless
    logging.verbose=true. Quiet from the start: loading the config may load torch, which reads
    TORCH_CPP_LOG_LEVEL then (placement.gpus_per_node=-1 counts the GPUs)."""
    with Quiet() as quiet:
        cfg = _load(config_fn, argv)
        if cfg.logging.verbose:
            quiet.close()
        return _main(cfg, argv, None if cfg.logging.verbose else quiet)


def _load(config_fn, argv: list[str]) -> Config:
    preset = next((a.split("=", 1)[1] for a in argv if a.startswith("preset=")), "tiny")
    files, overrides = split_cli([a for a in argv if not a.startswith("preset=")])
    try:
        return load(config_fn(preset), files=files, overrides=overrides)
    except ConfigError as e:
        raise _fail(e, EXIT_CONFIG) from None


def _main(cfg: Config, argv: list[str], quiet: Quiet | None) -> dict:
    if cfg.placement.gpus_per_node == 0:
        from colocate_rl import platform

        platform.hide_gpus()  # 0 means the CPU, for the actor and the engines, even on a GPU machine
    check_hardware(cfg)
    print_config(cfg)
    from colocate_rl.plan import resolve

    try:
        plan = resolve(cfg, strict=not cfg.dry_run)
    except ConfigError as e:
        raise _fail(e, EXIT_CONFIG) from None
    print(plan.describe(), flush=True)
    if cfg.dry_run:
        return {"plan": plan}
    if cfg.supervise.max_restarts and not os.environ.get("COLOCATE_RL_ATTEMPT"):
        raise SystemExit(supervise(cfg, plan.resolved.run_name, argv))
    from colocate_rl.loop import run  # heavy imports (vLLM, megatron-core) only after the checks

    if quiet:
        quiet.to_file(private_dir(Path(cfg.logging.run_dir) / plan.resolved.run_name))
    try:
        return run(cfg, plan)
    except ConfigError as e:  # found once the model folder exists (e.g. a tokenizer that does not fit)
        raise _fail(e, EXIT_CONFIG) from None
    except FloatingPointError as e:  # the NaN stop: restarting would only repeat it
        raise _fail(e, EXIT_NONFINITE) from None
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    except Exception as e:  # a crash: its traceback in the run's log, unless the console shows everything
        if quiet is None:
            raise
        raise _fail(quiet.crashed(e), 1) from None


if __name__ == "__main__":
    sys.exit("usage: python recipes/<recipe>.py preset=NAME [key=value ...]")
