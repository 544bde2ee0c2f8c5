"""What a placement gives the run, and the placements by name.

A placement starts the actor ranks and the engines somewhere (this process, Ray actors sharing
GPUs, Ray placement groups of their own) and hands back a ``Workers``: the same handles whatever
the layout, so the loop and the handoff never ask where things run. Adding a placement is one
module with a ``launch(cfg, offload) -> Workers`` plus one line in ``PLACEMENTS``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

from colocate_rl.config import Config, layout
from colocate_rl.weight_sync.ipc import SyncStats


class Workers(Protocol):
    actor: Any  # trainer.Actor's methods: in this process, or every Ray rank at once (ActorGroup)
    rollout: Any  # rollout.base.Rollout: one engine, or a Router over several
    handoff_class: type  # handoff.ColocatedHandoff or handoff.DisaggregatedHandoff

    def sync(self, bucket_mb: float) -> SyncStats:
        """The actor's current weights → every engine."""

    def verify(self) -> int:
        """Engine checksums equal the actor's (raises WeightMismatch naming the tensor); returns how
        many tensors were compared (never 0)."""

    def restart_rollout(self) -> None:
        """A new engine in place of a dead one; it holds the model folder's weights until the next sync."""

    def drain(self) -> None:
        """Waits until no generation is in flight (a broadcast must not race one)."""

    def make_buffer(self, handoff: Any) -> Any:
        """Where the loop takes each step's batch from (rollout.buffer: request / get / drain / close)."""

    def device_used(self) -> Optional[int]:
        """Bytes in use on the first GPU, every process included (None on CPU)."""

    def shutdown(self) -> None: ...


# (placement.mode, launcher) -> "module:function" returning Workers.
PLACEMENTS: dict[tuple[str, str], str] = {
    ("colocated", "local"): "colocate_rl.placement.local:launch",
    ("colocated", "ray"): "colocate_rl.placement.ray_colocated:launch",
    ("disaggregated", "ray"): "colocate_rl.placement.disaggregated:launch",
}


def immediate_buffer(workers: Workers, handoff: Any):
    """The colocated placements' buffer: it generates when the step asks, through the handoff (which
    replaces a dead engine); ``workers.rollout`` is looked up at each call, as a restart replaces it."""
    from colocate_rl.rollout.buffer import ImmediateBuffer

    def generate(samples, **kw):
        return handoff.on_rollout("generate", lambda: workers.rollout.generate(samples, **kw))

    return ImmediateBuffer(generate)


def engine_quantization(rollout: Any) -> dict[str, str]:
    """{weight: quantized layout} the engine holds (read from its own tensor names and shapes;
    weight_sync.quantize.sync_plan): what a sync must quantize before sending. {} for an engine
    that holds everything as it is trained, or one that cannot list its tensors."""
    from colocate_rl.weight_sync.quantize import sync_plan

    shapes = getattr(rollout, "weight_shapes", None)
    return sync_plan(shapes()) if shapes else {}


def launcher(cfg: Config) -> str:
    """local for one colocated process (Ray's start-up would dominate a tiny CPU run), else ray."""
    if cfg.placement.mode != "colocated":
        return "ray"
    if cfg.placement.launcher != "auto":
        return cfg.placement.launcher
    return "local" if layout(cfg).actor_gpus == 1 and cfg.placement.nnodes == 1 else "ray"


def check_shared_folder(cfg: Config, folder: Path) -> None:
    """On a Ray cluster, every node sees ``folder`` (the checkpoint folder: each actor rank writes its
    shards from its own node, and a resumed run reads them wherever it lands). Checked before
    anything starts; a Ray instance this run starts itself is this machine alone, nothing to check.
    Raises placement.nodes.FolderNotShared (a ConfigError) naming the node that cannot see it."""
    if launcher(cfg) == "local":
        return
    import ray

    if not (cfg.placement.ray_address or ray.is_initialized()):
        return
    from colocate_rl.placement.nodes import check_shared_folder as check
    from colocate_rl.placement.ray_colocated import start_ray

    start_ray(cfg)
    check(folder)


def launch(cfg: Config, offload: Optional[Sequence[str]] = None) -> Workers:
    """The run's workers. ``offload``: the actor parts the memory plan keeps off the device while
    vLLM runs (memory.MemoryPlan.offload; None: every part); a colocated placement builds the actor,
    moves those out, then starts the engines, so only what must move ever moves."""
    module, _, fn = PLACEMENTS[(cfg.placement.mode, launcher(cfg))].partition(":")
    return getattr(importlib.import_module(module), fn)(cfg, offload)
