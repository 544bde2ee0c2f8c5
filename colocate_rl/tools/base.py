"""Tools by name: what a policy may call in the middle of its answer.

A tool is one module plus one registration line. ``register(name)`` takes a factory
``(ToolsConfig) -> Tool``; the Tool holds the name, a description and the JSON schema of its
arguments (OpenAI's function format: what a chat template's ``tools=`` takes), and the call
``fn(arguments: dict) -> ToolResult``. ``Tool.__call__`` checks the arguments against the schema
first and turns every failure into a ToolResult with ``error=True``: nothing the model writes
raises. A tool written from scratch::

    from colocate_rl.tools import Tool, ToolResult, register

    @register("word_count")
    def word_count(cfg) -> Tool:
        return Tool(
            name="word_count",
            description="Counts the words of a text.",
            parameters={"type": "object", "properties": {"text": {"type": "string"}},
                        "required": ["text"], "additionalProperties": False},
            fn=lambda args: ToolResult(str(len(args["text"].split()))),
        )
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from colocate_rl.errors import error_line
from colocate_rl.config import ToolsConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model reads
    error: bool = False
    seconds: float = 0.0  # wall time of the call (Tool.__call__ sets it)


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: a tool's name and its arguments (a dict when they parsed). A call
    that could not be read carries ``error`` instead, which the executor hands back as the result."""

    name: str
    arguments: Any = None
    error: str = ""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[[dict], ToolResult]

    def spec(self) -> dict:
        """The tool as a chat template's ``tools=`` entry (OpenAI function format)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __call__(self, arguments: Any) -> ToolResult:
        start = time.monotonic()
        problem = check_arguments(self.parameters, arguments)
        if problem:
            result = ToolResult(f"{self.name}: bad arguments: {problem}", error=True)
        else:
            try:
                result = self.fn(arguments)
            except Exception as e:  # noqa: BLE001 - a tool's own failure is the model's to read, not the run's
                log.debug("tool %s failed", self.name, exc_info=True)
                result = ToolResult(f"{self.name} failed: {error_line(e)}", error=True)
        return dataclasses.replace(result, seconds=time.monotonic() - start)


def check_arguments(schema: dict, arguments: Any) -> str:
    """'' when ``arguments`` fit the JSON schema, else the first problem in one line."""
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(arguments))
    if error is None:
        return ""
    where = "/".join(str(p) for p in error.absolute_path)
    message = error.message if len(error.message) <= 200 else error.message[:200] + "..."  # it quotes the value
    return f"{where}: {message}" if where else message


ToolFactory = Callable[[ToolsConfig], Tool]
TOOLS: dict[str, ToolFactory] = {}


def register(name: str) -> Callable[[ToolFactory], ToolFactory]:
    def deco(factory: ToolFactory) -> ToolFactory:
        if name in TOOLS:
            raise ValueError(f"tool '{name}' is already registered (by {TOOLS[name].__module__})")
        TOOLS[name] = factory
        return factory

    return deco


def make_tools(cfg: ToolsConfig) -> dict[str, Tool]:
    """The tools ``cfg.names`` names, built; a ValueError naming ``tools.names`` for an unknown one."""
    unknown = [n for n in cfg.names if n not in TOOLS]
    if unknown:
        raise ValueError(f"tools.names: unknown tool {unknown[0]!r}; registered tools: {', '.join(sorted(TOOLS))}")
    tools = {n: TOOLS[n](cfg) for n in cfg.names}
    for n, t in tools.items():
        if t.name != n:
            raise ValueError(f"tool registered as {n!r} calls itself {t.name!r}")
    return tools
