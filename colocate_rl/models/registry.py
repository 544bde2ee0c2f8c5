"""Model families: HF ``model_type`` → how to build the Megatron model and map its weights.

A family is a small record of functions; adding one (say ``models/deepseek_v4/``) means writing
those functions and calling ``register`` in that module, then listing the module in ``_BUILTIN``.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from colocate_rl.config import ConfigError
from colocate_rl.errors import error_line

if TYPE_CHECKING:
    from colocate_rl.models.mapping import ParamSpec

# Modules that register families when imported.
_BUILTIN = ("colocate_rl.models.qwen3", "colocate_rl.models.deepseek_v4")


def common_config_fields(params_dtype) -> dict:
    """TransformerConfig fields every family sets alike: the dtype fields, and no fused kernels
    from apex or TransformerEngine (absent on CPU and on plain CUDA installs)."""
    import torch

    return dict(
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
    )


@dataclass(frozen=True)
class MoeRouting:
    """Where a model routes tokens to experts: what routing replay (R3) records and replays."""

    layers: tuple[int, ...]  # decoder layers with routed experts, in order: the L_moe columns of routed_experts
    experts: int  # routed experts per layer (ids are 0 .. experts - 1, over all expert-parallel ranks)
    topk: int  # experts per token

    @property
    def dtype(self):
        """dtype of RolloutBatch.routed_experts for this model (types.routing_dtype)."""
        from colocate_rl.types import routing_dtype

        return routing_dtype(self.experts)


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # HF config.json "model_type" values this family serves
    # (hf_config, params_dtype, parallel sizes dict) -> megatron TransformerConfig
    transformer_config: Callable
    # (TransformerConfig, use_te) -> layer spec for GPTModel (a ModuleSpec or block spec)
    layer_spec: Callable
    # hf_config -> GPTModel keyword arguments (vocab_size, rope, shared embeddings, ...)
    model_kwargs: Callable[[dict], dict]
    # hf_config -> every Megatron parameter of the full model and its HF counterpart(s), in export order
    params: Callable[[dict], "list[ParamSpec]"]
    # (hf_config, tp, pp, ep, sequence_parallel=False) -> raises ValueError naming the field when
    # the layout cannot work
    check_parallel: Callable[..., None]
    # (hf_config, TransformerConfig, pre_process, post_process) -> the model, for families whose
    # blocks do not fit GPTModel's TransformerBlock (DeepSeek-V4's hc_mult residual streams);
    # None builds a GPTModel from layer_spec and model_kwargs.
    build: Optional[Callable] = None
    # (TransformerConfig, hf_config) -> layer spec whose forward runs vLLM's batch-invariant kernels
    # op for op (rollout.exact, models/exact.py); None: the family has no exact mode.
    exact_layer_spec: Optional[Callable] = None
    # hf_config -> exported tensor names that engines keep unfused and unpacked (embeddings, norms,
    # the output layer, a router): the ones whose copy inside an engine can be checksummed after a
    # sync (weight_sync.verify). Empty would verify nothing, so every family must name some.
    verify_names: Callable[[dict], list[str]] = lambda hf: []
    # (model folder, dtype) -> the transformers model of this checkpoint: the reference in parity
    # checks and the sampler of rollout.backend=transformers. None: AutoModelForCausalLM.
    hf_model: Optional[Callable] = None
    # (that model's named parameters and buffers, exported name) -> the tensor (or view) holding it,
    # for families whose transformers layout differs from the exported one. None: the same name.
    hf_tensor: Optional[Callable] = None
    # hf_config -> MoeRouting of its routed experts (routing replay), None for a model without experts
    moe_routing: Callable[[dict], Optional[MoeRouting]] = lambda hf: None
    # The memory plan's activation estimate (memory.plan_memory) times this: a family whose layers
    # hold more than a standard transformer's (calibrated from a measured run).
    activation_factor: float = 1.0
    # (hf_config, RolloutConfig) -> raises ValueError naming the field when the rollout engine cannot
    # serve the model with those settings (checked before anything starts)
    check_rollout: Callable[[dict, Any], None] = lambda hf, rollout: None
    # (this stage's model, hf_config) -> makes its forward round as the family's FP8 rollout engine
    # does (actor.emulate_rollout_fp8); returns a function that undoes it. None: not offered.
    fp8_emulation: Optional[Callable[[Any, dict], Callable[[], None]]] = None
    # Whether actor.fp32_residual can keep this family's residual stream in fp32 (Megatron's
    # fp32_residual_connection), and so whether it is on when unset (plan.kernels).
    fp32_residual: bool = True
    # Whether the layer spec's MoE experts are models/grouped_experts.py's (actor.expert_kernel).
    grouped_experts: bool = False
    # vLLM's parser of the tool calls this family writes (its --tool-call-parser name, read through
    # vllm.tool_parsers.ToolParserManager by tools/parsing.py); "" for a family without one.
    tool_call_parser: str = ""
    # How a conversation with tools is written (tools/chat.py): "" the tokenizer's chat template,
    # "deepseek_v4" vLLM's DeepSeek-V4 encoder (the family ships no Jinja template).
    chat_encoding: str = ""


def load_hf_model(path: str, dtype) -> Any:
    """transformers' model of the checkpoint at ``path`` (Family.hf_model)."""
    fam = family_for(read_hf_config(path))
    if fam.hf_model is not None:
        return fam.hf_model(path, dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of the full model, from its config alone (``model_size``): what the memory
    plan is built from before anything loads."""

    total: int
    experts: int  # routed-expert parameters (split by expert parallelism)
    hidden: int
    layers: int
    vocab: int
    largest: int  # elements of the largest single tensor (gathered whole for a sync)
    moe_intermediate: int = 0
    topk: int = 0
    activation_factor: float = 1.0  # the family's (Family.activation_factor)
    fp32_residual: bool = True  # the family's (Family.fp32_residual)
    # A standard GPT layer's widths (query heads x head_dim, key/value groups x head_dim, the dense
    # MLP's): its activations are counted from them (memory.activation_bytes); 0 for a family with
    # its own builder, whose layers the memory plan does not model op by op.
    q_width: int = 0
    kv_width: int = 0
    ffn: int = 0
    # Routed-expert elements of the layer with the most (all its experts), and whether the family's
    # experts can run grouped (Family.grouped_experts): the grouped GEMMs stack one layer's at a time.
    expert_layer: int = 0
    grouped_experts: bool = False


def model_size(hf: dict) -> ModelSize:
    """Counts every exported parameter of the family's full model (no weights read)."""
    import math

    family = family_for(hf)
    specs = family.params(hf)
    sizes = [(math.prod(s.shape), s.expert is not None) for s in specs if s.export]
    per_layer: dict = {}
    for s in specs:
        if s.export and s.expert is not None:
            per_layer[s.layer] = per_layer.get(s.layer, 0) + math.prod(s.shape)
    return ModelSize(
        total=sum(n for n, _ in sizes), experts=sum(n for n, e in sizes if e), hidden=int(hf["hidden_size"]),
        layers=int(hf["num_hidden_layers"]), vocab=int(hf["vocab_size"]), largest=max(n for n, _ in sizes),
        moe_intermediate=int(hf.get("moe_intermediate_size") or 0),
        topk=int(hf.get("num_experts_per_tok") or 0), activation_factor=family.activation_factor,
        fp32_residual=family.fp32_residual, expert_layer=max(per_layer.values(), default=0),
        grouped_experts=family.grouped_experts,
        **(_gpt_widths(hf) if family.build is None else {}))


def _gpt_widths(hf: dict) -> dict:
    hd = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    return dict(q_width=hd * int(hf["num_attention_heads"]),
                kv_width=hd * int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
                ffn=int(hf.get("intermediate_size") or 0))


def moe_routing(hf: dict) -> Optional[MoeRouting]:
    """The model's MoeRouting (None without routed experts)."""
    return family_for(hf).moe_routing(hf)


def tool_call_parser(hf: dict) -> str:
    """vLLM's tool-call parser for the model's family (Family.tool_call_parser); a ConfigError
    naming the family when it has none."""
    family = family_for(hf)
    if not family.tool_call_parser:
        raise ConfigError(f"model family {family.name} names no tool-call parser (Family.tool_call_parser)")
    return family.tool_call_parser


def chat_encoding(hf: dict) -> str:
    """How the model's family writes a conversation with tools (Family.chat_encoding)."""
    return family_for(hf).chat_encoding


def exact_samples_on_v2(hf_config: dict, routing_replay: bool) -> bool:
    """Whether exact mode's engine runs vLLM's V2 model runner, which takes its logprobs with kernels
    of its own; the engine sets it (rollout/engine.py) and the actor takes its logprobs the same way
    (models/exact.token_logprobs). V2 for dense models, as vLLM 0.26 picks by default: exact mode
    costs less over the default there than on V1 (docs/lab/performance_log.md, *Exact mode's cost
    through the loop*). V1 for MoE models
    (vLLM's default for Qwen3-MoE) and wherever R3 captures the routed experts, which V2 cannot."""
    return moe_routing(hf_config) is None and not routing_replay


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for mt in family.model_types:
        _FAMILIES[mt] = family
    return family


def _load_builtin() -> None:
    for mod in _BUILTIN:
        importlib.import_module(mod)


def families() -> dict[str, Family]:
    _load_builtin()
    return dict(_FAMILIES)


# What a training run reads of a hub model: config, tokenizer, chat template, weights (not .bin/.pt
# copies of the same weights, nor original/ folders of other formats).
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]


