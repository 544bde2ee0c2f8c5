"""Runs one turn's tool calls, across many samples, off the calling thread."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from colocate_rl.tools.base import Tool, ToolCall, ToolResult, make_tools
from colocate_rl.config import ToolsConfig


class ToolExecutor:
    """``run(calls) -> results`` in the calls' order, at most ``cfg.max_concurrency`` at once. Every
    call gets a ToolResult: an unknown tool, arguments that did not parse or do not fit the tool's
    schema, and a tool's own failure are results with ``error=True``."""

    def __init__(self, cfg: ToolsConfig, tools: dict[str, Tool] | None = None):
        self.tools = make_tools(cfg) if tools is None else tools
        self._pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="tool")

    def specs(self) -> list[dict]:
        """The tools as a chat template's ``tools=`` list."""
        return [t.spec() for t in self.tools.values()]

    def call(self, call: ToolCall) -> ToolResult:
        if call.error:
            return ToolResult(call.error, error=True)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"there is no tool {call.name!r}; the tools are: {', '.join(self.tools)}", error=True)
        return tool(call.arguments)

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        return list(self._pool.map(self.call, calls))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "ToolExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
