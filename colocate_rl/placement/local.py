"""A colocated run in one process: the Megatron actor (a world of one) and an in-process engine
share the device; weights still travel as IPC handles (shared memory on CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from colocate_rl import platform
from colocate_rl.config import PlacementConfig
from colocate_rl.placement.colocated import engine_quantization, immediate_buffer
from colocate_rl.rollout.agent import Turns
from colocate_rl.rollout.base import Rollout
from colocate_rl.rollout.buffer import ImmediateBuffer
from colocate_rl.weight_sync.ipc import SyncStats
from colocate_rl.weight_sync.quantize import quantize_named
from colocate_rl.weight_sync.verify import compare
from colocate_rl.workers import Actor, Build, OnRollout


@dataclass
class LocalColocated:
    actor: Actor
    rollout: Rollout
    make_rollout: Callable[[], Rollout]
    quantized: dict[str, str]  # weight -> the quantized layout the engine holds it in (weight_sync.quantize)

    def sync(self, bucket_mb: float = 256) -> SyncStats:
        """The actor's weights → the engine; those it holds quantized are quantized here, on the
        actor's device, before they are packed (rollout.weight_quantization=fp8)."""
        return self.rollout.update_weights(quantize_named(self.actor.export_hf_weights(), self.quantized), bucket_mb)

    def verify(self) -> int:
        sums = self.actor.weight_checksums()
        return compare(sums, self.rollout.checksum(list(sums)))

    def restart_rollout(self) -> None:
        try:
            self.rollout.shutdown()
        except Exception:  # noqa: BLE001 - a dead engine may fail to shut down; its processes are gone
            pass
        self.rollout = self.make_rollout()

    def drain(self) -> None:
        pass

    def make_buffer(self, on_rollout: OnRollout, turns: Turns) -> ImmediateBuffer:
        return immediate_buffer(self, on_rollout, turns)

    def device_used(self) -> Optional[int]:
        return platform.device_used()

    def shutdown(self) -> None:
        self.rollout.shutdown()


def launch(pl: PlacementConfig, build: Build) -> LocalColocated:
    actor = build.make_actor()
    # What the plan keeps off the device while vLLM runs leaves before the engine starts and sizes
    # its KV cache; the rest stays (placement/base.py launch).
    actor.offload(build.resolved.offload)
    rollout = build.make_rollout()
    return LocalColocated(actor, rollout, build.make_rollout, engine_quantization(rollout))
