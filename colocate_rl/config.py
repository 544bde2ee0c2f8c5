"""The config tree: one small dataclass per component, merged by OmegaConf, checked field by field at load.

A recipe is a function returning a ``Config``; the command line adds YAML files and dotted
``key=value`` overrides on top (``load``). Every check here raises ``ConfigError`` whose one-line
message names the field, so a bad run stops before any engine starts. What follows from several
sections (the layout, the kernels, the rules between sections) is the plan's: colocate_rl.plan.
"""

from __future__ import annotations

import difflib
import importlib
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

class ConfigError(ValueError):
    """A bad config value; the message names the field."""


@dataclass
class ModelConfig:
    path: str = MISSING  # HF folder (config.json + safetensors) or hub id
    tokenizer: str = ""  # defaults to path
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16: actor params and rollout weights
    # Non-empty: write a small random-weight model of this shape to `path` when it does not exist
    # (the tiny CPU recipes; no hub needed). One of colocate_rl.models.tiny.SHAPES; "name@L" keeps a Qwen3
    # shape's first L layers (a real width on fewer GPUs).
    synthesize: str = ""
    trust_remote_code: bool = False
    # The output layer's precision on both sides: model (the model dtype) or float32 (vLLM's
    # head_dtype; the actor's output layer takes fp32 operands). 16-bit logits round to a grid as
    # coarse as 0.125 at |logit| 16, where two GEMMs' sums can land a step apart (docs/performance.md).
    head_dtype: str = "model"


@dataclass
class PartialConfig:
    """Partial rollouts (rollout/partial.py; docs/architecture.md, "Partial rollouts and stale samples"): a step stops
    generating once data.prompts_per_step groups are complete, aborts the rest and continues their
    rows from their tokens in a later step, so a step does not wait for its slowest sample."""

    enable: bool = False
    # Prompt groups in flight beyond data.prompts_per_step: the step stops when data.prompts_per_step
    # of the prompts_per_step + over_sample groups are complete. 0 stops nothing early.
    over_sample: int = 0
    # Leave a continued row's tokens from earlier steps out of the loss (they stay its context and
    # count for its reward); only the tokens of its last step train (slime's
    # --mask-offpolicy-in-partial-rollout), so rollout.max_staleness never restarts a continued row (a
    # row that finished while its group waited is trained whole, and still may be).
    mask_offpolicy: bool = False


@dataclass
class AgentConfig:
    """Multi-turn rollouts with tool calls (rollout/agent.py, docs/agentic.md): the policy writes,
    calls a tool of ``tools.names``, reads its result, writes again, all in one row."""

    enabled: bool = False
    max_turns: int = 4  # assistant turns per sample; a turn that still calls a tool at the last ends it
    # A tool result longer than this many tokens is cut there (a note says so) before the model reads it.
    max_result_tokens: int = 256
    # vLLM's tool-call parser ("" = the model family's: hermes for Qwen3, deepseek_v4 for DeepSeek-V4).
    tool_call_parser: str = ""


