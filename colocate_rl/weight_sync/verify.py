"""One checksum for "the engine holds the actor's weights": computed the same way on both sides."""

from __future__ import annotations

import torch


def tensor_checksum(t: torch.Tensor, offset: int = 0) -> float:
    """Position-weighted float64 sum: sum_i x_i * (1 + (offset + i) % 251). A permutation or a changed
    element changes it (a plain sum misses swapped rows). Equal within float64 rounding of the same
    values. ``offset``: the flat index of t's first element in a larger tensor, so the checksums of
    row blocks (tensor-parallel shards) add up to the whole tensor's."""
    x = t.detach().reshape(-1).to(torch.float64)
    w = ((torch.arange(x.numel(), device=x.device) + offset) % 251 + 1).to(torch.float64)
    return float((x * w).sum())


def combine_worker_checksums(per_worker: list[dict[str, tuple[float, bool]]]) -> dict[str, float]:
    """The engine's checksums from its workers' {name: (checksum, sharded)}: a sharded tensor's is the
    sum of its shards' (each taken at its global offset), a replicated one's is worker 0's."""
    return {name: sum(w[name][0] for w in per_worker) if sharded else value
            for name, (value, sharded) in per_worker[0].items()}


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
