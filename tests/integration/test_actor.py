"""The Megatron actor on CPU (real megatron-core, gloo, one process): logprob parity with
transformers, bit-exact HF round trip, GRPO / SFT steps that move the model the right way,
offload/onload that changes nothing, padding that costs nothing, and one-line errors."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from colocate_rl.config import Config, ModelConfig
from colocate_rl.types import RolloutBatch

from batches import build_actor, synthetic_batch

SHAPES = ["qwen3-tiny", "qwen3-tiny-tied", "qwen3-moe-tiny"]


def make_batch(vocab: int = 320, pad_to: int = 0, seed: int = 0) -> RolloutBatch:
    """6 rows (3 prompts x 2 samples) of prompt 3 + response, right-padded; advantages +1 / -1."""
    return synthetic_batch([12, 9, 11, 6, 10, 7], vocab=vocab, seed=seed, pad_to=pad_to)


def make_actor(path, dtype="float32", algorithm=None, **actor):
    cfg = Config(model=ModelConfig(path=str(path), dtype=dtype))
    cfg.actor.lr = 1e-3
    cfg.actor.micro_batch_size = 4  # 6 rows -> micro-batches of 4 and 2
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    for k, v in (algorithm or {}).items():
        setattr(cfg.algorithm, k, v)
    return build_actor(cfg)


def hf_logprobs(path, batch: RolloutBatch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch.tokens, attention_mask=batch.attention_mask.long()).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0)) * batch.attention_mask


def row_means(lp: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    m = batch.loss_mask
    return (lp * m).sum(1) / m.sum(1)


@pytest.mark.parametrize("shape", SHAPES)
def test_logprobs_match_transformers_and_round_trip_is_bit_exact(tiny_model, shape):
    path = tiny_model(shape)
    actor = make_actor(path)
    batch = make_batch()
    lp = actor.compute_logprobs(batch)
    ref = hf_logprobs(path, batch)
    assert lp.shape == batch.tokens.shape and lp.dtype == torch.float32
    assert (lp[:, 0] == 0).all() and (lp[~batch.attention_mask] == 0).all()
    diff = (lp - ref).abs().max().item()
    assert diff <= 1e-4, f"{shape}: max |megatron - transformers| = {diff}"

    # HF -> Megatron -> HF: every tensor, same names, same bits.
    ckpt = load_file(str(path / "model.safetensors"))
    exported = {}
    for name, t in actor.export_hf_weights():
        assert name not in exported, f"{name} exported twice"
        exported[name] = t.clone()
    assert sorted(exported) == sorted(ckpt)
    for name, t in ckpt.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name


def test_grpo_steps_raise_positive_and_lower_negative_tokens(tiny_model):
    actor = make_actor(tiny_model("qwen3-tiny"), num_minibatches=2, micro_batch_size=2)
    batch = make_batch()
    start = actor.compute_logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.loss_mask, start, 0)
    for _ in range(3):
        m = actor.train_step(batch, actor.compute_logprobs(batch))
        assert m["optimizer_steps"] == 2 and m["lr"] == pytest.approx(1e-3)
        assert m["grad_norm"] > 0 and all(v == v for v in m.values()), m
        for key in ("loss", "clip_frac", "approx_kl", "is_weight_mean", "tokens_per_s"):
            assert key in m
    moved = row_means(actor.compute_logprobs(batch), batch) - row_means(start, batch)
    adv = batch.advantages
    assert (moved[adv > 0] > 0.05).all() and (moved[adv < 0] < -0.05).all(), moved


def test_fp32_residual_rounds_less_in_bf16(tiny_model):
    """actor.fp32_residual keeps the residual stream in fp32: bf16 logprobs move toward the fp32
    model's, and a GRPO step still runs; unset, a bf16 actor keeps it so."""
    path = tiny_model("qwen3-small")
    batch = make_batch()
    m = batch.loss_mask
    ref = make_actor(path).compute_logprobs(batch)
    plain = make_actor(path, dtype="bfloat16", fp32_residual=False).compute_logprobs(batch)
    actor = make_actor(path, dtype="bfloat16", fp32_residual=True)
    wide = actor.compute_logprobs(batch)
    err = {k: float((lp - ref)[m].abs().mean()) for k, lp in (("plain", plain), ("wide", wide))}
    assert 0 < err["wide"] < err["plain"], err
    assert torch.equal(make_actor(path, dtype="bfloat16").compute_logprobs(batch), wide)
    assert actor.train_step(batch, None)["grad_norm"] > 0


