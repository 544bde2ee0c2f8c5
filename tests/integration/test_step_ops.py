"""actor.fp32_residual keeps the residual stream in fp32 without taking any matrix product out of
bf16, and adds only casts to the operators a train step launches (benchmarks/kernels/step_ops.py,
real megatron-core on CPU): the step stays as cheap to launch as the bf16 one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "step_ops.py"


def test_fp32_residual_adds_only_casts_and_no_fp32_gemm(tmp_path):
    out = tmp_path / "ops.json"
    subprocess.run([sys.executable, str(SCRIPT), "--layers", "2", "--rows", "8", "--seq", "64", "--out", str(out)],
                   check=True, capture_output=True, cwd=SCRIPT.parent)
    r = json.loads(out.read_text())
    off, on = r["fp32_residual=false"], r["fp32_residual=true"]
    assert sum(off["gemm_input_dtypes"].values()) > 0  # the products were seen
    assert on["gemm_input_dtypes"] == off["gemm_input_dtypes"]
    assert all("Float" not in k.replace("BFloat16", "") for k in on["gemm_input_dtypes"])
    assert set(r["ops_added"]) == {"aten::to"}  # the option does something, and only casts
    assert 1 < r["ops_on_vs_off"] < 1.05
