"""Pure-torch RL pieces: advantages and policy losses, each a registry by name (shapes in each
docstring). ``ADVANTAGES`` and ``POLICY_LOSSES`` hold the names ``algorithm.advantage`` and
``algorithm.policy_loss`` accept."""

from colocate_rl.algorithms.advantages import ADVANTAGES, AdvantageFn, get_advantage_fn, grpo
from colocate_rl.algorithms.losses import POLICY_LOSSES, PolicyLossFn, gap_summary, get_policy_loss, policy_loss
from colocate_rl.algorithms.terms import (
    KL_ESTIMATORS,
    LOSS_AGG,
    LossInputs,
    global_counts,
    logprob_abs_diff,
    masked_mean,
)

__all__ = [
    "ADVANTAGES", "AdvantageFn", "KL_ESTIMATORS", "LOSS_AGG", "LossInputs", "POLICY_LOSSES", "PolicyLossFn",
    "gap_summary", "get_advantage_fn", "get_policy_loss", "global_counts", "grpo", "logprob_abs_diff", "masked_mean",
    "policy_loss",
]
