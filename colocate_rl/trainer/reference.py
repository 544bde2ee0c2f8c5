"""The reference policy of the KL penalty (algorithm.kl_coef > 0): a frozen copy of the policy.

It is a second Megatron module of the policy's family, built at the policy's parallel layout (each
rank holds its own TP / PP / EP shard, every data-parallel rank a replica) and filled by copying
the policy's state, so no storage is shared. It is not wrapped in DDP, not given to the optimizer
and not part of the HF export, so neither an update nor the weight sync reaches it.

Between uses it lives in host memory (pinned on GPU) through the same HostOffload as the actor's
own state: its storages are shrunk to 0 bytes on the device and regrown only around its forward
pass and checkpoint saves and loads. It never changes, so the host copy taken once stays valid and
giving the device memory back copies nothing. ``actor.ref_on_device`` keeps it resident instead
(no copies at all, its bytes held on the device through the rollout too).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from colocate_rl.trainer.offload import HostOffload


class Reference:
    """``module``: this rank's reference model, on the device, its weights to be filled by the
    caller, who then calls ``release(changed=True)``. ``on_device``: keep it resident."""

    def __init__(self, module: torch.nn.Module, on_device: bool):
        self.module = module.requires_grad_(False).eval()
        self._offload = None if on_device else HostOffload({"ref": self._tensors}, frozen=("ref",))

    @classmethod
    def snapshot(cls, module: torch.nn.Module, policy: torch.nn.Module, on_device: bool) -> "Reference":
        """A reference holding the policy's current weights (``module`` built like the policy)."""
        ref = cls(module, on_device)
        with torch.no_grad():
            ref.module.load_state_dict(policy.state_dict())  # copies into ref's own storages
        mine = {s._cdata for s in ref.storages()}
        if any(t.untyped_storage()._cdata in mine for t in [*policy.parameters(), *policy.buffers()]):
            raise RuntimeError("the reference policy shares storage with the policy")
        ref.release(changed=True)
        return ref

    def _tensors(self) -> Iterator[torch.Tensor]:
        yield from self.module.parameters()
        yield from self.module.buffers()

    def storages(self) -> list[torch.UntypedStorage]:
        """Its distinct storages (0 bytes each while it is on the host)."""
        seen: dict[int, torch.UntypedStorage] = {}
        for t in self._tensors():
            seen.setdefault(t.untyped_storage()._cdata, t.untyped_storage())
        return list(seen.values())

    def device_bytes(self) -> int:
        """Bytes of its storages now on the device."""
        dev = next(self.module.parameters()).device
        return sum(s.nbytes() for s in self.storages() if s.device.type == dev.type)

    @property
    def on_host(self) -> bool:
        return self._offload is not None and self._offload.offloaded()

    def acquire(self) -> None:
        """Its weights onto the device (a no-op when resident)."""
        if self._offload is not None:
            self._offload.onload()

    def release(self, changed: bool = False) -> None:
        """Its device memory back (a no-op when resident). ``changed``: its weights were just
        written (snapshot, checkpoint load), so the host copy is taken again."""
        if self._offload is None:
            return
        if changed:
            self._offload.changed("ref")
        self._offload.offload()

    @contextlib.contextmanager
    def resident(self, changed: bool = False) -> Iterator[torch.nn.Module]:
        """``with ref.resident() as module:`` the module with its weights on the device."""
        self.acquire()
        try:
            yield self.module
        finally:
            self.release(changed)
