"""Qwen3 (dense) and Qwen3-MoE as Megatron GPT models, and their HF weight names.

Qwen3: RMSNorm pre-norm, GQA with per-head RMSNorm on q and k (qk-norm), RoPE (non-interleaved,
rotate-half), SwiGLU MLP, no biases, tied or untied embeddings. Qwen3-MoE: the same attention,
MLP replaced by a softmax top-k router (renormalised over the k when ``norm_topk_prob``) and
SwiGLU experts, no shared expert; ``mlp_only_layers`` / ``decoder_sparse_step`` pick dense layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from colocate_rl.models.mapping import ParamSpec
from colocate_rl.models.registry import Family, MoeRouting, common_config_fields, register


def _rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope_type={kind!r} is not supported for {hf.get('model_type')} (only 'default')")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _num_experts(hf: dict) -> int:
    # Official configs say num_experts; transformers 5 saves it as num_local_experts.
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def _moe_layers(hf: dict) -> list[bool]:
    """Which decoder layers are MoE (HF Qwen3MoeDecoderLayer's rule)."""
    n, step, dense = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    e = _num_experts(hf)
    return [e > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)]


def moe_routing(hf: dict) -> MoeRouting | None:
    layers = tuple(i for i, m in enumerate(_moe_layers(hf)) if m)
    return MoeRouting(layers, _num_experts(hf), int(hf["num_experts_per_tok"])) if layers else None


def _head_dim(hf: dict) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def check_parallel(hf: dict, tp: int, pp: int, ep: int, sequence_parallel: bool = False) -> None:
    heads, groups = hf["num_attention_heads"], hf["num_key_value_heads"]
    if heads % tp:
        raise ValueError(f"actor.tp={tp} does not divide the model's num_attention_heads={heads}")
    if groups % tp:
        raise ValueError(
            f"actor.tp={tp} does not divide the model's num_key_value_heads={groups} "
            "(Megatron shards whole key/value heads)"
        )
    if hf["vocab_size"] % tp:
        raise ValueError(f"actor.tp={tp} does not divide the model's vocab_size={hf['vocab_size']}")
    if hf["num_hidden_layers"] % pp:
        raise ValueError(f"actor.pp={pp} does not divide the model's num_hidden_layers={hf['num_hidden_layers']}")
    if any(not m for m in _moe_layers(hf)) and hf["intermediate_size"] % tp:
        raise ValueError(f"actor.tp={tp} does not divide the model's intermediate_size={hf['intermediate_size']}")
    experts = _num_experts(hf)
    if experts and experts % ep:
        raise ValueError(f"actor.ep={ep} does not divide the model's num_experts={experts}")
    if not experts and ep > 1:
        raise ValueError(f"actor.ep={ep} > 1 but the model ({hf.get('model_type')}) has no experts")


def _check_supported(hf: dict) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported for {hf['model_type']} (only silu)")
    if hf.get("attention_bias"):
        raise ValueError(f"attention_bias=True is not supported for {hf['model_type']}")
    if hf.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window=True is not supported for {hf['model_type']}")


def transformer_config(hf: dict, params_dtype: torch.dtype, **runtime):
    """HF config → megatron TransformerConfig; ``runtime`` adds parallel sizes, init and recompute flags."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    _check_supported(hf)
    _rope_theta(hf)
    moe = {}
    if _num_experts(hf):
        moe = dict(
            num_moe_experts=_num_experts(hf),
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_layer_freq=[int(m) for m in _moe_layers(hf)],
            # softmax over the top-k logits == softmax over all, top-k, renormalised (norm_topk_prob);
            # without renormalisation the softmax must come first.
            moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
            moe_router_score_function="softmax",
            # The router's auxiliary loss would add a term to the RL loss: off, as in inference.
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
        )
    return TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"],
        kv_channels=_head_dim(hf),
        normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"],
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        # The MLP's activation is the spec's module (layer_spec: SwiGLU, which keeps half the
        # bytes of megatron-core's inline one for the backward; TE's own under TE).
        use_te_activation_func=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=hf.get("attention_dropout", 0.0),
        attention_softmax_in_fp32=True,
        **common_config_fields(params_dtype),
        # Also set on dense models: Megatron rejects variable_seq_lengths (pipeline stages with
        # per-micro-batch lengths) under its default allgather dispatcher even without experts.
        moe_token_dispatcher_type="alltoall",
        **moe,
        **runtime,
    )


def layer_spec(config, use_te: bool):
    """Block spec of this pipeline stage's layers (local modules unless ``use_te``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from colocate_rl.models.attention import SDPACoreAttention
    from colocate_rl.models.grouped_experts import with_grouped_experts
    from colocate_rl.models.norm import RMSNorm
    from colocate_rl.models.swiglu import SwiGLU, with_activation

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
    if not use_te:
        spec.layer_norm = RMSNorm
        for layer in spec.layer_specs:
            sub = layer.submodules
            sub.input_layernorm = sub.pre_mlp_layernorm = RMSNorm
            attn = sub.self_attention.submodules
            attn.core_attention, attn.q_layernorm, attn.k_layernorm = SDPACoreAttention, RMSNorm, RMSNorm
            sub.mlp = with_grouped_experts(with_activation(sub.mlp, SwiGLU))
    return spec


