"""rollout.exact (models/exact.py): where it cannot be exact, the run stops in its plan in one line;
the exact spec replaces every norm, the attention and the activation by vLLM's kernels; the engine's
residual norm keeps vLLM's in-place contract."""

import pytest
import torch

from colocate_rl.config import Config, ConfigError, ModelConfig, load


def cfg(path="Qwen/Qwen3-0.6B", **over):
    return load(Config(model=ModelConfig(path=path)),
                overrides=["rollout.exact=true", *[f"{k}={v}" for k, v in over.items()]])


def one_line(fn, match):
    with pytest.raises(ConfigError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


def test_exact_stops_in_one_line_where_it_cannot_be_exact():
    from colocate_rl import plan

    # On the CPU: vLLM's batch-invariant kernels have no CPU build.
    one_line(lambda: plan.resolve(cfg(**{"placement.gpus_per_node": 0})), "rollout.exact=true needs CUDA GPUs")
    # A family without an exact forward (checked before the device).
    one_line(lambda: plan.resolve(cfg("deepseek-ai/DeepSeek-V4-Flash", **{"placement.gpus_per_node": 0,
                                                                       "rollout.engine_kwargs.kv_cache_dtype": "fp8"})),
             "covers Qwen3 dense and MoE models; deepseek_v4 has no exact forward")
    # A MoE block is vLLM's fused experts called whole, on one rank.
    one_line(lambda: plan.resolve(cfg("Qwen/Qwen3-30B-A3B", **{"placement.gpus_per_node": 2, "actor.ep": 2,
                                                               "placement.accelerator": "h200"})),
             "rollout.exact=true runs a MoE block on one rank: actor.tp=1 and actor.ep=2")
    # Sums split over another number of ranks round differently; an fp32 residual stream, fused
    # logprobs and fused norms are not vLLM's.
    one_line(lambda: plan.resolve(cfg(**{"placement.gpus_per_node": 2, "actor.tp": 2})),
             r"tensor_parallel_size \(1\) == actor.tp \(2\)")
    one_line(lambda: plan.resolve(cfg(**{"actor.fp32_residual": "true"})), "leave actor.fp32_residual unset or false")
    one_line(lambda: plan.resolve(cfg(**{"actor.logprob_kernel": "fused"})), "unset actor.logprob_kernel=fused")
    one_line(lambda: plan.resolve(cfg(**{"actor.norm_kernel": "fused"})), "unset actor.norm_kernel=fused")
    one_line(lambda: plan.resolve(cfg(**{"model.head_dtype": "float32"})), "leave model.head_dtype=model")
    # FlashAttention 3 has no float32 kernels (the tiny CPU recipe's dtype).
    one_line(lambda: plan.resolve(cfg(**{"model.dtype": "float32"})), "needs model.dtype=bfloat16 or float16, not float32")
    # vLLM's GPU top-k/top-p kernel is not replayed bit for bit.
    one_line(lambda: plan.resolve(cfg(**{"rollout.top_p": 0.9})), "rollout.exact=true samples the whole distribution: "
             "rollout.top_p=0.9 truncates it")
    one_line(lambda: plan.resolve(cfg(**{"rollout.top_k": 20})), "rollout.top_k=20 truncates it")


def test_exact_spec_replaces_every_norm_attention_and_activation():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    from colocate_rl.models import exact

    config = TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True, use_te_activation_func=True)
    spec = exact.layer_spec(config, 1e6, 4096, pp_rank=0)  # pp_rank: no process group needed
    attn = spec.layer_specs[1].submodules.self_attention.submodules
    norms = [spec.layer_norm, attn.q_layernorm, attn.k_layernorm,
             *(n for layer in spec.layer_specs for n in (layer.submodules.input_layernorm,
                                                         layer.submodules.pre_mlp_layernorm))]
    assert len(norms) == 9 and all(n.module is exact.ExactRMSNorm for n in norms)
    assert attn.core_attention.module is exact.ExactAttention and attn.core_attention.params["base"] == 1e6
    assert spec.layer_specs[2].submodules.mlp.keywords["submodules"].activation_func is exact.ExactSwiGLU
    assert exact.model_kwargs({"position_embedding_type": "rope"})["position_embedding_type"] == "none"


def test_invariant_residual_norm_keeps_the_fused_kernels_contract():
    """rollout/invariant_norm.add_rms_norm: residual ← x + residual, x ← norm(residual), in place, as
    vLLM's fused_add_rms_norm writes them; a row's result is the same alone and among others."""
    from colocate_rl.rollout.invariant_norm import add_rms_norm

    def norm(x, w, eps):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)

    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    w = torch.rand(64, generator=g).to(torch.bfloat16)
    x0, r0 = x.clone(), r.clone()
    out, res = add_rms_norm(x, w, 1e-6, r, norm)
    assert out is x and res is r
    assert torch.equal(r, x0 + r0) and torch.equal(x, norm(x0 + r0, w, 1e-6))
    one_x, one_r = x0[2:3].clone(), r0[2:3].clone()
    add_rms_norm(one_x, w, 1e-6, one_r, norm)
    assert torch.equal(one_x, x[2:3]) and torch.equal(one_r, r[2:3])


def test_invariant_residual_norm_installs_only_in_batch_invariant_mode(monkeypatch):
    from colocate_rl.rollout import invariant_norm

    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    monkeypatch.setattr(invariant_norm, "_INSTALLED", False)
    assert invariant_norm.install() is False


