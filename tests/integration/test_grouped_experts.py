"""actor.expert_kernel=grouped: a bf16 Qwen3-MoE or DeepSeek-V4 actor (real megatron-core on the CPU;
DeepSeek-V4's experts with its clamped SwiGLU and hash-routed layers) whose experts run through the
grouped GEMMs scores, and takes an optimizer step, as the sequential one does."""

from __future__ import annotations

import pytest
import torch

from colocate_rl.config import Config, ModelConfig

from batches import synthetic_batch


@pytest.mark.parametrize("shape", ["qwen3-moe-tiny", "deepseek-v4-tiny"])
def test_grouped_experts_score_and_train_as_the_sequential_ones(tiny_model, shape):
    from colocate_rl.models.grouped_experts import GroupedExperts
    from colocate_rl.trainer import Actor

    if shape.startswith("deepseek"):
        pytest.importorskip("transformers.models.deepseek_v4")
    path = tiny_model(shape)
    batch = synthetic_batch([24] * 4, vocab=320, seed=0)
    runs = {}
    for kernel in ("sequential", "grouped"):
        cfg = Config(model=ModelConfig(path=str(path), dtype="bfloat16"))
        cfg.actor.lr, cfg.actor.expert_kernel = 1e-3, kernel
        actor = Actor(cfg)
        layers = [m for m in actor.model.modules() if isinstance(m, GroupedExperts)]
        assert len(layers) >= 2 and all(m.grouped == (kernel == "grouped") for m in layers)
        n_experts = sum(m.num_local_experts for m in layers)
        lp = actor.compute_logprobs(batch)
        batch.rollout_logprobs = torch.where(batch.loss_mask, lp, 0)
        grad_norm = actor.train_step(batch, lp)["grad_norm"]
        experts = {n: p.detach().float().clone() for n, p in actor.model.named_parameters() if "local_experts" in n}
        runs[kernel] = (lp, grad_norm, experts)
    (lp_s, gn_s, w_s), (lp_g, gn_g, w_g) = runs["sequential"], runs["grouped"]
    m = batch.loss_mask
    assert m.sum() > 0 and (lp_g - lp_s)[m].abs().max() < 1e-3, (lp_g - lp_s)[m].abs().max()
    assert gn_s > 0 and gn_g == pytest.approx(gn_s, rel=1e-3)
    # Equal up to summation order (on this CPU the grouped GEMM's loop gives the same bits; a wrong
    # expert's weights moved the logprobs by 0.014 on average). Every expert parameter took the same
    # step: Adam's first step moves each weight by ~lr, against one gradient's sign.
    assert len(w_s) == 2 * n_experts and w_s.keys() == w_g.keys()
    moved = sum(((w_g[n] - w_s[n]).abs() > 0).float().mean().item() for n in w_s) / len(w_s)
    assert moved < 0.01, moved

