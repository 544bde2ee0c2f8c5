"""GSPO: "Group Sequence Policy Optimization" (Zheng et al., 2025).

The importance ratio is the sequence's, length-normalised, and it is clipped per sequence:

    s_i = exp( mean_t (logp_{i,t} - old_logp_{i,t}) )          over the response tokens of i
    J   = 1/G Σ_i min( s_i·A_i, clip(s_i, 1-ε_low, 1+ε_high)·A_i )

with ε = ``gspo_eps_low`` / ``gspo_eps_high`` (the paper: 3e-4 / 4e-4; a sequence ratio moves far
less than a token's). The gradient reaches every token of i through s_i:
∇s_i = s_i · 1/|y_i| Σ_t ∇logp_{i,t}, zero when the clipped term is the smaller.

Written in the paper's GSPO-token form, s_{i,t} = sg[s_i] · exp(logp_{i,t} - sg[logp_{i,t}]):
its value is s_i on every token and its gradient w.r.t. logp_{i,t} is s_i, so with one advantage
per sequence the loss, the clipping and the gradient are GSPO's exactly. The form lets the token
IS weight w_t (actor vs sampler) scale the gradient of the token it belongs to:

    loss = 1/G Σ_i 1/|y_i| Σ_t -min(s_{i,t}·A_i, clip(s_{i,t})·A_i) · w_t  [+ kl_coef · KL_t]

The 1/G Σ_i 1/|y_i| Σ_t is the paper's and fixed (``algorithm.loss_agg`` does not apply): a
sequence is the unit GSPO optimises, whatever its length.
"""

from __future__ import annotations

import torch

from colocate_rl.algorithms.terms import MAX_LOG_RATIO, LossInputs, seq_mean_token_mean
from colocate_rl.config import AlgorithmConfig


def gspo(x: LossInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (loss 0-dim, clipped [B, T] bool: the sequence's ratio was clipped, on each of its tokens)."""
    lengths = x.mask.sum(dim=1).clamp(min=1)  # [B] |y_i|
    seq_log_ratio = torch.where(x.mask, x.logprobs - x.old_logprobs, 0).sum(dim=1) / lengths  # [B]
    seq_log_ratio = seq_log_ratio.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    # sg[log s_i] + logp - sg[logp]: the value of log s_i, the gradient of logp_t
    ratio = (seq_log_ratio.unsqueeze(1) + x.logprobs - x.logprobs.detach()).exp()  # [B, T]
    adv = x.advantages.unsqueeze(1)  # [B, 1]
    surr = ratio * adv
    surr_clipped = ratio.clamp(1 - cfg.gspo_eps_low, 1 + cfg.gspo_eps_high) * adv
    pg = -torch.minimum(surr, surr_clipped)
    per_token = x.per_token(pg, cfg)
    return seq_mean_token_mean(per_token, x.mask, x.global_token_count, x.global_seq_count), surr_clipped < surr
