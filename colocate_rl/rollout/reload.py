"""An in-place weight update through vLLM's layerwise reload, and the two things that reload misses.

vLLM's layerwise reload (vllm/model_executor/model_loader/reload/layerwise.py) puts every layer back
in checkpoint format on the meta device and wraps its parameters' weight loaders: what they receive
is buffered, and once a layer has received all its elements it is materialised, loaded, processed
(``process_weights_after_loading``: CPU repacking, FP8 scale packing, MXFP4 expert re-layout) and
copied into the live storage. Layers still incomplete are processed by ``finalize_layerwise_reload``.
So a layer's post-load processing runs once per sync, after its last tensor, whichever buckets
carried its tensors; the worker extension begins this in ``begin_weight_sync`` and finalizes in
``end_weight_sync``.

What it misses (vLLM 0.26's DeepSeek-V4, vllm/models/deepseek_v4/nvidia/model.py
``DeepseekV4Model.load_weights`` / ``DeepseekV4ForCausalLM.load_weights``):
- A tensor the model's loader writes with a plain copy rather than a weight loader (the attention
  sinks: ``params_dict[name][:n].copy_(...)``) lands in the meta placeholder and is dropped; the
  layer keeps its old values. Such tensors are noticed after each bucket (their parameter is still a
  placeholder and no loader took them), kept, and loaded again once the parameters are live.
- A layer holding a tensor the sync does not carry (a sender that leaves out what RL never changes,
  such as DeepSeek-V4's hash-routing table ``ffn.gate.tid2eid``) never completes; finalize then
  processes it from a freshly allocated, uninitialised table and copies that over the live one.
  Before finalizing, such a layer gets the engine's own current values for what the sync left out,
  which completes it; unless the engine slept at level 2 since its last sync, which discarded those
  values: then the sync fails naming the tensor (the colocated actor sends every tensor).
After finalize one more ``load_weights`` call (the kept tensors, or none) runs the model's own
after-load hooks on live parameters: DeepSeek-V4 recomputes its mHC broadcast table there, which
during the sync was computed from placeholders.
"""

from __future__ import annotations

from typing import Any

import torch

from colocate_rl.weight_sync.ipc import WeightSyncError


def _layerwise_info():
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return LAYERWISE_INFO


def _original_loader(tensor: torch.Tensor):
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    loader = getattr(tensor, "weight_loader", default_weight_loader)
    while getattr(loader, "__name__", "") == "online_process_loader":  # vLLM's layerwise wrapper
        loader = loader.__wrapped__
    return loader


def vllm_name(model: torch.nn.Module, name: str) -> str | None:
    """The model's parameter name for a checkpoint name (its hf_to_vllm_mapper; None: skipped)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return name
    return (getattr(mapper, "map_name", None) or mapper._map_name)(name)  # public from vLLM 0.32


class LayerwiseSync:
    """begin() → load(bucket)… → finish(model_config); abort(model_config) instead of finish on failure.
    ``discarded``: the engine slept at level 2 since it last received weights, so its live tensors
    hold nothing and cannot stand in for one the sync leaves out."""

    def __init__(self, model: torch.nn.Module, discarded: bool = False):
        self.model, self.discarded = model, discarded
        self.kept: list[tuple[str, torch.Tensor]] = []

    def begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.kept = []
        initialize_layerwise_reload(self.model)

    @torch.no_grad()
    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(iter(named))
        self.kept += self._dropped(named)

    @torch.no_grad()
    def finish(self, model_config: Any) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._complete_partial_layers()
        finalize_layerwise_reload(self.model, model_config)
        kept, self.kept = self.kept, []
        self.model.load_weights(iter(kept))

    @torch.no_grad()
    def abort(self, model_config: Any) -> None:
        """Layers still waiting for tensors go back to their old weights (layers already complete keep
        the new ones: a sync that fails midway is partial)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        for info in _layerwise_info().values():
            if info.can_load():  # not processed yet: drop what it buffered, finalize puts the old tensors back
                info.loaded_weights = []
                info.load_numel = 0
        self.kept = []
        finalize_layerwise_reload(self.model, model_config)

    # ------------------------------------------------------------------

    def _dropped(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Tensors of this bucket that went around their parameter's weight loader into a placeholder."""
        infos, out = _layerwise_info(), []
        for name, t in named:
            target = vllm_name(self.model, name)
            if target is None:
                continue
            owner, _, attr = target.rpartition(".")
            try:
                module = self.model.get_submodule(owner)
            except AttributeError:  # a fused or stacked parameter (q/k/v, experts): loaders handle those
                continue
            tensor = module._parameters.get(attr, module._buffers.get(attr))
            info = infos.get(module)
            if tensor is None or not tensor.is_meta or info is None or not info.can_load():
                continue
            if attr not in {n for n, _ in info.loaded_weights}:
                out.append((name, t.detach().clone()))  # the bucket's memory is released after this call
        return out

    def _complete_partial_layers(self) -> None:
        """Layers that received some tensors but not all: the ones the sync did not carry come from
        the engine's live copy, where vLLM holds them as loaded (same shape and dtype, plain loader)."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        infos = _layerwise_info()
        for owner, module in self.model.named_modules():
            info = infos.get(module)
            if info is None or not info.can_load() or not 0 < info.load_numel < (info.load_numel_total or 0):
                continue
            loaded = {n for n, _ in info.loaded_weights}
            params, buffers = info.kernel_tensors or ({}, {})
            live = {**params, **buffers}
            for attr, placeholder in [*module._parameters.items(), *module._buffers.items()]:
                if not info.can_load():  # the last missing tensor completed it: vLLM processed it
                    break
                if placeholder is None or not placeholder.is_meta or attr in loaded:
                    continue
                if self.discarded:
                    raise WeightSyncError(
                        f"weight sync: '{owner}.{attr}' was not sent, and the engine discarded its own copy when "
                        "it slept at level 2: send every tensor the engine holds, or use rollout.sleep_level=1")
                old = live.get(attr)
                if (old is None or old.shape != placeholder.shape or old.dtype != placeholder.dtype
                        or _original_loader(placeholder) is not default_weight_loader):
                    raise WeightSyncError(
                        f"weight sync: '{owner}.{attr}' was not sent, and the engine's copy cannot stand in for it "
                        "(processed, or loaded by a custom loader): its layer would be finished from "
                        "uninitialised memory; send it")
                placeholder.weight_loader(placeholder, old)


__all__ = ["LayerwiseSync", "vllm_name"]
