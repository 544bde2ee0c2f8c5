"""The run survives its own crash: ``supervise.max_restarts=N`` runs the recipe as a child process
and, when the child dies (a killed process, a rank or engine error it could not recover from),
starts it again from its newest intact checkpoint, at most N times. A config error, the NaN stop
and Ctrl-C end the run: starting again would only repeat them.

Every restart is logged with its cause to the console and to ``<run folder>/supervisor.log``. The
child runs in a process group of its own; what it leaves behind when it dies (engine processes,
reward workers) is killed with the group before the next attempt.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from colocate_rl.cli import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_NONFINITE
from colocate_rl.config import Config

FINAL = {0: "finished", EXIT_CONFIG: "a config error", EXIT_NONFINITE: "the NaN stop", EXIT_INTERRUPTED: "Ctrl-C"}


def cause(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((r.get("step", 0) for r in rows), default=0)


def supervise(cfg: Config, argv: list[str]) -> int:
    """Returns the exit code of the last attempt."""
    name = cfg.logging.run_name or f"{cfg.recipe or 'run'}-{cfg.preset or 'custom'}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.logging.run_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "supervisor.log"
    base = [sys.executable, sys.argv[0], *argv, f"logging.run_name={name}"]
    limit = cfg.supervise.max_restarts
    for attempt in range(limit + 1):
        # Later attempts continue from this run's own newest checkpoint, whatever the first resumed from.
        cmd = base + (["checkpoint.resume=auto"] if attempt else [])
        child = subprocess.Popen(cmd, env={**os.environ, "COLOCATE_RL_ATTEMPT": str(attempt)}, start_new_session=True)
        try:
            code = child.wait()
        except KeyboardInterrupt:  # the child got the Ctrl-C too (same terminal): let it stop cleanly
            code = child.wait()
        _kill_group(child.pid)
        if code in FINAL or attempt == limit:
            if code not in FINAL:
                _note(log, f"the run died ({cause(code)}) after step {last_step(run_dir)}; "
                           f"{limit} restart(s) used: giving up")
            return code
        _note(log, f"restart {attempt + 1}/{limit}: the run died ({cause(code)}) after step {last_step(run_dir)}; "
                   "resuming from its newest intact checkpoint")
    raise AssertionError("unreachable")


def _kill_group(pgid: int) -> None:
    """Whatever the dead child left in its process group (engine cores, reward workers)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _note(log: Path, line: str) -> None:
    print(f"[supervisor] {line}", flush=True)
    with log.open("a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
