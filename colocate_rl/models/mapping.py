"""HF ⇄ Megatron weights: per-parameter specs, sharded loading, gathered export.

A family lists every Megatron parameter of the *full* model as a ``ParamSpec`` under a canonical
name (local-spec naming, global layer and expert numbers). A rank's model holds a subset: its
pipeline stage's layers, its expert-parallel rank's experts, a tensor-parallel shard of each
split weight. Names are translated between the canonical form and the rank's local form (layer
offset, expert offset, TransformerEngine's fused-norm names).

Fused layouts (Megatron, per tensor-parallel rank r of tp):
  qkv      rows = for each query group g of rank r: [q heads of g (heads/groups × hd), k_g (hd), v_g (hd)]
           — groups are contiguous per rank, so the full tensor is the rank shards concatenated.
  gate_up  rows = [gate rows of chunk r, up rows of chunk r] — the full tensor is NOT the shards
           concatenated; each shard is split in halves first.
"""

from __future__ import annotations

import math
import re
import weakref
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from colocate_rl.models.hf_checkpoint import HFCheckpoint
from colocate_rl.weight_sync.json_wire import all_gather, dtype_name, dtype_named


@dataclass(frozen=True)
class ParamSpec:
    name: str  # canonical Megatron name, e.g. decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight
    hf: tuple[str, ...]  # HF tensor(s) it is made of
    shape: tuple[int, ...]  # full (unsharded) Megatron shape
    kind: str = "copy"  # copy | qkv | gate_up
    tp_dim: Optional[int] = None  # dimension split over tensor parallelism; None = replicated
    layer: Optional[int] = None  # global decoder layer: decides the pipeline stage
    expert: Optional[int] = None  # global expert index: decides the expert-parallel rank
    stage: str = ""  # "first" / "last" pipeline stage for parameters outside the decoder layers
    qkv: tuple[int, int, int] = (0, 0, 0)  # (heads, query groups, head_dim) for kind == "qkv"
    export: bool = True  # False for a copy of another parameter (tied output layer)


# ---------------------------------------------------------------- shard / unshard


def read_shard(ckpt: HFCheckpoint, spec: ParamSpec, rank: int, size: int) -> torch.Tensor:
    """The tensor-parallel shard ``rank`` of ``size`` of this parameter, reading only its rows."""
    if spec.kind == "copy":
        if spec.tp_dim is None or size == 1:
            return ckpt.read(spec.hf[0])
        n = spec.shape[spec.tp_dim] // size
        return ckpt.read(spec.hf[0], spec.tp_dim, rank * n, (rank + 1) * n)
    if spec.kind == "gate_up":
        n = spec.shape[0] // 2 // size
        return torch.cat([ckpt.read(h, 0, rank * n, (rank + 1) * n) for h in spec.hf])
    if spec.kind == "qkv":
        heads, groups, hd = spec.qkv
        q_rows = heads // groups * hd
        per_rank = groups // size
        parts = []
        for g in range(rank * per_rank, (rank + 1) * per_rank):
            parts += [ckpt.read(spec.hf[0], 0, g * q_rows, (g + 1) * q_rows),
                      ckpt.read(spec.hf[1], 0, g * hd, (g + 1) * hd),
                      ckpt.read(spec.hf[2], 0, g * hd, (g + 1) * hd)]
        return torch.cat(parts)
    raise ValueError(f"unknown ParamSpec.kind {spec.kind!r} for {spec.name}")


