"""Python values between processes as JSON in a uint8 tensor, never as a pickle: the weight broadcast's
bucket headers, and the small values the actor's ranks share (torch's ``*_object*`` collectives would
unpickle whatever a peer sends). A receiver only parses what arrives; its caller checks the fields.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch
import torch.distributed as dist


class WireError(ValueError):
    """Bytes from another process that are not the JSON, or not the fields, expected; the message is one line."""


def encode(value: Any) -> torch.Tensor:
    """``value`` (JSON types only) as a 1-D uint8 CPU tensor."""
    return torch.frombuffer(bytearray(json.dumps(value, separators=(",", ":")).encode()), dtype=torch.uint8)


def decode(data: bytes | torch.Tensor, what: str) -> Any:
    """The JSON value in ``data``; WireError naming ``what`` when it is not UTF-8 JSON."""
    raw = data.cpu().numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)
    try:
        return json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"{what}: not JSON ({len(raw)} bytes; {e})") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_named(name: Any, what: str) -> torch.dtype:
    """The torch dtype called ``name`` ("bfloat16", ...); WireError for anything else."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise WireError(f"{what}: {str(name)[:40]!r} is not a torch dtype")
    return dtype


def _device(group) -> torch.device:
    """Where a collective's tensors live: NCCL (RCCL) groups take the current GPU's, gloo groups CPU tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def broadcast(value: Any, src: int, group: Optional[dist.ProcessGroup] = None) -> Any:
    """``value`` of group rank ``src`` on every rank of ``group`` (the others pass anything, e.g. None)."""
    device = _device(group)
    mine = encode(value) if dist.get_rank(group) == src else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, group=group, group_src=src)
    data = mine.to(device) if dist.get_rank(group) == src else torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, group=group, group_src=src)
    return decode(data, f"the value broadcast by group rank {src}")


def all_gather(value: Any, group: Optional[dist.ProcessGroup] = None) -> list[Any]:
    """Every rank's ``value``, in group rank order."""
    device, n = _device(group), dist.get_world_size(group)
    mine = encode(value).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:mine.numel()] = mine
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(n)]
    dist.all_gather(out, padded, group=group)
    return [decode(t[:int(s)], f"the value of group rank {r}") for r, (t, s) in enumerate(zip(out, sizes))]
