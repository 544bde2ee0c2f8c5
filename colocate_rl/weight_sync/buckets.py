"""The weight-sync wire format: named tensors flattened into one-dtype buckets.

A bucket is one contiguous 1-D tensor plus, per tensor, (name, shape, dtype, offset, numel), so a
sync sends one handle per bucket instead of one message per tensor. ``pack`` consumes its input
lazily and holds at most about one bucket of pending tensors per dtype: the actor exports its
parameters one at a time and the whole model is never materialised a second time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

# alloc(numel, dtype, device) -> 1-D tensor to copy a bucket into (e.g. straight into shared memory).
Alloc = Callable[[int, torch.dtype, torch.device], torch.Tensor]


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # in elements, into Bucket.flat
    numel: int


@dataclass
class Bucket:
    flat: torch.Tensor  # [sum of numel] one dtype, contiguous
    metas: list[TensorMeta]

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


def _flush(pending: list[tuple[str, torch.Tensor]], alloc: Alloc) -> Bucket:
    numel = sum(t.numel() for _, t in pending)
    first = pending[0][1]
    flat = alloc(numel, first.dtype, first.device)
    metas, offset = [], 0
    for name, t in pending:
        metas.append(TensorMeta(name, tuple(t.shape), t.dtype, offset, t.numel()))
        offset += t.numel()
    if all(t.is_contiguous() for _, t in pending):
        # One cat writes the whole bucket in a few batched kernels: a MoE model exports thousands of
        # small expert tensors, and a copy each was launch- and Python-bound.
        torch.cat([t.view(-1) for _, t in pending], out=flat)
    else:
        for (_, t), m in zip(pending, metas):  # strided sources in one copy each (reshape would copy first)
            flat[m.offset : m.offset + m.numel].view(t.shape).copy_(t)
    return Bucket(flat, metas)


def pack(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float, alloc: Alloc = _empty
) -> Iterator[Bucket]:
    """Yields buckets of at most ``bucket_mb`` MiB, one dtype and device each, in input order per dtype.

    A tensor larger than a bucket gets a bucket of its own. Tensors of other dtypes wait in their own
    pending list, so a mixed-dtype stream holds at most one bucket per dtype at a time.
    """
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb={bucket_mb} must be > 0")
    limit = max(1, math.floor(bucket_mb * 2**20))
    pending: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for name, t in named_tensors:
        t = t.detach()
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        if pending.get(key) and sizes[key] + nbytes > limit:
            yield _flush(pending.pop(key), alloc)
        pending.setdefault(key, []).append((name, t))
        sizes[key] = (sizes[key] if len(pending[key]) > 1 else 0) + nbytes
        if sizes[key] >= limit:
            yield _flush(pending.pop(key), alloc)
    for group in pending.values():
        yield _flush(group, alloc)


def unpack(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """(name, view into bucket.flat) for each tensor; views share the bucket's memory."""
    return [(m.name, bucket.flat[m.offset : m.offset + m.numel].view(m.shape)) for m in bucket.metas]
