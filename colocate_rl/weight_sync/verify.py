"""One checksum for "the engine holds the actor's weights": computed the same way on both sides."""

from __future__ import annotations

import torch


def tensor_checksum(t: torch.Tensor) -> float:
    """Position-weighted float64 sum: sum_i x_i * (1 + i % 251). A permutation or a changed element
    changes it (a plain sum misses swapped rows). Equal within float64 rounding of the same values."""
    x = t.detach().reshape(-1).to(torch.float64)
    w = (torch.arange(x.numel(), device=x.device) % 251 + 1).to(torch.float64)
    return float((x * w).sum())


class WeightMismatch(RuntimeError):
    pass


# Tensors vLLM keeps unfused and unpacked (embeddings, final norm, lm_head, first layer's norms):
# the ones whose checksum can be read inside the engine.
VERIFIABLE = ("embed_tokens.weight", "model.norm.weight", "lm_head.weight", "layers.0.input_layernorm.weight",
              "layers.0.post_attention_layernorm.weight")


def verifiable(names) -> list[str]:
    return [n for n in names if n.endswith(VERIFIABLE)]


def verifiable_checksums(named_tensors) -> dict[str, float]:
    """Checksums of the verifiable tensors among HF-named ones. Consumes the whole iterator: the
    actor's export is collective, every rank must walk it to the end."""
    return {n: tensor_checksum(t) for n, t in named_tensors if n.endswith(VERIFIABLE)}


def compare(actor: dict[str, float], engine: dict[str, float], who: str = "actor") -> None:
    """Raises WeightMismatch naming the first tensor whose checksums differ (beyond float64 rounding)."""
    for name, a in actor.items():
        e = engine.get(name)
        if e is None or abs(a - e) > 1e-9 + 1e-12 * abs(a):
            raise WeightMismatch(f"after the sync, '{name}' differs: {who} checksum {a!r}, engine {e!r}")
