"""One GPU: seconds per GRPO step of our colocated loop vs TRL's GRPOTrainer with vLLM in colocate
mode, in one run, with the same model shape, prompts, samples per prompt, completion length and
optimizer settings; and each side's trainer/sampler logprob gap.

    python benchmarks/peers/gpu_vs_trl.py --out benchmarks/results/gpu_vs_trl_h200.json

Model: the random-weight Qwen3-0.6B shape in bf16 (colocate_rl.models.tiny), both sides loading
the same folder. Prompts: the arithmetic train set; 64 prompts x 8 samples, up to 256 tokens,
temperature 1. Optimizer: Adam lr 1e-6, constant, grad clip 1.0, clip 0.2/0.28, no KL, one step per
batch, token-mean loss. Both sides sleep vLLM at level 2 while training and wake weights before KV
cache. Ours: Megatron actor, bf16 params with fp32 main params and (its default) an fp32 residual
stream. TRL: fp32 weights under bf16 autocast (its mixed precision), vllm_enable_sleep_mode=True.
Each side runs in its own process, one after the other; the first step of each is warm-up and not
counted.

TRL's step time moved by up to 60% between machines, so one pair says little: ``--pairs 3`` runs
a series of alternating pairs on one machine and reports every pair's ratio, their median and
their spread. Both sides also ran faster late in a lease than early (15-20% from the first pair to
the third, `gpu_vs_trl_256_pairs_h200.json`), so the order alternates too: ours then TRL, TRL then
ours, ours then TRL (ABBA), and a drift shared by both sides cancels in the median rather than
favouring whichever side runs second. A series too long for one command continues over several:
``--sides N`` runs only the next N runs of this machine's series (under
$COLOCATE_RL_CACHE/gpu_vs_trl/<tokens>/pairK/, one folder per pair), and reports the pairs finished
so far; ``--summarize <folder>`` rebuilds the result from a pair's or a series' records.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common/
from common.loop_overrides import loop_overrides  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("trl_runner.py")


def our_overrides(args, path: Path, root: Path) -> list[str]:
    return [*loop_overrides(path, root, "gpu_vs_trl", prompts=args.prompts, n=args.n, tokens=args.tokens,
                            micro=args.micro, lr=args.lr, fp32_residual=args.fp32_residual),
            f"steps={args.steps + 1}", f"rollout.gpu_memory_utilization={args.gpu_mem}", "eval.every=0"]


def ours_job(args, path: Path, root: Path, out: Path) -> None:
    """Our colocated steps, timed one by one (the loop's own per-phase times come along)."""
    from colocate_rl import loop
    from colocate_rl.config import Config, ModelConfig, load
    from colocate_rl.plan import resolve
    from colocate_rl.session import start_session

    cfg = load(Config(model=ModelConfig(path=str(path))), overrides=our_overrides(args, path, root))
    s = start_session(cfg, resolve(cfg))
    steps = []
    try:
        for _ in range(args.steps + 1):
            t = time.perf_counter()
            m = loop.step(s)
            steps.append({"wall": time.perf_counter() - t, "lp_diff": m["train_rollout_logprob_abs_diff"],
                          "response_len": m["rollout/response_len"],
                          **{k[5:]: v for k, v in m.items() if k.startswith("time/")}})
            s.step += 1
            print(f"ours step {len(steps) - 1}: {steps[-1]['wall']:.2f}s lp diff {steps[-1]['lp_diff']:.4f}",
                  flush=True)
    finally:
        s.close()
    out.write_text(json.dumps({"steps": steps, "machine": machine(), "settings": settings(args)}))


def settings(args) -> dict:
    """The run's options (what the ours-side child is started with), without the file arguments."""
    return {k: v for k, v in vars(args).items() if k not in ("out", "job", "summarize", "sides")}


def machine() -> dict:
    import torch
    import vllm

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "vllm": vllm.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}


