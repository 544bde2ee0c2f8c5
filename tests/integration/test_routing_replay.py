"""Routing replay (R3) in the Megatron actor on CPU, on the tiny Qwen3-MoE and the tiny DeepSeek-V4
(hash-routed first layers, noaux_tc after them; full recompute, so the experts must be replayed
again when the backward recomputes a layer).

A log on every MoE layer's token dispatcher records the experts it is handed. Replaying the
actor's own choices (from that log) gives the same logprobs and gradients, bit for bit, as not
replaying; replaying other experts changes the logprobs, and every dispatch of the training step,
recomputations included, carries exactly those experts, while hash-routed layers keep their table's.
Two gloo ranks (Qwen3-MoE at EP=2 and at PP=2, DeepSeek-V4 at TP=2 with sequence parallelism)
replay like one.
"""

from __future__ import annotations

import pytest
import torch

from colocate_rl.config import Config, ModelConfig
from colocate_rl.types import RolloutBatch

from batches import build_actor, synthetic_batch

CASES = {  # shape -> (rows' lengths, actor overrides)
    "qwen3-moe-tiny": ([12, 9, 11, 6, 10, 7], {}),
    "deepseek-v4-tiny": ([20, 14, 17, 9], {"recompute": True}),
}


def make_actor(path, replay: bool, **actor):
    cfg = Config(model=ModelConfig(path=str(path), dtype="float32"))
    cfg.actor.lr, cfg.actor.micro_batch_size = 1e-3, 2
    cfg.rollout.routing_replay = replay
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    return build_actor(cfg, gpu_run=replay)  # the plan keeps routing replay to GPU runs (vLLM's sampler)


def moe_layers(actor) -> list:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return sorted((m for m in actor.model.module.modules() if isinstance(m, MoELayer)), key=lambda m: m.layer_number)


class DispatchLog:
    """Per MoE layer (its index among the MoE layers), the routing map [tokens, E] of every call of
    its token dispatcher, in call order: what the experts actually run on."""

    def __init__(self, actor):
        self.maps: list[list[torch.Tensor]] = []
        for layer in moe_layers(actor):
            calls: list[torch.Tensor] = []
            self.maps.append(calls)
            disp = layer.token_dispatcher
            original = disp.dispatch_preprocess

            def record(hidden, routing_map, probs, _orig=original, _calls=calls):
                _calls.append(routing_map.detach().clone())
                return _orig(hidden, routing_map, probs)

            disp.dispatch_preprocess = record

    def clear(self) -> None:
        for calls in self.maps:
            calls.clear()


def micro_batches(actor, batch: RolloutBatch) -> list[torch.Tensor]:
    """The rows of each micro-batch, in the order the actor runs them (one rank, one mini-batch)."""
    return actor._micro_batches(torch.arange(batch.size), batch.attention_mask.sum(1))


