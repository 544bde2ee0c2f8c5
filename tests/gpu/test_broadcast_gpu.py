"""The weight broadcast over NCCL (RCCL on ROCm) between two GPUs, one process each, as the
disaggregated mode runs it: round trip of bf16 and block-FP8 buckets bit-exact, and a member that
stops taking part turns into a BroadcastTimeout naming the group and the rank."""

from __future__ import annotations

import socket

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip(f"needs 2 GPUs (torch.cuda.device_count() is {torch.cuda.device_count()})", allow_module_level=True)

import torch.multiprocessing as mp

from colocate_rl.weight_sync.broadcast import BroadcastGroup, BroadcastTimeout, GroupSpec
from colocate_rl.weight_sync.buckets import pack, unpack
from colocate_rl.weight_sync.quantize import quantize_named


def _spec(name: str, timeout_s: float) -> GroupSpec:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return GroupSpec(name, "127.0.0.1", port, 2, "nccl", timeout_s)


def _named(device):
    g = torch.Generator(device="cpu").manual_seed(0)
    named = [(f"layers.{i}.mlp.down_proj.weight", torch.randn(512, 768, generator=g)) for i in range(4)]
    named.append(("model.norm.weight", torch.randn(512, generator=g)))
    named = [(n, t.to(torch.bfloat16).to(device)) for n, t in named]
    return list(quantize_named(iter(named), {"layers.0.mlp.down_proj.weight": "fp8_block"}))


def _member(rank: int, spec: GroupSpec, mode: str, q) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    try:
        group = BroadcastGroup(spec, rank, dev)
        if rank == 0:
            stats = group.send(pack(iter(_named(dev)), bucket_mb=0.5))
            q.put(("sent", stats.buckets))
        elif mode == "silent":  # formed the group with rank 0, then never takes part in a broadcast
            import time

            time.sleep(3 * spec.timeout_s)
            q.put(("silent", None))
        else:
            got = {}
            group.receive(lambda b: got.update({n: t.view(torch.uint8).cpu().clone() for n, t in unpack(b)}))
            want = {n: t.view(torch.uint8).cpu() for n, t in _named(dev)}
            q.put(("equal", set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)))
    except BroadcastTimeout as e:
        q.put(("timeout", str(e)))


def _run(mode: str, timeout_s: float) -> list:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    spec = _spec(f"gpu-{mode}", timeout_s)
    procs = [ctx.Process(target=_member, args=(r, spec, mode, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = [q.get(timeout=180) for _ in range(2)]
    for p in procs:
        p.join(60)
    return out


def test_round_trip_over_nccl_is_bit_exact():
    out = dict(_run("roundtrip", 120))
    assert out.get("equal") is True, out
    assert out["sent"] >= 3, "several buckets: the pipeline was exercised"


def test_silent_member_times_out_naming_group_and_rank():
    out = _run("silent", 5)
    msgs = [m for kind, m in out if kind == "timeout"]
    assert msgs and "weight broadcast group 'gpu-silent' rank 0 of 2" in msgs[0], out
