"""A weight-sync payload is unpickled through an allow-list: a forged one is refused and runs nothing."""

import os
import pickle

import pytest
import torch

from colocate_rl.weight_sync.ipc import IpcReceiver, IpcSender, WeightSyncError


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_forged_payload_is_refused_and_runs_nothing(tmp_path):
    receiver = IpcReceiver("cpu")
    marker = str(tmp_path / "ran")
    forged = {receiver.uuid: pickle.dumps((_Payload(marker), [], (0, 0)))}
    with pytest.raises(WeightSyncError, match="names posix.mkdir, which no tensor handle holds: refused"):
        with receiver.open(forged):
            pass
    assert not os.path.exists(marker)
    pickle.loads(forged[receiver.uuid])  # the same bytes, unpickled without the allow-list, do run
    assert os.path.exists(marker)


def test_a_handle_that_is_no_rebuilder_is_refused():
    receiver = IpcReceiver("cpu")
    message = {receiver.uuid: pickle.dumps(((torch.Size, ((1, 2),)), [], (0, 0)))}
    with pytest.raises(WeightSyncError, match="not a tensor rebuilder: refused"):
        with receiver.open(message):
            pass


def test_a_real_shared_memory_bucket_loads():
    sender, receiver = IpcSender("cpu"), IpcReceiver("cpu")
    tensors = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4)}
    bucket = next(iter(sender.buckets(tensors.items(), bucket_mb=1)))
    with receiver.open(sender.make_message(bucket)) as got:
        assert torch.equal(got.flat, bucket.flat) and got.metas == bucket.metas
    sender.release()


def test_a_cuda_handle_passes_the_allow_list():
    """The globals of reduce_tensor's CUDA handle, as torch makes it (built here without a GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from colocate_rl.weight_sync.ipc import _loads

    t = torch.empty(2, 3, dtype=torch.bfloat16)
    handle = (rebuild_cuda_tensor, (type(t), t.size(), t.stride(), 0, type(t._typed_storage()), t.dtype, 0,
                                    b"handle", 12, 0, False, b"counter", 0, b"event", True))
    got, metas, ids = _loads(pickle.dumps((handle, [], (1, 2))))
    assert got[0] is rebuild_cuda_tensor and got[1][4] is torch.storage.TypedStorage and ids == (1, 2)
