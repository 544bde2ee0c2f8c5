"""Reward functions by name, and the worker pool's timeouts and error counting."""

from __future__ import annotations

import logging
import textwrap

import pytest
import torch

from colocate_rl.config import RewardConfig
from colocate_rl.rewards import REWARDS, RewardScorer, get_reward, get_reward_fn, score_batch
from colocate_rl.rewards.math import answer_line, last_boxed
from colocate_rl.types import RolloutBatch, Sample


def test_last_boxed_nested_braces():
    text = r"first \boxed{3}, then \boxed{\frac{1}{2} + \{1, \{2\}\}} done"
    assert last_boxed(text) == r"\frac{1}{2} + \{1, \{2\}\}"
    assert last_boxed(r"so \boxed 5.") == "5"
    assert last_boxed(r"\boxed{1") is None and last_boxed("no box") is None


def test_answer_line_takes_the_last():
    assert answer_line("Answer: 1\nthinking again...\nAnswer: $\\frac{3}{4}$") == "$\\frac{3}{4}$"
    assert answer_line("answer : \\boxed{7}") == "7"
    assert answer_line("no final line") is None


@pytest.mark.parametrize(
    "name, response, label, want",
    [
        ("math", r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),  # equivalent forms
        ("math", r"\boxed{\dfrac{\sqrt{3}}{2}}", r"\frac{\sqrt 3}{2}", 1.0),
        ("math", r"\boxed{\{1, 2\}}", r"\{2, 1\}", 1.0),  # nested braces, sets
        ("math", r"\boxed{\frac{1}{3}}", "0.5", 0.0),
        ("math", "work...\nAnswer: 1/2", r"\frac{1}{2}", 1.0),  # no box: the DAPO line
        ("math", "the total is 12 apples", "12", 1.0),  # neither: the whole response
        ("math", "the total is 13 apples", "12", 0.0),
        ("math", "", "12", 0.0),
        ("dapo", "Answer: 3\nwait, no.\nAnswer: 0.75", r"\frac34", 1.0),  # the last Answer line
        ("dapo", "Answer: 0.75\nwait, no.\nAnswer: 3", r"\frac34", 0.0),
        ("dapo", r"\boxed{0.75}", "0.75", 0.0),  # DAPO format only
        ("boxed", r"\boxed{2} or rather \boxed{1/2}", "0.5", 1.0),
        ("boxed", "Answer: 0.5", "0.5", 0.0),  # no box
        ("arithmetic", " 12 is it, not 13", "12", 1.0),
        ("arithmetic", "-3", "-3", 1.0),
        ("arithmetic", "13", "12", 0.0),
        ("arithmetic", "no digits", "12", 0.0),
    ],
)
def test_rewards(name, response, label, want):
    assert get_reward_fn(name)(response, label) == want


def test_only_cheap_rewards_run_inline():
    assert REWARDS["arithmetic"].inline
    assert not any(REWARDS[n].inline for n in ("math", "dapo", "boxed"))


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's reward module on sys.path (workers inherit sys.path when they start)."""
    (tmp_path / "user_rewards_for_test.py").write_text(textwrap.dedent("""
        import os
        import time

        def exact(response, label):
            return float(response.strip() == label)

        def slow_or_failing(response, label):
            if response == "hang":
                time.sleep(60)
            if response == "raise":
                raise KeyError("boom")
            if response == "crash":
                os._exit(3)
            return float(response == label)

        not_a_function = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_rewards_for_test"


def test_dotted_path_user_function(user_module):
    fn = get_reward_fn(f"{user_module}:exact")
    assert fn(" a ", "a") == 1.0 and fn("b", "a") == 0.0
    assert not get_reward(f"{user_module}:exact").inline  # users' functions may hang: always pooled


@pytest.mark.parametrize(
    "spec, message",
    [
        ("maths", "unknown reward 'maths': registered rewards: arithmetic, boxed, dapo, math; or give"),
        ("no_such_pkg.mod:fn", "reward 'no_such_pkg.mod:fn': cannot import 'no_such_pkg.mod' (No module named"),
        ("user_rewards_for_test:nope", "module 'user_rewards_for_test' has no 'nope'; registered rewards: arith"),
        ("user_rewards_for_test:not_a_function", "'not_a_function' is not a function"),
    ],
)
def test_bad_reward_names(user_module, spec, message):
    with pytest.raises(ValueError) as e:
        get_reward_fn(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_inline_scoring_counts_errors():
    rewards, stats = score_batch("arithmetic", ["7", "8", "5"], ["7", "7", "not an int"])
    assert rewards == [1.0, 0.0, 0.0]
    assert stats["reward/errors"] == 1 and stats["reward/timeouts"] == 0


def test_pool_timeout_and_exception_are_counted_and_the_pool_recovers(user_module, caplog):
    with RewardScorer(f"{user_module}:slow_or_failing", timeout_s=1.5, workers=2) as scorer:
        with caplog.at_level(logging.WARNING, logger="colocate_rl.rewards.scorer"):
            responses = ["a", "hang", "raise", "crash", "b", "x"]
            rewards, stats = scorer(responses, responses[:-1] + ["y"])
        assert rewards == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        assert stats["reward/timeouts"] == 1 and stats["reward/errors"] == 2  # the exception and the crash
        assert "1 of 6 calls timed out (> 1.5 s) and 2 raised" in caplog.text and "KeyError" in caplog.text
        # the hung worker was replaced: the next call still scores, and in full
        rewards, stats = scorer(["a", "b", "c"], ["a", "b", "z"])
        assert rewards == [1.0, 1.0, 0.0]
        assert stats["reward/timeouts"] == 0 and stats["reward/errors"] == 0
        assert all(w.proc.is_alive() for w in scorer._workers)
    with pytest.raises(RuntimeError, match="is closed"):
        scorer(["a"], ["a"])


def test_math_scores_in_the_pool():
    responses = [r"\boxed{\frac{1}{2}}", "Answer: 0.5", r"\boxed{2}"]
    rewards, stats = score_batch("math", responses, ["0.5", "1/2", "3"], timeout_s=30, workers=2)
    assert rewards == [1.0, 1.0, 0.0]
    assert stats["reward/errors"] == 0 and stats["reward/timeouts"] == 0


def test_score_a_rollout_batch():
    b = 3
    batch = RolloutBatch(
        tokens=torch.zeros(b, 2, dtype=torch.long), attention_mask=torch.ones(b, 2, dtype=torch.bool),
        loss_mask=torch.ones(b, 2, dtype=torch.bool), rollout_logprobs=torch.zeros(b, 2),
        prompt_lens=torch.zeros(b, dtype=torch.long), response_lens=torch.full((b,), 2),
        group_ids=torch.arange(b), truncated=torch.zeros(b, dtype=torch.bool), finish_reasons=["stop"] * b,
        responses=["7", "8", "12"], samples=[Sample([1], label=x) for x in ("7", "7", "12")],
    )
    scorer = RewardScorer.from_config(RewardConfig(name="arithmetic"))
    rewards, stats = scorer.score(batch)
    assert rewards.dtype == torch.float32 and rewards.tolist() == [1.0, 0.0, 1.0]
    assert stats["reward/mean"] == pytest.approx(2 / 3)
    scorer.close()
