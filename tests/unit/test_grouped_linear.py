"""models/grouped_experts.py: the grouped GEMM of every expert equals each expert's own F.linear,
forward and backward (an expert with no tokens included), and the Qwen3 spec swaps only the MoE
experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from colocate_rl.models.grouped_experts import grouped_linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_linear_equals_each_expert_linear(dtype):
    g = torch.Generator().manual_seed(0)
    counts = [5, 0, 11, 16]  # expert 1 gets no token
    x = torch.randn(sum(counts), 32, generator=g).to(dtype)
    weights = [torch.randn(48, 32, generator=g).to(dtype).requires_grad_() for _ in counts]
    dy = torch.randn(sum(counts), 48, generator=g).to(dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)

    xg = x.clone().requires_grad_()
    y = grouped_linear(xg, offs, weights)
    y.backward(dy)
    got = (y, xg.grad, *[w.grad for w in weights])
    for w in weights:
        w.grad = None
    xs = x.clone().requires_grad_()
    ref = torch.cat([F.linear(part, w) for part, w in zip(xs.split(counts), weights)])
    ref.backward(dy)
    want = (ref, xs.grad, *[w.grad for w in weights])
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        assert ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item() < tol, i
    assert got[3].abs().sum() == 0  # the expert without tokens gets a zero gradient
    assert all(w.abs().sum() > 0 for i, w in enumerate(got[2:]) if counts[i])


def test_with_grouped_experts_swaps_only_a_moe_layers_experts():
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.experts import SequentialMLP

    from colocate_rl.models.grouped_experts import GroupedExperts, with_grouped_experts

    moe = get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=False)
    grouped = with_grouped_experts(moe)
    sub, before = grouped.keywords["submodules"], moe.keywords["submodules"]
    assert sub.experts.func is GroupedExperts and before.experts.func is SequentialMLP  # a copy
    assert sub.experts.keywords == before.experts.keywords and sub.router is before.router
    assert issubclass(GroupedExperts, SequentialMLP)  # the same modules and parameter names
    dense = before.shared_experts  # an MLP spec without experts comes back as it was
    assert with_grouped_experts(dense) is dense


def test_which_runs_resolve_to_grouped_experts():
    """auto: grouped on a GPU for a 16-bit actor; never in exact mode or under the FP8 emulation
    (whose hooks on each expert's linears the grouped GEMMs would skip), which refuses an explicit
    grouped in one line. The plan decides; the actor runs what it says."""
    from colocate_rl.config import Config, ConfigError, ModelConfig, load
    from colocate_rl.plan import resolve

    def experts(model="Qwen/Qwen3-30B-A3B", **over):
        over = {"model.dtype": "bfloat16", "placement.gpus_per_node": 1, **over}
        cfg = load(Config(model=ModelConfig(path=model)), overrides=[f"{k}={v}" for k, v in over.items()])
        return resolve(cfg, strict=False).resolved.kernels.experts

    cpu = {"placement.gpus_per_node": 0}
    assert experts() == "grouped" and experts(**cpu) == "sequential"
    assert experts(**{"model.dtype": "float32"}) == "sequential"
    assert experts(**cpu, **{"actor.expert_kernel": "grouped"}) == "grouped"
    assert experts(**{"actor.expert_kernel": "sequential"}) == "sequential"
    fp8 = {"actor.emulate_rollout_fp8": "true", "rollout.weight_quantization": "fp8"}
    assert experts("deepseek-ai/DeepSeek-V4-Flash", **fp8) == "sequential"
    with pytest.raises(ConfigError, match="unset actor.expert_kernel=grouped"):
        experts("deepseek-ai/DeepSeek-V4-Flash", **fp8, **{"actor.expert_kernel": "grouped"})
