"""The memory plan's activation count against what the actor's training forward really keeps for its
backward (Actor.activation_census, real megatron-core on CPU): a plan that undercounts would let a
step run out of device memory that the plan said fits."""

from __future__ import annotations

import pytest

from colocate_rl.config import Config, ModelConfig, resolve_fp32_residual
from colocate_rl.memory import activation_bytes
from colocate_rl.models.registry import model_size, read_hf_config

from batches import synthetic_batch


@pytest.mark.parametrize("shape,dtype,fp32_residual", [
    ("qwen3-tiny", "float32", None), ("qwen3-tiny", "bfloat16", False),
    ("qwen3-tiny", "bfloat16", None),  # unset: the residual stream in fp32
    ("qwen3-moe-tiny", "bfloat16", None)])
def test_plan_counts_each_layers_saved_activations(tiny_model, shape, dtype, fp32_residual):
    from colocate_rl.trainer import Actor

    path = tiny_model(shape)
    cfg = Config(model=ModelConfig(path=str(path), dtype=dtype))
    cfg.actor.fp32_residual = fp32_residual
    actor = Actor(cfg)
    batch = synthetic_batch([24] * 8, vocab=320, seed=0)  # 8 full rows of 24 tokens
    before = actor.weight_checksums()
    groups = actor.activation_census(batch)
    assert actor.weight_checksums() == before  # a census runs no optimizer step

    hf = read_hf_config(path)
    tokens, layers = batch.tokens.numel(), hf["num_hidden_layers"]
    in_layers = sum(n for k, n in groups.items() if k.startswith("decoder.layers.*"))
    assert in_layers > 0 and "<loss>" in groups, groups
    residual = 4 if resolve_fp32_residual(cfg) else actor.dtype.itemsize
    planned, head = activation_bytes(model_size(hf), tokens, element_bytes=actor.dtype.itemsize, residual_bytes=residual)
    ratio = in_layers / layers / planned
    assert 0.9 <= ratio <= 1.1, f"{shape} {dtype} {fp32_residual}: a layer keeps {ratio:.2f}x what the plan counts: {groups}"
    # The loss keeps the logits (trainer/logprobs.py); the plan adds the backward's gradient.
    logits = tokens * hf["vocab_size"] * actor.dtype.itemsize
    assert logits <= groups["<loss>"] <= logits + 64 * tokens and head >= 2 * logits
