"""The resume path at width: `recipes/qwen3_grpo.py preset=learn-0.6b` (Qwen3-0.6B's shape, bf16)
run in one piece and in two (stop_after=3, then the same command again from its step-3
checkpoint). The pieces continue the curve: the data cursor at step 5 is the uninterrupted run's,
and the final weights lie within half the distance steps 4-5 moved them (bf16 GPU kernels need not
be bit-reproducible; on one H100 they were, distance 0: benchmarks/results/resume_gpu_h100.json).
Prints the distances, the rewards and a checkpoint's size on
disk (run with -s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colocate_rl import checkpoint as ck
from colocate_rl.metrics import read

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")

ROOT = Path(__file__).resolve().parents[2]


def command(run_dir: Path, model: Path, name: str, **over: str) -> list[str]:
    args = {"model.path": str(model), "logging.run_dir": str(run_dir), "logging.run_name": name,
            "logging.wandb_mode": "disabled", "logging.progress": "false", "logging.plot": "false",
            "sft.steps": "150", "reward.name": "fault_rewards:even_length",
            "data.prompts_per_step": "16", "rollout.n": "8",
            "rollout.gpu_memory_utilization": "0.08", "steps": "5", "eval.every": "0",
            "checkpoint.every": "3", "checkpoint.keep": "2", **over}
    return [sys.executable, str(ROOT / "recipes/qwen3_grpo.py"), "preset=learn-0.6b",
            *(f"{k}={v}" for k, v in args.items())]


def run(cmds: list[list[str]], logs: list[Path]) -> list[str]:
    # Random weights sample ids past the tiny BPE's vocabulary, which decode to "" (reward 1.0 for all,
    # no gradient); 150 warm-start steps make them write digits, whose lengths vary within each group.
    path = os.pathsep.join([str(ROOT / "tests/integration"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
             for c, log in zip(cmds, logs)]
    outs = []
    for p, log in zip(procs, logs):
        rc = p.wait(timeout=900)
        outs.append(log.read_text())
        assert rc == 0, outs[-1][-3000:]
    return outs


def weights(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp.with_suffix(".pt")  # ~8 GiB with the optimizer state: dropped once read
    dcp_to_torch_save(str(step_dir / ck.ACTOR), str(out))
    got = {k: v.float() for k, v in torch.load(out, weights_only=True).items()
           if isinstance(v, torch.Tensor) and k.startswith(("embedding", "decoder", "output_layer"))}
    out.unlink()
    return got


def test_learn_preset_resumes_in_pieces_at_width(tmp_path):
    # Each run writes its own copy of the model from the same seed, so the two start at once.
    pieces = command(tmp_path, tmp_path / "m_pieces", "pieces", stop_after="3")
    _, first = run([command(tmp_path, tmp_path / "m_full", "full"), pieces],
                   [tmp_path / "full.log", tmp_path / "piece1.log"])
    assert "stop_after=3: stopped after step 3 of 5" in first, first[-3000:]
    second, = run([pieces], [tmp_path / "piece2.log"])
    assert "step_00000003 at step 3" in second, second[-3000:]

    full, cut = read(tmp_path / "full/metrics.jsonl"), read(tmp_path / "pieces/metrics.jsonl")
    a5, b5 = (ck.read(ck.step_dir(tmp_path / f"{n}/checkpoints", 5)) for n in ("full", "pieces"))
    w = {(n, k): weights(ck.step_dir(tmp_path / f"{n}/checkpoints", k), tmp_path / f"{n}{k}")
         for n in ("full", "pieces") for k in (3, 5)}

    def dist(a, b):
        return sum(float((w[a][k] - w[b][k]).double().norm() ** 2) for k in w[a]) ** 0.5

    # Up to step 3 both ran in one process each: how far apart bf16 kernels alone put them.
    moved, before = dist(("full", 5), ("full", 3)), dist(("full", 3), ("pieces", 3))
    after = dist(("full", 5), ("pieces", 5))
    size = sum(f.stat().st_size for f in ck.step_dir(tmp_path / "full/checkpoints", 5).rglob("*") if f.is_file())
    print(f"steps 4-5 moved the weights by {moved:.4g}; one run vs pieces at step 3 {before:.4g}, at step 5 "
          f"{after:.4g}; rewards {[round(r['reward/mean'], 3) for r in full if 'reward/mean' in r]} vs "
          f"{[round(r['reward/mean'], 3) for r in cut if 'reward/mean' in r]}; cursor {a5['sampler']} vs "
          f"{b5['sampler']}; a checkpoint {size / 2**30:.2f} GiB")

    files = sorted(f.name for f in (tmp_path / "m_full").glob("*.safetensors"))
    assert files and all((tmp_path / "m_full" / f).read_bytes() == (tmp_path / "m_pieces" / f).read_bytes()
                         for f in files), "both runs start from the same weights"
    steps = [r["step"] for r in full]
    assert steps == [r["step"] for r in cut] and steps[-5:] == [1, 2, 3, 4, 5]
    assert all(r["grad_norm"] > 0 for r in full if r["step"] >= 1), "every step must change the weights"
    assert a5["sampler"] == b5["sampler"], "the data cursor continues where the first piece stopped"
    assert w["full", 5].keys() == w["pieces", 5].keys() and len(w["full", 5]) > 100
    assert moved > 0 and after <= 0.5 * moved, (after, moved)
