"""One checksum for "the engine holds the actor's weights": computed the same way on both sides."""

from __future__ import annotations

import torch

_CHUNK = 1 << 24


def tensor_checksum(t: torch.Tensor, offset: int = 0) -> float:
    """Position-weighted float64 sum: sum_i x_i * (1 + (offset + i) % 251). A permutation or a changed
    element changes it (a plain sum misses swapped rows). Equal within float64 rounding of the same
    values. ``offset``: the flat index of t's first element in a larger tensor, so the checksums of
    row blocks (tensor-parallel shards) add up to the whole tensor's."""
    x = t.detach().reshape(-1)
    if x.dtype.itemsize == 1 and x.is_floating_point():
        x = x.view(torch.uint8)  # float8 formats (e4m3 weights, e8m0 scales): their bytes are their values
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, x.numel(), _CHUNK):  # in chunks: a whole 8B model's embedding in float64 is 5 GB
        part = x[start : start + _CHUNK].to(torch.float64)
        w = ((torch.arange(part.numel(), device=x.device) + offset + start) % 251 + 1).to(torch.float64)
        total += (part * w).sum()
    return float(total)


def combine_worker_checksums(per_worker: list[dict[str, tuple[float, bool]]]) -> dict[str, float]:
    """The engine's checksums from its workers' {name: (checksum, sharded)}: a sharded tensor's is the
    sum of its shards' (each taken at its global offset), a replicated one's is worker 0's."""
    return {name: sum(w[name][0] for w in per_worker) if sharded else value
            for name, (value, sharded) in per_worker[0].items()}


class WeightMismatch(RuntimeError):
    pass


def checksums(named_tensors, names) -> dict[str, float]:
    """Checksums of the tensors named in ``names`` (the model family's Family.verify_names) among
    HF-named ones. Consumes the whole iterator: the actor's export is collective, every rank must
    walk it to the end."""
    want = set(names)
    return {n: tensor_checksum(t) for n, t in named_tensors if n in want}


def compare(actor: dict[str, float], engine: dict[str, float], who: str = "actor") -> int:
    """Raises WeightMismatch naming the first tensor whose checksums differ (beyond float64 rounding);
    returns how many were compared. Comparing none is an error: a check that checks nothing passes
    whatever the engine holds."""
    if not actor:
        raise WeightMismatch("weight verification compared no tensor: the model family names none of the "
                             "exported tensors (models.registry.Family.verify_names)")
    for name, a in actor.items():
        e = engine.get(name)
        if e is None or abs(a - e) > 1e-9 + 1e-12 * abs(a):
            raise WeightMismatch(f"after the sync, '{name}' differs: {who} checksum {a!r}, engine {e!r}")
    return len(actor)
