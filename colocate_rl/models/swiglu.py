"""SwiGLU as a module of the local (no-TE) spec, keeping only its input for the backward.

megatron-core's local MLP computes ``silu(gate) * (up + glu_linear_offset)`` with autograd, which
keeps three tensors per token for the backward: fc1's output (gate | up), silu(gate) and the offset
copy of up. This module computes the same bits and keeps fc1's output alone; the backward is the
closed form. Measured by benchmarks/memory/activation_census.py: the MLP's saved bytes go from 4 x ffn to
2 x ffn per token (16-bit), the largest single saving in a Qwen3 layer.

megatron-core calls an MLP's activation module only under ``use_te_activation_func`` (the Qwen3
config sets it); a MoE's experts take theirs from the same spec (``with_activation``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor, limit: Optional[float] = None) -> torch.Tensor:
    """[..., 2 * ffn] (gate | up) → [..., ffn]: silu(gate) * up, as megatron-core's local MLP; with
    ``limit`` (its activation_func_clamp_value, DeepSeek-V4's swiglu_limit) gate ≤ limit and
    |up| ≤ limit first."""
    gate, up = x.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def swiglu_backward(grad: torch.Tensor, x: torch.Tensor, limit: Optional[float] = None) -> torch.Tensor:
    """grad [..., ffn], x [..., 2 * ffn] (gate | up) → d/dx of swiglu(x, limit), in x's dtype: the
    closed form through torch's fused SiLU backward (no autograd graph of its own); a clamped
    element gets no gradient, as through torch's clamp."""
    gate, up = x.chunk(2, dim=-1)
    if limit is None:
        return torch.cat((torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)), dim=-1)
    g, u = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    dgate = torch.ops.aten.silu_backward(grad * u, g) * (gate <= limit)
    dup = grad * F.silu(g) * ((up >= -limit) & (up <= limit))
    return torch.cat((dgate, dup), dim=-1)


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kernel, limit):
        ctx.save_for_backward(x)
        ctx.limit = limit
        return kernel(x) if limit is None else kernel(x, limit)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return swiglu_backward(grad, x, ctx.limit), None, None


class SwiGLU(torch.nn.Module):
    """[..., 2 * ffn] (gate | up) → [..., ffn] by ``kernel`` (subclasses swap it), its input the
    only tensor kept for the backward; clamped at the config's activation_func_clamp_value."""

    kernel = staticmethod(swiglu)

    def __init__(self, config=None, **kwargs):
        super().__init__()
        self.limit = getattr(config, "activation_func_clamp_value", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SwiGLUFn.apply(x, self.kernel, self.limit)


def with_activation(mlp: functools.partial, module: type) -> functools.partial:
    """A layer spec's MLP builder (megatron-core's partial of MLP.as_mlp_submodule, or of MoELayer
    with experts and shared experts) whose every MLP uses ``module`` as its activation."""
    def patch(builder):
        return functools.partial(builder.func, *builder.args, **{
            **builder.keywords, "submodules": dataclasses.replace(builder.keywords["submodules"],
                                                                  activation_func=module)})

    sub = mlp.keywords["submodules"]
    if hasattr(sub, "experts"):  # MoESubmodules
        shared = None if sub.shared_experts is None else patch(sub.shared_experts)
        sub = dataclasses.replace(sub, experts=patch(sub.experts), shared_experts=shared)
        return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": sub})
    return patch(mlp)
