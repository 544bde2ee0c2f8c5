"""Runs untrusted Python programs: one launcher process per program (``launcher.py``), killed with
everything it started at the end in every case.

What holds, by ``ToolsConfig.isolation``:

- ``namespaces`` (Linux; as root, or with user namespaces): the program runs in its own mount,
  network, pid, ipc and uts namespaces, chrooted into a root that holds read-only binds of the
  system folders and Python's prefixes and nothing else of the host (no project folder, no /tmp,
  no sockets); it writes only to ``/scratch``, a tmpfs of ``scratch_mb`` that is its HOME, TMPDIR
  and working folder and vanishes with it. The network namespace has no interface up, so no
  connection leaves it. As root the program runs as one of ``max_concurrency`` unprivileged uids
  from ``sandbox_uid`` (no capabilities; RLIMIT_NPROC counts that sandbox's processes); without
  root, as uid 1000 of a user namespace of its own (its exec drops every capability there). When
  the program exits or is stopped, the namespace's init exits and the kernel kills every process
  in it, including those that ``setsid()`` away.
- ``audit`` (the fallback where namespaces are refused): the program runs as the host's user in a
  fresh folder under ``scratch_root``, under a ``sys.addaudithook`` hook installed before its code
  that refuses sockets, new processes, signals, ctypes, and opening for writing, removing or
  renaming outside that folder. This is much weaker: audit hooks are no security boundary (a C
  extension, or a bug in the hook's coverage, gets past them), the program can read whatever the
  host's user can, RLIMIT_NPROC is not set (it would count all of the user's processes; forking is
  refused instead), and the folder's size is bounded by RLIMIT_FSIZE per file only.

In both: RLIMIT_CPU (``cpu_s``; SIGKILL a second later), RLIMIT_AS (``memory_mb``),
RLIMIT_NOFILE, RLIMIT_FSIZE, no core files; a wall clock (``timeout_s``) after which the sandbox is
killed; stdout and stderr read through one pipe with a cap (``output_bytes``: the reader never
holds more, and a program printing past it is stopped); a minimal environment (no variable of the
host's reaches the program).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from colocate_rl.config import ToolsConfig

log = logging.getLogger(__name__)

LAUNCHER = str(Path(__file__).with_name("launcher.py"))
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc")
USERNS_UID = 1000  # the program's uid inside its user namespace (not root)
# How long a stopped sandbox may take to be gone: the kernel empties a pid namespace by itself, so
# this only bounds a launcher that stopped answering.
_STOP_GRACE_S = 60.0


class SandboxUnavailable(RuntimeError):
    """The machine cannot run the sandbox as configured (a setting, not a program, is at fault)."""


@dataclass(frozen=True)
class RunResult:
    output: str  # stdout and stderr as the program wrote them, at most output_bytes (UTF-8, replaced)
    exit_code: int | None = None  # None: ended by a signal, or stopped
    signal: int | None = None  # the signal that ended it (SIGXCPU/SIGKILL: its CPU time ran out)
    stopped: str = ""  # why the host stopped it: "timeout" or "output"
    setup_error: str = ""  # the sandbox itself could not start

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.stopped and not self.setup_error


def _root_binds() -> tuple[list[str], list[list[str]]]:
    """What the sandbox's root holds: folders bound read-only (each once, outermost only) and the
    system folders that are symlinks (/bin -> usr/bin on merged-/usr systems)."""
    links = [[p, os.readlink(p)] for p in SYSTEM_DIRS if os.path.islink(p)]
    binds = {p for p in SYSTEM_DIRS if os.path.isdir(p) and not os.path.islink(p)}
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable))):
        binds.add(os.path.realpath(p))
    outer = [b for b in binds if not any(b.startswith(o + "/") for o in binds)]
    return sorted(outer), links


class Sandbox:
    """``Sandbox(cfg).run(code) -> RunResult``; at most ``cfg.max_concurrency`` programs run at
    once (further calls wait for a slot). Thread-safe."""

    def __init__(self, cfg: ToolsConfig):
        self.cfg = cfg
        self._root = os.geteuid() == 0
        self._slots: queue.Queue = queue.Queue()
        for i in range(cfg.max_concurrency):
            self._slots.put(cfg.sandbox_uid + i if self._root else USERNS_UID)
        self._isolation = ""
        self._lock = threading.Lock()
        self._binds, self._links = _root_binds()

    @property
    def isolation(self) -> str:
        """"namespaces" or "audit": what this machine gives (probed once with a one-line program)."""
        with self._lock:
            if not self._isolation:
                self._isolation = self._choose()
            return self._isolation

    def _choose(self) -> str:
        if self.cfg.isolation == "audit":
            return "audit"
        if self._root:
            taken = [u for u in range(self.cfg.sandbox_uid, self.cfg.sandbox_uid + self.cfg.max_concurrency)
                     if _has_account(u)]
            if taken:
                raise SandboxUnavailable(f"tools.sandbox_uid={self.cfg.sandbox_uid}: uid {taken[0]} belongs to an "
                                         f"account; pick {self.cfg.max_concurrency} uids no account uses")
        probe = self._run("print('ok')", "namespaces")
        if probe.ok and probe.output == "ok\n":
            return "namespaces"
        why = probe.setup_error or probe.output.strip() or f"exit {probe.exit_code}"
        if self.cfg.isolation == "namespaces":
            raise SandboxUnavailable(f"tools.isolation=namespaces: this machine refuses the sandbox's "
                                     f"namespaces ({why})")
        log.warning("tools sandbox: namespaces refused (%s); falling back to an audit hook, which is weaker", why)
        return "audit"

    def run(self, code: str) -> RunResult:
        """Runs ``code`` as a program's main module; never raises for anything the program does."""
        return self._run(code, self.isolation)

    def _run(self, code: str, isolation: str) -> RunResult:
        data = code.encode("utf-8", "surrogatepass")
        if len(data) > self.cfg.max_code_bytes:
            return RunResult("", setup_error=f"the program is {len(data)} bytes, more than the "
                                              f"{self.cfg.max_code_bytes} allowed")
        uid = self._slots.get()
        scratch = None
        try:
            if isolation == "audit":
                root = self.cfg.scratch_root or tempfile.gettempdir()
                scratch = tempfile.mkdtemp(prefix="sandbox-", dir=root)  # 0700, the host user's
            return self._launch(data, self._spec(isolation, uid, scratch))
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            self._slots.put(uid)

    def _spec(self, isolation: str, uid: int, scratch: str | None) -> dict:
        cfg, mb = self.cfg, 1 << 20
        rlimits = {"RLIMIT_AS": cfg.memory_mb * mb, "RLIMIT_NOFILE": cfg.max_open_files,
                   "RLIMIT_FSIZE": cfg.max_file_mb * mb}
        if isolation == "namespaces":
            rlimits["RLIMIT_NPROC"] = cfg.max_processes
        venv_bin = os.path.dirname(sys.executable)
        return dict(
            isolation=isolation, drop_to_uid=self._root and isolation == "namespaces", uid=uid, gid=uid,
            cpu_s=cfg.cpu_s, rlimits=rlimits, scratch_bytes=cfg.scratch_mb * mb, scratch_inodes=cfg.scratch_files,
            scratch=scratch, python=sys.executable, host_pid=os.getpid(), binds=self._binds, links=self._links,
            env={"PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                 "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                 "MPLBACKEND": "Agg"},
        )

    def _launch(self, code: bytes, spec: dict) -> RunResult:
        status_r, status_w = os.pipe()
        spec["status_fd"] = status_w
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", LAUNCHER, json.dumps(spec)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(status_w,), start_new_session=True,
                cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        pidfd = -1
        try:
            pidfd = os.pidfd_open(proc.pid)
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(code)
                proc.stdin.close()
            output, stopped = self._collect(proc, pidfd)
            if stopped:
                self._stop(proc, pidfd)
        finally:
            with contextlib.suppress(ProcessLookupError):  # stragglers of its group (audit isolation)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if pidfd >= 0:
                os.close(pidfd)
            proc.stdout.close()
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
        events = _read_events(status_r)
        text = output.decode("utf-8", "replace")
        if "setup" in events:
            return RunResult(text, setup_error=events["setup"])
        return RunResult(text, exit_code=events.get("exit"), signal=events.get("signal"), stopped=stopped)

    def _collect(self, proc: subprocess.Popen, pidfd: int) -> tuple[bytes, str]:
        """The program's output until the launcher has exited and the pipe is drained; stops at the
        wall clock ("timeout") or at the byte cap ("output")."""
        cap, deadline = self.cfg.output_bytes, time.monotonic() + self.cfg.timeout_s
        out, fd = bytearray(), proc.stdout.fileno()
        exited = eof = False
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            sel.register(pidfd, selectors.EVENT_READ)
            while not (exited and eof):
                left = deadline - time.monotonic()
                if left <= 0:
                    return bytes(out), "timeout"
                for key, _ in sel.select(left):
                    if key.fd == pidfd:
                        exited = True
                        sel.unregister(pidfd)
                        continue
                    chunk = os.read(fd, min(1 << 16, cap + 1 - len(out)))
                    if not chunk:
                        eof = True
                        sel.unregister(fd)
                    out += chunk
                    if len(out) > cap:
                        return bytes(out[:cap]), "output"
        return bytes(out), ""

    def _stop(self, proc: subprocess.Popen, pidfd: int) -> None:
        """SIGTERM to the launcher, which kills the namespace's init and exits once every process
        in it is gone; SIGKILL to its whole group if it has not done so in time."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        with selectors.DefaultSelector() as sel:
            sel.register(pidfd, selectors.EVENT_READ)
            if not sel.select(_STOP_GRACE_S):
                log.warning("tools sandbox: launcher %d did not stop within %.0f s; killing its group",
                            proc.pid, _STOP_GRACE_S)


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def _read_events(fd: int) -> dict:
    """The launcher's status lines (every writer has exited), merged: {"exit"|"signal"|"setup": ...}."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    os.close(fd)
    events: dict = {}
    for line in data.decode("utf-8", "replace").splitlines():
        with contextlib.suppress(ValueError, TypeError):
            for k, v in json.loads(line).items():
                events.setdefault(k, v)
    return events