def as_ids(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """[tokens, E] bool with k experts a row → [tokens, k] ids, ascending."""
    return routing_map.float().topk(k, dim=1).indices.sort(dim=1).values


def own_routing(log: DispatchLog, micro: list[torch.Tensor], batch: RolloutBatch, k: int) -> torch.Tensor:
    """[B, T, L, k] uint8: the experts the dispatchers were handed during one forward over the batch
    (one call per micro-batch per layer), in RolloutBatch.routed_experts' layout."""
    b, t = batch.tokens.shape
    out = torch.zeros(b, t, len(log.maps), k, dtype=torch.uint8)
    for col, calls in enumerate(log.maps):
        assert len(calls) == len(micro)
        for rows, m in zip(micro, calls):
            s = m.shape[0] // len(rows)  # tokens arrive sequence-first: [s * b]
            out[rows, :s, col] = as_ids(m, k).view(s, len(rows), k).transpose(0, 1).to(torch.uint8)
    return out


def check_dispatches(log: DispatchLog, micro: list[torch.Tensor], want: torch.Tensor, columns: list[int],
                     calls_per_micro: int) -> None:
    """Every recorded dispatch of the given MoE columns carries exactly want's experts ([B, T, L, k]),
    at every token where want names k different experts (elsewhere the router chose)."""
    num_experts = log.maps[0][0].shape[1]
    for col in columns:
        calls = log.maps[col]
        assert len(calls) == calls_per_micro * len(micro), (col, len(calls))
        for c, m in enumerate(calls):
            rows = micro[c // calls_per_micro]
            s = m.shape[0] // len(rows)
            ids = want[rows, :s, col].transpose(0, 1).reshape(-1, want.shape[-1]).long()
            expect = torch.zeros(m.shape[0], num_experts, dtype=torch.bool).scatter(1, ids, True)
            named = expect.sum(1) == want.shape[-1]
            assert named.any() and torch.equal(m[named], expect[named]), \
                f"MoE layer {col}, call {c}: the dispatcher got other experts"


def other_experts(own: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per token the k lowest-numbered experts not among ``own``'s k (num_experts >= 2k)."""
    free = torch.ones(*own.shape[:-1], num_experts).scatter(-1, own.long(), 0.0)
    rank = free * (num_experts - torch.arange(num_experts))  # free and low-numbered first
    return rank.topk(own.shape[-1], dim=-1).indices.sort(dim=-1).values.to(own.dtype)


def as_sampled(routing: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """``routing`` with zeros where vLLM has none: each row's last token and the padding."""
    routed = torch.arange(batch.tokens.shape[1]) < batch.attention_mask.sum(1, keepdim=True) - 1
    return torch.where(routed[:, :, None, None], routing, torch.zeros_like(routing))


def grads(actor) -> list[torch.Tensor]:
    return [buf.grad_data.clone() for buf in actor.model.buffers + actor.model.expert_parallel_buffers]


@pytest.mark.parametrize("shape", list(CASES))
def test_replay_runs_the_given_experts_and_own_choices_change_nothing(tiny_model, shape):
    lens, overrides = CASES[shape]
    path = tiny_model(shape)
    batch = synthetic_batch(lens, seed=1)
    calls_in_training = 2 if overrides.get("recompute") else 1  # a recomputed layer dispatches again

    # Without replay: the logprobs, the step, and the experts the dispatchers were handed.
    plain = make_actor(path, replay=False, **overrides)
    log, micro = DispatchLog(plain), micro_batches(plain, batch)
    lp_plain = plain.compute_logprobs(batch)
    k = plain.family.moe_routing(plain.hf_config).topk
    own = own_routing(log, micro, batch, k)
    batch.rollout_logprobs = torch.where(batch.loss_mask, lp_plain - 0.01, 0)
    m_plain = plain.train_step(batch, lp_plain)
    grads_plain = grads(plain)
    hash_columns = [i for i, layer in enumerate(moe_layers(plain)) if getattr(layer.router, "is_hash", False)]
    learned = [i for i in range(own.shape[2]) if i not in hash_columns]
    assert learned and (shape != "deepseek-v4-tiny" or hash_columns == [0, 1])
    num_experts = log.maps[0][0].shape[1]
    del plain

    actor = make_actor(path, replay=True, **overrides)
    log = DispatchLog(actor)
    with pytest.raises(ValueError, match="the batch carries no routed_experts"):
        actor.compute_logprobs(batch)

    # Other experts than its own, where vLLM would give routing (tokens without it route by
    # themselves): the logprobs move. In the hash-routed columns too, where the table keeps deciding.
    other = batch.select(torch.arange(batch.size))
    other.routed_experts = as_sampled(other_experts(own, num_experts), batch)
    lp_other = actor.compute_logprobs(other)
    assert float((lp_other - lp_plain)[batch.loss_mask].abs().max()) > 1e-3

    # Its own experts as vLLM would return them: bit for bit the same logprobs, step and gradients.
    batch.routed_experts = as_sampled(own, batch)
    log.clear()
    lp = actor.compute_logprobs(batch)
    assert torch.equal(lp, lp_plain)
    check_dispatches(log, micro, own, list(range(own.shape[2])), 1)
    log.clear()
    m = actor.train_step(batch, lp)
    assert (m["loss"], m["grad_norm"]) == (m_plain["loss"], m_plain["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(grads(actor), grads_plain))
    check_dispatches(log, micro, own, list(range(own.shape[2])), calls_in_training)

    # A training step on the other experts: every dispatch (recomputations too) carries them, the
    # hash-routed layers their table's, and the learned routers still get gradients.
    log.clear()
    other.rollout_logprobs = torch.where(other.loss_mask, lp_other - 0.01, 0)
    m = actor.train_step(other, None)
    assert m["grad_norm"] > 0
    check_dispatches(log, micro, other.routed_experts, learned, calls_in_training)
    check_dispatches(log, micro, own, hash_columns, calls_in_training)
    for i in learned:
        assert moe_layers(actor)[i].router.weight.main_grad.abs().sum() > 0, f"MoE layer {i}: router has no gradient"


# ---------------------------------------------------------------- two ranks

LENS = [12, 9, 11, 6, 10, 7, 12, 5]  # 4 prompts x 2 samples
LAYOUTS = [  # (name, shape, actor overrides), world size 2
    ("ep2", "qwen3-moe-tiny", dict(ep=2)),
    ("pp2", "qwen3-moe-tiny", dict(pp=2)),  # each stage's layer reads its own column
    ("tp2sp", "deepseek-v4-tiny", dict(tp=2, sequence_parallel=True)),  # odd-length micro-batches padded
]
COMMON = dict(adam_eps=1e-3)  # see tests/integration/test_dsv4_parallel.py: smooth first Adam step


def random_routing(batch: RolloutBatch, layers: int, k: int, num_experts: int, seed: int = 3) -> torch.Tensor:
    """[B, T, L, k] uint8: k distinct random experts per token and layer, where vLLM gives routing."""
    g = torch.Generator().manual_seed(seed)
    b, t = batch.tokens.shape
    scores = torch.rand(b, t, layers, num_experts, generator=g)
    return as_sampled(scores.topk(k, dim=-1).indices.to(torch.uint8), batch)


def replay_view(path: str, overrides: dict, replay: bool = True) -> dict:
    """Logprobs of a synthetic batch under a random routing, one GRPO step on it, logprobs after."""
    actor = make_actor(path, replay, **COMMON, **overrides)
    routing = actor.family.moe_routing(actor.hf_config)
    batch = synthetic_batch(LENS, seed=1)
    batch.routed_experts = random_routing(batch, len(routing.layers), routing.topk, routing.experts)
    before = actor.compute_logprobs(batch)  # without replay the routing is not looked at
    if not replay:
        return {"before": before}
    batch.rollout_logprobs = torch.where(batch.loss_mask, before, 0)
    m = actor.train_step(batch, before)
    return {"before": before, "after": actor.compute_logprobs(batch), "loss": m["loss"], "grad_norm": m["grad_norm"]}


def all_layouts(jobs: list[tuple[str, str, dict]]) -> dict:
    return {name: replay_view(path, overrides) for name, path, overrides in jobs}


# Slow: one spawn of two fresh processes (torch + megatron-core imports, ~15-25 s on 2 cores), three
# actors each, then four one-rank actors.
@pytest.mark.slow
def test_two_ranks_replay_like_one(tiny_model):
    from colocate_rl.trainer import run_on_ranks

    paths = {shape: str(tiny_model(shape)) for _, shape, _ in LAYOUTS}
    got = run_on_ranks(all_layouts, 2, [(name, paths[shape], o) for name, shape, o in LAYOUTS])
    for name, shape, _ in LAYOUTS:
        ref, par = replay_view(paths[shape], {}), got[name]
        for key in ("before", "after"):
            diff = (par[key] - ref[key]).abs().max().item()
            assert diff <= 1e-5, f"{name}: logprobs {key} the step differ from one rank by {diff}"
        assert par["loss"] == pytest.approx(ref["loss"], abs=1e-6), name
        assert par["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), name
    # The random routing is replayed at all: without it the qwen3 logprobs differ.
    own = replay_view(paths["qwen3-moe-tiny"], {}, replay=False)["before"]
    assert (own - got["ep2"]["before"]).abs().max() > 1e-3
