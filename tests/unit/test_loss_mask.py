"""Multi-turn rows: tool results and template tokens sit between the policy's turns, off loss_mask.
Every policy loss (GRPO's ppo_clip, GSPO, Dr. GRPO, CISPO), the KL term, the IS weight and the
logprob-gap metrics must ignore them: whatever a masked token's logprobs are, the loss, its
gradient on the policy's tokens and the metrics stay the same, and no gradient reaches it."""

from __future__ import annotations

import pytest
import torch

from colocate_rl.algorithms import ADVANTAGES, POLICY_LOSSES, policy_loss
from colocate_rl.config import AlgorithmConfig

F64 = torch.float64
B, T = 4, 16


def conversation_mask() -> torch.Tensor:
    """[B, T]: prompt (3 tokens), a first turn, a tool result (off the mask), a second turn,
    padding; rows of different lengths, one row of a single turn."""
    m = torch.zeros(B, T, dtype=torch.bool)
    m[0, 3:6] = m[0, 9:12] = True
    m[1, 3:5] = m[1, 8:15] = True
    m[2, 3:7] = True  # answered without a call
    m[3, 3:4] = m[3, 6:8] = m[3, 10:13] = True  # two tool turns
    return m


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 2 - 0.1
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    rollout = old + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    adv = ADVANTAGES["grpo"](torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=F64), 2, AlgorithmConfig())
    return logp, old, rollout, ref, adv


def masked_off(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` with every token off the mask replaced (what a tool result's tokens may hold)."""
    return torch.where(mask, x, torch.full_like(x, value))


def run(cfg, logp, old, rollout, ref, adv, mask):
    lp = logp.detach().clone().requires_grad_()
    loss, metrics = policy_loss(lp, old, rollout, adv, mask, cfg, ref_logprobs=ref, max_response_tokens=T)
    loss.backward()
    return loss.detach(), lp.grad, {k: v.clone() for k, v in metrics.items()}


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_a_masked_token_changes_nothing(name, kl_coef):
    assert {"ppo_clip", "gspo", "dr_grpo", "cispo"} <= set(POLICY_LOSSES)
    cfg = AlgorithmConfig(policy_loss=name, kl_coef=kl_coef, is_clamp=2.0)
    mask = conversation_mask()
    logp, old, rollout, ref, adv = inputs(0)
    loss, grad, metrics = run(cfg, logp, old, rollout, ref, adv, mask)
    assert torch.isfinite(loss) and grad[mask].abs().sum() > 0
    # The tool result's tokens take other values, finite and absurd: nothing may move.
    for value in (-30.0, 0.0, -1e-3):
        other = run(cfg, masked_off(logp, mask, value), masked_off(old, mask, value - 5),
                    masked_off(rollout, mask, value + 7), masked_off(ref, mask, 3 * value), adv, mask)
        assert torch.equal(other[0], loss), (name, value)
        assert torch.equal(other[1][mask], grad[mask]) and not other[1][~mask].any()
        assert other[2].keys() == metrics.keys()
        for k, v in metrics.items():
            assert torch.equal(other[2][k], v), (name, k)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_unmasking_a_tool_token_does_change_the_loss(name):
    """The control: the same change on a token the mask covers moves the loss or its gradient."""
    cfg = AlgorithmConfig(policy_loss=name, is_clamp=2.0)
    mask = conversation_mask()
    logp, old, rollout, ref, adv = inputs(1)
    loss, grad, _ = run(cfg, logp, old, rollout, ref, adv, mask)
    wider = mask.clone()
    wider[0, 6:9] = True  # row 0's tool result, now trained on
    other = run(cfg, logp, old, rollout, ref, adv, wider)
    assert not torch.equal(other[0], loss) or not torch.equal(other[1], grad)
    assert other[1][0, 6:9].abs().sum() > 0
