"""A reserved port (colocate_rl.ports) stays held by its process until the store it serves takes it over: no other
process can bind it in between, the store serves clients on it, and rank 0 forms the default process group on it
with ranks that join through env:// (two processes, gloo)."""

from __future__ import annotations

import errno
import os
import socket
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from colocate_rl import ports


def _bind_error(port: int) -> int:
    """errno of binding ``port`` from a fresh socket (0: it bound)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as e:
            return e.errno
    return 0


def test_a_reserved_port_is_held_until_its_store_serves_on_it():
    port = ports.reserve_port()
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
            port = ports.reserve_port()
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
