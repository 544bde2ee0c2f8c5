"""The stop after too many skipped updates: the actor skips an update whose loss or gradients are
not finite (trainer.Actor._grads_finite); several in a row mean the run is broken, not unlucky."""

from __future__ import annotations


class NonfiniteGuard:
    def __init__(self, limit: int):
        self.limit, self.in_row = limit, 0

    def update(self, metrics: dict, step: int) -> None:
        """Counts skipped updates in a row (metrics["update_skipped"]); raises FloatingPointError at the limit."""
        self.in_row = self.in_row + 1 if metrics.get("update_skipped") else 0
        if self.in_row >= self.limit:
            raise FloatingPointError(
                f"{self.in_row} updates in a row skipped for NaN/inf loss or gradients (last at step {step}): "
                "stopping; lower actor.lr, check the rewards, or resume from a checkpoint")
