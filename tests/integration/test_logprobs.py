"""The actor's logprobs (trainer/logprobs.py, computed by row chunks from the logits as they are)
against megatron-core's vocab_parallel_cross_entropy on an fp32 copy: the same bits forward, the
same gradient within rounding, half the bytes kept for the backward in 16-bit, logits untouched.
(Tensor parallelism: tests/integration/test_actor_parallel.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from colocate_rl.trainer import logprobs

from saved import saved_bytes  # tests/


def megatron_logprobs(logits, tokens, temperature):
    """What the actor computed before: log_softmax of an fp32 copy through megatron-core."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    x = logits.float()
    x = x / temperature if temperature != 1.0 else (x.clone() if x is logits else x)
    nll = vocab_parallel_cross_entropy(x, F.pad(tokens[:, 1:], (0, 1)))
    return F.pad(-nll[:, :-1], (1, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_are_megatrons(world, monkeypatch, dtype, temperature):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 7000)  # 7 rows of 1000 per chunk: 22 chunks, the last short
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 50, 1000, generator=g)).to(dtype)
    tokens = torch.randint(0, 1000, (3, 50), generator=g)
    ours_in, ref_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours, kept = saved_bytes(logprobs.token_logprobs, ours_in, tokens, temperature)
    ref, ref_kept = saved_bytes(megatron_logprobs, ref_in, tokens, temperature)

    assert ours.dtype == torch.float32 and ours.shape == tokens.shape and (ours[:, 0] == 0).all()
    assert torch.equal(ours, ref)  # the same operations in the same order
    # Kept: the logits themselves and a few floats per row, against an fp32 softmax.
    assert kept <= logits.numel() * logits.element_size() + 64 * tokens.numel()
    if dtype == torch.bfloat16:
        assert kept < 0.6 * ref_kept

    grad = torch.randn(3, 50, generator=g)
    ours.backward(grad)
    ref.backward(grad)
    assert ours_in.grad.dtype == dtype
    err = ((ours_in.grad.float() - ref_in.grad.float()).norm() / ref_in.grad.float().norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), err
    assert torch.equal(ours_in.detach(), logits)  # nothing written into the logits


@pytest.mark.slow  # the first call compiles (~30 s on 2 cores)
def test_fused_logprobs_equal_the_chunked_ones(world, compiling):
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        logits = (3 * torch.randn(3, 50, 1000, generator=g)).to(dtype)
        tokens = torch.randint(0, 1000, (3, 50), generator=g)
        grad = torch.randn(3, 50, generator=g)
        for temperature in (1.0, 0.7):
            fused_in, chunked_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
            fused = logprobs.token_logprobs(fused_in, tokens, temperature, fused=True)
            chunked = logprobs.token_logprobs(chunked_in, tokens, temperature)
            assert fused.dtype == torch.float32 and (fused[:, 0] == 0).all()
            assert (fused - chunked).abs().max().item() < 1e-5  # fp32 sums in another order
            fused.backward(grad)
            chunked.backward(grad)
            assert fused_in.grad.dtype == dtype
            err = ((fused_in.grad.float() - chunked_in.grad.float()).norm() / chunked_in.grad.float().norm()).item()
            assert err < 1e-5, (dtype, temperature, err)
            assert torch.equal(fused_in.detach(), logits)
