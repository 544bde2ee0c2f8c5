"""A reserved port (colocate_rl.ports) stays held by its process until the store it serves takes it over: no other
process can bind it in between, the store serves clients on it, and rank 0 forms the default process group on it
with a rank that joins its store (two processes, gloo). While a one-node group is up, every socket its
ranks listen on is on loopback: the default group's store, Megatron-style subgroups, gloo's own sockets and
a weight-broadcast group's store."""

from __future__ import annotations

import errno
import os
import socket
from datetime import timedelta

import ipaddress

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colocate_rl import ports
from colocate_rl.trainer.distributed import run_on_ranks


def _bind_error(port: int) -> int:
    """errno of binding ``port`` from a fresh socket (0: it bound)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            return e.errno
    return 0


def test_a_reserved_port_is_held_until_its_store_serves_on_it():
    port = ports.reserve_port("127.0.0.1")
    assert ports.reserved(port) and _bind_error(port) == errno.EADDRINUSE
    master = ports.tcp_store("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    assert not ports.reserved(port) and _bind_error(port) == errno.EADDRINUSE  # the store holds it now
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
    client.set("from-client", "a")
    master.set("from-master", "b")
    assert master.get("from-client") == b"a" and client.get("from-master") == b"b"


def _rank(rank: int, port: int, reserve: bool, out) -> None:
    """A rank of a two-process gloo world; rank 0 holds ``port`` (reserved here) when ``reserve``."""
    import torch

    from colocate_rl.trainer.distributed import init_process_group

    try:
        if reserve:
            port = ports.reserve_port("127.0.0.1")
            out.put(("port", port))
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        init_process_group()
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        out.put((rank, t.item(), ports.reserved(port)))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, repr(e), None))


def test_rank_0_forms_the_default_group_on_its_reserved_port():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs, got = [ctx.Process(target=_rank, args=(0, 0, True, out))], []
    procs[0].start()
    try:
        kind, port = out.get(timeout=60)
        assert kind == "port", port
        assert _bind_error(port) == errno.EADDRINUSE  # between the pick and rank 0's store, no one else can take it
        procs.append(ctx.Process(target=_rank, args=(1, port, False, out)))
        procs[1].start()
        while len(got) < 2:
            got.append(out.get(timeout=60))
            assert isinstance(got[-1][1], float), got[-1]  # a rank's error
    finally:
        for p in procs:
            p.join(30 if len(got) == 2 else 1)
            if p.is_alive():
                p.kill()
    # Both ranks summed 1 + 2 in one group; rank 0's store took the held socket over.
    assert sorted(got) == [(0, 3.0, False), (1, 3.0, False)], got
    assert [p.exitcode for p in procs] == [0, 0]


def _listening(pid: int) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket that ``pid`` and its children listen on."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return [(c.laddr.ip, c.laddr.port, p.pid) for p in procs for c in p.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN]


def _listeners_while_the_groups_are_up() -> dict:
    """On every rank: the default group (formed by run_on_ranks), a subgroup and a weight-broadcast group
    of all ranks; rank 0 reads every rank's listening sockets while all of them are up."""
    from colocate_rl.weight_sync.broadcast import BroadcastGroup, GroupSpec

    rank, world, addr = dist.get_rank(), dist.get_world_size(), os.environ["MASTER_ADDR"]
    sub = dist.new_group(list(range(world)))
    dist.all_reduce(torch.ones(1), group=sub)
    port = torch.tensor([ports.reserve_port(addr) if rank == 0 else 0])
    dist.broadcast(port, 0)
    group = BroadcastGroup(GroupSpec("listeners", addr, int(port), world, "gloo", 120.0), rank)
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(pids, torch.tensor([os.getpid()]))
    out = None
    if rank == 0:
        out = {"listening": [x for p in pids for x in _listening(int(p))], "pids": [int(p) for p in pids],
               "stores": [int(os.environ["MASTER_PORT"]), int(port)], "addr": addr}
    dist.barrier(group=sub)  # the other ranks stay up until rank 0 has read them
    group.close()
    return out


def test_a_one_node_group_listens_on_loopback_only():
    got = run_on_ranks(_listeners_while_the_groups_are_up, 2)
    listening = got["listening"]
    assert got["addr"] == "127.0.0.1" and len(got["pids"]) == 2
    # Both stores (rank 0's) are among the sockets read, so the reading sees what the ranks serve.
    assert {(ip, port) for ip, port, pid in listening if pid == got["pids"][0]} >= \
        {("127.0.0.1", port) for port in got["stores"]}, listening
    assert [x for x in listening if not ipaddress.ip_address(x[0]).is_loopback] == [], listening
