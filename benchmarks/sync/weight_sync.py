"""Weight-sync throughput into a real vLLM engine vs a plain memcpy of the same bytes.

    python benchmarks/sync/weight_sync.py                       # random Qwen3-shaped model, ~330 MB bf16
    python benchmarks/sync/weight_sync.py --model qwen3-small   # a colocate_rl.models.tiny shape
    python benchmarks/sync/weight_sync.py --model /path/to/hf   # an HF folder (safetensors)

The engine runs multiprocess (its engine core and worker in their own processes), so every bucket
crosses a process boundary as on a real run. Reported per sync: seconds and GB/s of the full sync
(pack into shared memory + RPC + load into the engine, of which the time inside the engine is
reported apart), of packing alone, and of a memcpy of the
same tensors into one preallocated buffer; the ratio sync/memcpy says what the path costs over
the copy it cannot avoid. Writes benchmarks/results/weight_sync_<device>.json.

On a GPU each round syncs twice, through vLLM's ``load_weights`` and by replaying the copies it
recorded (``sync.direct``, rollout/copy_plan.py), and the engine's whole state after each is
compared. ``--in-process`` runs vLLM in this process, as the colocated recipes on one GPU do.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# Qwen3 layout at a size that makes copies measurable: 166 M params (330 MB bf16, 660 MB fp32).
BENCH_SHAPE = dict(
    model_type="qwen3", vocab_size=32768, tie_word_embeddings=False, hidden_size=1024, intermediate_size=3072,
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=512,
    rms_norm_eps=1e-6, rope_theta=10000.0,
)


def build_bench_model(out: Path, dtype: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from colocate_rl.models.tiny import build_tokenizer

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(BENCH_SHAPE)
    tok = build_tokenizer(out)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=None, dtype=dtype)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id}))
    return out


def resolve_model(name: str, dtype: str) -> Path:
    from colocate_rl.models.tiny import SHAPES, ensure_model, shape_config

    cache = ROOT / ".cache" / "bench"
    if name == "bench":
        return build_bench_model(cache / f"qwen3-bench-{dtype}", dtype)
    if (Path(name) / "config.json").is_file():
        return Path(name)
    try:
        shape_config(name)
    except ValueError:
        raise SystemExit(f"--model {name!r} is neither 'bench', one of {', '.join(SHAPES)} (optionally @<layers>), "
                         "nor an HF folder") from None
    return ensure_model(name, cache / f"{name}-{dtype}", dtype=dtype)


def machine_info() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        mem_kb = int(next(x for x in meminfo if x.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration):
        mem_kb = 0
    import vllm

    return {
        "cpu": cpu, "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
        "ram_gib": round(mem_kb / 2**20, 1), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
        "torch": torch.__version__, "vllm": vllm.__version__, "python": platform.python_version(),
        "os": platform.platform(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],  # other jobs on the machine skew timings
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def memcpy_seconds(tensors: dict[str, torch.Tensor], dst: torch.Tensor) -> float:
    """One copy of every tensor into a preallocated, already touched buffer of the same size."""
    t0 = time.perf_counter()
    off = 0
    for t in tensors.values():
        n = t.numel() * t.element_size()
        dst[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
        off += n
    if dst.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def pack_seconds(tensors: dict[str, torch.Tensor], bucket_mb: float, device: str) -> float:
    """Packing alone: the copy into fresh shared-memory (CPU) or device (GPU) buckets."""
    from colocate_rl.weight_sync.ipc import IpcSender

    sender = IpcSender(device)
    t0 = time.perf_counter()
    for bucket in sender.buckets(iter(tensors.items()), bucket_mb):
        del bucket
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench", help="'bench', a tiny shape name, or an HF folder")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--in-process", action="store_true", help="vLLM in this process (colocated, one GPU)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "tests"))
    from batches import build_engine

    from colocate_rl.config import Config
    from colocate_rl.weight_sync import tensor_checksum

    path = resolve_model(args.model, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f, device=device))
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():  # different weights from the engine's, in the engine's dtype
        dt = getattr(torch, args.dtype)
        tensors = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g, device=device)).to(dt)
                   for k, v in tensors.items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"model {path.name}: {len(tensors)} tensors, {nbytes / 1e6:.0f} MB {args.dtype}, "
          f"buckets of {args.bucket_mb} MiB")

    cfg = Config()
    cfg.model.path, cfg.model.dtype = str(path), args.dtype
    cfg.data.max_prompt_tokens, cfg.rollout.max_response_tokens, cfg.rollout.kv_cache_memory_mb = 16, 16, 64
    if device == "cuda":
        cfg.rollout.gpu_memory_utilization, cfg.rollout.enforce_eager = 0.5, True
    t0 = time.perf_counter()
    engine = build_engine(cfg, multiprocess=not args.in_process)
    start_s = time.perf_counter() - t0
    # Direct loading applies to unquantized GPU engines only (CPU engines reload layer by layer).
    paths = {"load_weights": False, "direct": True} if device == "cuda" else {"load_weights": False}
    # Interleaved, so that all of them see the same machine load (other jobs share small CI boxes).
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    syncs: dict[str, list] = {p: [] for p in paths}
    packs, copies, first_direct, states = [], [], None, {}
    try:
        if "direct" in paths:  # the first direct sync records the copies: timed apart
            engine.engine = replace(engine.engine, direct=True)  # sync.direct, as the engine holds it
            first_direct = engine.update_weights(tensors.items(), bucket_mb=args.bucket_mb).seconds
        for i in range(args.repeats):
            copies.append(min(memcpy_seconds(tensors, dst) for _ in range(2)))  # warm: the floor
            packs.append(pack_seconds(tensors, args.bucket_mb, device))
            for path_name, direct in paths.items():
                engine.engine = replace(engine.engine, direct=direct)
                stats = engine.update_weights(tensors.items(), bucket_mb=args.bucket_mb)
                syncs[path_name].append(stats)
                print(f"round {i} {path_name}: sync {stats.seconds:.3f} s ({stats.gb_per_s:.2f} GB/s, "
                      f"{stats.buckets} buckets, {stats.receiver_seconds:.3f} s inside the engine)")
                if i == 0 and device == "cuda":
                    states[path_name] = engine.state_checksums()
            print(f"round {i}: pack alone {packs[-1]:.3f} s; memcpy {copies[-1]:.3f} s")
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        got = engine.checksum(names)
        assert all(got[n] == tensor_checksum(tensors[n]) for n in names), f"engine weights differ after sync: {got}"
        if len(states) == 2:
            assert states["direct"] == states["load_weights"], "direct loading left another state than load_weights"
        direct_stats = engine.direct_load_stats()[0] if "direct" in paths else {}
    finally:
        engine.shutdown()
    med = statistics.median
    sync_s = {p: med(s.seconds for s in v) for p, v in syncs.items()}
    pack_s, copy_s = med(packs), med(copies)
    main_path = "direct" if "direct" in paths else "load_weights"
    result = {
        "model": path.name, "shape": BENCH_SHAPE if args.model == "bench" else args.model, "dtype": args.dtype,
        "bytes": nbytes, "tensors": len(tensors), "bucket_mb": args.bucket_mb, "buckets": syncs[main_path][0].buckets,
        "engine_start_s": round(start_s, 1),
        "engine": "vLLM in this process" if args.in_process else "vLLM multiprocess (engine core + worker in own processes)",
        "sync_path": main_path,
        "sync_s": [round(s.seconds, 4) for s in syncs[main_path]],
        "sync_gb_per_s": round(nbytes / sync_s[main_path] / 1e9, 3),
        "engine_side_s": [round(s.receiver_seconds, 4) for s in syncs[main_path]],
        "pack_s": [round(x, 4) for x in packs], "pack_gb_per_s": round(nbytes / pack_s / 1e9, 3),
        "memcpy_s": [round(x, 4) for x in copies], "memcpy_gb_per_s": round(nbytes / copy_s / 1e9, 3),
        "stat": "median over rounds",
        "sync_over_memcpy": round(sync_s[main_path] / copy_s, 2), "checksums_equal": True, "machine": machine_info(),
    }
    if "direct" in paths:
        result |= {
            "load_weights_sync_s": [round(s.seconds, 4) for s in syncs["load_weights"]],
            "load_weights_engine_side_s": [round(s.receiver_seconds, 4) for s in syncs["load_weights"]],
            "load_weights_sync_gb_per_s": round(nbytes / sync_s["load_weights"] / 1e9, 3),
            "direct_over_load_weights_speedup": round(sync_s["load_weights"] / sync_s["direct"], 2),
            "direct_first_sync_s": round(first_direct, 4), "direct_names": direct_stats,
            "engine_state_equal_after_both_paths": True,
        }
        print(f"load_weights: median sync {sync_s['load_weights']:.3f} s "
              f"({result['load_weights_sync_gb_per_s']} GB/s); direct is {result['direct_over_load_weights_speedup']}x "
              f"faster (its first, recording sync: {first_direct:.3f} s); names {direct_stats}")
    print(f"median sync {sync_s[main_path]:.3f} s ({result['sync_gb_per_s']} GB/s, {main_path}); pack alone "
          f"{pack_s:.3f} s; memcpy {copy_s:.3f} s ({result['memcpy_gb_per_s']} GB/s); "
          f"sync/memcpy = {result['sync_over_memcpy']}x")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"weight_sync_{'gpu' if device == 'cuda' else 'cpu'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # eager vLLM on CPU: no 15-19 s compile
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    for var, sub in [("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")]:
        os.environ.setdefault(var, str(ROOT / ".cache" / sub))
    main()
