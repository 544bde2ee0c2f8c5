"""The colocated loop on GPUs, with the CPU integration assertions: the handoff walks the designed
cycle, the engine's weights equal the actor's after every sync (CUDA IPC keyed by device UUID),
trainer/sampler logprobs agree, and the device memory measured at each phase boundary falls
when a side hands the card over. The last two run vLLM TP=2 and actor TP=2 on two GPUs: in-process
with the tiny model, and as a user's recipe command at the Qwen3-0.6B shape, exit included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)", allow_module_level=True)
pytest.importorskip("vllm", reason="the loop needs vLLM's GPU build")
pytest.importorskip("megatron.core", reason="the loop needs megatron-core")

from colocate_rl import loop
from colocate_rl.memory import Phase
from colocate_rl.metrics import read
from colocate_rl.session import start_session

from gpu_runs import planned, run_cfg  # same folder

CYCLE = [Phase.IDLE, Phase.ACTOR, Phase.ACTOR_PARAMS, Phase.SYNC, Phase.ROLLOUT_WEIGHTS, Phase.ROLLOUT]


def gpu_cfg(tmp_path, model, gpus: int = 1, **over):
    return run_cfg("qwen3_grpo", tmp_path, model, **{
        "model.dtype": "float32", "placement.gpus_per_node": str(gpus),
        "placement.launcher": "local" if gpus == 1 else "ray", "sync.verify_every": "1", "actor.offload": "all",
        **over})


def test_colocated_steps_on_one_gpu(tmp_path, tiny_model):
    # actor.offload=all: every part leaves the card each step, so each side's hand-over shows.
    s = start_session(*planned(gpu_cfg(tmp_path, tiny_model("qwen3-small"))))
    try:
        for step in range(3):
            start = len(s.handoff.machine.history)
            m = loop.step(s)
            s.step = step + 1
            assert [h[0] for h in s.handoff.machine.history[start:]] == CYCLE
            # fp32 both sides; GPU kernels order sums differently, so the bound is looser than the CPU's.
            assert m["train_rollout_logprob_abs_diff"] <= 2e-3, m["train_rollout_logprob_abs_diff"]
            assert m["sync/bytes"] > 0 and m["update_skipped"] == 0
            s.actor.onload(["params"])
            assert s.workers.verify() > 0  # engine checksums equal the actor's after the sync
            s.actor.offload(["params"])
        used = s.handoff.machine.peak_used()  # the whole card: vLLM's process and the actor's
        # Sleeping vLLM frees its KV cache (1 GiB) and weights; offloading the actor frees its state.
        assert used["idle"] < used["rollout"] - 2**29, used
        assert used["actor_params"] < used["actor"], used
    finally:
        s.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs on one host")
def test_tp2_colocated_on_two_gpus(tmp_path, tiny_model):
    pytest.importorskip("ray", reason="two ranks run as Ray actors")
    s = start_session(*planned(gpu_cfg(tmp_path, tiny_model("qwen3-small"), gpus=2,
                              **{"actor.tp": "2", "rollout.tensor_parallel_size": "2"})))
    try:
        assert s.workers.node_senders == [[0, 1]], "one sender per GPU UUID"
        procs = s.workers.processes()  # read from inside each process
        ranks, engine = procs["ranks"], procs["engines"][0]
        assert [r["env"]["LOCAL_RANK"] for r in ranks] == ["0", "1"] and engine["uuids"] == [r["uuid"] for r in ranks]
        for step in range(2):
            m = loop.step(s)
            s.step = step + 1
            assert m["train_rollout_logprob_abs_diff"] <= 2e-3, m["train_rollout_logprob_abs_diff"]
            assert m["sync/bytes"] > 0
            # sync.verify_every=1: every rank's checksums were compared with the engine's in the sync
    finally:
        s.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs on one host")
def test_recipe_command_at_a_real_shape_on_two_gpus_runs_and_exits(tmp_path):
    """The command a user runs on a two-GPU machine, with the engine's defaults (CUDA graphs,
    gpu_memory_utilization from the config): its steps run and the process exits by itself."""
    pytest.importorskip("ray", reason="two ranks run as Ray actors")
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "recipes/qwen3_grpo.py"), "preset=tiny", "model.synthesize=qwen3-0.6b",
           f"model.path={tmp_path / 'model'}", "model.dtype=bfloat16", "rollout.kv_cache_memory_mb=0", "actor.tp=2",
           "rollout.tensor_parallel_size=2", "placement.gpus_per_node=2", "placement.launcher=ray", "steps=4",
           f"logging.run_dir={tmp_path}", "logging.run_name=tp2", "logging.wandb_mode=disabled", "logging.progress=false"]
    try:
        p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the run did not exit within 20 minutes; its output ends: {str(e.stdout)[-3000:]}")
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = [r for r in read(tmp_path / "tp2" / "metrics.jsonl") if "sync/bytes" in r]  # not the eval-only rows
    assert [r["step"] for r in rows] == [1, 2, 3, 4], rows
    assert all(r["sync/bytes"] > 0 and r["train_rollout_logprob_abs_diff"] < 0.05 for r in rows), rows
