"""Custom rollout functions named by tests as rollout.custom_fn="rollout_fns:<name>"."""

from __future__ import annotations

from dataclasses import replace

from colocate_rl.types import RolloutBatch

HINT = 7  # a token id every prompt gets in front (prompt injection)


def hinted_two_passes(samples, generate) -> RolloutBatch:
    """Prompt injection plus multi-sample logic: half of the prompts sampled twice as long."""
    hinted = [replace(s, prompt_ids=[HINT, *s.prompt_ids]) for s in samples]
    half = len(hinted) // 2
    return RolloutBatch.concat([generate(hinted[:half]), generate(hinted[half:], max_tokens=8)])
