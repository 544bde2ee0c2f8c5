"""placement.mode=disaggregated: the actor and the rollout on GPUs of their own. Its layout maths,
rules and pools; it runs on Ray (``ray_disaggregated``).

Two pools, sized from ``placement`` (``pools``): the actor pool has one bundle per actor GPU (one
Megatron rank each); the rollout pool one bundle per engine holding all of its TP GPUs, so one
Ray actor owns the engine and vLLM starts its TP workers on the bundle's GPUs. DeepSeek-V4's
published layout — 2 actor nodes (TP4 × PP4 × EP4) + 1 rollout node (TP8, FP8) of 8 GPUs — is
``nnodes=3 gpus_per_node=8 actor_nodes=2 rollout_nodes=1 rollout.tensor_parallel_size=8``: 16
actor bundles and one rollout bundle of 8 GPUs. On one node ``placement.actor_gpus`` splits it; on
CPU (``gpus_per_node=0``) bundles are CPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from colocate_rl.config import ActorConfig, ConfigError, PlacementConfig, RolloutConfig
from colocate_rl.placement.base import Placement, check_engine_tp, cpu_actor_ranks, data_parallel
from colocate_rl.resolved import Layout


def check(pl: PlacementConfig, rollout: RolloutConfig, gpn: int) -> None:
    if pl.nnodes > 1 and (pl.actor_nodes < 1 or pl.rollout_nodes < 1):
        raise ConfigError(f"placement.actor_nodes={pl.actor_nodes} and placement.rollout_nodes={pl.rollout_nodes} "
                          f"must both be >= 1 on placement.nnodes={pl.nnodes} nodes")
    if pl.nnodes > 1 and pl.actor_nodes + pl.rollout_nodes != pl.nnodes:
        raise ConfigError(
            f"placement.actor_nodes={pl.actor_nodes} + placement.rollout_nodes={pl.rollout_nodes} "
            f"must equal placement.nnodes={pl.nnodes}"
        )
    if pl.nnodes == 1 and gpn > 0 and not 0 < pl.actor_gpus < gpn:
        raise ConfigError(
            f"placement.actor_gpus={pl.actor_gpus} must leave GPUs for rollout on one node of "
            f"{gpn} (0 < actor_gpus < gpus_per_node)"
        )


def layout(pl: PlacementConfig, a: ActorConfig, rollout: RolloutConfig, gpn: int) -> Layout:
    # Several nodes: each pool on nodes of its own; one node holds both pools.
    actor_nodes, rollout_nodes = (pl.actor_nodes, pl.rollout_nodes) if pl.nnodes > 1 else (1, 1)
    if not gpn:
        actor, gpus = cpu_actor_ranks(pl, a, actor_nodes), 0
    elif pl.nnodes > 1:
        actor, gpus = actor_nodes * gpn, rollout_nodes * gpn
    else:
        actor, gpus = pl.actor_gpus, gpn - pl.actor_gpus
    dp = data_parallel(pl, a, gpn, actor)
    tp, asked = rollout.tensor_parallel_size, rollout.num_engines
    engines = asked or 1
    if gpn:
        check_engine_tp(tp, gpn, whole_nodes=rollout_nodes > 1)
        if not asked:
            engines = max(gpus // tp, 1)
            if engines * tp != gpus:
                raise ConfigError(f"rollout.tensor_parallel_size={tp} does not divide the {gpus} rollout GPUs")
        elif engines * tp != gpus:
            raise ConfigError(f"rollout.num_engines={engines} x rollout.tensor_parallel_size={tp} must equal the "
                              f"{gpus} rollout GPUs (set rollout.num_engines={max(gpus // tp, 1)})")
    elif rollout_nodes > 1:
        engines = asked or rollout_nodes
        if engines % rollout_nodes:
            raise ConfigError(f"rollout.num_engines={engines} does not split evenly over placement.rollout_nodes="
                              f"{rollout_nodes} (on CPU each rollout node holds the same number of engines)")
    return Layout(gpus_per_node=gpn, nnodes=pl.nnodes, colocated=False, actor_gpus=actor, tp=a.tp, pp=a.pp, ep=a.ep,
                  dp=dp, rollout_gpus=gpus, engines=engines, engine_tp=tp, actor_nodes=actor_nodes,
                  rollout_nodes=rollout_nodes, ranks_per_node=actor // actor_nodes,
                  engines_per_node=engines // rollout_nodes)


@dataclass(frozen=True)
class Pools:
    actor: list[dict[str, float]]  # one bundle per actor rank
    rollout: list[dict[str, float]]  # one bundle per engine (all its TP GPUs)
    engine_gpus: int  # GPUs per engine (0 on CPU)
    actor_nodes: int = 1  # nodes the actor bundles split over evenly (several: a placement group per node)
    rollout_nodes: int = 1
    one_node: bool = True  # both pools on one node (placement.nnodes=1)

    def per_node(self, bundles: list[dict[str, float]], nodes: int) -> list[list[dict[str, float]]]:
        n = len(bundles) // nodes
        return [bundles[k * n:(k + 1) * n] for k in range(nodes)]


def pools(lay: Layout) -> Pools:
    """The two pools' bundles (the layout has checked that the rollout GPUs split into
    rollout.num_engines engines of rollout.tensor_parallel_size GPUs)."""
    nodes = dict(actor_nodes=lay.actor_nodes, rollout_nodes=lay.rollout_nodes, one_node=lay.nnodes == 1)
    if not lay.on_gpu:
        return Pools([{"CPU": 1.0}] * lay.actor_gpus, [{"CPU": 1.0}] * lay.engines, 0, **nodes)
    return Pools([{"GPU": 1.0, "CPU": 1.0}] * lay.actor_gpus, [{"GPU": float(lay.engine_tp), "CPU": 1.0}] * lay.engines,
                 lay.engine_tp, **nodes)


PLACEMENT = Placement(
    mode="disaggregated", launchers={"ray": "colocate_rl.placement.ray_disaggregated:launch"},
    handoff="disaggregated", layout=layout, check=check, auto_launcher=lambda pl, lay: "ray",
)
