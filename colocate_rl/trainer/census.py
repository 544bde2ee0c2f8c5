"""What a training forward keeps for its backward, by the module that kept it.

Activations are the tensors autograd saves in the forward pass and frees in the backward: their
bytes do not depend on the device, so a census on a CPU holds on a GPU. Each saved tensor is counted
once per storage (views share theirs) under the innermost module running when it was saved
(``<loss>`` outside every module), if it is still alive when the backward begins; storages given as
``exclude`` (the parameters') are left out.
memory.activation_bytes is checked against it (tests/integration/test_activation_census.py).
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections import defaultdict
from typing import Iterator, Optional

import torch


class SavedTensorCensus:
    def __init__(self, model: torch.nn.Module, exclude: set[int]):
        self.model, self.exclude = model, exclude
        # storage address → (module, bytes, the saved tensor, weakly): a part of the graph that the
        # loss does not reach is freed in the forward, and its address may then hold a new tensor.
        self._saved: dict[int, tuple[str, int, weakref.ref]] = {}
        self._kept: Optional[dict[str, int]] = None  # what was alive when the backward began
        self._stack: list[str] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in self.exclude:
            held = self._saved.get(key)
            if held is None or held[2]() is None:
                self._saved[key] = (self._stack[-1] if self._stack else "<loss>", storage.nbytes(), weakref.ref(t))
        return t

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        if self._kept is None:  # the backward's first read: every saved tensor it will need is alive
            self._kept = self._alive()
        return t

    def _alive(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for name, nbytes, ref in self._saved.values():
            if ref() is not None:
                out[name] += nbytes
        return out

    def _leave(self, module, args, output) -> None:  # a forward hook's return value would replace the output
        self._stack.pop()

    @contextlib.contextmanager
    def counting(self) -> Iterator["SavedTensorCensus"]:
        hooks = []
        for name, module in self.model.named_modules():
            hooks.append(module.register_forward_pre_hook(lambda m, args, name=name: self._stack.append(name)))
            hooks.append(module.register_forward_hook(self._leave))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for h in hooks:
                h.remove()

    def by_module(self) -> dict[str, int]:
        """Bytes by module name, decoder layers and experts folded ('decoder.layers.*.mlp…',
        summed over them), the largest first."""
        out: dict[str, int] = defaultdict(int)
        for name, n in (self._alive() if self._kept is None else self._kept).items():
            out[re.sub(r"^(module\.)+", "", re.sub(r"(layers|local_experts)\.\d+", r"\1.*", name))] += n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))
