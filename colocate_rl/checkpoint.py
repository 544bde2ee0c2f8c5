"""Checkpoints: one folder per step holding the actor (megatron-core distributed checkpointing:
model, optimizer, LR schedule, each rank its shards), the data cursor, RNG states, the step and
the run's config with its hash.

Atomic: a checkpoint is written as ``<dir>/step_00000025.partial``, every file is flushed to disk,
``manifest.json`` (every file's size, and a sha256 of the files small enough to hash cheaply) is
written last, then the folder is renamed to ``step_00000025`` and the parent synced. A crash or a
full disk mid-save leaves only a ``.partial`` folder, which never replaces a good checkpoint and is
removed at the next save. On resume a checkpoint whose files disagree with its manifest is
skipped, with a log line, for the one before it.

    python -m colocate_rl.checkpoint export <checkpoint folder> <out folder>   # → HF safetensors
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException

from colocate_rl import config as C

MANIFEST = "manifest.json"
STATE = "trainer_state.pt"
ACTOR = "actor"  # the megatron-core distributed checkpoint
_HASH_LIMIT = 64 << 20  # bytes; larger files are checked by size only (hashing 100s of GB is slow)

# Config fields a resumed run may change: they do not alter what the run computes.
HARMLESS = ("logging.", "checkpoint.", "eval.", "steps", "placement.launcher", "placement.ray_address",
            "placement.ray_token_file", "placement.accelerator", "supervise.", "dry_run",
            "reward.workers", "reward.timeout_s", "sync.", "actor.optimizer_chunk_mb",
            "rollout.multiprocess", "rollout.enforce_eager", "rollout.max_engine_restarts")


class CheckpointCorrupt(RuntimeError):
    """A checkpoint folder whose files do not match its manifest (or cannot be read)."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


# ---------------------------------------------------------------- trainer state


def rng_state() -> dict:
    out = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def flat(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} → {"a.b": 1}"""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def results_config(cfg: dict) -> dict:
    """The config fields that change what a run computes (everything not in HARMLESS)."""
    return {k: v for k, v in flat(cfg).items() if not k.startswith(HARMLESS)}


def config_hash(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(results_config(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_resume_config(saved: dict, current: dict, where: Path) -> None:
    """Raises ConfigError naming every results-changing field that differs from the checkpoint's."""
    a, b = results_config(saved), results_config(current)
    diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if diff:
        fields = ", ".join(f"{k} ({a.get(k)!r} → {b.get(k)!r})" for k in diff[:6])
        more = f" and {len(diff) - 6} more" if len(diff) > 6 else ""
        raise C.ConfigError(
            f"cannot resume from {where}: the config changed in fields that alter results: {fields}{more}; "
            f"restore them, or start afresh with checkpoint.resume=never")


# ---------------------------------------------------------------- writing and reading


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> Iterator[Path]:
    return (p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path, meta: dict) -> None:
    files = {}
    for p in _files(folder):
        _fsync(p)
        size = p.stat().st_size
        files[str(p.relative_to(folder))] = {"size": size, **({"sha256": _sha256(p)} if size <= _HASH_LIMIT else {})}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({**meta, "files": files}, indent=1))
    _fsync(tmp)
    tmp.rename(folder / MANIFEST)


def verify(folder: Path) -> dict:
    """The manifest of a complete, undamaged checkpoint; raises CheckpointCorrupt saying what is wrong."""
    m = folder / MANIFEST
    if not m.is_file():
        raise CheckpointCorrupt(f"{folder} has no {MANIFEST} (its save did not finish)")
    try:
        manifest = json.loads(m.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"{m} is unreadable: {e}") from None
    for rel, info in manifest["files"].items():
        p = folder / rel
        if not p.is_file():
            raise CheckpointCorrupt(f"{p} is missing")
        if p.stat().st_size != info["size"]:
            raise CheckpointCorrupt(f"{p} has {p.stat().st_size} bytes, the manifest says {info['size']}")
        if "sha256" in info and _sha256(p) != info["sha256"]:
            raise CheckpointCorrupt(f"{p} does not match its sha256 in the manifest")
    return manifest


@dataclass
class Loaded:
    path: Path
    step: int
    state: dict  # trainer state: step, sampler, rng, config