@dataclass
class RolloutConfig:
    n: int = 8  # samples per prompt (the GRPO group size)
    temperature: float = 1.0
    # Truncated sampling: vLLM keeps the top_k most likely tokens (0 or -1: all), then the fewest
    # whose probability adds up to top_p (1: all), after the temperature, and samples from them
    # renormalised. The actor then scores the same truncated distribution: it replays the filter on
    # its own logits (trainer/logprobs.py), so an unchanged policy has IS weights of 1 and the
    # policy trained is the one sampled (docs/recipes.md, "Truncated sampling": when to use it).
    top_p: float = 1.0
    top_k: int = 0
    max_response_tokens: int = 256
    seed: int = 0
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5  # share of the card vLLM may take while awake
    kv_cache_memory_mb: int = 0  # explicit KV cache size; 0 = from gpu_memory_utilization (CPU: 256)
    max_model_len: int = 0  # 0 = data.max_prompt_tokens + max_response_tokens
    enforce_eager: bool = False  # skip CUDA graph capture (faster start, slower decode)
    sleep_level: int = 2  # 2 discards weights (the next sync overwrites them); 1 copies them to host
    num_engines: int = 0  # disaggregated mode: engines behind the router; 0 = as many as the rollout GPUs hold
    # Disaggregated mode: generate step k+1 while step k trains (one step stale; the token IS
    # correction, algorithm.is_clamp, weights the stale samples).
    off_policy: bool = False
    # k: no token the loss trains on lags the weights that train it by more than k versions. With
    # off_policy the rollout runs k batches ahead (1: the one-step off-policy above). With partial
    # rollouts a row continued past the bound is regenerated from its prompt (its tokens discarded).
    max_staleness: int = 1
    partial: PartialConfig = field(default_factory=PartialConfig)
    custom_fn: str = ""  # disaggregated mode: "pkg.module:function" producing a step's batch (rollout/buffer.py)
    # "fp8" = the rollout runs FP8 weights (GPU). A quantized checkpoint (Qwen/DeepSeek-V3 block FP8,
    # DeepSeek-V4's released FP8 + MXFP4) gets its weights quantized in its layout by the sender on
    # every sync (colocated: on the actor's own device, before the IPC hand-over); a bf16 one is
    # quantized by vLLM (quantization="fp8") and re-quantized by its post-load processing.
    weight_quantization: str = ""
    multiprocess: bool = False  # vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING)
    # Seed every request from (seed, step): a resumed run samples exactly what the uninterrupted one
    # did. vLLM then samples seeded rows one by one (slightly slower on large batches).
    seed_each_step: bool = True
    max_engine_restarts: int = 2  # per step: a dead engine is rebuilt, re-synced, its prompts re-issued
    # DAPO's dynamic sampling: drop groups whose rewards are all equal (no gradient) and sample more
    # prompts, up to dynamic_max_rounds extra generations, until data.prompts_per_step groups remain.
    dynamic_sampling: bool = False
    dynamic_max_rounds: int = 4
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to vllm.LLM as-is
    # vllm | transformers: sample with transformers' generate in the actor's process, for models
    # vLLM cannot run on this machine (the tiny DeepSeek-V4 on CPU; see rollout/hf_generate.py).
    backend: str = "vllm"
    # R3, MoE models: vLLM returns the experts it routed every token to, and the actor's MoE layers
    # use those experts (weighted by the actor's own router scores at them) in every forward over the
    # batch, so trainer and sampler run the same experts. Needs vLLM on GPUs (its CPU build cannot
    # return routed experts). Costs B x T x MoE layers x top_k bytes of host memory a step (types.py).
    routing_replay: bool = False
    # Exact on-policy (Qwen3 dense and MoE, CUDA): vLLM runs its batch-invariant kernels on its V1
    # model runner (no torch.compile; CUDA graphs for decode unless enforce_eager), and the actor's
    # forward calls the same kernels op for op (models/exact.py): the actor computes what vLLM's
    # forward computes. Needs rollout.tensor_parallel_size == actor.tp and a bf16/fp16 model.
    exact: bool = False
    # Where vLLM's kernel JITs keep what they compiled (torch.compile, DeepGEMM, tilelang, Triton,
    # the CuTe DSL, FlashInfer): "" = COLOCATE_RL_CACHE/compile (the project's .cache, shared by
    # runs, kept across container restarts when the work folder is mounted), "default" = each
    # library's own home-folder default. A cold DeepSeek-V4 start compiles for minutes; a warm one
    # reads these (docs/performance.md).
    compile_cache: str = ""
    # Multi-turn rollouts with tool calls; the tools themselves are the `tools` section.
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class ActorConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 0  # 0 = derived from the GPU count; set it to assert the layout
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"  # constant | linear | cosine
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    # Sequences per forward/backward. On GPUs raise it as far as memory allows: the actor is bound
    # by kernel launches (docs/performance.md, actor.micro_batch_size).
    micro_batch_size: int = 4
    # > 0: micro-batches by tokens instead of rows (verl's use_dynamic_bsz, slime's
    # use_dynamic_batch_size): rows, longest first, fill each micro-batch while its rows times its
    # longest row stay within this many tokens, so short responses run many to a pass and long ones
    # few; actor.micro_batch_size is then unused. The memory plan counts a micro-batch of this many
    # tokens (or of one row of the longest, if that is more).
    micro_batch_tokens: int = 0
    num_minibatches: int = 1  # optimizer steps per RL step (PPO-style mini-batches)
    distributed_optimizer: bool = False
    # Colocated: which of the actor's params / grads / optimizer state leave the device while vLLM
    # runs. auto: only what the memory plan says does not fit beside vLLM's weights and KV cache
    # (nothing on CPU, where there is no device memory to hand over); all: every part, every step;
    # none: nothing (the plan stops the run if that does not fit).
    offload: str = "auto"
    # On a GPU, an offloaded optimizer state comes back on a side stream while the forward and
    # backward run; the optimizer step waits for it on the device (trainer/offload.py). The onload
    # phase then waits only for the parameters (docs/performance.md, actor.overlap_onload).
    overlap_onload: bool = True
    # Adam state in host memory (trainer/host_adam.py): a 284B model's fp32 master weights and two
    # fp32 moments are ~12 bytes/param (3.4 TB) and fit no GPUs. The device keeps the bf16 weights
    # and fp32 gradients; each step streams the state through it in chunks. Works with
    # distributed_optimizer (each data-parallel rank keeps its shard's state) and without it.
    optimizer_cpu_offload: bool = False
    # float32 | bfloat16: dtype of Adam's exp_avg / exp_avg_sq (master weights stay fp32), 12 → 8
    # bytes/param. Needs optimizer_cpu_offload (megatron-core keeps bf16 moments only in
    # TransformerEngine's FusedAdam). bf16 keeps 8 significant bits, so a stored moment moves only
    # by more than half a bf16 step (0.2-0.4% of itself): exp_avg_sq shrinks by at most (1 - beta2)
    # per step, and at adam_beta2 above ~0.996 (the default 0.999) it can no longer decrease.
    # DeepSeek-V3 trained with bf16 moments at beta2 = 0.95.
    optimizer_state_dtype: str = "float32"
    # MiB of fp32 master weights per streamed chunk (its moments follow). Two chunks are on the
    # device at a time (~2 x 3 x chunk_mb with fp32 moments); results do not depend on it.
    optimizer_chunk_mb: int = 256
    recompute: bool = False  # activation recomputation (full layers)
    # Split the per-token work (norms, residual, MoE routing) over the tensor-parallel ranks by
    # sequence (Megatron's sequence parallelism; needs actor.tp > 1). Megatron's MoE layer trains with
    # tensor parallelism only under it, so DeepSeek-V4 at actor.tp > 1 requires it.
    sequence_parallel: bool = False
    # Keep the residual stream (embeddings, residual adds, norm inputs) in fp32 in a 16-bit actor, as
    # mixed precision over fp32 weights (TRL's) does; every matrix product stays 16-bit. It narrows
    # the logprob gap to vLLM to TRL's own at a train-phase cost within the run-to-run spread, adding
    # casts only (docs/performance.md, actor.fp32_residual), and 2 bytes per token and hidden unit to
    # each norm's saved input. Unset (null): on for a bf16/fp16 actor, off in exact mode (vLLM rounds its residual to
    # the model dtype) and for families whose residual is not one plain stream (deepseek_v4's mHC).
    fp32_residual: Optional[bool] = None
    # How the loss's per-token logprobs and their gradient are computed (trainer/logprobs.py). fused:
    # three torch.compile'd kernels that read the 16-bit logits once each and keep the fp32 softmax in
    # registers (~8 bytes of memory traffic per logit); chunked: fp32 copies by row chunks (~74). The
    # same values within fp32 rounding; on a GPU fused is several times as fast at Qwen3's vocabulary
    # and the first step pays its compile (docs/performance.md, actor.logprob_kernel).
    # auto: fused on a GPU, chunked on the CPU (where compiling costs more than it saves); exact
    # mode computes them as vLLM's sampler does, whatever this says.
    logprob_kernel: str = "auto"
    # How the RMSNorms of a Qwen3 actor run (models/norm.py). eager: ~4 operators forward and ~20
    # backward each, four norms per layer, a large share of a train step's operators; fused: the same
    # expressions through torch.compile'd kernels, one or two per pass. On a GPU fused did not pay:
    # it recompiles for each new micro-batch shape, and once compiled its train phase was no faster
    # than eager's (docs/performance.md, actor.norm_kernel).
    norm_kernel: str = "eager"
    # How a MoE layer's experts run (Qwen3-MoE, DeepSeek-V4; models/grouped_experts.py). sequential: megatron-core's
    # SequentialMLP, two matmuls and the activation per expert; grouped: all local experts in two
    # torch grouped GEMMs, the same parameters and bit-for-bit the same results, several times as
    # fast on a GPU (docs/performance.md, actor.expert_kernel). auto: grouped on a GPU for a
    # 16-bit actor, sequential on the CPU. Exact mode runs vLLM's fused experts whatever this says.
    expert_kernel: str = "auto"
    # DeepSeek-V4 with an FP8 engine: the actor's forward rounds what the engine rounds to FP8 (every
    # FP8 GEMM's input, the KV cache) and trains through those roundings straight-through
    # (models/deepseek_v4/fp8_emulation.py). They move the actor's logprobs by about as much as its
    # gap to the engine, but not towards the engine (docs/performance.md, actor.emulate_rollout_fp8).
    emulate_rollout_fp8: bool = False
    max_nonfinite_in_row: int = 3  # updates skipped for NaN/inf loss or gradients before the run stops
    # Only with algorithm.kl_coef > 0: keep the reference policy on the device for the whole run
    # instead of in host memory (pinned) between its forward passes; same numbers, no copies, and
    # its bytes stay on the device through the rollout too.
    ref_on_device: bool = False


