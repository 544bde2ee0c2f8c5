"""Does a preset learn at width? Runs the recipe itself, several runs at once on one GPU, in three
stages that each pick from the one before, so the whole search fits a few commands:

    probe   warm starts only (steps=1): held-out accuracy after each sft setting of --grid
    sweep   the warm start closest to --target accuracy (within [--lo, --hi]), GRPO at each
            setting of --grid, for each of --seeds
    seeds   the sweep's setting with the largest mean gain, for every seed of --seeds, and the same
            settings on each --variant task (named overrides it was not tuned on)

    python benchmarks/learning/learning_at_width.py probe --recipe recipes/qwen3_grpo.py --preset learn-0.6b \\
        --state runs/width --grid sft.lr=1e-4,3e-4 --grid sft.steps=200,400,800
    python benchmarks/learning/learning_at_width.py sweep ... --grid actor.lr=2e-5,3e-5,5e-5 --seeds 1,2
    python benchmarks/learning/learning_at_width.py seeds ... --seeds 1,2,3 --variant mul="data.arithmetic.ops=*"

Each seed gets its own random weights (model.path per seed, written once before the runs start).
``--state`` holds every run's folder and ``results.json``: each run's command, exit code (a run
that failed is run again by the next command), wall time, its steps' metrics (recipe_runs.py's
rows: gap, phases, sync) and its held-out accuracy per eval, plus what each stage picked. A stage
reads the folder, so the stages can run in separate commands on the same machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))  # recipe_runs.py
from recipe_runs import collect, machine  # noqa: E402

ACC = "eval/accuracy"


def load(state: Path) -> dict:
    f = state / "results.json"
    return json.loads(f.read_text()) if f.is_file() else {"machine": machine(), "runs": {}, "picked": {}}


def save(state: Path, res: dict) -> None:
    (state / "results.json").write_text(json.dumps(res, indent=1) + "\n")


def grid(specs: list[str]) -> list[list[str]]:
    """["a=1,2", "b=x"] -> [["a=1", "b=x"], ["a=2", "b=x"]]."""
    axes = [[f"{k}={v}" for v in vals.split(",")] for k, _, vals in (s.partition("=") for s in specs)]
    return [list(c) for c in itertools.product(*axes)] if axes else [[]]


def model_args(args, seed: int) -> list[str]:
    return [f"model.path={args.state}/models/seed{seed}", f"seed={seed}"]


def build_models(args, seeds: list[int]) -> None:
    """Each seed's random weights, written before the runs start so that none races another to write them."""
    from colocate_rl.cli import preset_config

    cfg = preset_config(Path(args.recipe).with_suffix(".yaml"), args.preset, "")
    code = ("import sys; from colocate_rl.models.tiny import ensure_model; "
            "ensure_model(sys.argv[1], sys.argv[2], seed=int(sys.argv[3]), dtype=sys.argv[4])")
    procs = [subprocess.Popen([sys.executable, "-c", code, cfg.model.synthesize, f"{args.state}/models/seed{s}", str(s),
                               cfg.model.dtype]) for s in seeds]
    if any(p.wait() for p in procs):
        sys.exit("could not write the models")


def accuracies(run: dict) -> dict[int, float]:
    return {s["step"]: s[ACC] for s in run["steps"] if s.get(ACC) is not None}


def summarize(run: dict) -> dict:
    acc = accuracies(run)
    gaps = [s["train_rollout_logprob_abs_diff"] for s in run["steps"] if s["step"] > 0 and
            s.get("train_rollout_logprob_abs_diff") is not None]
    out = {"acc_start": acc.get(0), "acc_end": acc[max(acc)] if acc else None, "steps_done": max(acc, default=0)}
    if out["acc_start"] is not None and len(acc) > 1:
        out["gain"] = round(out["acc_end"] - out["acc_start"], 4)
        out["acc_best"] = max(v for k, v in acc.items() if k)
    if len(gaps) >= 40:  # bounded while the weights move: the last 20 steps against the first 20
        out["gap_first20"], out["gap_last20"] = statistics.mean(gaps[:20]), statistics.mean(gaps[-20:])
        out["gap_median"], out["gap_max"] = statistics.median(gaps), max(gaps)
    return out


