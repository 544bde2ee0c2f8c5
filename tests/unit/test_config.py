import json

import pytest

from colocate_rl.config import Config, ConfigError, ModelConfig, load, split_cli, to_yaml
from colocate_rl.plan import resolve


def base(**kw) -> Config:
    return Config(model=ModelConfig(path=kw.pop("path", "some/model")), **kw)


def err(overrides, base_cfg=None, files=()):
    """The one line a bad config stops with: at load (a field), or in its plan (between fields)."""
    with pytest.raises(ConfigError) as e:
        resolve(load(base_cfg or base(), files=list(files), overrides=overrides))
    msg = str(e.value)
    assert "\n" not in msg, "config errors are one line"
    return msg


def test_overrides_and_types():
    cfg = load(base(), overrides=["actor.lr=3e-6", "rollout.n=4", "eval.sets=[a,b]"])
    assert cfg.actor.lr == 3e-6 and cfg.rollout.n == 4 and cfg.eval.sets == ["a", "b"]


def test_yaml_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("actor:\n  lr: 2.0e-6\nrollout:\n  n: 16\n")
    cfg = load(base(), files=[str(f)], overrides=["rollout.n=2"])
    assert cfg.actor.lr == 2e-6 and cfg.rollout.n == 2
    assert "lr: 2.0e-06" in to_yaml(cfg)


def test_split_cli():
    assert split_cli(["a.yaml", "x=1", "preset=tiny"]) == (["a.yaml"], ["x=1", "preset=tiny"])


def test_unknown_key_did_you_mean():
    assert "unknown config key 'rollout.temprature'" in err(["rollout.temprature=0.5"])
    assert "did you mean 'rollout.temperature'" in err(["rollout.temprature=0.5"])


def test_unknown_key_in_yaml_names_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("actor:\n  learning_rate: 1.0\n")
    assert str(f) in err([], files=[f]) and "actor.learning_rate" in err([], files=[f])


def test_wrong_type_names_field():
    assert "rollout.n" in err(["rollout.n=many"])


def test_missing_required():
    assert "model.path" in err([], base_cfg=Config())


def test_bad_choice():
    assert "algorithm.loss_agg" in err(["algorithm.loss_agg=sum"])
    assert "model.head_dtype" in err(["model.head_dtype=bfloat16"])


def test_nonpositive():
    assert "rollout.n=0" in err(["rollout.n=0"])


def test_parallel_layout_must_match_gpus():
    msg = err(["placement.gpus_per_node=8", "actor.tp=3"])
    assert "actor.tp=3" in msg and "8 actor GPUs" in msg
    assert "actor.dp=3" in err(["placement.gpus_per_node=8", "actor.tp=2", "actor.dp=3"])
    resolve(load(base(), overrides=["placement.gpus_per_node=8", "actor.tp=2", "actor.pp=2", "actor.dp=2"]))


def plan_err(overrides, model: dict, tmp_path) -> str:
    """The one-line error of the run's plan (layout against the model family, before loading)."""
    from colocate_rl.plan import resolve

    (tmp_path / "config.json").write_text(json.dumps(model))
    cfg = load(base(path=str(tmp_path)), overrides=overrides + ["rollout.max_response_tokens=16",
                                                                "data.max_prompt_tokens=16"])
    with pytest.raises(ConfigError) as e:
        resolve(cfg)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_ep_must_divide_experts(tmp_path):
    from colocate_rl.models.tiny import SHAPES

    msg = plan_err(["placement.gpus_per_node=4", "actor.ep=4"], {**SHAPES["qwen3-moe-tiny"], "num_experts": 6}, tmp_path)
    assert "actor.ep=4" in msg and "num_experts=6" in msg


def test_tp_must_divide_heads(tmp_path):
    from colocate_rl.models.tiny import SHAPES

    msg = plan_err(["placement.gpus_per_node=4", "actor.tp=4"], {**SHAPES["qwen3-tiny"], "num_attention_heads": 6},
                   tmp_path)
    assert "actor.tp=4" in msg and "num_attention_heads=6" in msg


def test_local_launcher_with_several_ranks_stops_before_loading():
    msg = err(["placement.launcher=local", "placement.gpus_per_node=2", "actor.tp=2",
               "rollout.tensor_parallel_size=2"])
    assert "placement.launcher=local" in msg and "2 actor ranks" in msg and "placement.launcher=auto" in msg


