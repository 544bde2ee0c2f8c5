"""``python``: runs a program in the sandbox (``sandbox.py``) and returns what it printed."""

from __future__ import annotations

import signal

from colocate_rl.tools.base import Tool, ToolResult, register
from colocate_rl.config import ToolsConfig
from colocate_rl.tools.sandbox import RunResult, Sandbox


def describe(result: RunResult, cfg: ToolsConfig) -> ToolResult:
    """What the model reads: the program's output, and a last line saying why it ended when that
    was anything but a clean exit."""
    note = ""
    if result.setup_error:
        note = f"the sandbox could not start: {result.setup_error}"
    elif result.stopped == "timeout":
        note = f"stopped: no result within {cfg.timeout_s:g} s"
    elif result.stopped == "output":
        note = f"stopped: the output passed {cfg.output_bytes} bytes"
    elif result.signal == signal.SIGXCPU:
        note = f"killed: CPU time limit of {cfg.cpu_s} s reached"
    elif result.signal == signal.SIGKILL:
        note = f"killed: CPU time limit of {cfg.cpu_s} s reached, or out of memory"
    elif result.signal is not None:
        note = f"killed by signal {result.signal}"
    elif result.exit_code:
        note = f"exit code {result.exit_code}"
    text = result.output
    if note:
        text += ("" if not text or text.endswith("\n") else "\n") + f"[{note}]"
    return ToolResult(text, error=not result.ok)


@register("python")
def python(cfg: ToolsConfig) -> Tool:
    sandbox = Sandbox(cfg)
    sandbox.isolation  # probed now: a machine that cannot run it stops the run before it starts
    return Tool(
        name="python",
        description=("Runs a Python 3 program and returns what it prints (stdout and stderr). Each call starts "
                     "fresh: nothing is kept between calls, and there is no network."),
        parameters={"type": "object", "properties": {"code": {"type": "string", "description": "the program",
                                                              "maxLength": cfg.max_code_bytes}},
                    "required": ["code"], "additionalProperties": False},
        fn=lambda args: describe(sandbox.run(args["code"]), cfg),
    )
