"""Train/rollout logprob gap of a small DeepSeek-V4: vLLM (which has DeepSeek-V4 on GPU) samples
with logprobs, the Megatron actor re-scores the same tokens, both in bf16 on one GPU.

    python benchmarks/gap/dsv4_parity_gpu.py OUT.json [--weights fp8|bf16] [--kv-cache-dtype fp8]

vLLM 0.26's DeepSeek-V4 on NVIDIA needs more than vLLM's own packages: `compressed-tensors` and
`loguru` (imported on load), an FP8 KV cache (its fp8_ds_mla cache layout), the released FP8
weight layout (with bf16 weights its loader fails: 'ColumnParallelLinear' object has no attribute
'weight_scale_inv'), the CuTe DSL (nvidia-cutlass-dsl, quack-kernels) for its compressor kernels,
and a CUDA compiler for the JITs of tilelang (mHC) and DeepGEMM (vendored in vLLM):
scripts/dsv4_gpu_wheels.sh gathers tilelang, the CuTe DSL and the CUDA 13 compiler wheels and writes
the install step that sets CUDA_HOME up.

Self-contained: writes a random-weight DeepSeek-V4 in the official format into a temp folder. Its
attention keeps the released per-head sizes (head_dim 512, rope 64, index_head_dim 128, 64 heads,
128-token windows, index_topk 512), which vLLM's kernels require; it is small elsewhere (hidden
1024, 4 layers: window, C4 + indexer, C128, C4; 2 hash-routed layers; 16 experts, top 4).
Prompts are 300-700 tokens so the C4 and C128 branches both have entries.

--weights fp8 (default) writes the released layout (FP8 e4m3 128x128 blocks with ue8m0 scales,
MXFP4 routed experts), which vLLM computes with FP8 kernels and the actor loads dequantised; bf16
writes plain bf16 tensors (for a vLLM build that takes them). vLLM runs in a child process (its GPU
memory is freed before the actor builds); its whole log is kept next to the model. Also reported:
transformers' fp32 forward against both, to tell which side moves.

Output JSON: train_rollout_logprob_abs_diff {mean, p50, p99, max} over response tokens, the same
for transformers, token counts, versions, GPU name, the model config and the settings used; then
(bf16 weights, unless --no-sync) after one GRPO step and a weight sync into an in-process vLLM
engine, the gap on freshly sampled responses (after_one_step_and_sync).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # batches.py builds the actor and engine

from colocate_rl.models.deepseek_v4.synth import VLLM_SMALL as SHAPE  # noqa: E402

N_PROMPTS, N_SAMPLES, MAX_TOKENS = 8, 4, 128


def write_model(folder: Path, weights: str) -> dict:
    from colocate_rl.models.deepseek_v4 import synth

    hf = synth.official_config(**SHAPE)
    synth.write_model(folder, hf, seed=0, dtype="bfloat16", quantized=weights == "fp8")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    return hf


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(300, 700, (N_PROMPTS,), generator=g)
    return [torch.randint(2, SHAPE["vocab_size"], (int(n),), generator=g).tolist() for n in lens]


def vllm_stage(folder: str, out: str, kv_cache_dtype: str) -> None:
    """Child process: sample N_SAMPLES responses per prompt with their logprobs."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=1024,
              gpu_memory_utilization=0.5, enforce_eager=True, logprobs_mode="processed_logprobs",
              kv_cache_dtype=kv_cache_dtype, seed=0)
    params = SamplingParams(n=N_SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True,
                            detokenize=False, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    rows = []
    for o in outs:
        for c in sorted(o.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            rows.append({"prompt": list(o.prompt_token_ids), "response": ids,
                         "logprobs": [float(c.logprobs[j][t].logprob) for j, t in enumerate(ids)]})
    Path(out).write_text(json.dumps(rows))


def run_vllm(folder: Path, kv_cache_dtype: str) -> tuple[list[dict] | None, str]:
    out = folder / "vllm_rows.json"
    # FlashInfer's wrapper of DeepGEMM's FP8 block GEMM (vLLM's first pick on Hopper) JIT-builds against
    # the full CUDA toolkit (nvrtc.h, cublasLt.h); the next pick is DeepGEMM itself, the same kernels.
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_DISABLED_KERNELS", "FlashInferFp8DeepGEMMDynamicBlockScaledKernel")
    r = subprocess.run([sys.executable, __file__, "--vllm-stage", str(folder), str(out), kv_cache_dtype], env=env,
                       capture_output=True, text=True)
    log = folder / "vllm_stage.log"
    log.write_text(r.stdout + r.stderr)
    if r.returncode != 0 or not out.is_file():
        lines = [ln for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error:" in ln]  # the exception, not exit-time warnings
        print(f"vLLM stage failed (full log: {log}):\n" + "\n".join(lines[-40:]), file=sys.stderr)
        return None, (errors or lines or ["(no output)"])[-1]
    return json.loads(out.read_text()), ""


def sync_stage(cfg, actor, batch) -> dict:
    """The colocated path in one process: one GRPO step on the sampled batch, the actor's weights
    (official names) into an in-process vLLM engine through the IPC sync, a fresh sample, the gap
    again. A sync that loaded nothing would show as a gap of the size of the step."""
    from batches import build_engine

    from colocate_rl.types import Sample

    cfg.actor.lr = 1e-4
    cfg.rollout.max_model_len, cfg.rollout.gpu_memory_utilization, cfg.rollout.enforce_eager = 1024, 0.3, True
    g = torch.Generator().manual_seed(3)
    batch.advantages = torch.randn(batch.size, generator=g)
    before = actor.compute_logprobs(batch)
    m = actor.train_step(batch, before)
    moved = (actor.compute_logprobs(batch) - before).abs()[batch.loss_mask].mean().item()
    engine = build_engine(cfg)
    try:
        stats_ = engine.update_weights(actor.export_hf_weights())
        fresh = engine.generate([Sample(p) for p in prompts()], n=N_SAMPLES, max_tokens=MAX_TOKENS, seed=5)
    finally:
        engine.shutdown()
    gap = (actor.compute_logprobs(fresh) - fresh.rollout_logprobs).abs()[fresh.loss_mask]
    return {"train_rollout_logprob_abs_diff": stats(gap), "step_moved_logprobs_mean": moved,
            "grad_norm": m["grad_norm"], "sync_bytes": stats_.bytes, "sync_seconds": stats_.seconds,
            "response_tokens": int(fresh.loss_mask.sum())}


def stats(d: torch.Tensor) -> dict:
    d = d.double()
    return {"mean": float(d.mean()), "p50": float(d.quantile(0.5)), "p99": float(d.quantile(0.99)),
            "max": float(d.max())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--weights", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM kv_cache_dtype (DeepSeek-V4 may force fp8)")
    ap.add_argument("--keep", help="keep the model folder here instead of a temp folder")
    ap.add_argument("--no-sync", action="store_true", help="skip the step + weight sync + re-sample stage")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks/gap/dsv4_parity_gpu.py needs a GPU (vLLM's DeepSeek-V4 is GPU-only here)")

    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="dsv4_parity_"))
    folder = root / a.weights
    hf = write_model(folder, a.weights)
    t0 = time.perf_counter()
    rows, err = run_vllm(folder, a.kv_cache_dtype)
    vllm_s = time.perf_counter() - t0
    if rows is None:
        Path(a.out).write_text(json.dumps({"error": err, "weights": a.weights, "vllm_seconds": vllm_s}, indent=1))
        raise SystemExit(f"error: vLLM could not run the tiny DeepSeek-V4: {err}")

    result = measure(folder, rows, hf, a.no_sync, torch.device("cuda"))
    result.update(weights=a.weights, kv_cache_dtype=a.kv_cache_dtype, vllm_seconds=vllm_s)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("train_rollout_logprob_abs_diff", "weights", "response_tokens")}))


