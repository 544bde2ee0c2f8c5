"""Routing replay (R3) without a model: the batch carries the sampler's experts through every
reshaping the rollout side does (select, concat, the router's prompt order, dynamic sampling);
vLLM's routed-experts output becomes RolloutBatch.routed_experts (MoE layers only, compact dtype);
and the runs that cannot replay stop in one line before anything loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from colocate_rl.config import Config, ConfigError, ModelConfig, load
from colocate_rl.models.registry import MoeRouting, moe_routing
from colocate_rl.rollout.dynamic import keep_groups, refill
from colocate_rl.rollout.router import _in_prompt_order
from colocate_rl.types import RolloutBatch, Sample, routing_dtype

L, K = 3, 2  # MoE layers, experts per token


def routed_batch(prompts: list[int], n: int, resp_lens=None) -> RolloutBatch:
    """n rows per prompt p: prompt [p, p+1], a response of resp_lens[k] tokens; row i's routing at
    token t, layer l, slot j is (100 * i + 10 * t + l + j) % 251, so every entry says where it came from."""
    rows = [Sample([p, p + 1], label=str(p)) for p in prompts for _ in range(n)]
    lens = resp_lens or [1 + k for _ in prompts for k in range(n)]
    resp = [[200 + i] * lens[i] for i in range(len(rows))]
    routed = [torch.tensor([[[(100 * i + 10 * t + l + j) % 251 for j in range(K)] for l in range(L)]
                            for t in range(2 + lens[i] - 1)], dtype=torch.uint8) for i in range(len(rows))]
    return RolloutBatch.from_rows([s.prompt_ids for s in rows], resp, rows, pad_id=0, n=n, routed_experts=routed)


def expected(row_tokens: int, tag: int, t_total: int) -> torch.Tensor:
    """The routing from_rows gave the row tagged ``tag`` (its original index) of ``row_tokens`` tokens,
    padded to t_total: the last token and padding hold 0."""
    out = torch.zeros(t_total, L, K, dtype=torch.uint8)
    for t in range(row_tokens - 1):
        out[t] = torch.tensor([[(100 * tag + 10 * t + l + j) % 251 for j in range(K)] for l in range(L)])
    return out


def test_from_rows_places_routing_on_its_tokens_and_select_concat_to_keep_it():
    b = routed_batch([0, 1], 2)  # rows of 2 + 1, 2 + 2, 2 + 1, 2 + 2 tokens
    assert b.routed_experts.shape == (4, 4, L, K) and b.routed_experts.dtype == torch.uint8
    for i, n in enumerate([3, 4, 3, 4]):
        assert torch.equal(b.routed_experts[i], expected(n, i, 4)), i
    s = b.select(torch.tensor([2, 0]))  # both rows of 3 tokens: trimmed to T = 3
    assert s.routed_experts.shape == (2, 3, L, K)
    assert torch.equal(s.routed_experts[0], expected(3, 2, 3)) and torch.equal(s.routed_experts[1], expected(3, 0, 3))
    both = RolloutBatch.concat([s, b])  # re-padded to T = 4 with zeros
    assert both.routed_experts.shape == (6, 4, L, K)
    assert torch.equal(both.routed_experts[0], expected(3, 2, 4))
    assert torch.equal(both.routed_experts[5], b.routed_experts[3])
    assert both.to("meta").routed_experts.is_meta
    with pytest.raises(ValueError, match="routed_experts is set in some batches and None in others"):
        RolloutBatch.concat([b, RolloutBatch.from_rows([[1]], [[2]], [Sample([1])], pad_id=0)])
    with pytest.raises(ValueError, match="RolloutBatch.routed_experts has shape"):
        fields = {f: getattr(b, f) for f in b.__dataclass_fields__}
        RolloutBatch(**{**fields, "routed_experts": torch.zeros(4, 3, L, K)})


def test_router_prompt_order_moves_routing_with_its_rows():
    # Engine A ran prompts 2 and 0, engine B prompt 1 (rows of other lengths: re-padded).
    a, b = routed_batch([2, 0], 2, [1, 3, 2, 1]), routed_batch([1], 2, [4, 1])
    out = _in_prompt_order([([2, 0], a), ([1], b)], 3)
    t = out.tokens.shape[1]
    assert [s.label for s in out.samples] == ["0", "0", "1", "1", "2", "2"]
    # (source batch, row there, its tokens) of each output row
    for k, (src, i, n) in enumerate([(a, 2, 4), (a, 3, 3), (b, 0, 6), (b, 1, 3), (a, 0, 3), (a, 1, 5)]):
        assert torch.equal(out.routed_experts[k], expected(n, i, t)), k
        assert torch.equal(out.tokens[k, :n], src.tokens[i, :n]), k


def test_dynamic_sampling_keeps_each_groups_routing():
    b = routed_batch([0, 1, 2], 2)
    kept = keep_groups(b, torch.tensor([2, 0]))
    assert torch.equal(kept.routed_experts, b.routed_experts[[4, 5, 0, 1]])
    b.rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # groups 0 and 2 carry signal
    extra = routed_batch([7], 2, [3, 1])
    extra.rewards = torch.tensor([0.0, 1.0])

    out, _ = refill(b, 3, lambda k, r: extra, max_rounds=1)
    t = out.tokens.shape[1]
    assert out.size == 6 and out.routed_experts.shape == (6, t, L, K)
    for k, (src, i, n) in enumerate([(b, 0, 3), (b, 1, 4), (b, 4, 3), (b, 5, 4), (extra, 0, 5), (extra, 1, 3)]):
        assert torch.equal(out.routed_experts[k], expected(n, i, t)), k


def test_routing_dtype_is_the_smallest_that_holds_every_expert():
    assert routing_dtype(4) == routing_dtype(256) == torch.uint8
    assert routing_dtype(257) == routing_dtype(2**15) == torch.int16
    with pytest.raises(ValueError):
        routing_dtype(2**15 + 1)


def test_moe_layers_of_each_family():
    from colocate_rl.models.deepseek_v4.synth import official_config
    from colocate_rl.models.tiny import SHAPES

    assert moe_routing(SHAPES["qwen3-tiny"]) is None
    assert moe_routing(SHAPES["qwen3-moe-tiny"]) == MoeRouting((0, 1), 4, 2)
    qwen = {**SHAPES["qwen3-30b-a3b"], "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert moe_routing(qwen) == MoeRouting((1, 5), 128, 8)  # every 2nd layer, layer 3 dense
    assert moe_routing(official_config()) == MoeRouting((0, 1, 2, 3), 4, 2)  # hash-routed layers count too


# ---------------------------------------------------------------- vLLM's output → the batch


def vllm_outputs(prompt: list[int], responses: list[list[int]], routed: list[np.ndarray]):
    """One prompt's vllm.outputs.RequestOutput of vLLM's own classes (CompletionOutput: index,
    token_ids, logprobs as one {token: Logprob} per token, routed_experts), as
    RolloutEngine.generate receives them."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    comps = [CompletionOutput(index=k, text="", token_ids=r, cumulative_logprob=None,
                              logprobs=[{tok: Logprob(-0.5)} for tok in r], routed_experts=routed[k],
                              finish_reason="stop")
             for k, r in enumerate(responses)]
    return RequestOutput(request_id="0", prompt=None, prompt_token_ids=prompt, prompt_logprobs=None,
                         outputs=comps[::-1], finished=True)  # vLLM may list them out of order


