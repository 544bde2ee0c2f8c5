"""Device detection (cuda / rocm / cpu) and the CPU compatibility layer for megatron-core.

ROCm builds of torch answer to the ``torch.cuda`` API (HIP underneath) and report
``torch.version.hip``; RCCL is reached through torch's "nccl" backend. On a machine without a GPU,
megatron-core 0.19.2 still assumes CUDA in a few dozen places; ``apply_cpu_compat()`` patches
exactly those, once, and only when no GPU is present, so that the same trainer code runs on CPU
with gloo (tests, tiny recipes). Every patch names the Megatron behaviour it works around.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch


def kind() -> str:
    """'cuda', 'rocm' or 'cpu'."""
    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return "cpu"


def has_gpu() -> bool:
    return kind() != "cpu"


def device() -> torch.device:
    """The device this process computes on: its current GPU (cuda:N, also on ROCm), else cpu."""
    return torch.device("cuda", torch.cuda.current_device()) if has_gpu() else torch.device("cpu")


def dist_backend() -> str:
    """torch.distributed backend: NCCL on CUDA, RCCL (through the "nccl" name) on ROCm, gloo on CPU."""
    return "nccl" if has_gpu() else "gloo"


def visible_devices_env(ids: list[int] | tuple[int, ...]) -> dict[str, str]:
    """Env that pins a process to GPUs ``ids``; ROCm reads HIP_VISIBLE_DEVICES, CUDA the other."""
    v = ",".join(str(i) for i in ids)
    return {"CUDA_VISIBLE_DEVICES": v, "HIP_VISIBLE_DEVICES": v}


def setup_platform() -> str:
    """Call before building Megatron modules: patches megatron-core for CPU when there is no GPU."""
    k = kind()
    if k == "cpu":
        apply_cpu_compat()
    return k


# ---------------------------------------------------------------- megatron-core on CPU

_APPLIED = False


def apply_cpu_compat() -> None:
    """Idempotent; a no-op when a GPU is present (the real CUDA paths are then used unchanged)."""
    global _APPLIED
    if _APPLIED or has_gpu():
        return
    _APPLIED = True
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron asserts it for TP overlap
    _alias_cuda_runtime_to_cpu()
    _cpu_rng_tracker()
    _cuda_literals_to_cpu()
    _cpu_tensor_type_names()


class _Stream(torch.cpu.Stream):
    """The one CPU "stream": every instance is the same, events complete at once."""

    def __init__(self, device=None, priority=0, **kwargs):
        super().__init__()

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, torch.cpu.Stream)

    __hash__ = object.__hash__


class _Event(torch.cpu.Event):
    def __init__(self, *args, **kwargs):
        super().__init__()

    def elapsed_time(self, other) -> float:
        return 0.0


_CPU_STREAM = None


def _alias_cuda_runtime_to_cpu() -> None:
    global _CPU_STREAM
    _CPU_STREAM = _Stream()
    # Megatron allocates on torch.cuda.current_device() in ~120 places (rotary inv_freq.to(...),
    # causal masks, grad buffers, optimizer state); a CPU-only torch raises there: answer "cpu".
    torch.cuda.current_device = torch.cpu.current_device
    # The MoE all-to-all dispatcher moves its split sizes to host on a side torch.cuda.Stream and
    # synchronises on the recorded Event; the DDP overlap path does the same. On CPU there is one
    # stream and nothing to wait for.
    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Event
    torch.cuda.current_stream = lambda device=None: _CPU_STREAM
    torch.cuda.stream = torch.cpu.stream
    torch.cuda.synchronize = torch.cpu.synchronize


def _cpu_rng_tracker() -> None:
    # Megatron's CudaRNGStatesTracker swaps torch.cuda RNG states around dropout (fork()) and seeds
    # them in add(); keep the same bookkeeping with the CPU generator's state instead.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    mrandom.CudaRNGStatesTracker.add = add
    # model_parallel_cuda_manual_seed seeds the default CUDA generator first.
    torch.cuda.manual_seed = lambda seed: None


class _TorchOnCpu:
    """``torch`` as one Megatron module sees it, with device="cuda" in factory calls read as cpu."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn")

    def __getattr__(self, name):
        fn = getattr(torch, name)
        if name not in self._FACTORIES:
            return fn

        @functools.wraps(fn)
        def on_cpu(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)

        return on_cpu


def _cuda_literals_to_cpu() -> None:
    import importlib

    # These modules write device="cuda" literally: the causal mask (get_default_causal_mask), the
    # schedules' token counter, the optimizers' found_inf / grad-scale / grad-norm scalars (and the
    # local multi_tensor_l2norm fallback in megatron.core.utils), the
    # broadcast sizes of tensor_parallel.data and the dispatcher's over_budget flag.
    for name in ("utils", "transformer.utils", "pipeline_parallel.schedules", "optimizer.optimizer",
                 "optimizer.grad_scaler", "optimizer.clip_grads", "tensor_parallel.data",
                 "transformer.moe.token_dispatcher"):
        importlib.import_module("megatron.core." + name).torch = _TorchOnCpu()
    # Tied embeddings with PP>1 re-place the shared weight with .cuda() before the all-reduce; on a
    # CPU-only torch .cuda() raises, and the tensor is already where it belongs.
    torch.Tensor.cuda = lambda self, *a, **k: self


class _TypeName(str):
    """'torch.FloatTensor' that also equals 'torch.cuda.FloatTensor'."""

    def __eq__(self, other):
        return str.__eq__(self, other) or (isinstance(other, str) and str.__eq__(self, other.replace(".cuda.", ".", 1)))

    __hash__ = str.__hash__


def _cpu_tensor_type_names() -> None:
    # Megatron's optimizers (Float16OptimizerWithFloat16Params, DistributedOptimizer, clip_grads)
    # accept parameters only if Tensor.type() == 'torch.cuda.FloatTensor' (or Half/BFloat16).
    orig = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            return _TypeName(orig(self))
        return orig(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
