"""Direct weight loading: the copies vLLM's ``load_weights`` makes, recorded once, replayed per sync.

Into an unquantized GPU engine a sync ends in ``model.load_weights``: per tensor, Python walks the
model's name mapping (stacked q/k/v and gate/up, expert tables), finds the parameter and calls its
weight loader, which narrows the incoming tensor to this worker's shard and copies it into a slice
of the live parameter. Those copies are the same at every sync: same names, same slices. So the
first time a name arrives it goes through ``load_weights`` under a dispatch mode that records each
copy into the model's storage as (destination view, source view relative to the incoming tensor);
from then on that name is one ``copy_`` per recorded slice, with no loader in between.

A name is replayed only if everything its loader wrote into the model was a plain copy of the
incoming tensor's own elements (constant fills, such as the zeroed rows that pad a vocabulary
shard, are left as they are: nothing else writes them). A loader that computes (scales, casts into
a temporary, concatenates), writes the model another way, or copies the incoming tensor anywhere
but into the model, keeps that name on ``load_weights``. A loader that swaps a parameter's storage
ends direct loading for the engine: the recorded views would point at storage the model dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from colocate_rl.weight_sync.buckets import Bucket, TensorMeta

Named = list[tuple[str, torch.Tensor]]

_aten = torch.ops.aten
_FILLS = {_aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default}


@dataclass(frozen=True)
class _Copy:
    dst: torch.Tensor  # a view of the model's storage
    offset: int  # the source's first element, counted from the incoming tensor's first element
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _storages(model: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last] storage element a strided view touches (non-negative strides)."""
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    return t.storage_offset(), last


class _Recorder(TorchDispatchMode):
    """Watches every op while one incoming tensor ``src`` is loaded: copies of it into ``owned``
    storage are kept; anything that makes replaying them incomplete clears ``replayable``."""

    def __init__(self, owned: set[int], src: torch.Tensor) -> None:
        super().__init__()
        self.owned, self.src = owned, src
        self.ptr = src.untyped_storage().data_ptr()
        self.lo, self.hi = src.storage_offset(), src.storage_offset() + src.numel() - 1
        self.copies: list[_Copy] = []
        self.replayable = True

    def _from_src(self, t: object) -> bool:
        if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() != self.ptr:
            return False
        lo, hi = _span(t)
        return self.lo <= lo and hi <= self.hi

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.replayable:
            self._note(func, args, kwargs)
        return func(*args, **kwargs)

    def _note(self, func, args, kwargs) -> None:
        values = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
        written = [values.get(a.name) for a in func._schema.arguments if a.alias_info is not None
                   and a.alias_info.is_write]
        written = [t for t in written if isinstance(t, torch.Tensor)]
        if not written:
            return
        into_model = any(t.untyped_storage().data_ptr() in self.owned for t in written)
        reads_src = any(self._from_src(v) for v in values.values())
        if func is _aten.copy_.default and reads_src:
            dst, src = args[0], args[1]
            if into_model and src.dtype == self.src.dtype:
                self.copies.append(_Copy(dst, src.storage_offset() - self.src.storage_offset(),
                                         tuple(src.shape), tuple(src.stride())))
            else:
                self.replayable = False  # incoming data copied elsewhere: a loader that computes
        elif into_model and not (func in _FILLS and not reads_src):
            self.replayable = False
        elif reads_src and not into_model:
            self.replayable = False  # e.g. a cast of the incoming tensor into a temporary


# Copies at least this large run one kernel each; smaller ones are batched (see replay).
_BATCH_BELOW_BYTES = 64 * 2**20


def _batchable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous()
            and dst.numel() * dst.element_size() < _BATCH_BELOW_BYTES)