def engine_for(routing: MoeRouting):
    """A RolloutEngine's batch assembly without a vLLM engine behind it (_to_batch reads only these)."""
    from colocate_rl.rollout.engine import RolloutEngine

    eng = RolloutEngine.__new__(RolloutEngine)
    eng.tokenizer, eng.pad_id, eng.routing = None, 0, routing
    return eng


def test_to_batch_takes_vllms_routed_experts_for_the_moe_layers_only():
    pytest.importorskip("vllm")
    # 4 decoder layers, layer 2 dense (mlp_only_layers): vLLM's column 2 is junk and is dropped.
    routing = MoeRouting((0, 1, 3), experts=8, topk=2)
    prompt, responses = [5, 6, 7], [[8, 9], [10, 11, 12, 13]]
    rng = np.random.default_rng(0)
    # vLLM 0.26 (vllm/outputs.py CompletionOutput.routed_experts, filled by the scheduler's
    # RoutedExpertsManager): [prompt + response - 1, num_hidden_layers, top_k], uint8 up to 256 experts.
    routed = [rng.integers(0, 8, (len(prompt) + len(r) - 1, 4, 2)).astype(np.uint8) for r in responses]
    routed[0][:, 2] = 255
    b = engine_for(routing)._to_batch([Sample(prompt)], [vllm_outputs(prompt, responses, routed)], n=2)
    assert b.routed_experts.shape == (2, 7, 3, 2) and b.routed_experts.dtype == torch.uint8
    for i, r in enumerate(routed):
        n = len(r)
        assert torch.equal(b.routed_experts[i, :n], torch.from_numpy(r[:, [0, 1, 3]])), i
        assert (b.routed_experts[i, n:] == 0).all()  # the last sampled token (never fed) and padding
    assert b.tokens[1].tolist() == prompt + responses[1] and b.loss_mask[0, 3:5].all()

    # More than 256 experts: vLLM's uint16 becomes int16.
    wide = MoeRouting((0,), experts=300, topk=2)
    r16 = [np.array([[[299, 3]], [[7, 256]], [[0, 1]], [[2, 5]]], dtype=np.uint16)]
    b = engine_for(wide)._to_batch([Sample(prompt)], [vllm_outputs(prompt, [[8, 9]], r16)], n=1)
    assert b.routed_experts.dtype == torch.int16 and b.routed_experts[0, :4, 0].tolist() == r16[0][:, 0].tolist()


