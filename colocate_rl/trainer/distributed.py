"""torch.distributed + Megatron parallel state for the actor, and a local N-rank launcher.

Rank layout is Megatron's (tp fastest, then dp, then pp; experts parallel across tp x dp ranks).
On CPU the process group is gloo; on CUDA/ROCm it is nccl (RCCL on ROCm).
"""

from __future__ import annotations

import errno
import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from colocate_rl import platform, ports


def init_process_group() -> tuple[int, int]:
    """Joins (or creates) the default process group from RANK / WORLD_SIZE / MASTER_* env; a single
    process with none of them set becomes a world of one. Rank 0 serves the store on MASTER_ADDR only
    (colocate_rl.ports.tcp_store: on MASTER_PORT's held socket when this process reserved that port), and
    a group on loopback keeps gloo's own sockets there too. Returns (rank, world size)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    addr = os.environ.setdefault("MASTER_ADDR", ports.LOOPBACK)
    # A lone process (no WORLD_SIZE) takes a port of its own: a MASTER_PORT it inherited belongs to its
    # parent's process group (a test runner, a launcher), which is still listening on it.
    if "MASTER_PORT" not in os.environ or "WORLD_SIZE" not in os.environ:
        if world > 1:
            raise RuntimeError("WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT in the environment")
        os.environ["MASTER_PORT"] = str(ports.reserve_port(addr))
    if ports.is_loopback(addr):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ports.loopback_interface())
    if platform.has_gpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    timeout = timedelta(minutes=30)
    store = ports.tcp_store(addr, int(os.environ["MASTER_PORT"]), world, rank == 0, timeout, multi_tenant=True)
    # Prefixed as torch prefixes an env:// store.
    dist.init_process_group(platform.dist_backend(), store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world, timeout=timeout)
    return rank, world


def init_model_parallel(tp: int, pp: int, ep: int, seed: int) -> None:
    """Megatron's parallel groups and RNG states (experts not tensor-parallel: ETP = 1)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
    )
    model_parallel_cuda_manual_seed(seed)


# What a rank raises when the port run_on_ranks picked was taken before rank 0's store bound it.
_PORT_TAKEN = "the port picked for this process group was taken before its store bound it"


def _worker(local_rank: int, world: int, port: int, out: str, fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      MASTER_ADDR=ports.LOOPBACK, MASTER_PORT=str(port))
    try:
        init_process_group()
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise RuntimeError(f"{_PORT_TAKEN} ({port})") from None
        raise
    try:
        result = fn(*args)
        if local_rank == 0:
            torch.save(result, out)
    finally:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args) -> Any:
    """Runs ``fn(*args)`` on ``world_size`` fresh local processes (one process group) and returns
    rank 0's result. ``fn`` must be importable (module level); a rank's exception is re-raised here."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pt")
        for attempt in range(3):
            try:
                mp.spawn(_worker, args=(world_size, ports.free_port(), out, fn, args), nprocs=world_size, join=True)
                break
            except mp.ProcessRaisedException as e:
                # The ranks take seconds to start, and another process can bind the free port picked
                # here meanwhile; nothing of fn has run then, so start again on another port.
                if _PORT_TAKEN not in str(e) or attempt == 2:
                    raise
        return torch.load(out, weights_only=True)  # what rank 0 returned: tensors and plain containers
