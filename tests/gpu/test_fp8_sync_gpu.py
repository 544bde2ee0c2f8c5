"""FP8 rollout on a GPU: an engine started from a block-FP8 checkpoint (DeepSeek format: e4m3
weights + 128×128 `weight_scale_inv`) receives bf16 weights quantized on the sender and must then
sample exactly as an engine loaded from a checkpoint holding those same FP8 weights. That holds only
if vLLM's post-load processing (process_weights_after_loading) ran on the new weights: a byte copy
into the processed parameters leaves the quantization state wrong (e4m3fnuz on ROCm, GEMM layouts).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU (torch.cuda.is_available() is False)", allow_module_level=True)
if torch.version.hip is None and torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 GEMMs need compute capability >= 8.9 (Ada/Hopper) on CUDA", allow_module_level=True)

# vLLM's default block-FP8 GEMM on Hopper is DeepGEMM, whose first use compiles ~1,500 kernels (minutes
# on an H200); its Triton/CUTLASS kernels load the same weights through the same
# post-load processing, which is what this test is about.
os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")

from colocate_rl.types import Sample  # noqa: E402
from colocate_rl.weight_sync.fp8 import BLOCK  # noqa: E402
from colocate_rl.weight_sync.quantize import quantize_named, sync_plan  # noqa: E402

from batches import build_engine  # noqa: E402

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[11, 12, 13, 14], [20, 21, 22], [5, 6, 7, 8, 9], [30, 31]]


def write_fp8(src, dst, tensors: dict[str, torch.Tensor]):
    """A block-FP8 checkpoint of ``tensors`` (bf16, HF names): every layer linear quantized."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    targets = {n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEAR}
    plan = dict.fromkeys(targets, "fp8_block")
    out = {n: t.contiguous().cpu() for n, t in quantize_named(iter(tensors.items()), plan)}
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def engine(path):
    pytest.importorskip("vllm", reason="needs vLLM's GPU build")
    from colocate_rl.config import Config

    cfg = Config()
    cfg.model.path, cfg.model.dtype = str(path), "bfloat16"
    cfg.data.max_prompt_tokens, cfg.rollout.max_response_tokens, cfg.rollout.n = 16, 16, 2
    cfg.rollout.multiprocess, cfg.rollout.enforce_eager = True, True
    cfg.rollout.gpu_memory_utilization = 0.3
    return build_engine(cfg)


def sample(eng):
    b = eng.generate([Sample(prompt_ids=p) for p in PROMPTS], seed=3)
    return b.tokens, b.rollout_logprobs


def test_fp8_engine_after_each_of_three_syncs_samples_as_the_checkpoint_of_the_same_weights(tmp_path, tiny_model):
    """Syncs to the target weights, back to the start, and to the target again, each followed by a
    check: a second sync breaks where the first left the engine's FP8 layers re-laid-out."""
    from safetensors.torch import load_file

    # qwen3-0.6b's projections are multiples of 128: vLLM's block-FP8 layers accept them.
    src = tiny_model("qwen3-0.6b", "bfloat16")
    start = load_file(str(src / "model.safetensors"), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    target = {n: (t.float() + 0.02 * torch.randn(t.shape, generator=g, device="cuda")).to(torch.bfloat16)
              for n, t in start.items()}
    ref_eng = engine(write_fp8(src, tmp_path / "target", target))
    try:
        ref = sample(ref_eng)
    finally:
        ref_eng.shutdown()
    eng = engine(write_fp8(src, tmp_path / "start", start))
    try:
        targets = sync_plan(eng.weight_shapes())
        assert set(targets.values()) == {"fp8_block"}
        assert len(targets) == 7 * sum(1 for n in start if n.endswith("mlp.down_proj.weight")), "every linear is FP8"
        before = sample(eng)
        mask = ref[1] != 0
        control = not torch.equal(before[0], ref[0]) or float((before[1] - ref[1])[mask].abs().max()) > 0.05
        assert control, "control: the engine's starting weights sample differently from the target"
        for i, (weights, want, name) in enumerate([(target, ref, "target"), (start, before, "start"),
                                                   (target, ref, "target")], 1):
            stats = eng.update_weights(quantize_named(iter(weights.items()), targets), bucket_mb=64)
            assert stats.bytes > 0
            got = sample(eng)
            diff = float((got[1] - want[1])[want[1] != 0].abs().max())
            print(f"sync {i} (to {name}): {stats.bytes / 1e9:.3f} GB in {stats.seconds:.3f} s (quantized on the sender), "
                  f"same tokens {torch.equal(got[0], want[0])}, max |logprob diff| {diff:.2e}")
            assert torch.equal(got[0], want[0]), f"after sync {i} the FP8 engine samples the {name} checkpoint's tokens"
            assert diff <= 1e-3, (i, diff)
    finally:
        eng.shutdown()
