"""The vllm.LLM arguments each rollout setting turns into (rollout/engine.py llm_kwargs), and the
one-line stop of an FP8 engine whose vLLM lacks a package it imports."""

import importlib.util

import pytest

from colocate_rl.config import Config, ModelConfig, load
from colocate_rl.plan import resolve
from colocate_rl.rollout.engine import llm_kwargs


def kwargs(*overrides, eager=False, on_cpu=False, quantized=False):
    gpus = [] if on_cpu else ["placement.gpus_per_node=2"]  # FP8 and R3 stop in the plan on CPUs
    plan = resolve(load(Config(model=ModelConfig(path="m")), overrides=[*gpus, *overrides]))
    return llm_kwargs(plan.cfg.model, plan.engine, plan.sampling, plan.resolved, "m", eager=eager, on_cpu=on_cpu,
                      quantized_checkpoint=quantized)


def test_exact_mode_keeps_cuda_graphs_but_not_torch_compile():
    """Exact mode: vLLM's own kernels (no Inductor), replayed by CUDA graphs for decode (measured
    exact on an H200); an eager engine when asked for."""
    k = kwargs("rollout.exact=true")
    assert k["enforce_eager"] is False
    assert k["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert "compilation_config" not in kwargs("rollout.exact=true", eager=True)
    assert "compilation_config" not in kwargs()  # the default engine compiles as vLLM does


def test_each_setting_reaches_the_engine():
    base = kwargs()
    assert base["logprobs_mode"] == "processed_logprobs" and base["enable_sleep_mode"] is True
    assert "distributed_executor_backend" not in base and "quantization" not in base
    assert "enable_return_routed_experts" not in base
    assert kwargs("rollout.tensor_parallel_size=2")["distributed_executor_backend"] == "mp"
    assert kwargs("rollout.routing_replay=true")["enable_return_routed_experts"] is True
    assert kwargs("rollout.weight_quantization=fp8")["quantization"] == "fp8"
    # A checkpoint already in FP8 carries its own quantization config.
    assert "quantization" not in kwargs("rollout.weight_quantization=fp8", quantized=True)
    cpu = kwargs("rollout.kv_cache_memory_mb=64", on_cpu=True)
    assert cpu["kv_cache_memory_bytes"] == 64 * 2**20 and "enable_sleep_mode" not in cpu
    assert kwargs("rollout.kv_cache_memory_mb=64")["kv_cache_memory_bytes"] == 64 * 2**20
    assert "hf_overrides" not in base
    assert kwargs("model.head_dtype=float32")["hf_overrides"] == {"head_dtype": "float32"}


def test_user_engine_kwargs_come_last():
    k = kwargs("rollout.exact=true", "rollout.engine_kwargs={enforce_eager: true, max_num_seqs: 7}")
    assert k["enforce_eager"] is True and k["max_num_seqs"] == 7
    assert kwargs("rollout.engine_kwargs={use_tqdm_on_load: true}")["use_tqdm_on_load"] is True
    both = kwargs("model.head_dtype=float32", "rollout.engine_kwargs={hf_overrides: {rope_theta: 5}}")
    assert both["hf_overrides"] == {"head_dtype": "float32", "rope_theta": 5}


def test_the_engine_loads_quietly_unless_logging_is_verbose():
    """The quiet console (console.py): no progress bar of vLLM's own while it loads the weights."""
    assert kwargs()["use_tqdm_on_load"] is False
    assert "use_tqdm_on_load" not in kwargs("logging.verbose=true")  # vLLM's default: a bar


def test_fp8_engine_without_compressed_tensors_stops_in_one_line(monkeypatch):
    from colocate_rl.rollout import engine

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "compressed_tensors"
                        else real(name, *a))
    with pytest.raises(RuntimeError, match="needs the compressed-tensors package") as e:
        engine.require_quantization_deps()
    assert "\n" not in str(e.value)
    monkeypatch.setattr(importlib.util, "find_spec", real)
    engine.require_quantization_deps()  # installed here (vLLM's CPU build brings it)
