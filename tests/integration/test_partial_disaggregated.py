"""Asynchronous training with a staleness bound, disaggregated on CPU through Ray: the actor in
one process, two vLLM engines in theirs, weights broadcast. rollout.max_staleness=k keeps k
batches requested ahead; with partial rollouts (each engine stops at its share of the groups) no
token the loss trains on lags more than k versions. The long-tailed model of models/long_tail.py makes
rows carry over; versions are asserted on the batches the actor receives."""

from __future__ import annotations

from dataclasses import replace

import pytest

from colocate_rl import loop
from colocate_rl.models.long_tail import long_tail_model
from colocate_rl.session import start_session

from test_loop import planned, tiny_cfg  # noqa: E402

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # Ray and three processes importing vLLM / megatron-core: ~60 s for the module

P, N = 4, 4


@pytest.fixture(scope="module")
def session(tmp_path_factory, tiny_model, even_length_reward):
    root = tmp_path_factory.mktemp("async")
    model = long_tail_model(tiny_model("qwen3-tiny"), root / "long-tail")
    s = start_session(*planned(tiny_cfg(root, lambda shape: model, **{
        "placement.mode": "disaggregated", "rollout.num_engines": "2", "actor.lr": "1e-3",
        "reward.name": "test_even_length", "data.prompts_per_step": str(P), "rollout.n": str(N),
        "rollout.max_response_tokens": "64", "rollout.off_policy": "true", "rollout.max_staleness": "2",
        "rollout.partial.enable": "true", "rollout.partial.over_sample": "4"})))
    yield s
    s.close()
    ray.shutdown()


def run(s, steps: int) -> list[dict]:
    """Steps as loop.run runs them (nothing requested ahead at the last), then the batches still
    queued are taken, so the next test starts from an empty buffer."""
    out = [loop.step(s, last=i == steps - 1) for i in range(steps)]
    while len(s.buffer):
        s.buffer.get()
    return out


def test_k2_never_trains_a_token_older_than_two_versions(session, trained):
    s = session
    ms = run(s, 6)
    assert [m["rollout/staleness"] for m in ms] == [0, 1, 2, 2, 2, 2], "two batches ahead"
    lags = [(at - batch.token_versions[batch.loss_mask]) for batch, at in trained]
    assert len(lags) == 6 and all(int(lag.max()) <= 2 for lag in lags)
    assert max(int(lag.max()) for lag in lags) == 2, "the bound is reached, not just respected"
    assert [m["rollout/staleness_max"] for m in ms] == [float(lag.max()) for lag in lags]
    # Rows carried from a batch of version v into the next (v + 1, trained at v + 3) would lag 3:
    # they start again from their prompt, and their tokens are counted as discarded.
    assert sum(m["partial/carried"] for m in ms) > 0
    assert sum(m["partial/regenerated"] for m in ms) > 0 and sum(m["partial/tokens_discarded"] for m in ms) > 0
    assert all(m["partial/groups"] >= P for m in ms), "each engine stops at its share; together at least P"
    assert all(m["rollout/engine_restarts"] == 0 for m in ms)
    s.workers.verify()


def test_k1_is_the_one_step_off_policy_and_k2_without_partial_runs_two_ahead(session, trained):
    """Without partial rollouts a batch is sampled whole on one version: its lag is the step's
    staleness, at most k, and k=1 is the one-step off-policy of rollout.off_policy alone."""
    s = session
    s.buffer.partial, partial = None, s.buffer.partial
    try:
        for k, expected in ((1, [0, 1, 1]), (2, [0, 1, 2, 2])):
            s.plan.scheduling = replace(s.plan.scheduling, max_staleness=k, partial=False)
            ms, queued = [], []
            for i in range(len(expected)):
                ms.append(loop.step(s, last=i == len(expected) - 1))
                queued.append(len(s.buffer))
            assert [m["rollout/staleness"] for m in ms] == expected
            assert queued[:-1] == [k] * (len(expected) - 1), "k batches requested ahead"
            assert all(m["rollout/staleness_max"] == m["rollout/staleness_mean"] == m["rollout/staleness"] for m in ms)
            assert all(batch.token_versions is None for batch, _ in trained[-len(expected):])
            while len(s.buffer):
                s.buffer.get()
    finally:
        s.buffer.partial = partial
