"""A MoE layer's experts through torch's grouped GEMM (actor.expert_kernel), under megatron-core's
SequentialMLP names.

megatron-core's SequentialMLP runs each local expert as its own MLP: two matmuls, the activation
and the routing-weight product per expert, forward and backward, so a Qwen3-30B-A3B layer (128
experts) launches ~1,000 small operators per micro-batch. Its grouped expert layer needs
TransformerEngine. ``GroupedExperts`` keeps SequentialMLP's modules and parameter names
(``local_experts.{e}.linear_fc1.weight``: the mapping, the export, checkpoints and expert
parallelism are unchanged) and, when ``grouped`` is set, computes all local experts in two
``torch._grouped_mm`` calls (CUTLASS on CUDA, a loop on the CPU) around one activation call: the
same bits, several times as fast on a GPU (docs/performance.md, actor.expert_kernel).

Each grouped call stacks the experts' weights for the call and keeps only the experts' own
parameters for the backward, which restacks them: the stacked copy (0.8 GB for fc1 at
Qwen3-30B-A3B's width) lives only while its GEMM runs, never for the whole forward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


def _stacked(weights: tuple[torch.Tensor, ...], transposed: bool) -> torch.Tensor:
    """E weights [out, in] → [E, in, out] (``transposed``) or [E, out, in], column-major in the
    last two dimensions, the layout the grouped GEMM reads without another copy."""
    if transposed:
        return torch.stack(weights).transpose(1, 2)
    return torch.stack([w.t() for w in weights]).transpose(1, 2)


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offs, *weights):
        ctx.save_for_backward(x, offs, *weights)
        return torch._grouped_mm(x, _stacked(weights, transposed=True), offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, offs, *weights = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, _stacked(weights, transposed=False), offs=offs) \
            if ctx.needs_input_grad[0] else None
        # dW_e = dy_e^T x_e: the groups run along the token dimension (the GEMMs' K). dy^T column-major
        # and x row-major, as they lie: a group then starts at a multiple of a row's bytes, which CUDA's
        # kernel needs 16-byte aligned (with dy^T row-major it needs each expert's token count to be
        # a multiple of 8 and asserts on the device otherwise).
        dw = torch._grouped_mm(dy.t(), x, offs=offs)
        return (dx, None, *dw.unbind(0))


def grouped_linear(x: torch.Tensor, offs: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """x [N, in] with rows grouped by expert (group e ends at offs[e], int32 cumulative counts),
    weights E × [out, in] → [N, out]: each group times its expert's weight, transposed (F.linear)."""
    return _GroupedLinearFn.apply(x, offs, *weights)


@functools.cache
def grouped_gemm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs for ``dtype`` on this kind of device (CUDA's needs a
    Hopper-class GPU and a 16-bit dtype; the CPU's runs everywhere): one tiny call, once."""
    try:
        x = torch.ones(16, 16, dtype=dtype, device=device_type)
        w = torch.ones(2, 16, 16, dtype=dtype, device=device_type)
        torch._grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([8, 16], dtype=torch.int32, device=device_type))
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class GroupedExperts(SequentialMLP):
    """SequentialMLP whose forward, when ``grouped`` is set, runs every local expert in two grouped
    GEMMs. The actor sets ``grouped`` (actor.expert_kernel); ``why_not_grouped`` names what keeps
    this layer from it (None: it can), the Qwen3 and DeepSeek-V4 specs' experts (SwiGLU, clamped or
    not) being the ones it serves."""

    grouped = False

    @property
    def why_not_grouped(self) -> Optional[str]:
        cfg = self.config
        for blocked, why in (
                (self.tp_group.size() > 1, "the experts have tensor parallelism"),
                (cfg.add_bias_linear, "the experts have a bias"),
                (cfg.fp8 or cfg.fp4, "the experts run in FP8/FP4"),
                # the grouped GEMM reads rows at 16-byte aligned strides
                (cfg.hidden_size % 8 or cfg.moe_ffn_hidden_size % 8,
                 f"hidden {cfg.hidden_size} or expert width {cfg.moe_ffn_hidden_size} is not a multiple of 8"),
                (not cfg.use_te_activation_func, "the activation is not a module"),
                (cfg.moe_apply_probs_on_input, "the routing weights scale the experts' input"),
                (self.num_local_experts == 1, "each rank holds a single expert")):
            if blocked:
                return why
        return None

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """[N, h] tokens sorted by local expert, tokens_per_expert [E], probs [N] → ([N, h], None)."""
        if not self.grouped:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        offs = torch.cumsum(tokens_per_expert.to(x.device), 0, dtype=torch.int32)
        experts = self.local_experts
        h = grouped_linear(x.reshape(-1, x.shape[-1]).contiguous(), offs, [e.linear_fc1.weight for e in experts])
        h = experts[0].activation_func(h)  # every expert's activation module is the same function
        # As megatron-core's MLP applies an expert's routing weight: after the activation, in its dtype.
        h = (h * permuted_probs.unsqueeze(-1)).to(x.dtype)
        out = grouped_linear(h, offs, [e.linear_fc2.weight for e in experts])
        return out.view(*x.shape[:-1], out.shape[-1]), None


def with_grouped_experts(mlp: functools.partial) -> functools.partial:
    """A MoE layer's spec (megatron-core's partial of MoELayer) whose experts are GroupedExperts;
    any other MLP spec unchanged."""
    sub = mlp.keywords.get("submodules")
    experts = getattr(sub, "experts", None)
    if experts is None or experts.func is not SequentialMLP:
        return mlp
    grouped = functools.partial(GroupedExperts, *experts.args, **experts.keywords)
    return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": dataclasses.replace(sub, experts=grouped)})
