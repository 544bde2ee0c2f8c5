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
                       micro_batch_size: int) -> list[torch.Tensor]:
    """This rank's micro-batches (row index tensors) of ``rows``; every rank gets the same count.

    rows [R] global row indices, lengths [n_rows] real tokens per row.
    """
    if len(rows) % dp:
        raise ValueError(f"{len(rows)} rows do not split over {dp} data-parallel ranks")
    order = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    i = torch.arange(len(order))
    lane = torch.where((i // dp) % 2 == 0, i % dp, dp - 1 - i % dp)
    mine = order[lane == dp_rank]
    return list(mine.split(micro_batch_size))
