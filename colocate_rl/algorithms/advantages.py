"""Group-relative advantages: one scalar per response, from the rewards of its prompt's group.

Rows of one prompt are adjacent (colocate_rl.types), so a group is a ``view(-1, n)``, not a gather.
"""

from __future__ import annotations

from typing import Callable

import torch

AdvantageFn = Callable[[torch.Tensor, int, float], torch.Tensor]


def _groups(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """rewards [B] → [B/n, n]."""
    if rewards.dim() != 1 or n < 1 or rewards.numel() % n:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of n={n}")
    return rewards.view(-1, n)


def grpo(rewards: torch.Tensor, n: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps).   rewards [B] → advantages [B], B = prompts × n.

    The std is the population std (``unbiased=False``): it is defined for n = 1 (advantage 0 rather
    than NaN), and a group whose rewards are all equal gets advantage 0 for every row.
    """
    r = _groups(rewards, n)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    return ((r - r.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)


def grpo_no_std(rewards: torch.Tensor, n: int, eps: float = 1e-6) -> torch.Tensor:
    """r - group mean (Dr. GRPO: no std division, so easy and hard prompts are not re-weighted).
    rewards [B] → advantages [B]; ``eps`` is unused and kept for one signature."""
    r = _groups(rewards, n)
    return (r - r.mean(dim=1, keepdim=True)).view(-1)


ADVANTAGES: dict[str, AdvantageFn] = {"grpo": grpo, "grpo_no_std": grpo_no_std}


def get_advantage_fn(name: str) -> AdvantageFn:
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage '{name}': one of {', '.join(sorted(ADVANTAGES))}")
    return ADVANTAGES[name]
