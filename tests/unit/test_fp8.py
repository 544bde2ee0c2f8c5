"""Per-block FP8 quantize-on-sync against vLLM's reference block quantizer (DeepGEMM's math)."""

from __future__ import annotations

import pytest
import torch

from colocate_rl.weight_sync.buckets import pack, unpack
from colocate_rl.weight_sync.fp8 import E4M3_MAX, dequantize_block_fp8, quantize_block_fp8
from colocate_rl.weight_sync.quantize import quantize_named, sync_plan


def _ordinal(q: torch.Tensor) -> torch.Tensor:
    """e4m3 bit patterns → integers in value order, so |a - b| counts representable steps (ULPs)."""
    bits = q.view(torch.uint8).to(torch.int32)
    mag = bits & 0x7F
    return torch.where(bits & 0x80 > 0, -mag, mag)


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (7, 129), (128, 1)])
def test_matches_reference_within_one_ulp(shape):
    vllm_dg = pytest.importorskip("vllm.utils.deep_gemm")
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[1])[None, :]  # blocks of very different scale
    w[:3, :5] = 0.0
    q, s = quantize_block_fp8(w.to(torch.bfloat16))
    ref_q, ref_s = vllm_dg.per_block_cast_to_fp8(w.to(torch.bfloat16), [128, 128], use_ue8m0=False)
    assert q.dtype == torch.float8_e4m3fn == ref_q.dtype and q.shape == w.shape
    assert s.shape == ref_s.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and s.dtype == torch.float32
    torch.testing.assert_close(s, ref_s.float(), rtol=1e-6, atol=0)
    ulps = (_ordinal(q) - _ordinal(ref_q)).abs()
    assert int(ulps.max()) <= 1, f"{int((ulps > 1).sum())} values differ by more than one e4m3 ULP"


def test_dequantized_error_is_bounded_per_block():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 260, generator=g)
    q, s = quantize_block_fp8(w)
    back = dequantize_block_fp8(q, s)
    # e4m3 has 3 mantissa bits: the rounding error is at most half a step, 2^-4 of the value's
    # binade, so relative to the block max (448 maps to it) at most 1/16.
    blockmax = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260] * E4M3_MAX
    assert float(((back - w).abs() / blockmax).max()) <= 1 / 16
    assert float(q.float().abs().max()) == E4M3_MAX  # each block's largest value uses the full range


def test_quantize_named_follows_the_engine_checkpoint_and_packs():
    engine = {"model.layers.0.mlp.down_proj.weight": (64, 256),
              "model.layers.0.mlp.down_proj.weight_scale_inv": (1, 2),
              "model.norm.weight": (64,)}
    plan = sync_plan(engine)
    assert plan == {"model.layers.0.mlp.down_proj.weight": "fp8_block"}
    named = [("model.layers.0.mlp.down_proj.weight", torch.randn(64, 256)), ("model.norm.weight", torch.ones(64))]
    out = dict(quantize_named(iter(named), plan))
    assert {k: tuple(v.shape) for k, v in out.items()} == engine
    assert out["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    # The same bucket format carries FP8: one bucket per dtype, round trip bit-exact.
    got = {n: t for b in pack(out.items(), bucket_mb=1) for n, t in unpack(b)}
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"].view(torch.uint8),
                       out["model.layers.0.mlp.down_proj.weight"].view(torch.uint8))


def test_rejects_non_matrix():
    with pytest.raises(ValueError, match="2-D weight"):
        quantize_block_fp8(torch.ones(4))
