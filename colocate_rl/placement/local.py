"""A colocated run in one process: the Megatron actor (a world of one) and an in-process vLLM
engine share the device; weights still travel as IPC handles (shared memory on CPU)."""

from __future__ import annotations

from dataclasses import dataclass

from colocate_rl.config import Config, actor_world_size
from colocate_rl.rollout import RolloutEngine
from colocate_rl.trainer import Actor
from colocate_rl.weight_sync.ipc import SyncStats
from colocate_rl.weight_sync.verify import compare, verifiable_checksums


@dataclass
class LocalColocated:
    actor: Actor
    rollout: RolloutEngine

    def sync(self, bucket_mb: float = 256) -> SyncStats:
        return self.rollout.update_weights(self.actor.export_hf_weights(), bucket_mb)

    def verify(self) -> int:
        """Checksums of a few tensors inside the engine equal the actor's; returns how many were checked."""
        sums = verifiable_checksums(self.actor.export_hf_weights())
        compare(sums, self.rollout.checksum(list(sums)))
        return len(sums)

    def restart_rollout(self) -> None:
        """A fresh engine in place of a dead one (it loads the model folder's weights: sync after)."""
        try:
            self.rollout.shutdown()
        except Exception:  # noqa: BLE001 - a dead engine may fail to shut down; its processes are gone
            pass
        self.rollout = RolloutEngine(self.rollout.cfg, self.rollout.model_path)

    def shutdown(self) -> None:
        self.rollout.shutdown()


def launch(cfg: Config) -> LocalColocated:
    if actor_world_size(cfg) != 1:
        raise ValueError(f"placement.launcher=local runs a world of one; this layout needs "
                         f"{actor_world_size(cfg)} actor ranks: use placement.launcher=ray")
    actor = Actor(cfg)
    # The rollout owns the device first: the actor starts offloaded, vLLM profiles free memory.
    actor.offload()
    if cfg.rollout.backend == "transformers":
        from colocate_rl.rollout.hf_generate import TransformersRollout

        return LocalColocated(actor, TransformersRollout(cfg, cfg.model.path))
    return LocalColocated(actor, RolloutEngine(cfg, cfg.model.path))
