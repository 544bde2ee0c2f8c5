"""Weight sync into a real vLLM engine core running in its own process (CPU shared memory).

vLLM runs multiprocess here (VLLM_ENABLE_V1_MULTIPROCESSING=1) so the handles really cross a
process boundary, in both shapes an engine's worker takes: the tied-embedding engine's worker is a
process of its own under the engine core (vLLM's CPU default, as at TP>1), the MoE engine's runs in
the engine core's process (vLLM's shape for TP=1 on GPUs). Each check compares vLLM's sampled
logprobs with a plain transformers forward of the model whose weights were sent (fp32, max |diff|
<= 1e-4).
"""

from __future__ import annotations

import os

import pytest
import torch

from colocate_rl.types import Sample
from colocate_rl.weight_sync.ipc import IpcSender, WeightSyncError
from colocate_rl.weight_sync.verify import tensor_checksum

from batches import build_engine
from test_rollout import PROMPTS, _perturbed, make_cfg, max_diff

# Each engine start is a fresh spawned interpreter importing vLLM: 15-45 s on 2 busy cores.
pytestmark = pytest.mark.slow

TOL = 1e-4


def _engine(path, **engine_kwargs):
    cfg = make_cfg(path)
    cfg.rollout.multiprocess = True
    return build_engine(cfg, **engine_kwargs)


@pytest.fixture(scope="module")
def tied(tiny_model):
    eng = _engine(tiny_model("qwen3-tiny-tied"))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def moe(tiny_model):
    # The worker in the engine core's process: one spawned interpreter importing vLLM, not two.
    eng = _engine(tiny_model("qwen3-moe-tiny"),
                  distributed_executor_backend="vllm.v1.executor.uniproc_executor.UniProcExecutor")
    yield eng
    eng.shutdown()


def _samples(eng):
    return [Sample(prompt_ids=eng.tokenizer.encode(p)) for p in PROMPTS]


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _greedy(eng):
    return eng.generate(_samples(eng)[:2], n=1, temperature=0.0)


def _worker_is_engine_core(eng) -> bool:
    """The worker is the engine core's process itself (a child of this one), not a process under it."""
    import psutil

    (pid,) = eng._rpc("worker_pid")
    return psutil.Process(pid).ppid() == os.getpid()


def _sync_and_check(eng, path, tmp_path, seed, bucket_mb):
    assert eng.multiprocess and not eng.workers_in_process, "the handles must cross a process boundary"
    hf, tensors = _perturbed(path, tmp_path, seed)
    assert max_diff(hf, eng.generate(_samples(eng), seed=2)) > 0.05, "control: without the sync the gap is large"
    stats = eng.update_weights(tensors.items(), bucket_mb=bucket_mb)
    assert stats.buckets >= 3 and stats.bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert max_diff(hf, eng.generate(_samples(eng), seed=2)) <= TOL
    return hf, tensors


def test_moe_logprobs_match_hf_before_sync(moe, tiny_model):
    assert max_diff(_hf(tiny_model("qwen3-moe-tiny")), moe.generate(_samples(moe), seed=1)) <= TOL


def test_moe_sync(moe, tiny_model, tmp_path):
    """Fused experts: vLLM's CPU reload skips the experts' prepack; the extension re-runs it."""
    assert _worker_is_engine_core(moe)
    _sync_and_check(moe, tiny_model("qwen3-moe-tiny"), tmp_path, seed=11, bucket_mb=0.1)


def test_tied_embedding_sync_and_checksums(tied, tiny_model, tmp_path):
    """With tie_word_embeddings the output layer must follow the new embedding (on CPU its GEMM
    keeps a packed copy made at load time)."""
    assert not _worker_is_engine_core(tied)
    _, tensors = _sync_and_check(tied, tiny_model("qwen3-tiny-tied"), tmp_path, seed=12, bucket_mb=0.05)
    assert "lm_head.weight" not in tensors
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight"]
    names.append("lm_head.weight")  # tied: the engine's output layer is the embedding
    got = tied.checksum(names)
    want = {n: tensor_checksum(tensors["model.embed_tokens.weight" if n == "lm_head.weight" else n]) for n in names}
    assert got == pytest.approx(want, rel=1e-12)
    with pytest.raises(WeightSyncError, match="q_proj"):
        tied.checksum(["model.layers.0.self_attn.q_proj.weight"])  # fused into qkv_proj and repacked in vLLM


