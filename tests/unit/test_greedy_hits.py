"""trainer.logprobs.greedy_hits: whether each token is what greedy decoding picks, aligned as the logprobs."""

import torch

from colocate_rl.trainer.logprobs import greedy_hits, token_logprobs


def test_hits_follow_the_row_argmax_one_position_late():
    tokens = torch.tensor([[0, 2, 3, 1]])
    logits = torch.full((1, 4, 5), -1.0)
    for position, best in enumerate([2, 4, 1, 0]):  # position t predicts tokens[t + 1]
        logits[0, position, best] = 3.0
    assert greedy_hits(logits, tokens).tolist() == [[False, True, False, True]]


def test_a_hit_is_the_most_likely_token_of_its_position():
    torch.manual_seed(0)
    logits, tokens = torch.randn(3, 7, 11), torch.randint(0, 11, (3, 7))
    tokens[:, 1:] = torch.where(torch.rand(3, 6) < 0.5, logits[:, :-1].argmax(-1), tokens[:, 1:])
    hits = greedy_hits(logits, tokens)
    best = token_logprobs(logits.exp().log(), tokens) >= torch.nn.functional.pad(
        logits.log_softmax(-1).amax(-1)[:, :-1], (1, 0)) - 1e-6
    assert hits[:, 1:].any() and not hits[:, 1:].all()
    assert torch.equal(hits[:, 1:], best[:, 1:]) and not hits[:, 0].any()
