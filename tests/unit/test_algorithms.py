"""Advantages and the policy loss against hand-computed values on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from colocate_rl.algorithms import (
    ADVANTAGES,
    LOSS_AGG,
    get_advantage_fn,
    global_counts,
    logprob_abs_diff,
    policy_loss,
)
from colocate_rl.config import AlgorithmConfig

# ---------------------------------------------------------------- advantages


def test_grpo_uses_population_std():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0], dtype=torch.float64)
    adv = ADVANTAGES["grpo"](r, 3, AlgorithmConfig(adv_eps=0.0))
    # group 1: mean 1/3, population std sqrt(2/9); group 2: mean 2, std sqrt(8/3)
    s1, s2 = math.sqrt(2 / 9), math.sqrt(8 / 3)
    want = [2 / 3 / s1, -1 / 3 / s1, -1 / 3 / s1, -2 / s2, 0.0, 2 / s2]
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64))


def test_grpo_equal_rewards_and_singleton_groups_give_zero():
    assert torch.equal(ADVANTAGES["grpo"](torch.ones(4), 2, AlgorithmConfig()), torch.zeros(4))
    assert torch.equal(ADVANTAGES["grpo"](torch.tensor([3.0, -1.0]), 1, AlgorithmConfig()), torch.zeros(2))


@pytest.mark.parametrize("name", ["dr_grpo", "grpo_no_std"])
def test_dr_grpo_advantage_has_no_std(name):
    adv = ADVANTAGES[name](torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0]), 3, AlgorithmConfig())
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0]))


def test_advantage_errors():
    with pytest.raises(ValueError, match="groups of n=4"):
        ADVANTAGES["grpo"](torch.zeros(6), 4, AlgorithmConfig())
    with pytest.raises(ValueError, match="^algorithm.advantage='ppo' is not one of dr_grpo, grpo, grpo_no_std$"):
        get_advantage_fn("ppo")


# ---------------------------------------------------------------- the loss


def _cfg(**kw) -> AlgorithmConfig:
    return AlgorithmConfig(**{"eps_low": 0.2, "eps_high": 0.3, "is_clamp": 0.0, **kw})


def _one_token(logp: float, adv: float, old: float = 0.0, rollout: float | None = None, **kw):
    t = lambda x: torch.tensor([[x]], dtype=torch.float64)  # noqa: E731
    return policy_loss(
        t(logp).requires_grad_(), t(old), t(old if rollout is None else rollout),
        torch.tensor([adv], dtype=torch.float64), torch.tensor([[True]]), _cfg(**kw),
    )


@pytest.mark.parametrize(
    "ratio, adv, want_loss, clipped",
    [
        (1.1, +1.0, -1.1, False),  # inside the range: plain ratio·A
        (1.5, +1.0, -1.3, True),  # A > 0 clipped at 1 + eps_high (0.3, not eps_low)
        (0.5, +1.0, -0.5, False),  # A > 0 below the range: not clipped (pessimistic min)
        (0.5, -1.0, +0.8, True),  # A < 0 clipped at 1 - eps_low
        (1.5, -1.0, +1.5, False),  # A < 0 above the range: not clipped
        (0.9, -2.0, +1.8, False),
    ],
)
def test_asymmetric_clip(ratio, adv, want_loss, clipped):
    loss, m = _one_token(math.log(ratio), adv)
    assert loss.item() == pytest.approx(want_loss)
    assert m["clip_frac"].item() == float(clipped)
    loss.backward()


def test_clipped_token_has_no_gradient():
    logp = torch.tensor([[math.log(1.5), math.log(1.1)]], dtype=torch.float64, requires_grad=True)
    z = torch.zeros(1, 2, dtype=torch.float64)
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(logp, z, z, adv, mask, _cfg())
    loss.backward()
    # token 0 is clipped (grad 0); token 1: d/dlogp of -r·A/2 = -r/2
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.1 / 2]], dtype=torch.float64))
    assert m["clip_frac"].item() == 0.5


def test_is_weight_clamped_when_gap_is_large():
    # old - rollout = log 5: raw weight 5 > C = 2, so the loss is scaled by 2
    loss, m = _one_token(0.0, 1.0, old=0.0, rollout=-math.log(5), is_clamp=2.0)
    assert loss.item() == pytest.approx(-2.0)
    assert m["is_weight_mean"].item() == pytest.approx(2.0)
    assert m["is_weight_max"].item() == pytest.approx(5.0)
    assert m["is_clamped_frac"].item() == 1.0
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(math.log(5))
    # a small gap is applied as is
    loss, m = _one_token(0.0, 1.0, old=0.0, rollout=-math.log(1.25), is_clamp=2.0)
    assert loss.item() == pytest.approx(-1.25)
    assert m["is_clamped_frac"].item() == 0.0
    # C = 0 disables the correction
    loss, m = _one_token(0.0, 1.0, old=0.0, rollout=-math.log(5), is_clamp=0.0)
    assert loss.item() == pytest.approx(-1.0)
    assert m["is_weight_mean"].item() == 1.0 and m["is_clamped_frac"].item() == 0.0


@pytest.mark.parametrize("kl_type, want", [("k1", 0.5), ("k3", math.exp(-0.5) + 0.5 - 1)])
def test_kl_to_reference(kl_type, want):
    logp = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    z = torch.zeros(1, 1, dtype=torch.float64)
    cfg = _cfg(kl_coef=0.1, kl_type=kl_type)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, m = policy_loss(logp, z, z, torch.zeros(1, dtype=torch.float64), mask, cfg, ref_logprobs=z - 0.5)
    assert m["kl_ref"].item() == pytest.approx(want)
    assert loss.item() == pytest.approx(0.1 * want)  # A = 0: the KL term alone
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(logp, z, z, torch.zeros(1, dtype=torch.float64), mask, cfg)


def test_metrics_approx_kl_entropy_and_masked_garbage():
    logp = torch.tensor([[math.log(1.2), 0.0, 1e4]])  # last position is off the mask and absurd
    z = torch.zeros(1, 3)
    mask = torch.tensor([[True, True, False]])
    ent = torch.tensor([[1.0, 3.0, 100.0]])
    loss, m = policy_loss(logp, z, z, torch.tensor([1.0]), mask, _cfg(), entropy=ent)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(-(1.2 + 1.0) / 2)
    assert m["approx_kl"].item() == pytest.approx((0.2 - math.log(1.2)) / 2, rel=1e-5)
    assert m["entropy"].item() == pytest.approx(2.0)
    assert all(v.dim() == (1 if k.endswith("_hist") else 0) and not v.requires_grad for k, v in m.items())


def test_logprob_abs_diff():
    a = torch.tensor([[0.0, -1.0, 5.0], [-2.0, 0.0, 0.0]])
    b = torch.tensor([[0.5, -1.5, 0.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert logprob_abs_diff(a, b, mask).item() == pytest.approx((0.5 + 0.5 + 1.0) / 3)


def test_gradcheck_float64():
    torch.manual_seed(0)
    b, t = 4, 5
    # ratios well inside / outside the clip range, away from the kinks gradcheck cannot differentiate
    old = -torch.rand(b, t, dtype=torch.float64) - 0.5
    logp = (old + torch.tensor([-0.6, -0.05, 0.05, 0.6, 0.1], dtype=torch.float64)).requires_grad_()
    rollout = old + 0.3 * torch.randn(b, t, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(b, t, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.3], dtype=torch.float64)
    mask = torch.rand(b, t) > 0.3
    for agg in LOSS_AGG:
        cfg = AlgorithmConfig(eps_low=0.2, eps_high=0.28, is_clamp=1.2, kl_coef=0.05, kl_type="k3", loss_agg=agg)
        fn = lambda x: policy_loss(x, old, rollout, adv, mask, cfg, ref_logprobs=ref)[0]  # noqa: E731
        assert torch.autograd.gradcheck(fn, (logp,))


# ---------------------------------------------------------------- aggregation


def _ragged():
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, False, False, False], [True, True, False, False]])
    return loss, mask


def test_aggregation_modes_differ_on_ragged_masks():
    loss, mask = _ragged()
    assert LOSS_AGG["token_mean"](loss, mask).item() == pytest.approx((4 + 4 + 4) / 7)
    assert LOSS_AGG["seq_mean_token_mean"](loss, mask).item() == pytest.approx((1 + 4 + 2) / 3)


@pytest.mark.parametrize("agg", sorted(LOSS_AGG))
def test_micro_batch_losses_sum_to_the_full_batch(agg):
    torch.manual_seed(1)
    b, t = 6, 7
    logp = -torch.rand(b, t, dtype=torch.float64)
    old = logp + 0.2 * torch.randn(b, t, dtype=torch.float64)
    rollout = old + 0.1 * torch.randn(b, t, dtype=torch.float64)
    adv = torch.randn(b, dtype=torch.float64)
    lens = torch.tensor([7, 1, 3, 5, 2, 6])
    mask = torch.arange(t)[None, :] < lens[:, None]
    cfg = AlgorithmConfig(is_clamp=2.0, loss_agg=agg)

    full, _ = policy_loss(logp, old, rollout, adv, mask, cfg)
    counts = global_counts(mask)
    assert counts == {"global_token_count": 24, "global_seq_count": 6}
    parts = [
        policy_loss(logp[s], old[s], rollout[s], adv[s], mask[s], cfg, **counts)[0]
        for s in (slice(0, 2), slice(2, 5), slice(5, 6))
    ]
    torch.testing.assert_close(sum(parts), full)
    # without the global normaliser, the micro-batch means do not add up
    local = sum(policy_loss(logp[s], old[s], rollout[s], adv[s], mask[s], cfg)[0] for s in (slice(0, 2), slice(2, 6)))
    assert not torch.allclose(local, full)


def test_logprob_gap_max_is_the_largest_masked_token():
    old = torch.zeros(1, 3, dtype=torch.float64)
    rollout = torch.tensor([[-0.1, 0.3, -2.0]], dtype=torch.float64)  # the 2.0 token is padding
    mask = torch.tensor([[True, True, False]])
    _, m = policy_loss(old.clone().requires_grad_(), old, rollout, torch.ones(1, dtype=torch.float64), mask, _cfg())
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(0.2)
    assert m["train_rollout_logprob_abs_diff_max"].item() == pytest.approx(0.3)


def test_gap_quantiles_and_first_token_add_up_over_micro_batches():
    """The gap's p50/p99 come from token counts per log-spaced bin, which sum over micro-batches and
    ranks: the step's quantiles are those of all its tokens (within a bin, ±7.5%), exact zeros give
    0; the first and last response tokens' gaps are means over rows and the tail share a ratio of
    sums, whichever micro-batch held them."""
    from colocate_rl.algorithms import gap_summary
    from colocate_rl.algorithms.terms import first_token_mask, gap_histogram, histogram_quantile, last_token_mask

    g = torch.Generator().manual_seed(0)
    gap = torch.rand(6, 40, generator=g, dtype=torch.float64).pow(4) * 2  # skewed, like a real gap
    lens = torch.tensor([40, 31, 7, 22, 40, 15])
    start = torch.tensor([3, 0, 5, 1, 0, 9])  # the prompt's end: the response starts there
    pos = torch.arange(40)[None, :]
    mask = (pos >= start[:, None]) & (pos < lens[:, None])
    first = first_token_mask(mask)
    assert first.sum(1).tolist() == [1] * 6 and bool((first.int().argmax(1) == start).all())
    last = last_token_mask(mask)
    assert last.sum(1).tolist() == [1] * 6 and bool((last.int().argmax(1) == lens - 1).all())
    hist = sum(gap_histogram(gap[s], mask[s]) for s in (slice(0, 2), slice(2, 5), slice(5, 6)))
    assert torch.equal(hist, gap_histogram(gap, mask)) and int(hist.sum()) == int(mask.sum())
    tokens = gap[mask]
    for q in (0.5, 0.99):
        want = float(tokens.quantile(q, interpolation="higher"))
        assert histogram_quantile(hist, q) == pytest.approx(want, rel=0.08), q
    assert histogram_quantile(gap_histogram(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)), 0.99) == 0.0
    assert histogram_quantile(torch.zeros(162), 0.5) == 0.0

    old = torch.zeros(6, 40, dtype=torch.float64)
    steps = [policy_loss(old[s].clone().requires_grad_(), old[s], gap[s], torch.ones(s.stop - s.start,
                         dtype=torch.float64), mask[s], _cfg())[1] for s in (slice(0, 2), slice(2, 6))]
    summed = {k: sum(m[k] for m in steps) for k in ("train_rollout_logprob_abs_diff_hist",
                                                     "train_rollout_logprob_abs_diff_first_total",
                                                     "train_rollout_logprob_abs_diff_last_total",
                                                     "train_rollout_logprob_abs_diff_over1_total",
                                                     "train_rollout_logprob_abs_diff_sum_total",
                                                     "first_tokens_total")}
    out = gap_summary({"loss": 1.0, **summed})
    assert set(out) == {"loss", *(f"train_rollout_logprob_abs_diff_{k}" for k in ("p50", "p99", "first", "last",
                                                                                  "tail_share"))}
    assert out["train_rollout_logprob_abs_diff_first"] == pytest.approx(float(gap[first].mean()))
    assert out["train_rollout_logprob_abs_diff_last"] == pytest.approx(float(gap[last].mean()))
    assert 0 < (tokens > 1).sum() < tokens.numel()  # the tail share is neither nothing nor everything
    assert out["train_rollout_logprob_abs_diff_tail_share"] == pytest.approx(float(tokens[tokens > 1].sum() / tokens.sum()))
    assert out["train_rollout_logprob_abs_diff_p50"] == pytest.approx(histogram_quantile(hist, 0.5))
