"""Weight transfer from the actor to the rollout engine: bucket wire format and same-host IPC."""

from colocate_rl.weight_sync.buckets import Bucket, TensorMeta, pack, unpack
from colocate_rl.weight_sync.ipc import IpcReceiver, IpcSender, Message, SyncStats, device_uuid, merge_messages

__all__ = [
    "Bucket", "IpcReceiver", "IpcSender", "Message", "SyncStats", "TensorMeta", "device_uuid", "merge_messages",
    "pack", "unpack",
]
