"""The router's placement of prompt groups on engines, and putting rows back in prompt order."""

from __future__ import annotations

import torch

from colocate_rl.rollout.router import _in_prompt_order, assign
from colocate_rl.types import RolloutBatch, Sample


def test_assign_balances_by_load_and_counts_work_in_flight():
    assert assign([10, 10, 10, 10], [0, 0]) == [0, 1, 0, 1]
    # Longest first: the big group alone on one engine, the small ones together on the other.
    assert assign([1, 1, 8, 1], [0, 0]) == [1, 1, 0, 1]
    # Engine 0 still has 25 tokens of work in flight from an earlier call: the new work goes to 1 first.
    assert assign([10, 10], [25, 0]) == [1, 1]
    loads = [3.0, 0.0]
    assign([5], loads)
    assert loads == [3.0, 0.0], "the caller's loads are not modified"


def _batch(prompts, n):
    rows = [Sample([p, p + 1], label=str(p)) for p in prompts for _ in range(n)]
    resp = [[100 + p, k] for p in prompts for k in range(n)]
    return RolloutBatch.from_rows([s.prompt_ids for s in rows], resp, rows, pad_id=0, n=n)


def test_rows_come_back_in_prompt_order_with_groups_adjacent():
    # Engine A ran prompts 2 and 0, engine B prompt 1 (its rows of another length: re-padded).
    a, b = _batch([2, 0], 3), _batch([1], 3)
    out = _in_prompt_order([([2, 0], a), ([1], b)], 3)
    assert [s.label for s in out.samples] == ["0"] * 3 + ["1"] * 3 + ["2"] * 3
    assert out.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r[1] for r in out.tokens[:, 2:4].tolist()] == [0, 1, 2] * 3  # sample k of each group kept its place
    assert torch.equal(out.tokens[:, 2], torch.tensor([100, 100, 100, 101, 101, 101, 102, 102, 102]))
