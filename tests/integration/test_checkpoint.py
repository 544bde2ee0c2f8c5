"""Checkpoint and resume through the real recipe command, on CPU with fixed seeds:

- a run of 4 steps, the same run SIGKILLed in step 3 (after its step-2 checkpoint) and started
  again, and the same run in two pieces (stop_after=3, then the same command again) give
  bit-identical metrics for every step (timings aside) and identical final weights;
- under supervise.max_restarts, a run whose trainer process is SIGKILLed in step 3 (a fault drill at
  that named phase) is started again by the supervisor from its step-2 checkpoint and finishes with
  the same metrics as the uninterrupted run;
- Ctrl-C (SIGINT) ends the current step cleanly and writes a checkpoint: the uninterrupted run is
  one of 40 steps that gets a SIGINT in step 5 (a fault drill at that named phase; the learning
  rate is constant, so its first 4 steps are those of a 4-step run);
- a checkpoint exports to an HF folder holding the trained weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colocate_rl import checkpoint as ck
from colocate_rl.metrics import read

ROOT = Path(__file__).resolve().parents[2]
TIMING = ("time/", "reward/score_s")


def command(model: Path, run_dir: Path, name: str, **over) -> list[str]:
    args = {"model.path": str(model), "model.synthesize": "''", "logging.run_dir": str(run_dir),
            "logging.run_name": name, "logging.wandb_mode": "disabled", "logging.progress": "false",
            "logging.plot": "false", "data.prompts_per_step": "8", "rollout.n": "4", "sft.steps": "3",
            "steps": "4", "eval.every": "2", "checkpoint.every": "2",
            # varies within every group: each GRPO step really changes the weights
            "reward.name": "fault_rewards:even_length", **over}
    return [sys.executable, str(ROOT / "recipes/qwen3_grpo.py"), "preset=tiny", *(f"{k}={v}" for k, v in args.items())]


def start(cmd: list[str], log: Path, **extra_env: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def finish(p: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    rc = p.wait(timeout=timeout)
    out = log.read_text()
    assert rc == 0, out[-3000:]
    return out


def comparable(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMING) and not k.endswith(("_s", "GBps"))}
            for r in rows}


def model_weights(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt / ck.ACTOR), str(out))
    # Megatron's parameter names, and the optimizer state too
    return {k: v for k, v in torch.load(out, weights_only=True).items() if isinstance(v, torch.Tensor)}


# Slow: two runs of the recipe command, one of them twice (each starts vLLM and megatron-core,
# ~30 s on 2 cores).
@pytest.mark.slow
def test_sigkill_and_resume_is_bit_identical_and_ctrl_c_stops_cleanly(tiny_model, tmp_path):
    model = tiny_model("qwen3-tiny")
    logs = {n: tmp_path / f"{n}.log" for n in ("full", "killed")}
    # Ctrl-C: the run sends itself a SIGINT when step 5 reaches its train phase.
    full = start(command(model, tmp_path, "full", steps="40"), logs["full"], COLOCATE_RL_FAULT="int@train:5")
    # The trainer kills itself (SIGKILL) when step 3 reaches its train phase, in the first attempt only.
    killed = start(command(model, tmp_path, "killed", **{"supervise.max_restarts": "2"}), logs["killed"],
                   COLOCATE_RL_FAULT="kill@train:3")
    # A run in pieces: the first command stops after 3 steps (off the checkpoint.every grid), the same
    # command again runs step 4 from that checkpoint.
    pieces = command(model, tmp_path, "pieces", stop_after="3")
    first = finish(start(pieces, tmp_path / "piece1.log"), tmp_path / "piece1.log")
    assert "stop_after=3: stopped after step 3 of 4" in first, first[-3000:]
    second = finish(start(pieces, tmp_path / "piece2.log"), tmp_path / "piece2.log")
    assert "step_00000003 at step 3" in second, second[-3000:]
    full_out = finish(full, logs["full"])
    out = finish(killed, logs["killed"])
    assert "resumed from" in out and "step_00000002 at step 2" in out, out[-3000:]
    restarts = (tmp_path / "killed/supervisor.log").read_text().splitlines()
    assert len(restarts) == 1 and "restart 1/2: the run died (killed by SIGKILL) after step 2" in restarts[0], out

    # Every step's metrics, bit for bit (the killed run's rows after step 2 were dropped and redone).
    a = comparable(read(tmp_path / "full/metrics.jsonl"))
    b = comparable(read(tmp_path / "killed/metrics.jsonl"))
    assert sorted(b) == [0, 1, 2, 3, 4] and sorted(a) == [0, 1, 2, 3, 4, 5]
    for step in b:
        assert a[step] == b[step], f"step {step}: {set(a[step].items()) ^ set(b[step].items())}"
    assert comparable(read(tmp_path / "pieces/metrics.jsonl")) == b, "the pieces continue the curve exactly"
    assert "eval/accuracy" in a[4] and "train_rollout_logprob_abs_diff" in a[4]
    assert all(a[s]["grad_norm"] > 0 for s in (1, 2, 3, 4)), "every step must change the weights"
    wa = model_weights(ck.step_dir(tmp_path / "full/checkpoints", 4), tmp_path)
    wb = model_weights(ck.step_dir(tmp_path / "killed/checkpoints", 4), tmp_path)
    assert wa.keys() == wb.keys() and len(wa) > 5
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"final weight or optimizer state {k} differs after resume"

    # Ctrl-C: the step in progress finishes, a checkpoint of it is written (step 5: neither a multiple
    # of checkpoint.every=2 nor the last of 40 steps), the process exits 0.
    stopped = [line for line in full_out.splitlines() if line.startswith("interrupted: stopped cleanly after step")]
    assert stopped == ["interrupted: stopped cleanly after step 5"], full_out[-3000:]
    assert [r["step"] for r in read(tmp_path / "full/metrics.jsonl")] == list(range(6))
    assert [p.name for p in ck.CheckpointStore(tmp_path / "full/checkpoints", 2).complete()] == \
        [ck.step_dir(tmp_path, 4).name, ck.step_dir(tmp_path, 5).name]

    # Export: an HF folder whose weights are the trained ones (not the initial model's).
    from safetensors.torch import load_file

    hf = ck.export_hf(ck.step_dir(tmp_path / "full/checkpoints", 4), tmp_path / "export")
    exported, initial = load_file(hf / "model.safetensors"), load_file(model / "model.safetensors")
    assert exported.keys() == initial.keys()
    assert torch.equal(exported["model.embed_tokens.weight"], wa["embedding.word_embeddings.weight"])
    assert not torch.equal(exported["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
    assert json.loads((hf / "config.json").read_text())["model_type"] == "qwen3"
