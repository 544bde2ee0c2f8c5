"""Partial rollouts, colocated, with the real vLLM engine and Megatron actor on a long-tailed tiny
model (colocate_rl/models/long_tail.py): a step stops at data.prompts_per_step complete groups, aborts the rest, and a
later step continues those rows from their tokens. Tokens are counted, never seconds."""

from __future__ import annotations

import pytest
import torch

from colocate_rl import loop
from colocate_rl.models.long_tail import long_tail_model
from colocate_rl.session import start_session

from test_checkpoint import comparable  # noqa: E402 - same folder

from test_loop import planned, tiny_cfg  # noqa: E402

P, N, MAX_TOKENS = 4, 4, 128


@pytest.fixture(scope="module")
def cfg(tmp_path_factory, tiny_model, even_length_reward):
    root = tmp_path_factory.mktemp("partial")
    model = long_tail_model(tiny_model("qwen3-tiny"), root / "long-tail")
    # max_staleness 8: no row is regenerated here (test_partial_buffer.py covers the bound).
    return tiny_cfg(root, lambda shape: model, **{
        "reward.name": "test_even_length", "actor.lr": "1e-3", "data.prompts_per_step": str(P), "rollout.n": str(N),
        "rollout.max_response_tokens": str(MAX_TOKENS), "rollout.partial.enable": "true",
        "rollout.partial.over_sample": "4", "rollout.max_staleness": "8"})


@pytest.fixture(scope="module")
def session(cfg):
    s = start_session(*planned(cfg))
    yield s
    s.close()


def test_a_long_tailed_step_generates_fewer_tokens_than_the_whole_batch(session, trained):
    """Step 1 against generate() of the same prompts with the same seed and weights (what the step
    would run without partial rollouts): the groups both finish are the same, token for token."""
    s = session
    assert s.step == 0
    cursor = s.sampler.state_dict()
    prompts = s.sampler.next_batch(P)
    s.sampler.load_state_dict(cursor)
    whole = s.rollout.generate(prompts, seed=s.plan.sampling.step_seed(0))
    assert whole.truncated.any(), "the long tail: some sample runs to rollout.max_response_tokens"

    m = loop.step(s)
    (batch, version), = trained
    assert m["partial/groups"] >= P and batch.size == m["partial/groups"] * N and version == 0
    assert m["partial/carried"] > 0 and not batch.truncated.any(), "the slow rows were left for later"
    for g in range(batch.size // N):  # a group both have: the same rows (same seeds, same weights)
        rows = batch.select(torch.arange(g * N, (g + 1) * N))
        j = next((j for j, p in enumerate(prompts) if p.prompt_ids == rows.samples[0].prompt_ids), None)
        if j is not None:
            assert torch.equal(rows.tokens, whole.select(torch.arange(j * N, (j + 1) * N)).tokens)
    assert m["partial/tokens"] < int(whole.response_lens.sum()), (m["partial/tokens"], whole.response_lens.tolist())


def test_carried_rows_finish_in_a_later_step_from_their_tokens(session, trained):
    s = session
    if not s.buffer.partial.carried:
        loop.step(s)
    carried = [(g.sample.prompt_ids, list(r.tokens), list(r.logprobs), list(r.versions))
               for g in s.buffer.partial.carried for r in g.rows if r.finish is None and r.tokens]
    assert carried, "a step left unfinished rows with tokens"
    version = s.handoff.version
    found = []
    for _ in range(6):
        m = loop.step(s)
        assert m["partial/regenerated"] == 0
        batch, at = trained[-1]
        for i in range(batch.size):
            p = int(batch.prompt_lens[i])
            row = batch.tokens[i, p: p + int(batch.response_lens[i])].tolist()
            for prompt, prefix, logprobs, versions in carried:
                if batch.samples[i].prompt_ids == prompt and len(row) > len(prefix) and row[:len(prefix)] == prefix:
                    found.append((batch, i, p, prefix, logprobs, versions))
        if found:
            break
    assert found, "a carried row was trained within 6 steps"
    for batch, i, p, prefix, logprobs, versions in found:
        k = len(prefix)
        assert batch.rollout_logprobs[i, p: p + k].tolist() == logprobs, "its earlier tokens' logprobs are kept"
        assert batch.token_versions[i, p: p + k].tolist() == versions and max(versions) < version
        assert int(batch.token_versions[i, p + k]) > max(versions), "continued on newer weights"
        assert batch.loss_mask[i, p: p + int(batch.response_lens[i])].all()
    assert m["partial/finished_carried"] > 0 and m["partial/carried_age_max"] >= 1
    assert m["rollout/staleness_max"] >= 1 and m["grad_norm"] > 0


def in_flight(s) -> list:
    """The groups in flight: each row's tokens, logprobs, ages (versions behind the engines') and finish."""
    return [(list(g.sample.prompt_ids), [(list(r.tokens), list(r.logprobs), [s.handoff.version - v for v in r.versions],
                                         r.finish) for r in g.rows]) for g in s.buffer.partial.carried]


def test_a_resumed_run_continues_the_rows_in_flight(session, cfg):
    """A checkpoint holds the rows in flight: a run resumed from it has the same rows (their tokens,
    logprobs and ages) and its next step is the step the uninterrupted run takes."""
    s = session
    if not s.buffer.partial.carried:
        loop.step(s)
    loop.save(s)
    saved, at = in_flight(s), s.step
    assert any(r[0] for _, rows in saved for r in rows), "rows with tokens are in flight"
    go_on = loop.step(s)
    resumed = start_session(*planned(cfg))
    try:
        loop.resume(resumed)
        assert resumed.step == at and in_flight(resumed) == saved
        again = loop.step(resumed)
    finally:
        resumed.close()
    a, b = comparable([{"step": 0, **go_on}])[0], comparable([{"step": 0, **again}])[0]
    assert a == b and a["partial/finished_carried"] + a["partial/resumed"] > 0, set(a.items()) ^ set(b.items())