def execute(args, res: dict, runs: dict[str, list[str]]) -> None:
    """Runs ``{name: overrides}`` of the recipe, --parallel at a time; each run's result as it ends."""
    done = {n for n, r in res["runs"].items() if r["exit_code"] == 0}  # a failed run is run again
    for name in done & set(runs):
        print(f"[{name}] done earlier: {res['runs'][name]['summary']}", flush=True)
    todo, live = [(n, o) for n, o in runs.items() if n not in done], {}
    while todo or live:
        while todo and len(live) < args.parallel:
            name, over = todo.pop(0)
            cmd = [sys.executable, args.recipe, f"preset={args.preset}", *args.base, *over,
                   f"logging.run_dir={args.state}/runs", f"logging.run_name={name}", "logging.progress=false",
                   "logging.wandb_mode=disabled"]
            log = open(args.state / f"{name}.log", "w")
            live[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), time.perf_counter(), cmd, log)
            print(f"[{name}] started: {' '.join(over)}", flush=True)
        time.sleep(2)
        for name in [n for n, (p, *_) in live.items() if p.poll() is not None]:
            proc, t0, cmd, log = live.pop(name)
            log.close()
            run = {"command": " ".join(["python", *cmd[1:]]), "exit_code": proc.returncode,
                   "wall_s": round(time.perf_counter() - t0, 1), **collect(args.state / "runs" / name)}
            run["summary"] = summarize(run)
            if proc.returncode:
                run["output_tail"] = (args.state / f"{name}.log").read_text(errors="replace")[-2000:]
            res["runs"][name] = run
            save(args.state, res)
            print(f"[{name}] exit {proc.returncode} after {run['wall_s']:.0f} s: {run['summary']}", flush=True)


def probe(args, res: dict) -> None:
    seed = args.seeds[0]
    build_models(args, [seed])
    execute(args, res, {"probe_" + "_".join(o.split("=")[1] for o in combo): combo + ["steps=1"] + model_args(args, seed)
                        for combo in grid(args.grid)})


def pick_warm_start(args, res: dict) -> list[str]:
    found = [(abs(r["summary"]["acc_start"] - args.target), r) for n, r in res["runs"].items()
             if n.startswith("probe_") and r["summary"].get("acc_start") is not None
             and args.lo <= r["summary"]["acc_start"] <= args.hi]
    if not found:
        sys.exit(f"no warm start reached a held-out accuracy in [{args.lo}, {args.hi}]")
    best = min(found, key=lambda f: f[0])[1]
    over = [a for a in best["command"].split() if a.startswith("sft.")]
    res["picked"]["warm_start"] = {"overrides": over, "acc_start": best["summary"]["acc_start"]}
    return over


def sweep(args, res: dict) -> None:
    warm = args.warm.split() if args.warm else pick_warm_start(args, res)
    build_models(args, args.seeds)
    execute(args, res, {f"sweep_{'_'.join(o.split('=')[1] for o in combo)}_s{s}": warm + combo + model_args(args, s)
                        for combo in grid(args.grid) for s in args.seeds})


def seeds(args, res: dict) -> None:
    setting, over = ("main", args.setting.split()) if args.setting else pick_setting(args, res)
    build_models(args, args.seeds)
    runs = {f"{setting}_s{s}": over + model_args(args, s) for s in args.seeds}
    for spec in args.variant:
        vname, _, vover = spec.partition("=")
        runs.update({f"{vname}_s{s}": over + vover.split() + model_args(args, s) for s in args.seeds})
    execute(args, res, runs)


def pick_setting(args, res: dict) -> tuple[str, list[str]]:
    """The sweep's setting with the largest mean gain, and its overrides."""
    by_setting: dict[str, list[float]] = {}
    for name, r in res["runs"].items():
        if name.startswith("sweep_") and "gain" in r["summary"]:
            by_setting.setdefault(name.rsplit("_s", 1)[0], []).append(r["summary"]["gain"])
    if not by_setting:
        sys.exit("no sweep run finished with a gain")
    setting = max(by_setting, key=lambda k: statistics.mean(by_setting[k]))
    run = next(r for n, r in res["runs"].items() if n.startswith(setting + "_s"))
    over = [a for a in run["command"].split() if a.split("=")[0] in {*(g.split("=")[0] for g in args.grid), "sft.lr",
                                                                     "sft.steps"}]
    res["picked"]["grpo"] = {"setting": setting, "overrides": over, "gains": by_setting[setting]}
    return setting, over


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=["probe", "sweep", "seeds"])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--state", type=Path, required=True)
    ap.add_argument("--base", nargs="*", default=[], help="overrides every run gets")
    ap.add_argument("--grid", action="append", default=[], help="key=v1,v2 (repeatable): the settings tried")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    ap.add_argument("--variant", action="append", default=[], help='NAME="key=value ..." (seeds stage)')
    ap.add_argument("--warm", default="", help='sweep: "key=value ..." instead of the probes\' pick')
    ap.add_argument("--setting", default="", help='seeds: "key=value ..." instead of the sweep\'s pick')
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--target", type=float, default=0.3)
    ap.add_argument("--lo", type=float, default=0.1)
    ap.add_argument("--hi", type=float, default=0.5)
    args = ap.parse_args()
    args.state.mkdir(parents=True, exist_ok=True)
    res = load(args.state)
    {"probe": probe, "sweep": sweep, "seeds": seeds}[args.stage](args, res)
    save(args.state, res)


if __name__ == "__main__":
    main()
