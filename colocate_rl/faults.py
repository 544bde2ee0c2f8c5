"""Named fault points, so that a fault drill strikes at an exact phase instead of on a timer.

The handoff and the loop call ``point(name, step)`` right before each phase: generate, eval, sleep,
onload, train, offload, wake_weights, sync, wake_kv, checkpoint. Nothing happens unless a drill
asks for it:

- in-process: ``on(hook)`` registers ``hook(name, step)`` (the tests kill the engine at a phase);
- across processes: ``COLOCATE_RL_FAULT=<signal>@<name>:<step>`` sends this process a signal at that
  point of that step: ``kill`` (SIGKILL, a crash), ``int`` (SIGINT, a Ctrl-C) or ``stop`` (SIGSTOP:
  the process waits there until the drill, having done its part, sends it SIGCONT), in the first
  attempt of a supervised run only (``COLOCATE_RL_ATTEMPT`` unset or 0), so the restarted run gets
  past it (the supervisor, Ctrl-C and signal drills in tests/integration/test_checkpoint.py and
  test_supervise.py).
"""

from __future__ import annotations

import os
import signal
from typing import Callable

Hook = Callable[[str, int], None]
_hooks: list[Hook] = []
SIGNALS = {"kill": signal.SIGKILL, "int": signal.SIGINT, "stop": signal.SIGSTOP}  # COLOCATE_RL_FAULT's <signal> names


def on(hook: Hook) -> Callable[[], None]:
    """Registers ``hook``; returns the function that removes it."""
    _hooks.append(hook)
    return lambda: _hooks.remove(hook) if hook in _hooks else None


def point(name: str, step: int) -> None:
    for hook in list(_hooks):
        hook(name, step)
    spec = os.environ.get("COLOCATE_RL_FAULT", "")
    how, _, where = spec.partition("@")
    if how in SIGNALS and where == f"{name}:{step}" and os.environ.get("COLOCATE_RL_ATTEMPT", "0") == "0":
        os.kill(os.getpid(), SIGNALS[how])
