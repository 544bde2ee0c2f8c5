"""An FP8 DeepSeek-V4 engine's roundings inside the actor's forward (``actor.emulate_rollout_fp8``).

vLLM's DeepSeek-V4 holds the released FP8/MXFP4 weights, which the actor loads dequantised: at the
first step both sides have the same weights, yet their logprobs differ (0.064 per token on the
mini preset, docs/performance.md). Besides its weights, the engine rounds two things to FP8 that a
bf16 actor keeps in bf16, and benchmarks/gap/fp8_parts_cpu.py measures how far each moves the actor's
logprobs when applied to its own forward:
- **the input of every FP8 GEMM** (wq_a, wkv, wq_b, wo_a, wo_b, the indexer's wq_b, the shared
  experts' w1/w3 and w2): per token, in groups of 128 channels, to e4m3 with a power-of-two (UE8M0)
  scale, before the FP8 x FP8 GEMM;
- **the KV cache** (vLLM's ``fp8_ds_mla`` layout, the only one it builds for this model): every
  cached key (the K=V head, every compressed entry) keeps its leading 448 channels as e4m3 in
  blocks of 64 with UE8M0 scales, its trailing 64 rotary channels in bf16.
With this option the actor's forward applies the same roundings (vLLM's arithmetic: block amax
floored at 1e-4, scale 2^ceil(log2(amax / 448)), round to nearest e4m3), so the logprobs it trains
on are those of the function the engine samples from. The backward is straight-through: each
rounding passes its gradient unchanged, as quantisation-aware training does. Not emulated: the
indexer's own FP8 scoring, the kernels' accumulation order.
"""

from __future__ import annotations

import re

import torch

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
GEMM_GROUP = 128  # a GEMM input's scale covers this many channels of one token
KV_GROUP = 64  # a cached key's scale covers this many of its non-rotary channels
# Modules (below decoder.layers.N.) whose weight the released checkpoint holds as FP8 blocks: their
# input is rounded. wo_a is an einsum inside the attention, not a module (Attention.fp8_inputs).
FP8_LINEARS = re.compile(r"\.(self_attention\.(linear_q_down|linear_kv|linear_q_up|linear_proj|indexer\.linear_q_up)"
                         r"|mlp\.shared_experts\.linear_fc[12])$")
# Modules whose output vLLM caches: the K=V head's norm (RoPE only turns its trailing channels) and
# the attention's compressor (its entries); not the indexer's compressor, whose keys have a cache
# and a format of their own.
CACHED_KEYS = re.compile(r"\.self_attention\.(kv_layernorm|compressor)$")


def round_fp8(x: torch.Tensor, group: int, channels: int | None = None) -> torch.Tensor:
    """x [..., d] → the same shape and dtype: its first ``channels`` (default d) channels as vLLM
    stores them in e4m3 with one UE8M0 scale per ``group`` consecutive channels, scaled back; the
    rest as they are. A last group shorter than ``group`` takes the amax of what it has."""
    c = x.shape[-1] if channels is None else channels
    head = x[..., :c].float()
    pad = -c % group
    if pad:
        head = torch.nn.functional.pad(head, (0, pad))
    g = head.reshape(*head.shape[:-1], head.shape[-1] // group, group)
    scale = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR) / E4M3_MAX)))
    q = ((g / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale).flatten(-2)[..., :c]
    return torch.cat([q.to(x.dtype), x[..., c:]], dim=-1) if c < x.shape[-1] else q.to(x.dtype)


class _Rounded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, channels):
        return round_fp8(x, group, channels)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def fp8_rounded(x: torch.Tensor, group: int, channels: int | None = None) -> torch.Tensor:
    """round_fp8 in the forward, the identity in the backward (straight-through)."""
    return _Rounded.apply(x, group, channels)


def install(model: torch.nn.Module, rope_dim: int, gemm_inputs: bool = True, kv_cache: bool = True):
    """Makes ``model``'s forward round as the FP8 engine does (the module docstring): the input of its
    FP8 linears and of the attention's wo_a (``gemm_inputs``), the keys it caches (``kv_cache``).
    Returns a function that takes the roundings out again. Raises if nothing matched (a renamed
    module would otherwise round nothing)."""
    from colocate_rl.models.deepseek_v4.model import Attention

    hooks, attentions = [], []
    for name, m in model.named_modules():
        if gemm_inputs and FP8_LINEARS.search(name):
            hooks.append(m.register_forward_pre_hook(lambda m, args: (fp8_rounded(args[0], GEMM_GROUP), *args[1:])))
        elif kv_cache and CACHED_KEYS.search(name):
            hooks.append(m.register_forward_hook(
                lambda m, args, out: fp8_rounded(out, KV_GROUP, out.shape[-1] - rope_dim)))
        elif gemm_inputs and isinstance(m, Attention):
            m.fp8_inputs = True
            attentions.append(m)
    if not hooks and not attentions:
        raise ValueError("actor.emulate_rollout_fp8: no DeepSeek-V4 module to round in this model")

    def remove() -> None:
        for h in hooks:
            h.remove()
        for m in attentions:
            m.fp8_inputs = False

    return remove
