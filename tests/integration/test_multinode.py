"""Several nodes, for real, on this one machine: a Ray cluster of separate raylets
(``ray.cluster_utils.Cluster``: a head that takes no work, worker nodes of one CPU each), the CPU
path of the project (placement.gpus_per_node=0: a node holds actor ranks / nodes actor ranks and,
colocated, one vLLM-CPU engine in a Ray actor). What each process got is read from inside it
(its Ray node id, its rank and environment), not assumed.

- colocated on 2 nodes: each node's rank serves that node's engine (the IPC sync never leaves a
  node), the router spreads prompts over both engines, trainer and sampler logprobs agree; then
  the node of actor rank 1 is removed at the "train" phase of step 2: the run stops with one line
  naming the rank and its node, and run again (a replacement node joined) it resumes from its
  step-1 checkpoint;
- disaggregated 2 + 1 (two actor nodes, one rollout node): the broadcast group spans the nodes,
  its store on actor rank 0's node;
- the shared checkpoint folder: a node that mounts something else over it (a raylet started in a
  mount namespace of its own) is named.

On one machine every node has the same address, so "rank 0's node address" checks the code path,
not the network; GPUs on several nodes run the same code (docs/multinode.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from colocate_rl import faults, loop
from colocate_rl.metrics import read
from colocate_rl.placement.nodes import FolderNotShared, ProcessLost, check_shared_folder, short
from colocate_rl.session import start_session

from test_loop import planned, tiny_cfg  # noqa: E402 - same folder

ray = pytest.importorskip("ray")
# ~2.5-3.5 min on 2 cores (by the machine's load): five raylets, two colocated sessions of four
# vLLM / megatron-core processes each (the second one resumed), one disaggregated session of three.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    from colocate_rl.placement.ray_auth import local_token_file, use_token_file

    use_token_file(local_token_file())  # every node, and this driver, with the token: no other process joins
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # the driver's node takes no work
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


def free_nodes(cluster, n: int) -> list:
    """At least n alive worker nodes of one CPU each (added as needed); the alive ones, in order."""
    alive = [node for node in cluster.worker_nodes if node.node_id in {x["NodeID"] for x in ray.nodes() if x["Alive"]}]
    while len(alive) < n:
        alive.append(cluster.add_node(num_cpus=1, resources={f"node_{len(cluster.worker_nodes) + 1}": 1}))
    cluster.wait_for_nodes()
    return alive


@pytest.fixture
def gloo_interface(monkeypatch) -> str:
    """The interface of this machine's Ray address, named to gloo through the driver's environment
    (placement.nodes.network_env gives it to every Ray actor)."""
    ip = ray.util.get_node_ip_address()
    names = [name for name, addrs in psutil.net_if_addrs().items() if any(a.address == ip for a in addrs)]
    if not names:
        pytest.skip(f"no interface holds the node address {ip}")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", names[0])
    return names[0]


def test_colocated_two_nodes_then_a_node_lost_mid_step_and_the_run_resumes(cluster, tmp_path, tiny_model,
                                                                           even_length_reward, gloo_interface,
                                                                           capsys):
    free_nodes(cluster, 2)
    over = {"placement.nnodes": "2", "actor.lr": "1e-3", "reward.name": even_length_reward,
            "sync.verify_every": "1", "checkpoint.every": "1", "steps": "2"}
    s = start_session(*planned(tiny_cfg(tmp_path, tiny_model, **over)))
    try:
        w = s.workers
        procs = w.processes()
        ranks, engines = procs["ranks"], procs["engines"]
        workers_nodes = {n.node_id for n in cluster.worker_nodes}
        # Two ranks on two distinct worker nodes; engine k on the node of rank k; one rendezvous.
        assert len(ranks) == 2 and len(engines) == 2
        assert ranks[0]["node_id"] != ranks[1]["node_id"] and {r["node_id"] for r in ranks} <= workers_nodes
        for k, (r, e) in enumerate(zip(ranks, engines)):
            env = {key: r["env"].get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
            assert env == {"RANK": str(k), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": ranks[0]["node_ip"],
                           "MASTER_PORT": ranks[0]["env"]["MASTER_PORT"]}
            assert (r["dist_rank"], r["dist_world"], r["device"]) == (k, 2, "cpu")
            assert e["node_id"] == r["node_id"], f"engine {k} runs on the node of rank {k}"
            assert r["network"]["GLOO_SOCKET_IFNAME"] == e["network"]["GLOO_SOCKET_IFNAME"] == gloo_interface
        # Each node's merged message goes to that node's engine only, packed by that node's rank.
        assert w.node_senders == [[0], [1]] and w.engine_node == [0, 1]

        loop.prepare(s)
        m = loop.step(s)
        assert m["train_rollout_logprob_abs_diff"] <= 1e-4, m["train_rollout_logprob_abs_diff"]
        assert m["grad_norm"] > 0 and m["sync/bytes"] > 0
        loop.end_step(s, m, interrupted=False)  # the step-1 checkpoint
        assert w.verify() >= 3  # both engines hold both ranks' weights
        # The router spread a step's prompts over the engines of both nodes.
        pending = w.rollout.router.submit(s.train_samples[:8], n=2, max_tokens=4)
        pending.result()
        assert set(pending.engine_of.values()) == {0, 1}

        # The node of actor rank 1 (and engine 1) is lost at the start of step 2's training.
        victim = next(n for n in cluster.worker_nodes if n.node_id == ranks[1]["node_id"])

        def remove_node(name: str, step: int) -> None:
            if (name, step) == ("train", 2):
                cluster.remove_node(victim)

        remove = faults.on(remove_node)
        try:
            with pytest.raises(ProcessLost) as lost:
                loop.step(s)
        finally:
            remove()
        msg = str(lost.value)
        assert "\n" not in msg and msg.startswith("actor rank 1 of 2 on ") and "died during train_step" in msg
        assert f"(Ray node {short(victim.node_id)})" in msg, msg
    finally:
        s.close()

    # Run again: a replacement node has joined; the run resumes from its step-1 checkpoint.
    free_nodes(cluster, 2)
    capsys.readouterr()
    out = loop.run(*planned(tiny_cfg(tmp_path, tiny_model, **over)))
    assert "resumed from" in capsys.readouterr().out
    rows = read(tmp_path / "t" / "metrics.jsonl")
    assert out["steps"] == 2 and [r["step"] for r in rows] == [1, 2]
    assert rows[1]["train_rollout_logprob_abs_diff"] <= 1e-4 and rows[1]["grad_norm"] > 0
    assert sorted(p.name for p in (tmp_path / "t" / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]


def test_disaggregated_two_actor_nodes_one_rollout_node(cluster, tmp_path, tiny_model, even_length_reward):
    free_nodes(cluster, 3)
    s = start_session(*planned(tiny_cfg(tmp_path, tiny_model, **{
        "placement.mode": "disaggregated", "placement.nnodes": "3", "placement.actor_nodes": "2",
        "placement.rollout_nodes": "1", "actor.lr": "1e-3", "reward.name": even_length_reward,
        "sync.verify_every": "1"})))
    try:
        w = s.workers
        m = loop.step(s, last=True)  # generate on the rollout node, train on both actor nodes, broadcast
        assert m["train_rollout_logprob_abs_diff"] <= 1e-4 and m["sync/bytes"] > 0 and m["grad_norm"] > 0
        procs = w.processes()
        ranks, engines = procs["ranks"], procs["engines"]
        nodes = [r["node_id"] for r in ranks] + [engines[0]["node_id"]]
        assert len(ranks) == 2 and len(engines) == 1 and len(set(nodes)) == 3, "three nodes, one process each"
        for k, r in enumerate(ranks):
            assert (r["env"]["RANK"], r["env"]["WORLD_SIZE"], r["dist_rank"]) == (str(k), "2", k)
            assert r["env"]["MASTER_ADDR"] == ranks[0]["node_ip"]
        # The broadcast group's store is actor rank 0's, at its node's address (seen from inside it).
        assert ranks[0]["broadcast"][0] == ranks[0]["node_ip"] and ranks[1]["broadcast"] is None
        actor = s.actor.weight_checksums()
        for name, value in w.engine_checksums(list(actor))[0].items():
            assert value == pytest.approx(actor[name], rel=1e-12, abs=1e-9), name
    finally:
        s.close()


def test_a_node_that_does_not_see_the_checkpoint_folder_is_named(cluster, tmp_path):
    folder = tmp_path / "checkpoints"
    alive = [n for n in ray.nodes() if n["Alive"]]
    assert check_shared_folder(folder) == len(alive)
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --mount is not permitted here (needs CAP_SYS_ADMIN)")
    # A raylet whose mount namespace puts an empty tmpfs over the folder: that node cannot see it.
    ray_cli = str(Path(sys.executable).parent / "ray")
    node = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs none "$0" && exec "$1" start --address "$2" --num-cpus 0 --resources \'{"unshared": 1}\' '
         '--disable-usage-stats --block', str(folder), ray_cli, cluster.address],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the cluster's token file
    try:
        deadline = time.monotonic() + 120
        while not (new := [n for n in ray.nodes() if n["Alive"] and "unshared" in n["Resources"]]):
            assert node.poll() is None and time.monotonic() < deadline, "the extra node did not join"
            time.sleep(0.5)
        with pytest.raises(FolderNotShared) as e:
            check_shared_folder(folder)
        msg = str(e.value)
        assert "\n" not in msg and f"Ray node {short(new[0]['NodeID'])}" in msg and str(folder) in msg, msg
    finally:
        os.killpg(node.pid, signal.SIGTERM)  # the process group this test started, nothing else
        node.wait(60)
    assert not list(folder.iterdir()), "the marker file is removed"
    deadline = time.monotonic() + 120
    while any(n["Alive"] and "unshared" in n["Resources"] for n in ray.nodes()):  # gone before the next test
        assert time.monotonic() < deadline, "the extra node is still alive"
        time.sleep(0.5)
