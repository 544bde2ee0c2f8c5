"""What the actor's training forward keeps for its backward, by module, against the memory plan.

    python benchmarks/memory/activation_census.py                                  # qwen3-0.6b@2, 4 x 288 tokens
    python benchmarks/memory/activation_census.py --shape qwen3-8b@1 --set vocab_size=32768 --rows 2
    python benchmarks/memory/activation_census.py --shape qwen3-moe-small@2
    python benchmarks/memory/activation_census.py --shape deepseek-v4-mini --rows 2 --seq 256 \
        --set num_hidden_layers=2 n_routed_experts=8 'compress_ratios=[0,4]' vocab_size=32768

One micro-batch runs through the actor's own forward and backward (Actor.activation_census: what
autograd saves, by module, counted once per storage, parameters left out; the bytes do not depend
on the device, so the census runs on a CPU and holds on a GPU). Prints the bytes per token of one
decoder layer and of the output head + loss next to what the memory plan counts for them
(memory.activation_bytes), and records them under the shape's name in
benchmarks/results/activation_census_cpu.json (or --out). --set changes the shape's config (JSON
values): fewer layers, experts or vocabulary entries fit a real-width layer in a small host, and a
layer's bytes per token do not depend on them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]  # common/; batches.py builds the actor
from common.cpu_results import add_run  # noqa: E402


def make_batch(rows: int, seq: int, vocab: int):
    """``rows`` full rows of ``seq`` tokens, the last three quarters scored."""
    from colocate_rl.types import RolloutBatch, Sample

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (rows, seq), generator=g)
    attn = torch.ones(rows, seq, dtype=torch.bool)
    loss = attn.clone()
    loss[:, : seq // 4] = False
    return RolloutBatch(
        tokens=tokens, attention_mask=attn, loss_mask=loss, rollout_logprobs=torch.zeros(rows, seq),
        prompt_lens=torch.full((rows,), seq // 4), response_lens=torch.full((rows,), seq - seq // 4),
        group_ids=torch.arange(rows) // 2, truncated=torch.zeros(rows, dtype=torch.bool),
        finish_reasons=["stop"] * rows, responses=[""] * rows, samples=[Sample([1])] * rows,
        advantages=torch.randn(rows, generator=g),
    )


def available_host_bytes() -> int:
    """MemAvailable (free plus reclaimable page cache), or the free pages where /proc has none."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def write_model(hf: dict, out: Path, dtype: str) -> Path:
    """A random-weight HF model folder of config ``hf``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if hf["model_type"] == "deepseek_v4":
        from colocate_rl.models.deepseek_v4.synth import write_model as write_dsv4

        return write_dsv4(out, hf, dtype=dtype)
    config = AutoConfig.for_model(**hf, dtype=dtype)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(str(out))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b@2", help="a model.synthesize shape (name@layers)")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=288)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="config changes, e.g. vocab_size=32768")
    p.add_argument("--fp32-residual", choices=("auto", "true", "false"), default="auto",
                   help="actor.fp32_residual (auto: unset, the project's default)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/activation_census_cpu.json"))
    a = p.parse_args()

    from batches import build_actor

    from colocate_rl.config import Config, ModelConfig
    from colocate_rl.memory import activation_bytes
    from colocate_rl.models.registry import model_size
    from colocate_rl.models.tiny import ensure_model, shape_config
    from colocate_rl.trainer.logprobs import CHUNK_ELEMENTS

    hf = shape_config(a.shape)
    changes = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in a.set)}
    hf.update(changes)
    hf.pop("quantization_config", None)  # a bf16 actor: the released format's FP8 is the engine's
    layers = hf["num_hidden_layers"]
    # The actor on the host holds ~20 bytes per parameter while it builds and loads (16-bit weights,
    # fp32 gradient buffers, the checkpoint read in; 9.6 GB of RSS measured for qwen3-8b@1 with a
    # 32,768-token vocabulary, 0.49B parameters): stop in one line rather than be killed for memory.
    size = model_size(hf)
    need, free = 20 * size.total, available_host_bytes()
    if need > free:
        raise SystemExit(f"{a.shape}: the actor needs ~{need / 2**30:.0f} GiB of host memory, {free / 2**30:.0f} GiB "
                         "are free: fewer layers or a smaller vocabulary (--set vocab_size=32768)")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(hf, Path(tmp), a.dtype) if changes else ensure_model(a.shape, Path(tmp) / "m", dtype=a.dtype)
        cfg = Config(model=ModelConfig(path=str(path), dtype=a.dtype))
        cfg.actor.micro_batch_size = a.rows
        cfg.data.max_prompt_tokens, cfg.rollout.max_response_tokens = a.seq // 4, a.seq - a.seq // 4
        cfg.actor.optimizer_cpu_offload = True  # host Adam: no device state for an update the census never runs
        cfg.actor.fp32_residual = None if a.fp32_residual == "auto" else a.fp32_residual == "true"
        actor = build_actor(cfg)
    groups = actor.activation_census(make_batch(a.rows, a.seq, hf["vocab_size"]))
    tokens = a.rows * a.seq
    in_layers = sum(n for k, n in groups.items() if k.startswith("decoder.layers.*"))
    head = sum(n for k, n in groups.items() if not k.startswith("decoder.layers.*"))
    fp32_residual = actor.resolved.kernels.fp32_residual
    plan_layer, plan_head = activation_bytes(size, tokens, element_bytes=actor.dtype.itemsize,
                                             residual_bytes=4 if fp32_residual else 0)
    plan_layer *= size.activation_factor  # a family's calibration (DeepSeek-V4's), as the plan applies it
    run = {
        "dtype": a.dtype, "fp32_residual": fp32_residual, "rows": a.rows, "seq": a.seq, "layers": layers,
        "config_changes": changes,
        "per_layer_bytes_per_token": {"measured": in_layers / layers / tokens, "planned": plan_layer / tokens},
        # The plan's head also holds two chunks of fp32 temporaries (the backward's), left out here.
        "head_bytes_per_token": {"measured": head / tokens,
                                 "planned": (plan_head - 8 * min(CHUNK_ELEMENTS, tokens * hf["vocab_size"])) / tokens},
        "by_module_bytes_per_token": {k: n / tokens for k, n in groups.items()},
    }
    print(f"{a.shape} {a.dtype}{', fp32 residual' if fp32_residual else ''}, {a.rows} x {a.seq} tokens")
    for what in ("per_layer_bytes_per_token", "head_bytes_per_token"):
        m, pl = run[what]["measured"], run[what]["planned"]
        print(f"  {what}: measured {m:,.0f}, planned {pl:,.0f} (measured / planned {m / pl:.2f})")
    for k, v in run["by_module_bytes_per_token"].items():
        print(f"    {v:>12,.0f} B/token  {k}")
    add_run(a.out, "activation_census", " ".join([a.shape, *a.set, *(["fp32_residual"] if fp32_residual else [])]), run)


if __name__ == "__main__":
    main()
