"""Disaggregated on Ray: the actor and the rollout on separate placement groups, weights broadcast.

The pools and their layout are placement/disaggregated.py's. On several nodes each actor node and
each rollout node gets a placement group of its own (placement/nodes.py: STRICT_PACK, each group on
a node no other group of the run holds), so the actor and the rollout never share a node; on one node the two pools are one placement group each
(PACK). Ray is told not to set visible devices (ray_tools.NOSET); each Ray actor sets
CUDA_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES together to the GPUs Ray assigned it
(``ray.get_gpu_ids``), before torch or vLLM start. The actor's torch.distributed rendezvous and the
broadcast group's store are on actor rank 0's node (its address, or 127.0.0.1 when every member of the
group runs there; a port held there until the store serves on it); NCCL/gloo pick
the interface named by NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (placement.nodes.network_env).

Weights travel over one broadcast group (weight_sync.broadcast): actor rank 0, which holds every
full HF tensor after the export's gathers, is rank 0 of the group; engine e's worker w is rank
1 + (workers of engines before e) + w. Every actor rank walks the export (its gathers are
collective), only rank 0 sends. When the engines' checkpoint is quantized, rank 0 quantizes the
weights it holds quantized, each in its layout (weight_sync.quantize.sync_plan), before packing.

An engine that dies is replaced in its bundle and re-synced over a group of its own (actor rank
0 + its workers) while the other engines keep generating; the main group is formed again before
the next sync (a process group cannot swap a member).
"""

from __future__ import annotations

import os
import secrets
import signal
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from colocate_rl import platform
from colocate_rl.config import PlacementConfig, SyncConfig
from colocate_rl.placement.disaggregated import Pools, pools
from colocate_rl.placement.nodes import master_addr, network_env, node_groups, wait_ready
from colocate_rl.placement.ray_tools import (ActorGroup, EngineGroup, EngineHost, Host, pin_assigned_gpus, rank_names,
                                             start_ray, stop_engines)
from colocate_rl.rollout.agent import Turns
from colocate_rl.rollout.base import RemoteEngine
from colocate_rl.rollout.buffer import RolloutBuffer, load_rollout_fn
from colocate_rl.weight_sync.ipc import SyncStats
from colocate_rl.workers import Actor, Build, OnRollout


