"""The actor with its Adam state in host memory (actor.optimizer_cpu_offload; real megatron-core on
CPU, tiny Qwen3): the same updates as Megatron's own Adam, bf16 moments within their rounding,
checkpoints that resume exactly, chunk sizes that change nothing, an offload that has no optimizer
state to move, and two data-parallel ranks (with and without the distributed optimizer) that match
one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from colocate_rl.config import Config, ModelConfig

from batches import build_actor, grpo_step_view, synthetic_batch

BATCH = dict(lens=[12, 9, 11, 6, 10, 7], seed=0)


def make_actor(path, dtype="float32", **actor):
    cfg = Config(model=ModelConfig(path=str(path), dtype=dtype))
    cfg.actor.lr, cfg.actor.micro_batch_size = 1e-3, 4
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    return build_actor(cfg)


def steps(actor, n: int, batch=None) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """n GRPO steps on the synthetic batch; (metrics per step, exported weights in float32)."""
    batch = batch or synthetic_batch(**BATCH)
    out = []
    for _ in range(n):
        lp = actor.compute_logprobs(batch)
        batch.rollout_logprobs = torch.where(batch.loss_mask, lp, 0)
        out.append(actor.train_step(batch, lp))
    return out, weights(actor)


def weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.float().clone() for n, t in actor.export_hf_weights()}


def initial(path) -> dict[str, torch.Tensor]:
    """The weights before any step (the actor's export of them is bit-exact, test_actor.py)."""
    return {n: t.float() for n, t in load_file(str(path / "model.safetensors")).items()}


def rel_to_update(w: dict, ref: dict, start: dict) -> float:
    """‖w - ref‖ / ‖ref - start‖ over all tensors: a difference measured against the update itself."""
    num = sum(float((w[n] - ref[n]).double().norm() ** 2) for n in ref)
    den = sum(float((ref[n] - start[n]).double().norm() ** 2) for n in ref)
    return (num / den) ** 0.5


@pytest.mark.parametrize("shape", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_host_adam_equals_megatron_adam(tiny_model, shape):
    """Three GRPO steps and an SFT step at its own lr, through Megatron's fp32 Adam and through the
    host Adam, agree to fp32 rounding; the weights moved by far more than that. Compared along the
    way: grad clipping (the norms are > 1), the LR warm-up the scheduler writes into param_groups,
    weight decay with Megatron's exclusions (biases and norms), sft_step's lr override."""
    path = tiny_model(shape)
    start = initial(path)
    sched = dict(lr_warmup_steps=2, weight_decay=0.1)

    def run(actor):
        ms, _ = steps(actor, 3)
        ms.append(actor.sft_step(synthetic_batch(**BATCH), lr=3e-3))
        assert actor.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # the schedule's again
        return ms, weights(actor)

    ref_m, ref = run(make_actor(path, **sched))
    host = make_actor(path, optimizer_cpu_offload=True, **sched)
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in host.optimizer.host_tensors())
    got_m, got = run(host)
    assert ref_m[0]["grad_norm"] > 1.0 and [m["lr"] for m in ref_m[:3]] == pytest.approx([0.0, 5e-4, 1e-3])
    for a, b in zip(ref_m, got_m):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6) and b["lr"] == a["lr"]
    zero = {n: torch.zeros_like(t) for n, t in start.items()}
    assert rel_to_update(start, ref, zero) > 1e-3  # the update is no small part of the weights
    assert rel_to_update(got, ref, start) <= 1e-5


