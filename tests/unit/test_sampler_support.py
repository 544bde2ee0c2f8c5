"""trainer.logprobs.sampler_support / sampled_token_logprobs: the tokens vLLM's top-k then top-p
filter keeps, on hand-built distributions (ties at the top-k and top-p boundaries, the filters'
order, the most likely token always kept), and logprobs renormalised over them with no gradient
reaching the dropped logits. Against vLLM's own filter: tests/integration/test_truncated_sampling.py."""

import dataclasses

import pytest
import torch

from colocate_rl.resolved import Sampling
from colocate_rl.trainer.logprobs import sampled_token_logprobs, sampler_support, token_logprobs


def support(probs, top_k=0, top_p=1.0) -> list[bool]:
    """sampler_support of one row whose softmax is ``probs``."""
    return sampler_support(torch.tensor([probs]).log(), top_k, top_p)[0].tolist()


def test_top_p_drops_the_least_likely_until_the_rest_reach_p():
    probs = [0.1, 0.4, 0.05, 0.3, 0.15]
    # From the least likely up (1 - p = 0.28): 0.05, then 0.1 (0.15 in all) go; with 0.15 the sum
    # would reach 0.3 > 0.28, so it stays.
    assert support(probs, top_p=0.72) == [False, True, False, True, True]
    assert support(probs, top_p=0.99) == [True] * 5
    # The most likely token stays however small p is.
    assert support(probs, top_p=1e-6) == [False, True, False, False, False]


def test_a_tie_at_the_top_p_boundary_is_split():
    # Which of the tied tokens goes first is the order torch's sort leaves them in, as in vLLM
    # (tests/integration/test_truncated_sampling.py compares the two on many ties); how many go is not.
    probs = [0.3, 0.2, 0.3, 0.2]
    # 0.2 and 0.2 tie at the boundary (1 - p = 0.25): one goes, one stays, the kept mass is 0.8.
    keep = support(probs, top_p=0.75)
    assert keep[0] and keep[2] and keep[1] + keep[3] == 1
    # Both below the boundary (0.2 + 0.2 <= 0.45): both go.
    assert support(probs, top_p=0.55) == [True, False, True, False]
    # The tie at the top: both 0.3s stay while 0.2 + 0.2 + 0.3 = 0.7 > 1 - p (0.65); one goes once
    # it is not (0.75), as the most likely token is never dropped.
    assert support(probs, top_p=0.35) == [True, False, True, False]
    keep = support(probs, top_p=0.25)
    assert keep[0] + keep[2] == 1 and not keep[1] and not keep[3]


def test_top_k_keeps_every_tie_at_the_kth_logit():
    x = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.5]])
    assert sampler_support(x, top_k=2)[0].tolist() == [False, True, True, True, False]
    assert sampler_support(x, top_k=1)[0].tolist() == [False, True, False, False, False]
    for off in (0, 5, 9):  # 0 or at least the vocabulary: no filter
        assert sampler_support(x, top_k=off).all()


def test_top_k_runs_before_top_p():
    probs = [0.5, 0.2, 0.2, 0.1]
    # top-p alone (1 - p = 0.25): only 0.1 goes.
    assert support(probs, top_p=0.75) == [True, True, True, False]
    # top-k 3 first: the three left renormalise to 5/9, 2/9, 2/9, and 2/9 <= 0.25 drops one of the tied 0.2s.
    keep = support(probs, top_k=3, top_p=0.75)
    assert keep[0] and keep[1] + keep[2] == 1 and not keep[3]
    # The other order (top-p, then top-k 3) would keep [True, True, True, False].


@pytest.mark.parametrize("fused", [False, True])  # fused: the compiled kernels' code, run eagerly here
def test_truncated_logprobs_renormalise_over_the_kept_tokens(fused):
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 40)
    tokens = torch.randint(0, 40, (2, 6))
    temperature, top_k, top_p = 0.7, 25, 0.8
    x = logits / temperature
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
    keep = sampler_support(x.view(-1, 40), top_k, top_p).view(2, 6, 40)
    # Put each target inside the support the way the sampler would have drawn it.
    tokens[:, 1:] = torch.where(keep[:, :-1].gather(-1, targets[:, :-1, None])[..., 0], tokens[:, 1:],
                                x[:, :-1].argmax(-1))
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
    assert 0 < keep.sum(-1).min() and keep.sum(-1).max() < 25  # both filters cut something

    ours_in, ref_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = sampled_token_logprobs(ours_in, tokens, temperature, top_k, top_p, fused=fused)
    ref = (ref_in / temperature).masked_fill(~keep, float("-inf")).log_softmax(-1)
    ref = torch.nn.functional.pad(ref.gather(-1, targets[..., None])[:, :-1, 0], (1, 0))
    assert (ours - ref).abs().max() < 1e-6 and (ours[:, 0] == 0).all()
    # Each logprob is the untruncated one minus log(the kept mass): larger, never smaller.
    full = token_logprobs(logits, tokens, temperature)
    assert (ours[:, 1:] > full[:, 1:]).all()

    grad = torch.randn(2, 6)
    ours.backward(grad)
    ref.backward(grad)
    assert (ours_in.grad[:, :-1][~keep[:, :-1]] == 0).all()  # nothing reaches a dropped logit
    assert (ours_in.grad - ref_in.grad).abs().max() < 1e-6


def test_a_sampled_token_outside_the_support_keeps_a_finite_logprob():
    # The two sides' logits differ slightly outside exact mode, so the trainer's boundary can miss
    # a token the sampler kept: it is scored over the support plus itself, never -inf.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(1, 2, 4).clone()
    tokens = torch.tensor([[0, 3]])
    lp = sampled_token_logprobs(logits, tokens, 1.0, top_p=0.6)  # keeps 0.5 and 0.3
    assert torch.isclose(lp[0, 1], torch.tensor(0.05 / 0.85).log(), atol=1e-6)


def test_without_a_filter_the_logprobs_are_the_untruncated_ones_bit_for_bit():
    torch.manual_seed(1)
    logits, tokens = torch.randn(2, 5, 30), torch.randint(0, 30, (2, 5))
    for temperature in (1.0, 0.6):
        assert torch.equal(sampled_token_logprobs(logits, tokens, temperature, top_k=0, top_p=1.0),
                           token_logprobs(logits, tokens, temperature))


@pytest.mark.parametrize("temperature, top_k, top_p, truncated", [
    (1.0, 0, 1.0, False), (0.7, 0, 0.9, True), (1.0, 20, 1.0, True), (0.0, 20, 0.9, False),
])
def test_sampling_says_when_it_truncates(temperature, top_k, top_p, truncated):
    s = Sampling(n=2, temperature=1.0, top_p=1.0, top_k=0, max_response_tokens=4, seed=0, seed_each_step=True)
    assert dataclasses.replace(s, temperature=temperature, top_k=top_k, top_p=top_p).truncated is truncated


def test_rollout_top_k_reaches_the_sampling_settings_with_minus_one_as_off():
    from colocate_rl.config import Config, ModelConfig, load
    from colocate_rl.plan import rollout_views

    def sampling(*overrides):
        cfg = load(Config(model=ModelConfig(path="m")), overrides=list(overrides))
        return rollout_views(cfg.rollout, cfg.sync, quiet=True)[0]

    assert sampling("rollout.top_k=-1").top_k == 0 and not sampling("rollout.top_k=-1").truncated
    assert sampling("rollout.top_k=40").top_k == 40 and sampling("rollout.top_k=40").truncated
    assert sampling("rollout.top_p=0.9").truncated and not sampling().truncated