@ray.remote
class TrainerRank(Host):
    """One Megatron rank of the actor pool. Placed first (``where``), built second (``start``): its
    environment names rank 0's node, known only once every rank is placed."""

    def __init__(self, authkey: bytes):
        pin_assigned_gpus()
        super().__init__({}, authkey)
        self.group = None

    def start(self, make_actor: Callable[[], Actor], env: dict[str, str]) -> None:
        os.environ.update(env)  # before torch.distributed or NCCL start
        self.obj = make_actor()  # its own GPUs: nothing is offloaded between phases

    def describe(self) -> dict[str, Any]:
        import torch.distributed as dist

        out = super().describe()
        out.update(device=str(platform.device()), dist_rank=dist.get_rank() if dist.is_initialized() else None,
                   dist_world=dist.get_world_size() if dist.is_initialized() else None,
                   broadcast=None if self.group is None else (self.group.spec.master_addr, self.group.spec.master_port,
                                                              self.group.spec.name))
        return out

    def join_broadcast(self, spec: dict[str, Any]) -> None:
        """Rank 0 only: forms a new broadcast group as its sender (blocks until every member joined)."""
        from colocate_rl.weight_sync.broadcast import BroadcastGroup, GroupSpec

        self.leave_broadcast()
        self.group = BroadcastGroup(GroupSpec(**spec), 0, platform.device())

    def leave_broadcast(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def broadcast_weights(self, bucket_mb: float, fp8: dict[str, str]) -> SyncStats:
        """Every rank walks the export (collective gathers); rank 0 packs and broadcasts."""
        from colocate_rl.weight_sync.buckets import pack
        from colocate_rl.weight_sync.quantize import quantize_named

        weights = self.obj.export_hf_weights()
        if self.group is None:
            for _ in weights:
                pass
            return SyncStats()
        return self.group.send(pack(quantize_named(weights, fp8), bucket_mb))


@dataclass
class RayDisaggregated:
    actor: ActorGroup
    hosts: list  # EngineHost per engine
    pgs: list  # the placement groups (actor pool's first)
    slots: list  # per engine: (placement group, bundle index) it runs in
    authkey: bytes
    layout: Pools
    make_rollout: Callable[[], RemoteEngine]
    sync_cfg: SyncConfig
    fp8: dict[str, str] = field(default_factory=dict)  # weight -> quantized format the engines hold it in
    rollout: Optional[EngineGroup] = None  # the engines behind the router, which replaces a lost one
    buffer: Optional[RolloutBuffer] = None
    version: int = 0  # weights version the engines hold (syncs so far)
    members: list | None = None  # engines of the current broadcast group
    pids: list = field(default_factory=list)  # each engine's process (its Ray actor)
    restarts: int = 0
    custom_fn: str = ""  # rollout.custom_fn: what produces a step's batch from the router's generate

    # ------------------------------------------------------------ engines

    def _start_engine(self, i: int):
        env = {**network_env(), "OMP_NUM_THREADS": "1"}
        opts: dict[str, Any] = dict(num_gpus=self.layout.engine_gpus) if self.layout.engine_gpus else dict(num_cpus=1)
        pg, index = self.slots[i]
        return EngineHost.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index), **opts,
        ).remote(self.make_rollout, env, self.authkey, pin=True)

    def restart(self, i: int) -> None:
        """Replaces engine i in its bundle and gives it the actor's current weights."""
        ray.kill(self.hosts[i], no_restart=True)
        self.hosts[i] = self._start_engine(i)
        self.pids[i] = ray.get(self.hosts[i].pid.remote())  # started
        self.restarts += 1
        self._broadcast([i])

    # ------------------------------------------------------------ weights

    def _form_group(self, engines: list[int]) -> None:
        """A new broadcast group: actor rank 0 + every worker of ``engines``."""
        workers = ray.get([self.hosts[e].num_workers.remote() for e in engines])
        rank0 = self.actor.ranks[0]
        places = ray.get([rank0.where.remote()] + [self.hosts[e].where.remote() for e in engines])
        from colocate_rl.weight_sync.broadcast import backend_for

        # The group's store is served by actor rank 0, on its node (loopback when every member is there), on a
        # port it holds until then; the name is 128 random bits, never guessed by another process of the store.
        members = [self.actor.names[0]] + [f"engine {e} worker {w} on {p['node_ip']}"
                                           for e, n, p in zip(engines, workers, places[1:]) for w in range(n)]
        addr = master_addr(places)
        spec = dict(name=f"weights-{secrets.token_hex(16)}", master_addr=addr,
                    master_port=ray.get(rank0.reserve_port.remote(addr)), world_size=1 + sum(workers),
                    backend=backend_for("cuda" if self.layout.engine_gpus else "cpu"),
                    timeout_s=self.sync_cfg.timeout_s, members=tuple(members))
        with self.actor.lock:
            refs = [rank0.join_broadcast.remote(spec)]
        first = 1
        for e, n in zip(engines, workers):
            refs.append(self.hosts[e].call.remote("init_weight_broadcast", spec, first))
            first += n
        ray.get(refs)
        self.members = list(engines)

    def _broadcast(self, engines: list[int], bucket_mb: float | None = None) -> SyncStats:
        if self.members != engines:
            self._form_group(engines)
        bucket_mb = bucket_mb or self.sync_cfg.bucket_mb
        with self.actor.lock:
            sends = [r.broadcast_weights.remote(bucket_mb, self.fp8) for r in self.actor.ranks]
        recvs = [self.hosts[e].call.remote("receive_weights_broadcast") for e in engines]
        stats = self.actor.get(sends, "the weight broadcast")[0]
        ray.get(recvs)
        return stats

    def _revive_dead(self) -> None:
        """Engines that died while idle (between generations) are replaced before a broadcast
        that would otherwise wait for them until it times out."""
        for i, h in enumerate(self.hosts):
            try:
                ray.get(h.pid.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                self.restart(i)
                self.rollout.router.note_restart()

    def sync(self, bucket_mb: float | None = None) -> SyncStats:
        """The actor's weights → every engine (one broadcast); the weights version goes up by one."""
        self._revive_dead()
        stats = self._broadcast(list(range(len(self.hosts))), bucket_mb)
        self.version += 1
        return stats

    def verify(self) -> int:
        """Every engine's checksums equal actor rank 0's; returns how many tensors were compared."""
        from colocate_rl.weight_sync.verify import compare

        sums = self.actor.weight_checksums()
        for e, host in enumerate(self.hosts):
            compare(sums, ray.get(host.call.remote("checksum", list(sums))), who=f"actor (engine {e})")
        return len(sums)

    def restart_rollout(self) -> None:
        """Engines that died while idle are replaced (the router replaces those lost mid-generation)."""
        self._revive_dead()

    def drain(self) -> None:
        if self.buffer is not None:
            self.buffer.drain()

    def make_buffer(self, on_rollout: OnRollout, turns: Turns) -> RolloutBuffer:
        """Generation through the router, which replaces a dead engine itself (``on_rollout`` is not
        needed); a multi-turn rollout sends each turn's conversations through it."""
        custom = self.custom_fn
        self.buffer = RolloutBuffer(turns.over(self.rollout.generate), load_rollout_fn(custom) if custom else None,
                                    metrics=self.rollout.router.take_counts,
                                    generate_partial=self.rollout.generate_partial)
        return self.buffer

    def device_used(self) -> Optional[int]:
        return None  # each pool's GPUs are its own: the plan's per-pool figures are not measured here

    def processes(self) -> dict[str, list[dict[str, Any]]]:
        """Where every rank and engine runs and what it uses, as each process reports itself."""
        return {"ranks": ray.get([r.describe.remote() for r in self.actor.ranks]),
                "engines": ray.get([h.describe.remote() for h in self.hosts])}

    def engine_checksums(self, names: list[str]) -> list[dict[str, float]]:
        return ray.get([h.call.remote("checksum", list(names)) for h in self.hosts])

    def kill_engine(self, i: int) -> None:
        """SIGKILLs engine i's process and waits until it is gone (fault drills): the router finds out
        from its next call."""
        import psutil

        try:
            victim = psutil.Process(self.pids[i])
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=60)
        except psutil.NoSuchProcess:
            pass

    # ------------------------------------------------------------ lifetime

    def shutdown(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
        stop_engines(self.hosts)
        for r in self.actor.ranks:
            ray.kill(r)
        for pg in self.pgs:
            remove_placement_group(pg)


def _place(p: Pools) -> tuple[list, list, list]:
    """(placement groups, (group, bundle) per actor rank, (group, bundle) per engine). Several nodes:
    a group per actor node, then one per rollout node, every group on a node of its own."""
    if p.one_node:
        pg_actor = placement_group(p.actor, strategy="PACK", name="colocate_rl-actor")
        pg_rollout = placement_group(p.rollout, strategy="PACK", name="colocate_rl-rollout")
        wait_ready(pg_actor, "the actor pool", p.actor)
        wait_ready(pg_rollout, "the rollout pool", p.rollout)
        return ([pg_actor, pg_rollout], [(pg_actor, i) for i in range(len(p.actor))],
                [(pg_rollout, i) for i in range(len(p.rollout))])
    actor = node_groups(p.per_node(p.actor, p.actor_nodes), "actor")
    rollout = node_groups(p.per_node(p.rollout, p.rollout_nodes), "rollout", avoid=[g.node_id for g in actor])
    slots = [[(g.pg, i) for g in groups for i in range(n)]
             for groups, n in ((actor, len(p.actor) // p.actor_nodes), (rollout, len(p.rollout) // p.rollout_nodes))]
    return [g.pg for g in actor + rollout], slots[0], slots[1]


def launch(pl: PlacementConfig, build: Build) -> RayDisaggregated:
    """The actor owns its GPUs: nothing is offloaded (build.resolved.offload is the colocated layouts')."""
    p = pools(build.resolved.layout)
    start_ray(pl, num_cpus=int(sum(b.get("CPU", 0) for b in p.actor + p.rollout)) + 1)
    pgs, rank_slots, engine_slots = _place(p)
    authkey = secrets.token_bytes(32)
    world = len(p.actor)
    opts: dict[str, Any] = dict(num_gpus=1) if p.engine_gpus else dict(num_cpus=1)
    ranks = [TrainerRank.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i), **opts,
    ).remote(authkey) for pg, i in rank_slots]
    w = RayDisaggregated(ActorGroup(ranks), [], pgs, engine_slots, authkey, p, build.make_rollout, build.sync)
    w.hosts = [w._start_engine(i) for i in range(len(p.rollout))]  # they start while the ranks build
    places = ray.get([r.where.remote() for r in ranks])
    w.actor.names = rank_names(places)
    # torch.distributed's rendezvous on rank 0's node: its address and a port it holds until its store serves.
    addr = master_addr(places)
    master = {"MASTER_ADDR": addr, "MASTER_PORT": str(ray.get(ranks[0].reserve_port.remote(addr)))}
    net = network_env()
    w.actor.get([r.start.remote(build.make_actor, {**net, **master, "RANK": str(rank), "WORLD_SIZE": str(world),
                                                   "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"})
                 for rank, r in enumerate(ranks)], "start")
    w.pids = ray.get([h.pid.remote() for h in w.hosts])
    shapes = ray.get(w.hosts[0].call.remote("weight_shapes"))
    from colocate_rl.weight_sync.quantize import sync_plan

    w.fp8 = sync_plan(shapes)
    w.rollout = EngineGroup(w.hosts, build.sampling, restart=w.restart)
    w.custom_fn = build.scheduling.custom_fn
    return w
