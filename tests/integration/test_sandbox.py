"""The python tool's sandbox on the CPU: every way a program can misbehave ends in an error result,
and nothing escapes: no file outside its scratch folder, no process left (psutil), no connection.

Each test runs under both isolations: namespaces (skipped where the machine refuses them) and the
audit-hook fallback. Hangs are stopped by the wall clock each test sets, never timed here.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

from colocate_rl.tools import Sandbox, SandboxUnavailable, ToolCall, ToolExecutor, ToolsConfig, make_tools
from colocate_rl.tools.sandbox import LAUNCHER

UID_BASE = 61100  # apart from the default's uids
CONCURRENCY = 2
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scratch_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sandboxes")


@pytest.fixture(scope="module", params=["namespaces", "audit"])
def isolation(request, scratch_root) -> str:
    if request.param == "namespaces":
        try:
            Sandbox(ToolsConfig(isolation="namespaces", sandbox_uid=UID_BASE, max_concurrency=1)).isolation
        except SandboxUnavailable as e:
            pytest.skip(str(e))
    return request.param


def config(isolation: str, scratch_root: Path, **kw) -> ToolsConfig:
    kw.setdefault("timeout_s", 60.0)
    return ToolsConfig(names=("python",), isolation=isolation, sandbox_uid=UID_BASE, max_concurrency=CONCURRENCY,
                       scratch_root=str(scratch_root), **kw)


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def leftovers(scratch_root: Path, before: set[int]) -> list[str]:
    """Processes a sandbox of this test process started that are still there: its descendants that
    were not there ``before`` (an earlier test of this worker may leave its own, e.g. reward workers),
    launchers it started, anything running as a sandbox uid or inside a scratch folder."""
    uids = set(range(UID_BASE, UID_BASE + CONCURRENCY))
    host = f'"host_pid": {os.getpid()}'
    out = [f"{p.pid} {p.name()}" for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for p in psutil.process_iter(["pid", "uids", "cmdline", "cwd"]):
        cmd, cwd = " ".join(p.info["cmdline"] or []), p.info["cwd"] or ""
        if ((p.info["uids"] and p.info["uids"].real in uids) or (LAUNCHER in cmd and host in cmd)
                or cwd.startswith(str(scratch_root))):
            out.append(f"{p.info['pid']} {cmd[:80]}")
    return out


def run(isolation: str, scratch_root: Path, code: str, **kw):
    """One call of the python tool; asserts that nothing of the sandbox is left afterwards."""
    tool = make_tools(config(isolation, scratch_root, **kw))["python"]
    before = descendants()
    result = tool({"code": code})
    assert leftovers(scratch_root, before) == []
    assert list(scratch_root.iterdir()) == []  # an audit sandbox's folder is removed too
    return result


def test_a_program_runs_in_a_fresh_scratch_folder(isolation, scratch_root, monkeypatch):
    monkeypatch.setenv("COLOCATE_RL_TEST_SECRET", "s3cret")
    code = ("import os\nprint(sorted(os.listdir('.')))\nopen('note.txt', 'w').write('hi')\n"
            "print(open('note.txt').read())\nprint(os.environ['HOME'] == os.environ['TMPDIR'] == os.getcwd())\n"
            "print(os.environ.get('COLOCATE_RL_TEST_SECRET'))")
    for _ in range(2):  # the second call does not see the first one's file
        result = run(isolation, scratch_root, code)
        assert (result.text, result.error) == ("['main.py']\nhi\nTrue\nNone\n", False)


def test_a_failing_program_is_an_error_result(isolation, scratch_root):
    result = run(isolation, scratch_root, "import sys\nprint('partial')\nsys.exit(3)")
    assert (result.text, result.error) == ("partial\n[exit code 3]", True)
    result = run(isolation, scratch_root, "1 / 0")
    assert result.error and result.text.endswith("ZeroDivisionError: division by zero\n[exit code 1]")


def test_a_program_that_hangs_is_stopped(isolation, scratch_root):
    result = run(isolation, scratch_root, "import time\nprint('started')\ntime.sleep(10 ** 6)", timeout_s=5)
    assert (result.text, result.error) == ("started\n[stopped: no result within 5 s]", True)


def test_a_fork_loop_is_stopped_with_every_process_it_made(isolation, scratch_root):
    code = ("import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n"
            "    except OSError:\n        pass")
    result = run(isolation, scratch_root, code, timeout_s=5, max_processes=8)
    assert result.error and result.text.startswith("[stopped: no result within 5 s]")


def test_forks_are_bounded_and_killed_at_the_end(isolation, scratch_root):
    """Children that setsid() away and sleep outlive the program; they are gone when the call
    returns. Namespaces: RLIMIT_NPROC bounds them; audit: forking is refused."""
    code = ("import os, time\nn = 0\nfor _ in range(50):\n    try:\n        pid = os.fork()\n"
            "    except OSError as e:\n        print(type(e).__name__, e)\n        break\n"
            "    if pid == 0:\n        os.setsid()\n        time.sleep(10 ** 6)\n    n += 1\nprint(n)")
    result = run(isolation, scratch_root, code, max_processes=8)
    lines = result.text.splitlines()
    if isolation == "namespaces":
        assert not result.error and lines[0].startswith("BlockingIOError") and 0 < int(lines[1]) < 8
    else:
        assert lines == ["PermissionError the sandbox refuses os.fork", "0"]


@pytest.mark.parametrize("code", ["x = bytearray(1 << 31)", "x = []\nwhile True:\n    x.append(bytearray(1 << 20))"])
def test_unbounded_allocation_is_a_memory_error(isolation, scratch_root, code):
    result = run(isolation, scratch_root, code, memory_mb=256)
    assert result.error and "MemoryError" in result.text


def test_a_gigabyte_of_output_is_cut_at_the_cap(isolation, scratch_root):
    code = "import os\nfor _ in range(1024):\n    os.write(1, b'x' * (1 << 20))"
    result = run(isolation, scratch_root, code, output_bytes=4096)
    assert result.error and result.text == "x" * 4096 + "\n[stopped: the output passed 4096 bytes]"


def test_cpu_time_is_bounded(isolation, scratch_root):
    result = run(isolation, scratch_root, "while True:\n    pass", cpu_s=1, timeout_s=120)
    assert result.error and result.text.startswith("[killed: CPU time limit of 1 s reached")


def test_file_size_and_open_files_are_bounded(isolation, scratch_root):
    result = run(isolation, scratch_root, "open('big', 'wb').write(b'x' * (2 << 20))", max_file_mb=1)
    assert result.error and "File too large" in result.text
    result = run(isolation, scratch_root, "files = [open(f'f{i}', 'w') for i in range(100)]", max_open_files=32)
    assert result.error and "Too many open files" in result.text


def test_the_network_is_out_of_reach(isolation, scratch_root, tmp_path):
    """A TCP listener on loopback and a unix socket in a host folder: the program reaches neither."""
    unix_dir = tempfile.mkdtemp(prefix="crl-sock-")  # short: a unix socket path has 107 bytes at most
    with socket.create_server(("127.0.0.1", 0)) as tcp, socket.socket(socket.AF_UNIX) as unix:
        unix.bind(f"{unix_dir}/s")
        unix.listen()
        for server in (tcp, unix):
            server.setblocking(False)
        port = tcp.getsockname()[1]
        tcp_result = run(isolation, scratch_root,
                         f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)")
        unix_result = run(isolation, scratch_root,
                          f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({unix_dir + '/s'!r})")
        for server in (tcp, unix):
            with pytest.raises(BlockingIOError):
                server.accept()  # nothing connected
    os.unlink(f"{unix_dir}/s")
    os.rmdir(unix_dir)
    expected = ({"OSError: [Errno 101] Network is unreachable"}, {"FileNotFoundError"}) if isolation == "namespaces" \
        else ({"PermissionError: the sandbox refuses socket.getaddrinfo"},
              {"PermissionError: the sandbox refuses socket.__new__"})
    for result, errors in zip((tcp_result, unix_result), expected):
        assert result.error and any(e in result.text for e in errors), result.text


@pytest.mark.parametrize("where", ["worktree", "tmp", "host_temp"])
def test_writes_outside_the_scratch_folder_fail(isolation, scratch_root, tmp_path, where):
    name = f"escape-{uuid.uuid4().hex}.txt"
    target = {"worktree": ROOT / name, "tmp": Path("/tmp") / name, "host_temp": tmp_path / name}[where]
    try:
        result = run(isolation, scratch_root, f"open({str(target)!r}, 'w').write('x')")
        assert result.error and not target.exists()
    finally:
        target.unlink(missing_ok=True)


def test_host_files_cannot_be_removed_or_renamed(isolation, scratch_root, tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    for code in (f"import os\nos.remove({str(victim)!r})", f"import os\nos.rename({str(victim)!r}, 'stolen')",
                 f"import os\nos.mkdir({str(tmp_path / 'new')!r})"):
        assert run(isolation, scratch_root, code).error
    assert victim.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_a_batch_comes_back_in_order_within_the_concurrency_bound(isolation, scratch_root):
    code = "import os\nprint({i}, os.getuid())"
    calls = [ToolCall("python", {"code": code.format(i=i)}) for i in range(6)]
    calls.insert(3, ToolCall("python", {"code": "x" * 100}))  # longer than max_code_bytes
    before = descendants()
    with ToolExecutor(config(isolation, scratch_root, max_code_bytes=64)) as ex:
        results = ex.run(calls)
    assert leftovers(scratch_root, before) == []
    printed = [r.text.split() for r in results[:3] + results[4:]]
    assert [int(p[0]) for p in printed] == list(range(6)) and not any(r.error for r in results[:3] + results[4:])
    assert results[3].error and "is too long" in results[3].text  # the schema's maxLength: max_code_bytes
    if isolation == "namespaces" and os.geteuid() == 0:  # one uid per running sandbox, CONCURRENCY of them
        assert {int(p[1]) for p in printed} <= set(range(UID_BASE, UID_BASE + CONCURRENCY))


def test_the_program_cannot_write_the_launchers_status(isolation, scratch_root):
    """The launcher reports how the program ended through a pipe of its own; the program, which
    tries every descriptor, does not have it (a forged "setup" line would fail the call)."""
    forged = json.dumps({"setup": "forged"}) + "\n"
    code = (f"import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, {forged!r}.encode())\n"
            "    except OSError:\n        pass\nprint('ok')")
    result = Sandbox(config(isolation, scratch_root)).run(code)
    assert result.ok and result.output == "ok\n" and result.setup_error == ""