def test_to_batch_refuses_routing_it_cannot_place():
    pytest.importorskip("vllm")
    eng = engine_for(MoeRouting((0, 1), experts=4, topk=2))
    prompt = [5, 6]
    cases = [(None, "vLLM returned no routed_experts"),
             (np.zeros((2, 2, 2), np.uint8), r"expected \(3, decoder layers > 1, 2\)"),  # a row short
             (np.zeros((3, 2, 3), np.uint8), "expected"),  # top-3
             (np.full((3, 2, 2), 4, np.uint8), "names expert 4; the model has 4")]
    for routed, match in cases:
        with pytest.raises(RuntimeError, match=match):
            eng._to_batch([Sample(prompt)], [vllm_outputs(prompt, [[7, 8]], [routed])], n=1)


# ---------------------------------------------------------------- one-line stops


def _one_line(fn) -> str:
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and "rollout.routing_replay" in msg, msg
    return msg


def test_runs_that_cannot_replay_stop_in_one_line(tmp_path):
    from colocate_rl.models.tiny import SHAPES
    from colocate_rl.plan import resolve

    cfg = Config(model=ModelConfig(path="Qwen/Qwen3-30B-A3B"))
    assert "vLLM's CPU build cannot return routed experts" in _one_line(
        lambda: resolve(load(cfg, overrides=["rollout.routing_replay=true", "placement.gpus_per_node=0"])))
    assert "rollout.backend=vllm" in _one_line(lambda: resolve(load(cfg, overrides=[
        "rollout.routing_replay=true", "rollout.backend=transformers", "placement.gpus_per_node=1"])))
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({**SHAPES["qwen3-tiny"], "max_position_embeddings": 4096}))
    assert "has no routed experts" in _one_line(lambda: resolve(load(
        Config(model=ModelConfig(path=str(dense))), overrides=["rollout.routing_replay=true",
                                                                "placement.gpus_per_node=1"])))
    # A MoE model on GPUs plans (this machine has none: the plan is for the default accelerator).
    plan = resolve(load(cfg, overrides=["rollout.routing_replay=true", "placement.gpus_per_node=8", "actor.ep=8"]))
    assert plan.size is not None and plan.size.experts > 0
