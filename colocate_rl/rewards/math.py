"""Math answers checked by math-verify: the ``math``, ``dapo`` and ``boxed`` rewards (1.0 / 0.0).

The gold label is parsed first, as math-verify expects: ``verify(parse(gold), parse(answer))``.
Its own signal.alarm timeouts are turned off (they raise off the main thread and, when they fire,
score 0 without telling anyone); the scorer's per-call timeout kills a stuck worker instead and
counts it. When either side does not parse as math, a normalised string match decides.
"""

from __future__ import annotations

import logging
import re
from typing import Optional

from colocate_rl.rewards.registry import register

_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)


class _DropTimeoutDisabledWarning(logging.Filter):
    # math-verify warns once per process that its timeouts are off; that is deliberate here.
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (nested braces kept) or ``\\boxed x``; None if absent or unclosed."""
    i = text.rfind("\\boxed")
    if i < 0:
        return None
    rest = text[i + len("\\boxed"):]
    if rest[:1] == " ":  # "\boxed 5": the answer is the next word
        word = rest.split(maxsplit=1)
        return word[0].rstrip("$.") if word else None
    if rest[:1] != "{":
        return None
    depth = 0
    for k, c in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(c, 0)
        if depth == 0:
            return rest[1:k]
    return None


def answer_line(text: str) -> Optional[str]:
    """X of the last ``Answer: X`` (DAPO's format: "The last line of your response should be of
    the form Answer: $Answer"); a boxed X is unwrapped."""
    found = _ANSWER_LINE.findall(text)
    if not found:
        return None
    ans = found[-1].strip()
    return last_boxed(ans) or ans


def _normalize(s: str) -> str:
    return re.sub(r"\s+", "", s).strip("$").rstrip(".").lower()


def _as_math(s: str) -> str:
    # Inside $…$ math-verify reads the text as LaTeX: "\frac12", "x^2+1" and "\{1,2\}" parse only so.
    return f"${s.strip().strip('$')}$"


def is_equivalent(gold: str, answer: str, *, wrap_answer: bool = True) -> bool:
    """math-verify equivalence of an extracted answer to the gold label (1/2 ≡ 0.5 ≡ \\frac{1}{2})."""
    from math_verify import parse, verify  # imported here: sympy is slow to import, arithmetic runs skip it

    if not answer.strip():
        return False
    g = parse(_as_math(gold), parsing_timeout=None)
    a = parse(_as_math(answer) if wrap_answer else answer, parsing_timeout=None)
    if g and a:
        return bool(verify(g, a, timeout_seconds=None))
    return _normalize(gold) == _normalize(answer)


@register("math")
def math_reward(response: str, label: str) -> float:
    """The last \\boxed{} answer, else the last "Answer:" line, else the whole response."""
    ans = last_boxed(response) or answer_line(response)
    if ans is not None:
        return float(is_equivalent(label, ans))
    return float(is_equivalent(label, response, wrap_answer=False))


@register("dapo")
def dapo_reward(response: str, label: str) -> float:
    """DAPO's format: the last "Answer:" line. 1.0 / 0.0 (DAPO itself scores +1 / -1; with group
    normalised advantages the two differ only in scale, and 0/1 reads as accuracy in the logs)."""
    ans = answer_line(response)
    return 0.0 if ans is None else float(is_equivalent(label, ans))


@register("boxed")
def boxed_reward(response: str, label: str) -> float:
    """The last \\boxed{} answer; no box scores 0."""
    ans = last_boxed(response)
    return 0.0 if ans is None else float(is_equivalent(label, ans))
