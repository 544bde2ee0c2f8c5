"""What both Ray placements use: starting (or joining) Ray, the Ray actor that hosts an engine, the
actor ranks as one object, and engine errors as the run sees them.

Ray is told not to set visible devices (``NOSET``): each placement pins its processes' GPUs itself,
CUDA_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES together, so an actor rank and the engine worker on one
GPU agree on its UUID.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import ray

from colocate_rl import console, platform
from colocate_rl.config import PlacementConfig
from colocate_rl.errors import first_line
from colocate_rl.placement.nodes import gather, network_env, short, where
from colocate_rl.placement.ray_auth import authenticate, local_token_file, use_token_file
from colocate_rl.ports import reserve_port
from colocate_rl.private import cache_dir
from colocate_rl.resolved import Sampling
from colocate_rl.rollout.base import EngineDied, RemoteEngine
from colocate_rl.types import RolloutBatch, Sample

# Ray would otherwise set CUDA_VISIBLE_DEVICES per actor to its fractional GPU, hiding from the
# vLLM engine the other GPUs its TP workers need, and leave HIP_VISIBLE_DEVICES alone.
NOSET = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
         "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "1"}


def start_ray(pl: PlacementConfig, num_cpus: int | None = None) -> None:
    """Joins placement.ray_address, or starts a local instance. ``num_cpus``: CPUs a local instance
    advertises, at least the machine's (CPU runs place one bundle per process and may need more
    bundles than a small machine has cores)."""
    if ray.is_initialized():
        return
    _raise_nofile_limit()
    os.environ.update(NOSET)
    if pl.ray_address:
        authenticate(pl)  # a cluster started by scripts/start_ray.sh admits only its token's holders
    else:
        use_token_file(local_token_file())  # the local instance admits only this run's processes
    tmp = os.environ.get("RAY_TMPDIR", str(cache_dir() / "ray"))
    os.makedirs(tmp, mode=0o700, exist_ok=True)
    # A quiet console (console.py) is quiet on every node: its settings reach the workers, and each
    # worker logs to the run's log from its start. Here, Ray's logger gave up the console handler
    # its import gave it.
    quiet = console.child_env()
    runtime_env: dict[str, Any] = {"env_vars": {**NOSET, **quiet}}
    if console.CONFIG_ENV in quiet:
        runtime_env["worker_process_setup_hook"] = f"{console.__name__}.configure"
        console.configure()
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True, runtime_env=runtime_env)
    if pl.ray_address:
        ray.init(address=pl.ray_address, **kwargs)
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


def check_shared_folder(pl: PlacementConfig, folder: Path) -> None:
    """Every node of the cluster placement.ray_address names (or of the Ray instance this process
    already joined) sees ``folder``."""
    if not (pl.ray_address or ray.is_initialized()):
        return  # a Ray instance this run starts itself is this machine alone
    from colocate_rl.placement.nodes import check_shared_folder as check

    start_ray(pl)
    check(folder)


def pin_assigned_gpus() -> dict[str, str]:
    """CUDA_/HIP_VISIBLE_DEVICES = the GPUs Ray assigned this actor (Ray leaves them unset: NOSET)."""
    ids = [int(i) for i in ray.get_gpu_ids()]
    env = platform.visible_devices_env(ids) if ids else {}
    os.environ.update(env)
    return env


class Host:
    """Base of the placements' Ray actors: process env first, then the object, then calls by name."""

    obj: Any

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
class EngineHost(Host):
    """One engine (all its TP workers) as a Ray actor. ``pin``: the process sees the GPUs Ray
    assigned its bundle (a disaggregated engine's own); else ``env`` names them (a colocated
    engine's, shared with the actor ranks)."""

    def __init__(self, make_rollout: Callable[[], RemoteEngine], env: dict[str, str], authkey: bytes,
                 pin: bool = False):
        if pin:
            pin_assigned_gpus()
        super().__init__(env, authkey)
        self.obj: RemoteEngine = make_rollout()

    def num_workers(self) -> int:
        return self.obj.num_workers

    def pid(self) -> int:
        return os.getpid()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "uuids": list(self.obj.device_uuids)}


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