def child(cmd: list[str], what: str) -> None:
    print(f"[{what}] {' '.join(cmd[1:3])} ...", flush=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{what} failed (exit {proc.returncode})")
    print(f"[{what}] done in {time.perf_counter() - t:.0f}s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side, after one warm-up step")
    ap.add_argument("--micro", type=int, default=16, help="completions per forward/backward, both sides")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--fp32-residual", choices=("auto", "true", "false"), default="auto",
                    help="our actor.fp32_residual (auto: unset, on for a bf16 actor)")
    ap.add_argument("--gpu-mem", type=float, default=0.5, help="vLLM's share of the card while awake, both sides")
    ap.add_argument("--pairs", type=int, default=1, help="a new series of this many alternating pairs (ABBA order)")
    ap.add_argument("--sides", type=int, metavar="N",
                    help="continue this machine's series by its next N runs (one side each) instead")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--summarize", type=Path, metavar="DIR",
                    help="only rebuild the result from a finished run's ours.json and trl.json in DIR, "
                         "or a series' from its pair*/ folders")
    args = ap.parse_args()
    if args.summarize:  # a series' folder holds pair*/ folders, a pair's its two records
        is_series = any(args.summarize.glob("pair*/"))
        result = series_result(args, args.summarize) if is_series else summarize_dir(args, args.summarize)
        if result is None:
            raise SystemExit(f"no pair of {args.summarize} has finished")
        return write(args, result)

    from colocate_rl.models.tiny import ensure_model

    root = Path(os.environ.get("COLOCATE_RL_CACHE", ".cache"))
    path = ensure_model(args.shape, root / "models" / f"{args.shape}-bf16", dtype="bfloat16")
    if args.job:
        return ours_job(args, path, root, args.job)
    series = root / "gpu_vs_trl" / str(args.tokens)
    if args.sides is None:  # a new series
        shutil.rmtree(series, ignore_errors=True)
    for _ in range(args.sides if args.sides is not None else 2 * args.pairs):
        k, side = next_run(series)
        work = series / f"pair{k}"
        work.mkdir(parents=True, exist_ok=True)
        (run_ours if side == "ours" else run_trl)(args, path, root, work)
        with open(work / "order", "a") as f:  # which side ran first, for the result
            f.write(side + "\n")
    if result := series_result(args, series):
        return write(args, result)
    k, side = next_run(series)
    print(f"no pair of {series} has finished yet; its next run is pair {k}, {side}")


def finished_pairs(series: Path) -> list[Path]:
    """The pair folders of a series that hold both sides' records, in pair order."""
    return sorted((f.parent for f in series.glob("pair*/trl.json") if (f.parent / "ours.json").is_file()),
                  key=lambda d: int(d.name[4:]))


def next_run(series: Path) -> tuple[int, str]:
    """(pair, side) of the series' next run in ABBA order: pair 0 ours then TRL, pair 1 TRL then ours,
    pair 2 ours then TRL, …; a run counts once its record (ours.json, trl.json) is written."""
    k = 0
    while True:
        for side in ("ours", "trl")[:: 1 if k % 2 == 0 else -1]:
            if not (series / f"pair{k}" / f"{side}.json").is_file():
                return k, side
        k += 1


def series_result(args, series: Path) -> dict | None:
    """The finished pairs of a series: one pair's result, several pairs' summary, or None."""
    results = [summarize_dir(args, d) for d in finished_pairs(series)]
    return (results[0] if len(results) == 1 else pairs_summary(results)) if results else None


def summarize_dir(args, folder: Path) -> dict:
    """The result rebuilt from a finished pair's ours.json and trl.json."""
    ours, trl = (json.loads((folder / f).read_text()) for f in ("ours.json", "trl.json"))
    smi = folder / "gpu.txt"  # scripts/gpu_checks.sh's nvidia-smi record, for runs whose ours.json
    if "machine" not in ours and smi.is_file():  # predates its machine entry
        ours["machine"] = {"gpu": smi.read_text().splitlines()[1].split(",")[0]}
    order = folder / "order"  # absent in series run before the order alternated: ours ran first
    return {**summarize(args, ours, trl), "order": order.read_text().split() if order.is_file() else ["ours", "trl"]}


def run_ours(args, path: Path, root: Path, work: Path) -> None:
    """Our side of a pair, in its own process, into work/ours.json."""
    argv = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in settings(args).items()
            if v is not False and k != "pairs"]
    child([sys.executable, str(Path(__file__).resolve()), *argv, "--job", str(work / "ours.json")], "ours")