@dataclass
class SyncConfig:
    """How the actor's weights reach the engines (weight_sync/)."""

    bucket_mb: int = 256  # bucket size (one IPC handle, or one broadcast, per bucket)
    verify_every: int = 0  # syncs; compare checksums of the family's verified tensors, actor vs engine
    # Unquantized GPU engines: replay the copies vLLM's load_weights made at the first sync instead
    # of calling it again (rollout/copy_plan.py); false: load_weights at every sync.
    direct: bool = True
    timeout_s: float = 600.0  # disaggregated mode: a weight broadcast waiting longer than this fails


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"  # grpo | dr_grpo (= grpo_no_std): names in colocate_rl.algorithms.ADVANTAGES
    adv_eps: float = 1e-6
    # ppo_clip | gspo | dr_grpo | cispo: names in colocate_rl.algorithms.POLICY_LOSSES
    policy_loss: str = "ppo_clip"
    eps_low: float = 0.2  # ppo_clip, dr_grpo: the token ratio's clip range
    eps_high: float = 0.28
    # gspo: the sequence ratio's clip range, the paper's (Zheng et al. 2025); a length-normalised
    # sequence ratio moves far less than a token's
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    # cispo: the IS weight is truncated at 1 + this (no lower bound, as in MiniMax-M1, which does
    # not publish its value); 4 caps it at 5, the bound of "The Art of Scaling Reinforcement
    # Learning Compute for LLMs", which found CISPO insensitive to it between 4 and 8
    cispo_eps_high: float = 4.0
    # dr_grpo: the loss is Σ tokens / (loss_norm_tokens × sequences); 0 = rollout.max_response_tokens
    loss_norm_tokens: int = 0
    is_clamp: float = 2.0  # token IS weight cap C for the train/rollout mismatch; 0 disables it
    # > 0: add kl_coef x KL(policy || reference) per response token to the loss; the reference is the
    # policy's weights at the first GRPO step (after any SFT warm-start), frozen (trainer/reference.py).
    kl_coef: float = 0.0
    kl_type: str = "k3"  # k1 | k3
    # token_mean | seq_mean_token_mean, for ppo_clip and cispo; gspo and dr_grpo use their papers'
    loss_agg: str = "token_mean"


