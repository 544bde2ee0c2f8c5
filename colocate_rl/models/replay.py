"""Rollout routing replay (R3): a model's MoE layers use the experts the sampler chose for each token
instead of their own top-k, so trainer and sampler run the same experts.

Only the choice is replayed. Each router still computes its scores from its own weights, and the
routing weights are those scores at the replayed experts, normalised as the model normally does
(softmax over the k chosen logits, or the chosen share of a pre-softmax; sqrtsoftplus / sigmoid
scores divided by their sum, times the scaling factor; noaux_tc's bias never enters), so the
gradient still reaches the router's weights.

The hook is megatron-core's own: ``topk_routing_with_score_function`` asks a router's
``router_replay`` object for the top-k (``get_replay_topk``), and falls back to its own top-k when
that object computes it. ``RoutingReplay.install`` gives every learned router of a model such an
object; hash-routed layers (DeepSeek-V4's first layers) take their experts from the token ids
already, the same table the sampler uses, and keep doing so.

Shapes: b micro-batch rows, s sequence (padded to a multiple of tp under sequence parallelism),
L MoE layers of the whole model, k experts per token. A router sees its tokens sequence-first and
flattened, [s' * b, E] with s' = s / tp under sequence parallelism (this rank's contiguous share of
the sequence), else s.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch


class RoutingReplay:
    """Holds one micro-batch's routing [b, s, L, k] while a forward (or a recomputing backward) of
    the model runs, and serves each MoE layer its column. One per model; pipeline stages hold all
    L columns and each of their layers reads its own (``moe_layers`` numbers the whole model)."""

    def __init__(self, moe_layers: Sequence[int], sequence_parallel: bool):
        self.column = {layer: i for i, layer in enumerate(moe_layers)}
        self.sequence_parallel = sequence_parallel
        self.routing: Optional[torch.Tensor] = None  # [b, s, L, k] of the micro-batch in flight

    def install(self, model: torch.nn.Module) -> int:
        """Every learned top-k router in ``model`` (this pipeline stage's) replays from here; returns
        how many. Hash-routed routers are left as they are."""
        from megatron.core.transformer.moe.moe_layer import BaseMoELayer
        from megatron.core.transformer.moe.router import TopKRouter

        count = 0
        for moe in model.modules():
            router = getattr(moe, "router", None) if isinstance(moe, BaseMoELayer) else None
            if not isinstance(router, TopKRouter) or getattr(router, "is_hash", False):
                continue
            if router.config.moe_router_fusion:
                raise ValueError("routing replay needs megatron-core's unfused top-k (moe_router_fusion=False): "
                                 "the fused kernel takes no replayed experts")
            if router.router_replay is not None:
                raise ValueError("the model's routers already replay (megatron-core's moe_enable_routing_replay); "
                                 "leave it off with rollout.routing_replay")
            layer = moe.layer_number - 1  # megatron numbers layers from 1, globally over pipeline stages
            if layer not in self.column:
                raise ValueError(f"decoder layer {layer} has a router but is not among the model's MoE layers "
                                 f"{sorted(self.column)}")
            router.router_replay = _LayerReplay(self, self.column[layer])
            count += 1
        return count  # 0 on a pipeline stage of hash-routed layers only

    @contextlib.contextmanager
    def replaying(self, routing: Optional[torch.Tensor]) -> Iterator[None]:
        """The routers replay ``routing`` [b, s, L, k] (None: their own top-k) inside the block."""
        self.routing = routing
        try:
            yield
        finally:
            self.routing = None

    def for_backward(self, output: torch.Tensor, routing: torch.Tensor) -> None:
        """With activation recomputation the backward runs the layers' forward again, long after
        ``replaying`` has ended and while other micro-batches may have run: a hook on the forward's
        output (its gradient is computed before any layer's backward) sets this micro-batch's
        routing again for those recomputations."""
        if output.requires_grad:
            def restore(grad: torch.Tensor) -> None:
                self.routing = routing

            output.register_hook(restore)

    def clear(self) -> None:
        self.routing = None

    def ids(self, column: int, num_tokens: int, topk: int) -> Optional[torch.Tensor]:
        """[num_tokens, k] int64 expert ids of one MoE layer in the router's token order, or None
        when no routing is being replayed."""
        r = self.routing
        if r is None:
            return None
        ids = r[:, :, column].transpose(0, 1)  # [s, b, k], the router's sequence-first order
        if self.sequence_parallel:
            from megatron.core import parallel_state as ps

            tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            share = ids.shape[0] // tp
            ids = ids[rank * share:(rank + 1) * share]
        if ids.shape[0] * ids.shape[1] != num_tokens or ids.shape[2] != topk:
            raise ValueError(f"routing replay: MoE layer {column} routes {num_tokens} tokens to {topk} experts each, "
                             f"the replayed routing holds {ids.shape[0] * ids.shape[1]} tokens x {ids.shape[2]}")
        return ids.reshape(num_tokens, topk).long()


class _LayerReplay:
    """What megatron-core's top-k routing calls as a router's ``router_replay``: the replayed experts
    of one layer, and the scores at them (the caller gathers its unbiased scores at the ids again
    where a bias picked them, and normalises).

    A token whose replayed experts repeat one has no routing to replay (the zeros of padding, of
    each row's last token, which the sampler never ran on, and of the positions the actor pads for
    sequence parallelism): it takes the router's own top-k, as without replay. Megatron's token
    permutation needs k distinct experts per token; those positions' outputs are never used."""

    def __init__(self, replay: RoutingReplay, column: int):
        self.replay, self.column = replay, column
        self.layer_number: Optional[int] = None  # megatron-core's set_layer_number writes it

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        ids = self.replay.ids(self.column, scores.shape[0], topk)
        own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if ids is None:
            return own
        ids = ids.to(scores.device)
        if topk > 1:
            ordered = ids.sort(dim=1).values
            unrouted = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1, keepdim=True)
            ids = torch.where(unrouted, own[1], ids)
        return scores.gather(1, ids), ids
