"""Colocated handoff on one GPU: seconds of each phase of real steps, GB/s of each transfer next to
the card's limits measured in the same run, rollout throughput inside the loop vs bare vLLM, the
trainer/sampler logprob gap in bf16, and device memory at each phase boundary.

    python benchmarks/step/handoff.py --shape qwen3-0.6b --out benchmarks/results/handoff_h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import platform as pyplatform
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common/
from common.loop_overrides import loop_overrides  # noqa: E402

GiB = 2**30


def copy_limits(nbytes: int = GiB) -> dict[str, float]:
    """GB/s of pinned host->device, device->host and device->device copies (D2D counts read+write)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev2 = torch.empty_like(dev)

    def rate(fn, factor=1.0):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return factor * 5 * nbytes / (time.perf_counter() - t0) / 1e9

    out = {"h2d_pinned_GBps": rate(lambda: dev.copy_(host, non_blocking=True)),
           "d2h_pinned_GBps": rate(lambda: host.copy_(dev, non_blocking=True)),
           "d2d_GBps": rate(lambda: dev2.copy_(dev), factor=2.0)}
    del dev, dev2, host
    torch.cuda.empty_cache()
    return out


def probe_onload(actor) -> dict:
    """Where an onload's seconds go, while the actor's parts are on the host (run with
    --offload all): two unprofiled onload/offload cycles; one onload under torch.profiler (the
    device's own time in its host-to-device copies, the host's busiest operators); the same host
    buffers copied into one preallocated device buffer (no storage regrown), and their bytes from
    one fresh pinned allocation in one copy; a fresh 1 GiB pinned buffer's rates taken now."""
    off = actor._offload
    host = [t for t in off._host.values()]
    nbytes = sum(t.numel() for t in host)
    fresh = copy_limits()
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def raw() -> float:
        torch.cuda.synchronize()
        t0, at = time.perf_counter(), 0
        for t in host:
            flat[at:at + t.numel()].copy_(t, non_blocking=True)
            at += t.numel()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    raw()
    raw_s = min(raw() for _ in range(3))
    arena = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # one pinned allocation, same bytes
    at = 0
    for t in host:
        arena[at:at + t.numel()].copy_(t)
        at += t.numel()
    flat.copy_(arena, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    flat.copy_(arena, non_blocking=True)
    torch.cuda.synchronize()
    arena_s = time.perf_counter() - t0
    del flat, arena
    torch.cuda.empty_cache()
    cycles = []  # unprofiled onload / offload pairs: (GB/s in, GB/s out)
    for _ in range(2):
        n_in, s_in = actor.onload()
        n_out, s_out = actor.offload()
        cycles.append((n_in / s_in / 1e9, n_out / s_out / 1e9))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        moved, onload_s = actor.onload()
    copies = [e for e in prof.key_averages() if "Memcpy HtoD" in e.key]
    device_s = sum(e.device_time_total for e in copies) / 1e6  # profiler times are in us
    n_copies = sum(e.count for e in copies)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    offload_moved, offload_s = actor.offload()
    return {"unprofiled_onload_offload_GBps": cycles,
            "host_buffers": len(host), "host_bytes": nbytes, "onload_bytes": moved, "onload_s": onload_s,
            "onload_GBps": moved / onload_s / 1e9, "onload_copies": n_copies, "onload_copy_device_s": device_s,
            "onload_copy_device_GBps": moved / max(device_s, 1e-9) / 1e9,
            "same_buffers_into_one_device_buffer_GBps": nbytes / raw_s / 1e9,
            "one_pinned_arena_one_copy_GBps": nbytes / arena_s / 1e9,
            "offload_bytes": offload_moved, "offload_GBps": offload_moved / offload_s / 1e9,
            "limits_now_GBps": fresh,
            "onload_top_host_ops": [(e.key, e.count, e.self_cpu_time_total / 1e6) for e in top]}


def dump(prof: cProfile.Profile, path: str, title: str) -> None:
    """Appends the top functions by cumulative and by own time to ``path``."""
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("cumulative").print_stats(35)
    st.sort_stats("tottime").print_stats(25)
    with open(path, "a") as f:
        f.write(f"==== {title}\n{out.getvalue()}\n")


class HostMemory:
    """Samples the node's used memory (MemTotal - MemAvailable, every 0.5 s) in a thread: its value
    at the start and its peak, in GiB. The engine runs in this process or in children of it, so
    the node's figure is the run's plus whatever else runs there."""

    def __init__(self):
        self.start = self.peak = self._used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _used() -> float:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        kib = lambda k: int(info[k].split()[0])  # noqa: E731
        return (kib("MemTotal") - kib("MemAvailable")) / 2**20

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, self._used())

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {"used_at_start": self.start, "peak": self.peak, "peak_over_start": self.peak - self.start}


