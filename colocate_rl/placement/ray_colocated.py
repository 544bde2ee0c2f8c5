"""Colocated on Ray: one placement-group bundle per GPU, shared by an actor rank and an engine worker.

On every node (placement.nnodes of them) a placement group of its own holds one bundle per GPU
(placement/nodes.py: STRICT_PACK, each group on a distinct node), and each bundle an actor rank
holding half of it. Each node's GPUs are split into engines of rollout.tensor_parallel_size GPUs
(config.layout: one engine per TP group, ``nnodes * gpus_per_node // tp`` in all); engine e is a
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
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from colocate_rl import platform
from colocate_rl.config import Config, cache_dir, first_line, layout
from colocate_rl.handoff import ColocatedHandoff
from colocate_rl.placement.base import engine_quantization, immediate_buffer
from colocate_rl.placement.nodes import ProcessLost, gather, master_addr, network_env, node_groups, short, where
from colocate_rl.placement.ray_auth import authenticate, local_token_file, use_token_file
from colocate_rl.ports import reserve_port
from colocate_rl.rollout.buffer import ImmediateBuffer
from colocate_rl.weight_sync.ipc import SyncStats, merge_messages

# Ray would otherwise set CUDA_VISIBLE_DEVICES per actor to its fractional GPU, hiding from the
# vLLM engine the other GPUs its TP workers need, and leave HIP_VISIBLE_DEVICES alone.
NOSET = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
         "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "1"}


def start_ray(cfg: Config, num_cpus: int | None = None) -> None:
    """``num_cpus``: CPUs a local instance advertises, at least the machine's (CPU runs place one
    bundle per process and may need more bundles than a small machine has cores)."""
    if ray.is_initialized():
        return
    _raise_nofile_limit()
    os.environ.update(NOSET)
    if cfg.placement.ray_address:
        authenticate(cfg)  # a cluster started by scripts/start_ray.sh admits only its token's holders
    else:
        use_token_file(local_token_file())  # the local instance admits only this run's processes
    tmp = os.environ.get("RAY_TMPDIR", str(cache_dir() / "ray"))
    os.makedirs(tmp, mode=0o700, exist_ok=True)
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True, runtime_env={"env_vars": NOSET})
    if cfg.placement.ray_address:
        ray.init(address=cfg.placement.ray_address, **kwargs)
    else:
        if num_cpus:
            kwargs["num_cpus"] = max(num_cpus, os.cpu_count() or 1)
        ray.init(_temp_dir=tmp, object_store_memory=256 * 2**20, **kwargs)


def _raise_nofile_limit() -> None:
    """Large Ray clusters open many sockets; the default soft limit (1024) is too low."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class _Host:
    """Base of the Ray actors below: process env first, then the object, then calls by name."""

    def __init__(self, env: dict[str, str], authkey: bytes):
        os.environ.update(env)
        from colocate_rl.weight_sync.ipc import set_authkey

        set_authkey(authkey)  # CPU shared-memory handles between unrelated processes need one key

    def call(self, method: str, *args, **kwargs):
        return getattr(self.obj, method)(*args, **kwargs)

    def where(self) -> dict[str, Any]:
        """Node, process and the GPUs Ray assigned, as this process sees them."""
        return where()

    def reserve_port(self, host: str) -> int:
        """A port on ``host`` this process holds until a store it serves takes it: the stores of rank 0's groups."""
        return reserve_port(host)

    def describe(self) -> dict[str, Any]:
        """Where this process runs and what it uses, read from inside it (tests assert placement)."""
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                "HIP_VISIBLE_DEVICES")
        return {**where(), "env": {k: os.environ[k] for k in keys if k in os.environ}, "network": network_env()}


