"""Micro-batches by tokens (actor.micro_batch_tokens): every row once, each micro-batch within the
budget counting its padding (unless one row alone is longer), the same count on every
data-parallel rank, and fewer passes than fixed row counts need for the same memory."""

from __future__ import annotations

import pytest
import torch

from colocate_rl.trainer.batching import rank_micro_batches


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_token_budget_micro_batches(dp, seed):
    g = torch.Generator().manual_seed(seed)
    n, budget = 64, 2048
    # a long tail, as RL responses have: most rows short, a few near the cap, one over the budget
    lengths = torch.cat([torch.randint(40, 300, (n - 9,), generator=g), torch.randint(900, 1100, (8,), generator=g),
                         torch.tensor([2500])])
    rows = torch.arange(n)
    per_rank = [rank_micro_batches(rows, lengths, dp, r, micro_batch_size=4, max_tokens=budget) for r in range(dp)]
    assert len({len(mbs) for mbs in per_rank}) == 1  # expert-parallel all-to-alls need equal counts
    seen = sorted(int(i) for mbs in per_rank for mb in mbs for i in mb)
    assert seen == rows.tolist()
    for mbs in per_rank:
        for mb in mbs:
            assert len(mb) >= 1
            padded = len(mb) * int(lengths[mb].max())
            assert padded <= budget or len(mb) == 1, (mb.tolist(), padded)
    # against fixed rows sized for the longest row (what fits the same memory): fewer passes
    fixed = [rank_micro_batches(rows, lengths, dp, r, micro_batch_size=1) for r in range(dp)]
    assert len(per_rank[0]) < len(fixed[0]) / 3


def test_zero_budget_keeps_the_row_count_and_a_long_row_runs_alone():
    lengths = torch.tensor([10, 50, 20, 30])
    rows = torch.arange(4)
    assert [mb.tolist() for mb in rank_micro_batches(rows, lengths, 1, 0, micro_batch_size=3)] == [[1, 3, 2], [0]]
    assert [mb.tolist() for mb in rank_micro_batches(rows, lengths, 1, 0, 3, max_tokens=40)] == [[1], [3], [2, 0]]


def test_a_rank_with_shorter_rows_splits_to_the_same_count():
    # rows dealt 0 1 1 0 0 1 by length: rank 0 gets 100, 30, 30 (two passes at 100 tokens), rank 1
    # 30, 30, 30 (one would do), so rank 1 splits its pass in two
    lengths = torch.tensor([100, 30, 30, 30, 30, 30])
    per_rank = [rank_micro_batches(torch.arange(6), lengths, 2, r, 1, max_tokens=100) for r in range(2)]
    assert [[mb.tolist() for mb in mbs] for mbs in per_rank] == [[[0], [3, 4]], [[1, 2], [5]]]
