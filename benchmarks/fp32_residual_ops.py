"""What ``actor.fp32_residual`` adds to a bf16 train step: the operators launched and the dtypes every
GEMM and attention call runs in, with the option off and on, in one run.

    python benchmarks/fp32_residual_ops.py --out benchmarks/results/fp32_residual_ops_cpu.json
    python benchmarks/fp32_residual_ops.py --layers 28 --hidden 1024 ...   # any Qwen3 shape

The train step at 16 sequences of ~256 tokens is bound by the host launching kernels on an H200
(`actor_step_cuda.json`), so its cost there follows the operator count, which is the same on any
device; the GEMM dtypes say whether any matrix product left bf16. Counted with torch.profiler over
one train step after a warm-up one: every aten operator called from outside another (what a device
would launch, backward included), and each ``mm``/``addmm``/``bmm``/attention call's input dtypes.
No seconds: on a CPU a bf16 step times the CPU's bf16 arithmetic, not what an H200 does (there:
`scripts/gpu_checks.sh OUT fp32res-loop`).
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from actor_step import add_shape_args, build_model, make_batch

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention",
         "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_efficient_attention",
         "aten::_scaled_dot_product_cudnn_attention")


def measure(path: Path, a, fp32_residual: bool) -> dict:
    """One actor with the option set: the profiled step's operator counts and GEMM input dtypes."""
    from torch.profiler import ProfilerActivity, profile

    from colocate_rl.config import Config, ModelConfig
    from colocate_rl.trainer import Actor

    cfg = Config(model=ModelConfig(path=str(path), dtype="bfloat16"))
    cfg.actor.lr, cfg.actor.micro_batch_size, cfg.actor.fp32_residual = 1e-6, a.micro_batch, fp32_residual
    actor = Actor(cfg)
    batch = make_batch(a)
    batch.rollout_logprobs = torch.where(batch.loss_mask, actor.compute_logprobs(batch), 0)
    actor.train_step(batch)  # warm-up
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        actor.train_step(batch)
    ops, gemm_dtypes = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")):
            ops[e.name] += 1
        if e.name in GEMMS:
            gemm_dtypes["/".join(sorted({d for d in e.input_dtypes if d}))] += 1
    return {"ops": sum(ops.values()), "ops_by_name": dict(ops.most_common()), "gemm_input_dtypes": dict(gemm_dtypes)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.set_defaults(hidden=256, heads=4, kv_heads=2, head_dim=64, inter=768, vocab=2048, rows=16, seq=128, micro_batch=8)
    p.add_argument("--out", default="")
    a = p.parse_args()
    a.dtype = "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), a)
        runs = {f"fp32_residual={v}".lower(): measure(path, a, v) for v in (False, True)}
    off, on = runs["fp32_residual=false"], runs["fp32_residual=true"]
    result = {
        "benchmark": "fp32_residual_ops",
        "machine": {"device": "cuda" if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                    "python": platform.python_version(), "processor": platform.processor() or platform.machine(),
                    "date": time.strftime("%Y-%m-%d")},
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "ops_on_vs_off": on["ops"] / off["ops"],
        "ops_added": dict((collections.Counter(on["ops_by_name"])
                           - collections.Counter(off["ops_by_name"])).most_common()),
        **runs,
    }
    print(json.dumps({k: v for k, v in result.items() if k not in runs}, indent=1))
    for name, r in runs.items():
        print(f"{name}: {r['ops']} operators, GEMM inputs {r['gemm_input_dtypes']}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
