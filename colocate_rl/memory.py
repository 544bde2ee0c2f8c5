"""Who owns the GPU now: the colocated handoff as a state machine, with a memory check per phase.

One colocated step walks this cycle (the staged wake is what keeps the peak below the card):

    ROLLOUT ──sleep──▶ IDLE ──onload──▶ ACTOR ──offload grads+optimizer──▶ ACTOR_PARAMS
       ▲                                                                       │ wake weights
       └──wake kv cache── ROLLOUT_WEIGHTS ◀──offload params── SYNC ◀───────────┘

In SYNC the actor's parameters and vLLM's weights are both resident: the sync is a device-to-device
copy through IPC handles. Any other transition raises, so a phase called out of order fails
loudly instead of overflowing the card. Before entering a phase, the planned resident bytes are
compared with the device's capacity and the phase that would overflow is named.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class Phase(str, enum.Enum):
    ROLLOUT = "rollout"  # vLLM weights + KV cache
    IDLE = "idle"  # nothing resident (vLLM asleep, actor offloaded)
    ACTOR = "actor"  # actor params + grads + optimizer state + activations
    ACTOR_PARAMS = "actor_params"  # actor params only
    SYNC = "sync"  # actor params + vLLM weights + bucket staging
    ROLLOUT_WEIGHTS = "rollout_weights"  # vLLM weights only


# What each phase keeps on the device (keys of MemoryPlan.parts).
RESIDENT: dict[Phase, tuple[str, ...]] = {
    Phase.ROLLOUT: ("rollout_weights", "kv_cache"),
    Phase.IDLE: (),
    Phase.ACTOR: ("actor_params", "actor_grads", "actor_optimizer", "activations"),
    Phase.ACTOR_PARAMS: ("actor_params",),
    Phase.SYNC: ("actor_params", "rollout_weights", "sync_buckets"),
    Phase.ROLLOUT_WEIGHTS: ("rollout_weights",),
}

# Legal transitions and the call that performs each.
TRANSITIONS: dict[tuple[Phase, Phase], str] = {
    (Phase.ROLLOUT, Phase.IDLE): "rollout.sleep",
    (Phase.IDLE, Phase.ACTOR): "actor.onload",
    (Phase.ACTOR, Phase.ACTOR_PARAMS): "actor.offload(grads, optimizer)",
    (Phase.ACTOR_PARAMS, Phase.SYNC): "rollout.wake(weights)",
    (Phase.SYNC, Phase.ROLLOUT_WEIGHTS): "actor.offload(params)",
    (Phase.ROLLOUT_WEIGHTS, Phase.ROLLOUT): "rollout.wake(kv_cache)",
}


class IllegalTransition(RuntimeError):
    pass


class MemoryOverflow(RuntimeError):
    pass


@dataclass
class MemoryPlan:
    """Bytes each part needs on one device, and what the device offers (0 = unchecked, e.g. CPU)."""

    capacity: int = 0
    parts: dict[str, int] = field(default_factory=dict)

    def resident(self, phase: Phase) -> int:
        return sum(self.parts.get(p, 0) for p in RESIDENT[phase])

    def check(self, phase: Phase) -> None:
        need = self.resident(phase)
        if self.capacity and need > self.capacity:
            detail = ", ".join(f"{p} {self.parts.get(p, 0) / 2**30:.2f}" for p in RESIDENT[phase])
            raise MemoryOverflow(
                f"phase '{phase.value}' would need {need / 2**30:.2f} GiB of {self.capacity / 2**30:.2f} GiB "
                f"on the device ({detail} GiB)"
            )

    def peaks(self) -> dict[str, int]:
        return {p.value: self.resident(p) for p in Phase}

    def unstaged_peak(self) -> int:
        """What waking vLLM's weights and KV cache at once, with the actor's params still resident, would need."""
        return sum(self.parts.get(p, 0) for p in ("actor_params", "rollout_weights", "kv_cache", "sync_buckets"))


class Handoff:
    """The state machine. ``to(phase)`` checks legality and memory, then records the entry time;
    ``measure`` (optional) returns the device's bytes in use, recorded at each boundary."""

    def __init__(self, plan: MemoryPlan | None = None, start: Phase = Phase.ROLLOUT, measure=None):
        self.phase = start
        self.plan = plan or MemoryPlan()
        self.measure = measure
        self.history: list[tuple[Phase, float, int]] = [(start, time.perf_counter(), self._used())]

    def _used(self) -> int:
        return int(self.measure()) if self.measure else 0

    def to(self, phase: Phase) -> None:
        if (self.phase, phase) not in TRANSITIONS:
            legal = [b.value for (a, b) in TRANSITIONS if a == self.phase]
            raise IllegalTransition(
                f"cannot go from '{self.phase.value}' to '{phase.value}': the GPU owner after "
                f"'{self.phase.value}' is {legal[0]!r} (via {TRANSITIONS[(self.phase, Phase(legal[0]))]})"
            )
        self.plan.check(phase)
        self.phase = phase
        self.history.append((phase, time.perf_counter(), self._used()))

    def peak_used(self) -> dict[str, int]:
        """Measured bytes in use at each phase entry (max over the run)."""
        out: dict[str, int] = {}
        for ph, _, used in self.history:
            out[ph.value] = max(out.get(ph.value, 0), used)
        return out
