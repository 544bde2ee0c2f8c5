"""A Ray head started by scripts/start_ray.sh admits only holders of its token, for real on this
machine: a client without the token (or with another one) is refused by the cluster's gRPC
services, a driver given the token file through placement.ray_token_file runs work on it, the
dashboard's Jobs API (where this Ray install has one) refuses an unauthenticated submission over
HTTP and accepts one that carries the token; the token file is 0600 and its text shows in no output,
log, command line or environment; `stop` leaves nothing of the node running. The local instance a run
starts (placement/ray_tools.start_ray without placement.ray_address) admits only its own token
too, kept in a 0600 file of the run's cache, and Ray writes nothing under $HOME.

Without the dashboard's dependencies (`ray[default]`: aiohttp_cors, grpcio, opencensus, ...) Ray runs
its dashboard in a minimal mode that serves no HTTP API at all; the Jobs API test is then skipped and
the gRPC services (the GCS port a client joins by, which runs code on every node) are the surface."""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from ray._private.utils import get_dashboard_dependency_error, get_ray_client_dependency_error

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts/start_ray.sh")

# ~15-40 s on 2 loaded cores: a Ray head's start, three client processes importing Ray (one of
# them also torch), two of which are refused.
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict:
    """This interpreter's bin first on PATH (ray), and no Ray authentication setting of ours."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "COLOCATE_RL_RAY_TOKEN_FILE",
                        "RAY_ADDRESS")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    env.update(extra)
    return env


def stat_fields(pid: int) -> list[str] | None:
    """state, ppid, pgrp, ... of a process; None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def node_tree(pgid: int) -> set[int]:
    """Running processes of a process group and all their descendants (the raylet gives each Ray
    worker a process group of its own)."""
    parent, keep = {}, set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = stat_fields(int(stat.parent.name))
        if fields and fields[0] != "Z":
            parent[int(stat.parent.name)] = int(fields[1])
            if int(fields[2]) == pgid:
                keep.add(int(stat.parent.name))
    grew = True
    while grew:
        new = {p for p, pp in parent.items() if pp in keep and p not in keep}
        keep |= new
        grew = bool(new)
    return keep


def running(pids: set[int]) -> set[int]:
    return {p for p in pids if (f := stat_fields(p)) and f[0] != "Z"}


def proc_text(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A one-CPU head on free ports; stopped by the last test, and here again should one fail."""
    state = tmp_path_factory.mktemp("ray-head")
    port, dashboard_port = free_port(), free_port()
    # The services whose default ports are fixed (another Ray on this machine may hold them): the
    # dashboard on a free port, the agent's HTTP on one it picks (0); every other port Ray picks.
    # The Ray Client server runs only with grpcio.
    extra = ["--dashboard-port", str(dashboard_port), "--dashboard-agent-listen-port", "0"]
    if get_ray_client_dependency_error() is None:
        extra += ["--ray-client-server-port", str(free_port())]
    proc = subprocess.run(["bash", SCRIPT, "head", "--port", str(port), "--num-cpus", "1", "--node-ip-address",
                           "127.0.0.1", "--state-dir", str(state), "--", *extra],
                          capture_output=True, text=True, env=clean_env(), timeout=300)
    info = dict(state=state, port=port, dashboard_port=dashboard_port, address=f"127.0.0.1:{port}", proc=proc,
                token_file=state / "auth_token")
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        info["pids"] = node_tree(int((state / "pgid").read_text()))
        gcs = [c for c in map(lambda p: proc_text(p, "cmdline"), info["pids"]) if "gcs_server" in c]
        info["log_dir"] = Path(re.search(r"--log_dir=(\S+)", gcs[0]).group(1))  # <session folder>/logs
        yield info
    finally:
        subprocess.run(["bash", SCRIPT, "stop", "--state-dir", str(state)], capture_output=True, timeout=120)


def test_token_file_is_private_and_the_token_shows_nowhere(head):
    token_file = head["token_file"]
    assert oct(token_file.stat().st_mode & 0o777) == "0o600"
    token = token_file.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", token), "256 random bits as hex"
    out = head["proc"].stdout + head["proc"].stderr
    assert f"token file:         {token_file}" in out
    assert f"--token-file {token_file}" in out and f"placement.ray_token_file={token_file}" in out
    assert token not in out
    assert token not in (head["state"] / "ray-start.log").read_text()

    pids = running(head["pids"])
    cmdlines = {p: proc_text(p, "cmdline") for p in pids}
    assert any("gcs_server" in c for c in cmdlines.values()) and any("raylet" in c for c in cmdlines.values())
    for pid in pids:  # what `ps` (and `ps e`) shows of every process of the node
        assert token not in cmdlines[pid] and token not in proc_text(pid, "environ"), pid
    assert any(f"RAY_AUTH_TOKEN_PATH={token_file}" in proc_text(p, "environ") for p in pids)
    # The dashboard listens on this machine only unless --dashboard-host says otherwise.
    (dashboard,) = [c for c in cmdlines.values() if "dashboard/dashboard.py" in c]
    assert "--host=127.0.0.1" in dashboard.split()

    logs = [f for f in head["log_dir"].rglob("*") if f.is_file()]
    assert logs
    for f in logs:  # Ray's own logs of every process of the node
        assert token.encode() not in f.read_bytes(), f


# A plain client: what anyone who reaches the GCS port can run. It prints JOINED and runs a task
# on the cluster, or prints REFUSED.
CLIENT = """
import sys, ray
try:
    ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False)
