"""The cluster scripts, run for real on this machine: the host check (table, verdicts, exit code),
a Ray head and a worker started and stopped by scripts/start_ray.sh (each stop ends exactly its
own node's processes). The smoke run of the tiny recipe is in test_smoke.py (it starts no Ray)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERDICTS = {"ok", "warn", "FAIL"}
HAS_GPU = Path("/sys/class/kfd/kfd/topology/nodes").is_dir() or shutil.which("nvidia-smi") is not None


def script_env(**extra) -> dict:
    """This interpreter's bin first on PATH (ray, python), CPU-sized threads."""
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHON=sys.executable)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def check_host(*args: str) -> tuple[int, dict[str, tuple[str, str]], str]:
    """Runs scripts/check_host.sh -> (exit code, {check: (verdict, value)}, output)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts/check_host.sh"), *args], capture_output=True, text=True,
                          env=script_env(), cwd=ROOT, timeout=60)
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["CHECK", "VERDICT", "VALUE"], proc.stdout + proc.stderr
    value_at, note_at = lines[0].index("VALUE"), lines[0].index("NOTE")
    rows = {}
    for line in lines[1:-1]:
        check, verdict = line.split()[:2]
        rows[check] = (verdict, line[value_at:note_at].strip())
    assert set(v for v, _ in rows.values()) <= VERDICTS, proc.stdout
    return proc.returncode, rows, proc.stdout


def test_check_host_cpu_mode_passes_and_reports_everything():
    rc, rows, out = check_host("--cpu-ok", "--min-disk-gib", "0", "--min-shm-gib", "0")
    for check in ["gpus", "rdma", "open-files", "memlock", "/dev/shm", "docker", "ray", "disk"]:
        assert check in rows, out
    assert rows["gpus"][0] == "ok"
    assert rows["ray"][0] == "ok" and rows["ray"][1] == "2.60.0"  # this venv's Ray, the pinned one
    assert rc == 0 and out.splitlines()[-1] == "verdict: ready", out


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: the no-GPU failure cannot be shown here")
def test_check_host_blocks_without_a_gpu():
    rc, rows, out = check_host("--min-disk-gib", "0", "--min-shm-gib", "0")
    assert rows["gpus"] == ("FAIL", "none"), out
    assert rc == 1 and out.splitlines()[-1] == "verdict: BLOCKED (1 failing check(s))", out


def test_check_host_thresholds_and_usage(tmp_path):
    rc, rows, out = check_host("--cpu-ok", "--checkpoints", str(tmp_path / "new/dir"), "--min-disk-gib", "999999")
    assert rows["disk"][0] == "FAIL" and rc == 1, out
    assert str(tmp_path) in out  # the nearest existing parent of the checkpoint folder was measured
    rc, rows, out = check_host("--cpu-ok", "--min-disk-gib", "0", "--min-shm-gib", "999999")
    assert rows["/dev/shm"][0] == "FAIL" and rc == 1, out
    proc = subprocess.run(["bash", str(ROOT / "scripts/check_host.sh"), "--min-disk-gib", "lots"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "'lots'" in proc.stderr


# ------------------------------------------------------------------------ Ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ray(*args: str) -> subprocess.CompletedProcess:
    # Loopback only; no dashboard on the head (its fixed port may be taken by another Ray here).
    cmd = ["bash", str(ROOT / "scripts/start_ray.sh"), *args, "--node-ip-address", "127.0.0.1", "--num-cpus", "1"]
    if args[0] == "head":
        cmd += ["--", "--include-dashboard=false"]
    return subprocess.run(cmd, capture_output=True, text=True, env=script_env(), timeout=180)


def stop_ray(state: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts/start_ray.sh"), "stop", "--state-dir", str(state)],
                          capture_output=True, text=True, env=script_env(), timeout=60)


def group(pgid: int) -> set[int]:
    """Running (not zombie) processes of a process group."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.add(int(stat.parent.name))
    return out


def running(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.add(pid)
        except OSError:
            pass
    return out


def test_start_ray_head_and_worker_each_stop_only_their_own(tmp_path):
    head_state, worker_state = tmp_path / "head", tmp_path / "worker"
    port = free_port()
    try:
        head = start_ray("head", "--port", str(port), "--state-dir", str(head_state))
        assert head.returncode == 0, head.stdout + head.stderr
        assert f"address 127.0.0.1:{port}" in head.stdout
        assert f"scripts/start_ray.sh worker --address 127.0.0.1:{port}" in head.stdout
        assert (head_state / "address").read_text().strip() == f"127.0.0.1:{port}"
        head_pids = group(int((head_state / "pgid").read_text()))
        assert len(head_pids) >= 2  # gcs_server, raylet, ...

        again = start_ray("head", "--port", str(free_port()), "--state-dir", str(head_state))
        assert again.returncode == 2 and "still running" in again.stderr

        # The head's token file (tests/integration/test_ray_auth.py shows that nothing joins without it).
        worker = start_ray("worker", "--address", f"127.0.0.1:{port}", "--state-dir", str(worker_state),
                           "--token-file", str(head_state / "auth_token"))
        assert worker.returncode == 0, worker.stdout + worker.stderr
        assert f"joined 127.0.0.1:{port}" in worker.stdout
        worker_pids = group(int((worker_state / "pgid").read_text()))
        assert worker_pids and not worker_pids & head_pids

        stopped = stop_ray(worker_state)
        assert stopped.returncode == 0 and "stopping the Ray node" in stopped.stdout, stopped.stdout
        assert running(worker_pids) == set()
        assert running(head_pids) == head_pids  # the other node of the machine is untouched
        assert not (worker_state / "pgid").exists()

        stopped = stop_ray(head_state)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert running(head_pids) == set()
        assert "nothing to stop" in stop_ray(head_state).stdout
    finally:
        stop_ray(worker_state), stop_ray(head_state)


def test_start_ray_usage_errors(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts/start_ray.sh"), "worker", "--state-dir", str(tmp_path)],
                          capture_output=True, text=True, env=script_env(), timeout=30)
    assert proc.returncode == 2 and "--address" in proc.stderr
    proc = subprocess.run(["bash", str(ROOT / "scripts/start_ray.sh"), "header"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "head, worker or stop" in proc.stderr
    # A worker needs the head's token file, private to its user.
    token = tmp_path / "token"
    for text, mode, error in [(None, 0, "no token file"), ("ab" * 32, 0o644, "chmod 600"), ("", 0o600, "is empty")]:
        if text is not None:
            token.write_text(text)
            token.chmod(mode)
        proc = subprocess.run(["bash", str(ROOT / "scripts/start_ray.sh"), "worker", "--address", "127.0.0.1:1",
                               "--state-dir", str(tmp_path / "w"), "--token-file", str(token)],
                              capture_output=True, text=True, env=script_env(), timeout=30)
        assert proc.returncode == 2 and error in proc.stderr, (mode, proc.stderr)
    assert not (tmp_path / "w" / "pgid").exists()  # refused before anything started