@dataclass
class ArithmeticConfig:
    """The synthetic task of the tiny recipes: 'a+b=' with an exact reward."""

    num_train: int = 2000
    num_eval: int = 128  # capped at a quarter of all distinct problems (held out from training)
    max_operand: int = 9
    max_operand_b: int = -1  # range of the second operand; -1 = max_operand
    min_operand: int = 0  # both operands are at least this
    ops: str = "+"
    seed: int = 1234
    # With rollout.agent.enabled: the share of training problems whose warm-start demonstration
    # (sft.*) asks `calculator` and answers with its result; the others answer directly.
    tool_demos: float = 0.0


@dataclass
class DataConfig:
    train: str = ""  # hub id, local .parquet/.jsonl/.json, or "arithmetic"
    split: str = "train"
    # auto | verl (prompt as messages + reward_model.ground_truth) | slime (prompt + label) | math (problem + answer)
    format: str = "auto"
    prompt_key: str = ""  # "" = the format's default
    label_key: str = ""
    apply_chat_template: bool = True
    max_prompt_tokens: int = 512
    prompts_per_step: int = 32
    shuffle_seed: int = 0
    on_bad_row: str = "error"  # error | skip (skipped rows are counted and logged)
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)


@dataclass
class RewardConfig:
    name: str = "math"  # registered name (math | dapo | boxed | arithmetic) or "pkg.module:function"
    timeout_s: float = 5.0
    workers: int = 2


@dataclass
class PlacementConfig:
    mode: str = "colocated"  # colocated | disaggregated
    # Nodes of the Ray cluster the run takes (docs/multinode.md). Colocated: every node holds
    # gpus_per_node actor ranks and the engines of their GPUs. On CPU (gpus_per_node=0) a node
    # holds actor ranks / nodes ranks (actor.dp=0: one tp x pp group per node) and one engine.
    nnodes: int = 1
    # -1: every GPU this machine has (0 on a machine without); 0: the CPU, even where a GPU exists.
    gpus_per_node: int = -1
    # The accelerator the memory plan sizes against: auto (the one found; unchecked on CPU) or a
    # name from colocate_rl.memory.ACCELERATORS: plan a run for hardware this machine does not have
    # (dry_run=true).
    accelerator: str = "auto"
    actor_nodes: int = 0  # disaggregated only
    rollout_nodes: int = 0  # disaggregated only
    actor_gpus: int = 0  # disaggregated on one node: GPUs for the actor (rest go to rollout)
    launcher: str = "auto"  # colocated: auto | ray | local (world size 1 only); disaggregated runs on Ray
    ray_address: str = ""  # "" = start a local Ray instance
    # joining ray_address: the cluster's token file ("" = $COLOCATE_RL_RAY_TOKEN_FILE, else the file
    # scripts/start_ray.sh writes by default, where it exists; none: join without a token)
    ray_token_file: str = ""