def model_folder(path: str | Path, weights: bool = True) -> str:
    """The model folder on this machine for ``model.path``: the folder itself, or a hub id's snapshot
    in the Hugging Face cache, downloaded there on first use (with HF_HUB_OFFLINE=1 only the cache is
    read); without its weights when ``weights`` is False (a driver that reads config and tokenizer
    only). Each process resolves it where it runs, so a node whose cache lacks the model fetches it."""
    if Path(path).is_dir():
        return str(path)
    from huggingface_hub import snapshot_download

    files = MODEL_FILES if weights else [f for f in MODEL_FILES if f != "*.safetensors"]
    try:
        return snapshot_download(str(path), allow_patterns=files)
    except Exception as e:  # noqa: BLE001 - any failure: not a folder, and not a model the hub gave us
        raise ConfigError(f"model.path={path} is not a folder, and the Hugging Face hub did not give it "
                          f"({error_line(e)})") from None


class HFConfig(dict):
    """A model's config.json as a dict that names its file: reading a field it lacks raises a
    ConfigError naming the file and the field, where a bare KeyError would name neither."""

    def __init__(self, fields: dict, source: str):
        super().__init__(fields)
        self.source = source

    def __missing__(self, key: str):
        raise ConfigError(f"{self.source} has no field '{key}', which the model's family reads")


