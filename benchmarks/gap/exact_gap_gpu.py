"""Exact on-policy mode, end to end on one GPU (Qwen3-0.6B shape, bf16): where the remaining
trainer/sampler logprob gap sits. One colocated session with rollout.exact=true samples 8 prompts x 4;
the actor scores the batch; vLLM then re-reads the same sequences as prompts (its prefill, prompt
logprobs at temperature 1). Three gaps, mean |difference| per response token and the share of tokens
that differ at all:

- actor vs sampler at the run's temperature (what train_rollout_logprob_abs_diff reports);
- actor vs sampler, both at temperature 1;
- actor vs vLLM's prefill of the same tokens (temperature 1): the kernels themselves.

Then the three at T=1 over batches of other compositions (cases_t1: 1 x 1 up to 64 x 8, seeded or
not, after a prefix-cache reset): a kernel whose result depends on how many tokens share its launch
shows up as a gap that moves with the batch (rollout/invariant_norm.py is such a find).

    python benchmarks/gap/exact_gap_gpu.py --out gap.json [--temperature 1.0] [--set rollout.enforce_eager=false]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    d = (a - b)[mask].abs()
    return {"tokens": d.numel(), "mean_abs": float(d.mean()), "max_abs": float(d.max()),
            "differ_frac": float((d > 0).float().mean())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--out", default="")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. rollout.enforce_eager=false")
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]
    from gpu_runs import planned
    from test_exact_gpu import session_cfg  # the GPU test's session: 32 prompts x 4, 96 tokens

    from colocate_rl.models.tiny import ensure_model
    from colocate_rl.session import start_session

    tmp = Path(".cache/exact_gap")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = session_cfg(tmp, ensure_model("qwen3-0.6b", tmp / "model", dtype="bfloat16"))
    cfg.rollout.temperature = args.temperature
    if args.set:
        from colocate_rl.config import load

        cfg = load(cfg, overrides=args.set)
    s = start_session(*planned(cfg))
    result = {"machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "vllm": __import__("vllm").__version__}, "temperature": args.temperature}
    try:
        actor, samples = s.actor, s.train_samples[:8]
        sampling = actor.sampling  # the actor runs in this process (placement.launcher=local)

        def actor_logprobs(batch, temperature):
            with s.handoff.actor_owned(changes_weights=False):
                actor.sampling = replace(sampling, temperature=temperature)
                try:
                    return actor.compute_logprobs(batch)
                finally:
                    actor.sampling = sampling

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
        # The same measurement at T=1 over batches of other compositions: which of the batch's
        # size, the samples per prompt, the seeding and the prefix cache's state moves the gap.
        cases = {"8 prompts x 4 again": dict(prompts=8, n=4, seed=3),
                 "8 prompts x 4, prefix cache reset first": dict(prompts=8, n=4, seed=3, reset=True),
                 "64 prompts x 8": dict(prompts=64, n=8, seed=3),
                 "8 prompts x 1": dict(prompts=8, n=1, seed=3),
                 "1 prompt x 1": dict(prompts=1, n=1, seed=3),
                 "8 prompts x 4, unseeded": dict(prompts=8, n=4, seed=None)}
        result["cases_t1"] = {}
        for name, c in cases.items():
            if c.get("reset"):
                s.rollout.llm.reset_prefix_cache()
            b = s.rollout.generate(s.train_samples[:c["prompts"]], n=c["n"], seed=c["seed"], temperature=1.0)
            lp, pre = actor_logprobs(b, 1.0), s.rollout.prefill_logprobs(b)
            row = {"actor_vs_sampler": gap(lp, b.rollout_logprobs, b.loss_mask),
                   "actor_vs_prefill": gap(lp, pre, b.loss_mask),
                   "prefill_vs_sampler": gap(pre, b.rollout_logprobs, b.loss_mask)}
            result["cases_t1"][name] = row
            print(name, {k: (v["mean_abs"], round(v["differ_frac"], 3)) for k, v in row.items()}, flush=True)
    finally:
        s.close()
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
