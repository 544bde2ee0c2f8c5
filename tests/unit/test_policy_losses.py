"""The policy-loss registry: GSPO, Dr. GRPO and CISPO against their papers' formulas written out
here token by token (loss and gradient, float64), micro-batch additivity for every loss, ppo_clip
bit for bit against the loss as it was before the registry, and the one-line errors."""

from __future__ import annotations

import math

import pytest
import torch

from colocate_rl.algorithms import ADVANTAGES, LOSS_AGG, POLICY_LOSSES, global_counts, policy_loss
from colocate_rl.config import AlgorithmConfig

F64 = torch.float64


def _inputs(seed: int, b: int = 6, t: int = 9, spread: float = 0.3, dtype=F64):
    """Random micro-batch: logp (leaf, grad), old, rollout, ref [B, T]; adv [B]; ragged right-aligned
    response mask [B, T] (prompt first); off-mask logprobs are absurd but finite."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=F64) * 2 - 0.1
    logp = old + spread * torch.randn(b, t, generator=g, dtype=F64)
    rollout = old + 0.2 * torch.randn(b, t, generator=g, dtype=F64)
    ref = old + 0.2 * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, generator=g, dtype=F64)
    ends = torch.randint(3, t + 1, (b,), generator=g)
    pos = torch.arange(t)[None]
    mask = (pos >= 2) & (pos < ends[:, None])
    logp = torch.where(mask, logp, torch.full_like(logp, 1e4))
    cast = lambda x: x.to(dtype)  # noqa: E731
    return cast(logp).requires_grad_(), cast(old), cast(rollout), cast(ref), cast(adv), mask


def _run(cfg, logp, old, rollout, ref, adv, mask, **kw):
    logp = logp.detach().clone().requires_grad_()
    loss, m = policy_loss(logp, old, rollout, adv, mask, cfg, ref_logprobs=ref, **kw)
    loss.backward()
    return loss.detach(), logp.grad, m


def _is_weight(old, rollout, clamp):
    """The token IS weight, written out: min(p_old / p_rollout, C), 1 when C = 0."""
    w = torch.exp(old - rollout)
    return torch.clamp(w, max=clamp) if clamp > 0 else torch.ones_like(w)


def _k3_and_grad(lp, ref):
    """Schulman's k3 = e^(ref-lp) - (ref-lp) - 1 and its derivative w.r.t. lp: 1 - e^(ref-lp)."""
    d = ref - lp
    return math.exp(d) - d - 1, 1 - math.exp(d)


# ---------------------------------------------------------------- GSPO