def replay(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair. Small same-layout pairs go through one ``_foreach_copy_``
    per dtype, which launches a kernel per ~hundred tensors rather than one per tensor: a MoE model's
    sync replays a copy per expert matrix (4,719 copies at 12 of Qwen3-30B-A3B's layers), and one
    launch each made the replay launch-bound (benchmarks/sync/pack.py). No two pairs write the same
    memory (each name's loader writes its own slices), so the copies' order does not matter."""
    batched: dict[tuple[torch.dtype, torch.device], tuple[list, list]] = {}
    for dst, src in pairs:
        if _batchable(dst, src):
            dsts, srcs = batched.setdefault((dst.dtype, dst.device), ([], []))
            dsts.append(dst)
            srcs.append(src)
        else:
            dst.copy_(src)
    for dsts, srcs in batched.values():
        torch._foreach_copy_(dsts, srcs)


@dataclass
class BucketCopies:
    """One bucket layout's copies, resolved once. Each sync then cuts the new bucket into
    consecutive segments with one ``split_with_sizes`` and copies them out in one batch, instead of
    a view, a lookup and a check per tensor in Python (docs/lab/performance_log.md, *The engine
    loads whole buckets*)."""

    sizes: list[int]  # the flat bucket as consecutive segments, sources and the gaps between them
    batched: tuple[list[torch.Tensor], list[int]]  # destinations and their segments, one _foreach_copy_
    single: list[tuple[torch.Tensor, int]]  # large or casting copies: one copy_ each
    strided: list[_Copy]  # sources that are no one segment (offset counted from the flat's start)

    @classmethod
    def build(cls, flat: torch.Tensor, at: dict[str, int], copies: dict[str, list[_Copy]]) -> BucketCopies:
        """``at``: each loaded name's first element in ``flat``; ``copies``: its recorded copies."""
        runs, strided = [], []
        for name, start in at.items():
            for c in copies[name]:
                n = math.prod(c.size)
                source = torch.empty_strided(c.size, c.stride, device="meta")  # its layout, no memory
                if n and c.dst.is_contiguous() and source.is_contiguous():
                    runs.append((start + c.offset, n, c.dst.view(-1)))
                elif n:
                    strided.append(_Copy(c.dst, start + c.offset, c.size, c.stride))
        sizes, dsts, pos = [], [], 0
        for start, n, dst in sorted(runs, key=lambda r: r[0]):
            if start < pos:  # a source read twice (into two places): its own view
                strided.append(_Copy(dst, start, (n,), (1,)))
                continue
            if start > pos:
                sizes.append(start - pos)
            dsts.append((dst, len(sizes)))
            sizes.append(n)
            pos = start + n
        if pos < flat.numel():
            sizes.append(flat.numel() - pos)
        # Every destination here is contiguous and every segment is: _batchable's remaining terms.
        small = [d.dtype == flat.dtype and d.numel() * d.element_size() < _BATCH_BELOW_BYTES for d, _ in dsts]
        batched = [pair for pair, b in zip(dsts, small) if b]
        single = [pair for pair, b in zip(dsts, small) if not b]
        return cls(sizes, ([d for d, _ in batched], [i for _, i in batched]), single, strided)

    @torch.no_grad()
    def run(self, flat: torch.Tensor) -> None:
        """Copies a bucket of this layout, ``flat`` its new contents, into the model."""
        segs = flat.split_with_sizes(self.sizes)
        dsts, idx = self.batched
        if dsts:
            torch._foreach_copy_(dsts, [segs[i] for i in idx])
        for dst, i in self.single:
            dst.copy_(segs[i])
        for c in self.strided:
            c.dst.copy_(flat.as_strided(c.size, c.stride, flat.storage_offset() + c.offset))


class CopyPlan:
    """Loads named tensors into ``model``: replayed copies for names seen before, ``load`` (the
    model's own ``load_weights``) for the rest, recording what it does the first time. One plan per
    live model: the recorded destinations are views of its storage."""

    def __init__(self, model: torch.nn.Module, load: Callable[[Named], None]) -> None:
        self.model, self._load = model, load
        self.copies: dict[str, list[_Copy]] = {}
        self.slow: set[str] = set()  # names whose loader does more than copy
        self.enabled = True
        self._owned = _storages(model)
        # Bucket layouts (names, shapes, offsets) whose every tensor replays, resolved once.
        self._buckets: dict[tuple[TensorMeta, ...], BucketCopies] = {}

    def resolved(self, bucket: Bucket) -> BucketCopies | None:
        """The copies of a bucket laid out as this one (the same names, shapes and offsets), where
        one was loaded before with every tensor replayed; None otherwise. ``.run(bucket.flat)``
        loads it."""
        return self._buckets.get(tuple(bucket.metas)) if self.enabled else None

    def load(self, named: Iterable[tuple[str, torch.Tensor]], bucket: Bucket | None = None) -> None:
        """Loads ``named``; given the ``bucket`` they are views of, and every one replays, the
        bucket's layout is remembered (``resolved``)."""
        named = list(named)
        rest: Named = []
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model view, incoming view) to replay
        for name, t in named:
            copies = self.copies.get(name) if self.enabled and t.is_contiguous() else None
            if copies is not None:
                base = t.storage_offset()
                pairs += [(c.dst, t.as_strided(c.size, c.stride, base + c.offset)) for c in copies]
            elif self.enabled and name not in self.slow and t.is_contiguous():
                self._record(name, t)
            else:
                rest.append((name, t))
        replay(pairs)
        if rest:
            self._load(rest)
        if bucket is not None and self.enabled and all(n in self.copies for n, _ in named):
            base = bucket.flat.storage_offset()
            at = {n: t.storage_offset() - base for n, t in named}
            self._buckets[tuple(bucket.metas)] = BucketCopies.build(bucket.flat, at, self.copies)

    def _record(self, name: str, t: torch.Tensor) -> None:
        rec = _Recorder(self._owned, t)
        with rec:
            self._load([(name, t)])
        if _storages(self.model) != self._owned:
            # A loader replaced a parameter's storage: recorded views may point at dropped memory.
            self.enabled, self.copies, self._buckets = False, {}, {}
        elif rec.replayable:
            self.copies[name] = rec.copies
        else:
            self.slow.add(name)

    def stats(self) -> dict[str, int]:
        return {"direct": len(self.copies), "load_weights": len(self.slow), "enabled": int(self.enabled)}
