"""The reference policy of the KL penalty on CPU (real megatron-core actor, tiny model): the
penalty holds the policy closer to it, it is the policy at the first GRPO step and never changes,
it stays on the host between uses (storages of 0 bytes on the device) unless actor.ref_on_device,
both placements give the same numbers, and a checkpoint carries it (at another TP too)."""

from __future__ import annotations

import pytest
import torch

from colocate_rl.config import Config, ModelConfig

from batches import build_actor, synthetic_batch

LENS = [12, 9, 11, 6, 10, 7]


def make_actor(path, kl_coef: float, **actor):
    cfg = Config(model=ModelConfig(path=str(path), dtype="float32"))
    cfg.actor.lr, cfg.actor.micro_batch_size = 1e-3, 4
    cfg.algorithm.kl_coef = kl_coef
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    return build_actor(cfg)


def start(actor, seed: int = 0):
    """A fixed batch sampled 'by' the actor's starting weights, and those weights' logprobs."""
    batch = synthetic_batch(LENS, seed=seed)
    lp0 = actor.compute_logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.loss_mask, lp0, 0)
    return batch, lp0


def k3(lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean k3 estimate of KL(policy || reference) over the response tokens."""
    d = (ref - lp)[mask]
    return float((d.exp() - d - 1).mean())


def weights(actor) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in actor.export_hf_weights()}


def initial_names(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_kl_penalty_holds_the_policy_near_a_frozen_reference(tiny_model):
    """Same seed, same batch, 6 steps: with kl_coef the policy ends much closer to its starting
    weights. kl_ref is 0 at the first step (reference == policy), then the logged value is the
    KL measured between the policy and its starting weights; the reference never moves, shares no
    storage with the policy, has no gradient, and is not in the optimizer or the HF export."""
    path = tiny_model("qwen3-tiny")
    moved = {}
    for kl_coef in (0.0, 4.0):  # the policy-gradient term weighs |A| = 1 per token: a few units compete
        actor = make_actor(path, kl_coef)
        batch, lp0 = start(actor)
        initial = {n: p.detach().clone() for n, p in actor.model.module.named_parameters()}
        logged = [actor.train_step(batch) for _ in range(6)]
        moved[kl_coef] = k3(actor.compute_logprobs(batch), lp0, batch.loss_mask)
        if kl_coef == 0:
            assert actor.reference is None and "kl_ref" not in logged[0] and "kl_coef" not in logged[0]
            continue
        kl = [m["kl_ref"] for m in logged]
        assert kl[0] == pytest.approx(0.0, abs=1e-7) and all(k > 0 for k in kl[1:]), kl
        assert all(m["kl_coef"] == kl_coef and m["ref_time_s"] > 0 for m in logged)
        # The next step logs exactly the KL of the policy as it now is.
        assert actor.train_step(batch)["kl_ref"] == pytest.approx(moved[kl_coef], rel=1e-4)

        ref = actor.reference
        assert torch.equal(actor.compute_ref_logprobs(batch), lp0)
        with ref.resident() as module:
            assert all(torch.equal(p, initial[n]) for n, p in module.named_parameters())
            assert not any(p.requires_grad for p in module.parameters())
            in_optimizer = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
            assert not in_optimizer & {id(p) for p in module.parameters()}
        policy = {t.untyped_storage()._cdata for t in actor.model.module.parameters()}
        assert not policy & {s._cdata for s in ref.storages()}
        assert sorted(weights(actor)) == sorted(initial_names(path))
    assert moved[4.0] < 0.5 * moved[0.0], moved


def test_reference_stays_on_the_host_and_placement_changes_no_number(tiny_model):
    """ref_on_device=false: between passes the reference's storages are 0 bytes (its bytes are in
    its host buffers) and the actor's offload/onload neither moves nor counts them. ref_on_device
    =true keeps them resident. Both give the same metrics and weights, bit for bit."""
    path = tiny_model("qwen3-tiny")
    runs = {}
    for on_device in (False, True):
        actor = make_actor(path, 0.5, ref_on_device=on_device)
        batch, _ = start(actor)
        metrics = [actor.train_step(batch) for _ in range(3)]
        ref = actor.reference
        param_bytes = sum(p.numel() * p.element_size() for p in ref.module.parameters())
        if on_device:
            assert ref.device_bytes() >= param_bytes and not ref.on_host
        else:
            assert ref.device_bytes() == 0 and ref.on_host
            assert all(s.nbytes() == 0 for s in ref.storages())
        resident = ref.device_bytes()
        moved, _ = actor.offload()
        assert ref.device_bytes() == resident
        back, _ = actor.onload()
        assert back == moved and ref.device_bytes() == resident and ref.on_host != on_device
        runs[on_device] = (metrics, weights(actor), moved)
        if not on_device:
            plain = make_actor(path, 0.0)
            plain.train_step(start(plain)[0])
            # The actor's own offload moves exactly what it moves without a reference.
            assert plain.offload()[0] == moved
            del plain
    (m_host, w_host, _), (m_dev, w_dev, _) = runs[False], runs[True]
    for a, b in zip(m_host, m_dev):
        assert {k: v for k, v in a.items() if "time" not in k and "per_s" not in k} == \
            {k: v for k, v in b.items() if "time" not in k and "per_s" not in k}
    assert all(torch.equal(w_host[n], w_dev[n]) for n in w_host)


def warm_started(path, **actor):
    """An actor after one SFT step: its reference will differ from the model folder's weights."""
    actor = make_actor(path, 0.5, **actor)
    actor.sft_step(synthetic_batch(LENS, seed=3), lr=3e-3)
    return actor


