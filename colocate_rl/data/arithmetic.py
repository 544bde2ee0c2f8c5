"""The synthetic task of the tiny recipes: "a+b=" problems whose label is the exact integer result.

Train and eval are disjoint by construction, not by seed: the eval problems are a held-out set of
distinct (a, op, b) triples, and train problems are drawn from all other triples. The held-out set
is at most a quarter of all triples (so train keeps most of a small space: with operands 0..9 and
"+", that is 25 eval problems, not ``num_eval``). Everything is a function of ``cfg.seed``.
"""

from __future__ import annotations

import random

from colocate_rl.config import ArithmeticConfig

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _max_b(cfg: ArithmeticConfig) -> int:
    return cfg.max_operand if cfg.max_operand_b < 0 else cfg.max_operand_b


def _draw(rng: random.Random, cfg: ArithmeticConfig) -> tuple[int, str, int]:
    lo = cfg.min_operand
    return rng.randint(lo, cfg.max_operand), rng.choice(cfg.ops), rng.randint(lo, _max_b(cfg))


def arithmetic_problems(cfg: ArithmeticConfig, split: str = "train") -> list[tuple[str, str]]:
    """(prompt_text, label) pairs such as ("3+4=", "7"); ``split`` is "train" (``num_train``
    problems, repeats allowed) or "eval" (distinct problems, held out of train)."""
    if not cfg.ops or set(cfg.ops) - set(_APPLY) or cfg.max_operand < 0:
        raise ValueError(f"arithmetic: ops={cfg.ops!r} must use only '+-*' and max_operand={cfg.max_operand} be >= 0")
    if split not in ("train", "eval"):
        raise ValueError(f"arithmetic: split '{split}' is not train or eval")
    lo = cfg.min_operand
    space = (cfg.max_operand + 1 - lo) * (_max_b(cfg) + 1 - lo) * len(set(cfg.ops))
    n_eval = min(cfg.num_eval, space // 4)
    held_out: dict[tuple[int, str, int], None] = {}  # insertion-ordered set
    rng = random.Random(cfg.seed)
    while len(held_out) < n_eval:
        held_out[_draw(rng, cfg)] = None
    if split == "eval":
        triples = list(held_out)
    else:
        rng, triples = random.Random(cfg.seed + 1), []
        while len(triples) < cfg.num_train:
            t = _draw(rng, cfg)
            if t not in held_out:
                triples.append(t)
    return [(f"{a}{op}{b}=", str(_APPLY[op](a, b))) for a, op, b in triples]


def calculator_demo(problem: str, label: str) -> list[dict]:
    """The turns that answer ``problem`` ("12*34=") with the calculator: a call with its expression,
    the tool's result (the label, as the calculator writes an integer), and the answer."""
    from colocate_rl.tools.chat import tool_call

    return [{"role": "assistant", "content": "",
             "tool_calls": [tool_call("calculator", {"expression": problem.rstrip("=")})]},
            {"role": "tool", "content": label},
            {"role": "assistant", "content": label}]


def with_tool_demos(problems: list[tuple[str, str]], cfg: ArithmeticConfig) -> list[dict]:
    """Rows {"prompt", "label"[, "demo"]}: a ``cfg.tool_demos`` share of them (drawn with the task's
    seed) carry a calculator demonstration for the warm start."""
    rng = random.Random(cfg.seed + 2)
    return [{"prompt": p, "label": a, **({"demo": calculator_demo(p, a)} if rng.random() < cfg.tool_demos else {})}
            for p, a in problems]
