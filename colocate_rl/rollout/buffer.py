"""The data buffer between rollout and training: where the loop takes each step's batch.

``request(samples, version, seed, cursor)`` asks for one step's batch; ``get()`` hands the oldest
request's batch to training with the weights version it was generated with (the loop reports the
staleness: trainer version − rollout version). ``cursor`` is the prompt sampler's state before the
request drew its prompts: a checkpoint taken while a request is pending records that state
(``cursor()``), so a resumed run draws the same prompts again instead of skipping them.

Two kinds, one interface:
- ``RolloutBuffer`` (disaggregated) produces in a background thread from the moment of the request,
  so step k+1 can generate while step k trains (one-step off-policy);
- ``ImmediateBuffer`` (colocated: the engine shares the device with the actor) generates inside
  ``get()``, when the device is the engine's.

What produces a batch is the router's ``generate``, or a user's rollout function named in
``rollout.custom_fn`` as ``"pkg.module:function"`` (as ``reward.name`` names a reward):

    def my_rollout(samples: list[Sample], generate) -> RolloutBatch:
        # generate(samples, n=..., temperature=..., max_tokens=...) -> RolloutBatch
        ...

It may rewrite or inject prompts, call ``generate`` several times (multi-sample logic, filtering)
and must return a RolloutBatch of whole groups (RolloutBatch.concat joins several).

With partial rollouts (``partial``: rollout/partial.py) a request also carries the rows left
unfinished by earlier ones, and its batch is the groups complete when generation stopped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional, Protocol

from colocate_rl.config import import_function
from colocate_rl.rollout.partial import GeneratePartial, PartialRollouts
from colocate_rl.rollout.agent import Generate, conversation_metrics
from colocate_rl.types import RolloutBatch, Sample

RolloutFn = Callable[[list[Sample], Generate], RolloutBatch]


def load_rollout_fn(spec: str) -> RolloutFn:
    """``"pkg.module:function"`` → the function; ValueError naming rollout.custom_fn otherwise."""
    return import_function(spec, f"rollout.custom_fn={spec!r}")


@dataclass
class Produced:
    batch: RolloutBatch
    version: int  # weights version the engines held when generation started
    metrics: dict[str, float]


class Buffer(Protocol):
    """What the loop takes each step's batch from (both kinds below)."""

    generate: Generate  # a batch now, outside the queue (dynamic sampling's refill)
    partial: Optional[PartialRollouts]  # the rows in flight between steps (rollout.partial.enable)

    def request(self, samples: list[Sample], version: int, seed: Optional[int] = None, cursor: Any = None,
                ahead: int = 0) -> None: ...

    def get(self) -> Produced: ...

    def drain(self) -> None: ...

    def cursor(self) -> Any: ...

    def close(self) -> None: ...

    def __len__(self) -> int: ...


@dataclass
class _Request:
    samples: list[Sample]
    version: int
    seed: Optional[int]
    cursor: Any
    ahead: int = 0  # weights versions between the request and the update that trains its batch


class _Buffer:
    """What both kinds share: the production of one request (the plain generate call, or the
    user's rollout function) and the FIFO of requests with their sampler cursors."""

    def __init__(self, generate: Generate, rollout_fn: RolloutFn | None = None,
                 metrics: Callable[[], dict[str, float]] = dict,
                 generate_partial: Optional[GeneratePartial] = None) -> None:
        self.generate, self.rollout_fn, self._metrics = generate, rollout_fn, metrics
        self.generate_partial = generate_partial
        self.partial: Optional[PartialRollouts] = None  # set when rollout.partial.enable
        self._queue: deque[tuple[_Request, Any]] = deque()

    def _request(self, samples: list[Sample], version: int, seed: Optional[int], cursor: Any, ahead: int) -> _Request:
        extra = self.partial.extra_prompts() if self.partial is not None else []
        return _Request(list(samples) + extra, version, seed, cursor, ahead)

    def _produce(self, req: _Request) -> Produced:
        gen = self.generate if req.seed is None else partial(self.generate, seed=req.seed)
        extra: dict[str, float] = {}
        if self.partial is not None:
            batch, extra = self.partial.produce(req.samples, self.generate_partial, req.seed, req.version,
                                                req.version + req.ahead)
        elif self.rollout_fn is None:
            batch = gen(req.samples)
        else:
            batch = self.rollout_fn(list(req.samples), gen)
            if not isinstance(batch, RolloutBatch):
                raise TypeError(f"rollout.custom_fn returned {type(batch).__name__}, expected a RolloutBatch")
        return Produced(batch, req.version, {**self._metrics(), **extra, **conversation_metrics(batch)})

    def __len__(self) -> int:
        return len(self._queue)

    def cursor(self) -> Any:
        """The sampler state before the oldest pending request drew its prompts (None: none pending)."""
        return self._queue[0][0].cursor if self._queue else None

    def close(self) -> None:
        self._queue.clear()


class RolloutBuffer(_Buffer):
    """Produces in one background thread from the moment of the request, in request order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")

    def request(self, samples: list[Sample], version: int, seed: Optional[int] = None, cursor: Any = None,
                ahead: int = 0) -> None:
        req = self._request(samples, version, seed, cursor, ahead)
        self._queue.append((req, self._pool.submit(self._produce, req)))

    def get(self) -> Produced:
        """The oldest request's batch (waits for it); re-raises what its production raised."""
        if not self._queue:
            raise RuntimeError("RolloutBuffer.get: nothing requested")
        return self._queue.popleft()[1].result()

    def drain(self) -> None:
        """Waits for every request still running (e.g. before a weight sync), keeping the results queued."""
        for _, f in list(self._queue):
            f.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        super().close()


class ImmediateBuffer(_Buffer):
    """Generates inside ``get()``: for an engine that shares its device with the actor."""

    def request(self, samples: list[Sample], version: int, seed: Optional[int] = None, cursor: Any = None,
                ahead: int = 0) -> None:
        self._queue.append((self._request(samples, version, seed, cursor, ahead), None))

    def get(self) -> Produced:
        if not self._queue:
            raise RuntimeError("ImmediateBuffer.get: nothing requested")
        req, _ = self._queue[0]
        out = self._produce(req)
        self._queue.popleft()  # only once produced: a failed production leaves its cursor in place
        return out

    def drain(self) -> None:
        pass  # nothing runs between calls


__all__ = ["Buffer", "ImmediateBuffer", "Produced", "RolloutBuffer", "load_rollout_fn"]
