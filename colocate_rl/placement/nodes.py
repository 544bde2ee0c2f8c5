"""The nodes of a Ray cluster as the placements see them: one placement group per node, where each
process really runs, the network variables every process gets, calls that name the process that
died, and the check that every node sees the checkpoint folder.

One placement group per node (STRICT_PACK: its bundles on one node), created one after the other,
each with a label selector that keeps it off the nodes already taken (``ray.io/node-id``, a label
Ray gives every node). So k groups are on k distinct nodes, and a node's bundles are the GPUs of
that node: actor ranks sharing a node share it for the IPC weight sync, and a rank's index in its
group is its local rank. A single placement group with PACK may put any bundle on any node, and
STRICT_SPREAD puts every bundle on a node of its own; neither says which bundles share a node.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from colocate_rl.config import ConfigError
from colocate_rl.ports import LOOPBACK

PG_READY_S = 120.0  # a placement group not ready by then will not fit the cluster
NODE_ID_LABEL = "ray.io/node-id"

# Variables of the driver's environment given to every Ray actor of a run (beside the raylet's own
# environment, which each Ray worker inherits on its node): which network interface NCCL/RCCL and
# gloo bind to (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), InfiniBand/RoCE choices (NCCL_IB_HCA,
# NCCL_IB_GID_INDEX, NCCL_NET_GDR_LEVEL, ...), RCCL's own and NCCL's debug output.
NETWORK_PREFIXES = ("NCCL_", "RCCL_", "GLOO_", "TORCH_NCCL_", "UCX_")


def network_env() -> dict[str, str]:
    """The driver's NCCL_*, RCCL_*, GLOO_*, TORCH_NCCL_* and UCX_* variables."""
    return {k: v for k, v in os.environ.items() if k.startswith(NETWORK_PREFIXES)}


class ProcessLost(RuntimeError):
    """A process of the run (an actor rank, an engine) died; the one-line message names it and its node."""


@dataclass(frozen=True)
class NodeGroup:
    pg: PlacementGroup
    node_id: str
    node_ip: str


def node_ips() -> dict[str, str]:
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}


def short(node_id: str) -> str:
    return node_id[:8]


def wait_ready(pg: PlacementGroup, what: str, bundles: Sequence[dict[str, float]]) -> None:
    try:
        ray.get(pg.ready(), timeout=PG_READY_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"placement: {what} ({len(bundles)} bundles of {bundles[0]}) did not fit the Ray cluster "
                           f"in {PG_READY_S:g} s; available: {ray.available_resources()}") from None


def node_groups(per_node: Sequence[Sequence[dict[str, float]]], what: str,
                avoid: Sequence[str] = ()) -> list[NodeGroup]:
    """One STRICT_PACK placement group per entry of ``per_node`` (that node's bundles), each on a node
    of its own, none on a node in ``avoid``. Made in order, each kept off the nodes taken before it."""
    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in avoid]
    if len(alive) < len(per_node):
        raise RuntimeError(f"placement: the {what} groups need {len(per_node)} nodes of their own; the Ray cluster "
                           f"has {len(alive)} (placement.nnodes counts nodes: start the others with "
                           "scripts/start_ray.sh worker, docs/multinode.md)")
    taken, out = list(avoid), []
    ips = None
    for k, bundles in enumerate(per_node):
        selector = [{NODE_ID_LABEL: f"!in({','.join(taken)})"}] * len(bundles) if taken else None
        pg = placement_group(list(bundles), strategy="STRICT_PACK", name=f"colocate_rl-{what}-{k}",
                             bundle_label_selector=selector)
        wait_ready(pg, f"the {what} group of node {k}", bundles)
        node = placement_group_table(pg)["bundles_to_node_id"][0]
        if ips is None or node not in ips:
            ips = node_ips()
        taken.append(node)
        out.append(NodeGroup(pg, node, ips.get(node, "?")))
    return out


