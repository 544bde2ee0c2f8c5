"""The data buffer between rollout and training (disaggregated mode).

``request(samples, version)`` starts producing one step's batch in a background thread and returns
at once; ``get()`` hands the oldest produced batch to training with the weights version it was
generated with, so the loop can run generation of step k+1 while step k trains (one-step
off-policy) and report the staleness (trainer version − rollout version).

What produces a batch is the router's ``generate``, or a user's rollout function named in
``rollout.custom_fn`` as ``"pkg.module:function"`` (as ``reward.name`` names a reward):

    def my_rollout(samples: list[Sample], generate) -> RolloutBatch:
        # generate(samples, n=..., temperature=..., max_tokens=...) -> RolloutBatch
        ...

It may rewrite or inject prompts, call ``generate`` several times (multi-sample logic, filtering)
and must return a RolloutBatch of whole groups (RolloutBatch.concat joins several).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from colocate_rl.config import import_function
from colocate_rl.types import RolloutBatch, Sample

Generate = Callable[..., RolloutBatch]
RolloutFn = Callable[[list[Sample], Generate], RolloutBatch]


def load_rollout_fn(spec: str) -> RolloutFn:
    """``"pkg.module:function"`` → the function; ValueError naming rollout.custom_fn otherwise."""
    return import_function(spec, f"rollout.custom_fn={spec!r}")


@dataclass
class Produced:
    batch: RolloutBatch
    version: int  # weights version the engines held when generation started
    metrics: dict[str, float]


class RolloutBuffer:
    """FIFO of batches being produced or ready; one producer thread, so requests run in order."""

    def __init__(self, generate: Generate, rollout_fn: RolloutFn | None = None,
                 metrics: Callable[[], dict[str, float]] = dict) -> None:
        self.generate, self.rollout_fn, self._metrics = generate, rollout_fn, metrics
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self._queue: deque[Future] = deque()

    def _produce(self, samples: list[Sample], version: int) -> Produced:
        if self.rollout_fn is None:
            batch = self.generate(samples)
        else:
            batch = self.rollout_fn(list(samples), self.generate)
            if not isinstance(batch, RolloutBatch):
                raise TypeError(f"rollout.custom_fn returned {type(batch).__name__}, expected a RolloutBatch")
        return Produced(batch, version, dict(self._metrics()))

    def request(self, samples: list[Sample], version: int) -> None:
        self._queue.append(self._pool.submit(self._produce, samples, version))

    def __len__(self) -> int:
        return len(self._queue)

    def get(self) -> Produced:
        """The oldest request's batch (waits for it); re-raises what its production raised."""
        if not self._queue:
            raise RuntimeError("RolloutBuffer.get: nothing requested")
        return self._queue.popleft().result()

    def drain(self) -> None:
        """Waits for every request still running (e.g. before a weight sync), keeping the results queued."""
        for f in list(self._queue):
            f.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["Produced", "RolloutBuffer", "load_rollout_fn"]
