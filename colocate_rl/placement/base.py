"""The placements by mode, and the layout maths they share.

A placement starts the actor ranks and the engines somewhere (this process, Ray actors sharing
GPUs, Ray placement groups of their own) and hands back a ``workers.Workers``: the same handles
whatever the layout, so the loop and the handoff never ask where things run. Each placement is a
module holding a ``PLACEMENT = Placement(...)`` record (its mode, its launchers, its layout maths,
its rules and the handoff it needs) plus one line in ``PLACEMENTS``; the plan reads the mode and
launcher choices from here, so a new placement edits no other shared file.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from colocate_rl import platform
from colocate_rl.config import MAX_PROCESSES, ActorConfig, ConfigError, PlacementConfig, RolloutConfig
from colocate_rl.resolved import Layout
from colocate_rl.workers import Build, Workers


@dataclass(frozen=True)
class Placement:
    mode: str  # placement.mode
    launchers: dict[str, str]  # placement.launcher -> "module:function" of (PlacementConfig, Build) -> Workers
    handoff: str  # the handoff its layout needs (handoff.HANDOFFS): colocated | disaggregated
    # (placement, actor, rollout sections, GPUs per node) -> Layout, or ConfigError naming the field
    layout: Callable[[PlacementConfig, ActorConfig, RolloutConfig, int], Layout]
    # (placement, rollout sections, GPUs per node): the mode's own rules, checked before its layout
    check: Callable[[PlacementConfig, RolloutConfig, int], None]
    # (placement section, layout) -> the launcher placement.launcher=auto stands for
    auto_launcher: Callable[[PlacementConfig, Layout], str]
    # (placement section, layout, launcher): a launcher's own limits, checked once it is chosen
    check_launcher: Callable[[PlacementConfig, Layout, str], None] = lambda pl, lay, launcher: None


# placement.mode -> "module:PLACEMENT"; each module is imported when asked (no Ray until a launch).
PLACEMENTS: dict[str, str] = {
    "colocated": "colocate_rl.placement.colocated:PLACEMENT",
    "disaggregated": "colocate_rl.placement.disaggregated:PLACEMENT",
}


def placement(mode: str) -> Placement:
    module, _, name = PLACEMENTS[mode].partition(":")
    return getattr(importlib.import_module(module), name)


def launchers() -> list[str]:
    """placement.launcher's choices: auto and every launcher of every placement."""
    return ["auto", *dict.fromkeys(k for mode in PLACEMENTS for k in placement(mode).launchers)]


def gpus_per_node(pl: PlacementConfig) -> int:
    """placement.gpus_per_node with -1 (this machine's GPUs) resolved."""
    return platform.machine_gpus() if pl.gpus_per_node < 0 else pl.gpus_per_node


def layout(pl: PlacementConfig, actor: ActorConfig, rollout: RolloutConfig) -> Layout:
    """The layout of placement.mode: its rules, then its maths (ConfigError naming the field)."""
    p, gpn = placement(pl.mode), gpus_per_node(pl)
    p.check(pl, rollout, gpn)
    return p.layout(pl, actor, rollout, gpn)


def launcher(pl: PlacementConfig, lay: Layout) -> str:
    """placement.launcher with auto resolved; ConfigError when the mode has no such launcher or the
    launcher cannot run this layout."""
    p = placement(pl.mode)
    chosen = p.auto_launcher(pl, lay) if pl.launcher == "auto" else pl.launcher
    if chosen not in p.launchers:
        raise ConfigError(f"placement.launcher={pl.launcher} does not run placement.mode={pl.mode}: set "
                          f"placement.launcher to auto or {' or '.join(p.launchers)}")
    p.check_launcher(pl, lay, chosen)
    return chosen


def launch(pl: PlacementConfig, build: Build) -> Workers:
    """The run's workers, started by the resolved launcher of placement.mode. A colocated placement
    builds the actor, moves off the parts the plan offloads (``build.resolved.offload``), then starts
    the engines, so only what must move ever moves."""
    module, _, fn = placement(pl.mode).launchers[build.resolved.launcher].partition(":")
    return getattr(importlib.import_module(module), fn)(pl, build)


def check_shared_folder(pl: PlacementConfig, launcher: str, folder: Path) -> None:
    """On a Ray cluster, every node sees ``folder`` (the checkpoint folder: each actor rank writes its
    shards from its own node, and a resumed run reads them wherever it lands). Checked before
    anything starts; a Ray instance this run starts itself is this machine alone, nothing to check.
    Raises placement.nodes.FolderNotShared (a ConfigError) naming the node that cannot see it."""
    if launcher != "ray":
        return
    from colocate_rl.placement import ray_tools

    ray_tools.check_shared_folder(pl, folder)


# ---------------------------------------------------------------- the layout maths placements share


def cpu_actor_ranks(pl: PlacementConfig, a: ActorConfig, actor_nodes: int) -> int:
    """On CPU the actor's ranks are processes: tp x pp x dp (dp = 0: one tp x pp group per actor
    node), the same number on each actor node, at most MAX_PROCESSES per node."""
    actor = a.tp * a.pp * (a.dp or actor_nodes)
    if actor % actor_nodes:
        raise ConfigError(f"actor.tp={a.tp} x actor.pp={a.pp} x actor.dp={a.dp} = {actor} actor ranks do not split "
                          f"evenly over the {actor_nodes} actor node(s) (placement.nnodes={pl.nnodes}; on CPU "
                          "each node holds the same number of ranks)")
    if actor // actor_nodes > MAX_PROCESSES:
        raise ConfigError(f"actor.tp={a.tp} x actor.pp={a.pp} x actor.dp={a.dp} = {actor} actor ranks, "
                          f"{actor // actor_nodes} processes per node on the CPU: at most {MAX_PROCESSES}")
    return actor


def data_parallel(pl: PlacementConfig, a: ActorConfig, gpn: int, actor: int) -> int:
    """actor.dp over ``actor`` ranks: tp x pp divides them, a set actor.dp matches, ep divides tp x dp."""
    if actor % (a.tp * a.pp):
        raise ConfigError(f"actor.tp={a.tp} x actor.pp={a.pp} does not divide the {actor} actor GPUs "
                          f"(placement: {pl.mode}, {pl.nnodes} node(s) x {gpn})")
    dp = actor // (a.tp * a.pp)
    if a.dp and a.dp != dp:
        raise ConfigError(f"actor.tp={a.tp} x actor.pp={a.pp} x actor.dp={a.dp} = {a.tp * a.pp * a.dp} "
                          f"does not match the {actor} actor GPUs")
    if (a.tp * dp) % a.ep:
        raise ConfigError(f"actor.ep={a.ep} must divide actor.tp x dp = {a.tp * dp}")
    return dp


def check_engine_tp(tp: int, gpn: int, whole_nodes: bool) -> None:
    """An engine's TP group stays on one node (and, ``whole_nodes``, splits every node's GPUs evenly)."""
    if tp > gpn:
        raise ConfigError(f"rollout.tensor_parallel_size={tp} exceeds placement.gpus_per_node={gpn}: "
                          "an engine's TP group stays on one node")
    if whole_nodes and gpn % tp:
        raise ConfigError(f"rollout.tensor_parallel_size={tp} does not divide the {gpn} GPUs of a node")