@dataclass
class CheckpointConfig:
    dir: str = ""  # "" = <run_dir>/checkpoints
    every: int = 0  # steps; 0 = only at the end (at_end)
    keep: int = 2  # the last K checkpoints are kept
    at_end: bool = True  # also after the last step
    on_interrupt: bool = True  # Ctrl-C: finish the step, write a checkpoint, stop
    # auto: continue from the newest intact checkpoint of this run folder (set logging.run_name to
    # re-enter it) | never | a checkpoint folder, or a run / checkpoints folder (its newest)
    resume: str = "auto"


@dataclass
class EvalConfig:
    every: int = 0  # steps; 0 = never
    sets: list[str] = field(default_factory=list)  # same forms as data.train
    split: str = "train"  # of hub-id sets (AIME-2024 on the hub has only "train"); arithmetic: held-out
    n_samples: int = 1
    temperature: float = 0.0
    max_response_tokens: int = 0  # 0 = rollout.max_response_tokens
    at_start: bool = True


@dataclass
class LoggingConfig:
    run_dir: str = "runs"
    run_name: str = ""  # "" = <recipe>-<timestamp>
    wandb_project: str = "colocate_rl"
    wandb_mode: str = "auto"  # auto (online with WANDB_API_KEY, else offline) | online | offline | disabled
    plot: bool = True
    progress: bool = True
    # false: vLLM, megatron-core, Ray, torch and wandb log to <run folder>/run.log, and the console
    # shows their errors only (colocate_rl/console.py); true: each prints as it would on its own
    verbose: bool = False


@dataclass
class SFTConfig:
    """A short supervised warm-start on the training labels (tiny recipes: so rewards are not all 0)."""

    steps: int = 0  # the most it runs
    lr: float = 1e-3
    batch_size: int = 32
    # > 0: stop early once greedy accuracy on the last few batches (each before its update) reaches
    # it. From scratch accuracy jumps from ~0 to most problems at a step that moves with the seed.
    stop_at_accuracy: float = 0.0


@dataclass
class ToolsConfig:
    """The tools a policy may call in a multi-turn rollout (colocate_rl/tools/): the sandbox's limits
    and the executor's concurrency."""

    names: list[str] = field(default_factory=lambda: ["python", "calculator"])  # offered to the model (TOOLS)
    max_concurrency: int = 8  # sandboxes running at once (and executor threads)
    timeout_s: float = 10.0  # wall clock per call; then the sandbox is killed
    cpu_s: int = 10  # CPU seconds per program (RLIMIT_CPU)
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    max_processes: int = 32  # processes of the sandbox's user (RLIMIT_NPROC)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_file_mb: int = 16  # largest file a program may write (RLIMIT_FSIZE)
    scratch_mb: int = 64  # the scratch folder's size (namespaces: a tmpfs)
    scratch_files: int = 4096  # files and folders in it (namespaces)
    output_bytes: int = 8192  # stdout + stderr read; a program printing more is stopped there
    max_code_bytes: int = 256 * 1024  # longest program accepted
    # "namespaces": own mount, network, pid, ipc and uts namespaces (with a user namespace when not
    # root); "audit": an audit hook only (weaker, see tools/sandbox.py); "auto": namespaces where the
    # machine allows them, else audit.
    isolation: str = "auto"
    # As root: the first of max_concurrency uids the programs run as (one per running sandbox, so
    # RLIMIT_NPROC counts one sandbox's processes); no account may use them.
    sandbox_uid: int = 61000
    scratch_root: str = ""  # audit isolation: where scratch folders go ("" = the temp folder)

    def __post_init__(self):
        """Built directly (not through ``load``): the same checks as the config's, one line each."""
        for f in fields(self):
            rule = RANGES.get(f"tools.{f.name}")
            if rule is not None and not rule.holds(getattr(self, f.name)):
                raise ConfigError(f"tools.{f.name}={getattr(self, f.name)} must be {rule}")
        if self.isolation not in CHOICES["tools.isolation"]:
            raise ConfigError(f"tools.isolation={self.isolation!r} must be one of "
                              f"{', '.join(CHOICES['tools.isolation'])}")


