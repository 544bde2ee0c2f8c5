"""The supervisor (supervise.max_restarts) passes signals on, never restarts after one or after bad
input, and leaves no process of the run behind. Real supervised runs of the tiny recipe command, in
a pseudo-terminal where Ctrl-C is what it is at a console: the terminal's SIGINT to its foreground
process group, which holds the supervisor and not the run (the run has a group of its own).

The signal lands at a named phase: the run stops itself (SIGSTOP) when step 3 reaches its train
phase (COLOCATE_RL_FAULT=stop@train:3); the test sends the signal, waits for the supervisor's line
saying it passed it on, and lets the run continue (SIGCONT).

- one Ctrl-C: the run finishes step 3, writes its checkpoint and exits 0; no restart;
- two Ctrl-C: the run stops at once (exit 130) without a step-3 checkpoint; no restart;
- SIGTERM to the supervisor: as one Ctrl-C;
- bad input found by the run itself (an explicit checkpoint.resume whose checkpoint is damaged):
  one line naming the folder and why, exit 2, no restart;
- without a supervisor, Ctrl-C reaches the run's reward workers too, and the run still scores and
  finishes its step.
After each, no process of the run is left (psutil).
"""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from colocate_rl import checkpoint as ck
from colocate_rl.metrics import read

from test_checkpoint import command  # noqa: E402 - same folder

MARK = "COLOCATE_RL_TEST_RUN"  # every process of a run inherits it: how the test finds them all
LIMIT_S = 400  # seconds: a safety net for a hung run, never what triggers a fault


