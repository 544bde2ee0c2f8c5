"""The copy recorder/replayer (rollout/copy_plan.py) on loaders written the ways vLLM's are: shards
narrowed out of the incoming tensor, slices of a fused parameter, constant padding, a loader that
computes, and one that swaps a parameter's storage. Real vLLM loaders: tests/integration/test_copy_plan.py."""

from __future__ import annotations

import math

import torch

from colocate_rl.rollout.copy_plan import CopyPlan
from colocate_rl.weight_sync.buckets import Bucket, TensorMeta, unpack


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4))
        self.norm = torch.nn.Parameter(torch.zeros(4))
        self.embed = torch.nn.Parameter(torch.zeros(5, 4))  # 3 rows of this shard + 2 padding rows
        self.swap = False

    def load_weights(self, named) -> None:
        for name, t in named:
            if name in ("q", "k", "v"):
                self.qkv.data.narrow(0, 2 * "qkv".index(name), 2).copy_(t)
            elif name == "norm":
                self.norm.data.copy_(t * 2)  # computes: must stay on load_weights
            elif name == "embed":
                self.embed.data[:3].copy_(t[1:4])  # this rank's rows of the incoming tensor
                self.embed.data[3:].fill_(0)
            elif name == "out" and self.swap:
                self.norm.data = t.clone()


def bucket(seed: int) -> list[tuple[str, torch.Tensor]]:
    flat = torch.randn(3 * 8 + 4 + 16, generator=torch.Generator().manual_seed(seed))
    views = [flat[i * 8 : (i + 1) * 8].view(2, 4) for i in range(3)]
    return [*zip("qkv", views), ("norm", flat[24:28]), ("embed", flat[28:44].view(4, 4))]


def test_replay_equals_the_loaders_and_computing_loaders_stay_on_them():
    model = Model()
    plan = CopyPlan(model, model.load_weights)
    for seed in range(3):
        named = bucket(seed)
        plan.load(named)
        ref = Model()
        ref.load_weights(named)
        for (name, got), (_, want) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(got, want), (seed, name)
    assert plan.copies.keys() == {"q", "k", "v", "embed"} and plan.slow == {"norm"}
    assert plan.copies["embed"][0].offset == 4, "the shard starts one row into the incoming tensor"


def test_a_loader_that_swaps_storage_ends_direct_loading():
    model = Model()
    plan = CopyPlan(model, model.load_weights)
    plan.load(bucket(0))
    model.swap = True
    plan.load([("out", torch.ones(4))])
    assert not plan.enabled and not plan.copies
    named = bucket(1)
    plan.load(named)  # all through load_weights now, still right
    ref = Model()
    ref.load_weights(named)
    assert torch.equal(model.qkv, ref.qkv) and torch.equal(model.embed, ref.embed)


def test_replay_batches_what_it_can_and_copies_the_rest(monkeypatch):
    """Same-layout pairs below the size limit go through one batched copy per dtype; a cast, a
    strided source and a large pair are copied one by one; every destination ends up equal."""
    from colocate_rl.rollout import copy_plan

    monkeypatch.setattr(copy_plan, "_BATCH_BELOW_BYTES", 64 * 4)
    g = torch.Generator().manual_seed(0)
    w13, big = torch.zeros(4, 6, 3), torch.zeros(32, 4)
    half, wide = torch.zeros(5, dtype=torch.bfloat16), torch.zeros(3, 2)
    src = torch.randn(200, generator=g)
    pairs = [(w13[e, :3], src[18 * e: 18 * e + 9].view(3, 3)) for e in range(4)]  # gate halves
    pairs += [(w13[e, 3:], src[18 * e + 9: 18 * e + 18].view(3, 3)) for e in range(4)]  # up halves
    pairs += [(big, src[72:200].view(32, 4)),  # above the limit: its own copy
              (half, src[:5]),  # a cast
              (wide, src[:12].view(3, 4)[:, ::2])]  # a strided source
    copy_plan.replay(pairs)
    for dst, s in pairs:
        assert torch.equal(dst, s.to(dst.dtype))
    assert torch.equal(w13.view(4, 18), src[:72].view(4, 18)), "every expert slice written"


class Loaders(torch.nn.Module):
    """Loaders whose sources are one segment of the bucket, a strided view, and a segment read into
    two places; ``bf16`` takes a cast."""

    def __init__(self) -> None:
        super().__init__()
        self.w13 = torch.nn.Parameter(torch.zeros(2, 6, 3))
        self.cols = torch.nn.Parameter(torch.zeros(4, 2))
        self.twice = torch.nn.Parameter(torch.zeros(2, 5))
        self.bf16 = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))

    def load_weights(self, named) -> None:
        for name, t in named:
            if name.startswith(("gate", "up")):  # expert e's half of w13
                e = int(name[-1])
                self.w13.data[e, : 3 if name.startswith("gate") else 6][-3:].copy_(t)
            elif name == "cols":
                self.cols.data.copy_(t[:, 1::2])  # strided: every other column
            elif name == "twice":
                self.twice.data[0].copy_(t)
                self.twice.data[1].copy_(t)
            elif name == "bf16":
                self.bf16.data.copy_(t)


def _bucket(seed: int) -> Bucket:
    names = [("gate0", (3, 3)), ("up0", (3, 3)), ("gate1", (3, 3)), ("up1", (3, 3)), ("cols", (4, 4)),
             ("twice", (5,)), ("bf16", (5,))]
    metas, at = [], 0
    for name, shape in names:
        metas.append(TensorMeta(name, shape, torch.float32, at, math.prod(shape)))
        at += math.prod(shape)
    flat = torch.randn(at + 3, generator=torch.Generator().manual_seed(seed))[3:]  # not at its storage's start
    return Bucket(flat, metas)


def test_a_bucket_layout_replays_whole_and_equals_the_loaders():
    """After one load, a bucket laid out the same way replays as one resolved set of copies: the
    segments, a strided source, a source read twice and a cast all land as load_weights puts them."""
    model = Loaders()
    plan = CopyPlan(model, model.load_weights)
    first = _bucket(0)
    assert plan.resolved(first) is None
    plan.load(unpack(first), first)
    assert plan.resolved(first) is not None and plan.stats()["load_weights"] == 0
    for seed in (1, 2):
        b = _bucket(seed)
        copies = plan.resolved(b)
        assert copies is not None, "same names, shapes and offsets: the same layout"
        copies.run(b.flat)
        ref = Loaders()
        ref.load_weights(unpack(b))
        for (name, got), (_, want) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(got, want), (seed, name)
    other = Bucket(first.flat, first.metas[:-1])
    assert plan.resolved(other) is None, "another layout is loaded per tensor first"


def test_a_bucket_with_a_computing_loader_is_not_replayed_whole():
    model = Model()
    plan = CopyPlan(model, model.load_weights)
    named = bucket(0)
    flat = named[0][1].view(-1)  # the bucket's views start at its flat tensor
    metas = [TensorMeta(n, tuple(t.shape), t.dtype, t.storage_offset(), t.numel()) for n, t in named]
    plan.load(named, Bucket(flat.as_strided((44,), (1,), 0), metas))
    assert "norm" in plan.slow and plan.resolved(Bucket(flat, metas)) is None
