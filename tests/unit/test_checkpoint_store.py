"""Checkpoint folders without an actor: atomic saves, keep-last-K, damage detection and fallback,
a real write failure (the file-size limit makes the disk refuse), and the resume config check."""

from __future__ import annotations

import resource
import shutil
import signal

import pytest
import torch

from colocate_rl import checkpoint as ck
from colocate_rl.config import Config, ConfigError, to_dict


def state(step: int, **cfg_changes) -> dict:
    cfg = to_dict(Config())
    for dotted, v in cfg_changes.items():
        node = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = v
    return {"step": step, "sampler": {"epoch": 0, "index": step}, "rng": ck.rng_state(), "config": cfg}


def writer(size: int = 1000):
    def write(path: str) -> None:
        import os

        os.makedirs(path)
        torch.save(torch.arange(size, dtype=torch.float32), f"{path}/shard.pt")

    return write


def test_save_is_atomic_keeps_last_k_and_loads_newest(tmp_path):
    lines = []
    store = ck.CheckpointStore(tmp_path, keep=2, log=lines.append)
    for step in (1, 2, 3):
        assert store.save(step, writer(), state(step)) == ck.step_dir(tmp_path, step)
    assert [p.name for p in store.complete()] == ["step_00000002", "step_00000003"]
    assert not list(tmp_path.glob("*.partial"))
    loaded_from = []
    got = store.load("auto", state(0)["config"], loaded_from.append)
    assert got.step == 3 and got.state["sampler"] == {"epoch": 0, "index": 3}
    assert loaded_from == [str(ck.step_dir(tmp_path, 3) / ck.ACTOR)]
    assert lines == []


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "no_manifest"])
def test_damaged_latest_falls_back_to_previous_and_says_so(tmp_path, damage):
    lines = []
    store = ck.CheckpointStore(tmp_path, keep=3, log=lines.append)
    for step in (2, 4):
        store.save(step, writer(), state(step))
    shard = ck.step_dir(tmp_path, 4) / ck.ACTOR / "shard.pt"
    data = bytearray(shard.read_bytes())
    if damage == "flip_byte":
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[:100]))
    else:
        (ck.step_dir(tmp_path, 4) / ck.MANIFEST).unlink()
    got = store.load("auto", state(0)["config"], lambda p: None)
    assert got.step == 2
    if damage != "no_manifest":  # without a manifest the folder is not a checkpoint at all
        assert any("step_00000004" in line and "damaged" in line for line in lines), lines
        assert any("resumed from step_00000002 instead of step_00000004" in line for line in lines), lines


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path):
    """The process file-size limit makes the kernel refuse the write (EFBIG), as a full disk would."""
    lines = []
    store = ck.CheckpointStore(tmp_path, keep=2, log=lines.append)
    assert store.save(1, writer(), state(1))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        assert store.save(2, writer(size=1 << 20), state(2)) is None  # a 4 MB shard does not fit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert [p.name for p in store.complete()] == ["step_00000001"]
    assert not list(tmp_path.glob("*.partial"))
    assert len(lines) == 1 and "step 2 NOT written" in lines[0] and "kept step_00000001" in lines[0], lines
    assert store.load("auto", state(0)["config"], lambda p: None).step == 1


def test_resume_refuses_config_changes_that_alter_results(tmp_path):
    store = ck.CheckpointStore(tmp_path, keep=2)
    store.save(5, writer(), state(5))
    # Logging, checkpointing, eval and the step count may change.
    harmless = state(0, logging__run_dir="elsewhere", steps=500, checkpoint__keep=5, eval__every=3)["config"]
    assert store.load("auto", harmless, lambda p: None).step == 5
    changed = state(0, actor__lr=2e-6, model__path="other")["config"]
    with pytest.raises(ConfigError) as e:
        store.load("auto", changed, lambda p: pytest.fail("the actor must not load"))
    msg = str(e.value)
    assert "\n" not in msg and "actor.lr" in msg and "model.path" in msg and "step_00000005" in msg


