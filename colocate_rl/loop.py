"""The RL step, in order. This is the only module that orders phases.

Colocated step (docs/architecture.md; the staged wake keeps the peak below the card):
    rollout   generate n samples per prompt with logprobs → sleep (vLLM frees the GPU)
    reward    score → group-relative advantages
    actor     onload → train → offload grads + optimizer (old logprobs come from the training
              forward itself; a separate re-scoring pass only with actor.num_minibatches > 1)
    sync      wake vLLM weights → send the new weights over IPC → offload actor params → wake KV cache

Disaggregated step (actor and engines on their own GPUs, placement/disaggregated.py):
    rollout   take the step's batch from the rollout buffer (the router spread it over the engines)
    reward    score → group-relative advantages
    actor     train (re-scoring first only with actor.num_minibatches > 1)
    sync      engines idle → broadcast the new weights to every engine
With rollout.off_policy the next step's generation is requested before training instead of after
the sync, so it runs on the previous weights while this step trains (one step stale).
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable

from tqdm import tqdm

from colocate_rl import config as C
from colocate_rl.algorithms import ADVANTAGES
from colocate_rl.config import Config
from colocate_rl.memory import Handoff, Phase
from colocate_rl.metrics import PhaseTimer, console_line
from colocate_rl.rollout import EngineDied
from colocate_rl.session import Session, start_session
from colocate_rl.types import RolloutBatch


def run(cfg: Config) -> dict:
    if cfg.placement.mode == "disaggregated":
        return run_disaggregated(cfg)
    return run_colocated(cfg)


def run_colocated(cfg: Config) -> dict:
    s = start_session(cfg)  # run folder, data, reward, actor, rollout engine, handoff, metrics log
    try:
        with StopOnInterrupt() as interrupt:
            resume(s)
            if cfg.sft.steps and s.step == 0:
                warm_start(s)
            if cfg.eval.every and cfg.eval.at_start and s.step == 0:
                s.log.log(0, s.evaluate())
            bar = tqdm(range(s.step, cfg.steps), desc="grpo", disable=not cfg.logging.progress, initial=s.step,
                       total=cfg.steps)
            for _ in bar:
                metrics = colocated_step(s, cfg)
                if end_step(s, metrics, interrupt.requested, save=lambda: with_actor(s, s.save_checkpoint)):
                    break
        return s.finish()
    finally:
        s.close()


def end_step(s: Session, metrics: dict, interrupted: bool, save: Callable[[], None]) -> bool:
    """After a step: eval when due, the metrics row and console line, the stop after
    actor.max_nonfinite_in_row skipped updates, a checkpoint when due or on Ctrl-C.
    Returns True when the run should stop (Ctrl-C)."""
    cfg = s.cfg
    if cfg.eval.every and (s.step + 1) % cfg.eval.every == 0:
        metrics.update(s.evaluate())  # before the count moves: eval sampling is seeded by the step
    s.step += 1
    s.log.log(s.step, metrics)
    tqdm.write(console_line(s.step, cfg.steps, metrics))
    s.check_update(metrics)
    if s.checkpoint_due() or (interrupted and cfg.checkpoint.on_interrupt):
        save()
    if interrupted:
        tqdm.write(f"interrupted: stopped cleanly after step {s.step}")
    return interrupted


def colocated_step(s: Session, cfg: Config) -> dict:
    t = PhaseTimer()
    with t("generate"):
        batch, restarts = generate(s, s.sampler.next_batch())
    with t("sleep"):
        s.rollout.sleep(cfg.rollout.sleep_level)
        s.handoff.to(Phase.IDLE)
    with t("reward"):
        batch.rewards, reward_metrics = s.scorer.score(batch)
        batch.advantages = ADVANTAGES[cfg.algorithm.advantage](batch.rewards, batch.n_per_group, cfg.algorithm)
    with t("onload"):
        onload_bytes, onload_s = s.actor.onload()
        s.handoff.to(Phase.ACTOR)
    with t("train"):
        train_metrics = s.actor.train_step(batch, old_logprobs(s, batch, t))
    sync, offload_bytes, offload_s = hand_back_to_rollout(s, t)
    gen_tokens = int(batch.response_lens.sum())
    return {
        "reward/mean": float(batch.rewards.mean()),
        **reward_metrics,
        **train_metrics,  # train_rollout_logprob_abs_diff among them
        "rollout/response_len": float(batch.response_lens.float().mean()),
        "rollout/truncated": float(batch.truncated.float().mean()),
        "rollout/engine_restarts": restarts,
        "rollout/tokens_per_s": gen_tokens / max(t.seconds["generate"], 1e-9),
        "sync/bytes": sync.bytes,
        "sync/GBps": sync.bytes / max(sync.seconds, 1e-9) / 1e9,
        "actor/onload_GBps": onload_bytes / max(onload_s, 1e-9) / 1e9,
        "actor/offload_GBps": offload_bytes / max(offload_s, 1e-9) / 1e9,
        "actor/offloaded_bytes": offload_bytes,
        **t.metrics(),
        "time/step": sum(t.seconds.values()),
    }


def old_logprobs(s: Session, batch: RolloutBatch, t: PhaseTimer):
    """The actor's logprobs of the batch before this step's update: a forward pass of their own
    only when the batch makes several optimizer steps. With one (the default), the training
    forward's logprobs are exactly these and train_step takes them from there (None)."""
    if s.cfg.actor.num_minibatches == 1:
        return None
    with t("logprobs"):
        return s.actor.compute_logprobs(batch)