def test_bf16_moments_within_their_rounding(tiny_model):
    """bf16 moments (unit roundoff u = 2^-9) change three steps' update by at most ~4.2 u per
    element (first moment (1 + 0.9 + 0.81) u, second 3 u halved by its square root; see
    tests/unit/test_host_adam_update.py); as a norm over the whole update, within 5 u = 1%. And they are
    really bf16: the difference is not zero."""
    path = tiny_model("qwen3-tiny")
    start = initial(path)
    _, ref = steps(make_actor(path, optimizer_cpu_offload=True), 3)
    bf16 = make_actor(path, optimizer_cpu_offload=True, optimizer_state_dtype="bfloat16")
    assert [t.dtype for t in bf16.optimizer.host_tensors()] == [torch.float32, torch.bfloat16, torch.bfloat16]
    _, got = steps(bf16, 3)
    rel = rel_to_update(got, ref, start)
    assert 0 < rel <= 5 * 2**-9, rel


def test_device_optimizer_refuses_bf16_moments(tiny_model):
    with pytest.raises(ValueError, match="actor.optimizer_state_dtype='bfloat16' needs actor.optimizer_cpu_offload"):
        make_actor(tiny_model("qwen3-tiny"), optimizer_state_dtype="bfloat16")


def test_checkpoint_resumes_exactly(tiny_model, tmp_path):
    """bf16 weights with fp32 master weights and bf16 moments on the host: save after one step, load
    into a fresh actor, and its next step is the uninterrupted one bit for bit (the master weights
    came back: the bf16 weights alone would round them)."""
    path = tiny_model("qwen3-tiny")
    opts = dict(optimizer_cpu_offload=True, optimizer_state_dtype="bfloat16")
    a = make_actor(path, "bfloat16", **opts)
    steps(a, 1)
    a.save_checkpoint(str(tmp_path / "ckpt"))
    saved = [t.clone() for t in a.optimizer.host_tensors()]
    _, want = steps(a, 1)

    b = make_actor(path, "bfloat16", **opts)
    b.load_checkpoint(str(tmp_path / "ckpt"))
    assert b.optimizer.num_steps == 1 and b.scheduler.num_steps == 1
    assert all(torch.equal(x, y) for x, y in zip(saved, b.optimizer.host_tensors()))
    assert not torch.equal(saved[0].bfloat16().float(), saved[0])  # masters hold more than bf16
    _, got = steps(b, 1)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_chunk_size_changes_no_bit(tiny_model):
    """Chunks of 77 elements cut every tensor at odd offsets; the default (64 Mi elements) cuts none."""
    path = tiny_model("qwen3-tiny")
    results = []
    for chunk in (None, 77):
        a = make_actor(path, optimizer_cpu_offload=True, optimizer_state_dtype="bfloat16")
        if chunk:
            a.optimizer.chunk_numel = chunk
        n_chunks = sum(1 for _ in a.optimizer._chunks())
        results.append((n_chunks, steps(a, 2)[1], [t.clone() for t in a.optimizer.host_tensors()]))
    (n_whole, w0, s0), (n_cut, w1, s1) = results
    assert n_cut > 10 * n_whole
    assert all(torch.equal(w0[n], w1[n]) for n in w0)
    assert all(torch.equal(x, y) for x, y in zip(s0, s1))


def test_offload_moves_no_optimizer_state(tiny_model):
    """The colocated handoff with host Adam: the optimizer part has nothing on the device, the
    parameters move, the gradients are freed; the next step is the one without the round trip."""
    path = tiny_model("qwen3-tiny")
    _, want = steps(make_actor(path, "bfloat16", optimizer_cpu_offload=True), 2)
    a = make_actor(path, "bfloat16", optimizer_cpu_offload=True)
    steps(a, 1)
    moved, _ = a.offload(("optimizer",))
    assert moved == 0 and list(a._optimizer_tensors()) == []
    param_bytes = sum(p.numel() * p.element_size() for p in a.model.module.parameters())
    moved_rest, _ = a.offload(("grads", "params"))
    assert param_bytes <= moved_rest < param_bytes + 4096  # parameters only (plus buffer padding)
    back, _ = a.onload()
    assert back == moved_rest
    _, got = steps(a, 1)
    assert all(torch.equal(got[n], want[n]) for n in want)


