"""The phase cycle and the memory plan: legality, the phase that overflows, what auto offloads, and
the plans of real models at their published sizes (from their configs alone)."""

import pytest

from colocate_rl.config import Config, ModelConfig, load
from colocate_rl.memory import IllegalTransition, MemoryOverflow, MemoryPlan, Phase, PhaseMachine, activation_bytes
from colocate_rl.models.registry import model_size
from colocate_rl.models.tiny import known_config
from colocate_rl.plan import resolve

CYCLE = [Phase.IDLE, Phase.ACTOR, Phase.ACTOR_PARAMS, Phase.SYNC, Phase.ROLLOUT_WEIGHTS, Phase.ROLLOUT]
GiB = 2**30


def test_full_cycle_twice():
    h = PhaseMachine()
    for _ in range(2):
        for ph in CYCLE:
            h.to(ph)
    assert h.phase == Phase.ROLLOUT and len(h.history) == 1 + 2 * len(CYCLE)


@pytest.mark.parametrize("start,bad", [(Phase.ROLLOUT, Phase.ACTOR), (Phase.IDLE, Phase.SYNC),
                                       (Phase.ACTOR, Phase.ROLLOUT), (Phase.SYNC, Phase.ROLLOUT)])
def test_illegal_transitions_raise_and_name_the_way(start, bad):
    h = PhaseMachine(start=start)
    with pytest.raises(IllegalTransition, match=f"cannot go from '{start.value}' to '{bad.value}'"):
        h.to(bad)
    assert h.phase == start


def test_overflow_names_the_phase():
    plan = MemoryPlan(capacity=80 * GiB, parts={"rollout_weights": 16 * GiB, "kv_cache": 50 * GiB,
                                                "actor_params": 16 * GiB, "actor_grads": 32 * GiB,
                                                "actor_optimizer": 40 * GiB, "activations": 4 * GiB})
    h = PhaseMachine(plan)
    h.to(Phase.IDLE)
    with pytest.raises(MemoryOverflow, match="phase 'actor' would need 92.00 GiB of 80.00 GiB"):
        h.to(Phase.ACTOR)
    assert h.phase == Phase.IDLE


def test_staged_wake_peak_is_below_unstaged():
    plan = MemoryPlan(capacity=80 * GiB, parts={"rollout_weights": 16 * GiB, "kv_cache": 50 * GiB,
                                                "actor_params": 16 * GiB, "sync_buckets": 1 * GiB})
    staged = max(plan.peaks().values())
    assert staged == 66 * GiB and plan.unstaged_peak() == 83 * GiB > plan.capacity > staged


def test_measured_usage_recorded():
    used = iter([1, 5, 9])
    h = PhaseMachine(measure=lambda: next(used))
    h.to(Phase.IDLE)
    h.to(Phase.ACTOR)
    assert h.peak_used() == {"rollout": 1, "idle": 5, "actor": 9}


def _plan(model: str, accelerator: str, **over) -> MemoryPlan:
    """The run's memory plan on 8 GPUs of ``accelerator`` (what does not fit is listed, not raised)."""
    over = {"placement.gpus_per_node": 8, "model.dtype": "bfloat16", "placement.accelerator": accelerator, **over}
    cfg = load(Config(model=ModelConfig(path=model)), overrides=[f"{k}={v}" for k, v in over.items()])
    return resolve(cfg, strict=False).memory


def test_auto_offloads_only_what_does_not_fit():
    """Qwen3-0.6B beside vLLM on an H200: nothing needs to leave the card; squeeze vLLM's share and
    the optimizer, then the parameters too, must go."""
    small = _plan("Qwen/Qwen3-0.6B", "h200", **{"rollout.gpu_memory_utilization": 0.5})
    assert small.offload == () and small.overflow() is None
    big = dict(**{"actor.tp": 2, "actor.distributed_optimizer": True, "rollout.gpu_memory_utilization": 0.75})
    plan = _plan("Qwen/Qwen3-8B", "h100", **big)
    assert plan.offload == ("grads", "optimizer") and plan.overflow() is None, plan.table()
    assert _plan("Qwen/Qwen3-8B", "h100", **big, **{"actor.offload": "none"}).overflow() == Phase.ROLLOUT
    assert _plan("Qwen/Qwen3-0.6B", "h200", **{"actor.offload": "all"}).offload == ("grads", "optimizer", "params")


