"""Faults and bad input on CPU with the real engines:

- a reward that hangs, raises or returns NaN is counted and the step goes on;
- NaN loss/gradients: the update is skipped and counted; after actor.max_nonfinite_in_row in a row
  the run stops with one line saying why;
- the vLLM engine process killed at each phase: detected, rebuilt, given the actor's weights, the
  step goes on (same metrics as a run without faults);
- a model folder without weights and a tokenizer that does not fit the model stop in one line.
"""

from __future__ import annotations

import contextlib
import os

import psutil
import pytest
import torch

from colocate_rl import loop
from colocate_rl.algorithms import ADVANTAGES
from colocate_rl.config import ConfigError
from colocate_rl.metrics import read
from colocate_rl.session import start_session

from test_loop import planned, tiny_cfg  # noqa: E402 - same folder


@pytest.fixture
def unguarded_grpo():
    """GRPO without the std's epsilon: a group whose rewards are all equal gets 0/0 = NaN advantages,
    hence NaN loss and gradients (the config refuses algorithm.adv_eps=0, so it is registered here)."""
    def grpo_0_over_0(rewards, n, cfg):
        r = rewards.view(-1, n)
        return ((r - r.mean(1, keepdim=True)) / r.std(1, keepdim=True, unbiased=False)).view(-1)

    ADVANTAGES["test_grpo_0_over_0"] = grpo_0_over_0
    yield "test_grpo_0_over_0"
    ADVANTAGES.pop("test_grpo_0_over_0")


def test_reward_faults_are_counted_and_nan_updates_skipped_then_stop(tmp_path, tiny_model, unguarded_grpo):
    # The faulty reward hangs, raises or returns NaN by row; its all-equal groups make NaN updates.
    cfg = tiny_cfg(tmp_path, tiny_model, **{
        "reward.name": "fault_rewards:faulty", "reward.timeout_s": "1", "algorithm.advantage": unguarded_grpo,
        "steps": "6", "actor.max_nonfinite_in_row": "3", "checkpoint.at_end": "false"})
    with pytest.raises(FloatingPointError) as e:
        loop.run(*planned(cfg))
    msg = str(e.value)
    assert "\n" not in msg and "3 updates in a row" in msg and "step 3" in msg, msg
    rows = read(tmp_path / "t/metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["update_skipped"] == 1.0 for r in rows)
    assert sum(r["reward/timeouts"] for r in rows) >= 1 and sum(r["reward/errors"] for r in rows) >= 2
    assert all(r["time/generate"] > 0 for r in rows), "every step ran to the end"


def engine_core() -> psutil.Process:
    cores = [p for p in psutil.Process().children(recursive=True) if "EngineCore" in " ".join(p.cmdline() + [p.name()])]
    assert len(cores) == 1, [(p.pid, p.name()) for p in psutil.Process().children(recursive=True)]
    return cores[0]


class KillEngineAt:
    """A fault hook: SIGKILLs the engine's process at each named point of a step, once, and waits
    until it is gone, so the engine call of that phase is the one that finds it dead."""

    def __init__(self, at: set[tuple[str, int]], find=engine_core):
        self.at, self.find, self.killed = set(at), find, []

    def __call__(self, name: str, step: int) -> None:
        if (name, step) in self.at:
            self.at.discard((name, step))
            victim = self.find()
            ours = victim.ppid() == os.getpid()
            victim.kill()
            if ours:
                # Gone, but left for vLLM's process manager to reap: a child reaped here would look
                # alive to it for ever after, and it would signal that pid, by then maybe another's.
                with contextlib.suppress(ChildProcessError):  # vLLM reaped it first
                    os.waitid(os.P_PID, victim.pid, os.WEXITED | os.WNOWAIT)
            else:
                victim.wait(timeout=60)
            self.killed.append((name, step))


def rows_of(path) -> dict[int, dict]:
    rows = read(path)
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"a step's metrics row was written twice: {steps}"
    return {r["step"]: r for r in rows}


# Deterministic metrics of a step: what the samples, rewards and update were.
SAME = ("reward/mean", "loss", "grad_norm", "rollout/response_len", "train_rollout_logprob_abs_diff")

# The engine core in a process of its own, running its worker itself: the shape vLLM gives a TP=1
# engine on GPUs. vLLM's CPU platform would otherwise have the engine core spawn a second process for
# the worker, which imports vLLM again (~14 s more per engine start on 2 cores, nine starts here).
# The process killed is the engine core either way; the CPU default (a worker process under it) is
# the one test_weight_sync.py's tied-embedding engine runs. The calm run names the same executor
# (in-process it is the one vLLM picks anyway): a checkpoint resumes only under the config it was
# written with, and the rough run resumes the calm run's.
ENGINE_CORE_RUNS_ITS_WORKER = {
    "rollout.engine_kwargs": "{distributed_executor_backend: vllm.v1.executor.uniproc_executor.UniProcExecutor}"}


# Slow: nine multiprocess engine starts (~15-30 s each on 2 cores).
@pytest.mark.slow
def test_engine_killed_at_every_phase_is_replaced_and_the_run_goes_on(tmp_path, tiny_model, even_length_reward):
    """The engine process is killed at each named phase of a run (a resume, sleep, wake(weights),
    wake(kv_cache), eval generation, a checkpoint, generate, the sync), each at a phase boundary, not
    on a timer. Every time a new engine is built and given the actor's weights, and the step goes
    on from where it was: the run's metrics equal those of a run nothing happened to.

    The rough run resumes from the calm run's step-3 checkpoint (the engine is killed while it is
    restored) and runs steps 4-8, one fault per step at most but for step 6's eval and checkpoint:
    a replaced engine is synced by walking the step's handoff phases again, which would strike
    another fault of the same step there instead of at its own phase."""
    from colocate_rl import faults

    over = {"reward.name": even_length_reward, "actor.lr": "1e-3", "rollout.max_response_tokens": "24",
            "data.max_prompt_tokens": "16", "steps": "8", "eval.every": "3", "eval.sets": "[arithmetic]",
            "checkpoint.every": "3", "checkpoint.keep": "3", "sync.verify_every": "1",
            "rollout.max_engine_restarts": "1", **ENGINE_CORE_RUNS_ITS_WORKER}
    loop.run(*planned(tiny_cfg(tmp_path / "calm", tiny_model, **over)))
    calm = rows_of(tmp_path / "calm" / "t" / "metrics.jsonl")
    assert sorted(calm) == list(range(9))

    kills = {("resume", 0), ("sleep", 4), ("wake_weights", 5), ("wake_kv", 6), ("eval", 6), ("checkpoint", 6),
             ("generate", 7), ("sync", 8)}
    hook = KillEngineAt(kills)
    remove = faults.on(hook)
    try:
        ckpt = tmp_path / "calm" / "t" / "checkpoints" / "step_00000003"
        out = loop.run(*planned(tiny_cfg(tmp_path / "rough", tiny_model, **over, **{
            "rollout.multiprocess": "true", "checkpoint.resume": str(ckpt)})))
    finally:
        remove()
    assert sorted(hook.killed) == sorted(kills), "every fault fired"
    assert hook.killed[0] == ("resume", 0) and out["steps"] == 8
    rough = rows_of(tmp_path / "rough" / "t" / "metrics.jsonl")
    assert sorted(rough) == [4, 5, 6, 7, 8]
    # A step's row counts the restarts since the previous row: the resume's goes with step 4's, step
    # 6's eval and checkpoint (after its row was taken) with step 7's.
    assert [rough[s]["rollout/engine_restarts"] for s in sorted(rough)] == [2, 1, 1, 3, 1]
    for step in rough:
        for key in SAME:
            assert rough[step][key] == pytest.approx(calm[step][key], rel=1e-5, abs=1e-6), (step, key)
        assert rough[step]["train_rollout_logprob_abs_diff"] <= 1e-4
    assert rough[6]["eval/accuracy"] == calm[6]["eval/accuracy"]


def test_model_folder_without_weights_stops_in_one_line(tmp_path, tiny_model):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model("qwen3-tiny"), bare, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ConfigError, match=rf"^model.path={bare} has no weights \(no \*.safetensors files\)$"):
        start_session(*planned(tiny_cfg(tmp_path, tiny_model, **{"model.path": str(bare)})))


