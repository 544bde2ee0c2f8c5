"""DeepSeek-V4's FP8 emulation (actor.emulate_rollout_fp8): vLLM's rounding arithmetic, element by
element, and a straight-through backward."""

from __future__ import annotations

import torch

from colocate_rl.models.deepseek_v4.fp8_emulation import fp8_rounded, round_fp8


def vllm_rounding(x: torch.Tensor, group: int, channels: int) -> torch.Tensor:
    """quantize_and_insert_k_kernel's arithmetic (vLLM's DeepSeek-V4 cache_utils.py), one group at a
    time in plain Python floats: amax floored at 1e-4, scale 2^ceil(log2(amax / 448)), clamp, e4m3."""
    out = x.float().clone()
    for row in out.view(-1, x.shape[-1]):
        for g0 in range(0, channels, group):
            block = row[g0:min(g0 + group, channels)]
            amax = max(float(block.abs().max()), 1e-4)
            scale = 2.0 ** torch.ceil(torch.log2(torch.tensor(amax / 448.0))).item()
            q = (block / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
            block.copy_(q)
    return out.to(x.dtype)


def test_rounding_is_vllms_block_by_block():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 512, generator=g) * torch.logspace(-3, 2, 512)).to(torch.bfloat16)
    x[0, 0, :64] = 0  # an all-zero block: the floor keeps its scale finite
    got = round_fp8(x, 64, 448)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got, vllm_rounding(x, 64, 448))
    assert torch.equal(got[..., 448:], x[..., 448:])  # the rotary channels stay bf16
    changed = (got != x)[..., :448].float().mean().item()
    assert changed > 0.3, changed  # e4m3 keeps 3 mantissa bits of bf16's 7: most values move
    assert torch.equal(round_fp8(got, 64, 448), got)  # rounding a rounded tensor changes nothing


def test_groups_cover_every_channel_of_a_gemm_input():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 300, generator=g, dtype=torch.float32)  # 300 = two groups of 128 and one of 44
    assert torch.equal(round_fp8(x, 128), vllm_rounding(x, 128, 300))


def test_backward_is_straight_through():
    x = torch.randn(6, 256, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(6, 256, dtype=torch.bfloat16)
    y = fp8_rounded(x, 128)
    assert torch.equal(y.detach(), round_fp8(x.detach(), 128))
    y.backward(grad)
    assert torch.equal(x.grad, grad)
