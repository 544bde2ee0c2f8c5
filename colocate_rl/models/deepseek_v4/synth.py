"""Small DeepSeek-V4 configs in the official key format and random weights under the official
tensor names (optionally quantised as released: FP8 128x128 blocks with ue8m0 scales, MXFP4
routed experts). For tests, tiny recipes and the GPU parity script; no hub needed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from colocate_rl.models.deepseek_v4.config import Hparams
from colocate_rl.models.deepseek_v4.weights import params

# Every layer kind: window only (0), C4 with the indexer (4), C128 (128); the first two layers
# hash-routed; small windows so a 260-token row reaches two C128 entries and the window matters.
# 16 indexer heads: an index score is exactly 0 only when every head's ReLU is, so entries rarely
# tie (ties are broken differently by transformers' topk and by our stable sort, see model.py).
TINY = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=320, hidden_size=64,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=16,
    q_lora_rank=32, o_lora_rank=16, o_groups=2, sliding_window=16, compress_ratios=[0, 4, 128, 0],
    index_n_heads=16, index_head_dim=16, index_topk=8, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, moe_intermediate_size=32, num_hash_layers=2, scoring_func="sqrtsoftplus",
    topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, rope_theta=10000, compress_rope_theta=160000,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32,
                  "beta_slow": 1},
    max_position_embeddings=1024, tie_word_embeddings=False, num_nextn_predict_layers=0, hidden_act="silu",
    attention_bias=False, attention_dropout=0.0, bos_token_id=0, eos_token_id=1, initializer_range=0.02,
)

# Overrides of official_config for the GPU checks against vLLM (its parity run and sync test): the
# released attention sizes its kernels require (64 heads of 512, indexer 64 x 128 with top-512,
# 128-token windows), small elsewhere.
VLLM_SMALL = dict(
    vocab_size=4096, hidden_size=1024, num_hidden_layers=4, num_attention_heads=64, head_dim=512,
    qk_rope_head_dim=64, q_lora_rank=512, o_lora_rank=512, o_groups=8, sliding_window=128,
    compress_ratios=[0, 4, 128, 4], index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=16,
    num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=512, num_hash_layers=2, swiglu_limit=10.0,
    hc_mult=4, hc_sinkhorn_iters=20, routed_scaling_factor=1.5, max_position_embeddings=1048576,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                  "beta_slow": 1},
    eos_token_id=1, bos_token_id=0,
)

# DeepSeek-V4-Flash's published config.json (284B): the memory plan of the full-size presets.
FLASH = {'architectures': ['DeepseekV4ForCausalLM'],
         'attention_bias': False,
         'attention_dropout': 0.0,
         'bos_token_id': 0,
         'eos_token_id': 1,
         'expert_dtype': 'fp4',
         'hc_eps': 1e-06,
         'hc_mult': 4,
         'hc_sinkhorn_iters': 20,
         'head_dim': 512,
         'hidden_act': 'silu',
         'hidden_size': 4096,
         'index_head_dim': 128,
         'index_n_heads': 64,
         'index_topk': 512,
         'initializer_range': 0.02,
         'max_position_embeddings': 1048576,
         'model_type': 'deepseek_v4',
         'moe_intermediate_size': 2048,
         'n_routed_experts': 256,
         'n_shared_experts': 1,
         'norm_topk_prob': True,
         'num_attention_heads': 64,
         'num_experts_per_tok': 6,
         'num_hidden_layers': 43,
         'num_hash_layers': 3,
         'num_key_value_heads': 1,
         'num_nextn_predict_layers': 1,
         'o_groups': 8,
         'o_lora_rank': 1024,
         'q_lora_rank': 1024,
         'qk_rope_head_dim': 64,
         'quantization_config': {'activation_scheme': 'dynamic',
                                 'fmt': 'e4m3',
                                 'quant_method': 'fp8',
                                 'scale_fmt': 'ue8m0',
                                 'weight_block_size': [128, 128]},
         'rms_norm_eps': 1e-06,
         'rope_scaling': {'beta_fast': 32,
                          'beta_slow': 1,
                          'factor': 16,
                          'original_max_position_embeddings': 65536,
                          'type': 'yarn'},
         'rope_theta': 10000,
         'routed_scaling_factor': 1.5,
         'scoring_func': 'sqrtsoftplus',
         'sliding_window': 128,
         'swiglu_limit': 10.0,
         'tie_word_embeddings': False,
         'topk_method': 'noaux_tc',
         'torch_dtype': 'bfloat16',
         'transformers_version': '4.57.1',
         'use_cache': True,
         'vocab_size': 129280,
         'compress_rope_theta': 160000,
         'compress_ratios': [0, 0, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,
                             4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 0]}


def official_config(**overrides) -> dict:
    cfg = json.loads(json.dumps(TINY))
    cfg.update(overrides)
    return cfg


def random_state_dict(hf: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Official-named tensors with values large enough that every branch matters: unit-variance
    projections, non-trivial norms, mHC biases, sinks, position biases, routing bias, and a
    token → experts table with distinct experts per token."""
    h = Hparams.from_official(hf)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0, mean=0.0):
        return (torch.randn(*shape, generator=g) * std + mean).to(dtype)

    out = {}
    for spec in params(hf):
        for name in spec.hf:
            shape = spec.shape
            if spec.kind == "gate_up":
                shape = (shape[0] // 2, *shape[1:])
            if name.endswith("tid2eid"):
                t = torch.rand(h.vocab_size, h.num_experts, generator=g).argsort(-1)[:, : h.topk].to(torch.int32)
            elif name.endswith("gate.bias"):
                t = randn(*shape, std=0.3).float()
            elif name.endswith("norm.weight"):
                t = randn(*shape, std=0.1, mean=1.0)
            elif name.endswith(("_fn", "hc_head_fn")):
                t = randn(*shape, std=0.05).float()
            elif name.endswith(("_base", "_scale")):
                t = randn(*shape, std=0.5, mean=1.0 if name.endswith("_scale") else 0.0).float()
            elif name.endswith(("attn_sink", "ape")):
                t = randn(*shape, std=0.5).float()
            elif name == "embed.weight":
                t = randn(*shape)
            else:  # [out, in] projections
                t = randn(*shape, std=shape[-1] ** -0.5)
            out[name] = t.contiguous()
    return out


def quantize_released(sd: dict[str, torch.Tensor], hf: dict) -> dict[str, torch.Tensor]:
    """The released layout: 2-D projections as FP8 e4m3 128x128 blocks with ue8m0 ``.scale``, routed
    experts as MXFP4; embeddings, head, norms, mHC, compressor and indexer projections, router stay."""
    from colocate_rl.models.quantized import quant_fp8_block, quant_mxfp4

    keep = ("embed.", "head.", "norm", "compressor.", "indexer.weights_proj", "ffn.gate.")
    out = {}
    for name, t in sd.items():
        routed = ".experts." in name and ".shared_experts." not in name
        if routed and name.endswith(".weight") and t.shape[-1] % 32 == 0:
            out[name], out[name[: -len("weight")] + "scale"] = quant_mxfp4(t)
        elif name.endswith(".weight") and t.dim() == 2 and not any(k in name for k in keep):
            out[name], out[name[: -len("weight")] + "scale"] = quant_fp8_block(t)
        else:
            out[name] = t
    return out


def write_model(out_dir: str | Path, hf: dict, seed: int = 0, dtype: str = "float32", quantized: bool = False) -> Path:
    """config.json (official keys) + model.safetensors in ``out_dir``; config.json last (a finished build)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = random_state_dict(hf, seed, getattr(torch, dtype))
    cfg = dict(hf, torch_dtype=dtype)
    if quantized:
        sd = quantize_released(sd, hf)
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
        cfg["expert_dtype"] = "fp4"
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def transformers_model(folder: str | Path, dtype: torch.dtype = torch.float32):
    """transformers' DeepseekV4ForCausalLM holding a folder's weights (the reference side of the
    parity tests): the official config converted, the official tensors renamed and experts stacked."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from colocate_rl.models.deepseek_v4.config import to_transformers
    from colocate_rl.models.deepseek_v4.weights import transformers_state_dict
    from colocate_rl.models.hf_checkpoint import HFCheckpoint

    official = json.loads((Path(folder) / "config.json").read_text())
    config = DeepseekV4Config(**to_transformers(official))
    config._attn_implementation = "eager"
    with HFCheckpoint(folder) as ckpt:
        sd = {n: ckpt.read(n) for n in ckpt.names() if not (n.endswith(".scale") and n[:-5] + "weight" in ckpt)}
    model = DeepseekV4ForCausalLM(config).to(dtype)
    # What from_pretrained does: mHC, sinks, position biases, the routing bias and the norms stay fp32.
    keep = DeepseekV4ForCausalLM._keep_in_fp32_modules_strict
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.is_floating_point() and any(k in name.split(".") or name.split(".")[-1] == k for k in keep):
            p.data = p.data.float()
    model.load_state_dict(transformers_state_dict(sd, config.n_routed_experts), strict=True)
    return model.eval()
