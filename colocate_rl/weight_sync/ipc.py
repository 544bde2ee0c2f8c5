"""Same-host weight transfer by handle: CUDA/HIP IPC on GPUs, shared memory on CPU, one code path.

A message is ``{device_uuid: payload}``: one entry per GPU, so with TP/EP every actor rank packs
the bucket for the GPU it shares with a vLLM worker, the ranks' messages are merged
(``merge_messages``), one RPC carries the whole dict, and each worker takes its own entry. Entries
hold whole HF tensors (the actor gathers its TP/EP shards first); vLLM's weight loaders cut the
worker's shard. UUIDs are global while device indices depend on each process's
CUDA_/HIP_VISIBLE_DEVICES; that is why the key is the UUID and the receiver rebuilds on its own index.

A payload is ``ForkingPickler.dumps((handle, metas, (pid, token)))`` where ``handle`` is torch's
``reduce_tensor`` of the bucket, ``(rebuild_fn, args)``. Plain bytes travel through vLLM's msgpack
RPC without ``VLLM_ALLOW_INSECURE_SERIALIZATION``, and an entry is unpickled only by the worker it
is for, through an allow-list of torch's tensor rebuilders (a handle has no other form). A receiver in the sender's own process (vLLM in-process, TP=1) cannot use a CUDA handle:
torch cannot reopen its own IPC handle ("invalid device context"), and a handle made but never
opened elsewhere keeps its block alive until exit (torch's IPC limbo). ``IpcSender(same_process=
True)`` sends no handle then, only a token for the bucket held in this process.

Lifetimes. CUDA: the receiver's view keeps the sender's block alive through torch's IPC ref
counter; the sender keeps its bucket until the RPC returns and calls ``torch.cuda.ipc_collect()``
now and then. CPU: torch's default ``file_descriptor`` strategy hands a dup of the shared-memory fd
to ``multiprocessing.resource_sharer``, which serves it once; a payload never loaded keeps its
memory until the sender exits, so ``IpcSender.release()`` closes what no receiver took. The
receiver's side is served over a socket authenticated with ``multiprocessing.current_process()
.authkey``: vLLM's engine-core process inherits it from its parent, but two unrelated processes (two
Ray actors) must be given the same key first (``set_authkey``), or fail with "digest sent was
rejected".
"""

from __future__ import annotations

import io
import itertools
import multiprocessing
import os
import pickle
import socket
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, rebuild_tensor, reduce_tensor

from colocate_rl.weight_sync.buckets import Bucket, TensorMeta, pack

Message = dict[str, bytes]  # device UUID -> pickled ((rebuild_fn, args), metas, origin)

# Buckets sent with same_process=True, by token; alive while the sender holds the bucket.
_SENT: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_tokens = itertools.count()

_CUDA_DEVICE_ARG = 6  # index of storage_device in rebuild_cuda_tensor's arguments


class WeightSyncError(ValueError):
    """A message or tensor the receiver cannot take; the one-line message names the UUID or tensor."""


@dataclass
class SyncStats:
    bytes: int = 0
    seconds: float = 0.0  # wall time of the whole sync, sender side
    buckets: int = 0
    receiver_seconds: float = 0.0  # of which spent inside the receivers (map, check, load), when reported
    pack_seconds: float = 0.0  # of which spent producing buckets: the sender's export and the copies in

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __add__(self, other: "SyncStats") -> "SyncStats":
        return SyncStats(
            self.bytes + other.bytes, self.seconds + other.seconds, self.buckets + other.buckets,
            self.receiver_seconds + other.receiver_seconds, self.pack_seconds + other.pack_seconds,
        )


def _host_id() -> str:
    """Stable across the processes of one boot: the boot id, else the machine id, else the host name."""
    for p in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            text = Path(p).read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return socket.gethostname()


