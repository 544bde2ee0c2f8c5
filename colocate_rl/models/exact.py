"""Exact on-policy mode (``rollout.exact``): the actor's forward runs vLLM's own kernels, op for op.

The trainer/sampler logprob gap comes from the two sides computing the same function with different
kernels (reduction orders of norms, rotary, attention and softmax; fused vs separate rounding:
docs/performance.md has the per-op table). With vLLM in its batch-invariant mode
(``VLLM_BATCH_INVARIANT=1``: a row's result does not depend on the batch around it), the actor
reproduces vLLM's forward bit for bit by calling the very kernels vLLM calls, in the same order and
dtypes. One kernel of vLLM's is not batch-invariant: the residual stream's fused add + RMSNorm
(its block width depends on how many tokens the launch holds); the engine runs the add and the
Triton row norm instead (rollout/invariant_norm.py), and so does the actor. The logprobs are
taken as the engine's model runner takes them (registry.exact_samples_on_v2; docs/performance.md):

| op | vLLM (Qwen3, batch-invariant, eager) | here |
|---|---|---|
| linears | Triton persistent matmul (``linear_batch_invariant``) | the same kernel, through ``aten::mm`` (``enable``) |
| RMSNorm (every one: layer inputs, q/k, before the MLP, final) | ``rms_norm_batch_invariant`` (Triton), after the residual add where there is one (rollout/invariant_norm.py) | the same kernel, after megatron-core's residual add |
| rotary | ``_C.rotary_embedding``, its cos/sin cache built on the GPU at load | the same kernel, the cache built by vLLM's class |
| attention | FlashAttention 3 varlen, ``num_splits=1`` | the same, on unpaged K/V |
| SiLU-and-mul | ``_C.silu_and_mul`` | the same |
| MoE router top-k (Qwen3-MoE) | ``topk_softmax`` (fp32 softmax, renormalised in the kernel) | the same (``fused_topk``, models/exact_moe.py) |
| MoE experts | Triton fused-MoE GEMMs at one fixed tile config, ``moe_sum`` | the same (``fused_experts``) |
| logprobs, V2 runner (dense models) | temperature kernel on the bf16 logits, then ``compute_token_logprobs`` | the same kernels |
| logprobs, V1 runner (MoE models, R3) | ``log_softmax`` of fp32 logits / temperature (a tensor) | the same |

Backward passes need not be batch-invariant, so they take the cheapest correct route: the closed
form in fp32 for the norms and SwiGLU (no nested autograd graph: exact mode's train step is bound by
the host, not the GPU), vLLM's rotary kernel run by minus the angle, SDPA's autograd for attention,
and cuBLAS for the matmuls (``forward_mm``). Gradients are the function's, within the usual
tolerance. Needs CUDA and vLLM's GPU build; on anything else the run stops at config time
(colocate_rl.plan).
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

from colocate_rl.models.norm import RMSNorm, rms_norm_backward
from colocate_rl.models.swiglu import SwiGLU, with_activation

ENV = "VLLM_BATCH_INVARIANT"


def enable() -> None:
    """Batch-invariant kernels for this process and every engine it starts (before any CUDA matmul:
    cuBLAS reads its workspace settings when its handle is created)."""
    os.environ[ENV] = "1"
    import vllm.envs as envs

    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    from vllm.model_executor.layers import batch_invariant as bi
    from vllm.platforms import current_platform

    bi.init_batch_invariance()
    global _MM
    if _MM is None and not current_platform.is_device_capability_family(80):
        # On Hopper and later vLLM leaves torch's matmuls to cuBLAS but calls its Triton persistent
        # matmul in every linear layer (linear_batch_invariant): route this process's matmuls, which
        # Megatron's linears make through aten::mm, to the same kernel (on Ampere vLLM does it).
        _MM = torch.library.Library("aten", "IMPL")
        _MM.impl("aten::mm", functools.partial(forward_mm, bi.mm_batch_invariant), "CUDA")


_MM = None  # the aten::mm override, once registered (a torch.library.Library must stay alive)


def forward_mm(invariant_mm, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[m, k] @ [k, n] → [m, n]: vLLM's batch-invariant matmul in forward passes, cuBLAS inside a
    backward pass. Gradients need not be batch-invariant, and the backward holds two thirds of a
    linear's FLOPs; ``aten::mm.out`` is a separate operator that the override leaves native. A
    forward recomputed inside the backward (activation recompute) feeds only gradients, so it may
    take cuBLAS too."""
    if torch._C._current_graph_task_id() == -1:  # -1: not inside autograd's backward
        return invariant_mm(a, b)
    return torch.mm(a, b, out=a.new_empty((a.shape[0], b.shape[1])))


