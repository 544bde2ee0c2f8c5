"""vLLM worker extension: receive weights (IPC handle or broadcast), load them in place, report checksums.

vLLM mixes this class into its worker (``worker_extension_cls``); the engine calls the methods
through ``LLM.collective_rpc``, so they run in every worker process, next to the model. Method
names must not collide with the worker's own (vLLM 0.32 already has ``start_weight_update`` /
``update_weights`` / ``finish_weight_update`` for its built-in transfer engines).

A sync is ``begin_weight_sync`` → ``update_weights_from_ipc`` per bucket → ``end_weight_sync``; an
``update_weights_from_ipc`` outside a begin/end pair is a sync of its own. Every bucket is checked
(names and shapes against the checkpoint the engine started from) before any of it is loaded, so a
bad message leaves the engine serving its old weights. The disaggregated mode receives the same
buckets from a broadcast group instead (``init_weight_broadcast`` once, then
``update_weights_from_broadcast`` per sync) and loads them through the same checks and loaders.

Loading differs by platform:
- GPU: ``model.load_weights`` copies each tensor (or its shard) into the live parameters; fused
  q/k/v and gate/up shards land independently, so buckets may split them. The copies it makes for a
  name are recorded at that name's first sync and replayed afterwards without the loaders
  (rollout/copy_plan.py; ``sync.direct``).
- CPU, and quantized engines (FP8, DeepSeek-V4's FP8 + MXFP4): the linear layers' weights were
  repacked into kernel formats at load time (CPU GEMMs; FP8 scale packing, MXFP4 expert re-layout),
  so a byte copy or ``load_weights`` into them is wrong. vLLM's layerwise reload restores each layer
  to checkpoint format, buffers its incoming tensors until the layer is complete, then re-runs its
  processing and copies the result into the original storage (rollout/reload.py, which also fixes
  what it misses for DeepSeek-V4). It is started in ``begin_weight_sync`` and finished in
  ``end_weight_sync``, so a layer split across buckets is processed once, complete, and layers the
  sync leaves incomplete only at ``end_weight_sync``. Two CPU leftovers are fixed after it (see
  ``_fix_cpu_after_reload``).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from colocate_rl.rollout import invariant_norm
from colocate_rl.rollout.copy_plan import CopyPlan
from colocate_rl.rollout.reload import LayerwiseSync, vllm_name
from colocate_rl.weight_sync.buckets import Bucket, unpack
from colocate_rl.weight_sync.ipc import IpcReceiver, Message, WeightSyncError
from colocate_rl.weight_sync.verify import tensor_checksum

# vLLM imports this module in each worker before it builds the model: exact mode's residual norms
# (rollout/invariant_norm.py) are in place before the forward is first run or captured.
invariant_norm.install()


def _checkpoint_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor in the safetensors checkpoint (headers only, no data). The
    engine's model is a folder: make_rollout resolves a hub id to its snapshot."""
    root = Path(model)
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(root.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    if not shapes:
        raise FileNotFoundError(f"weight sync: no *.safetensors under {root} to check incoming tensors against")
    return shapes


class WeightReceiver:
    """Mixed into vLLM's Worker; ``self`` is the worker (``self.model_runner``, ``self.device`` ...)."""

    # ------------------------------------------------------------------ state

    def _crl_state(self) -> dict[str, Any]:
        st = self.__dict__.get("_crl")
        if st is None:
            mc = self.vllm_config.model_config
            hf = mc.hf_config.get_text_config() if hasattr(mc.hf_config, "get_text_config") else mc.hf_config
            shapes = _checkpoint_shapes(mc.model)
            tied = bool(getattr(hf, "tie_word_embeddings", False))
            if tied and "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
                shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
            st = self.__dict__["_crl"] = {
                "receiver": IpcReceiver(self.device), "shapes": shapes, "tied": tied, "active": False,
                "discarded": False,  # slept at level 2 since the last sync (weights_discarded)
            }
        return st

    def _crl_cpu(self) -> bool:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()

    def _crl_layerwise(self) -> bool:
        """Reload layer by layer (restore checkpoint format, buffer, re-run the layer's
        process_weights_after_loading) on CPU, where linears are repacked, and for quantized engines
        (FP8): their post-load processing converts the checkpoint's e4m3fn weights and scales (to
        e4m3fnuz on ROCm, to the GEMM backend's layout); copying bytes into the processed
        parameters would leave that state wrong."""
        return self._crl_cpu() or getattr(self.vllm_config, "quant_config", None) is not None

    def _crl_model(self) -> torch.nn.Module:
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    # ------------------------------------------------------------------ rpc methods

    def device_uuid(self) -> str:
        return self._crl_state()["receiver"].uuid

    def worker_pid(self) -> int:
        return os.getpid()

    def weight_shapes(self) -> dict[str, list[int]]:
        """HF name -> shape the engine accepts (its checkpoint's tensors)."""
        return {k: list(v) for k, v in self._crl_state()["shapes"].items()}

    def weights_discarded(self) -> None:
        """The engine is about to sleep at level 2, which frees its weights without a copy: until
        a sync has given back every tensor it holds, no live tensor may stand in for one the sync
        leaves out (end_weight_sync checks)."""
        st = self._crl_state()
        if "held" not in st:
            # The checkpoint tensors the model holds under their own names (not those vLLM fuses,
            # such as q/k/v, nor those it skips, such as DeepSeek-V4's MTP layers): computed while
            # the parameters are live, before any sync replaces them with placeholders.
            model = self._crl_model()
            own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
            st["held"] = {n for n in st["shapes"] if vllm_name(model, n) in own
                          and not (st["tied"] and n == "lm_head.weight")}
        st["discarded"] = True

    def begin_weight_sync(self, direct: bool = True) -> None:
        """``direct``: replay recorded copies where the engine loads with plain copies (copy_plan)."""
        from vllm.config import set_current_vllm_config

        st = self._crl_state()
        if st["active"]:
            raise RuntimeError("begin_weight_sync: a weight sync is already in progress (end or abort it first)")
        if self._crl_layerwise():
            try:
                import vllm.model_executor.model_loader.reload  # noqa: F401
            except ImportError as e:
                import vllm

                raise WeightSyncError(f"weight sync into a quantized (FP8) engine needs vLLM's layerwise reload "
                                      f"(vllm.model_executor.model_loader.reload), missing in vLLM {vllm.__version__}"
                                      ) from e

            st["reload"] = LayerwiseSync(self._crl_model(), discarded=st["discarded"])
            with set_current_vllm_config(self.vllm_config):
                st["reload"].begin()
        elif direct and "copy_plan" not in st:
            model = self._crl_model()
            st["copy_plan"] = CopyPlan(model, lambda named: model.load_weights(iter(named)))
        st["direct"] = direct
        st["active"], st["received"] = True, set()

    def update_weights_from_ipc(self, message: Message) -> dict[str, float]:
        """Loads this device's entry of ``message``: {"tensors": n, "bytes": b, "seconds": time here}."""
        t0 = time.perf_counter()
        st = self._crl_state()
        with st["receiver"].open(message) as bucket:
            n, nbytes = self._crl_take(bucket, st)
            del bucket
        return {"tensors": n, "bytes": nbytes, "seconds": time.perf_counter() - t0}

    def init_weight_broadcast(self, spec: dict[str, Any], first_rank: int) -> int:
        """Joins the weight-broadcast group (weight_sync.broadcast) as rank ``first_rank`` + this
        worker's rank in its engine; returns that rank. Blocks until every member has joined."""
        from colocate_rl.weight_sync.broadcast import BroadcastGroup, GroupSpec

        self.close_weight_broadcast()
        rank = first_rank + self.rank
        self.__dict__["_crl_bcast"] = BroadcastGroup(GroupSpec(**spec), rank, self.device)
        return rank

    def update_weights_from_broadcast(self) -> dict[str, float]:
        """Receives one sync (every bucket up to the sender's end marker) from the broadcast group
        and loads it through the same checks and loaders as IPC buckets."""
        group = self.__dict__.get("_crl_bcast")
        if group is None:
            raise WeightSyncError("weight sync: no broadcast group on this worker (init_weight_broadcast first)")
        st = self._crl_state()
        counts = {"tensors": 0}
        oneshot = not st["active"]
        if oneshot:
            self.begin_weight_sync()

        def load(bucket: Bucket) -> None:
            counts["tensors"] += self._crl_take(bucket, st)[0]

        try:
            stats = group.receive(load)
        except BaseException:
            self.abort_weight_sync()
            raise
        if oneshot:
            self.end_weight_sync()
        return {"tensors": counts["tensors"], "bytes": stats.bytes, "seconds": stats.seconds}

    def close_weight_broadcast(self) -> None:
        group = self.__dict__.pop("_crl_bcast", None)
        if group is not None:
            group.close()

    def end_weight_sync(self) -> float:
        """Finishes the sync; returns the seconds it took here (CPU: deferred layer processing)."""
        from vllm.config import set_current_vllm_config

        t0 = time.perf_counter()
        st = self._crl_state()
        if not st["active"]:
            raise RuntimeError("end_weight_sync without begin_weight_sync")
        missing = sorted(st["held"] - st["received"]) if st["discarded"] else []
        if missing:
            self.abort_weight_sync()
            raise WeightSyncError(
                f"weight sync: {len(missing)} tensor(s) the engine holds were not sent ({', '.join(missing[:4])}"
                f"{', ...' if len(missing) > 4 else ''}), and it discarded its own copies when it slept at level 2: "
                "send every tensor, or use rollout.sleep_level=1")
        reload = st.get("reload")
        if reload is not None:
            with set_current_vllm_config(self.vllm_config):
                try:
                    reload.finish(self.vllm_config.model_config)
                except BaseException:
                    self.abort_weight_sync()
                    raise
                st.pop("reload")
                if self._crl_cpu():
                    self._crl_fix_cpu_after_reload()
        st["active"] = st["discarded"] = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def abort_weight_sync(self) -> None:
        """Ends a failed sync. CPU: layers still waiting for tensors go back to their old weights
        (layers already complete keep the new ones: a sync that fails midway is partial)."""
        from vllm.config import set_current_vllm_config

        st = self._crl_state()
        if not st["active"]:
            return
        reload = st.pop("reload", None)
        if reload is not None:
            with set_current_vllm_config(self.vllm_config):
                reload.abort(self.vllm_config.model_config)
                if self._crl_cpu():
                    self._crl_fix_cpu_after_reload()
        st["active"] = False

    def checksum(self, names: list[str]) -> dict[str, tuple[float, bool]]:
        """HF name -> (tensor_checksum of this worker's copy, whether it is one vocabulary shard of
        it; weight_sync.verify.combine_worker_checksums adds the shards up). Only tensors vLLM keeps
        unfused and unpacked qualify (embeddings, norms, lm_head); others raise naming the tensor."""
        st = self._crl_state()
        model = self._crl_model()
        out = {}
        for name in names:
            if name not in st["shapes"]:
                raise WeightSyncError(f"checksum: tensor '{name}' does not exist in the engine's model")
            try:
                param = model.get_parameter(name)
            except AttributeError:
                param = None
            shape = st["shapes"][name]
            # Embeddings and lm_head are split by vocabulary rows over tensor parallelism and padded
            # per shard: this worker's checkpoint rows count, at their place in the full tensor.
            shard = None if param is None else getattr(model.get_submodule(name.rpartition(".")[0]),
                                                       "shard_indices", None)
            if (param is None or param.dim() != len(shape) or tuple(param.shape[1:]) != tuple(shape[1:])
                    or (shard is None and param.shape[0] != shape[0])):
                raise WeightSyncError(
                    f"checksum: tensor '{name}' is fused, sharded or repacked inside vLLM; "
                    "pick embeddings, norms or lm_head"
                )
            if shard is None:
                out[name] = (tensor_checksum(param), False)
            else:
                rows = param[: shard.num_org_elements]
                out[name] = (tensor_checksum(rows, shard.org_vocab_start_index * math.prod(shape[1:])), True)
        return out

    # ------------------------------------------------------------------ helpers

    def _crl_validate(self, named: list[tuple[str, torch.Tensor]], st: dict[str, Any]) -> None:
        shapes = st["shapes"]
        for name, t in named:
            if name not in shapes:
                raise WeightSyncError(f"weight sync: tensor '{name}' does not exist in the engine's model")
            if tuple(t.shape) != shapes[name]:
                raise WeightSyncError(
                    f"weight sync: tensor '{name}' has shape {tuple(t.shape)}, the engine expects {shapes[name]}"
                )

    def _crl_take(self, bucket: Bucket, st: dict[str, Any]) -> tuple[int, int]:
        """Checks then loads one bucket, whatever carried it (IPC handle or broadcast); a bucket
        outside begin/end is a sync of its own. Returns (tensors, bytes).

        A bucket laid out as one loaded before (the same names, shapes and offsets: every sync after
        the first) was checked then, and its copies replay whole (copy_plan.CopyPlan.resolved)."""
        oneshot = not st["active"]
        # A one-shot sync begins direct; a copy plan exists only where direct loading can run.
        plan = st.get("copy_plan") if oneshot or (st["direct"] and "reload" not in st) else None
        known = plan.resolved(bucket) if plan is not None else None
        if known is None:
            named = unpack(bucket)
            self._crl_validate(named, st)  # before anything is loaded: a bad bucket changes nothing
            named = [(n, t) for n, t in named if not (st["tied"] and n == "lm_head.weight")]
        if oneshot:
            self.begin_weight_sync()
        st["received"].update(m.name for m in bucket.metas)
        try:
            if known is not None:
                known.run(bucket.flat)
            else:
                self._crl_load(named, bucket)
        except BaseException:
            self.abort_weight_sync()
            raise
        if oneshot:
            self.end_weight_sync()
        return len(bucket.metas), bucket.nbytes

    def _crl_load(self, named: list[tuple[str, torch.Tensor]], bucket: Bucket) -> None:
        from vllm.config import set_current_vllm_config

        st = self._crl_state()
        reload = st.get("reload")
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            if reload is not None:
                reload.load(named)
            elif st["direct"]:
                st["copy_plan"].load(named, bucket)
            else:
                self._crl_model().load_weights(iter(named))

    def direct_load_stats(self) -> dict[str, int]:
        """How many checkpoint names load by replayed copies, how many through load_weights."""
        plan = self._crl_state().get("copy_plan")
        return plan.stats() if plan is not None else {"direct": 0, "load_weights": 0, "enabled": 0}

    def state_checksums(self) -> dict[str, float]:
        """tensor_checksum of every parameter and buffer of the engine's model, by vLLM's names
        (fused and sharded as vLLM holds them): two engines, or one engine before and after a
        sync, compare whole."""
        model = self._crl_model()
        return {n: tensor_checksum(t) for n, t in (*model.named_parameters(), *model.named_buffers())}

    def _crl_fix_cpu_after_reload(self) -> None:
        """What vLLM 0.32's CPU layerwise reload leaves stale.

        - Fused MoE experts: on a reload the unquantized method copies the new weights into the
          existing (already prepacked) storage and skips the experts' CPU prepack, so the kernel
          reads checkpoint-layout data as if it were packed. Re-run the experts' own
          process_weights_after_loading.
        - Tied embeddings: the output layer shares the embedding's Parameter, but its CPU GEMM was
          dispatched at load time from a packed copy of it (``cpu_linear``); nothing is loaded into
          lm_head itself, so reload never re-dispatches it and logits come from the old embedding.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        model = self._crl_model()
        embeds = {id(m.weight) for m in model.modules() if type(m) is VocabParallelEmbedding}
        for m in model.modules():
            qm = getattr(m, "quant_method", None)
            kernel = getattr(qm, "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and hasattr(experts, "process_weights_after_loading"):
                experts.process_weights_after_loading(m)
            if isinstance(m, ParallelLMHead) and id(m.weight) in embeds and qm is not None:
                qm.process_weights_after_loading(m)