def generate(s: Session, prompts: list) -> tuple[RolloutBatch, int]:
    """The step's rollout; an engine that dies is rebuilt, given the actor's weights, and the same
    prompts are issued again (same seed: the samples are those the dead engine would have drawn).
    Returns (batch, restarts)."""
    for restarts in range(s.cfg.rollout.max_engine_restarts + 1):
        try:
            return s.rollout.generate(prompts, seed=s.step_seed()), restarts
        except EngineDied as e:
            if restarts == s.cfg.rollout.max_engine_restarts:
                raise
            tqdm.write(f"step {s.step + 1}: {e}; restarting the engine and re-issuing {len(prompts)} prompts")
            s.workers.restart_rollout()
            s.handoff = Handoff(s.handoff.plan, measure=s.handoff.measure)  # the new engine is awake
            with_actor(s, lambda: None)  # its weights are the model folder's: sync the actor's
    raise AssertionError("unreachable")


def with_actor(s: Session, fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` with the actor onloaded and vLLM asleep, then hands the device back (which
    syncs the actor's weights into vLLM). For work between steps: checkpoints, resume, restarts."""
    t = PhaseTimer()
    s.rollout.sleep(s.cfg.rollout.sleep_level)
    s.handoff.to(Phase.IDLE)
    s.actor.onload()
    s.handoff.to(Phase.ACTOR)
    out = fn()
    hand_back_to_rollout(s, t)
    return out


def resume(s: Session) -> None:
    """Restore the newest intact checkpoint (if any) → push its weights to vLLM → continue."""
    ckpt = s.cfg.checkpoint
    if not s.checkpoints.candidates(ckpt.resume):
        return
    loaded = with_actor(s, lambda: s.checkpoints.load(ckpt.resume, C.to_dict(s.cfg), s.actor.load_checkpoint))
    if loaded is not None:
        s.restore(loaded)


class StopOnInterrupt:
    """While active, the first Ctrl-C (SIGINT) asks the loop to stop after the current step (and
    checkpoint, with checkpoint.on_interrupt); a second one interrupts at once. Main thread only."""

    def __init__(self):
        self.requested, self._previous = False, None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        tqdm.write("Ctrl-C: stopping after this step (press again to stop now)")

    def __enter__(self) -> "StopOnInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


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
    cfg = s.cfg

    def sft() -> dict:
        for i in tqdm(range(cfg.sft.steps), desc="sft warm-start", disable=not cfg.logging.progress):
            m = s.actor.sft_step(s.sft_batch(cfg.sft.batch_size, seed=i))
        return m

    m = with_actor(s, sft)
    tqdm.write(f"sft warm-start: {cfg.sft.steps} steps, final loss {float(m['loss']):.3f}")


def run_disaggregated(cfg: Config) -> dict:
    s = start_session(cfg)  # the actor pool, the engines behind the router, the rollout buffer
    w = s.workers
    try:
        with StopOnInterrupt() as interrupt:
            # The actor is always resident here: restore it, then broadcast its weights.
            if s.checkpoints.candidates(cfg.checkpoint.resume):
                loaded = s.checkpoints.load(cfg.checkpoint.resume, C.to_dict(cfg), s.actor.load_checkpoint)
                if loaded is not None:
                    s.restore(loaded)
                    s.sync_weights()
            if cfg.sft.steps and s.step == 0:
                for i in tqdm(range(cfg.sft.steps), desc="sft warm-start", disable=not cfg.logging.progress):
                    s.actor.sft_step(s.sft_batch(cfg.sft.batch_size, seed=i))
                s.sync_weights()
            if cfg.eval.every and cfg.eval.at_start and s.step == 0:
                s.log.log(0, s.evaluate())
            if s.step < cfg.steps:
                w.buffer.request(s.sampler.next_batch(), w.version)
            for step in tqdm(range(s.step, cfg.steps), desc="grpo", disable=not cfg.logging.progress,
                             initial=s.step, total=cfg.steps):
                metrics = disaggregated_step(s, cfg, last=interrupt.requested or step + 1 == cfg.steps)
                if end_step(s, metrics, interrupt.requested, save=s.save_checkpoint):
                    break
        return s.finish()
    finally:
        s.close()


def disaggregated_step(s: Session, cfg: Config, last: bool = False) -> dict:
    """One step; the batch was requested by the previous step (or before the first)."""
    t, w = PhaseTimer(), s.workers
    with t("generate"):  # off-policy: mostly produced while the previous step trained
        got = w.buffer.get()
    batch, staleness = got.batch, w.version - got.version
    if cfg.rollout.off_policy and not last:
        w.buffer.request(s.sampler.next_batch(), w.version)  # runs while this step trains
    with t("reward"):
        batch.rewards, reward_metrics = s.scorer.score(batch)
        batch.advantages = ADVANTAGES[cfg.algorithm.advantage](batch.rewards, batch.n_per_group, cfg.algorithm)
    with t("train"):  # the token IS correction weights stale samples by actor / sampler probability
        train_metrics = s.actor.train_step(batch, old_logprobs(s, batch, t))
    with t("wait_rollout"):
        w.buffer.drain()  # a sync waits for the engines to finish generating
    with t("sync"):
        sync = s.sync_weights()
    if not cfg.rollout.off_policy and not last:
        w.buffer.request(s.sampler.next_batch(), w.version)
    return {
        "reward/mean": float(batch.rewards.mean()),
        **reward_metrics,
        **train_metrics,  # train_rollout_logprob_abs_diff among them
        "rollout/staleness": staleness,
        **got.metrics,  # rollout/engine_restarts, rollout/reissued_prompts
        "rollout/response_len": float(batch.response_lens.float().mean()),
        "rollout/truncated": float(batch.truncated.float().mean()),
        "sync/bytes": sync.bytes,
        "sync/GBps": sync.bytes / max(sync.seconds, 1e-9) / 1e9,
        **t.metrics(),
        "time/step": sum(t.seconds.values()),
    }
