"""What the project writes is the user's alone: folders it creates 0700, files 0600, whatever the
umask (0 here: without these modes everything would be world-writable)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from colocate_rl import checkpoint as ck
from colocate_rl.config import Config, to_dict
from colocate_rl.metrics import MetricsLog
from colocate_rl.private import private_dir, write_text
from colocate_rl.supervise import _note, last_step


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def open_umask():
    old = os.umask(0)
    yield
    os.umask(old)


def test_private_dir_makes_missing_folders_0700_and_leaves_existing_ones(tmp_path, open_umask):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    private_dir(shared / "runs" / "a")
    assert mode(shared / "runs") == mode(shared / "runs" / "a") == 0o700
    assert mode(shared) == 0o755  # the user's own folder keeps its mode
    write_text(shared / "f.txt", "x")
    os.chmod(shared / "f.txt", 0o644)
    write_text(shared / "f.txt", "y")  # rewriting a file the project owns makes it private again
    assert mode(shared / "f.txt") == 0o600


def test_checkpoints_metrics_and_supervisor_log_are_private(tmp_path, open_umask):
    def write_actor(path: str) -> None:  # as megatron-core's writer does: the umask's modes
        os.makedirs(path)
        torch.save(torch.zeros(4), f"{path}/__0_0.distcp")

    store = ck.CheckpointStore(tmp_path / "run" / "checkpoints", keep=2)
    folder = store.save(1, write_actor, {"step": 1, "config": to_dict(Config())})
    for p in [tmp_path / "run", store.root, *folder.rglob("*"), folder]:
        assert mode(p) == (0o700 if p.is_dir() else 0o600), (p, oct(mode(p)))

    log = MetricsLog(tmp_path / "run", {})
    log.log(1, {"reward/mean": 0.5})
    log.truncate(1)
    log.close()
    _note(tmp_path / "run" / "supervisor.log", "a line")
    assert mode(tmp_path / "run" / "metrics.jsonl") == mode(tmp_path / "run" / "supervisor.log") == 0o600


def test_last_step_skips_a_last_line_cut_short(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    assert last_step(tmp_path) == 2
    assert last_step(tmp_path / "none") == 0
