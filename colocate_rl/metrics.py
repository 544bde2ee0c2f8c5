"""Step metrics: one JSON line per step (flushed, so a crash loses nothing), wandb, a console line,
and the run's plot (reward and accuracy by step, stacked seconds per phase)."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from colocate_rl.private import opener, private_dir, write_text


class PhaseTimer:
    """``with timer("generate"): ...`` adds the seconds to ``time/generate``; order is kept for the plot."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {f"time/{k}": v for k, v in self.seconds.items()}


class MetricsLog:
    def __init__(self, run_dir: Path, config: dict, wandb_project: str = "", wandb_mode: str = "disabled",
                 run_name: str = ""):
        self.run_dir = Path(run_dir)
        private_dir(self.run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", opener=opener)
        self._wandb = None
        if wandb_mode == "auto":
            wandb_mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=run_name or self.run_dir.name, config=config,
                                     dir=str(self.run_dir), mode=wandb_mode, reinit="finish_previous")

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _num(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(row, step=step)

    def truncate(self, step: int) -> int:
        """Drops the rows after ``step`` (a resumed run redoes them); returns how many were dropped."""
        self._file.close()
        rows = read(self.path) if self.path.exists() else []
        keep = [r for r in rows if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        write_text(tmp, "".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(self.path)
        self._file = open(self.path, "a", opener=opener)
        return len(rows) - len(keep)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def _num(v):
    if hasattr(v, "item"):
        return v.item()
    return v


def read(path: Path) -> list[dict]:
    """The rows of a metrics file; a last line cut short by a crash is dropped."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [json.loads(line) for line in lines[:-1]]
    try:
        rows += [json.loads(lines[-1])] if lines else []
    except json.JSONDecodeError:
        pass
    return rows


def console_line(step: int, total: int, m: dict) -> str:
    parts = [f"step {step}/{total}", f"reward {m.get('reward/mean', float('nan')):.3f}"]
    if "eval/accuracy" in m:
        parts.append(f"eval acc {m['eval/accuracy']:.3f}")
    if "train_rollout_logprob_abs_diff" in m:
        tail = [f"{name} {m[key]:.2e}" for name, key in (("p99", "train_rollout_logprob_abs_diff_p99"),
                                                          ("max", "train_rollout_logprob_abs_diff_max")) if m.get(key)]
        parts.append(f"lp diff {m['train_rollout_logprob_abs_diff']:.2e}" + (f" ({', '.join(tail)})" if tail else ""))
    if "rollout/tokens_per_s" in m:
        parts.append(f"gen {m['rollout/tokens_per_s']:.0f} tok/s")
    phases = {k[5:]: v for k, v in m.items() if k.startswith("time/") and k != "time/step"}
    parts.append(f"{m.get('time/step', sum(phases.values())):.2f}s [" +
                 " ".join(f"{k} {v:.2f}" for k, v in phases.items()) + "]")
    return " | ".join(parts)


def summary(rows: list[dict], seconds: float, warm_started: bool = False) -> list[str]:
    """The run's outcome in a few lines: each eval set's held-out accuracy from its first eval
    (at step 0: right after the warm-start, if there was one) to its last, the train reward over
    the first and last 5 steps, and the steps and wall time."""
    lines = []
    for key in sorted({k for r in rows for k in r if k.startswith("eval") and k.endswith("/accuracy")}):
        ev = [(r["step"], r[key]) for r in rows if key in r]
        (s0, a0), (s1, a1) = ev[0], ev[-1]
        if s1 > s0:
            first = "after the warm-start" if warm_started and s0 == 0 else f"at step {s0}"
            name = key[len("eval/"):-len("/accuracy")] if key.count("/") == 2 else ""
            lines.append(f"held-out accuracy{f' ({name})' if name else ''} {a0:.2f} {first} -> {a1:.2f} at step {s1} "
                         f"({100 * (a1 - a0):+.0f} points)")
    reward = [r["reward/mean"] for r in rows if "reward/mean" in r]
    if reward:
        head, tail = reward[:5], reward[-5:]
        lines.append(f"train reward {sum(head) / len(head):.2f} -> {sum(tail) / len(tail):.2f} "
                     "(mean of the first and last 5 steps)")
    steps = max((r["step"] for r in rows), default=0)
    lines.append(f"{steps} steps in {int(seconds // 60)} min {int(seconds % 60)} s")
    return lines


def plot(metrics_path: Path, out_png: Path) -> Path | None:
    """curves.png: train reward and held-out accuracy / pass@k by step (left), seconds per phase
    stacked (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read(metrics_path)
    train = [r for r in rows if "reward/mean" in r]
    if not train:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax1.plot([r["step"] for r in train], [r["reward/mean"] for r in train], label="reward (train)")
    # Every eval set's accuracy (= pass@1) and its pass@k for k > 1 when k samples were drawn.
    curves = sorted({k for r in rows for k in r
                     if k.startswith("eval") and (k.endswith("/accuracy") or ("/pass@" in k and not k.endswith("@1")))})
    for key in curves:
        ev = [r for r in rows if key in r]
        ax1.plot([r["step"] for r in ev], [r[key] for r in ev], "o-", label=f"{key} (held-out)")
    ax1.set_xlabel("step")
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend()
    ax1.set_title("reward and accuracy")
    phases = [k for k in train[-1] if k.startswith("time/") and k != "time/step"]
    steps = [r["step"] for r in train]
    bottom = [0.0] * len(train)
    for k in phases:
        vals = [r.get(k, 0.0) for r in train]
        ax2.bar(steps, vals, bottom=bottom, label=k[5:])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_xlabel("step")
    ax2.set_ylabel("seconds")
    ax2.set_title("seconds per phase")
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    with open(out_png, "wb", opener=opener) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return out_png
