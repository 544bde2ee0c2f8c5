"""Weight broadcast across machines: one process group spanning the actor's gathering rank (rank 0)
and every vLLM worker of every engine (ranks 1..), buckets in the IPC path's format (buckets.py).

The group is built from its own TCPStore and a process-group object constructed directly
(``ProcessGroupGloo`` / ``ProcessGroupNCCL``), not through ``init_process_group``: both sides
already own a default group (Megatron's world on the actor, vLLM's TP world in each worker) that
must stay untouched. Backends: gloo on CPU, nccl on GPU — on ROCm torch's "nccl" backend is RCCL.

Per bucket the sender broadcasts three things, in this order on every rank: the sizes (int64 [2]:
header bytes, payload bytes; [0, 0] ends the sync), the header (uint8: JSON naming the dtype and each
tensor's name, shape, offset and size; a receiver parses and checks it, and rejects it in one line
unless every field is there with its type and every tensor lies inside the payload), then the payload
as bytes (any dtype travels as its uint8 view, FP8 included: NCCL has no FP8 type everywhere).
Pipelined: the sender packs bucket k+1 while bucket k is on the wire; a receiver loads bucket k
while bucket k+1 is on the wire. Every wait has a timeout and a hang raises ``BroadcastTimeout``
naming the group, the rank that waited, the bucket, and the ranks that are silent: each member
notes in the group's store that it joined and which bucket it has reached (one small write per
bucket), so the one that times out can read who never got there (``GroupSpec.members`` says
what each rank is, e.g. "engine 1 worker 0 on 10.0.0.3").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from colocate_rl.errors import first_line
from colocate_rl.ports import is_loopback, tcp_store
from colocate_rl.weight_sync.buckets import Bucket, TensorMeta
from colocate_rl.weight_sync.ipc import SyncStats, WeightSyncError
from colocate_rl.weight_sync.json_wire import WireError, decode, dtype_name, dtype_named, encode


POLL_S = 0.0005  # host-side polling of a collective: well below a bucket's transfer time


class BroadcastTimeout(WeightSyncError):
    """A broadcast that did not complete in time; the message names the group, rank and bucket."""


@dataclass(frozen=True)
class GroupSpec:
    """What every member needs to join: rank 0 (the sender) hosts the store at master_addr:master_port
    (a port its process holds from ``colocate_rl.ports.reserve_port``, so none other can take it first)."""

    name: str
    master_addr: str
    master_port: int
    world_size: int  # 1 sender + every engine worker
    backend: str  # gloo | nccl (RCCL on ROCm)
    timeout_s: float = 600.0
    members: tuple[str, ...] = ()  # what each rank is, for messages ("" / absent: "rank i")


def backend_for(device: torch.device | str) -> str:
    return "gloo" if torch.device(device).type == "cpu" else "nccl"


def encode_header(metas: list[TensorMeta]) -> torch.Tensor:
    """A bucket's metas as JSON bytes (uint8): its one dtype, then [name, shape, offset, numel] per tensor."""
    if len({m.dtype for m in metas}) != 1:
        raise ValueError(f"a bucket holds one dtype, not {sorted({dtype_name(m.dtype) for m in metas})}")
    return encode({"dtype": dtype_name(metas[0].dtype),
                   "tensors": [[m.name, list(m.shape), m.offset, m.numel] for m in metas]})


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def decode_header(data: bytes | torch.Tensor, payload_bytes: int) -> list[TensorMeta]:
    """The metas of a bucket whose payload is ``payload_bytes`` long; WireError (one line) unless ``data`` is
    the JSON ``encode_header`` writes, every field of its type, and every tensor inside the payload."""
    header = decode(data, "header")
    if not isinstance(header, dict) or set(header) != {"dtype", "tensors"}:
        raise WireError("header: not an object of 'dtype' and 'tensors'")
    dtype = dtype_named(header["dtype"], "header 'dtype'")
    size = torch.empty(0, dtype=dtype).element_size()
    if payload_bytes % size:
        raise WireError(f"header: a payload of {payload_bytes} bytes is not whole {dtype_name(dtype)} elements")
    tensors = header["tensors"]
    if not isinstance(tensors, list) or not tensors:
        raise WireError("header 'tensors': not a non-empty list")
    metas = []
    for i, t in enumerate(tensors):
        if not (isinstance(t, list) and len(t) == 4 and isinstance(t[0], str) and t[0] and isinstance(t[1], list)
                and all(map(_count, t[1])) and _count(t[2]) and _count(t[3])):
            raise WireError(f"header tensor {i}: not [name, shape (sizes), offset, numel]")
        name, shape, offset, numel = t
        if math.prod(shape) != numel or offset + numel > payload_bytes // size:
            raise WireError(f"header tensor {i} ({name[:80]!r}): shape {shape[:8]} with {numel} elements at "
                            f"offset {offset} does not fit a payload of {payload_bytes // size}")
        metas.append(TensorMeta(name, tuple(shape), dtype, offset, numel))
    return metas


