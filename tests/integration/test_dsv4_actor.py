"""The Megatron actor on the tiny DeepSeek-V4 (official-format folder) on CPU: logprobs equal to
transformers' deepseek_v4, an HF round trip under the official names, GRPO steps that move the
model the right way while the frozen routing tables stay put, and full recompute that changes nothing."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers.models.deepseek_v4")

from colocate_rl.config import Config, ModelConfig  # noqa: E402
from colocate_rl.types import RolloutBatch  # noqa: E402

from batches import build_actor, synthetic_batch  # noqa: E402

SHAPE = "deepseek-v4-tiny"


def make_batch(vocab: int = 320, seed: int = 0) -> RolloutBatch:
    """4 rows (2 prompts x 2 samples), right-padded, 3 prompt tokens; advantages +1 / -1."""
    return synthetic_batch([20, 14, 17, 9], vocab=vocab, seed=seed)


def make_actor(path, **actor):
    cfg = Config(model=ModelConfig(path=str(path), dtype="float32"))
    cfg.actor.lr = 1e-3
    cfg.actor.micro_batch_size = 2
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    fp8_engine = cfg.actor.emulate_rollout_fp8  # the engine it emulates holds FP8 weights: a GPU run
    if fp8_engine:
        cfg.rollout.weight_quantization = "fp8"
    return build_actor(cfg, gpu_run=fp8_engine)


def reference_logprobs(path, batch: RolloutBatch) -> torch.Tensor:
    from colocate_rl.models.deepseek_v4.synth import transformers_model

    model = transformers_model(path)
    out = torch.zeros(batch.tokens.shape)
    with torch.no_grad():  # row by row, unpadded: transformers' indexer ties depend on the padding
        for i in range(batch.size):
            n = int(batch.attention_mask[i].sum())
            ids = batch.tokens[i: i + 1, :n]
            out[i, 1:n] = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return out


def test_logprobs_match_transformers_and_export_uses_official_names(tiny_model):
    path = tiny_model(SHAPE)
    actor = make_actor(path)
    batch = make_batch()
    lp = actor.compute_logprobs(batch)
    assert (lp[:, 0] == 0).all() and (lp[~batch.attention_mask] == 0).all()
    diff = (lp - reference_logprobs(path, batch)).abs().max().item()
    assert diff <= 1e-4, f"max |megatron - transformers| logprob = {diff}"

    ckpt = load_file(str(path / "model.safetensors"))
    exported = {name: t.clone() for name, t in actor.export_hf_weights()}
    # Every checkpoint tensor, the frozen routing state too (an engine that slept at level 2 holds
    # nothing until the sync gives it all back), in the checkpoint's dtype.
    assert any(n.endswith("tid2eid") for n in ckpt) and any(n.endswith("gate.bias") for n in ckpt)
    assert sorted(exported) == sorted(ckpt)
    for name, t in exported.items():
        assert t.dtype == ckpt[name].dtype and torch.equal(t, ckpt[name]), name


def test_grpo_steps_move_the_model_and_keep_routing_tables(tiny_model):
    actor = make_actor(tiny_model(SHAPE), num_minibatches=2)
    batch = make_batch()
    start = actor.compute_logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.loss_mask, start, 0)
    buffers = {n: b.clone() for n, b in actor.model.module.named_buffers() if n.endswith(("tid2eid", "expert_bias"))}
    for _ in range(3):
        m = actor.train_step(batch, actor.compute_logprobs(batch))
        assert m["optimizer_steps"] == 2 and m["grad_norm"] > 0 and all(v == v for v in m.values()), m
    lp = actor.compute_logprobs(batch)
    moved = ((lp - start) * batch.loss_mask).sum(1) / batch.loss_mask.sum(1)
    adv = batch.advantages
    assert (moved[adv > 0] > 0.05).all() and (moved[adv < 0] < -0.05).all(), moved
    for n, b in actor.model.module.named_buffers():
        if n in buffers:
            assert torch.equal(b, buffers[n]), f"{n} changed during training"
    # gradients reach the mHC, the C4 compressor (rows of 20 tokens: 5 entries; the C128 layer has
    # none yet), the sinks, the head merge and the router; the indexer only picks (no gradient)
    grads = {n: p.main_grad.abs().sum().item() for n, p in actor.model.module.named_parameters()}
    assert grads["decoder.layers.1.self_attention.indexer.linear_q_up.weight"] == 0
    for key in ("layers.0.attn_hc.fn", "layers.1.self_attention.compressor.linear_kv.weight",
                "layers.1.self_attention.sinks", "decoder.hc_head.fn", "layers.3.mlp.router.weight"):
        assert any(key in n and g > 0 for n, g in grads.items()), key


@pytest.mark.slow  # two actors built and stepped: ~25 s on 2 cores
def test_full_recompute_gives_the_same_step(tiny_model):
    path = tiny_model(SHAPE)
    out = []
    for recompute in (False, True):
        actor = make_actor(path, recompute=recompute)
        batch = make_batch()
        lp = actor.compute_logprobs(batch)
        batch.rollout_logprobs = torch.where(batch.loss_mask, lp, 0)
        m = actor.train_step(batch, lp)
        out.append((m["loss"], m["grad_norm"]))
    assert out[0][0] == pytest.approx(out[1][0], abs=1e-6) and out[0][1] == pytest.approx(out[1][1], rel=1e-5)


def test_fp8_emulation_rounds_every_fp8_gemm_input_and_cached_key(tiny_model):
    """actor.emulate_rollout_fp8: the logprobs move (the engine's roundings are in the forward), and a
    GRPO step trains through them (straight-through)."""
    path = tiny_model(SHAPE)
    batch = make_batch()
    plain = make_actor(path).compute_logprobs(batch)
    actor = make_actor(path, emulate_rollout_fp8=True)
    names = [n for n, m in actor.model.module.named_modules() if m._forward_pre_hooks or m._forward_hooks]
    h = actor.hf_config
    layers = h["num_hidden_layers"]
    compressed = sum(1 for r in h["compress_ratios"][:layers] if r)
    indexed = sum(1 for r in h["compress_ratios"][:layers] if r == 4)
    # Per layer wq_a, wkv, wq_b, wo_b, the shared expert's two linears and the K=V norm; the indexer's
    # wq_b in C4 layers; the compressor's entries in compressed layers.
    assert len(names) == 7 * layers + indexed + compressed, names
    lp = actor.compute_logprobs(batch)
    gap = (lp - plain)[batch.loss_mask].abs()
    assert 0 < gap.mean() < 0.5, float(gap.mean())
    batch.rollout_logprobs = torch.where(batch.loss_mask, lp, 0)
    m = actor.train_step(batch)
    assert m["grad_norm"] > 0 and m["update_skipped"] == 0, m