def unshard(spec: ParamSpec, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Tensor-parallel shards (rank order) → the HF tensors, full size."""
    if spec.kind == "copy":
        full = shards[0] if len(shards) == 1 else torch.cat(shards, dim=spec.tp_dim)
        return [(spec.hf[0], full)]
    if spec.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        if len(halves) == 1:  # views: a cat of one tensor would copy two thirds of an MLP for nothing
            return [(spec.hf[0], halves[0][0]), (spec.hf[1], halves[0][1])]
        return [(spec.hf[0], torch.cat([h[0] for h in halves])), (spec.hf[1], torch.cat([h[1] for h in halves]))]
    if spec.kind == "qkv":
        heads, groups, hd = spec.qkv
        full = torch.cat(shards) if len(shards) > 1 else shards[0]
        per_group = full.view(groups, (heads // groups + 2) * hd, *full.shape[1:])
        q_rows = heads // groups * hd
        q, k, v = per_group.split([q_rows, hd, hd], dim=1)
        rest = full.shape[1:]
        return [(spec.hf[0], q.reshape(heads * hd, *rest)), (spec.hf[1], k.reshape(groups * hd, *rest)),
                (spec.hf[2], v.reshape(groups * hd, *rest))]
    raise ValueError(f"unknown ParamSpec.kind {spec.kind!r} for {spec.name}")


# ---------------------------------------------------------------- names

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_TE_GROUPED = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
# TransformerEngine's spec fuses the pre-attention / pre-MLP norms into the next linear.
_TE_NORMS = {".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
             ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight"}


@dataclass
class Placement:
    """Where this rank's model sits in the full model."""

    layer_offset: int = 0  # global index of local layer 0
    expert_offset: int = 0  # global index of local expert 0

    def to_canonical(self, local: str) -> str:
        name = local
        for te, plain in _TE_NORMS.items():
            if name.endswith(te):
                name = name[: -len(te)] + plain
        m = _TE_GROUPED.search(name)
        if m:
            name = name[: m.start()] + f".mlp.experts.local_experts.{m.group(2)}.{m.group(1)}.weight"
        name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + self.layer_offset}.", name)
        return _LOCAL_EXPERT.sub(lambda m: f".mlp.experts.local_experts.{int(m.group(1)) + self.expert_offset}.", name)


def placement(model) -> Placement:
    """Layer and expert offsets of this rank's GPTModel (chunk)."""
    from megatron.core import parallel_state as ps

    layers = model.decoder.layers
    layer_offset = layers[0].layer_number - 1 if len(layers) else 0
    expert_offset = 0
    num_experts = getattr(model.config, "num_moe_experts", None)
    if num_experts:
        expert_offset = ps.get_expert_model_parallel_rank() * (num_experts // ps.get_expert_model_parallel_world_size())
    return Placement(layer_offset, expert_offset)


def _tp(spec: ParamSpec) -> tuple[int, int, object]:
    """(rank, size, group) of the tensor parallelism that splits this parameter."""
    from megatron.core import parallel_state as ps

    if spec.expert is not None:
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group(check_initialized=False))
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group(check_initialized=False))


# ---------------------------------------------------------------- load


@torch.no_grad()
def load_hf_weights(model, specs: list[ParamSpec], path) -> int:
    """Copy this rank's shards of an HF checkpoint into ``model`` (one GPTModel). Returns the count.

    Every parameter of the model must have a spec, and every HF tensor it needs must exist.
    """
    by_name = {s.name: s for s in specs}
    where = placement(model)
    todo = []
    for local, param in model.named_parameters():
        canonical = where.to_canonical(local)
        if canonical not in by_name:
            raise ValueError(f"no HF mapping for Megatron parameter {local} (canonical {canonical})")
        todo.append((local, param, by_name[canonical]))
    # Buffers that carry checkpoint state (DeepSeek-V4's frozen routing tables) load when a spec names them.
    for local, buf in model.named_buffers():
        canonical = where.to_canonical(local)
        if canonical in by_name:
            todo.append((local, buf, by_name[canonical]))
    with HFCheckpoint(path) as ckpt:
        ckpt.require(h for _, _, s in todo for h in s.hf)
        for local, param, spec in todo:
            rank, size, _ = _tp(spec)
            if getattr(param, "tensor_model_parallel", False) and size > 1 and param.partition_dim != spec.tp_dim:
                raise ValueError(f"{local}: Megatron splits dim {param.partition_dim}, the mapping says {spec.tp_dim}")
            t = read_shard(ckpt, spec, rank, size)
            if tuple(t.shape) != tuple(param.shape):
                raise ValueError(
                    f"{local}: checkpoint gives shape {tuple(t.shape)} (from {', '.join(spec.hf)}), "
                    f"the model has {tuple(param.shape)}"
                )
            param.copy_(t)
    return len(todo)


