"""Exact on-policy mode on a GPU (rollout.exact, models/exact.py), Qwen3-0.6B shape in bf16:

- the actor's forward equals vLLM's own forward over the same sequences (its prefill, read back as
  prompt logprobs), bit for bit: every kernel is vLLM's, op for op; also for a small Qwen3-MoE, whose
  blocks run vLLM's top-k and fused experts;
- the exact forward's gradients are autograd's (the default model's, within bf16 rounding);
- the actor's logprobs equal the sampler's on every token of every step, so every IS weight is
  exactly 1: the scoring pass and the training forward, at T=1 and at T=0.9, for the MoE shape
  with routing replay, and at TP=2 on two GPUs. The batch (32 sequences) decodes in launches of
  fewer than 256 tokens and is scored in larger ones: the two sides of vLLM's fused residual norm's
  block-width switch (rollout/invariant_norm.py). Dense models sample on vLLM's V2 model runner,
  the MoE shape with R3 on V1: each with its own logprob kernels.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if torch.version.hip is not None or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("rollout.exact runs FlashAttention 3 as vLLM does (NVIDIA, compute capability >= 8.0)",
                allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM's GPU build")
pytest.importorskip("megatron.core", reason="the actor needs megatron-core")

from colocate_rl import loop  # noqa: E402
from colocate_rl.config import Config, ModelConfig  # noqa: E402
from colocate_rl.session import start_session  # noqa: E402

from batches import build_actor, synthetic_batch  # noqa: E402
from gpu_runs import planned, run_cfg  # noqa: E402 - same folder

SHAPE = "qwen3-0.6b"  # head_dim 128: a FlashAttention 3 size


def session_cfg(tmp_path, model, **over: str):
    return run_cfg("qwen3_grpo", tmp_path, model, **{
        "logging.run_name": "exact", "data.prompts_per_step": "32", "rollout.max_response_tokens": "96",
        "rollout.temperature": "0.9", "rollout.kv_cache_memory_mb": "4096", "rollout.exact": "true",
        "actor.micro_batch_size": "8", "actor.lr": "1e-5", **over})


@pytest.mark.parametrize("shape", [SHAPE, "qwen3-moe-small"])
def test_actor_forward_is_vllms_forward(tmp_path, tiny_model, shape):
    cfg = session_cfg(tmp_path, tiny_model(shape, dtype="bfloat16"))
    cfg.rollout.temperature = 1.0  # vLLM's prompt logprobs are the model's own (no temperature)
    s = start_session(*planned(cfg))
    try:
        batch = s.rollout.generate(s.train_samples[:8], seed=3)
        with s.handoff.actor_owned(changes_weights=False):
            actor = s.actor.compute_logprobs(batch)
        prefill = s.rollout.prefill_logprobs(batch)
        scored = batch.attention_mask.clone()
        scored[:, 0] = False  # the first token has no logprob
        gap = (actor - prefill)[scored].abs()
        print(f"{shape}: actor vs vLLM's prefill, max {float(gap.max()):.3g} over {gap.numel()} tokens", flush=True)
        assert gap.numel() > 500 and float(gap.max()) == 0.0, (gap.numel(), float(gap.mean()), float(gap.max()))
    finally:
        s.close()


@pytest.mark.parametrize("shape,temperature,r3", [(SHAPE, 1.0, False), (SHAPE, 0.9, False),
                                                  ("qwen3-moe-small", 1.0, True)])
def test_actor_logprobs_equal_the_samplers_bit_for_bit(tmp_path, tiny_model, shape, temperature, r3):
    """The scoring pass (compute_logprobs) and the training forward of each step, against the
    logprobs vLLM sampled with: both are printed before either is asserted, so that a failure says
    which of the two differs. The MoE shape with routing replay (R3) too: the actor routes each token
    to the experts the sampler chose."""
    cfg = session_cfg(tmp_path, tiny_model(shape, dtype="bfloat16"))
    cfg.rollout.temperature, cfg.rollout.routing_replay = temperature, r3
    s = start_session(*planned(cfg))
    try:
        batch = s.rollout.generate(s.train_samples[:8], seed=5)
        with s.handoff.actor_owned(changes_weights=False):
            scored = s.actor.compute_logprobs(batch)
        gap = (scored.cpu() - batch.rollout_logprobs)[batch.loss_mask].abs()
        print(f"{shape} T={temperature} scoring pass: gap mean {gap.mean():.3g}, max {gap.max():.3g}, "
              f"{int((gap > 0).sum())} of {gap.numel()} tokens differ", flush=True)
        if temperature == 1.0:  # vLLM's prompt logprobs are the model's own: comparable at T=1 only
            where_it_differs(batch, scored.cpu(), s.rollout.prefill_logprobs(batch))
        steps = []
        for step in range(3):  # the second and third sample from synced weights
            m = loop.step(s)
            s.step = step + 1
            steps.append(m)
            print(f"{shape} T={temperature} step {step}: train_rollout_logprob_abs_diff {m['train_rollout_logprob_abs_diff']:.3g}, "
                  f"IS weight max {m['is_weight_max']:.9g}", flush=True)
        assert gap.numel() > 100 and float(gap.max()) == 0.0, float(gap.max())
        for step, m in enumerate(steps):
            assert m["sync/bytes"] > 0 and m["update_skipped"] == 0 and m["rollout/response_len"] > 8, m
            assert m["train_rollout_logprob_abs_diff"] == 0.0, (step, m["train_rollout_logprob_abs_diff"])
            assert m["is_weight_max"] == 1.0 and m["is_weight_mean"] == 1.0, m
    finally:
        s.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs on one host")
def test_exact_at_tp2_on_two_gpus(tmp_path, tiny_model):
    """The actor at TP=2 (two Ray ranks) and vLLM at TP=2 on the same two cards: each row-parallel
    linear sums two partial products, which rounds the same whichever side adds them, so the gap
    stays 0.0 on every token of every step."""
    pytest.importorskip("ray", reason="the two actor ranks run as Ray actors")
    cfg = session_cfg(tmp_path, tiny_model(SHAPE, dtype="bfloat16"), **{
        "actor.tp": "2", "rollout.tensor_parallel_size": "2", "placement.gpus_per_node": "2",
        "placement.launcher": "ray"})
    s = start_session(*planned(cfg))
    try:
        for step in range(3):  # the second and third sample from synced weights
            m = loop.step(s)
            s.step = step + 1
            print(f"TP=2 step {step}: train_rollout_logprob_abs_diff {m['train_rollout_logprob_abs_diff']:.3g}, "
                  f"IS weight max {m['is_weight_max']:.9g}", flush=True)
            assert m["sync/bytes"] > 0 and m["update_skipped"] == 0 and m["rollout/response_len"] > 8, m
            assert m["train_rollout_logprob_abs_diff"] == 0.0, (step, m["train_rollout_logprob_abs_diff"])
            assert m["is_weight_max"] == 1.0 and m["is_weight_mean"] == 1.0, m
    finally:
        s.close()


def where_it_differs(batch, actor, prefill):
    """Prints which side the gap is on: the actor against vLLM's prefill of the sampled rows, vLLM's
    prefill against its own sampler, and how far into a response the sampler first differs."""
    mask = batch.loss_mask
    for name, a, b in (("actor vs vLLM prefill", actor, prefill), ("vLLM prefill vs vLLM sampler", prefill,
                                                                  batch.rollout_logprobs)):
        d = (a - b)[mask].abs()
        print(f"  {name}: mean {d.mean():.3g}, max {d.max():.3g}, {int((d > 0).sum())} of {d.numel()} differ",
              flush=True)
    first = []
    for i in range(batch.size):
        start, n = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        d = (actor[i, start:start + n] - batch.rollout_logprobs[i, start:start + n]).abs()
        hits = (d > 0).nonzero()
        first.append(int(hits[0]) if len(hits) else n)
    print(f"  first response position where the actor differs from the sampler, per row: {first}", flush=True)


def test_exact_forward_has_autograds_gradients(tiny_model):
    from colocate_rl.models import exact

    path = tiny_model(SHAPE, dtype="bfloat16")
    batch = synthetic_batch([40, 33, 21, 40], prompt_len=6, vocab=151936)

    def grads(exact_mode: bool) -> dict[str, torch.Tensor]:
        cfg = Config(model=ModelConfig(path=str(path), dtype="bfloat16"))
        cfg.rollout.exact = exact_mode
        actor = build_actor(cfg)
        module = actor.model.module
        tokens, mask = batch.tokens.cuda(), batch.loss_mask.cuda()
        positions = torch.arange(tokens.shape[1], device="cuda")[None].expand_as(tokens)
        logits = module(tokens, positions, None)
        lp = exact.token_logprobs(logits, tokens, v2=True)
        (-(lp * mask).sum() / mask.sum()).backward()
        out = {n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).float().clone()
               for n, p in module.named_parameters()}
        del actor, module
        torch.cuda.empty_cache()
        return out

    exact_g, plain_g = grads(True), grads(False)
    assert exact_g.keys() == plain_g.keys() and len(exact_g) > 100
    for name, g in plain_g.items():
        rel = ((exact_g[name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel < 0.05, f"{name}: relative gradient difference {rel:.3g}"
