"""Quantize-on-sync into DeepSeek-V4's released checkpoint layout (DeepSeek-V4-Flash).

What vLLM 0.26's DeepSeek-V4 loader takes (vllm/models/deepseek_v4/nvidia/model.py,
``DeepseekV4Model.load_weights`` and ``_make_deepseek_v4_weights_mapper``; quant_config.py
``DeepseekV4FP8Config``), under the official tensor names:

    <linear>.weight                     [M, N]       float8_e4m3fn
    <linear>.scale                      [⌈M/128⌉, ⌈N/128⌉]  float8_e8m0fnu   (→ vLLM's weight_scale_inv)
    layers.L.ffn.experts.E.w{1,2,3}.weight  [M, N/2]  int8, two e2m1 codes per byte, low nibble first
    layers.L.ffn.experts.E.w{1,2,3}.scale   [M, N/32] float8_e8m0fnu   (→ vLLM's w13_/w2_weight_scale)

The linears are attention wq_a, wkv (fused by vLLM into fused_wqa_wkv), wq_b, wo_a, wo_b, the
indexer's wq_b and the shared experts' w1/w2/w3. Everything else stays as the actor holds it: the
embedding and head, norms, mHC (hc_*), attention sinks, the compressors' wkv/wgate and ape, the
indexer's weights_proj (vLLM builds those with quant_config=None), and the router (ffn.gate).

The scales are ue8m0 (powers of two) and must travel as float8_e8m0fnu: vLLM's expert loader
reinterprets an e8m0 scale's bytes as its uint8 parameter, and would convert any other dtype by
value (2^-7 → 0).

The rounding follows DeepSeek's reference quantizers (inference/kernel.py of the release:
``act_quant`` with ``scale_fmt="ue8m0"`` and ``fp4_act_quant``), applied per weight block:
    amax = max(max |w| over the block, floor)         floor 1e-4 (FP8), 6·2^-126 (FP4)
    s    = 2^ceil(log2(amax · fp32(1/qmax)))          the product taken in float32, qmax 448 / 6
    q    = round_to_nearest_even(clamp(w / s, -qmax, qmax))
The release ships no weight quantizer of its own (its weights come from training); these are the
functions its kernels use for the same formats.

Because s is rounded up to a power of two, quantize(dequantize(q, s)) gives back the same values
but may re-encode a block whose largest code is small (e4m3 224, e2m1 3) as (2q, s/2): the same
numbers, a canonical encoding. Every block this module writes is canonical.
"""

from __future__ import annotations

import torch

BLOCK = 128  # FP8 weight blocks are BLOCK × BLOCK
GROUP = 32  # MXFP4: one scale per GROUP consecutive inputs
E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6 * 2.0**-126  # keeps s a normal float32 (≥ 2^-126)
# The kernels multiply by the reciprocal held in float32 (not divide): the same float32 here.
_INV = {E4M3_MAX: torch.tensor(1 / E4M3_MAX, dtype=torch.float32),
        E2M1_MAX: torch.tensor(1 / E2M1_MAX, dtype=torch.float32)}
# e2m1 magnitudes by code: 0, 0.5, 1, 1.5, 2, 3, 4, 6. Between codes k and k+1 the midpoint goes to
# the even code (round to nearest even): up at 0.75, 1.75, 3.5; down at 0.25, 1.25, 2.5, 5.
_E2M1_UP_AT = (0.75, 1.75, 3.5)
_E2M1_DOWN_AT = (0.25, 1.25, 2.5, 5.0)


def _require_finite(x: torch.Tensor, name: str, what: str, block: tuple[int, int]) -> None:
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        r, c = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"weight sync: tensor '{name}' holds inf/NaN at [{r}, {c}] ({what} block "
                         f"[{r // block[0]}, {c // block[1]}]); it cannot be quantized")


def _require_matrix(w: torch.Tensor, name: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"weight sync: tensor '{name}' has shape {tuple(w.shape)}; block quantization needs a "
                         "2-D weight")