class Terminal:
    """A command in a new pseudo-terminal, as the foreground process group of its session."""

    def __init__(self, cmd: list[str], env: dict[str, str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: its terminal is the pty, its group the foreground one
            os.execve(cmd[0], cmd, env)
        self.out, self.code = b"", None

    def pump(self, wait_s: float = 0.2) -> bool:
        """Reads what the command wrote (the pty would block it when full); False at its end."""
        poll = select.poll()  # not select(): a long test session's descriptors pass its limit of 1024
        poll.register(self.fd, select.POLLIN)
        if poll.poll(wait_s * 1000):
            try:
                chunk = os.read(self.fd, 1 << 16)
            except OSError:  # EIO: every process holding the terminal has closed it
                chunk = b""
            self.out += chunk
            return bool(chunk)
        return True

    def text(self) -> str:
        return self.out.decode(errors="replace").replace("\r\n", "\n")

    def until(self, what: str) -> None:
        deadline = time.monotonic() + LIMIT_S
        while what not in self.text():
            assert self.pump() and time.monotonic() < deadline, f"never saw {what!r}:\n{self.text()[-3000:]}"

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")  # the line discipline turns it into SIGINT to the foreground group

    def wait(self) -> int:
        deadline = time.monotonic() + LIMIT_S
        while self.pump() and time.monotonic() < deadline:
            pass
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)


def supervised(model: Path, run_dir: Path, name: str, **over: str) -> tuple[list[str], dict[str, str]]:
    cmd = command(model, run_dir, name, steps="40", **{"supervise.max_restarts": "1", **over})
    here = str(Path(__file__).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", MARK: uuid.uuid4().hex,
           "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    return cmd, env


def wait_for(term: Terminal, what: str, ready) -> None:
    """Reads the terminal until ``ready()``."""
    deadline = time.monotonic() + LIMIT_S
    while not ready():
        assert term.pump() and time.monotonic() < deadline, f"never {what}:\n{term.text()[-3000:]}"


def stopped(p: psutil.Process) -> bool:
    return p.status() == psutil.STATUS_STOPPED


def stopped_run(term: Terminal) -> psutil.Process:
    """The supervised run's main process once it has stopped itself at its fault point."""
    wait_for(term, "saw the run stop", lambda: any(stopped(p) for p in psutil.Process(term.pid).children()))
    return psutil.Process(term.pid).children()[0]


def pending(pid: int, sig: signal.Signals) -> bool:
    """Whether ``sig`` waits for the (stopped) process ``pid``."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return any(int(fields[k], 16) >> (sig - 1) & 1 for k in ("SigPnd", "ShdPnd"))


def left_behind(mark: str) -> list[str]:
    """The processes of the run still alive (a zombie is gone: only its exit status is left)."""
    out = []
    for p in psutil.process_iter(["pid", "name", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get(MARK) == mark:
                out.append(f"{p.info['pid']} {p.info['name']}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def signalled_run(tiny_model, tmp_path: Path, name: str, send) -> tuple[int, str, Path]:
    """A supervised run stopped at step 3's train phase; ``send(term, run)`` delivers the signals.
    Returns the exit code, the terminal's text and the run folder, having checked nothing is left."""
    cmd, env = supervised(tiny_model("qwen3-tiny"), tmp_path, name)
    term = Terminal(cmd, {**env, "COLOCATE_RL_FAULT": "stop@train:3"})
    run = stopped_run(term)
    assert os.getpgid(run.pid) == run.pid != os.getpgid(term.pid)  # a group of its own, not the terminal's
    members = [run, *run.children(recursive=True)]
    send(term, run)
    code = term.wait()
    assert left_behind(env[MARK]) == [], term.text()[-3000:]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in members)
    log = tmp_path / name / "supervisor.log"
    assert "restart" not in (log.read_text() if log.exists() else ""), log.read_text()
    return code, term.text(), tmp_path / name


def steps_checkpointed(run_dir: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in ck.CheckpointStore(run_dir / "checkpoints", 0).complete()]


# Slow: each test is a real supervised run of the recipe to step 3 (~40 s on 2 cores).
@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl_c", "sigterm"])
def test_a_signal_stops_the_run_after_its_step_with_a_checkpoint(tiny_model, tmp_path, how):
    name = {"ctrl_c": "SIGINT", "sigterm": "SIGTERM"}[how]

    def send(term: Terminal, run: psutil.Process) -> None:
        if how == "ctrl_c":
            term.ctrl_c()
        else:
            os.kill(term.pid, signal.SIGTERM)
        term.until(f"[supervisor] {name}: asked the run to stop after its step")
        run.resume()

    code, out, run_dir = signalled_run(tiny_model, tmp_path, how, send)
    assert code == 0, out[-3000:]
    assert "interrupted: stopped cleanly after step 3" in out, out[-3000:]
    assert steps_checkpointed(run_dir) == [2, 3]
    assert [r["step"] for r in read(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]
    lines = (run_dir / "supervisor.log").read_text().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"{name}: asked the run to stop after its step"), lines
    # What the run wrote (config, metrics, log, checkpoints) is the user's alone.
    modes = {str(p.relative_to(run_dir)): oct(p.stat().st_mode & 0o777) for p in [run_dir, *run_dir.rglob("*")]}
    assert {k: v for k, v in modes.items() if v != ("0o700" if (run_dir / k).is_dir() else "0o600")} == {}
    assert {"config.yaml", "metrics.jsonl", "supervisor.log", "checkpoints/step_00000003/trainer_state.pt",
            "checkpoints/step_00000003/actor/.metadata"} <= modes.keys()


@pytest.mark.slow
def test_a_second_ctrl_c_stops_the_run_at_once(tiny_model, tmp_path):
    def send(term: Terminal, run: psutil.Process) -> None:
        term.ctrl_c()
        term.until("[supervisor] SIGINT: asked the run to stop after its step")
        run.resume()
        term.until("Ctrl-C: stopping after this step")  # the run has taken the first one
        term.ctrl_c()

    code, out, run_dir = signalled_run(tiny_model, tmp_path, "twice", send)
    assert code == 130, out[-3000:]
    assert "stopped cleanly" not in out and "[supervisor] SIGINT: asked the run to stop now" in out, out[-3000:]
    assert steps_checkpointed(run_dir) == [2]  # step 3 was not finished


@pytest.mark.slow
def test_bad_input_found_by_the_run_is_not_restarted(tiny_model, tmp_path):
    # A checkpoint whose manifest names a file that is not there: only the run, loading it, finds out.
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / ck.MANIFEST).write_text('{"step": 2, "files": {"trainer_state.pt": {"size": 10}}}')
    cmd, env = supervised(tiny_model("qwen3-tiny"), tmp_path, "bad", **{"checkpoint.resume": str(damaged)})
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LIMIT_S)
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"checkpoint.resume={damaged}:" in errors[0], p.stderr[-3000:]
    assert f"{damaged}/trainer_state.pt is missing" in errors[0], errors
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "bad" / "supervisor.log").exists()  # nothing to note: no restart
    assert left_behind(env[MARK]) == []


@pytest.mark.slow
def test_ctrl_c_at_the_terminal_of_a_run_without_supervisor(tiny_model, tmp_path):
    """Without a supervisor the terminal's SIGINT reaches every process of the run, its reward
    workers too: they leave stopping to the run, which scores and finishes its step as above. The
    run stops itself before step 3 generates, so that step's scoring comes after the Ctrl-C."""
    cmd, env = supervised(tiny_model("qwen3-tiny"), tmp_path, "direct", **{"supervise.max_restarts": "0"})
    term = Terminal(cmd, {**env, "COLOCATE_RL_FAULT": "stop@generate:3"})
    run = psutil.Process(term.pid)
    wait_for(term, "saw the run stop", lambda: stopped(run))
    workers = [p for p in run.children(recursive=True) if "forkserver" not in " ".join(p.cmdline())]
    assert workers, "the reward workers run in processes of their own"
    term.ctrl_c()
    wait_for(term, "saw the SIGINT reach the run", lambda: pending(run.pid, signal.SIGINT))
    run.resume()
    code = term.wait()
    out = term.text()
    assert code == 0 and "interrupted: stopped cleanly after step 3" in out, out[-3000:]
    assert read(tmp_path / "direct" / "metrics.jsonl")[-1]["reward/errors"] == 0  # no worker died of it
    assert steps_checkpointed(tmp_path / "direct") == [2, 3]
    assert left_behind(env[MARK]) == []