def test_backward_matmuls_leave_the_invariant_kernel():
    """The forward's matmuls are vLLM's batch-invariant kernel; the backward's (two thirds of the
    FLOPs) take torch's own, since gradients need not be batch-invariant."""
    import torch

    from colocate_rl.models.exact import forward_mm

    calls = []

    def invariant(a, b):  # stands in for vLLM's Triton kernel: records that it ran
        calls.append(tuple(a.shape))
        return torch.mm(a, b, out=a.new_empty((a.shape[0], b.shape[1])))

    class Linear(torch.autograd.Function):  # a linear whose backward calls the routed matmul, as aten::mm's would
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return forward_mm(invariant, x, w)

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return forward_mm(invariant, g, w.t()), forward_mm(invariant, x.t(), g)

    x, w = torch.randn(5, 3, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    out = Linear.apply(x, w)
    assert calls == [(5, 3)]  # the forward ran the invariant kernel
    out.sum().backward()
    assert calls == [(5, 3)]  # the backward did not
    torch.testing.assert_close(x.grad, torch.ones(5, 4) @ w.detach().t())
    torch.testing.assert_close(w.grad, x.detach().t() @ torch.ones(5, 4))
    with torch.no_grad():  # a no-grad forward (the old logprobs) is still a forward
        forward_mm(invariant, x, w)
    assert calls == [(5, 3), (5, 3)]


def test_closed_form_backwards_are_autograds():
    """The norms' and SwiGLU's backward (closed forms, no autograd graph of their own) give autograd's
    gradients of the same functions, in fp32 and within bf16 rounding in bf16."""
    import torch
    import torch.nn.functional as F

    from colocate_rl.models.norm import rms_norm_backward
    from colocate_rl.models.swiglu import swiglu_backward

    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(3, 5, 64, generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)
        grad = torch.randn(3, 5, 64, generator=g).to(dtype)
        xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * wf
        want = torch.autograd.grad(y, (xf, wf), grad.float())
        got = rms_norm_backward(grad, x, w, 1e-6)
        for a, b in zip(got, want):
            assert a.dtype == dtype
            assert ((a.float() - b).norm() / b.norm()).item() < tol

        h = torch.randn(4, 7, 2 * 48, generator=g).to(dtype)
        gout = torch.randn(4, 7, 48, generator=g).to(dtype)
        hf = h.float().requires_grad_()
        gate, up = hf.chunk(2, dim=-1)
        (want,) = torch.autograd.grad(F.silu(gate) * up, hf, gout.float())
        got = swiglu_backward(gout, h)
        assert got.dtype == dtype and got.shape == h.shape
        assert ((got.float() - want).norm() / want.norm()).item() < tol


def test_rotary_backward_is_the_kernel_by_minus_the_angle():
    """Rotary: vLLM's kernel (its CPU build here) forward, the same kernel with sin negated backward,
    against autograd of the NeoX rotation written out in torch."""
    import torch

    pytest.importorskip("vllm._custom_ops")
    from colocate_rl.models.exact import _RopeFn, inverse_rope_cache

    hd, n = 16, 6
    g = torch.Generator().manual_seed(1)
    angles = torch.arange(32)[:, None] * (10000.0 ** (-torch.arange(0, hd, 2) / hd))[None]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [max_position, hd]: cos | sin
    positions = torch.tensor([0, 1, 2, 7, 8, 31])
    q = torch.randn(n, 4, hd, generator=g, requires_grad=True)
    k = torch.randn(n, 2, hd, generator=g, requires_grad=True)

    def neox(x):
        cos, sin = cache[positions].unsqueeze(1).chunk(2, dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    try:
        rq, rk = _RopeFn.apply(q, k, positions, cache, inverse_rope_cache(cache))
    except (RuntimeError, NotImplementedError) as e:  # a vLLM build without the CPU kernel
        pytest.skip(f"vLLM's rotary kernel does not run here: {e}")
    torch.testing.assert_close(rq, neox(q))
    torch.testing.assert_close(rk, neox(k))
    gq, gk = torch.randn(rq.shape, generator=g), torch.randn(rk.shape, generator=g)
    got = torch.autograd.grad((rq, rk), (q, k), (gq, gk))
    want = torch.autograd.grad((neox(q), neox(k)), (q, k), (gq, gk))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_v2_logprob_backward_is_autograds():
    """The V2 sampler's logprobs (forward: vLLM's Triton kernels, GPU only) take their gradient in
    closed form, in row chunks: autograd's gradient of log_softmax(x / T)[id] with respect to x, for
    every chunking and at T=1 and T=0.7."""
    from colocate_rl.models.exact import logprob_backward

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 50, generator=g)
    ids = torch.randint(0, 50, (9,), generator=g)
    grad = torch.randn(9, generator=g)
    for temperature in (1.0, 0.7):
        xr = x.clone().requires_grad_()
        lp = (xr / temperature).log_softmax(-1).gather(1, ids[:, None]).squeeze(1)
        (want,) = torch.autograd.grad(lp, xr, grad)
        for chunk in (50, 150, 1 << 20):  # one row, three rows, all rows per chunk
            got = logprob_backward(x / temperature, ids, grad, temperature, chunk_elements=chunk)
            assert torch.allclose(got, want, atol=1e-6), (temperature, chunk)


def test_exact_logprobs_follow_the_engines_model_runner():
    """Dense models sample on vLLM's V2 runner; MoE models and R3 on V1 (no routed-experts capture in
    V2). The engine sets the runner from the same rule the actor reads (rollout/engine.py)."""
    from colocate_rl.models.registry import exact_samples_on_v2

    dense = {"model_type": "qwen3", "num_hidden_layers": 2}
    moe = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2}
    assert exact_samples_on_v2(dense, routing_replay=False)
    assert not exact_samples_on_v2(dense, routing_replay=True)
    assert not exact_samples_on_v2(moe, routing_replay=False)
