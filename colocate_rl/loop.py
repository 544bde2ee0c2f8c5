"""The RL step, in order. This is the only module that orders phases; the handoff performs them.

    generate   take the step's batch (colocated: the engine generates now; disaggregated: the batch
               the router was asked for earlier, generated on the rollout GPUs meanwhile)
    reward     score → group-relative advantages
    to_actor   the actor may train (colocated: vLLM sleeps, the actor's offloaded parts come back)
    train      one optimizer step per mini-batch (old logprobs from the training forward itself;
               a separate re-scoring pass only with actor.num_minibatches > 1)
    to_rollout the engines get the new weights (colocated, staged: offload → wake weights → sync →
               offload params → wake KV cache; disaggregated: a broadcast once generation is idle)

With rollout.off_policy (disaggregated) the next rollout.max_staleness steps' batches are requested
before training, so they are generated on earlier weights while this step trains (k steps stale).
With rollout.partial the buffer's batch is the groups complete when generation stopped; unfinished
rows wait for a later step (rollout/partial.py). Resume, warm-start, checkpoints and engine restarts
are the same in both modes (handoff.py).
"""

from __future__ import annotations

import signal
import threading

from tqdm import tqdm

from colocate_rl import config as C
from colocate_rl import faults
from colocate_rl.algorithms import ADVANTAGES
from colocate_rl.checkpoint import rng_state, set_rng_state
from colocate_rl.config import Config
from colocate_rl.data import sft_batch
from colocate_rl.eval import evaluate as run_eval
from colocate_rl.metrics import PhaseTimer, console_line
from colocate_rl.plan import RunPlan
from colocate_rl.rollout.base import EVAL_SEED_OFFSET
from colocate_rl.rollout.dynamic import informative, refill
from colocate_rl.rollout.partial import version_lag
from colocate_rl.session import Session, start_session
from colocate_rl.types import RolloutBatch


def run(cfg: Config, plan: RunPlan) -> dict:
    s = start_session(cfg, plan)
    try:
        with StopOnInterrupt() as interrupt:
            prepare(s)
            end = min(cfg.steps, s.step + cfg.stop_after) if cfg.stop_after else cfg.steps  # this piece's last
            for _ in tqdm(range(s.step, end), desc="grpo", disable=not cfg.logging.progress, initial=s.step,
                          total=cfg.steps):
                metrics = step(s, last=interrupt.requested or s.step + 1 == end)
                if end_step(s, metrics, interrupt.requested, pause=s.step + 1 == end < cfg.steps):
                    break
        return s.finish()
    finally:
        s.close()


def prepare(s: Session) -> None:
    """Resume from the newest intact checkpoint, or warm-start a fresh run; eval before step 1."""
    cfg = s.cfg
    resume(s)
    if s.step:
        return
    row = warm_start(s) if cfg.sft.steps else {}
    if cfg.eval.every and cfg.eval.at_start:
        row.update(evaluate(s))
    if row:
        s.log.log(0, row)


