"""rollout.backend=transformers on the tiny DeepSeek-V4: sampled logprobs equal the Megatron
actor's re-scoring, and a weight sync from the actor (official names) lands in the sampler."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4")

from colocate_rl.config import Config, ModelConfig  # noqa: E402
from colocate_rl.types import Sample  # noqa: E402


def test_transformers_rollout_matches_actor_and_takes_synced_weights(tiny_model):
    from colocate_rl.plan import resolve
    from colocate_rl.rollout.hf_generate import TransformersRollout

    path = tiny_model("deepseek-v4-tiny")
    cfg = Config(model=ModelConfig(path=str(path), dtype="float32"))
    cfg.rollout.backend, cfg.rollout.n, cfg.rollout.max_response_tokens = "transformers", 3, 6
    cfg.actor.lr = 1e-2
    build = resolve(cfg).build()
    rollout, actor = build.make_rollout(), build.make_actor()
    assert isinstance(rollout, TransformersRollout)
    prompts = [Sample([5, 17, 40, 9]), Sample([33, 2, 8])]
    batch = rollout.generate(prompts, seed=7)
    assert batch.size == 6 and torch.equal(batch.group_ids, torch.tensor([0, 0, 0, 1, 1, 1]))
    assert batch.response_lens.min() >= 1
    again = rollout.generate(prompts, seed=7)
    assert torch.equal(again.tokens, batch.tokens)  # seeded sampling is reproducible
    actor_lp = actor.compute_logprobs(batch)
    diff = ((actor_lp - batch.rollout_logprobs) * batch.loss_mask).abs().max().item()
    assert diff <= 1e-4, f"rollout vs actor logprob {diff}"

    # one GRPO step, then sync: the sampler scores with the new weights
    batch.advantages = torch.tensor([1.0, -1.0, 0.0] * 2)
    actor.train_step(batch, actor_lp)
    names = ["layers.0.attn.wq_b.weight", "layers.1.ffn.experts.2.w3.weight", "hc_head_fn"]
    before = rollout.checksum(names)
    stats = rollout.update_weights(actor.export_hf_weights())
    assert stats.bytes > 0
    after = rollout.checksum(names)
    exported = {n: t for n, t in actor.export_hf_weights() if n in names}
    from colocate_rl.weight_sync.verify import tensor_checksum

    for n in names:
        assert after[n] == pytest.approx(tensor_checksum(exported[n]), rel=1e-12) and after[n] != before[n], n
    rescored = rollout.generate(prompts, seed=7)
    new_lp = actor.compute_logprobs(rescored)
    assert ((new_lp - rescored.rollout_logprobs) * rescored.loss_mask).abs().max() <= 1e-4
