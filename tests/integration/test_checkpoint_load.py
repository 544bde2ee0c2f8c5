"""Loading checkpoints of the real actor (megatron-core's torch_dist format):

- its pickled parts pass the check that runs before megatron-core's reader (the allow-list for
  ``.metadata``, weights_only for the shards' non-tensor items) and it resumes with its weights;
- a shard damaged where the manifest cannot see it (truncated, or removed, and the manifest written
  after), which the actor then fails to load: resume=auto falls back to the previous checkpoint,
  logged, and the actor holds that checkpoint's weights, not a mix;
- its ``.metadata`` carrying a pickled call is refused in one line naming the file; it never runs.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from colocate_rl import checkpoint as ck
from colocate_rl.config import Config, ConfigError, ModelConfig, to_dict

from batches import build_actor, synthetic_batch


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def train_step(actor, seed: int) -> None:
    batch = synthetic_batch([9, 7, 8, 6], seed=seed)
    old = actor.compute_logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.loss_mask, old, 0)
    actor.train_step(batch, old)


def weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in actor.export_hf_weights()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def actor(tiny_model):
    cfg = Config(model=ModelConfig(path=str(tiny_model("qwen3-tiny"))))
    cfg.actor.lr = 1e-2  # every step moves every weight visibly
    return build_actor(cfg)


def saved_twice(actor, root) -> tuple[ck.CheckpointStore, list[str], dict, dict]:
    lines: list[str] = []
    store = ck.CheckpointStore(root, keep=3, log=lines.append)
    snapshots = []
    for step in (1, 2):
        train_step(actor, seed=step)
        store.save(step, actor.save_checkpoint, {"step": step, "config": to_dict(Config())})
        snapshots.append(weights(actor))
    train_step(actor, seed=3)  # the actor moves on: a load has to bring the weights back
    assert not same(weights(actor), snapshots[1])
    return store, lines, *snapshots


def test_a_checkpoint_of_the_real_actor_resumes(actor, tmp_path):
    store, lines, _, second = saved_twice(actor, tmp_path)
    got = store.load("auto", to_dict(Config()), actor.load_checkpoint)
    assert got.step == 2 and lines == []
    assert same(weights(actor), second)


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_a_damaged_shard_the_manifest_cannot_see_falls_back(actor, tmp_path, damage):
    store, lines, first, _ = saved_twice(actor, tmp_path)
    folder = ck.step_dir(tmp_path, 2)
    shard = folder / ck.ACTOR / "__0_0.distcp"
    if damage == "truncate":  # its non-tensor items, at the start, stay readable: megatron-core's read fails
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        shard.unlink()
    (folder / ck.MANIFEST).unlink()
    ck.write_manifest(folder, {"step": 2})
    got = store.load("auto", to_dict(Config()), actor.load_checkpoint)
    assert got.step == 1
    assert same(weights(actor), first)
    assert any(f"{folder} is damaged" in line for line in lines), lines
    assert any("resumed from step_00000001 instead of step_00000002" in line for line in lines), lines
    if damage == "truncate":
        assert any("does not load" in line for line in lines), lines


def test_real_metadata_carrying_a_call_is_refused(actor, tmp_path):
    marker = tmp_path / "payload-ran"
    store, _, _, _ = saved_twice(actor, tmp_path)
    folder = ck.step_dir(tmp_path, 2)
    path = folder / ck.ACTOR / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own file, written just now
    metadata.planner_data = {"injected": Payload(marker)}
    path.write_bytes(pickle.dumps(metadata))
    (folder / ck.MANIFEST).unlink()
    ck.write_manifest(folder, {"step": 2})
    with pytest.raises(ConfigError) as e:
        ck.CheckpointStore(tmp_path / "other", keep=2).load(str(folder), to_dict(Config()), actor.load_checkpoint)
    msg = str(e.value)
    assert "\n" not in msg and f"{path} holds io.open" in msg, msg
    assert not marker.exists(), "the payload ran"
