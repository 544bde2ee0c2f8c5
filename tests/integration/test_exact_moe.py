"""rollout.exact's MoE block (models/exact_moe.py ExactMoELayer) on the CPU: with vLLM's two kernels
(its top-k, its fused experts) stood in for by their torch formulas, the block computes what
megatron-core's MoE layer computes from the same parameters, with and without routing replay, and
its backward gives megatron-core's gradients: so the exact forward's gradient is that of the function
it computes. (That vLLM's kernels give those values bit for bit is the GPU test's:
tests/gpu/test_exact_gpu.py.)"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("megatron.core")

from colocate_rl.models import exact, exact_moe  # noqa: E402
from colocate_rl.models.registry import family_for, moe_routing  # noqa: E402
from colocate_rl.models.tiny import SHAPES  # noqa: E402

HF = {**SHAPES["qwen3-moe-tiny"], "num_hidden_layers": 1}


def cpu_topk(x, logits, k, renormalize):
    """vLLM's softmax top-k, by its definition."""
    w, ids = logits.float().softmax(dim=-1).topk(k, dim=-1)
    return ids.to(torch.int32), (w / w.sum(dim=-1, keepdim=True) if renormalize else w)


def cpu_experts(x, weights, ids, w13, w2):
    return exact_moe.experts_formula(x, weights, ids, w13, w2).to(x.dtype)


def blocks():
    """megatron-core's MoE layer of the model's spec and the exact spec's, the same parameters."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from colocate_rl.models.swiglu import SwiGLU, with_activation

    family = family_for(HF)
    config = family.transformer_config(HF, torch.float32, use_cpu_initialization=True)
    plain = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", pp_rank=0)
    ours = exact.layer_spec(config, 1e6, 4096, pp_rank=0)
    # The model's own MoE block: megatron-core's, its experts' activation the local spec's (qwen3.layer_spec).
    mlp, exact_mlp = with_activation(plain.layer_specs[0].submodules.mlp, SwiGLU), ours.layer_specs[0].submodules.mlp
    assert isinstance(exact_mlp, functools.partial) and exact_mlp.func is exact_moe.ExactMoELayer
    torch.manual_seed(0)
    ref, mine = mlp(config=config, layer_number=1), exact_mlp(config=config, layer_number=1)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.5)
    mine.load_state_dict(ref.state_dict())
    return ref, mine


def run(block, x, routing=None):
    from colocate_rl.models.replay import RoutingReplay

    x = x.clone().requires_grad_()
    replay = RoutingReplay(moe_routing(HF).layers, sequence_parallel=False)
    assert replay.install(block) == 1
    with replay.replaying(routing):
        out, bias = block(x)
    assert bias is None
    out.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("replayed", [False, True])
def test_exact_moe_block_is_megatrons_function(world, monkeypatch, replayed):
    monkeypatch.setattr(exact_moe, "vllm_topk", cpu_topk)
    monkeypatch.setattr(exact_moe, "vllm_experts", cpu_experts)
    ref, mine = blocks()
    s, b, k, experts = 6, 3, HF["num_experts_per_tok"], HF["num_experts"]
    x = torch.randn(s, b, HF["hidden_size"], generator=torch.Generator().manual_seed(1))
    routing = None
    if replayed:  # the sampler's experts: other than the block's own top-k for most tokens
        g = torch.Generator().manual_seed(2)
        routing = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(b * s)]).view(b, s, 1, k)
        routing[0, 0] = 0  # a position the sampler never routed (repeated expert): the block's own top-k
    want, got = run(ref, x, routing), run(mine, x, routing)

    def close(a, b, what):  # fp32, two summation orders: relative to the tensor's scale
        err = float((a - b).abs().max() / b.abs().max())
        assert err < 1e-5, f"{what}: max |diff| is {err:.1e} of the largest value"

    close(got[0], want[0], "output")
    close(got[1], want[1], "input gradient")
    assert set(got[2]) == set(want[2]) and any("router" in n for n in got[2])
    for name in want[2]:
        close(got[2][name], want[2][name], f"gradient of {name}")
    assert all(g.abs().sum() > 0 for n, g in got[2].items() if "router" in n)  # the gradient reaches the router
