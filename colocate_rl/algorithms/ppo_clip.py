"""PPO's clipped surrogate, per token (the GRPO loss).

Per token, with r = exp(logp - old_logp) and A the sequence's advantage:

    loss_t = -min(r·A, clip(r, 1-eps_low, 1+eps_high)·A) · w_t  [+ kl_coef · KL_t(logp ‖ ref)]

aggregated by ``algorithm.loss_agg``. A token whose clipped term is the smaller one has no gradient.
"""

from __future__ import annotations

import torch

from colocate_rl.algorithms.terms import LossInputs
from colocate_rl.config import AlgorithmConfig


def clipped_surrogate(x: LossInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (pg [B, T] = -min(r·A, clip(r)·A), clipped [B, T] bool: the clipped term was the smaller)."""
    ratio = x.log_ratio().exp()
    adv = x.advantages.unsqueeze(1)  # [B, 1]
    surr = ratio * adv
    surr_clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv
    return -torch.minimum(surr, surr_clipped), surr_clipped < surr


def ppo_clip(x: LossInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (loss 0-dim, clipped [B, T] bool)."""
    pg, clipped = clipped_surrogate(x, cfg)
    return x.aggregate(x.per_token(pg, cfg), cfg), clipped
