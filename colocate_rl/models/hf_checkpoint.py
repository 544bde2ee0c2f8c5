"""Read tensors, or slices of them, from an HF safetensors folder without loading whole files.

Quantised weights (FP8 128x128 blocks, MXFP4 experts: a ``<module>.weight`` in float8 / packed
int8 with a ``<module>.scale`` beside it, as DeepSeek-V4 ships them) read back dequantised to
bf16; the block size comes from config.json's ``quantization_config.weight_block_size``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import safe_open


class HFCheckpoint:
    """name → tensor over model.safetensors or the shards listed in model.safetensors.index.json."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file = {name: self.path / f for name, f in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {self.path}")
            self._file = {}
            for f in files:
                with safe_open(str(f), "pt") as h:
                    self._file.update({name: f for name in h.keys()})
        self._handles: dict[Path, object] = {}
        self._block = (128, 128)
        cfg = self.path / "config.json"
        if cfg.is_file():
            quant = json.loads(cfg.read_text()).get("quantization_config") or {}
            self._block = tuple(quant.get("weight_block_size") or self._block)

    def __contains__(self, name: str) -> bool:
        return name in self._file

    def names(self) -> list[str]:
        return list(self._file)

    def require(self, names: Iterable[str]) -> None:
        """Raises naming the tensors the checkpoint lacks."""
        missing = sorted({n for n in names if n not in self._file})
        if missing:
            more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
            raise ValueError(f"checkpoint {self.path} is missing tensor(s): {', '.join(missing[:8])}{more}")

    def shape(self, name: str) -> list[int]:
        return self._slice(name).get_shape()

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """The tensor, or rows [start:stop) of it along ``dim`` (only those bytes are read; a
        quantised weight is read whole and dequantised first)."""
        sl = self._slice(name)
        scale = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
        if scale in self._file and sl.get_dtype() in ("F8_E4M3", "I8", "U8", "F4"):
            from colocate_rl.models.quantized import dequantize

            full = dequantize(sl[:], self._slice(scale)[:], self._block)
            return full if dim is None else full.narrow(dim, start, (stop or full.shape[dim]) - start)
        if dim is None:
            return sl[:]
        index = (slice(None),) * dim + (slice(start, stop),)
        return sl[index]

    def _slice(self, name: str):
        if name not in self._file:
            self.require([name])
        f = self._file[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), "pt")
        return self._handles[f].get_slice(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
