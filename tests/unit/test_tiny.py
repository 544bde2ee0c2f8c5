"""Offline tokenizers and tiny model configs (no hub)."""

import json

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
