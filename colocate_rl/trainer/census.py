"""What a training forward keeps for its backward, by the module that kept it.

Activations are the tensors autograd saves in the forward pass and frees in the backward: their
bytes do not depend on the device, so a census on a CPU holds on a GPU. Each saved tensor is counted
once per storage (views share theirs) under the innermost module running when it was saved
(``<loss>`` outside every module); storages given as ``exclude`` (the parameters') are left out.
memory.activation_bytes is checked against it (tests/integration/test_activation_census.py).
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from typing import Iterator

import torch


class SavedTensorCensus:
    def __init__(self, model: torch.nn.Module, exclude: set[int]):
        self.model, self.exclude = model, exclude
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = defaultdict(int)
        self._stack: list[str] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in self.exclude and key not in self.seen:
            self.seen.add(key)
            self.bytes[self._stack[-1] if self._stack else "<loss>"] += storage.nbytes()
        return t

    def _leave(self, module, args, output) -> None:  # a forward hook's return value would replace the output
        self._stack.pop()

    @contextlib.contextmanager
    def counting(self) -> Iterator["SavedTensorCensus"]:
        hooks = []
        for name, module in self.model.named_modules():
            hooks.append(module.register_forward_pre_hook(lambda m, args, name=name: self._stack.append(name)))
            hooks.append(module.register_forward_hook(self._leave))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for h in hooks:
                h.remove()

    def by_module(self) -> dict[str, int]:
        """Bytes by module name, decoder layers and experts folded ('decoder.layers.*.mlp…',
        summed over them), the largest first."""
        out: dict[str, int] = defaultdict(int)
        for name, n in self.bytes.items():
            out[re.sub(r"^(module\.)+", "", re.sub(r"(layers|local_experts)\.\d+", r"\1.*", name))] += n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))