def test_fp32_residual_unset_follows_dtype_mode_and_family_and_is_counted():
    """Unset, actor.fp32_residual is on for a 16-bit actor only: off in fp32, in exact mode and for a
    family with its own residual (DeepSeek-V4's mHC streams); set, it is as set. The plan counts its
    fp32 layer inputs under full recompute: 2 more bytes per token and hidden unit and layer."""
    def fp32(model="m", **over):
        over = {"placement.gpus_per_node": 0, **over}
        cfg = load(Config(model=ModelConfig(path=model)), overrides=[f"{k}={v}" for k, v in over.items()])
        return resolve(cfg, strict=False).resolved.kernels.fp32_residual

    assert fp32() and not fp32(**{"model.dtype": "float32"})
    assert not fp32(**{"rollout.exact": "true", "placement.gpus_per_node": 1})
    assert not fp32("deepseek-ai/DeepSeek-V4-Flash")
    assert not fp32(**{"actor.fp32_residual": "false"})
    assert fp32(**{"actor.fp32_residual": "true", "model.dtype": "float32"})
    over = {"actor.recompute": "true", "actor.micro_batch_size": 4}
    wide, narrow = (_plan("Qwen/Qwen3-8B", "h200", **over, **{"actor.fp32_residual": v}) for v in ("null", "false"))
    size = model_size(known_config("Qwen/Qwen3-8B"))
    tokens = 4 * (Config().data.max_prompt_tokens + Config().rollout.max_response_tokens)
    layers_extra = 2 * tokens * size.hidden * size.layers
    norms_extra = 2 * tokens * size.hidden * 2  # one layer's two norm inputs, 2 bytes more each
    assert any("residual stream in fp32" in n for n in wide.notes) and not narrow.notes
    assert wide.parts["activations"] - narrow.parts["activations"] == pytest.approx(
        1.15 * (layers_extra + norms_extra), rel=1e-6)


def test_fused_logprobs_keep_no_fp32_chunks():
    """On a GPU the logprobs are fused unless actor.logprob_kernel=chunked (or exact mode): the plan's
    head then holds no fp32 chunk temporaries, two chunks fewer than the chunked path's."""
    from colocate_rl.trainer.logprobs import CHUNK_ELEMENTS

    fused, chunked = (_plan("Qwen/Qwen3-0.6B", "h200", **{"actor.logprob_kernel": k}) for k in ("auto", "chunked"))
    diff = chunked.parts["activations"] - fused.parts["activations"]
    assert diff == pytest.approx(1.15 * 2 * 4 * CHUNK_ELEMENTS, rel=1e-6)
    plain = {"actor.fp32_residual": "false"}  # exact mode's residual stream
    exact = _plan("Qwen/Qwen3-0.6B", "h200", **plain, **{"rollout.exact": "true"})
    assert exact.parts["activations"] == _plan("Qwen/Qwen3-0.6B", "h200", **plain,
                                               **{"actor.logprob_kernel": "chunked"}).parts["activations"]


def test_grouped_experts_count_one_layers_stacked_fc1_and_its_gradient():
    """On a GPU a bf16 Qwen3-MoE's experts run grouped (actor.expert_kernel=auto): the plan adds the
    stacked copy of one layer's fc1 weights and their stacked gradient, split by expert parallelism."""
    def activations(kernel, ep=1):
        return _plan("Qwen/Qwen3-30B-A3B", "h200", **{"actor.expert_kernel": kernel, "actor.ep": ep,
                                                      "actor.dp": 8}).parts["activations"]

    fc1 = 128 * 2 * 768 * 2048  # 128 experts' gate and up rows in one layer
    assert activations("auto") - activations("sequential") == pytest.approx(2 * 2 * fc1, abs=4)
    assert activations("auto", ep=8) - activations("sequential", ep=8) == pytest.approx(2 * 2 * fc1 / 8, abs=4)
    assert model_size(known_config("Qwen/Qwen3-8B")).expert_layer == 0


def test_published_models_are_counted_from_their_configs():
    assert 0.59e9 < model_size(known_config("Qwen/Qwen3-0.6B")).total < 0.61e9
    assert 8.1e9 < model_size(known_config("Qwen/Qwen3-8B")).total < 8.3e9
    moe = model_size(known_config("Qwen/Qwen3-30B-A3B"))
    assert 30.0e9 < moe.total < 31.0e9 and moe.experts > 0.9 * moe.total
    dsv4 = model_size(known_config("deepseek-ai/DeepSeek-V4-Flash"))
    assert 280e9 < dsv4.total < 290e9, dsv4.total  # "284B"


