"""What the plan decides once and hands down: ``plan.resolve`` fills these records, nothing else does.

``Resolved`` holds every choice derived from more than one config section (the layout, the context
length, the launcher and handoff, the actor's kernels, what leaves the device while the engines
run). A component receives its own config section(s) plus this record, and honours each choice or
raises: it never derives one again, nor falls back from one.

The rollout section is one block for the user (``rollout.n``, ``rollout.tensor_parallel_size``, ...)
and three views in the code, by job: ``Sampling`` (what a batch is drawn with), ``EngineSettings``
(how an engine is built and loads weights) and ``Scheduling`` (how the run asks for rollouts and
recovers from a dead engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class Layout:
    """Who runs where, derived once from ``placement``, ``actor`` and ``rollout`` by the placement's
    own layout maths (placement/).

    On CPU (gpus_per_node = 0) the actor's ranks are processes and ``actor_gpus`` counts them; a
    node's "GPUs" are then the ranks it holds: the actor ranks split evenly over the actor nodes
    (``actor.dp`` = 0 derives one tp x pp group per actor node), and each colocated node runs one
    engine."""

    gpus_per_node: int  # 0 = CPU
    nnodes: int
    colocated: bool
    actor_gpus: int  # actor ranks = tp x pp x dp
    tp: int
    pp: int
    ep: int
    dp: int
    rollout_gpus: int  # GPUs the engines run on (colocated: the actor's)
    engines: int  # vLLM engines (colocated: one per TP group of every node; on CPU one per node)
    engine_tp: int
    actor_nodes: int = 1  # nodes holding actor ranks (colocated: every node)
    rollout_nodes: int = 1  # nodes holding engines (colocated: every node; disaggregated on one node: that node)
    ranks_per_node: int = 1  # actor ranks on each actor node (its GPUs; on CPU actor ranks / actor nodes)
    engines_per_node: int = 1  # engines on each rollout node

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_node > 0


@dataclass(frozen=True)
class Kernels:
    """How the actor computes (actor.fp32_residual and actor.*_kernel, auto and unset resolved)."""

    fp32_residual: bool  # the residual stream in fp32 in a 16-bit actor
    logprobs: str  # fused | chunked | exact (as vLLM's sampler computes them, rollout.exact)
    norms: str  # eager | fused
    experts: str  # grouped | sequential (a MoE layer's local experts; nothing to run for a dense model)


@dataclass(frozen=True)
class Resolved:
    layout: Layout
    launcher: str  # local (this process) | ray
    handoff: str  # colocated | disaggregated: which handoff moves the device between the two sides
    max_model_len: int  # an engine's context: prompt + response tokens
    exact: bool  # rollout.exact: the actor's forward runs the engine's batch-invariant kernels
    routing_replay: bool  # rollout.routing_replay: the actor runs the experts the sampler ran
    kernels: Kernels
    offload: tuple[str, ...]  # actor parts (params, grads, optimizer) off the device while the engines run
    rollout_sleep: int  # the level the engines sleep at while the actor trains; 0: they stay awake
    lr_decay_steps: int  # optimizer steps the learning-rate schedule spans
    run_name: str  # the run folder's name under logging.run_dir


@dataclass(frozen=True)
class Sampling:
    """What a rollout batch is drawn with (rollout.n, temperature, top_p, top_k, max_response_tokens, seed)."""

    n: int
    temperature: float
    top_p: float
    top_k: int  # 0: no top-k (rollout.top_k=-1 too)
    max_response_tokens: int
    seed: int
    seed_each_step: bool

    @property
    def truncated(self) -> bool:
        """Top-k or top-p cuts the sampled distribution. Not at temperature 0: vLLM samples greedily
        there and reports the untruncated logprobs."""
        return self.temperature > 0 and (self.top_p < 1.0 or self.top_k > 0)

    def step_seed(self, step: int) -> Optional[int]:
        """Seed of step ``step``'s requests (None: the engine's own generator). Seeding every request
        from (rollout.seed, step) makes a resumed run sample exactly what the uninterrupted one did."""
        return self.seed * 1_000_003 + step * 7_919_003 if self.seed_each_step else None


@dataclass(frozen=True)
class EngineSettings:
    """How an engine is built and takes weights (rollout.backend, its parallelism and memory, sync.direct)."""

    backend: str
    tensor_parallel_size: int
    gpu_memory_utilization: float
    kv_cache_memory_mb: int
    enforce_eager: bool
    sleep_level: int
    weight_quantization: str
    multiprocess: bool
    compile_cache: str
    direct: bool  # replay the copies vLLM's load_weights made at the first sync (sync.direct)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scheduling:
    """How the run asks for rollouts and recovers a dead engine (rollout.off_policy, custom_fn, ...)."""

    off_policy: bool
    custom_fn: str
    max_engine_restarts: int
    dynamic_sampling: bool
    dynamic_max_rounds: int
    max_staleness: int = 1  # rollout.max_staleness: batches requested ahead (off_policy), and the token lag bound
    partial: bool = False  # rollout.partial.enable: steps stop at enough complete groups (rollout/partial.py)
    over_sample: int = 0  # rollout.partial.over_sample: groups in flight beyond data.prompts_per_step
    mask_offpolicy: bool = False  # rollout.partial.mask_offpolicy
