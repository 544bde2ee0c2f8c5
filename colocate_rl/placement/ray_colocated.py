"""Colocated on Ray: one placement-group bundle per GPU, shared by an actor rank and an engine worker.

Each actor rank is a Ray actor holding a fractional GPU share of its bundle. The node's GPUs are
split into engines of rollout.tensor_parallel_size GPUs (config.layout: one engine per TP group);
engine e is a Ray actor on the bundle of its first GPU whose workers span its GPUs (vLLM's own
executor starts them). Ray is told not to set visible devices: actor ranks see every GPU of the node
and pick theirs by index; engine e sees its own GPUs. The actor rank and the engine worker on one
GPU see the same device, and the same UUID, which keys the weight-sync messages.

Weight sync: every rank packs the same bucket sequence for its own GPU (full HF tensors, gathered
over TP/EP/PP), the driver merges the ranks' messages ({uuid: payload}) and hands the merged
message to every engine, whose workers each take their own entry. A step's prompts are spread
over the engines by the router (rollout/router.py), each prompt's group on one engine.
"""


from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from colocate_rl import platform
from colocate_rl.config import Config, ConfigError, cache_dir, layout
from colocate_rl.handoff import ColocatedHandoff
from colocate_rl.placement.ray_auth import authenticate
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
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # else Ray writes a token under $HOME
    tmp = os.environ.get("RAY_TMPDIR", str(cache_dir() / "ray"))
    os.makedirs(tmp, exist_ok=True)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _Host:
    """Base of the Ray actors below: process env first, then the object, then calls by name."""

    def __init__(self, env: dict[str, str], authkey: bytes):
        os.environ.update(env)
        from colocate_rl.weight_sync.ipc import set_authkey

        set_authkey(authkey)  # CPU shared-memory handles between unrelated processes need one key

    def call(self, method: str, *args, **kwargs):
        return getattr(self.obj, method)(*args, **kwargs)

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()


@ray.remote
class ActorRank(_Host):
    def __init__(self, cfg: Config, env: dict[str, str], authkey: bytes):
        super().__init__(env, authkey)
        from colocate_rl.trainer import Actor

        self.obj = Actor(cfg)
        self.obj.offload()  # the rollout owns the device first

    def device_uuid(self) -> str:
        from colocate_rl.weight_sync.ipc import device_uuid

        return device_uuid(platform.device())

    def device_used(self) -> Optional[int]:
        import torch

        if not platform.has_gpu():
            return None
        free, total = torch.cuda.mem_get_info()
        return total - free

    def begin_sync(self, bucket_mb: float, send: bool) -> None:
        """``send``: this rank serves the engine worker on its device. Every rank walks the export
        (its gathers over TP/EP/PP are collective), only the senders make messages."""
        from colocate_rl.weight_sync.ipc import IpcSender

        self.sender = IpcSender(platform.device()) if send else None
        weights = self.obj.export_hf_weights()
        self.buckets = self.sender.buckets(weights, bucket_mb) if send else ((n, t.numel()) for n, t in weights)

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


class ActorGroup:
    """The actor ranks as one object with trainer.Actor's methods: each call runs on every rank
    (they are collective) and returns rank 0's result. Calls are submitted to every rank under one
    lock, so calls from two threads (the loop, and a disaggregated engine's re-sync) reach all ranks
    in the same order: their collectives cannot interleave."""

    def __init__(self, ranks: list):
        self.ranks = ranks
        self.lock = threading.Lock()

    def submit(self, method: str, *args, **kwargs) -> list:
        with self.lock:
            return [getattr(r, method).remote(*args, **kwargs) for r in self.ranks]

    def all(self, method: str, *args, **kwargs) -> list:
        """trainer.Actor.<method> on every rank; every rank's result."""
        return ray.get(self.submit("call", method, *args, **kwargs))

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.all(method, *args, **kwargs)[0]


def _engine_error(e: BaseException) -> BaseException:
    """A failed engine call's error as the caller should see it: EngineDied when the engine's Ray
    actor or its vLLM process is gone, the engine's own exception otherwise."""
    from colocate_rl.rollout.base import EngineDied

    if isinstance(e, ray.exceptions.RayActorError):
        return EngineDied(f"the engine's Ray actor died: {str(e).splitlines()[0]}")
    if isinstance(e, ray.exceptions.RayTaskError):
        if isinstance(e.cause, EngineDied) or "EngineDeadError" in str(e):
            return EngineDied(str(e.cause).splitlines()[0] if str(e.cause) else "vLLM engine died")
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
        for h in self.hosts:
            try:
                ray.get(h.call.remote("shutdown"), timeout=60)  # before ray.shutdown(): vLLM's /dev/shm segment
            except (ray.exceptions.RayError, TimeoutError):
                pass
            ray.kill(h)


