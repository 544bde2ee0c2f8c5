"""Disaggregated placement sized from config: the two pools' bundles, the published DeepSeek-V4
layout, the one-key switch of a recipe, and the plan's checks of the mode's options; and the
colocated mode's Ray bundle, which one actor rank and vLLM share."""

from __future__ import annotations

from pathlib import Path

import pytest

from colocate_rl.cli import preset_config
from colocate_rl.config import Config, ConfigError, ModelConfig, load
from colocate_rl.placement.disaggregated import pools
from colocate_rl.plan import RunPlan, resolve

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def plan(*overrides: str, mode: str = "disaggregated") -> RunPlan:
    return resolve(load(Config(model=ModelConfig(path="some/model")), overrides=[f"placement.mode={mode}", *overrides]))


def layout(*overrides: str):
    return plan(*overrides).layout


def test_deepseek_v4_layout_two_actor_nodes_one_rollout_node():
    p = pools(layout("placement.nnodes=3", "placement.gpus_per_node=8", "placement.actor_nodes=2",
                     "placement.rollout_nodes=1", "actor.tp=4", "actor.pp=4", "actor.ep=4",
                     "rollout.tensor_parallel_size=8"))
    assert p.actor == [{"GPU": 1.0, "CPU": 1.0}] * 16  # one Megatron rank per GPU of the two actor nodes
    assert p.rollout == [{"GPU": 8.0, "CPU": 1.0}]  # one TP8 engine holding the whole rollout node
    assert p.engine_gpus == 8


def test_one_node_split_and_several_engines():
    p = pools(layout("placement.gpus_per_node=8", "placement.actor_gpus=4", "rollout.tensor_parallel_size=2",
                     "rollout.num_engines=2"))
    assert len(p.actor) == 4 and p.rollout == [{"GPU": 2.0, "CPU": 1.0}] * 2
    two_gpu = pools(layout("placement.gpus_per_node=2", "placement.actor_gpus=1"))  # the H200 benchmark's layout
    assert two_gpu.actor == [{"GPU": 1.0, "CPU": 1.0}] and two_gpu.rollout == [{"GPU": 1.0, "CPU": 1.0}]


def test_engines_fill_the_rollout_gpus():
    """rollout.num_engines=0 (the default) is as many engines as the rollout GPUs hold; a number
    that does not fill them stops in the plan, naming the fix."""
    assert len(pools(layout("placement.gpus_per_node=8", "placement.actor_gpus=4",
                            "rollout.tensor_parallel_size=2")).rollout) == 2
    with pytest.raises(ConfigError, match=r"rollout.num_engines=1 x rollout.tensor_parallel_size=2 must equal the 4 "
                                          r"rollout GPUs \(set rollout.num_engines=2\)"):
        plan("placement.gpus_per_node=8", "placement.actor_gpus=4", "rollout.tensor_parallel_size=2",
             "rollout.num_engines=1")
    with pytest.raises(ConfigError, match="exceeds placement.gpus_per_node=8"):
        plan("placement.nnodes=3", "placement.gpus_per_node=8", "placement.actor_nodes=1",
            "placement.rollout_nodes=2", "rollout.tensor_parallel_size=16")


def test_cpu_bundles_and_the_one_key_switch_of_a_recipe():
    base = preset_config(RECIPES / "qwen3_grpo.yaml", "tiny", recipe="qwen3_grpo")
    p = pools(resolve(load(base, overrides=["placement.mode=disaggregated"])).layout)  # nothing else needed
    assert p.actor == [{"CPU": 1.0}] and p.rollout == [{"CPU": 1.0}] and p.engine_gpus == 0
    c2 = load(base, overrides=["placement.mode=disaggregated", "rollout.num_engines=2"])
    assert pools(resolve(c2).layout).rollout == [{"CPU": 1.0}] * 2


def test_off_policy_and_custom_fn_checks():
    with pytest.raises(ConfigError, match="need placement.mode=disaggregated"):
        plan("rollout.off_policy=true", mode="colocated")
    with pytest.raises(ConfigError, match="algorithm.is_clamp > 0"):
        plan("placement.gpus_per_node=0", "rollout.off_policy=true", "algorithm.is_clamp=0")
    assert plan("placement.gpus_per_node=0", "rollout.off_policy=true").scheduling.off_policy


def test_fp8_rollout_needs_gpus_in_either_mode():
    with pytest.raises(ConfigError, match="vLLM's CPU backend runs no FP8 weights"):
        plan("placement.gpus_per_node=0", "rollout.weight_quantization=fp8")
    colocated = plan("placement.gpus_per_node=1", "rollout.weight_quantization=fp8", mode="colocated")
    assert colocated.engine.weight_quantization == "fp8" and colocated.resolved.handoff == "colocated"
    with pytest.raises(ConfigError, match="rollout.weight_quantization='int4' is not one of"):
        plan("placement.gpus_per_node=0", "rollout.weight_quantization=int4")
    c = plan("placement.gpus_per_node=8", "placement.actor_gpus=4", "rollout.tensor_parallel_size=4",
             "rollout.weight_quantization=fp8")
    assert c.engine.weight_quantization == "fp8"


def test_colocated_bundle_holds_a_rank_and_the_engine():
    from colocate_rl.placement.ray_colocated import bundles_and_share

    for gpu in (True, False):
        bundles, share = bundles_and_share(2, gpu)
        assert len(bundles) == 2
        # What Ray reserves for an actor: the options given, else one CPU and no GPU.
        demand = {"GPU": share.get("num_gpus", 0), "CPU": share.get("num_cpus", 1)}
        for resource, amount in bundles[0].items():  # rank 0 and vLLM share bundle 0
            assert 2 * demand[resource] <= amount, (gpu, resource)
