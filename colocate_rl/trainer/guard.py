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


class SignalWatch:
    """A warning when ``steps`` steps in a row drew no group whose rewards differ
    (metrics["reward/signal_groups"] == 0): every advantage and gradient is then 0 and the weights do
    not move. Said once per such stretch; a run that starts so has nothing to learn from."""

    def __init__(self, steps: int = 3):
        self.steps, self.in_row = steps, 0

    def update(self, metrics: dict, step: int) -> str | None:
        """The warning's line on the step that completes a stretch, else None."""
        self.in_row = self.in_row + 1 if metrics.get("reward/signal_groups", 1.0) == 0 else 0
        if self.in_row != self.steps:
            return None
        return (f"warning: steps {step - self.steps + 1}-{step}: in every group all rewards were equal (all right or "
                "all wrong), so every advantage and gradient was 0 and the weights did not move; a warm start "
                "(sft.steps), an easier task or rollout.dynamic_sampling=true gives GRPO samples to compare")
