"""Which part of an FP8 DeepSeek-V4 engine's arithmetic moves the logprobs, emulated on the CPU.

    python benchmarks/gap/fp8_parts_cpu.py                       # deepseek-v4-mini, 2 layers, 2 x 256 tokens
    python benchmarks/gap/fp8_parts_cpu.py --set num_hidden_layers=4 'compress_ratios=[0,4,128,4]'

At step 1 of the mini preset the engine's weights are the actor's exactly (the checkpoint is in the
released FP8/MXFP4 format and the actor loads it dequantised), yet their logprobs differ by 0.064 per
token (docs/lab/performance_log.md). What vLLM's DeepSeek-V4 does in low precision besides the weights:
- **FP8 GEMM inputs**: every FP8 linear (wq_a, wkv, wq_b, wo_a, wo_b, the indexer's wq_b, the
  shared experts) quantises its input per token in groups of 128 channels to e4m3 with power-of-two
  (UE8M0) scales before the FP8 x FP8 GEMM;
- **FP8 KV cache** (``fp8_ds_mla``, the only cache layout vLLM 0.26 builds for this model): each
  cached key (the shared K=V head and every compressed entry) keeps its 448 non-rotary channels as
  e4m3 in blocks of 64 with UE8M0 scales, its 64 rotary channels in bf16
  (vllm/models/deepseek_v4/common/ops/cache_utils.py, quantize_and_insert_k_cache).
Each is applied here to the actor's own bf16 forward (Megatron, the project's DeepSeek-V4 modules) by
the actor's own emulation of them (models/deepseek_v4/fp8_emulation.py, actor.emulate_rollout_fp8)
and the logprobs compared with the plain forward's, on the same token sequences:
- on the sequences' tokens (random tokens: this measures the model's sensitivity, not a rollout);
- as a rollout would see it: at each position the mean over the vocabulary of |Δ log p(v)|
  weighted by the plain forward's p(v), the expected gap of a token sampled there.
The roundings are vLLM's kernels' arithmetic; the GEMMs themselves run on the rounded bf16 values,
so their accumulation order is the CPU's, not DeepGEMM's. Not emulated: the indexer's FP8 scoring.
Writes benchmarks/results/fp8_parts_cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common/
from common.cpu_results import add_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def stats(x: torch.Tensor) -> dict[str, float]:
    x = x.flatten().float()
    return {"mean": float(x.mean()), "p50": float(x.quantile(0.5)), "p99": float(x.quantile(0.99)),
            "max": float(x.max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="deepseek-v4-mini")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--set", nargs="*", default=["num_hidden_layers=2", "compress_ratios=[0,4]", "n_routed_experts=8"],
                   metavar="KEY=JSON", help="config changes (default: the mini shape cut to a window and a C4 layer)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/fp8_parts_cpu.json"))
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    from colocate_rl import platform
    from colocate_rl.models.build import build_and_load
    from colocate_rl.models.deepseek_v4.config import Hparams
    from colocate_rl.models.deepseek_v4.model import emulate_fp8_engine as install
    from colocate_rl.models.deepseek_v4.synth import write_model
    from colocate_rl.models.tiny import shape_config
    from colocate_rl.trainer.distributed import init_model_parallel, init_process_group

    platform.setup_platform()
    init_process_group()
    init_model_parallel(1, 1, 1, 0)
    hf = shape_config(a.shape)
    changes = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in a.set)}
    hf.update(changes)
    hf.pop("quantization_config", None)  # the weights are the engine's either way; bf16 here
    with tempfile.TemporaryDirectory() as tmp:
        model, _, _ = build_and_load(write_model(Path(tmp), hf, dtype="bfloat16"), torch.bfloat16,
                                     use_cpu_initialization=True)
    model.eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, hf["vocab_size"], (a.rows, a.seq), generator=g)

    rope_dim = Hparams.from_official(hf).rope_dim

    @torch.no_grad()
    def logprobs(**emulate) -> torch.Tensor:  # [rows, seq - 1, vocab] float32
        remove = install(model, rope_dim, **emulate) if emulate else (lambda: None)
        try:
            return model(tokens)[:, :-1].float().log_softmax(-1)
        finally:
            remove()

    plain = logprobs()
    probs = plain.exp()
    target = tokens[:, 1:, None]
    runs = {}
    for name, emulate in (("fp8_gemm_inputs", dict(gemm_inputs=True, kv_cache=False)),
                          ("fp8_kv_cache", dict(gemm_inputs=False, kv_cache=True)),
                          ("both", dict(gemm_inputs=True, kv_cache=True))):
        lp = logprobs(**emulate)
        diff = (lp - plain).abs()
        expected = (probs * diff).sum(-1)  # [rows, seq - 1]
        runs[name] = {"on_the_tokens": stats(diff.gather(-1, target)),
                      "expected_for_a_sampled_token": stats(expected),
                      "first_position_expected": float(expected[:, 0].mean())}
        r = runs[name]
        print(f"{name:>16}: on the tokens mean {r['on_the_tokens']['mean']:.4f} p99 {r['on_the_tokens']['p99']:.4f}"
              f" | sampled-token expectation mean {r['expected_for_a_sampled_token']['mean']:.4f} "
              f"p50 {r['expected_for_a_sampled_token']['p50']:.4f} p99 {r['expected_for_a_sampled_token']['p99']:.4f}",
              flush=True)
    add_run(a.out, "fp8_parts_cpu", " ".join([a.shape, *a.set, f"{a.rows}x{a.seq}"]),
            {"shape": a.shape, "config_changes": changes, "rows": a.rows, "seq": a.seq, "dtype": "bfloat16", **runs},
            h200_gap_for_comparison={"file": "dsv4_mini_kv_ablation_h200.json", "what": "train_rollout_logprob_abs_"
                                     "diff of the mini preset's step 1 (4 layers, R3 on)",
                                     "mean": 0.0636, "p50": 0.0453, "p99": 0.2548, "max": 0.9115})


if __name__ == "__main__":
    main()
