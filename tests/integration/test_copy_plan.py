"""Direct loading (rollout/copy_plan.py) against vLLM's own load_weights, on real vLLM models.

The engine runs in-process so the test holds its model. Three syncs of different weights arrive as
one flat bucket, as IPC delivers them: the first loads per tensor and records, the next two replay
the bucket's resolved copies whole. After each, the model's parameters must equal, bit for bit,
what ``load_weights`` makes of the same tensors. On CPU vLLM serves from repacked copies,
so the model loaded here is a second instance of the engine's model class, built by vLLM in the
engine's worker (its config and parallel groups) and compared parameter by parameter; the GPU tier
loads into the live engine and samples through it (tests/gpu/test_sync_direct_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from colocate_rl.rollout.copy_plan import CopyPlan
from colocate_rl.rollout.engine import RolloutEngine
from colocate_rl.weight_sync.buckets import Bucket, TensorMeta, unpack
from batches import build_engine
from test_rollout import make_cfg


def _fresh_model(worker) -> torch.nn.Module:
    """The engine's model class, built by vLLM in the worker's own config and parallel groups but
    never processed after loading: on CPU the live model's linears have given their weights to
    repacked copies, so there is nothing in them to load into."""
    import copy

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    config = copy.copy(worker.vllm_config)  # its own registry of attention layers, beside the live one
    config.compilation_config = copy.copy(config.compilation_config)
    config.compilation_config.static_forward_context = {}
    with set_current_vllm_config(config), torch.device("cpu"):
        return initialize_model(vllm_config=config)


def _model(engine: RolloutEngine) -> torch.nn.Module:
    (model,) = engine.llm.collective_rpc(_fresh_model)
    return model


def _bucket(ckpt: dict[str, torch.Tensor], seed: int) -> Bucket:
    """The checkpoint moved by seeded noise, in one flat bucket."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.cat([(t.float() + 0.01 * torch.randn(t.shape, generator=g)).reshape(-1) for t in ckpt.values()])
    metas, at = [], 0
    for name, t in ckpt.items():
        metas.append(TensorMeta(name, tuple(t.shape), flat.dtype, at, t.numel()))
        at += t.numel()
    return Bucket(flat, metas)


@pytest.mark.parametrize("shape", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_replayed_copies_equal_load_weights(tiny_model, shape):
    path = tiny_model(shape)
    ckpt = load_file(str(path / "model.safetensors"))
    with build_engine(make_cfg(path), multiprocess=False) as engine:
        model = _model(engine)
        plan = CopyPlan(model, lambda named: model.load_weights(iter(named)))
        for seed in range(3):
            bucket = _bucket(ckpt, seed)
            named = unpack(bucket)
            with torch.no_grad():
                if seed == 0:
                    plan.load(named, bucket)  # records the copies and the bucket's layout
                else:
                    copies = plan.resolved(bucket)
                    assert copies is not None
                    copies.run(bucket.flat)  # the whole bucket through its resolved copies
                got = {n: p.detach().clone() for n, p in model.named_parameters()}
                model.load_weights(iter(named))
            changed = 0
            for n, p in model.named_parameters():
                assert torch.equal(got[n], p), f"sync {seed}: {n} differs from load_weights'"
                changed += int(seed > 0 and not torch.equal(p, before[n]))
            if seed > 0:
                assert changed == len(got), "every parameter took the new weights"
            before = got
        stats = plan.stats()
        # Qwen3's loaders are plain copies: every name replays after its first sync.
        assert stats == {"direct": len(ckpt), "load_weights": 0, "enabled": 1}, (stats, sorted(plan.slow))
