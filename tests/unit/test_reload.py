"""In-place weight updates through vLLM's real layerwise reload (rollout/reload.py), on a small model
that loads its weights the way vLLM 0.26's DeepSeek-V4 does (vllm/models/deepseek_v4/nvidia/model.py
``DeepseekV4Model.load_weights``): routed experts through a loader that takes an expert id and views
e8m0 scales as bytes, into a layer whose ``process_weights_after_loading`` re-lays them; attention
sinks by a plain copy into a padded parameter; a hash-routing table the sync never carries; and an
after-load hook that derives a table from the first layer's mHC weights. vLLM's DeepSeek-V4 itself
does not build on this CPU (rollout/hf_generate.py), so the model is small and local; the reload
machinery and the code under test are the real ones.

Checks: post-load processing runs once per layer per sync whatever the bucket boundaries (never per
bucket), the live storage is reused (CUDA graphs keep their pointers), and after each of three syncs
in a row every tensor holds what was sent, the frozen table what it held."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

pytest.importorskip("vllm.model_executor.model_loader.reload", reason="needs vLLM's layerwise reload")

from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: E402
from vllm.model_executor.model_loader.reload import record_metadata_for_reloading  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: E402
from vllm.model_executor.models.utils import WeightsMapper  # noqa: E402

from colocate_rl.rollout.reload import LayerwiseSync  # noqa: E402
from colocate_rl.weight_sync.ipc import WeightSyncError  # noqa: E402
from colocate_rl.weight_sync.released import quantize_mxfp4  # noqa: E402

E, I, D, HEADS, PAD, VOCAB, TOPK, LAYERS = 4, 32, 64, 3, 8, 16, 2, 2
EXPERT = re.compile(r"^model\.layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[13])\.(weight|scale)$")


def relayout(raw: torch.Tensor) -> torch.Tensor:
    """What a kernel layout does to the loaded bytes (here a permutation and a mask): a byte copy
    into the processed parameter without re-running it would be wrong."""
    return raw.flip(-1) ^ 0x5A


class Relayout(QuantizeMethodBase):
    def __init__(self):
        self.calls = 0

    def create_weights(self, *args, **kwargs):
        pass

    def apply(self, *args, **kwargs):
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1
        layer.w13 = nn.Parameter(relayout(layer.w13.data), requires_grad=False)


def expert_loader(param: torch.Tensor, loaded_weight: torch.Tensor, expert_id: int, shard: str) -> None:
    half = param.shape[1] // 2
    dst = param.data[expert_id, :half] if shard == "w1" else param.data[expert_id, half:]
    dst.copy_(loaded_weight)  # int8 codes into the uint8 parameter: the bytes, as vLLM's MoE loader copies them


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w13 = nn.Parameter(torch.zeros(E, 2 * I, D // 2, dtype=torch.uint8), requires_grad=False)
        self.w13_scale = nn.Parameter(torch.zeros(E, 2 * I, D // 32, dtype=torch.uint8), requires_grad=False)
        for p in (self.w13, self.w13_scale):
            p.weight_loader = expert_loader
        self.quant_method = Relayout()


class Gate(nn.Module):
    def __init__(self, hashed: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(E, D), requires_grad=False)
        table = torch.zeros(VOCAB, TOPK, dtype=torch.int32)
        self.tid2eid = nn.Parameter(table, requires_grad=False) if hashed else None


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_sink = nn.Parameter(torch.full((PAD,), -float("inf")), requires_grad=False)  # padded heads
        self.wq = nn.Linear(D, D, bias=False)


class Layer(nn.Module):
    def __init__(self, i: int):
        super().__init__()
        self.hc_attn_fn = nn.Parameter(torch.zeros(4, D), requires_grad=False)
        self.attn = Attn()
        self.ffn = nn.Module()
        self.ffn.gate = Gate(hashed=i == 0)
        self.ffn.experts = Experts()


class Model(nn.Module):
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={"layers.": "model.layers."})

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([Layer(i) for i in range(LAYERS)])
        self.hc_broadcast = None

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in self.hf_to_vllm_mapper.apply(weights):
            m = EXPERT.match(name)
            if m:
                layer, e, shard, kind = m.groups()
                if w.dtype == torch.float8_e8m0fnu:
                    w = w.view(torch.uint8)
                p = params[f"model.layers.{layer}.ffn.experts.w13" + ("_scale" if kind == "scale" else "")]
                p.weight_loader(p, w, expert_id=int(e), shard=shard)
            elif name.endswith(".attn.attn_sink"):
                params[name][: w.shape[0]].copy_(w)
            else:
                p = params[name]
                getattr(p, "weight_loader", default_weight_loader)(p, w)
        first = self.model.layers[0]
        self.hc_broadcast = first.hc_attn_fn.detach().sum(0)


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Official-style names, experts in the released MXFP4 layout; the hash table is not among them."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        p = f"layers.{i}."
        out[p + "hc_attn_fn"] = torch.randn(4, D, generator=g)
        out[p + "attn.attn_sink"] = torch.randn(HEADS, generator=g)
        out[p + "attn.wq.weight"] = torch.randn(D, D, generator=g)
        out[p + "ffn.gate.weight"] = torch.randn(E, D, generator=g)
        for e in range(E):
            for w in ("w1", "w3"):
                q, s = quantize_mxfp4(torch.randn(I, D, generator=g))
                out[p + f"ffn.experts.{e}.{w}.weight"], out[p + f"ffn.experts.{e}.{w}.scale"] = q, s
    return out


def buckets(named: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    """Three buckets, round robin: every layer's experts, and layer 1's gate, span all of them."""
    items = list(named.items())
    return [items[k::3] for k in range(3)]


def expect_experts(named: dict[str, torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.zeros(E, 2 * I, D // 2, dtype=torch.uint8)
    sc = torch.zeros(E, 2 * I, D // 32, dtype=torch.uint8)
    for e in range(E):
        for k, w in enumerate(("w1", "w3")):
            w13[e, k * I:(k + 1) * I] = named[f"layers.{layer}.ffn.experts.{e}.{w}.weight"].view(torch.uint8)
            sc[e, k * I:(k + 1) * I] = named[f"layers.{layer}.ffn.experts.{e}.{w}.scale"].view(torch.uint8)
    return relayout(w13), sc


def started_model() -> tuple[Model, torch.Tensor]:
    """As vLLM builds an engine: metadata recorded at construction, then load, then processing."""
    model = Model()
    record_metadata_for_reloading(model)
    model.load_weights(iter(weights(0).items()))
    table = torch.randint(0, E, (VOCAB, TOPK), generator=torch.Generator().manual_seed(9), dtype=torch.int32)
    model.model.layers[0].ffn.gate.tid2eid.data.copy_(table)
    for m in model.modules():
        if isinstance(getattr(m, "quant_method", None), Relayout):
            m.quant_method.process_weights_after_loading(m)
    return model, table


def experts_calls(model: Model) -> list[int]:
    return [layer.ffn.experts.quant_method.calls for layer in model.model.layers]


def test_three_syncs_in_a_row_process_each_layer_once_and_land_every_tensor():
    model, table = started_model()
    live = {n: p.data_ptr() for n, p in model.named_parameters()}
    for step in (1, 2, 3):
        new = weights(step)
        sync = LayerwiseSync(model)
        sync.begin()
        calls = experts_calls(model)
        for k, bucket in enumerate(buckets(new)):
            sync.load(bucket)
            if k < 2:  # every experts layer still misses tensors: nothing processed yet
                assert experts_calls(model) == calls
        sync.finish(model_config=None)  # the model config only matters for attention layers vLLM defers
        assert experts_calls(model) == [c + 1 for c in calls]  # once per layer per sync
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == live  # same storage, graphs stay valid
        for i, layer in enumerate(model.model.layers):
            w13, sc = expect_experts(new, i)
            assert torch.equal(layer.ffn.experts.w13, w13), (step, i)
            assert torch.equal(layer.ffn.experts.w13_scale, sc), (step, i)
            assert torch.equal(layer.attn.attn_sink[:HEADS], new[f"layers.{i}.attn.attn_sink"]), (step, i)
            assert torch.isinf(layer.attn.attn_sink[HEADS:]).all()
            assert torch.equal(layer.attn.wq.weight, new[f"layers.{i}.attn.wq.weight"])
            assert torch.equal(layer.ffn.gate.weight, new[f"layers.{i}.ffn.gate.weight"])
            assert torch.equal(layer.hc_attn_fn, new[f"layers.{i}.hc_attn_fn"])
        assert torch.equal(model.model.layers[0].ffn.gate.tid2eid, table), step  # frozen: kept, not re-made
        assert not model.hc_broadcast.is_meta
        assert torch.equal(model.hc_broadcast, new["layers.0.hc_attn_fn"].sum(0))


def test_without_the_fixes_vllm_reload_keeps_stale_sinks():
    """The control: vLLM's own begin / load_weights / finalize drops the sinks' plain copy."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model, _ = started_model()
    old = model.model.layers[0].attn.attn_sink[:HEADS].clone()
    new = weights(1)
    initialize_layerwise_reload(model)
    for bucket in buckets(new):
        model.load_weights(iter(bucket))
    finalize_layerwise_reload(model, None)
    assert torch.equal(model.model.layers[0].attn.attn_sink[:HEADS], old)
    assert not torch.equal(old, new["layers.0.attn.attn_sink"])


