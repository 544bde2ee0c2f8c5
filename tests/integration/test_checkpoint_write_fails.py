"""A checkpoint write that fails in megatron-core's writer (the file-size limit makes the kernel
refuse the write, as a full disk does) is logged in one line and the run goes on: the earlier
checkpoint stays, no partial folder is left, and the actor still trains."""

from __future__ import annotations

import resource
import signal

import torch

from colocate_rl import checkpoint as ck
from colocate_rl.config import Config, ModelConfig

from batches import synthetic_batch


def test_a_full_disk_in_megatrons_writer_keeps_the_run_and_the_last_checkpoint(tiny_model, tmp_path):
    from colocate_rl.trainer import Actor

    cfg = Config(model=ModelConfig(path=str(tiny_model("qwen3-tiny")), dtype="float32"))
    actor = Actor(cfg)
    lines: list[str] = []
    store = ck.CheckpointStore(tmp_path, keep=2, log=lines.append)
    state = {"config": {"seed": 1}, "step": 1}
    assert store.save(1, actor.save_checkpoint, state) is not None
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
    batch = synthetic_batch([9, 7, 8, 6], seed=2)
    old = actor.compute_logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.loss_mask, old, 0)
    assert torch.isfinite(torch.tensor(actor.train_step(batch, old)["loss"]))
