"""The local spec's RMSNorm and SwiGLU: the same forward bits as autograd of their formulas, the same
gradients within rounding, and only their inputs kept for the backward (memory.activation_bytes)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from colocate_rl.models.norm import RMSNorm
from colocate_rl.models.swiglu import SwiGLU

from saved import saved_bytes  # tests/


def hf_order(x, w):  # Qwen3's (HF's): normalise in fp32, round, then scale by the weight
    return w * F.rms_norm(x.float(), x.shape[-1:], eps=1e-6).to(w.dtype)


def weight_inside(x, w):  # DeepSeek-V4's: the weight inside the fp32 product, then the rounding
    h = x.float()
    return (w.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))).to(x.dtype)


def qwen3_norm(dtype):
    config = types.SimpleNamespace(use_cpu_initialization=True, params_dtype=dtype, sequence_parallel=False)
    return RMSNorm(config, 64, eps=1e-6)


def dsv4_norm(dtype):
    pytest.importorskip("megatron.core")
    from colocate_rl.models.deepseek_v4.model import RMSNorm as DSv4Norm

    config = types.SimpleNamespace(use_cpu_initialization=True, params_dtype=torch.float32)  # fp32 weights
    return DSv4Norm(config, 64, eps=1e-6)


@pytest.mark.parametrize("make,formula", [(qwen3_norm, hf_order), (dsv4_norm, weight_inside)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_norm_keeps_only_its_input(make, formula, dtype, tol):
    g = torch.Generator().manual_seed(0)
    norm = make(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=g))
    x = torch.randn(3, 5, 64, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(3, 5, 64, generator=g).to(dtype)

    out, kept = saved_bytes(norm, x, held=[x, norm.weight])
    assert kept == 0, f"the norm kept {kept} bytes beside its input and weight"
    # The same formula through autograd.
    w = norm.weight.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    ref, ref_kept = saved_bytes(formula, xr, w, held=[xr, w])
    assert ref_kept >= x.numel() * x.element_size()  # at least the norm of x (and in 16-bit an fp32 copy of x)
    assert torch.equal(out, ref)  # the same bits forward

    out.backward(grad)
    ref.backward(grad)
    for got, want in ((x.grad, xr.grad), (norm.weight.grad, w.grad)):
        assert got.dtype == want.dtype
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < tol


@pytest.mark.parametrize("limit", [None, 0.5])  # 0.5: DeepSeek-V4's clamp, hit by a third of the elements
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_swiglu_keeps_only_its_input(dtype, tol, limit):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 7, 96, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(4, 7, 48, generator=g).to(dtype)
    out, kept = saved_bytes(SwiGLU(types.SimpleNamespace(activation_func_clamp_value=limit)), x, held=[x])
    assert kept == 0, f"SwiGLU kept {kept} bytes beside its input"

    xr = x.detach().clone().requires_grad_()

    def inline(a):  # megatron-core's local MLP (glu_linear_offset 0, activation_func_clamp_value)
        gate, up = torch.chunk(a, 2, dim=-1)
        if limit is not None:
            gate, up = gate.clamp(min=None, max=limit), up.clamp(min=-limit, max=limit)
        return F.silu(gate) * (up + 0.0)

    ref, ref_kept = saved_bytes(inline, xr, held=[xr])
    assert ref_kept >= 2 * grad.numel() * grad.element_size()  # silu(gate) and the offset copy of up
    assert torch.equal(out, ref)
    out.backward(grad)
    ref.backward(grad)
    assert ((x.grad.float() - xr.grad.float()).norm() / xr.grad.float().norm()).item() < tol
    if limit is not None:
        clamped = torch.cat(((x[..., :48] > limit), (x[..., 48:].abs() > limit)), dim=-1)
        assert clamped.float().mean() > 0.2 and (x.grad[clamped] == 0).all()


def test_every_qwen3_mlp_gets_the_swiglu_module():
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from colocate_rl.models import qwen3
    from colocate_rl.models.swiglu import with_activation
    from colocate_rl.models.tiny import SHAPES

    for shape in ("qwen3-tiny", "qwen3-moe-tiny"):
        config = qwen3.transformer_config(dict(SHAPES[shape]), torch.float32, use_cpu_initialization=True)
        assert config.use_te_activation_func  # megatron-core calls the spec's module only then
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", pp_rank=0)
        mlp = with_activation(spec.layer_specs[0].submodules.mlp, SwiGLU)
        sub = mlp.keywords["submodules"]
        builders = [sub.experts, sub.shared_experts] if hasattr(sub, "experts") else [mlp]
        for builder in builders:
            assert builder.keywords["submodules"].activation_func is SwiGLU, shape


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_mhc_mixing_keeps_only_its_input(dtype, tol):
    """DeepSeek-V4's mHC mixing logits: linear of the rms-normalised fp32 streams."""
    from colocate_rl.models.deepseek_v4.ops import normed_linear, unweighted_rms_norm

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 4 * 32, generator=g).to(dtype).requires_grad_()
    w = (0.1 * torch.randn(24, 4 * 32, generator=g)).requires_grad_()
    grad = torch.randn(2, 5, 24, generator=g)
    out, kept = saved_bytes(lambda a, b: normed_linear(a, b, 1e-6), x, w, held=[x, w])
    assert kept == 0, f"kept {kept} bytes beside its inputs"

    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref, ref_kept = saved_bytes(lambda a, b: F.linear(unweighted_rms_norm(a.float(), 1e-6), b.float()), xr, wr,
                                held=[xr, wr])
    assert ref_kept >= x.numel() * 4  # the fp32 normalised streams
    assert torch.equal(out, ref)
    out.backward(grad)
    ref.backward(grad)
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad)):
        assert got.dtype == want.dtype
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < tol
