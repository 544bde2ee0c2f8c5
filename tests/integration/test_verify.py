"""Weight-sync verification names the tensor that differs, for every model family, and cannot pass
by checking nothing: the actor and a real engine (vLLM on CPU; transformers' sampler for the tiny
DeepSeek-V4, which vLLM's CPU build cannot run) after a sync, then one byte of one engine tensor
flipped at a time, for each tensor the family says is verified."""

from __future__ import annotations

import pytest
import torch

from colocate_rl.weight_sync.verify import WeightMismatch

from test_loop import tiny_cfg  # noqa: E402 - same folder


def flip_byte(t: torch.Tensor) -> None:
    """XOR one bit of the high mantissa byte of the largest element: a change no rounding hides.
    Applied twice it restores the tensor."""
    flat = t.data.view(-1)
    i = int(flat.float().abs().argmax())
    flat[i : i + 1].view(torch.uint8)[-2] ^= 1


def _flip_in_vllm_worker(worker, name: str) -> None:
    flip_byte(worker._crl_model().get_parameter(name))


SHAPES = {
    "qwen3-tiny": {},
    "qwen3-moe-tiny": {},
    "deepseek-v4-tiny": {"rollout.backend": "transformers", "rollout.max_response_tokens": "3"},
}


@pytest.fixture(scope="module", params=list(SHAPES))
def workers(request, tmp_path_factory, tiny_model):
    """The local placement's workers (actor and engine) for one model shape, synced once; the qwen3-tiny
    ones are shared by both tests."""
    from colocate_rl.placement.local import launch
    from colocate_rl.plan import resolve

    shape = request.param
    cfg = tiny_cfg(tmp_path_factory.mktemp(shape), tiny_model, **{"model.path": str(tiny_model(shape)),
                                                                   **SHAPES[shape]})
    w = launch(cfg.placement, resolve(cfg).build())
    try:
        w.actor.onload()  # what the plan offloaded for the engine's start comes back
        w.sync(1)
        yield cfg, w
    finally:
        w.shutdown()


def test_verification_names_the_one_tensor_that_differs(workers):
    cfg, w = workers
    names = list(w.actor.weight_checksums())
    assert len(names) >= 4 and set(names) == set(w.actor.family.verify_names(w.actor.hf_config))
    assert w.verify() == len(names)
    for name in names:
        if cfg.rollout.backend == "vllm":
            w.rollout.llm.collective_rpc(_flip_in_vllm_worker, args=(name,))
        else:
            flip_byte(w.rollout._target(name))
        with pytest.raises(WeightMismatch, match=f"'{name}' differs"):
            w.verify()
        if cfg.rollout.backend == "vllm":  # flipped back: the engine equals the actor again
            w.rollout.llm.collective_rpc(_flip_in_vllm_worker, args=(name,))
        else:
            flip_byte(w.rollout._target(name))
        assert w.verify() == len(names)


@pytest.mark.parametrize("workers", ["qwen3-tiny"], indirect=True)
def test_a_family_that_names_no_tensor_fails_verification(workers, monkeypatch):
    """A verification that would compare nothing is an error, not a pass."""
    _, w = workers
    monkeypatch.setattr(w.actor, "weight_checksums", lambda: {})
    with pytest.raises(WeightMismatch, match="compared no tensor"):
        w.verify()