def engine_error(e: BaseException) -> BaseException:
    """A failed engine call's error as the caller should see it: EngineDied when the engine's Ray
    actor or its vLLM process is gone, the engine's own exception otherwise."""
    if isinstance(e, ray.exceptions.RayActorError):
        return EngineDied(f"the engine's Ray actor died: {first_line(e)}")
    if isinstance(e, ray.exceptions.RayTaskError):
        if isinstance(e.cause, EngineDied) or "EngineDeadError" in str(e):
            return EngineDied(first_line(e.cause) if str(e.cause).strip() else "vLLM engine died")
        return e.cause if isinstance(e.cause, Exception) else e
    return e


def engine_call(ref):
    """ray.get of one engine call, its error as engine_error says."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as e:
        raise engine_error(e) from e


def is_lost(exc: BaseException) -> bool:
    """The engine is gone: its Ray actor died, or vLLM's engine core died under it (EngineDeadError,
    re-raised through the Ray actor)."""
    text = f"{type(exc).__name__} {exc}"
    return isinstance(exc, ray.exceptions.RayActorError) or "EngineDeadError" in text or "EngineDied" in text


class EngineGroup:
    """The engines (EngineHost actors) as one rollout.base.Rollout: generation spread over them by the
    router (each prompt's group on one engine), every other call made on every engine at once and
    engine 0's answer returned. ``restart(i)`` replaces engine i and gives it the weights: with it
    the router replaces an engine lost mid-generation itself and re-issues its prompts (disaggregated);
    without it a dead engine is EngineDied for the handoff to replace (colocated)."""

    def __init__(self, hosts: list, sampling: Sampling, restart: Optional[Callable[[int], None]] = None):
        from colocate_rl.rollout.router import Router

        self.hosts, self.restart = hosts, restart
        if restart is None:
            self.router = Router(self._submit, len(hosts), restart=self._no_restart, is_lost=lambda e: False,
                                 max_response_tokens=sampling.max_response_tokens, default_n=sampling.n,
                                 max_restarts=0)
        else:
            self.router = Router(self._submit, len(hosts), restart, is_lost, sampling.max_response_tokens, sampling.n)

    def _submit(self, i: int, samples, kwargs, method: str = "generate"):
        return self.hosts[i].call.remote(method, samples, **kwargs).future()

    def _no_restart(self, i: int) -> None:
        raise AssertionError(f"engine {i}: is_lost is always False here")

    def all(self, method: str, *args) -> list:
        return [engine_call(r) for r in [h.call.remote(method, *args) for h in self.hosts]]

    def each(self, method: str, args: list[tuple]) -> list:
        """Engine i's ``method(*args[i])``, every engine at once."""
        return [engine_call(r) for r in [h.call.remote(method, *a) for h, a in zip(self.hosts, args)]]

    def generate(self, samples: list[Sample], **kwargs) -> RolloutBatch:
        return self._routed("generate", samples, **kwargs)

    def generate_partial(self, groups: list, needed: int, total: int) -> list:
        """rollout/partial.py's groups spread over the engines, each stopping at its share of ``needed``."""
        from colocate_rl.rollout.partial import in_group_order

        return self._routed("generate_partial", groups, join=in_group_order, needed=needed, total=total)

    def _routed(self, method: str, samples: list, join=None, **kwargs):
        if self.restart is not None:
            return self.router.generate(samples, method, join, **kwargs)
        try:
            if len(self.hosts) == 1:
                return ray.get(self.hosts[0].call.remote(method, samples, **kwargs))
            return self.router.generate(samples, method, join, **kwargs)
        except ray.exceptions.RayError as e:
            raise engine_error(e) from e

    def sleep(self, level: Optional[int] = None) -> None:
        self.all("sleep", level)

    def wake(self, tags: Optional[list[str]] = None) -> None:
        self.all("wake", tags)

    def ping(self) -> None:
        self.all("ping")

    def checksum(self, names: list[str]) -> dict[str, float]:
        return self.all("checksum", names)[0]

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.all("weight_shapes")[0]

    def shutdown(self) -> None:
        stop_engines(self.hosts)
