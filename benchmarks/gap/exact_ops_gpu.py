"""Where the trainer/sampler logprob gap comes from, op by op (GPU, Qwen3-0.6B sizes, bf16).

For each op of the Qwen3 forward, the default actor's computation (local Megatron spec: models/norm.py,
Megatron's rotary, torch's SiLU, SDPA, Megatron's vocab-parallel cross-entropy) is compared with the
kernel vLLM runs in its batch-invariant mode, on the same random inputs: the share of output elements
that differ and the largest difference. Two more rows check the properties exact mode rests on: a
linear's row does not change with the rows around it, and FlashAttention's decode (one query against
a paged KV cache) gives the bits of its prefill row.

    python benchmarks/gap/exact_ops_gpu.py --out benchmarks/results/exact_ops_h200.json
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["VLLM_BATCH_INVARIANT"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

B, S, H, HEADS, GROUPS, HD, INTER, VOCAB, EPS, THETA = 4, 512, 1024, 16, 8, 128, 3072, 151936, 1e-6, 1e6


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float(), b.float()
    ne = a != b
    return {"elements": a.numel(), "differ_frac": ne.float().mean().item(), "max_abs": (a - b).abs().max().item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from vllm.model_executor.layers.batch_invariant import init_batch_invariance, rms_norm_batch_invariant

    init_batch_invariance()
    from vllm import _custom_ops as ops
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from colocate_rl.models import exact

    from megatron.core import parallel_state as ps  # Megatron's rotary and cross-entropy read its groups

    from colocate_rl.trainer.distributed import init_process_group

    init_process_group()  # a world of one, its store on 127.0.0.1 only
    ps.initialize_model_parallel()
    torch.manual_seed(0)
    dev, bf = torch.device("cuda"), torch.bfloat16
    n = B * S
    rows = {}

    # RMSNorm of a fresh tensor: models/norm.py (fp32 normalise, round, times weight) vs vLLM's Triton kernel.
    x = torch.randn(n, H, device=dev, dtype=bf) * 3
    w = (1 + 0.1 * torch.randn(H, device=dev)).to(bf)
    ours = w * F.rms_norm(x.float(), (H,), eps=EPS).to(bf)
    rows["rms_norm"] = diff(ours, rms_norm_batch_invariant(x, w, EPS))
    # RMSNorm after the residual add: torch add, then the same norm, vs vLLM's fused CUDA kernel.
    res = torch.randn(n, H, device=dev, dtype=bf) * 10
    ours = w * F.rms_norm((res + x).float(), (H,), eps=EPS).to(bf)
    theirs, r2 = x.clone(), res.clone()
    ops.fused_add_rms_norm(theirs, r2, w, EPS)
    rows["add_rms_norm"] = diff(ours, theirs)
    rows["add_rms_norm.residual"] = diff(res + x, r2)

    # Rotary: Megatron's (local spec) vs vLLM's kernel with its own cos/sin cache.
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_config import TransformerConfig

    tc = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=HEADS, kv_channels=HD,
                           apply_rope_fusion=False, bf16=True, params_dtype=bf)
    freqs = RotaryEmbedding(HD, 1.0, rotary_base=THETA)(S)  # [S, 1, 1, HD]
    q = torch.randn(S, B, HEADS, HD, device=dev, dtype=bf)
    k = torch.randn(S, B, GROUPS, HD, device=dev, dtype=bf)
    ours_q = apply_rotary_pos_emb(q, freqs, config=tc)
    cache = exact.rope_cache(HD, THETA, 40960, bf)
    qv = q.transpose(0, 1).reshape(n, HEADS, HD).contiguous()
    kv = k.transpose(0, 1).reshape(n, GROUPS, HD).contiguous()
    pos = torch.arange(S, device=dev).repeat(B)
    ops.rotary_embedding(pos, qv, kv, HD, cache, True)
    rows["rotary"] = diff(ours_q.transpose(0, 1).reshape(n, HEADS, HD), qv)

    # SiLU-and-mul.
    gu = torch.randn(n, 2 * INTER, device=dev, dtype=bf) * 2
    g, u = gu.chunk(2, -1)
    out = gu.new_empty(n, INTER)
    torch.ops._C.silu_and_mul(out, gu)
    rows["silu_and_mul"] = diff(F.silu(g) * u, out)

    # Attention: SDPA (the default actor) vs FlashAttention 3 as vLLM calls it.
    q = torch.randn(n, HEADS, HD, device=dev, dtype=bf)
    kk = torch.randn(n, GROUPS, HD, device=dev, dtype=bf)
    vv = torch.randn(n, GROUPS, HD, device=dev, dtype=bf)
    scale = HD ** -0.5
    sd = F.scaled_dot_product_attention(*(t.view(B, S, -1, HD).transpose(1, 2) for t in (q, kk, vv)),
                                        is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2).reshape(n, HEADS, HD)
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=dev)
    fa = flash_attn_varlen_func(q, kk, vv, max_seqlen_q=S, cu_seqlens_q=cu, max_seqlen_k=S, cu_seqlens_k=cu,
                                softmax_scale=scale, causal=True, fa_version=3, num_splits=1)
    rows["attention"] = diff(sd, fa)
    # Decode vs prefill: each row's query at position p against a paged cache of its first p + 1 keys.
    page = 16
    kc = kk.view(B * S // page, page, GROUPS, HD)
    vc = vv.view(B * S // page, page, GROUPS, HD)
    table = torch.arange(B * S // page, device=dev, dtype=torch.int32).view(B, S // page)
    worst = {"elements": 0, "differ_frac": 0.0, "max_abs": 0.0}
    for p in (0, 5, 127, 128, 300, S - 1):
        qd = q.view(B, S, HEADS, HD)[:, p].contiguous()
        dec = flash_attn_varlen_func(qd, kc, vc, max_seqlen_q=1, cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32,
                                     device=dev), max_seqlen_k=p + 1, seqused_k=torch.full((B,), p + 1,
                                     dtype=torch.int32, device=dev), block_table=table, softmax_scale=scale,
                                     causal=True, fa_version=3, num_splits=1)
        d = diff(dec, fa.view(B, S, HEADS, HD)[:, p])
        worst = {"elements": worst["elements"] + d["elements"], "differ_frac": max(worst["differ_frac"],
                 d["differ_frac"]), "max_abs": max(worst["max_abs"], d["max_abs"])}
    rows["attention.decode_vs_prefill"] = worst

    # Logprobs: Megatron's vocab-parallel cross-entropy (the default actor) vs log_softmax (vLLM's sampler).
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = (torch.randn(B, 256, VOCAB, device=dev) * 3).to(bf)
    tgt = torch.randint(0, VOCAB, (B, 256), device=dev)
    ce = -vocab_parallel_cross_entropy(logits.float(), tgt)
    ls = logits.float().log_softmax(-1, dtype=torch.float32).gather(-1, tgt[..., None])[..., 0]
    rows["logprobs"] = diff(ce, ls)

    # Linears: torch's (cuBLAS, the default actor) vs vLLM's Triton persistent matmul; then a row
    # alone vs inside a batch.
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant

    wl = torch.randn(INTER, H, device=dev, dtype=bf) * 0.02
    xl = torch.randn(n, H, device=dev, dtype=bf)
    rows["linear"] = diff(F.linear(xl, wl), linear_batch_invariant(xl, wl))
    rows["linear.row_vs_batch"] = diff(F.linear(xl[:3], wl), F.linear(xl, wl)[:3])

    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "vllm": __import__("vllm").__version__,
              "sizes": dict(batch=B, seq=S, hidden=H, heads=HEADS, groups=GROUPS, head_dim=HD, inter=INTER,
                            vocab=VOCAB), "ops": rows}
    for name, r in rows.items():
        print(f"{name:28s} differ {r['differ_frac']:.4%}  max |diff| {r['max_abs']:.3g}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