def model_kwargs(kwargs: dict) -> dict:
    """GPTModel keyword arguments of exact mode: rotary moves into ExactAttention (vLLM's kernel)."""
    return {**kwargs, "position_embedding_type": "none"}


def layer_spec(config, rope_base: float, max_position: int, pp_rank: Optional[int] = None):
    """Block spec of this pipeline stage (``pp_rank``: this process's) for a Qwen3 dense or MoE
    model: local modules with every norm, the core attention (rotary included), the SwiGLU and each
    MoE block (router top-k and experts) replaced by vLLM's kernels."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from colocate_rl.models.exact_moe import ExactMoELayer

    spec = copy.copy(get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                                pp_rank=pp_rank))
    norm = ModuleSpec(module=ExactRMSNorm)
    rope = dict(base=float(rope_base), max_position=int(max_position))
    spec.layer_norm = norm
    # One spec object may stand for every layer, and megatron-core's own: copy each level changed.
    spec.layer_specs = [copy.copy(layer) for layer in spec.layer_specs]
    for layer in spec.layer_specs:
        sub = layer.submodules = copy.copy(layer.submodules)
        sub.input_layernorm = sub.pre_mlp_layernorm = norm
        sub.self_attention = copy.copy(sub.self_attention)
        attn = sub.self_attention.submodules = copy.copy(sub.self_attention.submodules)
        attn.core_attention = ModuleSpec(module=ExactAttention, params=rope)
        attn.q_layernorm = attn.k_layernorm = norm
        # megatron-core gives the MLP as partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...)),
        # a MoE layer as partial(MoELayer, submodules=MoESubmodules(...)).
        mlp = with_activation(sub.mlp, ExactSwiGLU)
        if isinstance(mlp.func, type) and issubclass(mlp.func, MoELayer):
            mlp = functools.partial(ExactMoELayer, *mlp.args, **mlp.keywords)
        sub.mlp = mlp
    return spec


# ---------------------------------------------------------------- norms


class _NormFn(torch.autograd.Function):
    """vLLM's Triton row norm forward; the closed-form fp32 backward."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_batch_invariant(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return (*rms_norm_backward(grad, x, weight, ctx.eps), None)


class ExactRMSNorm(RMSNorm):
    """x [..., hidden] → same shape and dtype, by the kernel vLLM's every RMSNorm runs in exact mode
    (the Triton row norm; after the residual add where there is one: rollout/invariant_norm.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NormFn.apply(x, self.weight, self.eps)


# ---------------------------------------------------------------- SwiGLU


def _vllm_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    torch.ops._C.silu_and_mul(out, x.contiguous())
    return out


class ExactSwiGLU(SwiGLU):
    """[..., 2 * ffn] (gate | up) → [..., ffn]: silu(gate) * up by vLLM's kernel."""

    kernel = staticmethod(_vllm_silu_and_mul)


# ---------------------------------------------------------------- rotary + attention


