"""Runs one recipe several times, each with its own overrides, and writes one results file: every
run's command, wall time, the seconds outside its steps (start-up, shutdown), each step's metrics (logprob gap,
seconds per phase, sync bytes and GB/s, tokens/s) and the memory plan next to the measured bytes.

    python benchmarks/step/recipe_runs.py --recipe recipes/dsv4_flash_grpo.py \\
        --base preset=mini-1gpu rollout.enforce_eager=true \\
        --run sleep2_r3="steps=3" --run sleep2_no_r3="steps=2 rollout.routing_replay=false" \\
        --run sleep1_r3="steps=2 rollout.sleep_level=1" \\
        --out benchmarks/results/dsv4_mini_colocated_h200.json

Runs go one after another, so a later one finds the compile caches the first one wrote
(rollout.compile_cache). A run that fails is recorded with its exit code and the end of its output;
the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

GiB = 2**30
# Environment variables that change what a run measures (kernel choices, warm-ups, caches).
ENV = ("VLLM_DEEP_GEMM_WARMUP", "VLLM_DISABLED_KERNELS", "VLLM_USE_FLASHINFER_SAMPLER", "COLOCATE_RL_CACHE")


def machine() -> dict:
    out = {"python": platform.python_version(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    for pkg in ("torch", "vllm", "megatron-core", "tilelang", "nvidia-cutlass-dsl", "quack-kernels"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out["gpu"] = f"{p.name} ({p.total_memory / GiB:.1f} GiB) x {torch.cuda.device_count()}"
    except ImportError:
        pass
    return out


def step_row(m: dict) -> dict:
    return {
        "step": m["step"], "train_rollout_logprob_abs_diff": m.get("train_rollout_logprob_abs_diff"),
        # The gap's distribution over the step's tokens, the first and last response tokens' means,
        # and the share of its sum in tokens more than 1 nat apart.
        **{f"train_rollout_logprob_abs_diff_{k}": m.get(f"train_rollout_logprob_abs_diff_{k}")
           for k in ("p50", "p99", "max", "first", "last", "tail_share")},
        "reward_mean": m.get("reward/mean"), "grad_norm": m.get("grad_norm"), "step_s": m.get("time/step"),
        # The token IS weights (trainer over sampler probability) and the share of groups that teach.
        "is_weight_max": m.get("is_weight_max"), "is_clamped_frac": m.get("is_clamped_frac"),
        "signal_groups": m.get("reward/signal_groups"),
        "phase_s": {k[5:]: v for k, v in m.items() if k.startswith("time/") and k != "time/step"},
        "sync_bytes": m.get("sync/bytes"), "sync_GBps": m.get("sync/GBps"),
        "rollout_tokens_per_s": m.get("rollout/tokens_per_s"), "train_tokens_per_s": m.get("tokens_per_s"),
        "response_tokens": m.get("rollout/response_len"),
        # Learning: held-out accuracy on the steps that ran an eval, the warm start on step 0; partial
        # rollouts' counts (groups trained, rows carried, tokens generated) where they ran.
        **{k: v for k, v in m.items() if k.startswith(("eval/", "sft/", "partial/"))},
    }


def collect(folder: Path) -> dict:
    """What one run folder holds: its steps and its memory plan next to the measured bytes."""
    metrics = folder / "metrics.jsonl"
    steps = [step_row(json.loads(line)) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    out: dict = {"steps": steps}
    memory = folder / "memory.json"
    if memory.is_file():
        d = json.loads(memory.read_text())
        out["memory_GiB"] = {phase: {"predicted": round(d["predicted"][phase] / GiB, 2),
                                     "measured": round(d["measured"][phase] / GiB, 2) if phase in d["measured"]
                                     else None} for phase in d["predicted"]}
        out["offloaded"] = d.get("offload")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--base", nargs="*", default=[], help="overrides every run gets")
    ap.add_argument("--run", action="append", required=True, help='NAME="key=value ..." (repeatable)')
    ap.add_argument("--run-dir", default="runs/recipe_runs")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    result = {"benchmark": f"benchmarks/step/recipe_runs.py --recipe {args.recipe}", "machine": machine(),
              "environment": {k: os.environ[k] for k in ENV if k in os.environ}, "runs": {}}
    for spec in args.run:
        name, _, extra = spec.partition("=")
        cmd = [sys.executable, args.recipe, *args.base, *extra.split(), f"logging.run_dir={args.run_dir}",
               f"logging.run_name={name}", "logging.progress=false", "logging.wandb_mode=disabled"]
        print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
        log = Path(args.run_dir) / f"{name}.log"  # written as the run goes: a run cut short keeps it
        log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(log, "w") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
        wall = time.perf_counter() - t0
        run = {"command": " ".join(["python", *cmd[1:]]), "exit_code": proc.returncode, "wall_s": round(wall, 1),
               **collect(Path(args.run_dir) / name)}
        stepped = sum(s["step_s"] or 0 for s in run["steps"])
        run["outside_steps_s"] = round(wall - stepped, 1) if run["steps"] else None  # start-up and shutdown
        run["log"] = str(log)
        if proc.returncode:
            run["output_tail"] = log.read_text(errors="replace")[-3000:]
        print(f"[{name}] exit {proc.returncode} after {wall:.0f} s, {len(run['steps'])} step(s)", flush=True)
        result["runs"][name] = run
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")  # what ran so far survives a later crash


if __name__ == "__main__":
    main()