def test_gpus_per_node_minus_one_is_this_machines_gpus(monkeypatch):
    from colocate_rl import platform
    from colocate_rl.placement.base import layout

    monkeypatch.setattr(platform, "machine_gpus", lambda: 2)
    cfg = load(base(), overrides=["placement.gpus_per_node=-1"])
    assert cfg.placement.gpus_per_node == 2  # printed as the count
    assert layout(cfg.placement, cfg.actor, cfg.rollout).actor_gpus == 2
    monkeypatch.setattr(platform, "machine_gpus", lambda: 0)
    assert load(base(), overrides=["placement.gpus_per_node=-1"]).placement.gpus_per_node == 0
    assert load(base(), overrides=["placement.gpus_per_node=0"]).placement.gpus_per_node == 0


def test_cpu_on_a_gpu_machine_needs_a_cpu_rollout(monkeypatch):
    """gpus_per_node=0 means the CPU even where GPUs exist; a GPU build of vLLM cannot sample there,
    so the plan stops in one line saying so; the transformers sampler runs on the CPU anywhere."""
    from colocate_rl import plan, platform

    monkeypatch.setattr(platform, "gpus_present", lambda: True)
    monkeypatch.setattr(plan, "vllm_runs_on_cpu", lambda: False)
    cfg = load(base(path="Qwen/Qwen3-0.6B"), overrides=["placement.gpus_per_node=0"])
    with pytest.raises(ConfigError, match="placement.gpus_per_node=0 runs on the CPU, but the installed vLLM is a GPU"):
        plan.resolve(cfg)
    monkeypatch.setattr(plan, "vllm_runs_on_cpu", lambda: True)
    assert plan.resolve(cfg).device.startswith("cpu")


def test_registry_names_are_checked_before_loading():
    from colocate_rl.plan import resolve

    for field, value in (("algorithm.advantage", "ppo"), ("rollout.backend", "sglang"), ("reward.name", "nope")):
        with pytest.raises(ConfigError, match=field):
            resolve(load(base(path="Qwen/Qwen3-0.6B"), overrides=[f"{field}={value}", "placement.gpus_per_node=0"]))


def test_every_config_field_is_read_by_the_code():
    """A field nothing reads is a knob that changes nothing. A field counts as read where the package
    (or a recipe) takes it as a value: an attribute load that is not a method call (``actor.offload(...)``
    would otherwise count for the ``actor.offload`` field), outside config.py's own validation."""
    import ast
    import dataclasses
    from pathlib import Path

    from colocate_rl import config as C

    root = Path(C.__file__).resolve().parents[1]
    read: set[str] = set()
    for path in [*root.joinpath("colocate_rl").rglob("*.py"), *root.joinpath("recipes").glob("*.py")]:
        tree = ast.parse(path.read_text())
        if path == Path(C.__file__).resolve():  # checking a field is not using it
            tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "validate")]
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        read |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and id(n) not in called}
    fields = [(cls.__name__, f.name) for cls in vars(C).values()
              if dataclasses.is_dataclass(cls) and isinstance(cls, type) and cls.__module__ == C.__name__
              for f in dataclasses.fields(cls)]
    assert len(fields) > 80 and ("ActorConfig", "offload") in fields  # the scan sees the whole tree
    unread = [f"{c}.{name}" for c, name in fields if name not in read and not dataclasses.is_dataclass(
        getattr(C, c).__dataclass_fields__[name].default_factory() if callable(
            getattr(C, c).__dataclass_fields__[name].default_factory) else None)]
    assert unread == [], f"config fields no code reads: {unread}"


