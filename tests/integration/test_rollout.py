"""RolloutEngine on a real vLLM (CPU, in-process engine): the batch contract and logprobs vs HF.

Cross-process weight sync (multiprocess engine) is in test_weight_sync.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from colocate_rl.config import Config
from colocate_rl.types import Sample

from batches import build_engine

PROMPTS = ["1+2=", "What is 7+8?", "Answer: 4", "user\n3*4="]


def make_cfg(path, dtype: str = "float32") -> Config:
    cfg = Config()
    cfg.model.path = str(path)
    cfg.model.dtype = dtype
    cfg.data.max_prompt_tokens = 32
    cfg.rollout.max_response_tokens = 12
    cfg.rollout.n = 3
    cfg.rollout.kv_cache_memory_mb = 64
    return cfg


def hf_logprobs(model, batch) -> torch.Tensor:
    """[B, T] log p(tokens[t] | tokens[:t]) from a plain transformers forward; 0 at t = 0."""
    with torch.no_grad():
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask.long()).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))


def max_diff(model, batch) -> float:
    return float((hf_logprobs(model, batch) - batch.rollout_logprobs)[batch.loss_mask].abs().max())


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = build_engine(make_cfg(tiny_model("qwen3-tiny")), multiprocess=False)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def samples(engine):
    return [Sample(prompt_ids=engine.tokenizer.encode(p), prompt_text=p, label=str(i)) for i, p in enumerate(PROMPTS)]


def _check_contract(engine, samples, b, n: int, max_tokens: int) -> tuple[int, int]:
    """Asserts the RolloutBatch contract row by row; returns (rows stopped at EOS, rows truncated)."""
    assert b.size == len(samples) * n and b.n_per_group == n
    assert torch.equal(b.group_ids, torch.arange(len(samples)).repeat_interleave(n))
    assert b.tokens.dtype == torch.long and b.rollout_logprobs.dtype == torch.float32
    assert b.tokens.shape[1] == int((b.prompt_lens + b.response_lens).max())
    stopped = 0
    for k in range(b.size):
        s = samples[k // n]
        p, q = int(b.prompt_lens[k]), int(b.response_lens[k])
        assert b.samples[k] is s and p == len(s.prompt_ids)
        assert b.tokens[k, :p].tolist() == s.prompt_ids
        assert b.attention_mask[k].tolist() == [True] * (p + q) + [False] * (b.tokens.shape[1] - p - q)
        assert b.loss_mask[k].nonzero().flatten().tolist() == list(range(p, p + q))
        assert (b.tokens[k, p + q :] == engine.pad_id).all(), "right padding with the tokenizer's pad id"
        assert (b.rollout_logprobs[k][~b.loss_mask[k]] == 0).all() and (b.rollout_logprobs[k, p : p + q] < 0).all()
        assert bool(b.truncated[k]) == (b.finish_reasons[k] == "length")
        response = b.tokens[k, p : p + q].tolist()
        if b.truncated[k]:
            assert q == max_tokens or p + q == engine.max_model_len, "cut by max_tokens or by the context"
        else:
            assert b.finish_reasons[k] == "stop" and response[-1] in engine.eos_ids, "EOS ends the row and is kept"
            stopped += 1
        assert b.responses[k] == engine.tokenizer.decode(response, skip_special_tokens=True)
    return stopped, int(b.truncated.sum())


def test_batch_contract(engine, samples):
    assert engine.eos_ids == [engine.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    # A random tiny model emits EOS about once per vocabulary size of tokens: 32 rows of up to 40
    # tokens stop a few times per batch; a few seeds make a batch with both kinds near certain.
    n, max_tokens = 8, 40
    kinds = set()
    for seed in range(5):
        batch = engine.generate(samples, n=n, max_tokens=max_tokens, seed=seed)
        stopped, truncated = _check_contract(engine, samples, batch, n, max_tokens)
        kinds |= ({"stop"} if stopped else set()) | ({"length"} if truncated else set())
        if kinds == {"stop", "length"}:
            break
    assert kinds == {"stop", "length"}, f"five batches gave only {kinds}"


def test_logprobs_match_hf_fp32(engine, samples, tiny_model):
    from transformers import AutoModelForCausalLM

    b = engine.generate(samples, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3-tiny"), dtype=torch.float32)
    assert max_diff(hf, b) <= 1e-4


def test_prefill_logprobs_score_every_token_as_transformers_does(engine, samples, tiny_model):
    """The sampler's own forward over whole rows: prompt tokens included, fp32, temperature 1."""
    from transformers import AutoModelForCausalLM

    b = engine.generate(samples, seed=4)
    prefill = engine.prefill_logprobs(b)
    scored = b.attention_mask.clone()
    scored[:, 0] = False
    assert prefill.shape == b.tokens.shape and (prefill[~scored] == 0).all()
    hf = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3-tiny"), dtype=torch.float32)
    assert float((prefill - hf_logprobs(hf, b))[scored].abs().max()) <= 1e-4
    assert float((prefill - b.rollout_logprobs)[b.loss_mask].abs().max()) <= 1e-4


