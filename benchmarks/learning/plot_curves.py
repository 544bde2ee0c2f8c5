"""Learning curves from a ``benchmarks/step/recipe_runs.py`` or ``learning_at_width.py`` results file:
held-out accuracy, train reward and the trainer/sampler logprob gap per run group (runs named
``<group>_<seed>``), the mean over the seeds that reached a step, with their range.

    python benchmarks/learning/plot_curves.py                     # exact mode off vs on → docs/exact_curves.png
    python benchmarks/learning/plot_curves.py RESULTS.json OUT.png [STAGE,...]   # stages of a learning_at_width file
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = (ROOT / "benchmarks" / "results" / "exact_curves_3seeds_h200.json", ROOT / "docs" / "exact_curves.png")
SMOOTH = 10  # steps in the train reward's running mean


def series(run: dict, key: str) -> tuple[np.ndarray, np.ndarray]:
    """The (steps, values) of one metric where a step logged it."""
    rows = [(s["step"], s[key]) for s in run["steps"] if s.get(key) is not None]
    steps, values = zip(*rows)
    return np.asarray(steps), np.asarray(values, dtype=float)


def main(results: Path, out: Path, stage: str = "") -> None:
    data = json.loads(results.read_text())
    groups: dict[str, list[dict]] = defaultdict(list)
    runs = {k: v for st in stage.split(",") for k, v in data["stages"][st].items()} if stage else data["runs"]
    for name, run in runs.items():
        groups[name.rsplit("_", 1)[0]].append(run)
    fig, (acc_ax, reward_ax, gap_ax) = plt.subplots(1, 3, figsize=(15, 4))
    for group, runs in groups.items():
        color = None
        for ax, key, smooth in ((acc_ax, "eval/accuracy", 1), (reward_ax, "reward_mean", SMOOTH),
                                (gap_ax, "train_rollout_logprob_abs_diff", SMOOTH)):
            per_seed = [series(r, key) for r in runs]
            if smooth > 1:  # running mean along the steps, per seed
                kernel = np.ones(smooth) / smooth
                per_seed = [(s[smooth - 1:], np.convolve(v, kernel, mode="valid")) for s, v in per_seed]
            steps = max((s for s, _ in per_seed), key=len)
            values = np.full((len(per_seed), len(steps)), np.nan)  # a run cut short leaves NaN
            for i, (_, v) in enumerate(per_seed):
                values[i, :len(v)] = v
            line, = ax.plot(steps, np.nanmean(values, 0), label=f"{group} ({len(runs)} seeds)", color=color)
            color = line.get_color()
            ax.fill_between(steps, np.nanmin(values, 0), np.nanmax(values, 0), color=color, alpha=0.2)
    acc_ax.set(xlabel="step", ylabel="held-out accuracy", title="held-out accuracy (band: range over seeds)")
    reward_ax.set(xlabel="step", ylabel="train reward", title=f"train reward, {SMOOTH}-step running mean")
    gap_ax.set(xlabel="step", ylabel="mean |logprob diff|", title=f"trainer vs sampler gap, {SMOOTH}-step running mean")
    for ax in (acc_ax, reward_ax, gap_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    def where(st: str) -> str:  # a stage run elsewhere names its machine as machine_<stage>
        m = data.get(f"machine_{st}", data.get("machine", {}))
        return f"{st + ' on ' if st else ''}{m.get('gpu') or str(m.get('cpus', '?')) + ' CPUs'}"
    fig.suptitle(f"{results.name}: {'; '.join(map(where, stage.split(',')))}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*(map(Path, sys.argv[1:3]) if len(sys.argv) > 2 else DEFAULT), *sys.argv[3:4])