def rope_cache(head_dim: int, base: float, max_position: int, dtype: torch.dtype) -> torch.Tensor:
    """[max_position, head_dim] cos | sin, as vLLM's RotaryEmbedding builds it on the GPU at load."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()), torch.device(torch.cuda.current_device()):  # a CustomOp
        rope = RotaryEmbedding(head_dim, head_dim, max_position, base, True, dtype)
    return rope.cos_sin_cache.to(dtype)


class _RopeFn(torch.autograd.Function):
    """(q [N, heads, hd], k [N, groups, hd]) rotated (NeoX halves) by vLLM's kernel, on copies (it
    works in place). The backward is the same kernel rotating the gradients back: ``inverse`` is
    ``cache`` with sin negated (a rotation's transpose is the rotation by minus the angle)."""

    @staticmethod
    def forward(ctx, q, k, positions, cache, inverse):
        q, k = _rotate(q, k, positions, cache)
        ctx.save_for_backward(positions, inverse)
        return q, k

    @staticmethod
    def backward(ctx, gq, gk):
        positions, inverse = ctx.saved_tensors
        return (*_rotate(gq, gk, positions, inverse), None, None, None)


def _rotate(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor):
    from vllm import _custom_ops as ops

    # As vLLM's Qwen3 calls it: [tokens, heads * hd] (its CPU build reads heads from the last dim).
    q2, k2 = q.reshape(q.shape[0], -1).clone(), k.reshape(k.shape[0], -1).clone()
    ops.rotary_embedding(positions, q2, k2, q.shape[-1], cache, True)
    return q2.view(q.shape), k2.view(k.shape)


def inverse_rope_cache(cache: torch.Tensor) -> torch.Tensor:
    """cos | sin → cos | -sin: the cache that rotates by minus each position's angle."""
    cos, sin = cache.chunk(2, dim=-1)
    return torch.cat((cos, -sin), dim=-1)


class _AttentionFn(torch.autograd.Function):
    """Causal attention over right-padded rows of equal length, [b*s, heads, hd]: FlashAttention 3
    forward as vLLM calls it; backward through SDPA's autograd on the same inputs."""

    @staticmethod
    def forward(ctx, q, k, v, b, s, scale):
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
        out = flash_attn_varlen_func(q, k, v, max_seqlen_q=s, cu_seqlens_q=cu, max_seqlen_k=s, cu_seqlens_k=cu,
                                     softmax_scale=scale, causal=True, fa_version=3, num_splits=1)
        ctx.save_for_backward(q, k, v)
        ctx.shape = (b, s, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        b, s, scale = ctx.shape
        with torch.enable_grad():
            qs, ks, vs = (x.detach().view(b, s, x.shape[1], x.shape[2]).transpose(1, 2).requires_grad_()
                          for x in (q, k, v))
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                 enable_gqa=qs.shape[1] != ks.shape[1])
            g = grad.view(b, s, grad.shape[1], grad.shape[2]).transpose(1, 2)
            gq, gk, gv = torch.autograd.grad(out, (qs, ks, vs), g)
        return tuple(x.transpose(1, 2).reshape(b * s, x.shape[1], x.shape[3]) for x in (gq, gk, gv)) + (None,) * 3


class ExactAttention(torch.nn.Module):
    """Drop-in for Megatron's core attention (causal, no packing) that also applies the rotary
    embedding (GPTModel built with position_embedding_type='none'), both by vLLM's kernels.

    query [s, b, heads/tp, hd], key/value [s, b, groups/tp, hd] → context [s, b, heads/tp * hd].
    Rows are right-padded: position p of every row is token p.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, base: float = 10000.0,
                 max_position: int = 4096):
        super().__init__()
        if config.context_parallel_size != 1:
            raise ValueError("rollout.exact does not support context parallelism")
        self.config = config
        self.softmax_scale = softmax_scale or config.kv_channels ** -0.5  # as vLLM's Qwen3 writes it
        self.base, self.max_position = base, max_position
        self._cache: Optional[torch.Tensor] = None  # vLLM's cos | sin, and its inverse
        self._inverse: Optional[torch.Tensor] = None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("ExactAttention takes neither packed sequences nor an attention bias")
        s, b, heads, hd = query.shape
        if self._cache is None or self._cache.dtype != query.dtype:
            self._cache = rope_cache(hd, self.base, self.max_position, query.dtype)
            self._inverse = inverse_rope_cache(self._cache)
        q, k, v = (x.transpose(0, 1).reshape(b * s, x.shape[2], hd) for x in (query, key, value))
        positions = torch.arange(s, device=q.device).repeat(b)
        q, k = _RopeFn.apply(q, k, positions, self._cache, self._inverse)
        out = _AttentionFn.apply(q, k, v.contiguous(), b, s, self.softmax_scale)  # [b*s, heads, hd]
        return out.view(b, s, heads * hd).transpose(0, 1).contiguous()


# ---------------------------------------------------------------- logprobs


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *,
                   v2: bool) -> torch.Tensor:
    """logits [b, t, V/tp] → [b, t] float32 (out[:, 0] = 0), as vLLM's sampler computes its processed
    logprobs. ``v2`` (registry.exact_samples_on_v2): the logits in their own dtype, divided by the
    temperature in place by V2's temperature kernel (fp32 division, stored back in that dtype), then
    V2's log-softmax kernel, which reads the sampled token's logit and reduces each row in blocks of
    1,024. V1: fp32 logits divided by a temperature *tensor* (a Python scalar would become a
    multiplication by its reciprocal), then log_softmax."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    x = gather_from_tensor_model_parallel_region(logits)
    if v2:
        b, t, vocab = x.shape
        nxt = F.pad(tokens[:, 1:], (0, 1))  # each position's next token; the last row's is a dummy
        lp = _V2LogprobFn.apply(x.reshape(b * t, vocab), nxt.reshape(-1), temperature).view(b, t)
        return F.pad(lp[:, :-1], (1, 0))
    x = x.float()
    if temperature != 1.0:
        x = x / torch.full((1,), temperature, dtype=torch.float32, device=x.device)
    lp = x.log_softmax(dim=-1, dtype=torch.float32)
    return F.pad(lp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1), (1, 0))


