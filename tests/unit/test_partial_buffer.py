"""The partial-rollout buffer (rollout/partial.py): which groups are in flight, what a step trains,
how unfinished rows continue from their tokens, and the staleness bound. The engine side runs
against vLLM in tests/integration/test_partial_rollouts.py; here a scripted generator stands in for it:
each row has a length, and every call adds up to ``chunk`` tokens to every row it is given."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from colocate_rl.resolved import Sampling, Scheduling
from colocate_rl.rollout.partial import PartialRollouts, Segment, in_group_order, quota, version_lag
from colocate_rl.types import RolloutBatch, Sample

N = 2
SAMPLING = Sampling(n=N, temperature=1.0, top_p=1.0, top_k=0, max_response_tokens=10, seed=0, seed_each_step=True)
SCHEDULING = Scheduling(off_policy=False, custom_fn="", max_engine_restarts=0, dynamic_sampling=False,
                        dynamic_max_rounds=0, max_staleness=1, partial=True, over_sample=2)


class Script:
    """A generator whose row k of prompt p ends after lengths[p][k] tokens (token ids 100·p + its
    position); each call adds up to ``chunk`` tokens to every row. Records what it was asked."""

    def __init__(self, lengths: dict[int, list[int]], chunk: int):
        self.lengths, self.chunk, self.calls = lengths, chunk, []

    def __call__(self, groups, needed, total):
        self.calls.append((groups, needed, total))
        out = []
        for g in groups:
            p = g.prompt_ids[0]
            segs = []
            for row in g.rows:
                k = self._row(p, row)
                end = min(self.lengths[p][k], len(row.prefix) + self.chunk)
                toks = [100 * p + i for i in range(len(row.prefix), end)]
                done = end == self.lengths[p][k]
                segs.append(Segment(toks, [-0.5] * len(toks), "stop" if done else None, "t" * end if done else ""))
            out.append(segs)
        return out

    def _row(self, p: int, row) -> int:
        """The row index is read back from its seed (seed + j·n + k with seed 0)."""
        return row.seed % N


def pool(scheduling=SCHEDULING, prompts_per_step=2, start=1):
    drawn = iter(range(start, 1000))
    return PartialRollouts(scheduling, SAMPLING, prompts_per_step, lambda k: [Sample([next(drawn)]) for _ in range(k)])


def test_over_sampling_draws_until_prompts_per_step_plus_over_sample_are_in_flight():
    p = pool()
    extra = p.extra_prompts()
    assert [s.prompt_ids for s in extra] == [[1], [2]]  # 2 + over_sample 2 - nothing in flight
    script = Script({1: [1, 1], 2: [5, 1], 3: [1, 1], 4: [9, 9]}, chunk=2)
    batch, m = p.produce([Sample([3]), Sample([4])] + extra, script, seed=0, version=0, trains_at=0)
    groups, needed, total = script.calls[0]
    assert (needed, total) == (2, 4) and [g.prompt_ids for g in groups] == [[3], [4], [1], [2]]
    # Seeds: row k of the group at position j is seed + j*n + k, as vLLM seeds a whole-batch generate.
    assert [r.seed for g in groups for r in g.rows] == list(range(8))
    # Prompts 3 and 1 finished within the call; 4 and 2 carry rows over.
    assert [s.prompt_ids for s in batch.samples] == [[3], [3], [1], [1]]
    assert batch.group_ids.tolist() == [0, 0, 1, 1] and batch.token_versions is not None
    assert m["partial/groups"] == 2 and m["partial/carried"] == 3 and m["partial/tokens"] == 11
    assert p.extra_prompts() == [], "two groups in flight already: the step's own two prompts fill it"


def test_a_carried_row_continues_from_its_tokens_and_keeps_their_versions():
    p = pool(replace(SCHEDULING, max_staleness=3))
    script = Script({1: [3, 1], 2: [1, 1]}, chunk=2)
    first, _ = p.produce([Sample([1]), Sample([2])], script, seed=0, version=0, trains_at=0)
    assert [s.prompt_ids for s in first.samples] == [[2], [2]]
    second, m = p.produce([], script, seed=10, version=1, trains_at=1)
    (group,) = script.calls[1][0]
    assert group.prompt_ids == [1] and [r.prefix for r in group.rows] == [[100, 101]], "only the unfinished row"
    assert group.rows[0].max_tokens == SAMPLING.max_response_tokens - 2
    row = second.tokens[0, 1: 4].tolist()
    assert row == [100, 101, 102] and second.responses[0] == "ttt"
    assert second.token_versions[0, 1:4].tolist() == [0, 0, 1], "each token with the weights that sampled it"
    assert second.rollout_logprobs[0, 1:4].tolist() == [-0.5] * 3 and second.loss_mask[0, 1:4].all()
    assert m["partial/resumed"] == 1 and m["partial/finished_carried"] == 2 and m["partial/carried_age_max"] == 1


def test_rows_past_the_staleness_bound_are_regenerated_from_their_prompt():
    p = pool(replace(SCHEDULING, max_staleness=1))
    script = Script({1: [6, 6], 2: [1, 1]}, chunk=2)
    p.produce([Sample([1]), Sample([2])], script, seed=0, version=0, trains_at=0)
    p.produce([], script, seed=0, version=1, trains_at=1)  # lag 1: continued
    assert [r.prefix for r in script.calls[1][0][0].rows] == [[100, 101], [100, 101]]
    _, m = p.produce([], script, seed=0, version=2, trains_at=2)  # its first tokens would lag 2 > 1
    assert [r.prefix for r in script.calls[2][0][0].rows] == [[], []]
    assert m["partial/regenerated"] == 2 and m["partial/tokens_discarded"] == 8


def test_mask_offpolicy_trains_only_the_last_segment_of_a_continued_row():
    p = pool(replace(SCHEDULING, max_staleness=1, mask_offpolicy=True))
    script = Script({1: [5, 5], 2: [1, 1]}, chunk=2)
    for v in range(3):  # continued twice: its first tokens lag 2, but they are out of the loss
        batch, m = p.produce([Sample([1]), Sample([2])] if v == 0 else [], script, seed=0, version=v, trains_at=v)
        assert m["partial/regenerated"] == 0
    assert [s.prompt_ids[0] for s in batch.samples] == [1, 1]
    assert batch.tokens[0, 1:6].tolist() == [100, 101, 102, 103, 104]
    assert batch.token_versions[0, 1:6].tolist() == [0, 0, 1, 1, 2]
    assert batch.loss_mask[0, 1:6].tolist() == [False] * 4 + [True], "tokens of earlier steps left out"
    assert version_lag(batch, 2, 2) == {"rollout/staleness_max": 0.0, "rollout/staleness_mean": 0.0}

    # A row that finished while its group waited is trained whole: past the bound it starts again.
    p = pool(replace(SCHEDULING, max_staleness=1, mask_offpolicy=True))
    script = Script({1: [5, 1], 2: [1, 1]}, chunk=2)
    regenerated = [p.produce([Sample([1]), Sample([2])] if v == 0 else [], script, seed=0, version=v,
                             trains_at=v)[1]["partial/regenerated"] for v in range(3)]
    assert regenerated == [0, 0, 1]


def test_engine_quota_and_join():
    assert quota(needed=4, total=10, mine=10) == 4
    assert quota(needed=4, total=10, mine=5) + quota(needed=4, total=10, mine=5) == 4
    assert quota(needed=4, total=10, mine=3) + quota(needed=4, total=10, mine=7) >= 4
    assert quota(needed=4, total=5, mine=1) == 1
    assert in_group_order([([2, 0], ["c", "a"]), ([1], ["b"])], 3) == ["a", "b", "c"]


def test_version_lag_over_trained_tokens():
    b = RolloutBatch.from_rows([[1], [1]], [[5, 6], [7]], [Sample([1])] * 2, 0, n=2)
    assert version_lag(b, 3, 1) == {"rollout/staleness_max": 2.0, "rollout/staleness_mean": 2.0}
    b.token_versions = torch.tensor([[0, 1, 2], [0, 3, 0]])
    assert version_lag(b, 3, 3) == {"rollout/staleness_max": 2.0, "rollout/staleness_mean": pytest.approx(1.0)}


def test_the_plan_names_what_partial_rollouts_and_the_staleness_bound_need():
    from colocate_rl.config import Config, ConfigError, ModelConfig, load
    from colocate_rl.plan import resolve

    def err(*overrides):
        with pytest.raises(ConfigError) as e:
            resolve(load(Config(model=ModelConfig(path="some/model")), overrides=list(overrides)))
        return str(e.value)

    assert err("rollout.max_staleness=2").startswith("rollout.max_staleness=2 bounds stale samples")
    assert err("rollout.max_staleness=0") == "rollout.max_staleness=0 must be >= 1"
    assert "need rollout.partial.enable=true" in err("rollout.partial.over_sample=4")
    assert "rollout.partial.over_sample=-1 must be >= 0" in err("rollout.partial.over_sample=-1")
    on = "rollout.partial.enable=true"
    assert "does not combine with rollout.dynamic_sampling: its refills" in err(on, "rollout.dynamic_sampling=true")
    assert "needs rollout.backend=vllm" in err(on, "rollout.backend=transformers")
    assert "needs algorithm.is_clamp > 0" in err(on, "algorithm.is_clamp=0")
