"""verl's reward for benchmarks/peers/gpu_vs_verl.py (reward.custom_reward_function): the arithmetic
reward of colocate_rl.rewards.arithmetic (the first integer of the response equals the label), in
the signature verl's reward loop calls. verl loads it by path in its own environment, where
colocate_rl is not importable."""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


def compute_score(data_source, solution_str: str, ground_truth: str, extra_info=None, **_) -> float:
    m = _INT.search(solution_str)
    return float(m is not None and int(m.group()) == int(ground_truth))
