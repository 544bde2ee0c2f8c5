"""The GRPO policy loss for one micro-batch, and the token statistics logged around it.

Shapes: B sequences × T tokens, token-aligned as in colocate_rl.types (position t of every tensor
is the logprob of ``tokens[:, t]``); ``loss_mask`` is True on response tokens. Off-mask values may
be anything finite: they are selected away with ``torch.where``, never multiplied by 0 (0 × inf
is NaN).

Per token, with r = exp(logp - old_logp) and A the sequence's advantage:

    loss_t = -min(r·A, clip(r, 1-eps_low, 1+eps_high)·A) · w_t  [+ kl_coef · KL_t(logp ‖ ref)]
    w_t    = min(exp(old_logp - rollout_logp), C)  (detached)

``w`` corrects for vLLM's sampler and the actor disagreeing on the same weights (kernels,
precision): the samples come from the rollout policy, the ratio is taken against the actor's
``old_logp``. C = ``is_clamp`` bounds the variance; C = 0 disables the correction (w = 1). The
IS weight multiplies the policy-gradient term only; the KL term is a regulariser on the current
policy and is left unweighted.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from colocate_rl.config import AlgorithmConfig

# exp() of a log-ratio beyond this overflows float32 to inf (and inf·0 = NaN in the gradient);
# 20 is far outside any clip range, so the loss is unchanged wherever it was finite.
_MAX_LOG_RATIO = 20.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [B, T], mask [B, T] bool → 0-dim mean of x over the mask (0 when the mask is empty)."""
    return torch.where(mask, x, 0).sum() / mask.sum().clamp(min=1)


