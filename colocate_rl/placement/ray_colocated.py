"""Colocated on Ray: one placement-group bundle per GPU, shared by an actor rank and an engine worker.

On every node (placement.nnodes of them) a placement group of its own holds one bundle per GPU
(placement/nodes.py: STRICT_PACK, each group on a distinct node), and each bundle an actor rank
holding half of it. Each node's GPUs are split into engines of rollout.tensor_parallel_size GPUs
(placement/colocated.py: one engine per TP group, ``nnodes * gpus_per_node // tp`` in all); engine e is a
Ray actor on the bundle of its first GPU whose workers span its GPUs (vLLM's own executor starts
them). Ray is told not to set visible devices: the actor ranks of a node see the node's GPUs of the
run (the ones Ray assigned to its bundles) and pick theirs by LOCAL_RANK, their index on the node;
engine e sees its own GPUs. The actor rank and the engine worker on one GPU see the same device,
and the same UUID, which keys the weight-sync messages. The actor's torch.distributed rendezvous is
on rank 0's node (MASTER_ADDR is that node's address, not the driver's; 127.0.0.1 on one node, so
that its store and gloo's sockets listen on loopback only). On CPU each node's group
holds the node's actor ranks and its one engine.

Weight sync, node by node: every rank packs the same bucket sequence for its own GPU (full HF
tensors, gathered over TP/EP/PP), the driver merges the messages ({uuid: payload}) of each node's
ranks and hands each node's merged message to that node's engines only, whose workers each take
their own entry: IPC handles never leave their node. A step's prompts are spread over the engines
of every node by the router (rollout/router.py), each prompt's group on one engine.
"""


from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from colocate_rl import platform
from colocate_rl.config import PlacementConfig
from colocate_rl.placement.colocated import engine_quantization, immediate_buffer
from colocate_rl.placement.nodes import ProcessLost, master_addr, network_env, node_groups
from colocate_rl.placement.ray_tools import (ActorGroup, EngineGroup, EngineHost, Host, engine_call, rank_names,
                                             start_ray)
from colocate_rl.rollout.agent import Turns
from colocate_rl.rollout.base import EngineDied
from colocate_rl.rollout.buffer import ImmediateBuffer
from colocate_rl.weight_sync.ipc import SyncStats, merge_messages
from colocate_rl.workers import Actor, Build, OnRollout


@ray.remote
class ActorRank(Host):
    """Started in two calls: placed first (``where`` says on which node and GPU), then built with the
    environment that follows from every rank's place (``start``)."""

    def __init__(self, authkey: bytes):
        super().__init__({}, authkey)

    def start(self, make_actor: Callable[[], Actor], env: dict[str, str], offload: Sequence[str]) -> None:
        os.environ.update(env)  # before torch.distributed, NCCL or CUDA start
        self.obj = make_actor()
        self.obj.offload(offload)  # before the engines start (launch)

    def device_uuid(self) -> str:
        from colocate_rl.weight_sync.ipc import device_uuid

        return device_uuid(platform.device())

    def describe(self) -> dict[str, Any]:
        import torch.distributed as dist

        out = super().describe()
        out.update(device=str(platform.device()), uuid=self.device_uuid(),
                   dist_rank=dist.get_rank() if dist.is_initialized() else None,
                   dist_world=dist.get_world_size() if dist.is_initialized() else None)
        return out

    def device_used(self) -> Optional[int]:
        return platform.device_used()

    def begin_sync(self, bucket_mb: float, send: bool, quantized: dict[str, str]) -> None:
        """``send``: this rank serves the engine worker on its device. Every rank walks the export
        (its gathers over TP/EP/PP are collective), only the senders make messages; they quantize,
        on their device, the weights the engines hold quantized."""
        from colocate_rl.weight_sync.ipc import IpcSender
        from colocate_rl.weight_sync.quantize import quantize_named

        self.sender = IpcSender(platform.device()) if send else None
        weights = self.obj.export_hf_weights()
        self.buckets = (self.sender.buckets(quantize_named(weights, quantized), bucket_mb) if send
                        else ((n, t.numel()) for n, t in weights))

    def next_message(self):
        """(message or None for a non-sender, bytes) of the next bucket; None when done."""
        item = next(self.buckets, None)
        if item is None:
            return None
        return (self.sender.make_message(item), item.nbytes) if self.sender else (None, 0)

    def end_sync(self) -> int:
        self.buckets = None
        return self.sender.release() if self.sender else 0