# ---------------------------------------------------------------- export


def _local_shape(spec: ParamSpec, size: int) -> list[int]:
    shape = list(spec.shape)
    if spec.tp_dim is not None:
        shape[spec.tp_dim] //= size
    return shape


# A run of consecutive parameters that travel the same way (same pipeline stage, expert-parallel owner,
# tensor-parallel split and dtype) moves in one collective per group, up to this many bytes.
RUN_BYTES = 256 * 2**20

# model -> (specs, its export maps): built at a model's first export, reused by every later one.
_EXPORT_MAPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

# How a parameter travels: (pipeline stage, expert-parallel owner or None, tensor-parallel size it is
# split over (1: not split), dtype on its owner).
Route = tuple[int, Optional[int], int, torch.dtype]


def _export_maps(model, specs: list[ParamSpec]) -> tuple[dict, list[tuple[Route, list[ParamSpec]]]]:
    """(canonical name -> this rank's parameter or checkpoint-carrying buffer, the exported specs cut
    into runs that travel the same way, each with its route: the same on every rank).

    Walking the modules and canonicalising every name made up most of an export's time
    (docs/lab/performance_log.md, *Weight sync at the Qwen3-30B-A3B width*), and none of it changes
    between syncs: the parameters are
    the same objects for the model's life (offload and checkpoint loads write into them in place),
    and so is the layout, so the maps and the runs are kept per model.
    Collective the first time under pipeline parallelism (every stage calls it then)."""
    from megatron.core import parallel_state as ps

    cached = _EXPORT_MAPS.get(model)
    if cached is not None and cached[0] is specs:
        return cached[1]
    where = placement(model)
    local = {where.to_canonical(n): p for n, p in model.named_parameters()}
    named = {s.name for s in specs}  # buffers that carry checkpoint state export like parameters
    local.update({c: b for n, b in model.named_buffers() if (c := where.to_canonical(n)) in named})
    pdtype, pp_size = model.config.params_dtype, ps.get_pipeline_model_parallel_world_size()
    # Which stage holds which global layer (stages may hold unequal counts), and the parameters kept
    # at another dtype than the model's (DeepSeek-V4's fp32 mHC and sinks in a bf16 model): a stage
    # receiving one allocates it at the owner's dtype.
    layer_stage, dtypes = {}, {}
    if pp_size > 1:
        mine = sorted({int(m.group(1)) for n in local if (m := _LAYER.match(n))})
        odd = {n: dtype_name(p.dtype) for n, p in local.items() if p.dtype != pdtype}
        gathered = all_gather([mine, odd], ps.get_pipeline_model_parallel_group())
        layer_stage = {layer: stage for stage, (layers, _) in enumerate(gathered) for layer in layers}
        for stage, (_, stage_odd) in enumerate(gathered):
            dtypes.update({n: dtype_named(d, f"pipeline stage {stage}'s dtype of {n}") for n, d in stage_odd.items()})
    num_experts = getattr(model.config, "num_moe_experts", None) or 0
    per_ep = num_experts // ps.get_expert_model_parallel_world_size() if num_experts else 0

    def route(spec: ParamSpec) -> Route:
        if spec.layer is not None:
            stage = layer_stage.get(spec.layer, 0)
        else:
            stage = pp_size - 1 if spec.stage == "last" else 0
        owner_ep = spec.expert // per_ep if spec.expert is not None else None
        tp_size = _tp(spec)[1] if spec.tp_dim is not None else 1
        # Experts travel at the model's dtype (the receivers of an expert-parallel broadcast allocate it);
        # other parameters at their own, known to every rank of their stage and, under pipeline
        # parallelism, gathered for the others (above).
        if spec.name in dtypes:
            owned = dtypes[spec.name]
        elif spec.expert is None and spec.name in local:
            owned = local[spec.name].dtype
        else:
            owned = pdtype
        return stage, owner_ep, tp_size, owned

    runs: list[tuple[Route, list[ParamSpec]]] = []
    size = 0
    for spec in specs:
        if not spec.export:
            continue
        key = route(spec)
        nbytes = math.prod(spec.shape) * key[3].itemsize
        if runs and runs[-1][0] == key and size + nbytes <= RUN_BYTES:
            runs[-1][1].append(spec)
            size += nbytes
        else:
            runs.append((key, [spec]))
            size = nbytes
    _EXPORT_MAPS[model] = (specs, (local, runs))
    return local, runs


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` laid end to end in one 1-D tensor (one alone: flattened, a view where it can be)."""
    return torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)


def _flat_views(flat: torch.Tensor, shapes: list[list[int]]) -> list[torch.Tensor]:
    """Views of ``flat`` with ``shapes``, laid end to end."""
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset: offset + n].view(shape))
        offset += n
    return out


def _broadcast_flat(tensors: Optional[list[torch.Tensor]], shapes: list[list[int]], dtype: torch.dtype,
                    dev: torch.device, src: int, group) -> list[torch.Tensor]:
    """One broadcast of ``tensors`` (held by ``src``; None elsewhere) laid end to end; views of it."""
    if tensors is not None:
        flat = _flat(tensors)
    else:
        flat = torch.empty(sum(math.prod(s) for s in shapes), device=dev, dtype=dtype)
    dist.broadcast(flat, group_src=src, group=group)
    return _flat_views(flat, shapes)


@torch.no_grad()
def export_hf_weights(model, specs: list[ParamSpec], dtype: Optional[torch.dtype] = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (hf_name, full tensor) one at a time, on every rank, in ``specs`` order.

    Collective: every rank of the job must iterate to the end (each tensor is gathered over tensor
    parallelism, broadcast from its expert-parallel owner and from its pipeline stage). Consecutive
    parameters that travel the same way go in one collective of up to ``RUN_BYTES`` per group: at
    Qwen3-30B-A3B's width a layer's 384 expert matrices (256 parameters) would otherwise be as many
    broadcasts. Tensors are on this rank's device in the parameters' dtype (or ``dtype``, for those
    at the model's dtype); a yielded tensor may share storage with a parameter, so consumers copy it
    before the next optimizer step.
    """
    from megatron.core import parallel_state as ps

    local, runs = _export_maps(model, specs)
    dev, pdtype = next(iter(local.values())).device, model.config.params_dtype
    pp_size = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    ep_size = ps.get_expert_model_parallel_world_size()
    ep_rank = ps.get_expert_model_parallel_rank()

    for (stage, owner_ep, tp_size, owned), run in runs:
        shapes = [_local_shape(spec, tp_size) if tp_size > 1 else list(spec.shape) for spec in run]
        shard_shapes = [s for s in shapes for _ in range(tp_size)]  # per parameter, its shards in rank order
        shards: Optional[list[torch.Tensor]] = None  # flat list: parameter by parameter, shard by shard
        if stage == pp_rank and owner_ep in (None, ep_rank):
            params = [local[spec.name].detach() for spec in run]
            if tp_size > 1:
                _, _, tp_group = _tp(run[0])
                mine = _flat(params).contiguous()
                gathered = [torch.empty_like(mine) for _ in range(tp_size)]
                dist.all_gather(gathered, mine, group=tp_group)
                per_rank = [_flat_views(g, shapes) for g in gathered]
                shards = [per_rank[r][i] for i in range(len(run)) for r in range(tp_size)]
            else:
                shards = params
        if stage == pp_rank and owner_ep is not None and ep_size > 1:
            shards = _broadcast_flat(shards, shard_shapes, owned, dev, owner_ep, ps.get_expert_model_parallel_group())
        if pp_size > 1:
            shards = _broadcast_flat(shards, shard_shapes, owned, dev, stage, ps.get_pipeline_model_parallel_group())
        for i, spec in enumerate(run):
            for name, t in unshard(spec, shards[i * tp_size: (i + 1) * tp_size]):
                # Only parameters at the model's dtype convert: those a family keeps in fp32 inside a
                # bf16 model (DeepSeek-V4's mHC mixing, sinks, position biases) travel as they are.
                yield name, (t if dtype is None or t.dtype == dtype or t.dtype != pdtype else t.to(dtype))