def test_resume_from_an_explicit_folder(tmp_path):
    store = ck.CheckpointStore(tmp_path / "checkpoints", keep=2)
    store.save(3, writer(), state(3))
    other = ck.CheckpointStore(tmp_path / "new-run", keep=2)
    assert other.load(str(tmp_path), state(0)["config"], lambda p: None).step == 3  # a run folder
    assert other.load(str(ck.step_dir(tmp_path / "checkpoints", 3)), state(0)["config"], lambda p: None).step == 3
    assert other.load("never", state(0)["config"], lambda p: None) is None
    with pytest.raises(ConfigError, match="checkpoint.resume=.*no checkpoint there"):
        other.candidates(str(tmp_path / "new-run"))


def test_rng_state_round_trip():
    s = ck.rng_state()
    a = torch.rand(3)
    ck.set_rng_state(s)
    assert torch.equal(torch.rand(3), a)


def test_space_warning_when_the_disk_cannot_hold_the_kept_checkpoints(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    folder = tmp_path / "run" / "checkpoints"  # not made yet: the nearest existing parent is measured
    assert ck.space_warning(folder, each=1 << 20, copies=3) is None
    line = ck.space_warning(folder, each=free // 2, copies=3)
    assert line is not None and "\n" not in line and "checkpoint.keep" in line and str(tmp_path) in line, line


def test_copies_on_disk_counts_kept_and_in_flight_checkpoints():
    from colocate_rl.config import CheckpointConfig

    c = CheckpointConfig(every=10, keep=2, at_end=True)
    assert ck.copies_on_disk(c, steps=100) == 3  # two kept while the third is written
    c.keep = 0  # keep all: 10 periodic and the last
    assert ck.copies_on_disk(c, steps=100) == 11
    c.every, c.at_end = 0, False
    assert ck.copies_on_disk(c, steps=100) == 0



class Payload:
    """What a hostile checkpoint carries: unpickling it opens (creates) ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def dcp_actor(item, planner_data=None):
    """A writer of a torch distributed checkpoint as megatron-core's holds its common state: one
    pickled item in ``__0_0.distcp``, listed by the pickled ``.metadata``."""

    def write(path: str) -> None:
        import io
        import os
        import pickle

        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

        os.makedirs(path)
        data = io.BytesIO()
        torch.save([item], data)
        with open(f"{path}/__0_0.distcp", "wb") as f:
            f.write(data.getvalue())
        index = MetadataIndex("common_state/shard_0_1")
        metadata = Metadata({index.fqn: BytesStorageMetadata()}, planner_data,
                            {index: _StorageInfo("__0_0.distcp", 0, len(data.getvalue()))})
        with open(f"{path}/.metadata", "wb") as f:
            pickle.dump(metadata, f)

    return write


def test_a_trainer_state_carrying_code_is_refused_without_running_it(tmp_path, capsys):
    marker = tmp_path / "payload-ran"
    lines = []
    store = ck.CheckpointStore(tmp_path / "ckpts", keep=3, log=lines.append)
    for step in (2, 4):
        store.save(step, writer(), state(step))
    bad = ck.step_dir(tmp_path / "ckpts", 4)
    torch.save({**state(4), "sampler": Payload(marker)}, bad / ck.STATE)
    (bad / ck.MANIFEST).unlink()
    ck.write_manifest(bad, {"step": 4})  # whoever hands over a checkpoint writes its manifest too

    with pytest.raises(ConfigError) as e:  # named explicitly: stop, naming the file and what it holds
        ck.CheckpointStore(tmp_path / "new", keep=2).load(str(bad), state(0)["config"], lambda p: None)
    msg = str(e.value)
    assert "\n" not in msg and f"{bad / ck.STATE} holds io.open" in msg and "refused" in msg, msg
    assert store.load("auto", state(0)["config"], lambda p: None).step == 2  # auto: the previous one
    assert any(f"{bad} is refused ({bad / ck.STATE} holds io.open" in line for line in lines), lines
    assert ck.main(["export", str(bad), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{bad / ck.STATE} holds io.open" in err, err
    assert not marker.exists(), "the payload ran"


@pytest.mark.parametrize("where", ["metadata", "shard_item"])
def test_actor_metadata_or_shard_item_carrying_code_is_refused(tmp_path, where):
    """torch's reader unpickles ``.metadata`` without restriction, and megatron-core's the non-tensor
    items of the shards with weights_only=False: both are checked first."""
    marker = tmp_path / "payload-ran"
    good = ck.CheckpointStore(tmp_path / "good", keep=2)
    good.save(1, dcp_actor({"scheduler": {"step": 3}}), state(1))
    assert good.load("auto", state(0)["config"], lambda p: None).step == 1  # plain data passes the check

    store = ck.CheckpointStore(tmp_path / "bad", keep=2)
    if where == "metadata":
        store.save(1, dcp_actor({"scheduler": {"step": 3}}, planner_data=Payload(marker)), state(1))
    else:
        store.save(1, dcp_actor(Payload(marker)), state(1))
    actor = ck.step_dir(tmp_path / "bad", 1) / ck.ACTOR
    loaded = []
    with pytest.raises(ConfigError) as e:
        store.load(str(ck.step_dir(tmp_path / "bad", 1)), state(0)["config"], loaded.append)
    msg = str(e.value)
    named = (f"{actor / '.metadata'} holds io.open" if where == "metadata" else
             f"{actor / '__0_0.distcp'} (item common_state/shard_0_1) holds io.open")
    assert "\n" not in msg and named in msg, msg
    assert loaded == [] and not marker.exists(), "the payload ran"


def test_an_explicit_resume_that_fails_verification_stops_naming_the_folder(tmp_path):
    store = ck.CheckpointStore(tmp_path / "run" / "checkpoints", keep=2)
    store.save(3, writer(), state(3))
    folder = ck.step_dir(tmp_path / "run" / "checkpoints", 3)
    (folder / ck.ACTOR / "shard.pt").write_bytes(b"cut")
    other = ck.CheckpointStore(tmp_path / "new-run", keep=2)
    for resume in (folder, tmp_path / "run"):  # the checkpoint itself, and the run folder holding it
        with pytest.raises(ConfigError) as e:
            other.load(str(resume), state(0)["config"], lambda p: pytest.fail("the actor must not load"))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"checkpoint.resume={resume}: "), msg
        assert f"{folder / ck.ACTOR / 'shard.pt'} has 3 bytes, the manifest says" in msg, msg


def test_an_actor_that_does_not_load_falls_back_to_the_previous_checkpoint(tmp_path):
    """Damage the manifest cannot see (a shard too large to hash) shows when the actor loads."""
    lines = []
    store = ck.CheckpointStore(tmp_path, keep=3, log=lines.append)
    for step in (2, 4):
        store.save(step, writer(), state(step))
    loaded = []

    def load_actor(path: str) -> None:
        loaded.append(path)
        if "step_00000004" in path:
            raise RuntimeError("shard __0_0.distcp: unexpected end of file\nsecond line")

    got = store.load("auto", state(0)["config"], load_actor)
    assert got.step == 2 and [p.split("/")[-2] for p in loaded] == ["step_00000004", "step_00000002"]
    assert any("step_00000004 is damaged" in line and "does not load (RuntimeError: shard __0_0.distcp: "
               "unexpected end of file)" in line for line in lines), lines
    assert any("resumed from step_00000002 instead of step_00000004" in line for line in lines), lines

    # None loads: the actor holds part of a checkpoint, so the run must not start from step 0 on it.
    def never(path: str) -> None:
        raise RuntimeError("unreadable shard")

    with pytest.raises(ConfigError) as e:
        store.load("auto", state(0)["config"], never)
    assert "\n" not in str(e.value) and "partly loaded" in str(e.value) and "checkpoint.resume=never" in str(e.value)