def step(s: Session, last: bool = False) -> dict:
    cfg, scheduling, t = s.cfg, s.plan.scheduling, PhaseTimer()
    if not len(s.buffer):
        request(s)
    with t("generate"):
        got = s.buffer.get()
    staleness = s.handoff.version - got.version  # weights versions between sampling and this update
    stale = scheduling.off_policy or scheduling.partial  # per-token lags to report
    lag = version_lag(got.batch, s.handoff.version, got.version) if stale else {}
    while scheduling.off_policy and not last and len(s.buffer) < scheduling.max_staleness:
        request(s, ahead=len(s.buffer) + 1)  # generated while this step trains
    batch = got.batch
    with t("reward"):
        batch.rewards, reward_metrics = s.scorer.score(batch)
    # The share of groups whose rewards differ: only these carry an advantage, hence a gradient.
    reward_metrics["reward/signal_groups"] = float(informative(batch.rewards, batch.n_per_group).float().mean())
    if scheduling.dynamic_sampling:
        with t("resample"):
            batch, resampled = refill(batch, cfg.data.prompts_per_step, lambda k, r: more(s, k, r),
                                      scheduling.dynamic_max_rounds)
        reward_metrics.update(resampled)
    batch.advantages = ADVANTAGES[cfg.algorithm.advantage](batch.rewards, batch.n_per_group, cfg.algorithm)
    s.handoff.to_actor(t)
    with t("train"):
        faults.point("train", s.step + 1)
        train_metrics = s.actor.train_step(batch, old_logprobs(s, batch, t))
    sync = s.handoff.to_rollout(t)
    handoff = s.handoff.take_counts()  # engines replaced by the handoff, actor bytes moved
    return {
        "reward/mean": float(batch.rewards.mean()),
        **reward_metrics,
        **train_metrics,  # train_rollout_logprob_abs_diff among them
        **got.metrics,  # the router's restarts and re-issued prompts (disaggregated), partial rollouts' counts
        **handoff,
        "rollout/engine_restarts": handoff["rollout/engine_restarts"] + got.metrics.get("rollout/engine_restarts", 0),
        "rollout/staleness": staleness,
        **lag,  # max and mean over the trained tokens
        "rollout/response_len": float(batch.response_lens.float().mean()),
        "rollout/truncated": float(batch.truncated.float().mean()),
        "rollout/tokens_per_s": int(batch.response_lens.sum()) / max(t.seconds["generate"], 1e-9),
        "sync/bytes": sync.bytes,
        "sync/GBps": sync.bytes / max(sync.seconds, 1e-9) / 1e9,
        # Where a sync's seconds go: the actor's export and packing, the engines' loading.
        "sync/pack_s": sync.pack_seconds,
        "sync/engine_s": sync.receiver_seconds,
        **t.metrics(),
        "time/step": sum(t.seconds.values()),
    }


def request(s: Session, ahead: int = 0) -> None:
    """Asks the buffer for the batch of the step ``ahead`` after the one in progress."""
    cursor = s.sampler.state_dict()
    s.buffer.request(s.sampler.next_batch(), version=s.handoff.version, seed=s.plan.sampling.step_seed(s.step + ahead),
                     cursor=cursor, ahead=ahead)


def more(s: Session, k: int, round: int) -> RolloutBatch:
    """k more prompts' groups, generated now and scored (dynamic sampling's refill, round ``round``)."""
    seed = s.plan.sampling.step_seed(s.step)
    batch = s.buffer.generate(s.sampler.next_batch(k), seed=None if seed is None else seed + round * 104_729)
    batch.rewards, _ = s.scorer.score(batch)
    return batch


def old_logprobs(s: Session, batch: RolloutBatch, t: PhaseTimer):
    """The actor's logprobs of the batch before this step's update: a forward pass of their own
    only when the batch makes several optimizer steps. With one (the default), the training
    forward's logprobs are exactly these and train_step takes them from there (None)."""
    if s.cfg.actor.num_minibatches == 1:
        return None
    with t("logprobs"):
        return s.actor.compute_logprobs(batch)


def end_step(s: Session, metrics: dict, interrupted: bool, pause: bool = False) -> bool:
    """After a step: eval when due, the metrics row and console line, the stop after
    actor.max_nonfinite_in_row skipped updates, a checkpoint when due, on Ctrl-C or at the end of a
    piece (``pause``: stop_after). Returns True when the run should stop (Ctrl-C)."""
    cfg = s.cfg
    if cfg.eval.every and (s.step + 1) % cfg.eval.every == 0:
        metrics.update(evaluate(s))  # before the count moves: eval sampling is seeded by the step
    s.step += 1
    s.log.log(s.step, metrics)
    tqdm.write(console_line(s.step, cfg.steps, metrics))
    s.guard.update(metrics, s.step)
    if line := s.signal.update(metrics, s.step):
        tqdm.write(line)
    c = cfg.checkpoint
    if (c.every and s.step % c.every == 0) or (c.at_end and s.step == cfg.steps) or (interrupted and c.on_interrupt) \
            or pause:
        save(s)
    if interrupted:
        tqdm.write(f"interrupted: stopped cleanly after step {s.step}")
    elif pause:
        tqdm.write(f"stop_after={cfg.stop_after}: stopped after step {s.step} of {cfg.steps}; the same command "
                   "continues from its checkpoint")
    return interrupted


