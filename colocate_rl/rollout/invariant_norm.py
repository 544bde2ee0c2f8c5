"""vLLM's batch-invariant mode, completed for the residual stream's norms (rollout.exact).

In vLLM 0.26 every RMSNorm that follows a residual add runs ``fused_add_rms_norm``, a CUDA kernel
whose thread block is 1,024 wide when the launch holds fewer than 256 tokens and 256 wide otherwise.
The block width sets the order of the sum of squares, so the same row normalises to different bits
in a decode step of 32 sequences and in a prefill of 3,000 tokens: in exact mode the sampler's
logprobs then differed from the actor's on most tokens of a small batch and on the late decode
steps of a large one (docs/lab/performance_log.md, *Exact on-policy mode*).

``install`` replaces that path with the residual add and vLLM's Triton row norm, whose result does
not depend on the launch; the actor's exact forward (models/exact.py) normalises the stream with the
same Triton kernel. It runs in every process that runs vLLM's model: the engine's own (through the
worker extension's import, rollout/extension.py) and ours for an in-process engine.
"""

from __future__ import annotations

import os

_INSTALLED = False


def add_rms_norm(x, weight, eps: float, residual, norm):
    """vLLM's ``fused_add_rms_norm`` contract, batch-invariant: ``residual`` becomes x + residual
    (rounded to the dtype, as torch adds), ``x`` the row norm ``norm`` of it; both written in place,
    as the fused kernel writes them, and returned. x, residual [..., hidden]; weight [hidden] or None."""
    residual.add_(x)
    x.copy_(norm(residual, weight, eps))
    return x, residual


def install() -> bool:
    """Routes vLLM's residual-stream norms through :func:`add_rms_norm` (its Triton row norm) in this
    process when vLLM's batch-invariant mode is on (``VLLM_BATCH_INVARIANT=1``). Idempotent; True
    when installed."""
    global _INSTALLED
    if _INSTALLED or os.environ.get("VLLM_BATCH_INVARIANT", "0") in ("", "0"):
        return _INSTALLED
    from vllm.model_executor.layers import layernorm

    try:
        from vllm.model_executor.layers import batch_invariant  # vLLM 0.26
    except ImportError:
        from vllm.model_executor.determinism import batch_invariant  # its later home

    triton_norm = batch_invariant.rms_norm_batch_invariant  # without residual: one Triton program per row

    def rms_norm_batch_invariant(input, weight, eps=1e-6, residual=None):
        if residual is None:
            return triton_norm(input, weight, eps)
        return add_rms_norm(input, weight, eps, residual, triton_norm)

    # layernorm.py calls the name it imported: both bindings change.
    batch_invariant.rms_norm_batch_invariant = layernorm.rms_norm_batch_invariant = rms_norm_batch_invariant
    _INSTALLED = True
    return True
