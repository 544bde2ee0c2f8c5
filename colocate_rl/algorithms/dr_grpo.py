"""Dr. GRPO: "Understanding R1-Zero-Like Training: A Critical Perspective" (Liu et al., 2025).

GRPO divides each response's loss by its own length: among right answers the short ones get the
larger update, among wrong ones the long ones get the smaller penalty, so wrong answers grow long.
Dr. GRPO sums the tokens and divides by a constant instead:

    loss = 1/(L·G) Σ_i Σ_t -min(r_{i,t}·A_i, clip(r_{i,t})·A_i) · w_t  [+ kl_coef · KL_t]

with PPO's clipped surrogate per token (ppo_clip.py), G the number of sequences and
L = ``algorithm.loss_norm_tokens``, 0 = the run's ``rollout.max_response_tokens`` (the paper
divides by the generation budget). The normaliser is the paper's and fixed
(``algorithm.loss_agg`` does not apply). Its other half is the advantage without the std division:
``algorithm.advantage=dr_grpo`` (advantages.py).
"""

from __future__ import annotations

import torch

from colocate_rl.algorithms.ppo_clip import clipped_surrogate
from colocate_rl.algorithms.terms import LossInputs, seq_count
from colocate_rl.config import AlgorithmConfig


def dr_grpo(x: LossInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (loss 0-dim, clipped [B, T] bool). Needs ``cfg.loss_norm_tokens`` > 0 or ``x.max_response_tokens``."""
    if cfg.loss_norm_tokens < 0:
        raise ValueError(
            f"algorithm.loss_norm_tokens={cfg.loss_norm_tokens} must be >= 0 (0 = rollout.max_response_tokens)")
    norm_tokens = cfg.loss_norm_tokens or x.max_response_tokens
    if not norm_tokens:
        raise ValueError("algorithm.policy_loss='dr_grpo' needs algorithm.loss_norm_tokens > 0 or the run's "
                         "rollout.max_response_tokens (pass max_response_tokens to policy_loss)")
    pg, clipped = clipped_surrogate(x, cfg)
    per_token = x.per_token(pg, cfg)
    return torch.where(x.mask, per_token, 0).sum() / (norm_tokens * seq_count(x.mask, x.global_seq_count)), clipped
