"""DeepSeek-V4's pure tensor functions (no Megatron): RMSNorm without weight, interleaved partial
RoPE, the mHC mixing weights with their Sinkhorn projection, and the stream merge."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from colocate_rl.models.norm import rms_norm_input_grad, rms_stats


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] → x / rms(x), the scale computed in fp32 and rounded to x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions [b, s] → cos, sin [b, s, r/2], rounded to the activations' dtype as the reference does."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing 2·cos.shape[-1] channels of x [b, s, heads, d] (pairs of
    adjacent channels rotate together); cos/sin [b, s, r/2]. Leading channels pass through."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(2)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(2)
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    out = (rope.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat([nope, out], dim=-1)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., hc, hc] positive → approximately doubly stochastic: a column normalisation, then
    (iters − 1) rounds of row and column normalisation (the released model's order)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class _NormedLinear(torch.autograd.Function):
    """F.linear(unweighted_rms_norm(x in fp32), w), keeping only x and w for the backward: autograd
    of the formula keeps x's fp32 copy and the fp32 normalised streams (16 bytes per element of a
    bf16 x, 4 streams x hidden wide per token, at every mHC), and the backward recomputes them."""

    @staticmethod
    def forward(ctx, x, w, eps):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return F.linear(unweighted_rms_norm(x.float(), eps), w.float())

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        flat, rstd = rms_stats(x, ctx.eps)
        g = grad.float()
        dw = g.reshape(-1, g.shape[-1]).t() @ flat.reshape(-1, flat.shape[-1])
        dx = rms_norm_input_grad(g @ w.float(), flat, rstd)
        return dx.to(x.dtype), dw.to(w.dtype), None


def normed_linear(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., K] (any dtype), w [n, K] → [..., n] float32: x normalised by its rms in fp32, then w."""
    return _NormedLinear.apply(x, w, eps)


def hc_mix_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                   iters: int, hc_eps: float, norm_eps: float):
    """streams [b, s, hc, D], fn [(2+hc)·hc, hc·D], base [(2+hc)·hc], scale [3] →
    pre [b, s, hc], post [b, s, hc], comb [b, s, hc, hc] (fp32)."""
    b, s = streams.shape[:2]
    mixed = normed_linear(streams.reshape(b, s, -1), fn, norm_eps)
    pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(b, s, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, iters, hc_eps)


def hc_merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [b, s, hc, D] = post ⊗ block output + combᵀ · streams (comb is consumed transposed:
    Sinkhorn gives a doubly-stochastic, not symmetric, matrix)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
