"""Where a step's seconds go on one H200: our colocated step (dense and MoE shapes) and TRL's
GRPOTrainer step, as stacked bars, from the committed results files.

    python benchmarks/peers/plot_gpu.py            # writes docs/gpu_step.png
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
HANDOFF = ("sleep", "onload", "offload", "wake_weights", "sync", "wake_kv")
COLORS = {"generate": "#4c72b0", "logprobs": "#dd8452", "train": "#55a868", "handoff": "#c44e52",
          "other": "#8c8c8c"}


def ours(phases: dict, step: float) -> dict:
    out = {"generate": phases["generate"], "logprobs": phases.get("logprobs", 0.0), "train": phases["train"],
           "handoff": sum(phases.get(k, 0.0) for k in HANDOFF)}
    out["other"] = max(step - sum(out.values()), 0.0)
    return out


def trl(result: dict) -> dict:
    tp = result["trl_phase_s"]
    return {"generate": tp["generate"], "train": result["trl_s_per_step"] - tp["generate_and_score"],
            "other": tp["generate_and_score"] - tp["generate"]}


def main() -> None:
    dense = json.loads((RESULTS / "handoff_h200.json").read_text())
    moe = json.loads((RESULTS / "archive" / "handoff_moe_h200.json").read_text())
    vs = json.loads((RESULTS / "gpu_vs_trl_h200.json").read_text())
    m64 = json.loads((RESULTS / "gpu_vs_trl_h200_micro64.json").read_text())
    # (label, seconds of each part, the step's seconds as the results file gives them)
    rows = [
        ("ours, Qwen3-0.6B shape\n(handoff_h200.json)", ours(dense["phase_s"], dense["step_s"]), dense["step_s"]),
        ("ours, Qwen3-MoE small\n(handoff_moe_h200.json)", ours(moe["phase_s"], moe["step_s"]), moe["step_s"]),
        ("ours, Qwen3-0.6B shape\n(gpu_vs_trl_h200.json)", ours(vs["ours_phase_s"], 0.0), vs["ours_s_per_step"]),
        ("TRL GRPOTrainer, same\n(gpu_vs_trl_h200.json)", trl(vs), vs["trl_s_per_step"]),
        ("ours, 64 per micro-batch\n(gpu_vs_trl_h200_micro64.json)", ours(m64["ours_phase_s"], 0.0),
         m64["ours_s_per_step"]),
        ("TRL, 64 per micro-batch\n(gpu_vs_trl_h200_micro64.json)", trl(m64), m64["trl_s_per_step"]),
    ]
    fig, ax = plt.subplots(figsize=(11.5, 4.8))
    for i, (label, parts, step) in enumerate(rows):
        left = 0.0
        for name, color in COLORS.items():
            v = parts.get(name, 0.0)
            ax.barh(i, v, left=left, color=color, label=name if i == 0 else None)
            left += v
        ax.text(left + 0.2, i, f"{step:.1f} s/step", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (64 prompts x 8 samples x 256 tokens, bf16, one H200); gpu_vs_trl bars: per-phase "
                  "medians", fontsize=8)
    ax.legend(["generate (TRL: incl. its wake, weight load, sleep)", "logprob pass", "train",
               "handoff (sleep, onload, offload, wake, sync)", "other"], fontsize=7, loc="center left",
              bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    out = ROOT / "docs" / "gpu_step.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