def where() -> dict[str, Any]:
    """Where the calling Ray worker runs, as it sees itself."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(), "gpu_ids": [int(i) for i in ray.get_gpu_ids()]}


def master_addr(places: list[dict[str, Any]]) -> str:
    """Where the store of a group whose members run at ``places`` (each process's ``where``; the first serves
    it) listens: loopback when they all run on one node, reachable from no other machine; else that node's address."""
    return LOOPBACK if len({p["node_id"] for p in places}) == 1 else places[0]["node_ip"]


def _reason(e: BaseException) -> str:
    """The one line of a Ray error that says why (Ray's own message spans several)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith(("\t", " "))]
    return lines[-1] if lines else type(e).__name__


PROBE_S = 10.0  # after a rank's error, how long the others' liveness probes may take (a dead one fails at once)


def gather(refs: list, names: Sequence[str], what: str, handles: Optional[Sequence] = None) -> list:
    """ray.get of one call per process, failing at the first that fails: a process that died raises
    ProcessLost naming it (the others may wait in a collective for it and never return). Another
    error is often a rank's collective failing because a peer died (gloo: "connection closed by
    peer"): with ``handles`` (the processes' Ray actors) the others are probed, and a dead one is
    reported as the cause; otherwise the error is raised as it came."""
    index = {r: i for i, r in enumerate(refs)}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except ray.exceptions.RayActorError as e:
            raise ProcessLost(f"{names[index[done[0]]]} died during {what}: {_reason(e)}") from None
        except Exception as e:
            dead = _dead(handles, skip=index[done[0]]) if handles is not None else None
            if dead is None:
                raise
            i, err = dead
            raise ProcessLost(f"{names[i]} died during {what}: {_reason(err)} ({names[index[done[0]]]} then failed: "
                              f"{_reason(e)})") from None
    return ray.get(list(refs))


def _dead(handles: Sequence, skip: int) -> Optional[tuple[int, BaseException]]:
    """(index, error) of the first of ``handles`` whose process is gone, else None. A live process busy
    in a collective does not answer its probe; a dead one fails it at once."""
    probes = {h.where.remote(): i for i, h in enumerate(handles) if i != skip}
    done, _ = ray.wait(list(probes), num_returns=len(probes), timeout=PROBE_S)
    for ref in sorted(done, key=lambda r: probes[r]):
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:
            return probes[ref], e
    return None


# ---------------------------------------------------------------- the shared checkpoint folder


class FolderNotShared(ConfigError):
    """A node of the cluster does not see the run's checkpoint folder; the message names it."""


@ray.remote(num_cpus=0)
def _read_marker(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def check_shared_folder(folder: Path, what: str = "checkpoint.dir") -> int:
    """Every alive node of the cluster sees ``folder`` (checkpoints are written by every actor rank,
    each on its own node, and read back wherever the run resumes): the driver writes a marker file
    in it, a task on each node reads it back. Returns how many nodes were checked; raises
    FolderNotShared naming the first node that cannot see it."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    marker = folder / f".colocate_rl-shared-{token[:12]}"
    marker.write_text(token)
    try:
        nodes = [n for n in ray.nodes() if n["Alive"]]
        on = [NodeAffinitySchedulingStrategy(n["NodeID"], soft=False) for n in nodes]
        refs = [_read_marker.options(scheduling_strategy=s).remote(str(marker)) for s in on]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=PG_READY_S)
        seen = [ray.get(r) if r in done else r for r in refs]
    finally:
        marker.unlink(missing_ok=True)
    for n, text in zip(nodes, seen):
        if text != token:
            why = f"did not read {folder} within {PG_READY_S:g} s" if isinstance(text, ray.ObjectRef) else \
                f"does not see {folder}"
            raise FolderNotShared(f"{what}: Ray node {short(n['NodeID'])} ({n['NodeManagerAddress']}) {why} "
                                  "(every node must mount the same folder: docs/multinode.md)")
    return len(nodes)
