"""The actor across two gloo processes gives what one process gives: TP=2 (distributed optimizer),
TP=2 with sequence parallelism (odd-length micro-batches padded), TP=2 with fused logprobs, EP=2
(experts split, data parallel 2) and PP=2 (tied embeddings across stages), the last two also with
micro-batches by tokens. Per layout: logprobs
before and after one GRPO step, the step's loss and grad norm, and the gathered HF export."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from batches import grpo_step_view

# (name, model shape, actor overrides); world size 2 for each.
LAYOUTS = [
    ("tp2", "qwen3-small", dict(tp=2, distributed_optimizer=True)),
    ("tp2sp", "qwen3-small", dict(tp=2, sequence_parallel=True)),
    ("tp2fused", "qwen3-small", dict(tp=2, logprob_kernel="fused")),  # max and sums all-reduced between kernels
    ("ep2", "qwen3-moe-tiny", dict(ep=2)),
    ("pp2", "qwen3-tiny-tied", dict(pp=2)),
    # micro-batches by tokens: passes of 1 and 2 rows through the pipeline (shapes sent per micro-batch);
    # under EP=2 each data-parallel rank runs 3 passes, as the all-to-alls need
    ("pp2tokens", "qwen3-tiny-tied", dict(pp=2, micro_batch_tokens=20)),
    ("ep2tokens", "qwen3-moe-tiny", dict(ep=2, micro_batch_tokens=20)),
]
LENS = [12, 9, 11, 6, 10, 7, 12, 5]  # tokens per row of the synthetic batch (4 prompts x 2 samples)


def run_layout(path: str, overrides: dict) -> dict:
    return grpo_step_view(path, overrides, LENS)


def all_layouts(jobs: list[tuple[str, str, dict]]) -> dict:
    """One spawn for every layout: each Actor re-initialises Megatron's parallel state."""
    return {name: run_layout(path, overrides) for name, path, overrides in jobs}


# Slow: one spawn of two fresh processes, each importing torch + megatron-core (~15-25 s on 2 cores)
# and building four actors.
@pytest.mark.slow
def test_two_ranks_match_one_rank(tiny_model):
    from colocate_rl.trainer import run_on_ranks

    paths = {shape: str(tiny_model(shape)) for _, shape, _ in LAYOUTS}
    got = run_on_ranks(all_layouts, 2, [(name, paths[shape], o) for name, shape, o in LAYOUTS])
    for name, shape, _ in LAYOUTS:
        ref, par = run_layout(paths[shape], {}), got[name]
        for key in ("before", "after"):
            diff = (par[key] - ref[key]).abs().max().item()
            assert diff <= 1e-5, f"{name}: logprobs {key} the step differ from one rank by {diff}"
        assert par["loss"] == pytest.approx(ref["loss"], abs=1e-6), name
        assert par["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), name
        ckpt = load_file(paths[shape] + "/model.safetensors")
        assert sorted(par["exported"]) == sorted(ckpt), name
        for n, t in ckpt.items():
            assert torch.equal(par["exported"][n], t), f"{name}: exported {n} differs from the checkpoint"
