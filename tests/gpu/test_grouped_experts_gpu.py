"""actor.expert_kernel=grouped on a GPU (torch's CUDA grouped GEMM): at Qwen3-30B-A3B's expert width
every expert's product and gradients equal its own F.linear's (an expert without tokens included),
and bf16 Qwen3-MoE and DeepSeek-V4 actors score and train as with the sequential experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batches import make_actor, step_view, synthetic_batch

LENS = [24] * 4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


@pytest.fixture(autouse=True)
def _grouped_gemm_runs():
    from colocate_rl.models.grouped_experts import grouped_gemm_runs

    if not grouped_gemm_runs("cuda", torch.bfloat16):
        pytest.skip(f"torch's grouped GEMM does not run for bf16 on {torch.cuda.get_device_name(0)}")


def test_grouped_linear_at_qwen3_30b_a3b_width():
    from colocate_rl.models.grouped_experts import grouped_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.randint(100, 400, (128,), generator=g, device="cuda")
    counts[7] = 0  # an expert the micro-batch does not reach
    n = int(counts.sum())
    x = torch.randn(n, 2048, generator=g, device="cuda").to(torch.bfloat16)
    weights = [(0.02 * torch.randn(1536, 2048, generator=g, device="cuda")).to(torch.bfloat16).requires_grad_()
               for _ in range(128)]
    dy = torch.randn(n, 1536, generator=g, device="cuda").to(torch.bfloat16)
    offs = counts.cumsum(0).to(torch.int32)
    xg = x.clone().requires_grad_()
    y = grouped_linear(xg, offs, weights)
    got = (y, *torch.autograd.grad(y, [xg, *weights], dy))
    xs = x.clone().requires_grad_()
    ref = torch.cat([F.linear(p, w) for p, w in zip(xs.split(counts.tolist()), weights)])
    want = (ref, *torch.autograd.grad(ref, [xs, *weights], dy))
    assert len(got) == len(want) == 2 + 128
    for i, (a, b) in enumerate(zip(got, want)):
        if i == 2 + 7:
            assert a.abs().sum() == 0 and b.abs().sum() == 0  # no token, no gradient
            continue
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 1e-2, (i, err)  # bf16 outputs of fp32 accumulations in another order


@pytest.mark.parametrize("shape", ["qwen3-moe-tiny", "deepseek-v4-tiny"])
def test_actor_with_grouped_experts_scores_and_trains_as_the_sequential_one(tiny_model, shape):
    """auto (grouped on a GPU) against sequential, DeepSeek-V4's clamped SwiGLU and hash-routed
    layers included."""
    from colocate_rl.models.grouped_experts import GroupedExperts

    if shape.startswith("deepseek"):
        pytest.importorskip("transformers.models.deepseek_v4")
    path = str(tiny_model(shape, dtype="bfloat16"))
    runs = {}
    for kernel in ("sequential", "auto"):
        actor = make_actor(path, {"expert_kernel": kernel}, dtype="bfloat16")
        layers = [m for m in actor.model.modules() if isinstance(m, GroupedExperts)]
        assert len(layers) >= 2 and all(m.grouped == (kernel == "auto") for m in layers)
        runs[kernel] = step_view(actor, LENS)
        del actor
        torch.cuda.empty_cache()
    seq, grp = runs["sequential"], runs["auto"]
    m = synthetic_batch(LENS, seed=1).loss_mask.to(seq["before"].device)  # step_view's batch
    assert m.sum() > 0
    for when in ("before", "after"):  # scoring, and scoring after the optimizer step
        gap = (grp[when] - seq[when])[m].abs().mean()
        assert gap < 0.01, (when, gap)
    assert seq["grad_norm"] > 0 and grp["grad_norm"] == pytest.approx(seq["grad_norm"], rel=0.02)
