"""Weight transfer from the actor to the rollout engine: bucket wire format and same-host IPC."""

from colocate_rl.weight_sync.buckets import Bucket, TensorMeta, pack, unpack
from colocate_rl.weight_sync.ipc import (
    IpcReceiver, IpcSender, Message, SyncStats, WeightSyncError, device_uuid, merge_messages, set_authkey,
)
from colocate_rl.weight_sync.verify import tensor_checksum

__all__ = [
    "Bucket", "IpcReceiver", "IpcSender", "Message", "SyncStats", "TensorMeta", "WeightSyncError", "device_uuid",
    "merge_messages", "pack", "set_authkey", "tensor_checksum", "unpack",
]
