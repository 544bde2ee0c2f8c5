"""Tools a policy calls during a multi-turn rollout: the registry (``base.py``), the sandboxed
``python`` and the ``calculator``, the executor of a turn's calls, and the tool-call parsing."""

from colocate_rl.tools import calculator, python  # noqa: F401 - registers the built-in tools
from colocate_rl.tools.base import TOOLS, Tool, ToolCall, ToolResult, check_arguments, make_tools, register
from colocate_rl.config import ToolsConfig
from colocate_rl.tools.executor import ToolExecutor
from colocate_rl.tools.parsing import ParsedTurn, parse_tool_calls, parser_for
from colocate_rl.tools.sandbox import RunResult, Sandbox, SandboxUnavailable

__all__ = ["TOOLS", "ParsedTurn", "RunResult", "Sandbox", "SandboxUnavailable", "Tool", "ToolCall", "ToolExecutor",
           "ToolResult", "ToolsConfig", "check_arguments", "make_tools", "parse_tool_calls", "parser_for", "register"]
