"""Checkpoints: one folder per step holding the actor (megatron-core distributed checkpointing:
model, optimizer, LR schedule, each rank its shards), the data cursor, RNG states, the step and
the run's config with its hash.

Atomic: a checkpoint is written as ``<dir>/step_00000025.partial``, every file is flushed to disk,
``manifest.json`` (every file's size, and a sha256 of the files small enough to hash cheaply) is
written last, then the folder is renamed to ``step_00000025`` and the parent synced. A crash or a
full disk mid-save leaves only a ``.partial`` folder, which never replaces a good checkpoint and is
removed at the next save. On resume a checkpoint whose files disagree with its manifest, or whose
actor does not load, is skipped, with a log line, for the one before it; an explicit
``checkpoint.resume=<folder>`` with nothing usable there is a config error naming why.

Loading never runs code a checkpoint folder carries: the trainer state is read with
``torch.load(weights_only=True)``, and the actor's pickled parts (torch's ``.metadata``, the
non-tensor items in its shards, a legacy ``common.pt``) are checked before megatron-core's reader,
which unpickles them without restriction, sees them (``check_actor``). Folders are 0700, files 0600.

    python -m colocate_rl.checkpoint export <checkpoint folder> <out folder>   # → HF safetensors
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException

from colocate_rl import config as C
from colocate_rl.errors import error_line
from colocate_rl.private import opener, private_dir, seal

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


class CheckpointUnsafe(CheckpointCorrupt):
    """A checkpoint file that holds more than data (pickled functions or classes beyond checkpoint
    data's): loading it could run code, so it is refused."""


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
    seal(folder)  # the actor's shards come from megatron-core's writer with the umask's modes
    files = {}
    for p in _files(folder):
        _fsync(p)
        size = p.stat().st_size
        files[str(p.relative_to(folder))] = {"size": size, **({"sha256": _sha256(p)} if size <= _HASH_LIMIT else {})}
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w", opener=opener) as f:
        f.write(json.dumps({**meta, "files": files}, indent=1))
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


# ---------------------------------------------------------------- loading without running code


def load_data(source: Path | bytes, where: Path | str):
    """``torch.load(weights_only=True)`` of a file or of bytes: tensors and plain containers only.
    Raises CheckpointUnsafe naming the file and what it holds beyond data, CheckpointCorrupt when it
    cannot be read."""
    try:
        return torch.load(io.BytesIO(source) if isinstance(source, bytes) else source, map_location="cpu",
                          weights_only=True)
    except pickle.UnpicklingError as e:  # torch's weights-only unpickler refused it
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if found:
            raise CheckpointUnsafe(f"{where} holds {found[1]}, which checkpoint data never holds: refused "
                                   "(loading it could run code)") from None
        said = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(e))
        raise CheckpointUnsafe(f"{where} is not plain tensor data (torch.load with weights_only: "
                               f"{said[1] if said else error_line(e)}): refused") from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointCorrupt(f"{where} is unreadable ({error_line(e)})") from None


