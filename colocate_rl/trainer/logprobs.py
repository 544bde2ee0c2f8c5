"""Per-token logprobs from (vocab-parallel) logits, aligned as in colocate_rl.types."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [b, t, V/tp] (this tensor-parallel rank's vocabulary slice), tokens [b, t] → [b, t]
    float32 with out[:, t] = log p(tokens[t] | tokens[:t]) and out[:, 0] = 0.

    Megatron's vocab_parallel_cross_entropy all-reduces max and sum-exp over the tensor-parallel
    group, so the full vocabulary is never gathered. It also overwrites its fp32 input in place
    (to save a copy): the logits must not be read after this call.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # Position t predicts tokens[t + 1]; the last position predicts nothing (its target is a dummy).
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
    nll = vocab_parallel_cross_entropy(logits, targets)  # [b, t]; needs contiguous logits (it views them 2-D)
    return torch.nn.functional.pad(-nll[:, :-1], (1, 0))
