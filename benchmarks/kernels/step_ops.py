"""What an actor setting changes in a bf16 train step: the operators launched and the dtypes every
GEMM and attention call runs in, with the setting at two values, in one run.

    python benchmarks/kernels/step_ops.py --out benchmarks/results/fp32_residual_ops_cpu.json
    python benchmarks/kernels/step_ops.py --compare actor.norm_kernel=eager,fused --out benchmarks/results/norm_kernel_ops_cpu.json
    python benchmarks/kernels/step_ops.py --layers 28 --hidden 1024 ...   # any Qwen3 shape

The train step at 16 sequences of ~256 tokens is bound by the host launching kernels on an H200
(`actor_step_cuda.json`), so its cost there follows the operator count, which is the same on any
device; the GEMM dtypes say whether any matrix product left bf16. Counted with torch.profiler over
one train step after a warm-up one: every aten operator called from outside another (what a device
would launch, backward included; a call of a torch.compile'd region counts as one, a device runs
one or a few kernels for it), and each ``mm``/``addmm``/``bmm``/attention call's input dtypes.
No seconds: on a CPU a bf16 step times the CPU's bf16 arithmetic, not what an H200 does (there:
`scripts/gpu_checks.sh OUT fp32res-loop`, `norm-loop`).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from actor_step import TESTS, add_shape_args, build_model, machine_info, make_batch

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention",
         "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_efficient_attention",
         "aten::_scaled_dot_product_cudnn_attention")


def measure(path: Path, a, setting: str) -> dict:
    """One actor with ``setting`` (a config override): the profiled step's operator counts and GEMM
    input dtypes."""
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, TESTS)
    from batches import build_actor

    from colocate_rl.config import Config, ModelConfig

    cfg = Config(model=ModelConfig(path=str(path), dtype="bfloat16"))
    cfg.actor.lr, cfg.actor.micro_batch_size = 1e-6, a.micro_batch
    key, value = setting.split("=", 1)
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, yaml.safe_load(value))  # "false" -> False, "fused" -> "fused"
    actor = build_actor(cfg)
    batch = make_batch(a)
    batch.rollout_logprobs = torch.where(batch.loss_mask, actor.compute_logprobs(batch), 0)
    actor.train_step(batch)  # warm-up
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        actor.train_step(batch)
    ops, gemm_dtypes = collections.Counter(), collections.Counter()
    for e in prof.events():
        region = e.name.startswith("Torch-Compiled Region")
        inside = e.cpu_parent is not None and e.cpu_parent.name.startswith(("aten::", "Torch-Compiled Region"))
        if (region or e.name.startswith("aten::")) and not inside:
            ops["compiled region" if region else e.name] += 1
        if e.name in GEMMS:
            gemm_dtypes["/".join(sorted({d for d in e.input_dtypes if d}))] += 1
    return {"ops": sum(ops.values()), "ops_by_name": dict(ops.most_common()), "gemm_input_dtypes": dict(gemm_dtypes)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.set_defaults(hidden=256, heads=4, kv_heads=2, head_dim=64, inter=768, vocab=2048, rows=16, seq=128, micro_batch=8)
    p.add_argument("--compare", default="actor.fp32_residual=false,true", metavar="KEY=OFF,ON",
                   help="the actor setting and its two values (ops_on_vs_off: the second's count over the first's)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    a.dtype = "bfloat16"
    key, values = a.compare.split("=", 1)
    names = [f"{key.split('.')[-1]}={v}" for v in values.split(",")]  # e.g. fp32_residual=false
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), a)
        runs = {name: measure(path, a, f"{key}={name.split('=')[1]}") for name in names}
    off, on = runs[names[0]], runs[names[1]]
    result = {
        "benchmark": "step_ops",
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "ops_on_vs_off": on["ops"] / off["ops"],
        "ops_added": dict((collections.Counter(on["ops_by_name"])
                           - collections.Counter(off["ops_by_name"])).most_common()),
        "ops_removed": dict((collections.Counter(off["ops_by_name"])
                             - collections.Counter(on["ops_by_name"])).most_common()),
        **runs,
    }
    print(json.dumps({k: v for k, v in result.items() if k not in runs}, indent=1))
    for name, r in runs.items():
        print(f"{name}: {r['ops']} operators, GEMM inputs {r['gemm_input_dtypes']}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
