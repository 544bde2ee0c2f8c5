"""The tiny DeepSeek-V4 actor on a GPU: fp32 logprobs equal transformers' deepseek_v4 (rows long
enough for C4 and C128 entries), and a bf16 GRPO step that moves the model the right way with the
frozen routing tables unchanged. The vLLM comparison is benchmarks/gap/dsv4_parity_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from colocate_rl.config import Config, ModelConfig  # noqa: E402
from colocate_rl.types import RolloutBatch  # noqa: E402

from batches import build_actor, synthetic_batch  # noqa: E402

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
              pytest.mark.skipif(not hasattr(__import__("transformers"), "DeepseekV4Config"),
                                 reason="needs transformers with deepseek_v4 (5.23)")]


def make_batch() -> RolloutBatch:
    return synthetic_batch([300, 260, 140, 90], prompt_len=4)


def actor_for(path, dtype):
    cfg = Config(model=ModelConfig(path=str(path), dtype=dtype))
    cfg.actor.lr, cfg.actor.micro_batch_size = 1e-3, 2
    return build_actor(cfg)


def test_fp32_logprobs_match_transformers_and_bf16_step_moves(tiny_model):
    from colocate_rl.models.deepseek_v4.synth import transformers_model

    path = tiny_model("deepseek-v4-tiny")
    batch = make_batch()
    torch.backends.cuda.matmul.allow_tf32 = False
    actor = actor_for(path, "float32")
    lp = actor.compute_logprobs(batch)
    ref = transformers_model(path).cuda()
    want = torch.zeros_like(lp)
    with torch.no_grad():  # row by row, unpadded: transformers' indexer ties depend on the padding
        for i in range(batch.size):
            n = int(batch.attention_mask[i].sum())
            ids = batch.tokens[i: i + 1, :n].cuda()
            logits = ref(ids).logits.float()[0, :-1]
            want[i, 1:n] = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu()
    diff = ((lp - want) * batch.attention_mask).abs().max().item()
    assert diff <= 1e-4, f"max |megatron - transformers| logprob on GPU = {diff}"
    del actor, ref

    actor = actor_for(tiny_model("deepseek-v4-tiny", dtype="bfloat16"), "bfloat16")
    start = actor.compute_logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.loss_mask, start, 0)
    tables = {n: b.clone() for n, b in actor.model.module.named_buffers() if n.endswith(("tid2eid", "expert_bias"))}
    for _ in range(2):
        actor.train_step(batch, actor.compute_logprobs(batch))
    moved = ((actor.compute_logprobs(batch) - start) * batch.loss_mask).sum(1) / batch.loss_mask.sum(1)
    assert (moved[batch.advantages > 0] > 0).all() and (moved[batch.advantages < 0] < 0).all(), moved
    for n, b in actor.model.module.named_buffers():
        if n in tables:
            assert torch.equal(b, tables[n]), n