@dataclass
class RayColocated:
    actor: ActorGroup
    rollout: EngineGroup
    pgs: list  # one placement group per node
    node_senders: list[list[int]]  # per node: its ranks that pack a device's entry (the first rank on each device)
    engine_node: list[int]  # per engine: the node whose merged message it takes
    start_engine: Callable[[int], Any]  # i -> a new EngineHost for engine i
    quantized: dict[str, str]  # weight -> the quantized layout the engines hold it in

    def sync(self, bucket_mb: float = 256) -> SyncStats:
        """Bucket by bucket: every rank packs its GPU's entry; each node's entries are merged into
        one message for that node's engines (no handle crosses a node)."""
        t0, nbytes, n = time.perf_counter(), 0, 0
        ranks, senders = self.actor.ranks, [i for node in self.node_senders for i in node]
        self.actor.get([r.begin_sync.remote(bucket_mb, i in senders, self.quantized) for i, r in enumerate(ranks)],
                       "sync")
        self.rollout.all("begin_weight_sync")
        done = False
        try:
            while True:
                parts = self.actor.get([r.next_message.remote() for r in ranks], "sync")
                if parts[senders[0]] is None:
                    break
                merged = node_messages(parts, self.node_senders)
                self.rollout.each("load_message", [(merged[k],) for k in self.engine_node])
                nbytes, n = nbytes + parts[senders[0]][1], n + 1
            done = True
        except BaseException:
            try:
                self.rollout.all("abort_weight_sync")
            except Exception:  # noqa: BLE001 - a dead engine cannot abort; the original error says why
                pass
            raise
        finally:
            try:
                self.actor.get([r.end_sync.remote() for r in ranks], "sync")
            except ProcessLost:
                if done:
                    raise
                # else the error that ended the sync is the one to report
        self.rollout.all("end_weight_sync")
        return SyncStats(bytes=nbytes, seconds=time.perf_counter() - t0, buckets=n)

    def verify(self) -> int:
        """Every rank's checksums equal every engine's; returns how many tensors were compared."""
        from colocate_rl.weight_sync.verify import compare

        per_rank = self.actor.all("weight_checksums")
        for e, engine in enumerate(self.rollout.all("checksum", list(per_rank[0]))):
            for i, sums in enumerate(per_rank):
                compare(sums, engine, who=f"actor rank {i} (engine {e})")
        return len(per_rank[0])

    def restart_rollout(self) -> None:
        """Replaces every engine that no longer answers (its Ray actor or its vLLM process died)."""
        for i, host in enumerate(self.rollout.hosts):
            try:
                engine_call(host.call.remote("ping"))
                continue
            except EngineDied:
                pass
            ray.kill(host, no_restart=True)
            self.rollout.hosts[i] = self.start_engine(i)
        ray.get([h.pid.remote() for h in self.rollout.hosts])  # started

    def drain(self) -> None:
        pass

    def make_buffer(self, on_rollout: OnRollout, turns: Turns) -> ImmediateBuffer:
        return immediate_buffer(self, on_rollout, turns)

    def device_used(self) -> Optional[int]:
        return ray.get(self.actor.ranks[0].device_used.remote())

    def processes(self) -> dict[str, list[dict[str, Any]]]:
        """Where every rank and engine runs and what it uses, as each process reports itself."""
        return {"ranks": ray.get([r.describe.remote() for r in self.actor.ranks]),
                "engines": ray.get([h.describe.remote() for h in self.rollout.hosts])}

    def shutdown(self) -> None:
        self.rollout.shutdown()  # before ray.shutdown(), else vLLM leaves a /dev/shm segment behind
        for r in self.actor.ranks:
            ray.kill(r)
        for pg in self.pgs:
            remove_placement_group(pg)


def node_messages(parts: list, node_senders: list[list[int]]) -> list[dict]:
    """parts[i] = rank i's (message or None, bytes) of one bucket → one merged message per node,
    of that node's senders' entries only."""
    return [merge_messages(parts[i][0] for i in senders) for senders in node_senders]