def _resolve(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def device_uuid(device: torch.device | str | int | None = None) -> str:
    """Global id of a device. GPU (CUDA and ROCm): the UUID of the *visible* index; CPU: 'cpu-<boot id>'."""
    dev = _resolve(device)
    if dev.type == "cpu":
        return "cpu-" + _host_id()
    if dev.type != "cuda":
        raise ValueError(f"device_uuid: unsupported device type {dev.type!r}")
    return str(torch.cuda.get_device_properties(dev.index).uuid)


def shared_alloc(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A bucket buffer that can be handed out as is: CPU allocations go straight to shared memory
    (``share_memory_()`` afterwards would copy the whole bucket once more); GPU memory is IPC-able."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    storage = torch.UntypedStorage._new_shared(numel * torch.empty((), dtype=dtype).element_size())
    return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,))


def _local_alloc(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


def set_authkey(key: bytes) -> None:
    """Give this process the multiprocessing key its peer uses: needed between unrelated processes
    (e.g. the actor's and the rollout's Ray actors) for CPU fd passing. Call it on both sides, and on
    the rollout side before the engine starts: vLLM's processes take the key at spawn. (torch's
    ``file_system`` sharing strategy avoids fd passing, at the price of named /dev/shm files.)"""
    multiprocessing.current_process().authkey = key


class _RecordingPickler(ForkingPickler):
    """ForkingPickler that notes every fd it hands to resource_sharer, so it can be released."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fd_keys: list = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, resource_sharer.DupFd):
            self.fd_keys.append(obj._id[1])
        return NotImplemented


# The globals a payload may name: torch's rebuilders of a shared tensor, the types they take, and the
# bucket's TensorMeta. An unpickled global can be any callable, so anything else is refused.
_REBUILDERS = ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_storage_fd",
               "rebuild_storage_filename", "rebuild_storage_empty")
_PAYLOAD_GLOBALS = {("torch.multiprocessing.reductions", n) for n in _REBUILDERS} | {
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "UntypedStorage"), ("torch", "TypedStorage"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("multiprocessing.resource_sharer", "DupFd"),
    (TensorMeta.__module__, TensorMeta.__name__),
}


class _PayloadUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PAYLOAD_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                    torch.dtype)):
            return super().find_class(module, name)
        raise WeightSyncError(f"a weight-sync payload names {module}.{name}, which no tensor handle holds: refused")


def _loads(payload: bytes) -> Any:
    """A payload through the allow-list above (CPU: maps the shared memory now)."""
    return _PayloadUnpickler(io.BytesIO(payload)).load()


def _dumps(obj: Any) -> tuple[bytes, list]:
    buf = io.BytesIO()
    p = _RecordingPickler(buf, pickle.HIGHEST_PROTOCOL)
    p.dump(obj)
    return buf.getvalue(), p.fd_keys


class IpcSender:
    """Sender half: buckets -> messages. One per process that owns tensors for one device.
    ``same_process``: the receivers run in this process (see the module docstring)."""

    def __init__(self, device: torch.device | str | None = None, same_process: bool = False) -> None:
        self.same_process = same_process
        self.device = _resolve(device)
        self.uuid = device_uuid(self.device)
        self._fd_keys: list = []

    def buckets(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float) -> Iterator[Bucket]:
        """pack() onto this device, allocating CPU buckets directly in shared memory (unless the
        receivers share this process). Each bucket is sent before the next is built, so at most
        about one bucket per dtype is alive at a time."""
        moved = ((n, t.to(self.device)) for n, t in named_tensors)
        return pack(moved, bucket_mb, alloc=_local_alloc if self.same_process else shared_alloc)

    def make_message(self, bucket: Bucket) -> Message:
        flat = bucket.flat
        token = next(_tokens)
        if self.same_process:
            _SENT[token] = flat
            return {self.uuid: pickle.dumps((None, bucket.metas, (os.getpid(), token)))}
        if flat.device.type == "cpu" and not flat.is_shared():
            flat.share_memory_()
        payload, keys = _dumps((reduce_tensor(flat), bucket.metas, (os.getpid(), token)))
        self._fd_keys += keys
        return {self.uuid: payload}

    def release(self) -> int:
        """Close the shared-memory fds of messages no receiver loaded (CPU). Returns how many."""
        sharer = getattr(resource_sharer, "_resource_sharer", None)
        cache, lock = getattr(sharer, "_cache", None), getattr(sharer, "_lock", None)
        freed = 0
        if cache is not None and lock is not None:
            with lock:
                for key in self._fd_keys:
                    entry = cache.pop(key, None)
                    if entry is not None:
                        entry[1]()  # resource_sharer's close(): closes the dup'd fd
                        freed += 1
        self._fd_keys = []
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # blocks the receivers have released go back to the allocator
        return freed

    def sync(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float, send: Callable[[Message], Any]
    ) -> SyncStats:
        """Packs, sends each bucket's message with ``send`` (blocking until the receivers loaded it),
        then frees it. E.g. ``send = lambda m: llm.collective_rpc("update_weights_from_ipc", args=(m,))``."""
        stats = SyncStats()
        t0 = time.perf_counter()
        buckets = iter(self.buckets(named_tensors, bucket_mb))
        try:
            while True:
                t = time.perf_counter()
                bucket = next(buckets, None)
                stats.pack_seconds += time.perf_counter() - t
                if bucket is None:
                    break
                send(self.make_message(bucket))
                stats.bytes += bucket.nbytes
                stats.buckets += 1
                del bucket
                self.release()
        finally:
            self.release()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        return stats


def merge_messages(messages: Iterable[Message]) -> Message:
    """One dict for one RPC from the messages of several ranks (one GPU each)."""
    out: Message = {}
    for m in messages:
        for uuid, payload in m.items():
            if uuid in out:
                raise ValueError(f"two weight-sync payloads for device {uuid}: one rank per GPU must send")
            out[uuid] = payload
    return out


class IpcReceiver:
    """Receiver half: takes its own entry of a message and rebuilds the bucket on its own device."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = _resolve(device)
        self.uuid = device_uuid(self.device)

    def payload(self, message: Message) -> bytes:
        if self.uuid not in message:
            present = ", ".join(message) or "none"
            raise WeightSyncError(f"weight-sync message has no entry for this device {self.uuid} (entries: {present})")
        return message[self.uuid]

    @contextmanager
    def open(self, message: Message) -> Iterator[Bucket]:
        """Yields the bucket (``unpack`` names its tensors); the mapping/handle is dropped on exit."""
        handle, metas, (pid, token) = _loads(self.payload(message))
        if handle is None:
            flat = _SENT.get(token) if pid == os.getpid() else None
            if flat is None:
                raise WeightSyncError(f"weight-sync payload of process {pid} (same_process=True) cannot be loaded here")
        elif handle[0] is rebuild_cuda_tensor:
            if pid == os.getpid():
                raise WeightSyncError("a CUDA IPC handle cannot be opened in the process that made it: "
                                      "send with IpcSender(same_process=True)")
            args = list(handle[1])
            args[_CUDA_DEVICE_ARG] = self.device.index  # the sender's index means nothing in this process
            flat = rebuild_cuda_tensor(*args)
        elif handle[0] is rebuild_tensor:
            flat = rebuild_tensor(*handle[1])
        else:
            raise WeightSyncError(f"a weight-sync payload's handle is {handle[0]!r}, not a tensor rebuilder: refused")
        bucket = Bucket(flat, metas)
        if handle is None and flat.is_cuda:
            # The sender's own block: the caching allocator reuses it only after this stream's copies
            # out of it, so no wait is needed here.
            flat.record_stream(torch.cuda.current_stream(flat.device))
        try:
            yield bucket
        finally:
            del bucket, flat
            if self.device.type == "cuda" and handle is not None:
                torch.cuda.synchronize(self.device)  # the copies out of the handle are done before it goes


__all__ = [
    "IpcReceiver", "IpcSender", "Message", "SyncStats", "TensorMeta", "WeightSyncError", "device_uuid",
    "merge_messages", "set_authkey", "shared_alloc",
]
