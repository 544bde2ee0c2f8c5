"""How far bf16 moves a random-weight Qwen3's logprobs from its own fp32 ones, by width and depth:
the floor under the trainer/sampler gap of the GPU runs, which use such models (no hub here).

    python benchmarks/gap/bf16_width_cpu.py      # ~8 min on 2 cores; writes benchmarks/results/bf16_width_cpu.json

One transformers model per shape (the real config, random weights as the GPU benchmarks build them,
fewer layers where noted by @L), 4 random prompts of 16 tokens, 48 tokens sampled at T=1 from the
fp32 model; then the same weights in bf16 score the same sequences. Reported per shape: mean
|logprob(bf16) - logprob(fp32)| over the sampled tokens, the fp32 model's mean entropy and the
standard deviation of its log-probabilities over the vocabulary (the logits' spread). Both sides
here are one library's kernels on one CPU: the number is the model's sensitivity to bf16, not any
engine's difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common/
from common.cpu_results import add_run  # noqa: E402

RESULT = Path(__file__).resolve().parents[1] / "results" / "bf16_width_cpu.json"


def measure(shape: str, prompts: int = 4, prompt_len: int = 16, new: int = 48) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from colocate_rl.models.tiny import shape_config

    spec = dict(shape_config(shape))
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, config.vocab_size, (prompts, prompt_len), generator=g)
    with torch.no_grad():
        for _ in range(new):  # sampled from the fp32 model, as an engine samples from its own
            probs = model(seq).logits[:, -1].float().softmax(-1)
            seq = torch.cat([seq, torch.multinomial(probs, 1, generator=g)], dim=1)
        fp32 = model(seq).logits.float().log_softmax(-1)[:, prompt_len - 1:-1]
        bf16 = model.to(torch.bfloat16)(seq).logits.float().log_softmax(-1)[:, prompt_len - 1:-1]
    tokens = seq[:, prompt_len:, None]
    gap = (fp32.gather(-1, tokens) - bf16.gather(-1, tokens)).abs()
    return {"bf16_vs_fp32_gap_mean": float(gap.mean()), "bf16_vs_fp32_gap_max": float(gap.max()),
            "entropy_mean": float(-(fp32.exp() * fp32).sum(-1).mean()), "logprob_std": float(fp32.std(-1).mean()),
            "hidden": config.hidden_size, "layers": config.num_hidden_layers, "tokens": int(gap.numel())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="*", default=["qwen3-0.6b@4", "qwen3-0.6b", "qwen3-8b@4", "qwen3-8b@12"])
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args()
    for shape in args.shapes:
        run = measure(shape)
        print(f"{shape}: gap {run['bf16_vs_fp32_gap_mean']:.4f} (max {run['bf16_vs_fp32_gap_max']:.3f}), "
              f"entropy {run['entropy_mean']:.2f}, logprob std {run['logprob_std']:.3f}", flush=True)
        add_run(args.out, "benchmarks/gap/bf16_width_cpu.py", shape, run)


if __name__ == "__main__":
    main()
