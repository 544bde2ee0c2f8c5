"""What every policy loss is built from: the micro-batch as a loss sees it, the token IS weight and
KL term, masked means, and the aggregation of per-token terms over an optimizer step's batch.

Shapes: B sequences × T tokens, token-aligned as in colocate_rl.types (position t of every tensor
is the logprob of ``tokens[:, t]``); the mask is True on response tokens. Off-mask values may be
anything finite: they are selected away with ``torch.where``, never multiplied by 0 (0 × inf is NaN).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from colocate_rl.config import AlgorithmConfig

# exp() of a log-ratio beyond this overflows float32 to inf (and inf·0 = NaN in the gradient);
# 20 is far outside any clip range, so the loss is unchanged wherever it was finite.
MAX_LOG_RATIO = 20.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [B, T], mask [B, T] bool → 0-dim mean of x over the mask (0 when the mask is empty)."""
    return torch.where(mask, x, 0).sum() / mask.sum().clamp(min=1)


def logprob_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean |a - b| over masked tokens; a, b [B, T], mask [B, T] → 0-dim.

    With a = actor logprobs and b = vLLM's, this is the train/rollout mismatch: near 0 when the
    weight sync and both numerics agree, large after a broken sync.
    """
    return masked_mean((a - b).abs(), mask)


# The distribution of the train/rollout gap. Quantiles do not add up over micro-batches and ranks;
# token counts per bin do, so each micro-batch reports a histogram and the step's quantiles are
# read from their sum. Bins: 16 per decade from 1e-8 to 1e2 (a quantile is known to within ±7.5%),
# one below for exact agreement, one above.
GAP_EDGES = torch.logspace(-8, 2, 161, dtype=torch.float64)


def gap_histogram(diff: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """diff [B, T] (≥ 0), mask [B, T] bool → [162] float64 token counts: bin 0 holds diff < 1e-8
    (exact zeros), bin i holds GAP_EDGES[i-1] ≤ diff < GAP_EDGES[i], bin 161 holds diff ≥ 100."""
    edges = _gap_edges(diff.device)
    index = torch.bucketize(torch.where(mask, diff, 0).double().reshape(-1), edges, right=True)
    # index_add_ rather than bincount or boolean indexing: both read a size back from the device,
    # a sync per micro-batch. Off-mask tokens are counted with weight 0.
    counts = torch.zeros(len(edges) + 1, dtype=torch.float64, device=diff.device)
    return counts.index_add_(0, index, mask.reshape(-1).double())


@functools.lru_cache(maxsize=None)
def _gap_edges(device: torch.device) -> torch.Tensor:
    return GAP_EDGES.to(device)


def histogram_quantile(hist: torch.Tensor, q: float) -> float:
    """The q-quantile (0 < q ≤ 1) of the tokens counted in ``hist`` [162] (gap_histogram's bins):
    0 in the exact bin, the geometric middle of a bin's edges, 100 above them; 0 for no tokens."""
    counts = hist.double().cpu()
    total = float(counts.sum())
    if total <= 0:
        return 0.0
    k = int(torch.searchsorted(counts.cumsum(0), torch.tensor(q * total, dtype=torch.float64)))
    if k == 0:
        return 0.0
    if k >= len(GAP_EDGES):
        return float(GAP_EDGES[-1])
    return float((GAP_EDGES[k - 1] * GAP_EDGES[k]).sqrt())


def first_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """mask [B, T] bool → [B, T] bool: each row's first masked token (its first response token)."""
    return mask & (mask.cumsum(1) == 1)


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """mask [B, T] bool → [B, T] bool: each row's last masked token (its EOS where it finished)."""
    return mask & (mask.flip(1).cumsum(1).flip(1) == 1)


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
# A sequence never spans micro-batches, so a per-sequence quantity needs no global count.


def seq_count(mask: torch.Tensor, global_seq_count: Optional[float] = None):
    """The number of sequences with a loss token: ``global_seq_count``, else this micro-batch's."""
    return global_seq_count if global_seq_count is not None else mask.any(dim=1).sum().clamp(min=1)


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
    """Mean over sequences of each sequence's token mean: every sequence weighs the same."""
    per_seq = torch.where(mask, loss, 0).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [B]
    return per_seq.sum() / seq_count(mask, global_seq_count)


LOSS_AGG = {"token_mean": token_mean, "seq_mean_token_mean": seq_mean_token_mean}


def global_counts(loss_mask: torch.Tensor) -> dict[str, int]:
    """loss_mask [B, T] of the whole batch → the normalisers to pass to every micro-batch's loss."""
    return {
        "global_token_count": int(loss_mask.sum()),
        "global_seq_count": int(loss_mask.any(dim=1).sum()),
    }


# ---------------------------------------------------------------- a micro-batch, as a loss sees it


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch for a policy loss (built by ``policy_loss``; every tensor on one device).

    logprobs [B, T]: current policy, with grad. old_logprobs [B, T]: the actor's before this step's
    updates, detached. advantages [B]: detached. mask [B, T] bool: response tokens.
    is_weight [B, T]: the token IS weight min(exp(old_logp - rollout_logp), C), detached (1 where
    ``is_clamp`` = 0). ref_logprobs [B, T] or None. The counts: see "aggregation" above;
    max_response_tokens: the run's generation budget (``rollout.max_response_tokens``), or None.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    is_weight: torch.Tensor
    ref_logprobs: Optional[torch.Tensor] = None
    global_token_count: Optional[float] = None
    global_seq_count: Optional[float] = None
    max_response_tokens: Optional[int] = None

    def log_ratio(self) -> torch.Tensor:
        """log(π / π_old) per token [B, T], clamped so that exp() stays finite."""
        return (self.logprobs - self.old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)

    def per_token(self, pg: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
        """pg [B, T] (a policy-gradient term) → pg · w (+ kl_coef · KL(π ‖ ref)) [B, T].

        ``w`` corrects for vLLM's sampler and the actor disagreeing on the same weights (kernels,
        precision): the samples come from the rollout policy, the ratio is taken against the
        actor's ``old_logprobs``. The IS weight multiplies the policy-gradient term only; the KL
        term is a regulariser on the current policy and is left unweighted.
        """
        per_token = pg * self.is_weight
        if cfg.kl_coef:
            per_token = per_token + cfg.kl_coef * KL_ESTIMATORS[cfg.kl_type](self.logprobs, self.ref_logprobs)
        return per_token

    def aggregate(self, per_token: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
        """per_token [B, T] → 0-dim, by ``cfg.loss_agg`` with this micro-batch's global counts."""
        if cfg.loss_agg not in LOSS_AGG:
            raise ValueError(f"algorithm.loss_agg={cfg.loss_agg!r} is not one of {', '.join(sorted(LOSS_AGG))}")
        return LOSS_AGG[cfg.loss_agg](per_token, self.mask, self.global_token_count, self.global_seq_count)
