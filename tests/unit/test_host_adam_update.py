"""The chunk update of the host Adam (trainer/host_adam.py) against torch.optim.AdamW: the same
arithmetic in float64, the same result however the tensor is cut into chunks, and bf16 moments
within what 8 significant bits allow."""

from __future__ import annotations

import pytest
import torch

from colocate_rl.trainer.host_adam import adam_update_

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def grads(n: int, steps: int, dtype=torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # Changing scale and sign from step to step, so both moments move both ways.
    return [torch.randn(n, generator=g, dtype=dtype) * (1 + 4 * (k % 2)) for k in range(steps)]


def torch_adamw(w0: torch.Tensor, gs: list[torch.Tensor], scales: list[float]) -> torch.Tensor:
    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([w], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], foreach=False)
    for g, c in zip(gs, scales):
        w.grad = g * c
        opt.step()
    return w.detach()


def ours(w0: torch.Tensor, gs: list[torch.Tensor], scales: list[float], state_dtype=None, chunk: int = 0):
    master = w0.clone()
    dt = state_dtype or w0.dtype
    m, v = torch.zeros_like(w0, dtype=dt), torch.zeros_like(w0, dtype=dt)
    chunk = chunk or w0.numel()
    for step, (g, c) in enumerate(zip(gs, scales), start=1):
        for lo in range(0, w0.numel(), chunk):
            sl = slice(lo, lo + chunk)
            adam_update_(master[sl], m[sl], v[sl], g[sl], step=step, grad_scale=c, **HYPER)
    return master, m, v


def test_float64_equals_torch_adamw_with_clipping_scale():
    w0 = torch.randn(1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gs, scales = grads(1000, 6), [1.0, 0.5, 1.0, 0.25, 1.0, 0.8]
    want = torch_adamw(w0, gs, scales)
    got, _, _ = ours(w0, gs, scales)
    assert (want - w0).abs().max() > 1e-2  # six steps of lr 3e-3 moved every weight
    assert (got - want).abs().max().item() <= 1e-15


def test_chunks_change_nothing():
    """A chunk boundary inside a tensor is invisible: every op is elementwise."""
    w0 = torch.randn(997, generator=torch.Generator().manual_seed(2))
    gs, scales = grads(997, 4, torch.float32), [1.0, 0.3, 1.0, 1.0]
    whole = ours(w0, gs, scales, torch.bfloat16)
    for chunk in (1, 13, 500):
        cut = ours(w0, gs, scales, torch.bfloat16, chunk=chunk)
        assert all(torch.equal(a, b) for a, b in zip(whole, cut)), chunk


def test_bf16_moments_stay_within_their_rounding():
    """Stored in bf16 (8 significant bits, unit roundoff u = 2^-9) each moment is off by at most u
    of itself per store. After t steps the first moment carries at most (1 + b1 + ... + b1^(t-1)) u
    and the second t u, which its square root halves: the update direction m / sqrt(v) is off by
    about (2.71 + 1.5) u = 0.8% at t = 3, per element (more where m nearly cancels). Measured over
    the whole update, as a norm."""
    w0 = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    gs, scales = grads(4096, 3, torch.float32), [1.0, 1.0, 1.0]
    exact = ours(w0.double(), [g.double() for g in gs], scales)[0]
    got, m, v = ours(w0, gs, scales, torch.bfloat16)
    assert m.dtype == v.dtype == torch.bfloat16
    rel = ((got.double() - exact).norm() / (exact - w0.double()).norm()).item()
    assert rel <= 5 * 2**-9, rel
    # fp32 moments: only the fp32 master's own rounding (2^-24 of weights ~100x the update) remains.
    fp32 = ours(w0, gs, scales)[0]
    rel32 = ((fp32.double() - exact).norm() / (exact - w0.double()).norm()).item()
    assert rel32 <= 1e-4 and rel > 10 * rel32, (rel, rel32)


@pytest.mark.parametrize("beta2,decreases", [(0.999, False), (0.99, True)])
def test_bf16_second_moment_cannot_decrease_at_beta2_0_999(beta2, decreases):
    """The limit the config comment states: with zero gradients exp_avg_sq should shrink by a factor
    beta2 per step; stored in bf16 it cannot move by less than half a bf16 step (>= 2^-9 of
    itself), so at beta2 = 0.999 it stays where it is."""
    n = 256
    master = torch.zeros(n)
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.linspace(0.5, 4.0, n).to(torch.bfloat16)
    start = v.clone()
    hyper = dict(HYPER, beta2=beta2)
    for step in range(1, 20):
        adam_update_(master, m, v, torch.zeros(n), step=step, **hyper)
    assert bool((v < start).all()) is decreases