except Exception as e:
    print("REFUSED", type(e).__name__, e)
    sys.exit(0)
print("JOINED", ray.get(ray.remote(lambda: 6 * 7).remote()))
"""

# The project's driver: start_ray() with placement.ray_token_file. It reads Ray's authentication
# mode first (as a process that ran a local instance before has), so start_ray must make Ray reload it.
DRIVER = """
import sys, ray
from ray._raylet import get_authentication_mode
from colocate_rl.config import PlacementConfig
from colocate_rl.placement.ray_tools import start_ray

assert get_authentication_mode() == 0, "disabled"
start_ray(PlacementConfig(ray_address=sys.argv[1], ray_token_file=sys.argv[2]))
print("JOINED", ray.get(ray.remote(lambda: 6 * 7).remote()), ray.cluster_resources().get("CPU"))
ray.shutdown()
"""


def test_only_a_token_holder_joins(head, tmp_path):
    other = tmp_path / "other_token"
    other.write_text(secrets.token_hex(32))
    other.chmod(0o600)
    home = tmp_path / "home"  # no ~/.ray/auth_token for Ray to fall back on
    home.mkdir()
    # A refused client tries to join once a second for RAY_gcs_server_port_wait_time_s (20 by
    # default) before it gives up; the refusal is the same at the first attempt as at the last.
    refused = dict(HOME=str(home), RAY_gcs_server_port_wait_time_s="2")
    runs = {
        "no token": ([sys.executable, "-c", CLIENT, head["address"]], clean_env(**refused)),
        "another token": ([sys.executable, "-c", CLIENT, head["address"]],
                          clean_env(**refused, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(other))),
        "driver with the token file": ([sys.executable, "-c", DRIVER, head["address"], str(head["token_file"])],
                                       clean_env(HOME=str(home), RAY_AUTH_MODE="disabled")),
    }
    # Side by side: each refused client spends its time in Ray's connection retries.
    procs = {k: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for k, (cmd, env) in runs.items()}
    out = {k: p.communicate(timeout=300) for k, p in procs.items()}
    for k in ("no token", "another token"):
        assert procs[k].returncode == 0 and out[k][0].startswith("REFUSED"), (k, out[k])
        assert "JOINED" not in out[k][0]
    # Refused by authentication, not for some other reason.
    assert "Authentication token is missing or incorrect" in out["no token"][1] + out["another token"][1]
    k = "driver with the token file"
    assert procs[k].returncode == 0, out[k][1][-3000:]
    assert out[k][0].splitlines()[-1] == "JOINED 42 1.0", out[k]


def test_jobs_api_needs_the_token(head):
    if get_dashboard_dependency_error() is not None:
        pytest.skip(f"Ray's dashboard dependencies are missing ({get_dashboard_dependency_error()}): "
                    "this install serves no Jobs API to attack")
    from ray.job_submission import JobStatus, JobSubmissionClient

    url = f"http://127.0.0.1:{head['dashboard_port']}"
    token = head["token_file"].read_text()
    job = json.dumps({"entrypoint": "python -c 'print(6 * 7)'"}).encode()

    def post(headers: dict) -> int:
        req = urllib.request.Request(f"{url}/api/jobs/", data=job, method="POST",
                                     headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert post({}) == 401  # the advisory's request: a job from anyone who reaches the port
    assert post({"Authorization": f"Bearer {secrets.token_hex(32)}"}) == 403
    client = JobSubmissionClient(url, headers={"Authorization": f"Bearer {token}"})
    job_id = client.submit_job(entrypoint="python -c 'print(6 * 7)'")
    deadline = time.monotonic() + 240  # a bound on a hang, not a measurement
    while client.get_job_status(job_id) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.monotonic() < deadline, client.get_job_logs(job_id)
        time.sleep(1)
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED, client.get_job_logs(job_id)
    assert client.get_job_logs(job_id).strip().endswith("42")


def test_stop_leaves_nothing_running(head):
    pids = node_tree(int((head["state"] / "pgid").read_text())) | head["pids"]
    assert running(pids)
    stopped = subprocess.run(["bash", SCRIPT, "stop", "--state-dir", str(head["state"])], capture_output=True,
                             text=True, env=clean_env(), timeout=120)
    assert stopped.returncode == 0 and "stopping the Ray node" in stopped.stdout, stopped.stdout + stopped.stderr
    assert running(pids) == set()
    # Nothing of the node left anywhere on the machine: a process that escaped the tree would still
    # name the node's GCS address or its session's folder.
    marks = (head["address"], str(head["log_dir"].parent))
    left = {int(p.name) for p in Path("/proc").glob("[0-9]*")
            if any(m in proc_text(int(p.name), "cmdline") for m in marks)}
    assert running(left) == set()
    assert not (head["state"] / "pgid").exists()
    assert head["token_file"].exists()  # kept for the next head, so the other nodes' copies stay valid


# The project's driver starting a local instance: says where it is, then keeps it up until its stdin closes.
LOCAL = """
import json, os, sys, ray
from colocate_rl.config import PlacementConfig
from colocate_rl.placement.ray_tools import start_ray

