"""The weight sync's two copies alone, at a Qwen3-30B-A3B export's tensors, next to one copy of all
the bytes (the device's limit), each in its earlier form and its current one, in one run:

- packing: the tensors written into 256 MiB buckets, one copy per tensor against one batched cat
  per bucket (``weight_sync.pack``), the same bytes checked;
- replay: the buckets copied into an engine's parameters laid out as vLLM's (fused q/k/v, experts
  stacked as w13 [E, 2I, H] and w2 [E, H, I]), one copy per tensor against
  ``rollout.copy_plan.replay``, the same parameters checked;
- the engine's whole load of a bucket through a recorded ``CopyPlan``: per tensor (a view, a
  lookup, the replay: ``load``) against the bucket's copies resolved once (``resolved``).

    python benchmarks/sync/pack.py --layers 12 --out benchmarks/results/pack_replay_qwen3_30b_a3b_12_h200.json

Needs only torch (no vLLM, no megatron-core): the tensors are random, at the published config's
shapes and HF names (48 layers of 128 experts; --layers keeps the first ones, as
model.synthesize=qwen3-30b-a3b@12 does).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform as pyplatform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from colocate_rl.weight_sync import buckets  # noqa: E402  (torch only)


def _module(path: str):
    """One of the project's torch-only modules, loaded by file: its package's __init__ imports vLLM."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


copy_plan = _module("colocate_rl/rollout/copy_plan.py")

# Qwen3-30B-A3B's config.json: hidden 2048, 32 query and 4 key/value heads of 128, 128 experts of
# width 768, vocabulary 151,936, untied embeddings.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, EXPERT_WIDTH, VOCAB = 2048, 32, 4, 128, 128, 768, 151936


