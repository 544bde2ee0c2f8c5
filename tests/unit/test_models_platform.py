"""colocate_rl.platform: device detection helpers and the CPU compatibility layer's contract."""

from __future__ import annotations

import pytest
import torch

from colocate_rl import platform


def test_visible_devices_env_sets_cuda_and_hip():
    assert platform.visible_devices_env([0, 3]) == {"CUDA_VISIBLE_DEVICES": "0,3", "HIP_VISIBLE_DEVICES": "0,3"}


def test_backend_follows_the_device():
    k = platform.kind()
    assert k in ("cuda", "rocm", "cpu")
    assert platform.dist_backend() == ("gloo" if k == "cpu" else "nccl")
    assert platform.device().type == ("cpu" if k == "cpu" else "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU compatibility layer applies only without a GPU")
def test_cpu_compat_is_idempotent_and_answers_megatron_cuda_queries():
    platform.apply_cpu_compat()
    platform.apply_cpu_compat()
    import megatron.core.transformer.utils as tutils

    # Megatron's modules see a torch.cuda that answers for the CPU; everyone else keeps the real one.
    assert str(tutils.torch.cuda.current_device()) == "cpu"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    assert tutils.get_default_causal_mask(3).device.type == "cpu"
    # Megatron's optimizer checks Tensor.type() against CUDA names, only while it is built.
    with platform.megatron_tensor_methods_on_cpu():
        assert torch.zeros(2).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(2).type() == "torch.FloatTensor"
        assert torch.zeros(2, dtype=torch.bfloat16).type() in ["torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor"]
        assert torch.zeros(2).type() != "torch.cuda.HalfTensor"
        assert torch.zeros(2).type(torch.float64).dtype == torch.float64
    assert torch.zeros(2).type() != "torch.cuda.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(2).cuda()
    stream = tutils.torch.cuda.Stream(device="cuda")
    assert stream == tutils.torch.cuda.current_stream()
    stream.record_event().synchronize()
    assert not tutils.torch.cuda.is_available()  # the patch does not pretend a GPU exists
