"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale"): a group whose rewards are all equal has advantage 0 on every row and carries no
gradient; drop such groups and sample more prompts until the step has its full count of groups
that do carry signal (or the round limit is reached), so the effective batch size stays constant.
"""

from __future__ import annotations

from typing import Callable

import torch

from colocate_rl.types import RolloutBatch


def informative(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """rewards [B] (B = groups × n, a group's rows adjacent) → [G] bool: the group's rewards differ."""
    r = rewards.view(-1, n)
    return (r != r[:, :1]).any(dim=1)


def keep_groups(batch: RolloutBatch, groups: torch.Tensor) -> RolloutBatch:
    """The rows of the groups whose index is in ``groups`` [k] (long), group ids renumbered 0..k-1."""
    n = batch.n_per_group
    rows = (groups.view(-1, 1) * n + torch.arange(n).view(1, -1)).view(-1)
    out = batch.select(rows)
    out.group_ids = torch.arange(out.size) // max(n, 1)
    return out


def refill(batch: RolloutBatch, target: int, more: Callable[[int, int], RolloutBatch],
           max_rounds: int) -> tuple[RolloutBatch, dict[str, float]]:
    """batch: scored (``rewards`` set). ``more(k, round)`` → a scored batch of k more prompts' groups.
    Returns (up to ``target`` informative groups, metrics). When no group at all carries signal the
    batch is returned as it is (its advantages are all 0: the update is a no-op, not an error)."""
    n = batch.n_per_group
    parts = [keep_groups(batch, informative(batch.rewards, n).nonzero().view(-1))]
    kept = parts[0].size // n
    drawn, rounds = batch.size // n, 0
    while kept < target and rounds < max_rounds:
        rounds += 1
        extra = more(target - kept, rounds)
        drawn += extra.size // n
        parts.append(keep_groups(extra, informative(extra.rewards, n).nonzero().view(-1)))
        kept += parts[-1].size // n
    metrics = {"rollout/dynamic_rounds": float(rounds), "rollout/dynamic_kept_frac": kept / max(drawn, 1)}
    parts = [p for p in parts if p.size]
    if not parts:
        return batch, {**metrics, "rollout/dynamic_groups": 0.0}
    out = RolloutBatch.concat(parts) if len(parts) > 1 else parts[0]
    out = keep_groups(out, torch.arange(min(kept, target)))
    return out, {**metrics, "rollout/dynamic_groups": float(out.size // n)}
