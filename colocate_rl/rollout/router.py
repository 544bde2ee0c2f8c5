"""Several rollout engines behind one router (disaggregated mode).

Prompts are spread by load: each prompt's whole group (its n samples) goes to one engine — so
vLLM shares the prompt's prefix across the n samples and the group's rows come back together —
and groups are handed out longest first to the engine with the least outstanding work (prompt +
response tokens × n, counting work still in flight from earlier calls). The rows come back in the
order of the prompts, whichever engine ran them.

An engine that dies mid-generation is detected by its future failing with an error ``is_lost``
recognises; ``restart(i)`` (the placement's: a new engine, re-synced to the actor's weights) runs,
and the lost prompts are re-issued to the engines by load. Nothing is dropped; the counts are in
``Pending.metrics``. The router knows engines only as ``submit(i, samples, kwargs, method) -> Future``:
no Ray here, the placement adapts its actors. A call names the engine's method: ``generate``, or
``generate_partial`` for partial rollouts (its "samples" are rollout/partial.py's group requests,
its results joined by ``in_group_order``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from colocate_rl.errors import first_line
from colocate_rl.types import RolloutBatch, Sample

log = logging.getLogger(__name__)

# submit(engine, samples, kwargs, method): the engine's ``method`` (generate, or generate_partial of
# rollout/partial.py) on its share of the call
Submit = Callable[[int, list[Any], dict[str, Any], str], Future]
Join = Callable[[list[tuple[list[int], Any]], int], Any]  # the engines' results in the call's order


def assign(costs: list[float], loads: list[float]) -> list[int]:
    """costs [G] work per prompt group, loads [E] work already on each engine → engine per group.
    Longest group first to the least-loaded engine (ties: lowest index); ``loads`` is not changed."""
    if not loads:
        raise ValueError("assign: no engines")
    load = list(loads)
    out = [0] * len(costs)
    for g in sorted(range(len(costs)), key=lambda g: (-costs[g], g)):
        e = min(range(len(load)), key=lambda e: (load[e], e))
        out[g] = e
        load[e] += costs[g]
    return out


@dataclass
class _Shard:
    engine: int
    prompts: list[int]  # indices into the call's samples
    cost: float
    future: Future


@dataclass
class Pending:
    """One generate call in flight; ``result()`` waits, restarts lost engines and re-issues their prompts."""

    router: "Router"
    samples: list[Sample]
    kwargs: dict[str, Any]
    shards: list[_Shard]
    method: str = "generate"
    join: Optional[Join] = None  # default: the rows of a RolloutBatch in prompt order
    metrics: dict[str, float] = field(default_factory=dict)
    engine_of: dict[int, int] = field(default_factory=dict)  # prompt index -> engine that produced its group
    _done: list[tuple[list[int], RolloutBatch]] = field(default_factory=list)

    def done(self) -> bool:
        return all(s.future.done() for s in self.shards)

    def result(self) -> RolloutBatch:
        r = self.router
        restarts = reissued = 0
        while self.shards:
            wait([s.future for s in self.shards], return_when=FIRST_EXCEPTION)
            for shard in [s for s in self.shards if s.future.done()]:
                self.shards.remove(shard)
                r._finished(shard)
                exc = shard.future.exception()
                if exc is None:
                    self._done.append((shard.prompts, shard.future.result()))
                    self.engine_of.update({p: shard.engine for p in shard.prompts})
                    continue
                if not r.is_lost(exc) or restarts >= r.max_restarts:
                    for s in self.shards:
                        r._finished(s)
                    raise exc
                log.warning("rollout engine %d lost during generation (%s): restarting it, re-issuing %d prompts",
                            shard.engine, first_line(exc),
                            len(shard.prompts))
                r.restart(shard.engine)
                restarts += 1
                reissued += len(shard.prompts)
                self.shards += r._dispatch(self.samples, shard.prompts, self.kwargs, self.method)
        self.metrics.update({"rollout/engine_restarts": restarts, "rollout/reissued_prompts": reissued})
        return (self.join or _in_prompt_order)(self._done, len(self.samples))


def _in_prompt_order(parts: list[tuple[list[int], RolloutBatch]], num_prompts: int) -> RolloutBatch:
    """Joins the engines' batches and puts the rows back in prompt order; group ids 0..G-1 again."""
    parts = [(p, b) for p, b in parts if p]
    batch = RolloutBatch.concat([b for _, b in parts])
    n = batch.size // num_prompts if num_prompts else 0
    start_of: dict[int, int] = {}
    row = 0
    for prompts, _ in parts:
        for p in prompts:
            start_of[p] = row
            row += n
    order = torch.tensor([start_of[p] + k for p in range(num_prompts) for k in range(n)], dtype=torch.long)
    out = batch.select(order)
    out.group_ids = torch.arange(out.size) // max(n, 1)
    return out


