"""DeepSeek-V4 tensor names: Megatron ⇄ official checkpoint ⇄ transformers.

The released checkpoint (and vLLM's loader) use the official names (``layers.3.attn.wq_a.weight``,
``layers.3.ffn.experts.7.w1.weight``, ``hc_head_fn``, …); transformers 5.23 renames them on load and
stacks the routed experts into ``mlp.experts.gate_up_proj`` [E, 2I, D] / ``down_proj`` [E, D, I].
``params`` lists every Megatron parameter with its official source and tensor-parallel split;
``transformers_state_dict`` turns an official state dict into transformers' names.

Sharding (tp = tensor parallel, ep = expert parallel): q up-projection rows, sinks and the grouped
o down-projection by heads/groups (dim 0); o up-projection by input (dim 1); embedding and output
layer by vocabulary (dim 0); expert and shared-expert fc1 as gate/up halves (dim 0), fc2 by input
(dim 1); routed experts whole per expert-parallel rank. Everything else is replicated (the shared
K=V head, q down-projection, compressors, indexer, norms, mHC, router).
"""

from __future__ import annotations

import re

import torch

from colocate_rl.models.deepseek_v4.config import Hparams
from colocate_rl.models.mapping import ParamSpec


def params(hf: dict) -> list[ParamSpec]:
    """Every Megatron parameter (and the frozen routing buffers) of the full model, in export order."""
    h = Hparams.from_official(hf)
    d, hd, hc = h.hidden_size, h.head_dim, h.hc_mult
    n_hc = (2 + hc) * hc
    out = [ParamSpec("embedding.word_embeddings.weight", ("embed.weight",), (h.vocab_size, d), tp_dim=0, stage="first")]
    for i in range(h.num_layers):
        m, p = f"decoder.layers.{i}.", f"layers.{i}."
        a, pa = m + "self_attention.", p + "attn."

        def one(name, src, shape, **kw):
            return ParamSpec(name, (src,), shape, layer=i, **kw)

        out += [
            one(m + "attn_hc.fn", p + "hc_attn_fn", (n_hc, hc * d)),
            one(m + "attn_hc.base", p + "hc_attn_base", (n_hc,)),
            one(m + "attn_hc.scale", p + "hc_attn_scale", (3,)),
            one(m + "input_layernorm.weight", p + "attn_norm.weight", (d,)),
            one(a + "linear_q_down.weight", pa + "wq_a.weight", (h.q_lora_rank, d)),
            one(a + "q_layernorm.weight", pa + "q_norm.weight", (h.q_lora_rank,)),
            one(a + "linear_q_up.weight", pa + "wq_b.weight", (h.num_heads * hd, h.q_lora_rank), tp_dim=0),
            one(a + "linear_kv.weight", pa + "wkv.weight", (hd, d)),
            one(a + "kv_layernorm.weight", pa + "kv_norm.weight", (hd,)),
            one(a + "linear_o_down", pa + "wo_a.weight", (h.o_groups * h.o_lora_rank, h.num_heads * hd // h.o_groups),
                tp_dim=0),
            one(a + "linear_proj.weight", pa + "wo_b.weight", (d, h.o_groups * h.o_lora_rank), tp_dim=1),
            one(a + "sinks", pa + "attn_sink", (h.num_heads,), tp_dim=0),
        ]
        ratio = h.compress_ratios[i]
        if ratio:
            width = 2 * hd if ratio == 4 else hd
            out += _compressor(one, a + "compressor.", pa + "compressor.", ratio, width, hd, d)
        if ratio == 4:
            iw = 2 * h.index_head_dim
            out += _compressor(one, a + "indexer.compressor.", pa + "indexer.compressor.", ratio, iw,
                               h.index_head_dim, d)
            out += [
                one(a + "indexer.linear_q_up.weight", pa + "indexer.wq_b.weight",
                    (h.index_n_heads * h.index_head_dim, h.q_lora_rank)),
                one(a + "indexer.linear_weights.weight", pa + "indexer.weights_proj.weight", (h.index_n_heads, d)),
            ]
        out += [
            one(m + "mlp_hc.fn", p + "hc_ffn_fn", (n_hc, hc * d)),
            one(m + "mlp_hc.base", p + "hc_ffn_base", (n_hc,)),
            one(m + "mlp_hc.scale", p + "hc_ffn_scale", (3,)),
            one(m + "pre_mlp_layernorm.weight", p + "ffn_norm.weight", (d,)),
            one(m + "mlp.router.weight", p + "ffn.gate.weight", (h.num_experts, d)),
        ]
        # Frozen routing state (buffers; RL never changes them), exported all the same: an engine
        # that slept at level 2 discarded every tensor it holds, and a sync must give each one back.
        if h.is_hash(i):
            out.append(one(m + "mlp.router.tid2eid", p + "ffn.gate.tid2eid", (h.vocab_size, h.topk)))
        else:
            out.append(one(m + "mlp.router.expert_bias", p + "ffn.gate.bias", (h.num_experts,)))
        inter = h.moe_intermediate_size
        for e in range(h.num_experts):
            me, pe = m + f"mlp.experts.local_experts.{e}.", p + f"ffn.experts.{e}."
            out += [
                ParamSpec(me + "linear_fc1.weight", (pe + "w1.weight", pe + "w3.weight"), (2 * inter, d),
                          kind="gate_up", tp_dim=0, layer=i, expert=e),
                ParamSpec(me + "linear_fc2.weight", (pe + "w2.weight",), (d, inter), tp_dim=1, layer=i, expert=e),
            ]
        shared = inter * h.num_shared_experts
        ms, ps_ = m + "mlp.shared_experts.", p + "ffn.shared_experts."
        out += [
            ParamSpec(ms + "linear_fc1.weight", (ps_ + "w1.weight", ps_ + "w3.weight"), (2 * shared, d), kind="gate_up",
                      tp_dim=0, layer=i),
            ParamSpec(ms + "linear_fc2.weight", (ps_ + "w2.weight",), (d, shared), tp_dim=1, layer=i),
        ]
    out += [
        ParamSpec("decoder.hc_head.fn", ("hc_head_fn",), (hc, hc * d), stage="last"),
        ParamSpec("decoder.hc_head.base", ("hc_head_base",), (hc,), stage="last"),
        ParamSpec("decoder.hc_head.scale", ("hc_head_scale",), (1,), stage="last"),
        ParamSpec("decoder.final_layernorm.weight", ("norm.weight",), (d,), stage="last"),
        ParamSpec("output_layer.weight", ("head.weight",), (h.vocab_size, d), tp_dim=0, stage="last"),
    ]
    return out


def _compressor(one, m: str, p: str, ratio: int, width: int, dim: int, d: int) -> list[ParamSpec]:
    return [
        one(m + "linear_kv.weight", p + "wkv.weight", (width, d)),
        one(m + "linear_gate.weight", p + "wgate.weight", (width, d)),
        one(m + "position_bias", p + "ape", (ratio, width)),
        one(m + "norm.weight", p + "norm.weight", (dim,)),
    ]


# ---------------------------------------------------------------- transformers' names

# (official pattern, transformers replacement), applied in order to one name.
_TO_TRANSFORMERS = [
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^layers\.(\d+)\.hc_attn_(fn|base|scale)$", r"model.layers.\1.attn_hc.\2"),
    (r"^layers\.(\d+)\.hc_ffn_(fn|base|scale)$", r"model.layers.\1.ffn_hc.\2"),
    (r"^layers\.(\d+)\.attn\.indexer\.compressor\.", r"model.layers.\1.self_attn.compressor.indexer."),
    (r"^layers\.(\d+)\.attn\.indexer\.wq_b\.", r"model.layers.\1.self_attn.compressor.indexer.q_b_proj."),
    (r"^layers\.(\d+)\.attn\.indexer\.weights_proj\.",
     r"model.layers.\1.self_attn.compressor.indexer.scorer.weights_proj."),
    (r"^layers\.(\d+)\.attn\.attn_sink$", r"model.layers.\1.self_attn.sinks"),
    (r"^layers\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
    (r"^layers\.(\d+)\.ffn\.gate\.bias$", r"model.layers.\1.mlp.gate.e_score_correction_bias"),
    (r"^layers\.(\d+)\.ffn\.shared_experts\.w1\.", r"model.layers.\1.mlp.shared_experts.gate_proj."),
    (r"^layers\.(\d+)\.ffn\.shared_experts\.w2\.", r"model.layers.\1.mlp.shared_experts.down_proj."),
    (r"^layers\.(\d+)\.ffn\.shared_experts\.w3\.", r"model.layers.\1.mlp.shared_experts.up_proj."),
    (r"^layers\.(\d+)\.ffn\.", r"model.layers.\1.mlp."),
]
_LEAF = [(r"\.wq_a\.", ".q_a_proj."), (r"\.q_norm\.", ".q_a_norm."), (r"\.wq_b\.", ".q_b_proj."),
         (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."),
         (r"\.wo_b\.", ".o_b_proj."), (r"\.ape$", ".position_bias"), (r"compressor\.norm\.", "compressor.kv_norm."),
         (r"indexer\.norm\.", "indexer.kv_norm.")]
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


def transformers_name(official: str) -> str:
    """Official name of a non-expert tensor → transformers' name (experts: see transformers_state_dict)."""
    if _EXPERT.match(official):
        raise ValueError(f"{official} is a routed-expert tensor: transformers stacks those (transformers_state_dict)")
    name = official
    for pat, rep in _TO_TRANSFORMERS:
        new = re.sub(pat, rep, name)
        if new != name:
            name = new
            break
    for pat, rep in _LEAF:
        name = re.sub(pat, rep, name)
    return name


def transformers_state_dict(official: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Official (dequantised) state dict → transformers' DeepseekV4ForCausalLM state dict."""
    out, experts = {}, {}
    for name, t in official.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(int(m.group(1)), {})[(int(m.group(2)), m.group(3))] = t
        elif not name.startswith("mtp."):
            out[transformers_name(name)] = t
    for layer, ws in experts.items():
        p = f"model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack([torch.cat([ws[(e, "w1")], ws[(e, "w3")]]) for e in range(num_experts)])
        out[p + "down_proj"] = torch.stack([ws[(e, "w2")] for e in range(num_experts)])
    return out
