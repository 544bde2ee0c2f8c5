"""A small DeepSeek-V4 across gloo processes gives what one process gives, through the actor: the
logprobs before one GRPO step, the step's loss and grad norm, the weights after it (the gathered
export) and the logprobs after it.

Two processes: TP=2 (heads, o-groups, sinks, vocabulary and the shared expert split, sequence
parallelism), PP=2, EP=2 (data parallel 2) and TP=2 x EP=2 (experts over the tensor-parallel ranks;
full recompute), plus the gathered export of a bf16 model at PP=2 (its fp32 mHC parameters cross
stages as fp32).
Four processes: TP=2 x PP=2 x EP=2, which also resumes a one-rank checkpoint (same logprobs, and
the next step, which reads the restored Adam moments, moves the model as on one rank) and saves
one that one rank loads (same weights, same logprobs): megatron-core reshards on load.

The model has one window-only, one C4 and one C128 layer, the first two hash-routed, so PP=2 splits
it unevenly (one layer, then two) and the second stage holds a hash-routed layer; one row is long
enough for a C128 entry.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers.models.deepseek_v4")

from batches import make_actor, step_view  # noqa: E402

HF = dict(num_hidden_layers=3, compress_ratios=[0, 4, 128], num_hash_layers=2)
LENS = [140, 9, 11, 6, 10, 7, 12, 5]  # tokens per row of the synthetic batch (4 prompts x 2 samples)
# Adam's first step moves a weight by lr·g/(|g|+eps): at the default eps 1e-8 a gradient within
# rounding of zero (layer 0's mHC mixing has thousands: its four streams start equal) moves by
# anything in ±lr, so two summation orders can disagree by lr there. With eps 1e-3 the move is
# smooth in g, and the weights after the step agree to fp32 rounding when the gradients do.
COMMON = dict(adam_eps=1e-3)
SP = dict(sequence_parallel=True)
LAYOUTS = {  # world size 2
    "tp2": dict(tp=2, distributed_optimizer=True, **SP),
    "pp2": dict(pp=2),
    "ep2": dict(ep=2, distributed_optimizer=True),
    "tp2ep2": dict(tp=2, ep=2, recompute=True, **SP),
}
MIXED = dict(tp=2, pp=2, ep=2, **SP)  # world size 4


def layout(overrides: dict) -> dict:
    return {**COMMON, **overrides}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from colocate_rl.models.deepseek_v4 import synth

    return str(synth.write_model(tmp_path_factory.mktemp("dsv4-3layer"), synth.official_config(**HF), seed=0))


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """One rank: the first step's view; a checkpoint after it (Adam moments non-zero); the second
    step's view from there."""
    actor = make_actor(model_dir, layout({}))
    first = step_view(actor, LENS)
    ckpt = str(tmp_path_factory.mktemp("dsv4-ckpt") / "one_rank")
    actor.save_checkpoint(ckpt)
    return {"first": first, "ckpt": ckpt, "second": step_view(actor, LENS)}


def checkpoint_tensors(path: str) -> dict:
    return load_file(path + "/model.safetensors")


def assert_matches(name: str, got: dict, want: dict) -> None:
    for key in ("before", "after"):
        diff = (got[key] - want[key]).abs().max().item()
        assert diff <= 1e-5, f"{name}: logprobs {key} the step differ from one rank by {diff}"
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6), name
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), name
    assert sorted(got["exported_after"]) == sorted(want["exported_after"]), name
    for n, t in want["exported_after"].items():
        diff = (got["exported_after"][n] - t).abs().max().item()
        assert diff <= 1e-6, f"{name}: {n} after the step differs from one rank by {diff}"


# ---------------------------------------------------------------- two processes


def bf16_export(path: str, overrides: dict) -> dict:
    return {n: t.clone() for n, t in make_actor(path, overrides, dtype="bfloat16").export_hf_weights()}


def two_rank_layouts(path: str) -> dict:
    """One spawn for every layout: each Actor re-initialises Megatron's parallel state."""
    out = {name: step_view(make_actor(path, layout(o)), LENS) for name, o in LAYOUTS.items()}
    out["bf16_pp2"] = bf16_export(path, dict(pp=2))
    return out


# Slow: one spawn of two fresh processes importing torch + megatron-core, five actors (~60 s of CPU).
@pytest.mark.slow
def test_two_ranks_match_one_rank(model_dir, reference):
    from colocate_rl.trainer import run_on_ranks

    got = run_on_ranks(two_rank_layouts, 2, model_dir)
    ref = reference["first"]
    ckpt = checkpoint_tensors(model_dir)
    for name in LAYOUTS:
        assert sorted(got[name]["exported"]) == sorted(ckpt), name  # the routing state too
        for n, t in got[name]["exported"].items():
            assert torch.equal(t, ckpt[n]), f"{name}: exported {n} differs from the checkpoint"
        assert_matches(name, got[name], ref)
    kept = {n for n, t in got["bf16_pp2"].items() if t.dtype == torch.float32}
    assert kept and "layers.2.hc_attn_fn" in kept and "layers.1.attn.attn_sink" in kept
    for n, t in got["bf16_pp2"].items():
        assert torch.equal(t, ckpt[n] if n in kept else ckpt[n].to(torch.bfloat16)), f"bf16 pp2: {n}"


# ---------------------------------------------------------------- four processes


def mixed_layout(path: str, one_rank_ckpt: str, out_ckpt: str) -> dict:
    """TP=2 x PP=2 x EP=2: a step from the HF weights; then a step from the one-rank checkpoint,
    saved again after it."""
    actor = make_actor(path, layout(MIXED))
    first = step_view(actor, LENS)
    actor.load_checkpoint(one_rank_ckpt)
    second = step_view(actor, LENS)
    actor.save_checkpoint(out_ckpt)
    return {"first": first, "second": second}


@pytest.fixture(scope="module")
def mixed(model_dir, reference, tmp_path_factory) -> dict:
    from colocate_rl.trainer import run_on_ranks

    out_ckpt = str(tmp_path_factory.mktemp("dsv4-ckpt") / "mixed")
    return {"ckpt": out_ckpt, **run_on_ranks(mixed_layout, 4, model_dir, reference["ckpt"], out_ckpt)}


# Slow: one spawn of four processes on two cores, each importing torch + megatron-core (~70 s of CPU).
@pytest.mark.slow
def test_tp2_pp2_ep2_matches_one_rank(mixed, reference):
    assert_matches("tp2pp2ep2", mixed["first"], reference["first"])


@pytest.mark.slow  # shares the four-process run above
def test_checkpoints_reshard_between_one_rank_and_tp2_pp2_ep2(mixed, reference, model_dir):
    assert_matches("resumed at tp2pp2ep2", mixed["second"], reference["second"])
    actor = make_actor(model_dir, layout({}))
    actor.load_checkpoint(mixed["ckpt"])
    saved = mixed["second"]["exported_after"]
    loaded = {n: t.clone() for n, t in actor.export_hf_weights()}
    assert sorted(loaded) == sorted(saved)
    for n, t in saved.items():
        assert torch.equal(loaded[n], t), f"{n} differs after a TP=2 x PP=2 x EP=2 checkpoint loads on one rank"
    from batches import synthetic_batch

    diff = (actor.compute_logprobs(synthetic_batch(LENS, seed=1)) - mixed["second"]["after"]).abs().max().item()
    assert diff <= 1e-5, f"logprobs of the TP=2 x PP=2 x EP=2 checkpoint on one rank differ by {diff}"
