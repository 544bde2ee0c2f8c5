"""Tool calls out of a model's completed turn, read by the parser vLLM ships for its family
(``vllm.tool_parsers``, the parsers of ``--tool-call-parser``), called through vLLM's
``ToolParserManager``. Which parser a family uses is the family's (``Family.tool_call_parser``:
``hermes`` for Qwen3 and Qwen3-MoE, ``deepseek_v4`` for DeepSeek-V4).

The text is the turn as the engine detokenized it; the tokens that frame a call (Qwen3's
``<tool_call>``, DeepSeek-V4's ``｜DSML｜``) are not special tokens in either family's vocabulary,
so they survive ``skip_special_tokens``.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from colocate_rl.errors import error_line
from colocate_rl.tools.base import ToolCall


@dataclass(frozen=True)
class ParsedTurn:
    content: str | None  # the text outside the calls, as the parser returns it
    calls: list[ToolCall] = field(default_factory=list)  # in order; one that did not parse carries .error


class _Quiet(logging.Filter):
    """Drops a parser's log records on the threads parsing here: it logs a traceback for every
    call it cannot read, which during training is the model's everyday output, and parse_tool_calls
    reports each one itself."""

    def __init__(self):
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.local, "on", False)


_quiet = _Quiet()
_quieted: set[str] = set()


def parser_names() -> list[str]:
    """Every tool-call parser vLLM registers."""
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def _parser(name: str, tokenizer, tools: Sequence[dict]):
    from vllm.tool_parsers import ToolParserManager

    try:
        cls = ToolParserManager.get_tool_parser(name)
    except KeyError:
        raise ValueError(f"vLLM has no tool-call parser {name!r}; it has: {', '.join(parser_names())}") from None
    module = cls.__module__
    if module not in _quieted:
        logging.getLogger(module).addFilter(_quiet)
        _quieted.add(module)
    return cls(tokenizer, list(tools) or None)


def _markers(parser) -> list[str]:
    """The strings that open a call in this parser's format: a turn holding one but yielding no
    call wrote a call that does not parse."""
    start = getattr(parser, "tool_call_start_token", None)
    if isinstance(start, str):
        return [start]
    engine = getattr(parser, "_parser_engine", None)  # vLLM's ParserEngine adapters (DeepSeek-V4's)
    terminals = getattr(getattr(engine, "parser_engine_config", None), "terminals", {}) or {}
    out: list[str] = []
    for key in ("TOOL_START", "INVOKE_PREFIX"):
        value = terminals.get(key)
        out += [value] if isinstance(value, str) else list(value or ())
    return out


def _request(tools: Sequence[dict]):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(messages=[], model="", tools=list(tools) or None)


def _call(name: str, arguments: str) -> ToolCall:
    try:
        args: Any = json.loads(arguments)
    except (TypeError, ValueError) as e:
        return ToolCall(name, None, f"the arguments of {name!r} are not JSON ({error_line(e)})")
    if not isinstance(args, dict):
        return ToolCall(name, None, f"the arguments of {name!r} are not a JSON object")
    return ToolCall(name, args)


def parse_tool_calls(text: str, parser: str, tokenizer, tools: Sequence[dict] = ()) -> ParsedTurn:
    """The calls in ``text`` (a completed assistant turn), read by vLLM's parser ``parser`` with the
    model's ``tokenizer``; ``tools`` are the offered tools' specs (``Tool.spec()``), which some
    parsers consult. Never raises for what the text holds: a call that does not parse comes back
    as a ToolCall with ``error`` set. A ValueError only for a parser name vLLM does not know."""
    p = _parser(parser, tokenizer, tools)
    _quiet.local.on = True
    try:
        info = p.extract_tool_calls(text, _request(tools))
    except Exception as e:  # noqa: BLE001 - a parser's failure on odd text is that text's problem
        return ParsedTurn(text, [ToolCall("", None, f"the tool call does not parse ({error_line(e)})")])
    finally:
        _quiet.local.on = False
    if not info.tools_called:
        if any(m in text for m in _markers(p)):
            return ParsedTurn(info.content, [ToolCall("", None, "the tool call does not parse: it must follow "
                                                                "the format the system prompt shows")])
        return ParsedTurn(info.content, [])
    return ParsedTurn(info.content, [_call(c.function.name, c.function.arguments) for c in info.tool_calls])


def parser_for(hf_config: dict) -> str:
    """The tool-call parser of the model's family (models/registry.py)."""
    from colocate_rl.models.registry import tool_call_parser

    return tool_call_parser(hf_config)