def run_trl(args, path: Path, root: Path, work: Path) -> None:
    """TRL's side of a pair, in its own process, into work/trl.json: the same prompts, tokenized as
    our loop tokenizes them (the runner stops if TRL's tokenizer disagrees)."""
    from colocate_rl.config import ArithmeticConfig, Config, ModelConfig, load
    from colocate_rl.data.arithmetic import arithmetic_problems
    from colocate_rl.data.prompts import load_prompts
    from transformers import AutoTokenizer

    cfg = load(Config(model=ModelConfig(path=str(path))), overrides=our_overrides(args, path, root))
    ids = [list(x.prompt_ids) for x in list(load_prompts(cfg.data, AutoTokenizer.from_pretrained(path)))[:8]]
    spec = {"model": str(path), "seed": 0, "threads": 8, "n": args.n, "temperature": 1.0, "lr": args.lr,
            "grad_clip": 1.0, "eps_low": 0.2, "eps_high": 0.28, "budget_s": 0, "eval_every_s": 0, "eval": [],
            "eval_max_tokens": 4, "force_length": False, "out_dir": str(work / "trl-trainer"),
            "train": arithmetic_problems(ArithmeticConfig(), "train"), "train_prompt_ids": ids,
            "prompts_per_step": args.prompts, "max_tokens": args.tokens, "max_steps": args.steps + 1, "gpu": True,
            "micro_batch": args.micro, "vllm_gpu_memory_utilization": args.gpu_mem,
            "max_model_len": 32 + args.tokens}
    (work / "trl.spec.json").write_text(json.dumps(spec))
    child([sys.executable, str(RUNNER), str(work / "trl.spec.json"), str(work / "trl.json")], "trl")


def pairs_summary(results: list[dict]) -> dict:
    """Alternating pairs: each pair's ratio (TRL's seconds per step over ours), their median and
    spread, and each side's logprob gap per pair; every pair's full result beside them."""
    ratios = [r["step_s_vs_trl"] for r in results]
    return {
        "benchmark": "gpu_vs_trl, alternating pairs",
        "machine": results[0]["machine"], "settings": {**results[0]["settings"], "pairs": len(results)},
        "step_s_vs_trl_median": statistics.median(ratios),
        "step_s_vs_trl_spread": [min(ratios), max(ratios)],
        "step_s_vs_trl_per_pair": ratios,
        "ours_s_per_step_per_pair": [r["ours_s_per_step"] for r in results],
        "trl_s_per_step_per_pair": [r["trl_s_per_step"] for r in results],
        "ours_logprob_abs_diff_per_pair": [r["ours_logprob_abs_diff_mean"] for r in results],
        "trl_logprob_abs_diff_per_pair": [r["trl_logprob_abs_diff_mean"] for r in results],
        "pairs": results,
    }


def summarize(args, ours: dict, trl: dict) -> dict:
    """The result from each side's own record: medians over the steps after the warm-up one."""
    timed = ours["steps"][1:]
    trl_steps = trl["step_s"][1:]
    trl_logs = [lg for lg in trl["logs"] if "sampling/sampling_logp_difference/mean" in lg][1:]
    ours_s, trl_s = statistics.median(x["wall"] for x in timed), statistics.median(trl_steps)
    return {
        "benchmark": "gpu_vs_trl",
        "machine": {**ours.get("machine", {}), "trl": trl["versions"]["trl"],
                    "transformers": trl["versions"]["transformers"], "trl_side_torch": trl["versions"]["torch"]},
        "settings": ours.get("settings") or settings(args),
        "ours_s_per_step": ours_s,
        "trl_s_per_step": trl_s,
        "step_s_vs_trl": trl_s / ours_s,
        "ours_logprob_abs_diff_mean": statistics.fmean(x["lp_diff"] for x in timed),
        "trl_logprob_abs_diff_mean": statistics.fmean(lg["sampling/sampling_logp_difference/mean"]
                                                      for lg in trl_logs) if trl_logs else None,
        "ours_response_len": statistics.fmean(x["response_len"] for x in timed),
        "trl_response_len": statistics.fmean(lg["completions/mean_length"] for lg in trl_logs) if trl_logs else None,
        "ours_phase_s": {k: statistics.median(x[k] for x in timed) for k in timed[0]
                         if k not in ("wall", "lp_diff", "response_len")},
        "trl_phase_s": {k: statistics.median(v[1:]) for k, v in trl["phases"].items()},
        "ours_steps": ours["steps"],  # every step's wall time, phases and lp diff (the first is warm-up)
        "trl_steps_s": trl["step_s"],
        "trl_startup_s": trl["startup_s"],
    }


def write(args, result: dict) -> None:
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