# What torch's distributed checkpoint metadata (and megatron-core's, the torch_dist format) pickles:
# its own dataclasses, the save plans kept in it, shapes, dtypes and layouts. Nothing here runs code
# when the unpickler builds it.
_DCP = "torch.distributed.checkpoint"
_METADATA_GLOBALS = {
    *((f"{_DCP}.metadata", n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                         "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                                         "_MEM_FORMAT_ENCODING")),
    *((f"{_DCP}.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                    torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointUnsafe(f"holds {module}.{name}")


def read_metadata(path: Path):
    """A distributed checkpoint's ``.metadata`` through an allow-list of the classes torch's
    checkpoint metadata is made of (torch's own reader unpickles it without one)."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except CheckpointUnsafe as e:
        raise CheckpointUnsafe(f"{path} {e}, which checkpoint metadata never holds: refused "
                               "(loading it could run code)") from None
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointCorrupt(f"{path} is unreadable ({error_line(e)})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointCorrupt(f"{path} is not a distributed checkpoint's metadata ({type(metadata).__name__})")
    return metadata


def check_actor(folder: Path) -> None:
    """Refuses (CheckpointUnsafe) an actor checkpoint folder whose pickled parts hold anything but
    checkpoint data, before megatron-core's reader unpickles them without restriction: every
    ``*.metadata`` through the allow-list, every non-tensor item of the shards it lists (megatron's
    ShardedObjects: its common state, extra states) and a legacy ``common.pt`` with weights_only.
    Tensor items are raw bytes; ``metadata.json`` is JSON."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for path in sorted(folder.glob("*.metadata")):
        metadata = read_metadata(path)
        try:
            for index, info in metadata.storage_data.items():
                if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                    _check_item(folder, index.fqn, info)
        except (AttributeError, TypeError) as e:  # built of allowed classes, but not as torch builds them
            raise CheckpointCorrupt(f"{path} is malformed ({error_line(e)})") from None
    if (folder / "common.pt").is_file():
        load_data(folder / "common.pt", folder / "common.pt")


def _check_item(folder: Path, fqn: str, info) -> None:
    """One non-tensor item of a shard (``info``: torch's _StorageInfo) through weights_only."""
    where = f"{folder / str(info.relative_path)} (item {fqn})"
    if info.transform_descriptors:
        raise CheckpointUnsafe(f"{where} is stored transformed ({info.transform_descriptors}), which this "
                               "check cannot read: refused")
    shard = (folder / info.relative_path).resolve()
    if shard.parent != folder.resolve():
        raise CheckpointUnsafe(f"{where} lies outside its checkpoint folder: refused")
    try:
        with shard.open("rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"{where} is unreadable ({error_line(e)})") from None
    if len(data) != info.length:
        raise CheckpointCorrupt(f"{where} is cut short ({len(data)} of {info.length} bytes)")
    load_data(data, where)


def read(path: Path) -> dict:
    """The trainer state of an intact checkpoint whose files hold data only (verify, load_data,
    check_actor); raises CheckpointCorrupt / CheckpointUnsafe saying which file and why."""
    verify(path)
    state = load_data(path / STATE, path / STATE)
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict) or "step" not in state:
        raise CheckpointCorrupt(f"{path / STATE} is not a trainer state (no step and config)")
    if (path / ACTOR).is_dir():
        check_actor(path / ACTOR)
    return state


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
    return error_line(e)


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


def copies_on_disk(ckpt: C.CheckpointConfig, steps: int) -> int:
    """The most checkpoints a run of ``steps`` holds at once: the kept ones and the one being written."""
    saves = (steps // ckpt.every if ckpt.every > 0 else 0) + int(ckpt.at_end)
    return min(saves, ckpt.keep + 1) if ckpt.keep > 0 else saves


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
            private_dir(self.root)
            for stale in self.root.glob("*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(mode=0o700)
            write_actor(str(tmp / ACTOR))
            with open(tmp / STATE, "wb", opener=opener) as f:
                torch.save(trainer_state, f)
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
        """Restores the newest usable checkpoint: checks its files and config, then
        ``load_actor(folder)``. A damaged or refused checkpoint, or one whose actor does not load,
        is skipped for the previous one (logged). Raises ConfigError when the config changed in a
        way that alters results, when an explicit ``resume`` folder holds nothing usable, and when
        an actor failed part-way through loading and no earlier checkpoint replaced its state."""
        tried, why, actor_failed = [], "", False
        for path in self.candidates(resume):
            try:
                state = read(path)
            except CheckpointCorrupt as e:
                why = str(e)
                self.log(f"checkpoint {path} is {'refused' if isinstance(e, CheckpointUnsafe) else 'damaged'} "
                         f"({e}); trying the previous one")
                tried.append(path.name)
                continue
            check_resume_config(state["config"], current_config, path)
            try:
                load_actor(str(path / ACTOR))
            # A shard the manifest cannot vouch for (one too large to hash, or damaged before the
            # manifest was written) fails inside megatron-core's reader; torch reports it as a
            # CheckpointException, a BaseException.
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - the previous checkpoint is tried
                why, actor_failed = f"{path / ACTOR} does not load ({_why(e)})", True
                self.log(f"checkpoint {path} is damaged ({why}); trying the previous one")
                tried.append(path.name)
                continue
            if tried:
                self.log(f"resumed from {path.name} instead of {', '.join(tried)}")
            return Loaded(path, int(state["step"]), state)
        if tried and (resume != "auto" or actor_failed):
            hint = "" if resume != "auto" else "; the actor is partly loaded"
            raise C.ConfigError(f"checkpoint.resume={resume}: no usable checkpoint ({why}){hint}; repair it, "
                                "point checkpoint.resume at another, or start afresh with checkpoint.resume=never")
        if tried:
            self.log(f"no intact checkpoint under {self.root}: starting from step 0")
        return None


# ---------------------------------------------------------------- export


def export_config(saved: dict) -> C.Config:
    """A checkpoint's config as what an export runs: one actor rank in this process (tp = pp = ep = 1,
    megatron-core reshards on load) built from the run's model, actor and algorithm sections, with
    the kernels the run's actor ran (rollout.exact); nothing of the rollout side starts."""
    cfg = C.from_dict(saved)
    actor = replace(cfg.actor, tp=1, pp=1, ep=1, dp=0, sequence_parallel=False, emulate_rollout_fp8=False)
    rollout = C.RolloutConfig(exact=cfg.rollout.exact, max_response_tokens=cfg.rollout.max_response_tokens,
                              max_model_len=cfg.rollout.max_model_len)
    from colocate_rl import platform

    return C.Config(model=cfg.model, actor=actor, algorithm=cfg.algorithm, rollout=rollout, data=cfg.data,
                    placement=C.PlacementConfig(gpus_per_node=min(platform.machine_gpus(), 1)), steps=cfg.steps,
                    seed=cfg.seed)


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """An HF safetensors folder (config.json, tokenizer, weights) from a checkpoint, through a
    one-rank actor built from the checkpoint's own config (``export_config``)."""
    checkpoint, out = Path(checkpoint), Path(out)
    state = read(checkpoint)  # before anything heavy loads: a refused checkpoint stops in one line
    from safetensors.torch import save_file

    from colocate_rl.plan import resolve

    actor = resolve(export_config(state["config"]), strict=False).build().make_actor()
    actor.load_checkpoint(str(checkpoint / ACTOR))
    private_dir(out)
    weights = {name: t.detach().to("cpu").contiguous().clone() for name, t in actor.export_hf_weights()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    src = Path(actor.model_path)  # tokenizer and config files of the model trained
    for f in src.iterdir():
        if f.suffix in (".json", ".txt", ".model", ".tiktoken", ".jinja") and "safetensors" not in f.name:
            shutil.copy2(f, out / f.name)
    seal(out)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "export":
        print("usage: python -m colocate_rl.checkpoint export <checkpoint folder> <out folder>", file=sys.stderr)
        return 2
    try:
        print(export_hf(argv[1], argv[2]))
    except CheckpointCorrupt as e:
        print(f"error: cannot export {argv[1]}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
