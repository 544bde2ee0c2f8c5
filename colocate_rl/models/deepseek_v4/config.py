"""DeepSeek-V4 hyper-parameters read from the official config.json, and its transformers twin.

The released config uses the official key names (``compress_ratios``, ``num_hash_layers``,
``qk_rope_head_dim``, ``rope_scaling``); transformers 5.23 folds those into its own fields
(``layer_types``, ``mlp_layer_types``, ``partial_rotary_factor``, nested ``rope_parameters``) and
saves only the renamed ones. ``Hparams.from_official`` accepts both spellings so a folder written
by either side loads; ``to_transformers`` writes the config transformers' ``DeepseekV4Config``
takes for the same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Compression ratio → transformers' layer type (0: sliding window only, 4: CSA, 128: HCA).
RATIO_TO_LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
LAYER_TYPE_TO_RATIO = {v: k for k, v in RATIO_TO_LAYER_TYPE.items()}


@dataclass(frozen=True)
class Hparams:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int  # qk_rope_head_dim: the trailing slice of each head that carries RoPE
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # per layer: 0, 4 (CSA + indexer) or 128 (HCA)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_experts: int
    topk: int
    num_shared_experts: int
    moe_intermediate_size: int
    num_hash_layers: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: dict = field(default_factory=dict)  # factor, beta_fast, beta_slow, original_max_position_embeddings
    max_position_embeddings: int = 1 << 20
    tie_word_embeddings: bool = False
    num_mtp_layers: int = 0

    @staticmethod
    def from_official(hf: dict) -> "Hparams":
        n = hf["num_hidden_layers"]
        if "compress_ratios" in hf:
            ratios = tuple(int(r) for r in hf["compress_ratios"][:n])
        elif "layer_types" in hf:
            ratios = tuple(LAYER_TYPE_TO_RATIO[t] for t in hf["layer_types"][:n])
        else:
            raise ValueError("deepseek_v4 config has neither compress_ratios nor layer_types")
        bad = sorted({r for r in ratios if r not in RATIO_TO_LAYER_TYPE})
        if bad:
            raise ValueError(f"compress_ratios holds {bad}; DeepSeek-V4 layers are 0, 4 or 128")
        if "num_hash_layers" in hf:
            n_hash = int(hf["num_hash_layers"])
        else:
            n_hash = sum(1 for t in hf.get("mlp_layer_types", []) if t == "hash_moe")
        if "qk_rope_head_dim" in hf:
            rope_dim = int(hf["qk_rope_head_dim"])
        else:
            rope_dim = int(hf["head_dim"] * hf["partial_rotary_factor"])
        rope = hf.get("rope_scaling") or (hf.get("rope_parameters") or {}).get("compress") or {}
        kind = rope.get("type", rope.get("rope_type", "default"))
        if kind not in ("yarn", "default"):
            raise ValueError(f"rope_scaling.type={kind!r} is not supported for deepseek_v4 (yarn or none)")
        yarn = {}
        if kind == "yarn":
            yarn = dict(factor=float(rope["factor"]), beta_fast=float(rope.get("beta_fast") or 32),
                        beta_slow=float(rope.get("beta_slow") or 1),
                        original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
        main = (hf.get("rope_parameters") or {}).get("main") or {}
        comp = (hf.get("rope_parameters") or {}).get("compress") or {}
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported for deepseek_v4 (only silu)")
        return Hparams(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=n,
            num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"], rope_dim=rope_dim,
            q_lora_rank=hf["q_lora_rank"], o_lora_rank=hf["o_lora_rank"], o_groups=hf["o_groups"],
            sliding_window=hf["sliding_window"], compress_ratios=ratios, index_n_heads=hf["index_n_heads"],
            index_head_dim=hf["index_head_dim"], index_topk=hf["index_topk"],
            num_experts=hf.get("n_routed_experts") or hf["num_local_experts"], topk=hf["num_experts_per_tok"],
            num_shared_experts=hf.get("n_shared_experts", 1), moe_intermediate_size=hf["moe_intermediate_size"],
            num_hash_layers=n_hash, scoring_func=hf.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(hf.get("swiglu_limit") or 0.0), hc_mult=hf["hc_mult"],
            hc_sinkhorn_iters=hf["hc_sinkhorn_iters"], hc_eps=float(hf["hc_eps"]),
            rms_norm_eps=float(hf["rms_norm_eps"]),
            rope_theta=float(main.get("rope_theta", hf.get("rope_theta", 10000.0))),
            compress_rope_theta=float(comp.get("rope_theta", hf.get("compress_rope_theta", 160000.0))),
            yarn=yarn, max_position_embeddings=hf.get("max_position_embeddings", 1 << 20),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            num_mtp_layers=int(hf.get("num_nextn_predict_layers", 0)),
        )

    def is_hash(self, layer: int) -> bool:
        return layer < self.num_hash_layers


def to_transformers(official: dict) -> dict:
    """Official config.json → the kwargs of transformers' DeepseekV4Config for the same model.

    transformers reads ``compress_ratios`` / ``num_hash_layers`` / ``qk_rope_head_dim`` only as legacy
    keyword arguments and saves the renamed fields; this spells the renamed fields out so the
    reference model does not depend on that folding.
    """
    h = Hparams.from_official(official)
    out = {k: v for k, v in official.items()
           if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling", "quantization_config",
                        "expert_dtype", "torch_dtype", "transformers_version", "architectures", "rope_theta",
                        "compress_rope_theta", "num_nextn_predict_layers")}
    compress = {"rope_type": "default", "rope_theta": h.compress_rope_theta,
                "partial_rotary_factor": h.rope_dim / h.head_dim}
    if h.yarn:
        compress.update(rope_type="yarn", attention_factor=1.0, **h.yarn)
    out.update(
        layer_types=[RATIO_TO_LAYER_TYPE[r] for r in h.compress_ratios],
        mlp_layer_types=["hash_moe" if h.is_hash(i) else "moe" for i in range(h.num_layers)],
        partial_rotary_factor=h.rope_dim / h.head_dim,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": h.rope_theta,
                                  "partial_rotary_factor": h.rope_dim / h.head_dim},
                         "compress": compress},
        rope_theta=h.rope_theta, compress_rope_theta=h.compress_rope_theta,
        num_nextn_predict_layers=h.num_mtp_layers,
    )
    return out


def rope_inv_freq(h: Hparams, compress: bool) -> torch.Tensor:
    """[rope_dim / 2] float32 inverse frequencies: plain RoPE at rope_theta on sliding-window layers;
    YaRN at compress_rope_theta on compressed layers (with YaRN's attention factor held at 1, as
    the released model does — transformers forces the same)."""
    dim = h.rope_dim
    base = h.compress_rope_theta if compress else h.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv = 1.0 / pos_freqs
    if not compress or not h.yarn:
        return inv
    y = h.yarn

    def correction_dim(rot: float) -> float:
        return dim * math.log(y["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(y["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(y["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (inv / y["factor"]) * (1 - extrapolation) + inv * extrapolation
