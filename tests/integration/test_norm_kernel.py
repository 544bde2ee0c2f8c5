"""actor.norm_kernel=fused: the RMSNorms' forward and backward through torch.compile'd kernels give
what the eager expressions give (the same fp32 math, rounded at the same places), for a 16-bit and
an fp32 input (the fp32 residual stream) and for per-head norms; and a bf16 actor with them scores
and trains as the eager one does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colocate_rl.models.norm import RMSNorm

from batches import make_actor, step_view, synthetic_batch


class _Cfg:  # the TransformerConfig fields RMSNorm reads
    use_cpu_initialization, params_dtype, sequence_parallel = True, torch.bfloat16, False


@pytest.mark.parametrize("shape,dtype", [((3, 17, 64), torch.bfloat16), ((3, 17, 64), torch.float32),
                                         ((17, 3, 4, 32), torch.bfloat16)])  # the last: q/k norms per head
def test_fused_norm_equals_the_eager_one(shape, dtype, compiling):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(_Cfg(), shape[-1], eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=g))
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    grad = torch.randn(shape, generator=g).to(torch.bfloat16)
    out = {}
    for fused in (False, True):
        norm.fused, norm.weight.grad = fused, None
        xi = x.clone().requires_grad_()
        y = norm(xi)
        y.backward(grad)
        out[fused] = (y.float(), xi.grad.float(), norm.weight.grad.float())
    for what, eager, fused in zip(("out", "dx", "dweight"), out[False], out[True]):
        assert fused.dtype == eager.dtype and fused.shape == eager.shape
        # the same fp32 values up to summation order; a bf16 rounding may land one step apart
        err = ((fused - eager).norm() / eager.norm()).item()
        assert err < 4e-3, (what, err)
    assert (out[True][0] == out[False][0]).float().mean() > 0.9  # the forward mostly bit for bit


def test_actor_with_fused_norms_scores_and_trains_as_the_eager_one(tiny_model, compiling):
    path = str(tiny_model("qwen3-tiny"))
    runs = {}
    for kernel in ("eager", "fused"):
        actor = make_actor(path, {"norm_kernel": kernel}, dtype="bfloat16")
        assert all(m.fused == (kernel == "fused") for m in actor.model.modules() if isinstance(m, RMSNorm))
        view = step_view(actor, [24] * 4)
        runs[kernel] = (view["before"], view["grad_norm"])
    (lp_e, gn_e), (lp_f, gn_f) = runs["eager"], runs["fused"]
    m = synthetic_batch([24] * 4, seed=1).loss_mask  # step_view's batch
    assert m.sum() > 0 and (lp_f - lp_e)[m].abs().mean() < 0.02, (lp_f - lp_e)[m].abs().mean()
    assert gn_e > 0 and gn_f == pytest.approx(gn_e, rel=0.05)


def test_fused_norms_launch_fewer_operators_with_the_same_gemms(tmp_path):
    """benchmarks/kernels/step_ops.py: one bf16 train step with eager and fused norms, real megatron-core on
    CPU. The same matrix products in the same dtypes, a quarter fewer operators (a device launches
    one or a few kernels per compiled region), and one region per norm pass."""
    script, out = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "step_ops.py", tmp_path / "ops.json"
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}  # compile for real (conftest)
    subprocess.run([sys.executable, str(script), "--compare", "actor.norm_kernel=eager,fused", "--layers", "2",
                    "--rows", "8", "--seq", "64", "--out", str(out)], check=True, capture_output=True, cwd=script.parent,
                   env=env)
    r = json.loads(out.read_text())
    eager, fused = r["norm_kernel=eager"], r["norm_kernel=fused"]
    assert sum(eager["gemm_input_dtypes"].values()) > 0 and fused["gemm_input_dtypes"] == eager["gemm_input_dtypes"]
    # 8 rows in micro-batches of 8: one forward and backward of 2 layers x 4 norms + the final one
    assert r["ops_added"] == {"compiled region": 2 * (2 * 4 + 1)}
    assert r["ops_on_vs_off"] < 0.85, r["ops_on_vs_off"]
