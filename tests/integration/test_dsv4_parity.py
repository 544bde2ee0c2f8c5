"""DeepSeek-V4 as megatron-core modules vs transformers 5.23's deepseek_v4 (the reference), fp32 on
CPU, on tiny random configs written in the official key format: every decoder layer's hc streams
and the logits within 1e-4; the hash router against transformers' hash router; FP8/MXFP4 import."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4")

from colocate_rl.models.deepseek_v4 import FAMILY, synth  # noqa: E402

TOL = 1e-4
SEQ = 260  # two C128 entries, 65 C4 entries (index_topk 8 of them), 16-token windows


def megatron_model(hf: dict, folder):
    from colocate_rl.models.build import build_model
    from colocate_rl.models.mapping import load_hf_weights

    cfg = FAMILY.transformer_config(hf, torch.float32, use_cpu_initialization=True, perform_initialization=False)
    model = build_model(FAMILY, hf, cfg)
    n = load_hf_weights(model, FAMILY.params(hf), folder)
    # every parameter, plus one frozen routing buffer per layer (tid2eid or the noaux_tc bias)
    assert n == len(list(model.parameters())) + hf["num_hidden_layers"]
    return model.eval()


def layer_outputs(ref, ids) -> tuple[list[torch.Tensor], torch.Tensor]:
    outs = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: outs.__setitem__(k, o))
             for k, layer in enumerate(ref.model.layers)]
    try:
        with torch.no_grad():
            logits = ref(ids).logits
    finally:
        for hk in hooks:
            hk.remove()
    return [outs[k] for k in range(len(outs))], logits


# swiglu_limit 0.5 makes the clamp bind on most activations; scoring_func softmax covers the
# other score path; the second config has no hash layers and no shared-expert multiple.
# query_chunk: queries per attention block (1024 = one block here; 48 = six, windows crossing blocks).
CONFIGS = {
    "flash-like": (dict(swiglu_limit=0.5), 48),
    "c128-first": (dict(compress_ratios=[128, 0, 4, 4], num_hash_layers=1, o_groups=4, hc_mult=2,
                        hc_sinkhorn_iters=5, index_topk=64, routed_scaling_factor=2.5), 1024),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_by_layer_logit_parity(world, tmp_path, name):
    overrides, chunk = CONFIGS[name]
    hf = synth.official_config(**overrides)
    synth.write_model(tmp_path, hf, seed=1)
    ref = synth.transformers_model(tmp_path)
    model = megatron_model(hf, tmp_path)
    for layer in model.decoder.layers:
        layer.self_attention.query_chunk = chunk
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, hf["vocab_size"], (2, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(2, SEQ)
    ref_layers, ref_logits = layer_outputs(ref, ids)
    with torch.no_grad():
        for k, want in enumerate(ref_layers):
            got = model.hidden_streams(ids, pos, upto=k + 1)
            assert got.shape == want.shape == (2, SEQ, hf["hc_mult"], hf["hidden_size"])
            assert (got - want).abs().max() <= TOL, f"layer {k} (ratio {hf['compress_ratios'][k]})"
        logits = model(ids, pos)
    assert logits.shape == ref_logits.shape
    assert (logits - ref_logits).abs().max() <= TOL
    assert ref_logits.std() > 0.1  # not a degenerate model where everything agrees trivially


def test_padding_does_not_change_a_row(world, tmp_path):
    """A row scores the same alone and right-padded in a longer micro-batch, even with 2 indexer
    heads, where exact-zero index scores tie often: ties go to the lowest entry (transformers'
    topk breaks them by the tensor's length, so its padded and unpadded rows differ)."""
    hf = synth.official_config(index_n_heads=2)
    synth.write_model(tmp_path, hf, seed=0)
    model = megatron_model(hf, tmp_path)
    ids = torch.randint(3, hf["vocab_size"], (1, 90), generator=torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(ids, (0, 50))
    with torch.no_grad():
        alone = model(ids, torch.arange(90)[None])
        inside = model(padded, torch.arange(140)[None])[:, :90]
    assert (alone - inside).abs().max() <= 1e-5


def test_compressed_branches_change_the_output(world, tmp_path):
    """The parity above is not vacuous: with the compressed entries and indexer picks of late
    positions removed (a 127-token prefix has no C128 entry) the last-token logits change."""
    hf = synth.official_config()
    synth.write_model(tmp_path, hf, seed=2)
    model = megatron_model(hf, tmp_path)
    ids = torch.randint(2, hf["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(SEQ).expand(1, SEQ)
    with torch.no_grad():
        full = model(ids, pos)
        attn = model.decoder.layers[2].self_attention
        keep, attn.compressor = attn.compressor, None
        no_c128 = model(ids, pos)
        attn.compressor = keep
    # positions before the first C128 window closes (t < 127) see no compressed entry either way
    assert (full[:, :127] - no_c128[:, :127]).abs().max() <= TOL
    assert (full[:, 200:] - no_c128[:, 200:]).abs().max() > 1e-3


def test_hash_router_matches_transformers(world):
    """Megatron router with a frozen token → experts table vs transformers' DeepseekV4HashRouter:
    same experts (the table's, never the scores' top-k) and same weights."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

    from colocate_rl.models.deepseek_v4.config import to_transformers

    hf = synth.official_config()
    cfg = FAMILY.transformer_config(hf, torch.float32, use_cpu_initialization=True, perform_initialization=False)
    from colocate_rl.models.deepseek_v4.config import Hparams
    from colocate_rl.models.deepseek_v4.model import moe_layer

    moe = moe_layer(cfg, Hparams.from_official(hf), layer=0)
    router = moe.router
    assert router.is_hash
    ref = DeepseekV4HashRouter(DeepseekV4Config(**to_transformers(hf)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w = torch.randn(4, 64, generator=g)
        table = torch.rand(320, 4, generator=g).argsort(-1)[:, :2]
        router.weight.copy_(w)
        router.tid2eid.copy_(table)
        ref.weight.copy_(w)
        ref.tid2eid.copy_(table)
    ids = torch.randint(0, 320, (5, 3), generator=g)  # [s, b] as Megatron's MoE sees tokens
    x = torch.randn(5, 3, 64, generator=g)
    router.token_ids = ids
    with torch.no_grad():
        probs, routing_map = router(x)
        _, ref_w, ref_idx = ref(x.view(-1, 64), ids.reshape(-1))
    assert torch.equal(routing_map.nonzero()[:, 1].view(-1, 2).sort(-1).values, ref_idx.sort(-1).values)
    assert torch.equal(ref_idx.sort(-1).values, table[ids.reshape(-1)].sort(-1).values)
    dense = torch.zeros(15, 4).scatter(1, ref_idx, ref_w)
    assert (probs - dense).abs().max() <= 1e-6
    # a learned top-k would pick different experts for some tokens: the table really decides
    scores = torch.nn.functional.softplus(x.view(-1, 64) @ w.t()).sqrt()
    assert not torch.equal(scores.topk(2).indices.sort(-1).values, ref_idx.sort(-1).values)


def test_released_fp8_mxfp4_checkpoint_loads_dequantised(world, tmp_path):
    """A folder in the released layout (FP8 e4m3 128x128 blocks + ue8m0 scales, MXFP4 experts)
    loads into Megatron with every weight equal to its dequantised value, and transformers on the
    same dequantised tensors gives the same logits."""
    from safetensors.torch import load_file

    from colocate_rl.models.quantized import dequantize

    hf = synth.official_config(hidden_size=128, q_lora_rank=128, moe_intermediate_size=64)
    synth.write_model(tmp_path, hf, seed=4, quantized=True)
    raw = load_file(str(tmp_path / "model.safetensors"))
    assert raw["layers.0.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert raw["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    model = megatron_model(hf, tmp_path)
    params = dict(model.named_parameters())
    want = dequantize(raw["layers.1.attn.wq_b.weight"], raw["layers.1.attn.wq_b.scale"]).float()
    assert torch.equal(params["decoder.layers.1.self_attention.linear_q_up.weight"], want)
    w1 = dequantize(raw["layers.2.ffn.experts.3.w1.weight"], raw["layers.2.ffn.experts.3.w1.scale"]).float()
    assert torch.equal(params["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"][:64], w1)
    ref = synth.transformers_model(tmp_path)
    ids = torch.randint(2, 320, (1, 140), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (model(ids, torch.arange(140)[None]) - ref(ids).logits).abs().max() <= TOL
