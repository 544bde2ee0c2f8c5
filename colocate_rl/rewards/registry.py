"""Reward functions by name: ``fn(response: str, label: str) -> float``.

Register one with ``@register("name")``; a config may also name a user's own function as
``"pkg.module:function"``. Rewards run in a worker pool (colocate_rl.rewards.scorer) unless
registered ``inline=True``: cheap, pure-Python scorers that cannot hang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from colocate_rl.config import import_function

RewardFn = Callable[[str, str], float]


@dataclass(frozen=True)
class Reward:
    fn: RewardFn
    inline: bool = False  # scored in the calling process, without the pool and its timeout
    name: str = ""


REWARDS: dict[str, Reward] = {}


def register(name: str, *, inline: bool = False) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward '{name}' is already registered (by {REWARDS[name].fn.__module__})")
        REWARDS[name] = Reward(fn, inline, name)
        return fn  # the plain function: workers receive it pickled by reference

    return deco


def _choices() -> str:
    return f"registered rewards: {', '.join(sorted(REWARDS))}; or give your own as 'pkg.module:function'"


def get_reward(spec: str | RewardFn) -> Reward:
    """A registered name, a ``"pkg.module:function"`` path, or a function → Reward.
    Functions from paths or passed directly always go through the pool: they may hang."""
    if callable(spec):
        return Reward(spec, False, getattr(spec, "__qualname__", repr(spec)))
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown reward '{spec}': {_choices()}")
    try:
        return Reward(import_function(spec, f"reward '{spec}'"), False, spec)
    except ValueError as e:
        raise ValueError(f"{e}; {_choices()}") from None


def get_reward_fn(spec: str | RewardFn) -> RewardFn:
    return get_reward(spec).fn
