"""Device detection (cuda / rocm / cpu) and the CPU compatibility layer for megatron-core.

ROCm builds of torch answer to the ``torch.cuda`` API (HIP underneath) and report
``torch.version.hip``; RCCL is reached through torch's "nccl" backend. On a machine without a GPU,
megatron-core 0.19.2 still assumes CUDA in a few dozen places; ``apply_cpu_compat()`` works
around exactly those, only when no GPU is present, so that the same trainer code runs on CPU with
gloo (tests, tiny recipes). Megatron's modules get a ``torch`` whose ``torch.cuda`` answers for the
CPU (module-scoped: vLLM and everything else in the process keep the real one); the rest are a
few targeted patches. Each names the Megatron behaviour it works around.
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


@functools.cache
def compiled(fn):
    """fn compiled once for any shapes (torch.compile, dynamic): elementwise work and row reductions
    that eager mode launches as many small kernels, as one or a few. Casts to a narrower dtype round
    as in eager mode (inductor otherwise keeps an fp32 value it was told to round to bf16)."""
    return torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True})


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


def machine_gpus() -> int:
    """GPUs of this machine (0 without one)."""
    return torch.cuda.device_count() if has_gpu() else 0


def device_used() -> int | None:
    """Bytes in use on this process's GPU, every process included (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


def gpus_present() -> bool:
    """A GPU driver is on this machine (NVIDIA or AMD), found without initialising CUDA/HIP: after
    that, hiding the GPUs from this process (``hide_gpus``) would be too late."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")


def hide_gpus() -> None:
    """This process and its children see no GPU (placement.gpus_per_node=0 on a machine that has
    some). Must run before anything initialises CUDA/HIP. An invalid first index hides every device
    on both stacks."""
    os.environ.update({"CUDA_VISIBLE_DEVICES": "-1", "HIP_VISIBLE_DEVICES": "-1"})


def setup_platform() -> str:
    """Call before building Megatron modules: patches megatron-core for CPU when there is no GPU."""
    k = kind()
    if k == "cpu":
        apply_cpu_compat()
    return k


# ---------------------------------------------------------------- megatron-core on CPU

_PATCHED_MODULES: set[str] = set()
_GLOBAL_DONE = False

# Megatron modules the actor uses, imported before patching so their ``torch`` can be swapped.
_MEGATRON_MODULES = (
    "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.optimizer_param_scheduler",
    "megatron.core.distributed", "megatron.core.distributed.finalize_model_grads",
    "megatron.core.pipeline_parallel", "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.moe.moe_layer", "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts", "megatron.core.tensor_parallel",
    "megatron.core.dist_checkpointing", "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.torch", "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)


def apply_cpu_compat() -> None:
    """Idempotent; a no-op when a GPU is present (the real CUDA paths are then used unchanged).

    Megatron modules see a CPU-answering ``torch`` (module-scoped: other libraries in the process,
    vLLM included, keep the real one); two Tensor-method patches apply only while the Megatron
    calls that need them run. Call again after importing more of Megatron.
    """
    global _GLOBAL_DONE
    if has_gpu():
        return
    import importlib
    import sys

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron asserts it for TP overlap
    for mod in _MEGATRON_MODULES:
        importlib.import_module(mod)
    proxy = _TorchOnCpu()
    for name, mod in list(sys.modules.items()):
        if name.startswith("megatron.core") and name not in _PATCHED_MODULES and getattr(mod, "torch", None) is torch:
            mod.torch = proxy
            _PATCHED_MODULES.add(name)
    if not _GLOBAL_DONE:
        _GLOBAL_DONE = True
        _cpu_rng_tracker()
        _cpu_tensor_methods()
        _moe_split_sizes_as_numpy()


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


class _CudaOnCpu:
    """``torch.cuda`` as Megatron sees it without a GPU; anything not listed is the real one."""

    _stream = _Stream()
    # Megatron allocates on torch.cuda.current_device() in ~120 places (rotary inv_freq.to(...),
    # grad buffers, optimizer state, all-to-all outputs): answer "cpu".
    current_device = staticmethod(torch.cpu.current_device)
    # The MoE all-to-all dispatcher moves its split sizes to host on a side Stream and waits on the
    # recorded Event; the DDP overlap path does the same. On CPU there is one stream, nothing to wait for.
    Stream, Event = _Stream, _Event
    stream = staticmethod(torch.cpu.stream)

    @staticmethod
    def current_stream(device=None):
        return _CudaOnCpu._stream

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """``torch`` as a Megatron module sees it: ``torch.cuda`` answers for the CPU, and factory calls
    with a literal device="cuda" (causal masks, the schedules' token counter, the optimizers'
    found_inf / loss-scale / grad-norm scalars) allocate on the CPU."""

    cuda = _CudaOnCpu()
    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn")
    _wrapped: dict = {}

    def __getattr__(self, name):
        fn = getattr(torch, name)
        if name not in self._FACTORIES:
            return fn
        if name not in self._wrapped:
            @functools.wraps(fn)
            def on_cpu(*args, **kwargs):
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return fn(*args, **kwargs)

            self._wrapped[name] = on_cpu
        return self._wrapped[name]


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


class _TypeName(str):
    """'torch.FloatTensor' that also equals 'torch.cuda.FloatTensor'."""

    def __eq__(self, other):
        return str.__eq__(self, other) or (isinstance(other, str) and str.__eq__(self, other.replace(".cuda.", ".", 1)))

    __hash__ = str.__hash__


@contextlib.contextmanager
def megatron_tensor_methods_on_cpu():
    """While Megatron code runs inside: Tensor.type() names also match the torch.cuda.* names, and
    Tensor.cuda() leaves a CPU tensor where it is (a CPU-only torch raises there). Applied to
    optimizer construction and tied-embedding setup; wrap other Megatron calls that check tensor
    types (e.g. loading optimizer state) in it too."""
    orig_type, orig_cuda = torch.Tensor.type, torch.Tensor.cuda

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            return _TypeName(orig_type(self))
        return orig_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type, torch.Tensor.cuda = type_, lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = orig_type, orig_cuda


def _within_cpu_tensor_methods(owner, name: str) -> None:
    orig = getattr(owner, name)

    @functools.wraps(orig)
    def wrapped(*args, **kwargs):
        with megatron_tensor_methods_on_cpu():
            return orig(*args, **kwargs)

    setattr(owner, name, wrapped)


def _cpu_tensor_methods() -> None:
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.optimizer as moptimizer
    from megatron.core.models.common.language_module.language_module import LanguageModule

    # Megatron's optimizers (Float16OptimizerWithFloat16Params, DistributedOptimizer) accept
    # parameters only if Tensor.type() == 'torch.cuda.FloatTensor' (or Half/BFloat16), and grad
    # clipping asserts grad.type() == 'torch.cuda.FloatTensor' at every step.
    _within_cpu_tensor_methods(mopt, "get_megatron_optimizer")
    _within_cpu_tensor_methods(moptimizer, "clip_grad_by_total_norm_fp32")
    # Tied embeddings with PP>1 move the shared weight with .cuda() before the all-reduce.
    _within_cpu_tensor_methods(LanguageModule, "setup_embeddings_and_output_layer")


def _moe_split_sizes_as_numpy() -> None:
    import megatron.core.transformer.moe.token_dispatcher as td

    # The all-to-all dispatcher turns its split sizes into numpy arrays only when they start on
    # the GPU (maybe_move_tensor_to_cpu checks is_cuda); on CPU they stay tensors, which
    # torch.distributed.all_to_all_single rejects as split sizes.
    orig = td.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    td.maybe_move_tensor_to_cpu = to_host