def export_like(layers: int, device: str) -> list[tuple[str, torch.Tensor]]:
    """(HF name, bf16 tensor) in export order, each tensor its own allocation as the actor's are."""
    def t(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    out = [("model.embed_tokens.weight", t(VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", t(HIDDEN)), (p + "self_attn.q_proj.weight", t(HEADS * HEAD_DIM, HIDDEN)),
                (p + "self_attn.k_proj.weight", t(KV_HEADS * HEAD_DIM, HIDDEN)),
                (p + "self_attn.v_proj.weight", t(KV_HEADS * HEAD_DIM, HIDDEN)),
                (p + "self_attn.o_proj.weight", t(HIDDEN, HEADS * HEAD_DIM)),
                (p + "self_attn.q_norm.weight", t(HEAD_DIM)), (p + "self_attn.k_norm.weight", t(HEAD_DIM)),
                (p + "post_attention_layernorm.weight", t(HIDDEN)), (p + "mlp.gate.weight", t(EXPERTS, HIDDEN))]
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            out += [(q + "gate_proj.weight", t(EXPERT_WIDTH, HIDDEN)), (q + "up_proj.weight", t(EXPERT_WIDTH, HIDDEN)),
                    (q + "down_proj.weight", t(HIDDEN, EXPERT_WIDTH))]
    return out + [("model.norm.weight", t(HIDDEN)), ("lm_head.weight", t(VOCAB, HIDDEN))]


def flush_each(pending, alloc):
    """The earlier bucket writer: one copy (and Python round) per tensor."""
    numel = sum(t.numel() for _, t in pending)
    flat = alloc(numel, pending[0][1].dtype, pending[0][1].device)
    metas, offset = [], 0
    for name, t in pending:
        n = t.numel()
        flat[offset: offset + n].view(t.shape).copy_(t)
        metas.append(buckets.TensorMeta(name, tuple(t.shape), t.dtype, offset, n))
        offset += n
    return buckets.Bucket(flat, metas)


def engine_views(named, device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """vLLM's parameters for ``named`` at TP=1 and, per tensor in order, the view its loader copies
    it into: q/k/v into one qkv_proj, each expert's gate/up into w13[e] and down into w2[e]."""
    params, views, layer = [], [], {}

    def new(*shape):
        params.append(torch.zeros(*shape, device=device, dtype=torch.bfloat16))
        return params[-1]

    q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for name, t in named:
        if ".mlp.experts." in name:
            i, e = name.split(".")[2], int(name.split(".")[5])
            if i not in layer:
                layer = {i: (new(EXPERTS, 2 * EXPERT_WIDTH, HIDDEN), new(EXPERTS, HIDDEN, EXPERT_WIDTH))}
            w13, w2 = layer[i]
            kind = name.split(".")[6]
            views.append(w2[e] if kind == "down_proj" else w13[e, :EXPERT_WIDTH] if kind == "gate_proj"
                         else w13[e, EXPERT_WIDTH:])
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            if name.endswith("q_proj.weight"):
                qkv = new(q_rows + 2 * kv_rows, HIDDEN)
            start = {"q": 0, "k": q_rows, "v": q_rows + kv_rows}[name.rsplit(".", 2)[1][0]]
            views.append(qkv[start: start + t.shape[0]])
        else:
            views.append(new(*t.shape))
    return params, views


def replay_each(pairs) -> None:
    """The earlier replay: one copy (and kernel launch) per tensor."""
    for dst, src in pairs:
        dst.copy_(src)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(named, bucket_mb: float, flush, check: bool = False) -> tuple[float, list[int]]:
    """Seconds to pack every tensor (buckets consumed one at a time, as a sync does); with ``check``
    (untimed) one sum per bucket instead, to see that both writers wrote the same bytes."""
    saved, buckets._flush = buckets._flush, flush
    try:
        sums = []
        sync()
        t0 = time.perf_counter()
        for b in buckets.pack(named, bucket_mb):
            if check:
                sums.append(int(b.flat.view(torch.int16).sum(dtype=torch.int64)))
        sync()
        return time.perf_counter() - t0, sums
    finally:
        buckets._flush = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    named = export_like(args.layers, device)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    src = torch.empty_like(flat)

    def one_copy() -> float:
        sync()
        t0 = time.perf_counter()
        flat.copy_(src)
        sync()
        return time.perf_counter() - t0

    one_copy()
    limit = statistics.median(one_copy() for _ in range(args.repeat))
    del flat, src
    seconds, sums = {}, {}
    for name, flush in (("per_tensor", flush_each), ("batched", buckets._flush)):
        sums[name] = run(named, args.bucket_mb, flush, check=True)[1]  # also the warm-up
        seconds[name] = statistics.median(run(named, args.bucket_mb, flush)[0] for _ in range(args.repeat))
    assert sums["per_tensor"] == sums["batched"] and len(sums["batched"]) > 0

    # Replay: the buckets' views into the engine's parameters, as a sync after the first one does.
    packed = list(buckets.pack(named, args.bucket_mb))
    incoming = [view for b in packed for view in buckets.unpack(b)]
    del named
    params, views = engine_views(incoming, device)
    pairs = list(zip(views, (t for _, t in incoming)))
    replayed = {}
    for name, fn in (("per_tensor", replay_each), ("batched", copy_plan.replay)):
        for p in params:
            p.zero_()
        fn(pairs)
        replayed[name] = [int(p.view(torch.int16).sum(dtype=torch.int64)) for p in params]

        def timed() -> float:
            sync()
            t0 = time.perf_counter()
            fn(pairs)
            sync()
            return time.perf_counter() - t0

        seconds[f"replay_{name}"] = statistics.median(timed() for _ in range(args.repeat))
    assert replayed["per_tensor"] == replayed["batched"] and any(replayed["batched"])

    # The engine's whole load, Python included: a CopyPlan records the loader's copies on a first
    # sync, then each bucket loads per tensor (load) or as one resolved layout (resolved(b).run).
    engine = torch.nn.Module()
    engine.params = torch.nn.ParameterList(torch.nn.Parameter(p, requires_grad=False) for p in params)
    into = {n: v for (n, _), v in zip(incoming, views)}
    plan = copy_plan.CopyPlan(engine, lambda loaded: [into[n].copy_(t) for n, t in loaded])
    with torch.no_grad():
        for b in packed:
            plan.load(buckets.unpack(b), bucket=b)
    assert all(plan.resolved(b) is not None for b in packed) and plan.stats()["load_weights"] == 0
    for name, fn in (("per_tensor", lambda b: plan.load(buckets.unpack(b))),
                     ("bucket", lambda b: plan.resolved(b).run(b.flat))):
        for p in params:
            p.zero_()
        for b in packed:
            fn(b)
        assert [int(p.view(torch.int16).sum(dtype=torch.int64)) for p in params] == replayed["batched"], name

        def timed() -> float:
            sync()
            t0 = time.perf_counter()
            for b in packed:
                fn(b)
            sync()
            return time.perf_counter() - t0

        seconds[f"load_{name}"] = statistics.median(timed() for _ in range(args.repeat))
    result = {
        "benchmark": "pack", "layers": args.layers, "tensors": len(incoming), "bytes": nbytes,
        "buckets": len(sums["batched"]), "bucket_mb": args.bucket_mb, "repeat": args.repeat,
        "seconds": seconds, "GBps": {k: nbytes / v / 1e9 for k, v in seconds.items()},
        "one_copy_of_all_bytes_s": limit, "one_copy_GBps": nbytes / limit / 1e9,
        "batched_over_per_tensor": seconds["per_tensor"] / seconds["batched"],
        "replay_batched_over_per_tensor": seconds["replay_per_tensor"] / seconds["replay_batched"],
        "load_bucket_over_per_tensor": seconds["load_per_tensor"] / seconds["load_bucket"],
        "replayed_copies": len(pairs), "same_bytes": True,
        "machine": {"device": torch.cuda.get_device_name() if device == "cuda" else pyplatform.processor() or "cpu",
                    "torch": torch.__version__, "python": pyplatform.python_version(),
                    "date": time.strftime("%Y-%m-%d")},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
