"""What a placement hands the run, whatever runs where: ``Workers``, the protocol of its actor side
(``Actor``: trainer.Actor in this process, or every Ray rank at once) beside rollout.base.Rollout,
and ``Build``: what a placement starts them from, as the plan resolved it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import torch

from colocate_rl.config import SyncConfig
from colocate_rl.resolved import Resolved, Sampling, Scheduling
from colocate_rl.rollout.agent import Turns
from colocate_rl.rollout.base import Engine, Rollout
from colocate_rl.rollout.buffer import Buffer
from colocate_rl.types import RolloutBatch
from colocate_rl.weight_sync.ipc import SyncStats


class Actor(Protocol):
    """What the loop, the handoff and the placements call on the actor (trainer.Actor's methods;
    collective: a placement with several ranks calls each on every rank)."""

    def train_step(self, batch: RolloutBatch, old_logprobs: Optional[torch.Tensor] = None,
                   ref_logprobs: Optional[torch.Tensor] = None) -> dict[str, float]: ...

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor: ...

    def sft_step(self, batch: RolloutBatch, lr: float) -> dict[str, float]: ...

    def offload(self, parts: Optional[Sequence[str]] = None) -> tuple[int, float]: ...

    def onload(self, parts: Optional[Sequence[str]] = None) -> tuple[int, float]: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def export_hf_weights(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]: ...

    def weight_checksums(self) -> dict[str, float]: ...


# handoff.Handoff.on_rollout: an engine call at a fault point, a dead engine replaced first
OnRollout = Callable[[str, Callable[[], Any]], Any]


class Workers(Protocol):
    actor: Actor
    rollout: Rollout  # one engine, or several behind a router

    def sync(self, bucket_mb: float) -> SyncStats:
        """The actor's current weights → every engine."""

    def verify(self) -> int:
        """Engine checksums equal the actor's (raises WeightMismatch naming the tensor); returns how
        many tensors were compared (never 0)."""

    def restart_rollout(self) -> None:
        """A new engine in place of a dead one; it holds the model folder's weights until the next sync."""

    def drain(self) -> None:
        """Waits until no generation is in flight (a broadcast must not race one)."""

    def make_buffer(self, on_rollout: OnRollout, turns: Turns) -> Buffer:
        """Where the loop takes each step's batch from; ``turns.over`` wraps the rollout's generate
        (multi-turn rollouts with tools: rollout/agent.py)."""

    def device_used(self) -> Optional[int]:
        """Bytes in use on the first GPU, every process included (None on CPU)."""

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class Build:
    """What a placement starts, and with what. ``make_actor`` / ``make_rollout`` build one actor rank
    / one engine in the process that calls them (picklable: Ray ships them to its actors)."""

    make_actor: Callable[[], Actor]
    make_rollout: Callable[[], Engine]
    resolved: Resolved
    sampling: Sampling
    scheduling: Scheduling
    sync: SyncConfig
