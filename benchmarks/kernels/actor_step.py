"""Actor throughput vs plain PyTorch: train step and logprobs tokens/s, offload/onload GB/s.

    python benchmarks/kernels/actor_step.py                                  # Qwen3-shaped, 4 layers, hidden 512
    python benchmarks/kernels/actor_step.py --hidden 1024 --layers 8 --rows 32 --seq 512 --dtype bfloat16
    python benchmarks/kernels/actor_step.py --hidden 1024 --layers 28 --heads 16 --kv-heads 8 --head-dim 128 \
        --inter 3072 --vocab 151936 --rows 128 --seq 320 --micro-batch 16 --dtype bfloat16 --profile P.txt
    python benchmarks/kernels/actor_step.py ... --optimizer-cpu-offload [--optimizer-state-dtype bfloat16]

Our path: the Megatron actor (colocate_rl.trainer.Actor) at TP=PP=EP=1, one process. Baselines, in
the same run and on the same weights and micro-batches:
  - train step: the transformers model, plain forward + the same policy loss + backward, grad-norm
    clip and torch AdamW, micro-batch by micro-batch;
  - logprobs: the transformers model's forward + log_softmax/gather, no grad;
  - offload / onload: one torch copy of the same byte count between the device and a host buffer
    (pinned on GPU), i.e. the copy our path cannot avoid.
Ratios > 1 mean our path is faster. With --optimizer-cpu-offload the actor keeps its Adam state in
host memory (actor.optimizer_cpu_offload); the result's "optimizer" entry records that, the step
time and the device memory the actor holds between steps. Writes
benchmarks/results/actor_step_<device>[_host_adam].json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as py_platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TESTS = str(ROOT / "tests")  # batches.py builds the actor as a run would


def build_model(out: Path, a) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter or 3 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim or a.hidden // a.heads, max_position_embeddings=max(a.seq, 512), rms_norm_eps=1e-6,
        tie_word_embeddings=False, dtype=a.dtype,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=getattr(torch, a.dtype)).save_pretrained(str(out))
    return out


def make_batch(a):
    from colocate_rl.types import RolloutBatch, Sample

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(a.seq // 2, a.seq + 1, (a.rows,), generator=g)
    tokens = torch.randint(3, a.vocab, (a.rows, a.seq), generator=g)
    attn = torch.arange(a.seq)[None] < lens[:, None]
    tokens[~attn] = 0
    prompt = a.seq // 4
    loss = attn.clone()
    loss[:, :prompt] = False
    return RolloutBatch(
        tokens=tokens, attention_mask=attn, loss_mask=loss, rollout_logprobs=torch.zeros(a.rows, a.seq),
        prompt_lens=torch.full((a.rows,), prompt), response_lens=lens - prompt,
        group_ids=torch.arange(a.rows) // 2, truncated=torch.zeros(a.rows, dtype=torch.bool),
        finish_reasons=["stop"] * a.rows, responses=[""] * a.rows, samples=[Sample([1])] * a.rows,
        advantages=torch.randn(a.rows, generator=g),
    )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def timed(fn, repeat: int) -> float:
    """Median seconds of ``repeat`` calls after one warm-up."""
    fn()
    return sorted(seconds(fn) for _ in range(repeat))[repeat // 2]


def hf_baseline(path: Path, batch, a, cfg, dev):
    """(train step fn, logprobs fn) of plain transformers on the same micro-batches."""
    from transformers import AutoModelForCausalLM

    from colocate_rl.algorithms import global_counts, policy_loss
    from colocate_rl.trainer.batching import rank_micro_batches

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, a.dtype)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    rows = rank_micro_batches(torch.arange(batch.size), batch.attention_mask.sum(1), 1, 0, a.micro_batch)
    micro = [batch.select(r) for r in rows]
    counts = global_counts(batch.loss_mask)

    def logprobs(mb):
        tokens = mb.tokens.to(dev)
        logits = model(tokens).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
        return torch.nn.functional.pad(lp, (1, 0))

    def train():
        model.train()
        for mb in micro:
            lp = logprobs(mb)
            old = lp.detach()
            loss, _ = policy_loss(lp, old, old, mb.advantages.to(dev), mb.loss_mask.to(dev), cfg.algorithm, **counts)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    @torch.no_grad()
    def score():
        model.eval()
        for mb in micro:
            logprobs(mb)

    return train, score


def memcpy_fns(nbytes: int, dev):
    """(device→host, host→device) copies of ``nbytes`` between preallocated buffers (host pinned on GPU)."""
    pin = dev.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    return (lambda: host.copy_(src, non_blocking=pin)), (lambda: src.copy_(host, non_blocking=pin))


def write_profile(path: Path, fns: dict) -> None:
    """torch.profiler over one call of each fn: the busy share of the device and the top operators by
    device time and by host time, so launch-bound (host) and kernel-bound (device) steps tell apart."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with path.open("w") as f:
        for name, fn in fns.items():
            _sync()
            t0 = time.perf_counter()
            with profile(activities=acts) as prof:
                fn()
                _sync()
            wall = time.perf_counter() - t0
            ev = prof.key_averages()
            kernels = [e for e in ev if e.device_type.name == "CUDA"]  # operator rows repeat their kernels' time
            dev_s = sum(e.self_device_time_total for e in kernels) / 1e6
            f.write(f"==== {name}: {wall:.3f} s wall (profiled), device busy {dev_s:.3f} s "
                    f"({dev_s / wall:.0%}), {sum(e.count for e in kernels)} kernels\n")
            for key in (["self_device_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]:
                f.write(ev.table(sort_by=key, row_limit=25, max_name_column_width=60) + "\n")
    print(f"wrote {path}")


def machine_info() -> dict:
    cpu, mem_kb = "", 0
    try:
        cpu = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name"))
        cpu = cpu.split(":", 1)[1].strip()
        mem_kb = int(next(x for x in Path("/proc/meminfo").read_text().splitlines()
                          if x.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration):
        pass
    from importlib.metadata import version

    return {
        "cpu": cpu, "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(), "ram_gib": round(mem_kb / 2**20, 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
        "python": py_platform.python_version(), "torch": torch.__version__,
        "megatron_core": version("megatron-core"), "transformers": version("transformers"),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The model shape and batch options build_model and make_batch read (set_defaults changes them)."""
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=0, help="default hidden / heads")
    p.add_argument("--inter", type=int, default=0, help="MLP size (default 3 x hidden)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rows", type=int, default=8, help="sequences per train step")
    p.add_argument("--seq", type=int, default=256, help="padded length; rows are seq/2..seq long")
    p.add_argument("--micro-batch", type=int, default=4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default="")
    p.add_argument("--profile", default="", help="also write torch.profiler tables of one train step per side here")
    p.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="Adam state in host memory (actor.optimizer_cpu_offload)")
    p.add_argument("--optimizer-state-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--optimizer-chunk-mb", type=int, default=256)
    a = p.parse_args()

    sys.path.insert(0, TESTS)
    from batches import build_actor

    from colocate_rl import platform
    from colocate_rl.config import Config, ModelConfig

    dev = platform.device()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        path = build_model(Path(tmp), a)
        cfg = Config(model=ModelConfig(path=str(path), dtype=a.dtype))
        cfg.actor.lr, cfg.actor.micro_batch_size = 1e-6, a.micro_batch
        cfg.actor.optimizer_cpu_offload = a.optimizer_cpu_offload
        cfg.actor.optimizer_state_dtype, cfg.actor.optimizer_chunk_mb = a.optimizer_state_dtype, a.optimizer_chunk_mb
        actor = build_actor(cfg)
        batch = make_batch(a)
        tokens = float(batch.attention_mask.sum())
        n_params = sum(p.numel() for p in actor.model.module.parameters())

        old = actor.compute_logprobs(batch)
        batch.rollout_logprobs = torch.where(batch.loss_mask, old, 0)
        hf_train, hf_score = hf_baseline(path, batch, a, cfg, dev)
        # Interleaved, medians: other processes on the machine slow both sides alike.
        fns = {"ours_train": lambda: actor.train_step(batch, old), "hf_train": hf_train,
               "ours_score": lambda: actor.compute_logprobs(batch), "hf_score": hf_score}
        for fn in fns.values():
            fn()  # warm-up
        runs = {k: [] for k in fns}
        for _ in range(a.repeat):
            for k, fn in fns.items():
                runs[k].append(seconds(fn))
        t = {k: sorted(v)[a.repeat // 2] for k, v in runs.items()}
        _sync()
        held = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0  # between steps
        if a.profile:
            write_profile(Path(a.profile), {"ours (Megatron actor)": fns["ours_train"], "transformers": hf_train})
        nbytes, _ = actor.offload()  # the first cycle allocates the host buffers
        actor.onload()
        d2h, h2d = memcpy_fns(nbytes, dev)
        d2h(), h2d()
        copies = {"offload": [], "onload": [], "d2h": [], "h2d": []}
        for _ in range(a.repeat):  # interleaved, as above
            copies["offload"].append(seconds(actor.offload))
            copies["onload"].append(seconds(actor.onload))
            copies["d2h"].append(seconds(d2h))
            copies["h2d"].append(seconds(h2d))
        t_off, t_on, d2h, h2d = (sorted(copies[k])[a.repeat // 2] for k in ("offload", "onload", "d2h", "h2d"))

    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    result = {
        "machine": machine_info(), "device": str(dev),
        "shape": {"params": n_params, "hidden": a.hidden, "layers": a.layers, "heads": a.heads,
                  "kv_heads": a.kv_heads, "vocab": a.vocab, "dtype": a.dtype, "rows": a.rows, "seq": a.seq,
                  "micro_batch": a.micro_batch, "real_tokens": tokens},
        "train_step": {"ours_tokens_per_s": tokens / t["ours_train"], "hf_tokens_per_s": tokens / t["hf_train"],
                       "ratio_ours_over_hf": t["hf_train"] / t["ours_train"]},
        "logprobs": {"ours_tokens_per_s": tokens / t["ours_score"], "hf_tokens_per_s": tokens / t["hf_score"],
                     "ratio_ours_over_hf": t["hf_score"] / t["ours_score"]},
        "offload": {"bytes": nbytes, "ours_GBps": gbps(t_off), "memcpy_GBps": gbps(d2h),
                    "ratio_ours_over_memcpy": d2h / t_off},
        "onload": {"bytes": nbytes, "ours_GBps": gbps(t_on), "memcpy_GBps": gbps(h2d),
                   "ratio_ours_over_memcpy": h2d / t_on},
        "optimizer": {"cpu_offload": a.optimizer_cpu_offload, "state_dtype": a.optimizer_state_dtype,
                      "chunk_mb": a.optimizer_chunk_mb, "ours_train_step_s": t["ours_train"],
                      "device_bytes_between_steps": held},
    }
    print(json.dumps(result, indent=2))
    suffix = "_host_adam" if a.optimizer_cpu_offload else ""
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"actor_step_{platform.kind()}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
