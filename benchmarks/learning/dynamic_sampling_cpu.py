"""DAPO's dynamic sampling on the tiny task, on CPU: the quickstart's recipe (preset=tiny) run twice
with the same seeds, without and with ``rollout.dynamic_sampling``, and the held-out accuracy
curve, train reward, groups kept and seconds per step of each.

    .venv/bin/python benchmarks/learning/dynamic_sampling_cpu.py [--steps 150] [--out benchmarks/results/dynamic_sampling_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(name: str, steps: int, run_dir: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, str(ROOT / "recipes/qwen3_grpo.py"), "preset=tiny", f"steps={steps}",
           f"logging.run_dir={run_dir}", f"logging.run_name={name}", "logging.wandb_mode=disabled",
           "logging.progress=false", "logging.plot=false", "checkpoint.at_end=false", *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if r["step"] > 0]
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    return {
        "command": " ".join(cmd[1:]), "wall_s": wall,
        "eval_accuracy": {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r},
        "train_reward_first_last_10": [mean([r["reward/mean"] for r in steps_rows[:10]]),
                                       mean([r["reward/mean"] for r in steps_rows[-10:]])],
        "step_s_mean": mean([r["time/step"] for r in steps_rows]),
        "dynamic_rounds_mean": mean([r.get("rollout/dynamic_rounds", 0.0) for r in steps_rows]),
        "dynamic_kept_frac_mean": mean([r.get("rollout/dynamic_kept_frac", 1.0) for r in steps_rows]),
        "groups_per_step_mean": mean([r.get("rollout/dynamic_groups", 32.0) for r in steps_rows]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    run_dir = ROOT / ".cache" / "bench" / "dynamic_sampling"
    out = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")},
        "plain": run("plain", args.steps, run_dir, []),
        "dynamic_sampling": run("dynamic", args.steps, run_dir, ["rollout.dynamic_sampling=true"]),
    }
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
