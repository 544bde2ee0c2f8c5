"""The policy loss: one entry point, ``policy_loss``, that the actor calls once per micro-batch;
the objective is picked by name (``algorithm.policy_loss``) from ``POLICY_LOSSES``.

A policy loss is ``fn(x: LossInputs, cfg) -> (loss 0-dim, clipped [B, T] bool)``: it builds its
per-token policy-gradient term from ``x`` (terms.py), lets ``x.per_token`` apply the token IS
weight and the KL term, and normalises (``x.aggregate`` by ``algorithm.loss_agg``, or the
normaliser its paper fixes). Everything else (the IS weight, the checks, the metrics) is here,
the same for every loss. Adding one: a module with its function, and one line in POLICY_LOSSES.

The token IS weight, w_t = min(exp(old_logp - rollout_logp), C) (detached): ``old_logp`` is the
actor's, the samples are vLLM's, and the two disagree on the same weights (kernels, precision).
C = ``is_clamp`` bounds the variance; C = 0 disables the correction (w = 1).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from colocate_rl.algorithms.cispo import cispo
from colocate_rl.algorithms.dr_grpo import dr_grpo
from colocate_rl.algorithms.gspo import gspo
from colocate_rl.algorithms.ppo_clip import ppo_clip
from colocate_rl.algorithms.terms import (
    KL_ESTIMATORS,
    MAX_LOG_RATIO,
    LossInputs,
    first_token_mask,
    gap_histogram,
    histogram_quantile,
    last_token_mask,
    logprob_abs_diff,
    masked_mean,
)
from colocate_rl.config import AlgorithmConfig

PolicyLossFn = Callable[[LossInputs, AlgorithmConfig], tuple[torch.Tensor, torch.Tensor]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo_clip": ppo_clip,
    "gspo": gspo,
    "dr_grpo": dr_grpo,
    "cispo": cispo,
}


def get_policy_loss(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSSES:
        raise ValueError(f"algorithm.policy_loss={name!r} is not one of {', '.join(sorted(POLICY_LOSSES))}")
    return POLICY_LOSSES[name]


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
    max_response_tokens: Optional[int] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``cfg.policy_loss`` with token IS correction (and optional KL) for one micro-batch.

    logprobs [B, T]: current policy, with grad. old_logprobs [B, T]: the actor's logprobs before this
    step's updates. rollout_logprobs [B, T]: vLLM's. advantages [B]. loss_mask [B, T] bool.
    ref_logprobs [B, T]: needed when ``cfg.kl_coef`` > 0. entropy [B, T]: only logged.
    global_token_count / global_seq_count: see "aggregation" in terms.py. max_response_tokens: the
    run's ``rollout.max_response_tokens`` (Dr. GRPO's normaliser when ``cfg.loss_norm_tokens`` = 0).

    Returns (loss 0-dim, metrics): detached 0-dim tensors (no device sync per micro-batch), each a
    mean over this micro-batch's masked tokens unless named otherwise:
      clip_frac       tokens the loss clipped (ppo_clip, dr_grpo: the clipped term was the smaller,
                      its gradient is 0; gspo: the token's sequence ratio was; cispo: the weight was
                      truncated, the gradient kept)
      is_weight_mean  the IS weight as applied (after the clamp)
      is_weight_max   the raw IS weight before the clamp: how far vLLM and the actor disagree
      is_clamped_frac tokens whose raw weight exceeded C
      approx_kl       KL(old ‖ new) by k3: (r - 1) - log r, r = exp(logp - old_logp)
      train_rollout_logprob_abs_diff  mean |old_logp - rollout_logp|
      train_rollout_logprob_abs_diff_max  its largest token (the trainer maxes '_max' metrics)
      train_rollout_logprob_abs_diff_hist, _first_total, first_tokens_total  summed over the
                      step (the trainer sums '_hist' and '_total' metrics); gap_summary turns them
                      into the step's _p50, _p99 and _first (the first response token's mean)
      kl_ref          (when kl_coef > 0) the KL estimate to the reference
      entropy         (when passed in)
    """
    fn = get_policy_loss(cfg.policy_loss)
    old_logprobs, rollout_logprobs = old_logprobs.detach(), rollout_logprobs.detach()
    mask = loss_mask.bool()
    if cfg.kl_coef and ref_logprobs is None:
        raise ValueError("algorithm.kl_coef > 0 needs ref_logprobs (the reference policy's logprobs)")
    with torch.no_grad():
        is_raw = (old_logprobs - rollout_logprobs).clamp(max=MAX_LOG_RATIO).exp()
        is_weight = is_raw.clamp(max=cfg.is_clamp) if cfg.is_clamp > 0 else torch.ones_like(is_raw)
    x = LossInputs(
        logprobs, old_logprobs, advantages.detach(), mask, is_weight,
        ref_logprobs=None if ref_logprobs is None else ref_logprobs.detach(),
        global_token_count=global_token_count, global_seq_count=global_seq_count,
        max_response_tokens=max_response_tokens,
    )
    loss, clipped = fn(x, cfg)

    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        log_ratio = x.log_ratio()
        ratio = log_ratio.exp()
        if cfg.kl_coef:
            metrics["kl_ref"] = masked_mean(KL_ESTIMATORS[cfg.kl_type](logprobs, x.ref_logprobs), mask)
        metrics["clip_frac"] = masked_mean(clipped.to(ratio.dtype), mask)
        metrics["is_weight_mean"] = masked_mean(is_weight, mask)
        metrics["is_weight_max"] = torch.where(mask, is_raw, 0).max() if mask.numel() else is_raw.new_zeros(())
        clamped = is_raw > cfg.is_clamp if cfg.is_clamp > 0 else torch.zeros_like(mask)
        metrics["is_clamped_frac"] = masked_mean(clamped.to(ratio.dtype), mask)
        metrics["approx_kl"] = masked_mean(ratio - 1 - log_ratio, mask)
        metrics["train_rollout_logprob_abs_diff"] = logprob_abs_diff(old_logprobs, rollout_logprobs, mask)
        gap = (old_logprobs - rollout_logprobs).abs()
        metrics["train_rollout_logprob_abs_diff_max"] = (torch.where(mask, gap, 0).max() if mask.numel()
                                                         else is_raw.new_zeros(()))
        # Summed over the step, not averaged (see gap_summary): the histogram, the first and last
        # response tokens' gaps beside the count of rows, and the part of the gap in tokens more
        # than 1 nat apart beside the whole.
        metrics["train_rollout_logprob_abs_diff_hist"] = gap_histogram(gap, mask)
        first = first_token_mask(mask)
        metrics["train_rollout_logprob_abs_diff_first_total"] = torch.where(first, gap, 0).sum()
        metrics["train_rollout_logprob_abs_diff_last_total"] = torch.where(last_token_mask(mask), gap, 0).sum()
        metrics["first_tokens_total"] = first.sum()
        metrics["train_rollout_logprob_abs_diff_over1_total"] = torch.where(mask & (gap > 1), gap, 0).sum()
        metrics["train_rollout_logprob_abs_diff_sum_total"] = torch.where(mask, gap, 0).sum()
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.detach(), mask)
    return loss, {k: v.detach() for k, v in metrics.items()}


def gap_summary(step: dict) -> dict:
    """A step's reduced metrics with the gap's summed parts (policy_loss's '_hist' and '_total'
    entries) replaced by floats: train_rollout_logprob_abs_diff_p50 / _p99, _first and _last (per
    row), and _tail_share (the share of the gap's sum in tokens more than 1 nat apart)."""
    key = "train_rollout_logprob_abs_diff"
    out = dict(step)
    hist = out.pop(f"{key}_hist", None)
    first, last = out.pop(f"{key}_first_total", None), out.pop(f"{key}_last_total", None)
    over1, total = out.pop(f"{key}_over1_total", None), out.pop(f"{key}_sum_total", None)
    rows = out.pop("first_tokens_total", None)
    if hist is not None:
        out[f"{key}_p50"] = histogram_quantile(hist, 0.5)
        out[f"{key}_p99"] = histogram_quantile(hist, 0.99)
    if first is not None and rows:
        out[f"{key}_first"] = float(first) / float(rows)
    if last is not None and rows:
        out[f"{key}_last"] = float(last) / float(rows)
    if over1 is not None and total:
        out[f"{key}_tail_share"] = float(over1) / float(total)
    return out