@dataclass
class SuperviseConfig:
    """Restart a run that died (a killed process, an unrecoverable engine or rank error) from its
    newest intact checkpoint; a NaN stop, a config error or Ctrl-C is not restarted."""

    max_restarts: int = 0  # 0 = not supervised


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    supervise: SuperviseConfig = field(default_factory=SuperviseConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    steps: int = 100
    # > 0: this command runs at most this many steps, writes a checkpoint and exits; the same command
    # again (with logging.run_name) continues from it, so a long run goes in pieces of a few minutes.
    stop_after: int = 0
    seed: int = 0
    recipe: str = ""
    preset: str = ""
    dry_run: bool = False  # print the resolved config and the memory plan, then exit before loading anything


# ---------------------------------------------------------------- loading


def _did_you_mean(node: DictConfig, key: str) -> str:
    parent, _, leaf = key.rpartition(".")
    try:
        sub = OmegaConf.select(node, parent) if parent else node
        choices = list(sub.keys()) if isinstance(sub, DictConfig) else []
    except OmegaConfBaseException:
        choices = []
    close = difflib.get_close_matches(leaf, [str(c) for c in choices], n=1)
    return f" (did you mean '{(parent + '.') if parent else ''}{close[0]}'?)" if close else ""


def _merge(base: DictConfig, other: Any, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except ConfigKeyError as e:
        key = e.full_key or str(e.key)
        raise ConfigError(f"{source}: unknown config key '{key}'{_did_you_mean(base, key)}") from None
    except ValidationError as e:
        where = source if source == f"override {e.full_key}" else f"{source}: {e.full_key}"
        raise ConfigError(f"{where}: {e.msg.splitlines()[0]}") from None


def load(base: Config | None = None, files: list[str] = (), overrides: list[str] = ()) -> Config:
    """base ← YAML files ← ``key=value`` overrides, type-checked and validated."""
    node = OmegaConf.structured(base if base is not None else Config())
    for f in files:
        if not Path(f).is_file():
            raise ConfigError(f"config file not found: {f}")
        node = _merge(node, OmegaConf.load(f), f)
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override '{ov}' is not of the form key=value")
        key = ov.split("=", 1)[0]
        node = _merge(node, OmegaConf.from_dotlist([ov]), f"override {key}")
    missing = sorted(OmegaConf.missing_keys(node))
    if missing:
        raise ConfigError(f"config field '{missing[0]}' must be set")
    cfg: Config = OmegaConf.to_object(node)  # type: ignore[assignment]
    if cfg.placement.gpus_per_node == -1:  # printed and saved as the count it stands for
        from colocate_rl import platform  # torch: only for this question

        cfg.placement.gpus_per_node = platform.machine_gpus()
    validate(cfg)
    return cfg


def import_function(spec: str, what: str) -> Callable:
    """A config value naming code, ``"pkg.module:function"`` → the function. ``what`` names the
    field and value in the one-line ValueError raised otherwise."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{what} must be 'pkg.module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ValueError(f"{what}: cannot import '{module}' ({e})") from None
    except AttributeError:
        raise ValueError(f"{what}: module '{module}' has no '{attr}'") from None
    if not callable(fn):
        raise ValueError(f"{what}: '{attr}' is not a function")
    return fn


def split_cli(argv: list[str]) -> tuple[list[str], list[str]]:
    """Command-line words → (YAML files, key=value overrides)."""
    files = [a for a in argv if a.endswith((".yaml", ".yml")) and "=" not in a]
    overrides = [a for a in argv if a not in files]
    return files, overrides


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_dict(d: dict) -> Config:
    """A Config from ``to_dict``'s output (e.g. a checkpoint's), without re-validating it."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config()), d))  # type: ignore[return-value]


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def print_config(cfg: Config) -> None:
    print("resolved config:\n" + "\n".join("  " + line for line in to_yaml(cfg).splitlines()), flush=True)


# ---------------------------------------------------------------- validation

# Choice lists of plain settings. Names resolved through a registry (algorithm.advantage,
# algorithm.policy_loss, reward.name, rollout.backend, placement.mode and placement.launcher, the
# model family) are checked against the registry itself, in colocate_rl.plan, before anything loads.
CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.head_dtype": ("model", "float32"),
    "actor.lr_decay_style": ("constant", "linear", "cosine"),
    "actor.offload": ("auto", "all", "none"),
    "actor.logprob_kernel": ("auto", "fused", "chunked"),
    "actor.norm_kernel": ("eager", "fused"),
    "actor.expert_kernel": ("auto", "sequential", "grouped"),
    "actor.optimizer_state_dtype": ("float32", "bfloat16"),
    "algorithm.kl_type": ("k1", "k3"),
    "algorithm.loss_agg": ("token_mean", "seq_mean_token_mean"),
    "data.format": ("auto", "verl", "slime", "math"),
    "data.on_bad_row": ("error", "skip"),
    "logging.wandb_mode": ("auto", "online", "offline", "disabled"),
    "rollout.sleep_level": (1, 2),
    "rollout.weight_quantization": ("", "fp8"),
    "tools.isolation": ("auto", "namespaces", "audit"),
}