start_ray(PlacementConfig())
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "token_file": os.environ["RAY_AUTH_TOKEN_PATH"],
                  "logs": ray._private.worker._global_node.get_logs_dir_path(),
                  "answer": ray.get(ray.remote(lambda: 6 * 7).remote())}), flush=True)
sys.stdin.read()
ray.shutdown()
"""


def test_a_local_instance_admits_only_its_own_token(tmp_path):
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    with open(tmp_path / "driver.log", "w") as log:
        driver = subprocess.Popen([sys.executable, "-c", LOCAL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=log, text=True, cwd=ROOT, env=clean_env(HOME=str(home),
                                                                                 COLOCATE_RL_CACHE=str(cache)))
    try:
        line = driver.stdout.readline()
        assert line, (tmp_path / "driver.log").read_text()[-3000:]
        info = json.loads(line)
        token_file = Path(info["token_file"])
        token = token_file.read_text()
        assert info["answer"] == 42
        assert token_file.parent == cache / "ray-auth" and re.fullmatch(r"[0-9a-f]{64}", token)
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        assert oct(token_file.parent.stat().st_mode & 0o777) == "0o700"

        # Clients on this machine, through loopback (the GCS listens on every interface of the node).
        other = tmp_path / "other_token"
        other.write_text(secrets.token_hex(32))
        other.chmod(0o600)
        address = f"127.0.0.1:{info['gcs'].rsplit(':', 1)[1]}"
        refused = dict(HOME=str(home), RAY_gcs_server_port_wait_time_s="2")
        envs = {"no token": clean_env(**refused),
                "another token": clean_env(**refused, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(other))}
        clients = {k: subprocess.Popen([sys.executable, "-c", CLIENT, address], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for k, env in envs.items()}
        out = {k: p.communicate(timeout=300) for k, p in clients.items()}
        for k, p in clients.items():
            assert p.returncode == 0 and out[k][0].startswith("REFUSED") and "JOINED" not in out[k][0], (k, out[k])
            assert "Authentication token is missing or incorrect" in out[k][1], (k, out[k][1][-2000:])

        # The token is in no command line, environment or log of the instance; its file's path is.
        pids = [driver.pid] + [c.pid for c in psutil.Process(driver.pid).children(recursive=True)]
        assert any("gcs_server" in proc_text(p, "cmdline") for p in pids)
        for pid in pids:
            assert token not in proc_text(pid, "cmdline") and token not in proc_text(pid, "environ"), pid
        assert any(f"RAY_AUTH_TOKEN_PATH={token_file}" in proc_text(p, "environ") for p in pids)
        logs = [f for f in Path(info["logs"]).rglob("*") if f.is_file()] + [tmp_path / "driver.log"]
        for f in logs:
            assert token.encode() not in f.read_bytes(), f
    finally:
        driver.stdin.close()
        try:
            driver.wait(120)
        except subprocess.TimeoutExpired:
            driver.kill()  # the process this test started
            raise
    assert driver.returncode == 0, (tmp_path / "driver.log").read_text()[-3000:]
    assert not token_file.exists(), "removed when the driver exits"
    assert sorted(home.rglob("*")) == [], "Ray wrote under $HOME"