def measure(folder: Path, rows: list[dict], hf: dict, no_sync: bool, dev: torch.device) -> dict:
    """The actor (and transformers) re-score vLLM's rows; then the step + sync stage (bf16 only)."""
    from colocate_rl.config import Config, ModelConfig
    from colocate_rl.types import RolloutBatch, Sample

    quantized = "quantization_config" in json.loads((folder / "config.json").read_text())
    cfg = Config(model=ModelConfig(path=str(folder), dtype="bfloat16"))
    cfg.actor.micro_batch_size = 4
    cfg.rollout.temperature = 1.0
    samples = [Sample(r["prompt"]) for r in rows]
    batch = RolloutBatch.from_rows([r["prompt"] for r in rows], [r["response"] for r in rows], samples, 0,
                                   response_logprobs=[r["logprobs"] for r in rows],
                                   finish_reasons=["length"] * len(rows), n=N_SAMPLES)
    from batches import build_actor

    actor = build_actor(cfg)
    t0 = time.perf_counter()
    train = actor.compute_logprobs(batch)
    score_s = time.perf_counter() - t0
    mask = batch.loss_mask
    gap = (train - batch.rollout_logprobs).abs()[mask]

    from colocate_rl.models.deepseek_v4.synth import transformers_model

    # transformers has deepseek_v4 from 5.23 (an older one skips this reference). It runs in fp32: its bf16
    # forward feeds the fp32 mHC output into bf16 linears and fails; fp32 is the better reference anyway.
    ref_lp, ref_skipped = torch.zeros_like(train), None
    try:
        ref = transformers_model(folder, torch.float32).to(dev)
        with torch.no_grad():
            for i in range(batch.size):
                n = int(batch.attention_mask[i].sum())
                ids = batch.tokens[i: i + 1, :n].to(dev)
                lp = torch.log_softmax(ref(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
                ref_lp[i, 1:n] = lp.cpu()
        del ref
    except Exception as e:  # noqa: BLE001 - recorded in the JSON: the actor-vs-vLLM figure stands on its own
        ref_skipped = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    after_sync = {"skipped": "runs with bf16 weights only (an FP8 engine takes synced weights through "
                             "rollout.weight_quantization, a disaggregated-mode path)"}
    if not quantized and not no_sync:
        try:
            after_sync = sync_stage(cfg, actor, batch)
        except Exception as e:  # noqa: BLE001 - recorded in the JSON: the first figure stands on its own
            after_sync = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    import vllm

    return {
        "train_rollout_logprob_abs_diff": stats(gap),
        "transformers_vs_megatron_abs_diff": ref_skipped or stats((ref_lp - train).abs()[mask]),
        "transformers_vs_vllm_abs_diff": ref_skipped or stats((ref_lp - batch.rollout_logprobs).abs()[mask]),
        "response_tokens": int(mask.sum()), "rows": batch.size,
        "megatron_rescore_seconds": score_s,
        "after_one_step_and_sync": after_sync,
        "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "vllm": vllm.__version__,
        "torch": torch.__version__, "model": hf, "temperature": 1.0, "max_tokens": MAX_TOKENS,
    }


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--vllm-stage":
        vllm_stage(*sys.argv[2:5])
    else:
        main()
