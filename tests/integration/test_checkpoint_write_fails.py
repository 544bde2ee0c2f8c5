"""Checkpoints of the real actor (megatron-core's writer):

- the size the run predicts for one (memory.checkpoint_bytes, behind the start-up warning that the
  disk cannot hold what checkpoint.keep keeps) is within 25% of a real one, written after a step;
- a write that fails inside megatron-core's writer (the file-size limit makes the kernel refuse the
  write, as a full disk does) is logged in one line naming the rank's own error and the room left,
  and the run goes on: the earlier checkpoint stays, no partial folder is left, the actor trains.
"""

from __future__ import annotations

import resource
import signal

import torch

from colocate_rl import checkpoint as ck
from colocate_rl.config import Config, ModelConfig
from colocate_rl.memory import checkpoint_bytes
from colocate_rl.models.registry import model_size, read_hf_config

from batches import build_actor, synthetic_batch


def train_step(actor) -> float:
    batch = synthetic_batch([9, 7, 8, 6], seed=2)
    old = actor.compute_logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.loss_mask, old, 0)
    return actor.train_step(batch, old)["loss"]


def test_checkpoint_size_is_predicted_and_a_full_disk_keeps_the_run(tiny_model, tmp_path):
    path = tiny_model("qwen3-tiny")
    cfg = Config(model=ModelConfig(path=str(path), dtype="bfloat16"))
    actor = build_actor(cfg)
    train_step(actor)  # Adam's moments exist from the first step on
    lines: list[str] = []
    store = ck.CheckpointStore(tmp_path, keep=2, log=lines.append)
    state = {"config": {"seed": 1}, "step": 1}
    first = store.save(1, actor.save_checkpoint, state)
    assert first is not None
    written = sum(f.stat().st_size for f in first.rglob("*") if f.is_file())
    predicted = checkpoint_bytes(cfg.model, cfg.actor, cfg.algorithm, model_size(read_hf_config(path)))
    assert 0.75 < written / predicted < 1.25, (written, predicted)

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 10, hard))
    try:
        assert store.save(2, actor.save_checkpoint, {**state, "step": 2}) is None
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert [p.name for p in store.complete()] == ["step_00000001"] and not list(tmp_path.glob("*.partial"))
    assert len(lines) == 1 and "step 2 NOT written" in lines[0] and "kept step_00000001" in lines[0], lines
    assert "OSError" in lines[0] and "GiB free under" in lines[0], lines  # the rank's own error, and the room left
    assert torch.isfinite(torch.tensor(train_step(actor)))
