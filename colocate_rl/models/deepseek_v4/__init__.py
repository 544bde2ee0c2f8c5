"""DeepSeek-V4 (Flash / Pro layout) as a model family: mHC residual streams, compressed sparse
attention (window, C4 + indexer, C128), hash-routed and noaux_tc MoE. See model.py for the
blocks, weights.py for the names, config.py for the hyper-parameters."""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.nn.functional as F

from colocate_rl.models.deepseek_v4.config import Hparams
from colocate_rl.models.deepseek_v4.weights import params
from colocate_rl.models.registry import Family, MoeRouting, common_config_fields, register


def first_stage_layers(num_layers: int, pp: int) -> Optional[int]:
    """Decoder layers on the first pipeline stage when ``pp`` does not divide ``num_layers`` (the
    rest split evenly over the other stages, Megatron's num_layers_in_first_pipeline_stage); None
    for an even split. The first stage, which also holds the embedding, gets the fewer: 43 layers
    over 4 stages are 10 + 11 + 11 + 11. Raises when no such split exists."""
    if pp == 1 or num_layers % pp == 0:
        return None
    for per_stage in (-(-num_layers // pp), num_layers // pp):  # ceil, then floor
        first = num_layers - (pp - 1) * per_stage
        if first >= 1 and per_stage >= 1:
            return first
    raise ValueError(f"actor.pp={pp} cannot split the model's num_hidden_layers={num_layers} into stages of "
                     "at least one layer")


def check_parallel(hf: dict, tp: int, pp: int, ep: int, sequence_parallel: bool = False) -> None:
    h = Hparams.from_official(hf)
    if tp > 1 and not sequence_parallel:
        raise ValueError(f"actor.sequence_parallel=false: deepseek_v4 at actor.tp={tp} needs "
                         "actor.sequence_parallel=true (Megatron's MoE layer trains with tensor parallelism only "
                         "under sequence parallelism)")
    shared = h.moe_intermediate_size * h.num_shared_experts
    for field, value in (("num_attention_heads", h.num_heads), ("o_groups", h.o_groups), ("vocab_size", h.vocab_size),
                         ("moe_intermediate_size x n_shared_experts (the shared expert)", shared)):
        if value % tp:
            raise ValueError(f"actor.tp={tp} does not divide the model's {field}={value}")
    first_stage_layers(h.num_layers, pp)
    if h.num_experts % ep:
        raise ValueError(f"actor.ep={ep} does not divide the model's n_routed_experts={h.num_experts}")


def check_rollout(hf: dict, rollout) -> None:
    """vLLM 0.26 builds DeepSeek-V4's attention on its fp8_ds_mla cache layout only; any other KV
    cache dtype fails an assertion deep in its model constructor."""
    kv = str(rollout.engine_kwargs.get("kv_cache_dtype", "auto"))
    if rollout.backend == "vllm" and not kv.startswith("fp8"):
        raise ValueError(f"rollout.engine_kwargs.kv_cache_dtype={kv}: vLLM keeps DeepSeek-V4's KV cache in FP8 only "
                         "(its fp8_ds_mla layout); set it to fp8")


def transformer_config(hf: dict, params_dtype: torch.dtype, **runtime):
    """Megatron TransformerConfig: drives the MoE layer, the parallel linears and the schedule
    (the attention fields are the model's own, read from Hparams)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    h = Hparams.from_official(hf)
    first = first_stage_layers(h.num_layers, runtime.get("pipeline_model_parallel_size", 1))
    if first is not None:
        runtime.setdefault("num_layers_in_first_pipeline_stage", first)
    if runtime.pop("fp32_residual_connection", False):
        raise ValueError("actor.fp32_residual is not supported for deepseek_v4 (its residual is the mHC streams)")
    if h.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ValueError(f"scoring_func={h.scoring_func!r} is not supported for deepseek_v4")
    return TransformerConfig(
        num_layers=h.num_layers,
        hidden_size=h.hidden_size,
        ffn_hidden_size=h.moe_intermediate_size,
        num_attention_heads=h.num_heads,
        kv_channels=h.head_dim,
        layernorm_epsilon=h.rms_norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        # SwiGLU clamp of the released model: gate ≤ limit, |up| ≤ limit (routed and shared experts),
        # applied by the experts' activation module (model.moe_layer: models/swiglu.SwiGLU), which
        # megatron-core calls only under use_te_activation_func.
        activation_func_clamp_value=h.swiglu_limit or None,
        use_te_activation_func=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **common_config_fields(params_dtype),
        num_moe_experts=h.num_experts,
        moe_router_topk=h.topk,
        moe_ffn_hidden_size=h.moe_intermediate_size,
        moe_shared_expert_intermediate_size=h.moe_intermediate_size * h.num_shared_experts,
        moe_router_score_function=h.scoring_func,
        moe_router_enable_expert_bias=True,  # noaux_tc: the bias picks experts, never weights them
        moe_router_topk_scaling_factor=h.routed_scaling_factor,
        moe_router_pre_softmax=True,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_token_dispatcher_type="alltoall",
        **runtime,
    )


def build(hf: dict, config, pre_process: bool = True, post_process: bool = True):
    from colocate_rl.models.deepseek_v4.model import DeepseekV4Model

    return DeepseekV4Model(config, Hparams.from_official(hf), pre_process, post_process)


def _no_layer_spec(config, use_te: bool):
    raise ValueError("deepseek_v4 is built by its own model builder (mHC streams), not from a GPT layer spec")


def verify_names(hf: dict) -> list[str]:
    """Official names kept whole in higher precision by the released layout (and by engines):
    embedding, head, final and first-layer norms, the first layer's mHC mixing and router."""
    return ["embed.weight", "head.weight", "norm.weight", "layers.0.attn_norm.weight", "layers.0.ffn_norm.weight",
            "layers.0.hc_attn_fn", "layers.0.ffn.gate.weight"]


def emulate_fp8(model, hf: dict):
    from colocate_rl.models.deepseek_v4.model import emulate_fp8_engine

    return emulate_fp8_engine(model, Hparams.from_official(hf).rope_dim)


def hf_model(path, dtype):
    from colocate_rl.models.deepseek_v4.synth import transformers_model

    return transformers_model(path, dtype)


def moe_routing(hf: dict) -> MoeRouting:
    """Every decoder layer routes to experts: the first num_hash_layers by the token → experts table
    (replay leaves them alone: the table gives the sampler's experts already), the rest by noaux_tc."""
    h = Hparams.from_official(hf)
    return MoeRouting(tuple(range(h.num_layers)), h.num_experts, h.topk)


_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


def hf_tensor(tensors: dict, name: str):
    """transformers stacks the routed experts ([E, 2I, H] gate_up, [E, H, I] down) and renames the rest."""
    from colocate_rl.models.deepseek_v4.weights import transformers_name

    m = _EXPERT.match(name)
    if m is None:
        return tensors[transformers_name(name)]
    layer, e, w = int(m.group(1)), int(m.group(2)), m.group(3)
    p = f"model.layers.{layer}.mlp.experts."
    if w == "w2":
        return tensors[p + "down_proj"][e]
    gate_up = tensors[p + "gate_up_proj"][e]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if w == "w1" else gate_up[half:]


FAMILY = register(Family(
    name="deepseek_v4", model_types=("deepseek_v4",), transformer_config=transformer_config,
    layer_spec=_no_layer_spec, model_kwargs=lambda hf: {}, params=params, check_parallel=check_parallel,
    check_rollout=check_rollout, build=build, verify_names=verify_names, hf_model=hf_model, hf_tensor=hf_tensor,
    moe_routing=moe_routing, fp8_emulation=emulate_fp8, grouped_experts=True,
    # Calibrated on the mini preset's measured step (docs/lab/performance_log.md, *DeepSeek-V4 mini
    # trained through vLLM*): the chunked window + compressed-entry attention keeps fp32 scores, the
    # mHC streams are 4 wide.
    activation_factor=4.1,
    fp32_residual=False,  # the residual is hc_mult mHC streams, not Megatron's one stream
    tool_call_parser="deepseek_v4",  # DSML <｜DSML｜tool_calls> blocks (vllm/parser/deepseek_v4.py)
    chat_encoding="deepseek_v4",  # vLLM's encoder (vllm/tokenizers/deepseek_v4_encoding.py)
))
