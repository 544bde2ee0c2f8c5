"""What autograd saves for a backward, counted in tests of memory-lean autograd functions."""

from __future__ import annotations

import torch


def saved_bytes(fn, *inputs, held=()) -> tuple[torch.Tensor, int]:
    """fn(*inputs) and the bytes of the distinct storages autograd saved for its backward, those of
    ``held`` (e.g. the inputs and parameters, which are alive anyway) left out."""
    held = {t.untyped_storage().data_ptr() for t in held}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in held:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return out, sum(seen.values())
