"""Trainer/sampler logprob gap in bf16 on CPU, with and without an fp32 residual stream in the
actor (actor.fp32_residual), against the real vLLM engine (its CPU build) in the colocated loop.

    python benchmarks/gap/lp_gap_cpu.py      # ~5 min on 2 cores; writes benchmarks/results/lp_gap_cpu.json

Model: the random-weight `qwen3-deep` shape (16 layers, hidden 256), bf16 on both sides; the
arithmetic prompts, 16 prompts x 4 samples x up to 48 tokens, lr 1e-6. Each setting runs in its own
process for --steps steps; the gap is the loop's train_rollout_logprob_abs_diff (mean |actor logprob
- vLLM logprob| over response tokens, before the step's update). Also reported: each setting's
actor logprobs against the fp32 actor's on one batch (the actor's own bf16 rounding).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]  # common/; batches.py builds the fp32 actor
from common.loop_overrides import loop_overrides  # noqa: E402

RESULT = Path(__file__).resolve().parents[1] / "results" / "lp_gap_cpu.json"


def job(fp32_residual: bool, steps: int, out: Path) -> None:
    import torch
    from batches import build_actor

    from colocate_rl import loop
    from colocate_rl.config import Config, ModelConfig, load
    from colocate_rl.models.tiny import ensure_model
    from colocate_rl.plan import resolve
    from colocate_rl.session import start_session

    root = Path(os.environ.get("COLOCATE_RL_CACHE", ROOT / ".cache"))
    path = ensure_model("qwen3-deep", root / "models" / "qwen3-deep")
    over = [*loop_overrides(path, root, f"lp_gap_{fp32_residual}", prompts=16, n=4, tokens=48, micro=16, gpus=0,
                            fp32_residual=str(fp32_residual).lower()), "eval.every=0", "checkpoint.at_end=false"]
    cfg = load(Config(model=ModelConfig(path=str(path))), overrides=over)
    s = start_session(cfg, resolve(cfg))
    try:
        # One batch scored by this actor before any update, for the comparison with the fp32 actor.
        batch = s.buffer.generate(s.sampler.next_batch())
        with s.handoff.actor_owned(changes_weights=False):
            bf16 = s.actor.compute_logprobs(batch)
        gaps = []
        for _ in range(steps):
            m = loop.step(s)
            s.step += 1
            gaps.append(m["train_rollout_logprob_abs_diff"])
            print(f"fp32_residual={fp32_residual} step {s.step}: gap {gaps[-1]:.5f}", flush=True)
    finally:
        s.close()
    cfg32 = load(Config(model=ModelConfig(path=str(path))), overrides=[*over, "model.dtype=float32"])
    fp32 = build_actor(cfg32).compute_logprobs(batch)
    mask = batch.loss_mask
    out.write_text(json.dumps({"gaps": gaps, "actor_bf16_vs_fp32_mean": float((bf16 - fp32)[mask].abs().mean()),
                               "tokens": int(mask.sum()), "torch": torch.__version__}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--job", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        return job(args.job[0] == "true", args.steps, Path(args.job[1]))
    runs = {}
    for setting in ("false", "true"):
        tmp = ROOT / ".cache" / f"lp_gap_{setting}.json"
        subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--job", setting, str(tmp)],
                       check=True, cwd=ROOT)
        runs[setting] = json.loads(tmp.read_text())
    import vllm

    result = {
        "benchmark": "lp_gap_cpu",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": runs["false"]["torch"], "vllm": vllm.__version__,
                    "date": datetime.date.today().isoformat()},
        "settings": {"model": "colocate_rl.models.tiny qwen3-deep (16 layers, hidden 256), bf16",
                     "batch": "16 prompts x 4 samples x up to 48 tokens, arithmetic", "steps": args.steps},
        "gap_mean": {"bf16_residual": statistics.fmean(runs["false"]["gaps"]),
                     "fp32_residual": statistics.fmean(runs["true"]["gaps"])},
        "gap_per_step": {"bf16_residual": runs["false"]["gaps"], "fp32_residual": runs["true"]["gaps"]},
        "actor_bf16_vs_fp32_mean": {"bf16_residual": runs["false"]["actor_bf16_vs_fp32_mean"],
                                    "fp32_residual": runs["true"]["actor_bf16_vs_fp32_mean"]},
        "tokens_in_fp32_comparison": runs["false"]["tokens"],
    }
    gap = result["gap_mean"]
    result["gap_ratio_fp32_over_bf16_residual"] = gap["fp32_residual"] / gap["bf16_residual"]
    print(json.dumps(result, indent=1))
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
