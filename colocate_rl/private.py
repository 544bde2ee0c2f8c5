"""Folders and files that are the user's alone: what a run writes (checkpoints, metrics, logs, the
config, caches) holds its data and settings, so no other user of the machine may read it. Folders
the project creates are 0700, files it writes 0600; a folder that already exists keeps its mode."""

from __future__ import annotations

import os
from pathlib import Path


def private_dir(path: str | os.PathLike) -> Path:
    """``path``, with every folder missing on the way created 0700 (the umask can only narrow it)."""
    p = Path(path)
    for folder in reversed([q for q in (p, *p.parents) if not q.is_dir()]):
        folder.mkdir(mode=0o700, exist_ok=True)
    return p


def opener(path: str | os.PathLike, flags: int) -> int:
    """``open(path, mode, opener=opener)``: the file is created 0600, and one that existed made 0600."""
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def write_text(path: str | os.PathLike, text: str) -> None:
    with open(path, "w", opener=opener) as f:
        f.write(text)


def seal(folder: str | os.PathLike) -> None:
    """Every file under ``folder`` 0600 and every folder 0700: for what another library wrote there
    (megatron-core's checkpoint shards, safetensors, a tokenizer) with its own modes."""
    root = Path(folder)
    for p in [root, *root.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, 0o700 if p.is_dir() else 0o600)


def cache_dir() -> Path:
    """Run-local cache root (scripts/setup_env.sh exports COLOCATE_RL_CACHE), created private."""
    return private_dir(Path(os.environ.get("COLOCATE_RL_CACHE", ".cache")).resolve())
