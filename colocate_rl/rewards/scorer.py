"""Scoring responses in long-lived worker processes, every call under a timeout.

Why processes: math-verify (sympy) can hang on an adversarial answer, and its signal.alarm timeouts
raise when called off a main thread. Each worker runs one call at a time on its own main thread;
a call past ``timeout_s`` gets its worker killed and replaced (a thread cannot be killed, and a
ProcessPoolExecutor cannot kill one of its workers and carry on).

Why the forkserver start method: fork() after torch/vLLM/Ray have started threads copies locks
that another thread held, and the child can deadlock on them; spawn starts a fresh interpreter
that re-imports sympy (a slow import) for every replaced worker. The forkserver is one single-threaded
process, started once, that has imported the reward modules; each worker forks from it in
milliseconds. As with spawn, a script that starts a scorer needs an ``if __name__ == "__main__"``
guard, because workers import the main module.

A timeout or an exception scores 0 and is counted in the stats (``reward/timeouts``,
``reward/errors``) and in a warning line; never silently.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import signal
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Optional

from colocate_rl.config import RewardConfig
from colocate_rl.rewards.registry import RewardFn, get_reward

if TYPE_CHECKING:
    import torch

    from colocate_rl.types import RolloutBatch

logger = logging.getLogger(__name__)

_CTX = multiprocessing.get_context("forkserver")
# Imported once in the forkserver, so that every worker forked from it starts warm.
_PRELOAD = ["colocate_rl.rewards", "math_verify"]
_START_TIMEOUT_S = 120.0


def _finite(value) -> float:
    """A reward as float; NaN/inf would turn every advantage of its group into NaN, so it is an error."""
    r = float(value)
    if not math.isfinite(r):
        raise ValueError(f"reward is {r}")
    return r


def _serve(conn: Connection, fn: RewardFn) -> None:
    """Worker: (row, response, label) in, (row, ok, reward or error text) out; row -1 means ready."""
    # A Ctrl-C at the terminal reaches every process of the run: the run stops after its step and
    # closes the scorer then, so a worker that died of it would fail that step's scoring.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send((-1, True, 0.0))
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the scorer's process is gone
            return
        if job is None:
            return
        i, response, label = job
        try:
            conn.send((i, True, _finite(fn(response, label))))
        except Exception as e:  # noqa: BLE001 - any failure of a user's reward is a counted 0
            conn.send((i, False, f"{type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, fn: RewardFn):
        self.conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=_serve, args=(child, fn), daemon=True, name="reward-worker")
        self.proc.start()
        child.close()  # so that recv() sees EOF when the worker dies
        self.ready = False
        self.job: Optional[tuple[int, float]] = None  # (row, start time)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class RewardScorer:
    """A long-lived pool scoring ``fn(response, label) -> float``; start it once, call it every step.

    ``fn``: a registered name, ``"pkg.module:function"`` or a module-level function. Rewards
    registered ``inline`` (cheap, cannot hang: ``arithmetic``) are scored in this process, without
    workers or timeout. One call at a time (not thread-safe).
    """

    def __init__(self, fn: str | RewardFn, timeout_s: float = 5.0, workers: int = 2):
        if not (0 < timeout_s < math.inf) or workers < 1:  # NaN fails the first test too
            raise ValueError(f"RewardScorer needs a finite timeout_s > 0 and workers >= 1 (got {timeout_s}, {workers})")
        self.reward = get_reward(fn)
        self.timeout_s = timeout_s
        self._workers: list[_Worker] = []
        if not self.reward.inline:
            _CTX.set_forkserver_preload(_PRELOAD)  # no effect once the forkserver runs
            self._workers = [_Worker(self.reward.fn) for _ in range(workers)]

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> "RewardScorer":
        return cls(cfg.name, cfg.timeout_s, cfg.workers)

    def score(self, batch: "RolloutBatch") -> tuple["torch.Tensor", dict[str, float]]:
        """A rollout batch → (rewards [B] float32, stats): its responses against its samples' labels."""
        import torch  # here, not at the top: the forkserver imports this package and stays light

        rewards, stats = self(batch.responses, [s.label for s in batch.samples])
        return torch.tensor(rewards, dtype=torch.float32), stats

    def __call__(self, responses: list[str], labels: list[str]) -> tuple[list[float], dict[str, float]]:
        """responses [B], labels [B] → (rewards [B], stats). Stats: reward/timeouts and reward/errors
        (calls that scored 0 because they failed), reward/mean, reward/score_s (wall time)."""
        if len(responses) != len(labels):
            raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
        t0 = time.monotonic()
        rewards = [0.0] * len(responses)
        errors: list[str] = []
        if self.reward.inline:
            for i, (response, label) in enumerate(zip(responses, labels)):
                try:
                    rewards[i] = _finite(self.reward.fn(response, label))
                except Exception as e:  # noqa: BLE001
                    errors.append(f"{type(e).__name__}: {e}")
            timeouts = 0
        else:
            timeouts = self._score_in_pool(responses, labels, rewards, errors)
        if timeouts or errors:
            logger.warning(
                "reward '%s': %d of %d calls timed out (> %g s) and %d raised%s; they scored 0",
                self.reward.name, timeouts, len(responses), self.timeout_s, len(errors),
                f" (first: {errors[0]})" if errors else "",
            )
        return rewards, {
            "reward/timeouts": float(timeouts),
            "reward/errors": float(len(errors)),
            "reward/mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "reward/score_s": time.monotonic() - t0,
        }

    def _score_in_pool(self, responses: list[str], labels: list[str], rewards: list[float], errors: list[str]) -> int:
        if not self._workers:
            raise RuntimeError(f"the reward scorer for '{self.reward.name}' is closed")
        todo, left, timeouts = deque(range(len(responses))), len(responses), 0
        while left:
            now = time.monotonic()
            for w in self._workers:
                if w.ready and w.job is None and todo:
                    i = todo.popleft()
                    w.conn.send((i, responses[i], labels[i]))
                    w.job = (i, now)
            deadlines = [w.job[1] + self.timeout_s for w in self._workers if w.job]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else _START_TIMEOUT_S
            ready = wait([w.conn for w in self._workers], wait_s)
            if not ready and not deadlines:
                raise RuntimeError(f"no reward worker for '{self.reward.name}' started within {_START_TIMEOUT_S:.0f} s")
            for k, w in enumerate(self._workers):
                if w.conn not in ready:
                    continue
                try:
                    i, ok, value = w.conn.recv()
                except (EOFError, OSError):  # the worker died: a crash, os._exit, the OOM killer
                    if not w.ready:
                        raise RuntimeError(
                            f"reward worker for '{self.reward.name}' exited while starting "
                            f"(exit code {w.proc.exitcode}); its traceback is on stderr"
                        ) from None
                    if w.job:
                        errors.append(f"worker died (exit code {w.proc.exitcode})")
                        left -= 1
                    self._workers[k] = self._replace(w)
                    continue
                if i < 0:
                    w.ready = True
                    continue
                w.job, left = None, left - 1
                if ok:
                    rewards[i] = value
                else:
                    errors.append(value)
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                if w.job and now - w.job[1] >= self.timeout_s:
                    timeouts, left = timeouts + 1, left - 1
                    self._workers[k] = self._replace(w)
        return timeouts

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        return _Worker(self.reward.fn)

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            if w.proc.is_alive():
                w.kill()
            w.conn.close()
        self._workers = []

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def score_batch(
    fn: str | RewardFn, responses: list[str], labels: list[str], timeout_s: float = 5.0, workers: int = 2
) -> tuple[list[float], dict[str, float]]:
    """One-shot scoring (starts and closes a pool: for scripts and tests; a training loop keeps one
    RewardScorer for the whole run)."""
    with RewardScorer(fn, timeout_s, workers) as scorer:
        return scorer(responses, labels)