@ray.remote
class ActorRank(_Host):
    """Started in two calls: placed first (``where`` says on which node and GPU), then built with the
    environment that follows from every rank's place (``start``)."""

    def __init__(self, authkey: bytes):
        super().__init__({}, authkey)

    def start(self, cfg: Config, env: dict[str, str], offload: Optional[Sequence[str]] = None) -> None:
        os.environ.update(env)  # before torch.distributed, NCCL or CUDA start
        from colocate_rl.trainer import Actor

        self.obj = Actor(cfg)
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
        import torch

        if not platform.has_gpu():
            return None
        free, total = torch.cuda.mem_get_info()
        return total - free

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


@ray.remote
class RolloutHost(_Host):
    def __init__(self, cfg: Config, env: dict[str, str], authkey: bytes):
        super().__init__(env, authkey)
        from colocate_rl.rollout.base import make_rollout

        self.obj = make_rollout(cfg)

    def pid(self) -> int:
        return os.getpid()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "uuids": list(getattr(self.obj, "device_uuids", []))}


class ActorGroup:
    """The actor ranks as one object with trainer.Actor's methods: each call runs on every rank
    (they are collective) and returns rank 0's result. Calls are submitted to every rank under one
    lock, so calls from two threads (the loop, and a disaggregated engine's re-sync) reach all ranks
    in the same order: their collectives cannot interleave. A rank that dies (its process, or its
    node) ends the call at once with ProcessLost naming the rank and its node: the other ranks may
    be waiting for it in a collective."""

    def __init__(self, ranks: list, names: Optional[list[str]] = None):
        self.ranks = ranks
        self.names = names or [f"actor rank {i} of {len(ranks)}" for i in range(len(ranks))]
        self.lock = threading.Lock()

    def submit(self, method: str, *args, **kwargs) -> list:
        with self.lock:
            return [getattr(r, method).remote(*args, **kwargs) for r in self.ranks]

    def get(self, refs: list, what: str) -> list:
        """Every rank's result of one call (``refs``, one per rank, in rank order)."""
        return gather(refs, self.names, what, self.ranks)

    def all(self, method: str, *args, **kwargs) -> list:
        """trainer.Actor.<method> on every rank; every rank's result."""
        return self.get(self.submit("call", method, *args, **kwargs), method)

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.all(method, *args, **kwargs)[0]


def rank_names(places: list[dict[str, Any]]) -> list[str]:
    """'actor rank i of N on <ip> (Ray node <id>)' per rank, from each rank's own ``where``."""
    return [f"actor rank {i} of {len(places)} on {p['node_ip']} (Ray node {short(p['node_id'])})"
            for i, p in enumerate(places)]


def stop_engines(hosts: list) -> None:
    """Shuts each engine down (before ray.shutdown(): vLLM's /dev/shm segment), then its Ray actor; a
    dead or hung one is killed after 60 s."""
    for h in hosts:
        try:
            ray.get(h.call.remote("shutdown"), timeout=60)
        except (ray.exceptions.RayError, TimeoutError):
            pass
        ray.kill(h)


def _engine_error(e: BaseException) -> BaseException:
    """A failed engine call's error as the caller should see it: EngineDied when the engine's Ray
    actor or its vLLM process is gone, the engine's own exception otherwise."""
    from colocate_rl.rollout.base import EngineDied

    if isinstance(e, ray.exceptions.RayActorError):
        return EngineDied(f"the engine's Ray actor died: {first_line(e)}")
    if isinstance(e, ray.exceptions.RayTaskError):
        if isinstance(e.cause, EngineDied) or "EngineDeadError" in str(e):
            return EngineDied(first_line(e.cause) if str(e.cause).strip() else "vLLM engine died")
        return e.cause if isinstance(e.cause, Exception) else e
    return e


def _engine_call(ref):
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as e:
        raise _engine_error(e) from e


