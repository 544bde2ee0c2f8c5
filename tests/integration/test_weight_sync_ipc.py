"""Same-host IPC without an engine: buckets cross a real process boundary through shared memory."""

from __future__ import annotations

import pickle
from multiprocessing import resource_sharer

import pytest
import torch
import torch.multiprocessing as mp

from colocate_rl.weight_sync.buckets import unpack
from colocate_rl.weight_sync.ipc import IpcReceiver, IpcSender, WeightSyncError, device_uuid, merge_messages
from colocate_rl.weight_sync.verify import tensor_checksum


def _receiver_loop(requests, replies):
    """Child process: load each message it is sent, reply with checksums (or the error text)."""
    receiver = IpcReceiver("cpu")
    replies.put(receiver.uuid)
    while (message := requests.get()) is not None:
        try:
            with receiver.open(message) as bucket:
                replies.put({name: tensor_checksum(t) for name, t in unpack(bucket)})
        except WeightSyncError as e:
            replies.put(str(e))


@pytest.fixture(scope="module")
def child():
    ctx = mp.get_context("spawn")  # a fresh interpreter, as vLLM's engine core on CPU
    requests, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver_loop, args=(requests, replies), daemon=True)
    proc.start()
    uuid = replies.get(timeout=120)
    yield requests, replies, uuid
    requests.put(None)
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("w", torch.randn(64, 32, generator=g)),
        ("s", torch.randn((), generator=g)),
        ("h", torch.randn(16, 8, generator=g).to(torch.bfloat16)),
        ("v", torch.randn(5000, generator=g)),
    ]


def test_buckets_round_trip_through_a_child_process(child):
    requests, replies, child_uuid = child
    sender = IpcSender("cpu")
    assert child_uuid == sender.uuid == device_uuid("cpu"), "one host, one CPU 'device' id in every process"
    src = _tensors()
    got = {}
    n = 0
    for bucket in sender.buckets(iter(src), bucket_mb=0.01):
        assert bucket.flat.is_shared()
        requests.put(sender.make_message(bucket))
        got.update(replies.get(timeout=60))
        n += 1
        assert sender.release() == 0, "a loaded payload has nothing left to free"
    assert n >= 3
    assert got == {name: tensor_checksum(t) for name, t in src}


def test_message_for_another_device_is_refused_and_freed(child):
    requests, replies, child_uuid = child
    sender = IpcSender("cpu")
    (bucket,) = list(sender.buckets(iter(_tensors()[:1]), bucket_mb=1))
    message = {"cpu-some-other-host": sender.make_message(bucket)[sender.uuid]}
    requests.put(message)
    err = replies.get(timeout=60)
    assert isinstance(err, str) and child_uuid in err and "cpu-some-other-host" in err
    cache = resource_sharer._resource_sharer._cache
    before = len(cache)
    assert sender.release() == 1, "the payload nobody loaded is closed by the sender"
    assert len(cache) == before - 1


def test_payload_is_plain_bytes_per_device():
    sender = IpcSender("cpu")
    (bucket,) = list(sender.buckets(iter(_tensors()[:2]), bucket_mb=8))  # one dtype: one bucket
    message = sender.make_message(bucket)
    assert list(message) == [sender.uuid] and isinstance(message[sender.uuid], bytes)
    # The same process can load it too (in-process engines).
    with IpcReceiver("cpu").open(message) as got:
        assert [n for n, _ in unpack(got)] == [m.name for m in bucket.metas]
    assert sender.release() == 0
    pickle.dumps(message)  # travels through any RPC that takes bytes


def test_same_process_payload_carries_no_handle(child):
    """For receivers in the sender's own process (vLLM in-process): a token, no fd or CUDA handle."""
    requests, replies, _ = child
    sender = IpcSender("cpu", same_process=True)
    src = _tensors()[:2]
    (bucket,) = list(sender.buckets(iter(src), bucket_mb=8))
    message = sender.make_message(bucket)
    with IpcReceiver("cpu").open(message) as got:
        named = unpack(got)
        assert {n: tensor_checksum(t) for n, t in named} == {n: tensor_checksum(t) for n, t in src}
        assert named[0][1].data_ptr() == bucket.flat.data_ptr(), "no copy, no mapping: the same memory"
    assert sender.release() == 0
    requests.put(message)  # another process cannot use it, and says so
    err = replies.get(timeout=60)
    assert isinstance(err, str) and "same_process=True" in err


def test_merge_messages_one_entry_per_gpu():
    merged = merge_messages([{"GPU-a": b"1"}, {"GPU-b": b"2"}])
    assert merged == {"GPU-a": b"1", "GPU-b": b"2"}
    with pytest.raises(ValueError, match="GPU-a"):
        merge_messages([{"GPU-a": b"1"}, {"GPU-a": b"2"}])
