"""Rewards by name: ``fn(response, label) -> float``, scored in a pool of worker processes."""

from colocate_rl.rewards import arithmetic, math  # noqa: F401 - registers the built-in rewards
from colocate_rl.rewards.registry import REWARDS, Reward, RewardFn, get_reward, get_reward_fn, register
from colocate_rl.rewards.scorer import RewardScorer, score_batch

__all__ = ["REWARDS", "Reward", "RewardFn", "RewardScorer", "get_reward", "get_reward_fn", "register", "score_batch"]
