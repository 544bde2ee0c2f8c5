"""``calculator``: one arithmetic expression, evaluated over an allow-list of syntax (never ``eval``):
int and float literals, + - * / // % **, unary minus and plus, parentheses. Exponents and results
are bounded, so no expression runs long or fills memory."""

from __future__ import annotations

import ast
import math
import operator

from colocate_rl.tools.base import Tool, ToolResult, register
from colocate_rl.config import ToolsConfig

MAX_CHARS = 1000  # longest expression
MAX_EXPONENT = 10_000  # |b| in a ** b
MAX_BITS = 10_000  # largest integer, intermediate results included (about 3,000 digits)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalcError(ValueError):
    pass


def _power(a, b):
    if abs(b) > MAX_EXPONENT:
        raise CalcError(f"exponent {b} is beyond ±{MAX_EXPONENT}")
    if isinstance(a, int) and isinstance(b, int) and b > 0 and (a.bit_length() - 1) * b > MAX_BITS:
        raise CalcError(f"the result would have more than {MAX_BITS} bits")
    return a ** b


def _eval(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        value = _power(a, b) if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)](a, b)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_eval(node.operand))
    else:
        raise CalcError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** and parentheses")
    if isinstance(value, complex):
        raise CalcError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise CalcError(f"the result has more than {MAX_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("the result is not a finite number")
    return value


def evaluate(expression: str) -> int | float:
    """The expression's value; CalcError (one line) for anything outside the allowed arithmetic."""
    if len(expression) > MAX_CHARS:
        raise CalcError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalcError(f"not an expression: {getattr(e, 'msg', None) or type(e).__name__}") from None
    try:
        return _eval(tree.body)
    except OverflowError:
        raise CalcError("the result is too large") from None
    except (ZeroDivisionError, RecursionError) as e:
        raise CalcError(str(e) or type(e).__name__) from None


def _call(args: dict) -> ToolResult:
    try:
        return ToolResult(repr(evaluate(args["expression"])))
    except CalcError as e:
        return ToolResult(f"calculator: {e}", error=True)


@register("calculator")
def calculator(cfg: ToolsConfig) -> Tool:
    return Tool(
        name="calculator",
        description="Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        parameters={"type": "object", "properties": {"expression": {"type": "string",
                                                                    "description": "for example (2 + 3) ** 2 / 7"}},
                    "required": ["expression"], "additionalProperties": False},
        fn=_call,
    )