def _assert_refused(eng, message, match):
    before = _greedy(eng)
    sums = eng.checksum(["model.embed_tokens.weight", "model.norm.weight"])
    with pytest.raises(WeightSyncError, match=match):
        eng.load_message(message)
    after = _greedy(eng)
    assert torch.equal(before.tokens, after.tokens) and torch.equal(before.rollout_logprobs, after.rollout_logprobs)
    assert eng.checksum(["model.embed_tokens.weight", "model.norm.weight"]) == sums


def _bad_bucket(eng, extra):
    """A bucket of real, changed tensors plus one bad entry: nothing of it may be loaded."""
    shapes = eng.weight_shapes()
    good = [(n, torch.randn(shapes[n])) for n in ("model.embed_tokens.weight", "model.norm.weight")]
    sender = IpcSender("cpu")
    (bucket,) = list(sender.buckets(iter(good + [extra]), bucket_mb=64))
    return sender, sender.make_message(bucket)


def test_message_for_another_device_is_refused(tied):
    sender, message = _bad_bucket(tied, ("model.norm.weight", torch.ones(64)))
    message = {"cpu-not-this-host": message[sender.uuid]}
    _assert_refused(tied, message, f"no entry for this device {tied.device_uuids[0]}.*cpu-not-this-host")
    assert sender.release() == 1, "the payload nobody could load is freed by the sender"


def test_unknown_tensor_is_refused(tied):
    sender, message = _bad_bucket(tied, ("model.layers.0.self_attn.nope.weight", torch.ones(4)))
    _assert_refused(tied, message, "model.layers.0.self_attn.nope.weight")
    assert sender.release() == 0, "the engine mapped the payload before refusing it"


def test_shape_mismatch_is_refused(tied):
    sender, message = _bad_bucket(tied, ("model.layers.1.post_attention_layernorm.weight", torch.ones(65)))
    _assert_refused(tied, message, r"model.layers.1.post_attention_layernorm.weight.*\(65,\).*\(64,\)")
    sender.release()


def test_after_a_level_2_sleep_every_held_tensor_must_come_back(tied, tiny_model, tmp_path):
    """A sleep at level 2 frees the engine's weights without a copy (vLLM's CPU build has no sleep
    mode: the engine is told, as RolloutEngine.sleep(2) tells it). A sync that leaves out a tensor
    the engine holds stops naming it; one that sends everything lands, and the engine samples as
    the model it was given."""
    path = tiny_model("qwen3-tiny-tied")
    hf, tensors = _perturbed(path, tmp_path, seed=21)
    tied._rpc("weights_discarded")
    partial = [(n, t) for n, t in tensors.items() if n != "model.norm.weight"]
    with pytest.raises(WeightSyncError, match=r"1 tensor\(s\) the engine holds were not sent \(model\.norm\.weight\)"):
        tied.update_weights(iter(partial), bucket_mb=0.05)
    tied.update_weights(tensors.items(), bucket_mb=0.05)
    assert max_diff(hf, tied.generate(_samples(tied), seed=2)) <= TOL
    tied.update_weights(iter(partial), bucket_mb=0.05)  # awake since: the engine's own norm stands in


def test_tp2_engine_checksums_add_up_vocab_shards(tiny_model, monkeypatch):
    """vLLM at tensor_parallel_size=2 splits embed_tokens and lm_head by vocabulary rows (padded per
    shard); the engine's checksum adds the two workers' shards up to the checkpoint tensor's. (A
    weight sync into two CPU workers is not tested: a CPU shared-memory handle passes its file
    descriptor to one receiving process only; on GPU every worker opens its own CUDA IPC handle.)"""
    from safetensors.torch import load_file

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vLLM's CPU workers want a NUMA node each, else a core each
    path = tiny_model("qwen3-tiny")
    cfg = make_cfg(path)
    cfg.rollout.multiprocess, cfg.rollout.tensor_parallel_size = True, 2
    eng = build_engine(cfg)
    try:
        assert eng.num_workers == 2
        tensors = load_file(str(path / "model.safetensors"))
        names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
        assert eng.checksum(names) == pytest.approx({n: tensor_checksum(tensors[n]) for n in names}, rel=1e-12)
    finally:
        eng.shutdown()
