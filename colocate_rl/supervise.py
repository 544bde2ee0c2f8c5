"""The run survives its own crash: ``supervise.max_restarts=N`` runs the recipe as a child process
and, when the child dies (a killed process, a rank or engine error it could not recover from),
starts it again from its newest intact checkpoint, at most N times. A config error or other bad
input (exit code 2), the NaN stop and Ctrl-C end the run: starting again would only repeat them.

Signals: the child runs in a process group of its own, in the supervisor's session and terminal, so
a Ctrl-C at the terminal reaches only the supervisor, which passes it on. The first Ctrl-C, SIGTERM
or SIGHUP is sent to the run's main process as a SIGINT: it stops after its step and writes a
checkpoint (loop.StopOnInterrupt), while its engines and workers, which would die of a SIGINT of
their own, are stopped by it in order. A second stops the run at once; a third kills its group.
After a signal the supervisor never restarts.

Every restart and signal is logged to the console and to ``<run folder>/supervisor.log``. What the
child leaves behind when it ends (engine processes, reward workers) is killed with its group before
the supervisor goes on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from colocate_rl.config import Config
from colocate_rl.metrics import read
from colocate_rl.private import opener, private_dir

# Exit codes of a run that its supervisor does not restart after: restarting cannot help. The
# command line (cli.main) ends with them.
EXIT_CONFIG, EXIT_NONFINITE, EXIT_INTERRUPTED = 2, 3, 130
FINAL = {0: "finished", EXIT_CONFIG: "bad input", EXIT_NONFINITE: "the NaN stop", EXIT_INTERRUPTED: "Ctrl-C"}
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def cause(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def last_step(run_dir: Path) -> int:
    """The last step in the run's metrics (a last line cut short by a crash is left out)."""
    path = run_dir / "metrics.jsonl"
    return max((r.get("step", 0) for r in read(path)), default=0) if path.is_file() else 0


class Forwarder:
    """While active, SIGINT, SIGTERM and SIGHUP to the supervisor are passed on to the child: the
    first and the second as a SIGINT to its main process (stop after the step; stop now), a later
    one as a SIGKILL to its whole group. The handler only makes system calls (kill, write): it may
    interrupt the supervisor anywhere."""

    def __init__(self, log: Path):
        self.log, self.received, self.sent = log, 0, 0
        self.child: Optional[subprocess.Popen] = None
        self._previous: dict[int, object] = {}

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        """The child, in a process group of its own; a signal that came while it was starting is
        passed on once it exists."""
        child = subprocess.Popen(cmd, env=env, process_group=0)
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        try:
            self.child, self.sent = child, 0
            if self.received:
                self._forward(signal.SIGINT.name)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        return child

    def _forward(self, name: str) -> None:
        self.sent += 1
        if self.sent <= 2:
            os.kill(self.child.pid, signal.SIGINT)
            _note(self.log, f"{name}: asked the run to stop " + ("after its step" if self.sent == 1 else "now"))
        else:
            _kill_group(self.child.pid)
            _note(self.log, f"{name}: killed the run")

    def _handle(self, signum: int, frame) -> None:
        self.received += 1
        if self.child is not None and self.child.returncode is None:
            self._forward(signal.Signals(signum).name)

    def __enter__(self) -> "Forwarder":
        self._previous = {s: signal.signal(s, self._handle) for s in FORWARDED}
        return self

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)


def supervise(cfg: Config, name: str, argv: list[str]) -> int:
    """Runs the recipe command ``argv`` as the run ``name`` (plan.run_name: every attempt writes into
    one run folder) until it finishes or stops for good. Returns the exit code of the last attempt
    (128 + the signal's number when it was killed)."""
    run_dir = private_dir(Path(cfg.logging.run_dir) / name)
    log = run_dir / "supervisor.log"
    base = [sys.executable, sys.argv[0], *argv, f"logging.run_name={name}"]
    limit = cfg.supervise.max_restarts
    with Forwarder(log) as signals:
        for attempt in range(limit + 1):
            if signals.received:  # between attempts: the run is not started again
                _note(log, "stopped by a signal before restarting the run")
                return EXIT_INTERRUPTED
            # Later attempts continue from this run's own newest checkpoint, whatever the first resumed from.
            cmd = base + (["checkpoint.resume=auto"] if attempt else [])
            child = signals.start(cmd, {**os.environ, "COLOCATE_RL_ATTEMPT": str(attempt)})
            code = child.wait()
            _kill_group(child.pid)
            if signals.received or code in FINAL or attempt == limit:
                if not signals.received and code not in FINAL:
                    _note(log, f"the run died ({cause(code)}) after step {last_step(run_dir)}; "
                               f"{limit} restart(s) used: giving up")
                return 128 - code if code < 0 else code
            _note(log, f"restart {attempt + 1}/{limit}: the run died ({cause(code)}) after step "
                       f"{last_step(run_dir)}; resuming from its newest intact checkpoint")
    raise AssertionError("unreachable")


def _kill_group(pgid: int) -> None:
    """Whatever is left in the child's process group (engine cores, reward workers)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _note(log: Path, line: str) -> None:
    """The line on the console and in the log, by plain writes (it is called from a signal handler)."""
    os.write(sys.stdout.fileno(), f"[supervisor] {line}\n".encode())
    fd = opener(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n".encode())
    finally:
        os.close(fd)
