"""Disaggregated mode on one node of two GPUs: the actor on GPU 0, one vLLM engine on GPU 1, weights
broadcast over NCCL (RCCL on ROCm). Reports the sync's GB/s next to the GPU-to-GPU copy limit
measured in the same run, and seconds per step on-policy vs one-step off-policy (generation of
step k+1 overlapping the training of step k).

    python benchmarks/step/disagg_gpu.py --shape qwen3-0.6b --out benchmarks/results/disagg_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform as pyplatform
import time
from dataclasses import replace
from pathlib import Path

import torch

GiB = 2**30


def gpu_to_gpu_limit(nbytes: int = GiB, reps: int = 5) -> dict[str, float]:
    """GB/s of a device 0 → device 1 copy (peer-to-peer: NVLink / xGMI when present), the bound on
    what a broadcast between the two GPUs can reach; and device 0's own copy (read + write)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    a2 = torch.empty_like(a)

    def rate(fn, factor=1.0):
        fn()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        return factor * reps * nbytes / (time.perf_counter() - t0) / 1e9

    out = {"gpu0_to_gpu1_GBps": rate(lambda: b.copy_(a, non_blocking=True)),
           "gpu1_to_gpu0_GBps": rate(lambda: a.copy_(b, non_blocking=True)),
           "gpu0_d2d_GBps": rate(lambda: a2.copy_(a), factor=2.0),
           "peer_access": bool(torch.cuda.can_device_access_peer(0, 1))}
    del a, b, a2
    torch.cuda.empty_cache()
    return out


def run_steps(s, steps: int, off_policy: bool) -> list[dict]:
    """``steps`` measured steps after one warm-up, as the loop runs them; wall seconds each. One
    session runs both schedules: the loop reads rollout.off_policy from the plan's Scheduling view."""
    from colocate_rl import loop

    s.plan.scheduling = replace(s.plan.scheduling, off_policy=off_policy)
    rows = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        m = loop.step(s, last=i == steps)
        m["wall_s"] = time.perf_counter() - t0
        s.step += 1
        phases = " ".join(f"{k[5:]} {v:.2f}" for k, v in m.items() if k.startswith("time/"))
        print(f"{'off' if off_policy else 'on'}-policy step {i}: wall {m['wall_s']:.2f}s staleness "
              f"{m['rollout/staleness']} {phases}", flush=True)
        if i:
            rows.append(m)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--out", required=True, help="where to write the results JSON")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"disagg_gpu.py needs 2 GPUs, this machine shows {torch.cuda.device_count()}")

    from colocate_rl.config import Config, ModelConfig, load
    from colocate_rl.models.tiny import ensure_model
    from colocate_rl.plan import resolve
    from colocate_rl.session import start_session

    limits = gpu_to_gpu_limit()
    print("copy limits:", json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in limits.items()}),
          flush=True)
    root = Path(os.environ.get("COLOCATE_RL_CACHE", ".cache")).resolve()
    path = ensure_model(args.shape, root / "models" / f"{args.shape}-bf16", dtype="bfloat16")
    over = [f"model.path={path}", "model.dtype=bfloat16", "data.train=arithmetic", "data.apply_chat_template=false",
            "data.max_prompt_tokens=32", f"data.prompts_per_step={args.prompts}", "reward.name=arithmetic",
            f"rollout.n={args.n}", f"rollout.max_response_tokens={args.tokens}", f"steps={2 * args.steps + 10}",
            f"rollout.gpu_memory_utilization={args.gpu_mem}", f"sync.bucket_mb={args.bucket_mb}",
            "actor.lr=1e-6", "actor.micro_batch_size=8", "actor.offload=none",
            "placement.mode=disaggregated", "placement.gpus_per_node=2", "placement.actor_gpus=1",
            "rollout.num_engines=1", "sync.verify_every=0", "logging.wandb_mode=disabled",
            "logging.progress=false", f"logging.run_dir={root / 'bench'}", "logging.run_name=disagg"]
    cfg = load(Config(model=ModelConfig(path=str(path))), overrides=over)
    s = start_session(cfg, resolve(cfg))
    try:
        on = run_steps(s, args.steps, off_policy=False)
        off = run_steps(s, args.steps, off_policy=True)
        verified = s.workers.verify()  # after the timed syncs: the engine holds the actor's weights
    finally:
        s.close()
        import ray

        ray.shutdown()

    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    sync_bytes = on[0]["sync/bytes"]
    sync_wall_s = mean(on + off, "time/sync")
    sync_GBps = sync_bytes / sync_wall_s / 1e9
    phases = lambda rows: {k[5:]: mean(rows, k) for k in rows[0] if k.startswith("time/")}  # noqa: E731
    result = {
        "machine": {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                    "torch": torch.__version__, "vllm": __import__("vllm").__version__,
                    "ray": __import__("ray").__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                    "python": pyplatform.python_version(), "date": time.strftime("%Y-%m-%d")},
        "settings": vars(args),
        "layout": "actor (Megatron, 1 rank) on GPU 0, vLLM engine (TP1) on GPU 1, NCCL broadcast",
        "sync_bytes": sync_bytes,
        "verified_tensors_after_last_sync": verified,
        "sync_wall_s": sync_wall_s,
        "sync_GBps": sync_GBps,
        "sync_sender_GBps": mean(on + off, "sync/GBps"),  # bytes / the sender's export + pack + broadcast time
        "copy_limits_GBps": limits,
        "sync_share_of_gpu_to_gpu_limit": sync_GBps / limits["gpu0_to_gpu1_GBps"],
        "on_policy_s_per_step": mean(on, "wall_s"),
        "off_policy_s_per_step": mean(off, "wall_s"),
        "off_policy_speedup": mean(on, "wall_s") / mean(off, "wall_s"),
        "off_policy_staleness": [r["rollout/staleness"] for r in off],
        "on_policy_phase_s": phases(on),
        "off_policy_phase_s": phases(off),
        "logprob_abs_diff_on_policy": mean(on, "train_rollout_logprob_abs_diff"),
        "logprob_abs_diff_off_policy": mean(off, "train_rollout_logprob_abs_diff"),
    }
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