def model_kwargs(hf: dict) -> dict:
    return dict(
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf["max_position_embeddings"],
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=_rope_theta(hf),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
    )


def params(hf: dict) -> list[ParamSpec]:
    """Every Megatron parameter of the full model with its HF source, in export order."""
    h, v = hf["hidden_size"], hf["vocab_size"]
    heads, groups, hd = hf["num_attention_heads"], hf["num_key_value_heads"], _head_dim(hf)
    tied = bool(hf.get("tie_word_embeddings", False))
    out = [ParamSpec("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), (v, h), tp_dim=0,
                     stage="first")]
    for i, is_moe in enumerate(_moe_layers(hf)):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        out += [
            ParamSpec(m + "input_layernorm.weight", (p + "input_layernorm.weight",), (h,), layer=i),
            ParamSpec(m + "self_attention.linear_qkv.weight",
                      tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"), ((heads + 2 * groups) * hd, h),
                      kind="qkv", tp_dim=0, layer=i, qkv=(heads, groups, hd)),
            ParamSpec(m + "self_attention.q_layernorm.weight", (p + "self_attn.q_norm.weight",), (hd,), layer=i),
            ParamSpec(m + "self_attention.k_layernorm.weight", (p + "self_attn.k_norm.weight",), (hd,), layer=i),
            ParamSpec(m + "self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",), (h, heads * hd),
                      tp_dim=1, layer=i),
            ParamSpec(m + "pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",), (h,), layer=i),
        ]
        if is_moe:
            e_count, inter = _num_experts(hf), hf["moe_intermediate_size"]
            out.append(ParamSpec(m + "mlp.router.weight", (p + "mlp.gate.weight",), (e_count, h), layer=i))
            for e in range(e_count):
                me, pe = m + f"mlp.experts.local_experts.{e}.", p + f"mlp.experts.{e}."
                out += [
                    ParamSpec(me + "linear_fc1.weight", (pe + "gate_proj.weight", pe + "up_proj.weight"),
                              (2 * inter, h), kind="gate_up", tp_dim=0, layer=i, expert=e),
                    ParamSpec(me + "linear_fc2.weight", (pe + "down_proj.weight",), (h, inter), tp_dim=1,
                              layer=i, expert=e),
                ]
        else:
            inter = hf["intermediate_size"]
            out += [
                ParamSpec(m + "mlp.linear_fc1.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                          (2 * inter, h), kind="gate_up", tp_dim=0, layer=i),
                ParamSpec(m + "mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), (h, inter), tp_dim=1, layer=i),
            ]
    out.append(ParamSpec("decoder.final_layernorm.weight", ("model.norm.weight",), (h,), stage="last"))
    # Tied: with pipeline parallelism the last stage keeps its own copy of the embedding as the
    # output layer (Megatron keeps the two in sync); it loads from, and is never exported as, the embedding.
    out.append(ParamSpec("output_layer.weight", ("model.embed_tokens.weight",) if tied else ("lm_head.weight",),
                         (v, h), tp_dim=0, stage="last", export=not tied))
    return out


def verify_names(hf: dict) -> list[str]:
    """vLLM keeps these unfused: embeddings and output layer (vocabulary-sharded under TP), the final
    and first layer's norms. (A MoE router is repacked by vLLM's CPU linears: its copy cannot be read.)"""
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
             "model.layers.0.post_attention_layernorm.weight"]
    if not hf.get("tie_word_embeddings", False):
        names.append("lm_head.weight")
    return names


def _exact_layer_spec(config, hf: dict):
    from colocate_rl.models.exact import layer_spec

    return layer_spec(config, _rope_theta(hf), hf["max_position_embeddings"])


for _name in ("qwen3", "qwen3_moe"):
    register(Family(name=_name, model_types=(_name,), transformer_config=transformer_config, layer_spec=layer_spec,
                    model_kwargs=model_kwargs, params=params, check_parallel=check_parallel,
                    verify_names=verify_names, moe_routing=moe_routing, exact_layer_spec=_exact_layer_spec,
                    grouped_experts=True,
                    # Qwen3's chat template writes <tool_call>{"name": ..., "arguments": {...}}</tool_call>
                    tool_call_parser="hermes"))