def summarize_snapshot(snapshot: dict, top: int = 40) -> str:
    """Live device bytes of a ``torch.cuda.memory._snapshot()`` grouped by the innermost frame in
    colocate_rl, megatron or vLLM code (else the innermost frame), largest first: where an OOM's
    bytes were allocated."""
    groups: dict[str, list[int]] = {}
    for seg in snapshot["segments"]:
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = block.get("frames") or []
            ours = [f for f in frames if any(k in f["filename"] for k in ("colocate_rl", "megatron", "vllm"))]
            f = (ours or frames or [{"filename": "?", "line": 0, "name": "(no stack)"}])[0]
            key = f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
            g = groups.setdefault(key, [0, 0])
            g[0] += block["size"]
            g[1] += 1
    total = sum(v[0] for v in groups.values())
    lines = [f"live {total / GiB:.2f} GiB in {sum(v[1] for v in groups.values())} blocks"]
    for key, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{size / GiB:8.2f} GiB {n:6d} blocks  {key}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--micro", type=int, default=16, help="sequences per actor forward/backward")
    ap.add_argument("--fp32-residual", choices=("auto", "true", "false"), default="auto",
                    help="actor.fp32_residual (auto: unset, on for a bf16 actor)")
    ap.add_argument("--offload", default="auto", help="actor.offload: auto (what the memory plan says) | all | none")
    ap.add_argument("--set", nargs="*", default=[], help="more config overrides, e.g. rollout.exact=true")
    ap.add_argument("--memory-snapshot", default="",
                    help="on an error (an OOM), write torch's allocator snapshot here: every live block and its stack")
    ap.add_argument("--probe-onload", action="store_true",
                    help="after the steps, time one more onload piece by piece (with --offload all)")
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", default="",
                    help="write cProfiles of one extra, untimed step and of both rollouts here")
    args = ap.parse_args()

    from colocate_rl import loop
    from colocate_rl.config import Config, ModelConfig, load
    from colocate_rl.models.tiny import ensure_model
    from colocate_rl.plan import resolve
    from colocate_rl.session import start_session

    limits = copy_limits()
    print("card limits:", json.dumps({k: round(v, 1) for k, v in limits.items()}), flush=True)
    root = Path(os.environ.get("COLOCATE_RL_CACHE", ".cache"))
    path = ensure_model(args.shape, root / "models" / f"{args.shape}-bf16", dtype="bfloat16")
    over = [*loop_overrides(path, root, "handoff", prompts=args.prompts, n=args.n, tokens=args.tokens,
                            micro=args.micro, fp32_residual=args.fp32_residual),
            f"steps={args.steps + 1}", f"rollout.gpu_memory_utilization={args.gpu_mem}", "sync.verify_every=1",
            f"actor.offload={args.offload}", *args.set]
    cfg = load(Config(model=ModelConfig(path=str(path))), overrides=over)
    if args.memory_snapshot:
        # Python frames only: recording C++ stacks of every allocation while vLLM starts took more
        # host memory than the node had. Live blocks keep their stacks whatever max_entries is.
        torch.cuda.memory._record_memory_history(max_entries=1000, stacks="python")
    host = HostMemory()  # the node's used memory from here on, against the plan's host part
    s = start_session(cfg, resolve(cfg))  # the handoff measures the card's used bytes at every phase boundary
    print(s.plan.describe(), flush=True)
    rows, per_step = [], []
    machine = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "vllm": __import__("vllm").__version__, "python": pyplatform.python_version(),
               "date": time.strftime("%Y-%m-%d")}
    try:
        for i in range(args.steps + 1):  # the first step warms up (allocator, kernels)
            m = loop.step(s)
            s.step += 1
            per_step.append({k[5:]: v for k, v in m.items() if k.startswith("time/")})
            off = getattr(s.actor, "_offload", None)  # the actor in this process: its onload's split
            if off is not None and m.get("actor/onload_bytes"):
                per_step[-1].update({f"onload_{k}": v for k, v in off.last_onload_split.items()})
            per_step[-1].update({k: m[k] for k in ("onload_prefetch_bytes", "onload_prefetch_GBps") if k in m})
            print(f"step {i}: " + " ".join(f"{k} {v:.3f}" for k, v in per_step[-1].items()), flush=True)
            if i:
                rows.append(m)
            if args.out:  # a run cut short (a time limit, a crash) keeps the steps it finished
                Path(args.out).write_text(json.dumps({
                    "machine": machine, "settings": vars(args), "partial": f"{i + 1} of {args.steps + 1} steps",
                    "plan": s.plan.describe(), "phase_s_per_step": per_step}, indent=1) + "\n")
        if args.profile:  # one more step under cProfile, not counted: the profiler slows Python-bound phases
            prof = cProfile.Profile()
            with prof:
                loop.step(s)
            s.step += 1
            dump(prof, args.profile, "one colocated step (under cProfile: slower than the timed steps)")
        # Bare vLLM on the same prompts and sampling, for the throughput ratio: alternated with ours
        # (twice each, the better run of each) so neither side profits from running second.
        samples = s.sampler.next_batch()
        from vllm import SamplingParams

        sp = [SamplingParams(n=args.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                             max_tokens=args.tokens, logprobs=0, seed=s.plan.sampling.step_seed(s.step) + i * args.n,
                             stop_token_ids=s.rollout.eos_ids, detokenize=False)
              for i in range(len(samples))]  # the engine's own request: seeded per prompt
        prompts = [{"prompt_token_ids": list(x.prompt_ids)} for x in samples]
        batch = None

        def bare() -> int:
            return sum(len(o.token_ids) for r in s.rollout.llm.generate(prompts, sp, use_tqdm=False) for o in r.outputs)

        def ours() -> int:
            nonlocal batch
            batch = s.rollout.generate(samples, seed=s.plan.sampling.step_seed(s.step))
            return int(batch.response_lens.sum())

        rates = {"bare": [], "ours": []}
        for _ in range(2):
            for name, fn in (("bare", bare), ("ours", ours)):
                s.rollout.llm.reset_prefix_cache()
                t0 = time.perf_counter()
                tokens = fn()
                rates[name].append(tokens / (time.perf_counter() - t0))
        if args.profile:
            for title, fn in (("bare LLM.generate", bare), ("RolloutEngine.generate (as in the loop)", ours)):
                prof = cProfile.Profile()
                with prof:
                    fn()
                dump(prof, args.profile, title)
        onload_probe = None
        if args.probe_onload and s.actor.offloaded():
            onload_probe = probe_onload(s.actor)
            print("onload probe:", json.dumps(onload_probe), flush=True)
        # Per-token logprob gap (bf16) on that batch, before any update.
        with s.handoff.actor_owned(changes_weights=False):
            lp = s.actor.compute_logprobs(batch)
        diff = (lp - batch.rollout_logprobs).abs()[batch.loss_mask].float()
    except BaseException:
        if args.memory_snapshot:
            snap = torch.cuda.memory._snapshot()
            Path(args.memory_snapshot).with_suffix(".txt").write_text(summarize_snapshot(snap))
            torch.cuda.memory._dump_snapshot(args.memory_snapshot)
        raise
    finally:
        s.close()

    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    phases = {k[5:]: mean(k) for k in rows[0] if k.startswith("time/") and k != "time/step"}
    handoff_keys = ("sleep", "onload", "offload", "wake_weights", "sync", "wake_kv")
    step_s = mean("time/step")
    used = s.handoff.machine.peak_used()
    kv = used.get("rollout", 0) - used.get("rollout_weights", 0)
    result = {
        "machine": machine,
        "settings": vars(args),
        "step_s": step_s,
        "phase_s": phases,
        "phase_s_per_step": per_step,  # the first one the warm-up
        "handoff_s": sum(phases.get(k, 0) for k in handoff_keys),
        "handoff_share_of_step": sum(phases.get(k, 0) for k in handoff_keys) / step_s,
        "transfers_GBps": {"onload (h2d)": mean("actor/onload_GBps"), "offload (d2h)": mean("actor/offload_GBps"),
                           "weight sync (d2d, IPC)": mean("sync/GBps")},
        "limits_GBps": limits,
        **({"onload_probe": onload_probe} if onload_probe else {}),
        "sync_bytes": rows[0]["sync/bytes"],
        # The sync's seconds (without its verification): the actor's export and packing, the engine's
        # loading, and the rest (RPC, frees).
        "sync_split_s": {"total": sum(r["sync/bytes"] / max(r["sync/GBps"], 1e-9) / 1e9 for r in rows) / len(rows),
                         "pack": mean("sync/pack_s"), "engine": mean("sync/engine_s")},
        "offloaded_bytes": rows[0]["actor/offload_bytes"],
        "offloaded_parts": list(s.plan.memory.offload),
        "memory_predicted_GiB_at_phase": {k: v / GiB for k, v in s.plan.memory.peaks().items()},
        "rollout_tokens_per_s": max(rates["ours"]),
        "bare_vllm_tokens_per_s": max(rates["bare"]),
        "rollout_vs_bare_vllm": max(rates["ours"]) / max(rates["bare"]),
        "rollout_tokens_per_s_runs": rates,
        "logprob_abs_diff_mean": float(diff.mean()),
        "logprob_abs_diff_p99": float(diff.quantile(0.99)),
        "logprob_abs_diff_max": float(diff.max()),
        "memory_used_GiB_at_phase": {k: v / GiB for k, v in used.items()},
        "memory_unstaged_wake_GiB": (used.get("sync", 0) + kv) / GiB,
        "memory_staged_peak_GiB": max(used.values()) / GiB,
        "host_memory_GiB": {"planned_per_node": s.plan.memory.host_per_node / GiB, **host.stop()},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
