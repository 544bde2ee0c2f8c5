"""Which engine tensors get which quantized format on sync, and the quantizing pass the sender runs.

An FP8 rollout engine holds some linears quantized, as its checkpoint does; the actor holds them in
bf16/fp32. The engine's own tensor names and shapes (the ``weight_shapes`` RPC: its checkpoint's
safetensors headers) say which layout each weight is in: a weight with a scale tensor beside it,
whose (weight, scale) shapes are what a format would write for some [M, N]. Known formats:

    fp8_block     X.weight e4m3 [M, N] + X.weight_scale_inv float32 [⌈M/128⌉, ⌈N/128⌉]  (Qwen3 FP8, DeepSeek-V3)
    fp8_ue8m0     X.weight e4m3 [M, N] + X.scale float8_e8m0fnu [⌈M/128⌉, ⌈N/128⌉]     (DeepSeek-V4-Flash)
    mxfp4         X.weight int8 [M, N/2] (e2m1 pairs) + X.scale float8_e8m0fnu [M, N/32]  (its routed experts)

A variant is one module with its quantizer and shape rules plus one line in FORMATS.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from colocate_rl.weight_sync import fp8, released

Shape = tuple[int, ...]


@dataclass(frozen=True)
class SyncFormat:
    name: str
    scale_name: Callable[[str], str | None]  # weight name → its scale tensor's name (None: not a weight name)
    held: Callable[[tuple[int, int]], tuple[Shape, Shape]]  # actor [M, N] → (weight, scale) shapes the engine holds
    quantize: Callable[[torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]  # (w, name) → (weight, scale)
    unpacked: Callable[[Shape], tuple[int, int]] = lambda s: (s[0], s[1])  # engine weight shape → actor [M, N]

    def matches(self, weight: Shape, scale: Shape) -> bool:
        return len(weight) == 2 and self.held(self.unpacked(weight)) == (tuple(weight), tuple(scale))


FORMATS: dict[str, SyncFormat] = {f.name: f for f in (
    SyncFormat("fp8_block", fp8.scale_name, fp8.held, lambda w, name: fp8.quantize_block_fp8(w, name=name)),
    SyncFormat("fp8_ue8m0", released.scale_name, released.fp8_held, released.quantize_fp8_ue8m0),
    SyncFormat("mxfp4", released.scale_name, released.mxfp4_held, released.quantize_mxfp4, released.mxfp4_unpacked),
)}


def sync_plan(engine_shapes: Mapping[str, Shape]) -> dict[str, str]:
    """{weight name: format name} for every weight the engine holds quantized; other tensors travel
    as they are. Raises naming the tensor when a weight has a scale beside it that no format
    explains, or that two formats explain."""
    plan: dict[str, str] = {}
    for name, shape in engine_shapes.items():
        scaled = {f.name: s for f in FORMATS.values() if (s := f.scale_name(name)) in engine_shapes}
        if not scaled:
            continue
        hits = [n for n, s in scaled.items() if FORMATS[n].matches(tuple(shape), tuple(engine_shapes[s]))]
        if len(hits) != 1:
            scales = ", ".join(f"{s} {tuple(engine_shapes[s])}" for s in sorted(set(scaled.values())))
            why = "no known quantized layout has" if not hits else f"formats {hits} all match"
            raise ValueError(f"weight sync: the engine's checkpoint holds '{name}' {tuple(shape)} with {scales}: "
                             f"{why} these shapes")
        plan[name] = hits[0]
    # vLLM's DeepSeek-V4 reads .scale blocks as float8_e8m0fnu only when the routed experts are
    # MXFP4 (DeepseekV4FP8Config.is_scale_e8m0: expert_dtype == "fp4"); with FP8 experts
    # (Flash-Base) they are float32, and an e8m0 expert scale would be loaded byte for byte.
    if "fp8_ue8m0" in plan.values() and "mxfp4" not in plan.values():
        raise ValueError("weight sync: the engine's checkpoint has DeepSeek-V4 '.scale' FP8 blocks but no MXFP4 "
                         "routed experts (the FP8-expert layout with float32 scales); the sync writes the "
                         "MXFP4-expert layout (DeepSeek-V4-Flash) only")
    return plan


def quantize_named(
    named: Iterable[tuple[str, torch.Tensor]], plan: Mapping[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors with each planned weight replaced by its quantized (weight, scale) pair under
    the engine's names; others pass through. Lazy, like the actor's export: one tensor at a time."""
    for name, t in named:
        fmt = plan.get(name)
        if fmt is None:
            yield name, t
            continue
        f = FORMATS[fmt]
        q, s = f.quantize(t, name)
        yield name, q
        yield f.scale_name(name), s


__all__ = ["FORMATS", "SyncFormat", "quantize_named", "sync_plan"]
