"""The actor's per-token logprobs, forward and backward, chunked (fp32 copies by row chunks) vs fused
(compiled kernels over the 16-bit logits; actor.logprob_kernel), in one run, against the device's
own copy bandwidth.

    python benchmarks/kernels/logprobs_kernels.py --out benchmarks/results/logprobs_kernels_h200.json

One micro-batch's logits as the train step sees them: 16 sequences of 288 and of 1056 tokens
(64 x 8 x 256 and x 1024 responses after a 32-token prompt), Qwen3's 151,936-word vocabulary,
bf16. Each path: one warm-up call (the fused one compiles there), then the median of --repeat
forward + backward calls. Also: the two paths' largest logprob difference and the gradients'
relative difference, and a plain copy of the logits (read + write) as the bandwidth reference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from actor_step import machine_info, timed


def one_shape(rows: int, vocab: int, dev, repeat: int) -> dict:
    from colocate_rl.trainer.logprobs import token_logprobs

    g = torch.Generator(device=dev).manual_seed(0)
    logits = (3 * torch.randn(1, rows, vocab, generator=g, device=dev)).to(torch.bfloat16)
    tokens = torch.randint(0, vocab, (1, rows), generator=g, device=dev)
    grad = torch.randn(1, rows, generator=g, device=dev)

    def run(fused: bool):
        x = logits.detach().requires_grad_()
        lp = token_logprobs(x, tokens, fused=fused)
        lp.backward(grad)
        return lp.detach(), x.grad

    seconds = {name: timed(lambda f=fused: run(f), repeat)
               for name, fused in (("chunked", False), ("fused", True))}
    copy_s = timed(lambda: logits.clone(), repeat)
    (lp_c, g_c), (lp_f, g_f) = run(False), run(True)
    nbytes = logits.numel() * logits.element_size()
    return {
        "rows": rows, "vocab": vocab, "logits_GB": nbytes / 1e9,
        "seconds": seconds, "chunked_vs_fused": seconds["chunked"] / seconds["fused"],
        # A copy reads and writes the logits once: the floor for a pass that reads them and writes a gradient.
        "copy_s": copy_s, "copy_GBps": 2 * nbytes / copy_s / 1e9,
        "fused_vs_one_copy": seconds["fused"] / copy_s,
        "logprob_max_abs_diff": (lp_c - lp_f).abs().max().item(),
        "grad_rel_diff": ((g_c.float() - g_f.float()).norm() / g_c.float().norm()).item(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", default=[16 * 288, 16 * 1056])
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default="")
    a = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {
        "benchmark": "logprobs_kernels",
        "machine": machine_info(),
        "shapes": [],
    }
    for rows in a.rows:  # each shape printed and written as it finishes
        s = one_shape(rows, a.vocab, dev, a.repeat)
        result["shapes"].append(s)
        sec = s["seconds"]
        print(f"{s['rows']} rows x {s['vocab']}: chunked {sec['chunked'] * 1e3:.1f} ms, fused {sec['fused'] * 1e3:.1f} "
              f"ms ({s['chunked_vs_fused']:.2f}x), one copy {s['copy_s'] * 1e3:.1f} ms ({s['copy_GBps']:.0f} GB/s); "
              f"max |diff| {s['logprob_max_abs_diff']:.2e}, grad {s['grad_rel_diff']:.2e}", flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
