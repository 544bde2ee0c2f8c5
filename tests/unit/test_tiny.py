"""Offline tokenizers and tiny model configs (no hub)."""

import json

import pytest

from colocate_rl.models.tiny import SHAPES, build_qwen3_tokenizer, build_tokenizer


def test_tiny_tokenizer_splits_digits_and_has_chat_template():
    tok = build_tokenizer()
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = tok("12+7=19", add_special_tokens=False).input_ids
    assert len(ids) == 7 and tok.decode(ids) == "12+7=19"  # one token per digit, as in Qwen
    text = tok.apply_chat_template([{"role": "user", "content": "3+5="}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n3+5=<|im_end|>\n<|im_start|>assistant\n"
    assert all(len(tok) <= s["vocab_size"] for s in SHAPES.values())


def test_real_qwen3_vocabulary_offline(tmp_path):
    tok = build_qwen3_tokenizer(tmp_path)
    # 151,643 BPE ranks + <|endoftext|>, <|im_start|>, <|im_end|> and 205 extras.
    assert len(tok) == 151643 + 3 + 205
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    assert tok("Hello world 123", add_special_tokens=False).input_ids == [9707, 1879, 220, 16, 17, 18]
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def test_head_dim_fits_vllm_cpu():
    assert all(s["head_dim"] >= 32 for s in SHAPES.values())  # vLLM's CPU attention rejects 16


def test_a_real_width_shape_with_fewer_layers(tmp_path):
    """model.synthesize=<shape>@<layers>: Qwen3-30B-A3B's width (128 experts of 768, hidden 2048)
    with 12 of its 48 layers is 8.1B parameters, one H200's worth; the plan reads it, and what
    cannot be cut (DeepSeek-V4's per-layer lists, more layers than the model has) stops naming the field."""
    from colocate_rl.config import Config, ConfigError, load
    from colocate_rl.models.registry import model_size
    from colocate_rl.models.tiny import SHAPES, build_model, shape_config
    from colocate_rl.plan import model_config

    cut = shape_config("qwen3-30b-a3b@12")
    assert cut == {**SHAPES["qwen3-30b-a3b"], "num_hidden_layers": 12}
    assert 8.0e9 < model_size(cut).total < 8.3e9
    for bad in ("qwen3-30b-a3b@49", "qwen3-30b-a3b@0", "qwen3-8b@x", "deepseek-v4-mini@2", "qwen3-9b"):
        with pytest.raises(ValueError, match=r"^model.synthesize="):
            shape_config(bad)
    cfg = load(Config(), overrides=[f"model.path={tmp_path / 'm'}", "model.synthesize=qwen3-30b-a3b@12"])
    assert model_config(cfg)["num_hidden_layers"] == 12
    with pytest.raises(ConfigError, match=r"^model.synthesize='qwen3-8b@37': @<layers> takes 1 to 36"):
        model_config(load(Config(), overrides=[f"model.path={tmp_path / 'm'}", "model.synthesize=qwen3-8b@37"]))
    hf = json.loads((build_model("qwen3-moe-tiny@1", tmp_path / "one") / "config.json").read_text())
    assert hf["num_hidden_layers"] == 1 and hf["num_experts_per_tok"] == SHAPES["qwen3-moe-tiny"]["num_experts_per_tok"]
