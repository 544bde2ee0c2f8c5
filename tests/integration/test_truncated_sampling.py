"""Truncated sampling (rollout.top_p < 1, rollout.top_k > 0) on a real vLLM (CPU, in-process) and a
real megatron-core actor holding the same fp32 weights: the actor scores the distribution vLLM
sampled from, so every token's IS weight exp(actor - rollout) is 1 within fp32 rounding (1e-6),
where the untruncated logprobs miss by the log of the kept mass. trainer.logprobs.sampler_support
keeps exactly the tokens vLLM's own filter keeps, ties included; two tensor-parallel ranks, each
holding half the vocabulary, score and train as one does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from colocate_rl.config import Config, ModelConfig
from colocate_rl.trainer.logprobs import sampler_support
from colocate_rl.types import Sample

from batches import build_actor, build_engine, step_view, synthetic_batch

PROMPTS = ["1+2=", "What is 7+8?", "Answer: 4", "user\n3*4="]
TEMPERATURE = 0.7  # the filter runs on the logits after the temperature: not 1, so that order is tested
LENS = [12, 9, 11, 6, 10, 7, 12, 5]  # tokens per row of the synthetic batch (4 prompts x 2 samples)


@pytest.fixture(scope="module")
def sides(tiny_model):
    """(engine, actor, samples) on one fp32 tiny Qwen3; the actor's learning rate is 0, so a train
    step computes its loss and gradients and leaves the weights equal to the engine's."""
    cfg = Config()
    cfg.model.path, cfg.model.dtype = str(tiny_model("qwen3-tiny")), "float32"
    cfg.data.max_prompt_tokens = 32
    cfg.rollout.n, cfg.rollout.max_response_tokens, cfg.rollout.kv_cache_memory_mb = 4, 24, 64
    cfg.rollout.temperature = TEMPERATURE
    cfg.actor.lr = 0.0
    engine = build_engine(cfg, multiprocess=False)
    actor = build_actor(cfg)
    samples = [Sample(prompt_ids=engine.tokenizer.encode(p), prompt_text=p, label="") for p in PROMPTS]
    yield engine, actor, samples
    engine.shutdown()


def sample(engine, actor, samples, top_p: float, top_k: int):
    """A batch drawn at (top_p, top_k), both sides set to them (the run's rollout section would)."""
    engine.sampling = actor.sampling = dataclasses.replace(engine.sampling, top_p=top_p, top_k=top_k)
    assert actor.sampling.truncated
    return engine.generate(samples, seed=7)


@pytest.mark.parametrize("top_p, top_k", [(0.8, 0), (1.0, 20), (0.7, 50)])
def test_an_unchanged_policy_has_is_weights_of_one(sides, top_p, top_k):
    engine, actor, samples = sides
    batch = sample(engine, actor, samples, top_p, top_k)
    mask = batch.loss_mask
    assert mask.sum() > 100

    gap = (actor.compute_logprobs(batch) - batch.rollout_logprobs)[mask]
    assert float((gap.exp() - 1).abs().max()) <= 1e-6

    # The training forward (the loss's own logprobs, with their gradient) scores the same.
    batch.advantages = torch.linspace(-1, 1, batch.size)
    m = actor.train_step(batch)
    assert m["train_rollout_logprob_abs_diff_max"] <= 1e-6 and abs(m["is_weight_max"] - 1) <= 1e-6
    assert m["update_skipped"] == 0 and 0 < m["grad_norm"] < float("inf")

    # Without the correction the actor scores the whole distribution: every token's logprob is
    # lower by the log of the mass the filter kept, far outside the tolerance above.
    actor.sampling = dataclasses.replace(actor.sampling, top_p=1.0, top_k=0)
    untruncated = (actor.compute_logprobs(batch) - batch.rollout_logprobs)[mask]
    assert float(untruncated.max()) < 1e-6 and float(untruncated.mean()) < -0.05


def test_the_support_is_vllms_own_filter():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p  # what the CPU sampler calls

    g = torch.Generator().manual_seed(0)
    # Logits on a coarse grid: many exact ties, at the top-k and the top-p boundaries too.
    x = (torch.randint(-12, 12, (64, 320), generator=g).float() / 4) / torch.full((1,), TEMPERATURE)
    ties = 0
    for top_p, top_k in [(0.8, 0), (0.5, 0), (1.0, 20), (0.7, 50), (0.95, 5), (0.3, 300)]:
        k = torch.full((64,), top_k, dtype=torch.int32) if top_k else None
        p = torch.full((64,), top_p, dtype=torch.float32) if top_p < 1 else None
        vllm_keeps = apply_top_k_top_p(x.clone(), k, p).isfinite()
        ours = sampler_support(x, top_k, top_p)
        assert torch.equal(ours, vllm_keeps), (top_p, top_k)
        # Rows where the filter split a group of equal logits (kept some, dropped others).
        kept_min = torch.where(ours, x, float("inf")).amin(-1, keepdim=True)
        ties += int(((x == kept_min) & ~ours).any(-1).sum())
    assert ties > 50  # the comparison covers ties cut at the boundary, not only clear cuts


def truncated_step_view(path: str, tp: int) -> dict:
    """batches.step_view of an fp32 actor at actor.tp=tp sampling at top_p 0.8 after top_k 50, and
    its untruncated logprobs of the same batch before the step ("full")."""
    cfg = Config(model=ModelConfig(path=path, dtype="float32"))
    cfg.actor.tp, cfg.actor.lr, cfg.actor.micro_batch_size = tp, 1e-3, 2
    cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k = TEMPERATURE, 0.8, 50
    actor = build_actor(cfg)
    truncated = actor.sampling
    actor.sampling = dataclasses.replace(truncated, top_p=1.0, top_k=0)
    full = actor.compute_logprobs(synthetic_batch(LENS, seed=1))
    actor.sampling = truncated
    return {**step_view(actor, LENS), "full": full}


# Slow: one spawn of two fresh processes importing torch + megatron-core (~15-25 s on 2 cores).
@pytest.mark.slow
def test_tensor_parallel_ranks_filter_the_whole_vocabulary(tiny_model):
    """Each rank holds half the vocabulary: the filter runs on the rows gathered whole, so two ranks
    score and train as one does."""
    from colocate_rl.trainer import run_on_ranks

    path = str(tiny_model("qwen3-small"))
    par, ref = run_on_ranks(truncated_step_view, 2, path, 2), truncated_step_view(path, 1)
    for key in ("before", "after"):
        assert (par[key] - ref[key]).abs().max().item() <= 1e-5, key
    assert par["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    assert par["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    mask = synthetic_batch(LENS, seed=1).loss_mask
    assert (ref["before"] - ref["full"])[mask].min() > 0.1  # the filter cut every position