def senders_by_node(uuids: list[str], node_of: list[int], nnodes: int) -> list[list[int]]:
    """Per node, the first rank on each of its devices (on CPU all ranks of a node share one
    "device", so one rank per node sends)."""
    out: list[list[int]] = [[] for _ in range(nnodes)]
    seen: set[tuple[int, str]] = set()
    for i, (u, k) in enumerate(zip(uuids, node_of)):
        if (k, u) not in seen:
            seen.add((k, u))
            out[k].append(i)
    return out


def bundles_and_share(world: int, gpu: bool) -> tuple[list[dict], dict]:
    """One bundle per rank (on GPU: one GPU and one CPU); an engine's first GPU's bundle also hosts
    the engine, so each process asks for half of every resource in it. Both halves matter: a Ray
    actor that names only num_gpus still takes one CPU, the bundle's only one, and the engine would
    wait for it forever."""
    bundles = [{"GPU": 1, "CPU": 1} if gpu else {"CPU": 1} for _ in range(world)]
    return bundles, ({"num_gpus": 0.5, "num_cpus": 0.5} if gpu else {"num_cpus": 0.5})


def launch(pl: PlacementConfig, build: Build) -> RayColocated:
    lay = build.resolved.layout
    start_ray(pl)
    gpu, rpn, epn, tp = lay.on_gpu, lay.ranks_per_node, lay.engines_per_node, lay.engine_tp
    bundles, share = bundles_and_share(rpn, gpu)
    groups = node_groups([bundles] * lay.nnodes, "colocated")
    authkey = secrets.token_bytes(32)

    def bundle(k: int, i: int) -> dict[str, Any]:
        return dict(scheduling_strategy=PlacementGroupSchedulingStrategy(groups[k].pg, placement_group_bundle_index=i),
                    **share)

    # Placed first, built second: a rank's environment depends on where rank 0 and its node's GPUs are.
    ranks = [ActorRank.options(**bundle(k, i)).remote(authkey) for k in range(lay.nnodes) for i in range(rpn)]
    places = ray.get([r.where.remote() for r in ranks])
    names = rank_names(places)
    # Rank 0 holds its store's port from here until its Actor builds the process group (colocate_rl.ports).
    addr = master_addr(places)
    master = {"MASTER_ADDR": addr, "MASTER_PORT": str(ray.get(ranks[0].reserve_port.remote(addr)))}
    # Each node's GPUs of the run, in bundle order: rank k*rpn+i uses the node's i-th (LOCAL_RANK i).
    node_gpus = [[places[k * rpn + i]["gpu_ids"][0] for i in range(rpn)] if gpu else [] for k in range(lay.nnodes)]
    net = network_env()
    started = []
    for rank, r in enumerate(ranks):
        k, i = divmod(rank, rpn)
        env = {**(platform.visible_devices_env(node_gpus[k]) if gpu else {}), **net, **master, "RANK": str(rank),
               "WORLD_SIZE": str(len(ranks)), "LOCAL_RANK": str(i), "OMP_NUM_THREADS": "1"}
        started.append(r.start.remote(build.make_actor, env, build.resolved.offload))
    group = ActorGroup(ranks, names)
    # The engines start once every rank holds only what the plan keeps beside them: an engine
    # checks the free memory against its share of the card and sizes its KV cache at start.
    group.get(started, "start")

    def start_engine(e: int):
        k, j = divmod(e, epn)  # engine j of node k: that node's j-th TP group of GPUs
        env = platform.visible_devices_env(node_gpus[k][j * tp:(j + 1) * tp]) if gpu else {}
        env.update(net, OMP_NUM_THREADS="1")
        return EngineHost.options(**bundle(k, j * tp if gpu else 0)).remote(build.make_rollout, env, authkey)

    engines = EngineGroup([start_engine(e) for e in range(lay.engines)], build.sampling)
    uuids = group.get([r.device_uuid.remote() for r in ranks], "start")
    node_senders = senders_by_node(uuids, [rank // rpn for rank in range(len(ranks))], lay.nnodes)
    return RayColocated(group, engines, [g.pg for g in groups], node_senders, [e // epn for e in range(lay.engines)],
                        start_engine, engine_quantization(engines))
