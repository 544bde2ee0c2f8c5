"""The KL penalty's reference policy on a GPU: kept on the host (actor.ref_on_device=false), none of
its bytes stay on the device after train_step, and bringing it back costs exactly its bytes;
kept resident, it holds them; both give the same step."""

from __future__ import annotations

import gc
import os

import pytest
import torch

# cuBLAS picks split-K workspaces nondeterministically unless told otherwise (before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from colocate_rl.config import Config, ModelConfig  # noqa: E402

from batches import build_actor, synthetic_batch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


def make_actor(path, dtype: str, kl_coef: float, ref_on_device: bool = False):
    cfg = Config(model=ModelConfig(path=str(path), dtype=dtype))
    cfg.actor.lr, cfg.actor.micro_batch_size, cfg.actor.ref_on_device = 1e-3, 3, ref_on_device
    cfg.algorithm.kl_coef = kl_coef
    return build_actor(cfg)


def allocated() -> int:
    gc.collect()  # an earlier actor's reference cycles (its config holds its DDP's no_sync)
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_on_host_leaves_the_device_after_train_step(tiny_model, dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    path = tiny_model("qwen3-small")
    grown, steps = {}, {}
    # The math attention kernel is deterministic: the host and device runs compare bit for bit.
    with sdpa_kernel(SDPBackend.MATH):
        # The first run allocates what a process keeps once (cuBLAS workspaces, caches): not measured.
        for name, kl_coef, on_device in (("warm-up", 0.5, False), ("none", 0.0, False), ("host", 0.5, False),
                                         ("device", 0.5, True)):
            base = allocated()
            actor = make_actor(path, dtype, kl_coef, on_device)
            batch = synthetic_batch([24, 17, 21, 9, 20, 13], prompt_len=4)
            lp = actor.compute_logprobs(batch)
            batch.rollout_logprobs = torch.where(batch.loss_mask, lp, 0)
            steps[name] = [actor.train_step(batch) for _ in range(2)]
            grown[name] = allocated() - base  # params, grads, Adam state (+ the reference if resident)
            if name == "host":
                ref = actor.reference
                ref_bytes = sum(p.numel() * p.element_size() for p in ref.module.parameters())
                assert ref_bytes > 1 << 19 and ref.device_bytes() == 0
                assert all(p.is_cuda for p in ref.module.parameters())  # its storages are shrunk, not moved
                before = allocated()
                ref.acquire()
                assert allocated() - before >= ref_bytes
                ref.release()
                assert allocated() == before
                # the actor's own offload/onload leave the reference where it is
                actor.offload()
                actor.onload()
                assert ref.device_bytes() == 0
                del ref
            del actor
    assert abs(grown["host"] - grown["none"]) < ref_bytes // 8, grown
    assert grown["device"] - grown["host"] >= ref_bytes, grown
    for a, b in zip(steps["host"], steps["device"]):
        for key in ("loss", "kl_ref", "grad_norm"):
            assert a[key] == b[key], key
    assert steps["host"][1]["kl_ref"] > 0 and steps["host"][0]["kl_ref"] == pytest.approx(0, abs=1e-4)
