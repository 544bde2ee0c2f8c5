"""Quantize-on-sync into DeepSeek-V4's released layout, against a reference quantiser written here
from the release's own kernels (inference/kernel.py: ``act_quant`` with ``scale_fmt="ue8m0"``,
``fp4_act_quant``): amax floored (1e-4 / 6·2^-126), scale = fast_pow2(fast_log2_ceil(amax ·
fp32(1/qmax))) by IEEE bit manipulation, values clamped then rounded to the nearest representable
value, ties to the even code. The reference shares no code with colocate_rl: it finds nearest values
by search over the format's value table instead of casting."""

from __future__ import annotations

import json
import re

import pytest
import torch

from colocate_rl.weight_sync.buckets import pack, unpack
from colocate_rl.weight_sync.quantize import quantize_named, sync_plan
from colocate_rl.weight_sync.released import quantize_fp8_ue8m0, quantize_mxfp4

# ---------------------------------------------------------------- the reference


def _log2_ceil(x: torch.Tensor) -> torch.Tensor:
    """kernel.py fast_log2_ceil: biased exponent - 127, plus one if any mantissa bit is set."""
    bits = x.float().view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """kernel.py fast_pow2: (k + 127) << 23 read as float32."""
    return ((k + 127) << 23).to(torch.int32).view(torch.float32)


def _round_scale(amax: torch.Tensor, floor: float, qmax: float) -> torch.Tensor:
    return _pow2(_log2_ceil(amax.clamp(min=floor) * torch.tensor(1 / qmax, dtype=torch.float32)))


