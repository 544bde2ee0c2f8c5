"""Who owns the GPU now, and what each phase keeps on it: the colocated phase cycle and the memory plan.

One colocated step walks this cycle (the staged wake is what keeps the peak below the card):

    ROLLOUT ──sleep──▶ IDLE ──onload──▶ ACTOR ──offload grads+optimizer──▶ ACTOR_PARAMS
       ▲                                                                       │ wake weights
       └──wake kv cache── ROLLOUT_WEIGHTS ◀──offload params── SYNC ◀───────────┘

In SYNC the actor's parameters and vLLM's weights are both resident: the sync is a device-to-device
copy through IPC handles. ``PhaseMachine`` refuses any other transition, so a phase called out of
order fails loudly instead of overflowing the card.

``MemoryPlan`` is built before anything loads (``plan_memory``: parameter counts from the model's
config, dtype, optimizer, TP/PP/EP, vLLM's share of the card) and gives the predicted bytes per
GPU at every phase boundary. It also decides which actor parts must leave the device while vLLM
runs (``actor.offload=auto``): the fewest that make every phase fit. A phase that cannot fit is
named, with its bytes, before any engine starts.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from colocate_rl.config import ActorConfig, AlgorithmConfig, ModelConfig
from colocate_rl.resolved import EngineSettings, Kernels, Layout

GiB = 2**30


class Phase(str, enum.Enum):
    ROLLOUT = "rollout"  # vLLM weights + KV cache
    IDLE = "idle"  # vLLM asleep, actor offloaded
    ACTOR = "actor"  # actor params + grads + optimizer state + activations
    ACTOR_PARAMS = "actor_params"  # actor params (+ parts that stay on the device)
    SYNC = "sync"  # actor params + vLLM weights + bucket staging
    ROLLOUT_WEIGHTS = "rollout_weights"  # vLLM weights only


# Legal transitions, in cycle order.
CYCLE: tuple[Phase, ...] = (Phase.ROLLOUT, Phase.IDLE, Phase.ACTOR, Phase.ACTOR_PARAMS, Phase.SYNC,
                            Phase.ROLLOUT_WEIGHTS)
TRANSITIONS = {(a, CYCLE[(i + 1) % len(CYCLE)]) for i, a in enumerate(CYCLE)}

# Actor parts (trainer.Actor.offload's names) and the plan's part that sizes each.
ACTOR_PARTS = {"params": "actor_params", "grads": "actor_grads", "optimizer": "actor_optimizer"}
# Offload choices for actor.offload=auto, cheapest first: the gradients are freed, not copied
# (they are zeroed before every backward), so dropping them costs nothing.
OFFLOAD_CHOICES: tuple[tuple[str, ...], ...] = ((), ("grads",), ("grads", "optimizer"),
                                               ("grads", "optimizer", "params"))


class IllegalTransition(RuntimeError):
    pass


class MemoryOverflow(RuntimeError):
    pass


# Device memory of accelerators a run can be planned for (decimal GB, as vendors state them).
ACCELERATORS: dict[str, float] = {
    "h100": 80, "h200": 141, "b200": 180, "mi250x": 128, "mi300x": 192, "mi308x": 192, "mi325x": 256, "mi355x": 288,
}


@dataclass
class MemoryPlan:
    """Bytes each part needs on one GPU, what the GPU offers (0 = unchecked, e.g. CPU), and the
    actor parts that leave the device while vLLM runs.

    parts: actor_params, actor_grads, actor_optimizer, activations, rollout_weights, kv_cache,
    sync_buckets, runtime (CUDA contexts, allocator slack). host: bytes of host memory a node holds
    for the run beyond its processes themselves (``host_parts``: host Adam state, offloaded actor
    parts, the engines' weights while asleep at level 1), and the node's memory (0 = unchecked)."""

    capacity: int = 0
    parts: dict[str, int] = field(default_factory=dict)
    offload: tuple[str, ...] = ("grads", "optimizer", "params")
    colocated: bool = True
    # Colocated: vLLM sleeps while the actor trains. False when the actor's whole step fits beside the
    # awake engine: then the handoff is the weight sync alone.
    rollout_sleeps: bool = True
    reference_resident: bool = False  # actor.ref_on_device: the reference stays through the rollout too
    host_parts: dict[str, int] = field(default_factory=dict)  # per node
    host_capacity: int = 0
    host_fixes: list[str] = field(default_factory=list)  # settings that would hold less there
    notes: list[str] = field(default_factory=list)

    @property
    def host_per_node(self) -> int:
        return sum(self.host_parts.values())

    def host_error(self) -> Optional[str]:
        """One line when the node's memory cannot hold what the plan puts there. 10% is left for the
        processes themselves (each holds a few GiB of libraries and buffers)."""
        if not self.host_capacity or self.host_per_node <= 0.9 * self.host_capacity:
            return None
        fixes = "; " + ", ".join(self.host_fixes) if self.host_fixes else ""
        return (f"host memory: the run keeps {self.host_per_node / GiB:.1f} GiB per node in host memory "
                f"({self._host_parts_text()} GiB) of the node's {self.host_capacity / GiB:.1f} GiB{fixes}")

    def _host_parts_text(self) -> str:
        return ", ".join(f"{k} {v / GiB:.1f}" for k, v in self.host_parts.items() if v)

    def kept(self) -> list[str]:
        """Plan parts of the actor that stay on the device while vLLM runs."""
        return [ACTOR_PARTS[p] for p in ACTOR_PARTS if p not in self.offload]

    def resident_parts(self, phase: Phase) -> list[str]:
        kept = self.kept() + (["reference"] if self.reference_resident else [])
        if not self.rollout_sleeps:  # the engine's weights and KV cache stay through every phase
            kept += ["rollout_weights", "kv_cache"]
        actor_all = ["actor_params", "actor_grads", "actor_optimizer", "activations", "reference"]
        by_phase = {
            Phase.ROLLOUT: ["rollout_weights", "kv_cache", *kept],
            Phase.IDLE: kept,
            Phase.ACTOR: [*actor_all, *kept],
            Phase.ACTOR_PARAMS: ["actor_params", *[k for k in kept if k != "actor_params"]],
            Phase.SYNC: ["actor_params", *[k for k in kept if k != "actor_params"], "rollout_weights",
                         "sync_buckets"],
            Phase.ROLLOUT_WEIGHTS: ["rollout_weights", *kept],
        }
        if not self.colocated:  # each pool owns its GPUs: the actor's hold all of it, always
            by_phase = {p: (actor_all + ["sync_buckets"] if p in (Phase.ACTOR, Phase.ACTOR_PARAMS, Phase.SYNC)
                            else ["rollout_weights", "kv_cache"]) for p in Phase}
        return list(dict.fromkeys([*by_phase[phase], "runtime"]))  # each part once

    def resident(self, phase: Phase) -> int:
        return sum(self.parts.get(p, 0) for p in self.resident_parts(phase))

    def overflow(self) -> Optional[Phase]:
        """The first phase (in cycle order) that exceeds the usable capacity, or None."""
        if not self.capacity:
            return None
        return next((p for p in CYCLE if self.resident(p) > self.usable), None)

    @property
    def usable(self) -> int:
        """The capacity less 2% kept free: a plan that filled the card measured within a fraction of
        a GiB of it, too close to an out-of-memory error (docs/performance.md, *The memory plan
        against the card*)."""
        return int(self.capacity * 0.98)

    def check(self, phase: Phase) -> None:
        need = self.resident(phase)
        if self.capacity and need > self.usable:
            detail = ", ".join(f"{p} {self.parts.get(p, 0) / GiB:.2f}" for p in self.resident_parts(phase))
            raise MemoryOverflow(
                f"phase '{phase.value}' would need {need / GiB:.2f} GiB of {self.capacity / GiB:.2f} GiB "
                f"on the device ({detail} GiB)")

    def peaks(self) -> dict[str, int]:
        return {p.value: self.resident(p) for p in Phase}

    def unstaged_peak(self) -> int:
        """What waking vLLM's weights and KV cache at once, with the actor's params still resident, would need."""
        return sum(self.parts.get(p, 0) for p in ("actor_params", "rollout_weights", "kv_cache", "sync_buckets",
                                                   "runtime"))

    def table(self, measured: Optional[dict[str, int]] = None) -> str:
        """The plan as printed at start: one line per part, then per phase (and measured, when given)."""
        cap = f"{self.capacity / GiB:.1f} GiB" if self.capacity else "unchecked (CPU)"
        lines = [f"memory plan per GPU (capacity {cap}; actor parts offloaded while vLLM runs: "
                 f"{', '.join(self.offload) or 'none'}):"]
        lines.append("  parts: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.parts.items()) + " GiB")
        phases = CYCLE if self.colocated else (Phase.ACTOR, Phase.ROLLOUT)
        if self.colocated and not self.rollout_sleeps:
            lines[0] = lines[0][:-2] + "; vLLM stays awake: the actor's step fits beside it):"
        for p in phases:
            need = self.resident(p)
            mark = "  OVER" if self.capacity and need > self.usable else ""
            got = f"   measured {measured[p.value] / GiB:7.2f}" if measured and p.value in measured else ""
            where = "" if self.colocated else (" (actor GPUs)" if p == Phase.ACTOR else " (rollout GPUs)")
            lines.append(f"  {p.value:<16}{need / GiB:8.2f} GiB{where}{got}{mark}")
        if self.host_per_node:
            of = f" of {self.host_capacity / GiB:.1f}" if self.host_capacity else ""
            lines.append(f"  host memory per node: {self.host_per_node / GiB:.1f}{of} GiB ({self._host_parts_text()})"
                         + ("  OVER" if self.host_error() else ""))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------- the estimate


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def activation_bytes(size, tokens: int, tp: int = 1, element_bytes: int = 2,
                     sequence_parallel: bool = False, residual_bytes: int = 0,
                     fused: bool = False, fp32_head: bool = False) -> tuple[int, int]:
    """(one decoder layer, output head + loss): bytes the training forward of ``tokens`` tokens keeps
    for its backward on one tensor-parallel rank, without recompute (``size``: the model's
    models.registry.ModelSize; ``element_bytes``: the model dtype's; ``residual_bytes``: the
    residual stream's, 4 under actor.fp32_residual, 0 = the model dtype's).

    A standard GPT layer (Qwen3) keeps, per token, in elements of the model dtype: 4·h (the two
    norms' inputs, those in the residual stream's dtype, and outputs), 4·q + 3·kv (q before its
    norm, q/k/v, rotated q and k, the attention output), then 3·ffn for a dense SwiGLU MLP (fc1's
    output, fc2's input), or for a routed one h + topk·(h + 4·moe_ffn) (router input, each token's
    copy per expert, the experts' fc1 output, fc2 input and output). benchmarks/memory/activation_census.py
    counts what autograd saves, and this matches it for Qwen3 dense and MoE layers, with the fp32
    residual stream too (docs/lab/performance_log.md, *What the training forward keeps for its
    backward*). Tensor parallelism splits all but the 4·h (those too under sequence parallelism).
    Another family's layer takes Korthikanti et al.'s ~34 bytes per token and hidden unit. The head
    keeps the logits (trainer/logprobs.py) and, in the backward, their gradient, both in the model
    dtype, plus, unless the logprobs are ``fused``, two chunks of fp32 temporaries (of at most
    CHUNK_ELEMENTS each). ``fp32_head`` (model.head_dtype=float32): fp32 logits and gradient, and the
    fp32 copies of the output layer's weight and input that its backward keeps."""
    h, rb = size.hidden, residual_bytes or element_bytes
    if size.q_width:
        split = 4 * size.q_width + 3 * size.kv_width + \
            (h + size.topk * (h + 4 * size.moe_intermediate) if size.experts else 3 * size.ffn)
        norms = 2 * h * (rb + element_bytes)  # inputs in the residual's dtype, outputs in the model's
        per_layer = tokens * (norms / (tp if sequence_parallel else 1) + element_bytes * split / tp)
    else:
        per_layer = 34 * tokens * h / tp
        if size.experts and size.topk:  # routed MLP activations grow with top-k x expert width
            per_layer += 4 * tokens * size.topk * size.moe_intermediate / tp
    from colocate_rl.trainer.logprobs import CHUNK_ELEMENTS

    logits = tokens * size.vocab / tp
    temporaries = 0 if fused else 2 * 4 * min(logits, CHUNK_ELEMENTS)
    logit_bytes = 4 if fp32_head else element_bytes
    copies = 4 * (size.vocab / tp + tokens) * h if fp32_head else 0  # the output weight and its input in fp32
    return int(per_layer), int(2 * logit_bytes * logits + temporaries + copies)


def plan_memory(model: ModelConfig, a: ActorConfig, r: EngineSettings, layout: Layout, size, capacity: int,
                kernels: Kernels, *, row_tokens: int, reference: bool, bucket_mb: float) -> MemoryPlan:
    """Predicted bytes per GPU. ``size``: models.registry.ModelSize; ``capacity``: bytes of one GPU
    (0 = unchecked); ``kernels``: how the actor computes; ``row_tokens``: a sequence's longest
    (prompt + response); ``reference``: a KL term's reference policy is held; ``bucket_mb``: a sync
    bucket's size. The estimate is deliberately simple and says so; a real run records the measured
    bytes next to it (handoff.Handoff.measured)."""
    pb = _DTYPE_BYTES[model.dtype]
    tp, pp, ep, dp = layout.tp, layout.pp, layout.ep, layout.dp
    dense = size.total - size.experts
    per_gpu = dense / (tp * pp) + size.experts / (ep * pp)
    parts: dict[str, int] = {"actor_params": int(per_gpu * pb), "actor_grads": int(per_gpu * 4)}
    # Adam: fp32 master weights (unless the model is fp32) + two moments.
    moment = 2 if a.optimizer_state_dtype == "bfloat16" else 4
    opt_per_param = (0 if pb == 4 else 4) + 2 * moment
    shard = dense / (tp * pp) / (dp if a.distributed_optimizer else 1) + \
        size.experts / (ep * pp) / (max(tp * dp // ep, 1) if a.distributed_optimizer else 1)
    opt_bytes = int(shard * opt_per_param)
    on_host = a.optimizer_cpu_offload
    # Host Adam streams its state through the device two chunks at a time (master + 2 moments each).
    parts["actor_optimizer"] = int(2 * a.optimizer_chunk_mb * 2**20 * (4 + 2 * moment) / 4) if on_host else opt_bytes
    if reference:  # the frozen reference policy: on the device for its forward pass
        parts["reference"] = parts["actor_params"]
    # Activations of one micro-batch per pipeline stage in flight; full recompute keeps each layer's
    # input (the residual stream) plus one whole layer's activations.
    tokens = max(a.micro_batch_tokens, row_tokens) if a.micro_batch_tokens else row_tokens * a.micro_batch_size
    layers = size.layers / pp
    rb = 4 if kernels.fp32_residual else pb
    per_layer, head = activation_bytes(size, tokens, tp, pb, a.sequence_parallel, rb, kernels.logprobs == "fused",
                                       model.head_dtype == "float32")
    act = (layers * rb * tokens * size.hidden + per_layer) if a.recompute else layers * per_layer
    # x1.15 for the backward's temporaries and the allocator's fragmentation, calibrated on the
    # caching allocator's peak against the saved tensors of the same step (docs/lab/performance_log.md,
    # *The handoff that moves only what must move*).
    parts["activations"] = int(1.15 * size.activation_factor * (act * min(pp, 2) + head))
    if kernels.experts == "grouped":
        # The grouped GEMMs' stacked copy of one layer's local fc1 weights (2/3 of a SwiGLU expert's)
        # and, in the backward, their gradient stacked the same way.
        parts["activations"] += int(2 * pb * size.expert_layer * 2 / 3 / ep)
    # vLLM: weights split over the engine's TP group; it takes gpu_memory_utilization of the card for
    # weights, activations and KV cache (or weights + the explicit KV budget).
    wbytes = 1 if r.weight_quantization == "fp8" else pb
    parts["rollout_weights"] = int(size.total * wbytes / max(layout.engine_tp, 1))
    if r.kv_cache_memory_mb:
        parts["kv_cache"] = r.kv_cache_memory_mb * 2**20
    else:
        parts["kv_cache"] = max(int(r.gpu_memory_utilization * capacity) - parts["rollout_weights"], 0)
    # A bucket, and the export's gathered tensors: across ranks, runs of parameters of up to RUN_BYTES.
    from colocate_rl.models.mapping import RUN_BYTES

    gathered = max(size.largest * pb, RUN_BYTES if tp * pp * ep > 1 else 0)
    parts["sync_buckets"] = int(bucket_mb * 2**20 + gathered)
    # A CUDA/HIP context and allocator slack per process on the GPU (none to plan on the CPU): the
    # actor's context and the sleeping engine's graphs, workspaces and context, calibrated on a
    # colocated run (docs/lab/performance_log.md, *The handoff that moves only what must move*).
    parts["runtime"] = ((7 if layout.colocated else 2) * GiB) if capacity else 0
    notes = []
    if rb != pb:  # unset, it is on for a 16-bit actor: say so where the bytes it costs are printed
        notes.append("the actor keeps its residual stream in fp32 (actor.fp32_residual; its norms' inputs and "
                     "recompute checkpoints are counted so)")
    if capacity and not r.kv_cache_memory_mb and parts["kv_cache"] == 0:
        notes.append(f"vLLM's share (rollout.gpu_memory_utilization={r.gpu_memory_utilization}) does not even "
                     "hold its weights")
    plan = MemoryPlan(capacity=capacity, parts=parts, colocated=layout.colocated, notes=notes,
                      reference_resident=reference and a.ref_on_device)
    # The cheapest handoff that fits: vLLM awake and nothing moved (the handoff is the sync alone),
    # then vLLM asleep with the fewest actor parts moved.
    choices = [(sleeps, o) for sleeps in (False, True)
               for o in {"all": [OFFLOAD_CHOICES[-1]], "none": [()], "auto": list(OFFLOAD_CHOICES)}[a.offload]]
    if not capacity:  # CPU: host memory is the only memory; nothing to hand over, but keep the cycle
        choices = [(True, OFFLOAD_CHOICES[-1] if a.offload == "all" else ())]
    if a.offload == "all" or r.sleep_level != 2 or not layout.colocated:
        choices = [c for c in choices if c[0]] or choices
    for sleeps, offload in choices:
        plan.rollout_sleeps, plan.offload = sleeps, offload
        if not layout.colocated or plan.overflow() is None:
            break
    gpus_per_node = max(layout.gpus_per_node, 1)
    # Per node: every GPU's share of each (gradients are freed, not copied; an engine asleep at level
    # 1 copies its weights to host memory).
    plan.host_parts = {p: int(n * gpus_per_node) for p, n in {
        "host Adam state": opt_bytes if on_host else 0,
        "offloaded actor parts": (sum(parts[ACTOR_PARTS[p]] for p in plan.offload if p != "grads")
                                  if layout.colocated else 0),
        "reference": parts.get("reference", 0) if not plan.reference_resident else 0,
        "engine weights asleep": (parts["rollout_weights"] if layout.colocated and plan.rollout_sleeps
                                  and r.sleep_level == 1 else 0),
    }.items()}
    if on_host and moment == 4:
        plan.host_fixes.append("actor.optimizer_state_dtype=bfloat16 takes host Adam from 12 to 8 bytes per parameter")
    if plan.host_parts["engine weights asleep"]:
        plan.host_fixes.append("rollout.sleep_level=2 keeps no engine weights there")
    return plan


def checkpoint_bytes(model: ModelConfig, actor: ActorConfig, algorithm: AlgorithmConfig, size) -> int:
    """Bytes of one checkpoint of the whole run (every rank's shards together): the weights in the
    model's dtype, Adam's fp32 master weights (unless the model is fp32) and two moments in
    actor.optimizer_state_dtype, the reference policy's weights with a KL term. ``size``:
    models.registry.ModelSize."""
    pb = _DTYPE_BYTES[model.dtype]
    moment = 2 if actor.optimizer_state_dtype == "bfloat16" else 4
    per_param = pb + (0 if pb == 4 else 4) + 2 * moment + (pb if algorithm.kl_coef > 0 else 0)
    return int(size.total * per_param)


def plan_error(plan: MemoryPlan, what: str) -> Optional[str]:
    """One line naming the phase that does not fit (None when every phase fits)."""
    phase = plan.overflow()
    if phase is None:
        return None
    need = plan.resident(phase)
    top = sorted(((plan.parts.get(p, 0), p) for p in plan.resident_parts(phase)), reverse=True)[:3]
    return (f"{what}: phase '{phase.value}' needs {need / GiB:.1f} GiB per GPU of {plan.capacity / GiB:.1f} GiB "
            f"(largest: {', '.join(f'{p} {n / GiB:.1f}' for n, p in top)}; actor parts offloaded: "
            f"{', '.join(plan.offload) or 'none'})")


# ---------------------------------------------------------------- the phase state machine


class PhaseMachine:
    """Current owner of the device. ``to(phase)`` checks legality and the plan, then records the
    entry time and (with ``measure``: bytes in use on the device) the measured memory."""

    def __init__(self, plan: MemoryPlan | None = None, start: Phase = Phase.ROLLOUT,
                 measure: Optional[Callable[[], int]] = None):
        self.phase = start
        self.plan = plan or MemoryPlan()
        self.measure = measure
        self.history: list[tuple[Phase, float, int]] = [(start, time.perf_counter(), self._used())]
        self.inside: dict[str, int] = {}  # bytes measured within a phase (record), beside its entry

    def _used(self) -> int:
        return int((self.measure() if self.measure else 0) or 0)

    def to(self, phase: Phase) -> None:
        if (self.phase, phase) not in TRANSITIONS:
            nxt = next(b for (a, b) in TRANSITIONS if a == self.phase)
            raise IllegalTransition(
                f"cannot go from '{self.phase.value}' to '{phase.value}': the GPU owner after "
                f"'{self.phase.value}' is '{nxt.value}'")
        self.plan.check(phase)
        self.phase = phase
        self.history.append((phase, time.perf_counter(), self._used()))

    def record(self) -> None:
        """Measure again inside the current phase (e.g. at its end, when its peak is still held)."""
        used = self._used()
        self.inside[self.phase.value] = max(self.inside.get(self.phase.value, 0), used)

    def reset(self, phase: Phase) -> None:
        """After an engine was replaced: the device is in ``phase`` whatever the cycle said."""
        self.phase = phase
        self.history.append((phase, time.perf_counter(), self._used()))

    def peak_used(self) -> dict[str, int]:
        """Measured bytes in use at each phase's entry, or within it (``record``): max over the run."""
        out: dict[str, int] = dict(self.inside)
        for ph, _, used in self.history:
            out[ph.value] = max(out.get(ph.value, 0), used)
        return out
