"""DeepSeek-V4 pieces that need no Megatron: mHC (Sinkhorn mixing, head merge) against
transformers' modules, the FP8-block / MXFP4 dequantisers against a plain reference, the official
config and tensor names against transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4")

from transformers import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ref  # noqa: E402

from colocate_rl.models.deepseek_v4 import ops, synth  # noqa: E402
from colocate_rl.models.deepseek_v4.config import Hparams, rope_inv_freq, to_transformers  # noqa: E402
from colocate_rl.models.deepseek_v4.weights import params, transformers_name, transformers_state_dict  # noqa: E402
from colocate_rl.models import quantized as q  # noqa: E402

# The released DeepSeek-V4-Flash config.json (official key names), as published.
FLASH = Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v4_flash_config.json"


def tconfig(**kw) -> DeepseekV4Config:
    return DeepseekV4Config(**to_transformers(synth.official_config(**kw)))


# ---------------------------------------------------------------- mHC


@pytest.mark.parametrize("hc,iters", [(4, 20), (2, 3)])
def test_mhc_mixing_matches_transformers(hc, iters):
    cfg = tconfig(hc_mult=hc, hc_sinkhorn_iters=iters)
    mod = ref.DeepseekV4HyperConnection(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        mod.fn.copy_(torch.randn(mod.fn.shape, generator=g) * 0.1)
        mod.base.copy_(torch.randn(mod.base.shape, generator=g))
        mod.scale.copy_(torch.randn(3, generator=g) + 1)
    streams = torch.randn(2, 7, hc, 64, generator=g)
    post_r, comb_r, collapsed_r = mod(streams)
    pre, post, comb = ops.hc_mix_weights(streams, mod.fn, mod.base, mod.scale, hc, iters, cfg.hc_eps, cfg.rms_norm_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(2)
    assert (post - post_r).abs().max() <= 1e-6
    assert (comb - comb_r).abs().max() <= 1e-6
    assert (collapsed - collapsed_r).abs().max() <= 1e-5
    # the merge as transformers' decoder layer writes it
    out = torch.randn(2, 7, 64, generator=g)
    want = post_r.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb_r.transpose(-1, -2), streams)
    assert (ops.hc_merge(streams, out, post, comb) - want).abs().max() <= 1e-5
    # comb really is non-symmetric: merging with comb instead of combᵀ would differ
    assert (ops.hc_merge(streams, out, post, comb.transpose(-1, -2)) - want).abs().max() > 1e-4


def test_sinkhorn_is_doubly_stochastic_after_20_iterations():
    comb = torch.rand(5, 4, 4) * 3 + 1e-3
    out = ops.sinkhorn(comb, 20, 1e-6)
    assert (out.sum(-2) - 1).abs().max() <= 1e-5
    assert (out.sum(-1) - 1).abs().max() <= 1e-3
    assert (ops.sinkhorn(comb, 1, 1e-6).sum(-1) - 1).abs().max() > 1e-2  # one pass is not enough


def test_hyper_head_matches_transformers():
    cfg = tconfig()
    mod = ref.DeepseekV4HyperHead(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        mod.hc_fn.copy_(torch.randn(mod.hc_fn.shape, generator=g) * 0.1)
        mod.hc_base.copy_(torch.randn(4, generator=g))
        mod.hc_scale.copy_(torch.tensor([1.3]))
    x = torch.randn(3, 5, 4, 64, generator=g)
    flat = ops.unweighted_rms_norm(x.flatten(2).float(), cfg.rms_norm_eps)
    pre = torch.sigmoid(flat @ mod.hc_fn.t() * mod.hc_scale + mod.hc_base) + cfg.hc_eps
    assert ((pre.unsqueeze(-1) * x).sum(2) - mod(x)).abs().max() <= 1e-5


def test_interleaved_partial_rope_and_yarn_match_transformers():
    official = synth.official_config()
    cfg, h = DeepseekV4Config(**to_transformers(official)), Hparams.from_official(official)
    rot = ref.DeepseekV4RotaryEmbedding(cfg)
    pos = torch.arange(300)[None]
    x = torch.randn(1, 300, 3, 32)
    for kind, compress in (("main", False), ("compress", True)):
        assert torch.allclose(rope_inv_freq(h, compress), getattr(rot, f"{kind}_inv_freq"), rtol=1e-6, atol=0)
        cos, sin = rot(x, pos, layer_type=kind)
        want = ref.apply_rotary_pos_emb(x.transpose(1, 2), cos, sin).transpose(1, 2)
        mine = ops.apply_rope(x, *ops.rope_cos_sin(rope_inv_freq(h, compress), pos, x.dtype))
        assert (mine - want).abs().max() <= 1e-6
        assert torch.equal(mine[..., :16], x[..., :16])  # only the trailing rope_dim channels rotate
    assert not torch.allclose(rope_inv_freq(h, True), rope_inv_freq(h, False))


# ---------------------------------------------------------------- dequantisers


def _fp8_reference(w: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    out = torch.empty(w.shape)
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            out[i, j] = float(w[i, j].float()) * float(s[i // block, j // block].float())
    return out


def test_fp8_block_dequant_against_reference():
    """Known bf16 values that e4m3 holds exactly (the test builds the quantised tensor from them),
    a 200 x 300 weight (partial last blocks), ue8m0 scales both as float8_e8m0fnu and raw bytes."""
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([0.0, 0.5, -0.75, 1.0, 1.5, -2.0, 3.0, -6.0, 13.0, -240.0, 448.0])
    codes = grid[torch.randint(0, len(grid), (200, 300), generator=g)]
    exps = torch.randint(-8, 4, (2, 3), generator=g).float()
    scale = torch.exp2(exps).to(torch.float8_e8m0fnu)
    weight = codes.to(torch.float8_e4m3fn)
    want = (codes * torch.exp2(exps).repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300])
    got = q.dequant_fp8_block(weight, scale, (128, 128), torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(got, _fp8_reference(weight, scale, 128))
    raw = (exps + 127).to(torch.uint8)
    assert torch.equal(q.dequant_fp8_block(weight, raw, (128, 128), torch.float32), want)
    assert q.dequant_fp8_block(weight, scale).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="FP8 scale has shape"):
        q.dequant_fp8_block(weight, scale[:1])


def test_fp8_quantiser_round_trips_within_e4m3_precision():
    w = torch.randn(256, 130) * 0.02
    back = q.dequant_fp8_block(*q.quant_fp8_block(w), dtype=torch.float32)
    normal = w.abs() > w.abs().max() / 16  # far from the block scale's subnormal range
    assert ((back - w).abs() <= w.abs() * 2 ** -4)[normal].all()
    assert (back - w).abs().max() <= w.abs().max() * 2 ** -4


def test_mxfp4_dequant_against_reference():
    """Every e2m1 code in both nibbles, low nibble first, one ue8m0 scale per 32 inputs."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (6, 64), generator=g)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    exps = torch.randint(-4, 5, (6, 2), generator=g).float()
    scale = torch.exp2(exps).to(torch.float8_e8m0fnu)
    values = torch.tensor(q.FP4_E2M1_VALUES)
    want = torch.empty(6, 64)
    for i in range(6):
        for j in range(64):
            want[i, j] = values[codes[i, j]] * 2.0 ** float(exps[i, j // 32])
    assert torch.equal(q.dequant_mxfp4(packed, scale, torch.float32), want)
    assert torch.equal(q.dequantize(packed, scale, dtype=torch.float32), want)
    # the quantiser writes the same layout back for values on the grid
    p2, s2 = q.quant_mxfp4(want)
    assert torch.equal(q.dequant_mxfp4(p2, s2, torch.float32), want)


# ---------------------------------------------------------------- config and names


def test_flash_config_reads():
    h = Hparams.from_official(json.loads(FLASH.read_text()))
    assert (h.num_layers, h.hc_mult, h.num_hash_layers, h.rope_dim, h.num_experts, h.topk) == (43, 4, 3, 64, 256, 6)
    # 44 ratios for 43 layers: the last one belongs to the MTP layer
    assert len(h.compress_ratios) == 43 and h.compress_ratios[:4] == (0, 0, 4, 128) and h.compress_ratios[-1] == 4
    assert h.yarn["factor"] == 16 and h.compress_rope_theta == 160000
    cfg = DeepseekV4Config(**to_transformers(json.loads(FLASH.read_text())))
    assert cfg.layer_types[2:4] == ["compressed_sparse_attention", "heavily_compressed_attention"]
    assert cfg.mlp_layer_types[:4] == ["hash_moe"] * 3 + ["moe"]
    assert cfg.qk_rope_head_dim == 64 and cfg.rope_parameters["compress"]["rope_type"] == "yarn"


def test_bad_compress_ratio_is_named():
    with pytest.raises(ValueError, match=r"compress_ratios holds \[8\]"):
        Hparams.from_official(synth.official_config(compress_ratios=[0, 8, 4, 0]))


def test_official_names_cover_transformers_state_dict():
    """Official names → transformers' names: exactly the tensors transformers' model holds."""
    official = synth.official_config()
    sd = synth.random_state_dict(official)
    assert set(sd) == {n for s in params(official) for n in s.hf}
    model = ref.DeepseekV4ForCausalLM(DeepseekV4Config(**to_transformers(official)))
    converted = transformers_state_dict(sd, official["n_routed_experts"])
    assert set(converted) == set(model.state_dict())
    for k, v in converted.items():
        assert tuple(v.shape) == tuple(model.state_dict()[k].shape), k
    assert transformers_name("layers.2.attn.indexer.compressor.ape") == \
        "model.layers.2.self_attn.compressor.indexer.position_bias"
    assert transformers_name("layers.3.attn.compressor.norm.weight") == \
        "model.layers.3.self_attn.compressor.kv_norm.weight"
    assert transformers_name("layers.0.ffn.gate.bias") == "model.layers.0.mlp.gate.e_score_correction_bias"


@pytest.mark.parametrize("tp,pp,ep,sp,match", [
    (2, 1, 1, False, "actor.sequence_parallel=false: deepseek_v4 at actor.tp=2 needs actor.sequence_parallel=true"),
    (8, 1, 1, True, "actor.tp=8 does not divide the model's num_attention_heads=4"),
    (1, 5, 1, False, "actor.pp=5 cannot split the model's num_hidden_layers=4"),
    (1, 1, 3, False, "actor.ep=3 does not divide the model's n_routed_experts=4"),
])
def test_bad_parallel_layouts_are_named(tp, pp, ep, sp, match):
    from colocate_rl.models.registry import family_for

    hf = synth.official_config()
    with pytest.raises(ValueError, match=match):
        family_for(hf).check_parallel(hf, tp, pp, ep, sequence_parallel=sp)
    for tp, pp, ep in ((2, 2, 2), (2, 4, 4), (1, 3, 1)):
        family_for(hf).check_parallel(hf, tp, pp, ep, sequence_parallel=tp > 1)


@pytest.mark.parametrize("layers,pp,want", [(43, 4, [10, 11, 11, 11]), (4, 3, [2, 1, 1]), (3, 2, [1, 2]),
                                            (4, 2, [2, 2])])
def test_pipeline_stages_split_the_layers(layers, pp, want):
    """A pipeline size that does not divide the layers gives the first stage (which holds the
    embedding too) the remainder, through Megatron's num_layers_in_first_pipeline_stage."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from colocate_rl.models.deepseek_v4 import transformer_config

    hf = synth.official_config(num_hidden_layers=layers, compress_ratios=[0] * layers)
    cfg = transformer_config(hf, torch.float32, pipeline_model_parallel_size=pp, use_cpu_initialization=True)
    assert [get_num_layers_to_build(cfg, pp_rank=r) for r in range(pp)] == want
    assert [get_transformer_layer_offset(cfg, pp_rank=r) for r in range(pp)] == [sum(want[:r]) for r in range(pp)]


def test_checkpoint_reads_quantized_weights_dequantized_and_sliced(tmp_path):
    """A ``.weight`` with a ``.scale`` beside it reads back dequantised (FP8 block and MXFP4), whole
    or as a tensor-parallel slice; tensors without a scale read as stored."""
    from safetensors.torch import save_file

    from colocate_rl.models.hf_checkpoint import HFCheckpoint

    g = torch.Generator().manual_seed(3)
    dense, expert, plain = torch.randn(200, 256, generator=g), torch.randn(64, 128, generator=g), torch.randn(7)
    fq, fs = q.quant_fp8_block(dense)
    mq, ms = q.quant_mxfp4(expert)
    save_file({"a.weight": fq, "a.scale": fs, "e.w1.weight": mq, "e.w1.scale": ms, "n.weight": plain},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": [128, 128]}}))
    with HFCheckpoint(tmp_path) as ckpt:
        full = ckpt.read("a.weight")
        assert full.dtype == torch.bfloat16 and torch.equal(full, q.dequant_fp8_block(fq, fs))
        assert torch.equal(ckpt.read("a.weight", 0, 100, 200), full[100:200])
        assert torch.equal(ckpt.read("a.weight", 1, 128, 256), full[:, 128:])
        assert torch.equal(ckpt.read("e.w1.weight"), q.dequant_mxfp4(mq, ms))
        assert torch.equal(ckpt.read("n.weight"), plain)
        assert ((ckpt.read("a.weight").float() - dense).abs() <= dense.abs().max() * 2 ** -4).all()
