"""DAPO's dynamic sampling: groups whose rewards are all equal are dropped and the step is refilled
with groups that carry signal, up to the round limit."""

import torch

from colocate_rl.rollout.dynamic import informative, refill
from colocate_rl.types import RolloutBatch, Sample


def scored(rewards: list[list[float]], first_prompt: int = 0) -> RolloutBatch:
    """One group per inner list (n = its length); prompt i holds token 100 + i so groups are traceable."""
    n = len(rewards[0])
    prompts = [[100 + first_prompt + g] for g in range(len(rewards)) for _ in range(n)]
    b = RolloutBatch.from_rows(prompts, [[1, 2]] * len(prompts), [Sample(p) for p in prompts], 0, n=n)
    b.rewards = torch.tensor([r for g in rewards for r in g])
    return b


def test_informative_groups():
    assert informative(torch.tensor([1.0, 1, 0, 1, 0, 0]), 2).tolist() == [False, True, False]


def test_refill_keeps_signal_and_tops_up_to_the_target():
    first = scored([[1, 1], [0, 1], [0, 0], [1, 0]])  # groups 1 and 3 carry signal
    calls = []

    def more(k, round):  # k groups with signal after one without
        calls.append((k, round))
        return scored([[0, 0]] + [[0, 1]] * k, first_prompt=10 * round)

    out, m = refill(first, target=4, more=more, max_rounds=3)
    assert calls == [(2, 1)]
    assert out.size == 8 and out.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [int(out.tokens[i, 0]) for i in range(0, 8, 2)] == [101, 103, 111, 112]
    assert m == {"rollout/dynamic_rounds": 1.0, "rollout/dynamic_kept_frac": 4 / 7, "rollout/dynamic_groups": 4.0}


def test_refill_stops_at_the_round_limit_and_never_returns_nothing():
    def more(k, round):
        return scored([[1, 1]] * k, first_prompt=10 * round)

    out, m = refill(scored([[0, 1], [1, 1]]), target=2, more=more, max_rounds=2)
    assert out.size == 2 and m["rollout/dynamic_rounds"] == 2 and m["rollout/dynamic_groups"] == 1
    all_equal = scored([[1, 1], [0, 0]])
    out, m = refill(all_equal, target=2, more=more, max_rounds=1)
    assert out is all_equal and m["rollout/dynamic_groups"] == 0
