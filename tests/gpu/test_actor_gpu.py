"""The Megatron actor on a GPU (CUDA or ROCm; local layer spec, no TransformerEngine/apex needed):
logprob parity with transformers, bit-exact HF round trip, offload/onload that frees device memory
and changes nothing, GRPO direction, and TP=2 over NCCL when two GPUs are present."""

from __future__ import annotations

import os

import pytest
import torch

# cuBLAS picks split-K workspaces nondeterministically unless told otherwise (before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from safetensors.torch import load_file  # noqa: E402

from colocate_rl.config import Config, ModelConfig  # noqa: E402
from colocate_rl.types import RolloutBatch  # noqa: E402

from batches import build_actor, synthetic_batch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")

SHAPES = ["qwen3-tiny", "qwen3-tiny-tied", "qwen3-moe-tiny"]


def make_batch(vocab: int = 320) -> RolloutBatch:
    """8 rows (4 prompts x 2 samples), right-padded; advantages +1 / -1."""
    return synthetic_batch([24, 17, 21, 9, 20, 13, 24, 8], prompt_len=4, vocab=vocab)


def make_actor(path, dtype="float32", **actor):
    cfg = Config(model=ModelConfig(path=str(path), dtype=dtype))
    cfg.actor.lr, cfg.actor.micro_batch_size = 1e-3, 3
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    return build_actor(cfg)


def hf_logprobs(path, batch, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).cuda().eval()
    tokens = batch.tokens.cuda()
    with torch.no_grad():
        logits = model(tokens, attention_mask=batch.attention_mask.cuda().long()).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    return (torch.nn.functional.pad(lp, (1, 0)) * batch.attention_mask.cuda()).cpu()


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_logprobs_match_transformers_and_round_trip_is_bit_exact(tiny_model, shape):
    path = tiny_model(shape)
    actor = make_actor(path)
    assert all(p.is_cuda for p in actor.model.module.parameters())
    batch = make_batch()
    lp = actor.compute_logprobs(batch)
    diff = (lp - hf_logprobs(path, batch)).abs().max().item()
    assert diff <= 1e-4, f"{shape}: max |megatron - transformers| = {diff}"
    ckpt = load_file(str(path / "model.safetensors"))
    exported = {n: t.cpu() for n, t in actor.export_hf_weights()}
    assert sorted(exported) == sorted(ckpt)
    assert all(torch.equal(exported[n], t) for n, t in ckpt.items())


@pytest.mark.parametrize("shape", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_bf16_logprobs_close_to_transformers_bf16(tiny_model, shape):
    path = tiny_model(shape)
    batch = make_batch()
    actor = make_actor(path, "bfloat16")
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in actor.model.module.parameters())
    lp = actor.compute_logprobs(batch)
    d = (lp - hf_logprobs(path, batch, torch.bfloat16)).abs()[batch.attention_mask]
    assert d.mean() <= 0.02 and d.max() <= 0.25, (float(d.mean()), float(d.max()))


@pytest.mark.parametrize("shape,dtype", [("qwen3-tiny", "float32"), ("qwen3-moe-tiny", "bfloat16")])
def test_grpo_steps_move_logprobs_by_advantage_sign(tiny_model, shape, dtype):
    actor = make_actor(tiny_model(shape), dtype, num_minibatches=2)
    batch = make_batch()
    start = actor.compute_logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.loss_mask, start, 0)
    for _ in range(3):
        actor.train_step(batch, actor.compute_logprobs(batch))
    m = batch.loss_mask
    moved = ((actor.compute_logprobs(batch) - start) * m).sum(1) / m.sum(1)
    assert (moved[batch.advantages > 0] > 0).all() and (moved[batch.advantages < 0] < 0).all(), moved


@pytest.mark.parametrize("overlap", [False, True], ids=["onload", "overlapped_onload"])
@pytest.mark.parametrize("dtype,distributed_optimizer", [("float32", False), ("bfloat16", True)])
def test_offload_frees_the_device_and_onload_then_step_is_bit_identical(tiny_model, dtype, distributed_optimizer,
                                                                         overlap):
    """overlapped: the optimizer state comes back on a side stream behind the forward and backward
    (actor.overlap_onload); a step that read it before its copies landed would differ."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    path = tiny_model("qwen3-tiny")
    batch = make_batch()

    def step(actor):
        lp = actor.compute_logprobs(batch)
        batch.rollout_logprobs = torch.where(batch.loss_mask, lp, 0)
        return actor.train_step(batch, lp)

    # The math attention kernel has a deterministic backward; the fused ones accumulate atomically.
    with sdpa_kernel(SDPBackend.MATH):
        plain = make_actor(path, dtype, distributed_optimizer=distributed_optimizer)
        step(plain)
        step(plain)
        expected = {n: t.cpu() for n, t in plain.export_hf_weights()}
        del plain
        torch.cuda.empty_cache()

        actor = make_actor(path, dtype, distributed_optimizer=distributed_optimizer, overlap_onload=overlap)
        step(actor)
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        moved, _ = actor.offload(("grads", "optimizer"))
        synced = {n: t.cpu() for n, t in actor.export_hf_weights()}
        moved_params, _ = actor.offload(("params",))
        freed = resident - torch.cuda.memory_allocated()
        assert freed >= 0.95 * (moved + moved_params), (freed, moved, moved_params)
        assert all(p.untyped_storage().nbytes() == 0 for p in actor.model.module.parameters())
        back, _ = actor.onload()
        m = step(actor)
        got = {n: t.cpu() for n, t in actor.export_hf_weights()}
    if overlap:  # the onload returned with the parameters; the optimizer state followed during the step
        assert moved > 0 and back == moved_params and m["onload_prefetch_bytes"] == moved
    else:
        assert back == moved + moved_params and "onload_prefetch_bytes" not in m
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert any(not torch.equal(synced[n], expected[n]) for n in expected)


def _tp2_logprobs(path: str) -> torch.Tensor:
    actor = make_actor(path, tp=2)
    return actor.compute_logprobs(make_batch())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs")
def test_tp2_over_nccl_matches_one_gpu(tiny_model):
    from colocate_rl.trainer import run_on_ranks

    path = str(tiny_model("qwen3-small"))
    one = make_actor(path).compute_logprobs(make_batch())
    two = run_on_ranks(_tp2_logprobs, 2, path)
    assert (two - one).abs().max().item() <= 1e-4
