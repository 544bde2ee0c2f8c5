"""HostOffload on plain host tensors: a frozen part is copied to the host once, then only freed,
until it is marked changed."""

from __future__ import annotations

import torch

from colocate_rl.trainer.offload import HostOffload


def test_frozen_part_is_copied_once_until_changed():
    weights, state = torch.arange(8, dtype=torch.float32), torch.ones(4)
    off = HostOffload({"ref": lambda: [weights], "state": lambda: [state]}, frozen=("ref",))
    assert off.offload()[0] == 8 * 4 + 4 * 4
    assert weights.untyped_storage().nbytes() == 0 and state.untyped_storage().nbytes() == 0
    assert off.onload()[0] == 8 * 4 + 4 * 4 and torch.equal(weights, torch.arange(8.0))
    state.add_(1)
    assert off.offload()[0] == 4 * 4  # the frozen part's host copy is still valid: nothing to copy
    off.onload()
    assert torch.equal(weights, torch.arange(8.0)) and torch.equal(state, torch.full((4,), 2.0))

    weights.mul_(2)  # rewritten on the device (a checkpoint load)
    off.changed("ref")
    assert off.offload(("ref",))[0] == 8 * 4
    off.onload(("ref",))
    assert torch.equal(weights, 2 * torch.arange(8.0))


def test_a_prefetched_part_on_the_cpu_comes_back_with_the_onload():
    """Without a GPU there is no side stream: a prefetched part is copied before onload returns."""
    weights, state = torch.arange(8, dtype=torch.float32), torch.ones(4)
    off = HostOffload({"params": lambda: [weights], "optimizer": lambda: [state]}, prefetched=("optimizer",))
    off.offload()
    assert off.onload()[0] == 8 * 4 + 4 * 4 and torch.equal(state, torch.ones(4))
    off.ready()
    assert off.prefetch_stats() is None and set(off.last_onload_split) == {"alloc_s", "wait_s"}
