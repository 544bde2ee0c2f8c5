"""HF ⇄ Megatron mapping pieces that need no process group: registry, layout checks, fused
layouts under tensor parallelism, sliced safetensors reads, name translation."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from colocate_rl.models.hf_checkpoint import HFCheckpoint
from colocate_rl.models.mapping import ParamSpec, Placement, read_shard, unshard
from colocate_rl.models.registry import family_for
from colocate_rl.models.tiny import SHAPES


def test_registry_serves_qwen3_families():
    assert family_for(SHAPES["qwen3-tiny"]).name == "qwen3"
    assert family_for(SHAPES["qwen3-moe-tiny"]).name == "qwen3_moe"


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="unsupported model architecture LlamaForCausalLM.*'llama'"):
        family_for({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


@pytest.mark.parametrize("shape,tp,pp,ep,match", [
    ("qwen3-small", 3, 1, 1, "actor.tp=3 does not divide the model's num_attention_heads=4"),
    ("qwen3-small", 4, 1, 1, "actor.tp=4 does not divide the model's num_key_value_heads=2"),
    ("qwen3-tiny", 1, 4, 1, "actor.pp=4 does not divide the model's num_hidden_layers=2"),
    ("qwen3-moe-tiny", 1, 1, 3, "actor.ep=3 does not divide the model's num_experts=4"),
    ("qwen3-tiny", 1, 1, 2, "actor.ep=2 > 1 but the model"),
])
def test_bad_parallel_layouts_are_named(shape, tp, pp, ep, match):
    hf = SHAPES[shape]
    with pytest.raises(ValueError, match=match):
        family_for(hf).check_parallel(hf, tp, pp, ep)


def test_good_parallel_layouts_pass():
    for shape, tp, pp, ep in [("qwen3-small", 2, 2, 1), ("qwen3-moe-tiny", 1, 2, 4), ("qwen3-tiny", 1, 1, 1)]:
        family_for(SHAPES[shape]).check_parallel(SHAPES[shape], tp, pp, ep)


# ---------------------------------------------------------------- fused layouts

HEADS, GROUPS, HD, H, INTER = 4, 2, 3, 5, 6


@pytest.fixture
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "q": torch.randn(HEADS * HD, H, generator=g), "k": torch.randn(GROUPS * HD, H, generator=g),
        "v": torch.randn(GROUPS * HD, H, generator=g), "gate": torch.randn(INTER, H, generator=g),
        "up": torch.randn(INTER, H, generator=g), "o": torch.randn(H, HEADS * HD, generator=g),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with HFCheckpoint(tmp_path) as c:
        yield c, tensors


QKV = ParamSpec("qkv", ("q", "k", "v"), ((HEADS + 2 * GROUPS) * HD, H), kind="qkv", tp_dim=0, qkv=(HEADS, GROUPS, HD))
GATE_UP = ParamSpec("fc1", ("gate", "up"), (2 * INTER, H), kind="gate_up", tp_dim=0)
ROW = ParamSpec("proj", ("o",), (H, HEADS * HD), tp_dim=1)


def test_qkv_is_interleaved_per_query_group(ckpt):
    c, t = ckpt
    full = read_shard(c, QKV, 0, 1)
    q_rows = HEADS // GROUPS * HD
    expected = torch.cat([torch.cat([t["q"][g * q_rows:(g + 1) * q_rows], t["k"][g * HD:(g + 1) * HD],
                                     t["v"][g * HD:(g + 1) * HD]]) for g in range(GROUPS)])
    assert torch.equal(full, expected)
    # Megatron's shard r of tp is rows [r/tp, (r+1)/tp) of that layout: whole groups per rank.
    assert torch.equal(torch.cat([read_shard(c, QKV, r, 2) for r in range(2)]), full)


def test_gate_up_shard_is_gate_chunk_then_up_chunk(ckpt):
    c, t = ckpt
    shard1 = read_shard(c, GATE_UP, 1, 2)
    assert torch.equal(shard1, torch.cat([t["gate"][INTER // 2:], t["up"][INTER // 2:]]))


@pytest.mark.parametrize("spec", [QKV, GATE_UP, ROW], ids=lambda s: s.kind + str(s.tp_dim))
@pytest.mark.parametrize("tp", [1, 2])
def test_shard_then_unshard_gives_back_the_hf_tensors(ckpt, spec, tp):
    c, t = ckpt
    shards = [read_shard(c, spec, r, tp) for r in range(tp)]
    for s in shards:
        expected = list(spec.shape)
        expected[spec.tp_dim] //= tp
        assert list(s.shape) == expected
    out = dict(unshard(spec, shards))
    assert list(out) == list(spec.hf)
    for name in spec.hf:
        assert torch.equal(out[name], t[name]), name


# ---------------------------------------------------------------- checkpoint reader


def test_sharded_checkpoint_slices_and_missing_tensors(tmp_path):
    a, b = torch.arange(24.0).view(6, 4), torch.arange(10.0)
    save_file({"a": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": b}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with HFCheckpoint(tmp_path) as c:
        assert torch.equal(c.read("a", 0, 2, 4), a[2:4])
        assert torch.equal(c.read("a", 1, 1, 3), a[:, 1:3])
        assert torch.equal(c.read("b"), b)
        assert c.shape("a") == [6, 4]
        c.require(["a", "b"])
        with pytest.raises(ValueError, match="missing tensor\\(s\\): model.norm.weight"):
            c.require(["a", "model.norm.weight"])


# ---------------------------------------------------------------- names


def test_local_names_map_to_canonical_global_names():
    where = Placement(layer_offset=4, expert_offset=8)
    assert where.to_canonical("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight") == \
        "decoder.layers.5.mlp.experts.local_experts.10.linear_fc1.weight"
    assert where.to_canonical("embedding.word_embeddings.weight") == "embedding.word_embeddings.weight"
    # TransformerEngine's spec: norms fused into the next linear, grouped experts as weight<i>.
    assert where.to_canonical("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.4.input_layernorm.weight"
    assert where.to_canonical("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.4.pre_mlp_layernorm.weight"
    assert where.to_canonical("decoder.layers.0.mlp.experts.linear_fc2.weight3") == \
        "decoder.layers.4.mlp.experts.local_experts.11.linear_fc2.weight"


@pytest.mark.parametrize("shape", sorted(s for s in SHAPES if SHAPES[s]["model_type"].startswith("qwen3")))
def test_specs_cover_each_hf_tensor_once(shape):
    hf = SHAPES[shape]
    specs = family_for(hf).params(hf)
    exported = [h for s in specs if s.export for h in s.hf]
    assert len(exported) == len(set(exported))
    n_layers, experts = hf["num_hidden_layers"], hf.get("num_experts", 0)
    per_layer = 11 + (3 * experts - 3 + 1 if experts else 0)  # norms, q/k/v/o, q/k norms, mlp (+router)
    assert len(exported) == 2 + n_layers * per_layer + (0 if hf["tie_word_embeddings"] else 1)
    assert ("lm_head.weight" in exported) != hf["tie_word_embeddings"]


@pytest.mark.parametrize("shape", ["qwen3-tiny", "qwen3-moe-tiny", "qwen3-tiny-tied"])
def test_large_shapes_draw_weights_directly_as_transformers_would_save_them(tmp_path, monkeypatch, shape):
    """Shapes of 1B+ parameters skip transformers' one-core init: the same tensors, names and
    dtypes as save_pretrained writes, norms at one, N(0, 0.02) elsewhere, set by the seed alone."""
    from safetensors.torch import load_file

    from colocate_rl.models import tiny

    from colocate_rl.models.registry import model_size

    assert model_size(tiny.SHAPES["qwen3-8b"]).total == pytest.approx(8.19e9, rel=0.01)
    assert model_size(tiny.SHAPES["qwen3-30b-a3b"]).total == pytest.approx(30.5e9, rel=0.01)
    want = load_file(str(tiny.build_model(shape, tmp_path / "hf", dtype="bfloat16") / "model.safetensors"))
    monkeypatch.setattr(tiny, "DIRECT_INIT_PARAMS", 0)
    monkeypatch.setattr(tiny, "_CHUNK", 1000)  # several chunks per tensor, several threads
    got = [load_file(str(tiny.build_model(shape, tmp_path / f"d{i}", seed=s, dtype="bfloat16") / "model.safetensors"))
           for i, s in enumerate((0, 0, 1))]
    assert {k: (v.shape, v.dtype) for k, v in got[0].items()} == {k: (v.shape, v.dtype) for k, v in want.items()}
    assert all(torch.equal(got[0][k], got[1][k]) for k in want), "the same seed draws the same weights"
    assert not torch.equal(got[0]["model.embed_tokens.weight"], got[2]["model.embed_tokens.weight"])
    for name, t in got[0].items():
        if name.endswith("norm.weight"):
            assert bool((t == 1).all()), name
        else:
            assert float(t.float().std()) == pytest.approx(0.02, rel=0.1), name
    # The config transformers' path writes, architectures included (vLLM picks its model class by them).
    config = lambda d: {k: v for k, v in json.loads((tmp_path / d / "config.json").read_text()).items()  # noqa: E731
                        if k != "transformers_version"}
    assert config("d0") == config("hf")