def test_model_folder_without_architectures_stops_in_one_line(tmp_path, tiny_model):
    import json
    import shutil

    folder = tmp_path / "noarch"
    shutil.copytree(tiny_model("qwen3-tiny"), folder)
    config = json.loads((folder / "config.json").read_text())
    assert config.pop("architectures")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"^model.path={folder}: config.json has no 'architectures' "):
        start_session(*planned(tiny_cfg(tmp_path, tiny_model, **{"model.path": str(folder)})))


def test_tokenizer_that_does_not_fit_the_model_stops_in_one_line(tmp_path, tiny_model):
    from colocate_rl.models.tiny import build_qwen3_tokenizer

    tok_dir = tmp_path / "qwen3-tokenizer"
    build_qwen3_tokenizer().save_pretrained(str(tok_dir))  # 151k tokens vs the tiny model's few hundred
    with pytest.raises(ConfigError) as e:
        start_session(*planned(tiny_cfg(tmp_path, tiny_model, **{"model.tokenizer": str(tok_dir)})))
    msg = str(e.value)
    assert "\n" not in msg and str(tok_dir) in msg and "vocab_size" in msg, msg


def test_actor_skips_a_nonfinite_update_and_leaves_the_weights(tiny_model, monkeypatch):
    from test_actor import make_actor, make_batch

    from colocate_rl.trainer import actor as actor_module

    monkeypatch.setattr(actor_module, "_FINITE_CHECK_NUMEL", 1000)  # the check runs in many slices
    actor = make_actor(tiny_model("qwen3-tiny"))
    batch = make_batch()
    before = {n: t.clone() for n, t in actor.export_hf_weights()}
    lr_step = actor.scheduler.num_steps
    batch.advantages = torch.full_like(batch.advantages, float("nan"))
    m = actor.train_step(batch, actor.compute_logprobs(batch))
    assert m["update_skipped"] == 1.0
    assert actor.scheduler.num_steps == lr_step, "a skipped update does not advance the LR schedule"
    for n, t in actor.export_hf_weights():
        assert torch.equal(t, before[n]), f"{n} changed by a skipped update"
    batch.advantages = torch.tensor([1.0, -1.0] * 3)
    m = actor.train_step(batch, actor.compute_logprobs(batch))
    assert m["update_skipped"] == 0.0 and all(torch.isfinite(t).all() for _, t in actor.export_hf_weights())
    grads = actor.model.buffers[-1].grad_data.view(-1)  # the finite gradients of that update
    assert grads.numel() > 3 * 1000 and actor._grads_finite()
    grads[-1] = float("inf")  # in the last slice only
    assert not actor._grads_finite()
