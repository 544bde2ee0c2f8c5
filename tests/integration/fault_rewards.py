"""Reward functions for tests, importable by path ("fault_rewards:faulty") from the scorer's worker
processes and from recipe subprocesses (tests put this folder on PYTHONPATH)."""

from __future__ import annotations

import time


def even_length(response: str, label: str) -> float:
    """Varies within every group even on a random-weight model, so every step changes the weights."""
    return float(len(response) % 2 == 0)


def faulty(response: str, label: str) -> float:
    """By the answer's value: hangs (the scorer's timeout kills the worker), raises, returns NaN, or 0."""
    kind = int(label) % 8
    if kind == 0:
        time.sleep(60)
    if kind == 1:
        raise RuntimeError("reward crashed")
    if kind == 2:
        return float("nan")
    return 0.0
