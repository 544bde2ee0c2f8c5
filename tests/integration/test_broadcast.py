"""The weight broadcast group on CPU (gloo): two members in two threads of this process, real
process groups over localhost. Round trip in the IPC bucket format (FP8 included), pipelining
across several buckets, a hang that times out naming the group, the rank that waited and the
ranks that are silent, and a forged header (a pickle, bad JSON, wrong fields) that the receiver
rejects in one line without running or loading anything."""

from __future__ import annotations

import json
import pickle
import threading

import pytest
import torch

from colocate_rl.ports import reserve_port
from colocate_rl.weight_sync.broadcast import BroadcastGroup, BroadcastTimeout, GroupSpec
from colocate_rl.weight_sync.buckets import pack, unpack
from colocate_rl.weight_sync.quantize import quantize_named
from colocate_rl.weight_sync.ipc import WeightSyncError


def _spec(name: str, timeout_s: float = 30.0, world: int = 2) -> GroupSpec:
    port = reserve_port("127.0.0.1")  # held by this process, where rank 0 serves the store, as placement does
    members = ("actor rank 0 on 10.0.0.1", "engine 0 worker 0 on 10.0.0.3") if world == 2 else ()
    return GroupSpec(name, "127.0.0.1", port, world, "gloo", timeout_s, members)


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
    expected = dict(quantize_named(iter(named), {"proj.weight": "fp8_block"}))
    spec = _spec("roundtrip")
    received: dict[str, torch.Tensor] = {}

    def receiver():
        group = BroadcastGroup(spec, 1)
        try:
            return group.receive(lambda b: received.update({n: t.clone() for n, t in unpack(b)}))
        finally:
            group.close()

    th, out = _in_thread(receiver)
    sender = BroadcastGroup(spec, 0)
    stats = sender.send(pack(quantize_named(iter(named), {"proj.weight": "fp8_block"}), bucket_mb=0.1))
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
    # Whichever notices first, the host-side wait or gloo's own timeout, names the group and rank,
    # and the member that never took part (read from the group's store).
    with pytest.raises(BroadcastTimeout, match=r"group 'hang-test' rank 0 of 2: the sizes of bucket 0 (did not "
                                               r"complete within 2 s|failed: .*[Tt]imed out).*; silent: rank 1 "
                                               r"\(engine 0 worker 0 on 10.0.0.3\) joined, never started this sync$"):
        sender.send(pack([("w", torch.ones(8))], bucket_mb=1))
    sender.close()


def test_timeout_names_the_member_that_stopped_mid_sync():
    """A member that took part in the first buckets and then stops is named with the bucket it
    reached; a member that finished the previous sync but not this one is told apart."""
    spec = _spec("stall", timeout_s=2.0, world=3)
    got_two, release = threading.Event(), threading.Event()

    def stalls_after_two_buckets():
        group = BroadcastGroup(spec, 1)
        seen = []

        def load(bucket):
            seen.append(1)
            if len(seen) == 2:
                got_two.set()
                release.wait(30)  # stops taking part while bucket 2 is on the wire

        try:
            group.receive(load)
        except BroadcastTimeout:
            pass
        finally:
            group.close()

    def keeps_up():
        group = BroadcastGroup(spec, 2)
        try:
            group.receive(lambda bucket: None)
        except BroadcastTimeout:
            pass
        finally:
            group.close()

    threads = [_in_thread(stalls_after_two_buckets)[0], _in_thread(keeps_up)[0]]
    sender = BroadcastGroup(spec, 0)
    named = [(f"w{i}", torch.ones(64 * 1024)) for i in range(6)]  # 256 KiB each: one bucket each
    with pytest.raises(BroadcastTimeout, match=r"rank 0 of 3: .*bucket [34].*; silent: rank 1 at bucket [23]$"):
        sender.send(pack(named, bucket_mb=0.25))
    release.set()
    assert got_two.is_set()
    sender.close()
    for th in threads:
        th.join(15)


def test_missing_member_fails_to_form_in_time():
    spec = _spec("lonely", timeout_s=1.5, world=3)
    th, out = _in_thread(lambda: BroadcastGroup(spec, 1))
    with pytest.raises(BroadcastTimeout, match=r"group 'lonely' rank 0 of 3: could not form the group .*; "
                                               r"silent: rank 2 never joined$"):
        BroadcastGroup(spec, 0)
    th.join(10)


class _CreatesFile:
    """Unpickled, it opens ``path`` for writing: a file appears if anything unpickles the header."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _forged(kind: str, marker: str) -> bytes:
    return {
        "a pickle": pickle.dumps([_CreatesFile(marker)]),
        "malformed JSON": b'{"dtype": "float32", "tensors": [["w", [2], 0',
        "wrong fields": json.dumps({"dtype": "float32", "tensors": [["w", [2], 0, "2"]]}).encode(),
    }[kind]


@pytest.mark.parametrize("kind,why", [("a pickle", "not JSON"), ("malformed JSON", "not JSON"),
                                      ("wrong fields", "not [name, shape (sizes), offset, numel]")])
def test_a_forged_header_is_rejected_and_nothing_runs(tmp_path, kind, why):
    """Rank 0 sends sizes and a header of its own making: the receiver refuses the bucket with one
    line naming the group, its rank and the bucket, loads nothing, and the pickle's code never runs."""
    marker = tmp_path / "created-by-the-header"
    header = _forged(kind, str(marker))
    spec = _spec(f"forged-{kind.replace(' ', '-')}")
    loaded = []

    def receiver():
        group = BroadcastGroup(spec, 1)
        try:
            return group.receive(loaded.append)
        finally:
            group.close()

    th, out = _in_thread(receiver)
    forger = BroadcastGroup(spec, 0)
    forger._sizes(len(header), 8, "bucket 0", 0)
    forger._wait(forger._start(torch.frombuffer(bytearray(header), dtype=torch.uint8)), "the header", 0)
    th.join(30)
    forger.close()
    err = out.get("error")
    assert isinstance(err, WeightSyncError), out
    msg = str(err)
    assert "\n" not in msg and msg.startswith(f"weight broadcast group '{spec.name}' rank 1 of 2: bucket 0 rejected: "
                                              "header"), msg
    assert why in msg, msg
    assert loaded == [] and not marker.exists()
    if kind == "a pickle":  # the bytes were a working payload: unpickled, they create the file
        pickle.loads(header)
        assert marker.exists()
