"""placement.mode=colocated: every GPU is shared by an actor rank and an engine worker. Its layout
maths and rules; it runs in this process (``local``: a world of one) or on Ray (``ray_colocated``).

Each node's GPUs are split into engines of rollout.tensor_parallel_size (one per TP group, all
nodes' engines behind the router); on CPU each node runs one engine for its ranks."""

from __future__ import annotations

from colocate_rl.config import ActorConfig, ConfigError, PlacementConfig, RolloutConfig
from colocate_rl.placement.base import Placement, check_engine_tp, cpu_actor_ranks, data_parallel
from colocate_rl.resolved import Layout
from colocate_rl.rollout.agent import Turns
from colocate_rl.rollout.base import Rollout
from colocate_rl.rollout.buffer import ImmediateBuffer
from colocate_rl.weight_sync.quantize import sync_plan
from colocate_rl.workers import OnRollout, Workers


def check(pl: PlacementConfig, rollout: RolloutConfig, gpn: int) -> None:
    if pl.actor_nodes or pl.rollout_nodes or pl.actor_gpus:
        raise ConfigError(
            "placement.mode=colocated shares every GPU between actor and rollout: "
            "unset placement.actor_nodes/rollout_nodes/actor_gpus or set placement.mode=disaggregated"
        )
    if rollout.off_policy or rollout.custom_fn:
        raise ConfigError("rollout.off_policy and rollout.custom_fn need placement.mode=disaggregated")


def layout(pl: PlacementConfig, a: ActorConfig, rollout: RolloutConfig, gpn: int) -> Layout:
    nodes, tp = pl.nnodes, rollout.tensor_parallel_size
    actor = nodes * gpn if gpn else cpu_actor_ranks(pl, a, nodes)
    dp = data_parallel(pl, a, gpn, actor)
    if gpn:
        check_engine_tp(tp, gpn, whole_nodes=True)
        engines = nodes * (gpn // tp)
    else:
        engines = nodes  # one CPU engine per node, serving that node's ranks
    return Layout(gpus_per_node=gpn, nnodes=nodes, colocated=True, actor_gpus=actor, tp=a.tp, pp=a.pp, ep=a.ep,
                  dp=dp, rollout_gpus=actor if gpn else 0, engines=engines, engine_tp=tp, actor_nodes=nodes,
                  rollout_nodes=nodes, ranks_per_node=actor // nodes, engines_per_node=engines // nodes)


def auto_launcher(pl: PlacementConfig, lay: Layout) -> str:
    """local for one process (Ray's start-up would dominate a tiny CPU run), else ray."""
    return "local" if lay.actor_gpus == 1 and lay.nnodes == 1 else "ray"


def check_launcher(pl: PlacementConfig, lay: Layout, launcher: str) -> None:
    if launcher == "local" and (lay.actor_gpus != 1 or lay.nnodes > 1):
        raise ConfigError(f"placement.launcher=local runs one process (a world of one, colocated); this layout "
                          f"needs {lay.actor_gpus} actor ranks: set placement.launcher=auto or ray")


def immediate_buffer(workers: Workers, on_rollout: OnRollout, turns: Turns) -> ImmediateBuffer:
    """The colocated launchers' buffer: it generates when the step asks, through the handoff (which
    replaces a dead engine); ``workers.rollout`` is looked up at each call, as a restart replaces it.
    A multi-turn rollout goes through the handoff turn by turn."""

    def generate(samples, **kw):
        return on_rollout("generate", lambda: workers.rollout.generate(samples, **kw))

    def generate_partial(groups, **kw):  # partial rollouts (rollout/partial.py)
        return on_rollout("generate", lambda: workers.rollout.generate_partial(groups, **kw))

    return ImmediateBuffer(turns.over(generate), generate_partial=generate_partial)


def engine_quantization(rollout: Rollout) -> dict[str, str]:
    """{weight: quantized layout} the engines hold (read from their own tensor names and shapes):
    what each sender quantizes, on its own device, before the IPC hand-over. {} for engines that
    hold everything as it is trained."""
    return sync_plan(rollout.weight_shapes())


PLACEMENT = Placement(
    mode="colocated",
    launchers={"local": "colocate_rl.placement.local:launch", "ray": "colocate_rl.placement.ray_colocated:launch"},
    handoff="colocated", layout=layout, check=check, auto_launcher=auto_launcher, check_launcher=check_launcher,
)
