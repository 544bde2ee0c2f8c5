"""GRPO on DeepSeek-V4-Flash (mHC, compressed sparse attention, hash-routed + noaux_tc MoE).

    python recipes/dsv4_flash_grpo.py preset=tiny        # CPU, the tiny DeepSeek-V4, minutes
    python recipes/dsv4_flash_grpo.py preset=amd-3node   # the published disaggregated run
    python recipes/dsv4_flash_grpo.py preset=colocated   # the same model, colocated on 8 GPUs

Some settings of the published run have no config field yet. NEEDS lists them per preset as
(capability, config field, value): while a field is missing the preset stops in one line naming
what is missing, before anything loads (``dry_run=true`` still prints its memory plan); once the
field exists the value is applied. A preset never runs a quietly different setup.
"""

import sys
from pathlib import Path

from colocate_rl.cli import main, preset_config
from colocate_rl.config import Config

PRESETS = Path(__file__).with_suffix(".yaml")

_PUBLISHED = [
    ("FP8 rollout weights (per-block e4m3, quantised on sync)", "rollout.weight_quantization", "fp8"),
    ("R3 routing replay (rollout expert choices replayed in training)", "rollout.routing_replay", True),
    ("sequence parallelism", "actor.sequence_parallel", True),
    ("Adam state offloaded to CPU", "actor.optimizer_cpu_offload", True),
    ("BF16 Adam moments", "actor.optimizer_state_dtype", "bfloat16"),
    ("256 MiB streamed-Adam chunks", "actor.optimizer_chunk_mb", 256),
]
NEEDS = {
    "amd-3node": _PUBLISHED,
    # 284B parameters with fp32 gradients, master weights and Adam state (~16 bytes each) do not fit
    # 8 GPUs: the optimizer state has to live on the host.
    "colocated": [("Adam state offloaded to CPU", "actor.optimizer_cpu_offload", True),
                  ("BF16 Adam moments", "actor.optimizer_state_dtype", "bfloat16")],
}


def _has_field(dotted: str) -> bool:
    obj = Config()
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def missing(preset: str) -> list[str]:
    """Capabilities ``preset`` needs that colocate_rl does not have (checked without loading anything heavy)."""
    gaps = [f"{what} ({field})" for what, field, _ in NEEDS.get(preset, []) if not _has_field(field)]
    if preset == "amd-3node":
        from colocate_rl.models.deepseek_v4 import check_parallel
        from colocate_rl.models.deepseek_v4.synth import official_config

        for tp, pp, what in ((1, 4, "pipeline parallelism for deepseek_v4 (actor.pp=4)"),
                             (4, 1, "tensor parallelism for deepseek_v4 (actor.tp=4)")):
            try:
                # A shape actor.tp=4 divides, as it does the released 64 heads and 8 o-groups.
                check_parallel(official_config(num_attention_heads=4, o_groups=4), tp, pp, 1, sequence_parallel=tp > 1)
            except ValueError:
                gaps.append(what)
        import importlib.util

        if importlib.util.find_spec("colocate_rl.placement.disaggregated") is None:
            gaps.insert(0, "disaggregated placement (placement.mode=disaggregated)")
    return gaps


def gaps(cfg: Config) -> str:
    """'' when colocate_rl has everything the preset needs, else one line naming what it lacks."""
    lacking = missing(cfg.preset)
    return f"preset {cfg.preset} needs what colocate_rl does not have yet: {'; '.join(lacking)}" if lacking else ""


def config(preset: str = "tiny") -> Config:
    cfg = preset_config(PRESETS, preset, recipe="dsv4_flash_grpo")
    for _, field, value in NEEDS.get(preset, []):
        *path, leaf = field.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, leaf, value)
    return cfg


if __name__ == "__main__":
    main(config, sys.argv[1:], gaps=gaps)
