"""The tools' registry, argument checks, calculator and executor; no sandbox is started here
(tests/integration/test_sandbox.py runs programs)."""

from __future__ import annotations

import os
import textwrap

import pytest

from colocate_rl.models.registry import tool_call_parser
from colocate_rl.tools import (TOOLS, Sandbox, SandboxUnavailable, Tool, ToolCall, ToolExecutor, ToolResult,
                               ToolsConfig, make_tools, register)
from colocate_rl.tools import base as tools_base
from colocate_rl.tools.calculator import MAX_BITS, CalcError, evaluate

CALC = ToolsConfig(names=("calculator",))


@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("-2 ** 2", -4), ("(-2) ** 2", 4), ("7 // 2", 3), ("7 % 4", 3),
    ("7 / 2", 3.5), ("2 ** -1", 0.5), ("1_000 + 0.5", 1000.5), ("+3 - -3", 6), ("2 ** 100", 2 ** 100),
])
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("(1).__class__", "Attribute is not allowed"),
    ("[1, 2]", "List is not allowed"),
    ("'a' * 3", "Constant is not allowed"),  # only int and float literals
    ("True + 1", "Constant is not allowed"),
    ("1j * 1j", "Constant is not allowed"),
    ("1 << 10", "BinOp is not allowed"),
    ("1 if 1 else 2", "IfExp is not allowed"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "modulo by zero"),
    ("2 ** 100000", "exponent 100000 is beyond"),
    ("3 ** 9999", f"more than {MAX_BITS} bits"),  # within the exponent bound, past the size bound
    ("(2 ** 5000) * (2 ** 5000) * (2 ** 5000)", f"more than {MAX_BITS} bits"),
    ("10.0 ** 400", "the result is too large"),
    ("10 ** 400 / 3", "the result is too large"),
    ("1e400 - 1e400", "not a finite number"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an expression"),
    ("1; 2", "not an expression"),
    ("1" * 2000, "longer than 1000 characters"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, why):
    with pytest.raises(CalcError, match=why.replace("(", r"\(").replace("*", r"\*")):
        evaluate(expression)


def test_calculator_tool_results():
    calc = make_tools(CALC)["calculator"]
    ok, bad = calc({"expression": "2 ** 10"}), calc({"expression": "import os"})
    assert (ok.text, ok.error) == ("1024", False) and ok.seconds > 0
    assert bad.error and bad.text.startswith("calculator: not an expression")


@pytest.mark.parametrize("arguments, problem", [
    ({}, "'expression' is a required property"),
    ({"expression": 3}, "expression: 3 is not of type 'string'"),
    ({"expression": "1", "extra": 1}, "Additional properties are not allowed ('extra' was unexpected)"),
    ("2 + 2", "'2 + 2' is not of type 'object'"),
    (None, "None is not of type 'object'"),
])
def test_wrong_or_missing_arguments_are_error_results(arguments, problem):
    result = make_tools(CALC)["calculator"](arguments)
    assert result.error and result.text == f"calculator: bad arguments: {problem}"


def test_a_tool_that_raises_is_an_error_result():
    def broken(args):
        raise KeyError("nope")

    tool = Tool("broken", "d", {"type": "object"}, broken)
    result = tool({})
    assert (result.text, result.error) == ("broken failed: KeyError: 'nope'", True)


def test_executor_returns_results_in_order_and_errors_for_bad_calls():
    calls = [ToolCall("calculator", {"expression": f"{i} * 10"}) for i in range(6)]
    calls += [ToolCall("search", {"q": "x"}), ToolCall("", None, "the tool call does not parse"),
              ToolCall("calculator", {"expr": "1"})]
    with ToolExecutor(CALC) as ex:
        results = ex.run(calls)
    assert [r.text for r in results[:6]] == [str(i * 10) for i in range(6)]
    assert not any(r.error for r in results[:6])
    assert results[6] == ToolResult("there is no tool 'search'; the tools are: calculator", error=True)
    assert results[7] == ToolResult("the tool call does not parse", error=True)
    assert results[8].error and "'expression' is a required property" in results[8].text


def test_specs_are_the_openai_function_format():
    with ToolExecutor(CALC) as ex:
        (spec,) = ex.specs()
    assert spec["type"] == "function" and spec["function"]["name"] == "calculator"
    assert spec["function"]["parameters"]["required"] == ["expression"]


def test_the_docstring_example_registers_a_working_tool():
    """base.py's ten-line tool, run as written."""
    example = textwrap.dedent(tools_base.__doc__.split("::", 1)[1])
    try:
        exec(compile(example, "example", "exec"), {})
        tool = make_tools(ToolsConfig(names=("word_count",)))["word_count"]
        assert tool({"text": "one two three"}).text == "3"
        assert tool({"text": 3}).error
    finally:
        TOOLS.pop("word_count", None)


def test_registry_refuses_duplicates_and_unknown_names():
    with pytest.raises(ValueError, match="tool 'calculator' is already registered"):
        register("calculator")(lambda cfg: None)
    with pytest.raises(ValueError, match="tools.names: unknown tool 'search'; registered tools: calculator, python"):
        make_tools(ToolsConfig(names=("search",)))


@pytest.mark.parametrize("field, value, message", [
    ("timeout_s", 0, r"tools.timeout_s=0 must be in \(0, 86400\]"),
    ("max_concurrency", -1, r"tools.max_concurrency=-1 must be in \[1, 256\]"),
    ("isolation", "docker", "tools.isolation='docker' must be one of auto, namespaces, audit"),
])
def test_config_names_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ToolsConfig(**{field: value})


@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids are chosen only as root")
def test_a_sandbox_uid_an_account_owns_is_refused():
    nobody = 65534
    with pytest.raises(SandboxUnavailable, match=f"tools.sandbox_uid={nobody}: uid {nobody} belongs to an account"):
        Sandbox(ToolsConfig(sandbox_uid=nobody, max_concurrency=1)).isolation


def test_each_family_names_its_vllm_tool_call_parser():
    from vllm.tool_parsers import ToolParserManager

    parsers = {mt: tool_call_parser({"model_type": mt}) for mt in ("qwen3", "qwen3_moe", "deepseek_v4")}
    assert parsers == {"qwen3": "hermes", "qwen3_moe": "hermes", "deepseek_v4": "deepseek_v4"}
    assert set(parsers.values()) <= set(ToolParserManager.list_registered())
