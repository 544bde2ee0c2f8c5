"""Exact mode's train step vs the default's, wall time against kernel time (one CUDA GPU).

    python benchmarks/gap/exact_train_step_gpu.py [--rows 64 --seq 320 --prompt 64 --micro 16]

One Actor.train_step of the Qwen3-0.6B shape (random weights, bf16) on the same batch, with
rollout.exact off and on: an untimed warm-up call, then one call timed and one under
torch.profiler. Prints and writes, per mode, the wall seconds, the seconds the GPU spent in
kernels, the kernels that took most of it and the host-side ops that took most of the host's time.
Wall time well above kernel time means the step is bound by the host (kernel launches, autograd),
not by the GPU. Writes benchmarks/results/exact_train_step_<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))  # actor_step.py


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--seq", type=int, default=320, help="tokens per row (all rows full)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row (no loss on them)")
    p.add_argument("--micro", type=int, default=16, help="rows per forward/backward")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("exact_train_step_gpu.py needs a CUDA GPU (rollout.exact runs vLLM's CUDA kernels)")

    from actor_step import machine_info
    from batches import build_actor, synthetic_batch

    from colocate_rl.config import Config, ModelConfig
    from colocate_rl.models.tiny import ensure_model

    path = ensure_model(a.shape, Path(tempfile.mkdtemp()) / a.shape, seed=0, dtype="bfloat16")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    batch = synthetic_batch([a.seq] * a.rows, prompt_len=a.prompt, vocab=vocab)
    result = {"machine": machine_info(), "settings": vars(a), "modes": {}}
    for exact in (False, True):
        cfg = Config(model=ModelConfig(path=str(path), dtype="bfloat16"))
        cfg.rollout.exact, cfg.actor.micro_batch_size = exact, a.micro
        actor = build_actor(cfg)
        actor.train_step(batch)  # warm-up: allocator, Triton and cuBLAS first calls
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        actor.train_step(batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            actor.train_step(batch)
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
        host = sorted(events, key=lambda e: -e.self_cpu_time_total)  # where the host's time goes
        busy = sum(e.self_device_time_total for e in kernels) / 1e6
        name = "exact" if exact else "default"
        result["modes"][name] = {
            "wall_s": round(wall, 4), "kernel_s": round(busy, 4), "kernel_launches": sum(e.count for e in kernels),
            "top_kernels": [{"name": e.key[:100], "ms": round(e.self_device_time_total / 1e3, 2), "calls": e.count}
                            for e in kernels[:12]],
            "top_host_ops": [{"name": e.key[:100], "self_ms": round(e.self_cpu_time_total / 1e3, 2), "calls": e.count}
                             for e in host[:20]],
        }
        print(f"{name}: train_step {wall:.3f} s wall, {busy:.3f} s in kernels ({busy / wall:.0%} busy), "
              f"{result['modes'][name]['kernel_launches']} kernels", flush=True)
        del actor
        torch.cuda.empty_cache()
    m = result["modes"]
    result["exact_over_default"] = {"wall": round(m["exact"]["wall_s"] / m["default"]["wall_s"], 3),
                                    "kernel": round(m["exact"]["kernel_s"] / m["default"]["kernel_s"], 3)}
    print(f"exact / default: wall {result['exact_over_default']['wall']}x, kernels {result['exact_over_default']['kernel']}x")
    gpu = torch.cuda.get_device_name(0).split()[-1].lower()
    out = Path(a.out or ROOT / "benchmarks" / "results" / f"exact_train_step_{gpu}.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
