"""Who runs where. ``launch_colocated`` returns the actor and the rollout engine of a colocated run:
in this process for a world of one (``local``), or as Ray actors sharing each GPU (``ray``).
``launch`` picks by placement.mode; a disaggregated run always runs on Ray (placement.launcher is
a colocated choice), actor and engines on separate placement groups (``disaggregated``)."""

from __future__ import annotations

from colocate_rl.config import Config, actor_world_size


def launcher(cfg: Config) -> str:
    """local for a world of one (Ray's start-up would dominate a tiny CPU run), else ray."""
    if cfg.placement.launcher != "auto":
        return cfg.placement.launcher
    return "local" if actor_world_size(cfg) == 1 and cfg.placement.nnodes == 1 else "ray"


def launch_colocated(cfg: Config):
    if launcher(cfg) == "local":
        from colocate_rl.placement.local import launch
    else:
        from colocate_rl.placement.ray_colocated import launch
    return launch(cfg)


def launch(cfg: Config):
    if cfg.placement.mode == "disaggregated":
        from colocate_rl.placement.disaggregated import launch as launch_disaggregated

        return launch_disaggregated(cfg)
    return launch_colocated(cfg)
