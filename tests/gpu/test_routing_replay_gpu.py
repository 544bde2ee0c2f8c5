"""R3 on a GPU (vLLM 0.26's GPU build, which returns routed experts; its CPU build cannot):

- a Qwen3-MoE engine with rollout.routing_replay returns, for every row, the experts each token
  went to, in RolloutBatch.routed_experts' layout: transformers' routers, run on the same tokens in
  fp32, pick the same experts at almost every position (a shift by one position would agree by
  chance only, ~1 in 6 for 2 of 4 experts);
- a GRPO step through the colocated loop replays them, and on a batch sampled after it the actor's
  logprobs are at least as close to vLLM's with the replay as without (bf16, where the two sides'
  routers disagree more often).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM's GPU build (its CPU build cannot return routed experts)")
pytest.importorskip("megatron.core", reason="the loop needs megatron-core")

from colocate_rl import loop  # noqa: E402
from colocate_rl.session import start_session  # noqa: E402
from colocate_rl.types import Sample  # noqa: E402

from batches import build_engine  # noqa: E402
from gpu_runs import planned, run_cfg  # noqa: E402 - same folder

SHAPE = "qwen3-moe-tiny"  # 2 MoE layers, 4 experts, top-2


def hf_choices(path, batch) -> torch.Tensor:
    """[B, T, L, 2] the experts transformers' Qwen3-MoE routers pick for the batch's tokens (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    logits = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: logits.append(out[0] if isinstance(out, tuple) else out))
             for name, m in model.named_modules() if name.endswith("mlp.gate")]
    with torch.no_grad():
        model(input_ids=batch.tokens.cuda(), attention_mask=batch.attention_mask.long().cuda())
    for h in hooks:
        h.remove()
    b, t = batch.tokens.shape
    return torch.stack([lg.float().view(b, t, -1).topk(2, dim=-1).indices.sort(-1).values for lg in logits], 2).cpu()


def test_engine_returns_the_experts_of_each_token(tiny_model):
    from colocate_rl.config import Config

    path = tiny_model(SHAPE)
    cfg = Config()
    cfg.model.path, cfg.model.dtype = str(path), "float32"
    cfg.data.max_prompt_tokens, cfg.rollout.max_response_tokens, cfg.rollout.n = 32, 12, 3
    cfg.rollout.multiprocess = cfg.rollout.enforce_eager = cfg.rollout.routing_replay = True
    cfg.rollout.gpu_memory_utilization, cfg.rollout.kv_cache_memory_mb = 0.1, 256
    eng = build_engine(cfg)
    try:
        prompts = ["1+2=", "What is 7+8?", "Answer: 4", "user\n3*4="]
        batch = eng.generate([Sample(prompt_ids=eng.tokenizer.encode(p)) for p in prompts], seed=1)
    finally:
        eng.shutdown()
    r = batch.routed_experts
    assert r is not None and r.dtype == torch.uint8 and r.shape == (*batch.tokens.shape, 2, 2)
    lens = batch.attention_mask.sum(1)
    routed = torch.arange(r.shape[1]) < (lens - 1)[:, None]  # every token the engine ran on
    ids = r.long().sort(-1).values
    assert (ids[routed] < 4).all() and (ids[routed][..., 0] != ids[routed][..., 1]).all()
    assert (r[~routed] == 0).all()  # the last sampled token (never run) and padding
    agree = (ids == hf_choices(path, batch)).all(-1)[routed].float().mean().item()
    assert agree >= 0.9, f"vLLM's and transformers' experts agree on {agree:.1%} of the tokens"


def session_cfg(tmp_path, model):
    return run_cfg("qwen3_moe_grpo", tmp_path, model, **{"logging.run_name": "r3", "rollout.routing_replay": "true"})


def test_grpo_step_replays_and_replay_narrows_the_logprob_gap(tmp_path, tiny_model):
    s = start_session(*planned(session_cfg(tmp_path, tiny_model(SHAPE, dtype="bfloat16"))))
    try:
        m = loop.step(s)
        s.step = 1
        assert m["update_skipped"] == 0 and m["grad_norm"] > 0 and m["sync/bytes"] > 0, m
        assert m["train_rollout_logprob_abs_diff"] < 0.1, m["train_rollout_logprob_abs_diff"]

        batch = s.rollout.generate(s.train_samples[:16], seed=7)  # on the weights after the step
        assert batch.routed_experts is not None
        own = batch.select(torch.arange(batch.size))
        own.routed_experts = torch.zeros_like(batch.routed_experts)  # no routing: each router picks
        with s.handoff.actor_owned(changes_weights=False):
            replayed, plain = s.actor.compute_logprobs(batch), s.actor.compute_logprobs(own)
        mask = batch.loss_mask
        gap = {k: float((lp - batch.rollout_logprobs)[mask].abs().mean()) for k, lp in
               (("replay", replayed), ("plain", plain))}
        print(f"logprob gap after one step, replayed vs own routing: {gap}")
        assert gap["replay"] <= gap["plain"], gap
    finally:
        s.close()