class EngineGroup:
    """The colocated engines as one rollout.base.Rollout: generation spread over them by the router
    (each prompt's group on one engine), every other call made on every engine in parallel and
    engine 0's answer returned. Replacing a dead engine is the handoff's job, not the router's."""

    def __init__(self, hosts: list, max_response_tokens: int, n: int):
        from colocate_rl.rollout.router import Router

        self.hosts = hosts
        self.router = Router(self._submit, len(hosts), restart=self._no_restart, is_lost=lambda e: False,
                             max_response_tokens=max_response_tokens, default_n=n, max_restarts=0)

    def _submit(self, i: int, samples, kwargs):
        return self.hosts[i].call.remote("generate", samples, **kwargs).future()

    def _no_restart(self, i: int) -> None:
        raise AssertionError(f"engine {i}: is_lost is always False here")

    def all(self, method: str, *args) -> list:
        return [_engine_call(r) for r in [h.call.remote(method, *args) for h in self.hosts]]

    def each(self, method: str, args: list[tuple]) -> list:
        """Engine i's ``method(*args[i])``, every engine at once."""
        return [_engine_call(r) for r in [h.call.remote(method, *a) for h, a in zip(self.hosts, args)]]

    def generate(self, samples, **kwargs):
        if len(self.hosts) == 1:
            return _engine_call(self.hosts[0].call.remote("generate", samples, **kwargs))
        try:
            return self.router.generate(samples, **kwargs)
        except ray.exceptions.RayError as e:
            raise _engine_error(e) from e

    def checksum(self, names: list[str]) -> dict[str, float]:
        return self.all("checksum", names)[0]

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args: self.all(method, *args)[0]

    def shutdown(self) -> None:
        stop_engines(self.hosts)


@dataclass
class RayColocated:
    cfg: Config
    actor: ActorGroup
    rollout: EngineGroup
    pgs: list  # one placement group per node
    node_senders: list[list[int]]  # per node: its ranks that pack a device's entry (the first rank on each device)
    engine_node: list[int]  # per engine: the node whose merged message it takes
    start_engine: Any  # i -> a new RolloutHost for engine i
    quantized: dict[str, str]  # weight -> the quantized layout the engines hold it in
    handoff_class = ColocatedHandoff

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
        from colocate_rl.rollout.base import EngineDied

        for i, host in enumerate(self.rollout.hosts):
            try:
                _engine_call(host.call.remote("ping"))
                continue
            except EngineDied:
                pass
            ray.kill(host, no_restart=True)
            self.rollout.hosts[i] = self.start_engine(i)
        ray.get([h.pid.remote() for h in self.rollout.hosts])  # started

    def drain(self) -> None:
        pass

    def make_buffer(self, handoff: Any) -> ImmediateBuffer:
        return immediate_buffer(self, handoff)

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


def launch(cfg: Config, offload: Optional[Sequence[str]] = None) -> RayColocated:
    lay = layout(cfg)
    start_ray(cfg)
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
        started.append(r.start.remote(cfg, env, offload))
    group = ActorGroup(ranks, names)
    # The engines start once every rank holds only what the plan keeps beside them: an engine
    # checks the free memory against its share of the card and sizes its KV cache at start.
    group.get(started, "start")

    def start_engine(e: int):
        k, j = divmod(e, epn)  # engine j of node k: that node's j-th TP group of GPUs
        env = platform.visible_devices_env(node_gpus[k][j * tp:(j + 1) * tp]) if gpu else {}
        env.update(net, OMP_NUM_THREADS="1")
        return RolloutHost.options(**bundle(k, j * tp if gpu else 0)).remote(cfg, env, authkey)

    engines = EngineGroup([start_engine(e) for e in range(lay.engines)], cfg.rollout.max_response_tokens,
                          cfg.rollout.n)
    uuids = group.get([r.device_uuid.remote() for r in ranks], "start")
    node_senders = senders_by_node(uuids, [rank // rpn for rank in range(len(ranks))], lay.nnodes)
    return RayColocated(cfg, group, engines, [g.pg for g in groups], node_senders,
                        [e // epn for e in range(lay.engines)], start_engine, engine_quantization(engines))