def test_a_partial_layer_that_cannot_be_refilled_is_refused_by_name():
    """A tensor left out whose live copy cannot stand in for it (here: an expert scale, loaded by a
    custom loader) would be finished from uninitialised memory: the sync fails naming it."""
    model, _ = started_model()
    new = {n: t for n, t in weights(1).items() if not n.startswith("layers.1.ffn.experts.") or n.endswith(".weight")}
    sync = LayerwiseSync(model)
    sync.begin()
    for bucket in buckets(new):
        sync.load(bucket)
    with pytest.raises(WeightSyncError, match=r"'model\.layers\.1\.ffn\.experts\.w13_scale' was not sent"):
        sync.finish(model_config=None)
    sync.abort(model_config=None)


def test_after_a_level_2_sleep_a_left_out_tensor_is_refused_by_name():
    """A sleep at level 2 frees the engine's weights without a copy: the hash-routing table the
    sync leaves out (completed from the live copy above) would come from uninitialised memory."""
    model, _ = started_model()
    sync = LayerwiseSync(model, discarded=True)
    sync.begin()
    for bucket in buckets(weights(1)):
        sync.load(bucket)
    with pytest.raises(WeightSyncError, match=r"'model\.layers\.0\.ffn\.gate\.tid2eid' was not sent.*level 2"):
        sync.finish(model_config=None)
    sync.abort(model_config=None)
