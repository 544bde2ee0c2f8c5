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
indexer's own FP8 scoring, the kernels' accumulation order. This module holds the roundings; which
modules of the model take them is the model's (model.emulate_fp8_engine).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
GEMM_GROUP = 128  # a GEMM input's scale covers this many channels of one token
KV_GROUP = 64  # a cached key's scale covers this many of its non-rotary channels
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
