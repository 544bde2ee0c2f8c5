"""Exact on-policy mode, end to end on one GPU (Qwen3-0.6B shape, bf16): where the remaining
trainer/sampler logprob gap sits. One colocated session with rollout.exact=true samples 8 prompts x 4;
the actor scores the batch; vLLM then re-reads the same sequences as prompts (its prefill, prompt
logprobs at temperature 1). Three gaps, mean |difference| per response token and the share of tokens
that differ at all:

- actor vs sampler at the run's temperature (what train_rollout_logprob_abs_diff reports);
- actor vs sampler, both at temperature 1;
- actor vs vLLM's prefill of the same tokens (temperature 1): the kernels themselves.

    python benchmarks/exact_gap_gpu.py --out benchmarks/results/exact_gap_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    d = (a - b)[mask].abs()
    return {"tokens": d.numel(), "mean_abs": float(d.mean()), "max_abs": float(d.max()),
            "differ_frac": float((d > 0).float().mean())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]
    from test_exact_gpu import session_cfg  # the GPU test's session: 32 prompts x 4, 96 tokens

    from colocate_rl.models.tiny import ensure_model
    from colocate_rl.session import start_session

    tmp = Path(".cache/exact_gap")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = session_cfg(tmp, ensure_model("qwen3-0.6b", tmp / "model", dtype="bfloat16"))
    cfg.rollout.temperature = args.temperature
    s = start_session(cfg)
    result = {"machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "vllm": __import__("vllm").__version__}, "temperature": args.temperature}
    try:
        actor, samples = s.actor, s.train_samples[:8]

        def actor_logprobs(batch, temperature):
            with s.handoff.actor_owned(changes_weights=False):
                actor.cfg.rollout.temperature = temperature
                try:
                    return actor.compute_logprobs(batch)
                finally:
                    actor.cfg.rollout.temperature = args.temperature

        batch = s.rollout.generate(samples, seed=3)
        result["actor_vs_sampler"] = gap(actor_logprobs(batch, args.temperature), batch.rollout_logprobs,
                                         batch.loss_mask)
        plen = batch.attention_mask.sum(1) - batch.response_lens
        first = torch.zeros_like(batch.loss_mask)
        first[torch.arange(batch.size), plen] = True  # its logprob comes from the prompt's prefill
        result["actor_vs_sampler_first_token"] = gap(actor_logprobs(batch, args.temperature),
                                                     batch.rollout_logprobs, first & batch.loss_mask)

        b1 = s.rollout.generate(samples, seed=3, temperature=1.0)
        lp1 = actor_logprobs(b1, 1.0)
        result["actor_vs_sampler_t1"] = gap(lp1, b1.rollout_logprobs, b1.loss_mask)
        prefill = s.rollout.prefill_logprobs(b1)
        result["actor_vs_vllm_prefill_t1"] = gap(lp1, prefill, b1.loss_mask)
        result["sampler_vs_vllm_prefill_t1"] = gap(b1.rollout_logprobs, prefill, b1.loss_mask)
    finally:
        s.close()
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