# ---------------------------------------------------------------- two data-parallel ranks

LENS = [12, 9, 11, 6, 10, 7, 12, 5]  # as tests/integration/test_actor_parallel.py


def two_ranks(path: str, moe_path: str, ckpt: str) -> dict:
    """At dp=2: one GRPO step with the plain and with the distributed host Adam (the distributed one
    saves a checkpoint after its step), and one with experts split over the two ranks (ep=2: expert
    parameters in Megatron's second optimizer, whose norm group differs from the dense one's)."""
    views = {"plain": grpo_step_view(path, dict(optimizer_cpu_offload=True), LENS),
             "ep2": grpo_step_view(moe_path, dict(optimizer_cpu_offload=True, ep=2), LENS)}
    cfg = Config(model=ModelConfig(path=path, dtype="float32"))
    cfg.actor.lr, cfg.actor.micro_batch_size = 1e-3, 2
    cfg.actor.optimizer_cpu_offload = cfg.actor.distributed_optimizer = True
    actor = build_actor(cfg)
    batch = synthetic_batch(LENS, seed=1)
    before = actor.compute_logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.loss_mask, before, 0)
    m = actor.train_step(batch, before)
    views["distributed"] = {"after": actor.compute_logprobs(batch), "grad_norm": m["grad_norm"], "loss": m["loss"],
                            "state_numel": sum(t.numel() for t in actor.optimizer.host_tensors())}
    actor.save_checkpoint(ckpt)
    return views


# Slow: one spawn of two fresh processes importing torch + megatron-core (~20-30 s on 2 cores),
# each building three actors.
@pytest.mark.slow
def test_two_data_parallel_ranks_match_one(tiny_model, tmp_path):
    """dp=2 (gradients all-reduced, or reduce-scattered with each rank updating its shard and the
    parameters all-gathered) and ep=2 give one rank's step; the distributed checkpoint, written by
    two ranks that each hold half the state, resumes on one rank as if it had taken that step itself."""
    from colocate_rl.trainer import run_on_ranks

    path, moe_path = str(tiny_model("qwen3-tiny")), str(tiny_model("qwen3-moe-tiny"))
    got = run_on_ranks(two_ranks, 2, path, moe_path, str(tmp_path / "ckpt"))
    refs = {"plain": grpo_step_view(path, {}, LENS), "ep2": grpo_step_view(moe_path, {}, LENS)}
    refs["distributed"] = refs["plain"]
    for name, ref in refs.items():
        diff = (got[name]["after"] - ref["after"]).abs().max().item()
        assert diff <= 1e-5, f"{name}: logprobs after the step differ from one rank by {diff}"
        assert got[name]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), name
        assert got[name]["loss"] == pytest.approx(ref["loss"], abs=1e-6), name

    # One rank, resumed from the dp=2 checkpoint, against one rank that took both steps itself.
    def second_step(actor):
        batch = synthetic_batch(LENS, seed=1)
        lp = actor.compute_logprobs(batch)
        batch.rollout_logprobs = torch.where(batch.loss_mask, lp, 0)
        actor.train_step(batch, lp)
        return actor.compute_logprobs(batch)

    one = make_actor(path, optimizer_cpu_offload=True, micro_batch_size=2)
    full = sum(t.numel() for t in one.optimizer.host_tensors())
    assert got["distributed"]["state_numel"] < 0.75 * full  # each of the two ranks holds about half
    first = synthetic_batch(LENS, seed=1)
    lp = one.compute_logprobs(first)
    first.rollout_logprobs = torch.where(first.loss_mask, lp, 0)
    one.train_step(first, lp)
    want = second_step(one)
    resumed = make_actor(path, optimizer_cpu_offload=True, micro_batch_size=2)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    diff = (second_step(resumed) - want).abs().max().item()
    assert diff <= 1e-5, f"resumed from the dp=2 checkpoint, the second step differs by {diff}"