def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """The values a numeric field may take: lo to hi, each end included unless open. A float must
    also be finite: NaN passes no comparison and so slips past a ``<`` check, and inf overflows timers."""

    lo: float = -math.inf
    hi: float = math.inf
    open_lo: bool = False
    open_hi: bool = False
    note: str = ""  # what a value at the edge means, said in the error

    def holds(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        return (self.lo < v if self.open_lo else self.lo <= v) and (v < self.hi if self.open_hi else v <= self.hi)

    def __str__(self) -> str:
        if self.hi == math.inf:
            text = f"{'>' if self.open_lo else '>='} {_num(self.lo)}"
        else:
            text = f"in {'(' if self.open_lo else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.open_hi else ']'}"
        return text + (f" ({self.note})" if self.note else "")


# Processes one field can start on a machine (reward workers, CPU actor ranks, CPU engines): far
# above any real run, low enough that a typo (reward.workers=100000) stops here, not in a fork storm.
MAX_PROCESSES = 256
# A day: longer than any wait the run makes; inf or 1e300 would overflow the timers that use it.
MAX_TIMEOUT_S = 86400.0

COUNT, AT_LEAST_0, ABOVE_0 = Range(1), Range(0), Range(0, open_lo=True)
FRACTION = Range(0, 1, open_lo=True)  # (0, 1]
BETA = Range(0, 1, open_hi=True)  # [0, 1)
SEED = Range(0, 2**32 - 1)  # every RNG the run seeds takes 32 bits
TIMEOUT = Range(0, MAX_TIMEOUT_S, open_lo=True)

# Every int and float field of the tree and the values it may take (bool fields and those in
# CHOICES aside; tests/unit/test_config.py checks that none is missing). Relations between fields
# of one section are checked in ``validate``, between sections by the plan.
RANGES: dict[str, Range] = {
    "rollout.n": COUNT,
    "rollout.temperature": Range(0, note="0 samples greedily"),
    "rollout.top_p": FRACTION,
    "rollout.top_k": Range(-1, note="0 or -1: every token"),
    "rollout.max_response_tokens": COUNT,
    "rollout.seed": SEED,
    "rollout.tensor_parallel_size": COUNT,
    "rollout.gpu_memory_utilization": FRACTION,
    "rollout.kv_cache_memory_mb": Range(0, note="0: from rollout.gpu_memory_utilization"),
    "rollout.max_model_len": Range(0, note="0: data.max_prompt_tokens + rollout.max_response_tokens"),
    "rollout.num_engines": Range(0, MAX_PROCESSES, note="0: as many as fit"),
    "rollout.max_engine_restarts": AT_LEAST_0,
    "rollout.dynamic_max_rounds": AT_LEAST_0,
    "rollout.max_staleness": COUNT,
    "rollout.partial.over_sample": Range(0, note="0: nothing stops early"),
    "rollout.agent.max_turns": COUNT,
    "rollout.agent.max_result_tokens": COUNT,
    "actor.tp": COUNT,
    "actor.pp": COUNT,
    "actor.ep": COUNT,
    "actor.dp": Range(0, note="0: derived from the GPU count"),
    "actor.lr": AT_LEAST_0,
    "actor.min_lr": AT_LEAST_0,
    "actor.lr_warmup_steps": AT_LEAST_0,
    "actor.weight_decay": AT_LEAST_0,
    "actor.adam_beta1": BETA,
    "actor.adam_beta2": BETA,
    "actor.adam_eps": ABOVE_0,
    "actor.grad_clip": Range(0, note="0: no clipping"),
    "actor.micro_batch_size": COUNT,
    "actor.micro_batch_tokens": Range(0, note="0: actor.micro_batch_size rows per micro-batch"),
    "actor.num_minibatches": COUNT,
    "actor.optimizer_chunk_mb": COUNT,
    "actor.max_nonfinite_in_row": COUNT,
    "sync.bucket_mb": COUNT,
    "sync.verify_every": Range(0, note="0: never"),
    "sync.timeout_s": TIMEOUT,
    "algorithm.adv_eps": ABOVE_0,
    "algorithm.eps_low": Range(0, 1),
    "algorithm.eps_high": AT_LEAST_0,
    "algorithm.gspo_eps_low": Range(0, 1),
    "algorithm.gspo_eps_high": AT_LEAST_0,
    "algorithm.cispo_eps_high": AT_LEAST_0,
    "algorithm.loss_norm_tokens": Range(0, note="0: rollout.max_response_tokens"),
    "algorithm.is_clamp": Range(0, note="0 disables it"),
    "algorithm.kl_coef": Range(0, note="0 disables the KL penalty"),
    "data.max_prompt_tokens": COUNT,
    "data.prompts_per_step": COUNT,
    "data.shuffle_seed": SEED,
    "data.arithmetic.num_train": COUNT,
    "data.arithmetic.num_eval": AT_LEAST_0,
    "data.arithmetic.max_operand": AT_LEAST_0,
    "data.arithmetic.max_operand_b": Range(-1, note="-1: data.arithmetic.max_operand"),
    "data.arithmetic.seed": SEED,
    "data.arithmetic.min_operand": AT_LEAST_0,
    "data.arithmetic.tool_demos": Range(0, 1),
    "reward.timeout_s": TIMEOUT,
    "reward.workers": Range(1, MAX_PROCESSES),
    "placement.nnodes": COUNT,
    "placement.gpus_per_node": Range(-1, note="-1: this machine's GPUs, 0: the CPU"),
    "placement.actor_nodes": AT_LEAST_0,
    "placement.rollout_nodes": AT_LEAST_0,
    "placement.actor_gpus": AT_LEAST_0,
    "checkpoint.every": Range(0, note="0: only at the end"),
    "checkpoint.keep": Range(0, note="0 keeps every one"),
    "eval.every": Range(0, note="0: never"),
    "eval.n_samples": COUNT,
    "eval.temperature": Range(0, note="0 samples greedily"),
    "eval.max_response_tokens": Range(0, note="0: rollout.max_response_tokens"),
    "sft.steps": AT_LEAST_0,
    "sft.lr": AT_LEAST_0,
    "sft.batch_size": COUNT,
    "sft.stop_at_accuracy": Range(0, 1, note="0: run sft.steps"),
    "supervise.max_restarts": Range(0, note="0: not supervised"),
    "tools.max_concurrency": Range(1, MAX_PROCESSES),
    "tools.timeout_s": TIMEOUT,
    "tools.cpu_s": COUNT,
    "tools.memory_mb": COUNT,
    "tools.max_processes": COUNT,
    "tools.max_open_files": COUNT,
    "tools.max_file_mb": COUNT,
    "tools.scratch_mb": COUNT,
    "tools.scratch_files": COUNT,
    "tools.output_bytes": COUNT,
    "tools.max_code_bytes": COUNT,
    "tools.sandbox_uid": COUNT,
    "steps": COUNT,
    "stop_after": Range(0, note="0: run to the last step"),
    "seed": SEED,
}


def check_ranges(cfg: Config) -> None:
    """ConfigError naming the first field outside its RANGES entry."""
    for key, allowed in RANGES.items():
        value = _get(cfg, key)
        if not allowed.holds(value):
            finite = "" if math.isfinite(value) else "a finite number "
            raise ConfigError(f"{key}={value} must be {finite}{allowed}")


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj



def validate(cfg: Config) -> None:
    """Raises ConfigError naming the first bad field: choices, ranges and the rules within one
    section. Rules across sections, and the layout, are the plan's (colocate_rl.plan)."""
    for key, allowed in CHOICES.items():
        if _get(cfg, key) not in allowed:
            raise ConfigError(f"{key}={_get(cfg, key)!r} is not one of {', '.join(map(str, allowed))}")
    check_ranges(cfg)
    ar = cfg.data.arithmetic
    if not ar.ops or set(ar.ops) - set("+-*"):
        raise ConfigError(f"data.arithmetic.ops={ar.ops!r} must use only + - *")
    max_b = ar.max_operand if ar.max_operand_b < 0 else ar.max_operand_b
    if ar.min_operand > min(ar.max_operand, max_b):
        raise ConfigError(f"data.arithmetic.min_operand={ar.min_operand} must be <= data.arithmetic.max_operand "
                          f"and max_operand_b ({ar.max_operand}, {max_b})")
    a = cfg.actor
    if a.min_lr > a.lr:
        raise ConfigError(f"actor.min_lr={a.min_lr} must be <= actor.lr={a.lr} (the schedule "
                          "decays from actor.lr to actor.min_lr)")
    if a.sequence_parallel and a.tp == 1:
        raise ConfigError("actor.sequence_parallel=true needs actor.tp > 1 (it splits the sequence over the "
                          "tensor-parallel ranks)")
    if a.emulate_rollout_fp8 and a.expert_kernel == "grouped":
        raise ConfigError("actor.emulate_rollout_fp8=true rounds each expert's GEMM inputs through its own linear "
                          "layer: unset actor.expert_kernel=grouped")
    if a.optimizer_state_dtype != "float32" and not a.optimizer_cpu_offload:
        raise ConfigError("actor.optimizer_state_dtype=bfloat16 needs actor.optimizer_cpu_offload=true "
                          "(megatron-core keeps bf16 moments only in TransformerEngine's FusedAdam)")
