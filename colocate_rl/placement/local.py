"""A colocated run in one process: the Megatron actor (a world of one) and an in-process vLLM
engine share the device; weights still travel as IPC handles (shared memory on CPU)."""

from __future__ import annotations

from colocate_rl.config import Config, actor_world_size
from colocate_rl.rollout import RolloutEngine
from colocate_rl.trainer import Actor


def launch(cfg: Config):
    if actor_world_size(cfg) != 1:
        raise ValueError(f"placement.launcher=local runs a world of one; this layout needs "
                         f"{actor_world_size(cfg)} actor ranks: use placement.launcher=ray")
    actor = Actor(cfg)
    # The rollout owns the device first: the actor starts offloaded, vLLM profiles free memory.
    actor.offload()
    rollout = RolloutEngine(cfg, cfg.model.path)
    return actor, rollout