class _V2LogprobFn(torch.autograd.Function):
    """logits [n, V], ids [n] → [n] float32: V2's kernels forward; the softmax backward in fp32."""

    @staticmethod
    def forward(ctx, x, ids, temperature):
        from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
        from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

        scaled = x
        if temperature != 1.0:  # the kernel writes in place; x belongs to autograd
            scaled = x.clone()
            row_to_request = torch.zeros(x.shape[0], dtype=torch.int32, device=x.device)
            apply_temperature(scaled, row_to_request, torch.full((1,), temperature, dtype=torch.float32,
                                                                 device=x.device))
        ctx.save_for_backward(scaled, ids)
        ctx.temperature = temperature
        return compute_token_logprobs(scaled, ids[:, None]).squeeze(1)

    @staticmethod
    def backward(ctx, grad):
        scaled, ids = ctx.saved_tensors
        return logprob_backward(scaled, ids, grad, ctx.temperature), None, None


def logprob_backward(scaled: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, temperature: float,
                     chunk_elements: int = 1 << 26) -> torch.Tensor:
    """Gradient of log softmax(scaled)[ids] with respect to the unscaled logits (scaled = x / T):
    (onehot(ids) - softmax(scaled)) * grad / T. scaled [n, V], ids [n], grad [n] float32 → [n, V]
    in scaled's dtype; in row chunks of at most ``chunk_elements`` fp32 temporaries."""
    out = torch.empty_like(scaled)
    step = max(1, chunk_elements // scaled.shape[1])
    for i in range(0, scaled.shape[0], step):
        g = grad[i:i + step, None].float() / temperature
        d = scaled[i:i + step].float().softmax(-1).mul_(-g)
        d.scatter_add_(1, ids[i:i + step, None], g)
        out[i:i + step] = d
    return out
