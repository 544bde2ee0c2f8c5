"""Dequantisers for the formats released checkpoints ship (DeepSeek-V4-Flash uses both).

FP8 block: weight float8_e4m3fn [out, in], one scale per 128 x 128 block [ceil(out/128),
ceil(in/128)] (the last block of a dimension may be partial). MXFP4: two e2m1 values per byte
(low nibble first) [out, in/2] with one scale per 32 consecutive inputs [out, in/32]. Scales are
ue8m0 (a power of two: float8_e8m0fnu, or its raw exponent byte, 2^(byte-127)) or float32.
"""

from __future__ import annotations

import torch

# e2m1 code → value: sign bit 3, exponent bits 2..1, mantissa bit 0.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 (float8_e8m0fnu or the raw uint8 exponent) or float scales → float32."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    s = scale_to_float(scale).repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return s[: shape[0], : shape[1]]


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """weight [out, in] float8_e4m3fn, scale [ceil(out/b0), ceil(in/b1)] → [out, in] in ``dtype``."""
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale has shape {tuple(scale.shape)}, expected {want} for a {rows}x{cols} weight "
                         f"in {block[0]}x{block[1]} blocks")
    return (weight.float() * _expand(scale, block, (rows, cols))).to(dtype)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes (int8 / uint8 / float4_e2m1fn_x2) → [..., 2k] float32, low nibble first."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)
    values = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1)
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed [out, in/2], scale [out, in/32] → [out, in] in ``dtype``."""
    values = unpack_fp4(packed)
    rows, cols = values.shape
    if tuple(scale.shape) != (rows, cols // MXFP4_GROUP):
        raise ValueError(f"MXFP4 scale has shape {tuple(scale.shape)}, expected {(rows, cols // MXFP4_GROUP)} "
                         f"for a {rows}x{cols} weight")
    return (values * _expand(scale, (1, MXFP4_GROUP), (rows, cols))).to(dtype)


def is_quantized(weight: torch.Tensor) -> bool:
    return weight.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8) or weight.dtype == getattr(
        torch, "float4_e2m1fn_x2", None)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 block or MXFP4, told apart by the weight's dtype."""
    if weight.dtype == torch.float8_e4m3fn:
        return dequant_fp8_block(weight, scale, block, dtype)
    return dequant_mxfp4(weight, scale, dtype)


# ---------------------------------------------------------------- quantisers (writing test and tiny checkpoints)


def quant_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float → (float8_e4m3fn weight, ue8m0 scale per 128x128 block), the released format:
    the same quantiser the weight sync writes it with (weight_sync/released.py)."""
    from colocate_rl.weight_sync.released import quantize_fp8_ue8m0

    return quantize_fp8_ue8m0(w)


def quant_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float → (int8 [out, in/2] two e2m1 codes per byte, ue8m0 scale [out, in/32]), as the
    sync writes it."""
    from colocate_rl.weight_sync.released import quantize_mxfp4

    return quantize_mxfp4(w)
