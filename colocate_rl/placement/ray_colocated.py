"""Colocated on Ray: one placement-group bundle per GPU, shared by an actor rank and vLLM.

Each actor rank is a Ray actor holding a fractional GPU share of its bundle; the vLLM engine is a
Ray actor on bundle 0 whose workers span every GPU of the group (vLLM's own executor starts them).
Ray is told not to set the visible devices itself: we set CUDA_VISIBLE_DEVICES and
HIP_VISIBLE_DEVICES together, to every GPU of the node, and each rank picks its own GPU by index,
so the actor rank and the vLLM worker on one GPU see the same device (and the same UUID, which
keys the weight-sync messages).

Weight sync: every rank packs the same bucket sequence for its own GPU (full HF tensors, gathered
over TP/EP/PP), the driver merges the ranks' messages ({uuid: payload}) and hands the merged
message to the engine, whose workers each take their own entry.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from colocate_rl import platform
from colocate_rl.config import Config, actor_world_size, cache_dir
from colocate_rl.placement.ray_auth import authenticate
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

    def begin_sync(self, bucket_mb: float, send: bool) -> None:
        """``send``: this rank serves the vLLM worker on its device. Every rank walks the export
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

    def checksums(self) -> dict[str, float]:
        from colocate_rl.weight_sync.verify import verifiable_checksums

        return verifiable_checksums(self.obj.export_hf_weights())

    def end_sync(self) -> int:
        self.buckets = None
        return self.sender.release() if self.sender else 0


@ray.remote
class RolloutHost(_Host):
    def __init__(self, cfg: Config, env: dict[str, str], authkey: bytes):
        super().__init__(env, authkey)
        from colocate_rl.rollout import RolloutEngine

        self.obj = RolloutEngine(cfg, cfg.model.path)


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

    def _all(self, method: str, *args, **kwargs):
        return ray.get(self.submit("call", method, *args, **kwargs))[0]

    def compute_logprobs(self, batch):
        return self._all("compute_logprobs", batch)

    def train_step(self, batch, old_logprobs):
        return self._all("train_step", batch, old_logprobs)

    def sft_step(self, batch):
        return self._all("sft_step", batch)

    def onload(self, parts=None):
        return self._all("onload", parts)

    def offload(self, parts=None):
        return self._all("offload", parts)

    def save_checkpoint(self, path):
        return self._all("save_checkpoint", path)

    def load_checkpoint(self, path):
        return self._all("load_checkpoint", path)


class RemoteRollout:
    """rollout.RolloutEngine's methods, forwarded to the engine's Ray actor."""

    def __init__(self, host):
        self.host = host

    def __getattr__(self, method: str):
        return lambda *args, **kwargs: ray.get(self.host.call.remote(method, *args, **kwargs))

    def shutdown(self) -> None:
        ray.get(self.host.call.remote("shutdown"))
        ray.kill(self.host)


@dataclass
class RayColocated:
    actor: ActorGroup
    rollout: RemoteRollout
    pg: Any
    senders: list[int]  # the first rank on each device (on CPU all ranks share one "device")

    def sync(self, bucket_mb: float = 256) -> SyncStats:
        """Bucket by bucket: every rank packs its GPU's entry, one merged message per bucket."""
        import time

        t0, nbytes, n = time.perf_counter(), 0, 0
        ranks, senders = self.actor.ranks, self.senders
        ray.get([r.begin_sync.remote(bucket_mb, i in senders) for i, r in enumerate(ranks)])
        self.rollout.begin_weight_sync()
        try:
            while True:
                parts = ray.get([r.next_message.remote() for r in ranks])
                if parts[senders[0]] is None:
                    break
                self.rollout.load_message(merge_messages(parts[i][0] for i in senders))
                nbytes, n = nbytes + parts[senders[0]][1], n + 1
        except BaseException:
            self.rollout.abort_weight_sync()
            raise
        finally:
            ray.get([r.end_sync.remote() for r in ranks])
        self.rollout.end_weight_sync()
        return SyncStats(bytes=nbytes, seconds=time.perf_counter() - t0, buckets=n)

    def restart_rollout(self) -> None:
        from colocate_rl.rollout import EngineDied

        raise EngineDied("the vLLM engine died; restarting it under the Ray launcher is not supported: "
                         "run the same command again to resume from the last checkpoint")

    def verify(self) -> int:
        """Every rank's checksums of a few tensors equal the engine's; returns how many were checked."""
        from colocate_rl.weight_sync.verify import compare

        per_rank = ray.get([r.checksums.remote() for r in self.actor.ranks])
        engine = self.rollout.checksum(list(per_rank[0]))
        for i, sums in enumerate(per_rank):
            compare(sums, engine, who=f"actor rank {i}")
        return len(per_rank[0])

    def shutdown(self) -> None:
        self.rollout.shutdown()  # before ray.shutdown(), else vLLM leaves a /dev/shm segment behind
        for r in self.actor.ranks:
            ray.kill(r)
        remove_placement_group(self.pg)


def bundles_and_share(world: int, gpu: bool) -> tuple[list[dict], dict]:
    """One bundle per rank (on GPU: one GPU and one CPU); rank 0's bundle also hosts vLLM, so each
    process asks for half of every resource in it. Both halves matter: a Ray actor that names only
    num_gpus still takes one CPU, the bundle's only one, and the engine would wait for it forever."""
    bundles = [{"GPU": 1, "CPU": 1} if gpu else {"CPU": 1} for _ in range(world)]
    return bundles, ({"num_gpus": 0.5, "num_cpus": 0.5} if gpu else {"num_cpus": 0.5})


def launch(cfg: Config) -> RayColocated:
    if cfg.placement.nnodes > 1:
        # One vLLM engine per node and a rank-0 rendezvous on the first node are not wired yet.
        raise NotImplementedError("placement.mode=colocated runs on one node for now (placement.nnodes=1)")
    start_ray(cfg)
    world = actor_world_size(cfg)
    gpu = cfg.placement.gpus_per_node > 0
    bundles, share = bundles_and_share(world, gpu)
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready())
    authkey = secrets.token_bytes(32)
    master_port = _free_port()
    node_ip = ray.util.get_node_ip_address()
    gpus_per_node = cfg.placement.gpus_per_node
    visible = platform.visible_devices_env(list(range(gpus_per_node))) if gpu else {}

    ranks = []
    for rank in range(world):
        env = {**visible, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % max(gpus_per_node, 1)),
               "MASTER_ADDR": node_ip, "MASTER_PORT": str(master_port), "OMP_NUM_THREADS": "1"}
        ranks.append(ActorRank.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank), **share,
        ).remote(cfg, env, authkey))
    group = ActorGroup(ranks)
    host = RolloutHost.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0), **share,
    ).remote(cfg, {**visible, "OMP_NUM_THREADS": "1"}, authkey)
    uuids = ray.get([r.device_uuid.remote() for r in ranks])
    senders = [i for i, u in enumerate(uuids) if u not in uuids[:i]]
    return RayColocated(group, RemoteRollout(host), pg, senders)