def _nearest_even(y: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index into ``table`` (ascending magnitudes; index = code) of |y|'s nearest value, a tie to the
    even index."""
    a = y.abs().reshape(-1)
    hi = (a[:, None] > table).sum(1).clamp(max=len(table) - 1)  # first entry >= |y| (a searchsorted)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(pick_hi, hi, lo).view(y.shape)


E4M3_TABLE = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # byte = index
E2M1_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # code = index


def _sign(y: torch.Tensor) -> torch.Tensor:
    return (torch.copysign(torch.ones_like(y), y) < 0).to(torch.uint8)


def ref_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (e4m3 bytes [M, N] uint8, ue8m0 bytes [⌈M/128⌉, ⌈N/128⌉] uint8), block by block."""
    x = w.float()
    m, n = x.shape
    qb = torch.empty(m, n, dtype=torch.uint8)
    sb = torch.empty(-(-m // 128), -(-n // 128), dtype=torch.uint8)
    for i in range(sb.shape[0]):
        for j in range(sb.shape[1]):
            blk = x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s = _round_scale(blk.abs().max(), 1e-4, 448.0)
            y = (blk / s).clamp(-448.0, 448.0)
            qb[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = _nearest_even(y, E4M3_TABLE).to(torch.uint8) | (
                _sign(y) << 7)
            sb[i, j] = int(_log2_ceil(s)) + 127
    return qb, sb


def ref_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (packed bytes [M, N/2] uint8, low nibble = even element; ue8m0 bytes [M, N/32] uint8)."""
    x = w.float()
    m, n = x.shape
    codes = torch.empty(m, n, dtype=torch.uint8)
    sb = torch.empty(m, n // 32, dtype=torch.uint8)
    for j in range(n // 32):
        grp = x[:, j * 32:(j + 1) * 32]
        s = _round_scale(grp.abs().amax(1), 6 * 2.0 ** -126, 6.0)  # [M]
        y = (grp / s[:, None]).clamp(-6.0, 6.0)
        codes[:, j * 32:(j + 1) * 32] = _nearest_even(y, E2M1_TABLE).to(torch.uint8) | (_sign(y) << 3)
        sb[:, j] = (_log2_ceil(s) + 127).to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), sb


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _weights(shape, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Columns spanning five decades (blocks of very different scale), one all-zero corner block."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.logspace(-4, 1, shape[1])[None, :]
    w[:32, :32] = 0.0
    return w.to(dtype)


# ---------------------------------------------------------------- bit-exact against the reference


@pytest.mark.parametrize("shape,dtype", [((256, 384), torch.bfloat16), ((200, 130), torch.bfloat16),
                                         ((7, 129), torch.float32), ((300, 260), torch.float32)])
def test_fp8_ue8m0_is_bit_exact_with_the_reference(shape, dtype):
    w = _weights(shape, shape[0] + shape[1], dtype)
    q, s = quantize_fp8_ue8m0(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    rq, rs = ref_fp8(w)
    assert torch.equal(_bytes(s), rs)
    assert torch.equal(_bytes(q), rq), f"{int((_bytes(q) != rq).sum())} e4m3 bytes differ"


def test_fp8_ties_round_to_even_and_signs_survive():
    """Midpoints between e4m3 neighbours at a scale of 1 (block max 448): each goes to the even
    mantissa; -0 and tiny negatives keep the sign bit."""
    w = torch.zeros(1, 128)
    w[0, 0] = 448.0
    w[0, 1:9] = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 0.5 * 2 ** -9, 1.5 * 2 ** -9, -1e-6, -0.0])
    q, s = quantize_fp8_ue8m0(w)
    assert int(_bytes(s)[0, 0]) == 127  # 448 · fp32(1/448) rounds to exactly 1
    got = q[0, 1:9].float().tolist()
    assert got == [1.0, 1.25, 16.0, 20.0, 0.0, 2 ** -8, -0.0, -0.0]
    assert [int(b) >> 7 for b in _bytes(q)[0, 7:9]] == [1, 1]
    assert torch.equal(_bytes(q), ref_fp8(w)[0])


@pytest.mark.parametrize("shape,dtype", [((64, 256), torch.bfloat16), ((3, 96), torch.float32)])
def test_mxfp4_is_bit_exact_with_the_reference(shape, dtype):
    w = _weights(shape, 7 * shape[0], dtype)
    p, s = quantize_mxfp4(w)
    assert p.dtype == torch.int8 and p.shape == (shape[0], shape[1] // 2)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (shape[0], shape[1] // 32)
    rp, rs = ref_mxfp4(w)
    assert torch.equal(_bytes(s), rs)
    assert torch.equal(_bytes(p), rp), f"{int((_bytes(p) != rp).sum())} packed bytes differ"


def test_mxfp4_ties_round_to_even():
    """Every midpoint of e2m1, both signs, at a group scale of 1 (group max 6)."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    w = torch.zeros(1, 32)
    w[0, 0] = 6.0
    w[0, 1:8], w[0, 8:15] = mids, -mids
    w[0, 15] = -0.0
    p, s = quantize_mxfp4(w)
    assert int(_bytes(s)[0, 0]) == 127
    from colocate_rl.models.quantized import dequant_mxfp4

    got = dequant_mxfp4(p, s, torch.float32)[0]
    even = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # codes 0, 2, 2, 4, 4, 6, 6
    assert got[1:8].tolist() == even and got[8:15].tolist() == [-v for v in even]
    assert torch.equal(_bytes(p), ref_mxfp4(w)[0])


def test_all_zero_blocks_get_the_floor_scale():
    q, s = quantize_fp8_ue8m0(torch.zeros(130, 128))
    assert (_bytes(q) == 0).all() and (_bytes(s) == 127 - 22).all()  # 2^ceil(log2(1e-4/448)) = 2^-22
    assert torch.equal(_bytes(s), ref_fp8(torch.zeros(130, 128))[1])
    p, s = quantize_mxfp4(torch.zeros(2, 64))
    assert (_bytes(p) == 0).all() and (_bytes(s) == 1).all()  # 2^-126, the smallest normal float


# ---------------------------------------------------------------- error bounds, loud failures


def test_dequantized_error_bounds():
    """e4m3 keeps 3 mantissa bits: error ≤ 2^-4 of the value, or half the smallest subnormal step
    (2^-10 · s) below the normal range. e2m1's widest gap (4 → 6) bounds it at a quarter of the
    value, or s/4 near zero. Scales are the smallest power of two that fits the block."""
    from colocate_rl.models.quantized import dequant_fp8_block, dequant_mxfp4

    w = _weights((300, 260), 11, torch.float32)
    q, s = quantize_fp8_ue8m0(w)
    back = dequant_fp8_block(q, s, (128, 128), torch.float32)
    sx = s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260]
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2 ** -4, sx * 2 ** -10)).all()
    amax = torch.nn.functional.pad(w.abs(), (0, 124, 0, 84)).view(3, 128, 3, 128).amax(dim=(1, 3))
    live = amax > 1e-4
    assert ((amax / s.float() <= 448) & (amax / s.float() > 224))[live].all()

    e = _weights((64, 256), 12, torch.float32)
    p, s = quantize_mxfp4(e)
    back = dequant_mxfp4(p, s, torch.float32)
    sx = s.float().repeat_interleave(32, 1)
    assert ((back - e).abs() <= torch.maximum(e.abs() / 4, sx / 4)).all()
    gmax = e.abs().view(64, 8, 32).amax(-1)
    assert ((gmax / s.float() <= 6) & (gmax / s.float() > 3))[gmax > 0].all()


@pytest.mark.parametrize("quantize", [quantize_fp8_ue8m0, quantize_mxfp4])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_values_fail_naming_the_tensor_and_block(quantize, bad):
    w = torch.randn(160, 192)
    w[130, 70] = bad
    block = "[1, 0]" if quantize is quantize_fp8_ue8m0 else "[130, 2]"
    with pytest.raises(ValueError, match=re.escape("'layers.3.attn.wq_b.weight' holds inf/NaN at [130, 70]") +
                       r".*block " + re.escape(block)):
        quantize(w, "layers.3.attn.wq_b.weight")


def test_quantize_named_names_the_tensor_that_fails():
    plan = {"layers.0.ffn.experts.1.w2.weight": "mxfp4", "layers.0.attn.wo_b.weight": "fp8_block"}
    bad = torch.ones(64, 32)
    bad[3, 3] = float("nan")
    for name in plan:
        with pytest.raises(ValueError, match=re.escape(f"'{name}' holds inf/NaN")):
            list(quantize_named(iter([(name, bad)]), plan))


def test_shapes_the_formats_cannot_take_are_named():
    with pytest.raises(ValueError, match="'e.w2.weight' has 48 input features; MXFP4 needs a multiple of 32"):
        quantize_mxfp4(torch.ones(4, 48), "e.w2.weight")
    with pytest.raises(ValueError, match="'n.weight' has shape \\(64,\\); block quantization needs a 2-D weight"):
        quantize_fp8_ue8m0(torch.ones(64), "n.weight")


# ---------------------------------------------------------------- the released checkpoint round trip

# The linears vLLM 0.26's DeepSeek-V4 builds with its FP8 quant_config (models/deepseek_v4/attention.py
# DeepseekV4Attention / DeepseekV4Indexer, nvidia/model.py DeepseekV4MLP), and its MXFP4 routed experts.
FP8_LINEAR = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wkv|wq_b|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])"
                        r"\.weight$")
EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")


def reference_checkpoint(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released layout by the reference quantiser, applied twice: a checkpoint in canonical form
    (module docstring of weight_sync/released.py: a second pass is a fixed point)."""
    from colocate_rl.models.quantized import dequant_fp8_block, dequant_mxfp4

    out = {}
    for name, t in sd.items():
        scale = name[: -len("weight")] + "scale"
        if FP8_LINEAR.match(name):
            for _ in range(2):
                qb, sb = ref_fp8(t)
                q, s = qb.view(torch.float8_e4m3fn), sb.view(torch.float8_e8m0fnu)
                t = dequant_fp8_block(q, s, (128, 128), torch.bfloat16)
            out[name], out[scale] = q, s
        elif EXPERT.match(name):
            for _ in range(2):
                pb, sb = ref_mxfp4(t)
                p, s = pb.view(torch.int8), sb.view(torch.float8_e8m0fnu)
                t = dequant_mxfp4(p, s, torch.bfloat16)
            out[name], out[scale] = p, s
        else:
            out[name] = t
    return out


def test_released_checkpoint_round_trips_bit_for_bit(tmp_path):
    """The reference writes a tiny DeepSeek-V4 in the released layout; our reader loads it (dequantised
    to bf16, as the actor loads it); the plan from its own names and shapes and our quantiser turn the
    loaded tensors back into the checkpoint: same names, shapes, dtypes and bytes, through the bucket
    wire format too."""
    from safetensors.torch import save_file

    from colocate_rl.models.deepseek_v4 import synth
    from colocate_rl.models.hf_checkpoint import HFCheckpoint

    hf = synth.official_config()
    ckpt = reference_checkpoint(synth.random_state_dict(hf, seed=4, dtype=torch.bfloat16))
    save_file(ckpt, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(
        hf, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                 "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}, expert_dtype="fp4")))

    with HFCheckpoint(tmp_path) as reader:
        shapes = {n: tuple(reader.shape(n)) for n in reader.names()}
        loaded = [(n, reader.read(n)) for n in reader.names() if not n.endswith(".scale")]
    plan = sync_plan(shapes)
    assert {n for n, f in plan.items() if f == "fp8_ue8m0"} == {n for n in ckpt if FP8_LINEAR.match(n)}
    assert {n for n, f in plan.items() if f == "mxfp4"} == {n for n in ckpt if EXPERT.match(n)}
    assert all(t.dtype == torch.bfloat16 for n, t in loaded if n in plan)

    sent = dict(quantize_named(iter(loaded), plan))
    assert sent.keys() == ckpt.keys()
    for name, want in ckpt.items():
        got = sent[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        differ = int((_bytes(got) != _bytes(want)).sum())
        assert differ == 0, f"{name}: {differ} bytes differ"

    wire = {n: t for b in pack(quantize_named(iter(loaded), plan), bucket_mb=0.05) for n, t in unpack(b)}
    assert all(torch.equal(_bytes(wire[n]), _bytes(ckpt[n])) and wire[n].dtype == ckpt[n].dtype for n in ckpt)


def test_a_second_quantization_keeps_values_and_is_canonical():
    """Any (q, s) dequantised and quantised again holds the same values exactly; a block whose
    largest code is small comes back as (2q, s/2), after which the encoding is a fixed point."""
    from colocate_rl.models.quantized import dequant_fp8_block, dequant_mxfp4

    w = _weights((256, 256), 5, torch.float32)
    w[:128, 128:] = w[:128, 128:] / w[:128, 128:].abs().max() * 229.0  # largest code rounds down to 224
    q1, s1 = quantize_fp8_ue8m0(w)
    v1 = dequant_fp8_block(q1, s1, (128, 128), torch.float32)
    q2, s2 = quantize_fp8_ue8m0(v1.bfloat16())
    v2 = dequant_fp8_block(q2, s2, (128, 128), torch.float32)
    assert torch.equal(v2, v1)
    assert s2.float()[0, 1] == s1.float()[0, 1] / 2 and float(q2[:128, 128:].float().abs().max()) == 448.0
    q3, s3 = quantize_fp8_ue8m0(v2.bfloat16())
    assert torch.equal(_bytes(q3), _bytes(q2)) and torch.equal(_bytes(s3), _bytes(s2))

    e = _weights((64, 256), 6, torch.float32)
    p1, t1 = quantize_mxfp4(e)
    u1 = dequant_mxfp4(p1, t1, torch.float32)
    p2, t2 = quantize_mxfp4(u1.bfloat16())
    u2 = dequant_mxfp4(p2, t2, torch.float32)
    assert torch.equal(u2, u1) and not torch.equal(_bytes(t2), _bytes(t1))  # some groups re-encoded
    p3, t3 = quantize_mxfp4(u2.bfloat16())
    assert torch.equal(_bytes(p3), _bytes(p2)) and torch.equal(_bytes(t3), _bytes(t2))


# ---------------------------------------------------------------- the plan


def test_plan_reads_each_layout_from_the_engine_shapes():
    qwen = {"model.layers.0.mlp.down_proj.weight": (64, 256), "model.layers.0.mlp.down_proj.weight_scale_inv": (1, 2),
            "model.norm.weight": (64,)}
    assert sync_plan(qwen) == {"model.layers.0.mlp.down_proj.weight": "fp8_block"}
    v4 = {"layers.0.attn.wq_b.weight": (2048, 300), "layers.0.attn.wq_b.scale": (16, 3),
          "layers.0.ffn.experts.0.w1.weight": (2048, 2048), "layers.0.ffn.experts.0.w1.scale": (2048, 128),
          "layers.0.ffn.gate.weight": (256, 4096), "layers.0.hc_attn_scale": (3,)}
    assert sync_plan(v4) == {"layers.0.attn.wq_b.weight": "fp8_ue8m0", "layers.0.ffn.experts.0.w1.weight": "mxfp4"}
    assert sync_plan({"model.norm.weight": (64,)}) == {}


def test_plan_refuses_layouts_it_cannot_write():
    with pytest.raises(ValueError, match=r"'a\.weight' \(64, 256\) with a\.weight_scale_inv \(1, 1\): no known"):
        sync_plan({"a.weight": (64, 256), "a.weight_scale_inv": (1, 1)})
    # FP8 '.scale' blocks with FP8 experts: vLLM takes float32 scales there (DeepSeek-V4-Flash-Base)
    with pytest.raises(ValueError, match="no MXFP4 routed experts"):
        sync_plan({"layers.0.attn.wq_b.weight": (256, 128), "layers.0.attn.wq_b.scale": (2, 1),
                   "layers.0.ffn.experts.0.w1.weight": (256, 128), "layers.0.ffn.experts.0.w1.scale": (2, 1)})