class Router:
    """``num_engines`` engines reached through ``submit``; ``restart(i)`` replaces engine i (and re-syncs
    it); ``is_lost(exc)`` says whether a failed future means the engine is gone."""

    def __init__(self, submit: Submit, num_engines: int, restart: Callable[[int], None],
                 is_lost: Callable[[BaseException], bool], max_response_tokens: int, default_n: int,
                 max_restarts: int | None = None) -> None:
        if num_engines < 1:
            raise ValueError(f"Router: num_engines={num_engines} must be >= 1")
        self.submit_fn, self.num_engines, self.restart, self.is_lost = submit, num_engines, restart, is_lost
        self.max_response_tokens, self.default_n = max_response_tokens, default_n
        self.max_restarts = 2 * num_engines if max_restarts is None else max_restarts
        self.inflight = [0.0] * num_engines  # outstanding work per engine, in tokens
        self._lock = threading.Lock()  # submit may be called from the rollout buffer's thread
        self.counts: dict[str, float] = {}

    def _cost(self, s: Sample, kwargs: dict[str, Any]) -> float:
        n = kwargs.get("n") or self.default_n
        return float((len(s.prompt_ids) + (kwargs.get("max_tokens") or self.max_response_tokens)) * n)

    def _dispatch(self, samples: list[Sample], prompts: list[int], kwargs: dict[str, Any],
                  method: str = "generate") -> list[_Shard]:
        costs = [self._cost(samples[p], kwargs) for p in prompts]
        with self._lock:
            where = assign(costs, self.inflight)
            shards = []
            for e in range(self.num_engines):
                mine = [p for p, w in zip(prompts, where) if w == e]
                if not mine:
                    continue
                cost = sum(c for c, w in zip(costs, where) if w == e)
                self.inflight[e] += cost
                shards.append(_Shard(e, mine, cost, self.submit_fn(e, [samples[p] for p in mine], dict(kwargs), method)))
        return shards

    def _finished(self, shard: _Shard) -> None:
        with self._lock:
            self.inflight[shard.engine] = max(0.0, self.inflight[shard.engine] - shard.cost)

    def submit(self, samples: list[Sample], method: str = "generate", join: Optional[Join] = None,
               **kwargs: Any) -> Pending:
        """Starts generating; each prompt's group on one engine. kwargs: the engine method's
        (RolloutEngine.generate's by default; ``join`` puts the engines' results together)."""
        return Pending(self, list(samples), kwargs, self._dispatch(samples, list(range(len(samples))), kwargs, method),
                       method, join)

    def generate(self, samples: list[Sample], method: str = "generate", join: Optional[Join] = None,
                 **kwargs: Any) -> Any:
        pending = self.submit(samples, method, join, **kwargs)
        batch = pending.result()
        with self._lock:
            for k, v in pending.metrics.items():
                self.counts[k] = self.counts.get(k, 0) + v
        return batch

    def note_restart(self) -> None:
        """An engine restarted outside a generate call (found dead while idle)."""
        with self._lock:
            self.counts["rollout/engine_restarts"] = self.counts.get("rollout/engine_restarts", 0) + 1

    def take_counts(self) -> dict[str, float]:
        """Restarts and re-issued prompts since the last call (summed over generate calls)."""
        with self._lock:
            out, self.counts = self.counts, {}
        return {"rollout/engine_restarts": 0, "rollout/reissued_prompts": 0, **out}


__all__ = ["Pending", "Router", "assign"]