def logprob_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean |a - b| over masked tokens; a, b [B, T], mask [B, T] → 0-dim.

    With a = actor logprobs and b = vLLM's, this is the train/rollout mismatch: near 0 when the
    weight sync and both numerics agree, large after a broken sync.
    """
    return masked_mean((a - b).abs(), mask)


# ---------------------------------------------------------------- KL to a reference policy


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """log p - log p_ref per token: unbiased for KL(p ‖ ref), can be negative."""
    return logprobs - ref_logprobs


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """exp(d) - d - 1 with d = log p_ref - log p per token: unbiased and always >= 0 (Schulman's k3)."""
    d = ref_logprobs - logprobs
    return d.exp() - d - 1


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": kl_k1, "k3": kl_k3}


# ---------------------------------------------------------------- aggregation
#
# A batch is trained in micro-batches whose gradients accumulate, so the normaliser must be the
# whole batch's, not the micro-batch's: pass ``global_token_count`` / ``global_seq_count`` (from
# ``global_counts`` on the batch of one optimizer step) and the sum of the micro-batch losses equals
# the loss of the full batch. Left as None, the micro-batch's own count is used. With data
# parallelism the counts are the sum over ranks, and the gradient all-reduce must sum, not average.


def token_mean(
    loss: torch.Tensor, mask: torch.Tensor, global_token_count: Optional[float] = None,
    global_seq_count: Optional[float] = None,
) -> torch.Tensor:
    """Σ loss over masked tokens / token count: every token weighs the same (long answers weigh more)."""
    denom = global_token_count if global_token_count is not None else mask.sum().clamp(min=1)
    return torch.where(mask, loss, 0).sum() / denom


def seq_mean_token_mean(
    loss: torch.Tensor, mask: torch.Tensor, global_token_count: Optional[float] = None,
    global_seq_count: Optional[float] = None,
) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean: every sequence weighs the same.
    A sequence never spans micro-batches, so only the sequence count needs to be global."""
    per_seq = torch.where(mask, loss, 0).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [B]
    denom = global_seq_count if global_seq_count is not None else mask.any(dim=1).sum().clamp(min=1)
    return per_seq.sum() / denom


LOSS_AGG = {"token_mean": token_mean, "seq_mean_token_mean": seq_mean_token_mean}


def global_counts(loss_mask: torch.Tensor) -> dict[str, int]:
    """loss_mask [B, T] of the whole batch → the normalisers to pass to every micro-batch's loss."""
    return {
        "global_token_count": int(loss_mask.sum()),
        "global_seq_count": int(loss_mask.any(dim=1).sum()),
    }


# ---------------------------------------------------------------- the loss


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: AlgorithmConfig,
    *,
    ref_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    global_token_count: Optional[float] = None,
    global_seq_count: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate with token IS correction (and optional KL) for one micro-batch.

    logprobs [B, T]: current policy, with grad. old_logprobs [B, T]: the actor's logprobs before this
    step's updates. rollout_logprobs [B, T]: vLLM's. advantages [B]. loss_mask [B, T] bool.
    ref_logprobs [B, T]: needed when ``cfg.kl_coef`` > 0. entropy [B, T]: only logged.
    global_token_count / global_seq_count: see "aggregation" above.

    Returns (loss 0-dim, metrics): detached 0-dim tensors (no device sync per micro-batch), each a
    mean over this micro-batch's masked tokens unless named otherwise:
      clip_frac       tokens where the clipped term was the smaller one (its gradient is 0)
      is_weight_mean  the IS weight as applied (after the clamp)
      is_weight_max   the raw IS weight before the clamp: how far vLLM and the actor disagree
      is_clamped_frac tokens whose raw weight exceeded C
      approx_kl       KL(old ‖ new) by k3: (r - 1) - log r, r = exp(logp - old_logp)
      train_rollout_logprob_abs_diff  mean |old_logp - rollout_logp|
      kl_ref          (when kl_coef > 0) the KL estimate to the reference
      entropy         (when passed in)
    """
    old_logprobs, rollout_logprobs = old_logprobs.detach(), rollout_logprobs.detach()
    mask = loss_mask.bool()
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    adv = advantages.detach().unsqueeze(1)  # [B, 1]
    surr = ratio * adv
    surr_clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv
    pg = -torch.minimum(surr, surr_clipped)  # [B, T]

    with torch.no_grad():
        is_raw = (old_logprobs - rollout_logprobs).clamp(max=_MAX_LOG_RATIO).exp()
        is_weight = is_raw.clamp(max=cfg.is_clamp) if cfg.is_clamp > 0 else torch.ones_like(is_raw)
    per_token = pg * is_weight

    metrics: dict[str, torch.Tensor] = {}
    if cfg.kl_coef:
        if ref_logprobs is None:
            raise ValueError("algorithm.kl_coef > 0 needs ref_logprobs (the reference policy's logprobs)")
        kl = KL_ESTIMATORS[cfg.kl_type](logprobs, ref_logprobs.detach())
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl_ref"] = masked_mean(kl.detach(), mask)

    if cfg.loss_agg not in LOSS_AGG:
        raise ValueError(f"unknown loss_agg '{cfg.loss_agg}': one of {', '.join(sorted(LOSS_AGG))}")
    loss = LOSS_AGG[cfg.loss_agg](per_token, mask, global_token_count, global_seq_count)

    with torch.no_grad():
        metrics["clip_frac"] = masked_mean((surr_clipped < surr).to(ratio.dtype), mask)
        metrics["is_weight_mean"] = masked_mean(is_weight, mask)
        metrics["is_weight_max"] = torch.where(mask, is_raw, 0).max() if mask.numel() else is_raw.new_zeros(())
        clamped = is_raw > cfg.is_clamp if cfg.is_clamp > 0 else torch.zeros_like(mask)
        metrics["is_clamped_frac"] = masked_mean(clamped.to(ratio.dtype), mask)
        metrics["approx_kl"] = masked_mean(ratio - 1 - log_ratio, mask)
        metrics["train_rollout_logprob_abs_diff"] = logprob_abs_diff(old_logprobs, rollout_logprobs, mask)
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.detach(), mask)
    return loss, {k: v.detach() for k, v in metrics.items()}
