"""The config of a short loop run that the GPU tests share: a recipe's tiny preset on the model
folder given, 16 prompts x 4 samples x 16 tokens, vLLM eager in its own process with a 1 GiB KV
cache, no SFT, eval, checkpoint or wandb. A test passes what it is about as overrides."""

from __future__ import annotations

from pathlib import Path

from colocate_rl.cli import preset_config
from colocate_rl.config import Config, load
from colocate_rl.plan import RunPlan, resolve

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def run_cfg(recipe: str, tmp_path, model, **over: str) -> Config:
    """``over``: dotted config keys → values as on the command line, over the shared ones."""
    base = preset_config(RECIPES / f"{recipe}.yaml", "tiny", recipe=recipe)
    args = {"model.path": str(model), "model.synthesize": "''", "model.dtype": "bfloat16",
            "logging.run_dir": str(tmp_path), "logging.run_name": "gpu", "logging.wandb_mode": "disabled",
            "logging.progress": "false", "logging.plot": "false", "data.prompts_per_step": "16", "rollout.n": "4",
            "rollout.max_response_tokens": "16", "rollout.multiprocess": "true", "rollout.kv_cache_memory_mb": "1024",
            "rollout.gpu_memory_utilization": "0.3", "rollout.enforce_eager": "true", "sft.steps": "0",
            "eval.every": "0", "checkpoint.at_end": "false", "placement.gpus_per_node": "1",
            "placement.launcher": "local", **over}
    return load(base, overrides=[f"{k}={v}" for k, v in args.items()])


def planned(cfg: Config) -> tuple[Config, RunPlan]:
    """(cfg, the plan resolved from it): what loop.run and start_session take."""
    return cfg, resolve(cfg)
