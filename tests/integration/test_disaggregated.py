"""The disaggregated mode on CPU through Ray: one actor process and two vLLM engines in their own
Ray actors, on two placement groups, weights broadcast over gloo. One session is shared by the
tests of this module (Ray and three engine-importing processes start once)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import psutil
import pytest

from colocate_rl import loop
from colocate_rl.rollout.buffer import load_rollout_fn
from colocate_rl.session import start_session

from test_loop import planned, tiny_cfg  # noqa: E402 - same folder

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # Ray start and three processes importing vLLM / megatron-core: ~60 s for the module


def test_recipe_runs_disaggregated_one_step_off_policy(tmp_path, tiny_model, even_length_reward):
    """loop.run on the tiny recipe with placement.mode=disaggregated (plus shortening and the
    off-policy switch). First in the module: it owns its Ray instance, then the shared one starts."""
    over = {"placement.mode": "disaggregated", "rollout.off_policy": "true", "reward.name": "test_even_length",
            "steps": "3", "sft.steps": "2", "eval.every": "3", "eval.sets": "[arithmetic]", "checkpoint.every": "2"}
    try:
        out = loop.run(*planned(tiny_cfg(tmp_path, tiny_model, **over)))
    finally:
        ray.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/staleness" in r]
    assert out["steps"] == 3 and [r["rollout/staleness"] for r in steps] == [0, 1, 1]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    assert all(r["rollout/engine_restarts"] == 0 for r in steps)
    ckpts = sorted(p.name for p in (tmp_path / "t" / "checkpoints").iterdir())
    assert ckpts == ["step_00000002", "step_00000003"], ckpts  # every 2 steps, and at the end

    # The same run extended by one step resumes from step 3 (actor restored, weights broadcast).
    try:
        out = loop.run(*planned(tiny_cfg(tmp_path, tiny_model, **{**over, "steps": "4"})))
    finally:
        ray.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert out["steps"] == 4 and [r["step"] for r in rows] == [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def session(tmp_path_factory, tiny_model, even_length_reward):
    cfg = tiny_cfg(tmp_path_factory.mktemp("disagg"), tiny_model, **{
        "placement.mode": "disaggregated", "rollout.num_engines": "2", "actor.lr": "1e-3",
        "reward.name": "test_even_length", "sync.verify_every": "1", "sync.bucket_mb": "1",
        "rollout.max_model_len": "160"})
    s = start_session(*planned(cfg))
    yield s
    s.close()
    ray.shutdown()


def run_steps(s, k: int, off_policy: bool = False):
    """Yields the metrics of k steps run as loop.run runs them: none requested ahead at the end."""
    s.plan.scheduling = replace(s.plan.scheduling, off_policy=off_policy)
    for i in range(k):
        yield loop.step(s, last=i == k - 1)


def actor_checksums(s) -> dict[str, float]:
    return s.actor.weight_checksums()


def test_every_engine_holds_the_actors_weights_after_each_sync(session):
    s, w = session, session.workers
    assert len(w.hosts) == 2 and w.fp8 == {}  # a bf16/fp32 engine: nothing quantized on the way
    before = actor_checksums(s)
    for m in run_steps(s, 2):
        assert m["rollout/staleness"] == 0 and m["rollout/engine_restarts"] == 0
        assert m["train_rollout_logprob_abs_diff"] <= 1e-4  # on-policy: sampler and trainer hold the same weights
        assert m["grad_norm"] > 0 and m["sync/bytes"] > 0
        actor = actor_checksums(s)
        assert len(actor) >= 3
        for e, engine in enumerate(w.engine_checksums(list(actor))):
            for name, value in actor.items():
                assert engine[name] == pytest.approx(value, rel=1e-12, abs=1e-9), (e, name)
        assert actor != before, "the step changed the weights"
        before = actor
    # Every member on this one node: the group's store (actor rank 0's) listens on loopback only, and
    # the group's name is 128 random bits.
    rank0 = w.processes()["ranks"][0]
    addr, port, name = rank0["broadcast"]
    assert addr == rank0["env"]["MASTER_ADDR"] == "127.0.0.1" and re.fullmatch(r"weights-[0-9a-f]{32}", name)
    assert [c.laddr.ip for c in psutil.Process(rank0["pid"]).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port] == ["127.0.0.1"]


def test_router_keeps_each_prompt_group_on_one_engine(session):
    s = session
    samples = s.train_samples[:10]
    pending = s.workers.rollout.router.submit(samples, n=3)
    batch = pending.result()
    assert set(pending.engine_of.values()) == {0, 1}, "the load was spread over both engines"
    assert batch.size == 30 and batch.group_ids.tolist() == [i // 3 for i in range(30)]
    for i, sample in enumerate(samples):  # rows in prompt order, each group whole
        assert all(batch.samples[3 * i + k] is sample or batch.samples[3 * i + k].prompt_ids == sample.prompt_ids
                   for k in range(3))


def test_one_step_off_policy_reports_staleness_and_corrects(session):
    s = session
    ms = list(run_steps(s, 3, off_policy=True))
    assert [m["rollout/staleness"] for m in ms] == [0, 1, 1]
    # Samples of the previous weights: the sampler's logprobs differ from the trainer's, and the
    # token IS weights are in play (they are 1 when the two agree).
    assert ms[1]["train_rollout_logprob_abs_diff"] > 1e-4
    assert "is_clamped_frac" in ms[1]
    s.workers.verify()  # engines equal the actor after the last sync


def test_custom_rollout_function_produces_the_batch(session):
    s, w = session, session.workers
    s.buffer.rollout_fn = load_rollout_fn("rollout_fns:hinted_two_passes")
    try:
        s.buffer.request(s.train_samples[:6], s.handoff.version)
        got = s.buffer.get()
    finally:
        s.buffer.rollout_fn = None
    b = got.batch
    assert b.size == 6 * s.cfg.rollout.n and got.version == s.handoff.version
    assert (b.tokens[:, 0] == 7).all(), "every prompt got the injected token"
    assert b.response_lens[: 3 * s.cfg.rollout.n].max() <= s.cfg.rollout.max_response_tokens
    assert b.group_ids.tolist() == [i // s.cfg.rollout.n for i in range(b.size)]
    with pytest.raises(ValueError, match=r"rollout.custom_fn='rollout_fns:nope': module 'rollout_fns' has no 'nope'"):
        load_rollout_fn("rollout_fns:nope")


def test_engine_lost_under_its_prompts_is_restarted_resynced_and_its_prompts_reissued(session):
    """The engine is dead when the router hands it its share (killed first, not on a timer): the
    router finds out from that share's result, replaces the engine, re-syncs it and re-issues them."""
    s, w = session, session.workers
    samples = s.train_samples[:16]
    w.kill_engine(0)
    pending = w.rollout.router.submit(samples, n=4, max_tokens=40)
    batch = pending.result()
    assert pending.metrics["rollout/engine_restarts"] == 1 and pending.metrics["rollout/reissued_prompts"] > 0
    assert batch.size == 64 and [s_.prompt_ids for s_ in batch.samples[::4]] == [x.prompt_ids for x in samples]
    assert w.verify() >= 3, "the new engine got the actor's weights"
    m = next(iter(list(run_steps(s, 1))))  # the broadcast group is formed again with the new engine
    assert m["rollout/engine_restarts"] == 0
    w.verify()


def test_engine_killed_while_idle_is_replaced_before_the_sync(session):
    s, w = session, session.workers
    w.rollout.router.take_counts()
    w.kill_engine(1)  # between generations: the sync finds it, not the router
    stats = w.sync()
    assert stats.bytes > 0 and w.rollout.router.take_counts()["rollout/engine_restarts"] == 1
    assert w.verify() >= 3
