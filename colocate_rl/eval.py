"""Held-out evaluation: k samples per problem → accuracy, pass@k, response length, truncation."""

from __future__ import annotations

import math

import torch

from colocate_rl.types import RolloutBatch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct out of n samples: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(batch: RolloutBatch, rewards: torch.Tensor, name: str = "eval") -> dict[str, float]:
    """rewards [B] in [0, 1] (1 = correct), B = problems × n samples with n adjacent rows per problem."""
    n = batch.n_per_group
    correct = (rewards > 0.5).view(-1, n)  # [problems, n]
    out = {
        f"{name}/accuracy": float(correct.float().mean()),
        f"{name}/response_len": float(batch.response_lens.float().mean()),
        f"{name}/truncated": float(batch.truncated.float().mean()),
    }
    k = 1
    while k <= n:
        out[f"{name}/pass@{k}"] = sum(pass_at_k(n, int(c), k) for c in correct.sum(1)) / correct.shape[0]
        k *= 2
    if batch.conversations is not None:  # multi-turn rows: how often the tools were called, and to what end
        called = torch.tensor([c.tool_calls > 0 for c in batch.conversations]).view(-1, n)
        out[f"{name}/turns"] = sum(c.turns for c in batch.conversations) / batch.size
        out[f"{name}/tool_use"] = float(called.float().mean())
        out[f"{name}/correct_with_tool"] = float((called & correct).sum()) / max(int(correct.sum()), 1)
    return out


def evaluate(sets: dict, generate, score, n: int, temperature: float, max_tokens: int | None,
             seed: int | None) -> dict[str, float]:
    """Every eval set through ``generate(samples, n=, temperature=, max_tokens=, seed=)`` and
    ``score(batch) -> (rewards, metrics)``; keys "eval/..." (one set) or "eval/<name>/..."."""
    out: dict[str, float] = {}
    for name, samples in sets.items():
        batch = generate(samples, n=n, temperature=temperature, max_tokens=max_tokens, seed=seed)
        rewards, _ = score(batch)
        out.update(summarize(batch, rewards, "eval" if len(sets) == 1 else f"eval/{name}"))
    return out
