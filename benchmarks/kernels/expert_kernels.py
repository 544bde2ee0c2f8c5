"""One MoE layer's experts, forward and backward, sequential (megatron-core's SequentialMLP) vs
grouped (two torch grouped GEMMs; actor.expert_kernel), in one run.

    python benchmarks/kernels/expert_kernels.py --out benchmarks/results/expert_kernels_h200.json

The actor is built at Qwen3-30B-A3B's real width (128 experts of 8 active, hidden 2048, expert
width 768) cut to one layer, random bf16 weights; its first layer's experts take micro-batches of
--tokens tokens routed uniformly at random (what a micro-batch of 4 rows of 1056 tokens sends them:
4,224 tokens x 8 experts). Each kernel: one warm-up call, then the median of --repeat forward +
backward calls. Also: the two outputs' and the expert weights' gradients' relative differences.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from actor_step import TESTS, machine_info, timed


def routed(tokens: int, experts: int, topk: int, hidden: int, dev, g) -> tuple:
    """``tokens`` tokens sent to ``topk`` distinct experts each, sorted by expert as the dispatcher
    hands them over: (hidden [tokens * topk, hidden] bf16, tokens_per_expert [experts], probs)."""
    choice = torch.rand(tokens, experts, generator=g, device=dev).topk(topk, dim=1).indices
    per_expert = torch.bincount(choice.reshape(-1), minlength=experts)
    x = torch.randn(tokens * topk, hidden, generator=g, device=dev).to(torch.bfloat16)
    probs = torch.rand(tokens * topk, generator=g, device=dev) / topk
    return x, per_expert.cpu(), probs


def one_shape(layer, tokens: int, repeat: int, g) -> dict:
    cfg = layer.config
    dev = next(layer.parameters()).device
    x, per_expert, probs = routed(tokens, cfg.num_moe_experts, cfg.moe_router_topk, cfg.hidden_size, dev, g)
    grad = torch.randn(x.shape, generator=g, device=dev).to(torch.bfloat16)
    weights = list(layer.parameters())

    def run(grouped: bool):
        layer.grouped = grouped
        xi = x.detach().requires_grad_()
        out, _ = layer(xi, per_expert, probs)
        # autograd.grad, not backward: the gradients come back without the optimizer's buffers' hooks
        dx, *dw = torch.autograd.grad(out, [xi, *weights], grad)
        return out.detach(), dx, dw

    seconds = {name: timed(lambda f=grouped: run(f), repeat) for name, grouped in (("sequential", False),
                                                                                     ("grouped", True))}
    (o_s, dx_s, dw_s), (o_g, dx_g, dw_g) = run(False), run(True)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    return {
        "tokens": tokens, "routed_rows": x.shape[0], "experts": cfg.num_moe_experts, "topk": cfg.moe_router_topk,
        "tokens_per_expert_min_max": [int(per_expert.min()), int(per_expert.max())],
        "seconds": seconds, "sequential_vs_grouped": seconds["sequential"] / seconds["grouped"],
        "out_rel_diff": rel(o_g, o_s), "dx_rel_diff": rel(dx_g, dx_s),
        "dweight_rel_diff_max": max(rel(a, b) for a, b in zip(dw_g, dw_s)), "weights_compared": len(dw_s),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b@1")
    p.add_argument("--tokens", type=int, nargs="*", default=[4 * 1056, 16 * 288])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default="")
    a = p.parse_args()

    sys.path.insert(0, TESTS)
    from batches import build_actor

    from colocate_rl.config import Config, ModelConfig
    from colocate_rl.models.grouped_experts import GroupedExperts
    from colocate_rl.models.tiny import ensure_model

    folder = Path(tempfile.gettempdir()) / f"expert_kernels_{a.shape.replace('@', '_')}"
    cfg = Config(model=ModelConfig(path=str(ensure_model(a.shape, folder, dtype="bfloat16")), dtype="bfloat16"))
    cfg.actor.expert_kernel = "sequential"  # the benchmark switches the layer itself
    actor = build_actor(cfg)
    layer = next(m for m in actor.model.modules() if isinstance(m, GroupedExperts))
    assert layer.why_not_grouped is None, layer.why_not_grouped
    g = torch.Generator(device=next(layer.parameters()).device).manual_seed(0)
    result = {"benchmark": "expert_kernels", "shape": a.shape, "machine": machine_info(), "shapes": []}
    for tokens in a.tokens:  # each shape printed and written as it finishes
        s = one_shape(layer, tokens, a.repeat, g)
        result["shapes"].append(s)
        sec = s["seconds"]
        print(f"{s['tokens']} tokens ({s['routed_rows']} routed rows, {s['experts']} experts): sequential "
              f"{sec['sequential'] * 1e3:.1f} ms, grouped {sec['grouped'] * 1e3:.1f} ms "
              f"({s['sequential_vs_grouped']:.2f}x); rel. diff out {s['out_rel_diff']:.1e}, dx {s['dx_rel_diff']:.1e}, "
              f"dW max {s['dweight_rel_diff_max']:.1e} over {s['weights_compared']} weights", flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
