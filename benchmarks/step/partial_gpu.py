"""Partial rollouts against whole batches on one GPU, where answer lengths have a long tail: the
recipe itself (preset=learn-0.6b, Qwen3-0.6B's shape) on a model whose answers are long-tailed by
construction (colocate_rl/models/long_tail.py: about 1 answer in 60 runs to the length cap, the
others stop after a few words), in runs without and with rollout.partial.enable that alternate on
one lease (off, on, off, on, ...), each its own process (benchmarks/step/recipe_runs.py).

    python benchmarks/step/partial_gpu.py --out benchmarks/results/partial_rollouts_h200.json [--pairs 2]

Per run: the median seconds per step (step 1, with its compiles, left out) and the tokens generated
per second of step; then the median ratio without / with over the pairs. The arithmetic reward is 0
on random words, so every advantage is 0: this measures speed only (learning with partial rollouts
is measured on the CPU, partial_rollouts_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def summary(run: dict, prompts: int, n: int) -> dict:
    """Median seconds per step after the first, and generated tokens per second of step."""
    steps = [s for s in run["steps"] if s["step"] >= 2 and s["step_s"]]
    if not steps:
        return {"steps": 0}
    # With partial rollouts a step generates for more rows than it trains; without, every row is trained.
    tokens = [s.get("partial/tokens", (s["response_tokens"] or 0) * prompts * n) for s in steps]
    return {"steps": len(steps), "step_s_median": round(statistics.median(s["step_s"] for s in steps), 3),
            "generate_s_median": round(statistics.median(s["phase_s"].get("generate", 0) for s in steps), 3),
            "tokens_per_s": round(sum(tokens) / sum(s["step_s"] for s in steps), 1),
            "response_tokens_mean": round(statistics.mean(s["response_tokens"] or 0 for s in steps), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=".cache/bench/partial_gpu", help="model folders and run folders")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="rollout.max_response_tokens: where the tail stops")
    # 1 answer in 60 at the cap leaves 7 groups of 8 in 8 without one: 16 more groups than trained
    # let a step finish on those while the tail goes on in later steps, up to 4 versions old.
    ap.add_argument("--over-sample", type=int, default=16, help="rollout.partial.over_sample")
    ap.add_argument("--staleness", type=int, default=4, help="rollout.max_staleness")
    ap.add_argument("--enter", type=float, default=0.005, help="long_tail_model's chance of entering the loop")
    ap.add_argument("--shape", default="qwen3-0.6b", help="the model's shape (models/tiny.py), tiny tokenizer")
    ap.add_argument("--set", nargs="*", default=[], help="more overrides for every run")
    args = ap.parse_args()

    from colocate_rl.models.long_tail import long_tail_model
    from colocate_rl.models.tiny import ensure_model

    work = Path(args.work)
    model = work / f"{args.shape}-long-tail-{args.enter}"
    if not (model / "model.safetensors").is_file():
        long_tail_model(ensure_model(args.shape, work / args.shape, dtype="bfloat16"), model, enter=args.enter)
    base = ["preset=learn-0.6b", f"model.path={model}", "model.synthesize=''", "sft.steps=0", "eval.every=0",
            f"steps={args.steps}", f"rollout.max_response_tokens={args.tokens}",
            f"data.prompts_per_step={args.prompts}", f"rollout.n={args.n}", "rollout.kv_cache_memory_mb=16384",
            "rollout.gpu_memory_utilization=0.3", "checkpoint.every=0", "checkpoint.at_end=false", "logging.plot=false",
            *args.set]
    on = (f"rollout.partial.enable=true rollout.partial.over_sample={args.over_sample} "
          f"rollout.max_staleness={args.staleness}")
    runs = [spec for i in range(1, args.pairs + 1)
            for spec in (f"off_{i}=rollout.partial.enable=false", f"on_{i}={on}")]
    cmd = [sys.executable, str(ROOT / "benchmarks/step/recipe_runs.py"),
           "--recipe", str(ROOT / "recipes/qwen3_grpo.py"),
           "--base", *base, *(a for spec in runs for a in ("--run", spec)), "--run-dir", str(work / "runs"),
           "--out", args.out]
    subprocess.run(cmd, check=False)

    result = json.loads(Path(args.out).read_text())
    result["benchmark"] = " ".join(["python", "benchmarks/step/partial_gpu.py", *sys.argv[1:]])
    summ = result["summary"] = {name: summary(run, args.prompts, args.n) for name, run in result["runs"].items()}
    done = [i for i in range(1, args.pairs + 1)  # pairs whose two runs both stepped (a cut run has none)
            if summ.get(f"off_{i}", {}).get("steps") and summ.get(f"on_{i}", {}).get("steps")]
    summ["step_s_ratio_off_over_on"] = [summ[f"off_{i}"]["step_s_median"] / summ[f"on_{i}"]["step_s_median"]
                                        for i in done]
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, row in summ.items():
        print(f"{name}: {row}")


if __name__ == "__main__":
    main()
