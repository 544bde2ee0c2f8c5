"""CISPO: "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention" (MiniMax, 2025).

PPO's clip drops the gradient of a token whose ratio left the trust region, and the tokens it drops
first are the rare ones ("However", "Wait") that open a new line of reasoning. CISPO clips the
importance weight instead and stops its gradient, so every token keeps a REINFORCE gradient whose
weight is bounded:

    loss_t = -sg(min(r_t, 1 + ε_high)) · A · logp_t · w_t  [+ kl_coef · KL_t],   r_t = exp(logp_t - old_logp_t)

with ε_high = ``algorithm.cispo_eps_high``; like the paper, no lower bound. The gradient w.r.t.
logp_t is -min(r_t, 1+ε_high)·A·w_t. The paper normalises by the batch's token count: that is
``algorithm.loss_agg=token_mean`` (the default), which applies here.
"""

from __future__ import annotations

import torch

from colocate_rl.algorithms.terms import LossInputs
from colocate_rl.config import AlgorithmConfig


def cispo(x: LossInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (loss 0-dim, clipped [B, T] bool: the weight was truncated; the token keeps its gradient)."""
    ratio = x.log_ratio().exp().detach()
    cap = 1 + cfg.cispo_eps_high
    pg = -ratio.clamp(max=cap) * x.advantages.unsqueeze(1) * x.logprobs
    return x.aggregate(x.per_token(pg, cfg), cfg), ratio > cap