def test_host_memory_names_what_it_holds_and_stops_when_the_node_cannot():
    """Qwen3-8B with host Adam on one H200 of a node with 125 GiB: fp32 moments (12 bytes per
    parameter, 91.5 GiB) beside the offloaded bf16 parameters and an engine asleep at level 1 (its
    weights copied to host memory) do not fit; bf16 moments at sleep level 2 do. (On such a node an
    fp32 run at level 2, 108 GiB by this plan, started and reached its training step.)"""
    over = {"placement.gpus_per_node": 1, "actor.optimizer_cpu_offload": True, "actor.offload": "all",
            "rollout.gpu_memory_utilization": 0.35}
    plan = _plan("Qwen/Qwen3-8B", "h200", **over, **{"rollout.sleep_level": 1})
    parts = {k: v / GiB for k, v in plan.host_parts.items()}
    # The offloaded parts: the bf16 parameters (15.3 GiB) and host Adam's device chunk buffers.
    assert 90 < parts["host Adam state"] < 93 and 15 < parts["offloaded actor parts"] < 17
    assert 15 < parts["engine weights asleep"] < 16 and plan.host_error() is None  # unchecked: no capacity
    plan.host_capacity = 125 * GiB
    err = plan.host_error()
    assert err.startswith("host memory: the run keeps 123.6 GiB") and "host Adam state 91.5" in err, err
    assert "actor.optimizer_state_dtype=bfloat16" in err and "OVER" in plan.table()
    fits = _plan("Qwen/Qwen3-8B", "h200", **over, **{"actor.optimizer_state_dtype": "bfloat16"})
    fits.host_capacity = 125 * GiB
    assert fits.host_error() is None and 77 < fits.host_per_node / GiB < 78
    assert "host memory per node: 77.3" in fits.table() and "of 125.0 GiB" in fits.table()


def test_a_run_this_node_cannot_hold_stops_before_loading(monkeypatch):
    """On a GPU machine the plan sets host memory against the node's own RAM: Qwen3-8B with host
    Adam in fp32 on a node of 96 GiB stops in one line; with bf16 moments it plans."""
    from colocate_rl import plan as P
    from colocate_rl.config import ConfigError

    monkeypatch.setattr(P.platform, "machine_gpus", lambda: 1)
    monkeypatch.setattr(P, "device_summary", lambda cfg, lay: ("1 node(s) x 1 GPUs, test", int(139.8 * GiB)))
    page = 4096
    monkeypatch.setattr(P.os, "sysconf", lambda name: page if name == "SC_PAGE_SIZE" else 96 * GiB // page)
    over = {"placement.gpus_per_node": 1, "actor.optimizer_cpu_offload": True, "rollout.gpu_memory_utilization": 0.35}
    cfg = load(Config(model=ModelConfig(path="Qwen/Qwen3-8B")), overrides=[f"{k}={v}" for k, v in over.items()])
    with pytest.raises(ConfigError, match=r"^host memory: the run keeps 91.5 GiB per node .* of the node's 96.0 GiB; "
                                          r"actor.optimizer_state_dtype=bfloat16"):
        P.resolve(cfg)
    cfg.actor.optimizer_state_dtype = "bfloat16"
    plan = P.resolve(cfg)
    assert plan.memory.host_capacity == 96 * GiB and "of 96.0 GiB" in plan.memory.table()


def _described(*over, model="Qwen/Qwen3-0.6B"):
    from colocate_rl.plan import resolve

    return resolve(load(Config(model=ModelConfig(path=model)),
                        overrides=["placement.gpus_per_node=0", "model.dtype=bfloat16", *over])).describe()


def _kernels_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("kernels: ")]
    assert len(lines) == 1, text
    return lines[0]


def test_the_plan_prints_what_unset_and_auto_settings_resolve_to():
    """The printed config shows actor.fp32_residual as null and the kernels as auto; the plan's one
    kernels line says what they are on this run (on the CPU: fp32 residual on for bf16, chunked logprobs)."""
    assert _kernels_line(_described()).startswith(
        "kernels: actor.fp32_residual=true, actor.logprob_kernel=chunked, actor.norm_kernel=eager; megatron-core: ")
    assert _kernels_line(_described("model.dtype=float32")).startswith("kernels: actor.fp32_residual=false,")
    assert "actor.logprob_kernel=fused" in _kernels_line(_described("actor.logprob_kernel=fused"))
    # a MoE's experts: sequential on the CPU (grouped GEMMs on a GPU); a dense model says nothing of them
    assert "actor.expert_kernel" not in _described()
    moe = _described("actor.fp32_residual=true", "actor.logprob_kernel=fused", model="Qwen/Qwen3-30B-A3B")
    assert "actor.expert_kernel=sequential" in _kernels_line(moe)