def _why(e: BaseException) -> str:
    """One line for a failed write: a CheckpointException's first rank's own error, not the wrapper."""
    if isinstance(e, CheckpointException) and e.failures:
        first = next(iter(e.failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    return C.error_line(e)


def space_warning(root: Path, each: int, copies: int) -> Optional[str]:
    """A line when the disk under ``root`` (or its nearest existing parent) cannot hold ``copies``
    checkpoints of ``each`` bytes, else None: a full disk otherwise shows only when a checkpoint
    fails to be written, hours into a run."""
    where = next(p for p in (root, *root.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if each * copies <= free:
        return None
    return (f"warning: checkpoints of ~{each / 2**30:.1f} GiB, {copies} on disk at once (checkpoint.keep, and the "
            f"one being written), need {each * copies / 2**30:.1f} GiB; {free / 2**30:.1f} GiB are free under "
            f"{where} (checkpoint.dir)")


def copies_on_disk(cfg: C.Config) -> int:
    """The most checkpoints this run holds at once: the kept ones and the one being written."""
    saves = (cfg.steps // cfg.checkpoint.every if cfg.checkpoint.every > 0 else 0) + int(cfg.checkpoint.at_end)
    return min(saves, cfg.checkpoint.keep + 1) if cfg.checkpoint.keep > 0 else saves


class CheckpointStore:
    """The checkpoints of one run under ``root``: save (atomic), keep the last ``keep``, load the
    newest intact one. ``log`` receives one line per notable event (fallbacks, failed saves)."""

    def __init__(self, root: str | Path, keep: int, log: Callable[[str], None] = print):
        self.root, self.keep, self.log = Path(root), keep, log

    def complete(self) -> list[Path]:
        """Finished checkpoints (a manifest present), oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".partial")
                      and (p / MANIFEST).is_file())

    def save(self, step: int, write_actor: Callable[[str], None], trainer_state: dict) -> Optional[Path]:
        """Writes checkpoint ``step``; returns its folder, or None when writing failed (disk full,
        I/O error): then the failure is logged, the partial folder removed, and every earlier
        checkpoint is still there."""
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + ".partial")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
            write_actor(str(tmp / ACTOR))
            torch.save(trainer_state, tmp / STATE)
            write_manifest(tmp, {"step": step, "config_hash": config_hash(trainer_state["config"])})
            if final.exists():  # a re-run of the same step (after a resume) replaces it
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync(self.root)
        # torch's distributed checkpoint (megatron-core's writer) reports a failed write, a full disk
        # included, as CheckpointException, a BaseException: it ended the run instead of this line.
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - the previous checkpoints stay intact
            shutil.rmtree(tmp, ignore_errors=True)
            kept = self.complete()
            free = shutil.disk_usage(self.root).free / 2**30 if self.root.is_dir() else float("nan")
            self.log(f"checkpoint at step {step} NOT written ({_why(e)}; {free:.1f} GiB free under {self.root}); "
                     f"{'kept ' + kept[-1].name if kept else 'no earlier checkpoint exists'}")
            return None
        for old in self.complete()[: -self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def candidates(self, resume: str) -> list[Path]:
        """Checkpoints to try on resume, newest first. ``resume``: auto (this store) | never | a
        checkpoint folder | a folder of checkpoints."""
        if resume == "never":
            return []
        if resume == "auto":
            return self.complete()[::-1]
        p = Path(resume)
        if (p / MANIFEST).is_file() or (p / STATE).is_file():
            return [p]
        found = CheckpointStore(p / "checkpoints" if (p / "checkpoints").is_dir() else p, 0).complete()[::-1]
        if not found:
            raise C.ConfigError(f"checkpoint.resume={resume}: no checkpoint there")
        return found

    def load(self, resume: str, current_config: dict, load_actor: Callable[[str], None]) -> Optional[Loaded]:
        """Restores the newest intact checkpoint: checks the config, then ``load_actor(folder)``.
        A damaged checkpoint is skipped for the previous one (logged); a config that changes results
        raises ConfigError."""
        tried = []
        for path in self.candidates(resume):
            try:
                verify(path)
                state = torch.load(path / STATE, weights_only=False)
            except (CheckpointCorrupt, OSError, RuntimeError, EOFError) as e:
                self.log(f"checkpoint {path} is damaged ({e}); trying the previous one")
                tried.append(path.name)
                continue
            check_resume_config(state["config"], current_config, path)
            load_actor(str(path / ACTOR))
            if tried:
                self.log(f"resumed from {path.name} instead of {', '.join(tried)}")
            return Loaded(path, int(state["step"]), state)
        if tried:
            self.log(f"no intact checkpoint under {self.root}: starting from step 0")
        return None


# ---------------------------------------------------------------- export


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """An HF safetensors folder (config.json, tokenizer, weights) from a checkpoint, through a
    one-rank actor built from the checkpoint's own config (megatron-core reshards on load)."""
    from safetensors.torch import save_file

    from colocate_rl.trainer import Actor

    checkpoint, out = Path(checkpoint), Path(out)
    verify(checkpoint)
    state = torch.load(checkpoint / STATE, weights_only=False)
    cfg = C.from_dict(state["config"])
    cfg.actor.tp = cfg.actor.pp = cfg.actor.ep = 1
    cfg.actor.dp = 0
    actor = Actor(cfg)
    actor.load_checkpoint(str(checkpoint / ACTOR))
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: t.detach().to("cpu").contiguous().clone() for name, t in actor.export_hf_weights()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    src = Path(actor.model_path)  # tokenizer and config files of the model trained
    for f in src.iterdir():
        if f.suffix in (".json", ".txt", ".model", ".tiktoken", ".jinja") and "safetensors" not in f.name:
            shutil.copy2(f, out / f.name)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "export":
        print("usage: python -m colocate_rl.checkpoint export <checkpoint folder> <out folder>", file=sys.stderr)
        return 2
    print(export_hf(argv[1], argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