@dataclass
class RayColocated:
    cfg: Config
    actor: ActorGroup
    rollout: EngineGroup
    pg: Any
    senders: list[int]  # the first rank on each device (on CPU all ranks share one "device")
    start_engine: Any  # i -> a new RolloutHost for engine i
    handoff_class = ColocatedHandoff

    def sync(self, bucket_mb: float = 256) -> SyncStats:
        """Bucket by bucket: every rank packs its GPU's entry, one merged message per bucket."""
        t0, nbytes, n = time.perf_counter(), 0, 0
        ranks, senders = self.actor.ranks, self.senders
        ray.get([r.begin_sync.remote(bucket_mb, i in senders) for i, r in enumerate(ranks)])
        self.rollout.all("begin_weight_sync")
        try:
            while True:
                parts = ray.get([r.next_message.remote() for r in ranks])
                if parts[senders[0]] is None:
                    break
                self.rollout.all("load_message", merge_messages(parts[i][0] for i in senders))
                nbytes, n = nbytes + parts[senders[0]][1], n + 1
        except BaseException:
            try:
                self.rollout.all("abort_weight_sync")
            except Exception:  # noqa: BLE001 - a dead engine cannot abort; the original error says why
                pass
            raise
        finally:
            ray.get([r.end_sync.remote() for r in ranks])
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
        def generate(samples, **kw):
            return handoff.on_rollout("generate", lambda: self.rollout.generate(samples, **kw))

        return ImmediateBuffer(generate)

    def device_used(self) -> Optional[int]:
        return ray.get(self.actor.ranks[0].device_used.remote())

    def shutdown(self) -> None:
        self.rollout.shutdown()  # before ray.shutdown(), else vLLM leaves a /dev/shm segment behind
        for r in self.actor.ranks:
            ray.kill(r)
        remove_placement_group(self.pg)


def bundles_and_share(world: int, gpu: bool) -> tuple[list[dict], dict]:
    """One bundle per rank (on GPU: one GPU and one CPU); an engine's first GPU's bundle also hosts
    the engine, so each process asks for half of every resource in it. Both halves matter: a Ray
    actor that names only num_gpus still takes one CPU, the bundle's only one, and the engine would
    wait for it forever."""
    bundles = [{"GPU": 1, "CPU": 1} if gpu else {"CPU": 1} for _ in range(world)]
    return bundles, ({"num_gpus": 0.5, "num_cpus": 0.5} if gpu else {"num_cpus": 0.5})


def launch(cfg: Config) -> RayColocated:
    lay = layout(cfg)
    if lay.nnodes > 1:
        # One engine group per node and a rank-0 rendezvous across nodes are not wired yet.
        raise ConfigError("placement.mode=colocated runs on one node for now (placement.nnodes=1)")
    start_ray(cfg)
    world, gpu = lay.actor_gpus, lay.on_gpu
    bundles, share = bundles_and_share(world, gpu)
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready())
    authkey = secrets.token_bytes(32)
    master_port = _free_port()
    node_ip = ray.util.get_node_ip_address()
    gpn = lay.gpus_per_node
    visible = platform.visible_devices_env(list(range(gpn))) if gpu else {}

    ranks = []
    for rank in range(world):
        env = {**visible, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % max(gpn, 1)),
               "MASTER_ADDR": node_ip, "MASTER_PORT": str(master_port), "OMP_NUM_THREADS": "1"}
        ranks.append(ActorRank.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank), **share,
        ).remote(cfg, env, authkey))

    def start_engine(i: int):
        first = i * lay.engine_tp  # engine i's GPUs: its own TP group of the node
        env = platform.visible_devices_env(list(range(first, first + lay.engine_tp))) if gpu else {}
        return RolloutHost.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first if gpu else 0),
            **share,
        ).remote(cfg, {**env, "OMP_NUM_THREADS": "1"}, authkey)

    engines = EngineGroup([start_engine(i) for i in range(lay.engines if gpu else 1)],
                          cfg.rollout.max_response_tokens, cfg.rollout.n)
    uuids = ray.get([r.device_uuid.remote() for r in ranks])
    senders = [i for i, u in enumerate(uuids) if u not in uuids[:i]]
    return RayColocated(cfg, ActorGroup(ranks), engines, pg, senders, start_engine)
