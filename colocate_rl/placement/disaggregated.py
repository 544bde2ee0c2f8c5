"""Disaggregated on Ray: the actor and the rollout on separate placement groups, weights broadcast.

Two pools, sized from ``placement`` (``pools``): the actor pool has one bundle per actor GPU (one
Megatron rank each); the rollout pool one bundle per engine holding all of its TP GPUs, so one
Ray actor owns the engine and vLLM starts its TP workers on the bundle's GPUs. DeepSeek-V4's
published layout — 2 actor nodes (TP4 × PP4 × EP4) + 1 rollout node (TP8, FP8) of 8 GPUs — is
``nnodes=3 gpus_per_node=8 actor_nodes=2 rollout_nodes=1 rollout.tensor_parallel_size=8``: 16
actor bundles and one rollout bundle of 8 GPUs. On CPU (``gpus_per_node=0``) bundles are CPUs.

Ray is told not to set visible devices (ray_colocated.NOSET); each Ray actor sets
CUDA_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES together to the GPUs Ray assigned it
(``ray.get_gpu_ids``), before torch or vLLM start.

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
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from colocate_rl import platform
from colocate_rl.config import Config, layout
from colocate_rl.handoff import DisaggregatedHandoff
from colocate_rl.placement.ray_colocated import ActorGroup, _free_port, _Host, start_ray
from colocate_rl.rollout.buffer import RolloutBuffer, load_rollout_fn
from colocate_rl.rollout.router import Router
from colocate_rl.weight_sync.ipc import SyncStats

PG_READY_S = 120.0  # a placement group not ready by then will not fit the cluster


@dataclass(frozen=True)
class Pools:
    actor: list[dict[str, float]]  # one bundle per actor rank
    rollout: list[dict[str, float]]  # one bundle per engine (all its TP GPUs)
    engine_gpus: int  # GPUs per engine (0 on CPU)


def pools(cfg: Config) -> Pools:
    """The two pools' bundles (config.layout has checked that the rollout GPUs split into
    rollout.num_engines engines of rollout.tensor_parallel_size GPUs)."""
    lay = layout(cfg)
    if not lay.on_gpu:
        return Pools([{"CPU": 1.0}] * lay.actor_gpus, [{"CPU": 1.0}] * lay.engines, 0)
    return Pools([{"GPU": 1.0, "CPU": 1.0}] * lay.actor_gpus, [{"GPU": float(lay.engine_tp), "CPU": 1.0}] * lay.engines,
                 lay.engine_tp)


def _pin_assigned_gpus() -> dict[str, str]:
    """CUDA_/HIP_VISIBLE_DEVICES = the GPUs Ray assigned this actor (Ray leaves them unset: NOSET)."""
    ids = [int(i) for i in ray.get_gpu_ids()]
    env = platform.visible_devices_env(ids) if ids else {}
    os.environ.update(env)
    return env


@ray.remote
class TrainerRank(_Host):
    """One Megatron rank of the actor pool."""

    def __init__(self, cfg: Config, env: dict[str, str], authkey: bytes):
        _pin_assigned_gpus()
        super().__init__(env, authkey)
        from colocate_rl.trainer import Actor

        self.obj = Actor(cfg)  # its own GPUs: nothing is offloaded between phases
        self.group = None

    def free_port(self) -> int:
        return _free_port()

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



@ray.remote
class EngineHost(_Host):
    """One vLLM engine (all its TP workers) of the rollout pool."""

    def __init__(self, cfg: Config, env: dict[str, str], authkey: bytes):
        _pin_assigned_gpus()
        super().__init__(env, authkey)
        from colocate_rl.rollout.base import make_rollout

        self.obj = make_rollout(cfg)

    def num_workers(self) -> int:
        return self.obj.num_workers

    def pid(self) -> int:
        return os.getpid()


def is_lost(exc: BaseException) -> bool:
    """The engine is gone: its Ray actor died, or vLLM's engine core died under it (EngineDeadError,
    re-raised through the Ray actor)."""
    text = f"{type(exc).__name__} {exc}"
    return isinstance(exc, ray.exceptions.RayActorError) or "EngineDeadError" in text or "EngineDied" in text


@dataclass
class RayDisaggregated:
    cfg: Config
    actor: ActorGroup
    hosts: list  # EngineHost per engine
    pgs: tuple  # (actor pool, rollout pool)
    authkey: bytes
    layout: Pools
    fp8: dict[str, str] = field(default_factory=dict)  # weight -> quantized format the engines hold it in
    rollout: Router | None = None
    buffer: RolloutBuffer | None = None
    version: int = 0  # weights version the engines hold (syncs so far)
    members: list | None = None  # engines of the current broadcast group
    pids: list = field(default_factory=list)  # each engine's process (its Ray actor)
    restarts: int = 0
    handoff_class = DisaggregatedHandoff

    # ------------------------------------------------------------ engines

    def _start_engine(self, i: int):
        env = {"OMP_NUM_THREADS": "1"}
        opts: dict[str, Any] = dict(num_gpus=self.layout.engine_gpus) if self.layout.engine_gpus else dict(num_cpus=1)
        return EngineHost.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pgs[1], placement_group_bundle_index=i),
            **opts,
        ).remote(self.cfg, env, self.authkey)

    def _submit(self, i: int, samples, kwargs):
        return self.hosts[i].call.remote("generate", samples, **kwargs).future()

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
        from colocate_rl.weight_sync.broadcast import backend_for

        spec = dict(name=f"weights-{secrets.token_hex(3)}", master_addr=ray.get(rank0.node_ip.remote()),
                    master_port=ray.get(rank0.free_port.remote()), world_size=1 + sum(workers),
                    backend=backend_for("cuda" if self.layout.engine_gpus else "cpu"),
                    timeout_s=self.cfg.rollout.sync_timeout_s)
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
        bucket_mb = bucket_mb or self.cfg.rollout.sync_bucket_mb
        with self.actor.lock:
            sends = [r.broadcast_weights.remote(bucket_mb, self.fp8) for r in self.actor.ranks]
        recvs = [self.hosts[e].call.remote("receive_weights_broadcast") for e in engines]
        stats = ray.get(sends)[0]
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
                self.rollout.note_restart()

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
        self.buffer.drain()

    def make_buffer(self, handoff: Any) -> RolloutBuffer:
        return self.buffer

    def device_used(self) -> Optional[int]:
        return None  # each pool's GPUs are its own: the plan's per-pool figures are not measured here

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
        for h in self.hosts:
            try:
                ray.get(h.call.remote("shutdown"), timeout=60)  # before ray.shutdown(): vLLM's /dev/shm segment
            except (ray.exceptions.RayError, TimeoutError):
                pass
            ray.kill(h)
        for r in self.actor.ranks:
            ray.kill(r)
        for pg in self.pgs:
            remove_placement_group(pg)


def _ready(pg, what: str, bundles: list[dict[str, float]]) -> None:
    try:
        ray.get(pg.ready(), timeout=PG_READY_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"placement: the {what} pool ({len(bundles)} bundles of {bundles[0]}) did not fit the "
                           f"Ray cluster in {PG_READY_S:g} s; available: {ray.available_resources()}") from None


def launch(cfg: Config) -> RayDisaggregated:
    p = pools(cfg)
    start_ray(cfg, num_cpus=int(sum(b.get("CPU", 0) for b in p.actor + p.rollout)) + 1)
    pg_actor = placement_group(p.actor, strategy="PACK", name="colocate_rl-actor")
    pg_rollout = placement_group(p.rollout, strategy="PACK", name="colocate_rl-rollout")
    _ready(pg_actor, "actor", p.actor)
    _ready(pg_rollout, "rollout", p.rollout)
    authkey = secrets.token_bytes(32)
    world = len(p.actor)
    master_port, node_ip = _free_port(), ray.util.get_node_ip_address()
    opts: dict[str, Any] = dict(num_gpus=1) if p.engine_gpus else dict(num_cpus=1)
    ranks = []
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": node_ip,
               "MASTER_PORT": str(master_port), "OMP_NUM_THREADS": "1"}
        ranks.append(TrainerRank.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg_actor, placement_group_bundle_index=rank), **opts,
        ).remote(cfg, env, authkey))
    w = RayDisaggregated(cfg, ActorGroup(ranks), [], (pg_actor, pg_rollout), authkey, p)
    w.hosts = [w._start_engine(i) for i in range(len(p.rollout))]
    w.pids = ray.get([h.pid.remote() for h in w.hosts])
    shapes = ray.get(w.hosts[0].call.remote("weight_shapes"))
    ray.get([r.node_ip.remote() for r in ranks])  # every rank built
    from colocate_rl.weight_sync.quantize import sync_plan

    w.fp8 = sync_plan(shapes)
    r = cfg.rollout
    w.rollout = Router(w._submit, len(w.hosts), w.restart, is_lost, r.max_response_tokens, r.n)
    w.buffer = RolloutBuffer(w.rollout.generate, load_rollout_fn(r.custom_fn) if r.custom_fn else None,
                             metrics=w.rollout.take_counts)
    return w