def _gloo(store: dist.Store, rank: int, spec: GroupSpec, timeout: timedelta) -> dist.ProcessGroupGloo:
    """gloo's process group; its own sockets on loopback when the group is (every member on one node), else
    where gloo puts them (GLOO_SOCKET_IFNAME, else the address the host name resolves to)."""
    if not is_loopback(spec.master_addr):
        return dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=spec.master_addr)]
    return dist.ProcessGroupGloo(store, rank, spec.world_size, opts)


class BroadcastGroup:
    """One member of a weight-broadcast group. Rank 0 sends (``send``), the others ``receive``."""

    def __init__(self, spec: GroupSpec, rank: int, device: torch.device | str = "cpu") -> None:
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"weight broadcast group '{spec.name}': rank {rank} outside world size {spec.world_size}")
        self.spec, self.rank, self.device = spec, rank, torch.device(device)
        timeout = timedelta(seconds=spec.timeout_s)
        try:
            # Rank 0 serves on the port's held socket when its process reserved it (colocate_rl.ports).
            store = tcp_store(spec.master_addr, spec.master_port, spec.world_size, rank == 0, timeout,
                              wait_for_workers=False)
        except RuntimeError as e:
            raise BroadcastTimeout(f"{self._who()}: cannot reach the group's store at {spec.master_addr}:"
                                   f"{spec.master_port}, served by {self._name(0)} "
                                   f"({first_line(e)})") from e
        self._store = store  # rank 0 serves the store: keep it alive as long as the group
        self._marks = dist.PrefixStore(f"colocate_rl-progress/{spec.name}", store)
        self._syncs = 0  # syncs this member has started in this group (every member takes part in each)
        self._mark(-1)
        prefixed = dist.PrefixStore(f"colocate_rl/{spec.name}", store)
        try:
            if spec.backend == "gloo":
                # gloo raises at its timeout (also while forming the group): the same limit as _wait's.
                self.pg = _gloo(prefixed, rank, spec, timeout)
            elif spec.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timedelta(seconds=2 * spec.timeout_s + 60)  # the watchdog's: _wait fires first
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, opts)
            else:
                raise ValueError(f"weight broadcast group '{spec.name}': backend {spec.backend!r} is not gloo or nccl")
        except RuntimeError as e:
            raise BroadcastTimeout(f"{self._who()}: could not form the group ({first_line(e)})"
                                   f"{self._silent(-1)}") from e
        if spec.backend == "nccl":
            # NCCL creates its communicator inside the first collective call, blocking the host
            # until every member arrives; do it now, while every member is forming the group, so a
            # later hang is an enqueued broadcast that _wait can time out.
            self._wait(self._start(torch.zeros(1, device=self.device)),
                       "the first broadcast (forming NCCL's communicator)")

    def _who(self) -> str:
        return f"weight broadcast group '{self.spec.name}' rank {self.rank} of {self.spec.world_size}"

    def _name(self, rank: int) -> str:
        m = self.spec.members
        return f"rank {rank} ({m[rank]})" if rank < len(m) and m[rank] else f"rank {rank}"

    def _mark(self, bucket: int) -> None:
        """Notes in the store that this rank has reached ``bucket`` of the current sync (-1: joined)."""
        self._marks.set(str(self.rank), f"{self._syncs}:{bucket}")

    def _silent(self, bucket: int) -> str:
        """'; silent: <the ranks that have not reached bucket of the current sync>' read from the
        store, or why it cannot be read; '' when every rank got there (the wait failed otherwise)."""
        here = (self._syncs, bucket)
        try:
            behind = []
            for r in range(self.spec.world_size):
                key = str(r)
                mark = self._marks.get(key).decode() if self._marks.check([key]) else None
                at = tuple(int(x) for x in mark.split(":")) if mark else None
                if at is None or at < here:
                    where = ("never joined" if at is None else "joined, never started this sync" if at[1] < 0 or
                             at[0] < here[0] else f"at bucket {at[1]}")
                    behind.append(f"{self._name(r)} {where}")
        except (RuntimeError, ValueError) as e:
            return (f"; the group's store, served by {self._name(0)}, does not answer "
                    f"({first_line(e)})")
        return f"; silent: {', '.join(behind)}" if behind else ""

    def _start(self, t: torch.Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([t], opts)

    def _wait(self, work: dist.Work, what: str, bucket: int | None = None) -> None:
        """Waits for ``work`` on the host, at most spec.timeout_s. Polled rather than left to the
        backend: NCCL's own timeout is enforced by its watchdog, which tears the process down
        (TORCH_NCCL_ASYNC_ERROR_HANDLING) instead of raising here, so NCCL's timeout is set longer
        and this one fires first. ``bucket``: the one this wait belongs to (names the silent ranks)."""
        deadline = time.monotonic() + self.spec.timeout_s
        silent = (lambda: self._silent(bucket)) if bucket is not None else (lambda: "")
        try:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise BroadcastTimeout(f"{self._who()}: {what} did not complete within {self.spec.timeout_s:g} s "
                                           f"(a peer died or stopped taking part){silent()}")
                time.sleep(POLL_S)
            work.wait()
        except RuntimeError as e:  # the backend gave up first (a peer's connection closed, ...)
            raise BroadcastTimeout(f"{self._who()}: {what} failed: {first_line(e)}{silent()}") from e

    def _sizes(self, header: int, payload: int, what: str, bucket: int) -> tuple[int, int]:
        self._mark(bucket)
        t = torch.tensor([header, payload], dtype=torch.int64, device=self.device)
        self._wait(self._start(t), f"the sizes of {what}", bucket)
        return int(t[0]), int(t[1])

    # ------------------------------------------------------------------ sender

    def send(self, buckets: Iterable[Bucket]) -> SyncStats:
        """Rank 0: broadcasts every bucket, then the end marker. ``buckets`` is consumed lazily, so
        the next bucket is packed while the previous one is on the wire."""
        if self.rank != 0:
            raise RuntimeError(f"{self._who()}: only rank 0 sends")
        stats, t0 = SyncStats(), time.perf_counter()
        self._syncs += 1
        in_flight: tuple[dist.Work, Bucket, int] | None = None
        for i, bucket in enumerate(buckets):
            header = encode_header(bucket.metas)
            self._sizes(header.numel(), bucket.nbytes, f"bucket {i}", i)
            self._wait(self._start(header.to(self.device)), f"the header of bucket {i}", i)
            work = self._start(bucket.flat.view(torch.uint8))
            if in_flight is not None:
                self._wait(in_flight[0], f"bucket {in_flight[2]}", in_flight[2])
            in_flight = (work, bucket, i)
            stats.bytes += bucket.nbytes
            stats.buckets += 1
        if in_flight is not None:
            self._wait(in_flight[0], f"bucket {in_flight[2]}", in_flight[2])
        self._sizes(0, 0, "the end marker", stats.buckets)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        return stats

    # ------------------------------------------------------------------ receivers

    def _next(self, i: int) -> tuple[list[TensorMeta], torch.Tensor, dist.Work] | None:
        header_len, payload = self._sizes(0, 0, f"bucket {i}", i)
        if header_len == 0:
            return None
        if header_len < 0 or payload < 0:
            raise WeightSyncError(f"{self._who()}: bucket {i} rejected: sizes {header_len}, {payload}")
        h = torch.empty(header_len, dtype=torch.uint8, device=self.device)
        self._wait(self._start(h), f"the header of bucket {i}", i)
        try:
            metas = decode_header(h, payload)
        except WireError as e:
            raise WeightSyncError(f"{self._who()}: bucket {i} rejected: {e}") from None
        raw = torch.empty(payload, dtype=torch.uint8, device=self.device)
        return metas, raw, self._start(raw)

    def receive(self, load: Callable[[Bucket], None]) -> SyncStats:
        """Ranks > 0: ``load(bucket)`` per bucket until the end marker; bucket k is loaded while
        bucket k+1 arrives. The bucket's memory is valid only during the call."""
        if self.rank == 0:
            raise RuntimeError(f"{self._who()}: rank 0 sends, it does not receive")
        stats, t0, i = SyncStats(), time.perf_counter(), 0
        self._syncs += 1
        nxt = self._next(0)
        while nxt is not None:
            metas, raw, work = nxt
            self._wait(work, f"bucket {i}", i)
            nxt = self._next(i + 1)  # starts the next transfer before this bucket is loaded
            flat = raw.view(metas[0].dtype)
            load(Bucket(flat, metas))
            stats.bytes += raw.numel()
            stats.buckets += 1
            i += 1
            del raw, flat
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        return stats

    def close(self) -> None:
        """Drops the group; NCCL communicators are aborted so a group with a dead member does not hang exit."""
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None and self.spec.backend == "nccl":
            for method in ("abort", "shutdown"):
                if hasattr(pg, method):
                    try:
                        getattr(pg, method)()
                    except RuntimeError:
                        pass
                    break
        self._store = None


__all__ = ["BroadcastGroup", "BroadcastTimeout", "GroupSpec", "backend_for", "decode_header", "encode_header"]