def evaluate(s: Session) -> dict:
    ev, seed = s.cfg.eval, s.plan.sampling.step_seed(s.step)

    def generate(samples, **kw):
        return s.handoff.on_rollout("eval", lambda: s.rollout.generate(samples, **kw))

    return run_eval(s.eval_sets, s.turns.over(generate), s.scorer.score, ev.n_samples, ev.temperature,
                    ev.max_response_tokens or None, None if seed is None else seed + EVAL_SEED_OFFSET)


def save(s: Session) -> None:
    """A checkpoint of the actor and of enough trainer state to continue exactly where the run is."""
    faults.point("checkpoint", s.step)
    state = {"step": s.step, "sampler": s.buffer.cursor() or s.sampler.state_dict(), "rng": rng_state(),
             "config": C.to_dict(s.cfg)}
    if s.buffer.partial is not None and s.buffer.cursor() is None:  # the rows in flight, with their prompts
        state["in_flight"] = s.buffer.partial.state_dict(s.handoff.version)
    with s.handoff.actor_owned(changes_weights=False):
        s.checkpoints.save(s.step, s.actor.save_checkpoint, state)


def resume(s: Session) -> None:
    """The newest intact checkpoint's actor and trainer state; the engines then get its weights.
    Metrics rows after its step are dropped: they are redone."""
    ckpt = s.cfg.checkpoint
    if not s.checkpoints.candidates(ckpt.resume):
        return
    faults.point("resume", s.step)
    with s.handoff.actor_owned():
        loaded = s.checkpoints.load(ckpt.resume, C.to_dict(s.cfg), s.actor.load_checkpoint)
    if loaded is None:
        return
    s.step = loaded.step
    s.sampler.load_state_dict(loaded.state["sampler"])
    if s.buffer.partial is not None and "in_flight" in loaded.state:
        s.buffer.partial.load_state_dict(loaded.state["in_flight"], s.handoff.version)
    set_rng_state(loaded.state["rng"])
    dropped = s.log.truncate(s.step)
    print(f"resumed from {loaded.path} at step {s.step}"
          + (f" ({dropped} metrics rows after it dropped: they are redone)" if dropped else ""), flush=True)


SFT_WINDOW = 5  # batches whose mean accuracy sft.stop_at_accuracy is held to
SFT_REPORT = 50  # a console line every this many warm-start steps (a long one is not silent)


def warm_start(s: Session) -> dict:
    """A short supervised pass on the training labels; the engines then sample from it. With
    sft.stop_at_accuracy it stops once the last batches' greedy accuracy reaches that value."""
    cfg = s.cfg
    recent: list[float] = []
    with s.handoff.actor_owned():
        for i in tqdm(range(cfg.sft.steps), desc="sft warm-start", disable=not cfg.logging.progress):
            m = s.actor.sft_step(sft_batch(s.train_samples, s.tokenizer, cfg.sft.batch_size,
                                           seed=cfg.seed * 1_000_003 + i), cfg.sft.lr)
            recent = (recent + [m["exact_total"] / max(m["rows_total"], 1.0)])[-SFT_WINDOW:]
            if (i + 1) % SFT_REPORT == 0:
                tqdm.write(f"sft warm-start: step {i + 1}/{cfg.sft.steps}, loss {float(m['loss']):.3f}, accuracy of "
                           f"the last {len(recent)} batches {sum(recent) / len(recent):.3f}")
            if cfg.sft.stop_at_accuracy and len(recent) == SFT_WINDOW and \
                    sum(recent) / SFT_WINDOW >= cfg.sft.stop_at_accuracy:
                break
    out = {"sft/steps": i + 1, "sft/loss": float(m["loss"]), "sft/accuracy": sum(recent) / len(recent)}
    tqdm.write(f"sft warm-start: {i + 1} steps, final loss {out['sft/loss']:.3f}, accuracy of the last "
               f"{len(recent)} batches {out['sft/accuracy']:.3f}")
    return out


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
