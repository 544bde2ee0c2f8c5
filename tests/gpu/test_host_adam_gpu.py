"""The host Adam (actor.optimizer_cpu_offload) on a GPU: the streamed update (two copy streams,
two device slots, pinned host state) equals the device Adam and does not depend on the chunk size;
checkpoints resume exactly; at the Qwen3-0.6B shape the device holds only the bf16 weights and the
fp32 gradients, and the step time with and without the host state is printed (run with -s)."""

from __future__ import annotations

import os
import time

import pytest
import torch

# cuBLAS picks split-K workspaces nondeterministically unless told otherwise (before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from colocate_rl.config import Config, ModelConfig  # noqa: E402

from batches import build_actor, synthetic_batch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")

LENS = [24, 17, 21, 9, 20, 13, 24, 8]


def make_actor(path, dtype="float32", **actor):
    cfg = Config(model=ModelConfig(path=str(path), dtype=dtype))
    cfg.actor.lr, cfg.actor.micro_batch_size = 1e-3, 4
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    return build_actor(cfg)


def steps(actor, n: int) -> dict[str, torch.Tensor]:
    batch = synthetic_batch(LENS, prompt_len=4)
    for _ in range(n):
        lp = actor.compute_logprobs(batch)
        batch.rollout_logprobs = torch.where(batch.loss_mask, lp, 0)
        actor.train_step(batch, lp)
    return {n: t.float().cpu() for n, t in actor.export_hf_weights()}


def test_streamed_update_equals_device_adam_and_resumes(tiny_model, tmp_path):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    path = tiny_model("qwen3-tiny")
    # The math attention kernel has a deterministic backward; the fused ones accumulate atomically.
    with sdpa_kernel(SDPBackend.MATH):
        start = {n: t.float().cpu() for n, t in make_actor(path).export_hf_weights()}
        ref = steps(make_actor(path), 3)
        host = make_actor(path, optimizer_cpu_offload=True)
        assert all(t.device.type == "cpu" and t.is_pinned() for t in host.optimizer.host_tensors())
        got = steps(host, 3)
        # Chunks of 77 elements: every tensor cut at odd offsets, both slots reused many times over.
        cut = make_actor(path, optimizer_cpu_offload=True)
        cut.optimizer.chunk_numel = 77
        got_cut = steps(cut, 3)

        a = make_actor(path, optimizer_cpu_offload=True, optimizer_state_dtype="bfloat16")
        steps(a, 1)
        a.save_checkpoint(str(tmp_path / "ckpt"))
        want = steps(a, 1)
        b = make_actor(path, optimizer_cpu_offload=True, optimizer_state_dtype="bfloat16")
        b.load_checkpoint(str(tmp_path / "ckpt"))
        resumed = steps(b, 1)

    num = sum(float((got[n] - ref[n]).double().norm() ** 2) for n in ref)
    den = sum(float((ref[n] - start[n]).double().norm() ** 2) for n in ref)
    assert den > 0 and (num / den) ** 0.5 <= 1e-5, (num / den) ** 0.5
    assert all(torch.equal(got[n], got_cut[n]) for n in got)
    assert all(torch.equal(resumed[n], want[n]) for n in want)


def test_device_holds_only_weights_and_gradients(tiny_model):
    """Qwen3-0.6B shape in bf16 (~0.6B parameters; the embedding spans three 256 MiB chunks).
    Device Adam holds 2 + 4 bytes/param of weights and gradients plus 12 of optimizer state; with
    the state on the host, only the first 6, at construction and between steps."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    path = tiny_model("qwen3-0.6b", "bfloat16")
    times, held = {}, {}
    for host in (True, False):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        actor = make_actor(path, "bfloat16", optimizer_cpu_offload=host)
        n = sum(p.numel() for p in actor.model.module.parameters())
        weights_and_grads = 2 * n + sum(4 * b.grad_data.numel() for b in actor.model.buffers)
        built = torch.cuda.memory_allocated() - base
        with sdpa_kernel(SDPBackend.MATH):
            steps(actor, 1)  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            steps(actor, 3)
            torch.cuda.synchronize()
            times[host] = (time.perf_counter() - t0) / 3
        held[host] = torch.cuda.memory_allocated() - base
        if host:
            slack = 64 * 2**20 + 0.02 * weights_and_grads  # rotary tables, buffer padding
            assert built <= weights_and_grads + slack, (built, weights_and_grads)
            assert held[host] <= weights_and_grads + slack, (held[host], weights_and_grads)
            assert all(t.device.type == "cpu" and t.is_pinned() for t in actor.optimizer.host_tensors())
            assert sum(t.numel() for t in actor.optimizer.host_tensors()) == 3 * n
        else:
            assert held[host] >= weights_and_grads + 0.95 * 12 * n, (held[host], n)
        del actor
    print(f"\nqwen3-0.6b bf16, {n / 1e9:.2f}B params: train step (logprobs + GRPO step) "
          f"{times[False]:.3f} s with Adam on the device, {times[True]:.3f} s with Adam on the host; "
          f"device memory between steps {held[False] / 2**30:.2f} vs {held[True] / 2**30:.2f} GiB")
