"""The rollout side's interfaces and its backends by name (``rollout.backend``).

A backend is one class implementing ``Engine`` (``RemoteEngine`` when its workers run in processes
of their own, as vLLM's do), registered with one line in ``BACKENDS`` as
``"module:Class"`` (imported only when chosen: vLLM's import alone takes seconds). The placement
builds engines only through ``make_rollout``, so adding a backend (say SGLang) is one module plus
its registration line here. A backend's class is built as ``Class(model, engine, sampling, resolved,
model_path)``: the model section, the rollout views and the plan's record (resolved.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from colocate_rl.config import ModelConfig
from colocate_rl.models.registry import model_folder
from colocate_rl.resolved import EngineSettings, Resolved, Sampling
from colocate_rl.types import RolloutBatch, Sample
from colocate_rl.weight_sync.ipc import Message, SyncStats


class EngineDied(RuntimeError):
    """The engine's process is gone (killed, crashed, out of memory): this engine cannot be used
    again; build a new one and sync the weights into it."""


@runtime_checkable
class Rollout(Protocol):
    """The rollout side as the loop, the handoff and the placements see it: one engine, or several
    behind a router."""

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

    def checksum(self, names: list[str]) -> dict[str, float]:
        """HF name -> weight_sync.verify.tensor_checksum of the engine's copy."""

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The engine's tensors by checkpoint name, with their shapes as it holds them: what a sync
        must quantize (weight_sync.quantize.sync_plan)."""

    def shutdown(self) -> None: ...


@runtime_checkable
class Engine(Rollout, Protocol):
    """One engine, as a backend builds it (``make_rollout``)."""

    supports_sleep: bool  # False: sleep/wake only check the engine is alive (CPU)
    num_workers: int  # processes holding weights (one per GPU of a TP group)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float = 256,
                       device: Optional[str] = None) -> SyncStats:
        """HF-named tensors from this process, bucket by bucket."""


@runtime_checkable
class RemoteEngine(Engine, Protocol):
    """An engine whose workers run in processes of their own (vLLM): weights from other processes
    reach them as bucket messages (IPC handles, weight_sync.ipc) or over a broadcast group. The Ray
    placements run these only (the plan keeps other backends in a world of one)."""

    device_uuids: list[str]  # each worker's device (weight_sync.ipc.device_uuid): the keys of a bucket message

    def begin_weight_sync(self) -> None: ...

    def load_message(self, message: Message) -> list[dict[str, float]]:
        """One bucket message from other processes ({device uuid: payload}; weight_sync.ipc)."""

    def end_weight_sync(self) -> float: ...

    def abort_weight_sync(self) -> None: ...

    def init_weight_broadcast(self, spec: dict[str, Any], first_rank: int) -> list[int]:
        """Every worker joins the broadcast group (weight_sync.broadcast.GroupSpec as a dict) as rank
        first_rank + its rank in this engine."""

    def receive_weights_broadcast(self) -> SyncStats:
        """One sync from the broadcast group."""

    def close_weight_broadcast(self) -> None: ...


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


def make_rollout(model: ModelConfig, engine: EngineSettings, sampling: Sampling, resolved: Resolved,
                 model_path: Optional[str] = None, **kwargs: Any) -> Engine:
    """The engine of rollout.backend for ``model_path`` (default model.path; a hub id is resolved to
    its snapshot on this machine)."""
    return backend_class(engine.backend)(model, engine, sampling, resolved, model_folder(model_path or model.path),
                                         **kwargs)


EVAL_SEED_OFFSET = 500_009  # eval requests of a step are seeded apart from its training requests
