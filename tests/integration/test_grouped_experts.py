"""actor.expert_kernel=grouped: a bf16 Qwen3-MoE or DeepSeek-V4 actor (real megatron-core on the CPU;
DeepSeek-V4's experts with its clamped SwiGLU and hash-routed layers) whose experts run through the
grouped GEMMs scores, and takes an optimizer step, as the sequential one does."""

from __future__ import annotations

import pytest

from batches import make_actor, step_view, synthetic_batch

LENS = [24] * 4


@pytest.mark.parametrize("shape", ["qwen3-moe-tiny", "deepseek-v4-tiny"])
def test_grouped_experts_score_and_train_as_the_sequential_ones(tiny_model, shape):
    from colocate_rl.models.grouped_experts import GroupedExperts

    if shape.startswith("deepseek"):
        pytest.importorskip("transformers.models.deepseek_v4")
    path = str(tiny_model(shape, dtype="bfloat16"))
    runs = {}
    for kernel in ("sequential", "grouped"):
        actor = make_actor(path, {"expert_kernel": kernel}, dtype="bfloat16")
        layers = [m for m in actor.model.modules() if isinstance(m, GroupedExperts)]
        assert len(layers) >= 2 and all(m.grouped == (kernel == "grouped") for m in layers)
        n_experts = sum(m.num_local_experts for m in layers)
        runs[kernel] = step_view(actor, LENS)
    seq, grp = runs["sequential"], runs["grouped"]
    m = synthetic_batch(LENS, seed=1).loss_mask  # step_view's batch
    gap = (grp["before"] - seq["before"])[m].abs()
    gn_s, gn_g = seq["grad_norm"], grp["grad_norm"]
    # Equal up to summation order (on this CPU the grouped GEMM's loop gives the same bits; with fc2's
    # experts in reverse order the largest gap was 0.044, 2.8 for DeepSeek-V4). Every expert weight
    # took the same step: Adam's first step moves each weight by ~lr, against one gradient's sign.
    assert m.sum() > 0 and gap.max() < 1e-3, gap.max()
    assert gn_s > 0 and gn_g == pytest.approx(gn_s, rel=1e-3)
    # the exported experts after the step (gate, up and down of each; the shared experts excluded)
    w_s, w_g = ({n: t.float() for n, t in r["exported_after"].items() if ".experts." in n} for r in (seq, grp))
    assert len(w_s) == 3 * n_experts and w_s.keys() == w_g.keys()
    moved = sum(((w_g[n] - w_s[n]).abs() > 0).float().mean().item() for n in w_s) / len(w_s)
    assert moved < 0.01, moved


def test_an_explicit_grouped_the_experts_cannot_run_fails_in_one_line(tmp_path, monkeypatch):
    """Widths off the grouped GEMM's 16-byte row alignment: actor.expert_kernel=grouped stops with the
    reason, before anything runs."""
    from colocate_rl.models import tiny

    monkeypatch.setitem(tiny.SHAPES, "qwen3-moe-odd", {**tiny.SHAPES["qwen3-moe-tiny"], "moe_intermediate_size": 60})
    path = str(tiny.ensure_model("qwen3-moe-odd", tmp_path / "odd", dtype="bfloat16"))
    with pytest.raises(ValueError, match=r"^actor.expert_kernel=grouped: hidden 64 or expert width 60 is not a "
                                         r"multiple of 8$"):
        make_actor(path, {"expert_kernel": "grouped"}, dtype="bfloat16")
