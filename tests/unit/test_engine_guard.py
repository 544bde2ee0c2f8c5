"""The guard around vLLM's synchronous multiprocess client (rollout.engine._guard_client), on a
stand-in client with the same attributes: its sends and its shutdown never overlap (a ZMQ socket
closed by one thread while another sends on it aborts the process), and once its output thread
has ended every call still waiting is answered with EngineDeadError."""

from __future__ import annotations

import gc
import queue
import threading
import weakref
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from colocate_rl.rollout.engine import _guard_client

EngineDeadError = pytest.importorskip("vllm.v1.engine.exceptions").EngineDeadError


class StandIn:
    """SyncMPClient's parts the guard uses. ``_send_input`` blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.resources = SimpleNamespace(engine_dead=False)
        self.outputs_queue: queue.Queue = queue.Queue()
        self.utility_results: dict[int, Future] = {}
        self.stop_output = threading.Event()
        self.output_queue_thread = threading.Thread(target=self.stop_output.wait, daemon=True)
        self.output_queue_thread.start()
        self.sending, self.release = threading.Event(), threading.Event()
        self.events: list[str] = []

    def _send_input(self, request_type: int, request: object) -> None:
        if self.resources.engine_dead:  # vLLM's ensure_alive
            raise EngineDeadError()
        self.events.append("send")
        self.sending.set()
        self.release.wait()
        self.events.append("sent")

    def shutdown(self, timeout: float | None = None) -> None:
        self.resources.engine_dead = True  # vLLM marks the client dead first, then closes its sockets
        self.events.append("shutdown")
        self.stop_output.set()


def test_a_shutdown_waits_for_the_send_in_progress_and_a_later_send_finds_the_client_dead():
    client = StandIn()
    _guard_client(client)
    sender = threading.Thread(target=client._send_input, args=(0, "request"), daemon=True)
    sender.start()
    client.sending.wait()
    stopper = threading.Thread(target=client.shutdown, daemon=True)  # vLLM's monitor, on the engine's death
    try:
        stopper.start()
        stopper.join(timeout=0.5)  # with the guard it stays blocked however long this waits
        assert stopper.is_alive(), "the shutdown ran while a send was on the socket"
    finally:
        client.release.set()
    sender.join()
    stopper.join()
    assert client.events == ["send", "sent", "shutdown"]
    with pytest.raises(EngineDeadError):
        client._send_input(0, "after")


def test_waiters_are_answered_when_the_output_thread_ends():
    client = StandIn()
    waiting: Future = Future()
    client.utility_results[1] = waiting  # a utility call (collective_rpc) waiting for its answer
    _guard_client(client)
    client.stop_output.set()  # the output thread ends: nothing will answer the client any more
    with pytest.raises(EngineDeadError):
        waiting.result()
    assert isinstance(client.outputs_queue.get(), EngineDeadError)  # a generate() waiting on the queue
    assert client.resources.engine_dead


def test_the_guard_keeps_no_reference_to_the_client():
    client = StandIn()
    _guard_client(client)
    ref = weakref.ref(client)
    gc.disable()
    try:
        del client
        assert ref() is None, "the guarded client outlived its last reference"
    finally:
        gc.enable()


def test_an_in_process_client_is_left_alone():
    client = SimpleNamespace(shutdown=lambda: None)
    _guard_client(client)
    assert not hasattr(client, "_send_input")


def test_compile_caches_go_to_one_folder_and_the_environment_wins(monkeypatch, tmp_path):
    from colocate_rl.rollout.engine import COMPILE_CACHES, use_compile_cache

    for var in COMPILE_CACHES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    got = use_compile_cache(str(tmp_path))
    assert got["TRITON_CACHE_DIR"] == "/elsewhere"
    assert got["TILELANG_CACHE_DIR"] == str(tmp_path / "tilelang") and got["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm")
    for var in COMPILE_CACHES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("COLOCATE_RL_CACHE", str(tmp_path / "c"))
    assert use_compile_cache("")["QUACK_CACHE_DIR"] == str(tmp_path / "c" / "compile" / "quack")
    for var in COMPILE_CACHES:
        monkeypatch.delenv(var, raising=False)
    assert use_compile_cache("default") == {}
