"""Several nodes in the layout and the placement's pure parts: what a node holds (GPUs; on CPU the
actor ranks split over the nodes), the checks that name the field, each node's senders and merged
sync message, which variables of the driver's environment reach every process, and where a group's
store listens."""

from __future__ import annotations

import pytest

from colocate_rl.config import Config, ConfigError, ModelConfig, load
from colocate_rl.placement.disaggregated import pools
from colocate_rl.plan import resolve
from colocate_rl.resolved import Layout

pytest.importorskip("ray")
from colocate_rl.placement.nodes import master_addr, network_env  # noqa: E402 - needs ray
from colocate_rl.placement.ray_colocated import node_messages, senders_by_node  # noqa: E402
from colocate_rl.placement.ray_tools import rank_names  # noqa: E402


def layout(*overrides: str) -> Layout:
    """The plan's layout (ConfigError naming the field when it does not fit)."""
    return resolve(load(Config(model=ModelConfig(path="some/model")), overrides=list(overrides))).layout


def test_colocated_gpu_nodes_one_switch():
    one = layout("placement.gpus_per_node=8", "rollout.tensor_parallel_size=2")
    two = layout("placement.gpus_per_node=8", "rollout.tensor_parallel_size=2", "placement.nnodes=2")
    assert (one.actor_gpus, one.engines, one.ranks_per_node, one.engines_per_node) == (8, 4, 8, 4)
    assert (two.actor_gpus, two.dp, two.engines, two.ranks_per_node, two.engines_per_node) == (16, 16, 8, 8, 4)
    assert (two.actor_nodes, two.rollout_nodes) == (2, 2)


def test_cpu_nodes_hold_the_actor_ranks_evenly_and_one_engine_each():
    two = layout("placement.gpus_per_node=0", "placement.nnodes=2")  # dp derived: one rank per node
    assert (two.actor_gpus, two.dp, two.ranks_per_node, two.engines, two.engines_per_node) == (2, 2, 1, 2, 1)
    four = layout("placement.gpus_per_node=0", "placement.nnodes=2", "actor.dp=4")
    assert (four.ranks_per_node, four.engines) == (2, 2)
    one = layout("placement.gpus_per_node=0")  # one node: as before
    assert (one.actor_gpus, one.engines, one.ranks_per_node) == (1, 1, 1)
    with pytest.raises(ConfigError, match=r"actor.dp=3 = 3 actor ranks do not split evenly over the 2 actor node"):
        layout("placement.gpus_per_node=0", "placement.nnodes=2", "actor.dp=3")


def test_disaggregated_nodes():
    amd = layout("placement.mode=disaggregated", "placement.nnodes=3", "placement.gpus_per_node=8",
                 "placement.actor_nodes=2", "placement.rollout_nodes=1", "actor.tp=4", "actor.pp=4", "actor.ep=4",
                 "rollout.tensor_parallel_size=8")
    assert (amd.ranks_per_node, amd.engines, amd.engines_per_node, amd.actor_nodes) == (8, 1, 1, 2)
    lay = layout("placement.mode=disaggregated", "placement.nnodes=3", "placement.gpus_per_node=0",
                 "placement.actor_nodes=2", "placement.rollout_nodes=1")
    p = pools(lay)
    assert (lay.actor_gpus, lay.ranks_per_node, lay.engines) == (2, 1, 1)
    assert p.per_node(p.actor, p.actor_nodes) == [[{"CPU": 1.0}], [{"CPU": 1.0}]] and not p.one_node
    with pytest.raises(ConfigError, match=r"rollout.num_engines=3 does not split evenly over "
                                          r"placement.rollout_nodes=2"):
        layout("placement.mode=disaggregated", "placement.nnodes=3", "placement.gpus_per_node=0",
               "placement.actor_nodes=1", "placement.rollout_nodes=2", "rollout.num_engines=3")
    with pytest.raises(ConfigError, match=r"placement.actor_nodes=0 and placement.rollout_nodes=2 must both be >= 1"):
        layout("placement.mode=disaggregated", "placement.nnodes=2", "placement.gpus_per_node=8",
               "placement.actor_nodes=0", "placement.rollout_nodes=2")
    # 3 engines of TP4 fill 2 nodes of 6 GPUs, but one of them would span both nodes.
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=4 does not divide the 6 GPUs of a node"):
        layout("placement.mode=disaggregated", "placement.nnodes=3", "placement.gpus_per_node=6",
               "placement.actor_nodes=1", "placement.rollout_nodes=2", "rollout.tensor_parallel_size=4",
               "rollout.num_engines=3")


def test_each_node_merges_only_its_own_senders():
    # GPU: every rank is on a device of its own; CPU: a node's ranks share one "device" id, and on
    # one machine every node's CPU has the same id, so only grouping by node keeps them apart.
    assert senders_by_node(["a", "b", "c", "d"], [0, 0, 1, 1], 2) == [[0, 1], [2, 3]]
    assert senders_by_node(["cpu-x"] * 4, [0, 0, 1, 1], 2) == [[0], [2]]
    parts = [({"cpu-x": b"node0"}, 8), (None, 0), ({"cpu-x": b"node1"}, 8), (None, 0)]
    assert node_messages(parts, [[0], [2]]) == [{"cpu-x": b"node0"}, {"cpu-x": b"node1"}]
    with pytest.raises(ValueError, match="two weight-sync payloads for device cpu-x"):
        node_messages(parts, [[0, 2]])  # one merged message for both nodes: the ids collide


def test_network_variables_reach_every_process(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0")
    monkeypatch.setenv("NOT_NETWORK", "x")
    env = network_env()
    assert {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1", "NCCL_IB_HCA": "mlx5_0"}.items() <= env.items()
    assert "NOT_NETWORK" not in env


def test_rank_names_say_where():
    names = rank_names([{"node_ip": "10.0.0.1", "node_id": "abcdef0123"},
                        {"node_ip": "10.0.0.2", "node_id": "99887766aa"}])
    assert names == ["actor rank 0 of 2 on 10.0.0.1 (Ray node abcdef01)",
                     "actor rank 1 of 2 on 10.0.0.2 (Ray node 99887766)"]


def test_a_group_on_one_node_rendezvous_on_loopback():
    a0, a1, b = ({"node_ip": "10.0.0.1", "node_id": "a"}, {"node_ip": "10.0.0.1", "node_id": "a"},
                 {"node_ip": "10.0.0.2", "node_id": "b"})
    assert master_addr([a0]) == master_addr([a0, a1]) == "127.0.0.1"
    assert master_addr([a0, a1, b]) == "10.0.0.1" and master_addr([b, a0]) == "10.0.0.2"
    # Two Ray nodes of one machine share an address but not a node: the first one's address.
    assert master_addr([a0, {"node_ip": "10.0.0.1", "node_id": "c"}]) == "10.0.0.1"