def test_response_longer_than_context(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    msg = err(["rollout.max_response_tokens=1000"], base_cfg=base(path=str(tmp_path)))
    assert "rollout.max_response_tokens=1000" in msg and "1024" in msg
    assert "rollout.max_model_len" in err(["rollout.max_model_len=256", "data.max_prompt_tokens=200"])


def test_colocated_with_split_pools():
    msg = err(["placement.gpus_per_node=8", "placement.actor_gpus=4"])
    assert "placement.mode=colocated" in msg


def test_disaggregated_split():
    ok = ["placement.mode=disaggregated", "placement.gpus_per_node=8", "placement.actor_gpus=4"]
    resolve(load(base(), overrides=ok))
    assert "placement.actor_gpus" in err(["placement.mode=disaggregated", "placement.gpus_per_node=8"])
    msg = err(["placement.mode=disaggregated", "placement.nnodes=3", "placement.gpus_per_node=8",
               "placement.actor_nodes=2", "placement.rollout_nodes=2"])
    assert "placement.nnodes=3" in msg
    # AMD's published DeepSeek-V4 layout: 2 actor nodes at TP4/PP4 (EP4), 1 rollout node at TP8.
    resolve(load(base(), overrides=["placement.mode=disaggregated", "placement.nnodes=3", "placement.gpus_per_node=8",
                                    "placement.actor_nodes=2", "placement.rollout_nodes=1", "actor.tp=4", "actor.pp=4",
                                    "actor.ep=4", "rollout.tensor_parallel_size=8"]))


def test_reward_and_task_knobs():
    assert "reward.timeout_s" in err(["reward.timeout_s=0"])
    assert "data.arithmetic" in err(["data.arithmetic.ops=/"])


def test_kl_penalty_knobs():
    assert "algorithm.kl_coef=-0.1 must be >= 0" in err(["algorithm.kl_coef=-0.1"])
    cfg = load(base(), overrides=["algorithm.kl_coef=0.1", "actor.ref_on_device=true"])
    assert cfg.actor.ref_on_device and cfg.algorithm.kl_coef == 0.1


def test_preset_needing_gpus_fails_in_one_line_before_loading(monkeypatch):
    from pathlib import Path

    from colocate_rl import cli, platform

    monkeypatch.setattr(platform, "has_gpu", lambda: False)
    recipes = Path(__file__).resolve().parents[2] / "recipes"
    cfg = load(cli.preset_config(recipes / "qwen3_grpo.yaml", "qwen3-8b", recipe="qwen3_grpo"))
    with pytest.raises(SystemExit, match="preset qwen3-8b needs 8 GPUs per node; this machine has 0"):
        cli.check_hardware(cfg)
    with pytest.raises(ConfigError, match="preset='nope' is not one of tiny, qwen3-8b"):
        cli.preset_config(recipes / "qwen3_grpo.yaml", "nope", recipe="qwen3_grpo")
    cli.check_hardware(load(cli.preset_config(recipes / "qwen3_grpo.yaml", "tiny", recipe="qwen3_grpo")))


def test_optimizer_state_on_host_and_its_dtype():
    cfg = load(base(), overrides=["actor.optimizer_cpu_offload=true", "actor.optimizer_state_dtype=bfloat16"])
    assert cfg.actor.optimizer_state_dtype == "bfloat16" and cfg.actor.optimizer_chunk_mb == 256
    assert "needs actor.optimizer_cpu_offload=true" in err(["actor.optimizer_state_dtype=bfloat16"])
    assert "is not one of float32, bfloat16" in err(["actor.optimizer_cpu_offload=true",
                                                     "actor.optimizer_state_dtype=float16"])
    assert "actor.optimizer_chunk_mb=0 must be >= 1" in err(["actor.optimizer_chunk_mb=0"])


def test_micro_batch_tokens_must_not_be_negative():
    assert load(base(), overrides=["actor.micro_batch_tokens=16384"]).actor.micro_batch_tokens == 16384
    assert "actor.micro_batch_tokens=-1 must be >= 0" in err(["actor.micro_batch_tokens=-1"])


def test_fp8_emulation_needs_an_fp8_engine_and_a_family_that_has_one(tmp_path):
    from colocate_rl.models.tiny import SHAPES

    assert "needs rollout.weight_quantization=fp8" in err(["actor.emulate_rollout_fp8=true"])
    msg = plan_err(["placement.gpus_per_node=1", "actor.emulate_rollout_fp8=true", "rollout.weight_quantization=fp8"],
                   SHAPES["qwen3-tiny"], tmp_path)
    assert "actor.emulate_rollout_fp8=true" in msg and "qwen3 has no FP8 emulation" in msg


def test_an_error_as_one_line_names_it_even_without_a_message():
    from colocate_rl.errors import error_line, first_line

    assert first_line(RuntimeError("store refused\nat tcp.cpp:12")) == "store refused"
    assert first_line(RuntimeError("  \n")) == "RuntimeError"  # NCCL/gloo errors can be empty
    assert first_line(TimeoutError()) == "TimeoutError"
    assert error_line(OSError("disk full\ndetail")) == "OSError: disk full"


def _numeric_fields(cls, prefix=""):
    """Dotted names of every int and float field under a config dataclass (bool fields aside)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from _numeric_fields(kind, f"{prefix}{f.name}.")
        elif kind in (int, float):
            yield f"{prefix}{f.name}"


def test_every_numeric_field_has_a_range():
    """A numeric field without a rule would take NaN, inf or a negative count silently."""
    from colocate_rl.config import CHOICES, RANGES

    fields = list(_numeric_fields(Config))
    assert len(fields) > 60 and "reward.timeout_s" in fields and "data.arithmetic.seed" in fields
    assert [f for f in fields if f not in RANGES and f not in CHOICES] == []
    assert [k for k in RANGES if k not in fields] == []  # no rule for a field that is gone


@pytest.mark.parametrize("override, line", [
    ("reward.timeout_s=nan", "reward.timeout_s=nan must be a finite number in (0, 86400]"),
    ("sync.timeout_s=inf", "sync.timeout_s=inf must be a finite number in (0, 86400]"),
    ("actor.lr=nan", "actor.lr=nan must be a finite number >= 0"),
    ("algorithm.eps_high=-inf", "algorithm.eps_high=-inf must be a finite number >= 0"),
    ("rollout.top_p=0", "rollout.top_p=0.0 must be in (0, 1]"),
    ("rollout.top_p=1.5", "rollout.top_p=1.5 must be in (0, 1]"),
    ("rollout.top_k=-2", "rollout.top_k=-2 must be >= -1 (0 or -1: every token)"),
    ("actor.adam_beta2=1", "actor.adam_beta2=1.0 must be in [0, 1)"),
    ("seed=-1", "seed=-1 must be in [0, 4294967295]"),
    ("placement.gpus_per_node=-2", "placement.gpus_per_node=-2 must be >= -1 (-1: this machine's GPUs, 0: the CPU)"),
])
def test_range_errors_read_as_the_rule(override, line):
    assert err([override]) == line


def test_ranges_let_their_edges_through():
    cfg = load(base(), overrides=["rollout.temperature=0", "rollout.top_p=1", "actor.adam_beta1=0", "seed=4294967295",
                                  "reward.timeout_s=86400", "reward.workers=256", "checkpoint.keep=0",
                                  "rollout.top_k=-1"])
    assert cfg.rollout.top_p == 1.0 and cfg.reward.workers == 256 and cfg.seed == 2**32 - 1
    assert cfg.rollout.top_k == -1


def test_min_lr_above_lr_and_too_many_cpu_ranks():
    assert err(["actor.lr=1e-6", "actor.min_lr=1e-5"]).startswith("actor.min_lr=1e-05 must be <= actor.lr=1e-06")
    msg = err(["placement.gpus_per_node=0", "actor.dp=300"])
    assert "300 actor ranks" in msg and "at most 256" in msg


def test_multi_turn_rollouts_need_the_chat_format_and_known_tools():
    on = ["rollout.agent.enabled=true"]
    assert err([*on, "data.apply_chat_template=false"]).startswith(
        "rollout.agent.enabled=true writes every turn in the model's chat format")
    chat = [*on, "data.apply_chat_template=true"]
    assert err([*chat, "tools.names=[calculator,search]"]) == \
        "tools.names=['calculator', 'search']: 'search' is not one of calculator, python"
    assert err([*chat, "tools.names=[]"]) == "tools.names=[]: a multi-turn rollout needs at least one tool"
    assert err([*chat, "rollout.agent.max_turns=0"]).startswith("rollout.agent.max_turns=0 must be")
    assert err([*chat, "tools.timeout_s=0"]).startswith("tools.timeout_s=0.0 must be")
    assert resolve(load(base(), overrides=[*chat, "tools.names=[calculator]"])).cfg.rollout.agent.enabled
    assert err(["data.arithmetic.min_operand=10", "data.arithmetic.max_operand=9"]).startswith(
        "data.arithmetic.min_operand=10 must be <= data.arithmetic.max_operand")
