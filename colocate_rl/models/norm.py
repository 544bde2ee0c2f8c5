"""RMSNorm computed the way HF Qwen3 and vLLM compute it, for the local (no-TE) spec.

Megatron's local spec uses torch.nn.RMSNorm with an fp32 weight (it ignores params_dtype), so in
bf16 the norm weights become fp32 parameters and the scaling happens before the rounding. HF
normalises in fp32, rounds to the input dtype, then multiplies by a weight in the model dtype;
matching that order keeps the actor's bf16 logprobs close to the rollout engine's. The rounding
goes to the weight's dtype, which is the input's unless actor.fp32_residual keeps the residual
stream (the input here) in fp32 while the linears after the norm stay in the model dtype.
"""

from __future__ import annotations

import torch


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm is x * rsqrt(mean(x^2) + eps) as HF writes it out, through torch's fused
        # kernel where the device has one (aten._fused_rms_norm, with a fused backward); written out
        # it is five kernels each way. The weight stays outside so that the rounding to its dtype
        # comes before the scaling, as above.
        h = torch.nn.functional.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * h.to(self.weight.dtype)
