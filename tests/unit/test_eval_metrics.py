import json
import math

import pytest
import torch

from colocate_rl.eval import pass_at_k, summarize
from colocate_rl.metrics import MetricsLog, PhaseTimer, console_line, plot, read, summary
from colocate_rl.types import RolloutBatch, Sample


def test_pass_at_k_unbiased():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 8, 4) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(8, 2, 2) == pytest.approx(1 - math.comb(6, 2) / math.comb(8, 2))
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 4)


def test_summarize_groups():
    s = [Sample([1], label="2"), Sample([3], label="4")]
    b = RolloutBatch.from_rows([[1]] * 4 + [[3]] * 4, [[5]] * 3 + [[6, 7]] * 5, [s[0]] * 4 + [s[1]] * 4, 0,
                               finish_reasons=["stop"] * 7 + ["length"], n=4)
    m = summarize(b, torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1]))
    assert m["eval/accuracy"] == pytest.approx(5 / 8) and m["eval/truncated"] == pytest.approx(1 / 8)
    assert m["eval/pass@1"] == pytest.approx((0.25 + 1) / 2) and m["eval/pass@4"] == pytest.approx(1.0)
    assert "eval/pass@8" not in m


def test_summarize_conversations_counts_tool_use():
    """Multi-turn eval rows: turns per row, the share of rows that called a tool, and the share of
    the correct rows that did."""
    from colocate_rl.types import Conversation

    s = Sample([1], label="2")
    b = RolloutBatch.from_rows([[1]] * 4, [[5]] * 4, [s] * 4, 0, n=2)
    b.conversations = [Conversation(2, 1, 0, 0.1), Conversation(1, 0, 0, 0.0), Conversation(3, 2, 1, 0.2),
                       Conversation(1, 0, 0, 0.0)]
    m = summarize(b, torch.tensor([1.0, 1.0, 0.0, 1.0]))
    assert m["eval/turns"] == pytest.approx(7 / 4) and m["eval/tool_use"] == pytest.approx(2 / 4)
    assert m["eval/correct_with_tool"] == pytest.approx(1 / 3)
    b.conversations = None
    assert "eval/turns" not in summarize(b, torch.tensor([1.0, 1.0, 0.0, 1.0]))

def test_metrics_file_console_and_plot(tmp_path):
    log = MetricsLog(tmp_path, {"a": 1})
    t = PhaseTimer()
    for step in range(1, 4):
        with t("generate"):
            pass
        log.log(step, {"reward/mean": 0.1 * step, "train_rollout_logprob_abs_diff": torch.tensor(1e-6),
                       **t.metrics(), "time/step": 0.5})
    log.log(3, {"eval/accuracy": 0.5})
    log.close()
    rows = read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 3] and rows[0]["train_rollout_logprob_abs_diff"] == pytest.approx(1e-6)
    line = console_line(3, 10, {**rows[2], **rows[3]})
    assert "step 3/10" in line and "reward 0.300" in line and "eval acc 0.500" in line
    png = plot(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png.stat().st_size > 10_000


def test_summary_names_the_held_out_gain_the_reward_and_the_time():
    rows = [{"step": 0, "eval/accuracy": 0.25}, *({"step": s, "reward/mean": 0.1 * s} for s in range(1, 11)),
            {"step": 10, "eval/accuracy": 0.5}]
    lines = summary(rows, 125.0, warm_started=True)
    assert lines == ["held-out accuracy 0.25 after the warm-start -> 0.50 at step 10 (+25 points)",
                     "train reward 0.30 -> 0.80 (mean of the first and last 5 steps)", "10 steps in 2 min 5 s"]
    # Without a warm-start, or with a first eval after step 0, the line says when the first eval was.
    assert summary(rows, 1.0)[0].startswith("held-out accuracy 0.25 at step 0 ->")
    two_sets = [{"step": 5, "eval/a/accuracy": 0.5, "eval/b/accuracy": 0.1}, {"step": 9, "eval/a/accuracy": 0.25}]
    assert summary(two_sets, 1.0, warm_started=True)[0] == \
        "held-out accuracy (a) 0.50 at step 5 -> 0.25 at step 9 (-25 points)"
    assert summary(two_sets, 1.0)[1] == "9 steps in 0 min 1 s"  # one eval of set b: no line for it
