"""Pure-torch GRPO pieces: advantages and the policy loss (shapes in each docstring)."""

from colocate_rl.algorithms.advantages import ADVANTAGES, get_advantage_fn, grpo, grpo_no_std
from colocate_rl.algorithms.losses import (
    KL_ESTIMATORS,
    LOSS_AGG,
    global_counts,
    logprob_abs_diff,
    masked_mean,
    policy_loss,
)

__all__ = [
    "ADVANTAGES", "KL_ESTIMATORS", "LOSS_AGG", "get_advantage_fn", "global_counts", "grpo", "grpo_no_std",
    "logprob_abs_diff", "masked_mean", "policy_loss",
]