def test_gspo_matches_the_paper_loss_and_gradient():
    """"Group Sequence Policy Optimization": s_i = exp(mean_t log(π/π_old)), clipped per sequence,
    1/G Σ_i min(s_i A_i, clip(s_i) A_i), gradient s_i A_i / |y_i| on each token of i. Each row's
    ratio is set inside, above or below [1 - 3e-4, 1 + 4e-4], with both signs of A."""
    b, t = 6, 8
    logp0, old, rollout, ref, _, mask = _inputs(3, b, t)
    # per-row mean log-ratio: inside, above (clipped for A > 0), below (clipped for A < 0), ...
    target = torch.tensor([1e-4, 2e-3, -2e-3, 2e-3, -2e-3, -1e-4], dtype=F64)
    adv = torch.tensor([0.7, 1.3, -0.4, -1.1, 0.9, -2.0], dtype=F64)
    noise = 0.05 * torch.randn(b, t, generator=torch.Generator().manual_seed(4), dtype=F64)
    noise = torch.where(mask, noise, 0)
    noise = noise - (noise.sum(1, keepdim=True) / mask.sum(1, keepdim=True)) * mask  # zero mean per row
    logp = torch.where(mask, old + noise + target[:, None], logp0.detach())
    cfg = AlgorithmConfig(policy_loss="gspo", is_clamp=1.1, kl_coef=0.05, kl_type="k3")
    lo, hi = 1 - cfg.gspo_eps_low, 1 + cfg.gspo_eps_high
    assert (lo, hi) == (1 - 3e-4, 1 + 4e-4)  # the paper's
    w = _is_weight(old, rollout, cfg.is_clamp)

    want_loss, want_grad, clipped_rows = 0.0, torch.zeros(b, t, dtype=F64), []
    for i in range(b):
        toks = [j for j in range(t) if mask[i, j]]
        n = len(toks)
        s = math.exp(sum(float(logp[i, j] - old[i, j]) for j in toks) / n)
        a = float(adv[i])
        unclipped, clipped = s * a, min(max(s, lo), hi) * a
        obj = min(unclipped, clipped)
        is_clipped = clipped < unclipped
        clipped_rows.append(is_clipped)
        for j in toks:
            kl, dkl = _k3_and_grad(float(logp[i, j]), float(ref[i, j]))
            want_loss += (-obj * float(w[i, j]) + cfg.kl_coef * kl) / (n * b)
            # d s_i / d logp_{i,j} = s_i / n; zero where the clipped term is the smaller
            pg_grad = 0.0 if is_clipped else -a * s / n * float(w[i, j])
            want_grad[i, j] = (pg_grad + cfg.kl_coef * dkl / n) / b
    assert clipped_rows == [False, True, True, False, False, False]

    loss, grad, m = _run(cfg, logp, old, rollout, ref, adv, mask)
    torch.testing.assert_close(loss, torch.tensor(want_loss, dtype=F64), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    n = mask.sum(1).double()
    want_clip = float((n * torch.tensor(clipped_rows, dtype=F64)).sum() / n.sum())
    assert m["clip_frac"].item() == pytest.approx(want_clip)


def test_gspo_token_form_is_gspo_without_the_is_weight():
    """With w = 1 the per-token form equals the sequence-level objective differentiated directly
    (s_i with its own gradient, broadcast to nothing): same loss, same gradient."""
    logp, old, rollout, ref, adv, mask = _inputs(5, spread=2e-4)
    cfg = AlgorithmConfig(policy_loss="gspo", is_clamp=0.0)
    loss, grad, _ = _run(cfg, logp, old, rollout, ref, adv, mask)

    x = logp.detach().clone().requires_grad_()
    n = mask.sum(1)
    s = torch.exp(torch.where(mask, x - old, 0).sum(1) / n)  # [B]
    obj = torch.minimum(s * adv, s.clamp(1 - 3e-4, 1 + 4e-4) * adv)
    (-obj.mean()).backward()
    torch.testing.assert_close(loss, -obj.mean().detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------- Dr. GRPO


@pytest.mark.parametrize("norm_cfg, norm_run, want_norm", [(0, 16, 16), (12, 16, 12)])
def test_dr_grpo_matches_the_paper_loss_and_gradient(norm_cfg, norm_run, want_norm):
    """"Understanding R1-Zero-Like Training": Σ_i Σ_t min(r A, clip(r) A) / (L · G), L the
    generation budget (algorithm.loss_norm_tokens, else the run's rollout.max_response_tokens)."""
    logp, old, rollout, ref, adv, mask = _inputs(7)
    lpd = logp.detach()
    cfg = AlgorithmConfig(policy_loss="dr_grpo", loss_norm_tokens=norm_cfg, is_clamp=1.5, kl_coef=0.03, kl_type="k3")
    b, t = mask.shape
    w = _is_weight(old, rollout, cfg.is_clamp)
    denom = want_norm * b
    want_loss, want_grad, n_clipped = 0.0, torch.zeros(b, t, dtype=F64), 0
    for i in range(b):
        a = float(adv[i])
        for j in range(t):
            if not mask[i, j]:
                continue
            r = math.exp(float(lpd[i, j] - old[i, j]))
            unclipped, clipped = r * a, min(max(r, 1 - cfg.eps_low), 1 + cfg.eps_high) * a
            kl, dkl = _k3_and_grad(float(lpd[i, j]), float(ref[i, j]))
            want_loss += (-min(unclipped, clipped) * float(w[i, j]) + cfg.kl_coef * kl) / denom
            pg_grad = 0.0 if clipped < unclipped else -a * r * float(w[i, j])
            n_clipped += clipped < unclipped
            want_grad[i, j] = (pg_grad + cfg.kl_coef * dkl) / denom
    assert 0 < n_clipped < mask.sum()

    loss, grad, m = _run(cfg, logp, old, rollout, ref, adv, mask, max_response_tokens=norm_run)
    torch.testing.assert_close(loss, torch.tensor(want_loss, dtype=F64), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    assert m["clip_frac"].item() == pytest.approx(n_clipped / mask.sum().item())


def test_dr_grpo_token_gradient_does_not_depend_on_the_answer_length():
    """Two answers with the same advantage and ratio 1, of 2 and 6 tokens: under dr_grpo every token
    gets the same gradient; under ppo_clip with a per-sequence mean the short one's are 3x larger."""
    t = 8
    mask = torch.zeros(2, t, dtype=torch.bool)
    mask[0, :2], mask[1, :6] = True, True
    old = torch.full((2, t), -1.0, dtype=F64)
    adv = torch.tensor([1.0, 1.0], dtype=F64)
    grads = {}
    for name, agg in (("dr_grpo", "token_mean"), ("ppo_clip", "seq_mean_token_mean")):
        cfg = AlgorithmConfig(policy_loss=name, loss_agg=agg, is_clamp=0.0)
        grads[name] = _run(cfg, old, old, old, old, adv, mask, max_response_tokens=t)[1]
    g = grads["dr_grpo"]
    assert torch.allclose(g[mask], g[mask][0].expand(8)) and g[0, 0].item() == pytest.approx(-1 / (t * 2))
    g = grads["ppo_clip"]
    assert g[0, 0].item() == pytest.approx(3 * g[1, 0].item())


def test_dr_grpo_without_a_normaliser_names_the_field():
    logp, old, rollout, ref, adv, mask = _inputs(1)
    with pytest.raises(ValueError, match=r"^algorithm.policy_loss='dr_grpo' needs algorithm.loss_norm_tokens > 0"):
        policy_loss(logp, old, rollout, adv, mask, AlgorithmConfig(policy_loss="dr_grpo"))
    with pytest.raises(ValueError, match=r"^algorithm.loss_norm_tokens=-1 must be >= 0"):
        policy_loss(logp, old, rollout, adv, mask, AlgorithmConfig(policy_loss="dr_grpo", loss_norm_tokens=-1))


# ---------------------------------------------------------------- CISPO


@pytest.mark.parametrize("agg", sorted(LOSS_AGG))
def test_cispo_matches_the_paper_loss_and_gradient(agg):
    """MiniMax-M1's CISPO: -sg(min(r, 1 + ε_high)) · A · log π per token (REINFORCE with a truncated,
    detached IS weight), normalised by the token count (token_mean; seq_mean_token_mean also checked)."""
    logp, old, rollout, ref, adv, mask = _inputs(11, spread=0.5)
    cfg = AlgorithmConfig(policy_loss="cispo", cispo_eps_high=0.3, is_clamp=1.3, kl_coef=0.02, kl_type="k3",
                          loss_agg=agg)
    b, t = mask.shape
    w = _is_weight(old, rollout, cfg.is_clamp)
    n_tok = int(mask.sum())
    want_loss, want_grad, n_trunc = 0.0, torch.zeros(b, t, dtype=F64), 0
    for i in range(b):
        n_i = int(mask[i].sum())
        denom = n_tok if agg == "token_mean" else n_i * b
        for j in range(t):
            if not mask[i, j]:
                continue
            lp = float(logp[i, j].detach())
            r = math.exp(lp - float(old[i, j]))
            r_hat = min(r, 1 + cfg.cispo_eps_high)
            n_trunc += r > 1 + cfg.cispo_eps_high
            kl, dkl = _k3_and_grad(lp, float(ref[i, j]))
            want_loss += (-r_hat * float(adv[i]) * lp * float(w[i, j]) + cfg.kl_coef * kl) / denom
            # the weight is a constant: d/dlogp = -r_hat · A · w, never 0 for a truncated token
            want_grad[i, j] = (-r_hat * float(adv[i]) * float(w[i, j]) + cfg.kl_coef * dkl) / denom
    assert 0 < n_trunc < n_tok

    loss, grad, m = _run(cfg, logp, old, rollout, ref, adv, mask)
    torch.testing.assert_close(loss, torch.tensor(want_loss, dtype=F64), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    assert m["clip_frac"].item() == pytest.approx(n_trunc / n_tok)
    assert (grad[mask] != 0).all()


# ---------------------------------------------------------------- every loss


@pytest.mark.parametrize("agg", sorted(LOSS_AGG))
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_micro_batch_losses_sum_to_the_full_batch(name, agg):
    """Normalised by the batch's global counts, micro-batch losses (and their gradients) add up to
    the whole batch's; without them they do not."""
    logp, old, rollout, ref, adv, mask = _inputs(21, b=7, spread=0.2)
    cfg = AlgorithmConfig(policy_loss=name, loss_agg=agg, is_clamp=1.5, kl_coef=0.05, gspo_eps_low=0.01,
                          gspo_eps_high=0.01, cispo_eps_high=0.1)
    full, full_grad, _ = _run(cfg, logp, old, rollout, ref, adv, mask, max_response_tokens=12)
    counts = global_counts(mask)
    parts, grads, local = [], [], []
    for s in (slice(0, 2), slice(2, 5), slice(5, 7)):
        loss, grad, _ = _run(cfg, logp[s], old[s], rollout[s], ref[s], adv[s], mask[s], max_response_tokens=12,
                             **counts)
        parts.append(loss)
        grads.append(grad)
        local.append(_run(cfg, logp[s], old[s], rollout[s], ref[s], adv[s], mask[s], max_response_tokens=12)[0])
    torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.cat(grads), full_grad, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(sum(local), full)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_logs_the_same_metrics(name):
    logp, old, rollout, ref, adv, mask = _inputs(2, dtype=torch.float32)
    cfg = AlgorithmConfig(policy_loss=name, kl_coef=0.1)
    loss, m = policy_loss(logp, old, rollout, adv, mask, cfg, ref_logprobs=ref, entropy=torch.ones_like(old),
                          max_response_tokens=16)
    assert torch.isfinite(loss) and loss.requires_grad
    assert sorted(m) == sorted(["clip_frac", "is_weight_mean", "is_weight_max", "is_clamped_frac", "approx_kl",
                                "train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max", "kl_ref",
                                "entropy", "train_rollout_logprob_abs_diff_hist",
                                "train_rollout_logprob_abs_diff_first_total", "first_tokens_total",
                                *(f"train_rollout_logprob_abs_diff_{k}_total" for k in ("last", "over1", "sum"))])
    hist = m.pop("train_rollout_logprob_abs_diff_hist")
    assert hist.shape == (162,) and int(hist.sum()) == int(mask.sum())
    assert all(v.dim() == 0 and not v.requires_grad and torch.isfinite(v) for v in m.values())
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(float((old - rollout).abs()[mask].mean()))
    loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[~mask] == 0).all()


def test_unknown_policy_loss_is_one_line_naming_the_field():
    logp, old, rollout, _, adv, mask = _inputs(0)
    with pytest.raises(ValueError) as e:
        policy_loss(logp, old, rollout, adv, mask, AlgorithmConfig(policy_loss="ppo"))
    assert str(e.value) == "algorithm.policy_loss='ppo' is not one of cispo, dr_grpo, gspo, ppo_clip"


def test_the_run_plan_accepts_exactly_the_registered_names():
    from colocate_rl.plan import REGISTRY_FIELDS

    assert REGISTRY_FIELDS["algorithm.advantage"]() == list(ADVANTAGES)
    assert REGISTRY_FIELDS["algorithm.policy_loss"]() == list(POLICY_LOSSES)
    assert AlgorithmConfig().policy_loss in POLICY_LOSSES and AlgorithmConfig().advantage in ADVANTAGES


# ---------------------------------------------------------------- ppo_clip is the loss it was


def _ppo_clip_before_the_registry(logprobs, old_logprobs, rollout_logprobs, advantages, loss_mask, cfg, *,
                                  ref_logprobs=None, entropy=None, global_token_count=None, global_seq_count=None):
    """colocate_rl.algorithms.losses.policy_loss as it was (commit 2de9df6), aggregation and KL inlined."""

    def masked_mean(x, mask):
        return torch.where(mask, x, 0).sum() / mask.sum().clamp(min=1)

    old_logprobs, rollout_logprobs = old_logprobs.detach(), rollout_logprobs.detach()
    mask = loss_mask.bool()
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    adv = advantages.detach().unsqueeze(1)
    surr = ratio * adv
    surr_clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv
    pg = -torch.minimum(surr, surr_clipped)
    with torch.no_grad():
        is_raw = (old_logprobs - rollout_logprobs).clamp(max=20.0).exp()
        is_weight = is_raw.clamp(max=cfg.is_clamp) if cfg.is_clamp > 0 else torch.ones_like(is_raw)
    per_token = pg * is_weight
    metrics = {}
    if cfg.kl_coef:
        if cfg.kl_type == "k1":
            kl = logprobs - ref_logprobs.detach()
        else:
            d = ref_logprobs.detach() - logprobs
            kl = d.exp() - d - 1
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl_ref"] = masked_mean(kl.detach(), mask)
    if cfg.loss_agg == "token_mean":
        denom = global_token_count if global_token_count is not None else mask.sum().clamp(min=1)
        loss = torch.where(mask, per_token, 0).sum() / denom
    else:
        per_seq = torch.where(mask, per_token, 0).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        denom = global_seq_count if global_seq_count is not None else mask.any(dim=1).sum().clamp(min=1)
        loss = per_seq.sum() / denom
    with torch.no_grad():
        metrics["clip_frac"] = masked_mean((surr_clipped < surr).to(ratio.dtype), mask)
        metrics["is_weight_mean"] = masked_mean(is_weight, mask)
        metrics["is_weight_max"] = torch.where(mask, is_raw, 0).max() if mask.numel() else is_raw.new_zeros(())
        clamped = is_raw > cfg.is_clamp if cfg.is_clamp > 0 else torch.zeros_like(mask)
        metrics["is_clamped_frac"] = masked_mean(clamped.to(ratio.dtype), mask)
        metrics["approx_kl"] = masked_mean(ratio - 1 - log_ratio, mask)
        metrics["train_rollout_logprob_abs_diff"] = masked_mean((old_logprobs - rollout_logprobs).abs(), mask)
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.detach(), mask)
    return loss, {k: v.detach() for k, v in metrics.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(4))
def test_ppo_clip_is_bit_identical_to_the_loss_before_the_registry(seed, dtype):
    logp, old, rollout, ref, adv, mask = _inputs(100 + seed, spread=0.4, dtype=dtype)
    ent = torch.rand(mask.shape, dtype=dtype)
    for agg in sorted(LOSS_AGG):
        for is_clamp, kl_coef, kl_type in ((2.0, 0.0, "k3"), (0.0, 0.1, "k1"), (1.2, 0.05, "k3")):
            cfg = AlgorithmConfig(loss_agg=agg, is_clamp=is_clamp, kl_coef=kl_coef, kl_type=kl_type)
            assert cfg.policy_loss == "ppo_clip"  # the default
            for counts in ({}, global_counts(mask)):
                got, want = [], []
                for fn, out in ((policy_loss, got), (_ppo_clip_before_the_registry, want)):
                    x = logp.detach().clone().requires_grad_()
                    loss, m = fn(x, old, rollout, adv, mask, cfg, ref_logprobs=ref, entropy=ent, **counts)
                    loss.backward()
                    out += [loss.detach(), x.grad, m]
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                logged_since = ["train_rollout_logprob_abs_diff_max", "train_rollout_logprob_abs_diff_hist",
                                "train_rollout_logprob_abs_diff_first_total", "first_tokens_total",
                                *(f"train_rollout_logprob_abs_diff_{k}_total" for k in ("last", "over1", "sum"))]
                assert sorted(got[2]) == sorted([*want[2], *logged_since])
                assert all(torch.equal(got[2][k], want[2][k]) for k in want[2]), (agg, is_clamp, kl_coef)
