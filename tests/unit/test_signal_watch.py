"""The warning when no group's rewards differ for several steps in a row (trainer.guard.SignalWatch),
and the share it reads (loop.step's reward/signal_groups, from rollout.dynamic.informative)."""

import torch

from colocate_rl.rollout.dynamic import informative
from colocate_rl.trainer import SignalWatch


def test_the_share_counts_groups_whose_rewards_differ():
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # groups of 2: flat, mixed, flat, flat
    assert informative(rewards, 2).float().mean().item() == 0.25
    assert informative(rewards, 4).float().mean().item() == 1.0


def test_three_flat_steps_in_a_row_warn_once_per_stretch():
    watch = SignalWatch(steps=3)
    said = [watch.update({"reward/signal_groups": share}, step) for step, share in
            enumerate([0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0], start=1)]
    lines = {step: line for step, line in enumerate(said, start=1) if line}
    assert sorted(lines) == [6, 12]  # steps 4-6 and 10-12; not again at 7 and 8 in the same stretch
    assert lines[6].startswith("warning: steps 4-6: in every group all rewards were equal")
    assert "sft.steps" in lines[6] and "rollout.dynamic_sampling=true" in lines[6]


def test_a_step_without_the_share_counts_as_one_with_signal():
    watch = SignalWatch(steps=1)
    assert watch.update({}, 1) is None
    assert watch.update({"reward/signal_groups": 0.0}, 2) is not None
