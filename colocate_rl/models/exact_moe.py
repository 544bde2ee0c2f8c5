"""rollout.exact's MoE block (Qwen3-MoE): megatron-core's MoE layer whose forward is vLLM's router
top-k and fused experts (models/exact.py has the rest of the exact forward and its op table)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_layer import MoELayer


def experts_formula(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor) -> torch.Tensor:
    """The MoE block's function in fp32, the backward's reference. x [N, H]; weights [N, k] routing
    weights of experts ids [N, k]; w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I] (or sequences of
    E such matrices) → [N, H] float32:
    sum over j of weights[:, j] * w2[e] @ (silu(gate_e x) * up_e x), e = ids[:, j]."""
    n, k = ids.shape
    flat, token = ids.reshape(-1), torch.arange(n, device=x.device).repeat_interleave(k)
    weight = weights.reshape(-1, 1).float()
    out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    for e in flat.unique().tolist():
        slot = (flat == e).nonzero(as_tuple=True)[0]
        rows = token[slot]
        gate, up = (x[rows].float() @ w13[e].float().t()).chunk(2, dim=-1)
        out = out.index_add(0, rows, ((F.silu(gate) * up) @ w2[e].float().t()) * weight[slot])
    return out


def vllm_topk(x: torch.Tensor, logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's router top-k for a softmax MoE (its FusedTopKRouter: the topk_softmax CUDA kernel,
    softmax in fp32, ties to the lower expert id, renormalised inside the kernel): x [N, H], bf16
    logits [N, E] → (ids [N, k] int32, weights [N, k] float32)."""
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

    weights, ids, _ = fused_topk(x, logits, k, renormalize, indices_type=None, scoring_func="softmax")
    return ids, weights


def vllm_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor) -> torch.Tensor:
    """vLLM's unquantized fused experts as its batch-invariant mode runs them (TritonExperts: the
    Triton fused-MoE GEMMs at one fixed tile config, silu_and_mul, the routing weight applied to the
    second GEMM's fp32 accumulator, moe_sum over the k in slot order); fused_experts computes the
    same bits without the engine's workspace. x [N, H], w13 [E, 2I, H], w2 [E, H, I] → [N, H]."""
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    return fused_experts(x.contiguous(), w13.contiguous(), w2.contiguous(), weights, ids)


class _ExpertsFn(torch.autograd.Function):
    """vLLM's fused MoE forward (its batch-invariant Triton kernels) on the experts' weights stacked
    for the call; autograd of experts_formula backward, recomputed expert by expert on each expert's
    own weights. Only those are saved for the backward: the stacked copies (1.2 GB a layer at
    Qwen3-30B-A3B's width, 58 GB over its 48 layers) live only while the kernel runs."""

    @staticmethod
    def forward(ctx, x, weights, ids, *expert_weights):  # every expert's fc1, then every expert's fc2
        n = len(expert_weights) // 2
        ctx.save_for_backward(x, weights, ids, *expert_weights)
        return vllm_experts(x, weights, ids, torch.stack(expert_weights[:n]), torch.stack(expert_weights[n:]))

    @staticmethod
    def backward(ctx, grad):
        x, weights, ids, *expert_weights = ctx.saved_tensors
        n = len(expert_weights) // 2
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (x, weights, *expert_weights)]
            out = experts_formula(leaves[0], leaves[1], ids, leaves[2:2 + n], leaves[2 + n:])
            gx, gw, *gexp = torch.autograd.grad(out, leaves, grad.float(), allow_unused=True)
        # An expert no token chose gets zeros, as it did through torch.stack's backward (Megatron's
        # gradient buffers expect every parameter's gradient).
        gexp = [torch.zeros_like(w) if g is None else g.to(w.dtype) for g, w in zip(gexp, expert_weights)]
        return gx.to(x.dtype), gw.to(weights.dtype), None, *gexp


def routing_weights(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """[N, E] router logits, [N, k] chosen experts → [N, k] float32: the softmax over all experts at
    the chosen ones, divided by their sum when ``renormalize`` (Qwen3-MoE's norm_topk_prob)."""
    w = logits.float().softmax(dim=-1).gather(1, ids.long())
    return w / w.sum(dim=-1, keepdim=True) if renormalize else w


class ExactMoELayer(MoELayer):
    """Megatron's MoE layer (its router and experts' parameters, names and checkpoints unchanged)
    whose forward is vLLM's: the router's logits by the batch-invariant matmul, vLLM's top-k and
    routing weights, vLLM's fused experts. hidden [s, b, H] → ([s, b, H], None).

    With routing replay (R3) the replayed experts are used; a token whose replayed experts are
    vLLM's own top-k here keeps vLLM's routing weights, any other takes the fp32 formula's at the
    replayed experts (the sampler chose them from logits its decoding computed differently)."""

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        s, b, h = hidden_states.shape
        x = hidden_states.reshape(s * b, h)
        cfg = self.config  # one rank holds the whole block (plan.resolve checks tp = ep = 1)
        logits = F.linear(x, self.router.weight)  # aten::mm: vLLM's batch-invariant matmul (enable)
        k, renormalize = cfg.moe_router_topk, not cfg.moe_router_pre_softmax
        own_ids, own_weights = vllm_topk(x, logits, k, renormalize)
        ids = own_ids
        replay = getattr(self.router, "router_replay", None)
        replayed = replay.replay.ids(replay.column, s * b, k) if replay is not None else None
        if replayed is not None:
            replayed = replayed.to(own_ids.device)
            ordered = replayed.sort(dim=1).values  # a repeated expert: a position the sampler never routed
            unrouted = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1, keepdim=True)
            ids = torch.where(unrouted, own_ids.long(), replayed).to(own_ids.dtype)
        formula = routing_weights(logits, ids, renormalize)
        forward_weights = torch.where((ids == own_ids).all(dim=1, keepdim=True), own_weights, formula)
        weights = formula + (forward_weights - formula).detach()  # vLLM's values, the formula's gradient
        experts = self.experts.local_experts
        out = _ExpertsFn.apply(x, weights, ids, *[e.linear_fc1.weight for e in experts],
                               *[e.linear_fc2.weight for e in experts])
        return out.view(s, b, h), None
