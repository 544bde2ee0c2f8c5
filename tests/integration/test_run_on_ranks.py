"""run_on_ranks (the local N-rank launcher) picks a free port in the parent and the ranks bind it
seconds later: when another process took it meanwhile, it starts the ranks again on another port
instead of failing the run (seen once in CI, two test workers side by side)."""

from __future__ import annotations

import socket

import torch.distributed as dist

from colocate_rl import ports
from colocate_rl.trainer import distributed


def world_size_seen() -> int:
    return dist.get_world_size()


def test_a_port_taken_before_the_store_binds_it_is_picked_again(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port, picked, real = taken.getsockname()[1], [], ports.free_port

        def pick() -> int:  # the taken port first, then free ones
            picked.append(real() if picked else port)
            return picked[-1]

        monkeypatch.setattr(ports, "free_port", pick)
        assert distributed.run_on_ranks(world_size_seen, 2) == 2
    assert len(picked) == 2 and picked[0] == port != picked[1]
