"""One checksum for "the engine holds the actor's weights": computed the same way on both sides."""

from __future__ import annotations

import torch


def tensor_checksum(t: torch.Tensor) -> float:
    """Position-weighted float64 sum: sum_i x_i * (1 + i % 251). A permutation or a changed element
    changes it (a plain sum misses swapped rows). Equal within float64 rounding of the same values."""
    x = t.detach().reshape(-1).to(torch.float64)
    w = (torch.arange(x.numel(), device=x.device) % 251 + 1).to(torch.float64)
    return float((x * w).sum())
