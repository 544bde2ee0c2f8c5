"""A checkpoint written by one actor rank loads into two tensor-parallel ranks (megatron-core
reshards model and optimizer state on load): same logprobs, and the next step, which reads the
restored Adam moments, moves the weights exactly as it does on one rank."""

from __future__ import annotations

import pytest
import torch

from colocate_rl.config import Config, ModelConfig

from batches import build_actor, synthetic_batch


def make_batch():
    return synthetic_batch([12, 9, 11, 6, 10, 7, 12, 5], seed=1)


def actor(path: str, tp: int):
    cfg = Config(model=ModelConfig(path=path, dtype="float32"))
    cfg.actor.lr, cfg.actor.micro_batch_size, cfg.actor.tp = 1e-3, 2, tp
    return build_actor(cfg)


def step(a, batch) -> dict:
    before = a.compute_logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.loss_mask, before, 0)
    m = a.train_step(batch, before)
    return {"before": before, "after": a.compute_logprobs(batch), "loss": m["loss"]}


def resumed_at_tp2(path: str, ckpt: str) -> dict:
    a = actor(path, tp=2)
    a.load_checkpoint(ckpt)
    return step(a, make_batch())


# Slow: one spawn of two fresh processes importing torch + megatron-core (~20-30 s on 2 cores).
@pytest.mark.slow
def test_one_rank_checkpoint_loads_at_tp2(tiny_model, tmp_path):
    from colocate_rl.trainer import run_on_ranks

    path = str(tiny_model("qwen3-small"))
    ref = actor(path, tp=1)
    step(ref, make_batch())  # Adam moments are non-zero from here on
    ref.save_checkpoint(str(tmp_path / "ckpt"))
    want = step(ref, make_batch())
    got = run_on_ranks(resumed_at_tp2, 2, path, str(tmp_path / "ckpt"))
    for key in ("before", "after"):
        diff = (got[key] - want[key]).abs().max().item()
        assert diff <= 1e-5, f"logprobs {key} the step differ between TP=2 (resumed) and TP=1 by {diff}"
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
