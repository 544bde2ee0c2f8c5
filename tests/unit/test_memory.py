import pytest

from colocate_rl.memory import Handoff, IllegalTransition, MemoryOverflow, MemoryPlan, Phase

CYCLE = [Phase.IDLE, Phase.ACTOR, Phase.ACTOR_PARAMS, Phase.SYNC, Phase.ROLLOUT_WEIGHTS, Phase.ROLLOUT]
GiB = 2**30


def test_full_cycle_twice():
    h = Handoff()
    for _ in range(2):
        for ph in CYCLE:
            h.to(ph)
    assert h.phase == Phase.ROLLOUT and len(h.history) == 1 + 2 * len(CYCLE)


@pytest.mark.parametrize("start,bad", [(Phase.ROLLOUT, Phase.ACTOR), (Phase.IDLE, Phase.SYNC),
                                       (Phase.ACTOR, Phase.ROLLOUT), (Phase.SYNC, Phase.ROLLOUT)])
def test_illegal_transitions_raise_and_name_the_way(start, bad):
    h = Handoff(start=start)
    with pytest.raises(IllegalTransition, match=f"cannot go from '{start.value}' to '{bad.value}'"):
        h.to(bad)
    assert h.phase == start


def test_overflow_names_the_phase():
    plan = MemoryPlan(capacity=80 * GiB, parts={"rollout_weights": 16 * GiB, "kv_cache": 50 * GiB,
                                                "actor_params": 16 * GiB, "actor_grads": 32 * GiB,
                                                "actor_optimizer": 40 * GiB, "activations": 4 * GiB})
    h = Handoff(plan)
    h.to(Phase.IDLE)
    with pytest.raises(MemoryOverflow, match="phase 'actor' would need 92.00 GiB of 80.00 GiB"):
        h.to(Phase.ACTOR)
    assert h.phase == Phase.IDLE


def test_staged_wake_peak_is_below_unstaged():
    plan = MemoryPlan(capacity=80 * GiB, parts={"rollout_weights": 16 * GiB, "kv_cache": 50 * GiB,
                                                "actor_params": 16 * GiB, "sync_buckets": 1 * GiB})
    staged = max(plan.peaks().values())
    assert staged == 66 * GiB and plan.unstaged_peak() == 83 * GiB > plan.capacity > staged


def test_measured_usage_recorded():
    used = iter([1, 5, 9])
    h = Handoff(measure=lambda: next(used))
    h.to(Phase.IDLE)
    h.to(Phase.ACTOR)
    assert h.peak_used() == {"rollout": 1, "idle": 5, "actor": 9}
