"""The config overrides the loop benchmarks share (handoff.py, gpu_vs_trl.py, lp_gap_cpu.py): a
bf16 model folder on the arithmetic prompts and reward, in-process engine, no wandb or progress
bars, run folders under the cache. ``fp32_residual``: auto (unset: the project's default), true or false."""

from __future__ import annotations

from pathlib import Path


def loop_overrides(path: Path, root: Path, run_name: str, *, prompts: int, n: int, tokens: int, micro: int,
                   lr: float = 1e-6, gpus: int = 1, fp32_residual: str = "auto") -> list[str]:
    return [f"model.path={path}", "model.dtype=bfloat16", "data.train=arithmetic", "data.apply_chat_template=false",
            "data.max_prompt_tokens=32", f"data.prompts_per_step={prompts}", "reward.name=arithmetic",
            f"rollout.n={n}", f"rollout.max_response_tokens={tokens}", f"actor.lr={lr}",
            f"actor.micro_batch_size={micro}", f"placement.gpus_per_node={gpus}", "placement.launcher=local",
            "logging.wandb_mode=disabled", "logging.progress=false", f"logging.run_dir={root / 'bench'}",
            f"logging.run_name={run_name}",
            f"actor.fp32_residual={'null' if fp32_residual == 'auto' else fp32_residual}"]
