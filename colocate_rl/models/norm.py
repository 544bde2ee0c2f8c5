"""RMSNorm computed the way HF Qwen3 and vLLM compute it, for the local (no-TE) spec.

Megatron's local spec uses torch.nn.RMSNorm with an fp32 weight (it ignores params_dtype), so in
bf16 the norm weights become fp32 parameters and the scaling happens before the rounding. HF
normalises in fp32, rounds to the input dtype, then multiplies by a weight in the model dtype;
matching that order keeps the actor's bf16 logprobs close to the rollout engine's. The rounding
goes to the weight's dtype, which is the input's unless actor.fp32_residual keeps the residual
stream (the input here) in fp32 while the linears after the norm stay in the model dtype.

Eager, a norm's forward is 4 operators and its backward ~20 (casts, squares, sums, products):
four norms per Qwen3 layer (input, pre-MLP, q and k) are a large share of the operators a train
step launches (docs/lab/performance_log.md, *Fused norms*), and a small model's step on a GPU is
bound by launching them. ``fused`` (actor.norm_kernel) runs the same expressions through torch.compile'd
kernels, one or two per pass.
"""

from __future__ import annotations

import torch

from colocate_rl.platform import compiled


def rms_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., h] → (xhat [..., h], rstd [..., 1]) float32: xhat = x * rstd, rstd = rsqrt(mean(x²) +
    eps), what a norm's backward needs, computed once per backward. Means are sums / h: in exact
    mode's batch-invariant setting ``mean`` is a Triton kernel launched from Python."""
    xf = x.float()  # x itself when fp32: nothing below writes into it
    rstd = torch.rsqrt(xf.square().sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps))
    return xf * rstd, rstd


def rms_norm_input_grad(gxhat: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """gxhat [..., h], (xhat, rstd) of rms_stats(x) → [..., h] float32: the gradient at x given the
    gradient at xhat, in closed form (no autograd graph of its own)."""
    gf = gxhat.float()
    dot = (gf * xhat).sum(-1, keepdim=True).div_(xhat.shape[-1])
    return (gf - xhat * dot).mul_(rstd)


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """grad, x [..., h], weight [h] → (dx, dweight) of ``weight * x * rsqrt(mean(x²) + eps)`` with the
    weight inside the fp32 product (vLLM's norms, DeepSeek-V4's), in the inputs' dtypes, in closed
    form: a nested ``autograd.grad`` per norm would be host time."""
    xhat, rstd = rms_stats(x, eps)
    dw = (grad.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
    dx = rms_norm_input_grad(grad.float() * weight.float(), xhat, rstd)
    return dx.to(x.dtype), dw.to(weight.dtype)


def _norm(x, weight, eps):
    # torch's rms_norm is x * rsqrt(mean(x^2) + eps) as HF writes it out, through torch's fused
    # kernel where the device has one (aten._fused_rms_norm); the weight stays outside so that the
    # rounding to its dtype comes before the scaling, as above.
    h = torch.nn.functional.rms_norm(x.float(), x.shape[-1:], eps=eps)
    return weight * h.to(weight.dtype)


def _norm_backward(grad, x, weight, eps):
    xhat, rstd = rms_stats(x, eps)
    h = xhat.to(weight.dtype)  # the rounded norm the weight multiplied
    dw = (grad.float() * h.float()).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
    dx = rms_norm_input_grad(grad * weight, xhat, rstd)  # grad * weight in 16-bit, as autograd's
    return dx.to(x.dtype), dw


class _RMSNormFn(torch.autograd.Function):
    """weight * round(rms_norm(x in fp32)), keeping only x and the weight for the backward (autograd
    of the same expression keeps an fp32 copy of x and the rounded result too: 6 bytes per element
    of a 16-bit x instead of 2); ``fused``: both passes through compiled kernels."""

    @staticmethod
    def forward(ctx, x, weight, eps, fused):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.fused = eps, fused
        return (compiled(_norm) if fused else _norm)(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx, dw = (compiled(_norm_backward) if ctx.fused else _norm_backward)(grad, x, weight, ctx.eps)
        return dx, dw, None, None


class RMSNorm(torch.nn.Module):
    """x [..., hidden] → same shape and dtype. Weight [hidden] in config.params_dtype."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        # Under sequence parallelism a rank normalises only its own tokens: Megatron's
        # finalize_model_grads sums the gradients of parameters flagged so over the tensor-parallel group.
        self.weight.sequence_parallel = config.sequence_parallel
        self.eps = eps
        self.fused = False  # compiled kernels (actor.norm_kernel); the actor sets it after building

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps, self.fused)
