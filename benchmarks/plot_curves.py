"""Learning curves from a ``benchmarks/recipe_runs.py`` results file: held-out accuracy and train
reward per run group (runs named ``<group>_<seed>``), the mean over seeds with their range.

    python benchmarks/plot_curves.py                     # exact mode off vs on → docs/exact_curves.png
    python benchmarks/plot_curves.py RESULTS.json OUT.png
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

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = (ROOT / "benchmarks" / "results" / "exact_curves_3seeds_h200.json", ROOT / "docs" / "exact_curves.png")
SMOOTH = 10  # steps in the train reward's running mean


def series(run: dict, key: str) -> tuple[np.ndarray, np.ndarray]:
    """The (steps, values) of one metric where a step logged it."""
    rows = [(s["step"], s[key]) for s in run["steps"] if s.get(key) is not None]
    steps, values = zip(*rows)
    return np.asarray(steps), np.asarray(values, dtype=float)


def main(results: Path, out: Path) -> None:
    data = json.loads(results.read_text())
    groups: dict[str, list[dict]] = defaultdict(list)
    for name, run in data["runs"].items():
        groups[name.rsplit("_", 1)[0]].append(run)
    fig, (acc_ax, reward_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for group, runs in groups.items():
        for ax, key, smooth in ((acc_ax, "eval/accuracy", 1), (reward_ax, "reward_mean", SMOOTH)):
            per_seed = [series(r, key) for r in runs]
            steps, values = per_seed[0][0], np.stack([v for _, v in per_seed])
            if smooth > 1:  # running mean along the steps, per seed
                kernel = np.ones(smooth) / smooth
                values = np.stack([np.convolve(v, kernel, mode="valid") for v in values])
                steps = steps[smooth - 1:]
            line, = ax.plot(steps, values.mean(0), label=f"{group} (mean of {len(runs)})")
            ax.fill_between(steps, values.min(0), values.max(0), color=line.get_color(), alpha=0.2)
    acc_ax.set(xlabel="step", ylabel="held-out accuracy", title="held-out accuracy (band: range over seeds)")
    reward_ax.set(xlabel="step", ylabel="train reward", title=f"train reward, {SMOOTH}-step running mean")
    for ax in (acc_ax, reward_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    machine = data.get("machine", {})
    fig.suptitle(f"{results.name}: {machine.get('gpu') or str(machine.get('cpus', '?')) + ' CPUs'}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*(map(Path, sys.argv[1:3]) if len(sys.argv) > 2 else DEFAULT))
