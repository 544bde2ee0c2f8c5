"""The RL step, in order. This is the only module that orders phases.

Colocated step (docs/architecture.md; the staged wake keeps the peak below the card):
    rollout   generate n samples per prompt with logprobs → sleep (vLLM frees the GPU)
    reward    score → group-relative advantages
    actor     onload → re-score logprobs → train → offload grads + optimizer
    sync      wake vLLM weights → send the new weights over IPC → offload actor params → wake KV cache
"""

from __future__ import annotations

from tqdm import tqdm

from colocate_rl.algorithms import ADVANTAGES, logprob_abs_diff
from colocate_rl.config import Config
from colocate_rl.memory import Phase
from colocate_rl.metrics import PhaseTimer, console_line
from colocate_rl.session import Session, start_session


def run(cfg: Config) -> dict:
    if cfg.placement.mode == "disaggregated":
        raise NotImplementedError("placement.mode=disaggregated is not available yet")
    if cfg.checkpoint.every:
        raise NotImplementedError("checkpoint.every > 0: checkpointing is not available yet (set checkpoint.every=0)")
    return run_colocated(cfg)


def run_colocated(cfg: Config) -> dict:
    s = start_session(cfg)  # run folder, data, reward, actor, rollout engine, handoff, metrics log
    try:
        if cfg.sft.steps and s.step == 0:
            warm_start(s)
        if cfg.eval.every and cfg.eval.at_start and s.step == 0:
            s.log.log(0, s.evaluate())
        bar = tqdm(range(s.step, cfg.steps), desc="grpo", disable=not cfg.logging.progress, initial=s.step,
                   total=cfg.steps)
        for step in bar:
            metrics = colocated_step(s, cfg)
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0:
                metrics.update(s.evaluate())
            s.log.log(step + 1, metrics)
            tqdm.write(console_line(step + 1, cfg.steps, metrics))
            s.step = step + 1
        return s.finish()
    finally:
        s.close()


def colocated_step(s: Session, cfg: Config) -> dict:
    t = PhaseTimer()
    with t("generate"):
        batch = s.rollout.generate(s.sampler.next_batch())
    with t("sleep"):
        s.rollout.sleep(cfg.rollout.sleep_level)
        s.handoff.to(Phase.IDLE)
    with t("reward"):
        batch.rewards, reward_metrics = s.scorer.score(batch)
        batch.advantages = ADVANTAGES[cfg.algorithm.advantage](batch.rewards, batch.n_per_group,
                                                               cfg.algorithm.adv_eps)
    with t("onload"):
        onload_bytes, onload_s = s.actor.onload()
        s.handoff.to(Phase.ACTOR)
    with t("logprobs"):
        old_logprobs = s.actor.compute_logprobs(batch)
    with t("train"):
        train_metrics = s.actor.train_step(batch, old_logprobs)
    sync, offload_bytes, offload_s = hand_back_to_rollout(s, t)
    gen_tokens = int(batch.response_lens.sum())
    return {
        "reward/mean": float(batch.rewards.mean()),
        **reward_metrics,
        "train_rollout_logprob_abs_diff": logprob_abs_diff(old_logprobs, batch.rollout_logprobs, batch.loss_mask),
        **train_metrics,
        "rollout/response_len": float(batch.response_lens.float().mean()),
        "rollout/truncated": float(batch.truncated.float().mean()),
        "rollout/tokens_per_s": gen_tokens / max(t.seconds["generate"], 1e-9),
        "sync/bytes": sync.bytes,
        "sync/GBps": sync.bytes / max(sync.seconds, 1e-9) / 1e9,
        "actor/onload_GBps": onload_bytes / max(onload_s, 1e-9) / 1e9,
        "actor/offload_GBps": offload_bytes / max(offload_s, 1e-9) / 1e9,
        "actor/offloaded_bytes": offload_bytes,
        **t.metrics(),
        "time/step": sum(t.seconds.values()),
    }


def hand_back_to_rollout(s: Session, t: PhaseTimer):
    """actor → vLLM, staged: weights first, then the sync, then the KV cache.
    Returns (sync stats, bytes offloaded, seconds offloading)."""
    with t("offload"):
        b1, s1 = s.actor.offload(("grads", "optimizer"))
        s.handoff.to(Phase.ACTOR_PARAMS)
    with t("wake_weights"):
        s.rollout.wake(["weights"])
        s.handoff.to(Phase.SYNC)
    with t("sync"):
        sync = s.sync_weights()
    with t("offload"):
        b2, s2 = s.actor.offload(("params",))
        s.handoff.to(Phase.ROLLOUT_WEIGHTS)
    with t("wake_kv"):
        s.rollout.wake(["kv_cache"])
        s.handoff.to(Phase.ROLLOUT)
    return sync, b1 + b2, s1 + s2


def warm_start(s: Session) -> None:
    """A short supervised pass on the training labels, then a sync so vLLM samples from it."""
    cfg, t = s.cfg, PhaseTimer()
    s.rollout.sleep(cfg.rollout.sleep_level)
    s.handoff.to(Phase.IDLE)
    s.actor.onload()
    s.handoff.to(Phase.ACTOR)
    for i in tqdm(range(cfg.sft.steps), desc="sft warm-start", disable=not cfg.logging.progress):
        m = s.actor.sft_step(s.sft_batch(cfg.sft.batch_size, seed=i))
    hand_back_to_rollout(s, t)
    tqdm.write(f"sft warm-start: {cfg.sft.steps} steps, final loss {float(m['loss']):.3f}, {sum(t.seconds.values()):.1f}s handoff")
