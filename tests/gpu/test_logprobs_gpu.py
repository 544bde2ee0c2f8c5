"""The fused logprobs (kernels compiled for the device by torch.compile; actor.logprob_kernel=fused,
the default on a GPU) against the chunked ones on a GPU, at Qwen3's vocabulary width in bf16: the
same logprobs within fp32 rounding, the same gradient, the logits untouched."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)", allow_module_level=True)


def test_fused_logprobs_equal_the_chunked_ones_at_qwen3_width():
    from colocate_rl.trainer.logprobs import token_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 2 * 1056, 151_936
    logits = (3 * torch.randn(2, rows // 2, vocab, generator=g, device="cuda")).to(torch.bfloat16)
    tokens = torch.randint(0, vocab, (2, rows // 2), generator=g, device="cuda")
    grad = torch.randn(2, rows // 2, generator=g, device="cuda")
    for temperature in (1.0, 0.7):
        fused_in, chunked_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        fused = token_logprobs(fused_in, tokens, temperature, fused=True)
        chunked = token_logprobs(chunked_in, tokens, temperature)
        assert (fused - chunked).abs().max().item() < 1e-4  # |logprob| ~ 17 here: a few fp32 ulps
        fused.backward(grad)
        chunked.backward(grad)
        err = ((fused_in.grad.float() - chunked_in.grad.float()).norm() / chunked_in.grad.float().norm()).item()
        assert err < 1e-2, (temperature, err)  # both rounded to bf16 at the end
        assert torch.equal(fused_in.detach(), logits)
