"""Move tensors' storages to host memory and back, in place, by named part.

Each distinct storage is copied to a host buffer and then shrunk to 0 bytes with
``untyped_storage().resize_(0)``; onload regrows it and copies back. Every view into it (parameters,
Megatron's grad buffers and main_grad views, optimizer state, the optimizer's param_groups) stays
valid because the storage object itself is kept. Host buffers are pinned on GPU (the fast DMA
path) and kept across cycles, since pinning gigabytes costs more than the copy.

Parts (e.g. params / grads / optimizer) can move separately, so the colocated step can free the
gradients and optimizer state before the weight sync and the parameters after it. A storage
reachable from several parts (fp32 training: the optimizer's parameters *are* the model's) belongs
to the first part that lists it. A *scratch* part holds nothing worth keeping between uses (the
gradients: zeroed before every backward), so it is freed without a copy and comes back zero-filled:
the bytes it would have moved both ways (a fifth of the actor's state in bf16 training) stay put.
A *frozen* part does not change while it is on the device (the reference policy of the KL
penalty), so once its host copy is taken, offloading it only frees the device memory; ``changed``
says its device bytes were rewritten (loaded from a checkpoint) and the next offload copies again.
A *prefetched* part is not needed until later in the step (the optimizer state: only the optimizer
step reads it), so on a GPU its onload copies run on a side stream, behind the forward and backward
that follow; ``ready()`` makes the current stream wait for them (a device-side wait, no host stall)
and is called before anything reads the part, and by ``offload``.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Sequence

import torch

from colocate_rl import platform

TensorsFn = Callable[[], Iterable[Optional[torch.Tensor]]]


class HostOffload:
    """``parts``: name → function listing that part's tensors (duplicates, views and None are fine),
    in ownership order. ``scratch``: the parts among them that are freed rather than copied.
    ``frozen``: the parts whose host copy, once taken, stays valid; ``prefetched``: the parts whose
    onload may finish behind later work (see the module doc)."""

    def __init__(self, parts: dict[str, TensorsFn], scratch: Sequence[str] = (), frozen: Sequence[str] = (),
                 prefetched: Sequence[str] = ()):
        self._parts = parts
        self._scratch = set(self._select(scratch))
        self._frozen = set(self._select(frozen))
        self._prefetched = set(self._select(prefetched))
        self._stream = None  # the side stream of prefetched onloads (GPU), made at first use
        # (begin, end) CUDA events and bytes of the prefetch in flight, then of the one waited for
        self._pending: Optional[tuple[torch.cuda.Event, torch.cuda.Event, int]] = None
        self._done: Optional[tuple[torch.cuda.Event, torch.cuda.Event, int]] = None
        self.last_onload_split: dict[str, float] = {}  # seconds: regrowing the storages, copies waited for
        self._host_valid: set[str] = set()  # frozen parts whose host buffers hold their current bytes
        # part → (storage, its host copy or None for scratch, its size in bytes)
        self._moved: dict[str, list[tuple[torch.UntypedStorage, Optional[torch.Tensor], int]]] = {}
        self._host: dict[tuple[str, int], torch.Tensor] = {}  # reused buffers (GPU: pinned)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._parts)

    def offloaded(self, part: Optional[str] = None) -> bool:
        """Is ``part`` (default: any part) on the host?"""
        return part in self._moved if part else bool(self._moved)

    def changed(self, part: str) -> None:
        """``part``'s bytes on the device were rewritten: a frozen part is copied at its next offload."""
        self._host_valid.discard(self._select([part])[0])

    def _owned(self) -> dict[str, list[torch.UntypedStorage]]:
        dev = platform.device()
        owner: dict[int, str] = {}
        out: dict[str, list[torch.UntypedStorage]] = {p: [] for p in self._parts}
        for part, fn in self._parts.items():
            for t in fn():
                # On GPU, host-side scalars (Adam's step counters) stay where they are.
                if t is None or t.device.type != dev.type:
                    continue
                s = t.untyped_storage()
                key = s._cdata  # the storage object itself: stable while it is resized
                if key not in owner:
                    owner[key] = part
                    out[part].append(s)
        return out

    def _select(self, parts: Optional[Sequence[str]]) -> list[str]:
        chosen = list(self._parts) if parts is None else list(parts)
        unknown = [p for p in chosen if p not in self._parts]
        if unknown:
            raise ValueError(f"unknown offload part(s) {', '.join(unknown)}: one of {', '.join(self._parts)}")
        return chosen

    @torch.no_grad()
    def offload(self, parts: Optional[Sequence[str]] = None) -> tuple[int, float]:
        """Copies the parts' storages to host (scratch parts: no copy) and frees them on the device.
        Returns (bytes copied, seconds)."""
        t0 = time.perf_counter()
        pin = platform.has_gpu()
        self.ready()
        todo = [p for p in self._select(parts) if p not in self._moved]
        owned = self._owned() if todo else {}
        total = 0
        for part in todo:
            moved = []
            valid = part in self._host_valid
            for i, s in enumerate(owned[part]):
                n = s.nbytes()
                if not n:
                    continue
                if part in self._scratch:
                    moved.append((s, None, n))
                    continue
                host = self._host.get((part, i))
                if host is None or host.numel() != n:
                    host = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
                    self._host[(part, i)] = host
                    valid = False
                if not valid:
                    host.copy_(_bytes(s), non_blocking=pin)
                    total += n
                moved.append((s, host, n))
            self._moved[part] = moved
            if part in self._frozen:
                self._host_valid.add(part)
        if pin:
            torch.cuda.synchronize()
        for part in todo:
            for s, _, _ in self._moved[part]:
                s.resize_(0)
        if pin:
            # Also with nothing to move: the caching allocator still holds the training step's
            # activations (tens of GiB at long micro-batches), which the waking engine needs.
            torch.cuda.empty_cache()
        return total, time.perf_counter() - t0

    @torch.no_grad()
    def onload(self, parts: Optional[Sequence[str]] = None) -> tuple[int, float]:
        """Regrows the parts' storages in place and copies their bytes back (scratch parts: zeros);
        a prefetched part's copies are left running on the side stream (GPU; their bytes and rate
        come from ``prefetch_stats``). Returns (bytes copied by the return, seconds)."""
        t0 = time.perf_counter()
        pin = platform.has_gpu()
        todo = [p for p in self._select(parts) if p in self._moved]
        for part in todo:  # every allocation first: the copies then run back to back
            for s, _, n in self._moved[part]:
                s.resize_(n)
        t_alloc = time.perf_counter()
        side = [p for p in todo if pin and p in self._prefetched]
        total = sum(self._copy_back(part, pin) for part in todo if part not in side)
        if side:
            self._prefetch(side)
        if pin:
            torch.cuda.current_stream().synchronize()  # not the side stream's copies
        for part in todo:
            del self._moved[part]
        done = time.perf_counter()
        self.last_onload_split = {"alloc_s": t_alloc - t0, "wait_s": done - t_alloc}
        return total, done - t0

    def _prefetch(self, parts: list[str]) -> None:
        """Issues the parts' copies on the side stream."""
        self.ready()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        # The regrown blocks may be ones the current stream's queued work still uses.
        self._stream.wait_stream(main)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            begin.record()
            nbytes = sum(self._copy_back(part, True) for part in parts)
            end.record()
        self._pending = (begin, end, nbytes)

    def _copy_back(self, part: str, non_blocking: bool) -> int:
        """The part's host bytes into its regrown storages (scratch: zeros), on the current stream;
        returns the bytes copied."""
        total = 0
        for s, host, n in self._moved[part]:
            if host is None:
                _bytes(s).zero_()
            else:
                _bytes(s).copy_(host, non_blocking=non_blocking)
                total += n
        return total

    def ready(self) -> None:
        """The current stream waits for a prefetched onload still in flight (no host stall)."""
        if self._pending is None:
            return
        begin, end, nbytes = self._pending
        torch.cuda.current_stream().wait_event(end)
        self._pending = None
        self._done = (begin, end, nbytes)

    def prefetch_stats(self) -> Optional[tuple[int, float]]:
        """(bytes, device seconds) of the last prefetched onload, once ``ready()`` waited for it
        (blocks until its copies finished); None when nothing was prefetched since the last call."""
        if self._done is None:
            return None
        begin, end, nbytes = self._done
        end.synchronize()
        self._done = None
        return nbytes, begin.elapsed_time(end) / 1e3


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
