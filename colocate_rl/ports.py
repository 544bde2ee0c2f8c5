"""Ports for the TCPStores that form process groups, and the one address each store listens on.

A store listens only on its MASTER_ADDR: 127.0.0.1 when every member runs on one node, else rank 0's
node address. torch's TCPStore master binds every interface whatever host it is given, unless handed a
socket already listening (``master_listen_fd``): ``tcp_store`` always hands it one bound to ``host``.

A port found by binding port 0 and closing the socket is free for any process until the store binds it, often
seconds later (an Actor builds first). ``reserve_port`` keeps the socket bound and listening instead, and
``tcp_store`` hands it to the store this process serves: the port is never free in between, and a client that
connects early waits in the socket's backlog.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta
from typing import Any

import psutil
import torch.distributed as dist

LOOPBACK = "127.0.0.1"  # MASTER_ADDR of a group whose members all run on one node

_held: dict[int, socket.socket] = {}  # port -> the bound, listening socket, until a store serves on it


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` only (port 0: one the kernel picks)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own store does
        s.bind(addr)
        s.listen()
    except OSError:
        s.close()
        raise
    return s


def free_port(host: str = LOOPBACK) -> int:
    """A port of ``host`` free now, not held: for a store that another process will serve (the ranks
    run_on_ranks spawns), whose callers pick again when it was taken meanwhile."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reserve_port(host: str) -> int:
    """A port on ``host`` (the group's MASTER_ADDR), held by this process until its ``tcp_store`` serves on it."""
    s = _listen(host, 0)
    port = s.getsockname()[1]
    _held[port] = s
    return port


def reserved(port: int) -> bool:
    """Whether this process holds ``port`` (``reserve_port``) for a store not built yet."""
    return port in _held


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta, **kw: Any) -> dist.TCPStore:
    """``dist.TCPStore(host, port, ...)``; as master it serves on a socket bound to ``host`` only: the one this
    process reserved for ``port``, else one bound now (OSError EADDRINUSE when another process has the port)."""
    if is_master:
        sock = _held.pop(port, None) or _listen(host, port)
        kw["master_listen_fd"] = sock.detach()  # the store owns the descriptor now: Python must never close it
    return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timeout, **kw)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def loopback_interface() -> str:
    """The name of the interface that carries 127.0.0.1 ("lo" on Linux): gloo's, for a group on one node
    (else gloo listens on whatever address the host name resolves to)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs):
            return name
    raise RuntimeError(f"no network interface carries {LOOPBACK}")