def read_hf_config(folder: str | Path) -> HFConfig:
    """``folder``/config.json, or a ConfigError naming the file: missing, not JSON (and where), or
    not a JSON object."""
    p = Path(folder) / "config.json"
    if not p.is_file():
        raise ConfigError(f"model.path={folder} has no config.json")
    try:
        fields = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p} cannot be read ({error_line(e)})") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"{p} holds a JSON {type(fields).__name__}, not an object of fields")
    return HFConfig(fields, str(p))


# Files holding a tokenizer's vocabulary. From a folder with none of them transformers builds an
# empty tokenizer (every text 0 tokens) instead of failing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "*.tiktoken")


def load_tokenizer(path: str | Path, field: str, trust_remote_code: bool = False) -> Any:
    """The HF tokenizer of a folder or hub id, which config field ``field`` names; a ConfigError
    naming the field and the folder when there is none."""
    folder = Path(path)
    if folder.is_dir() and not any(any(folder.glob(f)) for f in TOKENIZER_FILES):
        raise ConfigError(f"{field}={path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): set "
                          "model.tokenizer to a folder or hub id that has them")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; each means no tokenizer there
        raise ConfigError(f"{field}={path}: no tokenizer loads from it ({error_line(e)})") from None


def family_for(hf_config: dict) -> Family:
    """The family serving this HF config; a one-line ConfigError naming the file, its model_type and
    the registry's model_types otherwise."""
    _load_builtin()
    mt = hf_config.get("model_type", "")
    if mt not in _FAMILIES:
        arch = ",".join(hf_config.get("architectures") or []) or "?"
        source = getattr(hf_config, "source", "")
        raise ConfigError(
            f"{source + ': ' if source else ''}unsupported model architecture {arch} (model_type={mt!r}); "
            f"supported model_types: {', '.join(sorted(_FAMILIES))}"
        )
    return _FAMILIES[mt]
