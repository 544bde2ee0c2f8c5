"""Which rows of a batch each data-parallel rank trains on, in which micro-batches.

Every rank receives the whole batch and picks its share, so global normalisers (token and
sequence counts of a mini-batch) need no communication. Within a mini-batch, rows are ordered by
length and dealt to the data-parallel ranks back and forth (0 1 1 0 0 1 ...), so ranks get similar
token counts and each micro-batch holds rows of similar length (RolloutBatch.select trims a micro-batch to its
longest row, so padding costs little). Sums over rows do not depend on their order.
"""

from __future__ import annotations

import torch


def minibatches(n_rows: int, num_minibatches: int, dp: int) -> list[torch.Tensor]:
    """Row indices [n_rows / num_minibatches] of each mini-batch (contiguous, so groups stay whole)."""
    if n_rows % (num_minibatches * dp):
        raise ValueError(
            f"a batch of {n_rows} rows does not split into actor.num_minibatches={num_minibatches} "
            f"x {dp} data-parallel rank(s)"
        )
    return list(torch.arange(n_rows).chunk(num_minibatches))


def rank_micro_batches(rows: torch.Tensor, lengths: torch.Tensor, dp: int, dp_rank: int,
                       micro_batch_size: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """This rank's micro-batches (row index tensors) of ``rows``; every rank gets the same count
    (expert-parallel all-to-alls and pipeline stages run one pass per micro-batch on every rank).

    rows [R] global row indices, lengths [n_rows] real tokens per row. ``max_tokens`` > 0: each
    micro-batch takes rows, longest first, while its rows times its longest row (the tokens it runs,
    padding included) stay within ``max_tokens``; a row longer than that runs alone.
    ``micro_batch_size`` rows each otherwise.
    """
    if len(rows) % dp:
        raise ValueError(f"{len(rows)} rows do not split over {dp} data-parallel ranks")
    order = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    i = torch.arange(len(order))
    lane = torch.where((i // dp) % 2 == 0, i % dp, dp - 1 - i % dp)
    if not max_tokens:
        return list(order[lane == dp_rank].split(micro_batch_size))
    per_rank = [_fill(lengths[order[lane == r]].tolist(), max_tokens) for r in range(dp)]
    count = max(len(sizes) for sizes in per_rank)
    sizes = _split_to(per_rank[dp_rank], count)
    return list(order[lane == dp_rank].split(sizes))


def _fill(lens: list[int], max_tokens: int) -> list[int]:
    """Row counts of consecutive micro-batches over ``lens`` (descending): each as many rows as fit
    ``max_tokens`` at the length of its first, longest row (at least one)."""
    sizes, at = [], 0
    while at < len(lens):
        n = max(1, min(max_tokens // max(lens[at], 1), len(lens) - at))
        sizes.append(n)
        at += n
    return sizes


def _split_to(sizes: list[int], count: int) -> list[int]:
    """``sizes`` with its largest micro-batches halved until there are ``count`` of them (a rank
    whose rows fit in fewer passes than another's)."""
    sizes = list(sizes)
    while len(sizes) < count:
        j = max(range(len(sizes)), key=lambda k: sizes[k])
        half = sizes[j] // 2
        sizes[j:j + 1] = [sizes[j] - half, half]
    return sizes
