"""Two Ray nodes of one GPU each on one host with two GPUs: a Ray cluster of separate raylets
(``ray.cluster_utils.Cluster``), raylet k started with CUDA_/HIP_VISIBLE_DEVICES=k so that the
GPU Ray assigns on node k is physical GPU k (Ray's GPU ids are taken from the raylet's visible
list). The same placement code as on several machines: per-node placement groups, the actor's
NCCL group and the weight broadcast across nodes, CUDA IPC inside each node keyed by UUID.

- colocated, placement.nnodes=2 gpus_per_node=1: rank k and engine k share GPU k (same UUID, read
  from inside both processes), the sync of each node stays on that node, logprobs agree;
- disaggregated 1 + 1: the actor on node 0, the engine on node 1, weights broadcast over NCCL."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA or ROCm GPUs on one host", allow_module_level=True)
pytest.importorskip("vllm", reason="the loop needs vLLM's GPU build")
pytest.importorskip("megatron.core", reason="the loop needs megatron-core")
ray = pytest.importorskip("ray")

from colocate_rl import loop  # noqa: E402
from colocate_rl.placement.ray_tools import NOSET  # noqa: E402
from colocate_rl.session import start_session  # noqa: E402

from gpu_runs import planned  # noqa: E402 - same folder
from test_loop_gpu import gpu_cfg  # noqa: E402 - same folder


@pytest.fixture(scope="module")
def two_gpu_nodes():
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in NOSET}
    os.environ.update(NOSET)  # raylets and their workers: Ray leaves visible devices to the placement
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 0})
    nodes = [c.add_node(num_cpus=4, num_gpus=1, env_vars={"CUDA_VISIBLE_DEVICES": str(k),
                                                          "HIP_VISIBLE_DEVICES": str(k)}) for k in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield nodes
    ray.shutdown()
    c.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_colocated_one_gpu_per_node(tmp_path, tiny_model, two_gpu_nodes):
    s = start_session(*planned(gpu_cfg(tmp_path, tiny_model("qwen3-small"), **{"placement.nnodes": "2",
                                                                       "placement.launcher": "ray"})))
    try:
        procs = s.workers.processes()
        ranks, engines = procs["ranks"], procs["engines"]
        assert len({r["node_id"] for r in ranks}) == 2 and s.workers.node_senders == [[0], [1]]
        for k, (r, e) in enumerate(zip(ranks, engines)):
            assert e["node_id"] == r["node_id"] and r["env"]["LOCAL_RANK"] == "0"
            assert e["uuids"] == [r["uuid"]], f"rank {k} and engine {k} share one GPU"
            assert r["env"]["MASTER_ADDR"] == ranks[0]["node_ip"]
        assert ranks[0]["uuid"] != ranks[1]["uuid"], "one GPU per node"
        for step in range(2):
            m = loop.step(s)
            s.step = step + 1
            assert m["train_rollout_logprob_abs_diff"] <= 2e-3, m["train_rollout_logprob_abs_diff"]
            assert m["sync/bytes"] > 0
        assert s.workers.verify() > 0
    finally:
        s.close()


def test_disaggregated_one_actor_node_one_rollout_node(tmp_path, tiny_model, two_gpu_nodes):
    s = start_session(*planned(gpu_cfg(tmp_path, tiny_model("qwen3-small"), **{
        "placement.mode": "disaggregated", "placement.nnodes": "2", "placement.actor_nodes": "1",
        "placement.rollout_nodes": "1", "placement.launcher": "auto"})))
    try:
        for step in range(2):
            m = loop.step(s, last=step == 1)
            s.step = step + 1
            assert m["train_rollout_logprob_abs_diff"] <= 2e-3 and m["sync/bytes"] > 0
        procs = s.workers.processes()
        rank, engine = procs["ranks"][0], procs["engines"][0]
        assert rank["node_id"] != engine["node_id"] and rank["broadcast"][0] == rank["node_ip"]
        assert s.workers.verify() > 0
    finally:
        s.close()