def _pow2_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """ceil(log2(amax · fp32(1/qmax))) as int32, for float32 amax ≥ the floor (a normal float)."""
    mant, exp = torch.frexp(amax * _INV[qmax].to(amax.device))  # x = mant · 2^exp, mant in [0.5, 1)
    return exp - (mant == 0.5).to(exp.dtype)  # an exact power of two is its own ceiling


def _e8m0(exp: torch.Tensor) -> torch.Tensor:
    """2^exp as float8_e8m0fnu, written as its biased exponent byte (no rounding involved)."""
    return (exp + 127).to(torch.uint8).view(E8M0)


def quantize_fp8_ue8m0(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """w [M, N] (any float dtype) → (q [M, N] float8_e4m3fn, s [⌈M/128⌉, ⌈N/128⌉] float8_e8m0fnu), w ≈ q·s.
    Edge blocks cover the rows/columns that exist."""
    _require_matrix(w, name)
    x = w.float()
    _require_finite(x, name, "128x128", (BLOCK, BLOCK))
    m, n = x.shape
    bm, bn = -(-m // BLOCK), -(-n // BLOCK)
    padded = torch.nn.functional.pad(x, (0, bn * BLOCK - n, 0, bm * BLOCK - m))  # zeros: no effect on |max|
    blocks = padded.view(bm, BLOCK, bn, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=FP8_AMAX_FLOOR)  # [bm, bn]
    exp = _pow2_exponent(amax, E4M3_MAX)
    s = torch.ldexp(torch.ones_like(amax), exp)  # exact powers of two: x / s is exact
    # torch's float32 → e4m3fn cast rounds to nearest even, as the kernels' cvt does; the clamp first
    # keeps it finite (torch maps out-of-range values to NaN, the kernels saturate).
    q = (blocks / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.view(bm * BLOCK, bn * BLOCK)[:m, :n].contiguous(), _e8m0(exp)


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """y in [-6, 6] → e2m1 codes (uint8, sign in bit 3), rounded to nearest even; -0 keeps its sign."""
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t in _E2M1_DOWN_AT:
        code += a > t
    for t in _E2M1_UP_AT:
        code += a >= t
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def quantize_mxfp4(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """w [M, N] (N divisible by 32) → (packed [M, N/2] int8, s [M, N/32] float8_e8m0fnu), w ≈ e2m1·s.
    Byte j of a row holds element 2j in its low nibble and 2j+1 in its high nibble."""
    _require_matrix(w, name)
    m, n = w.shape
    if n % GROUP:
        raise ValueError(f"weight sync: tensor '{name}' has {n} input features; MXFP4 needs a multiple of {GROUP}")
    x = w.float()
    _require_finite(x, name, f"1x{GROUP}", (1, GROUP))
    groups = x.view(m, n // GROUP, GROUP)
    amax = groups.abs().amax(-1).clamp(min=FP4_AMAX_FLOOR)  # [M, N/32]
    exp = _pow2_exponent(amax, E2M1_MAX)
    s = torch.ldexp(torch.ones_like(amax), exp)
    codes = _e2m1_codes((groups / s[..., None]).clamp(-E2M1_MAX, E2M1_MAX)).view(m, n // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.view(torch.int8), _e8m0(exp)


def scale_name(weight: str) -> str | None:
    """``X.weight`` → ``X.scale`` (the released layout's scale beside its weight)."""
    return weight[: -len("weight")] + "scale" if weight.endswith(".weight") else None


def fp8_held(shape: tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The actor's [M, N] → (weight, scale) shapes in the engine's checkpoint."""
    m, n = shape
    return (m, n), (-(-m // BLOCK), -(-n // BLOCK))


def mxfp4_held(shape: tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    m, n = shape
    return (m, n // 2), (m, n // GROUP)


def mxfp4_unpacked(held: tuple[int, ...]) -> tuple[int, int]:
    """The engine's packed [M, N/2] → the actor's [M, N]."""
    return held[0], 2 * held[1]


__all__ = ["BLOCK", "E2M1_MAX", "E4M3_MAX", "GROUP", "fp8_held", "mxfp4_held", "mxfp4_unpacked",
           "quantize_fp8_ue8m0", "quantize_mxfp4", "scale_name"]
