"""The sandbox's launcher: run as ``python -I -S launcher.py SPEC`` by ``sandbox.Sandbox``, with the
program's source on stdin. Standard library only; it never imports colocate_rl.

Namespaces (``SPEC["isolation"] == "namespaces"``)::

    launcher (host pid namespace; its own session) ── unshare(mount, net, pid, ipc, uts [, user])
      └─ init (pid 1 of the new pid namespace): mounts /proc, chroots, reaps
           └─ program: rlimits, drops to the sandbox uid, execs ``python -I -u main.py``

The root it chroots into is a tmpfs holding read-only binds of the system folders and of Python's
prefixes only, and a size-bounded tmpfs at ``/scratch``: no other host path exists in there. When
the program exits, init exits and the kernel kills every process left in the namespace. SIGTERM
to the launcher kills init and returns once the namespace is empty.

Audit (``"audit"``): no namespaces; the program runs in a host scratch folder under a
``sys.addaudithook`` hook (``AUDIT_BOOT``) that refuses sockets, new processes, signals, ctypes
and writes outside the folder.

Whoever waits for the program (init, or the launcher in audit mode) writes one JSON line to the
status pipe (``SPEC["status_fd"]``) when it ends: ``{"exit": n}`` or ``{"signal": n}``; a sandbox
that could not be built writes ``{"setup": "why"}`` there.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
PR_SET_PDEATHSIG = 1
# Per-mount flags a remount must keep (a user namespace may not clear them: they are locked).
KEPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
_status_fd = -1  # the host's status pipe (SPEC["status_fd"]), not inherited past exec
NEW_ROOT = "/tmp"  # where the sandbox's root tmpfs is mounted, inside its own mount namespace only
SCRATCH = "/scratch"
DEVICES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python 3.12+
        try:
            os.unshare(flags)
        except OSError as e:
            raise SetupError(f"unshare: {e.strerror}") from None
    else:
        _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def _status(**event) -> None:
    try:
        os.write(_status_fd, (json.dumps(event) + "\n").encode())
    except OSError:
        pass


def _die_with_parent() -> None:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _exit_event(status: int) -> dict:
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    return {"exit": os.WEXITSTATUS(status)}


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _mountinfo() -> list[tuple[str, list[str]]]:
    """(mount point, per-mount options) of every mount this process sees."""
    out = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            # the kernel writes space, tab, newline and backslash as \ooo
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])
            out.append((os.fsdecode(point), fields[5].decode().split(",")))
    return out


def _seal(root: str) -> None:
    """Every mount at or under ``root`` read-only and nosuid, keeping its other per-mount flags;
    nodev too except on the device nodes bound under /dev."""
    for point, options in _mountinfo():
        if point == root or point.startswith(root + "/"):
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
            flags |= 0 if point.startswith(root + "/dev/") else MS_NODEV
            flags |= sum(KEPT_FLAGS.get(o, 0) for o in set(options))
            _mount(None, point, None, flags)


def _build_root(spec: dict) -> None:
    """The sandbox's root at NEW_ROOT: read-only binds of spec["binds"], spec["links"] as symlinks,
    a few device nodes, an empty /proc and /tmp, and a writable tmpfs at /scratch."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    sources = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in spec["binds"]}  # before NEW_ROOT hides any
    devices = {d: os.open(f"/dev/{d}", os.O_PATH) for d in DEVICES if os.path.exists(f"/dev/{d}")}
    _mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    os.umask(0o022)
    for path in ("/proc", "/dev", "/tmp", SCRATCH):
        os.makedirs(NEW_ROOT + path, exist_ok=True)
    for path, target in spec["links"]:
        os.symlink(target, NEW_ROOT + path)
    for path, fd in sources.items():
        os.makedirs(NEW_ROOT + path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", NEW_ROOT + path, None, MS_BIND | MS_REC)
    for name, fd in devices.items():
        os.close(os.open(f"{NEW_ROOT}/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
        _mount(f"/proc/self/fd/{fd}", f"{NEW_ROOT}/dev/{name}", None, MS_BIND)
    os.symlink("/proc/self/fd", f"{NEW_ROOT}/dev/fd")
    for fd in (*sources.values(), *devices.values()):
        os.close(fd)
    _seal(NEW_ROOT)
    _mount("tmpfs", NEW_ROOT + SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={spec['scratch_bytes']},nr_inodes={spec['scratch_inodes']},mode=0700,"
           f"uid={spec['uid']},gid={spec['gid']}")


def _enter_user_namespace(spec: dict) -> None:
    """Not root: map the sandbox's uid 1000 onto ours; the program's exec drops every capability
    (its uid in the namespace is not 0), so it cannot undo the mounts."""
    uid, gid = os.geteuid(), os.getegid()
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{spec['uid']} {uid} 1")
    _write("/proc/self/gid_map", f"{spec['gid']} {gid} 1")


def _limit(spec: dict) -> None:
    limits = [(resource.RLIMIT_CPU, spec["cpu_s"], spec["cpu_s"] + 1), (resource.RLIMIT_CORE, 0, 0)]
    limits += [(getattr(resource, k), v, v) for k, v in spec["rlimits"].items()]
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))


def _program(spec: dict, code: bytes, cwd: str, argv: list[str]) -> None:
    """The program's process: limits, the sandbox's user, then exec. Never returns."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _limit(spec)
        if spec["drop_to_uid"]:
            os.setgroups([])
            os.setresgid(spec["gid"], spec["gid"], spec["gid"])
            os.setresuid(spec["uid"], spec["uid"], spec["uid"])
        os.chdir(cwd)
        fd = os.open("main.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, code)
        os.close(fd)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        env = dict(spec["env"], HOME=cwd, TMPDIR=cwd)
        os.execve(spec["python"], argv, env)
    except BaseException as e:  # noqa: BLE001 - reported to the host, never raised past exec
        _status(setup=f"program: {type(e).__name__}: {e}")
        os._exit(126)


def _init(spec: dict, code: bytes) -> None:
    """pid 1 of the sandbox's pid namespace: mounts its /proc, enters the new root, starts the
    program, reaps orphans, and reports the program's end. Never returns."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with_parent()
        os.chroot(NEW_ROOT)
        os.chdir("/")
        try:  # a /proc of this namespace only; without it the program simply has none
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        except SetupError:
            pass
        pid = os.fork()
        if pid == 0:
            _program(spec, code, SCRATCH, [spec["python"], "-I", "-u", "main.py"])
        while True:
            done, status = os.wait()
            if done == pid:
                _status(**_exit_event(status))
                os._exit(0)
    except BaseException as e:  # noqa: BLE001
        _status(setup=f"init: {type(e).__name__}: {e}")
        os._exit(126)


# Installed in the program's interpreter before its code runs (isolation "audit"). Audit hooks are
# no security boundary: C extensions bypass them, so this only stops what plain Python does.
AUDIT_BOOT = r"""
import os, sys
def _hook(event, args, _scratch=os.path.realpath(os.getcwd()) + os.sep, _real=os.path.realpath,
          _join=os.path.join, _cwd=os.getcwd, _flags=os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC,
          _refused=("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill",
                    "os.killpg", "subprocess.Popen", "pty.spawn", "signal.pthread_kill", "gc.get_objects",
                    "gc.get_referrers", "gc.get_referents", "sys._current_frames", "os.chroot"),
          _writes=("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod",
                   "os.chown", "os.truncate", "os.utime", "os.mkfifo", "os.mknod", "shutil.rmtree"),
          _ctypes_ok=("ctypes.addressof", "ctypes.cdata/buffer", "ctypes.create_string_buffer",
                      "ctypes.create_unicode_buffer", "ctypes.get_errno", "ctypes.set_errno")):
    ctypes_refused = event.startswith("ctypes.") and event not in _ctypes_ok and not (
        event == "ctypes.dlopen" and args[0] is None)  # ctypes' own import opens the process itself
    if event.startswith("socket.") or event in _refused or ctypes_refused:
        raise PermissionError(f"the sandbox refuses {event}")
    paths = ()
    if event == "open" and isinstance(args[0], (str, bytes)) and (args[2] or 0) & _flags:
        paths = (args[0],)
    elif event in _writes:
        paths = [a for a in args[:2] if isinstance(a, (str, bytes))]
    for p in paths:
        p = os.fsdecode(p)
        if not _real(_join(_cwd(), p)).startswith(_scratch):
            raise PermissionError(f"the sandbox refuses writing outside its folder: {p}")
sys.addaudithook(_hook)
del _hook
sys.argv = ["main.py"]
with open("main.py") as _f:
    _src = _f.read()
try:
    exec(compile(_src, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as _e:
    import traceback
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.exit(1)
"""


def _start(spec: dict, code: bytes) -> int:
    """Starts the sandbox; returns the pid of the child this launcher waits for."""
    if spec["isolation"] == "namespaces":
        flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        _unshare(flags | (0 if spec["drop_to_uid"] else CLONE_NEWUSER))
        if not spec["drop_to_uid"]:
            _enter_user_namespace(spec)
        _build_root(spec)
        pid = os.fork()
        if pid == 0:
            _init(spec, code)
        return pid
    pid = os.fork()
    if pid == 0:
        _program(spec, code, spec["scratch"], [spec["python"], "-I", "-u", "-c", AUDIT_BOOT])
    return pid


def main() -> None:
    global _status_fd
    spec = json.loads(sys.argv[1])
    _status_fd = spec["status_fd"]
    os.set_inheritable(_status_fd, False)
    _die_with_parent()
    if os.getppid() != spec["host_pid"]:  # the host died before the line above
        os._exit(1)
    code = sys.stdin.buffer.read()
    child = None
    stop = False

    def on_term(*_):  # the host's stop: kill the sandbox, then return once it is gone
        nonlocal stop
        stop = True
        if child is not None:
            os.kill(child, signal.SIGKILL)

    signal.signal(signal.SIGTERM, on_term)
    try:
        child = _start(spec, code)
    except (SetupError, OSError) as e:
        _status(setup=str(e))
        os._exit(1)
    if stop:
        os.kill(child, signal.SIGKILL)
    _, status = os.waitpid(child, 0)
    if spec["isolation"] != "namespaces":  # init reports the program's end itself
        _status(**_exit_event(status))
    os._exit(0)


if __name__ == "__main__":
    main()
