"""A colocated run in one process: the Megatron actor (a world of one) and an in-process engine
share the device; weights still travel as IPC handles (shared memory on CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from colocate_rl.config import Config
from colocate_rl.handoff import ColocatedHandoff, measure_device
from colocate_rl.placement.base import engine_quantization, immediate_buffer
from colocate_rl.rollout.base import Rollout, make_rollout
from colocate_rl.rollout.buffer import ImmediateBuffer
from colocate_rl.trainer import Actor
from colocate_rl.weight_sync.ipc import SyncStats
from colocate_rl.weight_sync.quantize import quantize_named
from colocate_rl.weight_sync.verify import compare


@dataclass
class LocalColocated:
    cfg: Config
    actor: Actor
    rollout: Rollout
    quantized: dict[str, str]  # weight -> the quantized layout the engine holds it in (weight_sync.quantize)
    handoff_class = ColocatedHandoff

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
        self.rollout = make_rollout(self.cfg)

    def drain(self) -> None:
        pass

    def make_buffer(self, handoff: Any) -> ImmediateBuffer:
        return immediate_buffer(self, handoff)

    def device_used(self) -> Optional[int]:
        used = measure_device()
        return used() if used else None

    def shutdown(self) -> None:
        self.rollout.shutdown()


def launch(cfg: Config, offload: Optional[Sequence[str]] = None) -> LocalColocated:
    actor = Actor(cfg)
    # What the plan keeps off the device while vLLM runs leaves before the engine starts and sizes
    # its KV cache; the rest stays (placement/base.py launch).
    actor.offload(offload)
    rollout = make_rollout(cfg)
    return LocalColocated(cfg, actor, rollout, engine_quantization(rollout))
