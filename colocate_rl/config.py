"""The config tree: one small dataclass per component, merged by OmegaConf, validated at load.

A recipe is a function returning a ``Config``; the command line adds YAML files and dotted
``key=value`` overrides on top (``load``). Every check here raises ``ConfigError`` whose one-line
message names the field, so a bad run stops before any engine starts.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
from dataclasses import dataclass, field
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
    # (the tiny CPU recipes; no hub needed). One of colocate_rl.models.tiny.SHAPES.
    synthesize: str = ""
    trust_remote_code: bool = False


@dataclass
class RolloutConfig:
    n: int = 8  # samples per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    max_response_tokens: int = 256
    seed: int = 0
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5  # share of the card vLLM may take while awake
    kv_cache_memory_mb: int = 0  # explicit KV cache size; 0 = from gpu_memory_utilization (CPU: 256)
    max_model_len: int = 0  # 0 = data.max_prompt_tokens + max_response_tokens
    enforce_eager: bool = False  # skip CUDA graph capture (faster start, slower decode)
    sleep_level: int = 2  # 2 discards weights (the next sync overwrites them); 1 copies them to host
    sync_bucket_mb: int = 256  # weight-sync bucket size (one IPC handle per bucket)
    verify_sync_every: int = 0  # steps; compare checksums of a few tensors, actor vs engine, after a sync
    num_engines: int = 1  # disaggregated mode: engines behind the router
    # Disaggregated mode: generate step k+1 while step k trains (one step stale; the token IS
    # correction, algorithm.is_clamp, weights the stale samples).
    off_policy: bool = False
    custom_fn: str = ""  # disaggregated mode: "pkg.module:function" producing a step's batch (rollout/buffer.py)
    sync_timeout_s: float = 600.0  # disaggregated mode: a weight broadcast waiting longer than this fails
    # Disaggregated mode: "fp8" = the rollout runs FP8 weights. A block-FP8 checkpoint (DeepSeek
    # format) gets per-block quantized weights on every sync; a bf16 one is quantized by vLLM
    # (quantization="fp8") and re-quantized by its post-load processing after every sync.
    weight_quantization: str = ""
    multiprocess: bool = False  # vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING)
    # Seed every request from (seed, step): a resumed run samples exactly what the uninterrupted one
    # did. vLLM then samples seeded rows one by one (slightly slower on large batches).
    seed_each_step: bool = True
    max_engine_restarts: int = 2  # per step: a dead engine is rebuilt, re-synced, its prompts re-issued
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to vllm.LLM as-is
    # vllm | transformers: sample with transformers' generate in the actor's process, for models
    # vLLM cannot run on this machine (the tiny DeepSeek-V4 on CPU; see rollout/hf_generate.py).
    backend: str = "vllm"


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
    # by kernel launches, and on an H200 64 trained a Qwen3-0.6B-shaped batch 38% faster than 16
    # (benchmarks/results/gpu_vs_trl_h200_micro64.json).
    micro_batch_size: int = 4
    num_minibatches: int = 1  # optimizer steps per RL step (PPO-style mini-batches)
    distributed_optimizer: bool = False
    offload: bool = True  # colocated: move params/optimizer to host, free grads, while vLLM runs
    recompute: bool = False  # activation recomputation (full layers)
    # Split the per-token work (norms, residual, MoE routing) over the tensor-parallel ranks by
    # sequence (Megatron's sequence parallelism; needs actor.tp > 1). Megatron's MoE layer trains with
    # tensor parallelism only under it, so DeepSeek-V4 at actor.tp > 1 requires it.
    sequence_parallel: bool = False
    # bf16: keep the residual stream (embeddings, residual adds, norm inputs) in fp32, as mixed
    # precision over fp32 weights does. On an H200 it cut the logprob gap to vLLM by 29% (0.0075 →
    # 0.0053) and cost 26% more training time (benchmarks/results/handoff_fp32res_h200.json).
    fp32_residual: bool = False
    max_nonfinite_in_row: int = 3  # updates skipped for NaN/inf loss or gradients before the run stops


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"  # grpo | grpo_no_std (names in colocate_rl.algorithms.ADVANTAGES)
    adv_eps: float = 1e-6
    eps_low: float = 0.2
    eps_high: float = 0.28
    is_clamp: float = 2.0  # token IS weight cap C for the train/rollout mismatch; 0 disables it
    kl_coef: float = 0.0
    kl_type: str = "k3"  # k1 | k3
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_mean


@dataclass
class ArithmeticConfig:
    """The synthetic task of the tiny recipes: 'a+b=' with an exact reward."""

    num_train: int = 2000
    num_eval: int = 128  # capped at a quarter of all distinct problems (held out from training)
    max_operand: int = 9
    max_operand_b: int = -1  # range of the second operand; -1 = max_operand
    ops: str = "+"
    seed: int = 1234


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
    nnodes: int = 1
    gpus_per_node: int = 1  # 0 = CPU
    actor_nodes: int = 0  # disaggregated only
    rollout_nodes: int = 0  # disaggregated only
    actor_gpus: int = 0  # disaggregated on one node: GPUs for the actor (rest go to rollout)
    launcher: str = "auto"  # colocated: auto | ray | local (world size 1 only); disaggregated runs on Ray
    ray_address: str = ""  # "" = start a local Ray instance


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


@dataclass
class SFTConfig:
    """A short supervised warm-start on the training labels (tiny recipes: so rewards are not all 0)."""

    steps: int = 0
    lr: float = 1e-3
    batch_size: int = 32


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    steps: int = 100
    seed: int = 0
    recipe: str = ""
    preset: str = ""


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
        raise ConfigError(f"{source}: {e.full_key}: {e.msg.splitlines()[0]}") from None


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

CHOICES = {
    "algorithm.advantage": ("grpo", "grpo_no_std"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "actor.lr_decay_style": ("constant", "linear", "cosine"),
    "algorithm.kl_type": ("k1", "k3"),
    "algorithm.loss_agg": ("token_mean", "seq_mean_token_mean"),
    "data.format": ("auto", "verl", "slime", "math"),
    "data.on_bad_row": ("error", "skip"),
    "placement.mode": ("colocated", "disaggregated"),
    "placement.launcher": ("auto", "ray", "local"),
    "logging.wandb_mode": ("auto", "online", "offline", "disabled"),
    "rollout.sleep_level": (1, 2),
    "rollout.weight_quantization": ("", "fp8"),
    "rollout.backend": ("vllm", "transformers"),
}

POSITIVE = (
    "rollout.n", "rollout.max_response_tokens", "rollout.tensor_parallel_size", "rollout.num_engines",
    "actor.tp", "actor.pp", "actor.ep", "actor.micro_batch_size", "actor.num_minibatches",
    "data.max_prompt_tokens", "data.prompts_per_step", "reward.workers", "placement.nnodes", "steps",
)


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def model_info(cfg: Config) -> dict:
    """The HF config.json of cfg.model.path when it is a local folder, else {} (hub ids resolve later)."""
    p = Path(cfg.model.path) / "config.json"
    if p.is_file():
        return json.loads(p.read_text())
    return {}


def validate(cfg: Config, info: Optional[dict] = None) -> None:
    """Raises ConfigError naming the first bad field. ``info`` is the model's HF config (if known)."""
    for key, allowed in CHOICES.items():
        if _get(cfg, key) not in allowed:
            raise ConfigError(f"{key}={_get(cfg, key)!r} is not one of {', '.join(map(str, allowed))}")
    for key in POSITIVE:
        if _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 1")
    if not 0 < cfg.rollout.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} must be in (0, 1]")
    if cfg.algorithm.eps_low < 0 or cfg.algorithm.eps_high < 0:
        raise ConfigError("algorithm.eps_low and algorithm.eps_high must be >= 0")
    if cfg.reward.timeout_s <= 0:
        raise ConfigError(f"reward.timeout_s={cfg.reward.timeout_s} must be > 0")
    ar = cfg.data.arithmetic
    if not ar.ops or set(ar.ops) - set("+-*") or ar.max_operand < 0:
        raise ConfigError(f"data.arithmetic: ops={ar.ops!r} must use only + - * and max_operand >= 0")
    if cfg.algorithm.is_clamp < 0:
        raise ConfigError(f"algorithm.is_clamp={cfg.algorithm.is_clamp} must be >= 0 (0 disables it)")

    pl = cfg.placement
    if pl.mode == "colocated" and (pl.actor_nodes or pl.rollout_nodes or pl.actor_gpus):
        raise ConfigError(
            "placement.mode=colocated shares every GPU between actor and rollout: "
            "unset placement.actor_nodes/rollout_nodes/actor_gpus or set placement.mode=disaggregated"
        )
    actor_gpus = actor_world_size(cfg)
    a = cfg.actor
    if pl.gpus_per_node > 0:
        if actor_gpus % (a.tp * a.pp):
            raise ConfigError(
                f"actor.tp={a.tp} x actor.pp={a.pp} does not divide the {actor_gpus} actor GPUs "
                f"(placement: {pl.mode}, {pl.nnodes} node(s) x {pl.gpus_per_node})"
            )
        dp = actor_gpus // (a.tp * a.pp)
        if a.dp and a.dp != dp:
            raise ConfigError(
                f"actor.tp={a.tp} x actor.pp={a.pp} x actor.dp={a.dp} = {a.tp * a.pp * a.dp} "
                f"does not match the {actor_gpus} actor GPUs"
            )
        if (a.tp * dp) % a.ep:
            raise ConfigError(f"actor.ep={a.ep} must divide actor.tp x dp = {a.tp * dp}")
        if pl.mode == "colocated" and cfg.rollout.tensor_parallel_size > actor_gpus:
            raise ConfigError(
                f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} exceeds the {actor_gpus} GPUs"
            )
    if pl.mode == "colocated" and (cfg.rollout.off_policy or cfg.rollout.custom_fn or cfg.rollout.weight_quantization):
        raise ConfigError("rollout.off_policy, rollout.custom_fn and rollout.weight_quantization need "
                          "placement.mode=disaggregated")
    if cfg.rollout.weight_quantization == "fp8" and pl.gpus_per_node == 0:
        raise ConfigError("rollout.weight_quantization=fp8 needs GPUs: vLLM's CPU backend runs no FP8 weights")
    if cfg.rollout.off_policy and cfg.algorithm.is_clamp <= 0:
        raise ConfigError("rollout.off_policy=true needs algorithm.is_clamp > 0: the token IS correction "
                          "weights the one-step-stale samples")
    if cfg.rollout.sync_timeout_s <= 0:
        raise ConfigError(f"rollout.sync_timeout_s={cfg.rollout.sync_timeout_s} must be > 0")
    if cfg.rollout.backend == "transformers" and (pl.mode != "colocated" or pl.launcher == "ray"
                                                  or actor_world_size(cfg) != 1):
        raise ConfigError("rollout.backend=transformers samples in the actor's own process: it needs "
                          "placement.mode=colocated with a world of one (placement.launcher local or auto)")
    if pl.mode == "disaggregated":
        if pl.nnodes > 1 and pl.actor_nodes + pl.rollout_nodes != pl.nnodes:
            raise ConfigError(
                f"placement.actor_nodes={pl.actor_nodes} + placement.rollout_nodes={pl.rollout_nodes} "
                f"must equal placement.nnodes={pl.nnodes}"
            )
        if pl.nnodes == 1 and pl.gpus_per_node > 0 and not 0 < pl.actor_gpus < pl.gpus_per_node:
            raise ConfigError(
                f"placement.actor_gpus={pl.actor_gpus} must leave GPUs for rollout on one node of "
                f"{pl.gpus_per_node} (0 < actor_gpus < gpus_per_node)"
            )

    ctx = cfg.rollout.max_model_len or (cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens)
    if cfg.rollout.max_model_len and cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens > ctx:
        raise ConfigError(
            f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} + rollout.max_response_tokens="
            f"{cfg.rollout.max_response_tokens} exceeds rollout.max_model_len={ctx}"
        )
    info = model_info(cfg) if info is None else info
    if info:
        max_pos = info.get("max_position_embeddings")
        if max_pos and ctx > max_pos:
            raise ConfigError(
                f"rollout.max_response_tokens={cfg.rollout.max_response_tokens} + data.max_prompt_tokens="
                f"{cfg.data.max_prompt_tokens} = {ctx} exceeds the model's context "
                f"(max_position_embeddings={max_pos})"
            )
        experts = info.get("num_experts") or info.get("num_local_experts") or info.get("n_routed_experts") or 0
        if experts and experts % a.ep:
            raise ConfigError(f"actor.ep={a.ep} does not divide the model's {experts} experts")
        if not experts and a.ep > 1:
            raise ConfigError(f"actor.ep={a.ep} > 1 but the model has no experts")
        heads = info.get("num_attention_heads")
        if heads and heads % a.tp:
            raise ConfigError(f"actor.tp={a.tp} does not divide the model's {heads} attention heads")


def actor_world_size(cfg: Config) -> int:
    """GPUs the actor runs on (1 on CPU)."""
    pl = cfg.placement
    if pl.gpus_per_node == 0:
        return max(1, cfg.actor.tp * cfg.actor.pp * max(cfg.actor.dp, 1))
    if pl.mode == "colocated":
        return pl.nnodes * pl.gpus_per_node
    if pl.nnodes > 1:
        return pl.actor_nodes * pl.gpus_per_node
    return pl.actor_gpus


def cache_dir() -> Path:
    """Run-local cache root (scripts/setup_env.sh exports COLOCATE_RL_CACHE)."""
    return Path(os.environ.get("COLOCATE_RL_CACHE", ".cache")).resolve()
