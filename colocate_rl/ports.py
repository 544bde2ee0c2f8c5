"""Ports for the TCPStores that form process groups: held from the moment they are picked when the
picking process serves the store (``reserve_port``), else only free when picked (``free_port``).

A port found by binding port 0 and closing the socket is free for any process until the store binds it, often
seconds later (an Actor builds first). ``reserve_port`` keeps the socket bound and listening instead, and
``tcp_store`` hands it to the store this process serves (``master_listen_fd``): the port is never free in between,
and a client that connects early waits in the socket's backlog.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_held: dict[int, socket.socket] = {}  # port -> the bound, listening socket, until a store serves on it


def free_port() -> int:
    """A port of this host free now, not held: for a store that another process will serve (a lone process's own
    group, the ranks run_on_ranks spawns), whose callers pick again when it was taken meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserve_port() -> int:
    """A port on every interface of this host, held by this process until its ``tcp_store`` serves on it."""
    s = socket.socket()
    s.bind(("", 0))
    s.listen()
    port = s.getsockname()[1]
    _held[port] = s
    return port


def reserved(port: int) -> bool:
    """Whether this process holds ``port`` (``reserve_port``) for a store not built yet."""
    return port in _held


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta, **kw: Any) -> dist.TCPStore:
    """``dist.TCPStore(host, port, ...)``; as master on a port this process reserved, it serves on the held socket."""
    sock = _held.pop(port, None) if is_master else None
    if sock is not None:
        kw["master_listen_fd"] = sock.detach()  # the store owns the descriptor now: Python must never close it
    return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timeout, **kw)
