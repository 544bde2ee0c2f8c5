"""Adam with its state in host memory, streamed through the device chunk by chunk.

A 284B-parameter model (DeepSeek-V4-Flash) trained in bf16 holds, per parameter, 2 bytes of weight
and 4 of fp32 gradient on the device; Megatron's mixed-precision Adam adds 12 more (fp32 master
weight, two fp32 moments), which no set of 8 GPUs holds. ``HostAdam`` keeps those 12 bytes (8 with
bf16 moments) in host memory, pinned when a GPU is present; the device keeps only the bf16
parameters and the fp32 gradient buffer.

Each step, chunk by chunk: the chunk's master weights and moments go host → device, the update
runs on the device against the gradients already there, the new weights are written into the
parameter (rounded to its dtype) and the state goes back device → host. Loading and storing run on
two copy streams, so chunk k+1 loads and chunk k-1 stores while chunk k computes. The device does
the arithmetic because it is the fast side: the alternative (gradients down, Adam on the host CPU,
weights up) moves 6 bytes instead of 24 but leaves ~10 elementwise passes per parameter to host
cores that eight ranks share. Without a GPU the state is updated where it lies.

What megatron-core 0.19.2 offers instead does not fit: its ``optimizer_cpu_offload``
(HybridDeviceOptimizer) calls torch.cuda streams unconditionally (it cannot run, nor be tested,
without a GPU), keeps fp32 moments only (its host side is torch.optim.AdamW), and keeps fp32 master
weights off the device only under the precision-aware distributed optimizer, which otherwise needs
TransformerEngine's FusedAdam, as ``exp_avg_dtype=bf16`` does.

Kept from Megatron, so the update is the one its optimizer makes: the parameter groups (weight-
decay exclusions, lr/wd multipliers the scheduler reads) and the per-part gradient-norm groups, both
taken from the optimizer ``get_megatron_optimizer`` builds; the grad-norm computation
(``get_grad_norm_fp32`` over the gradients of parameters that are not shared and not tensor-parallel
duplicates); clipping by ``max_norm / (norm + 1e-6)`` when that is below 1, applied to each chunk's
gradients as they are read (one pass fewer over the gradients than scaling them in place); the
arithmetic of torch.optim.AdamW, which is what megatron-core runs without TransformerEngine or apex;
the distributed optimizer's shard ranges (each data-parallel rank updates the slice of every bucket
that the reduce-scatter reduced for it, then DDP all-gathers the parameters); and the checkpoint
keys (``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<parameter key>`` in model space, so a
checkpoint reshards across TP/PP/EP and data-parallel sizes).
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from colocate_rl import platform

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STATE_KEYS = ("fp32_param", "exp_avg", "exp_avg_sq")  # Megatron's names for them in checkpoints


def adam_update_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *,
                 step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 grad_scale: float = 1.0) -> None:
    """One AdamW step on a chunk, in place, computed in the master weights' dtype (float32) whatever
    the moments are stored in.

    master [n] float32 (updated); exp_avg, exp_avg_sq [n] float32 or bfloat16 (updated; bfloat16 is
    rounded to nearest on store); grad [n] float32 (read only, multiplied by ``grad_scale`` first:
    the clipping coefficient). ``step`` >= 1 counts this update (bias correction).

    Op for op torch.optim.AdamW's single-tensor path (decoupled weight decay), which is the
    optimizer megatron-core builds when neither TransformerEngine nor apex is installed.
    """
    g = grad * grad_scale if grad_scale != 1.0 else grad
    m = exp_avg if exp_avg.dtype == master.dtype else exp_avg.to(master.dtype)
    v = exp_avg_sq if exp_avg_sq.dtype == master.dtype else exp_avg_sq.to(master.dtype)
    if weight_decay != 0:
        master.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
    master.addcdiv_(m, denom, value=-(lr / bias_correction1))
    if m is not exp_avg:
        exp_avg.copy_(m)
    if v is not exp_avg_sq:
        exp_avg_sq.copy_(v)


@dataclass
class _Slice:
    """The flat range [start, end) of one parameter that this rank updates (all of it without the
    distributed optimizer; possibly empty with it), and where its state sits in the host buffers."""

    param: torch.nn.Parameter
    group: dict  # its parameter group: lr, weight_decay, betas, eps
    part: int  # index into HostAdam._parts
    start: int
    end: int
    offset: int  # into the part's flat host buffers

    @property
    def numel(self) -> int:
        return self.end - self.start

    def grad(self) -> torch.Tensor:
        return self.param.main_grad.view(-1)[self.start:self.end]

    def weights(self) -> torch.Tensor:
        return self.param.detach().view(-1)[self.start:self.end]


@dataclass
class _Part:
    """One of the optimizers ``get_megatron_optimizer`` chains (dense parameters, expert parameters)."""

    groups: list  # its parameter groups
    stats_group: object  # process group its gradient norm is reduced over
    tp_group: object
    expert_tp_group: object
    state: dict  # key → flat host tensor holding every slice's state of this part


class HostAdam:
    """Built from the Megatron optimizer of ``get_megatron_optimizer`` (non-distributed config: its
    parameter groups hold the model's own parameters) and the DDP module it was built for.

    The Megatron optimizer interface the actor uses: ``param_groups`` (the LR scheduler writes 'lr'
    and 'weight_decay'), ``step() -> (ok, grad_norm, None)``, ``zero_grad``, ``scale_loss``,
    ``sharded_state_dict`` / ``load_state_dict``. ``distributed``: the DDP module reduce-scatters
    gradients (``use_distributed_optimizer``) and each data-parallel rank keeps state for its shard
    only. ``chunk_numel``: elements per streamed chunk (a chunk never spans two parameters).
    """

    def __init__(self, megatron_optimizer, ddp, *, clip_grad: float, state_dtype: str = "float32",
                 chunk_mb: int = 256, distributed: bool = False):
        from megatron.core import parallel_state
        from megatron.core.optimizer.optimizer import _get_param_grad_norm_group

        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"actor.optimizer_state_dtype={state_dtype!r} is not one of {', '.join(STATE_DTYPES)}")
        if chunk_mb < 1:
            raise ValueError(f"actor.optimizer_chunk_mb={chunk_mb} must be >= 1")
        self.clip_grad = clip_grad
        self.state_dtype = STATE_DTYPES[state_dtype]
        self.chunk_numel = chunk_mb * 2**20 // 4  # a chunk holds chunk_mb MiB of fp32 master weights
        self.distributed = distributed
        self.num_steps = 0  # Adam's step count: every parameter takes every (not skipped) update
        self._ddp = ddp
        self._gpu = platform.has_gpu()
        self._device = platform.device()
        owned = _shard_ranges(ddp) if distributed else {}

        self._parts: list[_Part] = []
        self._slices: list[_Slice] = []
        pinned = []
        for opt in megatron_optimizer.chained_optimizers:
            groups = [] if opt.is_stub_optimizer else opt.optimizer.param_groups
            # The distributed optimizer's norm sums shard slices over the whole instance (every rank),
            # the plain one whole parameters over model-parallel ranks (Megatron's two choices).
            stats = (parallel_state.get_intra_distributed_optimizer_instance_group() if distributed
                     else opt.get_grad_stats_parallel_group())
            part = _Part(groups, stats, getattr(opt, "tp_group", None), getattr(opt, "expert_tp_group", None), {})
            n = 0
            for group in groups:
                for p in group["params"]:
                    if _get_param_grad_norm_group(p) is not None:
                        raise ValueError(f"HostAdam clips by one norm; a parameter of grad-norm group "
                                         f"{_get_param_grad_norm_group(p)} needs Megatron's optimizer")
                    start, end = owned.get(p, (0, 0)) if distributed else (0, p.numel())
                    self._slices.append(_Slice(p, group, len(self._parts), start, end, n))
                    n += end - start
            for key in STATE_KEYS:
                part.state[key] = _host_zeros(n, torch.float32 if key == "fp32_param" else self.state_dtype, pinned)
            self._parts.append(part)
        for s in self._slices:  # master weights start from the model's (bf16 → fp32 is exact)
            self._state(s, "fp32_param").copy_(s.weights())
        if pinned:
            weakref.finalize(self, _unregister, pinned)

    # ------------------------------------------------------------ Megatron optimizer interface

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self._parts for g in part.groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients live in DDP's buffer (zeroed by ``zero_grad_buffer``), never in .grad."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss  # no loss scaling in bf16 / fp32

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        """Grad norm, clipping and one Adam update of every parameter; the distributed optimizer then
        all-gathers the parameters. Returns (True, grad norm before clipping, None) like Megatron's."""
        norm = self.grad_norm()
        coeff = self.clip_grad / (norm + 1.0e-6) if self.clip_grad > 0 else 1.0
        self.num_steps += 1
        self._update(coeff if coeff < 1.0 else 1.0)
        if self.distributed:
            self._ddp.start_param_sync()
        return True, norm, None

    def grad_norm(self) -> float:
        """L2 norm of the gradients over the whole model, as Megatron's ChainedOptimizer computes it:
        one reduction when every part reduces over the same group, else the parts' norms combined."""
        from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

        per_part = [[] for _ in self._parts]
        for s in self._slices:
            if s.numel and self._counted(s):
                per_part[s.part].append(s.grad())
        groups = [p.stats_group for p in self._parts]
        if all(g == groups[0] for g in groups):
            return float(get_grad_norm_fp32([g for grads in per_part for g in grads],
                                            grad_stats_parallel_group=groups[0]))
        norms = [float(get_grad_norm_fp32(grads, grad_stats_parallel_group=g)) for grads, g in zip(per_part, groups)]
        return math.sqrt(sum(x**2 for x in norms))

    def _counted(self, s: _Slice) -> bool:
        """Megatron's filter for the norm: shared parameters (a tied embedding's second copy) and
        tensor-parallel replicas count once."""
        from megatron.core.tensor_parallel import param_is_not_gtp_duplicate, param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        part = self._parts[s.part]
        return (param_is_not_shared(s.param) and param_is_not_gtp_duplicate(s.param)
                and param_is_not_tensor_parallel_duplicate(s.param, tp_group=part.tp_group,
                                                           expert_tp_group=part.expert_tp_group))

    # ------------------------------------------------------------ the streamed update

    def _chunks(self) -> Iterator[tuple[_Slice, int, int]]:
        """(slice, lo, hi): ranges of at most chunk_numel elements, relative to the slice."""
        for s in self._slices:
            for lo in range(0, s.numel, self.chunk_numel):
                yield s, lo, min(lo + self.chunk_numel, s.numel)

    def _state(self, s: _Slice, key: str, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        hi = s.numel if hi is None else hi
        return self._parts[s.part].state[key][s.offset + lo: s.offset + hi]

    def _apply(self, s: _Slice, lo: int, hi: int, master, exp_avg, exp_avg_sq, grad_scale: float) -> None:
        beta1, beta2 = s.group["betas"]
        adam_update_(master, exp_avg, exp_avg_sq, s.grad()[lo:hi], step=self.num_steps, lr=s.group["lr"],
                     beta1=beta1, beta2=beta2, eps=s.group["eps"], weight_decay=s.group["weight_decay"],
                     grad_scale=grad_scale)
        s.weights()[lo:hi].copy_(master)  # rounds to the parameter's dtype

    def _update(self, grad_scale: float) -> None:
        chunks = list(self._chunks())
        if not self._gpu:  # the state is host memory already: update it where it lies
            for s, lo, hi in chunks:
                self._apply(s, lo, hi, *(self._state(s, k, lo, hi) for k in STATE_KEYS), grad_scale)
            return
        if not chunks:
            return
        # Two device slots: chunk k computes in one while k+1 loads into the other; slot reuse waits
        # until the store of the chunk before has left it.
        size = max(hi - lo for _, lo, hi in chunks)
        slots = [{k: torch.empty(size, dtype=self._parts[0].state[k].dtype, device=self._device) for k in STATE_KEYS}
                 for _ in range(2)]
        stored: list[Optional[torch.cuda.Event]] = [None, None]
        compute, h2d, d2h = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()
        h2d.wait_stream(compute)  # the slots' memory comes from the compute stream's pool

        def load(i: int) -> torch.cuda.Event:
            s, lo, hi = chunks[i]
            slot = slots[i % 2]
            with torch.cuda.stream(h2d):
                if stored[i % 2] is not None:
                    h2d.wait_event(stored[i % 2])
                for k in STATE_KEYS:
                    slot[k][: hi - lo].copy_(self._state(s, k, lo, hi), non_blocking=True)
                return h2d.record_event()

        loaded = load(0)
        for i, (s, lo, hi) in enumerate(chunks):
            nxt = load(i + 1) if i + 1 < len(chunks) else None
            slot = slots[i % 2]
            compute.wait_event(loaded)
            self._apply(s, lo, hi, *(slot[k][: hi - lo] for k in STATE_KEYS), grad_scale)
            done = compute.record_event()
            with torch.cuda.stream(d2h):
                d2h.wait_event(done)
                for k in STATE_KEYS:
                    self._state(s, k, lo, hi).copy_(slot[k][: hi - lo], non_blocking=True)
                stored[i % 2] = d2h.record_event()
            loaded = nxt
        d2h.synchronize()  # the host state is complete before anyone reads it; the slots are freed after

    # ------------------------------------------------------------ offload and checkpoints

    def device_tensors(self) -> list[torch.Tensor]:
        """Tensors this optimizer holds on the device between steps: none (offload moves nothing)."""
        return []

    def host_tensors(self) -> list[torch.Tensor]:
        """The flat host buffers: fp32 master weights and the two moments of every part."""
        return [t for part in self._parts for t in part.state.values()]

    def reload_model_params(self) -> None:
        """Master weights from the model's parameters (after loading weights without optimizer state)."""
        for s in self._slices:
            self._state(s, "fp32_param").copy_(s.weights())

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """Optimizer state in model space: per parameter a tensor of its (TP/EP-sharded) shape for each
        of fp32_param / exp_avg / exp_avg_sq, keyed like Megatron's; Adam's step count as a plain value.

        With the distributed optimizer each rank holds a flat slice of each parameter: saving first
        sums the slices over the data-parallel group into whole tensors (collective; every rank
        holds its model shard's whole state in host memory until the save is done), loading reads
        whole tensors that ``load_state_dict`` cuts its slices from."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
        from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

        tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
        by_param = {id(t.data): t for t in nested_values(tensors)}
        state = {}
        for i, s in enumerate(self._slices):
            if id(s.param) not in by_param:
                raise ValueError(f"a parameter of shape {tuple(s.param.shape)} has no entry in the model's "
                                 "sharded state dict")
            whole = {k: self._whole(s, k, is_loading) for k in STATE_KEYS}
            state[i] = {k: make_sharded_optimizer_tensor(by_param[id(s.param)], t, prefix=f"optimizer.state.{k}")
                        for k, t in whole.items()}
        return {"state": state, "step": self.num_steps}

    def _whole(self, s: _Slice, key: str, is_loading: bool) -> torch.Tensor:
        dtype = self._parts[s.part].state[key].dtype
        if not self.distributed:
            return self._state(s, key).view(s.param.shape)
        if is_loading:
            return torch.empty(s.param.shape, dtype=dtype)
        t = torch.zeros(s.param.numel(), dtype=dtype, device=self._device)
        t[s.start:s.end].copy_(self._state(s, key))
        dist.all_reduce(t, group=self._ddp_group(s))  # the other ranks' slices are zero here
        return t.view(s.param.shape).cpu()

    def _ddp_group(self, s: _Slice):
        for buf in self._ddp.buffers + self._ddp.expert_parallel_buffers:
            if s.param in buf.param_index_map:
                return buf.data_parallel_group
        raise KeyError("parameter not in any DDP buffer")

    def load_state_dict(self, state_dict: dict) -> None:
        """The inverse of ``sharded_state_dict`` (after dist_checkpointing.load filled it)."""
        for i, s in enumerate(self._slices):
            for k in STATE_KEYS:
                src = state_dict["state"][i][k].reshape(-1)[s.start:s.end]
                dst = self._state(s, k)
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src)
        self.num_steps = int(state_dict["step"])


def _shard_ranges(ddp) -> dict:
    """param → (start, end): the flat range of it inside this data-parallel rank's shard of its
    buckets (what the distributed optimizer's reduce-scatter reduces here and its all-gather sends)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    out = {}
    for buf in ddp.buffers + ddp.expert_parallel_buffers:
        for buckets in DistributedOptimizer._build_gbuf_range_map(buf).values():
            for bucket in buckets:
                for p, ranges in bucket["param_map"].items():
                    out[p] = (ranges["param"].start, ranges["param"].end)
    return out


def _host_zeros(numel: int, dtype: torch.dtype, pinned: list) -> torch.Tensor:
    """A zeroed host tensor, page-locked when a GPU is present (asynchronous copies need it).
    Registered rather than taken from torch's pinned allocator, which rounds every block up to a
    power of two: a 140 GB state buffer would hold 256 GB."""
    t = torch.zeros(numel, dtype=dtype)
    if not platform.has_gpu() or not numel:
        return t
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    except (AttributeError, RuntimeError) as e:
        err = e
    if isinstance(err, Exception) or int(err) != 0:
        warnings.warn(f"cudaHostRegister failed ({err}): host Adam state pinned by torch's allocator")
        return t.pin_memory()
    pinned.append(t.data_ptr())
    return t


def _unregister(ptrs: Sequence[int]) -> None:
    for ptr in ptrs:
        torch.cuda.cudart().cudaHostUnregister(ptr)
