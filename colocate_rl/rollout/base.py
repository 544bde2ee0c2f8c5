"""The rollout side's interface and its backends by name (``rollout.backend``).

A backend is one class implementing ``Rollout``, registered with one line in ``BACKENDS`` as
``"module:Class"`` (imported only when chosen: vLLM's import alone takes seconds). The placement
builds engines only through ``make_rollout``, so adding a backend (say SGLang) is one module plus
its registration line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from colocate_rl.config import Config
from colocate_rl.models.registry import model_folder
from colocate_rl.types import RolloutBatch, Sample
from colocate_rl.weight_sync.ipc import Message, SyncStats


class EngineDied(RuntimeError):
    """The engine's process is gone (killed, crashed, out of memory): this engine cannot be used
    again; build a new one and sync the weights into it."""


@runtime_checkable
class Rollout(Protocol):
    """What the loop, the handoff and the placement need from an inference engine."""

    supports_sleep: bool  # False: sleep/wake only check the engine is alive (CPU)
    num_workers: int  # processes holding weights (one per GPU of a TP group)

    def generate(self, samples: list[Sample], n: Optional[int] = None, temperature: Optional[float] = None,
                 max_tokens: Optional[int] = None, seed: Optional[int] = None,
                 top_p: Optional[float] = None) -> RolloutBatch:
        """n samples per prompt, a prompt's rows adjacent; rollout_logprobs of the sampled distribution."""

    def sleep(self, level: Optional[int] = None) -> None:
        """Frees the device (level 2: weights discarded; the next sync overwrites them)."""

    def wake(self, tags: Optional[list[str]] = None) -> None:
        """Staged wake: ["weights"], then after the sync ["kv_cache"]; None wakes everything."""

    def ping(self) -> None:
        """Raises EngineDied when the engine is gone."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float = 256,
                       device: Optional[str] = None) -> SyncStats:
        """HF-named tensors from this process, bucket by bucket."""

    def begin_weight_sync(self) -> None: ...

    def load_message(self, message: Message) -> list[dict[str, float]]:
        """One bucket message from other processes ({device uuid: payload}; weight_sync.ipc)."""

    def end_weight_sync(self) -> float: ...

    def abort_weight_sync(self) -> None: ...

    def checksum(self, names: list[str]) -> dict[str, float]:
        """HF name -> weight_sync.verify.tensor_checksum of the engine's copy."""

    def shutdown(self) -> None: ...


# name -> "module:Class"; the class is imported when chosen.
BACKENDS: dict[str, str] = {
    "vllm": "colocate_rl.rollout.engine:RolloutEngine",
    "transformers": "colocate_rl.rollout.hf_generate:TransformersRollout",
}


def backend_class(name: str) -> type:
    if name not in BACKENDS:
        raise ValueError(f"rollout.backend={name!r} is not one of {', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_rollout(cfg: Config, model_path: Optional[str] = None, **kwargs: Any) -> Rollout:
    """The engine of ``cfg.rollout.backend`` for ``model_path`` (default cfg.model.path; a hub id is
    resolved to its snapshot on this machine)."""
    return backend_class(cfg.rollout.backend)(cfg, model_folder(model_path or cfg.model.path), **kwargs)


def sampling_seed(cfg: Config, step: int) -> Optional[int]:
    """Seed of step ``step``'s rollout requests (None: the engine's own generator). Seeding every
    request from (rollout.seed, step) makes a resumed run sample exactly what the uninterrupted one did."""
    r = cfg.rollout
    return r.seed * 1_000_003 + step * 7_919_003 if r.seed_each_step else None


EVAL_SEED_OFFSET = 500_009  # eval requests of a step are seeded apart from its training requests
