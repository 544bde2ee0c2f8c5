"""The weight broadcast group on CPU (gloo): two members in two threads of this process, real
process groups over localhost. Round trip in the IPC bucket format (FP8 included), pipelining
across several buckets, and a hang that times out naming the group and the rank."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from colocate_rl.weight_sync.broadcast import BroadcastGroup, BroadcastTimeout, GroupSpec
from colocate_rl.weight_sync.buckets import pack
from colocate_rl.weight_sync.fp8 import quantize_named


def _spec(name: str, timeout_s: float = 30.0, world: int = 2) -> GroupSpec:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return GroupSpec(name, "127.0.0.1", port, world, "gloo", timeout_s)


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


def test_round_trip_many_buckets_and_fp8():
    g = torch.Generator().manual_seed(0)
    named = [(f"layers.{i}.w", torch.randn(64, 256, generator=g)) for i in range(6)]
    named += [("norm", torch.randn(64, generator=g).to(torch.bfloat16)),
              ("proj.weight", torch.randn(256, 128, generator=g))]
    expected = dict(quantize_named(iter(named), {"proj.weight"}))
    spec = _spec("roundtrip")
    received: dict[str, torch.Tensor] = {}

    def receiver():
        group = BroadcastGroup(spec, 1)
        try:
            return group.receive(lambda views: received.update({n: t.clone() for n, t in views}))
        finally:
            group.close()

    th, out = _in_thread(receiver)
    sender = BroadcastGroup(spec, 0)
    stats = sender.send(pack(quantize_named(iter(named), {"proj.weight"}), bucket_mb=0.1))
    th.join(30)
    sender.close()
    assert "error" not in out, out.get("error")
    assert stats.buckets >= 6 and out["value"].buckets == stats.buckets and out["value"].bytes == stats.bytes
    assert set(received) == set(expected)
    for name, t in expected.items():
        assert received[name].dtype == t.dtype and received[name].shape == t.shape, name
        assert torch.equal(received[name].view(torch.uint8), t.view(torch.uint8)), name


def test_hung_broadcast_times_out_naming_group_and_rank():
    spec = _spec("hang-test", timeout_s=2.0)
    joined = threading.Event()

    def silent_member():  # joins the group, then never takes part in a broadcast
        group = BroadcastGroup(spec, 1)
        joined.set()
        threading.Event().wait(6)
        group.close()

    th, _ = _in_thread(silent_member)
    sender = BroadcastGroup(spec, 0)
    assert joined.wait(30)
    # Whichever notices first, the host-side wait or gloo's own timeout, names the group and rank.
    with pytest.raises(BroadcastTimeout, match=r"group 'hang-test' rank 0 of 2: the sizes of bucket 0 (did not "
                                               r"complete within 2 s|failed: .*[Tt]imed out)"):
        sender.send(pack([("w", torch.ones(8))], bucket_mb=1))
    sender.close()


def test_missing_member_fails_to_form_in_time():
    spec = _spec("lonely", timeout_s=1.5, world=3)
    th, out = _in_thread(lambda: BroadcastGroup(spec, 1))
    with pytest.raises(BroadcastTimeout, match=r"group 'lonely' rank 0 of 3: could not form the group"):
        BroadcastGroup(spec, 0)
    th.join(10)