def test_one_step_takes_old_logprobs_from_its_own_forward(tiny_model):
    """train_step(batch, None) with one optimizer step: the same update and metrics as re-scoring
    the batch first (compute_logprobs), one forward pass fewer."""
    path = tiny_model("qwen3-tiny")
    batch = make_batch()
    actor = make_actor(path)
    old = actor.compute_logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.loss_mask, old - 0.01, 0)  # the sampler 0.01 off
    m1 = actor.train_step(batch, old)
    w1 = {n: t.clone() for n, t in actor.export_hf_weights()}
    actor = make_actor(path)
    m2 = actor.train_step(batch, None)
    w2 = {n: t.clone() for n, t in actor.export_hf_weights()}
    assert all(torch.equal(w1[n], w2[n]) for n in w1)
    for key in ("loss", "grad_norm", "train_rollout_logprob_abs_diff", "is_weight_mean", "clip_frac"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-6, abs=1e-9), key
    assert m2["train_rollout_logprob_abs_diff"] == pytest.approx(0.01, rel=1e-3)
    with pytest.raises(ValueError, match="actor.num_minibatches=2: every optimizer step after the first"):
        make_actor(path, num_minibatches=2).train_step(batch, None)


@pytest.mark.parametrize("cut", [{"micro_batch_size": 1}, {"micro_batch_tokens": 30}], ids=["rows", "tokens"])
def test_first_step_loss_is_the_full_batch_token_mean(tiny_model, cut):
    """Ratio 1 on the first step: loss = -mean over all loss tokens of the row's advantage, however
    the rows are cut into micro-batches (the normaliser is the mini-batch's): one row each, or by
    tokens (rows of 12, 11 | 10, 9, 7 | 6 tokens at 30 a micro-batch)."""
    actor = make_actor(tiny_model("qwen3-tiny"), **cut)
    batch = make_batch()
    if "micro_batch_tokens" in cut:
        sizes = [len(r) for r in actor._micro_batches(torch.arange(batch.size), batch.attention_mask.sum(1))]
        assert sizes == [2, 3, 1]
    lp = actor.compute_logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.loss_mask, lp, 0)
    m = actor.train_step(batch, lp)
    n = batch.loss_mask.sum(1).float()
    assert m["loss"] == pytest.approx(float(-(batch.advantages * n).sum() / n.sum()), abs=1e-6)


@pytest.mark.parametrize("loss", ["gspo", "cispo", "dr_grpo"])
def test_policy_loss_by_name_trains(tiny_model, loss):
    """algorithm.policy_loss reaches the actor: one optimizer step (micro-batches of 4 and 2) has
    the loss its paper gives at ratio 1, moves the weights, and lifts the positive-advantage rows
    above the negative ones. dr_grpo's normaliser is the run's rollout.max_response_tokens."""
    actor = make_actor(tiny_model("qwen3-tiny"), algorithm={"policy_loss": loss})
    batch = make_batch()
    lp = actor.compute_logprobs(batch)
    batch.rollout_logprobs = torch.where(batch.loss_mask, lp - 0.01, 0)  # IS weight e^0.01 on every token
    before = {n: t.clone() for n, t in actor.export_hf_weights()}
    m = actor.train_step(batch, lp)

    adv, mask, w = batch.advantages.double(), batch.loss_mask, math.exp(0.01)
    n = mask.sum(1).double()
    want = {
        "gspo": -w * adv.mean(),  # 1/G Σ_i s_i A_i, s_i = 1
        "cispo": -w * (adv[:, None] * lp.double())[mask].sum() / n.sum(),  # -Σ sg(r) A logp / tokens
        "dr_grpo": -w * (adv * n).sum() / (actor.sampling.max_response_tokens * len(adv)),
    }[loss]
    assert math.isfinite(m["loss"]) and m["loss"] == pytest.approx(float(want), rel=1e-5, abs=1e-6), m
    assert m["grad_norm"] > 0 and m["update_skipped"] == 0 and m["clip_frac"] == 0
    assert m["is_weight_mean"] == pytest.approx(w, rel=1e-5)
    after = dict(actor.export_hf_weights())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    moved = row_means(actor.compute_logprobs(batch), batch) - row_means(lp, batch)
    assert moved[batch.advantages > 0].mean() > moved[batch.advantages < 0].mean(), moved


def test_padding_costs_nothing(tiny_model):
    """Extra right padding changes neither the logprobs nor the update: micro-batches are trimmed."""
    path = tiny_model("qwen3-tiny")
    results = []
    for pad_to in (0, 40):
        actor = make_actor(path)
        batch = make_batch(pad_to=pad_to)
        lp = actor.compute_logprobs(batch)
        batch.rollout_logprobs = torch.where(batch.loss_mask, lp, 0)
        m = actor.train_step(batch, lp)
        results.append((lp[:, :12], m["loss"], m["grad_norm"], {n: t.clone() for n, t in actor.export_hf_weights()}))
    (lp0, loss0, gn0, w0), (lp1, loss1, gn1, w1) = results
    assert torch.equal(lp0, lp1) and loss0 == loss1 and gn0 == gn1
    assert all(torch.equal(w0[n], w1[n]) for n in w0)