def test_seed_reproduces_a_batch(engine, samples):
    a = engine.generate(samples[:2], seed=5)
    b = engine.generate(samples[:2], seed=5)
    c = engine.generate(samples[:2], seed=6)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert not torch.equal(a.tokens, c.tokens)
    # The n samples of a prompt differ from each other (vLLM seeds child k with seed + k).
    assert len({tuple(r) for r in a.tokens[:3].tolist()}) > 1


def test_sleep_is_a_logged_no_op_on_cpu(engine, samples):
    assert engine.supports_sleep is False
    before = engine.generate(samples[:1], n=1, temperature=0.0)
    engine.sleep()
    engine.wake(["weights"])
    engine.wake(["kv_cache"])
    after = engine.generate(samples[:1], n=1, temperature=0.0)
    assert torch.equal(before.tokens, after.tokens)


def _perturbed(path, out_dir, seed: int):
    """HF model with noise added, and its tensors in checkpoint names/layout (what the actor sends)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    hf.save_pretrained(out_dir)
    return hf, load_file(os.path.join(out_dir, "model.safetensors"))


def test_update_weights_in_process(engine, samples, tiny_model, tmp_path):
    """The same sync as test_weight_sync.py without the process boundary; many small buckets, so
    fused q/k/v and gate/up groups are split across buckets."""
    assert engine.workers_in_process
    hf, tensors = _perturbed(tiny_model("qwen3-tiny"), tmp_path, seed=7)
    assert max_diff(hf, engine.generate(samples, seed=1)) > 0.05, "control: the engine still has the old weights"
    stats = engine.update_weights(tensors.items(), bucket_mb=0.05)
    assert stats.buckets >= 5 and stats.bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert max_diff(hf, engine.generate(samples, seed=1)) <= 1e-4


def test_sync_failing_midway_is_aborted(engine, samples, tiny_model, tmp_path):
    """A bad tensor in a later bucket: the sync stops with an error naming it, the engine keeps
    serving, and the next full sync is exact."""
    from colocate_rl.weight_sync import WeightSyncError

    hf, tensors = _perturbed(tiny_model("qwen3-tiny"), tmp_path, seed=8)
    items = list(tensors.items())
    half = len(items) // 2
    bad = items[:half] + [("model.layers.1.mlp.up_proj.weight", torch.zeros(3, 3))] + items[half:]
    with pytest.raises(WeightSyncError, match=r"model.layers.1.mlp.up_proj.weight.*\(3, 3\)"):
        engine.update_weights(bad, bucket_mb=0.05)
    b = engine.generate(samples, seed=1)
    assert torch.isfinite(b.rollout_logprobs).all() and b.response_lens.min() > 0
    engine.update_weights(tensors.items(), bucket_mb=0.05)
    assert max_diff(hf, engine.generate(samples, seed=1)) <= 1e-4