def test_checkpoint_keeps_the_reference(tiny_model, tmp_path):
    """The reference is the policy after the SFT warm-start. A resumed actor scores with the saved
    reference (not a snapshot of its resumed weights) and takes the same next step as the
    uninterrupted one; a checkpoint from before any KL step has no reference, and the resumed actor
    takes one at its first step."""
    path = tiny_model("qwen3-tiny")
    actor = warm_started(path)
    batch, lp0 = start(actor)
    for _ in range(2):
        actor.train_step(batch)
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    want, want_w = actor.train_step(batch), weights(actor)

    resumed = make_actor(path, 0.5)
    hf = resumed.compute_logprobs(batch)  # the model folder's weights
    assert (hf - lp0).abs().max() > 0.1
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.reference is not None and resumed.reference.on_host
    assert resumed.reference.device_bytes() == 0
    assert torch.equal(resumed.compute_ref_logprobs(batch), lp0)
    got = resumed.train_step(batch)
    assert got["kl_ref"] > 0.01
    for key in ("kl_ref", "loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    assert all(torch.equal(want_w[n], t) for n, t in weights(resumed).items())

    plain = make_actor(path, 0.0)
    plain.load_checkpoint(str(tmp_path / "ckpt"))  # a reference in the checkpoint is not loaded
    assert plain.reference is None
    plain.save_checkpoint(str(tmp_path / "no_ref"))
    resumed.load_checkpoint(str(tmp_path / "no_ref"))
    assert resumed.reference is None  # dropped: the checkpoint's run had not taken one
    assert resumed.train_step(batch)["kl_ref"] == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("shape", ["qwen3-moe-tiny", "deepseek-v4-tiny"])
def test_reference_of_other_families(tiny_model, tmp_path, shape):
    """MoE (megatron-core's experts copy their config) and DeepSeek-V4 (the family's own model):
    kl_ref starts at 0, the reference stays the starting policy and survives a checkpoint."""
    path = tiny_model(shape)
    actor = make_actor(path, 0.5, micro_batch_size=2)
    batch, lp0 = start(actor)
    kl = [actor.train_step(batch)["kl_ref"] for _ in range(2)]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[1] > 0.01, kl
    # The reference holds the starting weights bit for bit, but its parameters are storages of their
    # own while the policy's are views into Megatron's flat buffers: CPU GEMMs may pick other kernels
    # for other alignments (DeepSeek-V4's logprobs then differ by ~1e-6), so compare to 1e-5.
    assert_close = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # noqa: E731
    assert_close(actor.compute_ref_logprobs(batch), lp0)
    assert actor.reference.device_bytes() == 0
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = make_actor(path, 0.5, micro_batch_size=2)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert_close(resumed.compute_ref_logprobs(batch), lp0)


def reference_at_tp2_and_pp2(path: str, ckpt: str) -> dict[str, torch.Tensor]:
    out = {}
    for layout in ({"tp": 2}, {"pp": 2}):
        actor = make_actor(path, 0.5, micro_batch_size=2, **layout)
        actor.load_checkpoint(ckpt)
        out[str(layout)] = actor.compute_ref_logprobs(synthetic_batch(LENS))
    return out


# Slow: one spawn of two fresh processes importing torch + megatron-core (~20-30 s on 2 cores).
@pytest.mark.slow
def test_reference_reshards_to_tp2_and_pp2(tiny_model, tmp_path):
    from colocate_rl.trainer import run_on_ranks

    path = tiny_model("qwen3-small")
    actor = warm_started(path)  # a reference unlike the model folder's weights
    batch, lp0 = start(actor)
    for _ in range(2):
        actor.train_step(batch)
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    got = run_on_ranks(reference_at_tp2_and_pp2, 2, str(path), str(tmp_path / "ckpt"))
    for layout, lp in got.items():
        assert (lp - lp0).abs().max().item() <= 1e-5, layout
    assert (actor.compute_logprobs(batch) - lp0).abs().max().item() > 0.1  # the policy itself moved
    assert (make_actor(path, 0.5).compute_logprobs(batch) - lp0).abs().max().item() > 0.1  # and SFT did