@pytest.mark.parametrize("dtype,distributed_optimizer", [("float32", False), ("bfloat16", True)])
def test_offload_onload_then_step_is_bit_identical(tiny_model, dtype, distributed_optimizer):
    path = tiny_model("qwen3-tiny")
    batch = make_batch()

    def step(actor):
        lp = actor.compute_logprobs(batch)
        batch.rollout_logprobs = torch.where(batch.loss_mask, lp, 0)
        actor.train_step(batch, lp)

    plain = make_actor(path, dtype, distributed_optimizer=distributed_optimizer)
    step(plain)
    step(plain)
    expected = {n: t.clone() for n, t in plain.export_hf_weights()}
    del plain

    actor = make_actor(path, dtype, distributed_optimizer=distributed_optimizer)
    step(actor)
    params = list(actor.model.module.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    # Staged, as in the colocated step: gradients + optimizer first, then parameters after the sync.
    moved, _ = actor.offload(("grads", "optimizer"))
    assert actor.offloaded("grads") and not actor.offloaded("params")
    synced = {n: t.clone() for n, t in actor.export_hf_weights()}  # the sync needs params only
    from colocate_rl.models.mapping import _EXPORT_MAPS

    maps = _EXPORT_MAPS[actor.model.module]  # built by the first export, reused by the next ones
    moved_params, _ = actor.offload(("params",))
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    fp32 = 4 * sum(p.numel() for p in params)
    # params, 2 Adam moments (+ fp32 main params when training in bf16); the fp32 gradients are
    # freed, not copied: they come back as zeros
    main_params = fp32 if dtype != "float32" else 0
    kept = param_bytes + 2 * fp32 + main_params  # plus buffer padding and Adam's step counters
    assert moved_params >= param_bytes and kept <= moved + moved_params < kept + fp32
    with pytest.raises(RuntimeError, match="offloaded"):
        actor.compute_logprobs(batch)
    back, _ = actor.onload()
    assert back == moved + moved_params and not actor.offloaded()
    grads = [b.grad_data for b in actor.model.buffers]
    assert sum(g.numel() for g in grads) >= sum(p.numel() for p in params) and not any(g.any() for g in grads)
    step(actor)
    got = {n: t.clone() for n, t in actor.export_hf_weights()}
    assert _EXPORT_MAPS[actor.model.module] is maps
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert any(not torch.equal(synced[n], expected[n]) for n in expected)  # the second step changed them


def test_sft_steps_lower_the_nll_and_keep_the_rl_schedule(tiny_model):
    actor = make_actor(tiny_model("qwen3-tiny"))
    batch = make_batch()

    def nll():
        return float(-(actor.compute_logprobs(batch) * batch.loss_mask).sum() / batch.loss_mask.sum())

    before = nll()
    losses = [actor.sft_step(batch, lr=3e-3)["loss"] for _ in range(4)]
    assert nll() < before - 0.5 and losses[-1] < losses[0]
    assert losses[0] == pytest.approx(before, abs=1e-5)
    assert actor.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3) and actor.scheduler.num_steps == 0


# ---------------------------------------------------------------- bad input


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported model architecture LlamaForCausalLM"):
        make_actor(tmp_path)


def test_tp_not_dividing_heads_and_ep_not_dividing_experts(tiny_model):
    """The run's plan checks the layout against the model family before any rank starts."""
    from colocate_rl.config import Config, ConfigError, ModelConfig, load
    from colocate_rl.plan import resolve

    def plan(shape: str, *overrides: str):
        base = Config(model=ModelConfig(path=str(tiny_model(shape))))
        return resolve(load(base, overrides=["placement.gpus_per_node=0", "data.max_prompt_tokens=16",
                                             "rollout.max_response_tokens=16", *overrides]))

    with pytest.raises(ConfigError, match="actor.tp=2 does not divide the model's num_key_value_heads=1"):
        plan("qwen3-tiny", "actor.tp=2")
    with pytest.raises(ConfigError, match="actor.ep=3 does not divide the model's num_experts=4"):
        plan("qwen3-moe-tiny", "actor.ep=3", "actor.dp=3")
    with pytest.raises(ConfigError, match="actor.sequence_parallel=true needs actor.tp > 1"):
        plan("qwen3-tiny", "actor.sequence_parallel=true")


def test_missing_tensor_is_named(tiny_model, tmp_path):
    src = tiny_model("qwen3-tiny")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor\\(s\\): model.layers.1.mlp.up_proj.weight"):
        make_actor(tmp_path)


def test_rows_split_evenly_over_ranks_and_micro_batches():
    from colocate_rl.trainer.batching import minibatches, rank_micro_batches

    lengths = torch.tensor([5, 12, 7, 9, 3, 11, 8, 6])
    mbs = minibatches(8, 2, 2)
    assert [m.tolist() for m in mbs] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # contiguous: groups stay whole
    for rows in mbs:
        per_rank = [rank_micro_batches(rows, lengths, 2, r, micro_batch_size=1) for r in range(2)]
        assert len(per_rank[0]) == len(per_rank[1])  # MoE all-to-all needs equal micro-batch counts
        got = sorted(int(i) for mb in per_rank[0] + per_rank[1] for i in mb)
        assert got == rows.tolist()
        # longest rows first, dealt round-robin: ranks get similar token counts
        assert abs(int(lengths[torch.cat(per_rank[0])].sum()) - int(lengths[torch.cat(per_rank[1])].sum())) <= 3
    with pytest.raises(ValueError, match="actor.num_minibatches=3"):
        minibatches(8, 3, 1)
