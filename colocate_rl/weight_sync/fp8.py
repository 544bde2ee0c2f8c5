"""Quantize-on-sync for an FP8 rollout: per-block (128×128) e4m3 weights and their scales.

A rollout checkpoint in the DeepSeek block-FP8 format (``quantization_config.weight_block_size =
[128, 128]``, as DeepSeek-V3/V4 ship) holds, for each quantized linear ``X.weight`` [M, N]:

    X.weight            [M, N]                      float8_e4m3fn
    X.weight_scale_inv  [ceil(M/128), ceil(N/128)]  float32, the dequantization scale: W ≈ q * s

(the name says "inv" but the value multiplies; vLLM's Fp8LinearMethod reads it as such). The actor
trains in bf16/fp32, so the sender quantizes each such weight before packing, and the engine must
then run its post-load processing (``process_weights_after_loading``): vLLM converts e4m3fn to
e4m3fnuz on ROCm (doubling the scales), or re-lays weights and scales for its GEMM backend. A byte
copy into the live parameters would skip that and leave the quantization state wrong; the worker
extension reloads layer by layer for quantized engines for that reason (rollout/extension.py).

Which weights are quantized is read from the engine's own checkpoint: a weight whose
``<name>_scale_inv`` exists there (weight_sync/quantize.py matches every layout it knows, this one
and DeepSeek-V4's released one, weight_sync/released.py). Nothing here needs an FP8-capable
device: it is plain torch.
"""

from __future__ import annotations

import torch

BLOCK = 128
E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
# The block max is floored as DeepGEMM's and vLLM's reference quantizer floor it, so an all-zero
# (or nearly zero) block gets a finite scale and the same values as vLLM's own quantizer.
AMAX_FLOOR = 1e-4
SCALE_SUFFIX = "_scale_inv"


def quantize_block_fp8(w: torch.Tensor, block: int = BLOCK, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """w [M, N] (any float dtype) → (q [M, N] float8_e4m3fn, scale [ceil(M/block), ceil(N/block)] float32)
    with w ≈ q.float() * scale expanded over each block. Each block's scale maps its largest
    magnitude to e4m3's largest finite value (448); edge blocks cover the rows/columns that exist.
    ``name`` only labels errors (a non-matrix, inf/NaN)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_block_fp8: expected a 2-D weight, got shape {tuple(w.shape)} for '{name}'")
    m, n = w.shape
    bm, bn = -(-m // block), -(-n // block)
    x = torch.zeros(bm * block, bn * block, dtype=torch.float32, device=w.device)
    x[:m, :n] = w.float()
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        r, c = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"weight sync: tensor '{name}' holds inf/NaN at [{r}, {c}] (block [{r // block}, "
                         f"{c // block}]); it cannot be quantized")
    blocks = x.view(bm, block, bn, block)  # [bm, block, bn, block]
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR)  # [bm, bn]
    scale = amax / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.view(bm * block, bn * block)[:m, :n].contiguous(), scale.contiguous()


def dequantize_block_fp8(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Inverse of quantize_block_fp8 (up to the rounding): [M, N] float32."""
    m, n = q.shape
    s = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:m, :n]
    return q.float() * s


def scale_name(weight: str) -> str | None:
    """``X.weight`` → ``X.weight_scale_inv``."""
    return weight + SCALE_SUFFIX if weight.endswith("weight") else None


def held(shape: tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The actor's [M, N] → (weight, scale) shapes in the engine's checkpoint."""
    m, n = shape
    return (m, n), (-(-m // BLOCK), -(-n // BLOCK))


__all__ = ["BLOCK", "E4M3_MAX", "dequantize_block_fp8", "held", "quantize_block_fp8", "scale_name"]
