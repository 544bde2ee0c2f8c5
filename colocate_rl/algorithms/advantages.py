"""Advantages: one scalar per response, computed over the whole batch.

An advantage function is ``fn(rewards [B], n, cfg: AlgorithmConfig) -> advantages [B]``: it sees
every reward of the batch, the group size n and the algorithm's config, so a baseline that needs
more than one group's rewards (or a config field of its own) fits the same signature. Rows of one
prompt are adjacent (colocate_rl.types), so a group is a ``view(-1, n)``, not a gather. Adding one:
a function and one line in ADVANTAGES.
"""

from __future__ import annotations

from typing import Callable

import torch

from colocate_rl.config import AlgorithmConfig

AdvantageFn = Callable[[torch.Tensor, int, AlgorithmConfig], torch.Tensor]


def _groups(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """rewards [B] → [B/n, n]."""
    if rewards.dim() != 1 or n < 1 or rewards.numel() % n:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of n={n}")
    return rewards.view(-1, n)


def grpo(rewards: torch.Tensor, n: int, cfg: AlgorithmConfig) -> torch.Tensor:
    """(r - group mean) / (group std + cfg.adv_eps).   rewards [B] → advantages [B], B = prompts × n.

    The std is the population std (``unbiased=False``): it is defined for n = 1 (advantage 0 rather
    than NaN), and a group whose rewards are all equal gets advantage 0 for every row.
    """
    r = _groups(rewards, n)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    return ((r - r.mean(dim=1, keepdim=True)) / (std + cfg.adv_eps)).view(-1)


def dr_grpo(rewards: torch.Tensor, n: int, cfg: AlgorithmConfig) -> torch.Tensor:
    """r - group mean.   rewards [B] → advantages [B].

    "Understanding R1-Zero-Like Training: A Critical Perspective" (Liu et al., 2025): dividing by
    the group's std gives the prompts that are nearly always right or wrong (small std) the larger
    weight; without it every prompt's rewards count on one scale. Pair it with
    ``algorithm.policy_loss=dr_grpo`` (the loss without the length bias).
    """
    r = _groups(rewards, n)
    return (r - r.mean(dim=1, keepdim=True)).view(-1)


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "grpo_no_std": dr_grpo,  # the name this had before Dr. GRPO's loss was added
}


def get_advantage_fn(name: str) -> AdvantageFn:
    if name not in ADVANTAGES:
        raise ValueError(f"algorithm.advantage={name!r} is not one of {', '.join(sorted(ADVANTAGES))}")
    return ADVANTAGES[name]
