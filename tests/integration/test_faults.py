"""Faults and bad input on CPU with the real engines:

- a reward that hangs, raises or returns NaN is counted and the step goes on;
- NaN loss/gradients: the update is skipped and counted; after actor.max_nonfinite_in_row in a row
  the run stops with one line saying why;
- the vLLM engine process killed mid-run: detected, rebuilt, re-synced, the prompts re-issued;
- a model folder without weights and a tokenizer that does not fit the model stop in one line.
"""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import torch

from colocate_rl import loop
from colocate_rl.config import ConfigError
from colocate_rl.metrics import read
from colocate_rl.session import start_session

from test_loop import tiny_cfg


def test_reward_faults_are_counted_and_nan_updates_skipped_then_stop(tmp_path, tiny_model):
    # adv_eps=0: a group whose rewards are all equal gets 0/0 = NaN advantages, hence NaN loss and
    # gradients (a real misconfiguration). The faulty reward hangs, raises or returns NaN by row.
    cfg = tiny_cfg(tmp_path, tiny_model, **{
        "reward.name": "fault_rewards:faulty", "reward.timeout_s": "1", "algorithm.adv_eps": "0",
        "steps": "6", "actor.max_nonfinite_in_row": "3", "checkpoint.at_end": "false"})
    with pytest.raises(FloatingPointError) as e:
        loop.run(cfg)
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


# Slow: two multiprocess engine starts (~15-30 s each on 2 cores).
@pytest.mark.slow
def test_engine_killed_mid_generation_is_restarted_and_resynced(tmp_path, tiny_model, even_length_reward):
    cfg = tiny_cfg(tmp_path, tiny_model, **{
        "rollout.multiprocess": "true", "reward.name": even_length_reward, "actor.lr": "1e-3",
        "rollout.max_response_tokens": "48", "data.max_prompt_tokens": "16"})
    s = start_session(cfg)
    try:
        loop.colocated_step(s, cfg)
        s.step = 1
        victim = engine_core()
        killer = threading.Timer(0.3, victim.kill)  # SIGKILL while the step generates
        killer.start()
        m = loop.colocated_step(s, cfg)
        killer.join()
        assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
        assert m["rollout/engine_restarts"] == 1
        assert m["train_rollout_logprob_abs_diff"] <= 1e-4, "the new engine samples with the actor's weights"
        assert engine_core().pid != victim.pid
        s.actor.onload(["params"])  # offloaded at the end of a step; bring them back to read them
        assert s.workers.verify() > 0  # the engine's weights equal the actor's after the step's sync
        s.actor.offload(["params"])
        s.step = 2
        assert loop.colocated_step(s, cfg)["rollout/engine_restarts"] == 0
    finally:
        s.close()


def test_model_folder_without_weights_stops_in_one_line(tmp_path, tiny_model):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model("qwen3-tiny"), bare, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ConfigError, match=rf"^model.path={bare} has no weights \(no \*.safetensors files\)$"):
        start_session(tiny_cfg(tmp_path, tiny_model, **{"model.path": str(bare)}))


def test_tokenizer_that_does_not_fit_the_model_stops_in_one_line(tmp_path, tiny_model):
    from colocate_rl.models.tiny import build_qwen3_tokenizer

    tok_dir = tmp_path / "qwen3-tokenizer"
    build_qwen3_tokenizer().save_pretrained(str(tok_dir))  # 151k tokens vs the tiny model's few hundred
    with pytest.raises(ConfigError) as e:
        start_session(tiny_cfg(tmp_path, tiny_model, **{"model.tokenizer": str(tok_dir)}))
    msg = str(e.value)
    assert "\n" not in msg and str(tok_dir) in msg and "vocab_size" in msg, msg


def test_actor_skips_a_nonfinite_update_and_leaves_the_weights(tiny_model):
    from test_actor import make_actor, make_batch

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
