"""The handoff between the actor and the rollout: one object performs every transition.

    handoff.to_actor(t)      the actor may train now
    handoff.to_rollout(t)    the engines hold the actor's current weights and may generate
    handoff.actor_owned(t)   with-block: to_actor, the body, to_rollout (checkpoints, resume, warm-start)
    handoff.on_rollout(...)  an engine call (generate, eval); a dead engine is replaced first

Colocated (actor and engine share each GPU), staged so the peak stays below the card:
    to_actor     sleep (vLLM frees its weights and KV cache) → onload the offloaded actor parts
    to_rollout   offload grads + optimizer → wake weights → sync → offload params → wake KV cache
Which actor parts move, and whether vLLM sleeps at all, is the memory plan's decision
(``Resolved.offload`` and ``rollout_sleep``; nothing moves when everything fits beside vLLM).
Disaggregated (each side on its own GPUs):
    to_actor     nothing: the actor's GPUs are its own
    to_rollout   wait for the engines to finish generating → broadcast the new weights

A dead engine is rebuilt in any phase, given the actor's current weights, and the phase goes on:
the actor moves to what it keeps beside a running engine, a new engine is built, the cycle is
walked once to sync it, and the interrupted operation resumes from there (a to_rollout is then
already done; a generate is issued again with the same seed). At most
``rollout.max_engine_restarts`` times per operation. ``HANDOFFS`` names each kind, as a placement
asks for it (placement.base.Placement.handoff).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Optional

from colocate_rl import faults
from colocate_rl.config import SyncConfig
from colocate_rl.memory import MemoryPlan, Phase, PhaseMachine
from colocate_rl.metrics import PhaseTimer
from colocate_rl.resolved import Resolved
from colocate_rl.rollout.base import EngineDied
from colocate_rl.weight_sync.ipc import SyncStats
from colocate_rl.workers import Workers

log = logging.getLogger(__name__)


class _Resynced(Exception):
    """A replaced engine has been synced: the to_rollout in progress has nothing left to do."""

    def __init__(self, stats: SyncStats):
        super().__init__("engine replaced and synced")
        self.stats = stats


def _timed(t: Optional[PhaseTimer], name: str):
    return t(name) if t is not None else contextlib.nullcontext()


class Handoff:
    """``workers``: the placement's handles; ``memory``: the bytes each phase may hold (checked at
    every phase boundary); ``resolved``: what moves and what sleeps; ``sync``: how weights travel;
    ``max_engine_restarts``: engines replaced per operation. ``step``: a callable giving the step in
    progress (for fault points and logs)."""

    def __init__(self, workers: Workers, memory: MemoryPlan, resolved: Resolved, sync: SyncConfig,
                 max_engine_restarts: int, step: Callable[[], int] = lambda: 0,
                 measure: Optional[Callable[[], Optional[int]]] = None):
        self.workers, self.resolved, self.sync, self.step = workers, resolved, sync, step
        self.max_engine_restarts = max_engine_restarts
        self.machine = PhaseMachine(memory, measure=measure)
        self.syncs = 0  # weights transfers to the engines
        self.version = 0  # weights changes the engines hold (a re-sync of the same weights is not one)
        self.restarts = 0  # engines replaced since the last take_counts()
        self.moved = {"onload": 0, "offload": 0}  # bytes, since the last take_counts()
        self.moved_s = {"onload": 0.0, "offload": 0.0}

    # ------------------------------------------------------------ the interface

    def to_actor(self, t: Optional[PhaseTimer] = None) -> None:
        raise NotImplementedError

    def to_rollout(self, t: Optional[PhaseTimer] = None, changed: bool = True) -> SyncStats:
        """``changed``: the actor's weights changed since the engines received them."""
        raise NotImplementedError

    @contextlib.contextmanager
    def actor_owned(self, t: Optional[PhaseTimer] = None, changes_weights: bool = True) -> Iterator[None]:
        """The actor owns the device inside the block; afterwards the engines hold its weights."""
        self.to_actor(t)
        yield
        self.to_rollout(t, changed=changes_weights)

    def on_rollout(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` (an engine call, e.g. generate) at fault point ``what``; a dead engine is
        replaced and re-synced, then ``fn`` runs again."""
        return self._engine(what, fn)

    def take_counts(self) -> dict[str, float]:
        """Engine restarts and bytes moved since the last call (a step's metrics)."""
        out: dict[str, float] = {"rollout/engine_restarts": self.restarts}
        for k in ("onload", "offload"):
            out[f"actor/{k}_bytes"] = self.moved[k]
            out[f"actor/{k}_GBps"] = self.moved[k] / max(self.moved_s[k], 1e-9) / 1e9
            self.moved[k], self.moved_s[k] = 0, 0.0
        self.restarts = 0
        return out

    @property
    def phase(self) -> Phase:
        return self.machine.phase

    # ------------------------------------------------------------ shared pieces

    def _sync(self) -> SyncStats:
        """The actor's weights → every engine; verified every sync.verify_every syncs."""
        stats = self.workers.sync(self.sync.bucket_mb)
        self.syncs += 1
        every = self.sync.verify_every
        if every and self.syncs % every == 0:
            self.workers.verify()  # raises WeightMismatch naming the tensor
        return stats

    def _engine(self, what: str, fn: Callable[[], Any], retry: bool = True) -> Any:
        """Runs engine call ``fn`` at fault point ``what``. An engine found dead is replaced and given
        the actor's weights; then ``fn`` runs again (``retry``) or _Resynced ends the to_rollout
        in progress."""
        limit = self.max_engine_restarts
        for attempt in range(limit + 1):
            faults.point(what, self.step())
            try:
                return fn()
            except EngineDied as e:
                if attempt == limit:
                    raise
                log.warning("step %d: %s", self.step(), e)
                print(f"step {self.step()}: the rollout engine died during {what}; replacing it "
                      f"({attempt + 1}/{limit}) and giving it the actor's weights", flush=True)
                stats = self._replace_engine()
                self.restarts += 1
                if not retry:
                    raise _Resynced(stats) from None
        raise AssertionError("unreachable")

    def _replace_engine(self) -> SyncStats:
        raise NotImplementedError


class ColocatedHandoff(Handoff):
    # The placement started the engines with exactly the plan's parts offloaded (placement/base.py
    # launch): what the plan keeps is already on the device, and stays.

    def _actor_move(self, t: Optional[PhaseTimer], way: str, parts: list[str]) -> None:
        """actor.onload / actor.offload of ``parts``; an offload of nothing still returns the
        allocator's cached blocks (the step's activations) to the device."""
        faults.point(way, self.step())
        with _timed(t, way):
            if parts or way == "offload":
                actor = self.workers.actor
                nbytes, seconds = actor.onload(parts) if way == "onload" else actor.offload(parts)
                self.moved[way] += nbytes
                self.moved_s[way] += seconds

    def to_actor(self, t: Optional[PhaseTimer] = None) -> None:
        # self.workers.rollout is looked up at each call: a replaced engine is a new object. When the
        # plan says the actor's step fits beside the awake engine, it stays awake (only alive-checked).
        level = self.resolved.rollout_sleep
        with _timed(t, "sleep"):
            self._engine("sleep", lambda: self.workers.rollout.sleep(level) if level else self.workers.rollout.ping())
        self.machine.to(Phase.IDLE)
        self._actor_move(t, "onload", list(self.resolved.offload))
        self.machine.to(Phase.ACTOR)

    def to_rollout(self, t: Optional[PhaseTimer] = None, changed: bool = True) -> SyncStats:
        # A sleeping engine always needs the sync, ``changed`` or not: sleep level 2 discarded its
        # weights. An engine kept awake still holds them.
        self.version += changed
        return self._wake(t, sync=changed or bool(self.resolved.rollout_sleep))

    def _wake(self, t: Optional[PhaseTimer], sync: bool) -> SyncStats:
        try:
            return self._staged_wake(t, sync=sync)
        except _Resynced as done:
            return done.stats

    def _staged_wake(self, t: Optional[PhaseTimer], sync: bool = True) -> SyncStats:
        """The weights wake while the KV cache still sleeps, so the peak is max(actor params + vLLM
        weights, vLLM weights + KV cache) instead of their sum."""
        w, sleeps, offload = self.workers, self.resolved.rollout_sleep, self.resolved.offload
        self.machine.record()  # the train phase's peak: the allocator still holds the activations
        self._actor_move(t, "offload", [p for p in ("grads", "optimizer") if p in offload])
        self.machine.to(Phase.ACTOR_PARAMS)
        with _timed(t, "wake_weights"):
            self._engine("wake_weights", lambda: w.rollout.wake(["weights"]) if sleeps else None, retry=False)
        self.machine.to(Phase.SYNC)
        with _timed(t, "sync"):
            stats = self._engine("sync", self._sync, retry=False) if sync else SyncStats()
        self._actor_move(t, "offload", ["params"] if "params" in offload else [])
        self.machine.to(Phase.ROLLOUT_WEIGHTS)
        with _timed(t, "wake_kv"):
            self._engine("wake_kv", lambda: w.rollout.wake(["kv_cache"]) if sleeps else None, retry=False)
        self.machine.to(Phase.ROLLOUT)
        return stats

    def _replace_engine(self) -> SyncStats:
        """The actor keeps only what it keeps beside a running engine (the new one sizes its KV cache
        from the free memory), a new engine starts (awake, with the model folder's weights), then the
        cycle is walked once so it receives the actor's current weights."""
        self.workers.actor.offload(list(self.resolved.offload))
        self.workers.restart_rollout()
        self.machine.reset(Phase.ROLLOUT)
        self.to_actor()
        return self._wake(None, sync=True)


class DisaggregatedHandoff(Handoff):
    """The actor and the engines never share a device: only the weights cross, by broadcast. The
    placement replaces an engine that dies and re-syncs it itself (placement/disaggregated.py)."""

    def to_actor(self, t: Optional[PhaseTimer] = None) -> None:
        pass  # the actor's GPUs are its own

    def to_rollout(self, t: Optional[PhaseTimer] = None, changed: bool = True) -> SyncStats:
        if not changed:  # e.g. after a checkpoint: the engines already hold these weights
            return SyncStats()
        self.version += 1
        with _timed(t, "wait_rollout"):
            self.workers.drain()  # a broadcast waits for the engines to finish generating
        with _timed(t, "sync"):
            faults.point("sync", self.step())
            stats = self._sync()
        return stats

    def _replace_engine(self) -> SyncStats:
        self.workers.restart_rollout()
        return SyncStats()


# Placement.handoff -> the kind that moves the device between the two sides of that layout.
HANDOFFS: dict[str, type[Handoff]] = {"colocated": ColocatedHandoff, "disaggregated": DisaggregatedHandoff}

__all__ = ["HANDOFFS", "ColocatedHandoff", "DisaggregatedHandoff", "Handoff"]
