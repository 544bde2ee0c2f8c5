"""The memory plan's activation count against what the actor's training forward really keeps for its
backward (Actor.activation_census, real megatron-core on CPU): a plan that undercounts would let a
step run out of device memory that the plan said fits."""

from __future__ import annotations

import pytest

from colocate_rl.config import Config, ModelConfig
from colocate_rl.memory import activation_bytes
from colocate_rl.models.registry import model_size, read_hf_config

from batches import actor_plan, synthetic_batch


def census(path, dtype, fp32_residual=None):
    """(the actor's plan, its census of one batch of 8 full rows of 24 tokens, that batch)."""
    cfg = Config(model=ModelConfig(path=str(path), dtype=dtype))
    cfg.actor.fp32_residual = fp32_residual
    plan = actor_plan(cfg)
    actor = plan.build().make_actor()
    batch = synthetic_batch([24] * 8, vocab=320, seed=0)
    before = actor.weight_checksums()
    groups = actor.activation_census(batch)
    assert actor.weight_checksums() == before  # a census runs no optimizer step
    return plan, groups, batch


def layer_bytes(groups: dict) -> int:
    return sum(n for k, n in groups.items() if k.startswith("decoder.layers.*"))


@pytest.mark.parametrize("shape,dtype", [("qwen3-tiny", "float32"), ("qwen3-tiny", "bfloat16"),
                                         ("qwen3-moe-tiny", "bfloat16")])
def test_plan_counts_each_layers_saved_activations(tiny_model, shape, dtype):
    path = tiny_model(shape)
    plan, groups, batch = census(path, dtype)  # bf16: the residual stream in fp32 (unset)
    hf = read_hf_config(path)
    tokens, layers, element = batch.tokens.numel(), hf["num_hidden_layers"], 4 if dtype == "float32" else 2
    in_layers = layer_bytes(groups)
    assert in_layers > 0 and "<loss>" in groups, groups
    residual = 4 if plan.resolved.kernels.fp32_residual else element
    planned, head = activation_bytes(model_size(hf), tokens, element_bytes=element, residual_bytes=residual)
    ratio = in_layers / layers / planned
    assert 0.9 <= ratio <= 1.1, f"{shape} {dtype}: a layer keeps {ratio:.2f}x what the plan counts: {groups}"
    # The loss keeps the logits (trainer/logprobs.py); the plan adds the backward's gradient.
    logits = tokens * hf["vocab_size"] * element
    assert logits <= groups["<loss>"] <= logits + 64 * tokens and head >= 2 * logits


def test_plan_counts_what_the_fp32_residual_stream_adds(tiny_model):
    """The fp32 residual stream's extra bytes per layer, measured (bf16 actor with it, without it)
    against the plan's: the norms' fp32 inputs, 2 bytes more per token and hidden unit each."""
    path = tiny_model("qwen3-tiny")
    (_, wide, batch), (_, plain, _) = census(path, "bfloat16"), census(path, "bfloat16", False)
    size = model_size(read_hf_config(path))
    tokens = batch.tokens.numel()
    planned = [activation_bytes(size, tokens, element_bytes=2, residual_bytes=r)[0] for r in (4, 2)]
    measured = (layer_bytes(wide) - layer_bytes(plain)) / size.layers
    assert measured > 0 and measured == pytest.approx(planned[0] - planned[1], rel=0.01), (measured, planned)
