"""The exact reward of the synthetic arithmetic task (colocate_rl.data.arithmetic makes the problems)."""

from __future__ import annotations

import re

from colocate_rl.rewards.registry import register

_INT = re.compile(r"-?\d+")


@register("arithmetic", inline=True)
def arithmetic_reward(response: str, label: str) -> float:
    """1.0 when the first integer in the response equals the label, else 0.0."""
    m = _INT.search(response)
    return float(m is not None and int(m.group()) == int(label))