def test_the_kernels_line_says_which_megatron_fallbacks_run(monkeypatch):
    """megatron-core's layer spec and optimizer, and the optional packages this machine lacks (what its
    import warns of, once per module, said here once)."""
    import importlib.util

    from colocate_rl import plan

    found = importlib.util.find_spec

    def packages(*present):
        def find_spec(name, *args):
            if name in ("transformer_engine", "apex"):
                return object() if name in present else None
            return found(name, *args)

        monkeypatch.setattr(plan.importlib.util, "find_spec", find_spec)

    packages()
    assert _kernels_line(_described()).endswith(
        "megatron-core: local layer spec, torch optimizers (Transformer Engine, apex: not installed)")
    assert _kernels_line(_described("actor.optimizer_cpu_offload=true")).endswith(
        "megatron-core: local layer spec, host Adam (Transformer Engine, apex: not installed)")
    packages("apex")
    assert _kernels_line(_described()).endswith("local layer spec, apex's fused Adam (Transformer Engine: not installed)")
    packages("transformer_engine", "apex")
    assert _kernels_line(_described()).endswith("megatron-core: local layer spec, Transformer Engine's fused Adam")
    gpu = _described("placement.gpus_per_node=1", "placement.accelerator=h200")
    assert _kernels_line(gpu).endswith("megatron-core: Transformer Engine layer spec, Transformer Engine's fused Adam")


def test_micro_batches_by_tokens_are_planned_by_their_budget():
    """actor.micro_batch_tokens: the plan's micro-batch is the budget (padding included), as rows of
    the longest length would be, and never less than one such row (which runs alone)."""
    row = Config().data.max_prompt_tokens + Config().rollout.max_response_tokens
    by_rows = _plan("Qwen/Qwen3-8B", "h200", **{"actor.micro_batch_size": 4})
    by_tokens = _plan("Qwen/Qwen3-8B", "h200", **{"actor.micro_batch_tokens": 4 * row, "actor.micro_batch_size": 1})
    assert by_tokens.parts["activations"] == by_rows.parts["activations"]
    tiny, one_row = (_plan("Qwen/Qwen3-8B", "h200", **over) for over in
                     ({"actor.micro_batch_tokens": row // 2}, {"actor.micro_batch_size": 1}))
    assert tiny.parts["activations"] == one_row.parts["activations"] < by_rows.parts["activations"]


def test_the_sync_counts_a_bucket_and_what_the_export_gathers():
    """One rank gathers nothing; the sync phase holds a bucket and the largest tensor. Across ranks the
    export moves runs of parameters of up to mapping.RUN_BYTES, which counts where it is the larger
    (a small model: every real Qwen3's embedding is larger)."""
    from colocate_rl.models.mapping import RUN_BYTES

    bucket = Config().sync.bucket_mb * 2**20
    for model, largest in (("Qwen/Qwen3-30B-A3B", 151936 * 2048 * 2), ("qwen3-small", 0)):
        short = {"data.max_prompt_tokens": 128}  # within qwen3-small's context
        one = _plan(model, "h200", **short, **{"placement.gpus_per_node": 1}).parts["sync_buckets"]
        two = _plan(model, "h200", **short, **{"placement.gpus_per_node": 2, "actor.tp": 2}).parts["sync_buckets"]
        if largest:
            assert one == two == bucket + largest > bucket + RUN_BYTES, model
        else:
            assert one < bucket + RUN_BYTES == two, model


def test_a_plan_that_fits_only_with_host_adam_says_so():
    """Qwen3-4B's step on one H100 needs 82 GiB with Adam's state on the card: the line that stops the
    run offers actor.optimizer_cpu_offload, which fits; where that would not fit either, it offers nothing."""
    def problems(accelerator: str, **over) -> list[str]:
        over = {"placement.gpus_per_node": 1, "model.dtype": "bfloat16", "placement.accelerator": accelerator, **over}
        cfg = load(Config(model=ModelConfig(path="Qwen/Qwen3-4B")), overrides=[f"{k}={v}" for k, v in over.items()])
        return resolve(cfg, strict=False).problems

    tight, = problems("h100")
    assert "phase 'actor'" in tight and tight.endswith("actor.optimizer_cpu_offload=true fits (Adam's state in "
                                                       "host memory: 45 GiB a node)"), tight
    assert problems("h100", **{"actor.optimizer_cpu_offload": True}) == []
    hopeless, = problems("h100", **{"rollout.gpu_memory_utilization": 0.9})
    assert "optimizer_cpu_offload" not in hopeless, hopeless


def test_fp32_head_counts_fp32_logits_and_the_weight_copy():
    """model.head_dtype=float32: the head's share of the activations holds fp32 logits and their
    gradient (twice the bf16 ones) and the fp32 copies of the output weight and its input."""
    size = model_size(known_config("Qwen/Qwen3-0.6B"))
    tokens = 64 * 22
    _, bf16 = activation_bytes(size, tokens, fused=True)
    _, fp32 = activation_bytes(size, tokens, fused=True, fp32_head=True)
    assert fp32 - bf16 == 2 * 2 * tokens * size.vocab + 4 * (size.vocab + tokens) * size.hidden
    assert _plan("Qwen/Qwen3-0.6B", "h200", **{"model.head_dtype": "float32"}).parts["activations"] > \
        _plan("Qwen/Qwen3-0.6B", "h200").parts["activations"]
